// The RL2 viewer's page. Every text of the run (the model's and the environment's) goes into the page as
// text (textContent, title), never as markup: a <script> in a response is shown, not run.
"use strict";

const PAGE = 50;
const state = { offset: 0, total: 0, metrics: [], picked: new Set(["rollout/reward"]), sample: null, mode: "none",
                status: null };

// ---- data: the server's API, or the records embedded by `--html` ----

const embeddedNode = document.getElementById("rl2-data");
const EMBEDDED = embeddedNode ? JSON.parse(embeddedNode.textContent) : null;

function filterRows(rows, f) {  // as RL2/viewer/run.py:filter_rows
  const q = (f.q || "").toLowerCase();
  return rows.filter((r) => {
    const reward = r.reward || 0;
    return !((f.step !== "" && f.step !== undefined && r.step !== Number(f.step))
      || (f.min_reward !== "" && f.min_reward !== undefined && reward < Number(f.min_reward))
      || (f.max_reward !== "" && f.max_reward !== undefined && reward > Number(f.max_reward))
      || (f.source && r.data_source !== f.source) || (f.fault === "yes" && r.fault == null)
      || (f.fault === "no" && r.fault != null)
      || (f.tool_errors === "1" && !((r.tool_errors || 0) + (r.parse_errors || 0)))
      || (f.split === "1" && (r.n_sequences || 1) < 2)
      || (q && !(`${r.prompt || ""}\n${r.response || ""}`.toLowerCase().includes(q))));
  });
}

function summary(r) {
  return Object.assign({}, r, { snippet: (r.response || "").slice(0, 160), has_tokens: !!r.tokens });
}

function stepTable(rows) {
  const by = new Map();
  for (const r of rows) { if (!by.has(r.step)) by.set(r.step, []); by.get(r.step).push(r); }
  return [...by.keys()].sort((a, b) => a - b).map((step) => {
    const rs = by.get(step), rewards = rs.map((r) => r.reward || 0);
    const lengths = rs.map((r) => r.response_length).filter((x) => x != null);
    return { step, n: rs.length, reward: rewards.reduce((a, b) => a + b, 0) / rs.length,
             reward_min: Math.min(...rewards), reward_max: Math.max(...rewards),
             faults: rs.filter((r) => r.fault != null).length,
             length: lengths.length ? lengths.reduce((a, b) => a + b, 0) / lengths.length : null };
  });
}

function localApi(path, p) {
  const all = EMBEDDED.samples;
  if (path === "status") return EMBEDDED.status;
  if (path === "metrics") return EMBEDDED.metrics;
  if (path === "steps") return stepTable(all);
  if (path === "samples") {
    const rows = filterRows(all, p), offset = Number(p.offset || 0);
    return { total: rows.length, offset, rows: rows.slice(offset, offset + Number(p.limit || PAGE)).map(summary) };
  }
  if (path === "sample") return all[Number(p.id)] || null;
  if (path === "group") return all.filter((r) => r.step === Number(p.step) && r.group === Number(p.group));
  if (path === "same_prompt") {
    const prompt = all[Number(p.id)].prompt;
    return all.filter((r) => r.prompt === prompt).map(summary);
  }
  throw new Error(`no ${path}`);
}

async function api(path, params = {}) {
  if (EMBEDDED) return localApi(path, params);
  const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null));
  const response = await fetch(`/api/${path}?${query}`);
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

// ---- building the page: text only ----

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child == null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);
const fmt = (x, digits = 3) => (x == null ? "" : typeof x === "number" ? Number(x.toPrecision(digits)).toString() : String(x));

// ---- learning curves (SVG, hover for values) ----

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function drawCurves() {
  const box = $("curves");
  box.replaceChildren();
  for (const name of state.picked) {
    const points = state.metrics.filter((m) => typeof m[name] === "number" && isFinite(m[name])).map((m) => [m.step, m[name]]);
    if (!points.length) continue;
    box.append(curve(name, points));
  }
}

function curve(name, points) {
  const W = 360, H = 170, L = 48, R = 10, T = 22, B = 22;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (y1 === y0 ? 0.5 : 1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { width: W, height: H, "data-metric": name });
  const title = svg("text", { x: L, y: 14, "font-size": 12 });
  title.textContent = name;
  root.append(title);
  for (const [y, label] of [[y0, fmt(y0)], [y1, fmt(y1)]]) {
    const t = svg("text", { x: L - 4, y: sy(y) + 4, "font-size": 10, "text-anchor": "end", fill: "#666" });
    t.textContent = label;
    root.append(t);
  }
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    const t = svg("text", { x: sx(x), y: H - 6, "font-size": 10, "text-anchor": anchor, fill: "#666" });
    t.textContent = `step ${x}`;
    root.append(t);
  }
  root.append(svg("polyline", { points: points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none",
                                stroke: "#2b6cb0", "stroke-width": 1.6 }));
  for (const p of points.length <= 60 ? points : []) root.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: "#2b6cb0" }));
  const cursor = svg("line", { y1: T, y2: H - B, stroke: "#999", visibility: "hidden" });
  root.append(cursor);
  const holder = el("div", { class: "curve" }, root);
  const tip = el("div", { class: "tip", hidden: "" });
  holder.append(tip);
  root.addEventListener("mousemove", (event) => {
    const x = event.offsetX;
    let best = points[0];
    for (const p of points) if (Math.abs(sx(p[0]) - x) < Math.abs(sx(best[0]) - x)) best = p;
    cursor.setAttribute("x1", sx(best[0])); cursor.setAttribute("x2", sx(best[0]));
    cursor.setAttribute("visibility", "visible");
    tip.hidden = false;
    tip.textContent = `step ${best[0]}\n${name} = ${fmt(best[1], 5)}`;
    tip.style.left = `${Math.min(sx(best[0]) + 8, W - 120)}px`; tip.style.top = `${sy(best[1])}px`;
  });
  root.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.hidden = true; });
  return holder;
}

function drawPicker() {
  const names = [...new Set(state.metrics.flatMap((m) => Object.keys(m)))].filter((k) => k !== "step").sort();
  const needle = $("metric-search").value.toLowerCase();
  const picker = $("metric-picker");
  picker.replaceChildren();
  for (const name of names.filter((n) => n.toLowerCase().includes(needle))) {
    const box = el("input", { type: "checkbox", "data-metric": name });
    box.checked = state.picked.has(name);
    box.addEventListener("change", () => { box.checked ? state.picked.add(name) : state.picked.delete(name); drawCurves(); });
    picker.append(el("label", {}, box, ` ${name}`));
  }
}

// ---- steps and the list of trajectories ----

async function loadSteps() {
  const steps = await api("steps");
  const body = $("steps").tBodies[0];
  body.replaceChildren(...steps.map((s) => el("tr", { onclick: () => { $("f-step").value = String(s.step); state.offset = 0; loadSamples(); } },
    el("td", { text: s.step }), el("td", { text: s.n }), el("td", { text: fmt(s.reward) }), el("td", { text: fmt(s.reward_min) }),
    el("td", { text: fmt(s.reward_max) }), el("td", { text: s.faults, class: s.faults ? "fault" : "" }),
    el("td", { text: fmt(s.length) }))));
  const select = $("f-step"), chosen = select.value;
  select.replaceChildren(el("option", { value: "", text: "all" }), ...steps.map((s) => el("option", { value: s.step, text: s.step })));
  select.value = chosen;
}

function filters() {
  return { step: $("f-step").value, min_reward: $("f-min").value, max_reward: $("f-max").value, fault: $("f-fault").value,
           source: $("f-source").value, tool_errors: $("f-tool-errors").checked ? "1" : "",
           split: $("f-split").checked ? "1" : "", q: $("f-q").value };
}

async function loadSamples() {
  const page = await api("samples", Object.assign(filters(), { offset: state.offset, limit: PAGE }));
  state.total = page.total;
  $("page-info").textContent = page.total ? `${state.offset + 1}-${state.offset + page.rows.length} of ${page.total}` : "none";
  $("samples").tBodies[0].replaceChildren(...page.rows.map((r) => el("tr", { "data-id": r.id, onclick: () => openSample(r.id) },
    el("td", { text: r.id }), el("td", { text: r.step }), el("td", { text: r.group }), el("td", { text: fmt(r.reward) }),
    el("td", { text: r.response_length ?? "" }), el("td", { text: r.n_turns ?? "" }), el("td", { text: r.finish_reason ?? "" }),
    el("td", { text: r.stop_reason ?? "" }), el("td", { text: r.fault ? "yes" : "", class: "fault", title: r.fault || "" }),
    el("td", { text: r.data_source ?? "" }), el("td", { text: (r.snippet || "").replace(/\n/g, " \u23ce "), class: "snippet" }))));
}

// ---- one trajectory ----

const TOOL_CALL = /<tool_call>([\s\S]*?)<\/tool_call>/g;

function actionContent(text) {  // an action's text, with each <tool_call> block shown as a call
  const parts = [];
  let last = 0;
  for (const match of text.matchAll(TOOL_CALL)) {
    if (match.index > last) parts.push(document.createTextNode(text.slice(last, match.index)));
    let call = match[1].trim();
    try { const parsed = JSON.parse(call); call = `${parsed.name}(${JSON.stringify(parsed.arguments ?? {})})`; } catch (e) { /* shown as written */ }
    parts.push(el("span", { class: "tool-call" }, el("span", { class: "who", text: "tool call" }), call));
    last = match.index + match[0].length;
  }
  if (last < text.length) parts.push(document.createTextNode(text.slice(last)));
  return parts;
}

function bubble(kind, who, ...content) {
  return el("div", { class: `bubble ${kind}` }, el("span", { class: "who", text: who }), ...content);
}

function turnsOf(record) {
  return record.turns || [{ action: record.response || "", observation: "", reward: record.reward, finish_reason: record.finish_reason }];
}

function chat(record) {
  const nodes = [bubble("prompt", "prompt", record.prompt || "")];
  turnsOf(record).forEach((turn, i) => {
    nodes.push(bubble("action", `action ${i + 1} (reward ${fmt(turn.reward)}, ${turn.finish_reason || "?"})`, ...actionContent(turn.action || "")));
    if (turn.observation) nodes.push(bubble("observation", "environment / tool result", turn.observation));
  });
  return nodes;
}

// Colour modes: each maps a token's columns to a background, or null where it says nothing.
const MODES = {
  none: { label: "text" },
  mask: { label: "loss mask", legend: "green: trained (sampled) tokens; grey: prompt and observations",
          colour: (t, i) => (t.mask[i] ? "rgba(56,161,105,0.35)" : "rgba(160,160,160,0.25)") },
  adv: { label: "advantage", legend: "blue: positive advantage; red: negative (trained tokens only)", needs: "adv",
         colour: (t, i) => (t.adv[i] == null || !t.mask[i] ? null : diverging(t.adv[i], t.advScale)) },
  logp: { label: "sampled log-prob", legend: "the engine's log-probability of each sampled token: darker red is less likely",
          colour: (t, i) => (t.mask[i] ? `rgba(220,38,38,${Math.min(1, -t.logp[i] / 5).toFixed(3)})` : null) },
  mismatch: { label: "engine vs trainer", legend: "|trainer log-prob - engine log-prob|: darker purple is a larger gap (0.5 and up darkest)",
              needs: "trainer_logp",
              colour: (t, i) => (t.mask[i] && t.trainer_logp[i] != null
                ? `rgba(128,36,200,${Math.min(1, Math.abs(t.trainer_logp[i] - t.logp[i]) * 2).toFixed(3)})` : null) },
  version: { label: "weight version", legend: "the version (step) of the weights that sampled each token; one hue per version",
             colour: (t, i) => (t.mask[i] && t.version[i] >= 0 ? `hsla(${(t.version[i] * 67) % 360},70%,60%,0.45)` : null) },
};

function diverging(value, scale) {
  const a = Math.min(1, Math.abs(value) / (scale || 1)).toFixed(3);
  return value >= 0 ? `rgba(37,99,235,${a})` : `rgba(220,38,38,${a})`;
}

function tokenView(tokens, mode) {  // runs of sampled and not sampled tokens become action and observation bubbles
  const nodes = [];
  let run = null, kind = null;
  for (let i = 0; i < tokens.text.length; i++) {
    const sampled = tokens.mask[i] ? "action" : "observation";
    if (sampled !== kind) {
      kind = sampled;
      run = bubble(kind, kind === "action" ? "sampled tokens" : "environment tokens");
      nodes.push(run);
    }
    const span = el("span", { class: "tok", text: tokens.text[i] });
    const colour = MODES[mode].colour(tokens, i);
    if (colour) span.style.background = colour;
    const info = [`logp ${fmt(tokens.logp[i], 4)}`];
    if (tokens.trainer_logp && tokens.trainer_logp[i] != null) info.push(`trainer logp ${fmt(tokens.trainer_logp[i], 4)}`);
    if (tokens.adv && tokens.adv[i] != null) info.push(`advantage ${fmt(tokens.adv[i], 4)}`);
    if (tokens.version[i] >= 0) info.push(`version ${tokens.version[i]}`);
    span.title = `${JSON.stringify(tokens.text[i])} mask ${tokens.mask[i]} ${info.join(" ")}`;
    run.append(span);
  }
  if (tokens.n_tokens > tokens.text.length) nodes.push(el("div", { class: "hint", text: `... ${tokens.n_tokens - tokens.text.length} more tokens not saved (rollout.save_sample_tokens)` }));
  return nodes;
}

function meta(record) {
  const rows = [["step", record.step], ["group", record.group], ["reward", fmt(record.reward, 5)], ["score", fmt(record.score, 5)]];
  for (const [k, v] of Object.entries(record.reward_parts || {})) rows.push([`  reward part ${k}`, fmt(v, 5)]);
  rows.push(["finish reason", record.finish_reason], ["stop reason", record.stop_reason], ["turns", record.n_turns],
            ["response tokens", record.response_length]);
  if (record.data_source != null) rows.push(["source", record.data_source]);
  if (record.tool_calls != null) rows.push(["tool calls / errors / unparsed", `${record.tool_calls} / ${record.tool_errors} / ${record.parse_errors}`]);
  if (record.n_sequences > 1) rows.push(["sequences (split turns)", record.n_sequences]);
  if (record.fault) rows.push(["fault", record.fault]);
  return el("dl", { class: "meta" }, ...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v ?? "", class: k === "fault" ? "fault" : "" })]));
}

function drawDetail() {
  const record = state.sample;
  const tokens = record.tokens;
  if (tokens) {
    tokens.advScale = Math.max(1e-6, ...(tokens.adv || []).filter((x) => x != null).map(Math.abs));
  }
  const modes = $("colour-modes");
  modes.replaceChildren(el("span", { class: "hint", text: "colour tokens by:" }));
  for (const [name, mode] of Object.entries(MODES)) {
    const usable = name === "none" || (tokens && (!mode.needs || tokens[mode.needs]));
    const radio = el("input", { type: "radio", name: "mode", value: name, id: `mode-${name}` });
    radio.checked = state.mode === name;
    radio.disabled = !usable;
    radio.addEventListener("change", () => { state.mode = name; drawDetail(); });
    modes.append(el("label", { title: usable ? "" : "not recorded: run with rollout.save_sample_tokens=N" }, radio, ` ${mode.label}`));
  }
  $("legend").textContent = state.mode !== "none" ? MODES[state.mode].legend : (tokens ? "" : "token colours need rollout.save_sample_tokens=N");
  const body = state.mode !== "none" && tokens ? [bubble("prompt", "prompt", record.prompt || ""), ...tokenView(tokens, state.mode)] : chat(record);
  $("detail").replaceChildren(meta(record), el("div", { id: "chat" }, ...body));
}

async function openSample(id) {
  const record = await api("sample", { id });
  if (!record) return;
  state.sample = record;
  if (state.mode !== "none" && !record.tokens) state.mode = "none";
  $("detail-title").textContent = `trajectory #${id} (step ${record.step}, group ${record.group})`;
  $("detail-section").hidden = false;
  for (const row of $("samples").tBodies[0].rows) row.classList.toggle("selected", row.dataset.id === String(id));
  drawDetail();
  $("detail-section").scrollIntoView({ block: "start" });
}

// ---- side by side ----

function column(record) {
  return el("div", {}, el("div", { class: "row" }, el("strong", { text: `#${record.id} step ${record.step}` }),
    el("span", { text: `reward ${fmt(record.reward)}` }), record.fault ? el("span", { class: "fault", text: "fault" }) : null,
    el("span", { class: "hint", text: `${record.finish_reason || ""} ${record.stop_reason || ""}` })),
    ...chat(record).slice(1));
}

async function showGroup() {
  const records = await api("group", { step: state.sample.step, group: state.sample.group });
  $("compare-title").textContent = `GRPO group ${state.sample.group} of step ${state.sample.step}: ${records.length} trajectories`;
  $("compare-pick").replaceChildren();
  $("compare").replaceChildren(bubble("prompt", "prompt", state.sample.prompt || ""), el("div", { class: "compare-grid" }, ...records.map(column)));
  $("compare-section").hidden = false;
  $("compare-section").scrollIntoView({ block: "start" });
}

async function showPrompt() {
  const rows = await api("same_prompt", { id: state.sample.id });
  const steps = [...new Set(rows.map((r) => r.step))].sort((a, b) => a - b);
  const pickers = [0, 1].map((k) => el("select", {}, ...steps.map((s) => el("option", { value: s, text: `step ${s}` }))));
  pickers[0].value = String(state.sample.step);
  pickers[1].value = String(steps.find((s) => s !== state.sample.step) ?? state.sample.step);
  const draw = async () => {
    const columns = [];
    for (const picker of pickers) {
      const first = rows.find((r) => r.step === Number(picker.value));
      columns.push(el("div", {}, ...(await api("group", { step: first.step, group: first.group })).map(column)));
    }
    $("compare").replaceChildren(bubble("prompt", "prompt", state.sample.prompt || ""), el("div", { class: "compare-grid" }, ...columns));
  };
  pickers.forEach((p) => p.addEventListener("change", draw));
  $("compare-title").textContent = `this prompt at ${steps.length} step(s):`;
  $("compare-pick").replaceChildren(pickers[0], " vs ", pickers[1]);
  await draw();
  $("compare-section").hidden = false;
  $("compare-section").scrollIntoView({ block: "start" });
}

// ---- start, and follow a running job ----

async function refresh() {
  const status = await api("status");
  const changed = !state.status || status.n_samples !== state.status.n_samples || status.n_metrics !== state.status.n_metrics;
  state.status = status;
  $("run-name").textContent = status.save_dir;
  $("live").textContent = `${status.n_samples} trajectories, ${status.n_metrics} metric records${EMBEDDED ? " (saved page)" : " (live)"}`;
  if (!changed) return;
  const source = $("f-source"), chosen = source.value;
  source.replaceChildren(el("option", { value: "", text: "all" }), ...status.sources.map((s) => el("option", { value: s, text: s })));
  source.value = chosen;
  state.metrics = await api("metrics");
  if (![...state.picked].some((n) => state.metrics.some((m) => n in m))) {
    const first = state.metrics.flatMap((m) => Object.keys(m)).find((k) => k.startsWith("rollout/reward") || k.endsWith("loss"));
    if (first) state.picked.add(first);
  }
  drawPicker();
  drawCurves();
  await loadSteps();
  await loadSamples();
}

function start() {
  $("metric-search").addEventListener("input", drawPicker);
  $("filters").addEventListener("input", () => { state.offset = 0; loadSamples(); });
  $("filters").addEventListener("submit", (event) => event.preventDefault());
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); loadSamples(); });
  $("next").addEventListener("click", () => { if (state.offset + PAGE < state.total) { state.offset += PAGE; loadSamples(); } });
  $("close-detail").addEventListener("click", () => { $("detail-section").hidden = true; });
  $("close-compare").addEventListener("click", () => { $("compare-section").hidden = true; });
  $("show-group").addEventListener("click", showGroup);
  $("show-prompt").addEventListener("click", showPrompt);
  refresh().then(() => { document.body.dataset.ready = "1"; });
  if (!EMBEDDED) setInterval(() => refresh().catch(() => { $("live").textContent = "server gone"; }), 2000);
}

start();
