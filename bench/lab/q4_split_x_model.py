"""A model of the one-token Q4_0 mat-vec's activation split (`split_x` in
csrc/backend/cuda/q4_matvec_rows.cuh) before and after 21b50b0, lane by lane: the shared-memory
bytes of a warp's quad slice must be identical, and each 8-byte store of the new form must hit every
bank exactly twice. Record: bench/lab/records/q4_0_matvec_split_x-2026-12-06.md.

    python3 bench/lab/q4_split_x_model.py
"""

from __future__ import annotations

import numpy as np

QUAD_BYTES = 128  # one token's 4 hi and 4 lo quads of a block


def _hi_pair(x0: np.float32, x1: np.float32) -> int:
    """__byte_perm(x0, x1, 0x7632): the top 16 bits of each value (bf16 truncation)."""
    return int(x0.view(np.uint32)) >> 16 | (int(x1.view(np.uint32)) >> 16) << 16


def _bf16_rn(f: np.float32) -> int:
    u = int(np.float32(f).view(np.uint32))
    return (u + 0x7FFF + (u >> 16 & 1)) >> 16  # finite values: round to nearest even


def _lo_pair(x0: np.float32, x1: np.float32) -> int:
    def rest(x):
        return np.float32(x - np.uint32(int(x.view(np.uint32)) & 0xFFFF0000).view(np.float32))

    return _bf16_rn(rest(x0)) | _bf16_rn(rest(x1)) << 16


def _split(values) -> tuple[list[int], list[int]]:
    pairs = range(len(values) // 2)
    return [_hi_pair(values[2 * q], values[2 * q + 1]) for q in pairs], [
        _lo_pair(values[2 * q], values[2 * q + 1]) for q in pairs
    ]


def _store(mem: np.ndarray, address: int, words: list[int]) -> None:
    mem[address : address + 4 * len(words)] = np.array(words, np.uint32).view(np.uint8)


def quad_slice(tokens: int, x_loads: int, new: bool, seed: int) -> np.ndarray:
    """The warp's quad slice after split_x (old: partner exchange, one 16-byte store per lane)."""
    block_bytes = tokens * QUAD_BYTES
    mem = np.zeros(4 * x_loads * block_bytes, np.uint8)
    xv = np.random.default_rng(seed).standard_normal((32, tokens, x_loads, 4)).astype(np.float32) * 3
    for tok in range(tokens):
        for q in range(x_loads):
            for lane in range(32):
                c, own = lane & 7, xv[lane, tok, q]
                base = (4 * q + (lane >> 3)) * block_bytes + tok * QUAD_BYTES
                if new:
                    hi, lo = _split(own)
                    quad = base + 16 * (c & 3) + 8 * (c >> 2)
                    hi_first = ((c >> 2) ^ (lane >> 3)) & 1
                    _store(mem, quad + (0 if hi_first else 64), hi if hi_first else lo)
                    _store(mem, quad + (64 if hi_first else 0), lo if hi_first else hi)
                else:
                    other, low_half = xv[lane ^ 4, tok, q], (lane & 4) == 0
                    hi, lo = _split(np.concatenate([own, other] if low_half else [other, own]))
                    _store(mem, base + 16 * c, hi if low_half else lo)
    return mem


def store_bank_hits(tokens: int, tok: int, second: bool) -> set[int]:
    """How often each of the 32 banks is hit by one 8-byte store instruction of the new form."""
    hits = np.zeros(32, int)
    for lane in range(32):
        c = lane & 7
        quad = (lane >> 3) * tokens * QUAD_BYTES + tok * QUAD_BYTES + 16 * (c & 3) + 8 * (c >> 2)
        hi_first = ((c >> 2) ^ (lane >> 3)) & 1
        address = quad + (64 if bool(hi_first) == second else 0)
        for word in range(2):
            hits[(address // 4 + word) % 32] += 1
    return set(hits.tolist())


def main() -> int:
    for tokens in (1, 2, 4):
        for x_loads in (2, 4):
            old = quad_slice(tokens, x_loads, False, 10 * tokens + x_loads)
            new = quad_slice(tokens, x_loads, True, 10 * tokens + x_loads)
            assert np.array_equal(old, new), (tokens, x_loads)
            assert (old.view(np.uint32) != 0).all(), (tokens, x_loads)
            for tok in range(tokens):
                for second in (False, True):
                    assert store_bank_hits(tokens, tok, second) == {2}, (tokens, tok, second)
    print("split_x: identical bytes; every store hits each bank twice")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
