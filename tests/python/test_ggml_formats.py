"""The GGML block formats' reference codecs (routemm.quantize / routemm.dequantize over the core's
one table): every format's dequantiser bit-identical to the `gguf` package's (ggml's to_float
semantics) on random blocks, and every reference quantiser byte-identical to `gguf.quants.quantize`;
shapes along the last axis, and refusals by name."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm.formats.ggml import FORMATS

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

TYPES = {
    "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0,
    "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "mxfp4": Q.MXFP4,
}  # fmt: skip
QUANTIZED = [name for name, f in FORMATS.items() if f.has_quantizer]


def _random_blocks(name: str, blocks: int, seed: int) -> np.ndarray:
    """Random block bytes whose binary16 scales are finite and small (E8M0 exponents in range):
    random codes, random scales, so every bit of every field is exercised."""
    f = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (blocks, f.block_bytes), dtype=np.uint8)
    scales = rng.uniform(-2.0, 2.0, (blocks, 2)).astype(np.float16).view(np.uint8).reshape(blocks, 4)
    if name == "mxfp4":
        raw[:, 0] = rng.integers(100, 150, blocks)
    elif name == "q6_k":
        raw[:, 208:210] = scales[:, :2]
    elif name in ("q4_1", "q5_1", "q4_k", "q5_k"):
        raw[:, :4] = scales
    else:
        raw[:, :2] = scales[:, :2]
    return raw


def test_the_table_names_every_format():
    assert list(FORMATS) == list(TYPES)
    for name, f in FORMATS.items():
        assert (f.block_values, f.block_bytes) == quants.GGML_QUANT_SIZES[TYPES[name]], name
        assert routemm.GgmlType(name).block_layout == (f.block_values, f.block_bytes)


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_is_bit_identical_to_gguf(name):
    blocks = _random_blocks(name, 64, seed=1)
    got = routemm.dequantize(blocks.reshape(4, -1), name)
    want = quants.dequantize(blocks.reshape(4, -1), TYPES[name]).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantize_is_byte_identical_to_gguf(name):
    f = FORMATS[name]
    rng = np.random.default_rng(2)
    values = rng.standard_normal((3, 8 * f.block_values)).astype(np.float32)
    values[0, : f.block_values] = 0.0  # an all-zero block
    values[1, 5] = 40.0  # an outlier
    got = routemm.quantize(values, name)
    want = quants.quantize(values, TYPES[name])
    assert got.dtype == np.uint8 and np.array_equal(got, want), name
    assert np.array_equal(routemm.dequantize(got, routemm.GgmlType(name)), quants.dequantize(want, TYPES[name]))


@pytest.mark.parametrize("name", [n for n in TYPES if n not in QUANTIZED])
def test_k_quant_quantize_is_refused_by_name(name):
    with pytest.raises(routemm.InvalidArgumentError, match=f"{name} quantize: routemm has no reference quantiser"):
        routemm.quantize(np.zeros((1, 256), np.float32), name)


def test_refusals_name_the_argument():
    with pytest.raises(routemm.InvalidArgumentError, match="ggml_type must be one of q4_0, q4_1"):
        routemm.dequantize(np.zeros(18, np.uint8), "q3_k")
    with pytest.raises(routemm.InvalidArgumentError, match="ggml_type must be one of"):
        routemm.quantize(np.zeros(32, np.float32), 4)
    with pytest.raises(routemm.InvalidArgumentError, match="q4_k: the last dimension must be a multiple of 256"):
        routemm.quantize(np.zeros((2, 32), np.float32), "q4_k")
    with pytest.raises(
        routemm.InvalidArgumentError, match="mxfp4 dequantize: the last dimension must be a multiple of 17"
    ):
        routemm.dequantize(np.zeros(18, np.uint8), routemm.GgmlType.MXFP4)


def test_gguf_tensors_of_every_format_load_as_their_blocks(tmp_path):
    """A GGUF file (written by the gguf package) holding a tensor of every block format: each loads as
    its raw blocks, and routemm.dequantize of them equals the gguf reader's dequantised tensor."""
    path = tmp_path / "formats.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    stored = {}
    for i, name in enumerate(TYPES):
        f = FORMATS[name]
        blocks = _random_blocks(name, 6, seed=10 + i).reshape(3, 2 * f.block_bytes)  # [3 rows, 2 blocks]
        stored[name] = blocks
        writer.add_tensor(f"t.{name}", blocks, raw_dtype=TYPES[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    read = {t.name: t for t in reader.tensors}
    for name, blocks in stored.items():
        f = FORMATS[name]
        buf = routemm.gguf_tensor(path, f"t.{name}", device=routemm.Device("cpu"))
        got = buf.numpy()
        assert got.dtype == np.uint8 and np.array_equal(got, blocks), name
        assert routemm.gguf_io.gguf_tensor_type(path, f"t.{name}") == name
        values = routemm.dequantize(got, name)
        assert values.shape == (3, 2 * f.block_values)
        want = quants.dequantize(read[f"t.{name}"].data, TYPES[name]).reshape(values.shape)
        assert np.array_equal(values.view(np.uint32), want.astype(np.float32).view(np.uint32)), name
