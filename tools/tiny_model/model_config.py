#!/usr/bin/env python3
"""The tiny Qwen4Exp model: every architecture number in one place.

train.py builds the transformers config from `config_kwargs()` (field names as
scripts/hf_reference_qwen4exp.py uses them with transformers 5.17) and checks the model it gets
against `expected_parameters()`, which counts the parameters from the fields alone, the way
modeling_qwen4_exp.py lays them out. A field that transformers ignored or renamed then shows up
as a count mismatch instead of a silently different model. Pure standard library, so the size
can be checked anywhere:

    python3 tools/tiny_model/model_config.py      # parameters per component, FP16 bytes

Why these numbers:
- 8 layers, every 4th QSA (layers 3 and 7, zero-based): 2 QSA + 6 GatedDeltaNet, the real
  model's 1:3 ratio.
- Attention: 4 query heads of 64 over 2 KV heads (GQA group 2): head_dim 64 is one of the sizes
  e4kv's CUDA attention kernels take (64/128/256, group <= 16). Partial RoPE 0.5 (rotary dim 32)
  as the real model's partial RoPE; it must not exceed indexer_head_dim.
- QSA indexer: budget 256 tokens = 64 blocks of 4, so the 1K-8K evaluation contexts are 4-32x
  the budget and the selection is truly sparse from position 259 on; 4 index heads of 64 (e4kv's
  index-score kernel takes <= 8 heads, dim a multiple of 8 <= 256).
- MoE: 8 experts of width 32, top-2, normalised, plus a shared expert of 128: small on purpose,
  the parameter budget goes to the embedding (8192 x 256, tied with the output) first.
- Hyper-connections: 4 streams (the real count) with a rank-16 mixer.
- PLE on layer 2 (one-indexed, a DeltaNet layer, as the real model's [2]): trigram, 2 hash heads
  per order, 4 tables of ~8.2K rows x 16; table rows padded to 128 so the 2 checkpoint shards
  split evenly.
- Total about 8.0M parameters, 16 MB in FP16: under the 25 MB limit, and small enough that the
  training state (FP16 weights + 8-bit Adam moments, ~4 bytes per parameter) fits the device
  tool's 64 MiB working-tree limit beside the repository and the data (see README.md).
"""

from __future__ import annotations

import math

VOCAB_SIZE = 8192
EOS_ID = 8189                  # <|endoftext|> of make_data.py's tokenizer
MAX_WEIGHT_BYTES = 25_000_000  # the embedded model's limit: at most 25 MB of weights
MAX_CONTEXT = 8192

HIDDEN = 256
LAYERS = 8
QSA_INTERVAL = 4               # layer i is QSA when (i + 1) % QSA_INTERVAL == 0

ARCH = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1_000_000.0,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 64,
    "indexer_budget": 256,
    "indexer_compress_ratio": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 128,
    "hc_count": 4,
    "hc_lowrank": 16,
    "ple_layer_ids": [2],
    "ple_embed_dim": 64,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 8192,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 2,
    "hash_seed": 1234,
    "output_gate_type": "sigmoid",
    "router_aux_loss_coef": 0.01,
}


def layer_types() -> list[str]:
    return ["qwen_sparse_attention" if (i + 1) % QSA_INTERVAL == 0 else "linear_attention"
            for i in range(LAYERS)]


def qsa_layers() -> list[int]:
    return [i for i, t in enumerate(layer_types()) if t != "linear_attention"]


def config_kwargs() -> dict:
    """Keyword arguments of transformers' Qwen4ExpTextConfig (5.17 names)."""
    a = ARCH
    return dict(
        vocab_size=a["vocab_size"], hidden_size=a["hidden_size"],
        num_hidden_layers=a["num_hidden_layers"], num_attention_heads=a["num_attention_heads"],
        num_key_value_heads=a["num_key_value_heads"], head_dim=a["head_dim"],
        hidden_act="silu", max_position_embeddings=MAX_CONTEXT, initializer_range=0.02,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": a["rope_theta"],
                         "partial_rotary_factor": a["partial_rotary_factor"]},
        layer_types=layer_types(),
        linear_conv_kernel_dim=a["linear_conv_kernel_dim"],
        linear_key_head_dim=a["linear_key_head_dim"],
        linear_value_head_dim=a["linear_value_head_dim"],
        linear_num_key_heads=a["linear_num_key_heads"],
        linear_num_value_heads=a["linear_num_value_heads"],
        num_experts=a["num_experts"], num_experts_per_tok=a["num_experts_per_tok"],
        norm_topk_prob=a["norm_topk_prob"], moe_intermediate_size=a["moe_intermediate_size"],
        shared_expert_intermediate_size=a["shared_expert_intermediate_size"],
        router_aux_loss_coef=a["router_aux_loss_coef"],
        hc_count=a["hc_count"], hc_lowrank=a["hc_lowrank"],
        indexer_n_heads=a["indexer_n_heads"], indexer_kv_heads=a["indexer_kv_heads"],
        indexer_head_dim=a["indexer_head_dim"], indexer_budget=a["indexer_budget"],
        indexer_compress_ratio=a["indexer_compress_ratio"],
        ple_layer_ids=list(a["ple_layer_ids"]), ple_embed_dim=a["ple_embed_dim"],
        ple_conv_kernel_size=a["ple_conv_kernel_size"], ngram_size=a["ngram_size"],
        heads_per_ngram=a["heads_per_ngram"], ngram_vocab_size_base=a["ngram_vocab_size_base"],
        make_ngram_vocab_size_divisible_by=a["make_ngram_vocab_size_divisible_by"],
        split_ngram_parts=a["split_ngram_parts"], seed=a["hash_seed"],
        output_gate_type=a["output_gate_type"],
        bos_token_id=None, eos_token_id=EOS_ID,
        # No pad id: nn.Embedding would freeze the row of pad_token_id, and the only candidate,
        # EOS, must train. Generation gets its pad id from generation_config.json.
        pad_token_id=None,
        use_cache=True,
    )


def _is_prime(n: int) -> bool:
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


def _primes_from(base: int, count: int) -> list[int]:
    out, p = [], base - 1
    while len(out) < count:
        p += 1
        if _is_prime(p):
            out.append(p)
    return out


def ple_table_rows(ple_index: int = 0) -> int:
    """Rows of one PLE n-gram table: the PLE layer's hash heads take consecutive primes >= base
    (modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding), padded to the divisor."""
    a = ARCH
    heads = (a["ngram_size"] - 1) * a["heads_per_ngram"]
    primes = _primes_from(a["ngram_vocab_size_base"], (ple_index + 1) * heads)[ple_index * heads:]
    div = a["make_ngram_vocab_size_divisible_by"]
    return math.ceil(sum(primes) / div) * div


def expected_parameters() -> dict[str, int]:
    """Trainable parameters per component (tied lm_head counted once, int64 buffers apart)."""
    a = ARCH
    H, S, r = HIDDEN, a["hc_count"], a["hc_lowrank"]
    SH = S * H

    def hyper(inject: bool) -> int:
        return SH + SH * r + r * SH + (SH * S if inject else 0)

    nq, nkv, d = a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]
    ni, di = a["indexer_n_heads"], a["indexer_head_dim"]
    qsa = (H * 2 * nq * d + 2 * H * nkv * d + nq * d * H + 2 * d
           + H * (ni + a["indexer_kv_heads"]) * di + 2 * di)
    kd = a["linear_num_key_heads"] * a["linear_key_head_dim"]
    nv = a["linear_num_value_heads"]
    vd = nv * a["linear_value_head_dim"]
    conv = 2 * kd + vd
    deltanet = (conv * a["linear_conv_kernel_dim"] + 2 * nv + a["linear_value_head_dim"]
                + vd * H + H * conv + H * vd + 2 * H * nv)
    e, i, si = a["num_experts"], a["moe_intermediate_size"], a["shared_expert_intermediate_size"]
    moe = e * H + e * 2 * i * H + e * H * i + 3 * H * si + H
    heads = (a["ngram_size"] - 1) * a["heads_per_ngram"]
    pd = a["ple_embed_dim"]
    ple = sum(ple_table_rows(k) * (pd // heads) + pd * SH + pd * H + 3 * SH
              + SH * a["ple_conv_kernel_size"] for k in range(len(a["ple_layer_ids"])))
    n_qsa = len(qsa_layers())
    parts = {
        "embedding (tied lm_head)": VOCAB_SIZE * H,
        "hyper-connections": LAYERS * 2 * hyper(True) + hyper(False),
        "QSA attention + indexer": n_qsa * qsa,
        "GatedDeltaNet": (LAYERS - n_qsa) * deltanet,
        "MoE": LAYERS * moe,
        "PLE": ple,
    }
    parts["total"] = sum(parts.values())
    return parts


def check_arch() -> None:
    """The constraints of transformers' config validation and of e4kv's kernels, up front."""
    a = ARCH
    problems = []
    if a["head_dim"] not in (64, 128, 256):
        problems.append("head_dim must be 64, 128 or 256 (e4kv CUDA attention)")
    group = a["num_attention_heads"] // a["num_key_value_heads"]
    if a["num_attention_heads"] % a["num_key_value_heads"] or not 1 < group <= 16:
        problems.append("GQA group must be a whole number in 2..16")
    if int(a["head_dim"] * a["partial_rotary_factor"]) > a["indexer_head_dim"]:
        problems.append("rotary dim must not exceed indexer_head_dim")
    if a["indexer_budget"] % a["indexer_compress_ratio"]:
        problems.append("indexer_budget must be a multiple of indexer_compress_ratio")
    if not 1 <= a["indexer_n_heads"] <= 8 or a["indexer_head_dim"] % 8:
        problems.append("e4kv's index-score kernel takes 1..8 index heads of a multiple of 8")
    if a["indexer_kv_heads"] != 1:
        problems.append("Qwen4Exp QSA requires indexer_kv_heads 1")
    if a["linear_num_value_heads"] % a["linear_num_key_heads"]:
        problems.append("linear value heads must be a multiple of linear key heads")
    if a["ple_embed_dim"] % ((a["ngram_size"] - 1) * a["heads_per_ngram"]):
        problems.append("ple_embed_dim must be a multiple of (ngram_size - 1) * heads_per_ngram")
    for k in range(len(a["ple_layer_ids"])):
        if ple_table_rows(k) % a["split_ngram_parts"]:
            problems.append("PLE table rows must split evenly into split_ngram_parts")
    if any(layer_types()[i - 1] != "linear_attention" for i in a["ple_layer_ids"]):
        problems.append("PLE layers are kept on DeltaNet layers (as the real model's)")
    if 2 * expected_parameters()["total"] > MAX_WEIGHT_BYTES:
        problems.append(f"FP16 weights exceed {MAX_WEIGHT_BYTES} bytes")
    if problems:
        raise ValueError("model_config.ARCH: " + "; ".join(problems))


if __name__ == "__main__":
    check_arch()
    parts = expected_parameters()
    width = max(map(len, parts))
    for name, n in parts.items():
        print(f"{name:{width}}  {n:>10,}")
    total = parts["total"]
    print(f"FP16 weights: {2 * total:,} bytes ({2 * total / 1e6:.2f} MB, limit "
          f"{MAX_WEIGHT_BYTES / 1e6:.0f} MB); layer types {layer_types()}")
