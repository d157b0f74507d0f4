// `e4kv serve` driven by the official OpenAI client (openai-node): the shapes and the numbers of
// its answers, checked against the contract (docs: serve) and against /tokenize's token counts.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { poolBytes, postJson, qwen3Template, startServer } from "./serve.mjs";

const API_KEY = "test-key";
let server;
let client;
let model;

before(async () => {
  server = await startServer([
    "--chat-template", qwen3Template, "--tool-call-parser", "hermes", "--api-key", API_KEY,
    "--max-num-seqs", "4", "--max-model-len", "2048",
    "--kv-cache-memory-bytes", String(poolBytes(4, 64)),
  ]);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: API_KEY, maxRetries: 0, timeout: 120_000 });
  const models = await client.models.list();
  assert.equal(models.data.length, 1);
  model = models.data[0].id;
});

after(async () => {
  if (!server) return;
  const exit = await server.stop();  // throws if the server had exited by itself
  assert.deepEqual(exit, { code: 0, signal: null }, "SIGTERM: the server exits 0");
});

const tokenize = (body) => postJson(server.url, "/tokenize", body, API_KEY);
const detokenize = (tokens) => postJson(server.url, "/detokenize", { tokens }, API_KEY);

// A seed whose sampled chat answer is at least `minTokens` long: the tiny model's greedy chat
// answer is empty (it ends the turn at once), which would make the comparisons below vacuous.
async function seedWithLongAnswer(messages, minTokens) {
  for (let seed = 1; seed <= 16; ++seed) {
    const r = await client.chat.completions.create({ model, messages, max_tokens: minTokens,
                                                    temperature: 0.8, seed });
    if (r.usage.completion_tokens === minTokens) return seed;
  }
  throw new Error(`no seed in 1..16 gives a ${minTokens}-token answer`);
}

describe("e4kv serve with the openai client", () => {
  test("models: the served model with max_model_len", async () => {
    const models = await client.models.list();
    assert.equal(models.data[0].object, "model");
    assert.equal(models.data[0].owned_by, "e4kv");
    assert.equal(models.data[0].max_model_len, 2048);
  });

  test("completion: text, finish_reason and usage match /tokenize", async () => {
    const prompt = "The Debian package";
    const r = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0 });
    assert.equal(r.object, "text_completion");
    assert.equal(r.model, model);
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].index, 0);
    assert.equal(typeof r.choices[0].text, "string");
    assert.ok(r.choices[0].text.length > 0);
    const { count } = await tokenize({ prompt });
    assert.equal(r.usage.prompt_tokens, count);
    assert.ok(["stop", "length"].includes(r.choices[0].finish_reason));
    if (r.choices[0].finish_reason === "length") assert.equal(r.usage.completion_tokens, 8);
    assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 8);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  });

  test("chat: an assistant message; prompt tokens match /tokenize of the messages", async () => {
    const messages = [{ role: "system", content: "You are terse." },
                      { role: "user", content: "Tell me about Debian packages." }];
    const seed = await seedWithLongAnswer(messages, 12);
    const r = await client.chat.completions.create({ model, messages, max_tokens: 12,
                                                    temperature: 0.8, seed });
    assert.equal(r.object, "chat.completion");
    assert.equal(r.choices[0].message.role, "assistant");
    assert.equal(typeof r.choices[0].message.content, "string");
    assert.ok(r.choices[0].message.content.length > 0);
    assert.equal(r.choices[0].finish_reason, "length");
    assert.equal(r.usage.completion_tokens, 12);
    const { count } = await tokenize({ messages, add_generation_prompt: true });
    assert.equal(r.usage.prompt_tokens, count);
  });

  test("streaming chat with include_usage equals the non-streamed answer", async () => {
    const messages = [{ role: "user", content: "Tell me about Debian packages." }];
    const seed = await seedWithLongAnswer(messages, 16);
    const params = { model, messages, max_tokens: 24, temperature: 0.8, seed };
    const whole = await client.chat.completions.create(params);

    const stream = await client.chat.completions.create({
      ...params, stream: true, stream_options: { include_usage: true } });
    let content = "";
    let finishes = [];
    let usageChunks = [];
    const ids = new Set();
    let afterUsage = 0;
    for await (const chunk of stream) {
      assert.equal(chunk.object, "chat.completion.chunk");
      ids.add(chunk.id);
      if (usageChunks.length) ++afterUsage;
      if (chunk.usage) {
        assert.deepEqual(chunk.choices, [], "the usage chunk has no choices");
        usageChunks.push(chunk.usage);
        continue;
      }
      for (const choice of chunk.choices) {
        assert.equal(choice.index, 0);
        if (choice.delta.content) content += choice.delta.content;
        if (choice.finish_reason) finishes.push(choice.finish_reason);
      }
    }
    assert.equal(ids.size, 1, "every chunk carries the response's id");
    assert.equal(usageChunks.length, 1);
    assert.equal(afterUsage, 0, "the usage chunk is the last");
    assert.deepEqual(finishes, [whole.choices[0].finish_reason]);
    assert.equal(content, whole.choices[0].message.content);
    assert.deepEqual(usageChunks[0], whole.usage);
    assert.ok(usageChunks[0].completion_tokens >= 16);
    assert.equal(usageChunks[0].total_tokens,
                 usageChunks[0].prompt_tokens + usageChunks[0].completion_tokens);
  });

  test("tools: a well-formed answer, then the tool result round trip", async () => {
    const tools = [{
      type: "function",
      function: {
        name: "get_weather",
        description: "Current weather of a city",
        parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
      },
    }];
    const question = { role: "user", content: "What is the weather in Paris?" };
    const first = await client.chat.completions.create({ model, messages: [question], tools,
                                                        max_tokens: 16, temperature: 0 });
    const message = first.choices[0].message;
    assert.equal(message.role, "assistant");
    assert.ok(["stop", "length", "tool_calls"].includes(first.choices[0].finish_reason));
    assert.equal(first.choices[0].finish_reason === "tool_calls", (message.tool_calls || []).length > 0);
    for (const call of message.tool_calls || []) {
      assert.equal(call.type, "function");
      assert.equal(typeof call.id, "string");
      assert.equal(call.function.name, "get_weather");
      JSON.parse(call.function.arguments);
    }
    if (!(message.tool_calls || []).length) assert.equal(typeof message.content, "string");

    const result = "sunny, 21 C, station XYZZY-4217";
    const messages = [
      question,
      { role: "assistant", content: null, tool_calls: [{
        id: "call_0", type: "function",
        function: { name: "get_weather", arguments: '{"city": "Paris"}' } }] },
      { role: "tool", tool_call_id: "call_0", content: result },
    ];
    const second = await client.chat.completions.create({ model, messages, tools, max_tokens: 16,
                                                         temperature: 0 });
    assert.equal(second.choices[0].message.role, "assistant");
    assert.ok(["stop", "length"].includes(second.choices[0].finish_reason));
    assert.equal(typeof second.choices[0].message.content, "string");

    // The prompt the server renders holds the schema, the call and the result.
    const rendered = await tokenize({ messages, tools, add_generation_prompt: true });
    assert.equal(second.usage.prompt_tokens, rendered.count);
    const withoutTools = await tokenize({ messages, add_generation_prompt: true });
    assert.ok(rendered.count > withoutTools.count, "the tool schema adds tokens");
    const { prompt } = await detokenize(rendered.tokens);
    assert.match(prompt, /<tools>\n\{.*"name":\s*"get_weather".*\}\n<\/tools>/s);
    assert.ok(prompt.includes("Current weather of a city"));
    assert.match(prompt, /<tool_call>\n\{"name": "get_weather", "arguments": \{\s*"city":\s*"Paris"\s*\}\}\n<\/tool_call>/);
    assert.ok(prompt.includes(`<tool_response>\n${result}\n</tool_response>`));
    assert.match(prompt, /assistant\n$/, "the generation prompt ends it");
  });

  test("logprobs: top_logprobs=3 are log-probabilities, sorted, the greedy pick first", async () => {
    const r = await client.chat.completions.create({
      model, messages: [{ role: "user", content: "Name a Debian tool." }], max_tokens: 6,
      temperature: 0, logprobs: true, top_logprobs: 3 });
    const content = r.choices[0].logprobs.content;
    assert.ok(content.length >= 1);
    assert.equal(content.length, r.usage.completion_tokens);
    for (const entry of content) {
      assert.equal(typeof entry.token, "string");
      assert.ok(entry.logprob <= 0);
      assert.equal(entry.top_logprobs.length, 3);
      const values = entry.top_logprobs.map((t) => t.logprob);
      for (const v of values) assert.ok(v <= 0 && Number.isFinite(v));
      assert.deepEqual(values, [...values].sort((a, b) => b - a), "sorted, most likely first");
      assert.ok(values.reduce((s, v) => s + Math.exp(v), 0) <= 1 + 1e-4);
      // Greedy: the token taken is the most likely one.
      assert.ok(Math.abs(entry.logprob - values[0]) < 1e-4);
      assert.equal(entry.token, entry.top_logprobs[0].token);
    }
  });

  test("logprobs on completions: the legacy shape, one entry per generated token", async () => {
    const r = await client.completions.create({ model, prompt: "The Debian package", max_tokens: 6,
                                               temperature: 0, logprobs: 3 });
    const lp = r.choices[0].logprobs;
    assert.equal(r.usage.completion_tokens, 6);
    assert.equal(lp.tokens.length, 6);
    assert.equal(lp.token_logprobs.length, 6);
    assert.equal(lp.top_logprobs.length, 6);
    assert.equal(lp.tokens.join(""), r.choices[0].text);
    for (let i = 0; i < 6; ++i) {
      const top = Object.values(lp.top_logprobs[i]);
      // Distinct tokens may print the same, so a map of strings can hold fewer than 3.
      assert.ok(top.length >= 1 && top.length <= 3);
      assert.ok(lp.token_logprobs[i] <= 0);
      assert.ok(Math.abs(Math.max(...top) - lp.token_logprobs[i]) < 1e-4, "greedy: the most likely");
    }
  });

  test("n=2: two choices with indices 0 and 1", async () => {
    const r = await client.chat.completions.create({
      model, messages: [{ role: "user", content: "Tell me about Debian packages." }], n: 2,
      seed: 7, temperature: 1, max_tokens: 8 });
    assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
    for (const c of r.choices) {
      assert.equal(c.message.role, "assistant");
      assert.equal(typeof c.message.content, "string");
      assert.ok(["stop", "length"].includes(c.finish_reason));
    }
  });

  test("stop strings: the answer ends before the stop string, finish_reason stop", async () => {
    const prompt = "The Debian package";
    const params = { model, prompt, max_tokens: 32, temperature: 0 };
    const first = (await client.completions.create(params)).choices[0];
    const text = first.text;
    // A string whose first occurrence in the greedy answer is at `at`, past its start.
    let stop = null;
    let at = -1;
    for (let p = Math.floor(text.length / 2); p >= 1 && stop === null; --p) {
      for (let len = 2; len <= 8 && p + len <= text.length; ++len) {
        const s = text.slice(p, p + len);
        if (s.trim() !== "" && text.indexOf(s) === p) { stop = s; at = p; break; }
      }
    }
    assert.ok(stop !== null, `no usable stop string in ${JSON.stringify(text)}`);
    const second = (await client.completions.create({ ...params, stop: [stop] })).choices[0];
    assert.equal(second.finish_reason, "stop");
    assert.equal(second.text, text.slice(0, at), `stop ${JSON.stringify(stop)}`);
  });

  test("auth: a wrong key is a 401 AuthenticationError; /health and /metrics need none", async () => {
    const wrong = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "not-the-key", maxRetries: 0 });
    await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
    await assert.rejects(
      wrong.chat.completions.create({ model, messages: [{ role: "user", content: "hi" }] }),
      (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
    const none = await fetch(`${server.url}/v1/models`);
    assert.equal(none.status, 401);
    assert.equal((await none.json()).error.code, 401);
    assert.equal((await fetch(`${server.url}/health`)).status, 200);
    assert.equal((await fetch(`${server.url}/metrics`)).status, 200);
  });

  test("bad requests: 400 naming the field; an unknown model is 404", async () => {
    const messages = [{ role: "user", content: "hi" }];
    const naming = (field) => (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.status, 400);
      assert.ok(e.param === field || e.message.includes(field), `names ${field}: ${e.message}`);
      return true;
    };
    await assert.rejects(client.chat.completions.create({ model, messages, unknown_field: 1 }),
                         naming("unknown_field"));
    await assert.rejects(client.chat.completions.create({ model, messages, temperature: "hot" }),
                         naming("temperature"));
    await assert.rejects(client.completions.create({ model, prompt: "x", max_tokens: -1 }),
                         naming("max_tokens"));
    await assert.rejects(client.chat.completions.create({ model: "no-such-model", messages }),
                         (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
  });
});
