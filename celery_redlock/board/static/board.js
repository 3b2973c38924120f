// Keeps the page's live part (#live) current: asks the same URL for it every second and
// updates it in place, without reloading the page. The server escapes everything it sends.
//
// Only what changed is replaced: the new part is compared with the page node by node
// (same tag and attributes: its children are compared in turn; equal HTML: left alone),
// so a row that did not change keeps its nodes, a table's sideways scroll stays where it
// was, and a text selection in it survives. While text is selected inside the live part,
// the update waits (up to a minute), so a copy is not cut short.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var every = parseInt(live.getAttribute("data-refresh"), 10) || 1000;
  var busy = false;
  var held = 0;

  function selecting() {
    var sel = window.getSelection && window.getSelection();
    if (!sel || sel.isCollapsed || sel.rangeCount === 0) { return false; }
    var node = sel.getRangeAt(0).commonAncestorContainer;
    return live.contains(node);
  }

  function sameAttributes(a, b) {
    if (a.attributes.length !== b.attributes.length) { return false; }
    for (var i = 0; i < a.attributes.length; i++) {
      var at = a.attributes[i];
      if (b.getAttribute(at.name) !== at.value) { return false; }
    }
    return true;
  }

  function copyAttributes(from, to) {
    var i;
    for (i = to.attributes.length - 1; i >= 0; i--) {
      if (!from.hasAttribute(to.attributes[i].name)) { to.removeAttribute(to.attributes[i].name); }
    }
    for (i = 0; i < from.attributes.length; i++) {
      var at = from.attributes[i];
      if (to.getAttribute(at.name) !== at.value) { to.setAttribute(at.name, at.value); }
    }
  }

  // Make the children of *old* those of *fresh*, keeping every node that did not change.
  function patch(old, fresh) {
    var a = Array.prototype.slice.call(old.childNodes);
    var b = Array.prototype.slice.call(fresh.childNodes);
    var n = Math.max(a.length, b.length);
    for (var i = 0; i < n; i++) {
      var x = a[i], y = b[i];
      if (!y) { old.removeChild(x); continue; }
      if (!x) { old.appendChild(y); continue; }
      if (x.nodeType !== y.nodeType || x.nodeName !== y.nodeName) {
        old.replaceChild(y, x);
      } else if (x.nodeType === 1) {
        if (x.outerHTML === y.outerHTML) { continue; }
        // A row of another key, or an SVG (whose parts are many and cheap): replaced whole.
        var idX = x.getAttribute("data-name"), idY = y.getAttribute("data-name");
        if (idX !== idY || x.namespaceURI !== "http://www.w3.org/1999/xhtml") {
          old.replaceChild(y, x);
          continue;
        }
        copyAttributes(y, x);
        patch(x, y);
      } else if (x.nodeValue !== y.nodeValue) {
        x.nodeValue = y.nodeValue;
      }
    }
  }

  function update(html) {
    var scrolls = Array.prototype.map.call(live.querySelectorAll(".scroll"), function (s) {
      return s.scrollLeft;
    });
    var fresh = document.createElement("div");
    fresh.innerHTML = html;
    patch(live, fresh);
    Array.prototype.forEach.call(live.querySelectorAll(".scroll"), function (s, i) {
      if (scrolls[i] !== undefined && s.scrollLeft !== scrolls[i]) { s.scrollLeft = scrolls[i]; }
    });
  }

  function refresh() {
    if (busy || document.hidden) { return; }
    if (selecting() && held < 60) { held++; return; }
    held = 0;
    busy = true;
    fetch(window.location.href, { headers: { "X-Board-Part": "live" }, credentials: "same-origin" })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
      .then(function (html) {
        update(html);
        document.body.classList.remove("stale");
        var note = document.getElementById("stale-note");
        if (note) { note.parentNode.removeChild(note); }
        live.setAttribute("data-updated", String(Date.now()));
      })
      .catch(function () { document.body.classList.add("stale"); stale(); })
      .then(function () { busy = false; });
  }
  // While the board does not answer, say since when: what the page shows is that old.
  var loaded = Date.now();
  function stale() {
    var note = document.getElementById("stale-note");
    if (!note) {
      note = document.createElement("p");
      note.id = "stale-note";
      note.className = "unknown";
      note.setAttribute("role", "status");
      live.parentNode.insertBefore(note, live);
    }
    var at = parseInt(live.getAttribute("data-updated"), 10) || loaded;
    var ago = Math.max(0, Math.round((Date.now() - at) / 1000));
    note.textContent = "The board did not answer: last update " +
      new Date(at).toLocaleTimeString() + ", " + ago + " s ago.";
  }
  var filters = document.querySelector("form.filters");
  if (filters) {
    // The filter applies as one types: the URL follows, so a reload keeps it.
    var apply = function () {
      var q = new URLSearchParams(new FormData(filters));
      Array.from(q.keys()).forEach(function (k) { if (!q.get(k)) { q.delete(k); } });
      var s = q.toString();
      history.replaceState(null, "", window.location.pathname + (s ? "?" + s : ""));
      held = 60;
      refresh();
    };
    filters.addEventListener("input", apply);
    filters.addEventListener("change", apply);
    // The release of what the filters match takes the filters as they are now.
    var set = document.querySelector("form.actions-set");
    if (set) {
      set.addEventListener("submit", function () {
        ["prefix", "kind", "state", "task_id", "worker"].forEach(function (k) {
          var input = set.querySelector('input[name="' + k + '"]');
          var value = (filters.elements[k] && filters.elements[k].value) || "";
          if (!input) {
            input = document.createElement("input");
            input.type = "hidden";
            input.name = k;
            set.appendChild(input);
          }
          input.value = value;
        });
      });
    }
  }
  setInterval(refresh, every);
})();
