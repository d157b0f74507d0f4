// Load on `e4kv serve`: 64 concurrent clients for LOAD_SECONDS (default 60) with a KV pool small
// enough to force preemption; a mix of streamed and whole chat/completion requests with random
// max_tokens, and about 10% of the clients dropping their streams midway.
//
//   node load.mjs                 starts the server on the tiny model, prints one JSON line
//   E4KV_SERVE_URL=http://... node load.mjs   drives a server already running instead
//
// runLoad() returns the figures and the list of failed checks; load.test.mjs asserts on them.
import { pathToFileURL } from "node:url";
import { metrics, metricValue, poolBytes, qwen3Template, startServer } from "./serve.mjs";

const PROMPTS = [
  "The Debian package",
  "Tell me about the Python standard library.",
  "git rebase moves",
  "SQLite is a",
  "The manual page of ls says",
  "How do I install a package with apt? Explain each step and the options it takes.",
];

const pick = (list) => list[Math.floor(Math.random() * list.length)];
const randomInt = (lo, hi) => lo + Math.floor(Math.random() * (hi - lo + 1));

function percentile(values, p) {
  if (values.length === 0) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

// Parses a whole SSE body as it arrives: calls onData(data) per event.
async function readSse(body, onData) {
  const decoder = new TextDecoder();
  let buffer = "";
  for await (const bytes of body) {
    buffer += decoder.decode(bytes, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5)).join("\n");
      if (event.split("\n").some((l) => l.startsWith("data:"))) onData(data);
    }
  }
  if (buffer.trim() !== "") throw new Error(`stream ended inside an event: ${JSON.stringify(buffer)}`);
}

// One request; resolves to a record, never rejects (a failure is a record with `problem`).
async function oneRequest(url, apiKey, { chat, stream, maxTokens, abortAfterChunks }) {
  const prompt = pick(PROMPTS);
  const body = chat ? { messages: [{ role: "user", content: prompt }] } : { prompt };
  Object.assign(body, { max_tokens: maxTokens, temperature: Math.random() < 0.5 ? 0 : 0.8 });
  if (stream) body.stream = true;
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const path = chat ? "/v1/chat/completions" : "/v1/completions";
  const record = { chat, stream, ids: [], start: performance.now(), ttft: null, latency: null,
                   finish: null, completionTokens: 0, aborted: false, error: null, problem: null };
  const controller = new AbortController();
  try {
    const response = await fetch(`${url}${path}`, { method: "POST", headers, body: JSON.stringify(body),
                                                    signal: controller.signal });
    if (response.status !== 200) {
      const text = await response.text();
      let error = null;
      try { error = JSON.parse(text).error; } catch (_) { /* checked below */ }
      if (!error || typeof error.message !== "string" || error.code !== response.status) {
        record.problem = `HTTP ${response.status} without an error object: ${text.slice(0, 200)}`;
      } else {
        record.error = `${response.status}: ${error.message}`;
      }
      return record;
    }
    if (!stream) {
      const r = await response.json();
      record.latency = performance.now() - record.start;
      record.ids.push(r.id);
      record.finish = r.choices[0].finish_reason;
      record.completionTokens = r.usage.completion_tokens;
      if (!["stop", "length"].includes(record.finish)) record.problem = `finish_reason ${record.finish}`;
      return record;
    }
    let chunks = 0;
    let done = 0;
    let afterDone = 0;
    const finishes = [];
    const ids = new Set();
    await readSse(response.body, (data) => {
      if (done) { ++afterDone; return; }
      if (data === "[DONE]") { ++done; return; }
      const chunk = JSON.parse(data);
      if (chunk.error) {
        record.error = `in stream: ${chunk.error.message}`;
        if (typeof chunk.error.message !== "string") record.problem = `error event ${data}`;
        return;
      }
      ids.add(chunk.id);
      for (const c of chunk.choices) {
        const text = chat ? c.delta.content : c.text;
        if (record.ttft === null && (text || c.finish_reason)) record.ttft = performance.now() - record.start;
        if (c.finish_reason) finishes.push(c.finish_reason);
      }
      ++chunks;
      if (abortAfterChunks && chunks >= abortAfterChunks && finishes.length === 0) {
        record.aborted = true;
        controller.abort();
      }
    });
    record.latency = performance.now() - record.start;
    record.ids.push(...ids);
    record.finish = finishes[0] || null;
    if (ids.size !== 1) record.problem = `${ids.size} ids in one stream`;
    // A stream ends with one [DONE], also after an error event (a cut stream is a problem).
    else if (done !== 1 || afterDone !== 0) record.problem = `[DONE] ${done} times, ${afterDone} events after it`;
    else if (record.error === null && (finishes.length !== 1 || !["stop", "length"].includes(finishes[0]))) {
      record.problem = `finish_reasons ${JSON.stringify(finishes)}`;
    }
  } catch (e) {
    if (record.aborted && e.name === "AbortError") return record;
    record.problem = `${e.name}: ${e.message}`;
  }
  return record;
}

async function client(url, apiKey, deadline, { drops }, records) {
  while (performance.now() < deadline) {
    const stream = drops || Math.random() < 0.5;
    const maxTokens = randomInt(1, 160);
    const abortAfterChunks = drops ? randomInt(1, 8) : 0;
    records.push(await oneRequest(url, apiKey, { chat: Math.random() < 0.5, stream, maxTokens,
                                                 abortAfterChunks }));
  }
}

// Waits until the server has no request and no block in use (the aborted ones are freed when the
// server notices the closed connections); returns the last metrics.
async function settle(url, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const m = await metrics(url);
    const busy = metricValue(m, "e4kv:num_requests_running") + metricValue(m, "e4kv:num_requests_waiting") +
                 metricValue(m, "e4kv:kv_cache_blocks_used");
    if (busy === 0 || Date.now() > deadline) return m;
    await new Promise((r) => setTimeout(r, 250));
  }
}

export async function runLoad({ seconds = Number(process.env.LOAD_SECONDS || 60), clients = 64,
                                url = process.env.E4KV_SERVE_URL, apiKey = process.env.E4KV_API_KEY } = {}) {
  let server = null;
  if (!url) {
    // 16 sequences of up to ~200 tokens (4 blocks each) against 12 FP16 blocks: preemption.
    server = await startServer(["--chat-template", qwen3Template, "--max-num-seqs", "16",
                                "--max-model-len", "512", "--max-connections", "256",
                                "--kv-cache-dtype", "fp16",
                                "--kv-cache-memory-bytes", String(poolBytes(16, 12, "fp16"))]);
    url = server.url;
  }
  const failures = [];
  const records = [];
  try {
    const before = await metrics(url);
    const start = performance.now();
    const deadline = start + seconds * 1000;
    const nDrop = Math.round(clients / 10);
    await Promise.all(Array.from({ length: clients }, (_, i) =>
      client(url, apiKey, deadline, { drops: i < nDrop }, records)));
    const elapsed = (performance.now() - start) / 1000;

    const after = await settle(url, 30_000);
    for (const r of records) if (r.problem) failures.push(`a request: ${r.problem}`);
    const ids = records.flatMap((r) => r.ids);
    if (new Set(ids).size !== ids.length) failures.push(`${ids.length - new Set(ids).size} repeated response ids`);
    for (const name of ["num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"]) {
      const v = metricValue(after, `e4kv:${name}`);
      if (v !== 0) failures.push(`after the run e4kv:${name} = ${v}, not 0`);
    }
    const preemptions = metricValue(after, "e4kv:num_preemptions_total") -
                        metricValue(before, "e4kv:num_preemptions_total");
    if (server && preemptions <= 0) failures.push("no preemption: the pool was not small enough");
    if (server && !server.alive()) failures.push("the server exited");

    // The server's own count of finished requests against ours: each completed request is one
    // stop/length; an aborted one is an abort, or stop/length when it ended before the server
    // saw the closed connection.
    const completed = records.filter((r) => !r.problem && !r.error && !r.aborted);
    const aborted = records.filter((r) => r.aborted);
    const finished = (m) => metricValue(m, "e4kv:request_success_total", { finished_reason: "stop" }) +
                            metricValue(m, "e4kv:request_success_total", { finished_reason: "length" });
    const nFinished = finished(after) - finished(before);
    if (nFinished < completed.length || nFinished > completed.length + aborted.length) {
      failures.push(`request_success_total stop+length grew by ${nFinished}; ` +
                    `${completed.length} completed, ${aborted.length} aborted`);
    }
    // Every request that reached the engine is counted once, under one of the four reasons.
    const all = (m) => metricValue(m, "e4kv:request_success_total");
    const errors = records.filter((r) => r.error);
    if (errors.length === 0 && all(after) - all(before) !== completed.length + aborted.length) {
      failures.push(`request_success_total (all reasons) grew by ${all(after) - all(before)}, not ` +
                    `${completed.length} completed + ${aborted.length} aborted`);
    }
    const generated = metricValue(after, "e4kv:generation_tokens_total") -
                      metricValue(before, "e4kv:generation_tokens_total");
    const counted = completed.reduce((s, r) => s + r.completionTokens, 0);
    if (generated < counted) failures.push(`generation_tokens_total grew by ${generated} < ${counted} in usage`);

    const ttft = completed.filter((r) => r.stream && r.ttft !== null).map((r) => r.ttft);
    const latency = completed.map((r) => r.latency);
    const round = (x) => (x === null ? null : Math.round(x * 10) / 10);
    const figures = {
      clients, seconds: round(elapsed), requests: records.length, completed: completed.length,
      aborted: aborted.length, errors: errors.length,
      requests_per_s: round(completed.length / elapsed),
      ttft_p50_ms: round(percentile(ttft, 50)), ttft_p99_ms: round(percentile(ttft, 99)),
      latency_p50_ms: round(percentile(latency, 50)), latency_p99_ms: round(percentile(latency, 99)),
      preemptions,
    };
    if (completed.length === 0) failures.push("no request completed");
    return { figures, failures, errors: errors.map((r) => r.error) };
  } finally {
    if (server) {
      const exit = await server.stop().catch((e) => ({ error: e.message }));
      if (exit.code !== 0) failures.push(`the server's exit: ${JSON.stringify(exit)}`);
    }
  }
}

if (import.meta.url === pathToFileURL(process.argv[1]).href) {
  const { figures, failures } = await runLoad();
  console.log(JSON.stringify(figures));
  for (const f of failures) console.error(`load: ${f}`);
  process.exit(failures.length ? 1 : 0);
}
