#!/usr/bin/env python3
"""Checks that the Volta path (arch.cuh, E4KV_VOLTA_PATH) uses no instruction newer than sm_70.

CUDA 13 cannot compile for sm_70, so the check compiles every CUDA source of the library to PTX
for the lowest target it has (compute_75) with E4KV_VOLTA_PATH defined, which makes the sources
take the code a V100 build would take, and scans each instruction for opcodes and operand types
that PTX introduced after sm_70 (tensor-core shapes other than m8n8k4, ldmatrix, cp.async, clusters,
mbarrier, PDL, FP8/BF16 conversions, ...). Prints the tensor-core and shuffle counts per file and
exits 1 on any hit. `--self-test` runs the scanner over known lines first, so the check is shown to
fail where it should.

Usage: scripts/check_volta_ptx.py [--nvcc PATH] [--out DIR] [--jobs N] [--self-test]
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (pattern, what it is, the architecture that introduced it)
DENIED = [
    (r"\bmma\.sync\.aligned\.m(?!8n8k4\.)", "mma shape other than m8n8k4", "sm_75+"),
    (r"\b(ldmatrix|stmatrix|movmatrix)\b", "matrix load/store/transpose", "sm_75+"),
    (r"\bcp\.(async|reduce\.async)", "asynchronous copy", "sm_80+"),
    (r"\bgriddepcontrol\b", "programmatic dependent launch", "sm_90"),
    (r"\b(barrier\.cluster|mapa|getctarank|elect\.sync|fence\.(proxy|mbarrier_init))\b",
     "cluster / proxy operation", "sm_90"),
    (r"%(cluster_|clusterid|nclusterid|is_explicit_cluster)", "cluster register", "sm_90"),
    (r"\bmbarrier\b", "mbarrier", "sm_80+"),
    (r"\b(st|red)\.async\b", "asynchronous store / reduction", "sm_90"),
    (r"\b(redux\.sync|wgmma|tcgen05|setmaxnreg|multimem|tensormap|clusterlaunchcontrol)\b",
     "sm_80+ warp / sm_90+ tensor-core operation", "sm_80+"),
    (r"\.(e4m3|e5m2|e2m1|e3m2|e2m3|ue8m0)", "FP8 / FP6 / FP4 type", "sm_89+"),
    (r"\.(bf16|bf16x2|tf32)\b", "BF16 / TF32 type", "sm_80+"),
    (r"\b(createpolicy|applypriority|discard)\b|L2::(cache_hint|evict|64B|128B|256B)",
     "cache policy / L2 size hint", "sm_75+"),
    (r"\btanh\.approx|\bex2\.approx(\.ftz)?\.f16", "FP16/FP32 tanh, FP16 ex2", "sm_75+"),
    (r"\.relu\b|\bxorsign\b|\.NaN\b", "relu / xorsign / NaN-propagating min-max", "sm_80+"),
]
DENIED_RE = [(re.compile(p), what, arch) for p, what, arch in DENIED]

SELF_TEST_BAD = [
    "\tmma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, "
    "{%f1, %f2, %f3, %f4};",
    "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};",
    "\tldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];",
    "\tcp.async.cg.shared.global [%r1], [%rd1], 16;",
    "\tcp.async.wait_group 1;",
    "\tgriddepcontrol.wait;",
    "\tbarrier.cluster.arrive.relaxed.aligned;",
    "\tmov.u32 %r1, %cluster_ctarank;",
    "\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;",
    "\tst.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%r1], %r2, [%r3];",
    "\tcvt.rn.f16x2.e4m3x2 %r1, %rs1;",
    "\tcvt.rn.satfinite.e4m3x2.f32 %rs1, %f1, %f2;",
    "\tcvt.rn.bf16.f32 %rs1, %f1;",
    "\tredux.sync.add.u32 %r1, %r2, -1;",
]
SELF_TEST_GOOD = [
    "\tmma.sync.aligned.m8n8k4.col.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4, %f5, %f6, %f7, %f8}, "
    "{%r1, %r2}, {%r3, %r4}, {%f1, %f2, %f3, %f4, %f5, %f6, %f7, %f8};",
    "\tshfl.sync.idx.b32 %r1, %r2, %r3, 31, -1;",
    "\tld.shared.b32 %r1, [%r2];",
    "\tmatch.any.sync.b32 %r1, %r2, -1;",
    "\tfma.rn.f16x2 %r1, %r2, %r3, %r4;",
    "\tnanosleep.u32 100;",
    "\tprmt.b32 %r1, %r2, %r3, 21520;",
    "\tex2.approx.ftz.f32 %f1, %f2;",
]


def instructions(text: str):
    """(line number, instruction) for each PTX instruction line (comments and directives out)."""
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("//", 1)[0].strip()
        if not code or code.startswith(".") or code.endswith(":") or code in "{}":
            continue
        yield number, code


def scan(text: str):
    hits = []
    for number, code in instructions(text):
        for regex, what, arch in DENIED_RE:
            if regex.search(code):
                hits.append((number, code, what, arch))
                break
    return hits


def self_test() -> bool:
    ok = True
    for line in SELF_TEST_BAD:
        if not scan(line):
            print(f"self-test: NOT flagged (should be): {line.strip()}")
            ok = False
    for line in SELF_TEST_GOOD:
        if scan(line):
            print(f"self-test: flagged (should not be): {line.strip()}")
            ok = False
    print(f"self-test: {len(SELF_TEST_BAD)} newer-than-sm_70 lines flagged, "
          f"{len(SELF_TEST_GOOD)} sm_70 lines passed: {'ok' if ok else 'FAILED'}")
    return ok


def find_nvcc(given):
    for candidate in (given, os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def compile_ptx(nvcc: str, source: Path, out: Path) -> tuple[Path, str]:
    ptx = out / (source.stem + ".ptx")
    cmd = [nvcc, "-ptx", "-arch=compute_75", "-std=c++20", "--expt-relaxed-constexpr",
           "-DE4KV_VOLTA_PATH=1", "-DNDEBUG", "-O3", f"-I{ROOT / 'include'}", f"-I{ROOT / 'src'}",
           str(source), "-o", str(ptx)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return ptx, (proc.stderr if proc.returncode else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvcc")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "volta-ptx")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test and not self_test():
        return 1
    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("check_volta_ptx: no nvcc found (give --nvcc PATH or set CUDACXX)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sources = sorted((ROOT / "src" / "backend" / "cuda").glob("*.cu"))
    failed = False
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda s: (s, *compile_ptx(nvcc, s, args.out)), sources))
    for source, ptx, error in results:
        name = source.relative_to(ROOT)
        if error:
            print(f"{name}: nvcc failed:\n{error}")
            failed = True
            continue
        text = ptx.read_text()
        hits = scan(text)
        codes = [c for _, c in instructions(text)]
        mma = sum(c.startswith("mma.") for c in codes)
        shfl = sum(c.startswith("shfl.") for c in codes)
        print(f"{name}: {len(codes)} instructions, {mma} mma.m8n8k4, {shfl} shfl: "
              f"{'OK' if not hits else f'{len(hits)} newer than sm_70'}")
        for number, code, what, arch in hits[:10]:
            print(f"  {ptx.name}:{number}: {what} ({arch}): {code}")
        failed |= bool(hits)
    print(f"check_volta_ptx: {len(sources)} sources, nvcc {nvcc}: "
          f"{'FAILED' if failed else 'no instruction newer than sm_70'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
