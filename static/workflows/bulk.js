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
        form.dataset.confirm = `Apply this action to all ${matching} matching instance` +
          `${matching === 1 ? "" : "s"}? It runs in the background.`;
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
