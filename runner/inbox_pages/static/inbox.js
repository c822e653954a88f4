// Live updates for the agentfast inbox (runner/ui.py). The server sends a Server-Sent Event
// "changed" when what this page shows changes; this fetches the page again and swaps in its
// sections. A run's forms are swapped only when the set of calls awaiting a decision changed, so
// a reason being typed is not lost. Text is never inserted as markup here: nodes come from the
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
      for (const id of ["status", "decisions", "transcript", "waiting", "runs"]) {
        const next = fresh.getElementById(id);
        const here = document.getElementById(id);
        if (next && here) here.replaceWith(document.adoptNode(next));
      }
      const nextPending = fresh.getElementById("pending");
      const herePending = document.getElementById("pending");
      if (nextPending && herePending && nextPending.dataset.pending !== herePending.dataset.pending) {
        herePending.replaceWith(document.adoptNode(nextPending));
      }
    } finally {
      busy = false;
    }
  });
})();
