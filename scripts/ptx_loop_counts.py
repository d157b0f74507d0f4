#!/usr/bin/env python3
"""Instruction counts of the loops of PTX kernels: for every kernel whose mangled name contains
PATTERN, each loop (a backward branch to a label of the same kernel) with its instruction count
and the counts of mma, shfl, prmt, selp, ld.global, fp32 arithmetic and ex2 in it. Used for the
Volta path's per-byte estimate (bench/RESULTS.md, "The Volta path").

Usage: scripts/ptx_loop_counts.py FILE.ptx PATTERN
(PTX from, e.g., nvcc -ptx -arch=compute_75 -std=c++20 --expt-relaxed-constexpr -O3 -DNDEBUG
 -Iinclude -Isrc [-DE4KV_VOLTA_PATH=1] src/backend/cuda/paged_decode_attention.cu)
"""
import re
import sys

FP32 = re.compile(r"(fma|mul|add|sub)\.(rn\.)?(ftz\.)?f32")
GUARD = re.compile(r"^@!?%p\d+ ")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    lines = open(sys.argv[1]).read().split("\n")
    starts = [i for i, line in enumerate(lines) if ".entry" in line and sys.argv[2] in line]
    if not starts:
        print(f"no kernel matching {sys.argv[2]}", file=sys.stderr)
        return 1
    for start in starts:
        end = start + 1
        while end < len(lines) and ".entry" not in lines[end]:
            end += 1
        body = lines[start:end]
        print(lines[start].split()[-1].rstrip("("))
        labels = {}
        for k, line in enumerate(body):
            m = re.match(r"^(\$L__BB\w+):", line.strip())
            if m:
                labels[m.group(1)] = k
        for k, line in enumerate(body):
            m = re.search(r"bra(\.uni)?\s+(\$L__BB\w+);", line)
            if not (m and m.group(2) in labels and labels[m.group(2)] < k):
                continue
            a = labels[m.group(2)]
            seg = [GUARD.sub("", x.strip()) for x in body[a:k + 1]
                   if x.strip() and x.strip()[0] not in "$/.{}"]

            def count(prefix):
                return sum(1 for x in seg if x.startswith(prefix))

            print(f"  loop at +{a}..+{k}: {len(seg)} instructions, mma {count('mma')}, "
                  f"shfl {count('shfl')}, prmt {count('prmt')}, selp {count('selp')}, "
                  f"ld.global {count('ld.global')}, f32 arith {sum(1 for x in seg if FP32.match(x))}, "
                  f"ex2 {count('ex2')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
