#!/usr/bin/env python3
"""Train the tiny Qwen4Exp model with transformers' own Qwen4Exp implementation.

Runs on the GPU machine (torch, transformers 5.17, tokenizers, safetensors), in calls of a few
minutes: each call reads the state a previous call wrote (FP16 weights and counters), trains until
its time is up, and writes the state back, so training resumes across calls and sessions.

    python3 tools/tiny_model/train.py --data D --state S --out O --minutes 8.5 [--total-tokens N]
    python3 tools/tiny_model/train.py --data D --state S --out O --selfcheck   # no training
    python3 tools/tiny_model/train.py --data D --state S --out O --export      # HF checkpoint

D holds make_data.py's outputs (train.bin[.gz], val.bin, retrieval_train.jsonl[.gz],
tokenizer.json); S the state of the previous call (may be empty: a fresh model); O receives the
new state (weights.safetensors, state.json), train_log.jsonl, and with --export the checkpoint.

What it does beyond a language-model loss:
- The reference indexer (Qwen4ExpTextQSAIndexer.forward) loops over every query in Python, far
  too slow for training at 8K; `fast_indexer_forward` computes the same selection for a plain
  causal mask in a few batched ops. --selfcheck compares the two masks row by row, and the logits
  of both, on the real configuration before anything else.
- The indexer is trained by distillation: its block scores go through a softmax and are pulled
  (KL) towards the dense attention mass per block of the main attention of the same layer, on a
  sample of query rows, with the indexer's input detached (the indexer's selection is a top-k, so
  the language-model loss does not reach it). The first phase trains with dense attention (every
  block selected), the later ones with the real sparse selection at growing context lengths.
- Retrieval rows: make_data.py's passkey / key-value tasks and generated passkey prompts in the
  format `e4kv compare --task passkey` uses; the answer tokens get an extra loss term.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_config  # noqa: E402

from transformers.models.qwen4_exp import modeling_qwen4_exp as M  # noqa: E402

# ----------------------------------------------------------------------------------------------
# the training plan
# ----------------------------------------------------------------------------------------------

TOKENS_PER_STEP = 65536
PEAK_LR = 2e-3
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 200          # the first call's warm-up
RESUME_WARMUP_STEPS = 50    # Adam moments restart at every call (they do not travel)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
DISTILL_ROWS = 128          # query rows per sequence and QSA layer for the indexer loss
ANSWER_WEIGHT = 1.0         # the retrieval answers' extra loss term


def phase_for(progress: float) -> tuple[int, bool, float]:
    """(context length, sparse selection on, share of retrieval rows) at progress 0..1."""
    if progress < 0.35:
        return 1024, False, 0.15
    if progress < 0.6:
        return 2048, True, 0.25
    if progress < 0.85:
        return 4096, True, 0.3
    return 8192, True, 0.35


def lr_at(progress: float, step_in_call: int, first_call: bool) -> float:
    warm = WARMUP_STEPS if first_call else RESUME_WARMUP_STEPS
    scale = min(1.0, (step_in_call + 1) / warm)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return PEAK_LR * scale * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cos)


# ----------------------------------------------------------------------------------------------
# the indexer: a batched selection equal to the reference's, and its distillation loss
# ----------------------------------------------------------------------------------------------

class Ctx:
    dense = False            # every block selected (phase 1)
    distill = False          # collect indexer losses
    losses: list = []
    recalls: list = []
    reference_indexer = False


REF_INDEXER_FORWARD = M.Qwen4ExpTextQSAIndexer.forward
REF_ATTENTION_FORWARD = M.Qwen4ExpTextAttention.forward


def indexer_block_scores(mod, hidden, cos, sin, rows=None):
    """Block scores [B, S, n_blocks] (fp32) for the query rows `rows` (all when None), and the
    number of complete blocks; the ops of the reference indexer, batched."""
    B, T, _ = hidden.shape
    dI, nI, R = mod.index_head_dim, mod.index_n_heads, mod.compress_ratio
    qk = mod.index_qk_proj(hidden)
    q, token_k = torch.split(qk, [nI * dI, mod.index_kv_heads * dI], dim=-1)
    raw_keys = token_k.reshape(B, T, -1, dI).squeeze(2)
    if rows is not None:
        q, qcos, qsin = q[:, rows], cos[:, rows], sin[:, rows]
    else:
        qcos, qsin = cos, sin
    q = mod.q_layernorm(q.reshape(B, q.shape[1], -1, dI))
    q = M.apply_rotary_pos_emb(q, cos=qcos, sin=qsin, unsqueeze_dim=2)
    nb = T // R
    pooled = raw_keys[:, : nb * R].reshape(B, nb, R, dI).float().mean(dim=2).to(raw_keys.dtype)
    pooled = mod.k_layernorm(pooled)
    starts = torch.arange(nb, device=hidden.device) * R
    bk = M.apply_rotary_pos_emb(pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts],
                                unsqueeze_dim=2).squeeze(2)
    out = []
    for s in range(0, q.shape[1], 2048):
        part = torch.einsum("bthd,bcd->bthc", q[:, s:s + 2048].float(), bk.float())
        out.append(torch.relu(part).sum(dim=2) / math.sqrt(dI))
    return torch.cat(out, dim=1), nb


def fast_indexer_forward(self, hidden_states, position_embeddings, attention_mask,
                         past_key_values=None):
    """Qwen4ExpTextQSAIndexer.forward for a plain causal mask without a cache, batched."""
    if past_key_values is not None or Ctx.reference_indexer:
        return REF_INDEXER_FORWARD(self, hidden_states, position_embeddings, attention_mask,
                                   past_key_values)
    B, T, _ = hidden_states.shape
    if Ctx.dense:
        sel = torch.ones((B, 1, T, attention_mask.shape[-1]), dtype=torch.bool,
                         device=hidden_states.device)
    else:
        with torch.no_grad():
            R = self.compress_ratio
            full_cos, full_sin = position_embeddings
            scores, nb = indexer_block_scores(self, hidden_states, full_cos[:, -T:],
                                              full_sin[:, -T:])
            t = torch.arange(T, device=hidden_states.device)
            n_blocks = (t + 1) // R                                    # complete visible blocks
            valid = torch.arange(nb, device=t.device)[None, :] < n_blocks[:, None]   # [T, nb]
            scores = scores.masked_fill(~valid, float("-inf"))
            k = min(self.block_topk, nb)
            top = scores.topk(k, dim=-1)
            idx = torch.where(torch.isfinite(top.values), top.indices, nb)
            blocks = torch.zeros((B, T, nb + 1), dtype=torch.bool, device=t.device)
            blocks = blocks.scatter(-1, idx, True)[..., :nb]
            tokens = blocks.unsqueeze(-1).expand(B, T, nb, R).reshape(B, T, nb * R)
            tokens = F.pad(tokens, (0, attention_mask.shape[-1] - nb * R))
            j = torch.arange(attention_mask.shape[-1], device=t.device)
            tail = (j[None, :] >= (n_blocks * R)[:, None]) & (j[None, :] <= t[:, None])
            sel = (tokens | tail[None]).unsqueeze(1)
    if attention_mask.is_floating_point():
        return torch.where(sel, attention_mask.new_zeros(()), torch.finfo(attention_mask.dtype).min)
    return sel


def distill_loss(attn, hidden_states, position_embeddings):
    """KL(dense attention mass per block || softmax(indexer block scores)) on sampled rows."""
    idx = attn.indexer
    R, K = idx.compress_ratio, idx.block_topk
    h = hidden_states.detach()
    B, T, _ = h.shape
    nb = T // R
    if nb < 2:
        return None
    cos, sin = (x[:, -T:] for x in position_embeddings)
    lo = 2 * R - 1
    n_rows = min(DISTILL_ROWS, T - lo)
    rows = torch.randperm(T - lo, device=h.device)[:n_rows] + lo
    rows, _ = rows.sort()
    d = attn.head_dim
    with torch.no_grad():
        q = attn.q_proj(h[:, rows]).view(B, n_rows, -1, 2 * d)
        q = attn.q_norm(torch.chunk(q, 2, dim=-1)[0]).transpose(1, 2)          # [B, Hq, S, d]
        k = attn.k_norm(attn.k_proj(h).view(B, T, -1, d)).transpose(1, 2)      # [B, Hkv, T, d]
        q = M.apply_rotary_pos_emb(q, cos=cos[:, rows], sin=sin[:, rows])
        k = M.apply_rotary_pos_emb(k, cos=cos, sin=sin)
        k = M.repeat_kv(k, attn.num_key_value_groups)
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * attn.scaling
        j = torch.arange(T, device=h.device)
        logits = logits.masked_fill(j[None, None, None, :] > rows[None, None, :, None],
                                    float("-inf"))
        probs = logits.softmax(dim=-1).mean(dim=1)                             # [B, S, T]
        mass = probs[..., : nb * R].reshape(B, n_rows, nb, R).sum(dim=-1)       # [B, S, nb]
        valid = torch.arange(nb, device=h.device)[None, :] < ((rows + 1) // R)[:, None]
        mass = mass.masked_fill(~valid, 0.0)
        target = mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    scores, _ = indexer_block_scores(idx, h, cos, sin, rows)
    logq = scores.masked_fill(~valid, float("-inf")).log_softmax(dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-20)) - logq)).masked_fill(~valid, 0.0)
    loss = kl.sum(dim=-1).mean()
    with torch.no_grad():
        sparse = ((rows + 1) // R) > K
        if bool(sparse.any()):
            top = scores.detach().masked_fill(~valid, float("-inf")).topk(min(K, nb), dim=-1)
            got = torch.gather(target, -1, top.indices).sum(dim=-1)                # [B, S]
            Ctx.recalls.append(float(got[:, sparse].mean()))
    return loss


def attention_forward(self, hidden_states, position_embeddings, attention_mask,
                      past_key_values=None, **kwargs):
    out = REF_ATTENTION_FORWARD(self, hidden_states, position_embeddings, attention_mask,
                                past_key_values, **kwargs)
    if Ctx.distill and torch.is_grad_enabled():
        loss = distill_loss(self, hidden_states, position_embeddings)
        if loss is not None:
            Ctx.losses.append(loss)
    return out


M.Qwen4ExpTextQSAIndexer.forward = fast_indexer_forward
M.Qwen4ExpTextAttention.forward = attention_forward


# ----------------------------------------------------------------------------------------------
# the model and its state
# ----------------------------------------------------------------------------------------------

def build_model(device):
    import transformers
    cfg = transformers.Qwen4ExpTextConfig(architectures=["Qwen4ExpForCausalLM"],
                                          **model_config.config_kwargs())
    for key, want in (("layer_types", model_config.layer_types()),
                      ("indexer_budget", model_config.ARCH["indexer_budget"]),
                      ("hc_count", model_config.ARCH["hc_count"]),
                      ("ple_layer_ids", model_config.ARCH["ple_layer_ids"])):
        if getattr(cfg, key) != want:
            raise SystemExit(f"config field {key} reads back as {getattr(cfg, key)!r}")
    model = transformers.Qwen4ExpForCausalLM._from_config(
        cfg, attn_implementation="sdpa", experts_implementation="eager", dtype=torch.float32)
    got = sum(p.numel() for p in model.parameters())
    want = model_config.expected_parameters()["total"]
    if got != want:
        raise SystemExit(f"model has {got:,} parameters, model_config expects {want:,}")
    return model.to(device)


def float_state(model) -> dict:
    """Floating tensors to save, FP16; the tied lm_head and integer buffers left out."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" or not t.is_floating_point():
            continue
        out[name] = t.detach().to(torch.float16).contiguous().cpu()
    return out


def save_state(model, out: Path, counters: dict) -> None:
    from safetensors.torch import save_file
    save_file(float_state(model), str(out / "weights.safetensors"))
    (out / "state.json").write_text(json.dumps(counters, indent=1))


def load_state(model, state: Path) -> dict:
    w = state / "weights.safetensors"
    if not w.exists():
        return {"tokens": 0, "steps": 0, "calls": 0, "seed": 1234}
    from safetensors.torch import load_file
    tensors = load_file(str(w))
    own = model.state_dict()
    missing = [n for n, t in own.items()
               if t.is_floating_point() and n != "lm_head.weight" and n not in tensors]
    extra = [n for n in tensors if n not in own]
    if missing or extra:
        raise SystemExit(f"{w}: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for n, t in tensors.items():
            if tuple(own[n].shape) != tuple(t.shape):
                raise SystemExit(f"{w}: {n} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(own[n].shape)}")
            own[n].copy_(t.to(own[n].dtype))
    return json.loads((state / "state.json").read_text())


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------

def read_bin(path: Path) -> np.ndarray:
    if not path.exists() and Path(str(path) + ".gz").exists():
        return np.frombuffer(gzip.decompress(Path(str(path) + ".gz").read_bytes()), dtype="<u2")
    return np.frombuffer(path.read_bytes(), dtype="<u2")


def read_jsonl(path: Path) -> list[dict]:
    gz = Path(str(path) + ".gz")
    text = gzip.decompress(gz.read_bytes()).decode() if not path.exists() and gz.exists() \
        else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class Data:
    def __init__(self, root: Path, rng: random.Random):
        from tokenizers import Tokenizer
        self.rng = rng
        self.train = read_bin(root / "train.bin")
        self.val = read_bin(root / "val.bin")
        self.tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        self.eos = model_config.EOS_ID
        tasks = read_jsonl(root / "retrieval_train.jsonl")
        self.tasks = []
        for t in tasks:
            p = self.encode(t["prompt"] + "\n")
            a = self.encode(t["answer"])
            self.tasks.append((p, a))
        self.tasks.sort(key=lambda pa: len(pa[0]) + len(pa[1]))
        # the passkey format of `e4kv compare --task passkey`
        self.pk_head = self.encode(
            "There is a pass key hidden in the text below. Find it and remember it.\n")
        self.pk_filler = self.encode(
            "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
            "again. ")
        self.pk_question = self.encode("\nWhat is the pass key? The pass key is")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def window(self, n: int, source=None) -> list[int]:
        src = self.train if source is None else source
        s = self.rng.randrange(0, len(src) - n - 1)
        return src[s:s + n].tolist()

    def passkey(self, context: int, depth: float, key: str) -> tuple[list[int], list[int]]:
        needle = self.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        fill = max(0, context - len(self.pk_head) - len(needle) - len(self.pk_question))
        body = (self.pk_filler * (fill // len(self.pk_filler) + 1))[:fill]
        at = int(fill * depth)
        prompt = self.pk_head + body[:at] + needle + body[at:] + self.pk_question
        return prompt, self.encode(f" {key}.")

    def retrieval_row(self, ctx: int) -> tuple[list[int], list[int]]:
        """A retrieval prompt + answer (<= ctx tokens), EOS, then text; the answer's mask."""
        if self.rng.random() < 0.5:
            n = self.rng.randint(max(64, ctx // 8), ctx - 16)
            prompt, answer = self.passkey(n, self.rng.random(), str(self.rng.randint(10000, 99999)))
        else:
            fitting = [pa for pa in self.tasks if len(pa[0]) + len(pa[1]) < ctx]
            if not fitting:
                prompt, answer = self.passkey(ctx - 16, self.rng.random(),
                                              str(self.rng.randint(10000, 99999)))
            else:
                prompt, answer = self.rng.choice(fitting)
        ids = prompt + answer + [self.eos]
        mask = [0] * len(prompt) + [1] * len(answer) + [0]
        rest = ctx + 1 - len(ids)
        if rest > 0:
            ids += self.window(rest)
            mask += [0] * rest
        return ids[:ctx + 1], mask[:ctx + 1]

    def batch(self, ctx: int, retrieval_share: float, device):
        rows = max(1, TOKENS_PER_STEP // ctx)
        ids, mask = [], []
        for _ in range(rows):
            if self.rng.random() < retrieval_share:
                i, m = self.retrieval_row(ctx)
            else:
                i, m = self.window(ctx + 1), [0] * (ctx + 1)
            ids.append(i)
            mask.append(m)
        x = torch.tensor(ids, dtype=torch.long, device=device)
        m = torch.tensor(mask, dtype=torch.bool, device=device)
        return x[:, :-1], x[:, 1:], m[:, 1:]


# ----------------------------------------------------------------------------------------------
# loss, steps, evaluation
# ----------------------------------------------------------------------------------------------

class RouterLogits:
    def __init__(self, model):
        self.logits = []
        for mod in model.modules():
            if type(mod).__name__ == "Qwen4ExpTextTopKRouter":
                mod.register_forward_hook(self._hook)

    def _hook(self, mod, args, output):
        if torch.is_grad_enabled():
            self.logits.append(output[0])


def step_losses(model, router, x, y, answer_mask, cfg):
    Ctx.losses, router.logits = [], []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=x, use_cache=False).logits
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                         reduction="none").view_as(y)
    lm = ce.mean()
    answer = (ce * answer_mask).sum() / answer_mask.sum().clamp_min(1)
    aux = M.load_balancing_loss_func(tuple(router.logits), cfg.num_experts,
                                     cfg.num_experts_per_tok) * cfg.router_aux_loss_coef
    distill = torch.stack(Ctx.losses).mean() if Ctx.losses else torch.zeros((), device=x.device)
    return lm, answer, aux, distill


@torch.no_grad()
def evaluate(model, data: Data, device, contexts=(1024, 8192), windows=4) -> dict:
    """Validation loss per context (sparse selection), teacher-forced passkey accuracy (all five
    digits and the period right) per context and depth."""
    model.eval()
    Ctx.dense, Ctx.distill = False, False
    out = {}
    rng = random.Random(99)
    for ctx in contexts:
        losses = []
        for w in range(windows):
            s = rng.randrange(0, len(data.val) - ctx - 1)
            ids = torch.tensor(data.val[s:s + ctx + 1].astype(np.int64), device=device)[None]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids[:, :-1], use_cache=False).logits
            losses.append(float(F.cross_entropy(logits[0].float(), ids[0, 1:])))
        out[f"val_loss_{ctx}"] = sum(losses) / len(losses)
        for depth in (0.0, 0.5, 1.0):
            ok = 0
            for trial in range(5):
                key = str(10000 + (trial * 7919 + int(depth * 100) * 104729 + ctx) % 90000)
                prompt, answer = data.passkey(ctx - 8, depth, key)
                ids = torch.tensor(prompt + answer, device=device)[None]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
                pred = logits[0, len(prompt) - 1:].argmax(-1)
                ok += int(bool((pred == ids[0, len(prompt):]).all()))
            out[f"passkey_{ctx}_{int(depth * 100)}"] = ok / 5
    model.train()
    return out


def selfcheck(model, device, log) -> bool:
    """The batched indexer against the reference's per-query loop, on the real configuration.

    Both compute the same block scores with fp32 sums in different orders, so a row may select
    differently where two blocks' scores are within rounding of each other at the k-th place:
    every differing row must be such a near tie (a gap between the k-th and the next block below
    1e-4 of the row's largest score, in the batched scores; relu makes exact zeros common).
    """
    model.eval()
    torch.manual_seed(0)
    T = model.config.indexer_budget * 2 + 37
    ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    masks, inputs = {}, {}

    def grab(tag):
        def hook(mod, args, output):
            masks[(tag, mod.layer_idx)] = output.detach().clone()
            inputs[(tag, mod.layer_idx)] = (args[0].detach(), args[1])
        return hook

    ok = True
    with torch.no_grad():
        outs = {}
        for tag, ref in (("ref", True), ("fast", False)):
            handles = [m.register_forward_hook(grab(tag)) for m in layers]
            Ctx.reference_indexer, Ctx.dense = ref, False
            outs[tag] = model(input_ids=ids, use_cache=False).logits.float()
            for h in handles:
                h.remove()
        Ctx.reference_indexer = False
        for m in layers:
            a, b = masks[("ref", m.layer_idx)], masks[("fast", m.layer_idx)]
            rows = torch.nonzero((a != b).any(dim=-1)[0, 0]).flatten()
            worst_gap = 0.0
            if rows.numel():
                hidden, (cos, sin) = inputs[("fast", m.layer_idx)]
                scores, _ = indexer_block_scores(m, hidden, cos[:, -T:], sin[:, -T:], rows)
                for i, t in enumerate(rows.tolist()):
                    n = (t + 1) // m.compress_ratio
                    srt = scores[0, i, :n].sort(descending=True).values
                    k = m.block_topk
                    gap = float((srt[k - 1] - srt[k]) / srt[0].abs().clamp_min(1e-30))
                    worst_gap = max(worst_gap, gap)
            log(f"selfcheck: layer {m.layer_idx}: mask rows differing {rows.numel()} of {T}, "
                f"largest relative gap at the k-th block among them {worst_gap:.3g}; "
                f"selected per row (last) {int(a[0, 0, -1].sum())}")
            ok &= worst_gap < 1e-4
        rel = float((outs["ref"] - outs["fast"]).norm() / outs["ref"].norm())
        log(f"selfcheck: logits relative L2 fast vs reference indexer {rel:.3g} (the differing "
            f"rows' selections carried through the later layers)")
    model.train()
    return ok


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.5)
    ap.add_argument("--total-tokens", type=int, default=125_000_000)
    ap.add_argument("--selfcheck", action="store_true")
    ap.add_argument("--export", action="store_true")
    ap.add_argument("--probe", action="store_true", help="time a few steps at each phase")
    args = ap.parse_args()
    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train_log.jsonl").open("a")

    def log(msg, **rec):
        print(msg, flush=True)
        log_file.write(json.dumps({"t": round(time.time() - t_start, 1), "msg": msg, **rec}) + "\n")
        log_file.flush()

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(device)
    counters = load_state(model, args.state)
    log(f"state: {counters}; torch {torch.__version__}; "
        f"{sum(p.numel() for p in model.parameters()):,} parameters")
    if args.selfcheck:
        ok = selfcheck(model, device, log)
        log(f"selfcheck {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    rng = random.Random(counters["seed"] + 7919 * counters["calls"])
    torch.manual_seed(counters["seed"] + counters["calls"])
    data = Data(args.data, rng)
    log(f"data: {len(data.train):,} train tokens, {len(data.tasks)} retrieval tasks")
    if args.export:
        return export(model, counters, data, args, log)

    cfg = model.config
    router = RouterLogits(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    model.train()
    first_call = counters["calls"] == 0
    budget = args.minutes * 60
    step_in_call = 0
    probe_phases = [0.0, 0.4, 0.65, 0.9] if args.probe else []
    window = {"lm": 0.0, "answer": 0.0, "distill": 0.0, "aux": 0.0, "n": 0, "t": time.time(),
              "tokens": 0}
    while True:
        elapsed = time.time() - t_start
        if elapsed > budget or (not args.probe and counters["tokens"] >= args.total_tokens):
            break
        progress = counters["tokens"] / args.total_tokens
        if args.probe:
            if step_in_call >= 4 * len(probe_phases):
                break
            progress = probe_phases[step_in_call // 4]
        ctx, sparse, share = phase_for(progress)
        Ctx.dense, Ctx.distill = not sparse, True
        x, y, amask = data.batch(ctx, share, device)
        lr = lr_at(progress, step_in_call, first_call)
        for g in opt.param_groups:
            g["lr"] = lr
        lm, answer, aux, distill = step_losses(model, router, x, y, amask, cfg)
        loss = lm + ANSWER_WEIGHT * answer + aux + distill
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP))
        opt.step()
        step_in_call += 1
        if not args.probe:
            counters["tokens"] += x.numel()
            counters["steps"] += 1
        for k, v in (("lm", lm), ("answer", answer), ("distill", distill), ("aux", aux)):
            window[k] += float(v.detach())
        window["n"] += 1
        window["tokens"] += x.numel()
        if args.probe or window["n"] == 25:
            torch.cuda.synchronize()
            dt = time.time() - window["t"]
            n = window["n"]
            recall = sum(Ctx.recalls) / len(Ctx.recalls) if Ctx.recalls else None
            log(f"step {counters['steps']} ctx {ctx} {'sparse' if sparse else 'dense'} lr {lr:.2e} "
                f"lm {window['lm'] / n:.4f} answer {window['answer'] / n:.3f} "
                f"distill {window['distill'] / n:.4f} aux {window['aux'] / n:.4f} "
                f"gnorm {gnorm:.2f} recall {recall} tok/s {window['tokens'] / dt:,.0f} "
                f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
                step=counters["steps"], tokens=counters["tokens"], ctx=ctx, lm=window["lm"] / n,
                answer=window["answer"] / n, distill=window["distill"] / n, recall=recall,
                tok_s=window["tokens"] / dt)
            window = {"lm": 0.0, "answer": 0.0, "distill": 0.0, "aux": 0.0, "n": 0,
                      "t": time.time(), "tokens": 0}
            Ctx.recalls = []
    counters["calls"] += 1
    if not args.probe:
        save_state(model, args.out, counters)
    ev = evaluate(model, data, device)
    log(f"eval after {counters['tokens']:,} tokens: {ev}", eval=ev, tokens=counters["tokens"])
    log(f"call done in {time.time() - t_start:.0f} s")
    return 0


def export(model, counters, data, args, log) -> int:
    """The Hugging Face checkpoint: FP16, two or more shards with an index."""
    out = args.out / "model"
    model = model.to(torch.float16)
    model.generation_config.eos_token_id = model_config.EOS_ID
    model.generation_config.pad_token_id = model_config.EOS_ID
    model.generation_config.do_sample = False
    model.save_pretrained(out, max_shard_size="10MB", safe_serialization=True)
    ev = evaluate(model.float(), data, torch.device("cuda"))
    (out / "training.json").write_text(json.dumps({"counters": counters, "eval": ev}, indent=1))
    log(f"exported to {out}: {sorted(p.name for p in out.iterdir())}; eval {ev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
