"""Fail closed on GGUF files and MoE layers: a malformed file, metadata value or MoeLayer argument
is refused at load with a routemm.Error naming the argument or metadata key, before anything is
mapped or encoded -- never a Python/NumPy exception, a silently coerced value, or a layer whose
every later call fails.

Each case here used to load, coerce or escape as ValueError / TypeError / OverflowError /
IndexError / AttributeError. .ci/run also runs this file against an ASan + UBSan build (no torch).
"""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
import routemm
from routemm import GgmlType, q4_0
from support import (
    GGUF_ARRAY,
    GGUF_BOOL,
    GGUF_F32,
    GGUF_I32,
    GGUF_STRING,
    GGUF_U32,
    GGUF_U64,
    MOE_E,
    MOE_H,
    MOE_I,
    gguf_bytes,
    moe_gguf_bytes,
)


@pytest.fixture
def cpu():
    return routemm.Device("cpu")


def write(tmp_path, blob: bytes, name: str = "case.gguf"):
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def load_tensor(tmp_path, blob, name="t", **kw):
    return routemm.gguf_tensor(write(tmp_path, blob), name, device=routemm.Device("cpu"), **kw)


# ---- MoeLayer arguments -------------------------------------------------------------------------


@pytest.fixture
def parts(tmp_path, cpu):
    """(router, gate, up, down) buffers of a valid f32 layer."""
    layer = routemm.MoeLayer.from_gguf(write(tmp_path, moe_gguf_bytes()), 0, device=cpu)
    return layer.router, layer.gate, layer.up, layer.down


def f32(cpu, shape):
    return cpu.from_numpy(np.zeros(shape, np.float32))


@pytest.mark.parametrize(
    "slot,shape",
    [("router", (MOE_H,)), ("router", (1, MOE_E, MOE_H)), ("gate", (MOE_H,)), ("up", (MOE_E, MOE_I)), ("down", ())],
    ids=["router-1d", "router-3d", "gate-1d", "up-2d", "down-0d"],
)
def test_moe_layer_refuses_buffers_of_another_rank(cpu, parts, slot, shape):
    buffers = dict(zip(("router", "gate", "up", "down"), parts, strict=True))
    buffers[slot] = f32(cpu, shape)
    with pytest.raises(routemm.InvalidArgumentError, match=rf"moe layer: {slot}\b"):
        routemm.MoeLayer(*buffers.values(), top_k=2, renormalize=True)


@pytest.mark.parametrize("slot", ["router", "gate", "up", "down"])
def test_moe_layer_refuses_a_non_buffer(parts, slot):
    buffers = dict(zip(("router", "gate", "up", "down"), parts, strict=True))
    buffers[slot] = np.zeros(tuple(buffers[slot].shape), np.float32)
    with pytest.raises(routemm.InvalidArgumentTypeError, match=rf"moe layer: {slot} must be a Buffer, not ndarray"):
        routemm.MoeLayer(*buffers.values(), top_k=2, renormalize=True)


def test_moe_layer_refuses_zero_extents(cpu):
    with pytest.raises(routemm.InvalidArgumentError, match="extents must be nonzero"):
        routemm.MoeLayer(
            f32(cpu, (MOE_E, MOE_H)), f32(cpu, (MOE_E, 0, MOE_H)), f32(cpu, (MOE_E, 0, MOE_H)),
            f32(cpu, (MOE_E, MOE_H, 0)), top_k=2, renormalize=True,
        )  # fmt: skip


@pytest.mark.parametrize("top_k", [2.5, "2", 2.0, True, np.float64(2), [2], None], ids=repr)
def test_moe_layer_top_k_must_be_an_integer(parts, top_k):
    with pytest.raises(routemm.InvalidArgumentError, match="moe layer: top_k must be an integer"):
        routemm.MoeLayer(*parts, top_k=top_k, renormalize=True)


@pytest.mark.parametrize("top_k", [0, -1, MOE_E + 1, 2**64])
def test_moe_layer_top_k_range(parts, top_k):
    with pytest.raises(routemm.InvalidArgumentError, match=rf"moe layer: top_k {top_k} must be in \[1, "):
        routemm.MoeLayer(*parts, top_k=top_k, renormalize=True)


@pytest.mark.parametrize("renormalize", ["no", "false", 1, 0, None, [False]], ids=repr)
def test_moe_layer_renormalize_must_be_a_bool(parts, renormalize):
    with pytest.raises(routemm.InvalidArgumentError, match="moe layer: renormalize must be a bool"):
        routemm.MoeLayer(*parts, top_k=2, renormalize=renormalize)


def test_moe_layer_takes_numpy_integers_and_bools(parts):
    layer = routemm.MoeLayer(*parts, top_k=np.int64(2), renormalize=np.bool_(False))
    assert (layer.top_k, layer.renormalize) == (2, False)
    assert type(layer.top_k) is int and type(layer.renormalize) is bool


def test_moe_layer_ggml_type_as_its_name(cpu, rng):
    """ggml_type takes a GgmlType or its value, as moe_experts does; anything else is refused."""
    inter = 32  # down's rows are I values: a whole number of Q4_0 blocks

    def stack(shape):
        return cpu.from_numpy(q4_0.quantize(rng.standard_normal(shape).astype(np.float32)))

    router = f32(cpu, (MOE_E, MOE_H))
    gate, up, down = stack((MOE_E, inter, MOE_H)), stack((MOE_E, inter, MOE_H)), stack((MOE_E, MOE_H, inter))
    named = routemm.MoeLayer(router, gate, up, down, top_k=2, renormalize=True, ggml_type="q4_0")
    assert named.ggml_type is GgmlType.Q4_0 and named.intermediate == inter
    for bad in ("q4", "q3_k", 2, GgmlType.IQ4_XS):
        with pytest.raises(routemm.InvalidArgumentError, match="moe layer: ggml_type must be None"):
            routemm.MoeLayer(router, gate, up, down, top_k=2, renormalize=True, ggml_type=bad)


def test_moe_layer_refuses_block_stacks_without_ggml_type_and_floats_with_it(cpu, parts):
    """The stacks' dtypes are checked with the shapes (moe_experts' check), not at the first call."""
    router, gate, up, _ = parts
    blocks = [cpu.from_numpy(np.zeros((MOE_E, 32, 18), np.uint8)) for _ in range(3)]  # Q4_0, H = I = 32
    floats_as_blocks = cpu.from_numpy(np.zeros((MOE_E, 32, 18), np.float32))
    with pytest.raises(routemm.InvalidArgumentError, match="moe layer: q4_0 weights must be uint8 block stacks"):
        routemm.MoeLayer(router, *blocks[:2], floats_as_blocks, top_k=2, renormalize=True, ggml_type="q4_0")
    u8 = cpu.from_numpy(np.zeros((MOE_E, MOE_H, MOE_I), np.uint8))
    with pytest.raises(routemm.InvalidArgumentError, match="moe layer: weights must share one of f32, f16, bf16"):
        routemm.MoeLayer(router, gate, up, u8, top_k=2, renormalize=True)


def test_moe_layer_device_must_be_a_device(tmp_path, parts):
    with pytest.raises(routemm.InvalidArgumentTypeError, match="moe layer: device must be a Device or None, not str"):
        routemm.MoeLayer(*parts, top_k=2, renormalize=True, device="cpu")
    path = write(tmp_path, moe_gguf_bytes())
    with pytest.raises(routemm.InvalidArgumentTypeError, match="MoeLayer.from_gguf: device must be a Device or None"):
        routemm.MoeLayer.from_gguf(path, 0, device="cpu")


# ---- MoeLayer.from_gguf: metadata values --------------------------------------------------------


def from_gguf(tmp_path, meta=None, layer=0, **kw):
    path = write(tmp_path, moe_gguf_bytes(meta, **kw))
    return routemm.MoeLayer.from_gguf(path, layer, device=routemm.Device("cpu"))


@pytest.mark.parametrize(
    "key,value",
    [
        ("qwen3moe.expert_count", (GGUF_STRING, "4")),
        ("qwen3moe.expert_count", (GGUF_F32, math.nan)),
        ("qwen3moe.expert_count", (GGUF_ARRAY, (GGUF_U32, [4]))),
        ("qwen3moe.expert_count", (GGUF_F32, 4.0)),
        ("qwen3moe.expert_used_count", (GGUF_F32, 2.7)),
        ("qwen3moe.expert_used_count", (GGUF_STRING, "2")),
        ("qwen3moe.expert_used_count", (GGUF_F32, math.nan)),
        ("qwen3moe.expert_used_count", (GGUF_ARRAY, (GGUF_U32, [2]))),
        ("qwen3moe.expert_weights_norm", (GGUF_STRING, "false")),
        ("qwen3moe.expert_weights_norm", (GGUF_ARRAY, (GGUF_BOOL, [False]))),
        ("qwen3moe.expert_weights_norm", (GGUF_U32, 0)),
        ("qwen3moe.expert_gating_func", (GGUF_BOOL, True)),
        ("qwen3moe.expert_gating_func", (GGUF_F32, 1.0)),
        ("qwen3moe.expert_gating_func", (GGUF_STRING, "1")),
        ("qwen3moe.block_count", (GGUF_STRING, "1")),
        ("qwen3moe.block_count", (GGUF_F32, math.nan)),
        ("general.architecture", (GGUF_U32, 3)),
    ],
    ids=lambda v: v if isinstance(v, str) else repr(v[1]),
)
def test_from_gguf_refuses_metadata_of_the_wrong_type(tmp_path, key, value):
    """Each used to load with a coerced value (2.7 -> 2, "false" -> True, 1.0 -> softmax) or escape
    as ValueError / TypeError."""
    with pytest.raises(routemm.InvalidArgumentError, match=re.escape(key)):
        from_gguf(tmp_path, {key: value})


def test_from_gguf_names_both_counts_when_they_disagree(tmp_path):
    with pytest.raises(
        routemm.InvalidArgumentError,
        match=re.escape("qwen3moe.expert_used_count 2 must be in [1, qwen3moe.expert_count = 1]"),
    ):
        from_gguf(tmp_path, {"qwen3moe.expert_count": (GGUF_U32, 1)})


def test_from_gguf_takes_the_metadata_it_is_given(tmp_path):
    layer = from_gguf(
        tmp_path,
        {
            "qwen3moe.expert_used_count": (GGUF_U64, 3),
            "qwen3moe.expert_weights_norm": (GGUF_BOOL, False),
            "qwen3moe.expert_gating_func": (GGUF_I32, 1),
        },
    )
    assert (layer.top_k, layer.renormalize) == (3, False)


@pytest.mark.parametrize("path", [None, 3, ["a.gguf"]], ids=repr)
def test_from_gguf_path_must_be_a_path(path):
    with pytest.raises(routemm.InvalidArgumentTypeError, match="MoeLayer.from_gguf: path must be a str, bytes or"):
        routemm.MoeLayer.from_gguf(path, 0)


# ---- gguf_tensor arguments ----------------------------------------------------------------------


def test_gguf_tensor_arguments_are_checked(tmp_path):
    path = write(tmp_path, gguf_bytes())
    cases = [
        (
            lambda: routemm.gguf_tensor(path, ["t"], device=routemm.Device("cpu")),
            "gguf_tensor: name must be a str, not list",
        ),
        (lambda: routemm.gguf_tensor(path, "t", device="cpu"), "gguf_tensor: device must be a Device or None, not str"),
        (lambda: routemm.gguf_tensor(path, "t", copy="no"), "gguf_tensor: copy must be a bool, not str"),
        (lambda: routemm.gguf_tensor(None, "t"), "gguf_tensor: path must be a str, bytes or os.PathLike, not NoneType"),
        (lambda: routemm.gguf_metadata(3), "gguf_metadata: path must be a str, bytes or os.PathLike, not int"),
    ]
    for call, message in cases:
        with pytest.raises(routemm.InvalidArgumentTypeError, match=re.escape(message)):
            call()


# ---- Alignment ----------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [1, 2, 3, 4, 12, 24, 48])
def test_alignment_must_be_a_power_of_two_and_a_multiple_of_8(tmp_path, alignment):
    blob = gguf_bytes([("general.alignment", GGUF_U32, struct.pack("<I", alignment))], alignment=alignment)
    with pytest.raises(routemm.InvalidArgumentError, match=f"general.alignment {alignment} .*power of two"):
        load_tensor(tmp_path, blob)


@pytest.mark.parametrize("type_id,fmt", [(GGUF_U64, "<Q"), (GGUF_I32, "<i")], ids=["u64", "i32"])
def test_alignment_must_be_a_uint32(tmp_path, type_id, fmt):
    blob = gguf_bytes([("general.alignment", type_id, struct.pack(fmt, 32))])
    with pytest.raises(routemm.InvalidArgumentError, match="general.alignment .*uint32"):
        load_tensor(tmp_path, blob)


@pytest.mark.parametrize("alignment", [8, 16, 64, 4096])
def test_good_alignments_load(tmp_path, alignment):
    second = max(32, alignment)  # the second tensor's offset: a multiple of the alignment
    blob = gguf_bytes(
        [("general.alignment", GGUF_U32, struct.pack("<I", alignment))],
        tensors=[("t", [8], 0, 0), ("u", [8], 0, second)],
        data=bytes(range(32)) + bytes(second - 32) + bytes(range(32, 64)),
        alignment=alignment,
    )
    assert load_tensor(tmp_path, blob, "u").numpy().view(np.uint8).tobytes() == bytes(range(32, 64))


@pytest.mark.parametrize(
    "alignment,offset,type_id",
    [(32, 1, 2), (32, 2, 0), (32, 16, 0), (8, 4, 0), (64, 32, 8)],
    ids=["q4_0-odd", "f32-2", "f32-16", "align8-4", "q8_0-align64-32"],
)
def test_tensor_offset_must_be_a_multiple_of_the_alignment(tmp_path, alignment, offset, type_id):
    """A Q4_0 tensor at an odd offset loaded as a view at an odd address, and every call with it failed."""
    kvs = [("general.alignment", GGUF_U32, struct.pack("<I", alignment))] if alignment != 32 else []
    dims = [32] if type_id in (2, 8) else [8]
    blob = gguf_bytes(kvs, tensors=[("t", dims, type_id, offset)], data=bytes(128), alignment=alignment)
    with pytest.raises(
        routemm.InvalidArgumentError, match=f"tensor 't' is at data offset {offset}, not a multiple of {alignment}"
    ):
        load_tensor(tmp_path, blob)


def test_misaligned_tensor_refused_by_from_gguf(tmp_path):
    blob = bytearray(moe_gguf_bytes())
    name = b"blk.0.ffn_down_exps.weight"
    at = blob.index(name) + len(name) + 4 + 3 * 8 + 4  # n_dims, three dims, type; then the offset
    (offset,) = struct.unpack_from("<Q", blob, at)
    struct.pack_into("<Q", blob, at, offset + 2)
    with pytest.raises(routemm.InvalidArgumentError, match="'blk.0.ffn_down_exps.weight' is at data offset"):
        routemm.MoeLayer.from_gguf(write(tmp_path, bytes(blob)), 0, device=routemm.Device("cpu"))


# ---- Dimension bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims,type_id",
    [([0, 2**61], 0), ([2**61, 0], 0), ([0, 2**40, 2**40], 0), ([0, 2**62, 2], 2), ([32, 0, 2**62], 8)],
    ids=["f32-0x2^61", "f32-2^61x0", "f32-0x2^80", "q4_0-0x2^63", "q8_0-2^62"],
)
def test_zero_size_tensor_with_huge_dimensions_refused(tmp_path, dims, type_id):
    """A zero-size tensor whose other dimensions overflow loaded, and .numpy() raised NumPy's error."""
    with pytest.raises(routemm.InvalidArgumentError, match="tensor 't' .*beyond 2\\^63 - 1"):
        load_tensor(tmp_path, gguf_bytes(tensors=[("t", dims, type_id, 0)]))


@pytest.mark.parametrize("dims", [[0], [8, 0], [0, 2**20, 2**20], [32, 0], [0, 2**61 - 1]])
def test_zero_size_tensors_within_bounds_load(tmp_path, dims):
    buf = load_tensor(tmp_path, gguf_bytes(tensors=[("t", dims, 0, 0)]))
    assert buf.nbytes == 0
    assert buf.numpy().shape == tuple(reversed(dims))


# ---- Duplicates ---------------------------------------------------------------------------------


def test_duplicate_metadata_keys_refused(tmp_path):
    name = ("general.name", GGUF_STRING, struct.pack("<Q", 1) + b"a")
    for kvs in (
        [name, name],
        [
            ("general.alignment", GGUF_U32, struct.pack("<I", 32)),
            ("general.alignment", GGUF_U32, struct.pack("<I", 64)),
        ],
    ):
        path = write(tmp_path, gguf_bytes(kvs))
        for read in (lambda: routemm.gguf_metadata(path), lambda: routemm.gguf_tensor(path, "t")):
            with pytest.raises(routemm.InvalidArgumentError, match=f"metadata key {kvs[0][0]!r} twice"):
                read()


def test_duplicate_metadata_key_refused_by_from_gguf(tmp_path):
    """The second expert_used_count won (last wins) and the layer ran with it."""
    with pytest.raises(routemm.InvalidArgumentError, match="metadata key 'qwen3moe.expert_used_count' twice"):
        from_gguf(tmp_path, extra_kvs=[("qwen3moe.expert_used_count", GGUF_U32, 4)])


def test_duplicate_tensor_names_refused(tmp_path):
    path = write(tmp_path, gguf_bytes(tensors=[("t", [8], 0, 0), ("u", [8], 0, 0), ("t", [4], 0, 0)]))
    for read in (lambda: routemm.gguf_tensor(path, "u"), lambda: routemm.gguf_metadata(path)):
        with pytest.raises(routemm.InvalidArgumentError, match="two tensors named 't'"):
            read()
