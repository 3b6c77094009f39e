"""The GGML block formats dequantised with torch operations (routemm.integrations._ggml_torch, the
weights of the MoE block's gradients through block stacks): every format's values bit for bit those
of the reference dequantiser (routemm.formats.ggml.dequantize, ggml's to_float) on random bytes,
with every binary16 field random (subnormals, infinities and NaNs included) and MXFP4's subnormal
exponents, on the CPU and, where torch has one, on a CUDA device; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm.formats import ggml

torch = pytest.importorskip("torch")
from routemm.integrations._ggml_torch import dequantize  # noqa: E402
from torch_devices import have_torch_cuda  # noqa: E402

# binary16 fields' byte offsets in a block
HALVES = {
    "q4_0": (0,), "q8_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "mxfp4": (),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}  # fmt: skip
DEVICES = ["cpu"] + (["cuda"] if have_torch_cuda() else [])


def _random_blocks(ggml_type: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    fmt = ggml.block_format(ggml_type)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    if ggml_type == "mxfp4":
        raw[..., 0] = rng.choice(np.array([0, 1, 2, 127, 128, 254, 255], np.uint8), raw.shape[:2])
    for offset in HALVES[ggml_type]:
        # Mostly finite normal values; every eighth field any bits at all (subnormal, inf, NaN).
        bits = (rng.integers(1, 30, raw.shape[:2]) << 10) | rng.integers(0, 1024, raw.shape[:2])
        bits |= rng.integers(0, 2, raw.shape[:2]) << 15
        wild = rng.random(raw.shape[:2]) < 0.125
        bits = np.where(wild, rng.integers(0, 65536, raw.shape[:2]), bits).astype(np.uint16)
        raw[..., offset : offset + 2] = bits.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ggml_type", sorted(HALVES))
def test_torch_dequantize_is_the_reference_bit_for_bit(ggml_type, device):
    raw = _random_blocks(ggml_type, 5, 6, seed=sorted(HALVES).index(ggml_type))
    want = ggml.dequantize(raw, ggml_type)
    got = dequantize(torch.from_numpy(raw).to(device), ggml_type)
    assert got.dtype == torch.float32 and got.device.type == device and tuple(got.shape) == want.shape
    got = got.cpu().numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_torch_dequantize_keeps_leading_dimensions():
    raw = _random_blocks("q4_k", 6, 2, seed=9).reshape(2, 3, -1)
    got = dequantize(torch.from_numpy(raw), "q4_k")
    assert tuple(got.shape) == (2, 3, 512)
    np.testing.assert_array_equal(got.numpy(), ggml.dequantize(raw, "q4_k"))


def test_torch_dequantize_refuses_bad_input():
    with pytest.raises(routemm.InvalidArgumentError, match="unknown ggml_type"):
        dequantize(torch.zeros((1, 18), dtype=torch.uint8), "q3_k")
    with pytest.raises(routemm.InvalidArgumentError, match="must be uint8"):
        dequantize(torch.zeros((1, 18), dtype=torch.int8), "q4_0")
    with pytest.raises(routemm.InvalidArgumentError, match="multiple of 144 bytes"):
        dequantize(torch.zeros((1, 145), dtype=torch.uint8), "q4_k")
