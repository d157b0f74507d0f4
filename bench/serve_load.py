#!/usr/bin/env python3
"""A bounded load test of a running `e4kv serve`, with the standard library only (it runs on the
GPU machine, whose image has Python but no Node.js).

CLIENTS clients send requests back to back for SECONDS: a mix of /v1/completions and
/v1/chat/completions, streamed and whole, with random max_tokens; about one stream in ten is
dropped mid-way. Checked, and the exit code says so: every request completes (finish_reason stop
or length), gets an OpenAI error object, or is one we dropped; no response id is seen twice; every
stream ends with one [DONE]; afterwards /metrics shows no request running or waiting and no KV
block in use; the server still answers /health. Prints one JSON line: requests/s, p50/p99 TTFT and
latency, counts by outcome, preemptions.

  bench/serve_load.py --url http://127.0.0.1:8000 [--clients 64] [--seconds 60] [--api-key KEY]
                      [--max-tokens 8,128] [--prompt-words 8,64] [--drop 0.1] [--seed 0]
                      [--token-prompts LO,HI]
--token-prompts: a checkpoint without a tokenizer (the GPU benchmark model): completions only, each
prompt prompt-words random token ids in [LO, HI).
"""
import argparse
import http.client
import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea under "
         "old bridges of stone where people walked slowly talking about days long gone").split()


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return values[k]


def metric(text, name):
    m = re.search(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(2)) if m else None


class Load:
    def __init__(self, args):
        self.args = args
        u = urllib.parse.urlparse(args.url)
        self.host, self.port = u.hostname, u.port or 80
        self.lock = threading.Lock()
        self.ids = set()
        self.duplicates = 0
        self.outcomes = {}
        self.problems = []
        self.ttft, self.latency = [], []

    def headers(self):
        h = {"Content-Type": "application/json"}
        if self.args.api_key:
            h["Authorization"] = "Bearer " + self.args.api_key
        return h

    def record(self, outcome, rid=None, ttft=None, latency=None, problem=None):
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if rid is not None:
                if rid in self.ids:
                    self.duplicates += 1
                    self.problems.append("response id seen twice: " + rid)
                self.ids.add(rid)
            if ttft is not None:
                self.ttft.append(ttft)
            if latency is not None:
                self.latency.append(latency)
            if problem and len(self.problems) < 20:
                self.problems.append(problem)

    def one(self, rng):
        chat = rng.random() < 0.5 and not self.args.token_prompts
        stream = rng.random() < 0.5
        lo, hi = self.args.max_tokens
        wlo, whi = self.args.prompt_words
        if self.args.token_prompts:
            ilo, ihi = self.args.token_prompts
            text = [rng.randrange(ilo, ihi) for _ in range(rng.randint(wlo, whi))]
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(wlo, whi)))
        body = {"max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 0.7]),
                "seed": rng.randint(0, 1 << 30), "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = text
            path = "/v1/completions"
        if stream:
            body["stream_options"] = {"include_usage": True}
            if self.args.stream_logprobs:
                # Every token's event then carries its logprob: the first token is seen even
                # when its text is held back or empty (a synthetic vocabulary).
                if chat:
                    body["logprobs"] = True
                else:
                    body["logprobs"] = 0
        drop = stream and rng.random() < self.args.drop
        t0 = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), self.headers())
            resp = conn.getresponse()
            if resp.status != 200:
                data = resp.read()
                try:
                    err = json.loads(data)["error"]
                    self.record("error_%d" % resp.status, problem=None if resp.status in (429, 503)
                                else "HTTP %d: %s" % (resp.status, err.get("message")))
                except Exception:
                    self.record("bad_error_body", problem="HTTP %d without an error object" % resp.status)
                return
            if not stream:
                data = json.loads(resp.read())
                reasons = [c.get("finish_reason") for c in data.get("choices", [])]
                ok = reasons and all(r in ("stop", "length") for r in reasons)
                self.record("ok" if ok else "bad_finish", rid=data.get("id"),
                            latency=time.monotonic() - t0,
                            problem=None if ok else "finish reasons %s" % reasons)
                return
            ttft, rid, finish, dones, events = None, None, None, 0, 0
            buffer = b""
            while True:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1024)
                if not chunk:
                    break
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        dones += 1
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        finish = "error"
                        continue
                    events += 1
                    rid = obj.get("id", rid)
                    for c in obj.get("choices", []):
                        piece = c.get("text") or (c.get("delta") or {}).get("content") or \
                            (c.get("delta") or {}).get("reasoning_content")
                        token = piece or (self.args.stream_logprobs and c.get("logprobs"))
                        if token and ttft is None:
                            ttft = time.monotonic() - t0
                        if c.get("finish_reason"):
                            finish = c["finish_reason"]
                    if drop and events >= 3:
                        conn.close()
                        self.record("dropped", rid=rid)
                        return
            ok = dones == 1 and finish in ("stop", "length")
            self.record("ok" if ok else "bad_stream", rid=rid, ttft=ttft,
                        latency=time.monotonic() - t0,
                        problem=None if ok else "stream: %d [DONE], finish %s" % (dones, finish))
        except Exception as e:  # a refused or reset connection is a failure of the server
            self.record("exception", problem="%s: %s" % (type(e).__name__, e))
        finally:
            conn.close()

    def client(self, index, until):
        rng = random.Random(self.args.seed * 1000 + index)
        while time.monotonic() < until:
            self.one(rng)

    def get(self, path):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("GET", path, headers=self.headers())
        r = conn.getresponse()
        return r.status, r.read().decode()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--api-key", default="")
    p.add_argument("--max-tokens", default="8,128")
    p.add_argument("--prompt-words", default="8,64")
    p.add_argument("--drop", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-prompts", default="")
    p.add_argument("--stream-logprobs", action="store_true",
                   help="request logprobs on streamed requests and take the first event with a "
                        "token's logprob as the first token (TTFT where texts are empty)")
    p.add_argument("--wait-ready", type=float, default=0,
                   help="seconds to wait for /health to answer 200 (a server still loading)")
    args = p.parse_args()
    args.token_prompts = tuple(int(x) for x in args.token_prompts.split(",")) \
        if args.token_prompts else None
    args.max_tokens = tuple(int(x) for x in args.max_tokens.split(","))
    args.prompt_words = tuple(int(x) for x in args.prompt_words.split(","))
    load = Load(args)
    ready_by = time.monotonic() + args.wait_ready
    while True:
        try:
            status, _ = load.get("/health")
        except OSError:
            status = 0
        if status == 200 or time.monotonic() >= ready_by:
            break
        time.sleep(0.5)
    start = time.monotonic()
    until = start + args.seconds
    threads = [threading.Thread(target=load.client, args=(i, until)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    # The engine lets go of everything once the last request ended (dropped ones included).
    drained, text = False, ""
    for _ in range(100):
        status, text = load.get("/metrics")
        if status == 200 and metric(text, "e4kv:num_requests_running") == 0 and \
                metric(text, "e4kv:num_requests_waiting") == 0 and \
                metric(text, "e4kv:kv_cache_blocks_used") == 0:
            drained = True
            break
        time.sleep(0.1)
    health, _ = load.get("/health")
    done = sum(load.outcomes.get(k, 0) for k in ("ok", "dropped"))
    result = {
        "clients": args.clients, "seconds": round(elapsed, 1),
        "requests": sum(load.outcomes.values()), "completed": load.outcomes.get("ok", 0),
        "requests_per_s": round(done / elapsed, 2),
        "ttft_p50_s": percentile(load.ttft, 0.5), "ttft_p99_s": percentile(load.ttft, 0.99),
        "latency_p50_s": percentile(load.latency, 0.5),
        "latency_p99_s": percentile(load.latency, 0.99),
        "outcomes": load.outcomes, "duplicates": load.duplicates,
        "preemptions": metric(text, "e4kv:num_preemptions_total"),
        "drained": drained, "health_after": health, "problems": load.problems,
    }
    print(json.dumps(result))
    failed = load.duplicates or not drained or health != 200 or any(
        k not in ("ok", "dropped", "error_429", "error_503") for k in load.outcomes)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
