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
  // The hover title is the viewer's local time, so it names its zone ("long" time style).
  const dtf = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "long" });
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

  // The bulk bar's buttons act on the ticked rows: with none ticked they are disabled (a
  // click would only be refused), and Terminate's confirmation says how many it stops.
  function updateSelection(changed) {
    const boxes = [...document.querySelectorAll('#bulk input[name="pk"]')];
    if (changed && changed.matches("[data-select-all]")) boxes.forEach((b) => { b.checked = changed.checked; });
    const selected = boxes.filter((b) => b.checked).length;
    const count = document.querySelector("[data-selected-count]");
    if (count) count.textContent = String(selected);
    for (const button of document.querySelectorAll("#bulk [data-needs-selection]")) {
      button.disabled = selected === 0;
      if (button.dataset.confirm) {
        button.dataset.confirm = `${button.textContent.replace(/ selected$/, "")} the ${selected} selected instance${selected === 1 ? "" : "s"}? This cannot be reversed.`;
      }
    }
  }
  updateSelection();
  addEventListener("pageshow", () => updateSelection()); // ticks a Back navigation restored

  document.addEventListener("click", (ev) => {
    const row = ev.target.closest(".span-row");
    if (!row) return;
    const detail = document.getElementById(row.getAttribute("aria-controls"));
    const open = row.getAttribute("aria-expanded") !== "true";
    row.setAttribute("aria-expanded", String(open));
    if (detail) detail.hidden = !open;
  });

  // --- JSON: a collapsible, highlighted tree; multi-line strings (stacks) as real lines --
  const JSON_OPEN_DEPTH = 3; // levels open at first (a span event's attributes); deeper ones start folded
  const PREVIEW_CHARS = 90;

  /** The one-line JSON of a folded node, each string (keys too) in a <bdi>: a right-to-left
   * string, or a U+202E override in one, reorders only itself. In one text node the bidi
   * algorithm ran two Hebrew values together with the `","b":"` between them, so the
   * line read the values in the wrong order and a key looked like it held another's value. */
  function jsonPreview(value) {
    const pieces = [];
    (function walk(v) {
      if (Array.isArray(v)) {
        pieces.push("[");
        v.forEach((item, i) => { if (i) pieces.push(","); walk(item); });
        pieces.push("]");
      } else if (v !== null && typeof v === "object" && !isRaw(v)) {
        pieces.push("{");
        Object.entries(v).forEach(([key, item], i) => {
          pieces.push(...(i ? [","] : []), { text: JSON.stringify(key) }, ":");
          walk(item);
        });
        pieces.push("}");
      } else if (typeof v === "string") pieces.push({ text: JSON.stringify(v) });
      else pieces.push(JSON.stringify(v));
    })(value);
    const out = document.createDocumentFragment();
    let left = PREVIEW_CHARS;
    for (const [i, piece] of pieces.entries()) {
      let text = typeof piece === "string" ? piece : piece.text;
      // As before: past PREVIEW_CHARS in all, its first PREVIEW_CHARS - 1 and "…".
      const cut = text.length > left || (text.length === left && i < pieces.length - 1);
      if (cut) text = text.slice(0, Math.max(0, left - 1));
      if (typeof piece === "string") out.append(text);
      else { const bdi = document.createElement("bdi"); bdi.textContent = text; out.append(bdi); }
      left -= text.length;
      if (cut) { out.append("…"); break; }
    }
    return out;
  }

  // Numbers JSON.parse would round (ids past 2^53) keep their digits where the browser
  // can (JSON.rawJSON); elsewhere they show rounded, as any JSON.parse would.
  const keepDigits = typeof JSON.rawJSON === "function"
    ? (key, value, context) => (typeof value === "number" && context && String(value) !== context.source ? JSON.rawJSON(context.source) : value)
    : undefined;
  const isRaw = (value) => typeof JSON.isRawJSON === "function" && JSON.isRawJSON(value);

  function jsonScalar(value) {
    if (isRaw(value)) {
      const raw = document.createElement("span");
      raw.className = "json-number";
      raw.textContent = JSON.stringify(value);
      return raw;
    }
    const el = document.createElement(typeof value === "string" && value.includes("\n") ? "pre" : "span");
    el.className = value === null ? "json-null" : `json-${typeof value}`;
    if (el.tagName === "PRE") { el.classList.add("json-lines"); el.textContent = value; } // a stack, a message
    else el.textContent = JSON.stringify(value);
    return el;
  }

  function jsonNode(value, depth, folded) {
    if (value === null || typeof value !== "object" || isRaw(value)) return jsonScalar(value);
    const entries = Array.isArray(value) ? value.map((v, i) => [i, v]) : Object.entries(value);
    if (!entries.length) return jsonScalar(value);
    const node = document.createElement("details");
    node.className = "json-node";
    node.open = !folded && depth < JSON_OPEN_DEPTH;
    const summary = document.createElement("summary");
    const count = document.createElement("span");
    count.className = "json-count";
    count.textContent = Array.isArray(value) ? `[${entries.length}]` : `{${entries.length}}`;
    const preview = document.createElement("span");
    preview.className = "json-preview";
    preview.append(jsonPreview(value));
    summary.append(count, " ", preview);
    const children = document.createElement("div");
    children.className = "json-children";
    for (const [key, child] of entries) {
      const row = document.createElement("div");
      row.className = "json-row";
      const label = document.createElement("span");
      label.className = Array.isArray(value) ? "json-index" : "json-key";
      label.textContent = Array.isArray(value) ? String(key) : JSON.stringify(key);
      row.append(label, ": ", jsonNode(child, depth + 1, false));
      children.append(row);
    }
    node.append(summary, children);
    return node;
  }

  /** Elements marked data-json-view hold JSON text the server escaped; each gets a viewer
   * beside it (the text stays, hidden, for anything that cannot parse). */
  function viewJSON(root = document) {
    for (const el of root.querySelectorAll("[data-json-view]:not([data-json-viewed])")) {
      let value;
      try { value = JSON.parse(el.textContent, keepDigits); } catch { continue; }
      el.dataset.jsonViewed = "1";
      const viewer = document.createElement("div");
      viewer.className = "json-view";
      viewer.append(jsonNode(value, 0, el.dataset.jsonView === "folded"));
      el.after(viewer);
      el.hidden = true;
    }
  }

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
    const peak = card.querySelector('[data-axis="y-max"]');
    if (peak && typeof s.chart_peak === "number") peak.textContent = String(s.chart_peak);
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
  // tokens are masked afresh on every render, and the trace's read time changes on every
  // render, so both are left out of the comparison.
  const lastHTML = new Map();
  const comparable = (html) => html.replace(/name="csrfmiddlewaretoken" value="[^"]*"/g, "").replace(/ data-now-ms="\d+"/, "");
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
        viewJSON(node);
        if (name === "trace") layoutTrace(); // before the browser paints the server's unscaled bars
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
    // The server's own <details>, by position; JSON viewers are rebuilt afresh.
    const opened = [...from.querySelectorAll("details:not(.json-node)")].map((d) => d.open);
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

  // --- the live trace: idle gaps compressed, a time axis, zoom; in-flight spans grow ---
  function formatMs(ms) {
    if (ms < 1000) return `${ms.toFixed(0)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(2)} s`;
    return `${(ms / 60000).toFixed(1)} min`;
  }

  // A stretch where no span works (nothing open but sleeps and waits) longer than this
  // share of the time still drawn to scale becomes a break of BREAK_SHARE of the width.
  const GAP_SHARE = 0.2;
  const BREAK_SHARE = 0.06;
  const AXIS_TICKS = 6; // about this many labels across the track
  const MIN_TICK_PX = 70; // labels closer than this to the previous one are left out
  const TICK_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 15e3, 3e4, 6e4, 12e4, 3e5,
    6e5, 9e5, 18e5, 36e5, 72e5, 108e5, 216e5, 432e5, 864e5, 1728e5, 6048e5, 2592e6, 31536e6];

  /** "23 h", "1 d 2 h", "5 min", "45 s": the length of a break, in its two largest units
   * (rounded to the second, so a day less a millisecond reads "1 d"). */
  function formatSpan(ms) {
    const units = [["d", 864e5], ["h", 36e5], ["min", 6e4], ["s", 1e3]];
    if (ms < 1000) return `${Math.round(ms)} ms`;
    const top = units.findIndex(([, size]) => ms >= size);
    const grain = units[Math.min(top + 1, units.length - 1)][1];
    let rest = Math.round(ms / grain) * grain;
    const parts = [];
    for (const [unit, size] of units) {
      const n = Math.floor(rest / size);
      rest -= n * size;
      if (n) parts.push(`${n} ${unit}`);
    }
    return parts.slice(0, 2).join(" ");
  }

  /** An axis label: time since the trace began, to the precision of the tick step. */
  function formatOffset(ms, step) {
    if (ms === 0) return "0";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    const decimals = step >= 1000 ? 0 : step >= 100 ? 1 : step >= 10 ? 2 : 3;
    if (ms < 60000) return `${(ms / 1000).toFixed(decimals)} s`;
    const days = Math.floor(ms / 864e5);
    const h = Math.floor((ms % 864e5) / 36e5), m = Math.floor((ms % 36e5) / 6e4);
    const sec = (ms % 6e4) / 1000;
    if (ms < 36e5) return step >= 6e4 ? `${m} min` : `${m} min ${sec.toFixed(decimals)} s`;
    const mm = String(m).padStart(2, "0");
    const ss = sec.toFixed(decimals).padStart(decimals ? 3 + decimals : 2, "0");
    const clock = step >= 6e4 ? `${h}:${mm}` : `${h}:${mm}:${ss}`;
    return days ? `${days} d ${clock}` : clock;
  }

  /** Time → position 0…1 on a scale that draws busy stretches to scale and idle gaps
   * (no working span open) as short fixed breaks. */
  function buildScale(spans) {
    const first = Math.min(...spans.map((s) => s.start));
    const last = Math.max(...spans.map((s) => s.end), first + 1);
    const busy = spans.filter((s) => !s.wait).map((s) => [s.start, s.end]).sort((a, b) => a[0] - b[0]);
    const gaps = [];
    let reach = first;
    for (const [a, b] of busy) { if (a > reach) gaps.push([reach, a]); reach = Math.max(reach, b); }
    if (last > reach) gaps.push([reach, last]);
    // The biggest gaps first, each judged against the time still drawn to scale.
    gaps.sort((a, b) => (b[1] - b[0]) - (a[1] - a[0]));
    const breaks = [];
    let scaled = last - first;
    for (const gap of gaps) {
      const length = gap[1] - gap[0];
      if (length <= GAP_SHARE * scaled || scaled - length <= 0) break;
      breaks.push(gap); scaled -= length;
    }
    breaks.sort((a, b) => a[0] - b[0]);
    const breakShare = Math.min(BREAK_SHARE, 0.5 / Math.max(breaks.length, 1));
    const perMs = (1 - breakShare * breaks.length) / Math.max(scaled, 1);
    // Pieces of the axis: [t0, t1, p0, p1, isBreak]
    const pieces = [];
    let t = first, p = 0;
    for (const [a, b] of breaks) {
      if (a > t) { pieces.push([t, a, p, p + (a - t) * perMs, false]); p += (a - t) * perMs; }
      pieces.push([a, b, p, p + breakShare, true]); p += breakShare; t = b;
    }
    if (last > t || !pieces.length) pieces.push([t, last, p, 1, false]);
    pieces[pieces.length - 1][3] = 1;
    const at = (time) => {
      for (const [t0, t1, p0, p1] of pieces) {
        if (time <= t1) return time <= t0 ? p0 : p0 + ((time - t0) / Math.max(t1 - t0, 1e-9)) * (p1 - p0);
      }
      return 1;
    };
    const timeAt = (pos) => {
      for (const [t0, t1, p0, p1] of pieces) {
        if (pos <= p1) return pos <= p0 ? t0 : t0 + ((pos - p0) / Math.max(p1 - p0, 1e-12)) * (t1 - t0);
      }
      return last;
    };
    return { first, last, pieces, at, timeAt };
  }

  // The zoomed window as times (null: the whole trace), kept across live refreshes.
  let traceZoom = null;

  function traceSpans(list) {
    const open = list.querySelector("li.span-open");
    // The server's clock, not the browser's: the offset is taken when the list arrives.
    if (open && list.dataset.offsetMs === undefined) list.dataset.offsetMs = String(Number(list.dataset.nowMs) - Date.now());
    const now = Date.now() + Number(list.dataset.offsetMs || 0);
    return [...list.querySelectorAll(":scope > li.span[data-start-ms]")].map((li) => {
      const isOpen = li.classList.contains("span-open");
      const start = Number(li.dataset.startMs);
      return { li, open: isOpen, wait: li.dataset.wait === "1", start, end: isOpen ? Math.max(now, start) : Number(li.dataset.endMs) };
    });
  }

  function layoutTrace() {
    const list = document.querySelector("ol.waterfall[data-now-ms]");
    if (!list) return;
    const spans = traceSpans(list);
    if (!spans.length) return;
    const scale = buildScale(spans);
    let [v0, v1] = traceZoom ? [scale.at(traceZoom[0]), scale.at(traceZoom[1])] : [0, 1];
    if (!(v1 - v0 > 1e-9)) [v0, v1] = [0, 1];
    const x = (time) => ((scale.at(time) - v0) / (v1 - v0)) * 100;
    for (const s of spans) {
      const bar = s.li.querySelector(".span-bar");
      const left = x(s.start), right = x(s.end);
      bar.style.left = `${left}%`;
      bar.style.width = `${Math.max(right - left, 0.3)}%`;
      for (const mark of bar.querySelectorAll(".span-event[data-at-ms]")) {
        const width = right - left;
        mark.style.left = `${width > 0 ? ((x(Number(mark.dataset.atMs)) - left) / width) * 100 : 0}%`;
      }
      const track = s.li.querySelector(".span-track");
      const bands = scale.pieces.filter((piece) => piece[4]).map(([t0, t1]) => {
        const band = document.createElement("span");
        band.className = "gap-band";
        band.style.left = `${x(t0)}%`;
        band.style.width = `${x(t1) - x(t0)}%`;
        return band;
      });
      track.querySelectorAll(".gap-band").forEach((b) => b.remove());
      track.prepend(...bands);
      if (s.open) s.li.querySelector("[data-duration]").textContent = formatMs(s.end - s.start);
    }
    drawAxis(list, scale, v0, v1, x);
  }

  function drawAxis(list, scale, v0, v1, x) {
    const axis = list.parentElement.querySelector(".trace-axis .axis-track");
    if (!axis) return;
    const width = axis.getBoundingClientRect().width || 600;
    const labels = [];
    // The time drawn to scale inside the window sets the step: about AXIS_TICKS labels.
    let scaled = 0;
    for (const [t0, t1, p0, p1, isBreak] of scale.pieces) {
      if (isBreak || p1 <= v0 || p0 >= v1) continue;
      scaled += scale.timeAt(Math.min(p1, v1)) - scale.timeAt(Math.max(p0, v0));
    }
    const step = TICK_STEPS.find((s) => s >= scaled / AXIS_TICKS) || TICK_STEPS[TICK_STEPS.length - 1];
    let lastPx = -Infinity;
    for (const [t0, t1, p0, p1, isBreak] of scale.pieces) {
      if (p1 < v0 || p0 > v1) continue;
      if (isBreak) {
        const mid = (x(t0) + x(t1)) / 2;
        const gap = document.createElement("span");
        gap.className = "axis-gap";
        gap.style.left = `${mid}%`;
        gap.textContent = `⋯ ${formatSpan(t1 - t0)} ⋯`;
        gap.title = `${formatSpan(t1 - t0)} with nothing running, drawn short`;
        gap.dataset.px = String((mid / 100) * width);
        // The break's label wins over the ticks just before it.
        while (labels.length && Number(labels[labels.length - 1].dataset.px) > Number(gap.dataset.px) - MIN_TICK_PX) labels.pop();
        labels.push(gap);
        lastPx = Number(gap.dataset.px);
        continue;
      }
      const from = Math.max(t0, scale.timeAt(v0)), to = Math.min(t1, scale.timeAt(v1));
      for (let k = Math.ceil((from - scale.first) / step); scale.first + k * step <= to; k++) {
        const t = scale.first + k * step;
        const pct = x(t);
        const px = (pct / 100) * width;
        if (px - lastPx < MIN_TICK_PX || pct < -0.01 || pct > 100.01) continue;
        const tick = document.createElement("span");
        tick.className = "axis-tick";
        tick.style.left = `${pct}%`;
        tick.dataset.offsetMs = String(t - scale.first);
        tick.dataset.px = String(px);
        if (pct > 95) tick.classList.add("axis-end"); // right-aligned, not cut by the edge
        tick.textContent = formatOffset(t - scale.first, step);
        labels.push(tick);
        lastPx = px;
      }
    }
    axis.replaceChildren(...labels);
    keepLabelsInside(axis, labels);
    axis.dataset.zoomed = traceZoom ? "true" : "false";
  }

  // A label centred on its time (a break's length near either end, a long tick label) would
  // be cut by the track's edge: it is aligned to that edge instead, a tick keeping its mark.
  function keepLabelsInside(axis, labels) {
    const box = axis.getBoundingClientRect();
    if (!box.width) return; // not laid out (a hidden panel): drawn again on resize
    for (const label of labels) {
      const r = label.getBoundingClientRect();
      if (r.right > box.right + 0.5) {
        if (label.classList.contains("axis-tick")) label.classList.add("axis-end");
        else label.classList.add("axis-flush-end");
      } else if (r.left < box.left - 0.5) {
        label.classList.add(label.classList.contains("axis-tick") ? "axis-start" : "axis-flush-start");
      }
    }
  }

  function zoomTrace(factor, center) {
    const list = document.querySelector("ol.waterfall[data-now-ms]");
    if (!list) return;
    const scale = buildScale(traceSpans(list));
    let [v0, v1] = traceZoom ? [scale.at(traceZoom[0]), scale.at(traceZoom[1])] : [0, 1];
    const mid = center ?? (v0 + v1) / 2;
    const half = Math.min(((v1 - v0) * factor) / 2, 0.5);
    v0 = Math.max(0, mid - half); v1 = Math.min(1, v0 + 2 * half); v0 = Math.max(0, v1 - 2 * half);
    traceZoom = v1 - v0 >= 0.999 ? null : [scale.timeAt(v0), scale.timeAt(v1)];
    layoutTrace();
  }

  document.addEventListener("click", (ev) => {
    const button = ev.target.closest("[data-trace-zoom]");
    if (!button) return;
    const how = button.dataset.traceZoom;
    if (how === "reset") { traceZoom = null; layoutTrace(); } else zoomTrace(how === "in" ? 0.5 : 2);
  });

  // Drag across the axis: the window becomes the selected range.
  document.addEventListener("pointerdown", (ev) => {
    const axis = ev.target.closest(".trace-axis .axis-track");
    if (!axis || ev.button !== 0) return;
    ev.preventDefault();
    const box = axis.getBoundingClientRect();
    const fraction = (clientX) => Math.min(Math.max((clientX - box.left) / box.width, 0), 1);
    const from = fraction(ev.clientX);
    const band = document.createElement("span");
    band.className = "axis-selection";
    axis.append(band);
    const move = (e) => {
      const to = fraction(e.clientX);
      band.style.left = `${Math.min(from, to) * 100}%`;
      band.style.width = `${Math.abs(to - from) * 100}%`;
    };
    const up = (e) => {
      document.removeEventListener("pointermove", move);
      document.removeEventListener("pointerup", up);
      band.remove();
      const to = fraction(e.clientX);
      if (Math.abs(to - from) * box.width < 4) return; // a click, not a drag
      const list = document.querySelector("ol.waterfall[data-now-ms]");
      const scale = buildScale(traceSpans(list));
      const [v0, v1] = traceZoom ? [scale.at(traceZoom[0]), scale.at(traceZoom[1])] : [0, 1];
      const [a, b] = [Math.min(from, to), Math.max(from, to)].map((f) => v0 + f * (v1 - v0));
      traceZoom = [scale.timeAt(a), scale.timeAt(b)];
      layoutTrace();
    };
    document.addEventListener("pointermove", move);
    document.addEventListener("pointerup", up);
  });

  function growTrace() {
    if (document.querySelector("ol.waterfall[data-now-ms] li.span-open")) layoutTrace();
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
      body.dataset.socket = "connected";
      document.querySelector(".live-label").textContent = "live";
      page.onOpen?.(socket);
    });
    socket.addEventListener("message", (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch { return; }
      // Only a socket that got its state counts as a success: one the server accepts and
      // closes at once (too many open, a failed read) keeps backing off, not a storm.
      if (msg.type === "snapshot") backoff = MIN_BACKOFF_MS;
      if (typeof msg.seq === "number") {
        if (msg.type === "snapshot") seq = msg.seq;
        else if (seq !== null) {
          const expected = msg.type === "heartbeat" ? seq : seq + 1;
          if (msg.seq < expected) return; // already in the snapshot
          seq = msg.seq;
          if (msg.seq > expected) resync();
        }
      }
      // A message too large for one frame (a herd's batch) comes as a resync: ask for
      // the state instead, as on a lost message.
      if (msg.type === "resync") { resync(); return; }
      const handler = page[msg.type];
      if (typeof handler === "function") handler(msg);
      else if (msg.type === "error") console.warn("wfdash socket:", msg.error);
    });
    socket.addEventListener("close", (ev) => {
      if (ev.code === 4403) {
        // Signed out, or no longer allowed to view: every reconnect would be refused too.
        body.dataset.socket = "refused";
        document.querySelector(".live-label").textContent = "signed out: reload the page";
        return;
      }
      body.dataset.socket = "disconnected";
      document.querySelector(".live-label").textContent = "reconnecting";
      if (ev.code === 4429) {
        // This user has too many dashboard sockets open: try again slowly, in case one closes.
        document.querySelector(".live-label").textContent = "too many pages open: retrying";
        backoff = MAX_BACKOFF_MS;
      }
      const delay = backoff * (0.75 + Math.random() / 2);
      setTimeout(() => connect(page, Math.min(backoff * 2, MAX_BACKOFF_MS)), delay);
    });
  }

  for (const tz of document.querySelectorAll('input[name="tz"]')) tz.value = String(-new Date().getTimezoneOffset());
  formatTimes();
  viewJSON();
  layoutTrace();
  addEventListener("resize", layoutTrace);
  setInterval(() => formatTimes(), 30_000);
  setInterval(growTrace, 250);
  const page = pages[body.dataset.live];
  if (page && body.dataset.ws && "WebSocket" in window) {
    connect(page, MIN_BACKOFF_MS);
  } else {
    body.dataset.socket = "off"; // a page without live updates shows no live indicator
  }
})();
