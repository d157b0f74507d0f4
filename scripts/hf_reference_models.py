#!/usr/bin/env python3
"""Generate tiny Hugging Face reference checkpoints and logits for e4kv's model tests.

For each case below this script builds a small, randomly initialised decoder-only model with the
Hugging Face `transformers` implementation (Llama, Mistral, Qwen2, Qwen3), saves it with
`save_pretrained` exactly as a real checkpoint directory looks (config.json, model.safetensors,
generation_config.json) and writes reference.json next to it:

    {"family", "architecture", "saved_dtype", "transformers_version", "torch_version", "seed",
     "case", "config_style", "logit_std",
     "input_ids":  24 token ids,
     "greedy":     {"prompt_ids": 8 ids, "output_ids": 32 ids, "min_margin": float},
     "logits":     [[vocab floats] x 24]}

`logits` is the fp32 forward (eager attention, no TF32) over `input_ids`; for a case saved in
bfloat16/float16 it is the forward of the saved (rounded) weights upcast to fp32, i.e. the checkpoint
is reloaded from disk in fp32 and the reference is computed from it. `greedy` is a plain argmax loop
(full forward each step, no KV cache) from `prompt_ids`; `min_margin` is the smallest top1 - top2
logit gap over the 32 steps. Weights are re-drawn with the next seed until that gap is at least
1e-3 x the logit standard deviation, so the greedy check in e4kv is robust to rounding differences.

Every case is cross-checked before it is written: the reloaded checkpoint must reproduce the
in-memory model bit for bit, and an independent float64 re-implementation of the architecture
(reading model.safetensors directly, with its own RoPE tables) must agree with the transformers
logits and greedy tokens. A failing case is reported and the script exits non-zero.

Two of the five cases (llama default RoPE, qwen2 yarn) have their config.json rewritten into the
older layout most published checkpoints still carry (top-level `rope_theta` + `rope_scaling`,
`torch_dtype`) so that e4kv's config parser is tested on both layouts; transformers reloads that
layout and the reload check above proves it means the same model. `--no-legacy-config` keeps every
config.json exactly as transformers wrote it.

Requirements: torch, transformers (written against 5.x, with fallbacks for 4.4x+), safetensors,
numpy. Nothing is downloaded. Output is deterministic on a given machine.

Regenerate (on the GPU machine, from the repository root):

    python3 scripts/hf_reference_models.py

Options: --out DIR (default tests/data/hf, relative to the repository root), --device cuda|cpu,
--cases NAME [NAME ...], --max-seeds N, --no-legacy-config.
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
import shutil
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

PROMPT_LEN = 8
GEN_STEPS = 32
INPUT_LEN = 24
INIT_RANGE = 0.1          # std of every linear weight; also written as config.initializer_range
EMBED_STD = 0.4           # std of embed_tokens / lm_head, so logits have a std of a few units
# Tied embeddings: logits are x.E^T and x contains the current token's embedding, so a large
# embedding makes the model predict its own input forever (|e|^2 beats e.e' noise). A smaller
# std keeps greedy runs varied while the logit std stays around 1.
TIED_EMBED_STD = 0.15
NORM_JITTER = 0.2         # norm weights = 1 + NORM_JITTER * randn
BIAS_STD = 0.1            # q/k/v biases (Qwen2)
MARGIN_REL = 1e-3         # required min greedy margin, relative to the logit std
MIN_DISTINCT_OUTPUT = 6   # reject degenerate greedy runs that cycle through a few tokens
BOS_ID, EOS_ID = 1, 2     # ids below FIRST_INPUT_ID are never used as inputs
FIRST_INPUT_ID = 3
SOFT_SIZE_LIMIT = 400_000     # warn above this (model.safetensors)
HARD_SIZE_LIMIT = 1_000_000   # refuse above this (model.safetensors)
TOTAL_SIZE_WARN = 3_000_000
REF_CHECK_REL = 1e-4      # transformers fp32 vs independent fp64 forward, relative to logit std

FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    saved_dtype: str
    rms_eps: float
    rope: dict            # transformers v5 `rope_parameters` form (rope_type, rope_theta, ...)
    max_pos: int
    base_seed: int
    qkv_bias: bool = False
    qk_norm: bool = False
    legacy_config: bool = False   # rewrite config.json with top-level rope_theta + rope_scaling

    @property
    def architecture(self) -> str:
        return FAMILY_CLASSES[self.family][1]


# Note on sizes: the head layouts asked for (8 heads x head_dim 64/128) make the q/o projections
# 512-1024 wide, so each 2-layer checkpoint is ~0.8-0.92 MB even at hidden 64; hidden/vocab/
# intermediate are kept small and deliberately not powers of two where the budget allows.
CASES = [
    # Llama-2 style: default RoPE, tied embeddings, GQA 4 with 2 kv heads (q head h -> kv head h // 4),
    # head_dim (64) independent of hidden/heads (8). Legacy config.json layout.
    Case(name="llama_gqa4_hd64_tied", family="llama", vocab=256, hidden=64, intermediate=128,
         layers=2, heads=8, kv_heads=2, head_dim=64, tied=True, saved_dtype="float32",
         rms_eps=1e-5, rope={"rope_type": "default", "rope_theta": 10000.0}, max_pos=256,
         base_seed=1000, legacy_config=True),
    # Llama-3.1 style RoPE. original_max_position_embeddings=64 with theta 5e5 and head_dim 128
    # puts the 64 frequency pairs in all three llama3 regimes: pairs 0-4 unchanged
    # (wavelength < 64/4), pairs 5-11 smoothly interpolated, pairs 12-63 divided by 8. llama3
    # rescales frequencies regardless of position, so positions 0..39 exercise it fully.
    Case(name="llama_gqa8_hd128_llama3rope", family="llama", vocab=384, hidden=64, intermediate=160,
         layers=2, heads=8, kv_heads=1, head_dim=128, tied=False, saved_dtype="bfloat16",
         rms_eps=1e-5,
         rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
         max_pos=512, base_seed=2000),
    # Mistral: plain MHA (GQA 1), no sliding window, linear RoPE scaling (frequencies / 2).
    Case(name="mistral_gqa1_hd64", family="mistral", vocab=288, hidden=64, intermediate=160,
         layers=2, heads=4, kv_heads=4, head_dim=64, tied=False, saved_dtype="float32",
         rms_eps=1e-5, rope={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
         max_pos=512, base_seed=3000),
    # Qwen2.5 style: q/k/v biases (randomised), YaRN (factor 4, original 32 -> max_pos 128, so the
    # config is self-consistent; attention factor 0.1 ln 4 + 1 scales cos/sin), hidden 80 and
    # intermediate 144. Legacy config.json layout with {"type": "yarn"} like published Qwen2.5.
    Case(name="qwen2_bias_gqa4_hd64_yarn", family="qwen2", vocab=320, hidden=80, intermediate=144,
         layers=2, heads=4, kv_heads=1, head_dim=64, tied=False, saved_dtype="float32",
         rms_eps=1e-6,
         rope={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
               "original_max_position_embeddings": 32},
         max_pos=128, base_seed=4000, qkv_bias=True, legacy_config=True),
    # Qwen3: per-head q_norm/k_norm, head_dim 128 with hidden 64, tied, saved in float16.
    Case(name="qwen3_qknorm_gqa4_hd128", family="qwen3", vocab=256, hidden=64, intermediate=192,
         layers=2, heads=8, kv_heads=2, head_dim=128, tied=True, saved_dtype="float16",
         rms_eps=1e-6, rope={"rope_type": "default", "rope_theta": 1000000.0}, max_pos=256,
         base_seed=5000, qk_norm=True),
]


class CaseError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# numerics setup
# ----------------------------------------------------------------------------------------------

def setup_numerics(device: torch.device) -> None:
    """fp32 everywhere, no TF32, deterministic kernels; verified with a probe GEMM."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Legacy flags only (as one consistent API): torch >= 2.9 errors when the legacy and the new
        # fp32_precision APIs are mixed. Defaults already mean IEEE fp32 for matmuls; the probe
        # below is what actually guarantees it.
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

def tf_major() -> int:
    import transformers
    try:
        return int(transformers.__version__.split(".")[0])
    except ValueError:
        return 5


def legacy_rope_scaling(case: Case, type_key: str = "rope_type") -> dict | None:
    r = case.rope
    if r["rope_type"] == "default":
        return None
    out = {k: v for k, v in r.items() if k not in ("rope_type", "rope_theta")}
    out[type_key] = r["rope_type"]
    return out


def rope_params_of(cfg) -> dict | None:
    """The effective RoPE parameters of a config object, in v5 form, or None if unreadable."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        d = dict(rp)
        d["rope_type"] = d.get("rope_type", d.get("type", "default"))
        return d
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        return None
    rs = getattr(cfg, "rope_scaling", None) or {}
    d = dict(rs)
    d["rope_type"] = d.get("rope_type", d.get("type", "default"))
    d["rope_theta"] = theta
    return d


def rope_matches(cfg, case: Case) -> bool:
    got = rope_params_of(cfg)
    if got is None:
        return False
    for k, v in case.rope.items():
        if k not in got:
            return False
        if isinstance(v, str):
            if got[k] != v:
                return False
        elif float(got[k]) != float(v):
            return False
    return True


def make_config(case: Case):
    import transformers
    cfg_name, arch = FAMILY_CLASSES[case.family]
    cfg_cls = getattr(transformers, cfg_name)
    common: dict[str, Any] = dict(
        vocab_size=case.vocab, hidden_size=case.hidden, intermediate_size=case.intermediate,
        num_hidden_layers=case.layers, num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads, head_dim=case.head_dim, hidden_act="silu",
        max_position_embeddings=case.max_pos, initializer_range=INIT_RANGE,
        rms_norm_eps=case.rms_eps, tie_word_embeddings=case.tied, use_cache=True,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, architectures=[arch],
    )
    if case.family == "llama":
        common.update(attention_bias=False, mlp_bias=False)
    elif case.family == "mistral":
        common.update(sliding_window=None)
    elif case.family == "qwen2":
        common.update(use_sliding_window=False)   # q/k/v biases are always on in Qwen2
    elif case.family == "qwen3":
        common.update(use_sliding_window=False, attention_bias=False)

    v5_kwargs = {"rope_parameters": dict(case.rope)}
    legacy_kwargs = {"rope_theta": float(case.rope["rope_theta"]),
                     "rope_scaling": legacy_rope_scaling(case)}
    attempts = [("rope_parameters", v5_kwargs), ("rope_theta+rope_scaling", legacy_kwargs)]
    if tf_major() < 5:
        attempts.reverse()
    errors = []
    for style, kw in attempts:
        # A config class without a head_dim field may refuse it as a kwarg; then set it afterwards
        # (the attention modules read config.head_dim; check_structure verifies the shapes).
        for pass_head_dim in (True, False):
            args = dict(common, **kw)
            if not pass_head_dim:
                args.pop("head_dim")
            try:
                cfg = cfg_cls(**args)
            except (TypeError, ValueError) as e:
                errors.append(f"{style} (head_dim kwarg {pass_head_dim}): {type(e).__name__}: {e}")
                continue
            if not pass_head_dim:
                cfg.head_dim = case.head_dim
            if rope_matches(cfg, case):
                return cfg
            errors.append(f"{style}: config built but its RoPE parameters read back as "
                          f"{rope_params_of(cfg)!r}")
            break
    raise CaseError(f"{cfg_name} did not accept the RoPE settings {case.rope!r}:\n  "
                    + "\n  ".join(errors))


def ensure_eager(model) -> None:
    if getattr(model.config, "_attn_implementation", None) == "eager":
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:
        model.config._attn_implementation = "eager"
    if getattr(model.config, "_attn_implementation", None) != "eager":
        raise CaseError("could not switch the model to eager attention")


def build_model(case: Case, cfg):
    import transformers
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except TypeError:
        model = getattr(transformers, case.architecture)(cfg)
    ensure_eager(model)
    if type(model).__name__ != case.architecture:
        raise CaseError(f"built {type(model).__name__}, expected {case.architecture}")
    model = model.float().eval()
    check_structure(model, case)
    return model


def check_structure(model, case: Case) -> None:
    """The module tree must be the architecture the case describes (catches ignored kwargs)."""
    layer = model.model.layers[0]
    att = layer.self_attn
    want = {
        "q_proj": (case.heads * case.head_dim, case.hidden),
        "k_proj": (case.kv_heads * case.head_dim, case.hidden),
        "v_proj": (case.kv_heads * case.head_dim, case.hidden),
        "o_proj": (case.hidden, case.heads * case.head_dim),
    }
    for n, shape in want.items():
        got = tuple(getattr(att, n).weight.shape)
        if got != shape:
            raise CaseError(f"{n}.weight has shape {got}, expected {shape} "
                            f"(head_dim {case.head_dim} not honoured?)")
    for n in ("q_proj", "k_proj", "v_proj"):
        if (getattr(att, n).bias is not None) != case.qkv_bias:
            raise CaseError(f"{n} bias presence differs from the case ({case.qkv_bias})")
    if att.o_proj.bias is not None:
        raise CaseError("o_proj unexpectedly has a bias")
    if (hasattr(att, "q_norm") and hasattr(att, "k_norm")) != case.qk_norm:
        raise CaseError(f"q_norm/k_norm presence differs from the case ({case.qk_norm})")
    if len(model.model.layers) != case.layers:
        raise CaseError(f"{len(model.model.layers)} layers, expected {case.layers}")
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    tied = emb.data_ptr() == out.data_ptr()
    if tied != case.tied:
        if case.tied and hasattr(model, "tie_weights"):
            model.tie_weights()
            tied = model.get_input_embeddings().weight.data_ptr() == \
                model.get_output_embeddings().weight.data_ptr()
        if tied != case.tied:
            raise CaseError(f"lm_head tied={tied}, expected {case.tied}")
    if tuple(emb.shape) != (case.vocab, case.hidden):
        raise CaseError(f"embed_tokens shape {tuple(emb.shape)}")


def init_weights(model, case: Case, seed: int) -> None:
    """Deterministic re-initialisation of every parameter (independent of transformers' init)."""
    g = torch.Generator().manual_seed(seed)
    embed_std = TIED_EMBED_STD if case.tied else EMBED_STD
    params = dict(model.named_parameters())   # de-duplicates the tied lm_head
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):          # input/post_attention/final/q/k norms
                v = 1.0 + NORM_JITTER * torch.randn(shape, generator=g)
            elif name.endswith(".bias"):
                v = BIAS_STD * torch.randn(shape, generator=g)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                v = embed_std * torch.randn(shape, generator=g)
            elif p.dim() == 2:
                v = INIT_RANGE * torch.randn(shape, generator=g)
            else:
                raise CaseError(f"do not know how to initialise parameter {name} {shape}")
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


def load_saved(case_dir: Path):
    from transformers import AutoModelForCausalLM
    kw = dict(attn_implementation="eager", local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(case_dir), dtype=torch.float32, **kw)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(str(case_dir), torch_dtype=torch.float32, **kw)
    ensure_eager(model)
    return model.float().eval()


def hf_rope_tables(model) -> list[tuple[str, torch.Tensor, float]]:
    out = []
    for name, m in model.named_modules():
        inv = getattr(m, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and hasattr(m, "attention_scaling"):
            out.append((name, inv.detach().double().cpu(), float(m.attention_scaling)))
    return out


# ----------------------------------------------------------------------------------------------
# independent float64 reference (reads model.safetensors; no transformers code involved)
# ----------------------------------------------------------------------------------------------

def expected_rope(case: Case) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] and the cos/sin scale, per the published definitions."""
    r = case.rope
    hd = case.head_dim
    base = float(r["rope_theta"])
    idx = torch.arange(0, hd, 2, dtype=torch.float64)
    inv = 1.0 / base ** (idx / hd)
    scale = 1.0
    kind = r["rope_type"]
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(r["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(r["factor"]), float(r["low_freq_factor"]), float(r["high_freq_factor"])
        old = float(r["original_max_position_embeddings"])
        low_wl, high_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor = float(r["factor"])
        old = float(r["original_max_position_embeddings"])
        beta_fast, beta_slow = float(r.get("beta_fast", 32)), float(r.get("beta_slow", 1))

        def corr_dim(n_rot: float) -> float:
            return hd * math.log(old / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), hd - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(hd // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        pos_freqs = base ** (idx / hd)
        inv = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
        att = r.get("attention_factor")
        scale = float(att) if att is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    else:
        raise CaseError(f"no reference RoPE for rope_type {kind}")
    return inv, scale


def expected_keys(case: Case) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not case.tied:
        keys.add("lm_head.weight")
    for i in range(case.layers):
        p = f"model.layers.{i}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        keys |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        keys |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        if case.qkv_bias:
            keys |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        if case.qk_norm:
            keys |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return keys


def ref_forward(w: dict[str, torch.Tensor], case: Case, ids: list[int]) -> torch.Tensor:
    """float64 forward of the decoder (pre-norm, RMSNorm, neox-style RoPE, GQA, SwiGLU)."""
    eps = case.rms_eps
    hd, nh, nkv = case.head_dim, case.heads, case.kv_heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    T = len(ids)
    inv, scale = expected_rope(case)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = (emb.cos() * scale)[:, None, :], (emb.sin() * scale)[:, None, :]
    kv_of_head = torch.arange(nh) // (nh // nkv)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(case.layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])

        def proj(n):
            y = h @ w[p + f"self_attn.{n}_proj.weight"].T
            b = w.get(p + f"self_attn.{n}_proj.bias")
            return y if b is None else y + b

        q = proj("q").view(T, nh, hd)
        k = proj("k").view(T, nkv, hd)
        v = proj("v").view(T, nkv, hd)
        if case.qk_norm:
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = k[:, kv_of_head, :], v[:, kv_of_head, :]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(causal, float("-inf"))
        att = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(T, nh * hd)
        x = x + att @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def read_safetensors(path: Path, case: Case) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    t = load_file(str(path))
    want = expected_keys(case)
    got = set(t)
    extra, missing = got - want, want - got
    if case.tied:
        extra.discard("lm_head.weight")   # tolerated: some writers keep the tied copy
    if extra or missing:
        raise CaseError(f"model.safetensors keys differ: missing {sorted(missing)}, "
                        f"unexpected {sorted(extra)}")
    dt = DTYPES[case.saved_dtype]
    bad = sorted(k for k, v in t.items() if v.dtype != dt)
    if bad:
        raise CaseError(f"tensors not stored as {case.saved_dtype}: {bad[:5]}")
    return {k: v.to(torch.float64) for k, v in t.items()}


# ----------------------------------------------------------------------------------------------
# config.json handling
# ----------------------------------------------------------------------------------------------

def to_legacy_config(cfg: dict, case: Case) -> dict:
    d = dict(cfg)
    d.pop("rope_parameters", None)
    d["rope_theta"] = float(case.rope["rope_theta"])
    # Published Qwen2.5 checkpoints spell the YaRN type as {"type": "yarn"}; Llama 3.x uses rope_type.
    d["rope_scaling"] = legacy_rope_scaling(case, "type" if case.family.startswith("qwen") else "rope_type")
    if "dtype" in d and "torch_dtype" not in d:
        d["torch_dtype"] = d.pop("dtype")
    return d


def write_config(path: Path, cfg: dict) -> None:
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def check_config_json(case_dir: Path, case: Case) -> dict:
    cfg = json.loads((case_dir / "config.json").read_text())
    fixed = []
    if cfg.get("architectures") != [case.architecture]:
        cfg["architectures"] = [case.architecture]
        fixed.append("architectures")
    if cfg.get("model_type") != case.family:
        raise CaseError(f"config.json model_type {cfg.get('model_type')!r}, expected {case.family!r}")
    if cfg.get("head_dim") != case.head_dim:
        cfg["head_dim"] = case.head_dim
        fixed.append("head_dim")
    if fixed:
        log(f"  warning: config.json written by transformers lacked/mismatched {fixed}; patched")
        write_config(case_dir / "config.json", cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# one case
# ----------------------------------------------------------------------------------------------

def fmt(x: float) -> float:
    if not math.isfinite(x):
        raise CaseError(f"non-finite value {x} in reference data")
    return float(f"{x:.8g}")


def write_reference(path: Path, fields: dict, logits: torch.Tensor) -> None:
    lines = ["{"]
    for k, v in fields.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))},")
    rows = [json.dumps([fmt(float(v)) for v in row], separators=(",", ":")) for row in logits.tolist()]
    lines.append('  "logits": [')
    lines.append(",\n".join("    " + r for r in rows))
    lines.append("  ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    parsed = json.loads(text)   # must be valid JSON with the expected shape
    if len(parsed["logits"]) != logits.shape[0] or len(parsed["logits"][0]) != logits.shape[1]:
        raise CaseError("reference.json round trip changed the logits shape")
    path.write_text(text)


def input_data(case: Case) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(case.base_seed * 7919 + 17)
    input_ids = torch.randint(FIRST_INPUT_ID, case.vocab, (INPUT_LEN,), generator=g).tolist()
    prompt_ids = torch.randint(FIRST_INPUT_ID, case.vocab, (PROMPT_LEN,), generator=g).tolist()
    return input_ids, prompt_ids


def run_case(case: Case, out_root: Path, device: torch.device, max_seeds: int,
             legacy_config: bool) -> dict:
    import transformers
    log(f"\n== {case.name} ({case.architecture}, saved {case.saved_dtype})")
    if case.heads % case.kv_heads:
        raise CaseError("heads must be a multiple of kv_heads")
    cfg = make_config(case)
    input_ids, prompt_ids = input_data(case)
    dt = DTYPES[case.saved_dtype]

    # 1. seed search on the in-memory model (weights already rounded to the saved dtype)
    best = None
    for k in range(max_seeds):
        seed = case.base_seed + k
        model = build_model(case, cfg)
        init_weights(model, case, seed)
        round_to_saved_dtype(model, dt)
        model.to(device)
        logits = forward_logits(model, input_ids, device)
        std = float(logits.std())
        out, margins = greedy(model, prompt_ids, device)
        rel = min(margins) / std
        ok = (rel >= MARGIN_REL and EOS_ID not in out and BOS_ID not in out
              and len(set(out)) >= MIN_DISTINCT_OUTPUT)
        log(f"  seed {seed}: logit std {std:.3f}, min margin {min(margins):.4g} "
            f"({rel:.2e} x std), {len(set(out))} distinct tokens -> {'ok' if ok else 'retry'}")
        # Fallback ranking if no seed passes: margin first (robustness), then output diversity.
        rank = (ok, rel >= MARGIN_REL, len(set(out)), rel)
        cand = dict(seed=seed, model=model, logits=logits, std=std, out=out, margins=margins,
                    rel=rel, ok=ok, rank=rank)
        if best is None or rank > best["rank"]:
            best = cand
        if ok:
            break
    assert best is not None
    if not best["ok"]:
        log(f"  WARNING: no seed in {max_seeds} met the margin/diversity criteria; using seed "
            f"{best['seed']} (min margin {best['rel']:.2e} x std)")
    model = best["model"]
    seed = best["seed"]

    # 2. save in the target dtype
    case_dir = out_root / case.name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    model.to("cpu").to(dt)
    model.save_pretrained(str(case_dir))   # safetensors is the only / default format
    del model
    st_path = case_dir / "model.safetensors"
    if not st_path.is_file():
        raise CaseError(f"save_pretrained did not write model.safetensors: "
                        f"{sorted(p.name for p in case_dir.iterdir())}")
    cfg_json = check_config_json(case_dir, case)
    original_cfg_text = (case_dir / "config.json").read_text()
    written_style = "rope_parameters" if "rope_parameters" in cfg_json else "rope_theta+rope_scaling"
    style = written_style
    rewrote = legacy_config and case.legacy_config and written_style == "rope_parameters"
    if rewrote:
        write_config(case_dir / "config.json", to_legacy_config(cfg_json, case))
        style = "rope_theta+rope_scaling"

    # 3. reload from disk in fp32; it must be the same model bit for bit
    def reload_and_compare():
        m = load_saved(case_dir)
        check_structure(m, case)
        sd = m.state_dict()
        if set(sd) != set(before):
            raise CaseError(f"reloaded state_dict keys differ: {sorted(set(sd) ^ set(before))}")
        for key, ref in before.items():
            if sd[key].dtype != torch.float32 or not torch.equal(sd[key].cpu(), ref):
                raise CaseError(f"reloaded weight {key} differs from the saved one")
        m.to(device)
        lg = forward_logits(m, input_ids, device)
        d = float((lg - best["logits"]).abs().max())
        if d > 1e-5 * best["std"]:
            raise CaseError(f"reloaded model's logits differ from the in-memory model by {d:.3e}")
        return m, lg

    try:
        model, logits = reload_and_compare()
    except Exception as e:
        if not rewrote:
            raise
        log(f"  WARNING: the legacy config.json layout did not reload as the same model "
            f"({type(e).__name__}: {e}); keeping the layout transformers wrote")
        (case_dir / "config.json").write_text(original_cfg_text)
        style = written_style
        model, logits = reload_and_compare()

    # 4. RoPE tables transformers actually uses vs the published definitions
    inv_ref, scale_ref = expected_rope(case)
    tables = hf_rope_tables(model)
    if not tables:
        log("  note: no rotary module with inv_freq found; RoPE checked through logits only")
    for name, inv, scale in tables:
        rel = float(((inv - inv_ref).abs() / inv_ref).max()) if inv.shape == inv_ref.shape else float("inf")
        if rel > 1e-5 or abs(scale - scale_ref) > 1e-6:
            raise CaseError(f"transformers RoPE ({name}) differs from {case.rope['rope_type']}: "
                            f"inv_freq rel err {rel:.2e}, attention scale {scale} vs {scale_ref}")

    # 5. final greedy from the reloaded checkpoint
    out, margins = greedy(model, prompt_ids, device)
    if out != best["out"]:
        raise CaseError("greedy output of the reloaded model differs from the in-memory model")
    std = float(logits.std())
    min_margin = min(margins)

    # 6. independent float64 forward from model.safetensors
    w = read_safetensors(st_path, case)
    ref = ref_forward(w, case, input_ids)
    ref_diff = float((ref - logits.double()).abs().max())
    if ref_diff > REF_CHECK_REL * std:
        raise CaseError(f"transformers logits differ from the independent fp64 forward by "
                        f"{ref_diff:.3e} (logit std {std:.3f}); the case is not what it claims")
    full = prompt_ids + out[:-1]
    ref_full = ref_forward(w, case, full)[PROMPT_LEN - 1:]
    ref_tokens = ref_full.argmax(-1).tolist()
    if ref_tokens != out:
        raise CaseError("independent fp64 forward disagrees with the greedy tokens")

    # 7. reference.json
    fields = {
        "case": case.name,
        "family": case.family,
        "architecture": case.architecture,
        "saved_dtype": case.saved_dtype,
        "config_style": style,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": seed,
        "logit_std": fmt(std),
        "input_ids": input_ids,
        "greedy": {"prompt_ids": prompt_ids, "output_ids": out, "min_margin": fmt(min_margin)},
    }
    write_reference(case_dir / "reference.json", fields, logits)

    n_params = sum(p.numel() for p in model.parameters())
    files = {p.name: p.stat().st_size for p in sorted(case_dir.iterdir()) if p.is_file()}
    log(f"  seed {seed}, config {style}, min margin {min_margin:.4g} ({min_margin / std:.2e} x std), "
        f"fp64 check max diff {ref_diff:.2e}")
    return dict(case=case.name, dtype=case.saved_dtype, params=n_params, files=files, seed=seed,
                min_margin=min_margin, rel_margin=min_margin / std, ref_diff=ref_diff, style=style,
                met=best["ok"])


# ----------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/data/hf",
                    help="output directory (relative paths are relative to the repository root)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda if available, else cpu")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c.name for c in CASES],
                    help="only these cases (default: all)")
    ap.add_argument("--max-seeds", type=int, default=20)
    ap.add_argument("--no-legacy-config", action="store_true",
                    help="keep every config.json exactly as transformers wrote it")
    args = ap.parse_args()

    try:
        import transformers
        import safetensors  # noqa: F401
    except ImportError as e:
        print(f"error: {e}; this script needs torch, transformers and safetensors", file=sys.stderr)
        return 2

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
            results.append(run_case(case, out_root, device, args.max_seeds, not args.no_legacy_config))
        except Exception as e:
            traceback.print_exc()
            failures.append(f"{case.name}: {type(e).__name__}: {e}")

    # summary
    hdr = (f"{'case':32} {'dtype':9} {'params':>8} {'safetensors':>11} {'reference':>9} "
           f"{'dir total':>9} {'seed':>5} {'min_margin':>10} {'x std':>8} {'fp64 diff':>9}  config")
    log("\n" + hdr + "\n" + "-" * len(hdr))
    total = 0
    oversize = []
    for r in results:
        st = r["files"].get("model.safetensors", 0)
        dir_total = sum(r["files"].values())
        total += dir_total
        flag = ""
        if st > HARD_SIZE_LIMIT:
            oversize.append(f"{r['case']}: model.safetensors is {st} bytes (> {HARD_SIZE_LIMIT})")
            flag = "  TOO BIG"
        elif st > SOFT_SIZE_LIMIT:
            flag = "  (> 400 KB)"
        if not r["met"]:
            flag += "  MARGIN BELOW TARGET"
        log(f"{r['case']:32} {r['dtype']:9} {r['params']:>8} {st:>11} "
            f"{r['files'].get('reference.json', 0):>9} {dir_total:>9} {r['seed']:>5} "
            f"{r['min_margin']:>10.4g} {r['rel_margin']:>8.2e} {r['ref_diff']:>9.2e}  {r['style']}{flag}")
    log(f"total {total} bytes in {len(results)} case directories")
    if total > TOTAL_SIZE_WARN:
        log(f"note: total exceeds {TOTAL_SIZE_WARN} bytes")

    if oversize:
        print("error: refusing oversize checkpoints:\n  " + "\n  ".join(oversize), file=sys.stderr)
    if failures:
        print("error: cases failed:\n  " + "\n  ".join(failures), file=sys.stderr)
    return 1 if (oversize or failures) else 0


if __name__ == "__main__":
    sys.exit(main())
