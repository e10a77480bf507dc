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
  document.addEventListener("DOMContentLoaded", tick);
  document.addEventListener("htmx:afterSettle", tick);
  setInterval(tick, 1000);
})();
