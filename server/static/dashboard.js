// kvstore admin dashboard. Plain browser JavaScript, no libraries: the page reads the /admin JSON
// routes every few seconds and draws with DOM nodes and hand-made SVG. Every value from the server
// goes in as text (textContent, SVG text nodes), never as markup: namespaces and reasons are
// caller-chosen strings.
"use strict";

const REFRESH_MS = 3000;
const TOKEN_KEY = "kvstore.adminToken";
const COLORS = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#718096", "#b7791f"];
const SVGNS = "http://www.w3.org/2000/svg";

const state = {
  timer: null,
  tiers: [],           // names, in store order
  entries: { sort: "heat", order: "desc", offset: 0, limit: 50, filters: {} },
  selectedKey: null,
  refreshing: false,
  again: false,
  evictBody: null,     // the body of the last dry run, which the confirm button sends for real
};

// -- helpers -------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

async function api(path, { method = "GET", body } = {}) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    throw new ApiError(0, "Unreachable", "the server did not answer (" + err.message + ")");
  }
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { /* not JSON: reported below */ }
  if (!resp.ok && !(path === "/readyz" && data)) {
    const e = (data && data.error) || {};
    throw new ApiError(resp.status, e.type || "HTTP " + resp.status, e.message || text || resp.statusText);
  }
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.setAttribute("class", v);
    else if (k === "style") Object.assign(node.style, v);  // CSSOM: the CSP refuses style attributes
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

const $ = (id) => document.getElementById(id);

function fill(tbodyParent, rows) {
  const tbody = tbodyParent.querySelector("tbody");
  tbody.replaceChildren(...rows);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return i === 0 ? n + " B" : v.toFixed(1) + " " + units[i];
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(2) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function fmtTime(t) { return new Date(t * 1000).toLocaleTimeString(); }
// Moves carry placement's monotonic clock; their age_s places them in wall time.
function fmtAgo(age) { return fmtTime(Date.now() / 1000 - age); }
function fmtRate(r) { return r === null || r === undefined ? "–" : r === 0 ? "0" : r.toPrecision(2); }
function short(key) { return key.slice(0, 12) + "…"; }
function tierColor(name) {
  const i = state.tiers.indexOf(name);
  return COLORS[(i < 0 ? state.tiers.length : i) % COLORS.length];
}

function legend(node, items) {
  node.replaceChildren(...items.map(([label, color]) =>
    el("span", {}, el("span", { class: "swatch", style: { background: color } }), label)));
}

// -- login ---------------------------------------------------------------------------------------

function showLogin(message) {
  stopRefresh();
  $("dashboard").hidden = true;
  $("logout").hidden = true;
  $("health").hidden = true;
  $("login").hidden = false;
  $("login-error").hidden = !message;
  $("login-error").textContent = message || "";
  $("token").focus();
}

async function login(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  try {
    await api("/admin/stats");
  } catch (err) {
    sessionStorage.removeItem(TOKEN_KEY);
    if (err.status === 401 || err.status === 403) {
      showLogin("The server refused this token (" + err.status + " " + err.type + ": " + err.message + ").");
    } else {
      showLogin("Could not reach the admin routes: " + err.message);
    }
    return;
  }
  $("login").hidden = true;
  $("dashboard").hidden = false;
  $("logout").hidden = false;
  await refresh();
  startRefresh();
}

function startRefresh() {
  stopRefresh();
  state.timer = setInterval(refresh, REFRESH_MS);
}

function stopRefresh() {
  if (state.timer !== null) clearInterval(state.timer);
  state.timer = null;
}

// -- refresh ---------------------------------------------------------------------------------------

async function refresh() {
  // One refresh at a time: on a slow server they would pile up. One asked for meanwhile (after an
  // eviction, say) runs right after the one in flight, so what it shows is never older than the action.
  if (state.refreshing) {
    state.again = true;
    return;
  }
  state.refreshing = true;
  try {
    do {
      state.again = false;
      await refreshOnce();
    } while (state.again);
  } finally {
    state.refreshing = false;
  }
}

async function refreshOnce() {
  const calls = {
    stats: api("/admin/stats"),
    tiers: api("/admin/tiers"),
    history: api("/admin/history?limit=120"),
    heat: api("/admin/heat?bins=12"),
    moves: api("/admin/moves?limit=30"),
    decisions: api("/admin/decisions?limit=200"),
    prefetches: api("/admin/prefetches?limit=30"),
    policy: api("/admin/policy"),
    audit: api("/admin/audit?limit=30"),
    ready: api("/readyz"),
    info: api("/v1/info"),
    entries: api(entriesPath()),
    connectors: api("/admin/connectors"),
  };
  const names = Object.keys(calls);
  const results = await Promise.allSettled(Object.values(calls));
  const got = {};
  const failed = [];
  results.forEach((r, i) => {
    if (r.status === "fulfilled") got[names[i]] = r.value;
    else failed.push([names[i], r.reason]);
  });
  const refused = failed.find(([, e]) => e.status === 401 || e.status === 403);
  if (refused) {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin("The server no longer accepts this token (" + refused[1].status + ": " + refused[1].message + ").");
    return;
  }
  const renderers = { tiers: renderTiers, stats: renderStats, history: renderHistory, heat: renderHeat,
    moves: renderMoves, decisions: renderDecisions, prefetches: renderPrefetches, policy: renderPolicy, audit: renderAudit,
    ready: renderHealth, info: renderInfo, entries: renderEntries, connectors: renderConnectors };
  for (const name of names) {
    if (name in got) {
      try { renderers[name](got[name]); } catch (err) { failed.push([name, err]); }
    }
  }
  const banner = $("error-banner");
  banner.hidden = failed.length === 0;
  banner.textContent = failed.map(([n, e]) => n + ": " + e.message).join(" · ");
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// -- panels ----------------------------------------------------------------------------------------

function renderInfo(info) {
  $("version").textContent = "v" + info.version;
}

function renderStats(stats) {
  const c = stats.counters;
  const ratio = c.tokens_requested ? (100 * c.tokens_hit / c.tokens_requested).toFixed(1) + "% tokens hit" : "no gets yet";
  $("store-summary").textContent = stats.blocks + " blocks · " + fmtBytes(stats.frame_bytes) + " · " + ratio +
    " since start · up " + fmtSeconds(stats.service.uptime_s);
}

function renderHealth(ready) {
  const badge = $("health");
  badge.hidden = false;
  badge.className = "badge " + ready.status;
  badge.textContent = ready.status;
  badge.title = (ready.reasons || []).join("\n");
}

function renderTiers(data) {
  state.tiers = data.tiers.map((t) => t.name);
  for (const id of ["f-tier", "evict-tier"]) {
    const sel = $(id);
    const keep = sel.value;
    const opts = id === "f-tier" ? [el("option", { value: "", text: "any" })] : [];
    sel.replaceChildren(...opts, ...state.tiers.map((n) => el("option", { value: n, text: n })));
    sel.value = keep;
    if (sel.value !== keep) sel.selectedIndex = 0;
  }
  $("tiers").replaceChildren(...data.tiers.map((t) => {
    const cap = t.capacity_bytes || 1;
    const pct = Math.min(100, 100 * t.used_bytes / cap);
    const bar = el("div", { class: "bar", title: t.used_bytes + " of " + t.capacity_bytes + " bytes" },
      el("div", { class: "fill", style: { width: pct.toFixed(2) + "%", background: tierColor(t.name) } }));
    if (t.low_watermark_frac) bar.append(el("div", { class: "mark low", style: { left: 100 * t.low_watermark_frac + "%" },
      title: "low watermark " + t.low_watermark_frac }));
    if (t.high_watermark_frac) bar.append(el("div", { class: "mark high", style: { left: 100 * t.high_watermark_frac + "%" },
      title: "high watermark " + t.high_watermark_frac }));
    const down = t.state !== "ok";
    // reads: block reads the tier served on every path (co-located shm reads too), the store's
    // one account, as /admin/stats and /metrics (kvstore_tier_reads_total) report it.
    const reads = t.reads || 0;
    const row = el("div", { class: "tier" + (down ? " down" : ""), "data-tier": t.name,
      "data-used-bytes": t.used_bytes, "data-capacity-bytes": t.capacity_bytes, "data-entries": t.entries,
      "data-reads": reads },
      el("div", { class: "name" }, t.name + " ", el("span", { class: "kind", text: t.kind + (t.durable ? ", durable" : "") })),
      bar,
      el("div", { class: "label", text: fmtBytes(t.used_bytes) + " of " + fmtBytes(t.capacity_bytes) + " (" +
        pct.toFixed(1) + "%) · " + t.entries + " entries · " + reads + (reads === 1 ? " block read" : " block reads") +
        " served" + (down ? " · UNAVAILABLE" : "") }));
    if (down) row.append(el("div", { class: "reason", text: t.details.error || "not connected" }));
    return row;
  }));
}

function renderHistory(data) {
  const svg = $("hit-chart");
  const pts = data.points;
  const series = state.tiers.map((name) => ({ name, color: tierColor(name), values: pts.map((p) => p.tiers[name]) }));
  series.push({ name: "all tiers", color: "#1d2330", dash: "4 3", values: pts.map((p) => p.hit_ratio) });
  lineChart(svg, pts.map((p) => p.time_s), series, { yMax: 1, yLabel: (v) => (100 * v).toFixed(0) + "%" });
  legend($("hit-legend"), series.map((s) => [s.name, s.color]));
}

function renderHeat(data) {
  const svg = $("heat-chart");
  const bins = data.bins.slice();
  const labels = bins.map((b) => fmtRate(b.lo));
  const stacks = bins.map((b) => state.tiers.map((t) => b.counts[t] || 0));
  const zero = state.tiers.map((t) => data.zero[t] || 0);
  if (zero.some((v) => v > 0)) { labels.unshift("0"); stacks.unshift(zero); }
  barChart(svg, labels, stacks, state.tiers.map(tierColor));
  legend($("heat-legend"), state.tiers.map((t) => [t, tierColor(t)]));
  $("heat-note").textContent = "Entries by reads per second now (log-spaced bins; " + data.entries + " entries" +
    (data.sampled ? ", counted from a sample" : "") + "), stacked by tier.";
}

function renderConnectors(data) {
  // The four token figures as the connectors counted them, and the server's hit ratio (loaded over
  // looked up: server/connector_board.py hit_ratio), not one worked out again here.
  const rows = data.connectors;
  fill($("connectors"), rows.length ? rows.map((r) => {
    const errors = r.lookup_errors + r.load_errors + r.save_errors;
    return el("tr", {}, el("td", { text: r.namespace }), el("td", { text: r.engine }),
      el("td", { text: String(r.instances) }),
      el("td", { text: String(r.looked_up_tokens) }), el("td", { text: String(r.offered_tokens) }),
      el("td", { text: String(r.loaded_tokens) }), el("td", { text: String(r.saved_tokens) }),
      el("td", { text: r.hit_ratio === null || r.hit_ratio === undefined ? "–" :
        (100 * r.hit_ratio).toFixed(1) + "%" }),
      el("td", { text: fmtSeconds(r.load_seconds) }), el("td", { text: fmtSeconds(r.save_seconds) }),
      el("td", { class: errors ? "bad" : "", text: errors + (r.failed_blocks ? " (" + r.failed_blocks +
        " blocks recomputed)" : "") }),
      el("td", { text: fmtAgo(r.age_s) }));
  }) : [el("tr", {}, el("td", { colspan: 12, class: "muted", text: "no engine connector has reported" }))]);
}

function renderMoves(data) {
  const moves = data.moves.slice().reverse();
  fill($("moves"), moves.length ? moves.map((m) => el("tr", {},
    el("td", { text: fmtAgo(m.age_s) }), el("td", { class: "key", text: short(m.key), title: m.key }),
    el("td", { text: m.src }), el("td", { text: m.dst === null ? "(evicted)" : m.dst }),
    el("td", { text: fmtBytes(m.bytes) }), el("td", { class: "reason", text: m.reason }))) :
    [el("tr", {}, el("td", { colspan: 6, class: "muted", text: "no moves yet" }))]);
}

function renderDecisions(data) {
  const decisions = data.decisions.slice().reverse();  // newest first
  fill($("decisions"), decisions.length ? decisions.slice(0, 25).map((d) => el("tr", {},
    el("td", { text: fmtTime(d.time_s) }), el("td", { text: d.op + (d.explore ? " (explore)" : "") }),
    el("td", { text: d.choice }), el("td", { text: fmtBytes(d.bytes) }),
    el("td", { text: fmtSeconds(d.predicted_s) }), el("td", { text: fmtSeconds(d.actual_s) }),
    el("td", { text: d.ratio === null || d.ratio === undefined ? "–" : d.ratio.toFixed(2) }),
    el("td", { class: "reason", text: d.error ? "error: " + d.error : d.reason }))) :
    [el("tr", {}, el("td", { colspan: 8, class: "muted", text: "no decisions reported yet" }))]);
  const choices = [...new Set(decisions.map((d) => d.choice))];
  const color = (c) => COLORS[choices.indexOf(c) % COLORS.length];
  const points = decisions.filter((d) => d.predicted_s > 0 && d.actual_s > 0)
    .map((d) => ({ x: d.predicted_s, y: d.actual_s, color: color(d.choice), title: d.op + " " + d.choice }));
  scatterChart($("decision-chart"), points);
  legend($("decision-legend"), [...choices.map((c) => [c, color(c)]), ["actual = predicted", "#a0a8b5"]]);
  // The figure and its definition, both as the server computes them (kvstore.decisions.prediction_error).
  const pe = data.prediction_error;
  $("prediction-error").textContent = pe ? "prediction error " + fmtError(pe.median) + " over " + pe.samples +
    " transfers: the " + pe.definition + "." : "";
}

function fmtError(e) {
  return e === null || e === undefined ? "–" : (100 * e).toFixed(0) + "%";
}

function renderPrefetches(data) {
  const rows = data.prefetches.slice().reverse();  // newest first
  const tally = (counts) => Object.entries(counts || {}).map(([t, n]) => t + ": " + n).join(", ") || "–";
  fill($("prefetches"), rows.length ? rows.map((d) => el("tr", { "data-trigger": d.trigger },
    el("td", { text: fmtTime(d.time_s) }), el("td", { text: d.trigger }), el("td", { text: d.namespace }),
    el("td", { text: String(d.blocks) }), el("td", { text: tally(d.from) }), el("td", { text: d.to }),
    el("td", { text: d.moved === undefined ? "–" : String(d.moved + (d.adopted || 0)) }),
    el("td", { text: d.held ? d.held + " for " + fmtSeconds(d.hold_s) : "" }),
    el("td", { class: "reason", text: d.reason + (d.failed ? " (" + d.failed + " failed)" : "") }))) :
    [el("tr", {}, el("td", { colspan: 9, class: "muted", text: "no prefetches yet" }))]);
  const owners = Object.entries(data.retained_bytes || {});
  $("retained-summary").textContent = owners.length ?
    "retained now: " + owners.map(([o, b]) => o + " " + fmtBytes(b)).join(", ") : "nothing retained now";
}

function fmtRetained(r) {
  return r ? r.owner + " · p" + r.priority + " · " + fmtSeconds(r.expires_in_s) + " left" : "";
}

function renderPolicy(p) {
  const base = p.baseline;
  const cand = p.candidate;
  const facts = [
    ["baseline", "v" + base.version + (base.note ? " (" + base.note + ")" : "")],
    ["candidate", cand ? "v" + cand.version + (cand.note ? " (" + cand.note + ")" : "") : "none"],
    ["canary share", (100 * p.fraction).toFixed(0) + "% of transfers"],
    ["rule", "judged after " + p.canary.min_samples + " samples; rolled back when its p95 is " +
      (100 * p.canary.rollback_margin_frac).toFixed(0) + "% worse"],
    ["decisions received", String(p.decisions_received)],
  ];
  const rows = Object.entries(p.versions).map(([v, s]) => el("tr", {},
    el("td", { text: "v" + v + (cand && String(cand.version) === v ? " (candidate)" :
      String(base.version) === v ? " (baseline)" : "") }),
    el("td", { text: String(s.samples) }), el("td", { text: fmtSeconds(s.p50_s) }),
    el("td", { text: fmtSeconds(s.p95_s) }),
    el("td", { text: fmtError(s.prediction_error ? s.prediction_error.median : s.median_abs_error),
      title: s.prediction_error ? s.prediction_error.samples + " transfers counted" : undefined })));
  const definition = Object.values(p.versions).map((s) => s.prediction_error && s.prediction_error.definition)
    .find((d) => d) || "";
  const rollbacks = (p.rollbacks || []).slice(-5).map((r) => el("li", { text: JSON.stringify(r) }));
  $("canary").replaceChildren(el("div", { class: "canary" },
    el("dl", {}, ...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
    el("table", {}, el("thead", {}, el("tr", {}, ...["version", "samples", "p50", "p95", "prediction error"]
      .map((h) => el("th", { text: h, title: h === "prediction error" && definition ? definition : undefined })))),
      el("tbody", {}, ...rows)),
    el("p", { class: "muted small", text: definition ? "prediction error: the " + definition + "." : "" }),
    el("h3", { text: "rollbacks" }),
    rollbacks.length ? el("ul", {}, ...rollbacks) : el("p", { class: "muted", text: "none" })));
}

function renderAudit(data) {
  const records = data.records;  // newest first, as /admin/audit answers
  fill($("audit"), records.length ? records.map((r) => {
    const { id, time_s, who, action, ...rest } = r;
    const what = Object.entries(rest).map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join(" ");
    return el("tr", { "data-audit-id": id, "data-action": action, "data-dry-run": rest.dry_run ? "true" : "false" },
      el("td", { text: String(id) }), el("td", { text: fmtTime(time_s) }), el("td", { text: who }),
      el("td", { text: action + (rest.dry_run ? " (dry run)" : "") }), el("td", { class: "reason", text: what }));
  }) : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "no admin actions yet" }))]);
}

// -- entries ------------------------------------------------------------------------------------------

function entriesPath() {
  const e = state.entries;
  const q = new URLSearchParams({ sort: e.sort, order: e.order, limit: e.limit, offset: e.offset });
  for (const [k, v] of Object.entries(e.filters)) if (v !== "") q.set(k, v);
  return "/admin/entries?" + q.toString();
}

function renderEntries(data) {
  $("entries-total").textContent = data.total + " matching";
  const end = Math.min(data.offset + data.entries.length, data.total);
  $("entries-page").textContent = data.total ? (data.offset + 1) + "–" + end + " of " + data.total : "none";
  $("entries-prev").disabled = data.offset === 0;
  $("entries-next").disabled = end >= data.total;
  document.querySelectorAll("#entries th.sortable").forEach((th) => {
    th.classList.toggle("sorted-asc", th.dataset.sort === state.entries.sort && state.entries.order === "asc");
    th.classList.toggle("sorted-desc", th.dataset.sort === state.entries.sort && state.entries.order === "desc");
  });
  fill($("entries"), data.entries.length ? data.entries.map((e) => el("tr", {
    "data-key": e.key, class: e.key === state.selectedKey ? "selected" : null, onclick: () => explain(e.key) },
  el("td", { class: "key", text: short(e.key), title: e.key }), el("td", { text: e.namespace }),
  el("td", { text: e.tier }), el("td", { text: fmtRate(e.heat_per_s) }), el("td", { text: fmtBytes(e.size) }),
  el("td", { text: fmtSeconds(e.age_s) }), el("td", { text: fmtSeconds(e.last_access_age_s) + " ago" }),
  el("td", { text: String(e.hits) }), el("td", { text: e.codec }), el("td", { text: e.pinned ? "yes" : "" }),
  el("td", { class: "retained", text: fmtRetained(e.retained) }))) :
    [el("tr", {}, el("td", { colspan: 11, class: "muted", text: "no entries match" }))]);
}

async function reloadEntries() {
  try { renderEntries(await api(entriesPath())); } catch (err) { showError("entries", err); }
}

async function explain(key) {
  state.selectedKey = key;
  $("pin-result").textContent = "";
  let info;
  try { info = await api("/admin/explain/" + key); } catch (err) { showError("explain", err); return; }
  if (state.selectedKey !== key) return;  // another row was clicked while this one was asked for
  $("explain").hidden = false;
  $("explain-key").textContent = key;
  const facts = [["tier", info.tier], ["namespace", info.namespace], ["size", fmtBytes(info.size)],
    ["codec", info.codec], ["heat", fmtRate(info.heat_per_s) + " reads/s (" + info.accesses + " accesses)"],
    ["pinned", info.pinned ? "yes" + (info.pinned_for_s ? " for " + fmtSeconds(info.pinned_for_s) : "") : "no"],
    ["retained", info.retained ? "by " + fmtRetained(info.retained) : "no"],
    ["in this tier for", fmtSeconds(info.resident_for_s)], ["chain depth", info.depth], ["hits", info.hits],
    ["spec fingerprint", short(info.spec_fingerprint)],
    ["why here", info.moves && info.moves.length ? info.moves[info.moves.length - 1].reason : "placed here when written"]];
  $("explain-facts").replaceChildren(...facts.flatMap(([k, v]) =>
    [el("dt", { text: k }), el("dd", { text: v === undefined || v === null ? "–" : String(v) })]));
  const moves = (info.moves || []).slice().reverse();
  fill($("explain-moves"), moves.length ? moves.map((m) => el("tr", {}, el("td", { text: fmtAgo(m.age_s) }),
    el("td", { text: m.src }), el("td", { text: m.dst === null ? "(evicted)" : m.dst }),
    el("td", { class: "reason", text: m.reason }))) : [el("tr", {}, el("td", { colspan: 4, class: "muted",
    text: "not moved since it was written" }))]);
  document.querySelectorAll("#entries tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.key === key));
}

async function pin(on) {
  const key = state.selectedKey;
  if (!key) return;
  let r;
  try {
    r = await api("/admin/pin", { method: on ? "POST" : "DELETE", body: { keys: [key] } });
  } catch (err) { $("pin-result").textContent = err.type + ": " + err.message; return; }
  await explain(key);  // shows the pin (and clears the last result), so the result goes in after
  $("pin-result").textContent = on ? "pinned " + r.pinned + " block" : "unpinned " + r.unpinned + " block";
  await refresh();
}

function readFilters(event) {
  if (event) event.preventDefault();
  state.entries.filters = {
    namespace: $("f-namespace").value.trim(), tier: $("f-tier").value,
    min_heat_per_s: $("f-min-heat").value, max_heat_per_s: $("f-max-heat").value,
    min_age_s: $("f-min-age").value, max_age_s: $("f-max-age").value,
  };
  state.entries.offset = 0;
  reloadEntries();
}

// -- eviction ------------------------------------------------------------------------------------------

function evictBody() {
  const by = $("evict-by").value;
  const body = { include_pinned: $("evict-pinned").checked };
  if (by === "namespace") body.namespace = $("evict-namespace").value.trim();
  if (by === "tier") body.tier = $("evict-tier").value;
  if (by === "age") body.older_than_s = Number($("evict-age").value);
  if (by === "prefix") {
    let spec, tokens;
    try { spec = JSON.parse($("evict-spec").value); } catch (err) { throw new Error("spec: not JSON (" + err.message + ")"); }
    try { tokens = JSON.parse($("evict-tokens").value); } catch (err) { throw new Error("tokens: not a JSON list (" + err.message + ")"); }
    body.prefix = { spec, tokens, namespace: $("evict-prefix-namespace").value.trim() || "default" };
  }
  return body;
}

function describeEviction(r) {
  const tiers = Object.entries(r.by_tier).map(([t, v]) => t + ": " + v.blocks + " (" + fmtBytes(v.bytes) + ")").join(", ");
  const pinned = r.skipped_pinned ? "; " + r.skipped_pinned + " pinned left alone" : "";
  return r.blocks + " blocks, " + fmtBytes(r.bytes) + (tiers ? " [" + tiers + "]" : "") + pinned;
}

function resetConfirm() {
  state.evictBody = null;
  $("evict-confirm").disabled = true;
  $("evict-confirm").textContent = "Evict";
}

async function dryRun(event) {
  event.preventDefault();
  resetConfirm();
  const out = $("evict-result");
  let body;
  try { body = evictBody(); } catch (err) { out.className = "error"; out.textContent = err.message; return; }
  try {
    const r = await api("/admin/evict", { method: "POST", body: { ...body, dry_run: true } });
    out.className = "";
    out.textContent = "Dry run (audit #" + r.audit_id + "): would remove " + describeEviction(r) + ".";
    out.dataset.blocks = r.blocks;
    if (r.blocks > 0) {
      state.evictBody = body;
      $("evict-confirm").disabled = false;
      $("evict-confirm").textContent = "Evict " + r.blocks + " blocks";
    }
  } catch (err) {
    out.className = "error";
    out.textContent = err.type + ": " + err.message;
  }
  refresh();
}

async function confirmEvict() {
  const body = state.evictBody;
  if (!body) return;
  resetConfirm();
  const out = $("evict-result");
  try {
    const r = await api("/admin/evict", { method: "POST", body: { ...body, dry_run: false } });
    out.className = "";
    out.textContent = "Evicted (audit #" + r.audit_id + "): removed " + r.removed_blocks + " blocks, " +
      fmtBytes(r.removed_bytes) + ".";
    out.dataset.removed = r.removed_blocks;
  } catch (err) {
    out.className = "error";
    out.textContent = err.type + ": " + err.message;
  }
  await refresh();
}

function showEvictFields() {
  const by = $("evict-by").value;
  document.querySelectorAll("#evict-form [data-by]").forEach((d) => { d.hidden = d.dataset.by !== by; });
  resetConfirm();
}

function showError(where, err) {
  const banner = $("error-banner");
  banner.hidden = false;
  banner.textContent = where + ": " + err.message;
}

// -- charts -----------------------------------------------------------------------------------------------

const PAD = { left: 40, right: 10, top: 10, bottom: 24 };

function frame(svg) {
  const [, , w, h] = svg.getAttribute("viewBox").split(" ").map(Number);
  svg.replaceChildren();
  return { w, h, x0: PAD.left, x1: w - PAD.right, y0: h - PAD.bottom, y1: PAD.top };
}

function empty(svg, f, text) {
  svg.append(el("svg:text", { x: (f.x0 + f.x1) / 2, y: (f.y0 + f.y1) / 2, "text-anchor": "middle", text }));
}

function lineChart(svg, xs, series, { yMax, yLabel }) {
  const f = frame(svg);
  if (xs.length < 1) return empty(svg, f, "collecting samples…");
  const xMin = xs[0] - (xs.length === 1 ? 1 : 0);
  const xMax = xs[xs.length - 1];
  const sx = (x) => f.x0 + (f.x1 - f.x0) * (x - xMin) / Math.max(xMax - xMin, 1e-9);
  const sy = (y) => f.y0 - (f.y0 - f.y1) * y / yMax;
  for (const frac of [0, 0.25, 0.5, 0.75, 1]) {
    svg.append(el("svg:line", { class: "grid", x1: f.x0, x2: f.x1, y1: sy(frac * yMax), y2: sy(frac * yMax) }),
      el("svg:text", { x: f.x0 - 4, y: sy(frac * yMax) + 3, "text-anchor": "end", text: yLabel(frac * yMax) }));
  }
  svg.append(el("svg:text", { x: f.x0, y: f.h - 6, text: fmtTime(xMin) }),
    el("svg:text", { x: f.x1, y: f.h - 6, "text-anchor": "end", text: fmtTime(xMax) }));
  for (const s of series) {
    let d = "";
    let pen = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      d += (pen ? "L" : "M") + sx(xs[i]).toFixed(1) + " " + sy(Math.min(v, yMax)).toFixed(1);
      pen = true;
    });
    if (d) svg.append(el("svg:path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-dasharray": s.dash,
      "data-series": s.name }));
    s.values.forEach((v, i) => {  // a dot per interval: one busy interval among idle ones draws no line
      if (v === null || v === undefined) return;
      svg.append(el("svg:circle", { cx: sx(xs[i]), cy: sy(Math.min(v, yMax)), r: 2.5, fill: s.color },
        el("svg:title", { text: s.name + " " + fmtTime(xs[i]) + ": " + yLabel(v) })));
    });
  }
  if (series.every((s) => s.values.every((v) => v === null || v === undefined))) {
    empty(svg, f, "no gets in this window");
  }
}

function barChart(svg, labels, stacks, colors) {
  const f = frame(svg);
  if (!labels.length) return empty(svg, f, "no entries");
  const top = Math.max(1, ...stacks.map((s) => s.reduce((a, b) => a + b, 0)));
  const bw = (f.x1 - f.x0) / labels.length;
  const sy = (y) => (f.y0 - f.y1) * y / top;
  svg.append(el("svg:text", { x: f.x0 - 4, y: f.y1 + 3, "text-anchor": "end", text: String(top) }),
    el("svg:text", { x: f.x0 - 4, y: f.y0, "text-anchor": "end", text: "0" }),
    el("svg:line", { class: "axis", x1: f.x0, x2: f.x1, y1: f.y0, y2: f.y0 }));
  labels.forEach((label, i) => {
    let y = f.y0;
    stacks[i].forEach((n, t) => {
      if (!n) return;
      const h = sy(n);
      y -= h;
      svg.append(el("svg:rect", { x: f.x0 + i * bw + 1, y, width: Math.max(bw - 2, 1), height: h, fill: colors[t] },
        el("svg:title", { text: n + " entries from " + label + " reads/s" })));
    });
    if (i % 2 === 0 || labels.length <= 8) {
      svg.append(el("svg:text", { x: f.x0 + (i + 0.5) * bw, y: f.h - 8, "text-anchor": "middle", text: label }));
    }
  });
}

function scatterChart(svg, points) {
  const f = frame(svg);
  if (!points.length) return empty(svg, f, "no decisions reported yet");
  const vals = points.flatMap((p) => [p.x, p.y]);
  const lo = Math.log10(Math.min(...vals)) - 0.1;
  const hi = Math.log10(Math.max(...vals)) + 0.1;
  const sx = (v) => f.x0 + (f.x1 - f.x0) * (Math.log10(v) - lo) / (hi - lo);
  const sy = (v) => f.y0 - (f.y0 - f.y1) * (Math.log10(v) - lo) / (hi - lo);
  svg.append(el("svg:line", { class: "axis", x1: sx(10 ** lo), y1: sy(10 ** lo), x2: sx(10 ** hi), y2: sy(10 ** hi),
    stroke: "#a0a8b5", "stroke-dasharray": "4 3" }),
  el("svg:text", { x: f.x1, y: f.h - 6, "text-anchor": "end", text: "predicted → " + fmtSeconds(10 ** hi) }),
  el("svg:text", { x: f.x0, y: f.h - 6, text: fmtSeconds(10 ** lo) }),
  el("svg:text", { x: f.x0 - 4, y: f.y1 + 8, "text-anchor": "end", text: "actual" }));
  for (const p of points) {
    svg.append(el("svg:circle", { cx: sx(p.x), cy: sy(p.y), r: 3, fill: p.color, "fill-opacity": 0.7 },
      el("svg:title", { text: p.title + ": predicted " + fmtSeconds(p.x) + ", actual " + fmtSeconds(p.y) })));
  }
}

// -- wiring ------------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (e) => { e.preventDefault(); login($("token").value.trim()); });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showLogin(""); });
  $("entries-filter").addEventListener("submit", readFilters);
  $("f-clear").addEventListener("click", () => {
    for (const id of ["f-namespace", "f-min-heat", "f-max-heat", "f-min-age", "f-max-age"]) $(id).value = "";
    $("f-tier").value = "";
    readFilters();
  });
  document.querySelectorAll("#entries th.sortable").forEach((th) => th.addEventListener("click", () => {
    const e = state.entries;
    e.order = e.sort === th.dataset.sort && e.order === "desc" ? "asc" : "desc";
    e.sort = th.dataset.sort;
    e.offset = 0;
    reloadEntries();
  }));
  $("entries-prev").addEventListener("click", () => {
    state.entries.offset = Math.max(0, state.entries.offset - state.entries.limit);
    reloadEntries();
  });
  $("entries-next").addEventListener("click", () => { state.entries.offset += state.entries.limit; reloadEntries(); });
  $("explain-close").addEventListener("click", () => { $("explain").hidden = true; state.selectedKey = null; });
  $("pin-button").addEventListener("click", () => pin(true));
  $("unpin-button").addEventListener("click", () => pin(false));
  $("evict-form").addEventListener("submit", dryRun);
  $("evict-form").addEventListener("input", resetConfirm);
  $("evict-by").addEventListener("change", showEvictFields);
  $("evict-confirm").addEventListener("click", confirmEvict);
  // A stored token is tried again; with none, a server that has no tokens (loopback only) opens as is,
  // and one that has them asks for the admin token without calling the first 401 an error.
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token !== null) login(token);
  else api("/admin/stats").then(() => login(""), () => showLogin(""));
});
