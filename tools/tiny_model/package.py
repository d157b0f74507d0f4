#!/usr/bin/env python3
"""Put the exported tiny model into the repository: models/tiny-qwen4exp and data/tiny.

    python3 tools/tiny_model/package.py EXPORT_DIR DATA_DIR [--force]

EXPORT_DIR is what `train.py --export` wrote under its $OUT (model/ with config.json,
generation_config.json, the safetensors shards and their index, training.json); DATA_DIR is
make_data.py's output (tokenizer.json, tokenizer_config.json with the chat template, meta.json,
calibration.jsonl, eval.jsonl). Checks the embedded model's limits (at most 25 MB of weights, at least two
shards with an index) and writes the model card (README.md) from training.json and meta.json.
Refuses to replace an existing model directory without --force.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_OUT = ROOT / "models" / "tiny-qwen4exp"
DATA_OUT = ROOT / "data" / "tiny"


def card(training: dict, meta: dict, weights: int, shards: list[str]) -> str:
    counters, ev = training["counters"], training["eval"]
    parts = model_config.expected_parameters()
    a = model_config.ARCH
    rows = "\n".join(
        f"| {s['package']} | {s['version']} | {s['kind']} | {s['licence']} |"
        for s in meta["sources"])
    passkey = " / ".join(
        f"{int(ev[f'passkey_{c}_{d}'] * 5)}/5" for c in (1024, 8192) for d in (0, 50, 100))
    return f"""# tiny-qwen4exp

A small model of the Qwen4Exp family (`Qwen4ExpForCausalLM`: QSA and GatedDeltaNet layers, MoE,
hyper-connections, PLE) trained for e4kv as its embedded default: big enough to have real
attention patterns, a trained QSA indexer and passkey retrieval, small enough to ship
({weights / 1e6:.1f} MB of FP16 weights in {len(shards)} shards). It is a test model, not an
assistant: it continues text and code in the style of Debian's documentation and sources.

## Architecture

{model_config.LAYERS} layers ({len(model_config.qsa_layers())} QSA at {model_config.qsa_layers()},
the rest GatedDeltaNet), hidden {model_config.HIDDEN}; attention {a['num_attention_heads']} query /
{a['num_key_value_heads']} KV heads of {a['head_dim']} (partial RoPE {a['partial_rotary_factor']});
QSA indexer {a['indexer_n_heads']} heads of {a['indexer_head_dim']}, budget
{a['indexer_budget']} tokens, compress ratio {a['indexer_compress_ratio']}; MoE
{a['num_experts']} experts of {a['moe_intermediate_size']} (top-{a['num_experts_per_tok']},
normalised) plus a gated shared expert of {a['shared_expert_intermediate_size']};
{a['hc_count']} hyper-connection streams (rank {a['hc_lowrank']}); PLE on layer
{a['ple_layer_ids']} (trigram, {a['heads_per_ngram']} hash heads per order); vocabulary
{model_config.VOCAB_SIZE} (byte-level BPE), tied embeddings; {parts['total']:,} parameters.

## How it was made

- Data (`tools/tiny_model/make_data.py`, seed {meta['seed']}): {sum(meta['corpus_bytes'].values()) / 1e6:.1f} MB of text and code that
  Debian packages install, {meta['tokens']['train']:,} training tokens, plus generated retrieval
  tasks (passkeys and key-value lookups at random depths, 512-8192 tokens). Sources and licences:

| package | version | kind | licence |
|---|---|---|---|
{rows}

- Tokenizer: a byte-level BPE of {model_config.VOCAB_SIZE} ids trained by the same script
  (`tokenizer.json`; `<|endoftext|>` {model_config.EOS_ID} is EOS; a ChatML chat template).
- Training (`tools/tiny_model/train.py`, transformers 5.17's own Qwen4Exp classes on one H200):
  {counters['tokens']:,} tokens in {counters['steps']:,} steps over {counters['calls']} device
  calls; context 1024 with dense attention first, then the real sparse selection at 2048, 4096 and
  8192 tokens; the indexer distilled towards the dense attention mass per block. Records:
  `bench/notes/tiny_model_training.md`.

## How well it does

At the end of training (transformers, sparse selection, teacher-forced): validation loss
{ev['val_loss_1024']:.3f} at 1024 tokens and {ev['val_loss_8192']:.3f} at 8192; passkey (e4kv
compare's prompt format, 5 prompts per cell) at 1024 / 8192 tokens, depths 0/50/100: {passkey}.
FP16 against calibrated E4M3 KV in e4kv: `docs/quality.md`.

## Files

`config.json`, `generation_config.json` and the shards as transformers' `save_pretrained` wrote
them; `tokenizer.json` and `tokenizer_config.json` from make_data.py; `training.json` (counters and
the final evaluation). Calibration and evaluation sets: `data/tiny/`.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--model-out", type=Path, default=MODEL_OUT)
    ap.add_argument("--data-out", type=Path, default=DATA_OUT)
    args = ap.parse_args()
    model_out, data_out = args.model_out, args.data_out
    src = args.export / "model"
    if not (src / "config.json").exists():
        raise SystemExit(f"{src}: no config.json; give the directory train.py --export wrote")
    if model_out.exists() and not args.force:
        raise SystemExit(f"{model_out}: exists; --force replaces it")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    weights = sum((src / s).stat().st_size for s in shards)
    if len(shards) < 2:
        raise SystemExit(f"{len(shards)} shard(s); the issue asks for at least two")
    if weights > model_config.MAX_WEIGHT_BYTES:
        raise SystemExit(f"{weights:,} bytes of weights; the limit is "
                         f"{model_config.MAX_WEIGHT_BYTES:,}")
    training = json.loads((src / "training.json").read_text())
    meta = json.loads((args.data / "meta.json").read_text())
    if model_out.exists():
        shutil.rmtree(model_out)
    model_out.mkdir(parents=True)
    for name in ["config.json", "generation_config.json", "model.safetensors.index.json",
                 "training.json", *shards]:
        shutil.copy(src / name, model_out / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.data / name, model_out / name)
    (model_out / "README.md").write_text(card(training, meta, weights, shards))
    data_out.mkdir(parents=True, exist_ok=True)
    for name in ("calibration.jsonl", "eval.jsonl"):
        shutil.copy(args.data / name, data_out / name)
    print(f"wrote {model_out} ({weights:,} bytes of weights, {len(shards)} shards) and "
          f"{data_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
