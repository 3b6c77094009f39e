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


def _gguf_has_quantizer(name: str) -> bool:
    try:
        quants.quantize(np.zeros((1, FORMATS[name].block_values), np.float32), TYPES[name])
    except NotImplementedError:
        return False
    return True


# The gguf package quantises the 32-value formats; the K-quants' quantisers are checked against
# digests of ggml's own output below (bench/peer/ggml_quant_check.py compares them row by row).
GGUF_QUANTIZED = [name for name in QUANTIZED if _gguf_has_quantizer(name)]
K_QUANTS = ("q4_k", "q5_k", "q6_k")


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


@pytest.mark.parametrize("name", GGUF_QUANTIZED)
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


def _golden_rows() -> np.ndarray:
    """Eight 256-value rows made by exact arithmetic only (a 64-bit LCG's top bits, scaled by powers
    of two), so they are the same on every platform: a plain row, negative-only, constant, half
    zero, tiny (2^-60), huge (2^50), one outlier, every other value zero."""
    a, c = np.uint64(6364136223846793005), np.uint64(1442695040888963407)
    state, seq = np.uint64(0x9E3779B97F4A7C15), np.empty(8 * 256, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(seq.size):
            state = state * a + c
            seq[i] = state
    rows = (((seq >> np.uint64(40)).astype(np.float32) - np.float32(2**23)) * np.float32(2.0**-21)).reshape(8, 256)
    rows[1] = -np.abs(rows[1])
    rows[2] = rows[2, 0]
    rows[3, :128] = 0
    rows[4] *= np.float32(2.0**-60)
    rows[5] *= np.float32(2.0**50)
    rows[6, 17] = 4096.0
    rows[7, ::2] = 0
    return rows


# SHA-256 of ggml's quantize_row_<type>_ref over _golden_rows() (ggml 0.25.3, llama.cpp 0c1e570,
# as vendored by the llama-cpp-python 0.3.36 sdist).
GGML_K_QUANT_DIGESTS = {
    "q4_k": "ba8afd60bda04b99fc78e604b1b5a3628f575cf969fc6bff405a9cfd453ac73c",
    "q5_k": "45fe12f0f72181d984d5718d0cf9774f8338d1b3ef6b436731d24aee28b47308",
    "q6_k": "db3f445108e694c10fceeabdfc17329b03a9feefea82cad97cc214db87cc972c",
}


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_quantize_matches_ggml_bytes(name):
    import hashlib

    got = routemm.quantize(_golden_rows(), name)
    assert got.shape == (8, FORMATS[name].block_bytes)
    assert hashlib.sha256(got.tobytes()).hexdigest() == GGML_K_QUANT_DIGESTS[name]


# Bounds of the K-quant round trip on unit normal rows, a little above what ggml's quantisers give
# (max error / the super-block's max |x|, and RMS error / RMS value: Q4_K 0.076 / 0.071, Q5_K
# 0.046 / 0.036, Q6_K 0.016 / 0.018).
K_ROUND_TRIP_BOUNDS = {"q4_k": (0.09, 0.08), "q5_k": (0.055, 0.042), "q6_k": (0.02, 0.021)}


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_round_trip(name):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    blocks = routemm.quantize(x, name)
    y = routemm.dequantize(blocks, name)
    assert np.array_equal(y, quants.dequantize(blocks, TYPES[name]).astype(np.float32))
    max_bound, rms_bound = K_ROUND_TRIP_BOUNDS[name]
    per_block = np.abs(y - x).reshape(-1, 256).max(axis=1) / np.abs(x).reshape(-1, 256).max(axis=1)
    assert per_block.max() < max_bound
    assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)) < rms_bound
    assert not routemm.quantize(np.zeros((2, 256), np.float32), name).any()  # zeros: every byte zero
    for value in (0.37, -0.37, 3.0):  # a constant row comes back within its binary16 scale's rounding
        const = np.full((1, 256), value, np.float32)
        back = routemm.dequantize(routemm.quantize(const, name), name)
        assert np.abs(back - const).max() <= 5e-4 * abs(value)


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
