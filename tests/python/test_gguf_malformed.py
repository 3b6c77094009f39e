"""gguf_tensor on malformed files: every refusal is a routemm.Error naming the problem (never
ZeroDivisionError, UnicodeDecodeError, OverflowError, numpy's ValueError or RecursionError), and
`copy=True` loads a tensor that no longer depends on the file. MoeLayer.from_gguf refuses each
metadata key it reads given a value of a wrong GGUF type, naming the key."""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
import routemm
from support import (
    GGUF_ARRAY,
    GGUF_BOOL,
    GGUF_F32,
    GGUF_I32,
    GGUF_STRING,
    GGUF_U32,
    GGUF_U64,
    MOE_DEFAULT_META,
    gguf_bytes,
    moe_gguf_bytes,
)

U32, I32, F32_TYPE, STRING, ARRAY = 4, 5, 6, 8, 9


def load(tmp_path, blob, name="t", **kw):
    path = tmp_path / "case.gguf"
    path.write_bytes(blob)
    return routemm.gguf_tensor(path, name, device=routemm.Device("cpu"), **kw)


def test_hand_built_file_loads(tmp_path):
    buf = load(tmp_path, gguf_bytes())
    assert buf.numpy().view(np.uint8).tobytes() == bytes(range(32))


@pytest.mark.parametrize(
    "type_id,value",
    [(U32, struct.pack("<I", 0)), (I32, struct.pack("<i", -1)), (F32_TYPE, struct.pack("<f", 0.5))],
    ids=["zero", "minus-one", "half"],
)
def test_bad_alignment_refused(tmp_path, type_id, value):
    blob = gguf_bytes([("general.alignment", type_id, value)])
    with pytest.raises(routemm.InvalidArgumentError, match="general.alignment .* must be a positive integer"):
        load(tmp_path, blob)


def test_good_alignment_honoured(tmp_path):
    blob = gguf_bytes([("general.alignment", U32, struct.pack("<I", 64))], alignment=64)
    assert load(tmp_path, blob).numpy().view(np.uint8).tobytes() == bytes(range(32))


def test_non_utf8_names_refused(tmp_path):
    with pytest.raises(routemm.InvalidArgumentError, match="not UTF-8"):
        load(tmp_path, gguf_bytes([(b"\xff\xfe", U32, struct.pack("<I", 1))]))
    with pytest.raises(routemm.InvalidArgumentError, match="not UTF-8"):
        load(tmp_path, gguf_bytes(tensors=[(b"\xc3(", [8], 0, 0)], raw_tensor_names=True))


@pytest.mark.parametrize(
    "dims,message",
    [
        ([8, 2**63], "beyond 2\\^63"),
        ([8, 2**64 - 1], "beyond 2\\^63"),
        ([8, 2**62], "beyond 2\\^63 - 1"),  # 2^65 values
        ([8, 2**40], "extends past the end"),
        ([1] * 65, "65 dimensions"),
        ([1] * 5, "5 dimensions"),
    ],
    ids=["2^63", "u64-max", "2^62", "2^40", "65-dims", "5-dims"],
)
def test_impossible_dims_refused(tmp_path, dims, message):
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        load(tmp_path, gguf_bytes(tensors=[("t", dims, 0, 0)]))


def test_dim_count_beyond_the_file_refused_quickly(tmp_path):
    blob = bytearray(gguf_bytes())
    at = blob.index(struct.pack("<Q", 1) + b"t") + 9  # the tensor's dimension count follows its name
    blob[at : at + 4] = struct.pack("<I", 2**32 - 1)
    with pytest.raises(routemm.InvalidArgumentError, match="dimensions"):
        load(tmp_path, bytes(blob))


def test_deeply_nested_metadata_arrays_refused(tmp_path):
    depth = 5000
    value = struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U32, 0)
    with pytest.raises(routemm.InvalidArgumentError, match="nests metadata arrays deeper"):
        load(tmp_path, gguf_bytes([("deep", ARRAY, value)]))


def test_nested_arrays_within_the_limit_load(tmp_path):
    value = struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", STRING, 1) + struct.pack("<Q", 1) + b"a"
    assert load(tmp_path, gguf_bytes([("nested", ARRAY, value)])).nbytes == 32


def test_huge_counts_are_truncation_not_memory(tmp_path):
    for value in (struct.pack("<IQ", U32, 2**63), struct.pack("<Q", 2**64 - 1)):
        kind = ARRAY if len(value) == 12 else STRING
        with pytest.raises(routemm.InvalidArgumentError, match="truncated"):
            load(tmp_path, gguf_bytes([("big", kind, value)]))


def test_copy_is_independent_of_the_file(tmp_path):
    path = tmp_path / "case.gguf"
    path.write_bytes(gguf_bytes())
    mapped = routemm.gguf_tensor(path, "t", device=routemm.Device("cpu"))
    copied = routemm.gguf_tensor(path, "t", device=routemm.Device("cpu"), copy=True)
    assert copied.numpy().tobytes() == mapped.numpy().tobytes()
    blob = bytearray(path.read_bytes())
    blob[-32:] = bytes(32)
    path.write_bytes(blob[:-32])  # truncated and rewritten: only the copy may be touched now
    del mapped
    assert copied.numpy().view(np.uint8).tobytes() == bytes(range(32))


# ---- MoeLayer.from_gguf: every metadata key it reads, given each wrong GGUF value type -----------

MOE_KEYS = (*MOE_DEFAULT_META, "qwen3moe.expert_gating_func", "qwen3moe.expert_weights_norm")
WRONG_VALUES = {
    "string": (GGUF_STRING, "2"),
    "float": (GGUF_F32, 2.0),
    "nan": (GGUF_F32, math.nan),
    "array": (GGUF_ARRAY, (GGUF_U32, [2])),
    "bool": (GGUF_BOOL, True),
    "negative": (GGUF_I32, -1),
    "huge": (GGUF_U64, 2**64 - 1),
}
# Not wrong: a string architecture, a bool expert_weights_norm, a huge (but integer) block count.
RIGHT_TYPE = {
    ("general.architecture", "string"),
    ("qwen3moe.expert_weights_norm", "bool"),
    ("qwen3moe.block_count", "huge"),
}
WRONG_CASES = [(k, v) for k in MOE_KEYS for v in WRONG_VALUES if (k, v) not in RIGHT_TYPE]


@pytest.mark.parametrize("key,kind", WRONG_CASES, ids=[f"{k}-{v}" for k, v in WRONG_CASES])
def test_moe_layer_metadata_of_a_wrong_type_names_the_key(tmp_path, key, kind):
    path = tmp_path / "moe.gguf"
    path.write_bytes(moe_gguf_bytes({key: WRONG_VALUES[kind]}))
    with pytest.raises(routemm.InvalidArgumentError, match=re.escape(key)):
        routemm.MoeLayer.from_gguf(path, 0, device=routemm.Device("cpu"))
