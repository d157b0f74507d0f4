#!/usr/bin/env python3
"""Reference tokenizers and encodings from the Hugging Face `tokenizers` library.

Trains three small BPE tokenizers on tests/data/tokenizers/multilingual.txt and writes, for each,
tests/data/tokenizers/<name>/tokenizer.json and expected.json, which
tests/io/test_tokenizer_hf_reference.cpp checks e4kv against, id for id and byte for byte:

  llama3_bytelevel     byte-level BPE, Llama-3 pre-tokenizer regex (Split, Isolated) + ByteLevel
                       without regex, ignore_merges, a BOS template post-processor
  qwen2_bytelevel      byte-level BPE, NFC normalizer, Qwen2 pre-tokenizer regex, ByteLevel
                       post-processor (no BOS), ChatML special tokens
  sentencepiece_bpe    SentencePiece-style BPE as Llama-2 / Mistral ship it: Prepend("▁") +
                       Replace(" ", "▁") normalizer, no pre-tokenizer, byte_fallback, fuse_unk, decoder
                       Replace / ByteFallback / Fuse / Strip, "<s> $A" template

expected.json holds encode cases (the whole file with and without special tokens, every line on
its own, short edge cases and chat strings with special and added tokens) and decode cases (those
ids with and without skip_special_tokens, and random id lists that exercise invalid UTF-8).

Run from the repository root:  python3 scripts/hf_reference_tokenizers.py
Needs: tokenizers (0.19.1 or later, for ignore_merges). transformers is optional: when it imports,
its fast tokenizer is compared with `tokenizers` on the same cases and differences are reported.
The output is deterministic: the same text and library version give the same files.
"""

import collections
import json
import os
import random
import sys

try:
    import tokenizers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers
except ImportError:
    sys.exit("hf_reference_tokenizers.py needs the `tokenizers` library (pip install tokenizers)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "tokenizers")
TEXT_FILE = os.path.join(DATA, "multilingual.txt")

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Short texts every tokenizer is checked on, besides the file.
EDGE_CASES = [
    "",
    " ",
    "  two leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "a\r\nb\r\n",
    "don't I'LL WE'VE you're it's",
    "1234567 3.14159 12345678901234567890",
    "👩🏽‍💻🏳️‍🌈 e\u0301cole ＡＢＣ ﬁ",
    "\t\tindented\tcode  with   spaces  ",
    "中文日本語한국어 العربية हिन्दी",
    "Straße über Öl — Ça coûte 12,50 €",
]


def read_text():
    # newline="" keeps the file's \r\n line endings as they are.
    with open(TEXT_FILE, encoding="utf-8", newline="") as f:
        return f.read()


def patched(tokenizer, **fields):
    """Sets top-level tokenizer.json fields (and model fields via model=...) through the JSON
    form, which every `tokenizers` version reads the same way, and reloads."""
    data = json.loads(tokenizer.to_str())
    for key, value in fields.items():
        if key == "model":
            data["model"].update(value)
        else:
            data[key] = value
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def template(bos, bos_id):
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
    )


def build_llama3(text):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer=trainer)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    # Added tokens that are not special and take the white space around them.
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False, lstrip=True, rstrip=True)
         for t in ["<tool_call>", "</tool_call>"]]
    )
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), template(bos, tok.token_to_id(bos))]
    )
    tok = patched(tok, model={"ignore_merges": True, "byte_fallback": False, "fuse_unk": False})
    extra = [
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "text <tool_call>  {\"a\": 1}  </tool_call> after",
        "x<|eot_id|>y<|end_of_text|>",
    ]
    return tok, extra


def build_qwen2(text):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False)
         for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ["<tool_call>", "</tool_call>"]])
    # A normalized added token: matched in the NFC text.
    tok.add_tokens([AddedToken("<think>", special=False, normalized=True)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = patched(tok, model={"ignore_merges": False, "byte_fallback": False, "fuse_unk": False})
    extra = [
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nGrüße e\u0301<|im_end|>\n",
        "call <tool_call> {\"x\": 2} </tool_call>!<think>hmm</think>",
        "<|endoftext|>",
    ]
    return tok, extra


def build_sentencepiece(text):
    # Trained on words ("▁word", as SentencePiece sees them), then rewritten into the layout of a
    # converted Llama-2 tokenizer.json.
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    # Keep the 110 most frequent characters (a deterministic choice); the rest falls back to
    # bytes. initial_alphabet + an equal limit_alphabet makes the trainer keep exactly these.
    counts = collections.Counter(text.replace(" ", "▁"))
    counts["▁"] += len(text)
    alphabet = [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:110]]
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    tok.train_from_iterator([text], trainer=trainer)

    data = json.loads(tok.to_str())
    old_vocab = data["model"]["vocab"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for token, _ in sorted(old_vocab.items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    data["model"].update(
        {"vocab": vocab, "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True,
         "ignore_merges": False, "dropout": None}
    )
    data["added_tokens"] = [
        {"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for s in specials
    ]
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    data["pre_tokenizer"] = None
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    data["post_processor"] = None
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    tok.post_processor = template("<s>", tok.token_to_id("<s>"))
    extra = [
        "<s>[INST] Hello, how are you? [/INST] Fine.</s>",
        "a</s>b <s> c",
        "<unk> literally",
    ]
    return tok, extra


def encode_case(tok, name, text, add_special_tokens):
    ids = tok.encode(text, add_special_tokens=add_special_tokens).ids
    return {"name": name, "text": text, "add_special_tokens": add_special_tokens, "ids": ids}


def decode_case(tok, name, ids, skip_special_tokens):
    text = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    return {"name": name, "ids": ids, "skip_special_tokens": skip_special_tokens, "text": text}


def make_expected(tok, text, extra):
    encode = [
        encode_case(tok, "whole file", text, False),
        encode_case(tok, "whole file, special tokens", text, True),
    ]
    for i, line in enumerate(text.split("\n")):
        encode.append(encode_case(tok, f"line {i + 1}", line, False))
    for i, case in enumerate(EDGE_CASES):
        encode.append(encode_case(tok, f"edge case {i + 1}", case, False))
        encode.append(encode_case(tok, f"edge case {i + 1}, special tokens", case, True))
    for i, case in enumerate(extra):
        encode.append(encode_case(tok, f"special-token case {i + 1}", case, False))
        encode.append(encode_case(tok, f"special-token case {i + 1}, special tokens", case, True))

    decode = []
    for case in encode:
        if case["add_special_tokens"] and (case["name"].startswith("whole") or
                                           case["name"].startswith("special-token")):
            for skip in (False, True):
                decode.append(decode_case(tok, case["name"], case["ids"], skip))
    # Random ids: byte tokens that do not form UTF-8, special tokens in odd places.
    rng = random.Random(1234)
    n_ids = tok.get_vocab_size(with_added_tokens=True)
    for k in range(40):
        ids = [rng.randrange(n_ids) for _ in range(rng.randrange(1, 48))]
        for skip in (False, True):
            decode.append(decode_case(tok, f"random ids {k + 1}", ids, skip))
    return {
        "generator": "scripts/hf_reference_tokenizers.py",
        "tokenizers_version": tokenizers.__version__,
        "text_file": "multilingual.txt",
        "encode": encode,
        "decode": decode,
    }


def compare_with_transformers(name, tok, expected):
    """Reports (does not fail on) cases where transformers' fast tokenizer disagrees."""
    try:
        import transformers
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    except Exception as error:  # noqa: BLE001 - transformers is optional here
        print(f"  {name}: transformers comparison skipped ({error})")
        return
    differences = 0
    for case in expected["encode"]:
        ids = fast(case["text"], add_special_tokens=case["add_special_tokens"])["input_ids"]
        if ids != case["ids"]:
            differences += 1
    for case in expected["decode"]:
        text = fast.decode(case["ids"], skip_special_tokens=case["skip_special_tokens"])
        if text != case["text"]:
            differences += 1
    print(f"  {name}: transformers {transformers.__version__} differs from tokenizers in "
          f"{differences} of {len(expected['encode']) + len(expected['decode'])} cases")


def write_expected(path, expected):
    # One case per line: small diffs, readable in a text editor.
    def line(case):
        return "    " + json.dumps(case, ensure_ascii=False, separators=(",", ":"))

    parts = ["{"]
    for key in ("generator", "tokenizers_version", "text_file"):
        parts.append(f'  "{key}": {json.dumps(expected[key])},')
    parts.append('  "encode": [')
    parts.append(",\n".join(line(c) for c in expected["encode"]))
    parts.append("  ],")
    parts.append('  "decode": [')
    parts.append(",\n".join(line(c) for c in expected["decode"]))
    parts.append("  ]")
    parts.append("}")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(parts) + "\n")


def main():
    text = read_text()
    builders = {
        "llama3_bytelevel": build_llama3,
        "qwen2_bytelevel": build_qwen2,
        "sentencepiece_bpe": build_sentencepiece,
    }
    total = 0
    for name, build in builders.items():
        tok, extra = build(text)
        # Sanity: byte-level and byte-fallback tokenizers give the text back.
        round_trip = tok.decode(tok.encode(text, add_special_tokens=False).ids,
                                skip_special_tokens=False)
        if name != "qwen2_bytelevel" and round_trip != text:
            sys.exit(f"{name}: decode(encode(text)) differs from the text; the setup is wrong")
        expected = make_expected(tok, text, extra)
        out_dir = os.path.join(DATA, name)
        os.makedirs(out_dir, exist_ok=True)
        tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
        write_expected(os.path.join(out_dir, "expected.json"), expected)
        size = sum(os.path.getsize(os.path.join(out_dir, f))
                   for f in ("tokenizer.json", "expected.json"))
        total += size
        print(f"{name}: {tok.get_vocab_size(with_added_tokens=True)} ids, "
              f"{len(expected['encode'])} encode and {len(expected['decode'])} decode cases, "
              f"{size} bytes")
        compare_with_transformers(name, tok, expected)
    print(f"wrote {total} bytes under {os.path.relpath(DATA, ROOT)} "
          f"(tokenizers {tokenizers.__version__})")


if __name__ == "__main__":
    main()
