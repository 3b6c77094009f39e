"""GGML block stacks dequantised with torch operations, on the blocks' own device: no copy to the
host, no host read, so it runs inside a CUDA graph and under torch.compile. Every value is the F32
that routemm.formats.ggml.dequantize (ggml's to_float, routemm/ggml_formats.h) gives, bit for bit
in eager mode: each format does that dequantiser's F32 operations in its order, one rounding per
operation (codes and small integers become floats exactly). The gradients of the MoE block through
block stacks (_moe_autograd) take their experts' weights from here, one expert at a time.
"""

from __future__ import annotations

import torch

from ..core._errors import InvalidArgumentError
from ..formats.ggml import block_format

# MXFP4's E2M1 values doubled (integers), by 4-bit code; the block scale is halved to match.
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _half(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian binary16 at byte `offset` of every block, as F32 [N, 1] (exact)."""
    return b[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, 16] bytes -> [N, 32] codes: the low nibbles (values 0..15), then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _bits32(b: torch.Tensor, offset: int) -> torch.Tensor:
    """Bit j (j < 32) of the little-endian 32-bit word at `offset`, as [N, 32] int32."""
    word = b[:, offset : offset + 4].to(torch.int64)
    word = word[:, 0] | (word[:, 1] << 8) | (word[:, 2] << 16) | (word[:, 3] << 24)
    shifts = torch.arange(32, device=b.device, dtype=torch.int64)
    return ((word[:, None] >> shifts) & 1).to(torch.int32)


def _k4_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's eight 6-bit scales and mins (ggml's get_scale_min_k4), as F32 [N, 8]."""
    s = b[:, 4:16].to(torch.int32)
    low_sc, low_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((low_sc, high_sc), dim=1).float(), torch.cat((low_m, high_m), dim=1).float()


def _q4_0(b):
    return _half(b, 0) * (_nibbles(b[:, 2:18]).float() - 8.0)


def _q8_0(b):
    return _half(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_1(b):
    return _nibbles(b[:, 4:20]).float() * _half(b, 0) + _half(b, 2)


def _q5_0(b):
    codes = _nibbles(b[:, 6:22]).to(torch.int32) | (_bits32(b, 2) << 4)
    return (codes - 16).float() * _half(b, 0)


def _q5_1(b):
    codes = _nibbles(b[:, 8:24]).to(torch.int32) | (_bits32(b, 4) << 4)
    return codes.float() * _half(b, 0) + _half(b, 2)


def _mxfp4(b):
    e = b[:, 0:1].to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)
    return values[_nibbles(b[:, 1:17]).to(torch.int64)] * d


def _k_quant(b, high_bits: bool):
    """Q4_K (high_bits False) / Q5_K: y = d1 * code - m1 per 32-value sub-block, d1 = d * sc and
    m1 = dmin * m; sub-blocks 2c and 2c + 1 are the low and high nibbles of 32 bytes c."""
    sc, m = _k4_scales_mins(b)
    d1, m1 = _half(b, 0) * sc, _half(b, 2) * m
    qs = b[:, 48:176] if high_bits else b[:, 16:144]
    qs = qs.reshape(-1, 4, 32)
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32).to(torch.int32)
    if high_bits:  # bit `sub` of qh[l] is the fifth bit of sub-block sub's value l
        qh = b[:, 16:48].to(torch.int32)
        subs = torch.arange(8, device=b.device, dtype=torch.int32)
        codes = codes | (((qh[:, None, :] >> subs[None, :, None]) & 1) << 4)
    return (d1[:, :, None] * codes.float() - m1[:, :, None]).reshape(-1, 256)


def _q6_k(b):
    """y = (d * sc) * (code - 32), sc the int8 scale of each 16 values; half h (128 values): value
    32t + l takes ql[64h + 32 (t % 2) + l]'s low (t < 2) or high nibble and bits 2t, 2t + 1 of
    qh[32h + l]."""
    ql = b[:, 0:128].reshape(-1, 2, 2, 32).to(torch.int32)  # [N, half, t % 2, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)  # [N, half, ., l]
    low = torch.stack((ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4), dim=2)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.int32)[None, None, :, None]
    codes = low | (((qh >> shifts) & 3) << 4)  # [N, half, t, l]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16], one per 16 values
    ds = (_half(b, 208) * scales).repeat_interleave(16, dim=1)
    return ds * (codes.reshape(-1, 256) - 32).float()


_DECODERS = {
    "q4_0": _q4_0,
    "q8_0": _q8_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "mxfp4": _mxfp4,
    "q4_k": lambda b: _k_quant(b, False),
    "q5_k": lambda b: _k_quant(b, True),
    "q6_k": _q6_k,
}


def dequantize(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """uint8 blocks [..., r * block_bytes] of `ggml_type` (a ggml_type value: 'q4_0', 'q6_k', ...)
    -> float32 [..., r * block_values] on the same device."""
    if ggml_type not in _DECODERS:
        raise InvalidArgumentError(f"dequantize: unknown ggml_type {ggml_type!r}; one of {sorted(_DECODERS)}")
    if blocks.dtype != torch.uint8:
        raise InvalidArgumentError(f"{ggml_type} dequantize: blocks must be uint8, got {blocks.dtype}")
    fmt = block_format(ggml_type)
    values, size = fmt.block_values, fmt.block_bytes
    if blocks.dim() == 0 or blocks.shape[-1] % size != 0:
        raise InvalidArgumentError(
            f"{ggml_type} dequantize: the last dimension must be a multiple of {size} bytes, "
            f"got shape {tuple(blocks.shape)}"
        )
    lead = tuple(blocks.shape[:-1])
    per_row = blocks.shape[-1] // size
    flat = blocks.contiguous().reshape(-1, size)
    return _DECODERS[ggml_type](flat).reshape(*lead, per_row * values)
