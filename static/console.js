// Airlock console: the only script of our own. Loaded from 'self' (strict CSP,
// no inline script, no eval). Countdowns for approval expiry and undo deadlines.
(function () {
  "use strict";
  function fmt(seconds) {
    if (seconds <= 0) { return "expired"; }
    var d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600);
    var m = Math.floor((seconds % 3600) / 60), s = Math.floor(seconds % 60);
    if (d > 0) { return d + "d " + h + "h left"; }
    if (h > 0) { return h + "h " + m + "m left"; }
    return m + "m " + (s < 10 ? "0" : "") + s + "s left";
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("[data-deadline]").forEach(function (el) {
      var t = Date.parse(el.getAttribute("data-deadline"));
      if (!isNaN(t)) { el.textContent = fmt((t - now) / 1000); }
    });
  }
  // Narrow screens show a table as stacked cards (console.css): each cell carries its
  // column's header text, shown above the value. Headers spanning columns are counted.
  function labelTables(root) {
    var scope = root || document;
    var tables = Array.prototype.slice.call(scope.querySelectorAll("table"));
    if (scope.tagName === "TABLE") { tables.push(scope); }
    tables.forEach(function (table) {
      var head = table.tHead && table.tHead.rows[0];
      if (!head) { return; }
      var names = [];
      Array.prototype.forEach.call(head.cells, function (cell) {
        for (var i = 0; i < (cell.colSpan || 1); i++) { names.push(cell.textContent.trim()); }
      });
      Array.prototype.forEach.call(table.tBodies, function (body) {
        Array.prototype.forEach.call(body.rows, function (row) {
          var col = 0;
          Array.prototype.forEach.call(row.cells, function (cell) {
            if (names[col] && !cell.hasAttribute("data-label")) { cell.setAttribute("data-label", names[col]); }
            col += cell.colSpan || 1;
          });
        });
      });
      table.classList.add("stack");
    });
  }
  document.addEventListener("DOMContentLoaded", function () { tick(); labelTables(); });
  document.addEventListener("htmx:afterSettle", function (event) { tick(); labelTables(event.target); });
  setInterval(tick, 1000);
})();
