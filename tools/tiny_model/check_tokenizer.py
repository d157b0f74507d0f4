#!/usr/bin/env python3
"""Checks the tokenizer that make_data.py wrote against e4kv's C++ tokenizer.

For a few hundred strings (edge cases of the pre-tokenizer regex, snippets of the held-out
files, random strings over many scripts and random code points of all of Unicode) the ids of
make_data's Python encoder, read back from DIR/tokenizer.json, must equal those of
`e4kv tokenize DIR`, and `e4kv detokenize DIR` of those ids must give the string back.

Usage: python3 tools/tiny_model/check_tokenizer.py [DIR] [--e4kv build-cpu/e4kv]
Exits 1 on any mismatch; the last line reads "N passed, M failed".
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from make_data import REPO_ROOT, SPECIAL_TOKENS, BpeTokenizer

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n", "a", "Hello, world!", "Hello  world",
    "trailing space ", "  leading spaces", "a    b", "a\n\n  b", "x\r\ny\rz", "tab\tseparated",
    "don't DON'T it's IT'S we're they've I'm you'll he'd", "'s's 'S' ''", "iſ 'ſ 'K", "'re'RE'rE",
    "12345", "3.14159 -0.5e10 1,000,000", "0x1F 0b1010 1_000", "2024-01-31T12:00:00Z",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { return *p++; }\n",
    "    indented\n        more\n\ttab\n", "print('hi')\n\n\n\n# end", "x=[1,2,3];y={'a':1}",
    "naïve café résumé", "Ünïcödé ÀÉÎÕÜ ß ẞ", "日本語のテキストです。", "Привет, мир!",
    "مرحبا بالعالم", "नमस्ते दुनिया", "한국어 텍스트", "Γειά σου Κόσμε",
    "emoji 👍🏽 👨‍👩‍👧 ❤️", "e\u0301 a\u0308 n\u0303", "\u00a0nbsp\u00a0", "nel\u0085next",
    "mvs\u180esep", "line\u2028sep\u2029para", "ideo\u3000space", "fs\x1cgs\x1drs\x1eus\x1f",
    "vt\x0bff\x0c", "a!!\u0085\u0085b", "x \u180e\u180e y", "end\u0085",
    "p.\u00a0\u00a0\u00a0q", "w\u3000\u3000 z", "1\u2028\u2028", "x!\x1c\x1c y", "?\x0b\x0b\n",
    "٣٤٥ ５６ ²³ Ⅻ ½", "zero\u200bwidth", "private\ue000use", "unassigned\u0378",
    "<|endoftext|>", "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|>", "<|im_", "<|endoftext|", "<||>", "---===***", "!!!???...",
    "a" * 300, " " * 40 + "x", "\n" * 10 + "y", "=" * 80 + "\n",
]

SCRIPTS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789",
    " \t\n\r\u00a0\u2028\u3000\u0085\u180e\x0b\x0c", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿſ", "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔ", "абвгдежзийклмнопАБВГД",
    "的一是不了人我在有他这中大来上国个到说们", "ぁあぃいぅうァアィイ", "가나다라마바사", "ابتثجحخدذرز",
    "अआइईउऊऋएऐओऔकखग", "\u0301\u0308\u0303\u200d\ufe0f", "٠١٢٣٤٥٦٧٨٩５６²³½Ⅻ", "👍🏽😀🎉🚀❤",
    "'s't're've'm'll'd", "€£¥©®™°±×÷§¶•…", "\ue000\u0378\U000e0001\U0010fffd",
]


def random_script_string(rng: random.Random) -> str:
    """A string of runs from random scripts (letters, digits, spaces, punctuation, marks)."""
    parts = []
    for _ in range(rng.randint(1, 8)):
        alphabet = rng.choice(SCRIPTS)
        parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))))
    return "".join(parts)


def random_code_point_string(rng: random.Random) -> str:
    """Random code points of all of Unicode (no surrogates), between ASCII words and spaces."""
    chars = []
    for _ in range(rng.randint(4, 24)):
        if rng.random() < 0.3:
            chars.append(rng.choice([" ", "  ", "\n", "ab", "'s", "7", "."]))
            continue
        cp = rng.randrange(0x110000)
        while 0xD800 <= cp <= 0xDFFF:
            cp = rng.randrange(0x110000)
        chars.append(chr(cp))
    return "".join(chars)


def held_out_snippets(data_dir: Path, rng: random.Random, n: int) -> list[str]:
    """Random slices (up to 2000 characters, cut anywhere) of calibration and eval texts."""
    texts = []
    for name in ("calibration.jsonl", "eval.jsonl"):
        for line in (data_dir / name).read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            texts += [record["text"]] if "text" in record else [
                m["content"] for m in record["messages"]]
    snippets = []
    for _ in range(n):
        text = rng.choice(texts)
        start = rng.randrange(len(text))
        snippets.append(text[start:start + rng.randint(1, 2000)])
    return snippets


def e4kv_ids(e4kv: Path, model_dir: Path, text: str) -> list[int]:
    result = subprocess.run([str(e4kv), "tokenize", str(model_dir), "--text", "-", "--json"],
                            input=text.encode(), capture_output=True, check=True)
    return json.loads(result.stdout)["ids"]


def e4kv_text(e4kv: Path, model_dir: Path, ids: list[int]) -> str:
    result = subprocess.run([str(e4kv), "detokenize", str(model_dir), "--ids",
                             ",".join(map(str, ids)), "--json"], capture_output=True, check=True)
    return json.loads(result.stdout)["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", nargs="?", type=Path,
                        default=REPO_ROOT / "build" / "tiny_model_data")
    parser.add_argument("--e4kv", type=Path, default=REPO_ROOT / "build-cpu" / "e4kv")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    tokenizer = BpeTokenizer.from_json(args.data_dir / "tokenizer.json")
    rng = random.Random(args.seed)
    cases = (EDGE_CASES + held_out_snippets(args.data_dir, rng, 150)
             + [random_script_string(rng) for _ in range(100)]
             + [random_code_point_string(rng) for _ in range(60)])

    failed = 0
    for text in cases:
        ids = tokenizer.encode(text)
        expected = e4kv_ids(args.e4kv, args.data_dir, text)
        problems = []
        if ids != expected:
            problems.append(f"ids: python {ids[:40]} e4kv {expected[:40]}")
        if tokenizer.decode(ids) != text:
            problems.append("python decode does not give the text back")
        if e4kv_text(args.e4kv, args.data_dir, expected) != text:
            problems.append("e4kv detokenize does not give the text back")
        if problems:
            failed += 1
            print(f"FAIL {text[:80]!r}: " + "; ".join(problems))

    n_special = sum(any(t in c for t in SPECIAL_TOKENS) for c in cases)
    print(f"{len(cases)} strings ({n_special} with special tokens), "
          f"vocab {tokenizer.vocab_size}, e4kv {args.e4kv}")
    print(f"{len(cases) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
