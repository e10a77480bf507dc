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
  // The same words as the `when` filter (console/templatetags/console_time.py).
  function human(seconds) {
    seconds = Math.floor(Math.abs(seconds));
    if (seconds < 60) { return seconds + " s"; }
    if (seconds < 3600) { return Math.floor(seconds / 60) + " min"; }
    if (seconds < 86400) {
      var h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60);
      return h + " h" + (m ? " " + m + " min" : "");
    }
    var d = Math.floor(seconds / 86400), hh = Math.floor((seconds % 86400) / 3600);
    return d + " day" + (d === 1 ? "" : "s") + (hh && d < 7 ? " " + hh + " h" : "");
  }
  function relative(seconds) {
    if (Math.abs(seconds) < 60) { return "just now"; }
    return seconds > 0 ? "in " + human(seconds) : human(seconds) + " ago";
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("[data-deadline]").forEach(function (el) {
      var t = Date.parse(el.getAttribute("data-deadline"));
      if (!isNaN(t)) { el.textContent = fmt((t - now) / 1000); }
    });
    document.querySelectorAll("[data-relative]").forEach(function (el) {
      var t = Date.parse(el.getAttribute("data-relative"));
      if (!isNaN(t)) { el.textContent = relative((t - now) / 1000); }
    });
  }
  // The tab title carries the count of what waits for me (the navigation's badges:
  // approvals waiting for me and conflicts for me to resolve), e.g. "(3) Approvals · Airlock".
  var baseTitle = null;
  function titleCount() {
    if (baseTitle === null) { baseTitle = document.title.replace(/^\(\d+\) /, ""); }
    var total = 0;
    document.querySelectorAll(".topbar [id^='nav-count-'] .badge[data-count]").forEach(function (el) {
      total += parseInt(el.getAttribute("data-count"), 10) || 0;
    });
    document.title = (total ? "(" + total + ") " : "") + baseTitle;
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
  document.addEventListener("DOMContentLoaded", function () { tick(); labelTables(); titleCount(); });
  document.addEventListener("htmx:afterSettle", function (event) {
    tick(); labelTables(event.target); titleCount();
  });
  setInterval(tick, 1000);
})();
