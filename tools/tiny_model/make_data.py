#!/usr/bin/env python3
"""Builds the data of the tiny Qwen4Exp model from text and code that Debian packages install.

Steps (each one function below, run in this order by main()):
  a. collect_documents: install the source packages that are missing (apt-get), check each
     package's licence against its copyright file, read the chosen files (HTML stripped, man pages
     rendered by groff, POD by pod2text), normalise them and cut them into documents <= 32 KB.
  b. split_documents / write_heldout_sets: split the documents by a hash of their id into train
     (~96.5%), validation (~1%) and a held-out pool (~2.5%: the corpus has only ~4,800
     documents and the held-out files take ~100 whole ones); the pool gives calibration.jsonl
     and eval.jsonl, two small files meant to be committed, and the retrieval eval filler.
  c. train_tokenizer / write_tokenizer: a byte-level BPE (GPT-2 / Qwen2 style) learned on a sample
     of the training text; tokenizer.json (Hugging Face `tokenizers` format, shaped like the one
     src/testing/synth_tokenizer.cpp writes) and tokenizer_config.json (ChatML template).
  d. write_token_stream: train.bin / val.bin, little-endian uint16 ids, each document followed by
     the EOS id; train_sample.bin (the first --sample-tokens ids of train.bin) when train.bin is
     larger than that.
  e. write_retrieval_tasks: passkey and key-value lookup prompts of 512..8192 tokens;
     retrieval_eval.jsonl takes its keys and filler apart from retrieval_train.jsonl.
Finally meta.json records the sources with versions and licences, token counts, the seed, this
script's version, the timings and the sha256 of every output.

Pure Python 3.11 standard library; Debian bookworm; run as root for apt-get. The output depends
only on the installed package versions, --seed and the size flags (timings aside).
check_tokenizer.py, beside this file, compares the tokenizer with e4kv's C++ tokenizer.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import dataclasses
import gzip
import hashlib
import heapq
import html.parser
import json
import os
import random
import re
import subprocess
import sys
import time
import unicodedata
from collections import Counter
from pathlib import Path

SCRIPT_VERSION = "1"
REPO_ROOT = Path(__file__).resolve().parents[2]

DOC_MAX_BYTES = 32 * 1024  # documents are cut at paragraph boundaries to at most this
MIN_FILE_BYTES = 200  # normalised files shorter than this are dropped

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# The chat template of tokenizer_config.json: kSynthChatTemplate of src/testing/synth_tokenizer.h
# (ChatML, as Qwen checkpoints use), so the engine's tests and this model agree.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_start|>assistant\n"
    "{% endif -%}\n"
)

# The Qwen2 pre-tokenizer regex (Llama-3's with single digits), as tokenizer.json states it.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------------------------
# a. Sources


@dataclasses.dataclass(frozen=True)
class Source:
    package: str
    kind: str  # "prose" or "code"
    licence: str  # short name, as the copyright file states it
    # Text that must occur in /usr/share/doc/<package>/copyright; the script stops otherwise, so a
    # licence change between package versions cannot slip into the corpus unnoticed.
    licence_evidence: str
    reader: str  # "text", "gzip", "html", "man" or "pod"
    include: str  # regex over the package's installed paths (dpkg -L)
    exclude: str | None = None  # regex over the same paths
    # Cap on the normalised bytes taken; files are taken in the order of a hash of their path, so
    # a capped package is sampled across its whole tree.
    max_bytes: int | None = None


_MIB = 1 << 20
_PYTHON_LICENCE = "PSF-2.0 (Python Software Foundation License)"
_PYTHON_EVIDENCE = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
_MAN_LICENCE = "GPL-2+, BSD-2/3/4-clause, Expat, Linux-man-pages-copyleft and others, per page"

SOURCES = (
    # Prose.
    Source("python3.11-doc", "prose", _PYTHON_LICENCE, _PYTHON_EVIDENCE, "html",
           r"^/usr/share/doc/python3\.11/html/.*\.html$",
           r"/(_sources|_static)/|/(genindex[^/]*|search|py-modindex|contents)\.html$"),
    Source("debian-reference-en", "prose", "GPL-2+", "License: GPL-2+", "gzip",
           r"^/usr/share/debian-reference/debian-reference\.en\.txt\.gz$"),
    Source("developers-reference", "prose", "GPL-2", "License: GPL-2", "gzip",
           r"^/usr/share/developers-reference/developers-reference\.txt\.gz$"),
    Source("debian-policy", "prose", "GPL-2+ (FHS: FHS licence; parts BSD-3-clause)",
           "License: GPL-2+", "gzip", r"^/usr/share/doc/debian-policy/.*\.txt\.gz$"),
    Source("debian-handbook", "prose", "GPL-2.0+ or CC-BY-SA-3.0",
           "License: GPL-2.0+ or CC-BY-SA-3.0", "html",
           r"^/usr/share/doc/debian-handbook/html/en-US/[^/]*\.html$", r"/index\.html$"),
    Source("perl-doc", "prose", "GPL-1+ or Artistic", "License: GPL-1+ or Artistic", "pod",
           r"^/usr/share/perl/[^/]+/pod/.*\.pod$",
           # Release notes (perl5NNNdelta), the table of contents and the property tables are
           # long lists rather than prose.
           r"/perl(5\d+)?delta\.pod$|/perltoc\.pod$|/perluniprops\.pod$"),
    Source("git-doc", "prose", "GPL-2", "License: GPL-2", "text",
           r"^/usr/share/doc/git-doc/[^/]*\.txt$"),
    Source("sqlite3-doc", "prose", "public-domain", "License: public-domain", "html",
           r"^/usr/share/doc/sqlite3/.*\.html$", r"/(releaselog|syntax)/"),
    Source("manpages", "prose", _MAN_LICENCE, "Linux-man-pages-copyleft", "man",
           r"^/usr/share/man/man\d/[^/]*\.gz$"),
    Source("manpages-dev", "prose", _MAN_LICENCE, "Linux-man-pages-copyleft", "man",
           r"^/usr/share/man/man\d/[^/]*\.gz$"),
    # Code.
    Source("libpython3.11-minimal", "code", _PYTHON_LICENCE, _PYTHON_EVIDENCE,
           "text", r"^/usr/lib/python3\.11/.*\.py$"),
    Source("libpython3.11-stdlib", "code", _PYTHON_LICENCE, _PYTHON_EVIDENCE,
           "text", r"^/usr/lib/python3\.11/.*\.py$"),
    Source("golang-1.19-src", "code", "BSD-3-clause (the Go licence)", "License: Go", "text",
           r"^/usr/share/go-1\.19/src/.*\.go$",
           # Tests, test data and vendored third-party code (other licences) stay out.
           r"_test\.go$|/testdata/|/vendor/", max_bytes=6 * _MIB),
    Source("gnulib", "code", "LGPL-2+, GPL-3+ and others, per file", "License: LGPL-2+", "text",
           r"^/usr/share/gnulib/lib/[^/]*\.[ch]$", max_bytes=3 * _MIB),
)


def ensure_installed(packages: list[str]) -> None:
    """Installs the packages that dpkg does not list as installed."""
    missing = [p for p in packages if package_status(p) != "install ok installed"]
    if not missing:
        return
    print(f"installing {' '.join(missing)}", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *missing],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def package_status(package: str) -> str:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                            capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def package_version(package: str) -> str:
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], check=True,
                          capture_output=True, text=True).stdout.strip()


def check_licence(source: Source) -> None:
    """Stops when the package's copyright file lacks the source's licence evidence."""
    path = Path("/usr/share/doc") / source.package / "copyright"
    if source.licence_evidence not in path.read_text(encoding="utf-8", errors="replace"):
        raise SystemExit(f"{path}: does not contain {source.licence_evidence!r}; check the "
                         f"licence of {source.package} and update SOURCES in {__file__}")


def package_files(source: Source) -> list[Path]:
    """The source's files among those the package installed, sorted by a hash of their path."""
    listing = subprocess.run(["dpkg", "-L", source.package], check=True, capture_output=True,
                             text=True).stdout.splitlines()
    include, exclude = re.compile(source.include), source.exclude and re.compile(source.exclude)
    paths = [Path(p) for p in listing
             if include.search(p) and not (exclude and exclude.search(p))]
    return sorted((p for p in paths if p.is_file() and not p.is_symlink()),
                  key=lambda p: stable_hash(str(p)))


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class HtmlText(html.parser.HTMLParser):
    """The visible text of an HTML page. Block elements become line breaks, <pre> keeps its white
    space, scripts, forms and navigation are dropped, and when the page marks its main content
    (role="main", as Sphinx does) only that is kept."""

    SKIP_TAGS = {"head", "script", "style", "nav", "svg", "form", "button", "select", "noscript"}
    # Navigation blocks of Sphinx (Python docs), Publican (Debian handbook) and the SQLite site.
    SKIP_CLASSES = {"related", "sphinxsidebar", "footer", "headerlink", "navheader", "navfooter",
                    "docnav", "breadcrumbs", "menu", "nosearch", "fancy_toc", "fancy-toc1"}
    SKIP_IDS = {"banner", "title", "searchmenu", "submenu"}
    VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                 "param", "source", "track", "wbr"}
    BLOCK_TAGS = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
                  "table", "blockquote", "ul", "ol", "dl", "figure", "title"}
    LINE_TAGS = {"br", "li", "tr", "dt", "dd", "hr", "caption"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._stack: list[tuple[str, bool, bool, bool]] = []  # (tag, skip, main, pre)
        self._all: list[str] = []
        self._main: list[str] = []
        self.has_main = False

    def _state(self) -> tuple[bool, bool, bool]:
        return self._stack[-1][1:] if self._stack else (False, False, False)

    def _emit(self, text: str) -> None:
        skip, main, _ = self._state()
        if skip:
            return
        self._all.append(text)
        if main:
            self._main.append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if tag in self.BLOCK_TAGS:
            self._emit("\n\n")
        elif tag in self.LINE_TAGS:
            self._emit("\n")
        elif tag in ("td", "th"):
            self._emit(" ")
        if tag in self.VOID_TAGS:
            return
        skip, main, pre = self._state()
        classes = set((attr.get("class") or "").split())
        skip = (skip or tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES)
                or attr.get("id") in self.SKIP_IDS)
        if attr.get("role") == "main":
            main = self.has_main = True
        self._stack.append((tag, skip, main, pre or tag == "pre"))

    def handle_endtag(self, tag: str) -> None:
        # Pop up to the matching start tag; an end tag without one (sloppy HTML) is ignored.
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] == tag:
                del self._stack[depth:]
                break
        if tag in self.BLOCK_TAGS:
            self._emit("\n\n")
        elif tag in self.LINE_TAGS:
            self._emit("\n")

    def handle_data(self, data: str) -> None:
        if not self._state()[2]:
            data = re.sub(r"\s+", " ", data)
        self._emit(data)

    def text(self) -> str:
        text = "".join(self._main if self.has_main else self._all)
        return re.sub(r"[ \t]*\n[ \t]*", "\n", text)  # the spaces left around line breaks


def read_file(path: Path, reader: str) -> str:
    """The text of one installed file, rendered to plain text by its reader."""
    if reader == "text":
        return path.read_bytes().decode("utf-8")
    if reader == "gzip":
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    if reader == "html":
        parser = HtmlText()
        parser.feed(path.read_bytes().decode("utf-8"))
        parser.close()
        return parser.text()
    if reader == "man":
        source = gzip.decompress(path.read_bytes())
        if source.startswith(b".so "):  # a link to another page
            return ""
        # -k: preconv (UTF-8 input), -t: tbl; -P-cbou: plain text without overstriking;
        # HY=0 and .na: no hyphenation and no justification, so words stay whole and lines
        # carry no runs of padding spaces.
        return subprocess.run(
            ["groff", "-k", "-t", "-man", "-Tutf8", "-P-cbou", "-rHY=0", "-rLL=78n"],
            input=b".na\n" + source, capture_output=True, check=True).stdout.decode("utf-8")
    if reader == "pod":
        return subprocess.run(["pod2text", str(path)], capture_output=True,
                              check=True).stdout.decode("utf-8")
    raise ValueError(f"unknown reader {reader!r}")


_CONTROL_CHARS = re.compile(
    "[" + "".join(chr(c) for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])
    + "]")


def normalise(text: str) -> str:
    """Unix line ends, no control characters but \\n and \\t, no trailing white space on a line,
    at most one blank line in a row, no blank lines at the ends."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL_CHARS.sub("", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n").rstrip() + "\n"


# Zero-width cuts after each line end and each sentence end: text.split at these gives pieces that
# join back into the text.
LINE_OR_SENTENCE_END = re.compile(r"(?<=\n)|(?<=[.!?] )")


def split_text(text: str, max_bytes: int) -> list[str]:
    """Cuts text into pieces of at most max_bytes UTF-8 bytes: at blank lines, else at line ends,
    else (a single longer line) at character boundaries."""
    pieces: list[str] = []
    current: list[str] = []
    current_bytes = 0
    for unit, sep in _units(text, max_bytes):
        size = len(unit.encode()) + len(sep)
        if current and current_bytes + size > max_bytes:
            pieces.append("".join(current).rstrip("\n") + "\n")
            current, current_bytes = [], 0
        current.append(unit + sep)
        current_bytes += size
    if current:
        pieces.append("".join(current).rstrip("\n") + "\n")
    return pieces


def _units(text: str, max_bytes: int):
    """(unit, separator) pairs that each fit in max_bytes: paragraphs, or lines of a longer one, or
    slices of a longer line."""
    for paragraph in text.rstrip("\n").split("\n\n"):
        if len(paragraph.encode()) + 2 <= max_bytes:
            yield paragraph, "\n\n"
            continue
        for line in paragraph.split("\n"):
            while len(line.encode()) + 1 > max_bytes:
                cut = (max_bytes - 1) // 4  # characters of at most 4 UTF-8 bytes, and the line end
                yield line[:cut], "\n"
                line = line[cut:]
            yield line, "\n"


@dataclasses.dataclass
class Document:
    doc_id: str  # "package:path" or "package:path#part"
    package: str
    kind: str
    text: str


def collect_documents(sources: tuple[Source, ...]) -> tuple[list[Document], list[dict]]:
    """Reads every source into documents; returns them and one record per source package."""
    ensure_installed(sorted({s.package for s in sources}))
    documents: list[Document] = []
    records: list[dict] = []
    seen: set[bytes] = set()  # digests of the normalised files kept so far
    for source in sources:
        start = time.monotonic()
        check_licence(source)
        used_bytes = files = dropped = 0
        for path in package_files(source):
            try:
                text = normalise(read_file(path, source.reader))
            except (UnicodeDecodeError, subprocess.CalledProcessError):
                dropped += 1
                continue
            size = len(text.encode())
            digest = hashlib.sha256(text.encode()).digest()
            # Files that carry a special token's text are left out, so that encoding the corpus
            # with or without special-token matching gives the same ids.
            if (size < MIN_FILE_BYTES or digest in seen
                    or any(token in text for token in SPECIAL_TOKENS)):
                dropped += 1
                continue
            if source.max_bytes is not None and used_bytes + size > source.max_bytes:
                break
            seen.add(digest)
            pieces = split_text(text, DOC_MAX_BYTES)
            for k, piece in enumerate(pieces):
                doc_id = f"{source.package}:{path}" + (f"#{k}" if len(pieces) > 1 else "")
                documents.append(Document(doc_id, source.package, source.kind, piece))
            used_bytes += size
            files += 1
        records.append({"package": source.package, "version": package_version(source.package),
                        "kind": source.kind, "licence": source.licence,
                        "licence_evidence": source.licence_evidence, "files": files,
                        "files_dropped": dropped, "bytes": used_bytes})
        print(f"  {source.package}: {files} files, {used_bytes / 1e6:.1f} MB "
              f"({time.monotonic() - start:.0f} s)", file=sys.stderr)
    return documents, records


# ---------------------------------------------------------------------------------------------
# b. Splits and the held-out sets


def split_documents(documents: list[Document], val_permille: int, heldout_permille: int
                    ) -> tuple[list[Document], list[Document], list[Document]]:
    """train / validation / held-out pool, by a hash of each document id (independent of the seed
    and of the other documents, so adding a source moves no document between splits)."""
    train, val, pool = [], [], []
    for doc in documents:
        bucket = stable_hash(doc.doc_id) % 1000
        if bucket < heldout_permille:
            pool.append(doc)
        elif bucket < heldout_permille + val_permille:
            val.append(doc)
        else:
            train.append(doc)
    return train, val, pool


HELDOUT_DOC_BYTES = 5500  # calibration and eval documents are cut to this (first part kept)
CALIBRATION_MAX_BYTES = 400_000
EVAL_MAX_BYTES = 200_000


def write_heldout_sets(pool: list[Document], out: Path, rng: random.Random, n_calibration: int,
                       n_conversations: int, n_eval: int) -> list[Document]:
    """Writes calibration.jsonl ({"text"} lines, then {"messages"} conversations) and eval.jsonl
    from disjoint documents of the pool; returns the pool documents that calibration does not
    use (the eval documents first): the filler of the retrieval eval tasks."""
    order = sorted(pool, key=lambda d: d.doc_id)
    rng.shuffle(order)
    calibration, rest = order[:n_calibration], order[n_calibration:]
    conversations = []
    while len(conversations) < n_conversations and rest:
        conversation = continuation_conversation(rest.pop(0).text)
        if conversation is not None:
            conversations.append(conversation)
    if len(rest) < n_eval:
        raise SystemExit(f"the held-out pool has {len(order)} documents, too few for the "
                         f"calibration and eval sets; raise --heldout-permille")
    evaluation = rest[:n_eval]

    lines = [{"text": split_text(d.text, HELDOUT_DOC_BYTES)[0]} for d in calibration]
    lines += [{"messages": m} for m in conversations]
    write_jsonl(out / "calibration.jsonl", lines, CALIBRATION_MAX_BYTES)
    write_jsonl(out / "eval.jsonl",
                [{"text": split_text(d.text, HELDOUT_DOC_BYTES)[0]} for d in evaluation],
                EVAL_MAX_BYTES)
    return rest


def continuation_conversation(text: str) -> list[dict] | None:
    """A ChatML conversation from the opening of a document: the user gives about two thirds of
    its lines or sentences, the assistant goes on with the rest; None for a single sentence."""
    pieces = LINE_OR_SENTENCE_END.split(split_text(text, 1500)[0])
    cut = len(pieces) * 2 // 3
    opening, following = "".join(pieces[:cut]).strip(), "".join(pieces[cut:]).strip()
    if not opening or not following:
        return None
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Continue the following text.\n\n{opening}"},
            {"role": "assistant", "content": following}]


def write_jsonl(path: Path, lines: list[dict], max_bytes: int | None = None) -> None:
    data = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
    if max_bytes is not None and len(data) > max_bytes:
        raise AssertionError(f"{path}: {len(data)} bytes, over the limit of {max_bytes}")
    path.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# c. Tokenizer


def _pretokenizer_regex() -> re.Pattern[str]:
    """QWEN2_PATTERN for Python's `re`, which lacks \\p{..}: the classes are spelled out from
    unicodedata (Unicode 14 in Python 3.11, as e4kv's PCRE2). \\s is PCRE2's with UCP: \\t..\\r,
    U+0085, U+180E and the Z categories. Python's matcher is backtracking and leftmost-first like
    PCRE2, so the split is the same as e4kv's for every string; the `tokenizers` library
    (Oniguruma) differs only on U+180E (not a space there) and on characters newer than
    Unicode 14."""
    letters, numbers = [], []
    spaces = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85, 0x180E]
    for cp in range(sys.maxunicode + 1):
        major = unicodedata.category(chr(cp))[0]
        if major == "L":
            letters.append(cp)
        elif major == "N":
            numbers.append(cp)
        elif major == "Z":
            spaces.append(cp)
    L, N, S = _char_class(letters), _char_class(numbers), _char_class(sorted(spaces))
    return re.compile(
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]|"
        rf" ?[^{S}{L}{N}]+[\r\n]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")


def _char_class(code_points: list[int]) -> str:
    """The body of a regex character class holding exactly the sorted code points."""
    parts = []
    start = prev = code_points[0]
    for cp in [*code_points[1:], None]:
        if cp is not None and cp == prev + 1:
            prev = cp
            continue
        parts.append(f"\\U{start:08x}" if start == prev else f"\\U{start:08x}-\\U{prev:08x}")
        if cp is not None:
            start = prev = cp
    return "".join(parts)


PRETOKEN_RE = _pretokenizer_regex()


def byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others take U+0100
    on, in byte order."""
    chars, extra = [], 256
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE:
            chars.append(chr(b))
        else:
            chars.append(chr(extra))
            extra += 1
    return chars


class BpeTokenizer:
    """Byte-level BPE over the Qwen2 pre-tokenizer with the semantics of the `tokenizers` library
    (and of e4kv's io/tokenizer): special tokens are matched in the raw text first; each
    pre-token's bytes are merged by rank, the lowest rank first and the leftmost on ties, one
    merge at a time."""

    def __init__(self, token_bytes: list[bytes], merges: list[tuple[bytes, bytes]]) -> None:
        self.token_bytes = token_bytes  # [model ids]: the bytes of each token
        self.merges = merges  # in rank order
        ids = {t: i for i, t in enumerate(token_bytes)}
        self._byte_ids = [ids[bytes([b])] for b in range(256)]
        self._ranks = {(ids[a], ids[b]): (rank, ids[a + b]) for rank, (a, b) in enumerate(merges)}
        n = len(token_bytes)
        self.special_ids = {token: n + k for k, token in enumerate(SPECIAL_TOKENS)}
        self.eos_id = self.special_ids[EOS_TOKEN]
        self.vocab_size = n + len(SPECIAL_TOKENS)
        self._special_re = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_json(cls, path: Path) -> BpeTokenizer:
        """Reads a tokenizer.json that write_tokenizer wrote (dense ids, the specials last)."""
        root = json.loads(path.read_text(encoding="utf-8"))
        byte_of = {c: b for b, c in enumerate(byte_level_chars())}
        to_bytes = lambda token: bytes(byte_of[c] for c in token)  # noqa: E731
        vocab = root["model"]["vocab"]
        token_bytes = [b""] * len(vocab)
        for token, i in vocab.items():
            token_bytes[i] = to_bytes(token)
        merges = [(to_bytes(a), to_bytes(b)) for a, b in root["model"]["merges"]]
        tokenizer = cls(token_bytes, merges)
        added = {t["content"]: t["id"] for t in root["added_tokens"]}
        if added != tokenizer.special_ids:
            raise ValueError(f"{path}: added tokens {added}, expected {tokenizer.special_ids}")
        return tokenizer

    def encode(self, text: str) -> list[int]:
        """Ids of text, special tokens in it included (as e4kv's encode and HF's encode)."""
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids += self.encode_ordinary(text[pos:match.start()])
            ids.append(self.special_ids[match.group()])
            pos = match.end()
        return ids + self.encode_ordinary(text[pos:])

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of text read as plain text (special tokens' text not matched)."""
        ids: list[int] = []
        cache = self._cache
        for piece in PRETOKEN_RE.findall(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = cache[piece] = self._bpe(piece.encode())
            ids += piece_ids
        return ids

    def _bpe(self, piece: bytes) -> tuple[int, ...]:
        ids = [self._byte_ids[b] for b in piece]
        ranks = self._ranks
        while len(ids) > 1:
            best = None  # (rank, position, merged id)
            for pos in range(len(ids) - 1):
                merge = ranks.get((ids[pos], ids[pos + 1]))
                if merge is not None and (best is None or merge[0] < best[0]):
                    best = (merge[0], pos, merge[1])
            if best is None:
                break
            ids[best[1]:best[1] + 2] = [best[2]]
        return tuple(ids)

    def decode(self, ids: list[int]) -> str:
        special = {i: t.encode() for t, i in self.special_ids.items()}
        data = b"".join(special[i] if i in special else self.token_bytes[i] for i in ids)
        return data.decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        """tokenizer.json, field for field as src/testing/synth_tokenizer.cpp writes it."""
        chars = byte_level_chars()
        as_text = lambda data: "".join(chars[b] for b in data)  # noqa: E731
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                      "use_regex": False}
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for t, i in self.special_ids.items()]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated",
                 "invert": False},
                byte_level]},
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {as_text(t): i for i, t in enumerate(self.token_bytes)},
                      "merges": [[as_text(a), as_text(b)] for a, b in self.merges]},
        }


def tokenizer_sample(train: list[Document], rng: random.Random, sample_bytes: int) -> list[str]:
    """Training documents in a seeded random order, up to about sample_bytes."""
    order = list(train)
    rng.shuffle(order)
    texts, total = [], 0
    for doc in order:
        if total >= sample_bytes:
            break
        texts.append(doc.text)
        total += len(doc.text.encode())
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> BpeTokenizer:
    """Learns merges until the model ids fill vocab_size minus the special tokens.

    Pre-tokens are counted once; each merge then updates the pair counts of only the words that
    hold the merged pair, and a max-heap with lazy deletion finds the next pair (the most
    frequent; the smallest ids on ties). A merge whose bytes are already a token reuses its id,
    as the `tokenizers` trainer does.
    """
    word_counts = Counter(piece for text in texts for piece in PRETOKEN_RE.findall(text))
    words = [list(piece.encode()) for piece in word_counts]
    counts = list(word_counts.values())
    token_bytes = [bytes([b]) for b in range(256)]
    token_ids = {t: i for i, t in enumerate(token_bytes)}
    merges: list[tuple[bytes, bytes]] = []

    pair_counts: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for w, (word, count) in enumerate(zip(words, counts)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += count
            where.setdefault(pair, set()).add(w)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    n_model_ids = vocab_size - len(SPECIAL_TOKENS)
    while len(token_bytes) < n_model_ids and heap:
        neg_count, pair = heapq.heappop(heap)
        current = pair_counts.get(pair, 0)
        if current != -neg_count:
            # A stale entry: re-queue a pair whose count fell; one whose count rose already has
            # a newer entry.
            if 0 < current < -neg_count:
                heapq.heappush(heap, (-current, pair))
            continue
        if current < 2:
            break
        a, b = pair
        merged = token_bytes[a] + token_bytes[b]
        new_id = token_ids.get(merged)
        if new_id is None:
            new_id = token_ids[merged] = len(token_bytes)
            token_bytes.append(merged)
        merges.append((token_bytes[a], token_bytes[b]))

        risen: set[tuple[int, int]] = set()
        for w in where.pop(pair):
            old, count = words[w], counts[w]
            new, i = [], 0
            while i < len(old):
                if i + 1 < len(old) and old[i] == a and old[i + 1] == b:
                    new.append(new_id)
                    i += 2
                else:
                    new.append(old[i])
                    i += 1
            words[w] = new
            old_pairs, new_pairs = list(zip(old, old[1:])), list(zip(new, new[1:]))
            for p in old_pairs:
                pair_counts[p] -= count
            for p in new_pairs:
                pair_counts[p] += count
                risen.add(p)
            for p in set(old_pairs) - set(new_pairs):
                if p != pair:
                    where[p].discard(w)
            for p in set(new_pairs) - set(old_pairs):
                where.setdefault(p, set()).add(w)
        del pair_counts[pair]
        for p in risen:
            heapq.heappush(heap, (-pair_counts[p], p))
    return BpeTokenizer(token_bytes, merges)


def write_tokenizer(tokenizer: BpeTokenizer, out: Path, model_max_length: int) -> None:
    (out / "tokenizer.json").write_text(
        json.dumps(tokenizer.to_json(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "add_bos_token": False,
              "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# d. Token streams


def write_token_stream(documents: list[Document], tokenizer: BpeTokenizer, path: Path) -> int:
    """Writes the documents' ids, each document followed by EOS, as little-endian uint16;
    returns the number of ids."""
    if tokenizer.vocab_size > 1 << 16:
        raise ValueError(f"vocab size {tokenizer.vocab_size} does not fit in uint16")
    ids = array.array("H")
    for doc in documents:
        ids.extend(tokenizer.encode_ordinary(doc.text))
        ids.append(tokenizer.eos_id)
    if sys.byteorder != "little":
        ids.byteswap()
    path.write_bytes(ids.tobytes())
    return len(ids)


# ---------------------------------------------------------------------------------------------
# e. Retrieval tasks

PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
                 "text. Find it and memorize it; you will be asked about it.")
KV_INTRO = ("Below is a list of keys and their values, one pair per line. Read it carefully; "
            "you will be asked for the value of one key.")
RETRIEVAL_LENGTHS = (512, 1024, 2048, 4096, 8192)
class FillerSource:
    """Documents cut into lines and sentences, for haystacks: a haystack then fits its target
    closely and the pass key sits between two lines or two sentences."""

    def __init__(self, documents: list[Document], tokenizer: BpeTokenizer) -> None:
        self.docs = [[piece for piece in LINE_OR_SENTENCE_END.split(d.text) if piece]
                     for d in sorted(documents, key=lambda d: d.doc_id)]
        self.tokenizer = tokenizer

    def take(self, rng: random.Random, n_tokens: int) -> list[str]:
        """Consecutive pieces of random documents, n_tokens or a little more in all."""
        pieces, total = [], 0
        while total < n_tokens:
            doc = rng.choice(self.docs)
            for piece in doc[rng.randrange(len(doc)):]:
                pieces.append(piece)
                total += len(self.tokenizer.encode_ordinary(piece))
                if total >= n_tokens:
                    break
        return pieces


def passkey_task(filler: FillerSource, rng: random.Random, target: int, depth: float, key: str
                 ) -> dict:
    """A pass key sentence at `depth` (0..1) of a haystack; prompt <= target tokens."""
    encode = filler.tokenizer.encode_ordinary
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "What is the pass key? Answer with the number only."
    pieces = filler.take(rng, target - len(encode(f"{PASSKEY_INTRO}\n\n{needle}\n\n{question}")))
    while True:
        at = round(depth * len(pieces))
        # On a line of its own after a line end; within a paragraph, a sentence among the others.
        sep = "\n" if at == 0 or pieces[at - 1].endswith("\n") else " "
        haystack = "".join(pieces[:at]) + needle + sep + "".join(pieces[at:])
        prompt = f"{PASSKEY_INTRO}\n\n{haystack.rstrip()}\n\n{question}"
        tokens = len(encode(prompt))
        if tokens <= target or not pieces:
            break
        surplus = tokens - target  # drop about that many tokens of pieces from the end
        while pieces and surplus > 0:
            surplus -= len(encode(pieces.pop()))
    actual_depth = at / len(pieces) if pieces else 0.0
    return {"prompt": prompt, "answer": key, "kind": "passkey", "depth": round(actual_depth, 3),
            "tokens": tokens}


def kv_task(tokenizer: BpeTokenizer, target: int, depth: float, new_key) -> dict:
    """Random key: value lines; the question names the line at `depth` (0..1); prompt <= target
    tokens."""
    def question(key: str) -> str:
        return f"What is the value of the key {key}? Answer with the value only."

    overhead = f"{KV_INTRO}\n\n\n\n{question('00000000-0000')}"
    budget = target - len(tokenizer.encode_ordinary(overhead))
    pairs, total = [], 0
    while total < budget or len(pairs) < 2:
        pairs.append((new_key(), new_key()))
        total += len(tokenizer.encode_ordinary("{}: {}".format(*pairs[-1]))) + 1  # and "\n"
    while True:
        index = round(depth * (len(pairs) - 1))
        key, value = pairs[index]
        listing = "\n".join(f"{k}: {v}" for k, v in pairs)
        prompt = f"{KV_INTRO}\n\n{listing}\n\n{question(key)}"
        tokens = len(tokenizer.encode_ordinary(prompt))
        if tokens <= target or len(pairs) <= 2:
            break
        pairs.pop()
    return {"prompt": prompt, "answer": value, "kind": "kv", "depth": round(depth, 3),
            "tokens": tokens}


class KeyMaker:
    """Unique random keys: 5-digit pass keys and "xxxxxxxx-xxxx" hex ids, never one that
    `exclude` holds (the eval keys stay apart from the train keys)."""

    def __init__(self, rng: random.Random, exclude: set[str]) -> None:
        self.rng, self.exclude, self.used = rng, exclude, set()

    def _unique(self, make) -> str:
        while True:
            key = make()
            if key not in self.exclude and key not in self.used:
                self.used.add(key)
                return key

    def passkey(self) -> str:
        return self._unique(lambda: str(self.rng.randrange(10000, 100000)))

    def hex_id(self) -> str:
        rng = self.rng
        return self._unique(lambda: f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}")


def make_retrieval_tasks(filler: FillerSource, rng: random.Random, keys: KeyMaker,
                         lengths_and_depths: list[tuple[int, float]]) -> list[dict]:
    """One passkey and one key-value task per (target length, depth)."""
    tasks = []
    for target, depth in lengths_and_depths:
        tasks.append(passkey_task(filler, rng, target, depth, keys.passkey()))
        tasks.append(kv_task(filler.tokenizer, target, depth, keys.hex_id))
    return tasks


def write_retrieval_tasks(train: list[Document], heldout: list[Document],
                          tokenizer: BpeTokenizer, out: Path, rng: random.Random,
                          n_train: int) -> dict:
    """retrieval_train.jsonl: n_train (target, depth) draws, the target log-uniform over
    512..8192 tokens and the depth uniform; retrieval_eval.jsonl: every length of
    RETRIEVAL_LENGTHS at the depths 0, 0.1, .., 1, with keys unused by the train tasks and filler
    from the held-out documents."""
    train_keys = KeyMaker(rng, set())
    draws = [(int(2 ** rng.uniform(9, 13)), rng.random()) for _ in range(n_train)]
    train_tasks = make_retrieval_tasks(FillerSource(train, tokenizer), rng, train_keys, draws)
    eval_keys = KeyMaker(rng, train_keys.used)
    grid = [(n, d / 10) for n in RETRIEVAL_LENGTHS for d in range(11)]
    eval_tasks = make_retrieval_tasks(FillerSource(heldout, tokenizer), rng, eval_keys, grid)
    write_jsonl(out / "retrieval_train.jsonl", train_tasks)
    write_jsonl(out / "retrieval_eval.jsonl", eval_tasks)
    return {"train_tasks": len(train_tasks), "eval_tasks": len(eval_tasks),
            "train_tokens": sum(t["tokens"] for t in train_tasks),
            "eval_tokens": sum(t["tokens"] for t in eval_tasks)}


# ---------------------------------------------------------------------------------------------
# The run

OUTPUT_NAMES = ("calibration.jsonl", "eval.jsonl", "tokenizer.json", "tokenizer_config.json",
                "train.bin", "val.bin", "train_sample.bin", "retrieval_train.jsonl",
                "retrieval_eval.jsonl", "meta.json")


def prepare_out_dir(out: Path, force: bool) -> None:
    """Refuses a directory inside the repository that git does not ignore (outputs must not
    become tracked files by accident) and existing outputs unless --force."""
    out = out.resolve()
    if out.is_relative_to(REPO_ROOT):
        ignored = subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "-q", str(out)])
        if ignored.returncode != 0:
            raise SystemExit(f"{out}: inside the repository and not ignored by git; choose a "
                             f"directory under build/ or outside the repository")
    existing = [name for name in OUTPUT_NAMES if (out / name).exists()]
    if existing and not force:
        raise SystemExit(f"{out}: already holds {', '.join(existing)}; pass --force to replace")
    out.mkdir(parents=True, exist_ok=True)
    if force:
        for name in existing:
            (out / name).unlink()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "tiny_model_data",
                        help="output directory (default: build/tiny_model_data)")
    parser.add_argument("--force", action="store_true", help="replace existing outputs")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab", type=int, default=8192, help="ids, special tokens included")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=4.0,
                        help="MB of training text the merges are learned on")
    parser.add_argument("--val-permille", type=int, default=10)
    parser.add_argument("--heldout-permille", type=int, default=25)
    parser.add_argument("--calibration-docs", type=int, default=64)
    parser.add_argument("--calibration-conversations", type=int, default=8)
    parser.add_argument("--eval-docs", type=int, default=32)
    parser.add_argument("--retrieval-train", type=int, default=500,
                        help="(length, depth) draws; each gives a passkey and a key-value task")
    parser.add_argument("--sample-tokens", type=int, default=8_000_000,
                        help="train_sample.bin holds the first this many ids of train.bin")
    parser.add_argument("--model-max-length", type=int, default=8192)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out = args.out.resolve()
    prepare_out_dir(out, args.force)
    timings: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(step: str):
        print(f"[{step}]", file=sys.stderr)
        start = time.monotonic()
        yield
        timings[step] = round(time.monotonic() - start, 1)

    with timed("sources"):
        documents, sources = collect_documents(SOURCES)

    with timed("split"):
        train, val, pool = split_documents(documents, args.val_permille, args.heldout_permille)
        heldout_filler = write_heldout_sets(pool, out, random.Random(f"{args.seed}:heldout"),
                                            args.calibration_docs, args.calibration_conversations,
                                            args.eval_docs)

    with timed("tokenizer"):
        sample = tokenizer_sample(train, random.Random(f"{args.seed}:tokenizer"),
                                  int(args.tokenizer_sample_mb * _MIB))
        tokenizer = train_tokenizer(sample, args.vocab)
        write_tokenizer(tokenizer, out, args.model_max_length)

    with timed("token_streams"):
        # A seeded order, so that any prefix of train.bin (train_sample.bin) mixes every source.
        random.Random(f"{args.seed}:order").shuffle(train)
        n_train = write_token_stream(train, tokenizer, out / "train.bin")
        n_val = write_token_stream(val, tokenizer, out / "val.bin")
        n_sample = None
        if n_train > args.sample_tokens:
            n_sample = args.sample_tokens
            with open(out / "train.bin", "rb") as f:
                (out / "train_sample.bin").write_bytes(f.read(2 * n_sample))

    with timed("retrieval"):
        retrieval = write_retrieval_tasks(train, heldout_filler, tokenizer, out,
                                          random.Random(f"{args.seed}:retrieval"),
                                          args.retrieval_train)

    prose = sum(len(d.text.encode()) for d in documents if d.kind == "prose")
    code = sum(len(d.text.encode()) for d in documents if d.kind == "code")
    meta = {
        "script_version": SCRIPT_VERSION,
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "vocab_size": tokenizer.vocab_size,
        "n_merges": len(tokenizer.merges),
        "special_tokens": tokenizer.special_ids,
        "eos_id": tokenizer.eos_id,
        "token_dtype": "uint16 little-endian; each document followed by eos_id",
        "pretokenizer_regex": QWEN2_PATTERN,
        "tokenizer_sample_bytes": sum(len(t.encode()) for t in sample),
        "corpus_bytes": {"prose": prose, "code": code},
        "documents": {"all": len(documents), "train": len(train), "val": len(val),
                      "heldout_pool": len(pool), "calibration": args.calibration_docs,
                      "calibration_conversations": args.calibration_conversations,
                      "eval": args.eval_docs},
        "tokens": {"train": n_train, "val": n_val, "train_sample": n_sample},
        "retrieval": retrieval,
        "sources": sources,
        "timings_s": timings,
        "files": {name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
                  for name in OUTPUT_NAMES[:-1] if (out / name).exists()},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    print(json.dumps({"out": str(out), "tokens": meta["tokens"], "timings_s": timings}),
          file=sys.stderr)


if __name__ == "__main__":
    main()
