"""Capture nodes with hazard ranges (§7.4) and dispatch receipts/geometry of the trace example."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdRoute as Route
from routemm import DispatchKind, DType
from support import POISON_U32, WEIGHT_DTYPES, Case, distinct_ids, pack_kernel_params, random_weights, validate
from tolerances import assert_close

E = 8


def _trace_case(device, registry, rng, dtype=DType.F32, slotted=False):
    """The §7.4 trace example: m=9, top_k=6, n=7, k=35, 8 experts."""
    m, top_k, n, k = 9, 6, 7, 35
    w = random_weights(rng, dtype, (E, n, k))
    shape = (m * top_k, k) if slotted else (m, k)
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    return Case(device, registry, dtype, w, x, distinct_ids(rng, m, top_k, E), slotted=slotted, pad=12)


def _encode(case, enc, route, scratch=None):
    return routemm.dense_matmul_id(
        enc,
        case.registry,
        case.weights.view,
        case.input.view,
        case.id_buf.view,
        case.output.view,
        scratch or case.scratch,
        case.params(route),
    )


def _ranges(node):
    return sorted(node.reads), sorted(node.writes)


def _lr(buf):
    return tuple(buf.logical_range)


def _bound_buffer(node, slot):
    (b,) = [b for b in node.bindings if b["slot"] == slot]
    return b


def _assert_binding(node, slot, buf):
    b = _bound_buffer(node, slot)
    assert "bytes" not in b
    assert (b["address"], b["offset"]) == (buf.address, buf.byte_offset)


def test_two_grouped_calls_capture_sequence_and_ranges(device, registry, rng):
    a = _trace_case(device, registry, rng)
    b = _trace_case(device, registry, rng, dtype=DType.BF16, slotted=True)
    scratch = routemm.DenseMatmulIdScratch(device, E, 9)  # shared by both calls
    enc = device.command_encoder()
    enc.start_capture()
    assert enc.is_capturing()
    before = routemm.dispatch_count()
    for case in (a, b):
        receipt = _encode(case, enc, Route.GROUPED_PREFILL, scratch)
        assert receipt.dispatch_count == 2
        validate(receipt)
    assert routemm.dispatch_count() - before == 4  # capture mode still counts encodes
    nodes = enc.take_capture()
    assert not enc.is_capturing() and enc.take_capture() is None
    assert [n.kind for n in nodes] == ["barrier", "dispatch"] * 4
    assert all(isinstance(n, routemm.CapturedNode) for n in nodes)
    assert all(n.is_barrier == (n.kind == "barrier") for n in nodes)
    counts, routed = _lr(scratch.expert_counts), _lr(scratch.routed_rows)
    for case, (map_node, grouped_node) in zip((a, b), [(nodes[1], nodes[3]), (nodes[5], nodes[7])], strict=True):
        w, x, ids, out = (_lr(case.weights.view), _lr(case.input.view), _lr(case.id_buf.view), _lr(case.output.view))
        assert map_node.dispatch.pipeline_label == "dense_matmul_id_map_distinct"
        assert grouped_node.dispatch.pipeline_label == f"dense_matmul_id_grouped_{case.dtype.type_name}_f32"
        assert _ranges(map_node) == (sorted([ids]), sorted([counts, routed, out]))
        assert _ranges(grouped_node) == (sorted([w, x, counts, routed]), sorted([out]))
        # Bindings of §7.4: map 0 params, 1 ids, 2 counts, 3 routed, 4 output; grouped 0 params,
        # 1 weights, 2 input, 3 counts, 4 routed, 5 output.
        for node in (map_node, grouped_node):
            params = _bound_buffer(node, 0)["bytes"]
            assert params == pack_kernel_params(9, 7, 35, 6, E, case.stride, slotted=case.slotted)
            validate(node.dispatch)
        for slot, buf in (
            (1, case.id_buf.view),
            (2, scratch.expert_counts),
            (3, scratch.routed_rows),
            (4, case.output.view),
        ):
            _assert_binding(map_node, slot, buf)
        for slot, buf in (
            (1, case.weights.view),
            (2, case.input.view),
            (3, scratch.expert_counts),
            (4, scratch.routed_rows),
            (5, case.output.view),
        ):
            _assert_binding(grouped_node, slot, buf)
        assert len(map_node.bindings) == 5 and len(grouped_node.bindings) == 6
    # Nothing executed while capturing: outputs keep their poison even after a commit.
    enc.commit_and_wait()
    for case in (a, b):
        assert np.all(case.output.view_bytes().view(np.uint32) == POISON_U32)


def test_direct_capture_ranges_and_no_barriers(device, registry, rng):
    case = _trace_case(device, registry, rng, dtype=DType.F16)
    enc = device.command_encoder()
    enc.start_capture()
    _encode(case, enc, Route.DIRECT)
    _encode(case, enc, Route.DIRECT)
    nodes = enc.take_capture()
    assert [n.kind for n in nodes] == ["dispatch", "dispatch"]  # direct emits no barriers
    for node in nodes:
        assert node.dispatch.pipeline_label == "dense_matmul_id_direct_f16_f32"
        assert _ranges(node) == (
            sorted([_lr(case.weights.view), _lr(case.input.view), _lr(case.id_buf.view)]),
            [_lr(case.output.view)],
        )
        assert _bound_buffer(node, 0)["bytes"] == pack_kernel_params(9, 7, 35, 6, E, case.stride)
        for slot, buf in ((1, case.weights.view), (2, case.input.view), (3, case.id_buf.view), (4, case.output.view)):
            _assert_binding(node, slot, buf)
    # The logical ranges are the views (16-byte offset inside their allocations), not the parents.
    start, end = _lr(case.weights.view)
    assert start == case.weights.parent.address + 16 and end - start == case.weights.view.nbytes
    enc.commit_and_wait()
    assert np.all(case.output.view_bytes().view(np.uint32) == POISON_U32)


def _expected_geometry(dtype):
    direct = routemm.EncodedKernelDispatch(
        f"dense_matmul_id_direct_{dtype.type_name}_f32", DispatchKind.THREAD_GROUPS, (1, 54, 1), (64, 1, 1), ()
    )
    mapd = routemm.EncodedKernelDispatch(
        "dense_matmul_id_map_distinct", DispatchKind.THREAD_GROUPS, (1, 1, 1), (8, 1, 1), ()
    )
    grouped = routemm.EncodedKernelDispatch(
        f"dense_matmul_id_grouped_{dtype.type_name}_f32",
        DispatchKind.THREAD_GROUPS,
        (2, 1, 8),
        (256, 1, 1),
        ((0, 4096),),
    )
    return direct, mapd, grouped


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=lambda d: d.type_name)
def test_receipts_and_trace_geometry(device, registry, rng, backend, dtype):
    case = _trace_case(device, registry, rng, dtype=dtype)
    direct, mapd, grouped = _expected_geometry(dtype)
    outs = {}
    for route, n_disp in ((Route.DIRECT, 1), (Route.GROUPED_PREFILL, 2)):
        case.output.parent.copy_from_numpy(case.output.initial)
        enc = device.command_encoder()
        enc.start_encoded_dispatch_receipt(2)
        assert enc.has_open_receipt()
        receipt = _encode(case, enc, route)
        recorded = enc.take_encoded_dispatch_receipt()
        assert not enc.has_open_receipt()
        enc.commit_and_wait()  # recorded dispatches also ran
        outs[route] = case.output.view.numpy().reshape(54, 7)
        validate(receipt)
        assert (receipt.weight_dtype, receipt.route, receipt.dispatch_count) == (dtype, route, n_disp)
        assert len(recorded) == n_disp
        for d in recorded:
            validate(d)
            assert d.dispatch_kind is DispatchKind.THREAD_GROUPS
        labels = [d.pipeline_label for d in recorded]
        if route is Route.DIRECT:
            assert labels == [direct.pipeline_label]
            if backend == "cpu":
                assert recorded == [direct]
        else:
            assert labels == [mapd.pipeline_label, grouped.pipeline_label]
            if backend == "cpu":
                assert recorded == [mapd, grouped]
    ref, mag = case.reference()
    for out in outs.values():
        assert_close(out, ref, mag, dtype=dtype, k=35)
    assert np.array_equal(outs[Route.DIRECT].view(np.uint32), outs[Route.GROUPED_PREFILL].view(np.uint32))


@pytest.mark.parametrize(
    "m,n,top_k,grid_d,grid_g",
    [
        (1, 7, 1, (1, 1, 1), (1, 1, 8)),
        (33, 40, 6, (5, 198, 1), (5, 5, 8)),
        (8, 8, 2, (1, 16, 1), (1, 1, 8)),
    ],
)
def test_geometry_scales_with_shape(device, registry, rng, backend, m, n, top_k, grid_d, grid_g):
    if backend != "cpu":
        pytest.skip("launch geometry is pinned for the cpu backend only")
    k = 35
    w = random_weights(rng, DType.F32, (E, n, k))
    case = Case(
        device,
        registry,
        DType.F32,
        w,
        rng.uniform(-1, 1, (m, k)).astype(np.float32),
        distinct_ids(rng, m, top_k, E),
        slotted=False,
    )
    enc = device.command_encoder()
    enc.start_encoded_dispatch_receipt(3)
    _encode(case, enc, Route.DIRECT)
    _encode(case, enc, Route.GROUPED_PREFILL)
    d, mp, g = enc.take_encoded_dispatch_receipt()
    enc.commit_and_wait()
    assert (d.grid, d.threads_per_threadgroup) == (grid_d, (64, 1, 1))
    assert (mp.grid, mp.threads_per_threadgroup) == ((1, 1, 1), (E, 1, 1))
    assert (g.grid, g.threads_per_threadgroup, g.threadgroup_memory) == (grid_g, (256, 1, 1), ((0, 4096),))


def test_kernel_params_struct_layout():
    """The packed struct helper itself: 48 bytes, §7.4 field order."""
    raw = pack_kernel_params(9, 7, 35, 6, 8, 492, slotted=True)
    assert len(raw) == 48
    assert struct.unpack("<6I3Q", raw) == (9, 7, 35, 6, 8, 1, 492, 35 * 4 * 6, 35 * 4)
