#!/usr/bin/env python3
"""Generate tiny Hugging Face Qwen4Exp reference checkpoints and logits for e4kv's model tests.

For each case below this script builds a small, randomly initialised Qwen4Exp model with the Hugging
Face `transformers` implementation (written against 5.17: QSA sparse attention with its token indexer,
GatedDeltaNet linear attention, hyper-connection streams, PLE hashed n-gram embeddings, MoE with a
shared expert), saves it with `save_pretrained` exactly as a real checkpoint directory looks
(config.json, generation_config.json, model.safetensors) and writes reference.json next to it:

    {"case", "covers", "architecture", "saved_dtype", "text_weight_prefix",
     "transformers_version", "torch_version", "device", "attn_implementation",
     "experts_implementation", "seed", "logit_std",
     "config":       a summary of the fields the case exercises (layer types, QSA layers, PLE layers,
                     hc_count, head_dim, GQA group, rotary dim, indexer fields, experts, EOS, ...),
     "saved_layout": how model.safetensors stores the weights (per-expert or fused experts, number of
                     PLE shards, int64 buffers, tensor count, dtypes),
     "checks":       results of the cross-checks below,
     "input_ids":    input_len token ids (> indexer_budget + indexer_compress_ratio, so the QSA
                     selection is truly sparse), with the PLE EOS id inside, once alone and once twice
                     in a row,
     "eos_positions": where it is,
     "qsa":          per QSA layer (key: layer index) and per position of input_ids:
                       "selected_blocks": the compressed blocks HF selected (ascending),
                       "tie_at_k":        1 where torch.topk met an exact tie at the k-th score
                                          (the selection there is implementation-defined: exclude),
                       "boundary_gap":    k-th minus (k+1)-th largest block score, null where every
                                          complete block is selected (no top-k happened),
     "qsa_tie_affected_positions": positions whose logits may depend on how a tie was broken: the
                     tied row itself for a tie in the last QSA layer, every position from the tied row
                     on for a tie in an earlier QSA layer (DeltaNet states and QSA keys carry it on),
     "router_min_gap": per position of input_ids, the smallest (over layers) k-th minus (k+1)-th
                     router logit: where it is small a low-precision engine may route differently,
     "greedy":       {"prompt_ids", "output_ids", "min_margin", "margins", "qsa",
                      "qsa_tie_affected_positions", "router_min_gap"} - a plain argmax loop (full
                     forward each step, no cache) from prompt_ids (which holds the EOS id once);
                     min_margin is the smallest top1 - top2 logit gap; the other records are those
                     above for one forward over prompt_ids + output_ids[:-1],
     "batch":        {"note", "sequences": [{"input_ids", "qsa", "qsa_tie_affected_positions",
                                             "router_min_gap", "logits"}, x 3]} -
                     three sequences of different lengths (the longest two hold the EOS id), each run
                     as its own forward (e4kv batches them together),
     "logits":       [[vocab floats] x input_len]}

`logits` is the fp32 one-shot forward over input_ids (eager attention, eager experts, no TF32,
deterministic algorithms, no cache); for a case saved in bfloat16 it is the forward of the saved
(rounded) weights reloaded from disk and upcast to fp32. Every parameter is re-drawn from a seeded CPU
generator, including the pieces transformers initialises to zeros or ones ((1+w) RMSNorm weights, the
PLE conv, dt_bias, the gated norm), so a swapped norm form or a skipped gate cannot hide. Scales keep
activations O(1) (the largest activation seen is checked to be far below the FP16 range). Weights are
re-drawn with the next seed until the greedy min margin is at least 5e-3 x the logit standard
deviation, the output is varied and free of EOS/BOS, and over input_ids the smallest router top-k
logit gap is at least 2e-3 and the smallest non-zero QSA boundary gap at least 1e-3 (so a
low-precision engine routes and selects like the reference), no generated token depends on an exact
QSA tie and at most 4 positions of all the sequences do. The base seeds below were screened so that
the first seed tried passes.

How the QSA tie flags are obtained: a forward hook on every Qwen4ExpTextQSAIndexer receives the
indexer's own inputs (hidden states, full cos/sin, the 4-D causal mask) and its output (the selection
mask). The hook repeats HF's scoring with the indexer's own modules (index_qk_proj, q_layernorm,
k_layernorm, the modeling file's apply_rotary_pos_emb) in the same order, dtype and device, so the
block scores are the very values HF's torch.topk saw; the selected blocks are read from HF's output
mask (not from our own top-k), and every row is checked to be a valid top-k of the recomputed scores
(all blocks strictly above the k-th score selected, none strictly below; an exact tie at the k-th
score is flagged). The same hook style records the router's top-k boundary gap (reported) and the
largest activation.

Every case is cross-checked before it is written: the reloaded checkpoint must reproduce the
in-memory model's weights and logits bit for bit and its greedy tokens; model.safetensors is read
directly (experts re-stacked from per-expert tensors if stored that way, PLE shards concatenated in
numeric order, the language_model. prefix removed) and must equal the reloaded model's weights; an
independent float64 forward written from docs/qwen4exp_reference.md (using HF's recorded QSA
selection, so only the arithmetic is compared) must agree with the transformers logits and greedy
tokens; the PLE hash primes and multipliers recomputed from the config must equal the checkpoint's
int64 buffers. A failed arithmetic or layout check is recorded in "checks" (the files are still
written) and makes the script exit non-zero; a structural failure (config, reloaded weights) stops
that case.

Requirements: torch, transformers 5.17 (with the qwen4_exp family), safetensors. Nothing is
downloaded. Output is deterministic on a given machine.

Regenerate (on the GPU machine, from the repository root):

    python3 scripts/hf_reference_qwen4exp.py

Options: --out DIR (default tests/data/hf_qwen4exp, relative to the repository root),
--device cuda|cpu, --cases NAME [NAME ...], --max-seeds N, --selftest (pure-Python checks of the
PLE hash helpers against the test vectors of docs/qwen4exp_reference.md; needs no transformers).
"""

from __future__ import annotations

import os

# Must be set before torch initialises cuBLAS, for deterministic GEMMs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Nothing here needs the network; make sure transformers never tries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import dataclasses
import json
import math
import re
import shutil
import sys
import time
import traceback
import warnings
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

PROMPT_LEN = 20
GEN_STEPS = 24
BOS_ID = 1
FIRST_INPUT_ID = 3        # ids below this are never drawn as inputs (0 unused, 1 BOS, 2 EOS)
RESERVED_TOP = 8          # the top 8 ids are never drawn (vision/image/video ids of the multimodal cases)
RMS_EPS = 1e-6
MARGIN_REL = 5e-3         # required min greedy margin, relative to the logit std
MIN_DISTINCT_OUTPUT = 6   # reject degenerate greedy runs that cycle through a few tokens
ROUTER_GAP_MIN = 2e-3     # required smallest k-th minus (k+1)-th router logit over input_ids
MAX_TIE_AFFECTED = 4      # at most this many tie-affected positions over all sequences (none in greedy)
QSA_GAP_MIN = 1e-3        # required smallest non-zero k-th minus (k+1)-th block score over input_ids
SPEC_CHECK_REL = 1e-4     # transformers fp32 vs independent fp64 forward, relative to the logit std
ACT_LIMIT = 1000.0        # largest activation allowed (FP16 max is 65504)
CASE_SIZE_WARN = 1_600_000
TOTAL_SIZE_WARN = 8_000_000

# Initialisation (every parameter is drawn; scales chosen so activations stay O(1)).
EMBED_STD = 1.0           # embed_tokens
LM_HEAD_GAIN = 2.5        # lm_head std = gain / sqrt(hidden): logit std around 1
NORM_JITTER = 0.2         # (1+w) norms: w = 0.2 randn; plain-w norms (gated norm, LayerNorm): 1 + 0.2 randn
BIAS_STD = 0.1
CONV_GAIN = 0.8           # depthwise convs: std = gain / sqrt(kernel)
ROUTER_GAIN = 5.0         # router std = gain / sqrt(hidden): decisive routing
HC_DOWN_GAIN = 2.0        # hyper-connection mixer down projection
HC_UP_GAIN = 3.0          # hyper-connection mixer up projection (sigmoid weights spread over (0,1))
HC_INJECT_GAIN = 3.0      # hyper-connection injection weights spread over (0,2)
NGRAM_STD = 1.0           # PLE n-gram tables
A_RANGE = (0.02, 2.0)     # A = exp(A_log) uniform in this range: decays from ~1 to fast
DT_BIAS_STD = 0.5

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CAUSAL = "Qwen4ExpForCausalLM"
COND_GEN = "Qwen4ExpForConditionalGeneration"

# Smallest vision tower the multimodal config accepts (e4kv ignores model.visual.*).
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, in_channels=3, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    covers: str
    architecture: str
    saved_dtype: str
    vocab: int
    hidden: int
    layers: int
    interval: int              # full_attention_interval: layer i is QSA when (i+1) % interval == 0
    heads: int
    kv_heads: int
    head_dim: int
    partial_rotary: float
    rope_theta: float
    idx_heads: int
    idx_dim: int
    budget: int
    ratio: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    experts: int
    top_k: int
    norm_topk: bool
    moe_inter: int
    shared_inter: int
    hc_count: int
    hc_lowrank: int
    input_len: int
    base_seed: int
    conv_kernel: int = 4
    output_gate: str | None = None
    mrope_section: tuple | None = None
    ple_ids: tuple = ()            # one-indexed
    ple_embed_dim: int = 32
    ngram_size: int = 3
    heads_per_ngram: int = 2
    ngram_base: int = 101
    ngram_div: int = 64
    split_parts: int = 2
    ple_kernel: int = 4
    hash_seed: int = 1234
    eos: int | tuple = 2
    legacy_layer_types: bool = False   # config.json spells the QSA layers "full_attention"

    @property
    def is_cg(self) -> bool:
        return self.architecture == COND_GEN

    @property
    def layer_types(self) -> list[str]:
        return ["qwen_sparse_attention" if (i + 1) % self.interval == 0 else "linear_attention"
                for i in range(self.layers)]

    @property
    def qsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]

    @property
    def eos_first(self) -> int:
        return self.eos[0] if isinstance(self.eos, tuple) else self.eos

    @property
    def eos_set(self) -> set[int]:
        return set(self.eos) if isinstance(self.eos, tuple) else {self.eos}

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @property
    def block_topk(self) -> int:
        return self.budget // self.ratio

    @property
    def prefix(self) -> str:
        return "model.language_model." if self.is_cg else "model."


# Sizes: head_dim 128/256 makes q_proj (2 * heads * head_dim x hidden) the largest tensor, so those
# cases use few heads and are saved in bf16; the fp32 cases use head_dim 64. hidden is 64 throughout.
CASES = [
    Case(name="causal_f32_hd64_gqa2_r4k8_hc4_ple",
         covers="CausalLM, fp32; head_dim 64, GQA 2 (2 q heads, 1 kv), partial RoPE 0.5 (rd 32); "
                "QSA at layers 1,3 with ratio 4, budget 8 (2 blocks), 4 index heads of 32; "
                "hc_count 4; PLE on layers 1 and 3 (one-indexed, 2 shards, trigram, 2 heads/order); "
                "DeltaNet 2 k-heads / 4 v-heads; 4 experts top-2 normalised",
         architecture=CAUSAL, saved_dtype="float32", vocab=256, hidden=64, layers=4, interval=2,
         heads=2, kv_heads=1, head_dim=64, partial_rotary=0.5, rope_theta=10000.0,
         idx_heads=4, idx_dim=32, budget=8, ratio=4,
         lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16,
         experts=4, top_k=2, norm_topk=True, moe_inter=16, shared_inter=16,
         hc_count=4, hc_lowrank=8, input_len=48, base_seed=1001,
         ple_ids=(1, 3), ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_base=101,
         ngram_div=64, split_parts=2),
    Case(name="cg_f32_hd64_mha_r2k6_hc2_top1",
         covers="ConditionalGeneration (text under model.language_model., tiny vision tower), fp32; "
                "head_dim 64, GQA 1 (MHA), full RoPE; QSA at layers 1,3 with ratio 2, budget 6 "
                "(3 blocks), 4 index heads of 64; hc_count 2; no PLE; DeltaNet 2 k-heads / 2 v-heads "
                "(k dim 16, v dim 32) with output gate sigmoid; 4 experts top-1 NOT normalised "
                "(weight = softmax prob); eos_token_id is a list [2, 6] (PLE/EOS semantics use element 0); config.json "
                "spells QSA layers 'full_attention' (legacy, remapped on load)",
         architecture=COND_GEN, saved_dtype="float32", vocab=224, hidden=64, layers=4, interval=2,
         heads=2, kv_heads=2, head_dim=64, partial_rotary=1.0, rope_theta=1000000.0,
         idx_heads=4, idx_dim=64, budget=6, ratio=2,
         lin_k_heads=2, lin_v_heads=2, lin_k_dim=16, lin_v_dim=32, output_gate="sigmoid",
         experts=4, top_k=1, norm_topk=False, moe_inter=16, shared_inter=16,
         hc_count=2, hc_lowrank=8, input_len=40, base_seed=2000,
         eos=(2, 6), legacy_layer_types=True),
    Case(name="causal_bf16_hd256_gqa2_r8k16_hc3_ple",
         covers="CausalLM, bf16; head_dim 256, GQA 2, partial RoPE 0.25 (rd 64 = index head dim); "
                "QSA at layers 1,3 with ratio 8, budget 16 (2 blocks), 4 index heads of 64; "
                "hc_count 3; PLE on layer 3 only with ngram_size 2 (conv dilation 2), 4 heads, "
                "conv kernel 3, 4 shards; 4 experts top-2 NOT normalised",
         architecture=CAUSAL, saved_dtype="bfloat16", vocab=256, hidden=64, layers=4, interval=2,
         heads=2, kv_heads=1, head_dim=256, partial_rotary=0.25, rope_theta=5000000.0,
         idx_heads=4, idx_dim=64, budget=16, ratio=8,
         lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16,
         experts=4, top_k=2, norm_topk=False, moe_inter=16, shared_inter=16,
         hc_count=3, hc_lowrank=8, input_len=64, base_seed=3001,
         ple_ids=(3,), ple_embed_dim=32, ngram_size=2, heads_per_ngram=4, ngram_base=211,
         ngram_div=64, split_parts=4, ple_kernel=3, hash_seed=99),
    Case(name="cg_bf16_hd128_mha_r4k16_hc4_ple3",
         covers="ConditionalGeneration, bf16; head_dim 128, GQA 1, partial RoPE 0.5 (rd 64) with "
                "mrope_section [11,11,10] interleaved (text-only: plain RoPE); 6 layers, QSA at 2,5 "
                "with ratio 4, budget 16 (4 blocks), 4 index heads of 64; hc_count 4; PLE on "
                "layers 1,2,4 (three PLE indices: distinct primes and multipliers), 4 shards, "
                "hash seed 777; 6 experts top-2 normalised",
         architecture=COND_GEN, saved_dtype="bfloat16", vocab=256, hidden=64, layers=6, interval=3,
         heads=2, kv_heads=2, head_dim=128, partial_rotary=0.5, rope_theta=10000000.0,
         mrope_section=(11, 11, 10),
         idx_heads=4, idx_dim=64, budget=16, ratio=4,
         lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16,
         experts=6, top_k=2, norm_topk=True, moe_inter=16, shared_inter=16,
         hc_count=4, hc_lowrank=8, input_len=56, base_seed=4023,
         ple_ids=(1, 2, 4), ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_base=151,
         ngram_div=64, split_parts=4, hash_seed=777),
    Case(name="causal_bf16_hd64_gqa4_8l_r4k12_hc4_top3",
         covers="CausalLM, bf16; 8 layers, QSA at 3,7 (interval 4); head_dim 64, GQA 4 (4 q heads, "
                "1 kv), full RoPE; ratio 4, budget 12 (3 blocks), 4 index heads of 64; hc_count 4; "
                "no PLE; 4 experts top-3 normalised; config.json spells QSA layers 'full_attention'",
         architecture=CAUSAL, saved_dtype="bfloat16", vocab=256, hidden=64, layers=8, interval=4,
         heads=4, kv_heads=1, head_dim=64, partial_rotary=1.0, rope_theta=10000.0,
         idx_heads=4, idx_dim=64, budget=12, ratio=4,
         lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16,
         experts=4, top_k=3, norm_topk=True, moe_inter=16, shared_inter=16,
         hc_count=4, hc_lowrank=8, input_len=48, base_seed=5009, legacy_layer_types=True),
    Case(name="causal_bf16_hd64_mha_r4k4_hc2_long",
         covers="CausalLM, bf16; 80 tokens (DeltaNet chunked path over 2 chunks of 64); head_dim 64, "
                "GQA 1, partial RoPE 0.5 (rd 32); QSA at 1,3 with ratio 4, budget 4 (a single "
                "block), 8 index heads of 32; hc_count 2; PLE on layer 1 (2 shards); DeltaNet 1 "
                "k-head / 2 v-heads of 32, conv kernel 3; 3 experts top-1 normalised (weight 1)",
         architecture=CAUSAL, saved_dtype="bfloat16", vocab=192, hidden=64, layers=4, interval=2,
         heads=2, kv_heads=2, head_dim=64, partial_rotary=0.5, rope_theta=10000.0,
         idx_heads=8, idx_dim=32, budget=4, ratio=4,
         lin_k_heads=1, lin_v_heads=2, lin_k_dim=32, lin_v_dim=32, conv_kernel=3,
         experts=3, top_k=1, norm_topk=True, moe_inter=16, shared_inter=16,
         hc_count=2, hc_lowrank=4, input_len=80, base_seed=6004,
         ple_ids=(1,), ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_base=67,
         ngram_div=64, split_parts=2),
]


class CaseError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# PLE hash helpers (pure Python; written from docs/qwen4exp_reference.md §7)
# ----------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def splitmix64(v: int) -> int:
    v = (v + 0x9E3779B97F4A7C15) & _M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _M64
    return (v ^ (v >> 31)) & _M64


def ple_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    half = max(1, ((2 ** 63 - 1) // max(vocab, 1)) // 2)
    base = seed + 10007 * ple_index
    return [2 * (splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _M64) % half) + 1
            for i in range(ngram_size)]


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def ple_primes(base: int, ple_index: int, heads: int) -> list[int]:
    """Head h of PLE index l uses the (l*heads + h + 1)-th prime >= base."""
    p, need, found = base - 1, (ple_index + 1) * heads, []
    while len(found) < need:
        p += 1
        if is_prime(p):
            found.append(p)
    return found[ple_index * heads:]


def ple_context(ids: list[int], eos: int, ngram_size: int) -> list[list[int]]:
    """ctx[t][s] = token s back from t within t's EOS-delimited segment, else EOS (§7.3)."""
    ctx = []
    for t in range(len(ids)):
        row = [ids[t]]
        for s in range(1, ngram_size):
            src = t - s
            ok = src >= 0 and all(ids[j] != eos for j in range(src, t))
            row.append(ids[src] if ok else eos)
        ctx.append(row)
    return ctx


def selftest() -> None:
    want = {0: [23703573157769, 20109073645365, 8052911324071],
            1: [3352040966061, 19752442147475, 10742103100073],
            2: [35243655749357, 23198521423797, 25737225394503]}
    for ell, m in want.items():
        got = ple_multipliers(248320, 3, ell, 1234)
        if got != m:
            raise SystemExit(f"selftest: multipliers l={ell} {got} != {m}")
    p0 = ple_primes(20_000_000, 0, 16)
    if p0[:3] != [20000003, 20000023, 20000033] or sum(p0) != 320001446:
        raise SystemExit(f"selftest: primes l=0 {p0}")
    p1 = ple_primes(20_000_000, 1, 16)
    if p1[0] != 20000213 or p1[-1] != 20000429 or sum(p1) != 320005046:
        raise SystemExit(f"selftest: primes l=1 {p1}")
    ctx = ple_context([5, 6, 2, 7, 2, 2, 8], 2, 3)
    if ctx != [[5, 2, 2], [6, 5, 2], [2, 6, 5], [7, 2, 2], [2, 7, 2], [2, 2, 2], [8, 2, 2]]:
        raise SystemExit(f"selftest: ple context {ctx}")
    log("selftest: PLE multipliers, primes and n-gram context match docs/qwen4exp_reference.md")


# ----------------------------------------------------------------------------------------------
# numerics setup
# ----------------------------------------------------------------------------------------------

def setup_numerics(device: torch.device) -> None:
    """fp32 everywhere, no TF32, deterministic kernels; verified with a probe GEMM."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        except Exception as e:  # pragma: no cover - depends on the torch build
            log(f"note: legacy TF32 flags not settable ({e}); trying fp32_precision")
            try:
                torch.backends.cuda.matmul.fp32_precision = "ieee"
                torch.backends.cudnn.fp32_precision = "ieee"
            except Exception as e2:
                log(f"note: fp32_precision not settable either ({e2})")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        g = torch.Generator().manual_seed(0)
        a = torch.randn(256, 256, generator=g)
        b = torch.randn(256, 256, generator=g)
        exact = a.double() @ b.double()
        got = (a.to(device) @ b.to(device)).double().cpu()
        rel = float((got - exact).abs().max() / exact.abs().max())
        if rel > 1e-5:
            raise SystemExit(f"fp32 GEMM on {device} has relative error {rel:.2e}: TF32 or reduced "
                             "precision is active; cannot produce fp32 references")


# ----------------------------------------------------------------------------------------------
# transformers model construction
# ----------------------------------------------------------------------------------------------

def text_config_kwargs(case: Case) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": case.rope_theta,
                            "partial_rotary_factor": case.partial_rotary}
    if case.mrope_section is not None:
        rope["mrope_section"] = list(case.mrope_section)
        rope["mrope_interleaved"] = True
    kw: dict[str, Any] = dict(
        vocab_size=case.vocab, hidden_size=case.hidden, num_hidden_layers=case.layers,
        num_attention_heads=case.heads, num_key_value_heads=case.kv_heads, head_dim=case.head_dim,
        hidden_act="silu", max_position_embeddings=256, initializer_range=0.02, rms_norm_eps=RMS_EPS,
        tie_word_embeddings=False, rope_parameters=rope, attention_bias=False,
        linear_conv_kernel_dim=case.conv_kernel, linear_key_head_dim=case.lin_k_dim,
        linear_value_head_dim=case.lin_v_dim, linear_num_key_heads=case.lin_k_heads,
        linear_num_value_heads=case.lin_v_heads, moe_intermediate_size=case.moe_inter,
        shared_expert_intermediate_size=case.shared_inter, num_experts_per_tok=case.top_k,
        num_experts=case.experts, norm_topk_prob=case.norm_topk, layer_types=case.layer_types,
        bos_token_id=BOS_ID, eos_token_id=list(case.eos) if isinstance(case.eos, tuple) else case.eos,
        hc_count=case.hc_count, hc_lowrank=case.hc_lowrank,
        indexer_n_heads=case.idx_heads, indexer_kv_heads=1, indexer_head_dim=case.idx_dim,
        indexer_budget=case.budget, indexer_compress_ratio=case.ratio,
        output_gate_type=case.output_gate, use_cache=True,
    )
    if case.ple_ids:
        kw.update(ple_layer_ids=list(case.ple_ids), ple_embed_dim=case.ple_embed_dim,
                  ple_conv_kernel_size=case.ple_kernel, ngram_size=case.ngram_size,
                  heads_per_ngram=case.heads_per_ngram, ngram_vocab_size_base=case.ngram_base,
                  make_ngram_vocab_size_divisible_by=case.ngram_div, seed=case.hash_seed,
                  split_ngram_parts=case.split_parts)
    return kw


def tf_class(name: str):
    """A Qwen4Exp class from the top-level transformers namespace, else from its model module."""
    import transformers
    if hasattr(transformers, name):
        return getattr(transformers, name)
    from transformers.models import qwen4_exp
    return getattr(qwen4_exp, name)


def make_config(case: Case):
    text = text_config_kwargs(case)
    if case.is_cg:
        vocab = case.vocab
        cfg = tf_class("Qwen4ExpConfig")(
            text_config=text, vision_config=dict(VISION, out_hidden_size=case.hidden),
            image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 6,
            vision_end_token_id=vocab - 5, tie_word_embeddings=False, architectures=[case.architecture])
        tc = cfg.text_config
    else:
        cfg = tf_class("Qwen4ExpTextConfig")(architectures=[case.architecture], **text)
        tc = cfg
    # the config must read back as the case (catches ignored or renamed kwargs)
    checks = {"layer_types": case.layer_types, "hc_count": case.hc_count, "head_dim": case.head_dim,
              "indexer_budget": case.budget, "indexer_compress_ratio": case.ratio,
              "ple_layer_ids": sorted(case.ple_ids), "num_experts_per_tok": case.top_k,
              "norm_topk_prob": case.norm_topk}
    for k, v in checks.items():
        if getattr(tc, k) != v:
            raise CaseError(f"config field {k} reads back as {getattr(tc, k)!r}, expected {v!r}")
    rp = tc.rope_parameters
    if float(rp.get("partial_rotary_factor", 1.0)) != case.partial_rotary or \
            float(rp["rope_theta"]) != case.rope_theta:
        raise CaseError(f"rope_parameters read back as {rp!r}")
    return cfg


def model_class(case: Case):
    return tf_class(case.architecture)


def build_model(case: Case, cfg):
    model = model_class(case)._from_config(cfg, attn_implementation="eager",
                                           experts_implementation="eager", dtype=torch.float32)
    if type(model).__name__ != case.architecture:
        raise CaseError(f"built {type(model).__name__}, expected {case.architecture}")
    model = model.float().eval()
    check_structure(model, case)
    return model


def text_model(model, case: Case):
    return model.model.language_model if case.is_cg else model.model


def check_structure(model, case: Case) -> None:
    tm = text_model(model, case)
    if getattr(model.config, "_attn_implementation", None) != "eager":
        raise CaseError(f"attention implementation is {model.config._attn_implementation!r}")
    if len(tm.layers) != case.layers:
        raise CaseError(f"{len(tm.layers)} layers, expected {case.layers}")
    for i, layer in enumerate(tm.layers):
        qsa = i in case.qsa_layers
        if hasattr(layer, "self_attn") != qsa or hasattr(layer, "linear_attn") == qsa:
            raise CaseError(f"layer {i} mixer is not the expected kind (QSA {qsa})")
        if (layer.ple is not None) != ((i + 1) in case.ple_ids):
            raise CaseError(f"layer {i} PLE presence differs from the case")
        if qsa:
            att = layer.self_attn
            want = {"q_proj": (2 * case.heads * case.head_dim, case.hidden),
                    "k_proj": (case.kv_heads * case.head_dim, case.hidden),
                    "v_proj": (case.kv_heads * case.head_dim, case.hidden),
                    "o_proj": (case.hidden, case.heads * case.head_dim)}
            for n, shape in want.items():
                if tuple(getattr(att, n).weight.shape) != shape:
                    raise CaseError(f"layer {i} {n} shape {tuple(getattr(att, n).weight.shape)} != {shape}")
            ix = att.indexer
            if tuple(ix.index_qk_proj.weight.shape) != ((case.idx_heads + 1) * case.idx_dim, case.hidden):
                raise CaseError(f"layer {i} index_qk_proj shape {tuple(ix.index_qk_proj.weight.shape)}")
            if ix.block_topk != case.block_topk:
                raise CaseError(f"indexer block_topk {ix.block_topk} != {case.block_topk}")
        exp = layer.mlp.experts
        if tuple(exp.gate_up_proj.shape) != (case.experts, 2 * case.moe_inter, case.hidden):
            raise CaseError(f"experts gate_up_proj shape {tuple(exp.gate_up_proj.shape)}")
    if tuple(model.lm_head.weight.shape) != (case.vocab, case.hidden):
        raise CaseError(f"lm_head shape {tuple(model.lm_head.weight.shape)}")
    if model.lm_head.weight.data_ptr() == tm.embed_tokens.weight.data_ptr():
        raise CaseError("lm_head is tied to embed_tokens; the cases are untied")


def init_weights(model, case: Case, seed: int) -> None:
    """Deterministic re-initialisation of every parameter (independent of transformers' init).

    Each parameter gets its own generator, seeded from the seed and the parameter's name with the
    language_model. segment removed, so both layouts draw the same text weights for the same seed.
    """
    owner: dict[str, str] = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = type(mod).__name__
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            shape = tuple(p.shape)
            cls = owner[name]
            leaf = name.rsplit(".", 1)[-1]
            key = name.replace("model.language_model.", "model.", 1)
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 62))

            def rn(std: float) -> torch.Tensor:
                return std * torch.randn(shape, generator=g)

            if cls == "Qwen4ExpTextRMSNorm":                 # (1 + w) form
                v = rn(NORM_JITTER)
            elif cls == "Qwen4ExpTextRMSNormGated":          # plain w
                v = 1.0 + rn(NORM_JITTER)
            elif cls == "LayerNorm":                         # vision tower
                v = 1.0 + rn(NORM_JITTER) if leaf == "weight" else rn(BIAS_STD)
            elif cls == "Qwen4ExpTextGatedDeltaNet" and leaf == "A_log":
                u = torch.rand(shape, generator=g)
                v = torch.log(A_RANGE[0] + (A_RANGE[1] - A_RANGE[0]) * u)
            elif cls == "Qwen4ExpTextGatedDeltaNet" and leaf == "dt_bias":
                v = rn(DT_BIAS_STD)
            elif cls == "Qwen4ExpTextExperts":               # [E, out, in]
                v = rn(1.0 / math.sqrt(shape[2]))
            elif cls == "Qwen4ExpTextTopKRouter":
                v = rn(ROUTER_GAIN / math.sqrt(shape[1]))
            elif leaf == "bias":
                v = rn(BIAS_STD)
            elif cls == "Conv1d":                            # depthwise [C, 1, kernel]
                v = rn(CONV_GAIN / math.sqrt(shape[-1]))
            elif cls == "Conv3d":                            # vision patch embedding
                v = rn(1.0 / math.sqrt(p[0].numel()))
            elif cls == "Embedding":
                if "embed_tokens" in name:
                    v = rn(EMBED_STD)
                elif "ngram_embedding" in name:
                    v = rn(NGRAM_STD)
                else:                                        # vision pos_embed
                    v = rn(0.1)
            elif cls == "Linear" and p.dim() == 2:
                if name.startswith("lm_head"):
                    gain = LM_HEAD_GAIN
                elif name.endswith("input_mix_weight_down.weight"):
                    gain = HC_DOWN_GAIN
                elif name.endswith("input_mix_weight_up.weight"):
                    gain = HC_UP_GAIN
                elif name.endswith("block_inject_weight.weight"):
                    gain = HC_INJECT_GAIN
                else:
                    gain = 1.0
                v = rn(gain / math.sqrt(shape[1]))
            else:
                raise CaseError(f"do not know how to initialise parameter {name} {shape} ({cls})")
            p.copy_(v.to(p.dtype))


def round_to_saved_dtype(model, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))


@torch.inference_mode()
def forward_logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor([ids], dtype=torch.long, device=device)
    out = model(input_ids=t, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits.dtype != torch.float32:
        raise CaseError(f"forward produced {logits.dtype} logits; expected float32")
    return logits[0].detach().cpu()


def greedy(model, prompt: list[int], device: torch.device) -> tuple[list[int], list[float]]:
    ids = list(prompt)
    out, margins = [], []
    for _ in range(GEN_STEPS):
        last = forward_logits(model, ids, device)[-1]
        top = torch.topk(last, 2)
        margins.append(float(top.values[0] - top.values[1]))
        tok = int(top.indices[0])
        out.append(tok)
        ids.append(tok)
    return out, margins


def load_saved(case: Case, case_dir: Path):
    """Reload in fp32; returns (model, non-empty loading-info entries)."""
    kw = dict(attn_implementation="eager", experts_implementation="eager", local_files_only=True,
              output_loading_info=True, dtype=torch.float32)
    model, info = model_class(case).from_pretrained(str(case_dir), **kw)
    notes = {k: sorted(map(str, v))[:8] for k, v in (info or {}).items() if v}
    model = model.float().eval()
    check_structure(model, case)
    return model, notes


# ----------------------------------------------------------------------------------------------
# hooks: QSA selection and tie flags, router gaps, largest activation
# ----------------------------------------------------------------------------------------------

class Probe:
    """Forward hooks; `rows[layer]` holds the last forward's per-position QSA records."""

    def __init__(self, model):
        from transformers.models.qwen4_exp import modeling_qwen4_exp as M
        self.M = M
        self.handles = []
        self.rows: dict[int, list[dict]] = {}
        self.router_pos: list[float] = []
        self.enabled = True
        self.router_gap = float("inf")
        self.router_ties = 0
        self.max_act = 0.0
        self.max_act_where = ""
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if cls == "Qwen4ExpTextQSAIndexer":
                self.handles.append(mod.register_forward_hook(self._indexer_hook))
                continue
            if cls == "Qwen4ExpTextTopKRouter":
                self.handles.append(mod.register_forward_hook(self._router_hook))
            if name and "visual" not in name and "rotary" not in cls.lower():
                self.handles.append(mod.register_forward_hook(self._make_act_hook(name)))

    def reset(self) -> None:
        """Forget the per-forward records (QSA rows, per-position router gaps); keep the maxima."""
        self.rows = {}
        self.router_pos = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _make_act_hook(self, name: str):
        def hook(mod, args, output):
            if not self.enabled:
                return
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for o in outs:
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                    m = float(o.detach().abs().max())
                    if m > self.max_act:
                        self.max_act, self.max_act_where = m, name
        return hook

    def _router_hook(self, mod, args, output):
        if not self.enabled:
            return
        logits = output[0]
        k = mod.top_k
        if logits.shape[-1] <= k:
            return
        srt = logits.float().sort(dim=-1, descending=True).values
        gap = (srt[:, k - 1] - srt[:, k]).cpu().tolist()
        self.router_gap = min(self.router_gap, min(gap))
        self.router_ties += sum(1 for x in gap if x == 0.0)
        if not self.router_pos:
            self.router_pos = gap
        else:
            self.router_pos = [min(a, b) for a, b in zip(self.router_pos, gap)]

    @torch.no_grad()
    def _indexer_hook(self, mod, args, output):
        if not self.enabled:
            return
        if len(args) < 3:
            raise CaseError("indexer called with keyword arguments; the probe expects positional ones")
        M = self.M
        hidden_states, position_embeddings, attention_mask = args[0], args[1], args[2]
        bsz, seq_len, _ = hidden_states.shape
        dI, nI, R = mod.index_head_dim, mod.index_n_heads, mod.compress_ratio
        hidden_shape = (bsz, seq_len, -1, dI)
        full_cos, full_sin = position_embeddings
        cur_cos, cur_sin = full_cos[:, -seq_len:, :], full_sin[:, -seq_len:, :]
        # the same ops as Qwen4ExpTextQSAIndexer.forward, in the same order
        qk = mod.index_qk_proj(hidden_states)
        q, token_k = torch.split(qk, [nI * dI, mod.index_kv_heads * dI], dim=-1)
        q, raw_keys = q.reshape(*hidden_shape), token_k.reshape(*hidden_shape).squeeze(2)
        q = mod.q_layernorm(q)
        q = M.apply_rotary_pos_emb(q, cos=cur_cos, sin=cur_sin, unsqueeze_dim=2)
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        sel_mask = output if output.dtype == torch.bool else output == 0
        rows = []
        for b in range(bsz):
            for t in range(seq_len):
                local = torch.nonzero(visible[b, 0, t], as_tuple=False).flatten()
                n = local.shape[-1] // R
                kk = min(mod.block_topk, n)
                selected = set(torch.nonzero(sel_mask[b, 0, t], as_tuple=False).flatten().tolist())
                rec: dict[str, Any] = {"n": n, "kk": kk, "gap": None, "tie": False, "ok": True}
                groups: list[int] = []
                if n > 0:
                    blocks = local[: n * R].view(n, R)
                    key_groups = raw_keys[b].index_select(0, blocks.flatten()).view(*blocks.shape, dI)
                    pooled = key_groups.float().mean(dim=1).to(raw_keys.dtype)
                    pooled = mod.k_layernorm(pooled)
                    starts = blocks[:, 0]
                    bk = M.apply_rotary_pos_emb(pooled.unsqueeze(1), cos=full_cos[b].index_select(0, starts),
                                                sin=full_sin[b].index_select(0, starts)).squeeze(1)
                    scores = torch.matmul(q[b, t].float(), bk.float().transpose(-1, -2)).transpose(-1, -2)
                    scores = (torch.relu(scores).sum(dim=-1) / math.sqrt(dI)).cpu()
                    blist = blocks.cpu().tolist()
                    groups = [c for c in range(n) if all(j in selected for j in blist[c])]
                    srt = scores.sort(descending=True).values
                    if n > kk:
                        kth = float(srt[kk - 1])
                        rec["gap"] = float(srt[kk - 1] - srt[kk])
                        rec["tie"] = rec["gap"] == 0.0
                        above = {c for c in range(n) if float(scores[c]) > kth}
                        at = {c for c in range(n) if float(scores[c]) == kth}
                        gs = set(groups)
                        rec["ok"] = len(groups) == kk and above <= gs and gs <= above | at
                        if not rec["tie"] and gs != set(torch.topk(scores, kk).indices.tolist()):
                            rec["ok"] = False
                    else:
                        rec["ok"] = groups == list(range(n))
                    tokens = {j for c in groups for j in blist[c]}
                else:
                    tokens = set()
                tail = set(local[n * R:].tolist())
                if selected != tokens | tail:
                    rec["ok"] = False
                rec["groups"] = groups
                rows.append(rec)
        if bsz != 1:
            raise CaseError("the probe records single-sequence forwards only")
        self.rows[mod.layer_idx] = rows


def qsa_record(probe: Probe) -> dict:
    out = {}
    for layer in sorted(probe.rows):
        rows = probe.rows[layer]
        out[str(layer)] = {
            "selected_blocks": [r["groups"] for r in rows],
            "tie_at_k": [int(r["tie"]) for r in rows],
            "boundary_gap": [None if r["gap"] is None else float(f"{r['gap']:.6g}") for r in rows],
        }
    return out


def tie_affected(probe: Probe) -> list[int]:
    """Positions whose logits may depend on how an exact QSA tie was broken.

    A tie in the last QSA layer changes only its own row (the rest of that layer and the final mixer
    are per-position); a tie in an earlier QSA layer changes its row's hidden state, which later
    DeltaNet states and QSA keys/values carry to every later position.
    """
    if not probe.rows:
        return []
    last = max(probe.rows)
    n = len(next(iter(probe.rows.values())))
    out: set[int] = set()
    for layer, rows in probe.rows.items():
        for t, r in enumerate(rows):
            if r["tie"]:
                out |= {t} if layer == last else set(range(t, n))
    return sorted(out)


def router_record(probe: Probe) -> list[float]:
    return [float(f"{g:.4g}") for g in probe.router_pos]


def probe_summary(probe: Probe) -> tuple[int, int, float]:
    """(tie rows, inconsistent rows, smallest non-zero boundary gap) of the last forward."""
    ties = bad = 0
    gmin = float("inf")
    for rows in probe.rows.values():
        for r in rows:
            ties += int(r["tie"])
            bad += int(not r["ok"])
            if r["gap"] is not None and r["gap"] > 0:
                gmin = min(gmin, r["gap"])
    return ties, bad, gmin


# ----------------------------------------------------------------------------------------------
# model.safetensors as e4kv reads it, and the independent float64 forward
# ----------------------------------------------------------------------------------------------

def read_disk_weights(st_path: Path, case: Case) -> tuple[dict[str, torch.Tensor], dict]:
    """Runtime-named tensors (prefix `model.`) from the file: experts stacked, PLE shards joined."""
    from safetensors.torch import load_file
    return assemble_weights(load_file(str(st_path)), case)


def assemble_weights(raw: dict[str, torch.Tensor], case: Case) -> tuple[dict[str, torch.Tensor], dict]:
    dt = DTYPES[case.saved_dtype]
    w: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict] = defaultdict(dict)
    shards: dict[str, dict] = defaultdict(dict)
    unexpected, bad_dtype = [], []
    vision = 0
    fused_experts = 0
    int_buffers = []
    for key, v in raw.items():
        if v.is_floating_point() and v.dtype != dt:
            bad_dtype.append(key)
        if not v.is_floating_point():
            int_buffers.append(f"{key} {str(v.dtype).replace('torch.', '')}")
        if case.is_cg and key.startswith("model.visual."):
            vision += 1
            continue
        if key == "lm_head.weight":
            name = key
        elif key.startswith(case.prefix):
            name = "model." + key[len(case.prefix):]
        else:
            unexpected.append(key)
            continue
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            per_expert[m.group(1)][(int(m.group(2)), m.group(3))] = v
            continue
        m = re.match(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight$", name)
        if m:
            shards[m.group(1)][int(m.group(2))] = v
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            fused_experts += 1
        w[name] = v
    if unexpected:
        raise CaseError(f"model.safetensors has keys outside {case.prefix!r}: {unexpected[:5]}")
    if bad_dtype:
        raise CaseError(f"floating tensors not stored as {case.saved_dtype}: {bad_dtype[:5]}")
    for base, d in per_expert.items():
        n_exp = 1 + max(e for e, _ in d)
        if set(d) != {(e, k) for e in range(n_exp) for k in ("gate_proj", "up_proj", "down_proj")}:
            raise CaseError(f"{base}: incomplete per-expert tensors")
        w[base + ".gate_up_proj"] = torch.stack(
            [torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]], dim=0) for e in range(n_exp)])
        w[base + ".down_proj"] = torch.stack([d[(e, "down_proj")] for e in range(n_exp)])
    shard_counts = set()
    for base, d in shards.items():
        n = len(d)
        if sorted(d) != list(range(n)):
            raise CaseError(f"{base}: shard indices {sorted(d)}")
        shard_counts.add(n)
        w[base + ".weight"] = torch.cat([d[i] for i in range(n)], dim=0)   # numeric order
    layout = {
        "tensors": len(raw),
        "experts": ("per_expert (mlp.experts.{e}.gate_proj/up_proj/down_proj.weight)" if per_expert
                    else "fused (mlp.experts.gate_up_proj, mlp.experts.down_proj)" if fused_experts
                    else "none"),
        "ple_shards_per_table": sorted(shard_counts),
        "ple_shard_key": "...ple.ple_embedding.ngram_embedding.shard_{k}.weight" if shards else None,
        "int_tensors": sorted(int_buffers),
        "vision_tensors": vision,
        "float_dtype": case.saved_dtype,
    }
    return w, layout


def runtime_state(model, case: Case) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if case.is_cg:
            if k.startswith("model.visual."):
                continue
            if k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model."):]
        out[k] = v.detach().cpu()
    return out


def check_ple_buffers(w: dict[str, torch.Tensor], rt: dict[str, torch.Tensor], case: Case) -> bool:
    """PLE primes, offsets, multipliers and table rows recomputed from the config (§7.1-7.2) must equal
    the checkpoint's int64 buffers (or, where the file lacks them, the reloaded model's)."""
    if not case.ple_ids:
        return True
    G = (case.ngram_size - 1) * case.heads_per_ngram
    for ell, lid in enumerate(sorted(case.ple_ids)):
        p = f"model.layers.{lid - 1}.ple.ple_embedding."
        primes = ple_primes(case.ngram_base, ell, G)
        offs = [sum(primes[:h]) for h in range(G)]
        mult = ple_multipliers(case.vocab, case.ngram_size, ell, case.hash_seed)
        rows = math.ceil(sum(primes) / case.ngram_div) * case.ngram_div
        for key, want in (("layer_multipliers", mult), ("ngram_heads_vocab_sizes", primes),
                          ("ngram_heads_offsets", offs)):
            src = w if (p + key) in w else rt
            if src[p + key].tolist() != want:
                log(f"  PLE {p + key}: {src[p + key].tolist()} != recomputed {want}")
                return False
        if w[p + "ngram_embedding.weight"].shape[0] != rows:
            log(f"  PLE table rows {w[p + 'ngram_embedding.weight'].shape[0]} != recomputed {rows}")
            return False
    return True


def spec_forward(w: dict[str, torch.Tensor], case: Case, ids: list[int],
                 qsa_sel: dict[int, list[list[int]]] | None = None,
                 qsa_tie: dict[int, list[bool]] | None = None) -> tuple[torch.Tensor, int]:
    """float64 forward written from docs/qwen4exp_reference.md (§3-§8), one sequence, no cache.

    qsa_sel[layer][t]: the blocks to attend (HF's recorded selection); the fp64 scores' own top-k is
    compared with it and the disagreements outside tie rows are counted (second return value).
    """
    F = torch.nn.functional
    f64 = torch.float64
    W = {k: (v.to(f64) if v.is_floating_point() else v) for k, v in w.items()}
    H, S, T = case.hidden, case.hc_count, len(ids)
    D, nH, nKV = case.head_dim, case.heads, case.kv_heads
    rd = case.rotary_dim
    inv = 1.0 / case.rope_theta ** (torch.arange(0, rd, 2, dtype=f64) / rd)
    ang = torch.arange(T, dtype=f64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1)
    mismatches = 0

    def rope(x, c, s):
        half = rd // 2
        x1, x2, rest = x[..., :half], x[..., half:rd], x[..., rd:]
        c1, s1 = c[..., :half], s[..., :half]
        return torch.cat([x1 * c1 - x2 * s1, x2 * c1 + x1 * s1, rest], dim=-1)

    def rms1p(x, wt, group=None):
        if group is not None:
            xs = x.reshape(*x.shape[:-1], -1, group)
            y = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + RMS_EPS)).reshape(x.shape)
        else:
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return y * (1.0 + wt)

    def hc(X, p, combine=True):
        Xn = rms1p(X, W[p + "hc_norm.weight"], group=H)
        a = F.silu((Xn @ W[p + "input_mix_weight_down.weight"].T) / S)
        m = torch.sigmoid(a @ W[p + "input_mix_weight_up.weight"].T).view(T, S, H)
        mix = (m * Xn.view(T, S, H)).mean(dim=1)
        if not combine:
            return mix
        inj = 2.0 * torch.sigmoid((Xn @ W[p + "block_inject_weight.weight"].T) / S)
        return mix, inj

    def qsa(x, p, layer):
        nonlocal mismatches
        nI, dI, R, K = case.idx_heads, case.idx_dim, case.ratio, case.budget
        qk = x @ W[p + "indexer.index_qk_proj.weight"].T
        iq = qk[:, : nI * dI].reshape(T, nI, dI)
        ik = qk[:, nI * dI:]
        iq = rope(rms1p(iq, W[p + "indexer.q_layernorm.weight"]), cos[:, None, :], sin[:, None, :])
        allowed = torch.zeros(T, T, dtype=torch.bool)
        for t in range(T):
            n = (t + 1) // R
            kk = min(K // R, n)
            own: list[int] = []
            if n > 0:
                g = torch.arange(n * R).view(n, R)
                kh = rms1p(ik[g].mean(dim=1), W[p + "indexer.k_layernorm.weight"])
                kh = rope(kh, cos[g[:, 0]], sin[g[:, 0]])
                s = torch.relu(iq[t] @ kh.T).sum(dim=0) / math.sqrt(dI)
                own = sorted(torch.topk(s, kk).indices.tolist())
            chosen = own
            if qsa_sel is not None:
                chosen = qsa_sel[layer][t]
                tie = qsa_tie is not None and qsa_tie[layer][t]
                if own != sorted(chosen) and not tie:
                    mismatches += 1
            for c in chosen:
                allowed[t, c * R:(c + 1) * R] = True
            allowed[t, n * R: t + 1] = True
        qg = (x @ W[p + "q_proj.weight"].T).view(T, nH, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, nH * D)
        q = rms1p(q, W[p + "q_norm.weight"])
        k = rms1p((x @ W[p + "k_proj.weight"].T).view(T, nKV, D), W[p + "k_norm.weight"])
        v = (x @ W[p + "v_proj.weight"].T).view(T, nKV, D)
        q = rope(q, cos[:, None, :], sin[:, None, :])
        k = rope(k, cos[:, None, :], sin[:, None, :])
        kvh = torch.arange(nH) // (nH // nKV)
        sc = torch.einsum("qhd,khd->hqk", q, k[:, kvh]) / math.sqrt(D)
        sc = sc.masked_fill(~allowed[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(sc, dim=-1), v[:, kvh]).reshape(T, nH * D)
        o = o * torch.sigmoid(gate)
        return o @ W[p + "o_proj.weight"].T

    def l2n(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    def deltanet(x, p):
        nK, nV, dk, dv = case.lin_k_heads, case.lin_v_heads, case.lin_k_dim, case.lin_v_dim
        Kd = nK * dk
        u = x @ W[p + "in_proj_qkv.weight"].T                     # [T, C]
        cw = W[p + "conv1d.weight"][:, 0, :]                      # [C, W]
        Wk = cw.shape[1]
        up = F.pad(u.T, (Wk - 1, 0))                              # [C, T + W - 1]
        conv = sum(cw[:, j:j + 1] * up[:, j:j + T] for j in range(Wk))
        y = F.silu(conv).T                                        # [T, C]
        q = y[:, :Kd].reshape(T, nK, dk)
        k = y[:, Kd:2 * Kd].reshape(T, nK, dk)
        v = y[:, 2 * Kd:].reshape(T, nV, dv)
        z = (x @ W[p + "in_proj_z.weight"].T).view(T, nV, dv)
        beta = torch.sigmoid(x @ W[p + "in_proj_b.weight"].T)
        g = -W[p + "A_log"].exp() * F.softplus(x @ W[p + "in_proj_a.weight"].T + W[p + "dt_bias"])
        rep = nV // nK
        q = l2n(q.repeat_interleave(rep, dim=1)) / math.sqrt(dk)
        k = l2n(k.repeat_interleave(rep, dim=1))
        st = torch.zeros(nV, dk, dv, dtype=f64)
        outs = []
        for t in range(T):
            st = st * g[t].exp()[:, None, None]
            r = torch.einsum("hkv,hk->hv", st, k[t])
            st = st + k[t][:, :, None] * (beta[t][:, None] * (v[t] - r))[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", st, q[t]))
        o = torch.stack(outs)                                     # [T, nV, dv]
        act = torch.sigmoid if (case.output_gate or "silu") == "sigmoid" else F.silu
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + RMS_EPS) * W[p + "norm.weight"] * act(z)
        return o.reshape(T, nV * dv) @ W[p + "out_proj.weight"].T

    def moe(x, p):
        sh = (F.silu(x @ W[p + "shared_expert.gate_proj.weight"].T) * (x @ W[p + "shared_expert.up_proj.weight"].T)
              ) @ W[p + "shared_expert.down_proj.weight"].T
        probs = torch.softmax(x @ W[p + "gate.weight"].T, dim=-1)
        wv, idx = torch.topk(probs, case.top_k, dim=-1)
        if case.norm_topk:
            wv = wv / wv.sum(-1, keepdim=True)
        gu, dn = W[p + "experts.gate_up_proj"], W[p + "experts.down_proj"]
        I = case.moe_inter
        out = torch.zeros(T, H, dtype=f64)
        for t in range(T):
            for j in range(case.top_k):
                e = int(idx[t, j])
                h = gu[e] @ x[t]
                out[t] += wv[t, j] * (dn[e] @ (F.silu(h[:I]) * h[I:]))
        return out + torch.sigmoid(x @ W[p + "shared_expert_gate.weight"].T) * sh

    ple_ids = sorted(case.ple_ids)
    if ple_ids:
        ctx = ple_context(ids, case.eos_first, case.ngram_size)

    def ple(X, p, ell):
        N, hpn = case.ngram_size, case.heads_per_ngram
        G = (N - 1) * hpn
        primes = ple_primes(case.ngram_base, ell, G)
        offs = [sum(primes[:h]) for h in range(G)]
        mult = ple_multipliers(case.vocab, N, ell, case.hash_seed)
        rows_ids = []
        for t in range(T):
            row = []
            for n in range(2, N + 1):
                mix = 0
                for s in range(n):
                    mix ^= ctx[t][s] * mult[s]
                for j in range(hpn):
                    h = (n - 2) * hpn + j
                    row.append(mix % primes[h] + offs[h])
            rows_ids.append(row)
        table = W[p + "ple_embedding.ngram_embedding.weight"]
        emb = table[torch.tensor(rows_ids)].reshape(T, -1)       # [T, Pd], heads in order
        kn = rms1p(emb @ W[p + "key_proj.weight"].T, W[p + "norm_key.weight"], group=H).view(T, S, H)
        val = emb @ W[p + "value_proj.weight"].T
        qn = rms1p(X, W[p + "norm_query.weight"], group=H).view(T, S, H)
        gs = (kn * qn).sum(-1) / math.sqrt(H)
        gs = torch.sign(gs) * torch.sqrt(gs.abs().clamp_min(1e-6))
        gv = (torch.sigmoid(gs)[:, :, None] * val[:, None, :]).reshape(T, S * H)
        gvn = rms1p(gv, W[p + "norm_conv.weight"], group=H)
        cw = W[p + "conv1d.weight"][:, 0, :]                      # [S*H, Kp]
        Kp, d = cw.shape[1], N
        xp = F.pad(gvn.T, ((Kp - 1) * d, 0))                      # [S*H, T + (Kp-1)d]
        conv = sum(cw[:, j:j + 1] * xp[:, j * d: j * d + T] for j in range(Kp))
        return gv + F.silu(conv.T)

    X = W["model.embed_tokens.weight"][torch.tensor(ids)].repeat(1, S)
    for i in range(case.layers):
        p = f"model.layers.{i}."
        if (i + 1) in ple_ids:
            X = X + ple(X, p + "ple.", ple_ids.index(i + 1))
        mix, inj = hc(X, p + "attn_hyper_connection.")
        if i in case.qsa_layers:
            y = qsa(mix, p + "self_attn.", i)
        else:
            y = deltanet(mix, p + "linear_attn.")
        X = X + (inj[:, :, None] * y[:, None, :]).reshape(T, S * H)
        mix, inj = hc(X, p + "mlp_hyper_connection.")
        y = moe(mix, p + "mlp.")
        X = X + (inj[:, :, None] * y[:, None, :]).reshape(T, S * H)
    h = hc(X, "model.hyper_connection_mixer.", combine=False)
    return h @ W["lm_head.weight"].T, mismatches


# ----------------------------------------------------------------------------------------------
# config.json handling and output
# ----------------------------------------------------------------------------------------------

def write_config(path: Path, cfg: dict) -> None:
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_config_json(case_dir: Path, case: Case) -> dict:
    cfg = json.loads((case_dir / "config.json").read_text())
    tc = cfg["text_config"] if case.is_cg else cfg
    want_type = "qwen4_exp" if case.is_cg else "qwen4_exp_text"
    if cfg.get("model_type") != want_type:
        raise CaseError(f"config.json model_type {cfg.get('model_type')!r}, expected {want_type!r}")
    if case.is_cg and tc.get("model_type") != "qwen4_exp_text":
        raise CaseError(f"text_config.model_type {tc.get('model_type')!r}")
    fixed = []
    if cfg.get("architectures") != [case.architecture]:
        cfg["architectures"] = [case.architecture]
        fixed.append("architectures")
    if tc.get("layer_types") != case.layer_types:
        raise CaseError(f"config.json layer_types {tc.get('layer_types')}")
    want_eos = list(case.eos) if isinstance(case.eos, tuple) else case.eos
    if tc.get("eos_token_id") != want_eos:
        raise CaseError(f"config.json eos_token_id {tc.get('eos_token_id')!r}, expected {want_eos!r}")
    subs = [cfg] + [cfg[k] for k in ("text_config", "vision_config") if isinstance(cfg.get(k), dict)]
    for sub in subs:
        if sub.get("dtype") not in (None, case.saved_dtype):
            sub["dtype"] = case.saved_dtype
            fixed.append("dtype")
    if fixed:
        log(f"  warning: config.json written by transformers lacked/mismatched {fixed}; patched")
        write_config(case_dir / "config.json", cfg)
    return cfg


def spell_full_attention(case_dir: Path, case: Case) -> None:
    cfg = json.loads((case_dir / "config.json").read_text())
    tc = cfg["text_config"] if case.is_cg else cfg
    tc["layer_types"] = ["full_attention" if t == "qwen_sparse_attention" else t for t in tc["layer_types"]]
    write_config(case_dir / "config.json", cfg)


def fmt(x: float, digits: int = 8) -> float:
    if not math.isfinite(x):
        raise CaseError(f"non-finite value {x} in reference data")
    return float(f"{x:.{digits}g}")


def logit_rows(logits: torch.Tensor, indent: str) -> str:
    return ",\n".join(indent + json.dumps([fmt(float(v)) for v in row], separators=(",", ":"))
                      for row in logits.tolist())


def write_reference(path: Path, fields: dict, batch: dict, logits: torch.Tensor) -> None:
    c = (",", ":")
    lines = ["{"]
    for k, v in fields.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, separators=c)},")
    lines.append('  "batch": {')
    lines.append(f'    "note": {json.dumps(batch["note"])},')
    lines.append('    "sequences": [')
    seqs = batch["sequences"]
    for i, s in enumerate(seqs):
        lines.append("      {")
        lines.append(f'        "input_ids": {json.dumps(s["input_ids"], separators=c)},')
        lines.append(f'        "qsa": {json.dumps(s["qsa"], separators=c)},')
        lines.append(f'        "qsa_tie_affected_positions": '
                     f'{json.dumps(s["qsa_tie_affected_positions"], separators=c)},')
        lines.append(f'        "router_min_gap": {json.dumps(s["router_min_gap"], separators=c)},')
        lines.append('        "logits": [')
        lines.append(logit_rows(s["logits"], "          "))
        lines.append("        ]")
        lines.append("      }" + ("," if i + 1 < len(seqs) else ""))
    lines.append("    ]")
    lines.append("  },")
    lines.append('  "logits": [')
    lines.append(logit_rows(logits, "    "))
    lines.append("  ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    parsed = json.loads(text)   # must be valid JSON with the expected shapes
    if len(parsed["logits"]) != logits.shape[0] or len(parsed["logits"][0]) != logits.shape[1]:
        raise CaseError("reference.json round trip changed the logits shape")
    for s, ps in zip(seqs, parsed["batch"]["sequences"]):
        if len(ps["logits"]) != len(s["input_ids"]):
            raise CaseError("reference.json round trip changed a batch sequence's logits")
    path.write_text(text)


def input_data(case: Case) -> tuple[list[int], list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))   # independent of the weight seed
    hi = case.vocab - RESERVED_TOP

    def draw(n: int) -> list[int]:
        return torch.randint(FIRST_INPUT_ID, hi, (n,), generator=g).tolist()

    eos = case.eos_first
    T = case.input_len
    ids = draw(T)
    ids[T // 3] = eos                     # a lone EOS
    ids[2 * T // 3] = eos                 # and two in a row
    ids[2 * T // 3 + 1] = eos
    prompt = draw(PROMPT_LEN)
    prompt[6] = eos
    lens = [2 * T // 3 + 1, case.budget + case.ratio + 5, 7]
    if len(set(lens + [T])) != 4:
        raise CaseError(f"batch lengths {lens} not distinct from each other and {T}")
    batch = [draw(n) for n in lens]
    batch[0][4] = eos
    batch[1][-3] = eos
    return ids, prompt, batch


# ----------------------------------------------------------------------------------------------
# one case
# ----------------------------------------------------------------------------------------------

def evaluate_seed(model, case: Case, input_ids: list[int], prompt_ids: list[int],
                  batch_ids: list[list[int]], device: torch.device) -> dict:
    """Forward, greedy and tie/gap statistics of one candidate model (the seed criteria)."""
    probe = Probe(model)
    logits = forward_logits(model, input_ids, device)
    _, _, qgap = probe_summary(probe)
    rgap = probe.router_gap
    affected = {"input": tie_affected(probe)}
    probe.enabled = False
    out, margins = greedy(model, prompt_ids, device)
    probe.enabled = True
    probe.reset()
    forward_logits(model, prompt_ids + out[:-1], device)
    affected["greedy"] = [t for t in tie_affected(probe) if t >= PROMPT_LEN - 1]
    for i, ids in enumerate(batch_ids):
        probe.reset()
        forward_logits(model, ids, device)
        affected[f"batch{i}"] = tie_affected(probe)
    probe.close()
    std = float(logits.std())
    rel = min(margins) / std
    bad_tok = bool(set(out) & (case.eos_set | {BOS_ID}))
    n_aff = sum(len(v) for v in affected.values())
    gaps_ok = rgap >= ROUTER_GAP_MIN and qgap >= QSA_GAP_MIN
    ok = (rel >= MARGIN_REL and not bad_tok and len(set(out)) >= MIN_DISTINCT_OUTPUT and gaps_ok
          and not affected["greedy"] and n_aff <= MAX_TIE_AFFECTED)
    rank = (ok, rel >= MARGIN_REL, not bad_tok, not affected["greedy"], -n_aff,
            min(rgap / ROUTER_GAP_MIN, 1.0) + min(qgap / QSA_GAP_MIN, 1.0), len(set(out)), rel)
    summary = (f"logit std {std:.3f}, min margin {min(margins):.4g} ({rel:.2e} x std), "
               f"{len(set(out))} distinct tokens{', EOS/BOS emitted' if bad_tok else ''}, router gap "
               f"{rgap:.3g}, QSA gap {qgap:.3g}, tie-affected positions {n_aff} "
               f"(greedy {len(affected['greedy'])})")
    return dict(logits=logits, std=std, out=out, margins=margins, rel=rel, ok=ok, rank=rank,
                summary=summary)


def run_case(case: Case, out_root: Path, device: torch.device, max_seeds: int) -> dict:
    import transformers
    t0 = time.time()
    log(f"\n== {case.name} ({case.architecture}, saved {case.saved_dtype})")
    if case.heads % case.kv_heads or case.lin_v_heads % case.lin_k_heads:
        raise CaseError("head counts are not multiples")
    if case.input_len <= case.budget + case.ratio:
        raise CaseError("input_len must exceed indexer_budget + indexer_compress_ratio")
    cfg = make_config(case)
    input_ids, prompt_ids, batch_ids = input_data(case)
    dt = DTYPES[case.saved_dtype]
    failures: list[str] = []

    # 1. seed search on the in-memory model (weights already rounded to the saved dtype)
    best = None
    for k in range(max_seeds):
        seed = case.base_seed + k
        model = build_model(case, cfg)
        init_weights(model, case, seed)
        round_to_saved_dtype(model, dt)
        model.to(device)
        ev = evaluate_seed(model, case, input_ids, prompt_ids, batch_ids, device)
        log(f"  seed {seed}: {ev['summary']} -> {'ok' if ev['ok'] else 'retry'}")
        cand = dict(ev, seed=seed, model=model)
        rank = ev["rank"]
        if best is None or rank > best["rank"]:
            best = cand
        else:
            del model
        if ev["ok"]:
            break
    assert best is not None
    if not best["ok"]:
        log(f"  WARNING: no seed in {max_seeds} met the margin/diversity/gap/tie criteria; using seed "
            f"{best['seed']} (min margin {best['rel']:.2e} x std)")
    model, seed = best["model"], best["seed"]

    # 2. save in the target dtype
    case_dir = out_root / case.name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    model.to("cpu").to(dt)
    model.save_pretrained(str(case_dir))
    del model
    st_path = case_dir / "model.safetensors"
    if not st_path.is_file():
        raise CaseError(f"save_pretrained did not write model.safetensors: "
                        f"{sorted(p.name for p in case_dir.iterdir())}")
    check_config_json(case_dir, case)
    if case.legacy_layer_types:
        spell_full_attention(case_dir, case)

    # 3. reload from disk in fp32: the same weights and logits bit for bit
    model, load_notes = load_saved(case, case_dir)
    if load_notes:
        failures.append(f"from_pretrained reported {load_notes}")
    sd = model.state_dict()
    if set(sd) != set(before):
        raise CaseError(f"reloaded state_dict keys differ: {sorted(set(sd) ^ set(before))[:8]}")
    for key, ref in before.items():
        got = sd[key].cpu()
        if got.dtype != ref.dtype or not torch.equal(got, ref):
            raise CaseError(f"reloaded weight {key} differs from the saved one")
    model.to(device)
    probe = Probe(model)

    def probed(ids: list[int]) -> dict:
        probe.reset()
        lg = forward_logits(model, ids, device)
        ties, bad, gap = probe_summary(probe)
        return dict(input_ids=ids, logits=lg, qsa=qsa_record(probe), router=router_record(probe),
                    affected=tie_affected(probe),
                    sel={l: [r["groups"] for r in rs] for l, rs in probe.rows.items()},
                    tie={l: [r["tie"] for r in rs] for l, rs in probe.rows.items()},
                    ties=ties, bad=bad, gap=gap)

    main_run = probed(input_ids)
    logits = main_run["logits"]
    reload_diff = float((logits - best["logits"]).abs().max())
    reload_bitwise = torch.equal(logits, best["logits"])
    if not reload_bitwise:
        failures.append(f"reloaded logits differ from the in-memory model by {reload_diff:.3e}")
    std = float(logits.std())

    # 4. greedy from the reloaded checkpoint (hooks off), then one forward over its whole sequence
    probe.enabled = False
    out, margins = greedy(model, prompt_ids, device)
    probe.enabled = True
    if out != best["out"]:
        failures.append("greedy output of the reloaded model differs from the in-memory model")
    full = prompt_ids + out[:-1]
    greedy_run = probed(full)
    if greedy_run["logits"][PROMPT_LEN - 1:].argmax(-1).tolist() != out:
        failures.append("one forward over the greedy sequence does not reproduce the greedy tokens")

    # 5. batch sequences, each its own forward
    batch_seqs = [probed(ids) for ids in batch_ids]
    router_gap, router_ties = probe.router_gap, probe.router_ties
    max_act, max_act_where = probe.max_act, probe.max_act_where
    probe.close()
    ties_main, ties_g = main_run["ties"], greedy_run["ties"]
    ties_b = sum(s["ties"] for s in batch_seqs)
    gap_main = min([main_run["gap"], greedy_run["gap"]] + [s["gap"] for s in batch_seqs])
    n_bad = main_run["bad"] + greedy_run["bad"] + sum(s["bad"] for s in batch_seqs)
    if n_bad:
        failures.append(f"HF's QSA selection is not a valid top-k of the recomputed scores in {n_bad} rows")
    if max_act > ACT_LIMIT:
        failures.append(f"activation {max_act:.1f} in {max_act_where} exceeds {ACT_LIMIT}")

    # 6. model.safetensors as e4kv reads it, and the independent fp64 forward
    w, layout = read_disk_weights(st_path, case)
    rt = runtime_state(model, case)
    disk_ok = set(w) == set(rt) and all(
        torch.equal(w[k].to(rt[k].dtype), rt[k]) for k in rt)
    if not disk_ok:
        missing, extra = sorted(set(rt) - set(w)), sorted(set(w) - set(rt))
        diff = [k for k in rt if k in w and not torch.equal(w[k].to(rt[k].dtype), rt[k])]
        failures.append(f"model.safetensors read as e4kv would differs from the reloaded model: "
                        f"missing {missing[:4]}, extra {extra[:4]}, different {diff[:4]}")
    ple_ok = check_ple_buffers(w, rt, case)
    if not ple_ok:
        failures.append("PLE primes/multipliers recomputed from the config differ from the checkpoint")
    spec_diff = float("nan")
    spec_mism = spec_greedy_ok = None
    try:
        ref, mism = spec_forward(w, case, input_ids, main_run["sel"], main_run["tie"])
        spec_diff = float((ref - logits.double()).abs().max())
        ref_g, mism_g = spec_forward(w, case, full, greedy_run["sel"], greedy_run["tie"])
        spec_diff = max(spec_diff, float((ref_g - greedy_run["logits"].double()).abs().max()))
        spec_greedy_ok = ref_g[PROMPT_LEN - 1:].argmax(-1).tolist() == out
        spec_diff_b = 0.0
        mism_b = 0
        for s in batch_seqs:
            rb, mb = spec_forward(w, case, s["input_ids"], s["sel"], s["tie"])
            spec_diff_b = max(spec_diff_b, float((rb - s["logits"].double()).abs().max()))
            mism_b += mb
        spec_diff = max(spec_diff, spec_diff_b)
        spec_mism = mism + mism_g + mism_b
        if spec_diff > SPEC_CHECK_REL * std:
            failures.append(f"transformers logits differ from the fp64 spec forward by {spec_diff:.3e} "
                            f"(logit std {std:.3f})")
        if not spec_greedy_ok:
            failures.append("fp64 spec forward disagrees with the greedy tokens")
    except Exception as e:   # the spec forward is a check; keep the case's files
        traceback.print_exc()
        failures.append(f"fp64 spec forward raised {type(e).__name__}: {e}")

    # 7. reference.json
    tc = model.config.text_config if case.is_cg else model.config
    eos_positions = [i for i, t in enumerate(input_ids) if t == case.eos_first]
    fields = {
        "case": case.name,
        "covers": case.covers,
        "architecture": case.architecture,
        "saved_dtype": case.saved_dtype,
        "text_weight_prefix": case.prefix,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": device.type,
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "seed": seed,
        "logit_std": fmt(std),
        "config": {
            "hidden_size": case.hidden, "vocab_size": case.vocab, "num_hidden_layers": case.layers,
            "layer_types": case.layer_types,
            "config_json_layer_types_spelling": "full_attention" if case.legacy_layer_types
            else "qwen_sparse_attention",
            "qsa_layers": case.qsa_layers, "ple_layer_ids_one_indexed": sorted(case.ple_ids),
            "hc_count": case.hc_count, "hc_lowrank": case.hc_lowrank,
            "num_attention_heads": case.heads, "num_key_value_heads": case.kv_heads,
            "gqa_group": case.heads // case.kv_heads, "head_dim": case.head_dim,
            "partial_rotary_factor": case.partial_rotary, "rotary_dim": case.rotary_dim,
            "rope_theta": case.rope_theta,
            "mrope_section": list(case.mrope_section) if case.mrope_section else None,
            "indexer_n_heads": case.idx_heads, "indexer_head_dim": case.idx_dim,
            "indexer_budget": case.budget, "indexer_compress_ratio": case.ratio,
            "block_topk": case.block_topk, "qsa_row_width": case.budget + case.ratio - 1,
            "linear_num_key_heads": case.lin_k_heads, "linear_num_value_heads": case.lin_v_heads,
            "linear_key_head_dim": case.lin_k_dim, "linear_value_head_dim": case.lin_v_dim,
            "linear_conv_kernel_dim": case.conv_kernel,
            "output_gate_type": case.output_gate or "silu",
            "num_experts": case.experts, "num_experts_per_tok": case.top_k,
            "norm_topk_prob": case.norm_topk, "moe_intermediate_size": case.moe_inter,
            "shared_expert_intermediate_size": case.shared_inter,
            "ple_embed_dim": case.ple_embed_dim if case.ple_ids else None,
            "ngram_size": case.ngram_size if case.ple_ids else None,
            "heads_per_ngram": case.heads_per_ngram if case.ple_ids else None,
            "ngram_vocab_size_base": case.ngram_base if case.ple_ids else None,
            "split_ngram_parts": case.split_parts if case.ple_ids else None,
            "ple_conv_kernel_size": case.ple_kernel if case.ple_ids else None,
            "hash_seed": case.hash_seed if case.ple_ids else None,
            "eos_token_id": tc.eos_token_id, "eos_for_ple": case.eos_first, "bos_token_id": BOS_ID,
            "rms_norm_eps": RMS_EPS,
        },
        "saved_layout": layout,
        "checks": {
            "reload_bitwise": reload_bitwise,
            "reload_max_abs_diff": fmt(reload_diff, 4),
            "disk_layout_matches_runtime": disk_ok,
            "ple_buffers_match_recomputed": ple_ok,
            "spec_fp64_max_abs_diff": fmt(spec_diff, 4) if math.isfinite(spec_diff) else None,
            "spec_fp64_selection_disagreements_outside_ties": spec_mism,
            "spec_fp64_greedy_tokens_agree": spec_greedy_ok,
            "qsa_tie_rows": {"input": ties_main, "greedy": ties_g, "batch": ties_b},
            "qsa_min_nonzero_boundary_gap": fmt(gap_main, 4) if math.isfinite(gap_main) else None,
            "router_min_topk_logit_gap": fmt(router_gap, 4) if math.isfinite(router_gap) else None,
            "router_exact_ties": router_ties,
            "max_abs_activation": fmt(max_act, 4),
            "max_abs_activation_in": max_act_where,
            "greedy_margin_target_met": best["ok"],
            "failures": failures,
        },
        "input_ids": input_ids,
        "eos_positions": eos_positions,
        "qsa": main_run["qsa"],
        "qsa_tie_affected_positions": main_run["affected"],
        "router_min_gap": main_run["router"],
        "greedy": {"prompt_ids": prompt_ids, "output_ids": out, "min_margin": fmt(min(margins)),
                   "margins": [fmt(m, 5) for m in margins], "qsa": greedy_run["qsa"],
                   "qsa_tie_affected_positions": greedy_run["affected"],
                   "router_min_gap": greedy_run["router"]},
    }
    batch = {"note": "each sequence was run as its own forward (no padding, positions from 0); "
                     "e4kv runs them as one batch and must reproduce each",
             "sequences": [dict(input_ids=s["input_ids"], qsa=s["qsa"],
                                qsa_tie_affected_positions=s["affected"], router_min_gap=s["router"],
                                logits=s["logits"]) for s in batch_seqs]}
    write_reference(case_dir / "reference.json", fields, batch, logits)

    files = {p.name: p.stat().st_size for p in sorted(case_dir.iterdir()) if p.is_file()}
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  seed {seed}, min margin {min(margins):.4g} ({min(margins) / std:.2e} x std), reload "
        f"bitwise {reload_bitwise}, fp64 spec diff {spec_diff:.2e}, QSA ties {ties_main}/{ties_g}/{ties_b}, "
        f"min gap {gap_main:.3g}, router gap {router_gap:.3g}, max act {max_act:.1f} ({max_act_where}), "
        f"{time.time() - t0:.1f} s")
    for f in failures:
        log(f"  FAILED CHECK: {f}")
    return dict(case=case.name, dtype=case.saved_dtype, params=n_params, files=files, seed=seed,
                min_margin=min(margins), rel_margin=min(margins) / std, spec_diff=spec_diff,
                failures=failures, met=best["ok"], layout=layout)


# ----------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/data/hf_qwen4exp",
                    help="output directory (relative paths are relative to the repository root)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda if available, else cpu")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c.name for c in CASES],
                    help="only these cases (default: all)")
    ap.add_argument("--max-seeds", type=int, default=12)
    ap.add_argument("--selftest", action="store_true",
                    help="check the PLE hash helpers against the documented test vectors and exit")
    args = ap.parse_args()

    selftest()
    if args.selftest:
        return 0

    try:
        import transformers
        import safetensors  # noqa: F401
        tf_class("Qwen4ExpTextConfig")
    except (ImportError, AttributeError) as e:
        print(f"error: {e}; this script needs torch, transformers 5.17+ (qwen4_exp) and safetensors",
              file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()
    try:
        transformers.logging.disable_progress_bar()
    except AttributeError:
        pass
    warnings.filterwarnings("ignore")

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    setup_numerics(device)

    out_root = Path(args.out)
    if not out_root.is_absolute():
        out_root = REPO_ROOT / out_root
    out_root.mkdir(parents=True, exist_ok=True)
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f"\nwriting to {out_root}")

    selected = [c for c in CASES if args.cases is None or c.name in args.cases]
    results, failures = [], []
    for case in selected:
        try:
            r = run_case(case, out_root, device, args.max_seeds)
            results.append(r)
            failures += [f"{case.name}: {f}" for f in r["failures"]]
        except Exception as e:
            traceback.print_exc()
            failures.append(f"{case.name}: {type(e).__name__}: {e}")

    hdr = (f"{'case':42} {'dtype':9} {'params':>7} {'safetensors':>11} {'reference':>9} {'dir total':>9} "
           f"{'seed':>5} {'min_margin':>10} {'x std':>8} {'fp64 diff':>9}")
    log("\n" + hdr + "\n" + "-" * len(hdr))
    total = 0
    for r in results:
        dir_total = sum(r["files"].values())
        total += dir_total
        flag = "" if r["met"] else "  MARGIN BELOW TARGET"
        if dir_total > CASE_SIZE_WARN:
            flag += "  (large)"
        log(f"{r['case']:42} {r['dtype']:9} {r['params']:>7} {r['files'].get('model.safetensors', 0):>11} "
            f"{r['files'].get('reference.json', 0):>9} {dir_total:>9} {r['seed']:>5} "
            f"{r['min_margin']:>10.4g} {r['rel_margin']:>8.2e} {r['spec_diff']:>9.2e}{flag}")
    log(f"total {total} bytes in {len(results)} case directories")
    if results:
        log(f"saved layout: {json.dumps(results[0]['layout'])}")
    if total > TOTAL_SIZE_WARN:
        log(f"note: total exceeds {TOTAL_SIZE_WARN} bytes")
    if failures:
        print("error: failed checks:\n  " + "\n  ".join(failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
