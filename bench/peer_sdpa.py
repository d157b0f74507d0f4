"""Peer baseline for the decode attention benchmark: PyTorch scaled_dot_product_attention, FP16,
contiguous K/V (not paged), enable_gqa=True, one query token per sequence, same shapes as
bench/cuda/bench_decode_attention.cu. Prints a table and writes JSON (argv[1])."""
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = [
    ("b32_h32_kv8_d128_8k", 32, 32, 8, 128, 8192),
    ("b8_h32_kv8_d128_32k", 8, 32, 8, 128, 32768),
    ("b4_h16_kv2_d256_128k", 4, 16, 2, 256, 131072),
    ("b64_h24_kv2_d256_8k", 64, 24, 2, 256, 8192),
    ("b1_h16_kv2_d256_20k", 1, 16, 2, 256, 20480),
]


def median_ms(fn, samples=7, launches=10):
    """Median over samples of (time of `launches` back-to-back calls) / launches, as the e4kv
    benchmark measures."""
    for _ in range(3):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(launches):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / launches)
    times.sort()
    return times[len(times) // 2]


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "peer_sdpa.json"
    torch.manual_seed(0)
    results = []
    print(f"{'shape':38s} {'time_us':>10s} {'TB/s':>8s}")
    for name, b, hq, hkv, d, ctx in SHAPES:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        nbytes = 2.0 * b * hkv * ctx * d * 2
        # K/V smaller than 256 MB are replicated and rotated so repeated calls read HBM, not L2.
        copies = max(1, int((256 << 20) // nbytes))
        kvs = [(torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.float16),
                torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.float16))
               for _ in range(copies)]
        state = {"i": 0}

        def call():
            k, v = kvs[state["i"]]
            state["i"] = (state["i"] + 1) % copies
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        ms = median_ms(call)
        tbs = nbytes / (ms * 1e-3) / 1e12
        print(f"{name:38s} {ms * 1e3:10.1f} {tbs:8.3f}")
        results.append({"shape": name, "ms": ms, "bytes": nbytes, "tbs": tbs})
        del q, kvs
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
