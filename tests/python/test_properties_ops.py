"""Property-based guards over the op entry points (bounded for CI by the hypothesis profile in
conftest.py; `--hypothesis-profile=deep` runs many more examples).

* dense_matmul_id (direct and grouped_prefill), matmul_id and quantized_matmul_ggml against a
  float64 reference, ids out of range giving zero rows and ids repeated within a token routed;
* every operand a view into one shared buffer: every byte outside the output's view keeps its
  value, every element of the output is written;
* the capability's extents are exact: operands of exactly the required bytes are accepted, one
  element less is refused before anything is encoded (the big-integer model of the extents
  themselves is test_capability_property.py);
* raw dispatch of every registered pipeline with random arguments: refused with a routemm.Error or
  run without harm, never a crash. It runs in a child process, so a crash fails that test instead
  of ending the run.

Each failing example found is kept below as an explicit @example.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
import routemm  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from routemm import DenseMatmulIdInputLayout as Layout  # noqa: E402
from routemm import DenseMatmulIdMultiplicity as Mult  # noqa: E402
from routemm import DenseMatmulIdRoute as Route  # noqa: E402
from routemm import DType, q4_0  # noqa: E402
from support import NP_DTYPE, POISON_U32, WEIGHT_DTYPES, reference, weight_stack_bytes  # noqa: E402
from tolerances import accumulation_bound, assert_close, q4_gpu_bound  # noqa: E402

GAP_BYTE = 0xA5  # fills the shared buffer between views
SPECIAL_IDS = (0xFFFFFFFF, 0x80000000)


def examples(count: int) -> int:
    """`count` examples under the "ci" profile (100 by default), scaled with the loaded profile."""
    return max(1, count * settings().max_examples // 100)


def bounded(count: int) -> settings:
    return settings(max_examples=examples(count))


# ---- one shared buffer ------------------------------------------------------------------------------


@dataclasses.dataclass
class Arena:
    """Operand views inside one U8 parent at 4-byte aligned offsets, with `gaps[i]` bytes of
    GAP_BYTE before view i (and after the last); the output view starts as POISON_U32 words."""

    parent: routemm.Buffer
    initial: np.ndarray
    views: dict[str, routemm.Buffer]
    spans: dict[str, tuple[int, int]]

    def now(self) -> np.ndarray:
        return self.parent.numpy().view(np.uint8).reshape(-1)

    def reset(self) -> None:
        self.parent.copy_from_numpy(self.initial)

    def outside(self, name: str, data: np.ndarray) -> np.ndarray:
        start, end = self.spans[name]
        return np.concatenate([data[:start], data[end:]])

    def assert_only_written(self, name: str) -> None:
        assert np.array_equal(self.outside(name, self.now()), self.outside(name, self.initial)), (
            f"a byte outside {name} changed"
        )

    def words(self, name: str) -> np.ndarray:
        start, end = self.spans[name]
        return self.now()[start:end].view(np.uint32)


def make_arena(device, parts, gaps) -> Arena:
    """parts: (name, payload as uint8, dtype, shape), laid out in order; gaps: at least one more
    than parts (the last one trails the last view)."""
    layout, offset = [], 0
    for (name, payload, dtype, shape), gap in zip(parts, gaps[: len(parts)], strict=True):
        offset = (offset + gap + 3) // 4 * 4
        layout.append((name, offset, payload, dtype, shape))
        offset += payload.nbytes
    total = max(offset + gaps[len(parts)], 4)
    data = np.full(total, GAP_BYTE, np.uint8)
    for _, start, payload, _, _ in layout:
        data[start : start + payload.nbytes] = payload
    parent = device.alloc(total, DType.U8)
    parent.copy_from_numpy(data)
    views = {name: parent.view(start, p.nbytes, dtype, list(shape)) for name, start, p, dtype, shape in layout}
    spans = {name: (start, start + p.nbytes) for name, start, p, _, _ in layout}
    return Arena(parent, data, views, spans)


def poison_output(rows: int, n: int) -> np.ndarray:
    return np.full(rows * n, POISON_U32, np.uint32).view(np.uint8)


gap_list = st.lists(st.sampled_from([0, 0, 4, 8, 12, 64, 100]), min_size=5, max_size=5)


# ---- dense_matmul_id ---------------------------------------------------------------------------------


@dataclasses.dataclass
class DmidCase:
    dtype: DType
    m: int
    n: int
    k: int
    top_k: int
    n_experts: int
    pad: int  # bytes between expert matrices
    slotted: bool
    ids: list[list[int]]  # u32 values, may repeat within a token and may be out of range
    seed: int
    gaps: list[int]


@st.composite
def dmid_cases(draw, max_m=12):
    dtype = draw(st.sampled_from(WEIGHT_DTYPES))
    n_experts = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, min(n_experts, 5)))  # the grouped route is declared distinct
    m = draw(st.integers(1, max_m))
    n = draw(st.integers(1, 20))
    k = draw(st.integers(1, 70))
    id_value = st.one_of(
        st.integers(0, n_experts - 1),
        st.sampled_from([n_experts, n_experts + 1, *SPECIAL_IDS]),
    )
    ids = draw(st.lists(st.lists(id_value, min_size=top_k, max_size=top_k), min_size=m, max_size=m))
    pad = draw(st.integers(0, 8)) * dtype.size
    return DmidCase(
        dtype, m, n, k, top_k, n_experts, pad, draw(st.booleans()), ids, draw(st.integers(0, 2**32 - 1)), draw(gap_list)
    )


class DmidRun:
    """A case's operands in one arena; `call(route)` encodes and runs one dense_matmul_id."""

    def __init__(self, device, registry, c: DmidCase, short: str | None = None):
        rng = np.random.default_rng(c.seed)
        self.c, self.device, self.registry = c, device, registry
        self.w = rng.uniform(-1, 1, (c.n_experts, c.n, c.k)).astype(NP_DTYPE[c.dtype])
        rows = c.m * c.top_k
        self.x = rng.uniform(-1, 1, (rows if c.slotted else c.m, c.k)).astype(np.float32)
        self.ids = np.array(c.ids, np.uint32).reshape(c.m, c.top_k)
        wbytes, self.stride = weight_stack_bytes(self.w, c.pad)
        parts = {
            "weights": (wbytes, c.dtype, ()),
            "input": (self.x.view(np.uint8).reshape(-1), DType.F32, self.x.shape),
            "expert IDs": (self.ids.view(np.uint8).reshape(-1), DType.U32, self.ids.shape),
            "output": (poison_output(rows, c.n), DType.F32, (rows, c.n)),
        }
        if short is not None:  # one element less than the capability requires
            payload, dtype, _ = parts[short]
            parts[short] = (payload[: payload.nbytes - dtype.size], dtype, ())
        self.arena = make_arena(device, [(name, *part) for name, part in parts.items()], c.gaps)
        self.scratch = routemm.DenseMatmulIdScratch(device, c.n_experts, c.m)

    def params(self, route: Route) -> routemm.DenseMatmulIdParams:
        c = self.c
        return routemm.DenseMatmulIdParams(
            c.m,
            c.n,
            c.k,
            c.top_k,
            c.n_experts,
            self.stride,
            Layout.SLOTTED if c.slotted else Layout.SHARED_PER_TOKEN,
            Mult.DISTINCT_PER_TOKEN if route is Route.GROUPED_PREFILL else Mult.MAY_REPEAT,
            route,
        )

    def call(self, route: Route) -> np.ndarray:
        self.arena.reset()
        v = self.arena.views
        encoder = self.device.command_encoder()
        scratch = self.scratch if route is Route.GROUPED_PREFILL else None
        routemm.dense_matmul_id(
            encoder, self.registry, v["weights"], v["input"], v["expert IDs"], v["output"], scratch, self.params(route)
        )
        encoder.commit_and_wait()
        self.arena.assert_only_written("output")
        words = self.arena.words("output")
        assert not np.any(words == POISON_U32), (
            f"{route.value}: {int(np.sum(words == POISON_U32))} element(s) unwritten"
        )
        return words.view(np.float32).reshape(self.c.m * self.c.top_k, self.c.n).copy()


# The case of a token naming one expert in every slot, declared distinct, on the grouped route:
# the map used to route only the first slot and leave the others' rows unwritten.
REPEATED_IDS = DmidCase(DType.F32, 3, 5, 9, 3, 4, 0, True, [[1, 1, 1], [0, 2, 3], [2, 2, 0xFFFFFFFF]], 7, [0] * 5)


@bounded(80)
@given(dmid_cases())
@example(REPEATED_IDS)
@example(dataclasses.replace(REPEATED_IDS, slotted=False, dtype=DType.BF16, pad=6))
def test_dense_matmul_id_routes_match_reference_inside_a_shared_buffer(device, registry, c):
    """Both scalar routes against float64, bit-identical to each other, writing only the output."""
    run = DmidRun(device, registry, c)
    ref, mag = reference(run.w, run.x, run.ids, c.slotted)
    out = {route: run.call(route) for route in (Route.DIRECT, Route.GROUPED_PREFILL)}
    invalid = run.ids.reshape(-1) >= c.n_experts
    for route, got in out.items():
        assert np.all(got[invalid].view(np.uint32) == 0), f"{route.value}: out-of-range ids must give +0.0 rows"
        assert_close(got, ref, mag, dtype=c.dtype, k=c.k, context=route.value)
    assert np.array_equal(out[Route.DIRECT].view(np.uint32), out[Route.GROUPED_PREFILL].view(np.uint32))


@bounded(40)
@given(dmid_cases(max_m=6), st.sampled_from(["weights", "input", "expert IDs", "output"]), st.booleans())
def test_dense_matmul_id_one_element_short_is_refused(device, registry, c, short, grouped):
    """The capability's extents are exact: one element less than required is refused, naming the
    operand, before anything is encoded or written."""
    run = DmidRun(device, registry, c, short=short)
    route = Route.GROUPED_PREFILL if grouped else Route.DIRECT
    v = run.arena.views
    encoder = device.command_encoder()
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match=f"dense_matmul_id {short} requires"):
        routemm.dense_matmul_id(
            encoder, registry, v["weights"], v["input"], v["expert IDs"], v["output"], run.scratch, run.params(route)
        )
    assert routemm.dispatch_count() == before and encoder.pending_dispatches == 0
    encoder.commit_and_wait()
    assert np.array_equal(run.arena.now(), run.arena.initial)


# ---- matmul_id ---------------------------------------------------------------------------------------


@st.composite
def matmul_id_cases(draw):
    dtype = draw(st.sampled_from(WEIGHT_DTYPES))
    n_experts, top_k, m = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 14))
    n, k = draw(st.integers(1, 12)), draw(st.integers(1, 40))
    any_id = st.one_of(st.integers(-2, n_experts + 1), st.integers(-(2**63), 2**63 - 1))
    ids = draw(st.lists(st.lists(any_id, min_size=top_k, max_size=top_k), min_size=m, max_size=m))
    route = draw(st.sampled_from([None, Route.DIRECT, Route.GROUPED_PREFILL]))
    framework = draw(st.sampled_from(FRAMEWORKS))
    return dtype, n_experts, m, n, k, top_k, ids, draw(st.booleans()), route, draw(st.integers(0, 2**32 - 1)), framework


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


# NumPy arrays, and PyTorch CPU tensors (used in place through DLPack) where torch is installed.
FRAMEWORKS = ("numpy", "torch") if _torch() is not None else ("numpy",)


def _declarable_distinct(ids: np.ndarray, n_experts: int) -> bool:
    """Valid ids distinct within every token, and top_k <= n_experts."""
    if ids.shape[1] > n_experts:
        return False
    return all(len(v) == len(set(v)) for v in ([i for i in row if 0 <= i < n_experts] for row in ids.tolist()))


@bounded(80)
@given(matmul_id_cases())
@example((DType.F32, 1, 2, 3, 8, 2, [[0, 5], [-1, 0]], False, None, 1, "numpy"))  # out-of-range ids are not experts
@example((DType.F32, 1, 9, 3, 8, 2, [[0, 5], [-1, 0]] * 4 + [[0, 2**40]], True, None, 2, "numpy"))
@example((DType.F32, 1, 2, 3, 8, 2, [[0, 5], [-1, 0]], False, Route.DIRECT, 3, FRAMEWORKS[-1]))
@example((DType.F32, 2, 1, 1, 1, 2, [[0, 0]], False, Route.GROUPED_PREFILL, 0, FRAMEWORKS[-1]))  # repeats, by shape
def test_matmul_id_matches_reference(device, case):
    dtype, n_experts, m, n, k, top_k, ids, slotted, route, seed, framework = case
    rng = np.random.default_rng(seed)
    w = rng.uniform(-1, 1, (n_experts, n, k)).astype(NP_DTYPE[dtype])
    x = rng.uniform(-1, 1, (m, top_k, k) if slotted else (m, k)).astype(np.float32)
    ids = np.array(ids, np.int64)
    if framework == "torch":  # CPU tensors run on the CPU backend, in place
        torch = _torch()
        args = (
            torch.from_numpy(w.view(np.uint16)).view(torch.bfloat16) if dtype is DType.BF16 else torch.from_numpy(w),
            torch.from_numpy(x),
            torch.from_numpy(ids),
        )
        call = lambda: routemm.matmul_id(*args, route=route).numpy()  # noqa: E731
    else:
        call = lambda: routemm.matmul_id(w, x, ids, route=route, device=device)  # noqa: E731
    # Tensors route by shape alone, so an explicit grouped_prefill only needs top_k <= n_experts
    # there (the grouped kernels compute repeated ids, bit-identical to direct); NumPy arrays,
    # which are on the host anyway, are checked for distinct ids.
    refused = not _declarable_distinct(ids, n_experts) if framework == "numpy" else top_k > n_experts
    if route is Route.GROUPED_PREFILL and refused:
        with pytest.raises(routemm.InvalidArgumentError):
            call()
        return
    out = call()
    valid = (ids >= 0) & (ids < n_experts)
    ref, mag = reference(w, x, np.where(valid, ids, 0xFFFFFFFF).astype(np.uint32), slotted)
    assert np.all(out[~valid.reshape(-1)].view(np.uint32) == 0)
    assert_close(out, ref, mag, dtype=dtype, k=k)


# ---- quantized_matmul_ggml ----------------------------------------------------------------------------


@dataclasses.dataclass
class Q4Case:
    m: int
    n: int
    k: int
    policy: tuple[str, bool]
    seed: int
    gaps: list[int]


q4_cases = st.builds(
    Q4Case,
    m=st.integers(1, 20),
    n=st.integers(1, 24),
    k=st.sampled_from([32, 64, 96, 160]),
    policy=st.tuples(st.sampled_from(["auto_probe", "force_simd"]), st.booleans()),
    seed=st.integers(0, 2**32 - 1),
    gaps=gap_list,
)


def _q4_arena(device, c: Q4Case, short: str | None = None):
    rng = np.random.default_rng(c.seed)
    blocks = q4_0.quantize(rng.uniform(-1, 1, (c.n, c.k)).astype(np.float32))
    x = rng.uniform(-1, 1, (c.m, c.k)).astype(np.float32)
    parts = {
        "input": (x.view(np.uint8).reshape(-1), DType.F32, x.shape),
        "weight": (blocks.reshape(-1), DType.U8, blocks.shape),
        "output": (poison_output(c.m, c.n), DType.F32, (c.m, c.n)),
    }
    if short is not None:
        payload, dtype, _ = parts[short]
        parts[short] = (payload[: payload.nbytes - dtype.size], dtype, ())
    arena = make_arena(device, [(name, *part) for name, part in parts.items()], c.gaps)
    return arena, x, q4_0.dequantize(blocks)


def _q4_call(device, registry, arena, c: Q4Case):
    v = arena.views
    encoder = device.command_encoder()
    params = routemm.GgmlQuantizedMatmulParams(c.m, c.n, c.k)
    receipt = routemm.quantized_matmul_ggml(
        encoder, registry, v["input"], v["weight"], v["output"], params, routemm.GgmlRoutingPolicy(*c.policy)
    )
    encoder.commit_and_wait()
    return receipt


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES[:2])
@bounded(60)
@given(q4_cases)
def test_quantized_matmul_matches_reference_inside_a_shared_buffer(device, registry, c):
    arena, x, w = _q4_arena(device, c)
    receipt = _q4_call(device, registry, arena, c)
    arena.assert_only_written("output")
    words = arena.words("output")
    assert not np.any(words == POISON_U32), "output element(s) unwritten"
    got = words.view(np.float32).reshape(c.m, c.n).astype(np.float64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref, magnitude = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    if device.backend == "cuda":
        bound = q4_gpu_bound(receipt.route, c.k, magnitude)
    else:
        bound = accumulation_bound(c.k, magnitude)
    assert np.all(np.abs(got - ref) <= bound), f"{receipt.route}: worst excess {np.max(np.abs(got - ref) - bound):.3e}"


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES[:2])
@bounded(30)
@given(q4_cases, st.sampled_from(["input", "weight", "output"]))
def test_quantized_matmul_one_element_short_is_refused(device, registry, c, short):
    arena, _, _ = _q4_arena(device, c, short=short)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match=f"{short.capitalize()} buffer too small"):
        _q4_call(device, registry, arena, c)
    assert routemm.dispatch_count() == before
    assert np.array_equal(arena.now(), arena.initial)


# ---- raw dispatch ---------------------------------------------------------------------------------------

RAW_DISPATCH_EXAMPLES = 60
EXTREME_WORDS = (0, 1, 7, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**32, 2**62, 2**63, 2**64 - 1)


def _proof_case(words: int, slots: int, guarded: int):
    """Raw arguments of a calibration proof kernel: `slots` F32/U32 buffers of `words` elements,
    then its params with 8 logical elements of `guarded`."""
    buffers = [(slot, (slot, DType.U32 if slot == 2 else DType.F32, words), 0) for slot in range(slots)]
    return buffers + [(slots, struct.pack("<QQII", 8, guarded, 0, 0))], (16, 1, 1), (16, 1, 1)


# Failing examples found, kept as regression cases: {pipeline name: [raw_arguments() values]}.
RAW_DISPATCH_REGRESSIONS = {
    # guarded_elements * 4 wrapped to 0 and passed the extent check of 16-element buffers.
    "routemm_calibration_poison_f32": [_proof_case(16, 2, 2**62), _proof_case(16, 2, 2**63)],
    "routemm_calibration_compare_f32": [_proof_case(16, 3, 2**62)],
}


def binding_templates(device, registry) -> dict[str, tuple[list[dict], routemm.DispatchKind]]:
    """{pipeline label: (bindings, dispatch kind)} of the dispatches the op front doors encode
    for small valid calls, read back from capture mode: which slots hold buffers and which hold
    the params struct, and a well-formed params struct to mutate."""
    from routemm.calibration import ProofKernels

    out = {}

    def record(call):
        encoder = device.command_encoder()
        encoder.start_capture()
        try:
            call(encoder)
        except routemm.Error:  # a route this backend does not run
            encoder.take_capture()
            return
        for node in encoder.take_capture():
            if not node.is_barrier:
                out.setdefault(node.dispatch.pipeline_label, (list(node.bindings), node.dispatch.dispatch_kind))

    def buf(nbytes, dtype, shape):
        b = device.alloc(nbytes, dtype, shape)
        b.copy_from_numpy(np.zeros(nbytes, np.uint8))
        return b

    m, n, k, top_k, e = 9, 3, 64, 2, 3
    for dtype in WEIGHT_DTYPES:
        w = buf(e * n * k * dtype.size, dtype, [e, n, k])
        x, ids, y = buf(m * k * 4, DType.F32, [m, k]), buf(m * top_k * 4, DType.U32, [m, top_k]), None
        y = buf(m * top_k * n * 4, DType.F32, [m * top_k, n])
        scratch = routemm.DenseMatmulIdScratch(device, e, m)
        for route in Route:
            params = routemm.DenseMatmulIdParams(m, n, k, top_k, e, n * k * dtype.size, route=route)
            record(lambda enc, p=params: routemm.dense_matmul_id(enc, registry, w, x, ids, y, scratch, p))
    blocks = buf(n * k // 32 * 18, DType.U8, [n * k // 32 * 18])
    for rows in (1, m):
        x, y = buf(rows * k * 4, DType.F32, [rows, k]), buf(rows * n * 4, DType.F32, [rows, n])
        params = routemm.GgmlQuantizedMatmulParams(rows, n, k)
        record(lambda enc, x=x, y=y, p=params: routemm.quantized_matmul_ggml(enc, registry, x, blocks, y, p))
        for q4_route in routemm.DenseQ4Route:
            record(
                lambda enc, x=x, y=y, p=params, r=q4_route: routemm.encode_q4_route(enc, registry, x, blocks, y, p, r)
            )
    proof = ProofKernels(registry)
    a, b, statuses = buf(64, DType.F32, [16]), buf(64, DType.F32, [16]), buf(16, DType.U32, [4])
    record(lambda enc: proof.encode_poison(enc, a, b, 8, 16))
    record(lambda enc: proof.encode_compare(enc, a, b, statuses, 1, 8, 16))
    return out


@st.composite
def mutated_blob(draw, blob: bytes) -> bytes:
    """The params struct with some 4- or 8-byte words replaced (extreme or random), or a random
    length."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(min_size=0, max_size=len(blob) + 16))
    data = bytearray(blob)
    for _ in range(draw(st.integers(0, 4))):
        width = draw(st.sampled_from([4, 8]))
        if len(data) < width:
            break
        at = draw(st.integers(0, len(data) // width - 1)) * width
        value = draw(st.one_of(st.sampled_from(EXTREME_WORDS), st.integers(0, 2**64 - 1))) % (1 << (8 * width))
        data[at : at + width] = value.to_bytes(width, "little")
    return bytes(data)


@st.composite
def raw_arguments(draw, template: list[dict], max_grid: int = 70):
    """Bindings shaped like `template` (sometimes a slot dropped, added or rebound), each buffer of
    a random size and dtype at a random offset, sometimes one buffer bound to two slots; a
    random grid (each dimension up to `max_grid`, or one of two huge values)."""
    args, buffers = [], []
    for binding in template:
        if draw(st.integers(0, 19)) == 0:
            continue  # a slot left unbound
        slot = binding["slot"]
        if "bytes" in binding:
            args.append((slot, draw(mutated_blob(bytes(binding["bytes"])))))
            continue
        if buffers and draw(st.integers(0, 9)) == 0:
            spec = draw(st.sampled_from(buffers))  # the same buffer at two slots
        else:
            dtype = draw(st.sampled_from([DType.F32, DType.U32, DType.U8, DType.F16, DType.BF16]))
            spec = (len(buffers), dtype, draw(st.one_of(st.integers(1, 64), st.integers(65, 2048))))
            buffers.append(spec)
        offset = draw(st.one_of(st.just(0), st.integers(0, 300), st.sampled_from([2**32, 2**63])))
        args.append((slot, spec, offset))
    if draw(st.integers(0, 9)) == 0:
        args.append((draw(st.integers(0, 40)), draw(st.binary(max_size=16))))
    grid = tuple(draw(st.one_of(st.integers(0, max_grid), st.sampled_from([2**31, 2**32 - 1]))) for _ in range(3))
    threads = (draw(st.sampled_from([1, 8, 32, 64, 256, 1024, 4096])), 1, 1)
    return args, grid, threads


def run_raw_dispatch_property(backend: str, label: str, max_examples: int) -> None:
    """Random raw dispatches shaped like the op's own: each is refused with a routemm.Error (when
    encoded or when run) or runs; the process survives either way. Runs in a child process."""
    device = routemm.Device(backend)
    registry = routemm.KernelRegistry(device)
    template, kind = binding_templates(device, registry)[label]
    pipeline = registry.get_pipeline(label.split("|")[0])

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    # The Metal model runs every thread as a fiber: small grids keep an example under a second
    # (the huge values still reach it, and it refuses them).
    @given(raw_arguments(template, max_grid=8 if backend == "metal_emu" else 70))
    def prop(drawn):
        args, grid, threads = drawn
        made, bound = {}, []
        for arg in args:
            if len(arg) == 2:
                bound.append(arg)
                continue
            slot, (index, dtype, count), offset = arg
            if index not in made:
                made[index] = device.alloc(count * dtype.size, dtype, [count])
                made[index].copy_from_numpy(np.zeros(count * dtype.size, np.uint8))
            bound.append((slot, (made[index], offset) if offset else made[index]))
        encoder = device.command_encoder()
        try:
            encoder.dispatch(pipeline, bound, grid, threads, dispatch_kind=kind)
            encoder.commit_and_wait()
        except routemm.Error:
            pass

    for case in RAW_DISPATCH_REGRESSIONS.get(label.split("|")[0], ()):
        prop = example(case)(prop)
    prop()


def _raw_dispatch_params():
    params = []
    for backend in routemm.available_backends():
        device = routemm.Device(backend)
        labels = sorted(binding_templates(device, routemm.KernelRegistry(device)))
        for label in labels:
            name = label.split("|")[0]
            params.append(pytest.param(backend, label, id=f"{backend}-{name}"))
    return params


@pytest.mark.parametrize("backend,label", _raw_dispatch_params())
def test_raw_dispatch_refuses_or_runs_never_crashes(backend, label):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {tests_dir!r})
        import test_properties_ops as t
        t.run_raw_dispatch_property({backend!r}, {label!r}, {examples(RAW_DISPATCH_EXAMPLES)})
        """
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, f"exit status {child.returncode}\n{child.stdout[-3000:]}\n{child.stderr[-3000:]}"
