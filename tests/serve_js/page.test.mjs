// The chat page (src/serve/page/) in headless Chromium against `e4kv serve`: the model name, the
// KV panel, a streamed answer equal to the API's, Stop, and an error from the server shown.
// Exits 77 (ctest's skip) when Debian's chromium is not installed; never downloads a browser.
import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { chromium } from "playwright-core";
import { metrics, metricValue, outDir, poolBytes, postJson, qwen3Template, startServer } from "./serve.mjs";

const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
if (!existsSync(CHROMIUM)) {
  console.log(`SKIP: ${CHROMIUM} is not installed (scripts/setup.sh installs Debian's chromium)`);
  process.exit(77);
}

const API_KEY = "page-key";
const QUESTION = "Tell me about Debian packages.";
let server;
let browser;
let page;
let model;
let seed;  // a seed whose answer to QUESTION is long (the tiny model's greedy answer is empty)

const chatApi = (body) => postJson(server.url, "/v1/chat/completions",
  { model, messages: [{ role: "user", content: QUESTION }], temperature: 0.8, seed, ...body }, API_KEY);

before(async () => {
  server = await startServer([
    "--chat-template", qwen3Template, "--api-key", API_KEY, "--max-num-seqs", "4",
    "--max-model-len", "2048", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", "unit",
    "--kv-cache-memory-bytes", String(poolBytes(4, 64, "fp8_e4m3")),
  ]);
  const models = await fetch(`${server.url}/v1/models`, { headers: { Authorization: `Bearer ${API_KEY}` } });
  model = (await models.json()).data[0].id;
  for (seed = 1; seed <= 12; ++seed) {
    if ((await chatApi({ max_tokens: 300 })).choices[0].finish_reason === "length") break;
  }
  assert.ok(seed <= 12, "no seed in 1..12 gives a 300-token answer");
  browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: ["--no-sandbox"] });
  page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
  page.setDefaultTimeout(60_000);
});

after(async () => {
  if (page) await page.screenshot({ path: join(outDir(), "page.png"), fullPage: true }).catch(() => {});
  if (browser) await browser.close();
  if (server) assert.deepEqual(await server.stop(), { code: 0, signal: null });
});

test("the page: model, KV panel, a streamed answer, Stop", { timeout: 300_000 }, async () => {
  await page.goto(server.url);
  assert.equal(await page.title(), "e4kv chat");

  // Without the key /v1/models is refused: the server's message is shown.
  await page.locator("#error").waitFor({ state: "visible" });
  assert.match(await page.locator("#error").textContent(), /401/);
  await page.fill("#api-key", API_KEY);
  await page.locator("#api-key").dispatchEvent("change");
  await page.waitForFunction((m) => document.getElementById("model-name").textContent === m, model);
  assert.equal(await page.locator("#error").isHidden(), true);

  // The KV panel, filled from /metrics.
  const m = await metrics(server.url);
  const total = metricValue(m, "e4kv:kv_cache_blocks_total");
  const poolTokens = metricValue(m, "e4kv:kv_cache_pool_tokens");
  await page.waitForFunction(() => document.getElementById("kv-dtype").textContent !== "-");
  assert.equal(await page.textContent("#kv-dtype"), "E4M3");
  assert.equal(await page.textContent("#kv-scales"), "unit");
  assert.equal(await page.textContent("#kv-blocks"), `0 / ${total.toLocaleString("en-US")}`);
  assert.equal(await page.textContent("#kv-block-size"), "64 tokens");
  assert.equal(await page.textContent("#kv-pool-tokens"), poolTokens.toLocaleString("en-US"));
  assert.equal(await page.textContent("#kv-usage"), "0.0 %");
  assert.equal(await page.textContent("#req-running"), "0");

  // A streamed answer: the text the page assembles from the SSE deltas is the API's answer.
  const expected = (await chatApi({ max_tokens: 24 })).choices[0].message.content;
  assert.ok(expected.length > 0);
  await page.fill("#temperature", "0.8");
  await page.fill("#seed", String(seed));
  await page.fill("#max-tokens", "24");
  await page.fill("#prompt", QUESTION);
  await page.click("#send");
  const first = page.locator(".message.assistant").nth(0);
  await page.waitForFunction(() => document.querySelector(".message.assistant")?.dataset.state === "done");
  assert.equal(await first.locator(".content").textContent(), expected);
  assert.match(await first.locator(".finish").textContent(), /^finish: length · \d+ prompt \+ 24 completion tokens$/);

  // The server's error message is shown, and the failed turn leaves the conversation's history.
  await page.click("#clear");
  await page.fill("#temperature", "-1");
  await page.fill("#prompt", QUESTION);
  await page.click("#send");
  await page.waitForFunction(() => document.querySelector(".message.assistant")?.dataset.state === "error");
  assert.match(await page.textContent("#error"), /^400: .*temperature/);
  await page.fill("#temperature", "0.8");

  // reasoning_content deltas go to the muted block (the tiny model writes no <think>, so this
  // stream is canned; the parsing is the page's own).
  const canned = [
    { delta: { role: "assistant", content: "" } }, { delta: { reasoning_content: "Let me " } },
    { delta: { reasoning_content: "think." } }, { delta: { content: "Hello" } },
    { delta: { content: " world" }, finish_reason: "stop" },
  ].map((c) => `data: ${JSON.stringify({ id: "chatcmpl-canned", object: "chat.completion.chunk",
                                          choices: [{ index: 0, finish_reason: null, ...c }] })}\r\n\r\n`);
  await page.route("**/v1/chat/completions", (route) => route.fulfill({
    status: 200, headers: { "Content-Type": "text/event-stream" }, body: canned.join("") + "data: [DONE]\n\n" }));
  await page.click("#clear");
  await page.fill("#prompt", "canned");
  await page.click("#send");
  await page.waitForFunction(() => document.querySelector(".message.assistant")?.dataset.state === "done");
  const reasoned = page.locator(".message.assistant").nth(0);
  assert.equal(await reasoned.locator(".reasoning").textContent(), "Let me think.");
  assert.equal(await reasoned.locator(".reasoning").isVisible(), true);
  assert.equal(await reasoned.locator(".content").textContent(), "Hello world");
  assert.equal(await reasoned.locator(".finish").textContent(), "finish: stop");
  await page.unroute("**/v1/chat/completions");

  // Stop on a long answer (at least 300 tokens with this seed): the page shows it stopped, and
  // the server ends the request early and counts it aborted.
  const counts = async () => {
    const now = await metrics(server.url);
    return { running: metricValue(now, "e4kv:num_requests_running"),
             generated: metricValue(now, "e4kv:generation_tokens_total"),
             aborts: metricValue(now, "e4kv:request_success_total", { finished_reason: "abort" }) };
  };
  const long = (await chatApi({ max_tokens: 300 })).choices[0].message.content;
  const before = await counts();
  await page.click("#clear");
  await page.fill("#max-tokens", "1900");
  await page.fill("#prompt", QUESTION);
  await page.click("#send");
  const second = page.locator(".message.assistant").nth(0);
  await page.waitForFunction(() => document.querySelector(".message.assistant .content")?.textContent.length > 0);
  assert.equal(await page.isEnabled("#stop"), true);
  await page.click("#stop");
  await page.waitForFunction(() => document.querySelector(".message.assistant")?.dataset.state === "stopped");
  assert.equal(await second.locator(".finish").textContent(), "stopped");
  assert.equal(await page.isEnabled("#send"), true);
  assert.equal(await page.isDisabled("#stop"), true);
  const shown = await second.locator(".content").textContent();
  assert.ok(shown.length > 0 && shown.length < long.length && long.startsWith(shown),
            "the stopped answer is a prefix of the whole one");
  const deadline = Date.now() + 20_000;
  let after = await counts();
  while ((after.running !== 0 || after.aborts === before.aborts) && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 250));
    after = await counts();
  }
  assert.equal(after.running, 0);
  assert.ok(after.generated - before.generated < 300,
            `the server stopped generating (${after.generated - before.generated} tokens)`);
  await page.waitForFunction(() => document.getElementById("req-running").textContent === "0");
  assert.equal(after.aborts, before.aborts + 1, "request_success_total{finished_reason=\"abort\"} counts it");
});
