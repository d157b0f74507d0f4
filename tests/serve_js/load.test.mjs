// The load run of load.mjs as a test: every check it makes must hold.
import assert from "node:assert/strict";
import { test } from "node:test";
import { runLoad } from "./load.mjs";

test("64 clients with preemption and dropped streams: every request answered once", { timeout: 600_000 }, async () => {
  const { figures, failures, errors } = await runLoad({ seconds: Number(process.env.LOAD_SECONDS || 20) });
  console.log(JSON.stringify(figures));
  if (errors.length) console.log(`errors (each with an error object): ${[...new Set(errors)].slice(0, 5).join(" | ")}`);
  assert.deepEqual(failures, []);
  assert.ok(figures.aborted > 0, "some streams were dropped midway");
  assert.ok(figures.preemptions > 0);
});
