// Keeps the page's live part (#live) current: asks the same URL for it every second and
// swaps it in, without reloading the page. The server escapes everything it sends.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var every = parseInt(live.getAttribute("data-refresh"), 10) || 1000;
  var busy = false;
  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Board-Part": "live" }, credentials: "same-origin" })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
      .then(function (html) {
        live.innerHTML = html;
        document.body.classList.remove("stale");
        live.setAttribute("data-updated", String(Date.now()));
      })
      .catch(function () { document.body.classList.add("stale"); })
      .then(function () { busy = false; });
  }
  var filters = document.querySelector("form.filters");
  if (filters) {
    // The filter applies as one types: the URL follows, so a reload keeps it.
    var apply = function () {
      var q = new URLSearchParams(new FormData(filters));
      Array.from(q.keys()).forEach(function (k) { if (!q.get(k)) { q.delete(k); } });
      var s = q.toString();
      history.replaceState(null, "", window.location.pathname + (s ? "?" + s : ""));
      refresh();
    };
    filters.addEventListener("input", apply);
    filters.addEventListener("change", apply);
  }
  setInterval(refresh, every);
})();
