#!/usr/bin/env python3
"""Tests of scripts/quantize_checkpoint.py on hand-made tensors whose codes and scales are worked
out by hand (the formats' definitions, not the script's arithmetic). Run directly (exit 77 when
numpy is missing, ctest's skip code) or with `python3 -m unittest`."""

import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover - depends on the machine
    np = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "quantize_checkpoint.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
if np is not None:
    import quantize_checkpoint as qc


def read_safetensors(path):
    """An independent reader: {name: (dtype, shape, bytes)}."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n:]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


def f32_to_bf16_bytes(a):
    return (np.asarray(a, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def write_f32_checkpoint(directory, tensors, config):
    """A tiny checkpoint written by hand (F32 or BF16 tensors given as (dtype, array))."""
    os.makedirs(directory)
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, array = tensors[name]
        raw = f32_to_bf16_bytes(array) if dtype == "BF16" else np.asarray(array, "<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write("{}")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def tree_digest(directory):
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(path[len(directory):].encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


@unittest.skipIf(np is None, "numpy missing")
class Formats(unittest.TestCase):
    def test_awq_pack_order_on_a_known_pattern(self):
        # Column c holds the value c: nibble i must hold column (0, 2, 4, 6, 1, 3, 5, 7)[i].
        values = np.arange(16, dtype=np.uint8).reshape(2, 8) % 8
        packed = qc.awq_pack(values)
        self.assertEqual(packed.dtype, np.int32)
        self.assertEqual(packed.shape, (2, 1))
        self.assertEqual(int(packed.view(np.uint32)[0, 0]), 0x75316420)
        np.testing.assert_array_equal(qc.awq_unpack(packed), values)
        # Two packed columns: the second covers output columns 8..15.
        wide = np.tile(np.arange(16, dtype=np.uint8) % 16, (1, 1))
        self.assertEqual([hex(v) for v in qc.awq_pack(wide).view(np.uint32)[0]],
                         ["0x75316420", "0xfdb9eca8"])

    def test_awq_zero_point_group(self):
        # One row, group 32: min -1, max 2 -> scale fp16(3 / 15), zero round(1 / scale) = 5.
        w = np.linspace(-1.0, 2.0, 32, dtype=np.float32)[None, :]
        w = np.repeat(w, 8, axis=0)  # out must be a multiple of 8
        tensors, dequant = qc.awq_quantize(w, 32, True)
        s = np.float32(np.float16(np.float32(3.0) / np.float32(15.0)))
        self.assertEqual(tensors["scales"].dtype, np.float16)
        self.assertEqual(tensors["scales"].shape, (1, 8))
        self.assertEqual(np.float32(tensors["scales"][0, 0]), s)
        zeros = qc.awq_unpack(tensors["qzeros"])
        self.assertTrue((zeros == 5).all())
        q = qc.awq_unpack(tensors["qweight"]).T  # [out, in]
        self.assertEqual(q[0, 0], 0)    # -1 / s = -5.001 -> -5, + 5
        self.assertEqual(q[0, 31], 15)  # 2 / s = 10.002 -> 10, + 5
        expected = (q.astype(np.float32) - 5) * s
        np.testing.assert_array_equal(dequant, expected)
        self.assertEqual(tensors["qweight"].shape, (32, 1))

    def test_awq_symmetric_group_is_exact_for_integers(self):
        # absmax 7 -> scale 1 exactly, codes w + 8, no qzeros.
        row = np.array([(k % 15) - 7 for k in range(64)], dtype=np.float32)
        w = np.repeat(row[None, :], 8, axis=0)
        tensors, dequant = qc.awq_quantize(w, 64, False)
        self.assertNotIn("qzeros", tensors)
        self.assertEqual(float(tensors["scales"][0, 0]), 1.0)
        np.testing.assert_array_equal(qc.awq_unpack(tensors["qweight"]).T, (w + 8).astype(np.uint8))
        np.testing.assert_array_equal(dequant, w)

    def test_e2m1_table_and_ties_to_even(self):
        cases = {0.0: 0, 0.25: 0, 0.26: 1, 0.5: 1, 0.75: 2, 1.0: 2, 1.25: 2, 1.5: 3, 1.75: 4,
                 2.5: 4, 2.6: 5, 3.0: 5, 3.5: 6, 5.0: 6, 5.1: 7, 6.0: 7,
                 -0.1: 8, -0.5: 9, -6.0: 15, -3.5: 14}
        for value, code in cases.items():
            self.assertEqual(int(qc.e2m1_encode(np.float32(value))), code, value)
        codes = np.arange(16, dtype=np.uint8)
        self.assertEqual(list(qc.e2m1_decode(codes)),
                         [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
        np.testing.assert_array_equal(qc.e2m1_encode(qc.e2m1_decode(codes[1:8])), codes[1:8])
        np.testing.assert_array_equal(qc.e2m1_encode(qc.e2m1_decode(codes[9:])), codes[9:])

    def test_e4m3_all_codes_round_trip(self):
        codes = np.arange(256, dtype=np.uint8)
        values = qc.e4m3_decode(codes)
        self.assertTrue(np.isnan(values[0x7F]) and np.isnan(values[0xFF]))
        finite = ~np.isnan(values)
        self.assertEqual(int(finite.sum()), 254)
        np.testing.assert_array_equal(qc.e4m3_encode(values[finite]), codes[finite])
        # Hand-checked codes: max, 1, the smallest subnormal, the smallest normal, 0.125.
        for value, code in {448.0: 0x7E, 1.0: 0x38, 2.0 ** -9: 0x01, 2.0 ** -6: 0x08,
                            0.125: 0x20, -448.0: 0xFE, 0.0: 0x00}.items():
            self.assertEqual(float(values[code]), value)
        # Ties go to the even mantissa: 1.0625 -> 1.0, 1.1875 -> 1.25, 2^-10 -> 0.
        for value, code in {1.0625: 0x38, 1.1875: 0x3A, 2.0 ** -10: 0x00, 3 * 2.0 ** -10: 0x02}.items():
            self.assertEqual(int(qc.e4m3_encode(np.float32(value))), code, value)

    def test_nvfp4_group_with_known_amax(self):
        # Tensor amax 6: global 448 * 6 / 6 = 448; a group with amax 6 has the scale 448 (0x7E) and
        # the effective scale 1, so the E2M1 values are stored as they are.
        row = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, 0], np.float32)
        half = row / 2  # amax 3: scale 448 * 3 / 6 = 224 (0x76), effective 0.5
        w = np.stack([row, half])
        g = qc.nvfp4_global_scale(w, "F32")
        self.assertEqual(g, np.float32(448.0))
        tensors, dequant = qc.nvfp4_quantize(w, g, "F32")
        self.assertEqual(list(tensors["weight_scale"][:, 0]), [0x7E, 0x76])
        codes = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]
        expected_bytes = [codes[2 * j] | codes[2 * j + 1] << 4 for j in range(8)]
        self.assertEqual(list(tensors["weight_packed"][0]), expected_bytes)
        self.assertEqual(list(tensors["weight_packed"][1]), expected_bytes)
        np.testing.assert_array_equal(dequant, w)
        self.assertEqual(tensors["weight_global_scale"].tolist(), [448.0])

    def test_nvfp4_zero_group_gets_the_smallest_scale(self):
        w = np.zeros((1, 32), np.float32)
        w[0, 20] = 6.0  # group 1 only
        tensors, dequant = qc.nvfp4_quantize(w, qc.nvfp4_global_scale(w, "F32"), "F32")
        self.assertEqual(list(tensors["weight_scale"][0]), [0x20, 0x7E])
        np.testing.assert_array_equal(dequant, w)

    def test_fp8_block_with_known_amax_and_partial_blocks(self):
        # 40 x 40 in blocks of 32: the scales are [2, 2], the last row and column of blocks partial.
        w = np.zeros((40, 40), np.float32)
        w[0, 0], w[1, 1] = 448.0, -1.0        # block (0, 0): amax 448, scale 1
        w[35, 38], w[39, 33] = 0.875, 0.4375  # block (1, 1): amax 0.875, scale 1 / 512
        w[3, 36] = 3.0                         # block (0, 1): amax 3
        tensors, dequant = qc.fp8_block_quantize(w, 32)
        scale_inv = tensors["weight_scale_inv"]
        self.assertEqual(scale_inv.shape, (2, 2))
        self.assertEqual(scale_inv[0, 0], 1.0)
        self.assertEqual(scale_inv[1, 1], np.float32(1.0) / np.float32(512.0))
        self.assertEqual(scale_inv[1, 0], 1.0)  # an all-zero block
        self.assertEqual(tensors["weight"][0, 0], 0x7E)
        self.assertEqual(tensors["weight"][35, 38], 0x7E)  # 0.875 * 512 = 448
        self.assertEqual(tensors["weight"][39, 33], 0x76)  # 224
        np.testing.assert_array_equal(dequant, w)


@unittest.skipIf(np is None, "numpy missing")
class Checkpoints(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        rng = np.random.default_rng(3)
        bf16 = lambda *shape: qc.round_to_bf16(rng.standard_normal(shape).astype(np.float32) * 0.1)
        n_experts, inter, hidden = 2, 32, 32
        self.gate_up = bf16(n_experts, 2 * inter, hidden)
        self.tensors = {
            "model.embed_tokens.weight": ("BF16", bf16(8, hidden)),
            "lm_head.weight": ("BF16", bf16(8, hidden)),
            "model.layers.0.input_layernorm.weight": ("BF16", bf16(hidden)),
            "model.layers.0.self_attn.q_proj.weight": ("BF16", bf16(32, hidden)),
            "model.layers.0.self_attn.k_proj.weight": ("BF16", bf16(16, hidden)),
            "model.layers.0.self_attn.v_proj.weight": ("BF16", bf16(16, hidden)),
            "model.layers.0.self_attn.o_proj.weight": ("BF16", bf16(hidden, 32)),
            "model.layers.0.mlp.gate.weight": ("BF16", bf16(n_experts, hidden)),
            "model.layers.0.mlp.experts.gate_up_proj": ("BF16", self.gate_up),
            "model.layers.0.mlp.experts.down_proj": ("BF16", bf16(n_experts, hidden, inter)),
        }
        self.src = os.path.join(self.dir, "src")
        write_f32_checkpoint(self.src, self.tensors, {"model_type": "test", "hidden_size": hidden})

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_refuses_a_non_empty_out_dir_and_leaves_everything_alone(self):
        out = os.path.join(self.dir, "out")
        os.makedirs(out)
        with open(os.path.join(out, "keep.txt"), "w") as f:
            f.write("user data")
        before = tree_digest(self.src)
        result = self.run_script(self.src, out, "--format", "awq", "--group-size", "32")
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("quantize_checkpoint.py: error: OUT_DIR", result.stderr)
        self.assertIn("not an empty directory", result.stderr)
        self.assertEqual(os.listdir(out), ["keep.txt"])
        self.assertEqual(tree_digest(self.src), before)
        # An OUT_DIR inside SRC_DIR is refused too.
        result = self.run_script(self.src, os.path.join(self.src, "q"), "--format", "nvfp4")
        self.assertEqual(result.returncode, 1)
        self.assertEqual(tree_digest(self.src), before)

    def test_flag_misuse_exits_2(self):
        out = os.path.join(self.dir, "out")
        self.assertEqual(self.run_script(self.src, out, "--format", "nvfp4", "--block", "32").returncode, 2)
        self.assertFalse(os.path.exists(out))

    def test_awq_splits_stacked_experts_and_dequantizes_exactly(self):
        out, deq = os.path.join(self.dir, "q"), os.path.join(self.dir, "d")
        before = tree_digest(self.src)
        result = self.run_script(self.src, out, "--format", "awq", "--group-size", "32",
                                 "--dequantized-out", deq)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(tree_digest(self.src), before)
        q = read_safetensors(os.path.join(out, "model.safetensors"))
        d = read_safetensors(os.path.join(deq, "model.safetensors"))
        config = read_json(os.path.join(out, "config.json"))["quantization_config"]
        self.assertEqual(config["quant_method"], "awq")
        self.assertEqual(config["modules_to_not_convert"], ["lm_head", "model.layers.0.mlp.gate"])
        self.assertTrue(os.path.exists(os.path.join(out, "tokenizer.json")))
        # Per-expert modules, AWQ tensors [in, out / 8], [in / G, out / 8], [in / G, out].
        prefix = "model.layers.0.mlp.experts.1."
        self.assertEqual(q[prefix + "gate_proj.qweight"][:2], ("I32", [32, 4]))
        self.assertEqual(q[prefix + "up_proj.qzeros"][:2], ("I32", [1, 4]))
        self.assertEqual(q[prefix + "down_proj.scales"][:2], ("F16", [1, 32]))
        self.assertNotIn("model.layers.0.mlp.experts.gate_up_proj", q)
        self.assertEqual(q["model.layers.0.mlp.gate.weight"], d["model.layers.0.mlp.gate.weight"])
        # The dequantized checkpoint keeps the stacked tensor; expert 1's up rows are the
        # dequantization of the stored codes, computed here from the packed bytes.
        dtype, shape, raw = d["model.layers.0.mlp.experts.gate_up_proj"]
        self.assertEqual((dtype, shape), ("F16", [2, 64, 32]))
        stacked = np.frombuffer(raw, "<f2").reshape(shape).astype(np.float32)
        codes = np.frombuffer(q[prefix + "up_proj.qweight"][2], "<u4").reshape(32, 4)
        zeros = np.frombuffer(q[prefix + "up_proj.qzeros"][2], "<u4").reshape(1, 4)
        scales = np.frombuffer(q[prefix + "up_proj.scales"][2], "<f2").reshape(1, 32)
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        for out_col in range(32):
            word, nibble = out_col // 8, order.index(out_col % 8)
            zero = (int(zeros[0, word]) >> (4 * nibble)) & 15
            for k in range(32):
                code = (int(codes[k, word]) >> (4 * nibble)) & 15
                expected = np.float16((code - zero) * np.float32(scales[0, out_col]))
                self.assertEqual(stacked[1, 32 + out_col, k], np.float32(expected))
        # Quantization error stays within half a step.
        up = self.gate_up[1, 32:]
        step = scales[0].astype(np.float32)[:, None]
        self.assertTrue((np.abs(stacked[1, 32:] - up) <= step * 0.5 + 1e-3).all())

    def test_nvfp4_fuses_qkv_global_scales_and_output_is_deterministic(self):
        outs = []
        for run in range(2):
            out = os.path.join(self.dir, f"q{run}")
            deq = os.path.join(self.dir, f"d{run}")
            result = self.run_script(self.src, out, "--format", "nvfp4", "--dequantized-out", deq)
            self.assertEqual(result.returncode, 0, result.stderr)
            outs.append((tree_digest(out), tree_digest(deq)))
        self.assertEqual(outs[0], outs[1])
        q = read_safetensors(os.path.join(self.dir, "q0", "model.safetensors"))
        globals_ = {p: np.frombuffer(q[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"][2], "<f4")[0]
                    for p in "qkvo"}
        self.assertEqual(globals_["q"], globals_["k"])
        self.assertEqual(globals_["k"], globals_["v"])
        own = {p: qc.nvfp4_global_scale(self.tensors[f"model.layers.0.self_attn.{p}_proj.weight"][1], "BF16")
               for p in "qkv"}
        self.assertEqual(globals_["q"], min(own.values()))
        self.assertEqual(q["model.layers.0.self_attn.q_proj.weight_packed"][:2], ("U8", [32, 16]))
        self.assertEqual(q["model.layers.0.self_attn.q_proj.weight_scale"][:2], ("F8_E4M3", [32, 2]))
        config = read_json(os.path.join(self.dir, "q0", "config.json"))["quantization_config"]
        self.assertEqual(config["ignore"], ["lm_head", "model.layers.0.mlp.gate"])
        self.assertEqual(config["format"], "nvfp4-pack-quantized")


def main():
    if np is None:
        print("SKIP: numpy missing: install python3-numpy (scripts/setup.sh does)")
        return 77
    program = unittest.main(module=__name__, exit=False)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
