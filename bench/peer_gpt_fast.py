"""Peer for bench/cuda/bench_dense_decode.cpp: gpt-fast (pytorch-labs/gpt-fast) decoding the same
Llama-3-8B shape (ModelArgs.from_name("llama-3-8b"): 32 layers, dim 4096, 32 q / 8 KV heads x 128,
FFN 14336, vocab 128256, rope base 500000) with random weights, on one GPU.

gpt-fast's model.py is not part of this tree: scripts/fetch_peers.sh exports it (and its LICENSE and
COMMIT) into peers/gpt-fast, and the device call carries that folder. This script only builds the
model, fills it and times it.

The weights: normal with std 0.02 (embedding and every linear), norms 1; FP16 by default (gpt-fast
runs bfloat16 by default; --dtype bfloat16). The caches: setup_caches(batch, max_seq_length) with
max_seq_length = context + steps, as generate.py sizes them for a generation of `steps` tokens
(block_size raised to hold it). Prefill: the plain model, --context positions of every sequence in
forwards of about --prefill-rows rows. A decode step is what generate.py's decode loop runs, less
the sampling: model_forward(model, x, input_pos) with x [batch, 1] token ids and input_pos an int32
tensor [1] advanced in place (input_pos += 1), compiled with torch.compile(mode="reduce-overhead",
fullgraph=True) under generate.py's inductor settings, and called with SDPA limited to the math
backend as decode_n_tokens does. The e4kv benchmark's step likewise ends at the logits.

Timing: after warm-up calls (the first compiles; reduce-overhead records its CUDA graph on a later
one), --samples samples of --steps steps; every sample rewinds input_pos to --context, so every
sample decodes the same positions (as the e4kv benchmark does). compiled_ms synchronises at the
ends of a sample only (how gpt-fast's loop runs: no step waits for the device); compiled_sync_ms
synchronises after every step (how the e4kv benchmark's steps run). --eager also times the
uncompiled step (sample ends synchronised). Each figure is the median over the samples of the
sample's time / steps.

Prints one JSON line (and writes it to --out when given).
Usage: python3 bench/peer_gpt_fast.py [--context 4096] [--batch 1] [--eager] [--gpt-fast DIR]
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GPT_FAST = os.path.join(os.path.dirname(HERE), "peers", "gpt-fast")


def fail(message):
    print(f"peer_gpt_fast: {message}", file=sys.stderr)
    sys.exit(1)


def parse_args():
    ap = argparse.ArgumentParser(description="gpt-fast decode steps on the Llama-3-8B shape")
    ap.add_argument("--gpt-fast", default=DEFAULT_GPT_FAST,
                    help="folder holding gpt-fast's model.py (scripts/fetch_peers.sh)")
    ap.add_argument("--context", type=int, default=4096, help="tokens prefilled per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="decode steps per sample")
    ap.add_argument("--warmup", type=int, default=3,
                    help="compiled calls before the samples (compile, graph recording)")
    ap.add_argument("--eager", action="store_true", help="also time the uncompiled step")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--prefill-rows", type=int, default=2048,
                    help="rows (batch x positions) per prefill forward")
    ap.add_argument("--no-tuning", action="store_true",
                    help="inductor's coordinate descent tuning off (generate.py turns it on; "
                         "off compiles faster)")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    for name in ("context", "batch", "samples", "steps", "warmup", "prefill_rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def math_attention(torch):
    """SDPA restricted to the math backend, as gpt-fast's decode_n_tokens asks (inductor then
    generates the attention itself)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)
    except ImportError:  # before PyTorch 2.3
        return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False,
                                              enable_math=True)


def set_config(module, name, value):
    """Sets module.<dotted name> where this PyTorch has it (older ones lack some flags)."""
    parts = name.split(".")
    for part in parts[:-1]:
        module = getattr(module, part, None)
        if module is None:
            return
    if hasattr(module, parts[-1]):
        setattr(module, parts[-1], value)


def main():
    args = parse_args()
    try:
        import torch
    except ImportError:
        fail("PyTorch is not installed here (import torch failed); run this on the GPU machine")
    if not torch.cuda.is_available():
        fail(f"PyTorch {torch.__version__} sees no CUDA device; run this on the GPU machine")
    model_py = os.path.join(args.gpt_fast, "model.py")
    if not os.path.isfile(model_py):
        fail(f"{model_py} is missing; run scripts/fetch_peers.sh here and carry peers/gpt-fast")
    commit = "unknown"
    commit_path = os.path.join(args.gpt_fast, "COMMIT")
    if os.path.isfile(commit_path):
        with open(commit_path) as f:
            commit = f.read().strip()
    sys.path.insert(0, os.path.abspath(args.gpt_fast))
    import torch._inductor.config  # noqa: F401  (the settings below live there)
    from model import ModelArgs, RMSNorm, Transformer, find_multiple

    # generate.py's inductor settings.
    set_config(torch, "_inductor.config.coordinate_descent_tuning", not args.no_tuning)
    set_config(torch, "_inductor.config.triton.unique_kernel_names", True)
    set_config(torch, "_inductor.config.fx_graph_cache", True)
    set_config(torch, "_functorch.config.enable_autograd_cache", True)

    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    config = ModelArgs.from_name("llama-3-8b")
    max_seq_length = args.context + args.steps
    config.block_size = max(config.block_size, find_multiple(max_seq_length, 8))

    # Fits? weights, K/V caches (max_seq_length rounded up to 8), the [S, S] causal mask.
    seq = find_multiple(max_seq_length, 8)
    head_dim = config.dim // config.n_head
    weights = 2 * config.vocab_size * config.dim + config.n_layer * (
        config.dim * (config.n_head + 2 * config.n_local_heads) * head_dim + config.dim * config.dim
        + 3 * config.dim * config.intermediate_size + 2 * config.dim) + config.dim
    kv = 2 * args.batch * seq * config.n_local_heads * head_dim * config.n_layer
    need = 2 * (weights + kv) + seq * seq
    free, _ = torch.cuda.mem_get_info()
    if need > free:
        fail(f"batch {args.batch} x {max_seq_length} positions need about {need / 1e9:.1f} GB "
             f"(weights, caches, mask) and the GPU has {free / 1e9:.1f} GB free; "
             "give a smaller --batch or --context")

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(config)
    # Sized on the meta device, converted there, then materialised once in the target dtype.
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(mean=0.0, std=0.02)
    model = model.eval()
    with torch.device(device):
        model.setup_caches(max_batch_size=args.batch, max_seq_length=max_seq_length)

    # Prefill with the plain model, random token ids (the cache's values do not change a step's work).
    gen = torch.Generator(device="cpu").manual_seed(1)
    chunk = max(1, args.prefill_rows // args.batch)
    t0 = time.perf_counter()
    with torch.no_grad():
        for begin in range(0, args.context, chunk):
            end = min(args.context, begin + chunk)
            ids = torch.randint(1, config.vocab_size - 16, (args.batch, end - begin), generator=gen)
            input_pos = torch.arange(begin, end, device=device)
            model(ids.to(device=device, dtype=torch.int), input_pos)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0

    def model_forward(m, x, input_pos):
        return m(x, input_pos)

    compiled = torch.compile(model_forward, mode="reduce-overhead", fullgraph=True)
    x = torch.randint(1, config.vocab_size - 16, (args.batch, 1), generator=gen).to(
        device=device, dtype=torch.int)
    input_pos = torch.tensor([args.context], device=device, dtype=torch.int)

    def sample_ms(fn, sync_each_step):
        input_pos.fill_(args.context)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            fn(model, x, input_pos)
            input_pos.add_(1)  # in place: the tensor the closure shares (and the graph's input)
            if sync_each_step:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / args.steps

    with torch.no_grad(), math_attention(torch):
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            input_pos.fill_(args.context)
            compiled(model, x, input_pos)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        sample_ms(compiled, False)
        if args.eager:
            sample_ms(model_forward, False)
        compiled_ms, compiled_sync_ms, eager_ms = [], [], []
        for _ in range(args.samples):
            compiled_ms.append(sample_ms(compiled, False))
            compiled_sync_ms.append(sample_ms(compiled, True))
            if args.eager:
                eager_ms.append(sample_ms(model_forward, False))
        input_pos.fill_(args.context)
        finite = bool(torch.isfinite(compiled(model, x, input_pos)).all().item())

    result = {
        "peer": "gpt-fast",
        "commit": commit,
        "batch": args.batch,
        "context": args.context,
        "compiled_ms": round(statistics.median(compiled_ms), 4),
        "compiled_sync_ms": round(statistics.median(compiled_sync_ms), 4),
        "eager_ms": round(statistics.median(eager_ms), 4) if eager_ms else None,
        "compile_s": round(compile_s, 1),
        "prefill_s": round(prefill_s, 1),
        "dtype": args.dtype,
        "max_seq_length": model.max_seq_length,
        "steps": args.steps,
        "samples": args.samples,
        "coordinate_descent_tuning": not args.no_tuning,
        "logits_finite": finite,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001  (one line naming the failure, not a traceback wall)
        if type(e).__name__ == "OutOfMemoryError":
            fail(f"out of GPU memory: {e}".splitlines()[0] +
                 "; give a smaller --batch, --context or --prefill-rows")
        raise
