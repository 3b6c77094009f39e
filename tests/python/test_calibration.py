"""Route-calibration engine and the dense Q4_0 plan (spec §6, §8), on every available backend."""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct

import numpy as np
import pytest
import routemm
from routemm import calibration as cal
from routemm import q4_0
from routemm.plans import dense_q4_plan as dq
from support import validate

# Most tests calibrate Q4_0 routes; the proof-kernel test below needs only the calibration kernels.
pytestmark = pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)

V2 = routemm.DenseQ4Route.COMPATIBILITY_V2
C64 = routemm.DenseQ4Route.TENSOR_64X32
S = routemm.DenseQ4SelectionStatus
_N = itertools.count(200)


def fresh_n() -> int:
    """A base-shape N no other test used, so the process cache starts cold for it."""
    return next(_N)


def weight(device, n, k, rng, nan_scale=False):
    blocks = q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32)).reshape(n, k // 32, 18)
    if nan_scale:
        blocks[:, :, 0:2] = np.frombuffer(struct.pack("<H", 0x7E00), np.uint8)
    return device.from_numpy(blocks.reshape(-1))


def case(w, n, k, ms):
    return routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, k), tuple(ms))


def samples(center):
    return [center - 2, center - 1, center, center + 1, center + 2]


def winner_timer(route, round_index, measured):
    # V2 wall (99,100,101) / GPU (89,90,91) vs candidate (69,70,71) / (59,60,61): spec §6.4's winner.
    wall, gpu = (100, 90) if route == V2.value else (70, 60)
    return samples(wall)[round_index], samples(gpu)[round_index]


# ---- engine ---------------------------------------------------------------------------------------


def dist(p25, med, p75):
    return dq.DenseQ4TimingDistribution(p25, med, p75, 5)


def test_distribution_percentiles():
    assert cal.distribution([5, 1, 4, 2, 3]) == (2.0, 3.0, 4.0, 5)


@pytest.mark.parametrize(
    "cand_wall,cand_gpu,expected",
    [
        ((69, 70, 71), (59, 60, 61), cal.Verdict.CANDIDATE_WINS),
        ((90, 94, 101), (59, 60, 61), cal.Verdict.NO_STABLE_WINNER),  # overlapping: p75 101 >= V2 p25 95
        ((69, 70, 71), (99, 100, 101), cal.Verdict.NO_STABLE_WINNER),  # contrary GPU: 100 > 1.02 * 90
        ((96, 97, 98), (59, 60, 61), cal.Verdict.NO_STABLE_WINNER),  # not material: 97 > 0.95 * 100
        ((99, 100, 101), (59, 60, 61), cal.Verdict.CONTROL_FASTEST),
    ],
)
def test_select_winner_rule(cand_wall, cand_gpu, expected):
    v2_wall = (
        dist(95, 100, 101) if expected is cal.Verdict.NO_STABLE_WINNER and cand_wall[2] == 101 else dist(99, 100, 101)
    )
    assert cal.select_winner(v2_wall, dist(89, 90, 91), dist(*cand_wall), dist(*cand_gpu)) is expected


@pytest.mark.parametrize(
    "count", [0, 1, cal.PROOF_INPUT_PERIOD - 1, cal.PROOF_INPUT_PERIOD, 3 * cal.PROOF_INPUT_PERIOD + 5]
)
def test_proof_input_is_the_spec_formula(count):
    """The tiled period equals the formula evaluated at every index, across period boundaries."""
    i = np.arange(count, dtype=np.int64)
    expected = ((29 * i) % 257 - 128) / 251.0 + ((43 * i) % 31 - 15) / 16381.0
    got = cal.proof_input(count)
    assert got.dtype == np.float32 and got.shape == (count,)
    assert np.array_equal(got, expected.astype(np.float32))
    if count:
        got[0] += 1  # a fresh array each call: the caller may perturb it (the fault hook does)
        assert cal.proof_input(count)[0] == np.float32(expected[0])


def test_proof_scratch_views_share_one_input_per_width(device):
    scratch = cal.ProofScratch(device, {64: 5, 32: 2}, 2, 100)
    a, b = scratch.input(3, 64), scratch.input(5, 64)
    assert a.address == b.address and a.shape == (3, 64) and b.shape == (5, 64)
    assert np.array_equal(a.numpy(), cal.proof_input(5 * 64)[: 3 * 64].reshape(3, 64))
    assert np.array_equal(scratch.input(2, 32).numpy(), cal.proof_input(64).reshape(2, 32))
    outs = scratch.outputs(40)
    assert len(outs) == 2 and all(o.shape == (40,) for o in outs) and outs[0].address != outs[1].address
    assert [o.address for o in scratch.outputs(100)] == [o.address for o in outs]
    with pytest.raises(ValueError, match="declared"):
        scratch.input(6, 64)
    words = scratch.statuses(3)
    words._write_bytes(np.full(12, 0xFF, np.uint8))
    assert scratch.statuses(3).numpy().tolist() == [0, 0, 0]  # zeroed again for the next batch
    assert scratch.statuses(40).shape == (40,)
    # An input longer than one upload chunk continues the sequence across chunk boundaries.
    chunk = cal.ProofScratch(device, {}, 1, 1).upload_chunk
    rows, k = 3, (chunk + 5 * 32) // 32
    long = cal.ProofScratch(device, {k: rows}, 1, 1)
    assert np.array_equal(long.input(rows, k).numpy(), cal.proof_input(rows * k).reshape(rows, k))
    with pytest.raises(ValueError, match="declared"):
        scratch.outputs(101)


@pytest.mark.needs_kernels(*cal.PROOF_PIPELINES)
def test_proof_kernels_status_bits(device, registry):
    kernels = cal.ProofKernels(registry)
    logical, guarded = 40, 56
    control = device.alloc(guarded * 4, routemm.DType.F32, [guarded])
    candidate = device.alloc(guarded * 4, routemm.DType.F32, [guarded])
    statuses = device.from_numpy(np.zeros(3, np.uint32))
    enc = device.command_encoder()
    kernels.encode_poison(enc, control, candidate, logical, guarded)
    enc.commit_and_wait()
    assert (control.numpy().view(np.uint32) == 0xFFFFFFFF).all()
    good = np.zeros(guarded, np.float32)
    good[:logical] = np.arange(logical)
    good.view(np.uint32)[logical:] = 0xFFFFFFFF
    bad = good.copy()
    bad[3] = 7.5
    guard = good.copy()
    guard[logical + 2] = 0.0
    for index, cand in enumerate((good, bad, guard)):
        control.copy_from_numpy(good)
        candidate.copy_from_numpy(cand)
        enc = device.command_encoder()
        kernels.encode_compare(enc, control, candidate, statuses, index, logical, guarded)
        enc.commit_and_wait()
    assert statuses.numpy().tolist() == [0, cal.STATUS_MISMATCH, cal.STATUS_CANDIDATE_GUARD]
    # Unwritten control (still poison) and non-finite candidate.
    control.copy_from_numpy(np.full(guarded, np.nan, np.float32).view(np.uint32) * 0 + 0xFFFFFFFF)
    candidate.copy_from_numpy(
        np.where(np.arange(guarded) < logical, np.inf, np.nan).astype(np.float32).view(np.uint32)
        | np.where(np.arange(guarded) < logical, 0, 0xFFFFFFFF).astype(np.uint32)
    )
    statuses.copy_from_numpy(np.zeros(3, np.uint32))
    enc = device.command_encoder()
    kernels.encode_compare(enc, control, candidate, statuses, 0, logical, guarded)
    enc.commit_and_wait()
    bits = int(statuses.numpy()[0])
    assert bits == cal.STATUS_CONTROL_UNWRITTEN | cal.STATUS_CANDIDATE_NON_FINITE | cal.STATUS_MISMATCH


# ---- dense Q4: calibration accounting -----------------------------------------------------------


def test_cold_one_shape_two_weights_accounting(device, registry, rng):
    n, k = fresh_n(), 64
    w0, w1 = weight(device, n, k, rng), weight(device, n, k, rng)
    plan, rec = routemm.calibrate_dense_q4_routes(registry, device, 7, None, [case(w0, n, k, [9]), case(w1, n, k, [9])])
    assert (
        rec.authorized_shape_weight_pairs,
        rec.proof_submissions,
        rec.proof_route_dispatches,
        rec.proof_auxiliary_dispatches,
        rec.timing_submissions,
        rec.cleanup_submissions,
    ) == (2, 1, 4, 4, 10, 1)
    assert rec.decisions[0].calibration_submissions == 11 and rec.calibration_submissions == 12
    d = rec.decisions[0]
    assert {t.route for t in d.timings} == {V2, C64}  # the candidate is timed even when V2 is kept
    assert d.status in (S.CALIBRATED_WINNER, S.COMPATIBILITY_FASTEST, S.NO_STABLE_WINNER)
    assert rec.plan_id == plan.plan_id and registry.frozen_plan_id("dense_q4") == plan.plan_id
    assert registry.dense_q4_plan() is plan
    validate(rec)
    validate(plan)
    assert dq.DenseQ4CalibrationBatchReceipt.from_json(rec.to_json()) == rec
    assert dq.DenseQ4RoutePlan.from_json(plan.to_json()) == plan
    assert json.loads(registry.frozen_plan_document("dense_q4"))["plan_id"] == plan.plan_id
    bad = json.loads(rec.to_json())
    bad["extra"] = 1
    with pytest.raises(routemm.InvalidArgumentError, match="unknown field"):
        dq.DenseQ4CalibrationBatchReceipt.from_dict(bad)


def test_cold_two_shapes_and_cache_hits_across_registries(device, rng):
    n, k = fresh_n(), 64
    reg_a = routemm.KernelRegistry(device)
    w0, w1 = weight(device, n, k, rng), weight(device, n, k, rng)
    _, rec = routemm.calibrate_dense_q4_routes(
        reg_a, device, 1, None, [case(w0, n, k, [9, 37]), case(w1, n, k, [37, 9])]
    )
    assert (
        rec.authorized_shape_weight_pairs,
        rec.proof_submissions,
        rec.proof_route_dispatches,
        rec.proof_auxiliary_dispatches,
        rec.timing_submissions,
        rec.calibration_submissions,
    ) == (4, 2, 8, 8, 20, 23)
    assert rec.process_cache_hits == 0 and rec.calibrated_decisions == 2
    # B (new registry, other bytes): cache hit, but the current weight is still proved.
    reg_b = routemm.KernelRegistry(device)
    wb = weight(device, n, k, rng)
    _, rec_b = routemm.calibrate_dense_q4_routes(reg_b, device, 2, None, [case(wb, n, k, [9])])
    assert (
        rec_b.proof_submissions,
        rec_b.proof_route_dispatches,
        rec_b.proof_auxiliary_dispatches,
        rec_b.timing_submissions,
        rec_b.calibration_submissions,
        rec_b.process_cache_hits,
    ) == (1, 2, 2, 0, 2, 1)
    assert rec_b.decisions[0].process_cache_hit and rec_b.decisions[0].timing_submissions == 0
    # A again (a fresh activation of the first model): cache hits, full reproof of both weights.
    reg_a2 = routemm.KernelRegistry(device)
    _, rec_a2 = routemm.calibrate_dense_q4_routes(
        reg_a2, device, 3, None, [case(w0, n, k, [9, 37]), case(w1, n, k, [9, 37])]
    )
    assert (rec_a2.authorized_shape_weight_pairs, rec_a2.proof_submissions, rec_a2.timing_submissions) == (4, 2, 0)
    routes = lambda r: {d.shape.key: (d.selected_route, d.status) for d in r.decisions}  # noqa: E731
    assert routes(rec_a2) == routes(rec)


# ---- winner, dispatch decisions and traces ------------------------------------------------------


def q4_call(device, n, k, m, rng):
    x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    out = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
    return x, out


def test_winner_plan_dispatch_and_traces(device, registry, rng):
    n, k = fresh_n(), 64
    w = weight(device, n, k, rng)
    plan, rec = routemm.calibrate_dense_q4_routes(
        registry, device, 5, None, [case(w, n, k, [32, 129])], _timer=winner_timer
    )
    assert [(d.selected_route, d.status) for d in rec.decisions] == [(C64, S.CALIBRATED_WINNER)] * 2
    assert rec.compatibility_route_decisions == 0 and plan.decision_count() == 2
    policy = routemm.GgmlRoutingPolicy()
    src = routemm.DenseQ4DecisionSource
    for m in (32, 129):
        x, out = q4_call(device, n, k, m, rng)
        enc = device.command_encoder()
        trace = routemm.trace_dense_q4_auto(
            enc, registry, device, x, w, out, routemm.GgmlQuantizedMatmulParams(m, n, k), policy
        )
        enc.commit_and_wait()
        assert trace.decision.route is C64 and trace.decision.source is src.FROZEN_PLAN
        assert trace.plan_id == plan.plan_id and trace.encoded == routemm.q4_expected_dispatch(
            C64, m, n, registry=registry, k=k
        )
        validate(trace)
        # The candidate's output equals the compatibility route's bit for bit.
        ref_out = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
        enc = device.command_encoder()
        routemm.encode_q4_route(enc, registry, x, w, ref_out, routemm.GgmlQuantizedMatmulParams(m, n, k), V2)
        enc.commit_and_wait()
        assert (out.numpy().view(np.uint32) == ref_out.numpy().view(np.uint32)).all()
    # Undeclared M keeps V2.
    x, out = q4_call(device, n, k, 33, rng)
    enc = device.command_encoder()
    t = routemm.trace_dense_q4_auto(
        enc, registry, device, x, w, out, routemm.GgmlQuantizedMatmulParams(33, n, k), policy
    )
    assert (t.decision.route, t.decision.source) == (V2, src.UNDECLARED_COMPATIBILITY_FALLBACK)
    # No large tile: tensor V1, ineligible.
    x, out = q4_call(device, n, k, 32, rng)
    enc = device.command_encoder()
    t = routemm.trace_dense_q4_auto(
        enc,
        registry,
        device,
        x,
        w,
        out,
        routemm.GgmlQuantizedMatmulParams(32, n, k),
        routemm.GgmlRoutingPolicy(allow_dense_large_tile_mm=False),
    )
    assert t.decision.source is src.INELIGIBLE_COMPATIBILITY_FALLBACK
    # dense_q4_auto receipts say why.
    enc = device.command_encoder()
    r = routemm.dense_q4_auto(enc, registry, device, x, w, out, routemm.GgmlQuantizedMatmulParams(32, n, k), policy)
    assert (r.dense_route, r.decision) == (C64, src.FROZEN_PLAN)
    # No plan: V2 / no-plan fallback; a forced route: forced_test.
    other = routemm.KernelRegistry(device)
    d = dq.select_route(other, device, routemm.GgmlQuantizedMatmulParams(32, n, k), routing=policy)
    assert (d.route, d.source) == (V2, src.NO_PLAN_COMPATIBILITY_FALLBACK)
    enc = device.command_encoder()
    r = routemm.encode_q4_route(enc, other, x, w, out, routemm.GgmlQuantizedMatmulParams(32, n, k), C64)
    assert r.decision is src.FORCED_TEST
    # Ineligible shapes.
    d = dq.select_route(registry, device, routemm.GgmlQuantizedMatmulParams(8, n, k), routing=policy)
    assert d.source is src.INELIGIBLE_COMPATIBILITY_FALLBACK
    # The candidate lookup failing at dispatch silently falls back to V2.
    registry.inject_next_pipeline_lookup_failure(C64.pipeline_name)
    enc = device.command_encoder()
    r = routemm.dense_q4_auto(enc, registry, device, x, w, out, routemm.GgmlQuantizedMatmulParams(32, n, k), policy)
    assert r.dense_route is V2


# ---- failures and fallbacks ---------------------------------------------------------------------


def test_incoherent_weight_downgrades_whole_base(device, registry, rng):
    n, k = fresh_n(), 64
    w0, w1 = weight(device, n, k, rng), weight(device, n, k, rng)
    plan, rec = routemm.calibrate_dense_q4_routes(
        registry,
        device,
        1,
        None,
        [case(w0, n, k, [9, 37]), case(w1, n, k, [9, 37])],
        _timer=winner_timer,
        _candidate_fault=lambda i, shape: i == 1 and shape.m == 9,
    )
    for d in rec.decisions:
        assert (d.selected_route, d.status) == (V2, S.INCOHERENT_CANDIDATE)
        assert "weight 1" in d.diagnostic and "base-shape Cartesian proof failure" in d.diagnostic
    assert "mismatch" in rec.decisions[0].diagnostic


def test_wrong_kernel_under_candidate_name_is_incoherent(device, registry, rng):
    n, k = fresh_n(), 64
    registry.register_kernel_from(C64.pipeline_name, "kernel_mul_mv_q4_0_f32")
    w = weight(device, n, k, rng)
    plan, rec = routemm.calibrate_dense_q4_routes(registry, device, 1, None, [case(w, n, k, [9])], _timer=winner_timer)
    d = rec.decisions[0]
    assert (d.selected_route, d.status) == (V2, S.INCOHERENT_CANDIDATE)
    assert "weight 0" in d.diagnostic


def test_candidate_unavailable(device, registry, rng):
    n, k = fresh_n(), 64
    registry.inject_next_pipeline_lookup_failure(C64.pipeline_name)
    _, rec = routemm.calibrate_dense_q4_routes(registry, device, 1, None, [case(weight(device, n, k, rng), n, k, [9])])
    d = rec.decisions[0]
    assert (d.status, d.proof_submissions, d.authorized_weight_buffers) == (S.CANDIDATE_UNAVAILABLE, 0, 0)
    assert "64x32 candidate pipeline unavailable" in d.diagnostic


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_budget_fallback_before_proof(device, registry, rng):
    n, k = fresh_n(), 64
    clock = Clock()
    w = weight(device, n, k, rng)

    def jump(done, total, info):
        clock.now = 1.0  # the deadline passes after the first shape

    _, rec = routemm.calibrate_dense_q4_routes(
        registry,
        device,
        1,
        dq.DenseQ4CalibrationLimits(max_elapsed_ms=50),
        [case(w, n, k, [9, 10])],
        progress=jump,
        _clock=clock,
    )
    assert all(d.status is S.BUDGET_FALLBACK and d.selected_route is V2 for d in rec.decisions)
    assert "calibration deadline reached before shape proof" in rec.decisions[1].diagnostic
    assert "base-shape Cartesian proof failure" in rec.decisions[0].diagnostic
    assert rec.deadline_overrun_ms > 0


def test_final_deadline_downgrades_candidates(device, registry, rng):
    n, k = fresh_n(), 64
    clock = Clock()
    w = weight(device, n, k, rng)

    def late(done, total, info):
        if done == total:
            clock.now = 0.01025  # elapsed 10.25 ms against a 10 ms budget

    plan, rec = routemm.calibrate_dense_q4_routes(
        registry,
        device,
        1,
        dq.DenseQ4CalibrationLimits(max_elapsed_ms=10),
        [case(w, n, k, [9])],
        progress=late,
        _timer=winner_timer,
        _clock=clock,
    )
    assert rec.deadline_overrun_ms == pytest.approx(0.25)
    d = rec.decisions[0]
    assert (d.selected_route, d.status) == (V2, S.BUDGET_FALLBACK)
    assert d.diagnostic == "final dense Q4 calibration deadline exceeded; candidate disabled"
    assert plan.routes == {d.shape.key: V2}

    n2 = fresh_n()
    clock2, reg2 = Clock(), routemm.KernelRegistry(device)

    def on_time(done, total, info):
        clock2.now = 0.010  # exactly the budget: no overrun

    _, rec2 = routemm.calibrate_dense_q4_routes(
        reg2,
        device,
        1,
        dq.DenseQ4CalibrationLimits(max_elapsed_ms=10),
        [case(weight(device, n2, k, rng), n2, k, [9])],
        progress=on_time,
        _timer=winner_timer,
        _clock=clock2,
    )
    assert rec2.deadline_overrun_ms == 0 and rec2.decisions[0].selected_route is C64


def test_preconditions(device, registry, rng):
    n, k = fresh_n(), 64
    w = weight(device, n, k, rng)
    calib = routemm.calibrate_dense_q4_routes
    for epoch in (0, -1, True, 2**64, 1.0):
        with pytest.raises(
            routemm.InvalidArgumentError, match=r"epoch must be (nonzero|an integer within 1\.\.=18446744073709551615)"
        ):
            calib(registry, device, epoch, None, [case(w, n, k, [9])])
    with pytest.raises(routemm.InvalidArgumentError, match="at least one case"):
        calib(registry, device, 1, None, [])
    with pytest.raises(routemm.InvalidArgumentError, match="limits must be nonzero"):
        calib(registry, device, 1, dq.DenseQ4CalibrationLimits(max_shapes=0), [case(w, n, k, [9])])
    with pytest.raises(routemm.InvalidArgumentError, match="invalid dense Q4 calibration base shape"):
        calib(registry, device, 1, None, [case(w, n, 48, [9])])
    with pytest.raises(routemm.InvalidArgumentError, match="must be exactly"):
        calib(registry, device, 1, None, [case(weight(device, n + 1, k, rng), n, k, [9])])
    with pytest.raises(routemm.InvalidArgumentError, match="reachable M"):
        calib(registry, device, 1, None, [case(w, n, k, [8])])
    with pytest.raises(routemm.InvalidArgumentError, match="declares 3 exact shapes"):
        calib(registry, device, 1, dq.DenseQ4CalibrationLimits(max_shapes=2), [case(w, n, k, [9, 10, 11])])
    registry.inject_next_pipeline_lookup_failure(V2.pipeline_name)
    with pytest.raises(
        routemm.InvalidArgumentError, match="required dense Q4 compatibility V2 pipeline is unavailable"
    ):
        calib(registry, device, 1, None, [case(w, n, k, [9])])
    with pytest.raises(routemm.InvalidArgumentError, match="non-finite"):
        calib(registry, device, 1, None, [case(weight(device, n, k, rng, nan_scale=True), n, k, [9])])
    assert registry.frozen_plan_id("dense_q4") is None
    calib(registry, device, 1, None, [case(w, n, k, [9])])
    with pytest.raises(routemm.InvalidArgumentError, match="one-shot"):
        calib(registry, device, 2, None, [case(w, n, k, [9])])


def test_freeze_protection_and_authority(device, rng):
    n, k = fresh_n(), 64
    reg_a = routemm.KernelRegistry(device)
    reg_a.register_kernel_from(V2.pipeline_name, V2.pipeline_name)  # allowed before a freeze
    w = weight(device, n, k, rng)
    plan, _ = routemm.calibrate_dense_q4_routes(reg_a, device, 1, None, [case(w, n, k, [9])])
    for name in (C64.pipeline_name, V2.pipeline_name, cal.POISON_PIPELINE):
        with pytest.raises(routemm.InvalidArgumentError, match="protected"):
            reg_a.register_kernel_from(name, name)
    routemm.freeze_dense_q4_plan(reg_a, device, plan)  # same id again: no-op
    reg_b = routemm.KernelRegistry(device)
    with pytest.raises(routemm.InvalidArgumentError, match="different registry activation authority"):
        reg_b.freeze_dense_q4_plan(device, plan)
    assert reg_b.dense_q4_plan() is None and reg_a.dense_q4_plan() is plan
    other = dataclasses.replace(plan, plan_id="0" * 64)
    with pytest.raises(routemm.InvalidArgumentError, match="already frozen as"):
        reg_a.freeze_dense_q4_plan(device, other)
    # A plan id depends on the epoch.
    reg_c = routemm.KernelRegistry(device)
    p2, _ = routemm.calibrate_dense_q4_routes(reg_c, device, 2, None, [case(w, n, k, [9])])
    assert p2.plan_id != plan.plan_id and p2.routes == plan.routes


# ---- persistence --------------------------------------------------------------------------------


def test_plan_file_round_trip_and_refusal(device, rng, tmp_path):
    n, k = fresh_n(), 64
    w = weight(device, n, k, rng)
    reg = routemm.KernelRegistry(device)
    plan, rec = routemm.calibrate_dense_q4_routes(reg, device, 3, None, [case(w, n, k, [9, 40])], _timer=winner_timer)
    path = plan.save(tmp_path / "q4.json")
    cal.PROCESS_CACHE.clear()  # as after a restart
    reg2 = routemm.KernelRegistry(device)
    plan2, rec2 = routemm.load_dense_q4_plan(path, reg2, device, [case(w, n, k, [9, 40])])
    assert plan2.routes == plan.routes and reg2.frozen_plan_id("dense_q4") == plan2.plan_id
    assert rec2.timing_submissions == 0 and rec2.proof_submissions == 2
    assert [(d.selected_route, d.status) for d in rec2.decisions] == [
        (d.selected_route, d.status) for d in rec.decisions
    ]
    # Different shapes, and a changed validator, are refused.
    with pytest.raises(cal.PlanFileMismatch, match="different shapes"):
        routemm.load_dense_q4_plan(path, routemm.KernelRegistry(device), device, [case(w, n, k, [9])])
    doc = json.loads(path.read_text())
    doc["validators"]["device_properties"]["driver"] = "other"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(cal.PlanFileMismatch, match="device_properties"):
        routemm.load_dense_q4_plan(bad, routemm.KernelRegistry(device), device, [case(w, n, k, [9, 40])])
    doc["validators"] = json.loads(path.read_text())["validators"]
    doc["validators"]["library_version"] = "0.0.0"
    bad.write_text(json.dumps(doc))
    with pytest.raises(cal.PlanFileMismatch, match="library_version"):
        routemm.load_dense_q4_plan(bad, routemm.KernelRegistry(device), device, [case(w, n, k, [9, 40])])
    doc = json.loads(path.read_text())
    del doc["receipt"]["decisions"][0]["timings"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(cal.PlanFileMismatch, match="malformed calibration receipt"):
        routemm.load_dense_q4_plan(bad, routemm.KernelRegistry(device), device, [case(w, n, k, [9, 40])])


def test_plan_cache_dir_knob(device, rng, tmp_path, monkeypatch):
    monkeypatch.setenv("ROUTEMM_PLAN_CACHE_DIR", str(tmp_path))
    n, k = fresh_n(), 64
    w = weight(device, n, k, rng)
    plan, rec = routemm.calibrate_dense_q4_routes(
        routemm.KernelRegistry(device), device, 1, None, [case(w, n, k, [9])], _timer=winner_timer
    )
    assert rec.timing_submissions == 10 and len(list(tmp_path.glob("dense_q4-*.json"))) == 1
    cal.PROCESS_CACHE.clear()
    plan2, rec2 = routemm.calibrate_dense_q4_routes(
        routemm.KernelRegistry(device), device, 2, None, [case(w, n, k, [9])]
    )
    assert rec2.timing_submissions == 0 and plan2.routes == plan.routes == {(9, n, k, 1, "contiguous"): C64}


def test_knob_table_declares_plan_cache_dir():
    assert "ROUTEMM_PLAN_CACHE_DIR" in {k.name for k in routemm.env.KNOBS}


def test_progress_callback_and_debug_logging(device, registry, rng, caplog):
    n, k = fresh_n(), 64
    seen = []
    with caplog.at_level("DEBUG", logger="routemm.calibration"):
        routemm.calibrate_dense_q4_routes(
            registry,
            device,
            1,
            None,
            [case(weight(device, n, k, rng), n, k, [9, 12])],
            progress=lambda d, t, info: seen.append((d, t, info["shape"]["m"])),
        )
    assert seen == [(1, 2, 9), (2, 2, 12)]
    assert sum("dense Q4 shape m=" in r.message for r in caplog.records) == 2


# ---- acceptance ---------------------------------------------------------------------------------


def test_cartesian_acceptance(device, rng):
    k = 64
    ns = (fresh_n(), fresh_n())
    ws = {n: [weight(device, n, k, rng), weight(device, n, k, rng)] for n in ns}
    cases = [case(w, n, k, [9, 16]) for n in ns for w in ws[n]]
    _, cold = routemm.calibrate_dense_q4_routes(
        routemm.KernelRegistry(device), device, 1, None, cases, _timer=winner_timer
    )
    _, warm = routemm.calibrate_dense_q4_routes(routemm.KernelRegistry(device), device, 2, None, cases)
    req = dq.DenseQ4CartesianAcceptanceRequirements(2, 2, (9, 16), (), 1, 15_000)
    routemm.validate_dense_q4_cartesian_acceptance(cold, warm, req)
    bad = [
        (dataclasses.replace(req, required_compatibility_m=(16,)), cold, "required compatibility M=16"),
        (dataclasses.replace(req, expected_weight_buffers_per_base=1), cold, "authorized pairs"),
        (dataclasses.replace(req, expected_base_shapes=1), cold, "declared shapes"),
        (req, dataclasses.replace(cold, deadline_overrun_ms=0.25), "overrun"),
        (req, dataclasses.replace(cold, elapsed_ms=15_000.25), "elapsed"),
        (req, dataclasses.replace(cold, authorized_shape_weight_pairs=7), "authorized pairs"),
    ]
    d0 = cold.decisions[0]
    bad.append(
        (
            req,
            dataclasses.replace(
                cold,
                decisions=(dataclasses.replace(d0, status=S.BUDGET_FALLBACK, selected_route=V2, diagnostic="x"),)
                + cold.decisions[1:],
            ),
            "fallback decision",
        )
    )
    bad.append(
        (
            req,
            dataclasses.replace(
                cold,
                decisions=(dataclasses.replace(d0, shape=dataclasses.replace(d0.shape, m=10)),) + cold.decisions[1:],
            ),
            "non-Cartesian",
        )
    )
    t0 = d0.timings[0]
    moved = dataclasses.replace(t0, encoded=dataclasses.replace(t0.encoded, grid=(99, 1, 1)))
    bad.append(
        (
            req,
            dataclasses.replace(
                cold, decisions=(dataclasses.replace(d0, timings=(moved,) + d0.timings[1:]),) + cold.decisions[1:]
            ),
            "is not the route's expected dispatch",
        )
    )
    for requirements, receipt, message in bad:
        with pytest.raises(routemm.InvalidArgumentError, match="dense Q4 Cartesian acceptance failed: .*" + message):
            routemm.validate_dense_q4_cartesian_acceptance(receipt, warm, requirements)
