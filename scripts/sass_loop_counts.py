#!/usr/bin/env python3
"""Instruction counts of the loops of SASS kernels (cuobjdump -sass output): for every function
whose mangled name contains PATTERN, each loop (a branch back to an earlier address of the same
function) with its instruction count and the counts of HMMA, SHFL, PRMT, SEL, LDG, FFMA/FMUL/FADD
and MUFU in it. The SASS twin of ptx_loop_counts.py, for the Volta path's per-byte figures
(bench/RESULTS.md, "The Volta path").

Usage: scripts/sass_loop_counts.py FILE.sass PATTERN
(SASS from cuobjdump -sass of, e.g., nvcc -cubin -arch=sm_75 ... [-DE4KV_VOLTA_PATH=1]
 src/backend/cuda/paged_decode_attention.cu; scripts/gpu_volta.sh makes both)
"""
import re
import sys

FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# "        /*0230*/                   @!P0 HMMA.1688.F32 R8, R12, R16, R8 ;   /* 0x... */"
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b(?:\.\w+)*\s+(?:`\((\.L_x_\d+)\)|(0x[0-9a-fA-F]+))")
KINDS = [("HMMA", "HMMA"), ("SHFL", "SHFL"), ("PRMT", "PRMT"), ("SEL", "SEL"), ("LDG", "LDG"),
         ("fp32", ("FFMA", "FMUL", "FADD")), ("MUFU", "MUFU")]


def functions(text: str):
    """(name, [(address, instruction)], {label: address}) per function."""
    name, body, labels, pending = None, [], {}, []
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            if name is not None:
                yield name, body, labels
            name, body, labels, pending = m.group(1), [], {}, []
            continue
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSTRUCTION.match(line)
        if m and name is not None:
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            body.append((address, re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    if name is not None:
        yield name, body, labels


def opcode(instruction: str) -> str:
    return instruction.split()[0] if instruction else ""


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    found = False
    for name, body, labels in functions(open(sys.argv[1]).read()):
        if sys.argv[2] not in name:
            continue
        found = True
        print(name)
        for address, instruction in body:
            m = BRANCH.search(instruction)
            if not m:
                continue
            target = labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
            if target is None or target >= address:
                continue
            loop = [ins for a, ins in body if target <= a <= address]
            counts = []
            for label, prefixes in KINDS:
                prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
                n = sum(1 for ins in loop if opcode(ins).split(".")[0] in prefixes)
                counts.append(f"{label} {n}")
            print(f"  loop 0x{target:x}..0x{address:x}: {len(loop)} instructions, "
                  + ", ".join(counts))
    if not found:
        print(f"no function matching {sys.argv[2]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
