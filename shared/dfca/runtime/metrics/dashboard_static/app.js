// The dfca dashboard: plain JS and SVG, no dependencies. Two pages behind the URL hash: "#/" (experiments,
// create) and "#/e/<id>" (curves, graph, workers, messages, start/stop). Curves follow the metrics service's
// server-sent events; the API token is kept in sessionStorage and sent on every call (reads need it under
// DFCA_READ_TOKEN).
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#475569", "#ea580c"];
const TOPOLOGY = "/ui/api/topology";
let teardown = () => {};

const $ = (root, selector) => root.querySelector(selector);
const byTestId = (root, id) => root.querySelector(`[data-testid="${id}"]`);
const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(digits);
const svgNS = "http://www.w3.org/2000/svg";

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
  const node = tag === "svg" || ["line", "polyline", "circle", "text", "path", "g", "title"].includes(tag)
    ? document.createElementNS(svgNS, tag) : document.createElement(tag);
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
  let graph = null;
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
    byTestId(main, "round").textContent = `round ${record.round} of ${record.rounds} · ${record.clients} clients on ${record.workers} workers`;
    byTestId(main, "start").disabled = record.status !== "created";
    byTestId(main, "stop").disabled = !["running", "created"].includes(record.status);
    workersTable(byTestId(main, "workers"), record.worker_states || {});
    const view = await api(`/ui/api/overview/${id}`);
    if (closed) return null;
    const history = view.history;
    curve(byTestId(main, "curve-accuracy"), history, "test_accuracy", 0, 1);
    curve(byTestId(main, "curve-ari"), history, "ari", Math.min(0, ...history.map((h) => h.ari)), 1);
    const k = record.config ? record.config.clusters : 2;
    curve(byTestId(main, "curve-clusters"), history, "populated_clusters", 0, Math.max(k, ...history.map((h) => h.populated_clusters)));
    messagesTable(byTestId(main, "messages"), view.summary ? view.summary.messages || {} : {});
    if (!graph) graph = await api(`${TOPOLOGY}/experiments/${id}/topology`);
    if (closed) return null;
    drawGraph(byTestId(main, "graph"), graph, view.clients);
    return record;
  }

  await refresh();
  // EventSource cannot send headers: under DFCA_READ_TOKEN the stream takes the token as a query parameter
  const events = new EventSource(`/experiments/${id}/events` + (token() ? `?access_token=${encodeURIComponent(token())}` : ""));
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
  teardown = () => { closed = true; events.close(); clearInterval(timer); };
}

function curve(svg, history, key, lo, hi) {
  const W = 360, H = 200, L = 34, R = 8, T = 10, B = 24;
  const points = history.filter((h) => h[key] !== undefined && h[key] !== null);
  const rounds = points.map((h) => h.round);
  const x0 = Math.min(...rounds, 1), x1 = Math.max(...rounds, x0 + 1);
  const span = hi - lo || 1;
  const x = (r) => L + (W - L - R) * (r - x0) / (x1 - x0);
  const y = (v) => H - B - (H - T - B) * (v - lo) / span;
  const nodes = [el("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    el("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    el("text", { x: 2, y: y(hi) + 4 }, fmt(hi, key === "populated_clusters" ? 0 : 1)),
    el("text", { x: 2, y: y(lo) + 4 }, fmt(lo, key === "populated_clusters" ? 0 : 1)),
    el("text", { x: W - R - 40, y: H - 6 }, `round ${x1}`)];
  if (points.length) {
    nodes.push(el("polyline", { class: "curve", points: points.map((h) => `${x(h.round)},${y(h[key])}`).join(" ") }));
    for (const h of points) nodes.push(el("circle", { class: "dot", "data-round": h.round, cx: x(h.round), cy: y(h[key]), r: 2.2 }));
  }
  svg.replaceChildren(...nodes);
  svg.setAttribute("data-points", String(points.length));
}

function drawGraph(svg, topology, clients) {
  const n = topology.clients, cx = 210, cy = 210, radius = 180;
  const pos = (c) => [cx + radius * Math.cos(2 * Math.PI * c / n - Math.PI / 2), cy + radius * Math.sin(2 * Math.PI * c / n - Math.PI / 2)];
  const assigned = {}, truth = {};
  if (clients && clients.clients) clients.clients.forEach((c, i) => { assigned[c] = clients.assigned[i]; truth[c] = clients.true_cluster[i]; });
  const nodes = topology.edges.map(([u, v]) => {
    const [x1, y1] = pos(u), [x2, y2] = pos(v);
    return el("line", { class: "edge", x1, y1, x2, y2 });
  });
  for (let c = 0; c < n; c++) {
    const [x, y] = pos(c);
    const node = el("circle", { "data-testid": "graph-node", "data-client": c, cx: x, cy: y, r: n > 60 ? 4 : 7,
      fill: assigned[c] === undefined ? "#e5e7eb" : COLORS[assigned[c] % COLORS.length],
      stroke: truth[c] === undefined ? "#9ca3af" : COLORS[truth[c] % COLORS.length], "stroke-width": 3 });
    node.append(el("title", {}, `client ${c}: cluster ${assigned[c] ?? "?"}, true cluster ${truth[c] ?? "?"}`));
    nodes.push(node);
  }
  svg.replaceChildren(...nodes);
}

function workersTable(table, states) {
  const rows = Object.entries(states).map(([w, s]) => {
    const tr = el("tr", { "data-testid": `worker-${w}` });
    const state = s.state === "dead" ? "presumed dead" : s.incarnations > 1 ? `${s.state} (restarted)` : s.state;
    for (const c of [w, state, s.device || "–", s.round, s.incarnations, s.seconds_since_seen === null ? "–" : `${fmt(s.seconds_since_seen, 1)} s ago`]) {
      tr.append(el("td", {}, String(c)));
    }
    return tr;
  });
  $(table, "tbody").replaceChildren(...rows);
}

function messagesTable(table, messages) {
  const rows = [];
  for (const key of ["published", "applied", "ignored", "duplicates", "stale_dropped", "stale_merged", "timeouts", "dead_lettered", "screened"]) {
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

const tokenInput = document.getElementById("token");
tokenInput.value = token();
tokenInput.addEventListener("change", () => sessionStorage.setItem("dfca-token", tokenInput.value.trim()));
window.addEventListener("hashchange", route);
route();
