#!/usr/bin/env python3
"""transformers' logits on the dequantized checkpoints of tests/data/quant: the reference e4kv's
quantized checkpoints are checked against (run on the GPU machine, whose image has torch and
transformers 5.17; the CPU is enough).

For every case directory CASE (with quantized/ and dequantized/), loads CASE/dequantized with the
architecture its config.json names, in fp32 with eager attention (and eager experts), and writes
CASE/reference.json:

    {"architecture", "transformers_version", "torch_version",
     "input_ids": the ids below, "logits": [[vocab floats] per position],
     "greedy": {"prompt_ids", "output_ids": 16 ids, "min_margin": the smallest top1 - top2 gap}}

`greedy` is a plain argmax loop (a full forward per step, no cache). The checkpoint directories are
only read. Usage: scripts/hf_reference_quant.py [--data tests/data/quant] [--device cpu|cuda]
[--out DIR]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

INPUT_IDS = [1, 17, 42, 7, 99, 3, 250, 64, 5, 128, 33, 2]
GEN_STEPS = 16


def load(dequantized: Path, device: torch.device):
    import transformers
    config = json.loads((dequantized / "config.json").read_text())
    arch = config["architectures"][0]
    cls = getattr(transformers, arch)
    kw = dict(attn_implementation="eager", local_files_only=True, dtype=torch.float32)
    if "qwen4" in config.get("model_type", "").lower():
        kw["experts_implementation"] = "eager"
    model = cls.from_pretrained(str(dequantized), **kw)
    return arch, model.float().eval().to(device)


@torch.inference_mode()
def logits_of(model, ids, device):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0].float().cpu()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parent.parent / "tests/data/quant"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="",
                   help="write OUT/CASE/reference.json instead of beside the case (a device run)")
    args = p.parse_args()
    import transformers
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = sorted(d for d in Path(args.data).iterdir() if (d / "dequantized/config.json").exists())
    if not cases:
        print(f"{args.data}: no case with a dequantized/ checkpoint", file=sys.stderr)
        return 1
    for case in cases:
        arch, model = load(case / "dequantized", device)
        logits = logits_of(model, INPUT_IDS, device)
        ids, out, margins = list(INPUT_IDS), [], []
        for _ in range(GEN_STEPS):
            top = torch.topk(logits_of(model, ids, device)[-1], 2)
            margins.append(float(top.values[0] - top.values[1]))
            out.append(int(top.indices[0]))
            ids.append(out[-1])
        ref = {"architecture": arch, "transformers_version": transformers.__version__,
               "torch_version": torch.__version__, "input_ids": INPUT_IDS,
               "logits": logits.tolist(),
               "greedy": {"prompt_ids": INPUT_IDS, "output_ids": out,
                          "min_margin": min(margins)}}
        dest = Path(args.out) / case.name if args.out else case
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "reference.json").write_text(json.dumps(ref))
        print(f"{case.name}: {arch}, min greedy margin {min(margins):.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
