// The e4kv chat page: streams /v1/chat/completions (SSE over fetch, so Stop can abort it) and
// polls /metrics for the KV cache panel. Plain script, no build step, nothing from other hosts.
"use strict";

const $ = (id) => document.getElementById(id);

const history = [];        // [{role, content}] sent with every request
let modelName = null;      // from /v1/models
let controller = null;     // AbortController of the answer being streamed
let epoch = 0;             // bumped by "New chat", so an answer that ends later stays out of it

// ---------- requests ----------

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The server answers errors as {"error": {"message", "type", "param", "code"}}; anything else
// (a proxy's page, a dropped connection) is reported by its status line.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}${text ? ": " + text.slice(0, 200) : ""}`;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) {
      $("model-name").textContent = "(unknown)";
      showError(`/v1/models: ${await errorMessage(response)}` +
                (response.status === 401 ? " (set the API key)" : ""));
      return;
    }
    const body = await response.json();
    modelName = body.data && body.data.length ? body.data[0].id : null;
    $("model-name").textContent = modelName || "(none)";
    showError("");
  } catch (e) {
    showError(`/v1/models: ${e.message}`);
  }
}

// ---------- sampling knobs ----------

// [input id, request field, parser]; an empty field is not sent (the server's default applies).
const KNOBS = [
  ["temperature", "temperature", parseFloat],
  ["top-p", "top_p", parseFloat],
  ["top-k", "top_k", (s) => parseInt(s, 10)],
  ["min-p", "min_p", parseFloat],
  ["max-tokens", "max_tokens", (s) => parseInt(s, 10)],
  ["seed", "seed", (s) => parseInt(s, 10)],
  ["presence-penalty", "presence_penalty", parseFloat],
  ["frequency-penalty", "frequency_penalty", parseFloat],
  ["repetition-penalty", "repetition_penalty", parseFloat],
];

function samplingFields() {
  const fields = {};
  for (const [id, field, parse] of KNOBS) {
    const text = $(id).value.trim();
    if (text === "") continue;
    const value = parse(text);
    if (Number.isNaN(value)) throw new Error(`${field}: "${text}" is not a number`);
    fields[field] = value;
  }
  return fields;
}

// ---------- the conversation ----------

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  item.append(label);
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const finish = document.createElement("span");
  finish.className = "finish";
  item.append(reasoning, content, finish);
  $("conversation").append(item);
  item.scrollIntoView({ block: "end" });
  return { item, reasoning, content, finish };
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("state").textContent = busy ? "generating..." : "";
}

// Yields the data of each SSE event of a fetch response body ("data: ...\n\n", several data
// lines joined by "\n"); comments and other fields are skipped.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5));
      if (data.length) yield data.join("\n");
    }
  }
}

async function send(text) {
  showError("");
  let fields;
  try {
    fields = samplingFields();
  } catch (e) {
    showError(e.message);
    return;
  }
  const turnEpoch = epoch;
  const remember = (message) => { if (turnEpoch === epoch) history.push(message); };
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const view = addMessage("assistant", "");
  view.item.dataset.state = "streaming";

  controller = new AbortController();
  setBusy(true);
  let answer = "";
  let finishReason = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ model: modelName || undefined, messages: history, stream: true,
                             stream_options: { include_usage: true }, ...fields }),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    let usage = null;
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        view.reasoning.hidden = false;
        view.reasoning.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        answer += delta.content;
        view.content.textContent = answer;
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
      view.item.scrollIntoView({ block: "end" });
    }
    view.item.dataset.state = "done";
    view.finish.textContent = `finish: ${finishReason || "?"}` +
      (usage ? ` · ${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens` : "");
    remember({ role: "assistant", content: answer });
  } catch (e) {
    if (e.name === "AbortError") {
      // The partial answer stays in the conversation, as the user saw it.
      view.item.dataset.state = "stopped";
      view.finish.textContent = "stopped";
      remember({ role: "assistant", content: answer });
    } else {
      view.item.dataset.state = "error";
      view.finish.textContent = "error";
      if (turnEpoch === epoch) history.pop();  // the failed turn is not sent again
      showError(e.message);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
}

// ---------- the KV cache panel ----------

// Prometheus text format 0.0.4 -> Map(name -> [{labels, value}]).
function parsePrometheus(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value: Number(m[3]) });
  }
  return samples;
}

const DTYPE_NAMES = { fp8_e4m3: "E4M3", fp16: "FP16" };
const fmt = (n) => (Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "-");

async function pollMetrics() {
  try {
    const response = await fetch("/metrics");
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    const samples = parsePrometheus(await response.text());
    const value = (name) => {
      const s = samples.get(`e4kv:${name}`);
      return s && s.length ? s[0].value : NaN;
    };
    const info = (samples.get("e4kv:kv_cache_info") || [{ labels: {} }])[0].labels;
    $("kv-dtype").textContent = DTYPE_NAMES[info.kv_cache_dtype] || info.kv_cache_dtype || "-";
    $("kv-scales").textContent = info.scales || "-";
    const used = value("kv_cache_blocks_used");
    const total = value("kv_cache_blocks_total");
    const usage = value("kv_cache_usage_perc");
    $("kv-block-size").textContent = info.block_size ? `${info.block_size} tokens` : "-";
    $("kv-blocks").textContent = `${fmt(used)} / ${fmt(total)}`;
    $("kv-usage").textContent = Number.isFinite(usage) ? `${(usage * 100).toFixed(1)} %` : "-";
    $("kv-meter").value = Number.isFinite(usage) ? usage : 0;
    $("kv-pool-tokens").textContent = fmt(value("kv_cache_pool_tokens"));
    $("kv-fp16-tokens").textContent = fmt(value("kv_cache_fp16_equivalent_tokens"));
    $("req-running").textContent = fmt(value("num_requests_running"));
    $("req-waiting").textContent = fmt(value("num_requests_waiting"));
    $("preemptions").textContent = fmt(value("num_preemptions_total"));
    $("metrics-state").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("metrics-state").textContent = `/metrics: ${e.message}`;
  }
}

// ---------- wiring ----------

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("chat-form").requestSubmit();
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  epoch += 1;
  history.length = 0;
  $("conversation").replaceChildren();
  showError("");
});
$("api-key").addEventListener("change", loadModel);

loadModel();
pollMetrics();
setInterval(pollMetrics, 2000);
