#!/usr/bin/env python3
"""A development export of a train.py state without torch, for trying e4kv on it between GPU calls.

train.py keeps its state as FP16 tensors under transformers' in-memory names
(weights.safetensors). This writes them in the layout transformers 5.17's save_pretrained uses on
disk (per-expert gate/up/down tensors, the PLE n-gram table in `split_ngram_parts` row shards,
the tied lm_head left out) with a config.json built from model_config.py, so e4kv can load it on
the development machine. The checkpoint that ships is written by transformers itself
(`train.py --export`); this one is for development only and is never committed.

    python3 tools/tiny_model/export_local.py STATE_DIR DATA_DIR OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_config  # noqa: E402


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], body[a:b])
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, offset, parts = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        parts.append(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(parts))


def disk_tensors(state: dict) -> dict:
    """In-memory names and shapes -> save_pretrained's on-disk ones."""
    parts = model_config.ARCH["split_ngram_parts"]
    out = {}
    for name, (dtype, shape, raw) in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):          # [E, 2I, H]
            e, two_i, h = shape
            step = two_i * h * 2
            for k in range(e):
                w = raw[k * step:(k + 1) * step]
                base = name.replace("gate_up_proj", f"{k}.")
                out[base + "gate_proj.weight"] = (dtype, [two_i // 2, h], w[:step // 2])
                out[base + "up_proj.weight"] = (dtype, [two_i // 2, h], w[step // 2:])
        elif name.endswith("mlp.experts.down_proj"):           # [E, H, I]
            e, h, i = shape
            step = h * i * 2
            for k in range(e):
                out[name.replace("down_proj", f"{k}.down_proj.weight")] = (
                    dtype, [h, i], raw[k * step:(k + 1) * step])
        elif name.endswith("ngram_embedding.weight"):
            rows, dim = shape
            if rows % parts:
                raise SystemExit(f"{name}: {rows} rows do not split into {parts} parts")
            step = rows // parts * dim * 2
            for k in range(parts):
                out[name.replace(".weight", f".shard_{k}.weight")] = (
                    dtype, [rows // parts, dim], raw[k * step:(k + 1) * step])
        else:
            out[name] = (dtype, shape, raw)
    return out


def config_json() -> dict:
    kw = model_config.config_kwargs()
    cfg = {"architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text",
           "dtype": "float16", "attention_dropout": 0.0, "output_router_logits": False,
           "number_of_conv_states": 3}
    cfg.update(kw)
    return dict(sorted(cfg.items()))


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    state_dir, data_dir, out = (Path(a) for a in sys.argv[1:])
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    tensors = disk_tensors(read_safetensors(state_dir / "weights.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = [names[:half], names[half:]]
    weight_map, total = {}, 0
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, {n: tensors[n] for n in group})
        for n in group:
            weight_map[n] = fname
            total += len(tensors[n][2])
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config_json(), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": model_config.EOS_ID, "pad_token_id": model_config.EOS_ID,
         "do_sample": False}, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / f, out / f)
    print(f"wrote {out}: {len(tensors)} tensors, {total:,} bytes in {len(shards)} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
