"""Shared helpers: guarded buffers, weight stacks, id generators, the float64 reference, schemas."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import routemm
import routemm.core._schemas
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdMultiplicity as Mult
from routemm import DenseMatmulIdRoute as Route
from routemm import DType

POISON_U32 = 0x7FC000C7  # a quiet-NaN pattern no kernel produces from finite inputs
PAD_BYTE = 0xD7  # fills expert-stride padding and the guards around input views
GUARD = 16  # bytes of poison before and after every view
WEIGHT_DTYPES = (DType.F32, DType.F16, DType.BF16)
NP_DTYPE = {DType.F32: np.dtype(np.float32), DType.F16: np.dtype(np.float16), DType.BF16: np.dtype(ml_dtypes.bfloat16)}
INVALID_IDS = (0xFFFFFFFF, 0x80000000)  # plus n_experts and n_experts + 1 per call
# The Q4_0 pipelines every Q4-capable backend has (mat-vec and the simdgroup matrix route). The
# tensor-API routes may be missing (a Metal device or model without the tensor API): a test that
# takes a `route` parameter is skipped for a route whose pipeline is missing (conftest.py), and a
# test that needs them all says so with needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES).
Q4_BASE_PIPELINES = ("kernel_mul_mv_q4_0_f32", "kernel_mul_mm_q4_0_f32")

try:
    import jsonschema  # noqa: F401

    HAVE_JSONSCHEMA = True
except ImportError:  # schema tests skip themselves; see test_json_schemas.py
    HAVE_JSONSCHEMA = False


def validate(record, name: str | None = None) -> None:
    """Validate a produced record against its shipped JSON Schema (skipped without jsonschema)."""
    if HAVE_JSONSCHEMA:
        routemm.core._schemas.validate(record, name)


def finfo(dtype: DType):
    return ml_dtypes.finfo(NP_DTYPE[dtype]) if dtype is DType.BF16 else np.finfo(NP_DTYPE[dtype])


# ---- buffers -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Guarded:
    """A view at byte offset `offset` (GUARD unless a caller chose another guard) inside a parent
    allocation with `offset` poison bytes each side."""

    parent: routemm.Buffer
    view: routemm.Buffer
    initial: np.ndarray  # every byte of the parent as written
    offset: int = GUARD

    def parent_bytes(self) -> np.ndarray:
        return self.parent.numpy().view(np.uint8).reshape(-1)

    def view_bytes(self) -> np.ndarray:
        return self.parent_bytes()[self.offset : self.offset + self.view.nbytes]

    def assert_guards_intact(self, what: str) -> None:
        now = self.parent_bytes()
        end = self.offset + self.view.nbytes
        assert np.array_equal(now[: self.offset], self.initial[: self.offset]), f"{what}: prefix guard written"
        assert np.array_equal(now[end:], self.initial[end:]), f"{what}: suffix guard written"

    def assert_unchanged(self, what: str) -> None:
        assert np.array_equal(self.parent_bytes(), self.initial), f"{what}: bytes changed"


def guarded(device, payload: np.ndarray, dtype: DType, shape=(), guard: np.ndarray | None = None) -> Guarded:
    payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    if guard is None:
        guard = np.full(GUARD, PAD_BYTE, np.uint8)
    full = np.concatenate([guard, payload, guard]).astype(np.uint8)
    parent = device.alloc(full.nbytes, DType.U8)
    parent.copy_from_numpy(full)
    view = parent.view(guard.size, payload.nbytes, dtype, list(shape))
    return Guarded(parent, view, full.copy(), guard.size)


def run_ggml_guarded(device, registry, ggml_type, blocks, x, n, policy=None, weight_guard=GUARD, input_guard=GUARD):
    """One quantized_matmul_ggml call on guarded views (the guards, bytes of padding before each view,
    set the views' alignment); checks that the weights, the input and the output's guards are
    unchanged. Returns (a copy of the [m, n] output, the receipt)."""
    m, k = x.shape
    weight = guarded(device, blocks, DType.U8, blocks.shape, guard=np.full(weight_guard, PAD_BYTE, np.uint8))
    inp = guarded(device, x, DType.F32, x.shape, guard=np.full(input_guard, PAD_BYTE, np.uint8))
    out = guarded_output(device, m, n)
    encoder = device.command_encoder()
    params = routemm.GgmlQuantizedMatmulParams(m, n, k, ggml_type)
    receipt = routemm.quantized_matmul_ggml(encoder, registry, inp.view, weight.view, out.view, params, policy)
    encoder.commit_and_wait()
    weight.assert_unchanged("weight")
    inp.assert_unchanged("input")
    out.assert_guards_intact("output")
    return out.view.numpy().reshape(m, n).copy(), receipt


def poison_words(count: int) -> np.ndarray:
    return np.full(count, POISON_U32, np.uint32)


def guarded_output(device, rows: int, n: int) -> Guarded:
    return guarded(device, poison_words(rows * n), DType.F32, (rows, n), guard=poison_words(GUARD // 4).view(np.uint8))


def weight_stack_bytes(w: np.ndarray, pad: int) -> tuple[np.ndarray, int]:
    """Experts of w [E, n, k] back to back with `pad` bytes of PAD_BYTE between them.

    Returns (bytes, stride); the length is exactly (E - 1) * stride + n * k * itemsize.
    """
    n_experts = w.shape[0]
    matrix = w[0].nbytes
    stride = matrix + pad
    out = np.full((n_experts - 1) * stride + matrix, PAD_BYTE, np.uint8)
    for e in range(n_experts):
        out[e * stride : e * stride + matrix] = np.ascontiguousarray(w[e]).reshape(-1).view(np.uint8)
    return out, stride


def random_weights(rng, dtype: DType, shape) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, size=shape).astype(NP_DTYPE[dtype])


# ---- ids -----------------------------------------------------------------------------------------


def distinct_ids(rng, m: int, top_k: int, n_experts: int) -> np.ndarray:
    return np.stack([rng.permutation(n_experts)[:top_k] for _ in range(m)]).astype(np.uint32)


def sprinkle_invalid(rng, ids: np.ndarray, n_experts: int, fraction: float = 0.15) -> np.ndarray:
    """Replace some ids with invalid ones (n_experts, n_experts+1, 0x80000000, 0xFFFFFFFF),
    never repeating a value within a token (so distinct-per-token stays true)."""
    ids = ids.copy()
    pool = np.array([n_experts, n_experts + 1, *INVALID_IDS], np.uint32)
    for t in range(ids.shape[0]):
        slots = [s for s in range(ids.shape[1]) if rng.random() < fraction][: len(pool)]
        ids[t, slots] = rng.permutation(pool)[: len(slots)]
    return ids


# ---- reference -----------------------------------------------------------------------------------


def reference(w: np.ndarray, x: np.ndarray, ids: np.ndarray, slotted: bool):
    """float64 out[flat] = W[ids.flat[flat]] @ x[row] with exactly widened weights, and the
    magnitude sum_i |w_i * x_i| per element (for the accumulation bound). Invalid ids: 0 rows."""
    w64 = w.astype(np.float64)
    n_experts, n, k = w64.shape
    m, top_k = ids.shape
    flat_ids = ids.reshape(-1).astype(np.int64)
    rows = x.reshape(-1, k).astype(np.float64)
    row_of = np.arange(m * top_k) if slotted else np.repeat(np.arange(m), top_k)
    ref = np.zeros((m * top_k, n))
    mag = np.zeros((m * top_k, n))
    for flat in range(m * top_k):
        e = flat_ids[flat]
        if 0 <= e < n_experts:
            prod = w64[e] * rows[row_of[flat]][None, :]
            ref[flat] = prod.sum(axis=1)
            mag[flat] = np.abs(prod).sum(axis=1)
    return ref, mag


def invalid_rows(ids: np.ndarray, n_experts: int) -> np.ndarray:
    return ids.reshape(-1).astype(np.int64) >= n_experts


# ---- running the op ------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    out: np.ndarray  # float32 [m*top_k, n]
    receipt: routemm.DenseMatmulIdDispatchReceipt
    dispatches: int


def make_params(
    m, n, k, top_k, n_experts, stride, layout=Layout.SHARED_PER_TOKEN, mult=Mult.DISTINCT_PER_TOKEN, route=Route.DIRECT
) -> routemm.DenseMatmulIdParams:
    return routemm.DenseMatmulIdParams(
        m=m,
        n=n,
        k=k,
        top_k=top_k,
        n_experts=n_experts,
        expert_stride_bytes=stride,
        input_layout=layout,
        id_multiplicity=mult,
        route=route,
    )


class Case:
    """One fully guarded dense_matmul_id call; `run(route)` may be repeated with the same buffers."""

    def __init__(
        self,
        device,
        registry,
        dtype: DType,
        w: np.ndarray,
        x: np.ndarray,
        ids: np.ndarray,
        *,
        slotted: bool,
        pad: int = 12,
        mult: Mult = Mult.DISTINCT_PER_TOKEN,
        scratch_capacity: tuple[int, int] | None = None,
    ):
        self.device, self.registry, self.dtype = device, registry, dtype
        self.w, self.x, self.ids, self.slotted, self.mult = w, x, ids, slotted, mult
        self.n_experts, self.n, self.k = w.shape
        self.m, self.top_k = ids.shape
        wbytes, self.stride = weight_stack_bytes(w, pad)
        self.weights = guarded(device, wbytes, dtype)
        self.input = guarded(device, x.astype(np.float32), DType.F32, x.shape)
        self.id_buf = guarded(device, ids.astype(np.uint32), DType.U32, ids.shape)
        self.output = guarded_output(device, self.m * self.top_k, self.n)
        cap = scratch_capacity or (self.n_experts, self.m)
        self.scratch = routemm.DenseMatmulIdScratch(device, *cap)

    def params(self, route: Route) -> routemm.DenseMatmulIdParams:
        return make_params(
            self.m,
            self.n,
            self.k,
            self.top_k,
            self.n_experts,
            self.stride,
            Layout.SLOTTED if self.slotted else Layout.SHARED_PER_TOKEN,
            self.mult,
            route,
        )

    def run(self, route: Route) -> RunResult:
        # Re-poison the output (and its guards) before every run.
        self.output.parent.copy_from_numpy(self.output.initial)
        params = self.params(route)
        cap = routemm.dense_matmul_id_capability(self.dtype, params)
        validate(cap)
        validate(params)
        assert cap.required_weight_bytes == self.weights.view.nbytes
        before = routemm.dispatch_count()
        encoder = self.device.command_encoder()
        receipt = routemm.dense_matmul_id(
            encoder,
            self.registry,
            self.weights.view,
            self.input.view,
            self.id_buf.view,
            self.output.view,
            self.scratch if route is Route.GROUPED_PREFILL else None,
            params,
        )
        encoder.commit_and_wait()
        dispatches = routemm.dispatch_count() - before
        validate(receipt)
        assert receipt.route is route and receipt.weight_dtype == self.dtype
        assert receipt.dispatch_count == dispatches == (2 if route is Route.GROUPED_PREFILL else 1)
        # Inputs untouched (weights, padding, guards), output guards intact, every element written.
        self.weights.assert_unchanged("weights")
        self.input.assert_unchanged("input")
        self.id_buf.assert_unchanged("expert ids")
        self.output.assert_guards_intact("output")
        words = self.output.view_bytes().view(np.uint32)
        assert not np.any(words == POISON_U32), f"{int(np.sum(words == POISON_U32))} output element(s) never written"
        out = words.view(np.float32).reshape(self.m * self.top_k, self.n).copy()
        return RunResult(out, receipt, dispatches)

    def reference(self):
        return reference(self.w, self.x, self.ids, self.slotted)


def pack_kernel_params(m, n, k, top_k, n_experts, stride, slotted=False) -> bytes:
    """The 48-byte kernel-argument struct of spec §7.4 (little endian)."""
    row = k * 4
    token_stride, slot_stride = (row * top_k, row) if slotted else (row, 0)
    return struct.pack("<6I3Q", m, n, k, top_k, n_experts, 1 if slotted else 0, stride, token_stride, slot_stride)


# ---- GGUF files built by hand (for malformed-file tests) ------------------------------------------


def gguf_bytes(
    kvs=(),
    tensors=(("t", [8], 0, 0),),
    data: bytes = bytes(range(32)),
    *,
    alignment: int = 32,
    version: int = 3,
    raw_tensor_names: bool = False,
) -> bytes:
    """A GGUF file: `kvs` are (key bytes or str, type id, encoded value bytes); `tensors` are
    (name, dims innermost first, GGML type, offset); the data section starts at the next multiple
    of `alignment` (which should match any general.alignment in `kvs`) after the header."""

    def string(s) -> bytes:
        raw = s if isinstance(s, bytes) else s.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, type_id, value in kvs:
        out += string(key) + struct.pack("<I", type_id) + value
    for name, dims, type_id, offset in tensors:
        out += string(name if raw_tensor_names else str(name)) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % max(alignment, 1))
    return out + data


def run_python(code: str, *, unset: tuple[str, ...] = (), timeout: float = 60, **env: str):
    """`code` run by a fresh interpreter (knobs are read once per process), with this process's
    environment less the variables in `unset`, plus `env`; the finished process, output as text."""
    child_env = {k: v for k, v in os.environ.items() if k not in unset}
    child_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=timeout)


# GGUF metadata value types (gguf.md): scalar struct formats; 8 is a string, 9 an array.
GGUF_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY, GGUF_U64, GGUF_I64 = 4, 5, 6, 7, 8, 9, 10, 11


def gguf_value(type_id: int, value) -> bytes:
    """The encoding of one metadata value: a scalar, a str (type 8) or (item type, items) (type 9)."""
    if type_id == GGUF_STRING:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if type_id == GGUF_ARRAY:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(gguf_value(item_type, v) for v in items)
    return struct.pack(GGUF_SCALAR_FORMATS[type_id], value)


# The MoE layer of moe_gguf_bytes: experts, experts per token, hidden and intermediate size.
MOE_E, MOE_TOP_K, MOE_H, MOE_I = 4, 2, 32, 8
MOE_DEFAULT_META = {
    "general.architecture": (GGUF_STRING, "qwen3moe"),
    "qwen3moe.block_count": (GGUF_U32, 1),
    "qwen3moe.expert_count": (GGUF_U32, MOE_E),
    "qwen3moe.expert_used_count": (GGUF_U32, MOE_TOP_K),
}


def moe_gguf_bytes(meta=None, *, extra_kvs=(), seed: int = 0) -> bytes:
    """A GGUF file with one qwen3moe MoE layer (llama.cpp's tensor names; f32 router [E, H] and
    expert stacks, E=4, top-k 2, H=32, I=8). `meta` overrides MOE_DEFAULT_META: key -> (type id,
    value) as gguf_value takes it, or None to leave the key out; `extra_kvs` are appended as
    (key, type id, value) (a key already present is written twice)."""
    rng = np.random.default_rng(seed)
    entries = {**MOE_DEFAULT_META, **(meta or {})}
    kvs = [(key, t_v[0], gguf_value(*t_v)) for key, t_v in entries.items() if t_v is not None]
    kvs += [(key, type_id, gguf_value(type_id, value)) for key, type_id, value in extra_kvs]
    shapes = {
        "blk.0.ffn_gate_inp.weight": (MOE_E, MOE_H),
        "blk.0.ffn_gate_exps.weight": (MOE_E, MOE_I, MOE_H),
        "blk.0.ffn_up_exps.weight": (MOE_E, MOE_I, MOE_H),
        "blk.0.ffn_down_exps.weight": (MOE_E, MOE_H, MOE_I),
    }
    tensors, data = [], b""
    for name, shape in shapes.items():
        tensors.append((name, list(reversed(shape)), 0, len(data)))
        raw = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32).tobytes()
        data += raw + b"\0" * (-len(raw) % 32)
    return gguf_bytes(kvs, tensors, data)
