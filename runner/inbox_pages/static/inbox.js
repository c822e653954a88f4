// Live updates for the agentfast inbox (runner/ui.py). The server sends a Server-Sent Event
// "changed" when what this page shows changes; this fetches the page again and swaps in its
// sections. Forms (a run's, and the list's) are swapped only when the set of calls awaiting a
// decision changed, so a reason being typed is not lost. Text is never inserted as markup here: nodes come from the
// server's autoescaped page, parsed by DOMParser (which runs no script).
"use strict";
(function () {
  const live = document.getElementById("live");
  if (!live) return;
  const page = live.dataset.livePage;
  // After a form post the address is .../decide: a reload must not post again.
  if (window.location.pathname !== page && window.location.pathname.endsWith("/decide")) {
    window.history.replaceState(null, "", page);
  }
  if (!window.EventSource) return;
  const query = new URLSearchParams({ page: page, since: live.dataset.version || "" });
  if (live.dataset.namespace) query.set("namespace", live.dataset.namespace);
  const source = new EventSource("/events?" + query.toString());
  let busy = false;
  source.addEventListener("changed", async function () {
    if (busy) return;
    busy = true;
    try {
      const url = page + (live.dataset.namespace ? "?namespace=" + encodeURIComponent(live.dataset.namespace) : "");
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "text/html" } });
      if (!response.ok || response.redirected) {
        // Refused or sent to log in (a token expired): stop, and show the server's page, which says why.
        source.close();
        window.location.reload();
        return;
      }
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
      for (const id of ["status", "decisions", "transcript", "runs"]) {
        const next = fresh.getElementById(id);
        const here = document.getElementById(id);
        if (next && here) here.replaceWith(document.adoptNode(next));
      }
      // The sections holding forms (a run's calls; the list's calls awaiting a decision).
      for (const id of ["pending", "waiting"]) {
        const next = fresh.getElementById(id);
        const here = document.getElementById(id);
        if (next && here && next.dataset.pending !== here.dataset.pending) here.replaceWith(document.adoptNode(next));
      }
    } finally {
      busy = false;
    }
  });
})();
