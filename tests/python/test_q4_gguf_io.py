"""routemm.gguf_tensor: Q4_0 / F32 / F16 / BF16 tensors of a GGUF file written by gguf.GGUFWriter
come back byte for byte (Q4_0 as raw U8 blocks, zero copy on the CPU backend), and a loaded Q4_0
weight feeds quantized_matmul_ggml directly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm import DType, q4_0
from support import Q4_BASE_PIPELINES
from tolerances import q4_cuda_default_bound

# The Q4_0 pipelines exist on the CPU backend; other backends gain them later.
pytestmark = pytest.mark.needs_kernels(*Q4_BASE_PIPELINES)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture
def gguf_file(tmp_path, rng):
    w = rng.uniform(-1, 1, (40, 96)).astype(np.float32)
    tensors = {
        "blk.0.ffn_up.weight": (gguf.quants.quantize(w, Q.Q4_0), Q.Q4_0),
        "blk.0.norm.weight": (rng.standard_normal(96).astype(np.float32), None),
        "token_embd.weight": (rng.standard_normal((3, 5, 8)).astype(np.float32), None),
        "output.weight": (rng.standard_normal((7, 33)).astype(np.float16), None),
        "blk.0.attn_q.weight": (rng.standard_normal((6, 10)).astype(ml_dtypes.bfloat16).view(np.uint16), Q.BF16),
    }
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_string("general.name", "routemm-q4-test")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tensors, w


def test_q4_0_tensor_round_trip(gguf_file, device):
    path, tensors, _ = gguf_file
    blocks = tensors["blk.0.ffn_up.weight"][0]
    buf = routemm.gguf_tensor(path, "blk.0.ffn_up.weight", device=device)
    assert buf.dtype == DType.U8 and buf.shape == (40, 96 // 32 * 18)
    np.testing.assert_array_equal(buf.numpy(), blocks)
    # Same bytes as the gguf package's own reader.
    reader = gguf.GGUFReader(str(path))
    (t,) = [t for t in reader.tensors if t.name == "blk.0.ffn_up.weight"]
    np.testing.assert_array_equal(buf.numpy(), np.asarray(t.data))


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("blk.0.norm.weight", DType.F32),
        ("token_embd.weight", DType.F32),
        ("output.weight", DType.F16),
        ("blk.0.attn_q.weight", DType.BF16),
    ],
)
def test_float_tensor_round_trip(gguf_file, device, name, dtype):
    path, tensors, _ = gguf_file
    data = tensors[name][0]
    buf = routemm.gguf_tensor(path, name, device=device)
    assert buf.dtype == dtype and buf.shape == data.shape
    np.testing.assert_array_equal(buf.numpy().view(np.uint8).reshape(-1), data.view(np.uint8).reshape(-1))


def test_cpu_load_is_zero_copy_and_read_only(gguf_file):
    path, _, _ = gguf_file
    buf = routemm.gguf_tensor(path, "blk.0.ffn_up.weight", device=routemm.Device("cpu"))
    assert not buf.writable


def test_loaded_weight_feeds_the_matmul(gguf_file, device, rng):
    path, tensors, _ = gguf_file
    weight = routemm.gguf_tensor(path, "blk.0.ffn_up.weight", device=device)
    w = q4_0.dequantize(tensors["blk.0.ffn_up.weight"][0]).astype(np.float64)
    for m in (3, 20):
        x = rng.uniform(-1, 1, (m, 96)).astype(np.float32)
        out = device.alloc(m * 40 * 4, DType.F32, [m, 40])
        encoder = device.command_encoder()
        routemm.quantized_matmul_ggml(
            encoder,
            routemm.KernelRegistry(device),
            device.from_numpy(x),
            weight,
            out,
            routemm.GgmlQuantizedMatmulParams(m, 40, 96),
            routemm.GgmlRoutingPolicy(),
        )
        encoder.commit_and_wait()
        exact = x.astype(np.float64) @ w.T
        if device.backend == "cuda":
            assert np.all(np.abs(out.numpy() - exact) <= q4_cuda_default_bound(m, 96, np.abs(x) @ np.abs(w).T))
        else:
            np.testing.assert_allclose(out.numpy(), exact, atol=1e-4, rtol=1e-4)


def test_missing_and_bad_inputs(gguf_file, tmp_path, device):
    path, _, _ = gguf_file
    with pytest.raises(routemm.InvalidArgumentError, match="no tensor 'nope'"):
        routemm.gguf_tensor(path, "nope", device=device)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" * 4)
    with pytest.raises(routemm.InvalidArgumentError, match="not a GGUF file"):
        routemm.gguf_tensor(bad, "x", device=device)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:40])
    with pytest.raises(routemm.InvalidArgumentError, match="truncated"):
        routemm.gguf_tensor(truncated, "blk.0.ffn_up.weight", device=device)
