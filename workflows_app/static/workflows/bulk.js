/* wfdash: follow a bulk job's progress on the instance list until it is done.
   Over the dashboard's WebSocket (/ws/bulk-jobs/<id>/: a snapshot, then a `bulk.progress`
   message per committed batch) while it is up; the job's JSON is read every half second
   only when the socket cannot be opened or has closed before the job is done. */
(() => {
  "use strict";
  const POLL_MS = 500;
  const OPEN_TIMEOUT_MS = 3000; // a socket not open by then: poll (it stops if one opens)

  function follow(panel) {
    const bar = panel.querySelector("[data-bulk-progress]");
    const summary = panel.querySelector("[data-bulk-summary]");
    const errors = panel.querySelector("[data-bulk-errors]");
    let polling = false;

    function render(job) {
      bar.max = Math.max(job.matched, 1);
      bar.value = job.matched ? job.processed : 1;
      summary.textContent = `${job.processed} of ${job.matched} processed: ${job.applied} applied, ` +
        (job.pause_requested ? `pause requested for ${job.pause_requested}, ` : "") +
        `${job.skipped} skipped, ${job.failed} failed` + (job.done ? " — done" : "");
      errors.replaceChildren(...job.errors.map((text) => {
        const item = document.createElement("li");
        item.textContent = text; // text, never HTML: messages quote instance ids
        return item;
      }));
      panel.dataset.done = job.done ? "1" : "0";
    }

    async function tick() {
      if (panel.dataset.done === "1" || panel.dataset.socket === "connected") {
        polling = false;
        return;
      }
      let job;
      try {
        const response = await fetch(panel.dataset.bulkJobUrl, {
          headers: { Accept: "application/json" }, credentials: "same-origin",
        });
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        job = await response.json();
      } catch (e) {
        setTimeout(tick, POLL_MS * 4);
        return;
      }
      render(job);
      setTimeout(tick, POLL_MS);
    }

    function poll() {
      if (polling || panel.dataset.done === "1") return;
      polling = true;
      tick();
    }

    function listen() {
      const scheme = location.protocol === "https:" ? "wss:" : "ws:";
      let socket;
      try {
        socket = new WebSocket(`${scheme}//${location.host}${panel.dataset.bulkJobWs}`);
      } catch (e) {
        poll();
        return;
      }
      let seq = 0;
      const fallback = setTimeout(poll, OPEN_TIMEOUT_MS);
      socket.addEventListener("open", () => {
        clearTimeout(fallback);
        panel.dataset.socket = "connected";
      });
      socket.addEventListener("message", (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "snapshot" || message.type === "bulk.progress") {
          seq = message.seq;
          render(message.job); // the whole job each time: a missed message loses nothing
          if (message.job.done) socket.close();
        } else if (message.type === "heartbeat" && message.seq > seq) {
          socket.send(JSON.stringify({ type: "resync" })); // missed the latest: read it again
        }
      });
      socket.addEventListener("close", () => {
        clearTimeout(fallback);
        panel.dataset.socket = "disconnected";
        poll(); // nothing if the job is done
      });
    }

    if (panel.dataset.done === "1") return;
    if (panel.dataset.bulkJobWs && "WebSocket" in window) listen();
    else poll();
  }

  // The confirmation names the chosen action and the count ("Delete all 32 matching
  // instances?"), and says when it cannot be undone.
  const FOR_GOOD = new Set(["terminate", "cancel", "delete"]);
  function nameTheAction(form) {
    const select = form.querySelector('select[name="action"]');
    const matching = form.dataset.matchCount;
    if (!select || matching === undefined) return;
    const label = select.options[select.selectedIndex].text;
    form.dataset.confirm = `${label} all ${matching} matching instance${matching === "1" ? "" : "s"}? ` +
      "It runs in the background." + (FOR_GOOD.has(select.value) ? " This cannot be reversed." : "");
  }
  document.addEventListener("change", (ev) => {
    if (ev.target.matches('[data-count-url] select[name="action"]')) nameTheAction(ev.target.form);
  });

  // "Apply to all N matching": counted when opened, so the list itself never pays for it.
  function countWhenOpened(details) {
    const form = details.querySelector("form");
    const button = details.querySelector("[data-bulk-all]");
    const shown = details.querySelector("[data-matching]");
    details.addEventListener("toggle", async () => {
      if (!details.open) return;
      button.disabled = true;
      shown.textContent = "…";
      try {
        const response = await fetch(details.dataset.countUrl, {
          headers: { Accept: "application/json" }, credentials: "same-origin",
        });
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        const { matching } = await response.json();
        shown.textContent = String(matching);
        form.dataset.matchCount = String(matching);
        nameTheAction(form);
        button.disabled = matching === 0;
      } catch (e) {
        shown.textContent = "?";
      }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const panel of document.querySelectorAll("[data-bulk-job-url]")) follow(panel);
    for (const details of document.querySelectorAll("[data-count-url]")) countWhenOpened(details);
  });
})();
