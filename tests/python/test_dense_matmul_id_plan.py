"""Expert-ID route plans (spec §7.6): calibration, dispatch, fallbacks and plan files."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import routemm
from routemm import calibration as cal
from routemm.plans import _expert_id_plan as ex
from routemm.plans import dense_matmul_id_plan as dp
from support import validate

R = routemm.DenseMatmulIdRoute
S = routemm.DenseMatmulIdSelectionStatus
_K = itertools.count(40)


def setup(device, rng, *, m=9, n=7, top_k=2, E=8, dtype=np.float32, multiplicity=None):
    k = next(_K)  # a fresh shape per test: the process cache starts cold
    w = device.from_numpy(rng.standard_normal((E, n, k)).astype(dtype))
    p = routemm.DenseMatmulIdParams(
        m,
        n,
        k,
        top_k,
        E,
        n * k * np.dtype(dtype).itemsize,
        id_multiplicity=multiplicity or routemm.DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN,
    )
    return w, p


def grouped_wins(route, round_index, measured):
    """Injected timings: grouped_prefill clearly fastest, tensor-core candidates (where a backend has
    them) faster than direct but slower than grouped_prefill."""
    wall, gpu = {R.DIRECT.value: (100, 90), R.GROUPED_PREFILL.value: (70, 60)}.get(route, (85, 75))
    return wall - 2 + round_index, gpu - 2 + round_index


def test_winner_and_auto_dispatch(device, registry, rng):
    w, p = setup(device, rng)
    plan, rec = routemm.calibrate_dense_matmul_id_routes(
        registry, device, 4, None, [routemm.DenseMatmulIdCalibrationCase(w, p)], _timer=grouped_wins
    )
    d = rec.decisions[0]
    assert (d.selected_route, d.status) == (R.GROUPED_PREFILL, S.CALIBRATED_WINNER)
    assert {t.profile for t in d.timings} == set(routemm.DenseMatmulIdRoutingProfile)
    assert all(pr.coherent for pr in d.proofs)
    # grouped_prefill is proved bit for bit; tensor-core candidates (where present) within tolerance.
    assert all(pr.tolerance == 0 for pr in d.proofs if pr.route is R.GROUPED_PREFILL)
    assert all(pr.rel_frobenius_error <= pr.tolerance for pr in d.proofs if pr.route is not R.GROUPED_PREFILL)
    n_routes = 1 + len(d.candidates)
    # Spec §7.6 accounting: per profile direct and each candidate in a proof submission of its own,
    # then 5 timing rounds of every route; with grouped_prefill alone 24 submissions, 36 dispatches.
    assert d.proof_submissions == 2 * n_routes and d.timing_submissions == 2 * 5 * n_routes
    if n_routes == 2:
        assert d.calibration_submissions == 24 and d.proof_dispatches + d.timing_dispatches == 36
    assert rec.calibration_submissions == d.calibration_submissions + 1 and rec.cleanup_submissions == 1
    validate(rec)
    validate(plan)
    assert dp.DenseMatmulIdCalibrationReceipt.from_json(rec.to_json()) == rec
    x = device.from_numpy(rng.standard_normal((p.m, p.k)).astype(np.float32))
    ids = device.from_numpy(np.tile(np.arange(p.top_k, dtype=np.uint32), (p.m, 1)))
    out = device.alloc(p.m * p.top_k * p.n * 4, routemm.DType.F32, [p.m * p.top_k, p.n])
    enc = device.command_encoder()
    r = routemm.dense_matmul_id_auto(
        enc, registry, device, w, x, ids, out, routemm.DenseMatmulIdScratch(device, 8, p.m), p, activation_epoch=4
    )
    enc.commit_and_wait()
    assert (r.route, r.decision_source, r.activation_epoch, r.primitive.dispatch_count) == (
        R.GROUPED_PREFILL,
        routemm.DenseMatmulIdDecisionSource.FROZEN_PLAN,
        4,
        2,
    )
    validate(r)
    ref = routemm.matmul_id(w.numpy(), x.numpy(), ids.numpy(), route=R.DIRECT, device=device)
    assert (out.numpy().view(np.uint32) == ref.view(np.uint32)).all()
    # Same base, undeclared m: direct. Another base: refused.
    p2 = type(p)(**{**p.__dict__, "m": 12})
    assert dp.resolve_dense_matmul_id_auto_route(registry, device, w.dtype, p2, activation_epoch=4)[:2] == (
        R.DIRECT,
        routemm.DenseMatmulIdDecisionSource.UNDECLARED_DIRECT,
    )
    p3 = type(p)(**{**p.__dict__, "top_k": 3})
    with pytest.raises(routemm.InvalidArgumentError, match="not admitted"):
        dp.resolve_dense_matmul_id_auto_route(registry, device, w.dtype, p3, activation_epoch=4)
    with pytest.raises(routemm.InvalidArgumentError, match="frozen activation plan"):
        dp.resolve_dense_matmul_id_auto_route(routemm.KernelRegistry(device), device, w.dtype, p, activation_epoch=4)
    # Protected after the freeze; one-shot.
    with pytest.raises(routemm.InvalidArgumentError, match="protected"):
        registry.register_kernel_from("dense_matmul_id_grouped_f32_f32", "dense_matmul_id_grouped_f32_f32")
    with pytest.raises(routemm.InvalidArgumentError, match="one-shot"):
        routemm.calibrate_dense_matmul_id_routes(
            registry, device, 5, None, [routemm.DenseMatmulIdCalibrationCase(w, p)]
        )
    with pytest.raises(routemm.InvalidArgumentError, match="different registry activation authority"):
        routemm.freeze_dense_matmul_id_plan(routemm.KernelRegistry(device), device, plan)


def test_shapes_of_one_calibration_share_proof_buffers(device, registry, rng):
    """One calibration over shapes of two K widths, different m, n and E, both input layouts: the
    proofs reuse one pool of buffers (outputs at the largest size, inputs as prefixes, one scratch),
    and every shape still proves coherent and picks the injected winner."""
    k0, k1 = next(_K), next(_K)
    specs = [(9, 7, k0, 2, 8, False), (33, 20, k0, 3, 6, True), (5, 13, k1, 4, 16, False), (40, 3, k1, 1, 4, True)]
    cases = []
    for m, n, k, top_k, E, slotted in specs:
        w = device.from_numpy(rng.standard_normal((E, n, k)).astype(np.float32))
        layout = (
            routemm.DenseMatmulIdInputLayout.SLOTTED if slotted else routemm.DenseMatmulIdInputLayout.SHARED_PER_TOKEN
        )
        p = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * 4, layout)
        cases.append(routemm.DenseMatmulIdCalibrationCase(w, p))
    _, rec = routemm.calibrate_dense_matmul_id_routes(registry, device, 11, None, cases, _timer=grouped_wins)
    assert len(rec.decisions) == len(specs)
    for d in rec.decisions:
        assert (d.selected_route, d.status) == (R.GROUPED_PREFILL, S.CALIBRATED_WINNER), d.diagnostic
        assert d.proofs and all(pr.coherent for pr in d.proofs)


def test_proof_pool_inputs_are_prefixes(device):
    shape = dp.DenseMatmulIdShape(
        routemm.DType.F32,
        6,
        5,
        24,
        3,
        4,
        5 * 24 * 4,
        routemm.DenseMatmulIdInputLayout.SLOTTED,
        routemm.DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN,
    )
    pool = ex.ProofPool(device, [shape], 3)
    full = pool.input(18, 24).numpy()
    assert np.array_equal(full.reshape(-1), np.resize(ex.ADVERSARIAL, 18 * 24))
    assert np.array_equal(pool.input(7, 24).numpy(), full[:7])
    with pytest.raises(ValueError, match="19 rows requested"):
        pool.input(19, 24)
    control, *outs = pool.outputs(6 * 3 * 5 + cal.GUARD_ELEMENTS, 2)
    assert len(outs) == 2 and control.shape[0] == 6 * 3 * 5 + cal.GUARD_ELEMENTS
    assert pool.statuses(2).numpy().tolist() == [0, 0]
    scratch = pool.scratch()
    assert (scratch.max_experts, scratch.max_tokens) == (4, 6) and pool.scratch() is scratch


def test_direct_only_and_cache_hit(device, rng):
    w, p = setup(device, rng, multiplicity=routemm.DenseMatmulIdMultiplicity.MAY_REPEAT)
    _, rec = routemm.calibrate_dense_matmul_id_routes(
        routemm.KernelRegistry(device), device, 1, None, [routemm.DenseMatmulIdCalibrationCase(w, p)]
    )
    assert rec.decisions[0].status is S.DIRECT_ONLY and rec.calibration_submissions == 0
    w, p = setup(device, rng)
    case = [routemm.DenseMatmulIdCalibrationCase(w, p)]
    _, cold = routemm.calibrate_dense_matmul_id_routes(
        routemm.KernelRegistry(device), device, 1, None, case, _timer=grouped_wins
    )
    _, warm = routemm.calibrate_dense_matmul_id_routes(routemm.KernelRegistry(device), device, 2, None, case)
    d = warm.decisions[0]
    assert d.process_cache_hit and d.selected_route is R.GROUPED_PREFILL
    # the cached winner is re-proved: 2 profiles x (direct + grouped), 2 x (1 + 2) dispatches
    assert (d.proof_submissions, d.proof_dispatches, d.timing_submissions) == (4, 6, 0)


def test_incoherent_grouped(device, registry, rng):
    if any(registry.has_kernel(name) for name in routemm.DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES):
        pytest.skip("with tensor-core candidates another route may win; this pins the grouped-only outcome")
    w, p = setup(device, rng)
    registry.register_kernel_from("dense_matmul_id_grouped_f32_f32", "dense_matmul_id_grouped_f16_f32")
    _, rec = routemm.calibrate_dense_matmul_id_routes(
        registry, device, 1, None, [routemm.DenseMatmulIdCalibrationCase(w, p)], _timer=grouped_wins
    )
    d = rec.decisions[0]
    assert (d.selected_route, d.status) == (R.DIRECT, S.INCOHERENT_GROUPED)
    assert "grouped_prefill proof failed" in d.diagnostic


def test_budget_fallbacks(device, rng):
    w, p = setup(device, rng)
    case = [routemm.DenseMatmulIdCalibrationCase(w, p)]
    _, rec = routemm.calibrate_dense_matmul_id_routes(
        routemm.KernelRegistry(device), device, 1, dp.DenseMatmulIdCalibrationLimits(max_submissions=5), case
    )
    assert rec.decisions[0].status is S.BUDGET_FALLBACK and rec.calibration_submissions == 0
    clock = [0.0]
    _, rec = routemm.calibrate_dense_matmul_id_routes(
        routemm.KernelRegistry(device),
        device,
        1,
        dp.DenseMatmulIdCalibrationLimits(max_elapsed_ms=1),
        case,
        _clock=lambda: clock[0],
        _timer=lambda r, i, m: (clock.__setitem__(0, 1.0), m)[1],
    )
    assert rec.decisions[0].status is S.BUDGET_FALLBACK and rec.deadline_overrun_ms > 0


def test_tensor_candidates_within_tolerance(device, registry, rng):
    name = "dense_matmul_id_grouped_tf32_f32_f32"
    if not registry.has_kernel(name):
        pytest.skip(f"backend {device.backend} has no tensor-core expert-ID routes")
    w, p = setup(device, rng, m=33, n=64, top_k=4, E=8)
    _, rec = routemm.calibrate_dense_matmul_id_routes(
        registry, device, 1, None, [routemm.DenseMatmulIdCalibrationCase(w, p)]
    )
    proofs = [pr for pr in rec.decisions[0].proofs if pr.route is R.GROUPED_TENSOR_TF32]
    assert len(proofs) == 2 and all(pr.tolerance == 2e-3 and pr.rel_frobenius_error <= 2e-3 for pr in proofs)


def test_plan_file_round_trip_and_refusal(device, rng, tmp_path):
    w, p = setup(device, rng)
    case = [routemm.DenseMatmulIdCalibrationCase(w, p)]
    plan, rec = routemm.calibrate_dense_matmul_id_routes(
        routemm.KernelRegistry(device), device, 3, None, case, _timer=grouped_wins
    )
    path = plan.save(tmp_path / "id.json")
    cal.PROCESS_CACHE.clear()
    reg = routemm.KernelRegistry(device)
    plan2, rec2 = routemm.load_dense_matmul_id_plan(path, reg, device, case)
    assert plan2._lookup == plan._lookup and rec2.timing_submissions == 0 and rec2.proof_submissions == 4
    assert reg.frozen_plan_id("dense_matmul_id") == plan2.plan_id
    doc = json.loads(path.read_text())
    doc["validators"]["knobs"] = {"ROUTEMM_SOMETHING": "1"}
    path.write_text(json.dumps(doc))
    with pytest.raises(cal.PlanFileMismatch, match="knobs"):
        routemm.load_dense_matmul_id_plan(path, routemm.KernelRegistry(device), device, case)


# ---- Worker registries: freeze_dense_matmul_id_plan_for_cases --------------------------------------


def _primary(device, registry, rng, epoch=6):
    """A plan calibrated on `registry` for two shapes sharing one weight (grouped_prefill wins both)."""
    w, p = setup(device, rng)
    p16 = type(p)(**{**p.__dict__, "m": 16})
    cases = [routemm.DenseMatmulIdCalibrationCase(w, p), routemm.DenseMatmulIdCalibrationCase(w, p16)]
    plan, _ = routemm.calibrate_dense_matmul_id_routes(registry, device, epoch, None, cases, _timer=grouped_wins)
    return plan, cases, w, p


def _assert_nothing_frozen(worker, device, w, p):
    assert worker.frozen_plan_id("dense_matmul_id") is None and worker.dense_matmul_id_plan() is None
    assert not worker.is_protected("dense_matmul_id_grouped_f32_f32")
    with pytest.raises(routemm.InvalidArgumentError, match="frozen activation plan"):
        dp.resolve_dense_matmul_id_auto_route(worker, device, w.dtype, p, activation_epoch=6)


def test_worker_install_resolves_like_primary(device, registry, rng):
    plan, cases, w, p = _primary(device, registry, rng)
    worker = routemm.KernelRegistry(device)
    assert worker.authority_id != registry.authority_id
    routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, plan, cases, activation_epoch=6)
    assert worker.frozen_plan_id("dense_matmul_id") == plan.plan_id and worker.dense_matmul_id_plan() is plan
    p12 = type(p)(**{**p.__dict__, "m": 12})
    for q in (p, cases[1].params, p12):
        assert dp.resolve_dense_matmul_id_auto_route(
            worker, device, w.dtype, q, activation_epoch=6
        ) == dp.resolve_dense_matmul_id_auto_route(registry, device, w.dtype, q, activation_epoch=6)
    assert dp.resolve_dense_matmul_id_auto_route(worker, device, w.dtype, p, activation_epoch=6)[:2] == (
        R.GROUPED_PREFILL,
        routemm.DenseMatmulIdDecisionSource.FROZEN_PLAN,
    )
    # dense_matmul_id_auto on the worker: the frozen route, bit-identical to direct.
    x = device.from_numpy(rng.standard_normal((p.m, p.k)).astype(np.float32))
    ids = device.from_numpy(np.tile(np.arange(p.top_k, dtype=np.uint32), (p.m, 1)))
    out = device.alloc(p.m * p.top_k * p.n * 4, routemm.DType.F32, [p.m * p.top_k, p.n])
    enc = device.command_encoder()
    r = routemm.dense_matmul_id_auto(
        enc, worker, device, w, x, ids, out, routemm.DenseMatmulIdScratch(device, 8, p.m), p, activation_epoch=6
    )
    enc.commit_and_wait()
    assert (r.route, r.decision_source, r.activation_epoch) == (
        R.GROUPED_PREFILL,
        routemm.DenseMatmulIdDecisionSource.FROZEN_PLAN,
        6,
    )
    validate(r)
    ref = routemm.matmul_id(w.numpy(), x.numpy(), ids.numpy(), route=R.DIRECT, device=device)
    assert (out.numpy().view(np.uint32) == ref.view(np.uint32)).all()
    # Idempotent (cases in any order, duplicates collapse), also through the registry method and the
    # primary freeze; the plan's pipelines are protected on the worker; calibration there is one-shot.
    routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, plan, [cases[1], cases[0], cases[0]])
    worker.freeze_dense_matmul_id_plan_for_cases(device, plan, cases)
    routemm.freeze_dense_matmul_id_plan(worker, device, plan)
    assert worker.frozen_plan_id("dense_matmul_id") == plan.plan_id
    with pytest.raises(routemm.InvalidArgumentError, match="protected"):
        worker.register_kernel_from("dense_matmul_id_grouped_f32_f32", "dense_matmul_id_grouped_f32_f32")
    with pytest.raises(routemm.InvalidArgumentError, match="one-shot"):
        routemm.calibrate_dense_matmul_id_routes(worker, device, 6, None, cases)
    # Re-installing the same plan is still checked against the cases.
    with pytest.raises(routemm.InvalidArgumentError, match="case union mismatch"):
        routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, plan, cases[:1])
    # The primary freeze still refuses another registry: the worker path is the only exception.
    with pytest.raises(routemm.InvalidArgumentError, match="different registry activation authority"):
        routemm.freeze_dense_matmul_id_plan(routemm.KernelRegistry(device), device, plan)


def test_worker_install_mismatches_refused(device, registry, rng):
    plan, cases, w, p = _primary(device, registry, rng)
    worker = routemm.KernelRegistry(device)

    def install(pl=plan, cs=cases, **kw):
        return routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, pl, cs, **kw)

    C = routemm.DenseMatmulIdCalibrationCase
    # Other weights with the same bytes and shapes (another buffer): the authority digest differs.
    w2 = device.from_numpy(w.numpy().copy())
    with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id worker plan authority digest mismatch"):
        install(cs=[C(w2, c.params) for c in cases])
    with pytest.raises(routemm.InvalidArgumentError, match="authority digest mismatch"):
        install(cs=[*cases, C(w2, cases[0].params)])  # an extra borrowed weight identity for a declared shape
    # Case union: a missing shape, an extra shape, no cases.
    with pytest.raises(
        routemm.InvalidArgumentError, match="dense_matmul_id worker plan case union mismatch: cases miss 1"
    ):
        install(cs=cases[:1])
    p20 = type(p)(**{**p.__dict__, "m": 20})
    with pytest.raises(routemm.InvalidArgumentError, match="case union mismatch: cases add 1"):
        install(cs=[*cases, C(w, p20)])
    with pytest.raises(routemm.InvalidArgumentError, match="case union mismatch"):
        install(cs=[])
    # Epoch: the worker's epoch, or a plan whose epoch was changed after calibration.
    with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id worker plan epoch mismatch"):
        install(activation_epoch=7)
    with pytest.raises(routemm.InvalidArgumentError, match="epoch mismatch: plan says epoch 7"):
        install(pl=dataclasses.replace(plan, activation_epoch=7))
    # Device, and a plan whose decisions were altered after calibration.
    with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id worker plan device mismatch"):
        install(pl=dataclasses.replace(plan, device_name="elsewhere"))
    altered = dataclasses.replace(plan, decisions=tuple(dataclasses.replace(d, route=R.DIRECT) for d in plan.decisions))
    with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id worker plan id mismatch"):
        install(pl=altered)
    _assert_nothing_frozen(worker, device, w, p)
    install()  # the refusals left the worker installable
    assert worker.frozen_plan_id("dense_matmul_id") == plan.plan_id


def test_worker_install_pipeline_identities(device, registry, rng):
    plan, cases, w, p = _primary(device, registry, rng)
    name = "dense_matmul_id_grouped_f32_f32"
    # A pipeline the plan relies on cannot be resolved on the worker: its identity is missing.
    worker = routemm.KernelRegistry(device)
    worker.inject_next_pipeline_lookup_failure(name)
    with pytest.raises(
        routemm.InvalidArgumentError, match=f"dense_matmul_id worker plan build/pipeline identity mismatch: .*{name}"
    ):
        routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, plan, cases)
    _assert_nothing_frozen(worker, device, w, p)
    routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, plan, cases)
    # A pipeline re-registered from another kernel before installation: refused exactly when the
    # identity changes. (The CPU backend stamps every builtin kernel with one content hash and origin,
    # so there re-registration keeps the identity and the install is accepted; a backend with
    # per-kernel hashes must refuse.)
    other = routemm.KernelRegistry(device)
    before = other.get_pipeline(name).identity
    other.register_kernel_from(name, "dense_matmul_id_grouped_f16_f32")
    if other.get_pipeline(name).identity == before:
        routemm.freeze_dense_matmul_id_plan_for_cases(other, device, plan, cases)
        assert other.frozen_plan_id("dense_matmul_id") == plan.plan_id
    else:
        with pytest.raises(routemm.InvalidArgumentError, match=f"pipeline identity mismatch: .*{name}"):
            routemm.freeze_dense_matmul_id_plan_for_cases(other, device, plan, cases)
        _assert_nothing_frozen(other, device, w, p)


def test_worker_install_is_one_shot(device, registry, rng):
    plan, cases, w, p = _primary(device, registry, rng)
    other_plan, other_cases, _, _ = _primary(device, routemm.KernelRegistry(device), rng, epoch=8)
    worker = routemm.KernelRegistry(device)
    routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, plan, cases)
    with pytest.raises(routemm.InvalidArgumentError, match=f"already frozen as {plan.plan_id}"):
        routemm.freeze_dense_matmul_id_plan_for_cases(worker, device, other_plan, other_cases)
    assert worker.frozen_plan_id("dense_matmul_id") == plan.plan_id and worker.dense_matmul_id_plan() is plan
    # A registry with its own activation refuses the primary's plan as well.
    own = routemm.KernelRegistry(device)
    routemm.calibrate_dense_matmul_id_routes(own, device, 6, None, cases, _timer=grouped_wins)
    with pytest.raises(routemm.InvalidArgumentError, match="already frozen"):
        routemm.freeze_dense_matmul_id_plan_for_cases(own, device, plan, cases)
