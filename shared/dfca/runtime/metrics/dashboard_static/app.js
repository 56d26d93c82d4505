// The dfca dashboard: plain JS, no build step; curves and the communication graph are drawn with Apache ECharts,
// vendored beside this file (echarts.min.js, see VENDORED.md). Two pages behind the URL hash: "#/" (experiments,
// create) and "#/e/<id>" (round, summary, downloads, curves, graph with its legend, workers, messages, config,
// start/stop). The page follows the metrics service's server-sent events; the API token is kept in sessionStorage
// and sent on every call (reads need it under DFCA_READ_TOKEN; links carry it as ?access_token=).
"use strict";

// one colour per true cluster; an assigned cluster is drawn in the colour of the true cluster it is matched to
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#475569", "#ea580c"];
const UNKNOWN = "#e5e7eb", UNKNOWN_RING = "#9ca3af";
const TOPOLOGY = "/ui/api/topology";
const TERMINAL = ["completed", "failed", "stopped"];
let teardown = () => {};

const $ = (root, selector) => root.querySelector(selector);
const byTestId = (root, id) => root.querySelector(`[data-testid="${id}"]`);
const color = (j) => COLORS[((j % COLORS.length) + COLORS.length) % COLORS.length];
const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(digits);

function token() { return sessionStorage.getItem("dfca-token") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers.Authorization = `Bearer ${token()}`;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  const text = await response.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (_) { body = text; }
  if (!response.ok) {
    let detail = body && body.detail !== undefined ? body.detail : body;
    if (Array.isArray(detail)) detail = detail.map((e) => `${(e.loc || []).slice(1).join(".")}: ${e.msg}`).join("; ");
    const error = new Error(`${response.status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
    error.status = response.status;
    throw error;
  }
  return body;
}

function show(message, node, isError) {
  node.textContent = message;
  node.classList.toggle("error", Boolean(isError));
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- the experiments page ------------------------------------------------------------------------------------
async function listPage(main) {
  main.replaceChildren(document.getElementById("list-page").content.cloneNode(true));
  const body = $(byTestId(main, "experiments"), "tbody");
  const yaml = byTestId(main, "yaml");
  yaml.value = yaml.value || EXAMPLE;
  const result = byTestId(main, "create-result");
  const create = async (start) => {
    show("creating…", result);
    try {
      const created = await api(`${TOPOLOGY}/experiments`, { method: "POST", body: yaml.value,
        headers: { "Content-Type": "application/yaml" } });
      if (start) await api(`${TOPOLOGY}/experiments/${created.id}:start`, { method: "POST" });
      show(`${start ? "started" : "created"} ${created.id}`, result);
      await refresh();
      if (start) location.hash = `#/e/${created.id}`;
    } catch (error) { show(error.message, result, true); }
  };
  byTestId(main, "create").onclick = () => create(false);
  byTestId(main, "create-start").onclick = () => create(true);

  let closed = false;
  async function refresh() {
    if (closed) return;
    const [records, scores] = await Promise.all([api(`${TOPOLOGY}/experiments`), api("/ui/api/scores")]);
    const rows = records.slice().reverse().map((r) => {
      const summary = scores[r.id] || {};
      const tr = el("tr", { "data-testid": `row-${r.id}` });
      const link = el("a", { href: `#/e/${r.id}` }, r.id);
      const cells = [link, r.name, r.algorithm, r.status, `${r.round}/${r.rounds}`, fmt(summary.test_accuracy),
        fmt(summary.cluster_ari, 2)];
      for (const c of cells) { const td = el("td"); td.append(c); tr.append(td); }
      return tr;
    });
    if (!closed) body.replaceChildren(...rows);
  }
  await refresh();
  const timer = setInterval(() => refresh().catch(() => {}), 3000);
  teardown = () => { closed = true; clearInterval(timer); };
}

const EXAMPLE = `name: dashboard-demo
clusters: 2
rounds: 10
data: {dataset: mnist-bundled, rotations: [0, 180], clients: 24, train_per_client: 80, test_per_client: 25}
model: {kind: mlp, hidden: 64}
train: {lr: 0.25, local_epochs: 3, batch_size: 20}
topology: {kind: erdos_renyi, p: 0.5}
runtime: {round_timeout: 10}
`;

// -- one experiment -------------------------------------------------------------------------------------------
async function experimentPage(main, id) {
  main.replaceChildren(document.getElementById("experiment-page").content.cloneNode(true));
  byTestId(main, "experiment-id").textContent = id;
  const status = byTestId(main, "status");
  const action = byTestId(main, "action-result");
  const charts = [];
  const chart = (testid) => {
    const c = echarts.init(byTestId(main, testid), null, { renderer: "canvas" });
    charts.push(c);
    return c;
  };
  const curves = { accuracy: chart("curve-accuracy"), ari: chart("curve-ari"), loss: chart("curve-loss"),
    clusters: chart("curve-clusters") };
  const graphChart = chart("graph");
  let drawn = null;  // the graph's last arguments: a resize redraws it in a square box of the new size
  const resize = () => { charts.forEach((c) => c.resize()); if (drawn) drawGraph(...drawn); };
  window.addEventListener("resize", resize);
  let graph = null;
  let downloads = null;
  let closed = false;

  const act = (verb) => async () => {
    try { await api(`${TOPOLOGY}/experiments/${id}:${verb}`, { method: "POST" }); show(`${verb} sent`, action); }
    catch (error) { show(error.message, action, true); }
    refresh();
  };
  byTestId(main, "start").onclick = act("start");
  byTestId(main, "stop").onclick = act("stop");

  async function refresh() {  // every await may outlive the page (the user went back to the list): check `closed`
    if (closed) return null;
    const record = await api(`${TOPOLOGY}/experiments/${id}`);
    if (closed) return null;
    status.textContent = record.status;
    status.className = `badge ${record.status}`;
    byTestId(main, "start").disabled = record.status !== "created";
    byTestId(main, "stop").disabled = !["running", "created"].includes(record.status);
    workersTable(byTestId(main, "workers"), record.worker_states || {}, record.seeding_rounds === undefined ? null
      : { seeding_rounds: record.seeding_rounds, rounds: record.rounds - record.seeding_rounds });
    const view = await api(`/ui/api/overview/${id}`);
    if (closed) return null;
    byTestId(main, "round").textContent = progressLabel(record, view.schedule);
    byTestId(main, "run-size").textContent = `· ${record.clients} clients on ${record.workers} workers`;
    const history = view.history;
    for (const h of history) h.displayLabel = roundLabel(h, view.schedule);
    const seeding = view.schedule ? view.schedule.seeding_rounds : 0;
    const k = view.config ? view.config.clusters : (record.config ? record.config.clusters : 2);
    drawCurve(curves.accuracy, byTestId(main, "curve-accuracy"), history, seeding,
      [{ key: "test_accuracy", name: "test accuracy" }], { min: 0, max: 1 });
    drawCurve(curves.ari, byTestId(main, "curve-ari"), history, seeding,
      [{ key: "ari", name: "ARI" }, { key: "cluster_acc", name: "matched cluster accuracy" }],
      { min: Math.min(0, ...history.map((h) => h.ari ?? 0)), max: 1 });
    drawCurve(curves.loss, byTestId(main, "curve-loss"), history, seeding,
      [{ key: "train_loss", name: "train loss" }], { min: 0 });
    drawCurve(curves.clusters, byTestId(main, "curve-clusters"), history, seeding,
      [{ key: "populated_clusters", name: "populated clusters" }],
      { min: 0, max: Math.max(k, ...history.map((h) => h.populated_clusters ?? 0)), minInterval: 1 }, 0);
    summaryCards(byTestId(main, "summary"), view, record);
    messagesTable(byTestId(main, "messages"), view.summary ? view.summary.messages || {} : {});
    if (view.config) byTestId(main, "config").textContent = toYaml(view.config);
    if (!graph) graph = await api(`${TOPOLOGY}/experiments/${id}/topology`);
    if (closed) return null;
    drawn = [graphChart, byTestId(main, "graph"), byTestId(main, "graph-legend"), graph, view.clients];
    drawGraph(...drawn);
    if (TERMINAL.includes(record.status) && view.status && TERMINAL.includes(view.status) && !downloads) {
      downloads = downloadLinks(byTestId(main, "downloads"), id, () => closed,
        { models: record.status === "completed", plots: history.length > 0 });
    }
    return record;
  }

  await refresh();
  // EventSource cannot send headers: under DFCA_READ_TOKEN the stream takes the token as a query parameter
  const events = new EventSource(`/experiments/${id}/events` + tokenQuery());
  let pending = false;
  const onEvent = () => {
    if (pending || closed) return;
    pending = true;
    setTimeout(() => { pending = false; refresh().catch(() => {}); }, 300);
  };
  events.addEventListener("progress", onEvent);
  events.addEventListener("status", onEvent);
  events.addEventListener("summary", () => { onEvent(); events.close(); });
  events.onerror = () => {};  // the browser reconnects by itself; the timer below covers the gaps
  const timer = setInterval(() => refresh().catch(() => {}), 5000);
  teardown = () => {
    closed = true; events.close(); clearInterval(timer); window.removeEventListener("resize", resize);
    charts.forEach((c) => c.dispose());
  };
}

function tokenQuery() { return token() ? `?access_token=${encodeURIComponent(token())}` : ""; }

// "seeding 3 of 8" / "round 4 of 10": the API's phase fields when it has them, else from the schedule
function phaseLabel(phase, number, total) { return `${phase === "seeding" ? "seeding" : "round"} ${number} of ${total}`; }

function roundLabel(row, schedule) {
  if (row.phase && row.phase_round !== undefined && row.phase_rounds !== undefined) {
    return phaseLabel(row.phase, row.phase_round, row.phase_rounds);
  }
  if (!schedule) return `round ${row.round}`;
  const s = schedule.seeding_rounds;
  return row.round <= s ? phaseLabel("seeding", row.round, s) : phaseLabel("training", row.round - s, schedule.rounds);
}

function progressLabel(record, schedule) {
  if (record.phase && record.phase_round !== undefined && record.phase_rounds !== undefined) {
    return phaseLabel(record.phase, record.phase_round, record.phase_rounds);
  }
  if (!record.round) return `round 0 of ${schedule ? schedule.rounds : record.rounds}`;
  if (!schedule) return `round ${record.round} of ${record.rounds}`;
  return roundLabel({ round: record.round }, schedule);
}

// x of a round, as the plots draw it: training round r at r; the S seeding rounds evenly inside (0, 1), before round 1
function roundX(round, seeding) { return round <= seeding ? round / (seeding + 1) : round - seeding; }

function drawCurve(chart, node, history, seeding, series, yAxis, digits = 3) {
  const rows = history.filter((h) => series.some((s) => h[s.key] !== undefined && h[s.key] !== null));
  const rounds = rows.map((h) => roundX(h.round, seeding));
  node.setAttribute("data-points", String(rows.length));
  const option = {
    animationDuration: 300,
    color: ["#2563eb", "#d97706"],
    grid: { left: 46, right: 14, top: series.length > 1 ? 30 : 14, bottom: 38 },
    legend: series.length > 1 ? { top: 2, itemHeight: 8, textStyle: { fontSize: 11 } } : { show: false },
    tooltip: { trigger: "axis", confine: true,
      formatter: (ps) => [ps[0].data[2], ...ps.map((p) => `${p.marker}${p.seriesName}: ${fmt(p.data[1], digits)}`)].join("<br>") },
    xAxis: { type: "value", name: "training round", nameLocation: "middle", nameGap: 24, minInterval: 1,
      min: seeding > 0 ? 0 : Math.min(1, ...rounds), max: Math.max(2, ...rounds),
      axisLabel: { fontSize: 10, formatter: (v) => (v >= 1 && Number.isInteger(v) ? String(v) : "") } },
    yAxis: Object.assign({ type: "value", axisLabel: { fontSize: 10 }, splitLine: { lineStyle: { color: "#eef0f4" } },
      scale: yAxis.max === undefined }, yAxis),
    series: series.map((s, i) => ({
      name: s.name, type: "line", showSymbol: true, symbolSize: 5,
      data: rows.filter((h) => h[s.key] !== undefined && h[s.key] !== null)
        .map((h) => [roundX(h.round, seeding), h[s.key], h.displayLabel]),
      markArea: i === 0 && seeding > 0 ? { silent: true, itemStyle: { color: "rgba(148,163,184,0.15)" },
        label: { show: true, position: "insideTop", fontSize: 10, color: "#6b7280" },
        data: [[{ name: "seeding", xAxis: 0 }, { xAxis: (seeding + 0.5) / (seeding + 1) }]] } : undefined,
    })),
  };
  chart.setOption(option, { notMerge: true });
}

function summaryCards(node, view, record) {
  const s = view.summary || {};
  const c = view.clients || {};
  if (s.test_accuracy === undefined && !(view.history || []).length) return;
  const last = (view.history || []).slice(-1)[0] || {};
  const cards = [];
  const add = (key, label, value, title) => cards.push([key, label, value, title]);
  add("accuracy", "test accuracy", s.test_accuracy !== undefined ? `${fmt(s.test_accuracy)} ± ${fmt(s.test_accuracy_std, 3)}` : fmt(last.test_accuracy),
    "mean (± std) over the clients of their latest evaluation");
  add("ari", "cluster ARI", fmt(s.cluster_ari ?? last.ari, 2), "adjusted Rand index of assigned against true clusters");
  add("cluster-acc", "matched cluster accuracy", fmt(s.cluster_acc ?? last.cluster_acc, 3),
    "share of clients in their true cluster under the best matching of assigned to true clusters");
  if (c.has_truth && c.clients.length) {
    const right = c.matched_assigned.filter((m, i) => m === c.true_cluster[i]).length;
    add("clustered-right", "clients in their true cluster", `${right} of ${c.clients.length}`);
  }
  const k = view.config ? view.config.clusters : undefined;
  add("clusters", "populated clusters", `${s.populated_clusters ?? last.populated_clusters ?? "–"}${k ? ` of ${k}` : ""}`);
  if (s.assignment_counts) add("counts", "clients per cluster", s.assignment_counts.join(" · "));
  const seeding = view.schedule ? view.schedule.seeding_rounds : 0;
  const training = view.schedule ? view.schedule.rounds : record.rounds;
  const done = record.round || 0;
  add("rounds", "rounds", seeding && done <= seeding ? `seeding ${done} of ${seeding}`
    : `${done - seeding} of ${training}` + (seeding ? ` (after ${seeding} seeding)` : ""));
  if (s.wall_seconds !== undefined) add("seconds", "wall time", `${fmt(s.wall_seconds, 1)} s`);
  if (s.seconds_per_round !== undefined) add("seconds-per-round", "seconds per round", fmt(s.seconds_per_round, 2));
  if (s.bytes_sent_per_client_per_round !== undefined) {
    add("bytes", "sent per client per round", `${fmt(s.bytes_sent_per_client_per_round / 1024, 1)} KiB`);
  }
  if ((s.failed_clients || []).length) add("failed", "failed clients", String(s.failed_clients.length));
  node.replaceChildren(...cards.map(([key, label, value, title]) => {
    const card = el("div", { class: "card", "data-testid": `summary-${key}` });
    if (title) card.title = title;
    card.append(el("div", { class: "value" }, value), el("div", { class: "label" }, label));
    return card;
  }));
}

// the results' links; `has`: which listings to ask for (asking for what is not there logs a 404 in the console)
async function downloadLinks(node, id, isClosed, has) {
  const href = (path) => `${path}${tokenQuery()}`;
  const link = (testid, path, text) => el("a", { href: href(path), "data-testid": testid, download: "" }, text);
  const group = (title, items) => {
    const div = el("div", { class: "download-group" });
    div.append(el("span", { class: "muted" }, `${title}: `), ...items);
    return div;
  };
  const groups = [group("results", [link("download-summary", `/experiments/${id}/summary`, "summary.json"),
    link("download-metrics", `/experiments/${id}/metrics`, "metrics.json")])];
  node.replaceChildren(...groups);
  for (const [kind, title] of [["models", "final models"], ["plots", "plots"]]) {
    const none = (why) => [el("span", { class: "muted", "data-testid": `download-${kind}-none` }, `none (${why})`)];
    const why = kind === "models" ? "only a completed run has final models" : "no evaluated round";
    let items = none(why);
    if (has[kind]) {
      try {
        const listing = await api(`/experiments/${id}/${kind}`);
        items = listing.files.map((f) => link(`download-${kind}-${f}`, `/experiments/${id}/${kind}/${encodeURIComponent(f)}`, f));
      } catch (error) { items = error.status === 404 ? none(why) : none(error.message); }
    }
    if (isClosed()) return;
    groups.push(group(title, items));
    node.replaceChildren(...groups);
  }
}

// The graph: one node per client, its fill the colour of the true cluster its assigned cluster is matched to (the
// server's Hungarian matching), its ring the colour of its true cluster; nodes placed by (matched) assigned
// cluster, each cluster a disc of its own. The option is kept on window.dfcaGraphOption for tests and tools.
function drawGraph(chart, node, legend, topology, clients) {
  const n = topology.clients;
  const c = clients || {};
  const byClient = {};
  (c.clients || []).forEach((client, i) => {
    byClient[client] = { assigned: c.assigned[i], matched: c.matched_assigned[i],
      truth: c.has_truth ? c.true_cluster[i] : undefined };
  });
  const groupOf = (client) => (byClient[client] ? byClient[client].matched : -1);
  const groups = [...new Set(Array.from({ length: n }, (_, i) => groupOf(i)))].sort((a, b) => a - b);
  const members = Object.fromEntries(groups.map((g) => [g, []]));
  for (let i = 0; i < n; i++) members[groupOf(i)].push(i);
  const G = groups.length;
  const position = {};
  groups.forEach((g, gi) => {
    const angle = 2 * Math.PI * gi / G + (G === 2 ? Math.PI : -Math.PI / 2);  // two clusters side by side
    const [cx, cy] = G > 1 ? [Math.cos(angle), Math.sin(angle)] : [0, 0];
    const discRadius = G > 1 ? Math.min(0.85, 0.95 * Math.sin(Math.PI / G)) : 1;
    const m = members[g].length;
    members[g].forEach((client, j) => {  // a sunflower: evenly spread over the disc
      const r = discRadius * Math.sqrt((j + 0.5) / m), a = j * 2.399963;
      position[client] = [cx + r * Math.cos(a), cy + r * Math.sin(a)];
    });
  });
  const size = n > 200 ? 6 : n > 60 ? 9 : 15;
  const data = Array.from({ length: n }, (_, i) => {
    const b = byClient[i];
    const fill = b ? color(b.matched) : UNKNOWN;
    const ring = b && b.truth !== undefined ? color(b.truth) : (b ? fill : UNKNOWN_RING);
    const text = !b ? `client ${i}: not evaluated yet`
      : `client ${i}<br>assigned cluster ${b.assigned}` + (b.truth !== undefined
        ? ` (matched to true cluster ${b.matched})<br>true cluster ${b.truth}${b.matched === b.truth ? "" : " <b>(misclustered)</b>"}` : "");
    return { id: String(i), name: `client ${i}`, x: position[i][0] * 100, y: position[i][1] * 100, symbolSize: size,
      itemStyle: { color: fill, borderColor: ring, borderWidth: n > 60 ? 2 : 3 }, tooltipText: text,
      dfca: b ? { assigned: b.assigned, matched: b.matched, truth: b.truth ?? null } : null };
  });
  const option = {
    animation: false,
    tooltip: { confine: true, formatter: (p) => (p.dataType === "node" ? p.data.tooltipText : `${p.data.source} – ${p.data.target}`) },
    series: [{
      type: "graph", layout: "none", roam: true, data, ...fittedView(node, data),
      links: topology.edges.map(([u, v]) => ({ source: String(u), target: String(v) })),
      lineStyle: { color: "#94a3b8", opacity: n > 60 ? 0.12 : 0.3, width: 0.7 },
      emphasis: { focus: "adjacency", lineStyle: { width: 1.5, opacity: 0.8 } },
    }],
  };
  chart.setOption(option, { notMerge: true });
  window.dfcaGraphOption = option;
  node.setAttribute("data-nodes", String(n));
  drawLegend(legend, c, groups);
}

// ECharts stretches a `layout: "none"` graph's bounding box to fill the view: a view of the box's own aspect keeps
// the clusters' discs (and the nodes) round
function fittedView(node, data) {
  const xs = data.map((d) => d.x), ys = data.map((d) => d.y);
  const bw = Math.max(Math.max(...xs) - Math.min(...xs), 1), bh = Math.max(Math.max(...ys) - Math.min(...ys), 1);
  const w = (node.clientWidth || 400) - 40, h = (node.clientHeight || 400) - 40;
  const scale = Math.min(w / bw, h / bh), width = Math.max(bw * scale, 20), height = Math.max(bh * scale, 20);
  return { left: 20 + (w - width) / 2, top: 20 + (h - height) / 2, width, height };
}

function drawLegend(legend, c, groups) {
  const swatch = (fill, ring) => el("span", { class: "swatch", style: `background:${fill};border-color:${ring}` });
  const items = [];
  const truths = c.has_truth ? [...new Set(c.true_cluster)].sort((a, b) => a - b) : [];
  const shown = [...new Set([...truths, ...groups.filter((g) => g >= 0)])].sort((a, b) => a - b);
  for (const j of shown) {
    const item = el("span", { class: "legend-item", "data-testid": `legend-cluster-${j}` });
    const leftover = c.has_truth && !truths.includes(j);
    item.append(swatch(color(j), color(j)), leftover ? `extra assigned cluster (no true cluster left to match)` : `cluster ${j}`);
    items.push(item);
  }
  if (groups.includes(-1)) {
    const item = el("span", { class: "legend-item" });
    item.append(swatch(UNKNOWN, UNKNOWN_RING), "not evaluated yet");
    items.push(item);
  }
  const key = el("div", { class: "legend-key", "data-testid": "legend-key" });
  if (c.has_truth) {
    const mis = c.matched_assigned.filter((m, i) => m !== c.true_cluster[i]).length;
    key.append(el("div", {}, "fill = assigned cluster, in the colour of the true cluster it is matched to (the matching that scores matched cluster accuracy)"),
      el("div", {}, "ring = true cluster; fill ≠ ring: a client in the wrong cluster"),
      el("div", { "data-testid": "legend-misclustered" }, mis ? `${mis} client${mis > 1 ? "s" : ""} in the wrong cluster` : "every client in its true cluster"));
  } else {
    key.append(el("div", {}, "no true clusters known: fill = assigned cluster (its own number's colour), ring the same"));
  }
  const row = el("div", { class: "legend-items" });
  row.append(...items);
  legend.replaceChildren(row, key);
}

function toYaml(value, indent = "") {
  const scalar = (v) => (v === null ? "null" : typeof v === "string" ? (/^[\w./@+-]*$/.test(v) && v !== "" ? v : JSON.stringify(v)) : String(v));
  const isScalar = (v) => v === null || typeof v !== "object";
  if (Array.isArray(value)) {
    if (value.every(isScalar)) return `[${value.map(scalar).join(", ")}]`;
    return value.map((v) => `\n${indent}- ${toYaml(v, indent + "  ").trimStart()}`).join("");
  }
  if (value !== null && typeof value === "object") {
    return Object.entries(value).map(([k, v]) => {
      if (isScalar(v) || (Array.isArray(v) && v.every(isScalar))) return `${indent}${k}: ${toYaml(v, indent + "  ")}`;
      if (Array.isArray(v) ? !v.length : !Object.keys(v).length) return `${indent}${k}: ${Array.isArray(v) ? "[]" : "{}"}`;
      return `${indent}${k}:${Array.isArray(v) ? "" : "\n"}${toYaml(v, indent + "  ")}`;
    }).join("\n");
  }
  return scalar(value);
}

// a round as the workers table shows it: `seeding 3/8`, then `4/10` (absolute rounds without a schedule)
function shortRound(round, schedule) {
  if (!schedule || !round) return String(round ?? 0);
  const s = schedule.seeding_rounds;
  return s && round <= s ? `seeding ${round}/${s}` : `${round - s}/${schedule.rounds}`;
}

function workersTable(table, states, schedule) {
  const rows = Object.entries(states).map(([w, s]) => {
    const tr = el("tr", { "data-testid": `worker-${w}` });
    const state = s.state === "dead" ? "presumed dead" : s.incarnations > 1 ? `${s.state} (restarted)` : s.state;
    for (const c of [w, state, s.device || "–", shortRound(s.round, schedule), s.incarnations, s.seconds_since_seen === null ? "–" : `${fmt(s.seconds_since_seen, 1)} s ago`]) {
      tr.append(el("td", {}, String(c)));
    }
    return tr;
  });
  $(table, "tbody").replaceChildren(...rows);
}

function messagesTable(table, messages) {
  const rows = [];
  for (const key of ["published", "applied", "ignored", "duplicates", "stale_dropped", "stale_merged", "timeouts", "dead_lettered", "screened", "republished"]) {
    if (messages[key] !== undefined) rows.push([key.replace("_", " "), messages[key]]);
  }
  for (const [reason, count] of Object.entries(messages.rejected || {})) rows.push([`rejected: ${reason}`, count]);
  $(table, "tbody").replaceChildren(...rows.map(([k, v]) => {
    const tr = el("tr", { "data-testid": `messages-${k.replace(/[^a-z]+/g, "-")}` });
    tr.append(el("th", {}, k), el("td", {}, String(v)));
    return tr;
  }));
}

// -- routing --------------------------------------------------------------------------------------------------
async function route() {
  teardown();
  teardown = () => {};
  const main = document.getElementById("main");
  const match = location.hash.match(/^#\/e\/([^/]+)$/);
  try {
    if (match) await experimentPage(main, decodeURIComponent(match[1]));
    else await listPage(main);
  } catch (error) {
    main.replaceChildren(el("section", { class: "message error", "data-testid": "page-error" }, error.message));
  }
}

// `dfca up` prints the dashboard's address as /ui#token=<API token>: the fragment never reaches a server; it is kept
// for this tab and taken out of the address bar.
const given = location.hash.match(/^#token=([^&]+)$/);
if (given) {
  sessionStorage.setItem("dfca-token", decodeURIComponent(given[1]));
  history.replaceState(null, "", location.pathname + location.search);
}
const tokenInput = document.getElementById("token");
tokenInput.value = token();
tokenInput.addEventListener("change", () => {  // reads need the token too: show the page again with it
  sessionStorage.setItem("dfca-token", tokenInput.value.trim());
  route();
});
window.addEventListener("hashchange", route);
route();
