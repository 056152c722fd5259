// The dashboard's one script: live updates over server-sent events, and the
// confirmation + admin token for action forms. Nothing is loaded from elsewhere.
(function () {
  "use strict";
  var KEY = "bus-dashboard-token";
  var tokenInput = document.getElementById("admin-token");
  if (tokenInput) {
    // sessionStorage: the token lives only in this tab, and no cookie carries it,
    // so another site cannot make the browser send it (no CSRF).
    tokenInput.value = window.sessionStorage.getItem(KEY) || "";
    tokenInput.addEventListener("input", function () {
      window.sessionStorage.setItem(KEY, tokenInput.value);
    });
  }

  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (!form.matches || !form.matches("form[data-confirm]")) return;
    if (!window.confirm(form.getAttribute("data-confirm"))) {
      ev.preventDefault();
      return;
    }
    form.elements.confirm.value = "yes";
    form.elements.token.value = tokenInput ? tokenInput.value : "";
  });

  var live = document.querySelector("[data-live]");
  if (live && window.EventSource) {
    var last = null;
    var source = new EventSource(live.getAttribute("data-live"));
    var events = 0;
    source.onmessage = function (ev) {
      events += 1;
      document.body.setAttribute("data-live-events", String(events));
      // Replace only when something changed, so open <details> and focus survive quiet periods.
      if (ev.data === last) return;
      last = ev.data;
      var open = {};
      live.querySelectorAll("details[open]").forEach(function (d, i) { open[i] = true; });
      live.innerHTML = ev.data;
      live.querySelectorAll("details").forEach(function (d, i) { if (open[i]) d.open = true; });
      document.body.setAttribute("data-updated", String(Date.now()));
    };
    window.addEventListener("pagehide", function () { source.close(); });
  }
})();
