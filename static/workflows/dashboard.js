/* wfdash dashboard: local times, confirmations, JSON validation, and live updates.
 *
 * Rule: user data reaches the DOM only through textContent/attributes, or as HTML the
 * server rendered and escaped (fragments are parsed with DOMParser, never innerHTML).
 */
"use strict";

(() => {
  const body = document.body;

  // --- times: <time datetime> → local time + relative age ------------------------------
  const rtf = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });
  const dtf = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "medium" });
  const UNITS = [["year", 31536e6], ["month", 2592e6], ["day", 864e5], ["hour", 36e5], ["minute", 6e4], ["second", 1e3]];

  function relative(date) {
    const delta = date.getTime() - Date.now();
    for (const [unit, ms] of UNITS) {
      if (Math.abs(delta) >= ms || unit === "second") return rtf.format(Math.round(delta / ms), unit);
    }
    return "";
  }

  function formatTimes(root = document) {
    for (const el of root.querySelectorAll("time[datetime]")) {
      const date = new Date(el.getAttribute("datetime"));
      if (Number.isNaN(date.getTime())) continue;
      el.textContent = relative(date);
      el.title = dtf.format(date);
    }
  }

  // --- forms: confirm(), JSON validation, bulk selection, span details ------------------
  document.addEventListener("submit", (ev) => {
    const form = ev.target;
    const button = ev.submitter;
    const message = (button && button.dataset.confirm) || form.dataset.confirm;
    if (message && !window.confirm(message)) { ev.preventDefault(); return; }
    for (const area of form.querySelectorAll("[data-json]")) {
      if (!validateJSON(area)) { ev.preventDefault(); area.focus(); return; }
    }
  });

  function validateJSON(area) {
    const error = area.form && area.form.querySelector(`[data-error-for="${area.name}"]`);
    let problem = "";
    if (area.value.trim()) {
      try { JSON.parse(area.value); } catch (e) { problem = `Not valid JSON: ${e.message}`; }
    }
    area.setAttribute("aria-invalid", problem ? "true" : "false");
    area.setCustomValidity(problem);
    if (error) error.textContent = problem;
    return !problem;
  }

  document.addEventListener("input", (ev) => {
    if (ev.target.matches("[data-json]")) validateJSON(ev.target);
    if (ev.target.matches('input[name="pk"], [data-select-all]')) updateSelection(ev.target);
  });

  function updateSelection(changed) {
    const boxes = [...document.querySelectorAll('#bulk input[name="pk"]')];
    if (changed && changed.matches("[data-select-all]")) boxes.forEach((b) => { b.checked = changed.checked; });
    const count = document.querySelector("[data-selected-count]");
    if (count) count.textContent = String(boxes.filter((b) => b.checked).length);
  }

  document.addEventListener("click", (ev) => {
    const row = ev.target.closest(".span-row");
    if (!row) return;
    const detail = document.getElementById(row.getAttribute("aria-controls"));
    const open = row.getAttribute("aria-expanded") !== "true";
    row.setAttribute("aria-expanded", String(open));
    if (detail) detail.hidden = !open;
  });

  // --- live updates ---------------------------------------------------------------------
  function setBadge(badge, status) {
    if (!badge || badge.dataset.status === status) return;
    badge.dataset.status = status;
    badge.textContent = status;
    badge.classList.remove("flash");
    void badge.offsetWidth; // restart the animation
    badge.classList.add("flash");
  }

  function setTime(cell, iso) {
    if (!cell || !iso) return;
    let time = cell.querySelector("time");
    if (!time) { time = document.createElement("time"); cell.replaceChildren(time); }
    time.setAttribute("datetime", iso);
    formatTimes(cell);
  }

  async function fetchHTML(url) {
    const response = await fetch(url, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } });
    if (!response.ok) throw new Error(`${url}: ${response.status}`);
    return new DOMParser().parseFromString(await response.text(), "text/html");
  }

  /** Run `task` now, or once more after the running one ends: bursts cost two fetches. */
  function coalesce(task) {
    let running = null, again = false;
    const run = async () => {
      if (running) { again = true; return; }
      do {
        again = false;
        running = task().catch((e) => console.warn("wfdash refresh failed", e));
        await running;
        running = null;
      } while (again);
    };
    return run;
  }

  const pages = {
    overview: {
      snapshot(msg) { msg.workflows.forEach(updateCard); },
      "workflow.summary"(msg) { updateCard(msg.workflow); },
    },
    instances: {
      snapshot(msg) { msg.instances.forEach((i) => updateRow(i, true)); },
      "instance.batch"(msg) { msg.changes.forEach((c) => updateRow(c.instance, false)); },
      onResync() { newRows(); },
      onOpen(socket) {
        const pks = [...document.querySelectorAll("tr[data-pk]")].map((tr) => Number(tr.dataset.pk));
        if (pks.length) socket.send(JSON.stringify({ type: "watch", pks }));
      },
    },
    instance: {
      snapshot(msg) { updateDetail(msg.instance); refreshDetail(); },
      "instance.status"(msg) { updateDetail(msg.instance); refreshDetail(); },
      "step.written"() { refreshDetail(); },
      "history.appended"() { refreshDetail(); },
      "span.stored"() { refreshDetail(); },
      "error.recorded"() { refreshDetail(); },
    },
  };

  // overview
  function updateCard(s) {
    const card = [...document.querySelectorAll("article[data-workflow]")].find((c) => c.dataset.workflow === s.name);
    if (!card) return;
    const set = (field, text) => { const el = card.querySelector(`[data-field="${field}"]`); if (el) el.textContent = text; };
    set("total", String(s.total));
    set("last_hour", String(s.last_hour));
    set("error_rate", s.error_rate === null ? "—" : `${(s.error_rate * 100).toFixed(1)}%`);
    const counts = card.querySelector(".counts");
    const base = card.querySelector("h2 a").dataset.listUrl;
    const badges = Object.entries(s.counts).filter(([, n]) => n > 0).map(([status, n]) => {
      const a = document.createElement("a");
      a.className = "badge"; a.dataset.status = status;
      a.href = `${base}&status=${encodeURIComponent(status)}`;
      const b = document.createElement("b"); b.textContent = String(n);
      a.append(`${status} `, b);
      return a;
    });
    const key = badges.map((a) => a.textContent).join("|");
    if (counts.dataset.key !== key) { counts.dataset.key = key; counts.replaceChildren(...badges); }
    card.querySelectorAll("g[data-bucket]").forEach((g, i) => {
      const bar = s.chart[i];
      if (!bar) return;
      const [ok, err] = g.querySelectorAll("rect");
      ok.setAttribute("y", bar.y_ok); ok.setAttribute("height", bar.h_ok);
      err.setAttribute("y", bar.y_err); err.setAttribute("height", bar.h_err);
      g.querySelector("title").textContent = `${bar.minutes_ago} min ago: ${bar.completed} completed, ${bar.errored} errored`;
    });
  }

  // instance list
  const newRows = coalesce(async () => {
    const tbody = document.querySelector("tbody[data-rows]");
    const newest = Math.max(0, ...[...tbody.querySelectorAll("tr[data-pk]")].map((tr) => Number(tr.dataset.pk)));
    const doc = await fetchHTML(`${body.dataset.rowsUrl}&since=${newest}`);
    const rows = [...doc.querySelectorAll("tr[data-pk]")].filter((tr) => !tbody.querySelector(`tr[data-pk="${tr.dataset.pk}"]`));
    if (!rows.length) return;
    const imported = rows.map((tr) => { const row = document.importNode(tr, true); row.classList.add("new-row"); return row; });
    tbody.prepend(...imported);
    imported.forEach((row) => formatTimes(row));
    document.querySelector(".empty")?.remove();
  });

  function updateRow(inst, fromSnapshot) {
    const tr = document.querySelector(`tr[data-pk="${inst.pk}"]`);
    if (!tr) {
      const newest = Math.max(0, ...[...document.querySelectorAll("tr[data-pk]")].map((r) => Number(r.dataset.pk)));
      if (body.dataset.prepend && inst.pk > newest) newRows();
      return;
    }
    setBadge(tr.querySelector(".badge[data-status]"), inst.status);
    if (!fromSnapshot) setTime(tr.querySelector('[data-field="updated_at"]'), inst.updated_at);
    const error = tr.querySelector('[data-field="error"]');
    if (error && error.textContent !== inst.error) error.textContent = inst.error;
  }

  // instance detail
  function updateDetail(inst) {
    setBadge(document.querySelector('[data-section="head"] .badge[data-status]'), inst.status);
  }

  const refreshDetail = coalesce(async () => {
    const doc = await fetchHTML(body.dataset.fragmentUrl);
    swapSections(document.getElementById("live-root"), doc.body);
  });

  // Section name → server HTML last applied, so unchanged sections are left alone. CSRF
  // tokens are masked afresh on every render, so they are left out of the comparison.
  const lastHTML = new Map();
  const comparable = (html) => html.replace(/name="csrfmiddlewaretoken" value="[^"]*"/g, "");
  for (const section of document.querySelectorAll("#live-root > [data-section]")) {
    lastHTML.set(section.dataset.section, comparable(section.outerHTML));
  }

  /** Replace changed sections in place, keeping open <details>, expanded spans and typed input. */
  function swapSections(root, incoming) {
    const fresh = [...incoming.querySelectorAll(":scope > [data-section]")];
    const keep = new Set();
    let previous = null;
    for (const section of fresh) {
      const name = section.dataset.section;
      keep.add(name);
      let current = root.querySelector(`:scope > [data-section="${name}"]`);
      const html = comparable(section.outerHTML);
      // A section holding input the server refused (data-keep) stays as it is: the
      // operator is correcting it, and a refresh would wipe both the input and the error.
      const held = current && current.dataset.keep;
      if (!held && (!current || lastHTML.get(name) !== html)) {
        const node = document.importNode(section, true);
        if (current) { carryState(current, node); current.replaceWith(node); } else { root.append(node); }
        formatTimes(node);
        current = node;
        lastHTML.set(name, html);
      }
      if (previous ? previous.nextElementSibling !== current : root.firstElementChild !== current) {
        if (previous) previous.after(current); else root.prepend(current);
      }
      previous = current;
    }
    for (const stale of root.querySelectorAll(":scope > [data-section]")) {
      if (!keep.has(stale.dataset.section)) { stale.remove(); lastHTML.delete(stale.dataset.section); }
    }
  }

  function carryState(from, to) {
    const opened = [...from.querySelectorAll("details")].map((d) => d.open);
    to.querySelectorAll("details").forEach((d, i) => { if (opened[i]) d.open = true; });
    for (const row of from.querySelectorAll('.span-row[aria-expanded="true"]')) {
      const twin = to.querySelector(`[aria-controls="${CSS.escape(row.getAttribute("aria-controls"))}"]`);
      if (!twin) continue;
      twin.setAttribute("aria-expanded", "true");
      const detail = to.querySelector(`#${CSS.escape(twin.getAttribute("aria-controls"))}`);
      if (detail) detail.hidden = false;
    }
    for (const field of from.querySelectorAll("input[name], textarea[name], select[name]")) {
      const edited = field.type === "checkbox" ? field.checked !== field.defaultChecked : field.value !== field.defaultValue;
      if (!edited) continue;
      const twin = to.querySelector(`[name="${CSS.escape(field.name)}"]`);
      if (!twin) continue;
      if (field.type === "checkbox") twin.checked = field.checked; else twin.value = field.value;
    }
  }

  // --- the live trace: in-flight spans grow until their stored span replaces them ------
  function formatMs(ms) {
    if (ms < 1000) return `${ms.toFixed(0)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(2)} s`;
    return `${(ms / 60000).toFixed(1)} min`;
  }

  function growTrace() {
    const list = document.querySelector("ol.waterfall[data-now-ms]");
    if (!list || !list.querySelector("li.span-open")) return;
    // The server's clock, not the browser's: the offset is taken when the list arrives.
    if (list.dataset.offsetMs === undefined) list.dataset.offsetMs = String(Number(list.dataset.nowMs) - Date.now());
    const now = Date.now() + Number(list.dataset.offsetMs);
    const rows = [...list.querySelectorAll(":scope > li.span[data-start-ms]")];
    const spans = rows.map((li) => {
      const open = li.classList.contains("span-open");
      const start = Number(li.dataset.startMs);
      return { li, open, start, end: open ? Math.max(now, start) : Number(li.dataset.endMs) };
    });
    const first = Math.min(...spans.map((s) => s.start));
    const total = Math.max(Math.max(...spans.map((s) => s.end)) - first, 1);
    for (const s of spans) {
      const bar = s.li.querySelector(".span-bar");
      bar.style.left = `${((s.start - first) / total) * 100}%`;
      bar.style.width = `${Math.max(((s.end - s.start) / total) * 100, 0.3)}%`;
      if (s.open) s.li.querySelector("[data-duration]").textContent = formatMs(s.end - s.start);
    }
  }

  // --- the socket: connect, reconnect with backoff --------------------------------------
  const MIN_BACKOFF_MS = 250;
  const MAX_BACKOFF_MS = 8000;

  function connect(page, backoff) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}${body.dataset.ws}`);
    // Messages of the page's stream are numbered; a heartbeat repeats the last number.
    // A skipped number means a lost message: ask for a snapshot instead of staying stale.
    let seq = null;
    const resync = () => {
      body.dataset.resyncs = String(Number(body.dataset.resyncs || 0) + 1);
      if (page.onOpen) page.onOpen(socket); else socket.send(JSON.stringify({ type: "resync" }));
      page.onResync?.();
    };
    socket.addEventListener("open", () => {
      backoff = MIN_BACKOFF_MS;
      body.dataset.socket = "connected";
      document.querySelector(".live-label").textContent = "live";
      page.onOpen?.(socket);
    });
    socket.addEventListener("message", (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch { return; }
      if (typeof msg.seq === "number") {
        if (msg.type === "snapshot") seq = msg.seq;
        else if (seq !== null) {
          const expected = msg.type === "heartbeat" ? seq : seq + 1;
          if (msg.seq < expected) return; // already in the snapshot
          seq = msg.seq;
          if (msg.seq > expected) resync();
        }
      }
      const handler = page[msg.type];
      if (typeof handler === "function") handler(msg);
      else if (msg.type === "error") console.warn("wfdash socket:", msg.error);
    });
    socket.addEventListener("close", () => {
      body.dataset.socket = "disconnected";
      document.querySelector(".live-label").textContent = "reconnecting";
      const delay = backoff * (0.75 + Math.random() / 2);
      setTimeout(() => connect(page, Math.min(backoff * 2, MAX_BACKOFF_MS)), delay);
    });
  }

  for (const tz of document.querySelectorAll('input[name="tz"]')) tz.value = String(-new Date().getTimezoneOffset());
  formatTimes();
  setInterval(() => formatTimes(), 30_000);
  setInterval(growTrace, 250);
  const page = pages[body.dataset.live];
  if (page && body.dataset.ws && "WebSocket" in window) {
    connect(page, MIN_BACKOFF_MS);
  } else {
    body.dataset.socket = "off"; // a page without live updates shows no live indicator
  }
})();
