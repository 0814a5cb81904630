/* wfdash: follow a bulk job's progress on the instance list until it is done.
   Reads the job's JSON (a staff page like the list itself) every half second. */
(() => {
  "use strict";
  const POLL_MS = 500;

  function follow(panel) {
    const bar = panel.querySelector("[data-bulk-progress]");
    const summary = panel.querySelector("[data-bulk-summary]");
    const errors = panel.querySelector("[data-bulk-errors]");
    async function tick() {
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
      bar.max = Math.max(job.matched, 1);
      bar.value = job.matched ? job.processed : 1;
      summary.textContent = `${job.processed} of ${job.matched} processed: ${job.applied} applied, ` +
        `${job.skipped} skipped, ${job.failed} failed` + (job.done ? " — done" : "");
      errors.replaceChildren(...job.errors.map((text) => {
        const item = document.createElement("li");
        item.textContent = text; // text, never HTML: messages quote instance ids
        return item;
      }));
      panel.dataset.done = job.done ? "1" : "0";
      if (!job.done) setTimeout(tick, POLL_MS);
    }
    if (panel.dataset.done !== "1") tick();
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const panel of document.querySelectorAll("[data-bulk-job-url]")) follow(panel);
  });
})();
