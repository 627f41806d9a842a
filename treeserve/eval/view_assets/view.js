// treeserve view: the page's script (inlined into the HTML by treeserve/eval/view.py).
// It reads the index (#index, JSON) and each problem's record (#p<run>_<i>: gzip, base64) and
// draws with DOM and SVG nodes only. Text from results is only ever set as textContent, so a
// step holding a script tag shows as text.
"use strict";

const INDEX = JSON.parse(document.getElementById("index").textContent);
const SVGNS = "http://www.w3.org/2000/svg";
const FLAT = ["best_of_n", "weighted_best_of_n", "majority"];
const COL = 34, ROW = 14, PAD = 24, R = 5;
const records = new Map(); // "run/index" -> the problem's record (decompressed once)
let selected = null; // unique id shown now

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

function verdict(correct) {
  if (correct === null || correct === undefined) return el("span", { title: "no gold answer" }, "–");
  return correct ? el("span", { class: "ok" }, "✓") : el("span", { class: "bad" }, "✗");
}

function scoreColor(score) {
  if (score === null || score === undefined) return "#d0d7de";
  const s = Math.max(0, Math.min(1, score));
  return `hsl(${Math.round(120 * s)}, 70%, 45%)`;
}

async function loadRecord(run, index) {
  const key = `${run}/${index}`;
  if (!records.has(key)) {
    const text = document.getElementById(`p${run}_${index}`).textContent.trim();
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    records.set(key, JSON.parse(await new Response(stream).text()));
  }
  return records.get(key);
}

// ---- the problem list -------------------------------------------------------------------

function buildList() {
  const runs = INDEX.runs;
  const head = el("tr", {}, el("th", {}, "id"), el("th", {}, "level"));
  runs.forEach((run, r) => {
    const label = runs.length > 1 ? ` ${String.fromCharCode(65 + r)}` : "";
    head.append(el("th", {}, `ok${label}`), el("th", {}, `pred${label}`));
  });
  head.append(el("th", {}, "gold"), el("th", {}, "tokens"), el("th", {}, "s"));
  const body = el("tbody");
  for (const uid of INDEX.order) {
    const first = INDEX.runs.map((run) => run.problems[uid]).find((p) => p);
    const row = el("tr", { class: "problem", "data-uid": uid }, el("td", {}, uid), el("td", {}, first.level ?? "–"));
    for (const run of runs) {
      const p = run.problems[uid];
      row.append(el("td", {}, p ? verdict(p.correct) : "–"), el("td", { class: "pred" }, p ? p.pred ?? "–" : "–"));
    }
    row.append(el("td", {}, first.answer ?? "–"), el("td", {}, first.tokens ?? "–"), el("td", {}, fmt(first.seconds, 1)));
    row.addEventListener("click", () => showProblem(uid));
    body.append(row);
  }
  const levels = [...new Set(INDEX.order.map((u) => firstOf(u).level).filter((l) => l !== null && l !== undefined))];
  const text = el("input", { id: "filter-text", type: "search", placeholder: "filter: id or problem text" });
  const status = el("select", { id: "filter-status" }, el("option", { value: "all" }, "all"),
    el("option", { value: "correct" }, "correct"), el("option", { value: "wrong" }, "wrong"));
  if (runs.length > 1) status.append(el("option", { value: "differ" }, "A ≠ B"));
  const level = el("select", { id: "filter-level" }, el("option", { value: "" }, "every level"),
    ...levels.sort().map((l) => el("option", { value: String(l) }, `level ${l}`)));
  const count = el("span", { id: "count" });
  for (const control of [text, status, level]) control.addEventListener("input", applyFilters);
  document.getElementById("filters").append(text, status, level, count);
  document.getElementById("rows").append(el("table", {}, el("thead", {}, head), body));
  applyFilters();
}

function firstOf(uid) {
  return INDEX.runs.map((run) => run.problems[uid]).find((p) => p);
}

function applyFilters() {
  const text = document.getElementById("filter-text").value.toLowerCase();
  const status = document.getElementById("filter-status").value;
  const level = document.getElementById("filter-level").value;
  let shown = 0;
  for (const row of document.querySelectorAll("tr.problem")) {
    const uid = row.dataset.uid;
    const p = firstOf(uid);
    const verdicts = INDEX.runs.map((run) => run.problems[uid]?.correct);
    let keep = !text || uid.toLowerCase().includes(text) || (p.problem || "").toLowerCase().includes(text);
    if (status === "correct") keep &&= verdicts[0] === true;
    if (status === "wrong") keep &&= verdicts[0] === false;
    if (status === "differ") keep &&= verdicts[0] !== verdicts[1];
    if (level) keep &&= String(p.level) === level;
    row.hidden = !keep;
    shown += keep;
  }
  document.getElementById("count").textContent = `${shown} of ${INDEX.order.length}`;
}

// ---- one problem ------------------------------------------------------------------------

async function showProblem(uid) {
  selected = uid;
  for (const row of document.querySelectorAll("tr.problem")) row.classList.toggle("selected", row.dataset.uid === uid);
  const view = document.getElementById("problem");
  const p = firstOf(uid);
  const panels = el("div", { class: "runs", style: `grid-template-columns: repeat(${INDEX.runs.length}, minmax(0, 1fr))` });
  view.replaceChildren(el("h2", {}, `problem ${uid}`), el("div", { class: "question" }, p.problem ?? ""), panels);
  for (const [r, run] of INDEX.runs.entries()) {
    const entry = run.problems[uid];
    const panel = el("section", { class: "run", "data-run": String(r) });
    panels.append(panel);
    panel.append(el("h3", {}, run.name));
    if (!entry) {
      panel.append(el("p", {}, "this problem is not in this file"));
      continue;
    }
    const record = await loadRecord(r, entry.index);
    if (selected !== uid) return; // another problem was chosen while this one loaded
    panel.append(el("div", {}, "answer ", el("b", {}, record.pred ?? "–"), " ", verdict(entry.correct),
      `  gold ${record.answer ?? "–"}`));
    if (entry.stopped) panel.append(el("div", { class: "stopped" }, entry.stopped)); // adaptive: where and why
    if (!record.trace) {
      panel.append(el("p", { class: "notice" }, "This problem has no search trace. Record traces with ",
        el("code", {}, "treeserve eval ... --trace"), " (or ", el("code", {}, '"trace": true'), " on /v1/search)."));
      continue;
    }
    drawTree(panel, record);
  }
  history.replaceState(null, "", `#problem=${encodeURIComponent(uid)}`);
}

function traceNodes(trace) {
  // the trace's rows (search/trace.py) as objects; ids are strings (the row's index)
  return trace.nodes.map((row, i) => {
    const node = { id: String(i) };
    trace.fields.forEach((field, k) => { node[field] = row[k]; });
    node.parent = node.parent === null ? null : String(node.parent);
    return node;
  });
}

function layout(record) {
  // every node gets a column (its iteration; best-of-N: its step) and a row within it
  const trace = record.trace;
  const rows = traceNodes(trace);
  const nodes = [];
  if (FLAT.includes(trace.strategy)) {
    rows.forEach((node, i) => {
      const steps = node.text.split("\n\n");
      const count = Math.max(steps.length, node.step_scores.length, 1);
      for (let k = 0; k < count; k++) {
        nodes.push({ ...node, id: k ? `${node.id}/${k}` : node.id, parent: k > 1 ? `${node.id}/${k - 1}` : k ? node.id : null,
          completion: node.id, iteration: k, text: steps[k] ?? "", step_scores: [node.step_scores[k] ?? null],
          tokens: k ? null : node.tokens, col: k, row: i, fate: k === count - 1 ? node.fate : "kept" });
      }
    });
    return nodes;
  }
  const rowOf = new Map();
  const columns = new Map();
  for (const node of rows) {
    if (!columns.has(node.iteration)) columns.set(node.iteration, []);
    columns.get(node.iteration).push(node);
  }
  for (const it of [...columns.keys()].sort((a, b) => a - b)) {
    const column = columns.get(it).map((node, order) => ({ node, order }));
    column.sort((a, b) => (rowOf.get(a.node.parent) ?? -1) - (rowOf.get(b.node.parent) ?? -1) || a.order - b.order);
    column.forEach(({ node }, row) => {
      rowOf.set(node.id, row);
      nodes.push({ ...node, col: it, row, completion: node.id });
    });
  }
  return nodes;
}

function marked(record, nodes, which) {
  // node ids on the paths of the completions `which` selects (and their ancestors)
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const out = new Set();
  record.completions.forEach((c, j) => {
    if (!which(c)) return;
    let id = String(record.trace.completions[j]);
    if (FLAT.includes(record.trace.strategy)) { // the completion's last step
      const last = nodes.filter((n) => n.completion === id).pop();
      id = last ? last.id : id;
    }
    while (id && byId.has(id) && !out.has(id)) {
      out.add(id);
      id = byId.get(id).parent;
    }
  });
  return out;
}

function drawTree(panel, record) {
  const nodes = layout(record);
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const chosen = record.pred === null || record.pred === undefined ? new Set() : marked(record, nodes, (c) => c.answer === record.pred);
  const gold = marked(record, nodes, (c) => c.correct === true);
  const cols = Math.max(1, ...nodes.map((n) => n.col + 1));
  const rows = Math.max(1, ...nodes.map((n) => n.row + 1));
  const width = PAD * 2 + (cols - 1) * COL, height = PAD + 8 + (rows - 1) * ROW + PAD;
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`, "data-nodes": String(record.trace.nodes.length) });
  const x = (n) => PAD + n.col * COL, y = (n) => PAD + 8 + n.row * ROW;
  const flat = FLAT.includes(record.trace.strategy);
  for (let c = 0; c < cols; c += Math.ceil(cols / 20)) {
    const label = svgEl("text", { x: PAD + c * COL, y: 12, class: "axis", "text-anchor": "middle" });
    label.textContent = flat ? `step ${c + 1}` : `it ${c}`;
    svg.append(label);
  }
  const edges = svgEl("g"), dots = svgEl("g");
  svg.append(edges, dots);
  const faded = (n) => n.fate === "pruned" || n.fate === "duplicate";
  for (const n of nodes) {
    const parent = byId.get(n.parent);
    if (!parent) continue;
    const [x0, y0, x1, y1] = [x(parent), y(parent), x(n), y(n)];
    const mid = (x0 + x1) / 2;
    const cls = chosen.has(n.id) ? "edge chosen" : faded(n) ? "edge faded" : "edge";
    edges.append(svgEl("path", { d: `M${x0},${y0} C${mid},${y0} ${mid},${y1} ${x1},${y1}`, class: cls }));
  }
  const details = el("div", { class: "details" }, el("p", { class: "legend" }, "click a node for its step"));
  for (const n of nodes) {
    const score = n.step_scores.length ? n.step_scores[n.step_scores.length - 1] : null;
    const classes = ["node", faded(n) ? "faded" : "", chosen.has(n.id) ? "chosen" : "", gold.has(n.id) ? "gold" : ""];
    const attrs = { class: classes.join(" ").trim(), fill: scoreColor(score), "data-id": n.id, "data-fate": n.fate };
    const shape = n.fate === "finished"
      ? svgEl("rect", { ...attrs, x: x(n) - R, y: y(n) - R, width: 2 * R, height: 2 * R })
      : svgEl("circle", { ...attrs, cx: x(n), cy: y(n), r: R });
    const title = svgEl("title");
    title.textContent = `${n.id}: ${n.fate}, PRM ${fmt(score)}`;
    shape.append(title);
    shape.addEventListener("click", () => {
      for (const other of svg.querySelectorAll(".node.active")) other.classList.remove("active");
      shape.classList.add("active");
      showNode(details, n, byId, chosen.has(n.id), gold.has(n.id));
    });
    dots.append(shape);
  }
  const legend = el("div", { class: "legend" },
    el("span", {}, el("i", { class: "swatch", style: `background:${scoreColor(0)}` }), " PRM 0 "),
    el("span", {}, el("i", { class: "swatch", style: `background:${scoreColor(1)}` }), " PRM 1 "),
    el("span", {}, "■ finished  ● kept/pruned (faded)"),
    el("span", { style: "color:var(--chosen)" }, "— chosen answer's path"),
    el("span", { style: "color:var(--gold)" }, "○ reached the gold answer"),
    el("span", {}, `${record.trace.nodes.length} nodes, ${record.trace.strategy} n=${record.trace.n}`));
  panel.append(legend, el("div", { class: "tree" }, svg), details);
}

function showNode(details, n, byId, chosen, gold) {
  const path = [];
  for (let id = n.parent; id && byId.has(id); id = byId.get(id).parent) path.unshift(byId.get(id).text);
  const rows = [
    ["node", n.id], ["iteration", n.iteration], ["fate", n.fate + (chosen ? " · on the chosen answer's path" : "") + (gold ? " · reached gold" : "")],
    ["PRM step score", n.step_scores.map((s) => fmt(s)).join(", ") || "–"], ["ranked by", fmt(n.score)],
    ["tokens", n.tokens ?? "–"], ["scores from", n.cache || "–"], ["decoded ahead", (n.decoded_ahead ?? n.speculative) ? "yes" : "no"],
  ];
  if (n.lookahead_scores && n.lookahead_scores.length) rows.push(["lookahead scores", n.lookahead_scores.map((s) => fmt(s)).join(", ")]);
  const dl = el("dl");
  for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, v));
  details.replaceChildren(dl, el("div", {}, "step text"), el("pre", { class: "step-text" }, n.text),
    el("details", {}, el("summary", {}, `the ${path.length} steps before it`), el("pre", {}, path.join("\n\n"))));
}

// ---- start --------------------------------------------------------------------------------

function start() {
  document.getElementById("runinfo").textContent = INDEX.runs.map((r) => r.describe).join("  |  ");
  const plots = document.getElementById("plots");
  for (const plot of INDEX.plots) plots.append(el("img", { src: plot.src, alt: plot.title, title: plot.title }));
  if (!INDEX.plots.length) plots.hidden = true;
  if (!INDEX.runs.some((r) => r.traced)) {
    document.getElementById("problem").append(el("p", { class: "notice", id: "no-traces" },
      "These results hold no search traces, so there is no tree to draw. Record them with ",
      el("code", {}, "treeserve eval ... --trace"), " and open that file with ", el("code", {}, "treeserve view"), "."));
  }
  buildList();
  const wanted = decodeURIComponent((location.hash.match(/problem=([^&]*)/) || [])[1] || "");
  const first = INDEX.order.includes(wanted) ? wanted : INDEX.order.length === 1 ? INDEX.order[0] : null;
  const ready = () => { document.body.dataset.ready = "1"; };
  if (first !== null) showProblem(first).then(ready); else ready();
}

start();
