#!/usr/bin/env python3
"""Where the QSA attention-output error of an E4M3 KV cache comes from, measured with transformers'
own Qwen4Exp classes (an independent reference for `e4kv compare`'s relative L2; docs/quality.md).

Every QSA layer's attention is evaluated several times on the same inputs: with K and V as an FP16
cache holds them (the reference), with only K rounded to E4M3, only V, and both, at the per-layer
absmax scales (absmax / 448 over the calibration corpus, as `summarize --policy absmax`) and at
unit scale. The forward always continues with the reference output, so every layer sees FP16
inputs and the indexer's FP16 selection: the figures are the rounding error of the cache format
alone, with no error carried from earlier layers and no selection change (which `compare`
includes). Relative L2 is pooled over all rows of all documents per layer (as `compare` pools),
on the attention output before the output gate ("ungated") and after it ("gated": what the engine's
probe sees, the output o_proj reads).

The "rot" variants store K (and V) multiplied by a fixed orthogonal matrix R = D H / sqrt(d) (H the
Sylvester Hadamard matrix, D random signs) and multiply the read-back values by R^T, which is what
an attention that also rotates the query (q R . k R = q . k) computes: the incoherent processing of
FlashAttention-3's FP8 path, measured here as a candidate, not something e4kv does.

Usage: scripts/hf_kv_rounding_floor.py MODEL_DIR DATA_DIR OUT.json [--device cuda]
       [--calibration-docs N] [--eval-docs N]
(DATA_DIR holds calibration.jsonl and eval.jsonl, e.g. data/tiny; the first N documents of each,
all by default. `e4kv compare --isolated` measures the same thing in the engine: the quality test
compares the two on its subset.)
"""
import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from transformers.models.qwen4_exp import modeling_qwen4_exp as M

E4M3_MAX = 448.0


def round_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x stored as E4M3 with `scale` (x / scale rounded to nearest even, saturated) and read back."""
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return y.to(torch.float32) * scale


@functools.lru_cache(maxsize=None)
def rotation(d: int, device) -> torch.Tensor:
    """R = D H / sqrt(d): H the Sylvester Hadamard matrix, D fixed random signs; orthogonal."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise SystemExit(f"head_dim {d} is not a power of two: no Hadamard rotation")
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return (signs[:, None].float() * h / math.sqrt(d)).to(device)


def attention(module, q, k, v, mask, scaling):
    """Eager attention in fp32: q [B, Hq, T, d], k/v [B, Hkv, S, d], mask additive or boolean."""
    k = M.repeat_kv(k, module.num_key_value_groups)
    v = M.repeat_kv(v, module.num_key_value_groups)
    logits = torch.matmul(q.float(), k.float().transpose(2, 3)) * scaling
    if mask is not None:
        mask = mask[:, :, :, : k.shape[-2]]
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, v.float())  # [B, Hq, T, d]


class Probe:
    mode = "absmax"  # "absmax": collect per-layer absmax; "measure": accumulate the errors
    absmax: dict = {}
    scales: dict = {}
    sums: dict = {}  # (layer, variant) -> [sum |a-b|^2, sum |b|^2]
    hidden: dict = {}  # layer -> the attention module's input of the current forward
    element: dict = {}  # (layer, K|V, scale name) -> [sum |round(x)-x|^2, sum |x|^2]


def probe_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
    layer = module.layer_idx
    k16, v16 = key.half().float(), value.half().float()  # what an FP16 cache holds
    ref = attention(module, query, k16, v16, attention_mask, scaling)
    R = rotation(key.shape[-1], key.device)  # built once per head_dim and device
    if Probe.mode == "absmax":
        for name, x in (("K", k16), ("V", v16), ("Krot", k16 @ R), ("Vrot", v16 @ R)):
            Probe.absmax[(layer, name)] = max(Probe.absmax.get((layer, name), 0.0),
                                              float(x.abs().max()))
    else:
        for scale_name in ("absmax", "unit"):
            sk = Probe.scales[(layer, "K")] if scale_name == "absmax" else 1.0
            sv = Probe.scales[(layer, "V")] if scale_name == "absmax" else 1.0
            kq, vq = round_e4m3(k16, sk), round_e4m3(v16, sv)
            for name, x, xq in (("K", k16, kq), ("V", v16, vq)):
                e = Probe.element.setdefault((layer, name, scale_name), [0.0, 0.0])
                e[0] += float((xq - x).double().pow(2).sum())
                e[1] += float(x.double().pow(2).sum())
            gate = output_gate(module, Probe.hidden[layer]).double()
            variants = [("K", (kq, v16)), ("V", (k16, vq)), ("KV", (kq, vq))]
            if scale_name == "absmax":
                kr = round_e4m3(k16 @ R, Probe.scales[(layer, "Krot")]) @ R.T
                vr = round_e4m3(v16 @ R, Probe.scales[(layer, "Vrot")]) @ R.T
                for name, x, xq in (("Krot", k16, kr), ("Vrot", v16, vr)):
                    e = Probe.element.setdefault((layer, name, scale_name), [0.0, 0.0])
                    e[0] += float((xq - x).double().pow(2).sum())
                    e[1] += float(x.double().pow(2).sum())
                variants += [("Krot", (kr, v16)), ("Krot_V", (kr, vq)), ("KVrot", (kr, vr))]
            for variant, (kk, vv) in variants:
                out = attention(module, query, kk, vv, attention_mask, scaling)
                a, b = out.double(), ref.double()
                for form, g in (("ungated", 1.0), ("gated", gate)):
                    s = Probe.sums.setdefault((layer, f"{form}_{variant}@{scale_name}"), [0.0, 0.0])
                    s[0] += float(((a - b) * g).pow(2).sum())
                    s[1] += float((b * g).pow(2).sum())
    return ref.transpose(1, 2).contiguous().to(query.dtype), None


def output_gate(module, hidden: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate) [B, Hq, T, d] as Qwen4ExpTextAttention.forward computes it, FP16-rounded as
    the engine's kernel reads it."""
    shape = (*hidden.shape[:-1], -1, module.head_dim * 2)
    _, gate = torch.chunk(module.q_proj(hidden).view(shape), 2, dim=-1)
    return torch.sigmoid(gate.half().float()).transpose(1, 2)


def stash_input(module, args, kwargs):
    Probe.hidden[module.layer_idx] = args[0] if args else kwargs["hidden_states"]


def read_texts(path: Path) -> list[str]:
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "text" in row:
                texts.append(row["text"])
            elif "messages" in row:  # a conversation: its turns' contents, one after another
                texts.append("\n".join(m["content"] for m in row["messages"]))
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calibration-docs", type=int, default=None)
    ap.add_argument("--eval-docs", type=int, default=None)
    args = ap.parse_args()
    t0 = time.time()
    device = torch.device(args.device)
    M.eager_attention_forward = probe_forward
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(
        str(args.model), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32, local_files_only=True).to(device).eval()
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    for module in model.modules():
        if isinstance(module, M.Qwen4ExpTextAttention):
            module.register_forward_pre_hook(stash_input, with_kwargs=True)

    def run(texts):
        tokens = 0
        for text in texts:
            ids = tok.encode(text).ids
            tokens += len(ids)
            with torch.no_grad():
                model(input_ids=torch.tensor([ids], device=device), use_cache=False)
        return tokens

    Probe.mode = "absmax"
    calib_tokens = run(read_texts(args.data / "calibration.jsonl")[: args.calibration_docs])
    if not Probe.absmax:
        raise SystemExit("the attention probe was never called: transformers no longer routes "
                         "eager attention through modeling_qwen4_exp.eager_attention_forward")
    for key, a in Probe.absmax.items():
        # the smallest fp32 s with fl(a / s) <= 448, as summarize computes it
        s = torch.tensor(a / E4M3_MAX, dtype=torch.float32)
        while float(torch.tensor(a, dtype=torch.float32) / s) > E4M3_MAX:
            s = torch.nextafter(s, torch.tensor(math.inf))
        Probe.scales[key] = float(s)
    Probe.mode = "measure"
    eval_tokens = run(read_texts(args.data / "eval.jsonl")[: args.eval_docs])

    layers = sorted({layer for layer, _ in Probe.scales})
    result = {"model": str(args.model), "transformers": transformers.__version__,
              "torch": torch.__version__, "device": str(device),
              "calibration_tokens": calib_tokens, "eval_tokens": eval_tokens, "layers": {}}
    for layer in layers:
        entry = {f"scale_{name.lower()}": Probe.scales[(layer, name)]
                 for name in ("K", "V", "Krot", "Vrot")}
        for (lyr, name, scale_name), (err, ref) in Probe.element.items():
            if lyr == layer:
                entry[f"{name}_element_rel_l2@{scale_name}"] = math.sqrt(err / ref)
        for (lyr, variant), (err, ref) in Probe.sums.items():
            if lyr == layer:
                entry[f"output_rel_l2_{variant}"] = math.sqrt(err / ref)
        entry = dict(sorted(entry.items()))
        result["layers"][str(layer)] = entry
    for variant in sorted({v for _, v in Probe.sums}):
        err = sum(s[0] for (_, v), s in Probe.sums.items() if v == variant)
        ref = sum(s[1] for (_, v), s in Probe.sums.items() if v == variant)
        result[f"aggregate_output_rel_l2_{variant}"] = math.sqrt(err / ref)
    result["seconds"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
