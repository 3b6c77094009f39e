"""CommandEncoder: barriers, raw dispatch, receipts, capture, counters, timing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import routemm
from routemm import DispatchKind, DType
from support import pack_kernel_params, validate

PIPE = "dense_matmul_id_direct_f32_f32"


def _raw_direct(device, rng, m=3, n=5, k=7, n_experts=2):
    """Buffers and bound args of a raw direct-kernel dispatch (shared per-token input)."""
    w = rng.uniform(-1, 1, (n_experts, n, k)).astype(np.float32)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    ids = (np.arange(m) % n_experts).astype(np.uint32).reshape(m, 1)
    out = device.alloc(m * n * 4, DType.F32, [m, n])
    out.copy_from_numpy(np.full((m, n), np.nan, np.float32))
    bufs = [device.from_numpy(w), device.from_numpy(x), device.from_numpy(ids), out]
    args = [(0, pack_kernel_params(m, n, k, 1, n_experts, n * k * 4))] + [(i + 1, b) for i, b in enumerate(bufs)]
    want = np.stack([w[ids[t, 0]].astype(np.float64) @ x[t] for t in range(m)])
    return args, out, want, ((n + 7) // 8, m, 1)


def test_barrier_before_any_dispatch_is_a_noop(device):
    enc = device.command_encoder()
    before = routemm.encoder_counters()["barriers"]
    enc.memory_barrier()
    enc.memory_barrier()
    assert routemm.encoder_counters()["barriers"] == before
    enc.start_capture()
    enc.memory_barrier()  # but it is always recorded in capture mode
    nodes = enc.take_capture()
    assert [n.kind for n in nodes] == ["barrier"]
    assert routemm.encoder_counters()["barriers"] == before


def test_raw_dispatch_runs_and_counts(device, registry, rng):
    pipeline = registry.get_pipeline(PIPE)
    args, out, want, grid = _raw_direct(device, rng)
    enc = device.command_encoder()
    c0 = routemm.encoder_counters()
    d0 = routemm.dispatch_count()
    enc.dispatch(pipeline, args, grid, (64, 1, 1))
    assert routemm.dispatch_count() == d0 + 1
    assert enc.pending_dispatches == 1
    enc.memory_barrier()  # after a dispatch, a real barrier
    assert routemm.encoder_counters()["barriers"] == c0["barriers"] + 1
    enc.commit_and_wait()
    assert enc.pending_dispatches == 0
    c1 = routemm.encoder_counters()
    assert c1["commits"] == c0["commits"] + 1 and c1["dispatches"] == c0["dispatches"] + 1
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_raw_dispatch_with_explicit_offset(device, registry, rng):
    """(Buffer, offset) binds at the explicit offset, ignoring the view's own byte_offset."""
    pipeline = registry.get_pipeline(PIPE)
    args, out, want, grid = _raw_direct(device, rng)
    m, n = want.shape
    parent = device.alloc(64 + m * n * 4, DType.F32)
    parent.copy_from_numpy(np.zeros(16 + m * n, np.float32))
    view = parent.view(64, m * n * 4, DType.F32)  # a view at 64, but bound at 16
    args[4] = (4, (view, 16))
    enc = device.command_encoder()
    enc.dispatch(pipeline, args, grid, (64, 1, 1))
    enc.commit_and_wait()
    got = parent.numpy()
    np.testing.assert_allclose(got[4 : 4 + m * n].reshape(m, n), want, rtol=1e-5, atol=1e-5)
    assert np.all(got[:4] == 0) and np.all(got[4 + m * n :] == 0)


def test_raw_dispatch_rejections_leave_no_trace(device, registry, rng):
    pipeline = registry.get_pipeline(PIPE)
    args, _, _, grid = _raw_direct(device, rng)
    enc = device.command_encoder()
    enc.start_encoded_dispatch_receipt(4)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError):
        enc.dispatch(pipeline, args + [(1, args[1][1])], grid, (64, 1, 1))  # slot bound twice
    with pytest.raises(routemm.InvalidArgumentError):
        enc.dispatch(pipeline, args + [(10_000, b"x")], grid, (64, 1, 1))  # slot out of range
    with pytest.raises(routemm.InvalidArgumentError):
        enc.dispatch(pipeline, args[:4] + [(4, (args[4][1], 1 << 40))], grid, (64, 1, 1))  # offset past end
    assert routemm.dispatch_count() == before and enc.pending_dispatches == 0
    assert enc.take_encoded_dispatch_receipt() == []


def test_receipt_records_and_overflows(device, registry, rng):
    pipeline = registry.get_pipeline(PIPE, [(700, 1), (701, 1)])
    args, out, want, grid = _raw_direct(device, rng)
    enc = device.command_encoder()
    enc.start_encoded_dispatch_receipt(1)
    enc.memory_barrier()  # barriers are never recorded
    enc.dispatch(pipeline, args, grid, (64, 1, 1), threadgroup_memory=[(0, 128)])
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError):
        enc.dispatch(pipeline, args, grid, (64, 1, 1))
    assert routemm.dispatch_count() == before and enc.pending_dispatches == 1
    (rec,) = enc.take_encoded_dispatch_receipt()
    validate(rec)
    assert rec == routemm.EncodedKernelDispatch(
        f"{PIPE}|700:i1|701:i1", DispatchKind.THREAD_GROUPS, grid, (64, 1, 1), ((0, 128),)
    )
    enc.commit_and_wait()  # receipts record dispatches that still execute
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_threads_dispatch_kind_recorded(device, registry, rng):
    args, _, _, grid = _raw_direct(device, rng)
    enc = device.command_encoder()
    enc.start_encoded_dispatch_receipt(1)
    enc.dispatch(registry.get_pipeline(PIPE), args, grid, (64, 1, 1), dispatch_kind=DispatchKind.THREADS)
    (rec,) = enc.take_encoded_dispatch_receipt()
    assert rec.dispatch_kind is DispatchKind.THREADS
    validate(rec)
    enc.commit_and_wait()


def test_receipt_and_capture_exclusive(device):
    enc = device.command_encoder()
    enc.start_capture()
    with pytest.raises(routemm.InvalidArgumentError):
        enc.start_encoded_dispatch_receipt(2)
    assert not enc.has_open_receipt()
    assert enc.take_capture() == []
    enc.start_encoded_dispatch_receipt(2)
    with pytest.raises(routemm.InvalidArgumentError):
        enc.start_capture()
    assert not enc.is_capturing()
    with pytest.raises(routemm.InvalidArgumentError):
        enc.start_encoded_dispatch_receipt(2)  # already open
    assert enc.take_encoded_dispatch_receipt() == []
    with pytest.raises(routemm.InvalidArgumentError):
        enc.take_encoded_dispatch_receipt()  # none open
    with pytest.raises(routemm.InvalidArgumentError):
        enc.start_encoded_dispatch_receipt(0)
    assert enc.take_capture() is None  # not capturing
    enc.start_capture()
    with pytest.raises(routemm.InvalidArgumentError):
        enc.start_capture()  # already capturing
    assert enc.take_capture() == []


def test_capture_records_instead_of_running(device, registry, rng):
    pipeline = registry.get_pipeline(PIPE)
    args, out, want, grid = _raw_direct(device, rng)
    enc = device.command_encoder()
    enc.start_capture()
    before = routemm.dispatch_count()
    enc.set_pending_buffer_ranges([(1, 2)], [(3, 4)])
    enc.dispatch(pipeline, args, grid, (64, 1, 1))
    enc.memory_barrier()
    enc.dispatch(pipeline, args, grid, (64, 1, 1))  # pending ranges were consumed by the first
    assert routemm.dispatch_count() == before + 2
    nodes = enc.take_capture()
    assert [n.kind for n in nodes] == ["dispatch", "barrier", "dispatch"]
    assert (nodes[0].reads, nodes[0].writes) == (((1, 2),), ((3, 4),))
    assert (nodes[2].reads, nodes[2].writes) == ((), ())
    assert nodes[0].dispatch.pipeline_label == PIPE
    assert nodes[0].bindings[0]["bytes"] == args[0][1]
    enc.commit_and_wait()
    assert np.all(np.isnan(out.numpy()))  # nothing ran
    # Outside capture mode pending ranges are ignored.
    enc.set_pending_buffer_ranges([(1, 2)], [(3, 4)])
    enc.start_capture()
    enc.dispatch(pipeline, args, grid, (64, 1, 1))
    (node,) = enc.take_capture()
    assert (node.reads, node.writes) == ((), ())


def test_commit_wait_with_gpu_time(device, registry, rng):
    args, out, want, grid = _raw_direct(device, rng)
    enc = device.command_encoder()
    enc.dispatch(registry.get_pipeline(PIPE), args, grid, (64, 1, 1))
    start, end = enc.commit_wait_with_gpu_time()
    assert math.isfinite(start) and math.isfinite(end) and end >= start
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    start, end = device.command_encoder().commit_wait_with_gpu_time()  # empty submission
    assert math.isfinite(start) and math.isfinite(end) and end >= start


def test_counters_and_reset(device):
    before = routemm.encoder_counters()["encoders_created"]
    device.command_encoder()
    assert routemm.encoder_counters()["encoders_created"] == before + 1
    routemm.reset_encoder_counters()
    assert set(routemm.encoder_counters().values()) == {0}
    assert routemm.dispatch_count() == 0
