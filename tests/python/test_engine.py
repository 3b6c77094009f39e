"""The encoder inside an engine's decode loop: async commit, labels, counters, streams, tracked
dispatches, graph replay (derived barriers, reorder, sessions), all on every available backend."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from support import distinct_ids, random_weights

E, N, K = 8, 48, 64


def _problem(device, rng, m: int, top_k: int = 2, dtype: DType = DType.BF16):
    w = random_weights(rng, dtype, (E, N, K))
    x = rng.uniform(-1, 1, (m, K)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, E).astype(np.uint32)
    params = routemm.DenseMatmulIdParams(
        m=m, n=N, k=K, top_k=top_k, n_experts=E, expert_stride_bytes=N * K * dtype.size, route=Route.DIRECT
    )
    buffers = (
        device.from_numpy(w, dtype),
        device.from_numpy(x),
        device.from_numpy(ids),
    )
    return params, buffers


def _out(device, m, top_k=2):
    return device.alloc(m * top_k * N * 4, DType.F32, [m * top_k, N])


def test_commit_is_asynchronous_and_wait_completes(device, registry, rng):
    params, (w, x, ids) = _problem(device, rng, 4)
    out = _out(device, 4)
    eager = _out(device, 4)
    encoder = device.command_encoder()
    routemm.dense_matmul_id(encoder, registry, w, x, ids, eager, None, params)
    encoder.commit_and_wait()
    before = routemm.encoder_counters()
    routemm.dense_matmul_id(encoder, registry, w, x, ids, out, None, params)
    encoder.commit_labeled("decode step 0")
    after_commit = routemm.encoder_counters()
    assert after_commit["commits"] == before["commits"] + 1
    assert after_commit["waits"] == before["waits"]  # commit never waits
    assert after_commit["command_buffers"] == before["command_buffers"] + 1
    encoder.wait_until_completed()
    assert routemm.encoder_counters()["waits"] == before["waits"] + 1
    assert np.array_equal(out.numpy().view(np.uint32), eager.numpy().view(np.uint32))


def test_counters_name_every_spec_counter():
    c = routemm.encoder_counters()
    for key in (
        "encoders_created",
        "command_buffers",
        "dispatches",
        "barriers",
        "commits",
        "waits",
        "streams_created",
        "device_allocations",
        "host_waits",
    ):
        assert isinstance(c[key], int)


def test_labels_are_checked(device):
    encoder = device.command_encoder()
    for bad in ("", "x" * 257, "tab\there"):
        with pytest.raises(routemm.InvalidArgumentError, match="commit label"):
            encoder.commit_labeled(bad)
        with pytest.raises(routemm.InvalidArgumentError, match="commit label"):
            encoder.commit_and_wait_labeled(bad)
    encoder.commit_and_wait_labeled("layer 3 experts")


def test_dropping_an_encoder_never_runs_its_work(device, registry, rng):
    params, (w, x, ids) = _problem(device, rng, 2)
    out = device.from_numpy(np.full((4, N), 7.0, np.float32))
    encoder = device.command_encoder()
    routemm.dense_matmul_id(encoder, registry, w, x, ids, out, None, params)
    del encoder
    device.command_encoder().commit_and_wait()  # anything queued on the device has run now
    assert np.all(out.numpy() == 7.0)


@pytest.mark.parametrize("backend", ["cpu"])
def test_wait_releases_the_gil(backend, rng):
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    m, n, k = 64, 1024, 1024
    w = rng.standard_normal((E, n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = distinct_ids(rng, m, 2, E).astype(np.uint32)
    params = routemm.DenseMatmulIdParams(
        m=m, n=n, k=k, top_k=2, n_experts=E, expert_stride_bytes=n * k * 4, route=Route.DIRECT
    )
    bufs = device.from_numpy(w), device.from_numpy(x), device.from_numpy(ids)
    out = device.alloc(m * 2 * n * 4, DType.F32, [m * 2, n])
    encoder = device.command_encoder()
    for _ in range(4):
        routemm.dense_matmul_id(encoder, registry, *bufs, out, None, params)
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t0 = time.perf_counter()
    encoder.commit()
    committed = time.perf_counter()
    thread = threading.Thread(target=tick)
    thread.start()
    encoder.wait_until_completed()
    done = time.perf_counter()
    stop.set()
    thread.join()
    assert committed - t0 < (done - t0) / 2, "commit() waited for the work"
    assert sum(committed < t < done for t in ticks) >= 2, "another thread could not run during the wait"


@pytest.mark.parametrize("backend", ["cpu"])
def test_cpu_submissions_from_many_threads_keep_their_results(backend):
    """The CPU queue runs a submission on the waiting thread when it is next in line (no hand-off),
    else on the submission thread: under threads that commit and wait at once, commit several
    times before one wait, or wait while others' work runs, every submission still runs exactly
    once, whole, and gives the single-threaded bits."""
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(7)
    problems = [_problem(device, rng, m) for m in (1, 3, 5, 2)]
    expected = []
    for params, bufs in problems:
        out = _out(device, params.m)
        encoder = device.command_encoder()
        routemm.dense_matmul_id(encoder, registry, *bufs, out, None, params)
        encoder.commit_and_wait()
        expected.append(out.numpy().copy())
    failures = []

    def worker(index: int) -> None:
        params, bufs = problems[index % len(problems)]
        poison = np.full((params.m * 2, N), np.nan, np.float32)
        for step in range(40):
            encoders, outs = [], []
            for _ in range(1 + step % 3):  # one to three submissions in flight before the waits
                out = device.from_numpy(poison)
                outs.append(out)
                encoder = device.command_encoder()
                routemm.dense_matmul_id(encoder, registry, *bufs, out, None, params)
                encoder.commit()
                encoders.append(encoder)
            for encoder, out in zip(encoders, outs, strict=True):
                encoder.wait_until_completed()
                if not np.array_equal(out.numpy().view(np.uint32), expected[index % len(problems)].view(np.uint32)):
                    failures.append((index, step))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]


@pytest.mark.parametrize("backend", ["cpu"])
def test_cpu_submissions_run_in_commit_order_across_encoders(backend):
    """A submission committed after another, from another encoder, sees its writes: the CPU queue
    runs submissions in commit order, and a waiter only ever takes the head of the line itself.
    The first submission is left to run asynchronously (slow: m = 64); the second reads its output
    as its own input and is waited on at once."""
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(11)
    m, top_k, n1, k1, n2 = 64, 2, 256, 1024, 32
    w1 = rng.standard_normal((E, n1, k1)).astype(np.float32)
    w2 = rng.standard_normal((E, n2, n1)).astype(np.float32)
    x = rng.standard_normal((m, k1)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, E).astype(np.uint32)
    first = routemm.DenseMatmulIdParams(m, n1, k1, top_k, E, n1 * k1 * 4, route=Route.DIRECT)
    second = routemm.DenseMatmulIdParams(
        m, n2, n1, top_k, E, n2 * n1 * 4, routemm.DenseMatmulIdInputLayout.SLOTTED, route=Route.DIRECT
    )
    ids_buf = device.from_numpy(ids)
    for _ in range(5):
        middle = device.from_numpy(np.full((m * top_k, n1), np.nan, np.float32))
        out = device.from_numpy(np.full((m * top_k, n2), np.nan, np.float32))
        producer, consumer = device.command_encoder(), device.command_encoder()
        routemm.dense_matmul_id(
            producer, registry, device.from_numpy(w1), device.from_numpy(x), ids_buf, middle, None, first
        )
        producer.commit()
        routemm.dense_matmul_id(consumer, registry, device.from_numpy(w2), middle, ids_buf, out, None, second)
        consumer.commit_and_wait()
        producer.wait_until_completed()
        got_middle = middle.numpy()
        assert np.all(np.isfinite(got_middle))
        expected = np.stack([w2[e] @ got_middle[f] for f, e in enumerate(ids.reshape(-1))])
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-3)


def test_stream_argument(device):
    if device.backend != "cuda":
        with pytest.raises(routemm.InvalidArgumentError, match="stream"):
            device.command_encoder(stream=123456)
    with pytest.raises(routemm.InvalidArgumentError, match="stream must be"):
        device.command_encoder(stream="default")
    with pytest.raises(routemm.InvalidArgumentError, match="stream must be"):
        device.command_encoder(stream=True)
    with pytest.raises(routemm.InvalidArgumentError, match="auto_barrier"):
        device.command_encoder(auto_barrier=1)


def test_stream_handles_of_framework_streams():
    from routemm.core._core_api import stream_handle

    class TorchLike:
        cuda_stream = 0x7F00

    class CuPyLike:
        ptr = 0x7F10

    assert stream_handle(None) is None
    assert stream_handle(5) == 5
    assert stream_handle(TorchLike()) == 0x7F00
    assert stream_handle(CuPyLike()) == 0x7F10
    with pytest.raises(routemm.InvalidArgumentError):
        stream_handle(-1)


def test_auto_barrier_knob_and_tracked_dispatch(device, registry, rng):
    encoder = device.command_encoder(auto_barrier=True)
    assert encoder.auto_barrier
    poison = registry.get_pipeline("routemm_calibration_poison_f32")
    a = device.alloc(64, DType.F32, [16])
    b = device.alloc(64, DType.F32, [16])
    params = struct.pack("<QQII", 16, 16, 0, 0)  # CalibrationKernelParams
    args = [(2, params), (0, a), (1, b)]
    before = routemm.encoder_counters()["barriers"]
    encoder.dispatch_tracked(poison, args, (1, 1, 1), (16, 1, 1), reads=[b], writes=[a])
    encoder.dispatch_tracked(poison, args, (1, 1, 1), (16, 1, 1), reads=[b], writes=[a])  # WAW
    assert routemm.encoder_counters()["barriers"] == before + 1
    encoder.auto_barrier = False
    encoder.dispatch_tracked(poison, args, (1, 1, 1), (16, 1, 1), reads=[b], writes=[a])
    assert routemm.encoder_counters()["barriers"] == before + 1
    encoder.commit_and_wait()
    assert device.command_encoder().auto_barrier is False  # the knob's default


def _capture_two_calls(device, registry, rng, m=2):
    params, (w, x, ids) = _problem(device, rng, m)
    outs = [_out(device, m), _out(device, m)]
    encoder = device.command_encoder()
    encoder.start_capture()
    encoder.set_op_kind("rms_norm")  # tags the next dispatch only
    for out in outs:
        routemm.dense_matmul_id(encoder, registry, w, x, ids, out, None, params)
    graph = encoder.take_graph()
    return graph, outs, (params, w, x, ids)


def test_graph_replay_is_bit_identical_to_eager(device, registry, rng):
    graph, outs, (params, w, x, ids) = _capture_two_calls(device, registry, rng)
    assert graph.dispatch_count == 2
    nodes = graph.nodes
    assert [n.op_kind for n in nodes] == ["rms_norm", "other"]
    assert all(n.writes for n in nodes)
    eager = _out(device, 2)
    encoder = device.command_encoder()
    routemm.dense_matmul_id(encoder, registry, w, x, ids, eager, None, params)
    encoder.commit_and_wait()
    assert graph.barriers_before() == [False, False]  # the two calls write different outputs
    assert graph.dependencies() == [[], []]
    for replay in (graph.encode_sequential, graph.encode_with_barriers, graph.reordered().encode_with_barriers):
        for out in outs:
            out.copy_from_numpy(np.zeros((4, N), np.float32))
        enc = device.command_encoder()
        replay(enc)
        enc.commit_and_wait()
        for out in outs:
            assert np.array_equal(out.numpy().view(np.uint32), eager.numpy().view(np.uint32))
    exec_ = graph.instantiate(device)
    if device.backend == "cuda":
        assert exec_.node_count == 2
        for out in outs:
            out.copy_from_numpy(np.zeros((4, N), np.float32))
        enc = device.command_encoder()
        enc.encode_graph(exec_)
        enc.commit_and_wait()
        for out in outs:
            assert np.array_equal(out.numpy().view(np.uint32), eager.numpy().view(np.uint32))
    else:
        assert exec_ is None


def test_grouped_session_finishes_with_reorder(device, registry, rng):
    """The spec's recorded session: a grouped call carries complete hazard ranges."""
    m = 12
    params, (w, x, ids) = _problem(device, rng, m)
    params = routemm.DenseMatmulIdParams(**{**params.__dict__, "route": Route.GROUPED_PREFILL})
    scratch = routemm.DenseMatmulIdScratch(device, E, m)
    out, eager = _out(device, m), _out(device, m)
    encoder = device.command_encoder()
    routemm.dense_matmul_id(encoder, registry, w, x, ids, eager, scratch, params)
    encoder.commit_and_wait()
    session = routemm.GraphSession(encoder)
    routemm.dense_matmul_id(session.encoder, registry, w, x, ids, out, scratch, params)
    session.finish_with_reorder()
    assert not encoder.is_capturing()
    assert np.array_equal(out.numpy().view(np.uint32), eager.numpy().view(np.uint32))


def test_reorder_refuses_dispatches_without_ranges(device, registry):
    poison = registry.get_pipeline("routemm_calibration_poison_f32")
    a = device.alloc(64, DType.F32, [16])
    b = device.alloc(64, DType.F32, [16])
    encoder = device.command_encoder()
    encoder.start_capture()
    params = struct.pack("<QQII", 16, 16, 0, 0)
    encoder.dispatch(poison, [(2, params), (0, a), (1, b)], (1, 1, 1), (16, 1, 1))
    graph = encoder.take_graph()
    with pytest.raises(routemm.InvalidArgumentError, match="complete hazard ranges"):
        graph.reordered()
    with pytest.raises(routemm.InvalidArgumentError, match="unknown op kind"):
        encoder.set_op_kind("matmul")


def test_scratch_from_caller_buffers(device):
    counts = device.alloc(4 * E, DType.U32, [E])
    rows = device.alloc(4 * E * 3, DType.U32, [E, 3])
    scratch = routemm.DenseMatmulIdScratch.from_buffers(counts, rows, E, 3)
    assert (scratch.max_experts, scratch.max_tokens) == (E, 3)
    with pytest.raises(routemm.InvalidArgumentError, match="capacity needs"):
        routemm.DenseMatmulIdScratch.from_buffers(counts, rows, E, 4)
    with pytest.raises(routemm.InvalidArgumentError, match="must be u32"):
        routemm.DenseMatmulIdScratch.from_buffers(device.alloc(4 * E, DType.F32, [E]), rows, E, 3)
    with pytest.raises(routemm.InvalidArgumentError, match="must not overlap"):
        routemm.DenseMatmulIdScratch.from_buffers(rows.view(0, 4 * E, DType.U32, [E]), rows, E, 2)
