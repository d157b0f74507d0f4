// Starts `e4kv serve` on the embedded tiny model for the tests, and small HTTP helpers.
import { spawn } from "node:child_process";
import { mkdirSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

// E4KV_SOURCE_DIR when CTest runs a copy of these files from the build directory.
export const repoRoot = process.env.E4KV_SOURCE_DIR ||
                        resolve(dirname(fileURLToPath(import.meta.url)), "../..");
export const cliPath = process.env.E4KV_CLI || join(repoRoot, "build/e4kv");
export const tinyModel = join(repoRoot, "models/tiny-qwen4exp");
export const qwen3Template = join(repoRoot, "tests/data/chat_templates/qwen3/template.jinja");

// The model has no calibrated K/V scales, so the E4M3 cache runs with unit scales (the
// negative control); the tests only need a cache, and FP16 is the server's other dtype.
//
// One sequence's states (QSA raw rings, recurrent and conv states) take 431104 bytes and one block
// of 64 tokens 69632 bytes in FP16, 36864 in E4M3 (`e4kv capacity models/tiny-qwen4exp`).
export const SEQ_STATE_BYTES = 431104;
export const BLOCK_BYTES = { fp16: 69632, fp8_e4m3: 36864 };

// The bytes of --kv-cache-memory-bytes for max_num_seqs states plus n_blocks blocks.
export function poolBytes(maxNumSeqs, nBlocks, dtype = "fp16") {
  return maxNumSeqs * SEQ_STATE_BYTES + nBlocks * BLOCK_BYTES[dtype];
}

export function outDir() {
  const dir = process.env.E4KV_TEST_OUT || join(repoRoot, "tests/serve_js/out");
  mkdirSync(dir, { recursive: true });
  return dir;
}

const LISTENING = /^e4kv serve: listening on (http:\/\/\S+)\s*$/;

// Spawns `e4kv serve MODEL --port 0 ARGS...`, waits for its "listening on" line and for /health
// 200. The returned server's stop() fails if the process had exited by itself, then sends
// SIGTERM and returns the exit code.
export async function startServer(args, { startTimeoutMs = 180_000 } = {}) {
  const child = spawn(cliPath, ["serve", tinyModel, "--port", "0", ...args],
                      { stdio: ["ignore", "pipe", "pipe"] });
  let stderr = "";
  child.stderr.setEncoding("utf8");
  child.stderr.on("data", (s) => { stderr = (stderr + s).slice(-16_000); });
  const exit = new Promise((done) => child.on("exit", (code, signal) => done({ code, signal })));
  let exited = null;
  exit.then((e) => { exited = e; });
  const failure = (why) => new Error(`e4kv serve ${args.join(" ")}: ${why}\n--- stderr ---\n${stderr}`);

  const url = await new Promise((done, fail) => {
    let stdout = "";
    const timer = setTimeout(() => fail(failure("no 'listening on' line")), startTimeoutMs);
    child.on("error", (e) => { clearTimeout(timer); fail(failure(e.message)); });
    exit.then((e) => { clearTimeout(timer); fail(failure(`exited (${JSON.stringify(e)}) before listening`)); });
    child.stdout.setEncoding("utf8");
    child.stdout.on("data", (s) => {
      stdout += s;
      for (const line of stdout.split("\n")) {
        const m = LISTENING.exec(line);
        if (m) { clearTimeout(timer); done(m[1]); }
      }
    });
  });

  const deadline = Date.now() + startTimeoutMs;
  for (;;) {
    if (exited) throw failure("exited before /health answered 200");
    try {
      if ((await fetch(`${url}/health`)).status === 200) break;
    } catch (_) { /* not accepting yet */ }
    if (Date.now() > deadline) throw failure("/health never answered 200");
    await new Promise((r) => setTimeout(r, 200));
  }

  return {
    url,
    child,
    stderr: () => stderr,
    alive: () => exited === null,
    async stop() {
      if (exited) throw failure(`exited by itself (${JSON.stringify(exited)})`);
      child.kill("SIGTERM");
      const e = await exit;
      return e;
    },
  };
}

// Prometheus text -> Map(name -> [{labels, value}]).
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) throw new Error(`/metrics: a line that is not a sample: ${line}`);
    const labels = {};
    for (const l of (m[2] || "").matchAll(/([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]] = l[2];
    }
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value: Number(m[3]) });
  }
  return samples;
}

export async function metrics(url) {
  const response = await fetch(`${url}/metrics`);
  if (response.status !== 200) throw new Error(`/metrics: HTTP ${response.status}`);
  return parseMetrics(await response.text());
}

// The value of a metric with one sample (or the sum of the samples matching `where`).
export function metricValue(samples, name, where = {}) {
  const list = (samples.get(name) || []).filter((s) =>
    Object.entries(where).every(([k, v]) => s.labels[k] === v));
  if (list.length === 0) throw new Error(`/metrics has no ${name} ${JSON.stringify(where)}`);
  return list.reduce((sum, s) => sum + s.value, 0);
}

export async function postJson(url, path, body, apiKey) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const response = await fetch(`${url}${path}`, { method: "POST", headers, body: JSON.stringify(body) });
  const text = await response.text();
  if (response.status !== 200) throw new Error(`${path}: HTTP ${response.status}: ${text}`);
  return JSON.parse(text);
}
