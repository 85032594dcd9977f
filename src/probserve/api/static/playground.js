// probserve playground: tokens coloured by probability, their alternatives, branches, scoring.
// No dependencies, no build step; talks to this server's own OpenAI-compatible API.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  mode: "complete",
  key: null, // an API key, kept in memory only
  branches: [], // {id, parent, label, prompt, messages, columns: [{model, tokens}]}
  current: null,
  running: false,
};

// ---- the API ------------------------------------------------------------------------------------

async function api(path, body) {
  const headers = { "content-type": "application/json" };
  if (state.key) headers.authorization = `Bearer ${state.key}`;
  const r = await fetch(path, body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body) });
  if (r.status === 401) {
    $("key-box").hidden = false;
    $("key").focus();
    throw new Error("this server needs an API key");
  }
  if (!r.ok) {
    let msg = `${r.status}`;
    try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  return r;
}

async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message);
        yield obj;
      }
    }
  }
}

function settings() {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  const s = {
    temperature: num("temperature"),
    top_p: num("top_p"),
    top_k: num("top_k") || undefined,
    max_tokens: $("step").checked ? 1 : num("max_tokens"),
    logprobs_mode: $("mode").value,
    return_entropy: true,
  };
  if (num("seed") !== null) s.seed = num("seed");
  return s;
}

const K = () => Math.max(0, Math.min(20, Number($("k").value) || 0));

// ---- tokens ------------------------------------------------------------------------------------
// A token: {text, bytes (or null), logprob (null: the first prompt token), top: [{token, logprob}],
//           entropy, prompt: bool}

function fromCompletion(lp, prompt) {
  const out = [];
  for (let j = 0; j < lp.tokens.length; j++) {
    const top = lp.top_logprobs[j]
      ? Object.entries(lp.top_logprobs[j]).map(([token, logprob]) => ({ token, logprob }))
      : [];
    top.sort((a, b) => b.logprob - a.logprob);
    out.push({
      text: lp.tokens[j], bytes: null, logprob: lp.token_logprobs[j], top,
      entropy: lp.entropy ? lp.entropy[j] : null, prompt,
    });
  }
  return out;
}

function fromChat(entries) {
  return entries.map((e) => ({
    text: e.token, bytes: e.bytes, logprob: e.logprob,
    top: e.top_logprobs.map((t) => ({ token: t.token, logprob: t.logprob, bytes: t.bytes })),
    entropy: e.entropy ?? null, prompt: false,
  }));
}

function rank(tok) {
  const i = tok.top.findIndex((t) => t.token === tok.text);
  if (i >= 0) return String(i + 1);
  return tok.top.length ? `>${tok.top.length}` : "?";
}

function topkEntropyBound(tok) {
  // -sum p log p over the returned alternatives: a lower bound of the true entropy
  return tok.top.reduce((h, t) => h - Math.exp(t.logprob) * t.logprob, 0);
}

// ---- colour --------------------------------------------------------------------------------------

function value(tok) {
  const scale = $("scale").value;
  if (tok.logprob === null) return null;
  if (scale === "prob") return Math.exp(tok.logprob);
  if (scale === "surprisal") return Math.min(1, -tok.logprob / 10);
  return tok.entropy === null ? null : Math.min(1, tok.entropy / 6);
}

function colour(v, scale) {
  if (v === null) return "transparent";
  // probability: red (unlikely) to green (likely); surprisal and entropy: green (low) to red
  const t = scale === "prob" ? v : 1 - v;
  return `hsl(${Math.round(120 * t)}, 75%, 82%)`;
}

function legend() {
  const scale = $("scale").value;
  const labels = {
    prob: ["p = 0", "p = 1", "probability of the token"],
    surprisal: ["0 nats", "≥ 10 nats", "surprisal, -log p"],
    entropy: ["0 nats", "≥ 6 nats", "entropy of the full distribution at that position (exact)"],
  }[scale];
  const a = colour(0, scale), b = colour(1, scale);
  $("legend").innerHTML = "";
  const left = document.createElement("span"); left.textContent = labels[0];
  const bar = document.createElement("span"); bar.className = "bar";
  bar.style.background = `linear-gradient(to right, ${a}, ${b})`;
  const right = document.createElement("span"); right.textContent = labels[1];
  const what = document.createElement("span"); what.textContent = `— ${labels[2]}; focus or hover a token for its figures`;
  $("legend").append(left, bar, right, what);
}

// ---- rendering -----------------------------------------------------------------------------------

function fmt(x, d = 4) { return x === null || x === undefined ? "—" : Number(x).toFixed(d); }

function escapeToken(text) {
  return JSON.stringify(text).slice(1, -1);
}

function renderColumn(col, container, branch, colIndex) {
  const div = document.createElement("div");
  div.className = "column";
  const h = document.createElement("h3");
  h.textContent = col.model;
  const text = document.createElement("div");
  text.className = "text";
  text.dataset.model = col.model;
  col.tokens.forEach((tok, i) => {
    const span = document.createElement("span");
    span.className = "tok" + (tok.prompt ? " prompt" : "");
    span.tabIndex = 0;
    span.textContent = tok.display ?? tok.text;
    span.dataset.index = String(i);
    span.dataset.token = tok.text;
    span.dataset.logprob = tok.logprob === null ? "" : String(tok.logprob);
    span.style.background = colour(value(tok), $("scale").value);
    span.setAttribute("aria-label", `${escapeToken(tok.text)}, logprob ${fmt(tok.logprob)}`);
    const show = () => showPopover(span, tok, branch, colIndex, i);
    span.addEventListener("mouseenter", show);
    span.addEventListener("focus", show);
    span.addEventListener("keydown", (ev) => { if (ev.key === "Escape") hidePopover(); });
    text.append(span);
  });
  div.append(h, text);
  container.append(div);
}

function render() {
  const out = $("outputs");
  out.innerHTML = "";
  const branch = state.branches.find((b) => b.id === state.current);
  if (branch) branch.columns.forEach((col, ci) => renderColumn(col, out, branch, ci));
  renderTree();
  legend();
}

function renderTree() {
  const ol = $("branches");
  ol.innerHTML = "";
  const children = (parent) => state.branches.filter((b) => b.parent === parent);
  const add = (list, b) => {
    const li = document.createElement("li");
    if (b.id === state.current) li.className = "current";
    const btn = document.createElement("button");
    btn.textContent = b.label;
    btn.addEventListener("click", () => { state.current = b.id; render(); });
    li.append(btn);
    const kids = children(b.id);
    if (kids.length) {
      const sub = document.createElement("ol");
      kids.forEach((k) => add(sub, k));
      li.append(sub);
    }
    list.append(li);
  };
  children(null).forEach((b) => add(ol, b));
}

function showPopover(span, tok, branch, colIndex, index) {
  const pop = $("popover");
  pop.innerHTML = "";
  const head = document.createElement("div");
  const bytes = tok.bytes ? ` bytes [${tok.bytes.join(", ")}]` : "";
  head.textContent = `"${escapeToken(tok.text)}"${bytes}`;
  const facts = document.createElement("div");
  if (tok.logprob === null) {
    facts.textContent = "first token: no context, no logprob";
  } else {
    const bound = tok.top.length ? ` · top-${tok.top.length} entropy ≥ ${fmt(topkEntropyBound(tok), 3)}` : "";
    facts.textContent = `logprob ${fmt(tok.logprob)} · p ${fmt(Math.exp(tok.logprob))} · rank ${rank(tok)}` +
      (tok.entropy !== null ? ` · entropy ${fmt(tok.entropy, 3)} nats${bound}` : bound);
  }
  pop.append(head, facts);
  if (tok.top.length) {
    const table = document.createElement("table");
    tok.top.forEach((alt) => {
      const tr = document.createElement("tr");
      tr.className = "alt" + (alt.token === tok.text ? " chosen" : "");
      tr.tabIndex = 0;
      tr.dataset.token = alt.token;
      const p = Math.exp(alt.logprob);
      const c1 = document.createElement("td"); c1.textContent = `"${escapeToken(alt.token)}"`;
      const c2 = document.createElement("td"); c2.className = "barcell";
      const bar = document.createElement("div"); bar.className = "pbar"; bar.style.width = `${Math.max(1, p * 100)}%`;
      c2.append(bar);
      const c3 = document.createElement("td"); c3.textContent = `${fmt(alt.logprob, 3)} (${(p * 100).toFixed(1)}%)`;
      tr.append(c1, c2, c3);
      if (!tok.prompt && state.mode !== "score") {
        tr.title = "continue from this token (a new branch)";
        const go = () => branchFrom(branch, colIndex, index, alt.token);
        tr.addEventListener("click", go);
        tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter") go(); });
      }
      table.append(tr);
    });
    pop.append(table);
  }
  const r = span.getBoundingClientRect();
  pop.style.left = `${window.scrollX + r.left}px`;
  pop.style.top = `${window.scrollY + r.bottom + 4}px`;
  pop.hidden = false;
}

function hidePopover() { $("popover").hidden = true; }

// ---- runs --------------------------------------------------------------------------------------

function models() {
  const first = $("model").value;
  if ($("side").checked) {  // the chosen model beside the next one
    const others = Array.from($("model").options).map((o) => o.value).filter((v) => v !== first);
    return [first, ...others.slice(0, 1)];
  }
  return [first];
}

async function streamCompletion(model, prompt, col) {
  const body = { model, prompt, stream: true, logprobs: K(), ...settings() };
  const r = await api("/v1/completions", body);
  for await (const chunk of sse(r)) {
    const ch = chunk.choices && chunk.choices[0];
    if (!ch || !ch.logprobs) continue;
    col.tokens.push(...fromCompletion(ch.logprobs, false));
    render();
  }
}

async function streamChat(model, messages, col, extra = {}) {
  const body = { model, messages, stream: true, logprobs: true, top_logprobs: K(), ...settings(), ...extra };
  const r = await api("/v1/chat/completions", body);
  for await (const chunk of sse(r)) {
    const ch = chunk.choices && chunk.choices[0];
    if (!ch || !ch.logprobs || !ch.logprobs.content) continue;
    col.tokens.push(...fromChat(ch.logprobs.content));
    render();
  }
}

function newBranch(parent, label, prompt, messages) {
  const b = {
    id: state.branches.length + 1, parent, label, prompt, messages,
    columns: models().map((model) => ({ model, tokens: [] })),
  };
  state.branches.push(b);
  state.current = b.id;
  return b;
}

function textOf(tokens) { return tokens.map((t) => t.text).join(""); }

async function generate(branch) {
  await Promise.all(branch.columns.map((col) => {
    if (branch.messages) {
      if (!col.tokens.length) return streamChat(col.model, branch.messages, col);
      const messages = branch.messages.concat([{ role: "assistant", content: textOf(col.tokens) }]);
      return streamChatContinuation(col, messages);
    }
    return streamCompletion(col.model, branch.prompt + textOf(col.tokens), col);
  }));
}

async function branchFrom(branch, colIndex, index, token) {
  hidePopover();
  const col = branch.columns[colIndex];
  const kept = col.tokens.slice(0, index);
  const base = branch.prompt !== null ? branch.prompt + textOf(kept) : textOf(kept);
  const label = `…${token}`;
  const b = newBranch(branch.id, label, branch.prompt !== null ? base + token : null, branch.messages);
  b.columns = [{ model: col.model, tokens: [...kept, { text: token, bytes: null, logprob: null, top: [], entropy: null, prompt: true, display: token }] }];
  if (branch.messages) {
    // chat: the chosen alternative becomes the start of the assistant's message
    b.messages = branch.messages;
  }
  await run(async () => {
    if (branch.messages) {
      const prefix = textOf(b.columns[0].tokens);
      const messages = branch.messages.concat([{ role: "assistant", content: prefix }]);
      return streamChatContinuation(b.columns[0], messages);
    }
    return streamCompletion(col.model, b.prompt, b.columns[0]);
  });
}

function streamChatContinuation(col, messages) {
  // the model's own template with the partial answer left open as the last message
  return streamChat(col.model, messages, col, { add_generation_prompt: false, continue_final_message: true });
}

async function score() {
  const text = $("score-text").value;
  const b = newBranch(null, `score: ${text.slice(0, 20)}`, text, null);
  await Promise.all(b.columns.map(async (col) => {
    const r = await api("/v1/completions", {
      model: col.model, prompt: text, max_tokens: 0, echo: true, logprobs: K(), return_entropy: true,
    });
    const lp = (await r.json()).choices[0].logprobs;
    col.tokens = fromCompletion(lp, true);
  }));
  render();
  renderStats(b);
}

function renderStats(branch) {
  const box = $("stats");
  box.innerHTML = "";
  branch.columns.forEach((col) => {
    const scored = col.tokens.filter((t) => t.logprob !== null);
    const total = scored.reduce((s, t) => s + t.logprob, 0);
    const mean = scored.length ? total / scored.length : 0;
    const worst = [...scored].sort((a, b) => a.logprob - b.logprob).slice(0, 5);
    const h = document.createElement("h3"); h.textContent = col.model;
    const table = document.createElement("table");
    table.className = "score-stats";
    table.dataset.model = col.model;
    const rows = [["tokens scored", String(scored.length)], ["total logprob", fmt(total)],
      ["mean logprob", fmt(mean)], ["perplexity", fmt(Math.exp(-mean), 3)],
      ["least likely", worst.map((t) => `"${escapeToken(t.text)}" ${fmt(t.logprob, 2)}`).join(", ")]];
    rows.forEach(([k, v]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th"); th.textContent = k;
      const td = document.createElement("td"); td.textContent = v; td.dataset.stat = k;
      tr.append(th, td); table.append(tr);
    });
    box.append(h, table);
  });
}

async function run(work) {
  if (state.running) return;
  state.running = true;
  document.body.dataset.idle = "false";
  $("status").textContent = "running…";
  $("run").disabled = true;
  try {
    await work();
    $("status").textContent = "done";
  } catch (e) {
    $("status").textContent = `error: ${e.message}`;
  } finally {
    state.running = false;
    $("run").disabled = false;
    document.body.dataset.idle = "true";
  }
}

async function onRun() {
  document.body.dataset.idle = "false";
  $("stats").innerHTML = "";
  if (state.mode === "score") return run(score);
  const current = state.branches.find((b) => b.id === state.current);
  if ($("step").checked && current && state.mode !== "score" && current.columns[0].tokens.length
      && current.columns[0].tokens.some((t) => !t.prompt)) {
    return run(() => generate(current)); // one more token on the same branch
  }
  if (state.mode === "chat") {
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    messages.push({ role: "user", content: $("user").value });
    const b = newBranch(null, $("user").value.slice(0, 24), null, messages);
    return run(() => generate(b));
  }
  const b = newBranch(null, $("prompt").value.slice(0, 24), $("prompt").value, null);
  return run(() => generate(b));
}

function setMode(mode) {
  state.mode = mode;
  for (const m of ["complete", "chat", "score"]) {
    $(`tab-${m}`).setAttribute("aria-selected", String(m === mode));
    $(`in-${m}`).hidden = m !== mode;
  }
  $("run").textContent = mode === "score" ? "Score" : "Generate";
  $("step-label").hidden = mode === "score";
}

async function loadModels() {
  try {
    const r = await api("/v1/models");
    // one entry per model: an alias (a model's own name beside its served name) shares its root
    const roots = new Set();
    const list = [];
    for (const m of (await r.json()).data) {
      if (!roots.has(m.root || m.id)) { roots.add(m.root || m.id); list.push(m.id); }
    }
    $("model").innerHTML = "";
    for (const id of list) {
      const o = document.createElement("option"); o.value = id; o.textContent = id;
      $("model").append(o);
    }
    $("side-label").hidden = list.length < 2;
    examples();
  } catch (e) {
    $("status").textContent = `error: ${e.message}`;
  }
}

// ---- API examples: each route as a curl command for the selected model ------------------------

function exampleBodies(model) {
  const hi = [{ role: "user", content: "What is the capital of France?" }];
  return [
    ["Completion, the prompt scored too (echo)", "/v1/completions",
      { model, prompt: "The capital of France is", max_tokens: 5, logprobs: 3, echo: true }],
    ["Chat with logprobs and exact entropy", "/v1/chat/completions",
      { model, messages: hi, max_tokens: 8, logprobs: true, top_logprobs: 3, return_entropy: true }],
    ["Anthropic's Messages API (Claude Code, the anthropic SDK)", "/v1/messages",
      { model, max_tokens: 8, messages: hi, logprobs: true, top_logprobs: 2 }],
    ["Responses", "/v1/responses",
      { model, input: "What is the capital of France?", max_output_tokens: 8, top_logprobs: 2 }],
    ["Embeddings", "/v1/embeddings", { model, input: ["A cat sat on the mat.", "Paris is in France."] }],
    ["Rerank", "/v1/rerank",
      { model, query: "Where is Paris?", documents: ["Paris is the capital of France.", "Cats purr."], top_n: 2 }],
    ["The full distribution at chosen positions", "/v1/distributions",
      { model, prompt: "The capital of France is", positions: [1], encoding: "base64" }],
  ];
}

function examples() {
  const list = $("example-list");
  list.innerHTML = "";
  for (const [title, path, body] of exampleBodies($("model").value || "MODEL")) {
    const h = document.createElement("h3"); h.textContent = title;
    const pre = document.createElement("pre");
    pre.dataset.path = path;
    pre.dataset.body = JSON.stringify(body);
    const json = JSON.stringify(body).replaceAll("'", "'\\''");
    pre.textContent = `curl -s ${location.origin}${path} -H 'content-type: application/json' -d '${json}'`;
    list.append(h, pre);
  }
}

document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => setMode(b.dataset.mode)));
$("run").addEventListener("click", onRun);
$("scale").addEventListener("change", render);
$("model").addEventListener("change", examples);
$("key-ok").addEventListener("click", () => {
  state.key = $("key").value || null;
  $("key-box").hidden = true;
  loadModels();
});
document.addEventListener("click", (ev) => {
  if (!$("popover").contains(ev.target) && !ev.target.classList.contains("tok")) hidePopover();
});
legend();
loadModels();
document.body.dataset.idle = "true";
