"""Peer for bench/cuda/bench_qwen4exp.cpp: Hugging Face transformers (FP16 weights, CUDA, its
default attention and experts implementations) on the checkpoint the benchmark keeps with
--keep-checkpoint DIR. Batch 1: a prompt of CONTEXT tokens (the benchmark's ids), then greedy
decode through generate(). Decode tokens/s = the extra tokens / the extra time of a long generate
over a one-token generate (both include the same prefill). Prints and writes JSON.

Usage: python3 bench/peer_qwen4exp.py CHECKPOINT_DIR OUT.json [CONTEXT] [NEW_TOKENS]
"""
import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    new_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16, device_map="cuda")
    model.eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.get_text_config().vocab_size
    # The benchmark's prompt ids for its first sequence (bench_qwen4exp.cpp, prefill).
    ids = [(i * 7919) % (vocab - 16) + 1 for i in range(context)]
    x = torch.tensor([ids], dtype=torch.long, device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(2)  # warm-up
    one = min(generate(1) for _ in range(2))
    long = min(generate(1 + new_tokens) for _ in range(2))
    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "context": context,
        "new_tokens": new_tokens,
        "load_s": load_s,
        "prefill_s": one,
        "prefill_tokens_per_s": context / one,
        "decode_step_ms": (long - one) / new_tokens * 1e3,
        "decode_tokens_per_s": new_tokens / (long - one),
    }
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
