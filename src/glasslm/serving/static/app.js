// The glasslm explorer: plain DOM and SVG, no build step, no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
let info = null;                 // /api/info: the model's shape
let gen = { prompt: [], tokens: [], selected: -1, controller: null };

// A token's text made visible: spaces and newlines drawn as symbols (as glasslm inspect does).
const visible = (t) => t.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";

async function post(path, body) {
  const response = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                       body: JSON.stringify(body) });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
}

function showError(where, err) { where.textContent = String(err.message || err); where.classList.add("error"); }
function showStatus(where, text) { where.textContent = text; where.classList.remove("error"); }

function samplingControls() {
  return { temperature: Number($("temperature").value), top_k: Number($("top-k").value) || 0,
           top_p: Number($("top-p").value) };
}

// --- generation, streamed as server-sent events from /v1/completions ---

async function generate() {
  const output = $("output"), status = $("gen-status");
  output.textContent = "";
  $("next-token-bars").textContent = "";
  const text = $("prompt").value;
  gen = { prompt: [], tokens: [], selected: -1, controller: new AbortController(), text: "" };
  $("inspect-generation").disabled = true;
  $("generate").disabled = true; $("stop").disabled = false;
  try {
    gen.prompt = text ? (await post("/api/tokenize", { text })).tokens : [];
    const newTokens = fittingNewTokens(gen.prompt.length);
    const promptSpan = document.createElement("span");
    promptSpan.className = "prompt"; promptSpan.textContent = text;
    output.appendChild(promptSpan);
    const body = { prompt: text, max_tokens: newTokens.count, stream: true, logprobs: 5,
                   return_token_ids: true, ...samplingControls() };
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    const start = performance.now();
    const response = await fetch("/v1/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" }, signal: gen.controller.signal });
    if (!response.ok) throw new Error((await response.json()).error.message);
    let finish = null;
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      if (choice.token_ids) addToken(choice);
      if (choice.finish_reason) finish = choice.finish_reason;
      const seconds = (performance.now() - start) / 1000;
      showStatus(status, `${gen.tokens.length} tokens, ${(gen.tokens.length / seconds).toFixed(1)} tokens/s` +
                 (finish ? `, finish: ${finish}` : "") + newTokens.note);
    }
    output.dataset.done = "true";
    // The "Inside the model" text stays the user's own; "Inspect this text" copies the generation there.
    gen.text = text + gen.tokens.map((t) => t.text).join("");
    $("inspect-generation").disabled = false;
    if (gen.tokens.length) selectToken(gen.tokens.length - 1);
  } catch (err) {
    if (err.name !== "AbortError") showError(status, err);
  } finally {
    $("generate").disabled = false; $("stop").disabled = true;
  }
}

// New tokens asked for: the box's number, capped so prompt + new tokens fit the model's context
// (past it the model would only see a sliding window of the text). `note` says when it was capped.
function fittingNewTokens(promptLength) {
  const asked = Number($("max-tokens").value), fits = Math.max(1, info.context_length - promptLength);
  if (asked <= fits) return { count: asked, note: "" };
  return { count: fits, note: ` (capped from ${asked}: the prompt's ${promptLength} tokens + ${fits} new fill ` +
                               `the context of ${info.context_length})` };
}

function inspectGeneration() {
  $("inspect-text").value = gen.text;
  showStatus($("inspect-status"), "the generated text; Attention and Logit lens show its last " +
             `${info.context_length} tokens if it is longer`);
}

async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ")) continue;
      if (line === "data: [DONE]") return;
      yield JSON.parse(line.slice(6));
    }
  }
}

function addToken(choice) {
  const index = gen.tokens.length;
  const lp = choice.logprobs;
  const token = { id: choice.token_ids[0], text: lp.tokens[0], logprob: lp.token_logprobs[0],
                  top: lp.top_logprobs[0] };
  gen.tokens.push(token);
  const span = document.createElement("span");
  span.className = "tok gen";
  span.textContent = token.text;
  span.dataset.index = index; span.dataset.id = token.id;
  span.dataset.prob = Math.exp(token.logprob).toFixed(4);
  span.title = `p = ${Math.exp(token.logprob).toFixed(3)}`;
  span.onclick = () => selectToken(index);
  $("output").appendChild(span);
  // While streaming, show the alternatives that came with the token (the model's own top 5).
  drawBars(Object.entries(token.top).map(([text, l]) => ({ text, prob: Math.exp(l), adjusted: null })),
           token.text, `token ${index + 1} (streamed)`);
}

// --- next-token distribution under the sampling controls ---

async function selectToken(index) {
  gen.selected = index;
  document.querySelectorAll("#output .tok.selected").forEach((e) => e.classList.remove("selected"));
  const span = document.querySelector(`#output .tok[data-index="${index}"]`);
  if (span) span.classList.add("selected");
  await redrawNextToken();
}

async function redrawNextToken() {
  if (gen.selected < 0 || gen.controller === null) return;
  const index = gen.selected;
  const context = gen.prompt.concat(gen.tokens.slice(0, index).map((t) => t.id)).slice(-info.context_length);
  if (!context.length) return;
  try {
    const table = await post("/api/next-token", { tokens: context, k: 12, ...samplingControls() });
    if (index !== gen.selected) return;  // a newer selection was made meanwhile
    drawBars(table.top, gen.tokens[index].text, `token ${index + 1}; the controls keep ${table.kept} of ${info.vocab_size} tokens`);
  } catch (err) { showError($("next-token-where"), err); }
}

function drawBars(rows, chosenText, where) {
  showStatus($("next-token-where"), where);
  const bars = $("next-token-bars");
  bars.textContent = "";
  for (const row of rows) {
    const div = document.createElement("div");
    div.className = "bar-row" + (row.text === chosenText ? " chosen" : "");
    div.dataset.prob = row.prob; if (row.adjusted !== null) div.dataset.adjusted = row.adjusted;
    const shown = row.adjusted === null ? row.prob : row.adjusted;
    div.innerHTML = `<span class="label"></span><span class="bar-track"><span class="bar-raw"></span>` +
                    `<span class="bar-adj"></span></span><span class="value"></span>`;
    div.querySelector(".label").textContent = visible(row.text);
    div.querySelector(".bar-raw").style.width = `${100 * row.prob}%`;
    div.querySelector(".bar-adj").style.width = `${100 * shown}%`;
    div.querySelector(".value").textContent = shown.toFixed(3);
    bars.appendChild(div);
  }
}

let redrawTimer = null;
function controlsChanged() {
  $("temperature-value").textContent = $("temperature").value;
  $("top-p-value").textContent = $("top-p").value;
  clearTimeout(redrawTimer);
  redrawTimer = setTimeout(redrawNextToken, 60);  // live, but not one request per pixel of a drag
}

// --- per-token loss ---

async function scoreText() {
  const status = $("loss-status"), out = $("loss-output");
  try {
    const result = await post("/api/token-loss", { text: $("loss-text").value });
    out.textContent = "";
    const worst = Math.log(info.vocab_size);
    result.texts.forEach((text, i) => {
      const span = document.createElement("span");
      const loss = result.loss[i];
      span.className = "tok"; span.textContent = text; span.dataset.index = i;
      if (loss !== null) {
        const a = Math.min(1, loss / worst);
        span.style.background = `rgba(214, 39, 40, ${a.toFixed(3)})`;
        span.dataset.loss = loss; span.title = `loss ${loss.toFixed(3)} nats (p = ${Math.exp(-loss).toFixed(3)})`;
      }
      out.appendChild(span);
    });
    showStatus(status, `${result.texts.length} tokens, mean loss ${result.mean_loss === null ? "–" : result.mean_loss.toFixed(3)} nats`);
  } catch (err) { showError(status, err); }
}

// --- the text for attention and logit lens: at most one context window ---

// The inspect text's token ids, cut to its last context_length tokens (the window the model would
// see next); `note` says which window is shown when the text is longer.
async function inspectWindow() {
  const text = $("inspect-text").value;
  if (!text) return { body: { text }, note: "" };  // the server names the problem
  const ids = (await post("/api/tokenize", { text })).tokens, n = info.context_length;
  if (ids.length <= n) return { body: { tokens: ids }, note: "" };
  return { body: { tokens: ids.slice(-n) },
           note: ` — the text is ${ids.length} tokens; showing its last ${n} (tokens ${ids.length - n + 1}–${ids.length}), ` +
                 "the model's context" };
}

// --- attention heat map (SVG) ---

async function showAttention() {
  const status = $("inspect-status"), layer = Number($("layer").value), head = Number($("head").value);
  try {
    const shown = await inspectWindow();
    const result = await post("/api/attention", { ...shown.body, layer, head });
    drawHeatMap($("attention-map"), result.patterns[0], result.texts, layer, head);
    $("attention-title").textContent = `layer ${layer}, head ${head} (rows: queries, columns: keys)`;
    showStatus(status, `${result.texts.length} tokens${shown.note}`);
  } catch (err) { showError(status, err); }
}

function drawHeatMap(where, pattern, texts, layer, head) {
  const n = texts.length, cell = Math.max(8, Math.min(24, Math.floor(420 / n))), margin = 56;
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("width", margin + n * cell + 4); svg.setAttribute("height", margin + n * cell + 4);
  svg.dataset.layer = layer; svg.dataset.head = head;
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  };
  for (let q = 0; q < n; q++) {
    add("text", { x: margin - 4, y: margin + q * cell + cell * 0.7, "text-anchor": "end", "font-size": 10 }, visible(texts[q]));
    add("text", { x: 0, y: 0, "font-size": 10, transform: `translate(${margin + q * cell + cell * 0.7},${margin - 4}) rotate(-90)` },
        visible(texts[q]));
    for (let k = 0; k < n; k++) {
      const p = pattern[q][k];
      const rect = add("rect", { x: margin + k * cell, y: margin + q * cell, width: cell - 1, height: cell - 1,
        class: "cell", fill: k > q ? "#eeeeee" : `rgba(26, 115, 232, ${Math.sqrt(p).toFixed(4)})` });
      rect.dataset.q = q; rect.dataset.k = k; rect.dataset.p = p;
      const title = document.createElementNS(svgNS, "title");
      title.textContent = `${visible(texts[q])} → ${visible(texts[k])}: ${p.toFixed(4)}`;
      rect.appendChild(title);
    }
  }
  where.textContent = ""; where.appendChild(svg);
}

// A table headed "layer" and then one column per token (the logit lens and the experts fill its rows).
function layerTable(texts) {
  const table = document.createElement("table");
  const header = table.insertRow();
  header.insertCell().outerHTML = "<th>layer</th>";
  texts.forEach((t) => { const th = document.createElement("th"); th.textContent = visible(t); header.appendChild(th); });
  return table;
}

// --- logit lens (table: one row per layer, last layer on top) ---

async function showLens() {
  const status = $("inspect-status");
  try {
    const shown = await inspectWindow();
    const result = await post("/api/logit-lens", shown.body);
    const table = layerTable(result.texts);
    for (let layer = result.layers.length - 1; layer >= 0; layer--) {
      const row = table.insertRow();
      const th = document.createElement("th"); th.textContent = layer; row.appendChild(th);
      result.layers[layer].forEach((top, pos) => {
        const td = row.insertCell();
        td.textContent = visible(top.text);
        td.dataset.layer = layer; td.dataset.pos = pos; td.dataset.id = top.id; td.dataset.prob = top.prob;
        td.style.background = `rgba(46, 160, 67, ${top.prob.toFixed(3)})`;
        td.title = `after layer ${layer}, position ${pos}: ${visible(top.text)} (p = ${top.prob.toFixed(3)})`;
      });
    }
    $("lens").textContent = ""; $("lens").appendChild(table);
    showStatus(status, `${result.texts.length} tokens, ${result.layers.length} layers${shown.note}`);
  } catch (err) { showError(status, err); }
}

// --- experts (table: one row per mixture-of-experts layer; a cell lists the token's top-k experts) ---

async function showExperts() {
  const status = $("inspect-status");
  try {
    const shown = await inspectWindow();
    const result = await post("/api/experts", shown.body);
    const table = layerTable(result.texts);
    for (let row = result.layers.length - 1; row >= 0; row--) {
      const layer = result.layers[row], tr = table.insertRow();
      const th = document.createElement("th"); th.textContent = layer.layer; tr.appendChild(th);
      layer.experts.forEach((chosen, pos) => {
        const td = tr.insertCell(), weights = layer.weights[pos];
        td.textContent = chosen.join(" ");
        td.dataset.layer = layer.layer; td.dataset.pos = pos; td.dataset.experts = chosen.join(",");
        td.style.background = `rgba(46, 160, 67, ${weights[0].toFixed(3)})`;  // the first choice's weight
        td.title = `layer ${layer.layer}, position ${pos}: ` +
          chosen.map((e, j) => `expert ${e} (${weights[j].toFixed(3)})`).join(", ");
      });
    }
    $("experts").textContent = ""; $("experts").appendChild(table);
    showStatus(status, `${result.texts.length} tokens, ${result.layers.length} mixture-of-experts layers of ` +
                       `${result.n_experts} experts${shown.note}`);
  } catch (err) { showError(status, err); }
}

// --- direct logit attribution, head scores, activation patching ---

const svgNS = "http://www.w3.org/2000/svg";

// Blue for positive, red for negative, opacity |value| / scale (capped at 1).
function diverging(value, scale) {
  const a = Math.min(1, Math.abs(value) / (scale || 1)).toFixed(3);
  return value >= 0 ? `rgba(26, 115, 232, ${a})` : `rgba(214, 39, 40, ${a})`;
}

// An SVG grid: one rect.cell per (row, column), carrying data-row, data-col and data-value.
function drawGrid(where, values, rowLabels, colLabels, scale, describe) {
  const cell = Math.max(12, Math.min(36, Math.floor(480 / colLabels.length))), left = 64, top = 64;
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("width", left + colLabels.length * cell + 4); svg.setAttribute("height", top + rowLabels.length * cell + 4);
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  };
  rowLabels.forEach((label, r) => add("text", { x: left - 4, y: top + r * cell + cell * 0.65, "text-anchor": "end",
                                                "font-size": 10 }, label));
  colLabels.forEach((label, c) => add("text", { x: 0, y: 0, "font-size": 10,
    transform: `translate(${left + c * cell + cell * 0.65},${top - 4}) rotate(-90)` }, label));
  values.forEach((row, r) => row.forEach((value, c) => {
    const rect = add("rect", { x: left + c * cell, y: top + r * cell, width: cell - 1, height: cell - 1, class: "cell",
                               fill: diverging(value, scale) });
    rect.dataset.row = r; rect.dataset.col = c; rect.dataset.value = value;
    const title = document.createElementNS(svgNS, "title");
    title.textContent = describe(r, c, value);
    rect.appendChild(title);
  }));
  where.textContent = ""; where.appendChild(svg);
  return svg;
}

// The key to a grid's colours, under it: red at -scale, white at 0, blue at +scale, as `diverging` draws
// them (values beyond ±scale get the full colour); `meaning` says what each end means here.
function drawLegend(where, scale, meaning) {
  const legend = document.createElement("div");
  legend.className = "legend"; legend.dataset.min = -scale; legend.dataset.max = scale;
  for (const [cls, text] of [["legend-end", `−${scale.toPrecision(3)}`], ["legend-bar", ""],
                             ["legend-end", `+${scale.toPrecision(3)}`], ["legend-words", meaning]]) {
    const span = document.createElement("span");
    span.className = cls; span.textContent = text; legend.appendChild(span);
  }
  where.textContent = ""; where.appendChild(legend);
}

const maxAbs = (rows) => Math.max(1e-9, ...rows.flat().map(Math.abs));
const fixed = (x) => (x === null ? "–" : x.toFixed(3));

function attributionBody(shown) {
  const typed = $("dla-token-text").value, picked = $("dla-token").value;
  if (typed !== "") return { ...shown.body, token: typed };  // the server checks it is one token
  return picked === "" ? shown.body : { ...shown.body, token: Number(picked) };
}

async function showAttribution() {
  const status = $("analysis-status");
  try {
    const shown = await inspectWindow();
    const result = await post("/api/logit-attribution", attributionBody(shown));
    const token = result.token, n = result.heads.length;
    const svg = drawGrid($("dla-map"), result.heads, result.heads.map((_, l) => `layer ${l}`),
                         result.heads[0].map((_, h) => `head ${h}`), maxAbs(result.heads),
                         (l, h, v) => `L${l}H${h}: ${v.toFixed(4)}`);
    svg.dataset.token = token.id;
    drawLegend($("dla-legend"), maxAbs(result.heads), "red takes away from the logit, white is 0, blue adds to it");
    $("dla-title").textContent = `of ${visible(token.text)} (p = ${token.prob.toFixed(3)}, rank ${token.rank + 1}) ` +
                                 `after ${visible(result.texts[result.position])}`;
    drawComponents(result);
    fillTokenChoices(result);
    showStatus(status, `${result.texts.length} tokens, ${n} layers${shown.note}`);
  } catch (err) { showError(status, err); }
}

function drawComponents(result) {
  const headSum = result.heads.flat().reduce((a, b) => a + b, 0);
  const rows = [["all heads (the grid)", headSum], ...result.components.map((c) => [c.label, c.value]),
                ["unembed bias", result.unembed_bias]];
  const table = document.createElement("table");
  for (const [label, value] of rows) {
    const row = table.insertRow();
    row.insertCell().textContent = label;
    const td = row.insertCell();
    td.textContent = value.toFixed(4); td.dataset.label = label; td.dataset.value = value;
    td.style.background = diverging(value, Math.abs(result.logit_minus_mean) || 1);
  }
  const total = table.insertRow();
  total.insertCell().textContent = "sum = logit − mean logit";
  const td = total.insertCell();
  td.textContent = result.logit_minus_mean.toFixed(4); td.dataset.total = result.logit_minus_mean;
  $("dla-components").textContent = ""; $("dla-components").appendChild(table);
}

// The token box offers the top predictions of the last run, keeping the chosen token selected.
function fillTokenChoices(result) {
  const select = $("dla-token"), chosen = select.value;
  select.length = 1;
  for (const row of result.top) select.add(new Option(`${visible(row.text)} (p = ${row.prob.toFixed(3)})`, String(row.id)));
  if (chosen !== "" && ![...select.options].some((o) => o.value === chosen)) {
    select.add(new Option(visible(result.token.text), chosen));
  }
  select.value = chosen;
}

const SCORE_NAMES = { previous_token: "previous token", duplicate_token: "duplicate token", induction: "induction" };

async function showHeadScores() {
  const status = $("analysis-status");
  try {
    const shown = await inspectWindow();
    const result = await post("/api/head-scores", shown.body), random = result.repeated_random;
    const table = document.createElement("table");
    const groups = table.insertRow();
    groups.innerHTML = `<th></th><th colspan="3">this text (${result.texts.length} tokens)</th>` +
                       `<th colspan="3">repeated random tokens</th>`;
    const header = table.insertRow();
    header.innerHTML = "<th>head</th>" + Object.values(SCORE_NAMES).concat(Object.values(SCORE_NAMES))
      .map((name) => `<th>${name}</th>`).join("");
    const layers = random.induction.scores.length, heads = random.induction.scores[0].length;
    for (let l = 0; l < layers; l++) for (let h = 0; h < heads; h++) {
      const row = table.insertRow();
      row.insertCell().outerHTML = `<th>L${l}H${h}</th>`;
      for (const [source, scores] of [["prompt", result.prompt], ["repeated_random", random]]) {
        for (const name of Object.keys(SCORE_NAMES)) scoreCell(row.insertCell(), source, name, l, h, scores[name]);
      }
    }
    $("scores").textContent = ""; $("scores").appendChild(table);
    $("scores-title").textContent = `(mean attention to each head type's target; random: ${random.batch} sequences of ` +
      `${random.half} random tokens then the same again, seed ${random.seed})`;
    showStatus(status, `${result.texts.length} tokens${shown.note}`);
  } catch (err) { showError(status, err); }
}

function scoreCell(td, source, name, layer, head, score) {
  td.dataset.source = source; td.dataset.score = name; td.dataset.layer = layer; td.dataset.head = head;
  if (score.scores === null) {
    td.textContent = "–"; td.title = "no position of this text has such a target (duplicate-token and induction need a repeated token)";
    return;
  }
  const value = score.scores[layer][head];
  td.textContent = value.toFixed(3); td.dataset.value = value;
  td.style.background = `rgba(46, 160, 67, ${Math.min(1, value).toFixed(3)})`;
  td.title = `${SCORE_NAMES[name]} score of L${layer}H${head}, averaged over ${score.queries} positions`;
}

async function showPatching() {
  const status = $("patch-status"), hook = $("patch-hook").value;
  try {
    const body = { text: $("inspect-text").value, corrupted_text: $("corrupted-text").value,
                   answer: $("answer").value, wrong_answer: $("wrong-answer").value, hook };
    const result = await post("/api/patching", body);
    if (result.patched === null) throw new Error("the clean and corrupted texts give the same logit difference");
    const labels = result.texts.map((t, i) => (t === result.corrupted_texts[i] ? visible(t)
                                                : `${visible(t)}/${visible(result.corrupted_texts[i])}`));
    const svg = drawGrid($("patch-map"), result.patched, result.patched.map((_, l) => `layer ${l}`), labels, 1,
                         (l, p, v) => `${hook} of layer ${l} at ${labels[p]}: ${v.toFixed(4)} ` +
                                      `(logit difference ${result.logit_diff[l][p].toFixed(4)})`);
    svg.dataset.hook = hook;
    drawLegend($("patch-legend"), 1, "blue 1: the patch restores the clean run; white 0: it changes nothing; " +
               "red: it moves further from the clean run");
    $("patch-title").textContent = `${hook}: logit difference ${visible(result.answer.text)} − ` +
      `${visible(result.wrong_answer.text)}, clean ${result.clean_logit_diff.toFixed(3)}, ` +
      `corrupted ${result.corrupted_logit_diff.toFixed(3)}`;
    showStatus(status, `${result.texts.length} positions × ${result.patched.length} layers (label: clean/corrupted token)`);
  } catch (err) { showError(status, err); }
}

// --- start ---

// The box's default: 80 new tokens, or fewer where the default prompt + 80 would overflow the context.
async function defaultNewTokens() {
  const box = $("max-tokens"), text = $("prompt").value;
  const promptLength = text ? (await post("/api/tokenize", { text })).tokens.length : 1;
  box.max = info.context_length;
  box.value = Math.min(Number(box.value), Math.max(1, info.context_length - promptLength));
}

// The example texts: the server's (/api/info "defaults"), which this model's tokenizer can encode.
const DEFAULT_BOXES = { prompt: "prompt", loss_text: "loss-text", inspect_text: "inspect-text",
                        corrupted_text: "corrupted-text", answer: "answer", wrong_answer: "wrong-answer" };

function applyDefaults(defaults) {
  for (const [field, id] of Object.entries(DEFAULT_BOXES)) $(id).value = defaults.texts[field];
  if (defaults.from_vocabulary) {
    showStatus($("page-status"), "This model's tokenizer cannot encode the usual Shakespeare examples, so the texts " +
               "below are made from its own vocabulary: a sequence of its tokens repeated, which an induction head copies.");
  }
}

// --- the training run: the curves `glasslm plot` draws, from /api/run, redrawn while the run trains ---

const RUN_REFRESH_MS = 5000;
const RUN_COLOURS = { train: "#1a73e8", validation: "#d62728", longest: "#888", chosen: "#1a73e8", rejected: "#e8710a" };
let runShown = "";  // what the charts show (record count and last record): redraw only when it changes

// A small SVG line chart. Each series: { name, points: [[step, value], ...], band: [[step, low, high], ...]
// (a shaded area, optional), dots: true for sparse series (validation), dashed: true }.
function lineChart(title, series, key) {
  const width = 320, height = 170, right = 8, top = 30, bottom = 24;
  const ys = series.flatMap((s) => s.points.map((p) => p[1]).concat((s.band || []).flatMap((b) => [b[1], b[2]])));
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  let [x0, x1] = [xs.reduce((a, b) => Math.min(a, b)), xs.reduce((a, b) => Math.max(a, b))];
  let [y0, y1] = [ys.reduce((a, b) => Math.min(a, b)), ys.reduce((a, b) => Math.max(a, b))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const fmt = (v) => Number(v.toPrecision(4)).toString();
  // The y labels end at the plot's left edge: leave room for the longest (a 10px digit or sign is ~6px
  // wide), or a label like "-0.01179" starts left of the chart and loses its minus sign.
  const left = Math.max(48, 10 + 6 * Math.max(fmt(y0).length, fmt(y1).length));
  const sx = (x) => (left + (x - x0) / (x1 - x0) * (width - left - right)).toFixed(1);
  const sy = (y) => (top + (y1 - y) / (y1 - y0) * (height - top - bottom)).toFixed(1);
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("width", width); svg.setAttribute("height", height); svg.dataset.key = key;
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  };
  add("text", { x: left, y: 12, "font-size": 12 }, title);
  add("rect", { x: left, y: top, width: width - left - right, height: height - top - bottom, fill: "none", stroke: "#ccc" });
  add("text", { x: left - 4, y: top + 8, "text-anchor": "end", "font-size": 10 }, fmt(y1));
  add("text", { x: left - 4, y: height - bottom, "text-anchor": "end", "font-size": 10 }, fmt(y0));
  add("text", { x: left, y: height - 8, "font-size": 10 }, `step ${x0}`);
  add("text", { x: width - right, y: height - 8, "text-anchor": "end", "font-size": 10 }, `${x1}`);
  let legendX = left;
  for (const s of series) {
    const colour = RUN_COLOURS[s.name];
    if (s.band) {
      const edge = s.band.map((b) => `${sx(b[0])},${sy(b[2])}`).concat(s.band.slice().reverse().map((b) => `${sx(b[0])},${sy(b[1])}`));
      add("polygon", { points: edge.join(" "), fill: colour, "fill-opacity": 0.2, class: "band" });
    }
    const line = add("polyline", { points: s.points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none",
                                   stroke: colour, "stroke-width": 1.3, class: `series ${s.name}` });
    if (s.dashed) line.setAttribute("stroke-dasharray", "4 3");
    line.dataset.points = s.points.length;
    if (s.dots) s.points.forEach((p) => add("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: colour }));
    add("text", { x: legendX, y: 25, "font-size": 10, fill: colour }, s.name);
    legendX += 8 + 6 * s.name.length;
  }
  return svg;
}

// The series of one chart: `key` over the training records, `val_${key}` where held-out records have it.
function runSeries(records, key, valKey) {
  const points = (k) => records.filter((r) => typeof r[k] === "number" && typeof r.step === "number")
                               .map((r) => [r.step, r[k]]);
  const series = [{ name: "train", points: points(key) }];
  const held = points(valKey);
  if (held.length) series.push({ name: "validation", points: held, dots: true });
  return series.filter((s) => s.points.length);
}

function drawRun(data) {
  const panel = $("run-panel"), charts = $("run-charts");
  if (data.run === null) {
    charts.textContent = ""; panel.dataset.steps = 0; runShown = "";
    showStatus($("run-status"), data.reason);
    return;
  }
  const records = data.records, last = records[records.length - 1];
  const shown = `${records.length}:${JSON.stringify(last)}`;
  if (shown === runShown) return;
  runShown = shown;
  const loss = runSeries(records, "train_loss", "val_loss");
  const drawn = loss.length ? [lineChart(data.signals.length ? "training objective" : "loss (nats/token)", loss, "loss")] : [];
  for (const [key, title] of data.signals) {
    const series = runSeries(records, key, `val_${key}`);
    const train = records.filter((r) => typeof r[key] === "number");
    if (key === "reward" && train.every((r) => typeof r.reward_std === "number")) {
      series[0].band = train.map((r) => [r.step, r.reward - r.reward_std, r.reward + r.reward_std]);
    }
    if (key === "completion_length" && train.every((r) => typeof r.completion_length_max === "number")) {
      series.push({ name: "longest", points: runSeries(records, "completion_length_max")[0].points, dashed: true });
    }
    if (key === "rewards/chosen" && series.length) {  // both answers' rewards: both falling is a collapse
      series[0].name = "chosen";
      const rejected = runSeries(records, "rewards/rejected")[0];
      if (rejected) series.push({ name: "rejected", points: rejected.points, dashed: true });
    }
    if (series.length) drawn.push(lineChart(title, series, key));
  }
  charts.textContent = "";
  drawn.forEach((svg) => charts.appendChild(svg));
  const steps = records.filter((r) => typeof r.step === "number").map((r) => r.step);
  panel.dataset.steps = steps.length;
  showStatus($("run-status"), `${data.run}: ${records.length} records` +
             (steps.length ? `, up to step ${steps[steps.length - 1]}` : "") + `; refreshed every ${RUN_REFRESH_MS / 1000} s`);
}

// Polls while the server has a run to show; a model from no run answers once and the polling stops.
async function refreshRun() {
  if (document.hidden) return;
  try {
    const response = await fetch("/api/run");
    const data = await response.json();
    if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
    drawRun(data);
    if (data.run === null) clearInterval(refreshRun.timer);
  } catch (err) { showError($("run-status"), err); }
}

function startRunPanel() {
  refreshRun.timer = setInterval(refreshRun, RUN_REFRESH_MS);
  return refreshRun();
}

function wireControls() {
  $("generate").onclick = generate;
  $("inspect-generation").onclick = inspectGeneration;
  $("stop").onclick = () => gen.controller && gen.controller.abort();
  $("score").onclick = scoreText;
  $("show-attention").onclick = showAttention;
  $("layer").onchange = $("head").onchange = showAttention;
  $("show-lens").onclick = showLens;
  $("show-experts").onclick = showExperts;
  $("show-dla").onclick = showAttribution;
  $("dla-token").onchange = () => { $("dla-token-text").value = ""; showAttribution(); };  // the list's token wins
  $("inspect-text").addEventListener("input", () => { $("dla-token").value = ""; });  // a new text: its top prediction
  $("show-scores").onclick = showHeadScores;
  $("show-patching").onclick = showPatching;
  for (const id of ["temperature", "top-k", "top-p"]) $(id).oninput = controlsChanged;
}

// Start-up survives any model: the controls are wired first, each later step that can fail says so on
// the page (and anything else that escapes lands in the status line under the header).
async function start() {
  window.addEventListener("unhandledrejection", (event) => showError($("page-status"), event.reason));
  wireControls();
  startRunPanel();  // the run's curves need no model info: they show even if /api/info fails
  try {
    const response = await fetch("/api/info");
    info = await response.json();
    if (!response.ok) throw new Error(info.error ? info.error.message : response.statusText);
  } catch (err) {
    info = null;
    showError($("model-info"), err);
    return;
  }
  $("model-info").textContent = `${info.model}: ${(info.parameters / 1e6).toFixed(2)}M parameters, ` +
    `${info.n_layers} layers × ${info.n_heads} heads, context ${info.context_length}, ${info.tokenizer} tokenizer`;
  for (let i = 0; i < info.n_layers; i++) $("layer").add(new Option(String(i), String(i)));
  for (let i = 0; i < info.n_heads; i++) $("head").add(new Option(String(i), String(i)));
  $("show-experts").hidden = $("experts-view").hidden = !info.n_experts;  // a mixture of experts only
  applyDefaults(info.defaults);
  try { await defaultNewTokens(); } catch (err) { showError($("gen-status"), err); }
  document.body.dataset.ready = "true";
}
start();
