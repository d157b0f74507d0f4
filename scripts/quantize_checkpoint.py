#!/usr/bin/env python3
"""Quantize a FP16/BF16/F32 Hugging Face checkpoint the way the public tools lay out their output.

Usage:
  scripts/quantize_checkpoint.py SRC_DIR OUT_DIR --format awq|nvfp4|fp8-block
      [--group-size 32|64|128] [--no-zero-point] [--block N] [--dequantized-out DIR]

OUT_DIR receives the quantized checkpoint (config.json with a `quantization_config`, the
safetensors files, the tokenizer and generation files copied). --dequantized-out writes the same
model with every quantized weight replaced by exactly its dequantized value (computed in float32
from the stored codes and scales, rounded once to FP16), every other tensor byte-for-byte as in
SRC_DIR: the reference that an engine reading OUT_DIR must match. Neither output may exist with
files in it, and SRC_DIR is only read.

Plain round-to-nearest: no calibration data, no activation-aware scaling or clipping search (the
tools' search only changes the weights before this step; the stored layout is the same).

Only the standard library and numpy: the safetensors reader and writer are the few lines below.

The layouts, checked against the tools' public sources:

AWQ ("quant_method": "awq", "version": "gemm"), AutoAWQ awq/quantize/quantizer.py
  (pseudo_quantize_tensor) and awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear):
  per output row and group of G input columns, scale = max(max - min, 1e-5) / 15,
  zero = clamp(round(-min / scale), 0, 15), q = clamp(round(w / scale) + zero, 0, 15),
  w' = (q - zero) * scale. `P.qweight` int32 [in, out / 8]: packed column c holds output column
  c * 8 + AWQ_ORDER[i] in bits 4i..4i+3; `P.qzeros` int32 [in / G, out / 8] packed the same way;
  `P.scales` FP16 [in / G, out]. AutoAWQ computes in the model's dtype (FP16); here the scale is
  rounded to FP16 first and q, zero and w' use that rounded scale, which is what the stored
  tensors mean. AutoAWQ's GEMM layer asserts a zero point; the symmetric form (--no-zero-point)
  is e4kv's: scale = max(absmax, 1e-5) / 7 (FP16), q = clamp(round(w / scale), -8, 7) + 8, no
  `qzeros` tensor, w' = (q - 8) * scale.

NVFP4 ("quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"), compressed-tensors
  quantization/utils/helpers.py (generate_gparam, calculate_qparams), quantization/quant_args.py
  (FP4_E2M1_DATA.cast_to_fp4), quantization/lifecycle/forward.py (_quantize, _dequantize),
  compressors/quantized_compressors/nvfp4_quantized.py (pack_fp4_to_uint8), and llm-compressor's
  min-max observer and update_fused_layer_weight_global_scales:
  global = 448 * 6 / amax(|W|), the minimum of q/k/v's (and of gate/up's) globals shared by them;
  per row and group of 16 columns, scale = e4m3(clamp(global * (amax_group / 6), +-448)), a zero
  scale replaced by 0.125; q = e2m1(clamp(w / (scale / global), +-6)) rounding half to even (the
  thresholds 0.25, 0.75, ..., 5 of cast_to_fp4), bit 3 the sign of a negative value (also when it
  rounds to zero); w' = e2m1(q) * (scale / global). The tool computes 448 * 6 / amax and
  amax / 6 in the checkpoint's dtype (its observer reads the BF16 weight); this script rounds
  those two to the source dtype to match. `P.weight_packed` uint8 [out, in / 2], element 2j in
  the low nibble of byte j; `P.weight_scale` F8_E4M3 [out, in / 16]; `P.weight_global_scale` F32
  [1]; `P.input_global_scale` F32 [1] (an activation calibration would set it; written as 1.0).

FP8 block ("quant_method": "fp8", DeepSeek-V3 / Qwen3-FP8 releases), transformers
  quantizers/quantizer_finegrained_fp8.py: per block of 128 x 128 (`--block`), inv =
  448 / amax_block, q = e4m3(clamp(w * inv, +-448)), `P.weight_scale_inv` = 1 / inv (F32,
  [ceil(out / B), ceil(in / B)], the blocks at the right and bottom edges partial, as in the
  DeepSeek-V3 release), w' = e4m3(q) * weight_scale_inv (DeepSeek-V3 inference/kernel.py
  weight_dequant). `P.weight` F8_E4M3 [out, in]. An all-zero block gets the scale 1.
"""

import argparse
import json
import os
import re
import shutil
import struct
import sys

import numpy as np

PROG = "quantize_checkpoint.py"

# Nibble i of an AWQ-packed int32 holds column AWQ_ORDER[i] of its group of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E4M3_MAX = 448.0
E4M3_ZERO_SCALE_CODE = 0x20  # 0.125: what compressed-tensors puts in place of a zero group scale

# The linear projections of the decoder layers that are quantized (module names, no ".weight").
QUANTIZED_MODULE = re.compile(
    r"^(?:.*\.)?layers\.\d+\.(?:"
    r"self_attn\.(?:q|k|v|o)_proj"
    r"|self_attn\.indexer\.index_qk_proj"
    r"|mlp\.(?:gate|up|down)_proj"
    r"|mlp\.shared_expert\.(?:gate|up|down)_proj"
    r"|mlp\.experts\.\d+\.(?:gate|up|down)_proj"
    r"|linear_attn\.(?:in_proj_qkv|in_proj_z|out_proj)"
    r")$")
# Stacked experts as newer transformers store them: [E, 2I, H] (gate rows first) and [E, H, I].
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class UserError(Exception):
    pass


# ---- number formats ---------------------------------------------------------------------------

def bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x):
    """float32 -> the nearest BF16 value (ties to even), as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def round_to_dtype(x, dtype):
    """Rounds float32 values to the source checkpoint's dtype (what torch does for its tensor ops)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "BF16":
        return round_to_bf16(x)
    if dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    return x


def e4m3_decode(codes):
    """E4M3 (fn: no infinities, 0x7f/0xff NaN, max 448) bytes -> float32."""
    codes = np.asarray(codes, dtype=np.uint8).astype(np.int32)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 7).astype(np.float32)
    magnitude = np.where(exponent == 0, mantissa * np.float32(2.0 ** -9),
                         (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float32) - 7.0))
    magnitude = magnitude.astype(np.float32)
    magnitude[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


def e4m3_encode(x):
    """float32 -> E4M3 bytes, round to nearest, ties to even. Callers clamp to +-448 first (a larger
    magnitude or NaN gives the NaN code, as a torch cast does)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)  # every step below is exact in float64
    _, e = np.frexp(a)  # a = f * 2^e, f in [0.5, 1)
    e = np.where(a == 0, -100, e)  # zero joins the subnormals
    # Normal numbers have 3 mantissa bits: the quantum is 2^(e - 4); below 2^-6 it stays 2^-9.
    quantum_exp = np.maximum(e - 4, -9)
    steps = np.rint(np.ldexp(a, -quantum_exp))  # 8..16 for normals, 0..8 for subnormals
    # A normal number is (exponent field) * 8 + steps - 8, with exponent field e - 1 + 7; steps 16
    # carries into the next exponent and steps 8 of a subnormal is the smallest normal.
    codes = np.where(quantum_exp == -9, steps, (e + 5) * 8 + steps)
    codes = np.where(np.isnan(a) | (codes > 0x7E), 0x7F, codes).astype(np.uint8)
    return np.where(np.signbit(x), codes | 0x80, codes).astype(np.uint8)


def e2m1_encode(x):
    """float32 values in [-6, 6] -> E2M1 codes: the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to
    the even code; bit 3 set for a negative value (even one that rounds to zero, as
    compressed-tensors' cast_to_fp4 followed by pack_fp4_to_uint8 does)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    # Each midpoint is a tie; passing it strictly (odd code above) or inclusively (even code above)
    # makes ties go to the even code.
    index = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
             + (a >= 3.5) + (a > 5.0))
    return (index | np.where(x < 0, 8, 0)).astype(np.uint8)


def e2m1_decode(codes):
    codes = np.asarray(codes, dtype=np.uint8)
    magnitude = E2M1_VALUES[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude).astype(np.float32)


# ---- AWQ ----------------------------------------------------------------------------------------

def awq_pack(values):
    """[rows, cols] integers 0..15 -> int32 [rows, cols / 8] in AutoAWQ's interleaved order."""
    values = np.asarray(values, dtype=np.uint32)
    rows, cols = values.shape
    groups = values.reshape(rows, cols // 8, 8)
    packed = np.zeros((rows, cols // 8), dtype=np.uint32)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= groups[:, :, column] << np.uint32(4 * nibble)
    return packed.view(np.int32)


def awq_unpack(packed):
    packed = np.asarray(packed, dtype=np.int32).view(np.uint32)
    rows, cols = packed.shape
    values = np.zeros((rows, cols, 8), dtype=np.uint8)
    for nibble, column in enumerate(AWQ_ORDER):
        values[:, :, column] = (packed >> np.uint32(4 * nibble)) & 0xF
    return values.reshape(rows, cols * 8)


def awq_quantize(w, group_size, zero_point):
    """w float32 [out, in] -> (tensors by suffix, dequantized float32 [out, in])."""
    out_features, in_features = w.shape
    g = w.reshape(out_features, in_features // group_size, group_size)
    if zero_point:
        w_max = g.max(axis=2)
        w_min = g.min(axis=2)
        scale = (np.maximum(w_max - w_min, np.float32(1e-5)) / np.float32(15)).astype(np.float16)
        s = scale.astype(np.float32)
        zero = np.clip(np.rint(-w_min / s), 0, 15)
        q = np.clip(np.rint(g / s[:, :, None]) + zero[:, :, None], 0, 15)
    else:
        absmax = np.abs(g).max(axis=2)
        scale = (np.maximum(absmax, np.float32(1e-5)) / np.float32(7)).astype(np.float16)
        s = scale.astype(np.float32)
        zero = np.full(s.shape, 8.0, dtype=np.float32)
        q = np.clip(np.rint(g / s[:, :, None]), -8, 7) + 8
    q = q.astype(np.uint8)
    zero = zero.astype(np.uint8)
    dequant = awq_dequantize(q.reshape(out_features, in_features), zero, scale)
    tensors = {"qweight": awq_pack(q.reshape(out_features, in_features).T),
               "scales": np.ascontiguousarray(scale.T)}
    if zero_point:
        tensors["qzeros"] = awq_pack(zero.T)
    return tensors, dequant


def awq_dequantize(q, zero, scale):
    """q uint8 [out, in], zero uint8 [out, in / G], scale FP16 [out, in / G] -> float32 [out, in]."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    qg = q.reshape(out_features, groups, in_features // groups).astype(np.float32)
    w = (qg - zero.astype(np.float32)[:, :, None]) * scale.astype(np.float32)[:, :, None]
    return w.reshape(out_features, in_features).astype(np.float32)


# ---- NVFP4 --------------------------------------------------------------------------------------

NVFP4_GROUP = 16


def nvfp4_global_scale(w, src_dtype):
    amax = np.float32(np.abs(w).max())
    if amax == 0:
        return np.float32(1.0)
    return np.float32(round_to_dtype(np.float32(E4M3_MAX * 6.0) / amax, src_dtype))


def nvfp4_quantize(w, global_scale, src_dtype):
    out_features, in_features = w.shape
    g = w.reshape(out_features, in_features // NVFP4_GROUP, NVFP4_GROUP)
    amax = np.abs(g).max(axis=2)
    local = np.float32(global_scale) * round_to_dtype(amax / np.float32(6.0), src_dtype)
    scale_codes = e4m3_encode(np.clip(local, -E4M3_MAX, E4M3_MAX))
    scale_codes[scale_codes == 0] = E4M3_ZERO_SCALE_CODE
    effective = (e4m3_decode(scale_codes) / np.float32(global_scale)).astype(np.float32)
    scaled = np.clip(g / effective[:, :, None], -6.0, 6.0).astype(np.float32)
    codes = e2m1_encode(scaled).reshape(out_features, in_features)
    tensors = {"weight_packed": (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8),
               "weight_scale": scale_codes,
               "weight_global_scale": np.array([global_scale], dtype=np.float32),
               "input_global_scale": np.array([1.0], dtype=np.float32)}
    return tensors, nvfp4_dequantize(tensors["weight_packed"], scale_codes, global_scale)


def nvfp4_dequantize(packed, scale_codes, global_scale):
    out_features = packed.shape[0]
    codes = np.empty((out_features, packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    effective = (e4m3_decode(scale_codes) / np.float32(global_scale)).astype(np.float32)
    values = e2m1_decode(codes).reshape(out_features, -1, NVFP4_GROUP)
    return (values * effective[:, :, None]).reshape(out_features, -1).astype(np.float32)


# ---- FP8 block ----------------------------------------------------------------------------------

def fp8_block_quantize(w, block):
    out_features, in_features = w.shape
    block_rows = -(-out_features // block)
    block_cols = -(-in_features // block)
    padded = np.zeros((block_rows * block, block_cols * block), dtype=np.float32)
    padded[:out_features, :in_features] = w
    blocks = padded.reshape(block_rows, block, block_cols, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    safe_amax = np.where(amax == 0, np.float32(E4M3_MAX), amax).astype(np.float32)
    inv = (np.float32(E4M3_MAX) / safe_amax).astype(np.float32)
    scaled = np.clip(blocks * inv[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(np.float32)
    codes = e4m3_encode(scaled).reshape(padded.shape)[:out_features, :in_features]
    scale_inv = (np.float32(1.0) / inv).astype(np.float32)
    tensors = {"weight": np.ascontiguousarray(codes), "weight_scale_inv": scale_inv}
    return tensors, fp8_block_dequantize(tensors["weight"], scale_inv, block)


def fp8_block_dequantize(codes, scale_inv, block):
    out_features, in_features = codes.shape
    expanded = np.repeat(np.repeat(scale_inv, block, axis=0), block, axis=1)
    return (e4m3_decode(codes) * expanded[:out_features, :in_features]).astype(np.float32)


# ---- safetensors --------------------------------------------------------------------------------

class SafetensorsFile:
    """A safetensors file read into memory: tensors by name as (dtype string, shape, bytes)."""

    def __init__(self, path):
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 8:
            raise UserError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", data[:8])
        if 8 + header_len > len(data):
            raise UserError(f"{path}: header length {header_len} runs past the end of the file")
        try:
            header = json.loads(data[8:8 + header_len])
        except ValueError as e:
            raise UserError(f"{path}: header is not JSON ({e})")
        self.metadata = header.pop("__metadata__", None)
        self.tensors = {}
        body = memoryview(data)[8 + header_len:]
        for name, info in header.items():
            begin, end = info["data_offsets"]
            self.tensors[name] = (info["dtype"], list(info["shape"]), bytes(body[begin:end]))

    def array(self, name):
        """The tensor as float32 (F32, F16 or BF16 only)."""
        dtype, shape, raw = self.tensors[name]
        if dtype == "F32":
            return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
        if dtype == "F16":
            return np.frombuffer(raw, dtype="<f2").reshape(shape).astype(np.float32)
        if dtype == "BF16":
            return bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
        raise UserError(f"tensor {name} is {dtype}; only F32, F16 and BF16 weights can be quantized")


def to_entry(array, dtype):
    """numpy array -> (safetensors dtype, shape, little-endian bytes)."""
    numpy_types = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "U8": "u1", "F8_E4M3": "u1"}
    return (dtype, list(array.shape), np.ascontiguousarray(array, dtype=numpy_types[dtype]).tobytes())


def write_safetensors(path, entries, metadata):
    """Tensors in name order, header padded with spaces to 8 bytes: the same bytes every run."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name in sorted(entries):
        dtype, shape, raw = entries[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(entries):
            f.write(entries[name][2])


# ---- the checkpoint -----------------------------------------------------------------------------

def module_of(tensor_name):
    return tensor_name[:-len(".weight")] if tensor_name.endswith(".weight") else None


def fits(fmt, shape, group_size):
    out_features, in_features = shape
    if fmt == "awq":
        return in_features % group_size == 0 and out_features % 8 == 0
    if fmt == "nvfp4":
        return in_features % NVFP4_GROUP == 0
    return True


def linear_like(name, shape):
    """A 2-D weight of a module the tools would see as a Linear (not an embedding or a norm)."""
    module = module_of(name)
    return (module is not None and len(shape) == 2 and "embed" not in module
            and not module.split(".")[-1].endswith("norm"))


def fused_global_group(module):
    """The modules whose NVFP4 global scales llm-compressor fuses: q/k/v of one attention, gate/up
    of one MLP (each expert, the shared expert). None for the others."""
    match = re.match(r"^(.*\.self_attn)\.(?:q|k|v)_proj$", module)
    if match:
        return match.group(1) + ".qkv"
    match = re.match(r"^(.*)\.(?:gate|up)_proj$", module)
    if match:
        return match.group(1) + ".gate_up"
    return None


def source_files(src):
    index_path = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        return sorted(set(index["weight_map"].values())), index
    if os.path.exists(os.path.join(src, "model.safetensors")):
        return ["model.safetensors"], None
    raise UserError(f"{src}: no model.safetensors or model.safetensors.index.json")


def quantization_config(args, not_converted):
    if args.format == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": args.group_size,
                "zero_point": args.zero_point, "version": "gemm",
                "modules_to_not_convert": not_converted}
    if args.format == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [args.block, args.block],
                "modules_to_not_convert": not_converted}
    # llm-compressor's NVFP4 preset as it serializes (every QuantizationArgs field written).
    def args_of(dynamic):
        return {"actorder": None, "block_structure": None, "dynamic": dynamic,
                "group_size": NVFP4_GROUP, "num_bits": 4, "observer": "minmax",
                "observer_kwargs": {}, "strategy": "tensor_group", "symmetric": True,
                "type": "float"}
    return {"config_groups": {"group_0": {"format": "nvfp4-pack-quantized",
                                          "input_activations": args_of("local"),
                                          "output_activations": None, "targets": ["Linear"],
                                          "weights": args_of(False)}},
            "format": "nvfp4-pack-quantized", "global_compression_ratio": None,
            "ignore": not_converted, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}}


def quantize_weight(args, w, src_dtype, global_scale):
    if args.format == "awq":
        tensors, dequant = awq_quantize(w, args.group_size, args.zero_point)
        types = {"qweight": "I32", "qzeros": "I32", "scales": "F16"}
    elif args.format == "nvfp4":
        tensors, dequant = nvfp4_quantize(w, global_scale, src_dtype)
        types = {"weight_packed": "U8", "weight_scale": "F8_E4M3", "weight_global_scale": "F32",
                 "input_global_scale": "F32"}
    else:
        tensors, dequant = fp8_block_quantize(w, args.block)
        types = {"weight": "F8_E4M3", "weight_scale_inv": "F32"}
    return {suffix: to_entry(t, types[suffix]) for suffix, t in tensors.items()}, dequant


def convert_file(args, src_file, fused_globals):
    """One source shard -> (quantized entries, dequantized entries, not-converted modules)."""
    quantized, dequantized, not_converted = {}, {}, []
    # Per-module float32 weights to quantize, the stacked expert tensors split first.
    candidates = {}
    fused_sources = {}
    for name, (dtype, shape, raw) in src_file.tensors.items():
        fused = FUSED_EXPERTS.match(name)
        if fused and len(shape) == 3:
            stacked = src_file.array(name)
            half = shape[1] // 2
            for e in range(shape[0]):
                prefix = f"{fused.group('prefix')}.{e}"
                if fused.group("kind") == "gate_up_proj":
                    candidates[prefix + ".gate_proj"] = (stacked[e, :half], dtype)
                    candidates[prefix + ".up_proj"] = (stacked[e, half:], dtype)
                else:
                    candidates[prefix + ".down_proj"] = (stacked[e], dtype)
            fused_sources[name] = (fused.group("prefix"), fused.group("kind"), shape)
            continue
        module = module_of(name)
        if module and len(shape) == 2 and QUANTIZED_MODULE.match(module) and dtype in ("F32", "F16", "BF16"):
            candidates[module] = (src_file.array(name), dtype)
            continue
        quantized[name] = dequantized[name] = (dtype, shape, raw)
        if linear_like(name, shape):
            not_converted.append(module)

    dequantized_modules, quantized_modules = {}, set()
    for module in sorted(candidates):
        w, dtype = candidates[module]
        if not fits(args.format, w.shape, args.group_size):
            # Left dense, under its per-module name, and listed as not converted.
            quantized[module + ".weight"] = (dtype, list(w.shape),
                                             src_raw(src_file, module, w, dtype))
            dequantized_modules[module] = w
            not_converted.append(module)
            continue
        entries, dequant = quantize_weight(args, w, dtype, fused_globals.get(module))
        for suffix, entry in entries.items():
            quantized[f"{module}.{suffix}"] = entry
        dequantized_modules[module] = dequant
        quantized_modules.add(module)

    for module, w in dequantized_modules.items():
        name = module + ".weight"
        if name in src_file.tensors:
            dequantized[name] = (to_entry(w.astype(np.float16), "F16") if module in quantized_modules
                                 else src_file.tensors[name])
    # The dequantized checkpoint keeps the source's stacked expert tensors, re-stacked.
    for name, (prefix, kind, shape) in fused_sources.items():
        parts = []
        for e in range(shape[0]):
            if kind == "gate_up_proj":
                parts.append(np.concatenate([dequantized_modules[f"{prefix}.{e}.gate_proj"],
                                             dequantized_modules[f"{prefix}.{e}.up_proj"]]))
            else:
                parts.append(dequantized_modules[f"{prefix}.{e}.down_proj"])
        dequantized[name] = to_entry(np.stack(parts).astype(np.float16), "F16")
    return quantized, dequantized, not_converted


def src_raw(src_file, module, w, dtype):
    """The bytes of a dense weight: the source's own when it has the tensor, else (a split expert)
    the slice re-encoded in its dtype, exactly."""
    name = module + ".weight"
    if name in src_file.tensors:
        return src_file.tensors[name][2]
    if dtype == "BF16":
        return (w.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    return w.astype("<f2" if dtype == "F16" else "<f4").tobytes()


def nvfp4_fused_globals(files):
    """Every quantized module's global scale: its own, or the minimum over its fused group."""
    own = {}
    for src_file in files:
        for name, (dtype, shape, _) in src_file.tensors.items():
            fused = FUSED_EXPERTS.match(name)
            if fused and len(shape) == 3:
                stacked = src_file.array(name)
                half = shape[1] // 2
                for e in range(shape[0]):
                    prefix = f"{fused.group('prefix')}.{e}"
                    if fused.group("kind") == "gate_up_proj":
                        parts = {".gate_proj": stacked[e, :half], ".up_proj": stacked[e, half:]}
                    else:
                        parts = {".down_proj": stacked[e]}
                    for suffix, w in parts.items():
                        if fits("nvfp4", w.shape, 0):
                            own[prefix + suffix] = nvfp4_global_scale(w, dtype)
                continue
            module = module_of(name)
            if module and len(shape) == 2 and QUANTIZED_MODULE.match(module) and fits("nvfp4", shape, 0):
                own[module] = nvfp4_global_scale(src_file.array(name), dtype)
    groups = {}
    for module in own:
        key = fused_global_group(module)
        if key:
            groups.setdefault(key, []).append(module)
    shared = dict(own)
    for members in groups.values():
        smallest = min(own[m] for m in members)
        for m in members:
            shared[m] = smallest
    return shared


def check_out_dir(path, src, flag):
    real, real_src = os.path.realpath(path), os.path.realpath(src)
    if real == real_src or real.startswith(real_src + os.sep):
        raise UserError(f"{flag} {path} is inside SRC_DIR {src}; choose a directory outside it")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"{flag} {path} exists and is not an empty directory; choose a new one")


def write_checkpoint(out_dir, src, config, shards, index, metadata_by_file):
    """Writes into a sibling temporary directory, then renames it into place: an interrupted run
    leaves no half-written checkpoint at OUT_DIR."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    try:
        for entry in sorted(os.listdir(src)):
            path = os.path.join(src, entry)
            if (os.path.isfile(path) and not entry.endswith(".safetensors")
                    and entry not in ("config.json", "model.safetensors.index.json")):
                shutil.copyfile(path, os.path.join(tmp, entry))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        weight_map, total = {}, 0
        for file_name, entries in shards.items():
            write_safetensors(os.path.join(tmp, file_name), entries, metadata_by_file[file_name])
            for name, (_, _, raw) in entries.items():
                weight_map[name] = file_name
                total += len(raw)
        if index is not None:
            new_index = dict(index)
            new_index["metadata"] = dict(index.get("metadata") or {}, total_size=total)
            new_index["weight_map"] = {k: weight_map[k] for k in sorted(weight_map)}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(new_index, f, indent=2)
                f.write("\n")
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # checked empty
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def run(args):
    src = args.src_dir
    if not os.path.isdir(src):
        raise UserError(f"SRC_DIR {src} is not a directory")
    check_out_dir(args.out_dir, src, "OUT_DIR")
    if args.dequantized_out:
        check_out_dir(args.dequantized_out, src, "--dequantized-out")
        if os.path.realpath(args.dequantized_out) == os.path.realpath(args.out_dir):
            raise UserError("--dequantized-out must differ from OUT_DIR")
    config_path = os.path.join(src, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{config_path}: cannot read ({e})")
    if "quantization_config" in config:
        raise UserError(f"{config_path} already has a quantization_config; pass an unquantized checkpoint")

    file_names, index = source_files(src)
    files = {name: SafetensorsFile(os.path.join(src, name)) for name in file_names}
    fused_globals = nvfp4_fused_globals(files.values()) if args.format == "nvfp4" else {}

    quantized_shards, dequantized_shards, metadata, not_converted = {}, {}, {}, []
    for name in file_names:
        q, d, skipped = convert_file(args, files[name], fused_globals)
        quantized_shards[name], dequantized_shards[name] = q, d
        metadata[name] = files[name].metadata
        not_converted += skipped
    # The tools always keep the output projection dense and list it, tied to the embedding or not.
    not_converted = sorted(set(not_converted) | {"lm_head"})

    quantized_config = dict(config)
    quantized_config["quantization_config"] = quantization_config(args, not_converted)
    write_checkpoint(args.out_dir, src, quantized_config, quantized_shards, index, metadata)
    if args.dequantized_out:
        write_checkpoint(args.dequantized_out, src, config, dequantized_shards, index, metadata)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("src_dir", metavar="SRC_DIR")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--format", required=True, choices=["awq", "nvfp4", "fp8-block"])
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128],
                        help="AWQ input columns per scale (default 128)")
    parser.add_argument("--no-zero-point", dest="zero_point", action="store_false",
                        help="AWQ: symmetric codes (zero 8), no qzeros tensor")
    parser.add_argument("--block", type=int, help="FP8 block: rows and columns per scale (default 128)")
    parser.add_argument("--dequantized-out", metavar="DIR",
                        help="also write the dequantized FP16 reference checkpoint here")
    args = parser.parse_args(argv)
    if args.format != "awq" and (args.group_size is not None or not args.zero_point):
        parser.error("--group-size and --no-zero-point apply to --format awq only")
    if args.format != "fp8-block" and args.block is not None:
        parser.error("--block applies to --format fp8-block only")
    if args.block is not None and args.block < 1:
        parser.error("--block must be positive")
    if args.group_size is None:
        args.group_size = 128
    if args.block is None:
        args.block = 128
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
