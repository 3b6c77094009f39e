"""docs/spec-conformance.md stays true: every row marked "same" is checked -- by a check here, run
on every backend of the run (conftest's `device` fixture: a backend named in ROUTEMM_TEST_BACKENDS
but unavailable here is a skip) where the row's claim depends on the backend, or by an existing
test the row names -- every test or check any row names exists, every check here belongs to a row
(so the table cannot drift from the code), and every status is one of the table's four."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import routemm
from routemm import q4_0
from routemm.ops.dense_matmul_id import BF16_DOT_PIPELINE_NAMES as BF16_DOT_PIPELINES
from routemm.plans import dense_q4_plan as dq

TABLE = Path(__file__).resolve().parents[2] / "docs" / "spec-conformance.md"
V2 = routemm.DenseQ4Route.COMPATIBILITY_V2
C64 = routemm.DenseQ4Route.TENSOR_64X32
Policy = routemm.GgmlRoutingPolicy
IdRoute = routemm.DenseMatmulIdRoute
_N = itertools.count(700)
_K = itertools.count(1024, 8)


def rows(text: str | None = None) -> list[dict]:
    """The table's rows: {id, section, checked_by, status}."""
    out = []
    for line in (TABLE.read_text() if text is None else text).splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 6 and re.fullmatch(r"`[a-z0-9.\-]+`", cells[0]):
            out.append({"id": cells[0].strip("`"), "section": cells[1], "checked_by": cells[-2], "status": cells[-1]})
    return out


CHECKS: dict = {}  # row id -> check(rng, tmp_path), run once
BACKEND_CHECKS: dict = {}  # row id -> check(rng, tmp_path, device), run on every backend of the run


def check(row_id: str, *, per_backend: bool = False):
    """Registers a row's check. per_backend: the row's claim depends on the backend, so the check
    runs once per backend of conftest's `device` fixture (ROUTEMM_TEST_BACKENDS, else every
    available one): a requested backend that is not available here is a skip, never a pass. A row
    may have both kinds."""

    def register(fn):
        (BACKEND_CHECKS if per_backend else CHECKS)[row_id] = fn
        return fn

    return register


def checked_rows() -> set:
    return set(CHECKS) | set(BACKEND_CHECKS)


# ---- helpers -------------------------------------------------------------------------------------


def cpu():
    return routemm.Device("cpu")


def q4_weight(device, n, k, rng):
    return device.from_numpy(q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32)).reshape(-1))


def winner_timer(route, round_index, measured):
    wall, gpu = (100, 90) if route == V2.value else (70, 60)
    return wall - 2 + round_index, gpu - 2 + round_index


def q4_call(device, n, k, m, rng):
    w = q4_weight(device, n, k, rng)
    x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
    return w, x, y, routemm.GgmlQuantizedMatmulParams(m, n, k)


def id_setup(device, rng, m=9, n=7, top_k=2, E=8):
    k = next(_K)
    w = device.from_numpy(rng.standard_normal((E, n, k)).astype(np.float32))
    p = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * 4)
    x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    ids = device.from_numpy(np.tile(np.arange(top_k, dtype=np.uint32), (m, 1)))
    out = device.alloc(m * top_k * n * 4, routemm.DType.F32, [m * top_k, n])
    return w, p, x, ids, out, routemm.DenseMatmulIdScratch(device, E, m)


def grouped_wins(route, round_index, measured):
    wall, gpu = (100, 90) if route == "direct" else (70, 60)
    return wall - 2 + round_index, gpu - 2 + round_index


# ---- §1 buffers ----------------------------------------------------------------------------------


@check("1.1-is-file-backed")
def _(rng, tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_tensor("w", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mapped = routemm.gguf_tensor(path, "w", device=cpu())
    assert mapped.is_file_backed and not mapped.writable
    assert mapped.view(0, 16, routemm.DType.F32, [4]).is_file_backed  # views share the storage
    assert (
        not cpu().alloc(16, routemm.DType.F32, [4]).is_file_backed and cpu().alloc(16, routemm.DType.F32, [4]).writable
    )
    assert not routemm.gguf_tensor(path, "w", device=cpu(), copy=True).is_file_backed
    with pytest.raises(routemm.InvalidArgumentError, match="Cannot mutate a read-only file-backed buffer"):
        mapped.as_mut_slice()


@check("1.2-with-shape")
def _(rng, tmp_path):
    b = cpu().from_numpy(np.arange(12, dtype=np.float32))
    s = b.with_shape([3, 4])
    assert s.shape == (3, 4) and (s.address, s.byte_offset, s.nbytes, s.dtype) == (
        b.address,
        b.byte_offset,
        b.nbytes,
        b.dtype,
    )
    with pytest.raises(routemm.InvalidArgumentError, match="with_shape"):
        b.with_shape([5, 3])


@check("1.2-as-slice", per_backend=True)
def _(rng, tmp_path, device):
    parent = device.from_numpy(np.arange(16, dtype=np.float32))
    if not device.host_accessible:  # CUDA: refused with the way to a copy
        for slicer in (parent.as_slice, parent.as_mut_slice):
            with pytest.raises(routemm.InvalidArgumentError, match="not host-accessible; copy it with numpy"):
                slicer()
        return
    view = parent.view(8, 16, routemm.DType.F32, [4])
    s = view.as_slice()
    assert s.tolist() == [2.0, 3.0, 4.0, 5.0] and not s.flags.writeable
    m = view.as_mut_slice()
    m[0] = 42.0  # zero-copy: the write is visible through the buffer
    assert parent.numpy()[2] == 42.0
    with pytest.raises(routemm.InvalidArgumentError, match="not aligned"):
        parent.view(2, 8, routemm.DType.U8, [8]).as_slice(np.float32)
    with pytest.raises(routemm.InvalidArgumentError, match="whole number"):
        parent.view(0, 6, routemm.DType.U8, [6]).as_slice(np.float32)


def _poison_args(out, src):
    params = struct.pack("<QQII", 16, 16, 0, 0)  # CalibrationKernelParams
    return [(2, params), (0, out), (1, src)]


def _barriers() -> int:
    return routemm.encoder_counters()["barriers"]


@check("1.3-tracked-ranges", per_backend=True)
def _(rng, tmp_path, device):
    poison = routemm.KernelRegistry(device).get_pipeline("routemm_calibration_poison_f32")
    parent, src = device.alloc(256, routemm.DType.F32, [64]), device.alloc(64, routemm.DType.F32, [16])
    lo, hi, middle = (parent.view(offset, 64, routemm.DType.F32, [16]) for offset in (0, 64, 32))
    enc = device.command_encoder(auto_barrier=True)
    before = _barriers()
    for view in (lo, hi):  # two views of one allocation whose logical ranges do not overlap
        enc.dispatch_tracked(poison, _poison_args(view, src), (1, 1, 1), (16, 1, 1), reads=[src], writes=[view])
    assert _barriers() == before, device.backend  # a rest-of-allocation extent would order them
    enc.dispatch_tracked(poison, _poison_args(middle, src), (1, 1, 1), (16, 1, 1), reads=[src], writes=[middle])
    assert _barriers() == before + 1, device.backend  # overlaps both: ordered
    enc.commit_and_wait()


@check("2.1-gpu-time", per_backend=True)
def _(rng, tmp_path, device):
    poison = routemm.KernelRegistry(device).get_pipeline("routemm_calibration_poison_f32")
    a, b = device.alloc(64, routemm.DType.F32, [16]), device.alloc(64, routemm.DType.F32, [16])
    enc = device.command_encoder()
    enc.dispatch(poison, _poison_args(a, b), (1, 1, 1), (16, 1, 1))
    start, end = enc.commit_wait_with_gpu_time()
    assert isinstance(start, float) and isinstance(end, float), device.backend
    assert math.isfinite(start) and math.isfinite(end) and 0 < start < end, (device.backend, start, end)
    assert routemm.calibration.gpu_interval_us(start, end, "a dispatch") == pytest.approx((end - start) * 1e6)


@check("2.4-no-ranges", per_backend=True)
def _(rng, tmp_path, device):
    poison = routemm.KernelRegistry(device).get_pipeline("routemm_calibration_poison_f32")
    a, b, c, d = (device.alloc(64, routemm.DType.F32, [16]) for _ in range(4))
    enc = device.command_encoder(auto_barrier=True)
    before = _barriers()
    enc.dispatch_tracked(poison, _poison_args(a, b), (1, 1, 1), (16, 1, 1), reads=[b], writes=[a])
    enc.dispatch(poison, _poison_args(c, d), (1, 1, 1), (16, 1, 1))  # no ranges: after all tracked
    enc.dispatch_tracked(poison, _poison_args(d, b), (1, 1, 1), (16, 1, 1), reads=[b], writes=[d])
    assert _barriers() == before + 2, device.backend  # the spec's tracker would emit none
    enc.commit_and_wait()
    enc = device.command_encoder()
    enc.start_capture()
    enc.dispatch(poison, _poison_args(a, b), (1, 1, 1), (16, 1, 1))
    with pytest.raises(routemm.InvalidArgumentError, match="complete hazard ranges"):
        enc.take_graph().reordered()


@check("2.1-metal-knobs")
def _(rng, tmp_path):
    """Neither knob exists: no source reads either variable, and the Metal backend makes only
    retained-reference command buffers and concurrent compute encoders (its host code compiles on
    macOS only, so this reads it)."""
    root = TABLE.parents[1]
    suffixes = {".h", ".cpp", ".cu", ".cuh", ".mm", ".metal", ".py"}
    sources = [p for d in ("csrc", "metal", "python") for p in (root / d).rglob("*") if p.suffix in suffixes]
    assert any(p.name == "device.mm" for p in sources)
    for knob in ("MLX_UNRETAINED_REFS", "HF2Q_FORCE_SERIAL_DISPATCH"):
        assert not [p for p in sources if knob in p.read_text(errors="replace")], knob
    host = (root / "csrc" / "backend" / "metal" / "device.mm").read_text()
    assert "computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent" in host
    assert "commandBufferWithUnretainedReferences" not in host and "MTLDispatchTypeSerial" not in host


# ---- §3 registry ---------------------------------------------------------------------------------


@check("3.1-bool-constants")
def _(rng, tmp_path):
    registry = routemm.KernelRegistry(cpu())
    name = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[0]
    b1 = registry.get_pipeline_with_bool_constants(name, [(5, True)])
    b0 = registry.get_pipeline_with_constants(name, [(5, False)], [(700, 1)])
    assert b1.label == f"{name}|5:b1" and b0.label == f"{name}|5:b0|700:i1"
    assert registry.pipeline_identity(b0.label).pipeline_label == b0.label
    with pytest.raises(routemm.InvalidArgumentError, match="bool"):
        registry.get_pipeline(name, [(700, True)])  # never silently i1


@check("3.1-optional-probe")
def _(rng, tmp_path):
    registry = routemm.KernelRegistry(cpu())
    assert registry.probe_optional_pipeline("no_such_kernel_anywhere") is None
    name = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[0]
    assert registry.probe_optional_pipeline(name).label == name


@check("3.1-register-source", per_backend=True)
def _(rng, tmp_path, device):
    registry = routemm.KernelRegistry(device)
    with pytest.raises(routemm.InvalidArgumentError, match="compiles no kernel source"):
        registry.register_source("my_kernel", "kernel void my_kernel() {}")
    assert not registry.has_kernel("my_kernel")


@check("3.2-identity", per_backend=True)
def _(rng, tmp_path, device):
    registry = routemm.KernelRegistry(device)
    ident = registry.get_pipeline(routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[0]).identity
    assert ident.schema_version == 2 and ident.kernel_name == ident.pipeline_label.split("|")[0]
    assert ident.backend == device.backend and re.fullmatch(r"[0-9a-f]{64}", ident.content_sha256)
    # the spec's origin and its two hashes are derived from the one stored hash: exactly one is set
    assert ident.origin_kind == "precompiled" and ident.runtime_source_sha256 is None
    assert ident.precompiled_sha256 == ident.content_sha256
    assert set(ident.to_dict()) == {
        "pipeline_label",
        "kernel_name",
        "entry_point",
        "backend",
        "origin",
        "content_sha256",
        "schema_version",
    }


@check("3.3-registry-policy")
def _(rng, tmp_path):
    device = cpu()
    registry = routemm.KernelRegistry(device)
    assert registry.ggml_routing_policy() is None
    policy = Policy(allow_dense_large_tile_mm=False, expert_mm_threshold=4)
    registry.freeze_ggml_routing_policy(policy)
    registry.freeze_ggml_routing_policy(policy)  # the same again: no-op
    assert registry.ggml_routing_policy() == policy
    with pytest.raises(routemm.InvalidArgumentError, match="already frozen"):
        registry.freeze_ggml_routing_policy(Policy())
    w, x, y, params = q4_call(device, 64, 64, 16, rng)
    receipt = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params)
    assert receipt.policy == policy and receipt.route == "compatibility_tensor_v1"


# ---- §4 routing policy and capability ------------------------------------------------------------


@check("4.1-policy-fields")
def _(rng, tmp_path):
    fields = {f.name for f in dataclasses.fields(Policy)}
    assert fields >= {
        "dense_decode_mvn",
        "dense_decode_mv_ext",
        "dense_q6k_mv_nr2",
        "dense_q8_0_mv_nr2",
        "dense_tensor_mm",
        "allow_dense_large_tile_mm",
        "expert_mm_threshold",
        "expert_q6k_mv_nr2",
        "expert_q8_0_mv_nr2",
        "expert_tensor_mm",
    }
    auto = routemm.GgmlTensorMmPreference.AUTO_PROBE
    assert dataclasses.asdict(Policy()) == {  # the defaults of the spec's table
        **{f.name: getattr(Policy(), f.name) for f in dataclasses.fields(Policy)},  # routemm's additions
        "dense_decode_mvn": True,
        "dense_decode_mv_ext": False,
        "dense_q6k_mv_nr2": True,
        "dense_q8_0_mv_nr2": True,
        "dense_tensor_mm": auto,
        "allow_dense_large_tile_mm": True,
        "expert_mm_threshold": 8,
        "expert_q6k_mv_nr2": True,
        "expert_q8_0_mv_nr2": False,
        "expert_tensor_mm": auto,
    }
    assert (auto.value, routemm.GgmlTensorMmPreference.FORCE_SIMD.value) == ("auto_probe", "force_simd")
    p = Policy(dense_decode_mv_ext=True, expert_q8_0_mv_nr2=True, expert_mm_threshold=3)
    assert Policy.from_json(p.to_json()) == p
    with pytest.raises(routemm.InvalidArgumentError):
        Policy.from_dict({**p.to_dict(), "expert_mm_threshold_x": 1})


@check("4.1-policy-effects")
def _(rng, tmp_path):
    assert set(Policy.RECORDED_ONLY) == {
        "dense_decode_mvn",
        "dense_decode_mv_ext",
        "dense_q6k_mv_nr2",
        "expert_q6k_mv_nr2",
    }
    assert "expert_tensor_mm" not in Policy.RECORDED_ONLY  # 4.1-expert-tensor-mm
    assert "expert_q8_0_mv_nr2" not in Policy.RECORDED_ONLY  # 4.1-expert-q8-0-mv-nr2


@check("4.1-policy-effects", per_backend=True)
def _(rng, tmp_path, device):
    """Each recorded-only field, flipped, changes no dispatch and no bit of the calls its name
    is about (mat-vec sizes): dense Q4_0, Q8_0 and Q6_K at m = 1, 4 and 8 (the dense receipts record
    the policy), and expert-ID Q8_0 and Q6_K at m = 1 and 4 under a policy frozen into the front
    door's registry."""
    from routemm.ops import dense_matmul_id as dmi

    T, k, n = routemm.GgmlType, 256, 16
    flipped = [Policy(**{name: not getattr(Policy(), name)}) for name in Policy.RECORDED_ONLY]
    registry = routemm.KernelRegistry(device)
    for t in (T.Q4_0, T.Q8_0, T.Q6_K):
        w = device.from_numpy(routemm.quantize(rng.standard_normal((n, k)).astype(np.float32), t).reshape(-1))
        for m in (1, 4, 8):
            x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            params = routemm.GgmlQuantizedMatmulParams(m, n, k, t)

            def run(policy):
                y = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
                enc = device.command_encoder()
                receipt = routemm.quantized_matmul_ggml(enc, registry, x, w, y, params, policy)
                enc.commit_and_wait()
                return receipt, y.numpy().view(np.uint32)

            base, want = run(Policy())
            for policy in flipped:
                receipt, got = run(policy)
                assert receipt.policy == policy
                assert (receipt.route, receipt.dispatch) == (base.route, base.dispatch), (device.backend, t, m, policy)
                assert np.array_equal(got, want), (device.backend, t, m, policy)
    E = 4
    for t in (T.Q8_0, T.Q6_K):
        stack = routemm.quantize(rng.standard_normal((E, n, k)).astype(np.float32), t)
        for m in (1, 4):
            x = rng.standard_normal((m, k)).astype(np.float32)
            ids = (np.arange(m)[:, None] + np.arange(2)[None, :]) % E
            runs = []
            for policy in (Policy(), *flipped):
                frozen = routemm.KernelRegistry(device)
                frozen.freeze_ggml_routing_policy(policy)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(dmi, "_registry_for", lambda _device, frozen=frozen: frozen)
                    got, receipt = routemm.matmul_id(stack, x, ids, device=device, ggml_type=t, return_receipt=True)
                runs.append((receipt, got.view(np.uint32)))
            for receipt, got in runs[1:]:
                assert receipt == runs[0][0] and np.array_equal(got, runs[0][1]), (device.backend, t, m)


@check("4.1-expert-q8-0-mv-nr2", per_backend=True)
def _(rng, tmp_path, device):
    """expert_q8_0_mv_nr2 flipped on, frozen into the registry matmul_id's automatic route uses: a
    Q8_0 decode call (the direct route) runs the nr2 pipeline where the backend has it, each routed
    row bit-identical to kernel_mul_mv_q8_0_f32_nr2 on its expert; off (the default) the direct
    pipeline, as before. CUDA has no nr2 pipeline: either setting runs its direct one."""
    from routemm.ops import dense_matmul_id as dmi
    from routemm.ops import quantized_matmul_id as qmi

    T, E, n, k, m = routemm.GgmlType, 4, 10, 1024, 3
    stack = routemm.quantize(rng.standard_normal((E, n, k)).astype(np.float32), T.Q8_0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = (np.arange(m)[:, None] + np.arange(2)[None, :]) % E
    runs = {}
    for on in (False, True):
        frozen = routemm.KernelRegistry(device)
        frozen.freeze_ggml_routing_policy(Policy(expert_q8_0_mv_nr2=on))
        with pytest.MonkeyPatch.context() as mp:
            for module in (dmi, qmi):
                mp.setattr(module, "_registry_for", lambda _device, frozen=frozen: frozen)
            runs[on] = routemm.matmul_id(stack, x, ids, device=device, ggml_type=T.Q8_0, return_receipt=True)
    has_nr2 = routemm.KernelRegistry(device).has_kernel(routemm.GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE)
    direct = routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES[1]
    assert [r.route.value for _, r in runs.values()] == ["direct", "direct"]
    assert runs[False][1].pipeline == direct
    assert runs[True][1].pipeline == (routemm.GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE if has_nr2 else direct)
    registry = routemm.KernelRegistry(device)
    for flat, expert in enumerate(ids.reshape(-1)):
        w = device.from_numpy(stack[expert].reshape(-1))
        xb = device.from_numpy(x[flat // 2 : flat // 2 + 1])
        y = device.alloc(n * 4, routemm.DType.F32, [1, n])
        enc = device.command_encoder()
        receipt = routemm.quantized_matmul_ggml(
            enc, registry, xb, w, y, routemm.GgmlQuantizedMatmulParams(1, n, k, T.Q8_0), Policy()
        )
        enc.commit_and_wait()
        if has_nr2:
            assert receipt.dispatch.pipeline_label.split("|")[0] == routemm.Q8_0_MAT_VEC_NR2_PIPELINE
            assert np.array_equal(runs[True][0][flat].view(np.uint32), y.numpy()[0].view(np.uint32)), (
                device.backend,
                flat,
            )
        else:
            assert np.array_equal(runs[True][0].view(np.uint32), runs[False][0].view(np.uint32)), device.backend


def _auto_routes(device, rng, ms, ggml_type=None) -> list:
    """The route matmul_id's automatic choice takes for distinct ids at each m (2 experts, top_k 2)."""
    E, n, k = 2, 16, 64
    w = rng.standard_normal((E, n, k)).astype(np.float32)
    if ggml_type is not None:
        w = q4_0.quantize(w.reshape(E * n, k)).reshape(E, n, -1)
    routes = []
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        ids = (np.arange(m)[:, None] + np.arange(2)[None, :]) % E
        _, receipt = routemm.matmul_id(w, x, ids, device=device, ggml_type=ggml_type, return_receipt=True)
        routes.append(receipt.route.value)
    return routes


@check("4.1-expert-mm-threshold", per_backend=True)
def _(rng, tmp_path, device):
    """matmul_id on arrays (dense and quantised) and the NumPy MoE block: the environment's
    threshold, and a policy frozen into the device's registry over it. CUDA also needs 8 routed rows
    per expert (dense) or 256 (block stacks): m >= 8 and m >= 256 here (2 experts, top_k 2)."""
    from routemm.ops import dense_matmul_id as dmi

    ms = (1, 9, 16, 17)

    def want(m, threshold, quantized):
        rows_rule = device.backend != "cuda" or (not quantized and m >= 8)
        grouped = m > threshold and rows_rule
        assert grouped == dmi.auto_grouped(device.backend, m, 2, 2, quantized=quantized, mm_threshold=threshold)
        return grouped

    for ggml_type, grouped in ((None, "grouped_prefill"), (routemm.GgmlType.Q4_0, "grouped")):
        q = ggml_type is not None
        with pytest.MonkeyPatch.context() as mp:
            for value, threshold in (("", 8), ("16", 16), ("0", 0)):
                mp.setenv("ROUTEMM_MM_ID_ROUTING_THRESHOLD", value)
                routes = _auto_routes(device, rng, ms, ggml_type)
                assert routes == [grouped if want(m, threshold, q) else "direct" for m in ms], (device.backend, value)
            mp.setenv("ROUTEMM_MM_ID_ROUTING_THRESHOLD", "-1")
            with pytest.raises(routemm.InvalidArgumentError, match="ROUTEMM_MM_ID_ROUTING_THRESHOLD"):
                _auto_routes(device, rng, ms[:1], ggml_type)
    # A policy frozen into the registry the front doors use wins over the environment's.
    registry = routemm.KernelRegistry(device)
    registry.freeze_ggml_routing_policy(Policy(expert_mm_threshold=16))
    E, h, inter = 2, 32, 32
    gate_up, down = rng.standard_normal((E, 2 * inter, h)), rng.standard_normal((E, h, inter))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROUTEMM_MM_ID_ROUTING_THRESHOLD", "0")
        mp.setattr(dmi, "_registry_for", lambda _device: registry)
        for ggml_type, grouped in ((None, "grouped_prefill"), (routemm.GgmlType.Q4_0, "grouped")):
            routes = _auto_routes(device, rng, ms, ggml_type)
            assert routes == [grouped if want(m, 16, ggml_type is not None) else "direct" for m in ms], device.backend
        for m in (9, 17):  # the MoE block: its automatic route encodes what the same explicit route does
            hidden = rng.standard_normal((m, h)).astype(np.float32)
            ids = (np.arange(m)[:, None] + np.arange(2)[None, :]) % E
            weights = np.full((m, 2), 0.5, np.float32)
            counts = {}
            for route in (None, "direct", "grouped_prefill"):
                before = routemm.dispatch_count()
                routemm.moe_experts(
                    hidden,
                    ids,
                    weights,
                    gate_up.astype(np.float32),
                    down.astype(np.float32),
                    route=route,
                    device=device,
                )
                counts[route] = routemm.dispatch_count() - before
            assert counts["direct"] != counts["grouped_prefill"]
            chosen = "grouped_prefill" if want(m, 16, False) else "direct"
            assert counts[None] == counts[chosen], (device.backend, m, counts)


@check("4.1-expert-mm-threshold")
def _(rng, tmp_path):
    """The tensor ops read the variable in the core; the rule itself, CUDA's included, on every host."""
    from routemm.ops.dense_matmul_id import auto_grouped

    assert auto_grouped("cpu", 9, 2, 8) and not auto_grouped("cpu", 9, 2, 8, mm_threshold=9)
    assert auto_grouped("cpu", 1, 2, 8, mm_threshold=0)
    assert not auto_grouped("cuda", 31, 2, 8, mm_threshold=0) and auto_grouped("cuda", 32, 2, 8, mm_threshold=31)
    assert not auto_grouped("cuda", 32, 2, 8, mm_threshold=32)
    assert not auto_grouped("cuda", 1023, 2, 8, quantized=True, mm_threshold=0)
    assert auto_grouped("cuda", 1024, 2, 8, quantized=True, mm_threshold=1023)
    pytest.importorskip("torch")
    code = (
        "import torch, routemm\n"
        "w = torch.randn(8, 16, 64)\n"
        "for m in (8, 9, 16, 17):\n"
        "    x, ids = torch.randn(m, 64), (torch.arange(m)[:, None] + torch.arange(2)[None, :]) % 8\n"
        "    print(routemm.matmul_id(w, x, ids, return_receipt=True)[1].route.value)\n"
    )
    for threshold, grouped_from in (("", 1), ("16", 3)):  # tensors: the core reads the variable itself
        env = dict(os.environ, ROUTEMM_MM_ID_ROUTING_THRESHOLD=threshold)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["direct"] * grouped_from + ["grouped_prefill"] * (4 - grouped_from)


def _tensor_candidates_proved(device, rng, ggml_type, policy=None) -> list:
    """The candidates one expert-ID calibration on a fresh registry of `device` has (bf16 stacks, or
    `ggml_type` block stacks), under `policy` frozen into the registry (None: the environment's).
    Where the backend has no tensor-core pipeline, the exact grouped kernel is registered under its
    name, so the tensor route is a candidate on every backend."""
    import ml_dtypes

    registry = routemm.KernelRegistry(device)
    E, n, k, m, top_k = 2, 16, 64, 16, 2
    if ggml_type is None:
        names = ("dense_matmul_id_grouped_lowp_bf16_f32", "dense_matmul_id_grouped_bf16_f32")
        stack = rng.standard_normal((E, n, k)).astype(ml_dtypes.bfloat16)
        params = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * 2)
        calibrate, case = routemm.calibrate_dense_matmul_id_routes, routemm.DenseMatmulIdCalibrationCase
    else:
        names = ("quantized_matmul_id_grouped_lowp_q4_0_f32", "quantized_matmul_id_grouped_q4_0_f32")
        stack = q4_0.quantize(rng.standard_normal((E * n, k)).astype(np.float32)).reshape(-1)
        params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, E, ggml_type, n * k // 32 * 18)
        calibrate, case = routemm.calibrate_quantized_matmul_id_routes, routemm.GgmlQuantizedMatmulIdCalibrationCase
    if not registry.has_kernel(names[0]):
        registry.register_kernel_from(*names)
    if policy is not None:
        routemm.freeze_ggml_routing_policy(registry, policy)
    _, receipt = calibrate(registry, device, 3, None, [case(device.from_numpy(stack), params)], _timer=winner_timer)
    return [route.value for route in receipt.decisions[0].candidates]


@check("4.1-expert-tensor-mm", per_backend=True)
def _(rng, tmp_path, device):
    """Calibration: the tensor candidates are proved only under auto_probe."""
    simd = Policy(expert_tensor_mm=routemm.GgmlTensorMmPreference.FORCE_SIMD)
    tf32 = routemm.KernelRegistry(device).has_kernel("dense_matmul_id_grouped_tf32_bf16_f32")  # CUDA's
    for ggml_type, grouped in ((None, "grouped_prefill"), (routemm.GgmlType.Q4_0, "grouped")):
        tensor = ["grouped_tensor_tf32"] * (tf32 and ggml_type is None) + ["grouped_tensor_lowp"]
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("ROUTEMM_DISABLE_TENSOR_MM_ID", raising=False)
            assert _tensor_candidates_proved(device, rng, ggml_type) == [grouped, *tensor]
            assert _tensor_candidates_proved(device, rng, ggml_type, simd) == [grouped]
            mp.setenv("ROUTEMM_DISABLE_TENSOR_MM_ID", "1")
            assert _tensor_candidates_proved(device, rng, ggml_type) == [grouped]
            assert _tensor_candidates_proved(device, rng, ggml_type, Policy()) == [grouped, *tensor]


@check("4.1-expert-tensor-mm")
def _(rng, tmp_path):
    from routemm import _core

    # The MoE op's automatic route (the torch op moe_experts, exact=False): a pure rule of the
    # backend's name and the shapes, so CUDA's is checked on every host. 64 rows per expert.
    route, D = _core._moe_experts_auto_route, routemm.DType
    for dtype, blocks, m, exact_route in ((D.BF16, False, 64, "grouped_prefill"), (D.U8, True, 512, "grouped")):
        assert route("cuda", m, 8, 8, dtype, blocks, False, True) == "grouped_tensor_lowp"
        assert route("cuda", m, 8, 8, dtype, blocks, False, False) == exact_route  # force_simd: the exact rule
        assert route("cuda", m, 8, 8, dtype, blocks, True, True) == exact_route
        assert route("cpu", m, 8, 8, dtype, blocks, False, True) == exact_route
    code = (
        "import routemm; from routemm import _core\n"
        "print(_core._moe_experts_auto_route('cuda', 64, 8, 8, routemm.DType.BF16, False, False, None))"
    )
    for value, want in (("0", "grouped_tensor_lowp"), (" 1 ", "grouped_prefill")):
        env = dict(os.environ, ROUTEMM_DISABLE_TENSOR_MM_ID=value)  # read once, at first use
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == want, value


@check("4.1-policy-environment")
def _(rng, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROUTEMM_DECODE_MV_EXT", "1")
        mp.setenv("ROUTEMM_MM_ID_ROUTING_THRESHOLD", "16")
        mp.setenv("ROUTEMM_DISABLE_TENSOR_MM_ID", "1")
        mp.setenv("ROUTEMM_Q6K_MV_NR2", "off")
        p = Policy.from_environment()
        assert p.dense_decode_mv_ext and p.expert_mm_threshold == 16 and not p.dense_q6k_mv_nr2
        assert p.expert_tensor_mm is routemm.GgmlTensorMmPreference.FORCE_SIMD
        mp.setenv("ROUTEMM_MM_ID_ROUTING_THRESHOLD", "many")
        with pytest.raises(routemm.InvalidArgumentError, match="ROUTEMM_MM_ID_ROUTING_THRESHOLD"):
            Policy.from_environment()


@check("4.2-plan-dense-auto-route")
def _(rng, tmp_path):
    R, T = routemm.GgmlKernelRoute, routemm.GgmlType
    plan = routemm.plan_dense_auto_route
    assert plan(T.Q4_0, 1, 64, Policy()) is R.DENSE_MV
    assert plan(T.Q4_0, 9, 64, Policy()) is R.DENSE_MM
    assert plan(T.Q6_K, 4, 256, Policy()) is R.DENSE_MVN
    assert plan(T.Q6_K, 4, 256, Policy(dense_decode_mvn=False)) is R.DENSE_MV
    assert plan(T.Q4_0, 2, 64, Policy(dense_decode_mv_ext=True)) is R.DENSE_MV_EXT
    assert plan(T.Q4_K, 3, 256, Policy(dense_decode_mvn=False, dense_decode_mv_ext=True)) is R.DENSE_MV
    assert plan(routemm.DType.BF16, 1, 64, Policy()) is R.NATIVE_SCALAR_MV
    assert plan(routemm.DType.F16, 5, 64, Policy()) is R.NATIVE_SCALAR_MM
    # The dispatcher splits where the planner does.
    device = cpu()
    registry = routemm.KernelRegistry(device)
    for t in (T.Q4_0, T.Q8_0):
        for m in (1, 7, 8, 9, 16):
            w, x, y, _ = q4_call(device, 64, 64, m, rng)
            if t is T.Q8_0:
                w = device.from_numpy(
                    routemm.q8_0.quantize(rng.standard_normal((64, 64)).astype(np.float32)).reshape(-1)
                )
            r = routemm.quantized_matmul_ggml(
                device.command_encoder(), registry, x, w, y, routemm.GgmlQuantizedMatmulParams(m, 64, 64, t), Policy()
            )
            assert (plan(t, m, 64, Policy()) is R.DENSE_MM) == (r.dense_route is not None), (t, m)


@check("4.2-ggml-capability")
def _(rng, tmp_path):
    Inv, K, W = routemm.GgmlInvocation, routemm.GgmlInvocationKind, routemm.GgmlWorkload
    cap = routemm.ggml_capability(
        routemm.GgmlCapabilityRequest(Inv(K.DENSE_AUTO, 16, 64, 64), routemm.GgmlType.Q4_0, W.PROMPT)
    )
    assert cap.executable and cap.route is routemm.GgmlKernelRoute.DENSE_MM
    assert (cap.block_values, cap.block_bytes, cap.minimum_weight_bytes) == (32, 18, 64 * 2 * 18)
    bad = routemm.ggml_capability(
        routemm.GgmlCapabilityRequest(Inv(K.DENSE_AUTO, 4, 64, 64), routemm.GgmlType.Q4_0, W.DECODE_SINGLE)
    )
    assert bad.rejection_code is routemm.GgmlRejectionCode.INVALID_OPERATION_CONTRACT
    q6 = routemm.ggml_capability(
        routemm.GgmlCapabilityRequest(Inv(K.DENSE_AUTO, 4, 64, 256), routemm.GgmlType.Q6_K, W.CONTINUOUS_WIDTH)
    )
    assert q6.route is routemm.GgmlKernelRoute.DENSE_MVN and not q6.executable and "no dense_mvn" in q6.diagnostic
    e = routemm.GgmlExpertShape(n_tokens=16, n=64, k=64, top_k=8, n_experts=32, expert_stride_bytes=64 * 2 * 18)
    ex = routemm.ggml_capability(
        routemm.GgmlCapabilityRequest(Inv(K.EXPERT_POOLED, expert=e), routemm.GgmlType.Q4_0, W.PROMPT)
    )
    assert ex.route is routemm.GgmlKernelRoute.EXPERT_MM_ID
    assert (ex.scratch.htpe_bytes, ex.scratch.hids_bytes) == (4 * 32, 4 * 32 * 16)


# ---- §5 quantized_matmul_ggml --------------------------------------------------------------------


@check("5.3-registry-policy-default")
def _(rng, tmp_path):
    device = cpu()
    registry = routemm.KernelRegistry(device)
    w, x, y, params = q4_call(device, 64, 64, 16, rng)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROUTEMM_DISABLE_TENSOR_MM", "1")
        receipt = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params)
        assert receipt.route == "compatibility_simdgroup"  # no registry policy: the environment
        registry.freeze_ggml_routing_policy(Policy())
        receipt = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params)
        assert receipt.route == "compatibility_v2"  # the registry's policy wins over the environment


@check("5.4-threshold", per_backend=True)
def _(rng, tmp_path, device):
    from routemm.ops.quantized_matmul import MM_ROUTING_THRESHOLD

    assert MM_ROUTING_THRESHOLD == 8
    registry, n = routemm.KernelRegistry(device), next(_N)
    w = q4_weight(device, n, 64, rng)
    enc = device.command_encoder()
    got = {}
    for m in (1, 8, 9, 16):
        x = device.from_numpy(rng.standard_normal((m, 64)).astype(np.float32))
        y = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
        params = routemm.GgmlQuantizedMatmulParams(m, n, 64)
        got[m] = routemm.quantized_matmul_ggml(enc, registry, x, w, y, params, Policy()).route
    enc.commit_and_wait()
    assert got[1] == got[8] == "mat_vec" and "mat_vec" not in (got[9], got[16]), (device.backend, got)


@check("5.5-q8-geometry", per_backend=True)
def _(rng, tmp_path, device):
    registry = routemm.KernelRegistry(device)
    m, n, k = 3, 7, 64
    w = device.from_numpy(routemm.q8_0.quantize(rng.standard_normal((n, k)).astype(np.float32)).reshape(-1))
    x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
    params = routemm.GgmlQuantizedMatmulParams(m, n, k, routemm.GgmlType.Q8_0)
    nr2 = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params, Policy())
    d = nr2.dispatch
    if device.backend == "cuda":  # no nr2 pipeline: the lane-contract mat-vec under either setting
        assert d.pipeline_label.split("|")[0] == "kernel_mul_mv_q8_0_f32"
    else:
        assert d.pipeline_label.split("|")[0] == "kernel_mul_mv_q8_0_f32_nr2", device.backend
        assert (d.grid, d.threads_per_threadgroup, d.threadgroup_memory) == ((4, 3, 1), (32, 4, 1), ((0, 256),))
    off = Policy(dense_q8_0_mv_nr2=False)
    lane = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params, off)
    assert lane.dispatch.pipeline_label.split("|")[0] == "kernel_mul_mv_q8_0_f32", device.backend


@check("5.5-k-quants-refused")
def _(rng, tmp_path):
    device = cpu()
    registry = routemm.KernelRegistry(device)
    w, x, y, _ = q4_call(device, 64, 256, 4, rng)
    for t in (routemm.GgmlType.Q2_K, routemm.GgmlType.Q3_K, routemm.GgmlType.IQ4_XS):
        params = routemm.GgmlQuantizedMatmulParams(4, 64, 256, t)
        with pytest.raises(routemm.InvalidArgumentError, match=f"does not support {t.value}"):
            routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params, Policy())


# ---- §6 dense Q4 plan ----------------------------------------------------------------------------


@check("6.1-route-spelling")
def _(rng, tmp_path):
    assert routemm.DenseQ4Route("tensor64x32") is C64 and C64.value == "tensor_64x32"
    seed_plan = {
        "plan_id": "a" * 64,
        "build_fingerprint": "b" * 64,
        "device_name": "cpu",
        "device_registry_id": 1,
        "registry_authority_id": 2,
        "activation_epoch": 1,
        "decisions": [
            {"shape": {"m": m, "n": 32, "k": 64, "batch": 1, "input_layout": "contiguous"}, "route": r}
            for m, r in ((64, "tensor64x32"), (96, "compatibility_v2"))
        ],
        "schema_version": dq.DENSE_Q4_ROUTE_SCHEMA_VERSION,
    }
    plan = dq.DenseQ4RoutePlan.from_json(json.dumps(seed_plan))  # the seed's serde spelling reads
    assert [plan.route_for(d.shape) for d in plan.decisions] == [C64, V2]
    assert '"tensor_64x32"' in plan.to_json() and "tensor64x32" not in plan.to_json()  # written as routemm's
    with pytest.raises(routemm.InvalidArgumentError):
        dq.DenseQ4RoutePlan.from_json(json.dumps(seed_plan).replace("tensor64x32", "tensor_64_x32"))
    # A calibration's plan, receipt and trace written with the seed's spelling read back the same,
    # and their schemas accept it.
    device = cpu()
    registry, n = routemm.KernelRegistry(device), next(_N)
    w, x, y, params = q4_call(device, n, 64, 9, rng)
    case = routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, 64), (9,))
    plan, receipt = routemm.calibrate_dense_q4_routes(registry, device, 1, None, [case], _timer=winner_timer)
    enc = device.command_encoder()
    trace = routemm.trace_dense_q4_auto(enc, registry, device, x, w, y, params, Policy())
    enc.commit_and_wait()
    for record in (plan, receipt, trace):
        text = record.to_json()
        assert '"tensor_64x32"' in text and "tensor64x32" not in text, type(record)
        seed = text.replace('"tensor_64x32"', '"tensor64x32"')
        assert type(record).from_json(seed) == record, type(record)
        routemm.schemas.validate(json.loads(seed), type(record).SCHEMA)


@check("6.1-schema")
def _(rng, tmp_path):
    assert dq.DENSE_Q4_ROUTE_SCHEMA_VERSION == 4
    assert dq.DenseQ4RoutePlan.__dataclass_fields__["schema_version"].default == 4


@check("6.1-receipt-schema")
def _(rng, tmp_path):
    assert dq.DENSE_Q4_RECEIPT_SCHEMA_VERSION == 5
    for record in (dq.DenseQ4CalibrationBatchReceipt, dq.DenseQ4DispatchTrace):
        names = {f.name for f in dataclasses.fields(record)}
        assert "routemm_version" in names and "mlx_native_version" not in names, record
    # a saved version-4 receipt (the reference's field name) is read as version 5
    v4 = {"schema_version": 4, "mlx_native_version": "0.13.1", "plan_id": "p"}
    assert dq.DenseQ4RoutePlan.KIND.upgrade_receipt(v4) == {
        "schema_version": 5,
        "routemm_version": "0.13.1",
        "plan_id": "p",
    }


@check("6.2-trace-policy", per_backend=True)
def _(rng, tmp_path, device):
    registry = routemm.KernelRegistry(device)
    w, x, y, params = q4_call(device, next(_N), 64, 16, rng)
    enc = device.command_encoder()
    before = routemm.dispatch_count()
    for routing in (None, {}):
        with pytest.raises(routemm.InvalidArgumentTypeError, match="trace_dense_q4_auto routing must be"):
            routemm.trace_dense_q4_auto(enc, registry, device, x, w, y, params, routing)
    assert routemm.dispatch_count() == before  # refused before anything was encoded
    trace = routemm.trace_dense_q4_auto(enc, registry, device, x, w, y, params, Policy())
    enc.commit_and_wait()
    assert trace.shape.m == 16


@check("6.2-dispatcher-consults-plan", per_backend=True)
def _(rng, tmp_path, device):
    registry = routemm.KernelRegistry(device)
    n, k = next(_N), 64
    w, x, y, params = q4_call(device, n, k, 9, rng)
    case = routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, k), (9,))
    plan, _ = routemm.calibrate_dense_q4_routes(registry, device, 1, None, [case], _timer=winner_timer)
    assert plan.route_for(dq.DenseQ4Shape(9, n, k)) is C64
    S = routemm.DenseQ4DecisionSource
    receipt = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x, w, y, params, Policy())
    assert (receipt.dense_route, receipt.decision) == (C64, S.FROZEN_PLAN)
    x33 = device.from_numpy(rng.standard_normal((33, k)).astype(np.float32))
    y33 = device.alloc(33 * n * 4, routemm.DType.F32, [33, n])
    p33 = routemm.GgmlQuantizedMatmulParams(33, n, k)
    undeclared = routemm.quantized_matmul_ggml(device.command_encoder(), registry, x33, w, y33, p33, Policy())
    assert (undeclared.dense_route, undeclared.decision) == (V2, S.UNDECLARED_COMPATIBILITY_FALLBACK)
    unplanned = routemm.quantized_matmul_ggml(
        device.command_encoder(), routemm.KernelRegistry(device), x, w, y, params, Policy()
    )
    assert (unplanned.dense_route, unplanned.decision) == (V2, S.NO_PLAN_COMPATIBILITY_FALLBACK)


@check("6.3-freeze", per_backend=True)
def _(rng, tmp_path, device):
    n, k = next(_N), 64
    case = routemm.DenseQ4CalibrationCase(q4_weight(device, n, k, rng), routemm.DenseQ4BaseShape(n, k), (9,))
    registry, other = routemm.KernelRegistry(device), routemm.KernelRegistry(device)
    plan, _ = routemm.calibrate_dense_q4_routes(registry, device, 1, None, [case], _timer=winner_timer)
    routemm.freeze_dense_q4_plan(registry, device, plan)  # the same plan again: a no-op
    refused = (
        (other, plan, "dense Q4 route plan belongs to a different registry activation authority"),
        (registry, dataclasses.replace(plan, device_registry_id=plan.device_registry_id + 1), "different device"),
        (registry, dataclasses.replace(plan, device_name="elsewhere"), "different device"),
        (registry, dataclasses.replace(plan, plan_id="f" * 64), f"already frozen as {plan.plan_id}"),
        (
            other,
            dataclasses.replace(plan, registry_authority_id=other.authority_id, build_fingerprint="0" * 64),
            "build/pipeline identity mismatch",
        ),
    )
    for target, candidate, message in refused:
        with pytest.raises(routemm.InvalidArgumentError, match=re.escape(message)):
            routemm.freeze_dense_q4_plan(target, device, candidate)
    assert registry.dense_q4_plan() == plan and other.dense_q4_plan() is None


@check("6.4-gpu-interval")
def _(rng, tmp_path):
    device = cpu()
    n, k = next(_N), 64
    w = q4_weight(device, n, k, rng)
    case = routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, k), (9,))
    real = routemm.CommandEncoder.commit_wait_with_gpu_time
    for bad in (lambda s, e: (s, s), lambda s, e: (s, math.nan), lambda s, e: (e, s)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(routemm.CommandEncoder, "commit_wait_with_gpu_time", lambda self, bad=bad: bad(*real(self)))
            registry = routemm.KernelRegistry(device)
            with pytest.raises(routemm.Error, match="GPU interval .* is not a finite positive time"):
                routemm.calibrate_dense_q4_routes(registry, device, 1, None, [case])
            assert registry.dense_q4_plan() is None
    with pytest.raises(routemm.CalibrationError, match="not a finite positive"):
        routemm.calibration.gpu_interval_us(2.0, 2.0, "a test submission")


def _cartesian_receipts(device, rng):
    k, ns = 64, (next(_N), next(_N))
    cases = [
        routemm.DenseQ4CalibrationCase(q4_weight(device, n, k, rng), routemm.DenseQ4BaseShape(n, k), (9, 16))
        for n in ns
        for _ in range(2)
    ]
    _, cold = routemm.calibrate_dense_q4_routes(
        routemm.KernelRegistry(device), device, 1, None, cases, _timer=winner_timer
    )
    _, warm = routemm.calibrate_dense_q4_routes(routemm.KernelRegistry(device), device, 2, None, cases)
    return cold, warm, dq.DenseQ4CartesianAcceptanceRequirements(2, 2, (9, 16), (), 1, 15_000)


def _replace_timings(receipt, fn):
    return dataclasses.replace(
        receipt,
        decisions=tuple(dataclasses.replace(d, timings=tuple(fn(t) for t in d.timings)) for d in receipt.decisions),
    )


@check("6.5-cartesian-acceptance", per_backend=True)
def _(rng, tmp_path, device):
    cold, warm, req = _cartesian_receipts(device, rng)
    routemm.validate_dense_q4_cartesian_acceptance(cold, warm, req)
    moved = lambda t: dataclasses.replace(t, encoded=dataclasses.replace(t.encoded, grid=(99, 99, 99)))  # noqa: E731
    ident99 = lambda t: dataclasses.replace(t, pipeline=dataclasses.replace(t.pipeline, schema_version=99))  # noqa: E731
    unhashed = lambda t: dataclasses.replace(t, pipeline=dataclasses.replace(t.pipeline, content_sha256="x"))  # noqa: E731
    for fn, message in ((moved, "expected dispatch"), (ident99, "schema_version 99"), (unhashed, "origin/hash")):
        with pytest.raises(routemm.InvalidArgumentError, match=message):
            routemm.validate_dense_q4_cartesian_acceptance(_replace_timings(cold, fn), _replace_timings(warm, fn), req)
    with pytest.raises(routemm.InvalidArgumentError, match="nonzero"):
        routemm.validate_dense_q4_cartesian_acceptance(
            cold, warm, dataclasses.replace(req, minimum_candidate_decisions=0)
        )


# ---- §7 expert-ID auto route ---------------------------------------------------------------------


@check("7.1-schema-version")
def _(rng, tmp_path):
    params = routemm.DenseMatmulIdParams(9, 7, 32, 2, 8, 7 * 32 * 4)
    receipt = routemm.DenseMatmulIdDispatchReceipt(routemm.DType.F32, IdRoute.DIRECT, 1)
    encoded = routemm.q4_expected_dispatch(V2, 16, 64)
    for record in (params, receipt, encoded):
        doc = record.to_dict()
        assert type(record).from_dict(doc) == record
        del doc["schema_version"]  # the reference's shape of these documents
        with pytest.raises(routemm.InvalidArgumentError, match="schema_version"):
            type(record).from_dict(doc)


@check("7.1-id-multiplicity-default")
def _(rng, tmp_path):
    params = routemm.DenseMatmulIdParams(1, 4, 32, 9, 8, 4 * 32 * 4)
    assert params.id_multiplicity is routemm.DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN
    with pytest.raises(routemm.InvalidArgumentError, match="distinct top_k 9 exceeds n_experts 8"):
        routemm.dense_matmul_id_capability(routemm.DType.F32, params)
    repeat = dataclasses.replace(params, id_multiplicity=routemm.DenseMatmulIdMultiplicity.MAY_REPEAT)
    routemm.dense_matmul_id_capability(routemm.DType.F32, repeat)
    doc = params.to_dict()
    del doc["id_multiplicity"]  # a document still names it, as the reference's does
    with pytest.raises(routemm.InvalidArgumentError, match="id_multiplicity"):
        routemm.DenseMatmulIdParams.from_dict(doc)


@check("7.4-geometry", per_backend=True)
def _(rng, tmp_path, device):
    """The trace example (m=9, top_k=6, n=7, 8 experts) on every backend: the receipts equal
    dense_matmul_id_expected_dispatches, which is the spec's geometry on the CPU and Metal's own map."""
    spec = {
        "direct": [((1, 54, 1), (64, 1, 1), ())],
        "grouped_prefill": [((1, 1, 1), (8, 1, 1), ()), ((2, 1, 8), (256, 1, 1), ((0, 4096),))],
    }
    metal = dict(spec, grouped_prefill=[((1, 1, 1), (128, 1, 1), ((0, 16400),)), spec["grouped_prefill"][1]])
    registry = routemm.KernelRegistry(device)
    w, p, x, ids, out, scratch = id_setup(device, rng, m=9, n=7, top_k=6, E=8)
    for route in (IdRoute.DIRECT, IdRoute.GROUPED_PREFILL):
        params = dataclasses.replace(p, route=route)
        enc = device.command_encoder()
        enc.start_encoded_dispatch_receipt(2)
        routemm.dense_matmul_id(enc, registry, w, x, ids, out, scratch, params)
        got = enc.take_encoded_dispatch_receipt()
        enc.commit_and_wait()
        assert got == routemm.dense_matmul_id_expected_dispatches(registry, routemm.DType.F32, params)
        want = {"cpu": spec, "metal_emu": metal, "metal": metal}.get(device.backend)
        if want is not None:  # CUDA: its own tiles, as the expected dispatches give them
            shapes = [(d.grid, d.threads_per_threadgroup, d.threadgroup_memory) for d in got]
            assert shapes == want[route.value], (device.backend, route, shapes)


def _simd_registry(device):
    """A registry whose frozen policy keeps the tensor-core candidates out of expert-ID calibrations
    (4.1-expert-tensor-mm): the spec's candidates on every backend."""
    registry = routemm.KernelRegistry(device)
    registry.freeze_ggml_routing_policy(Policy(expert_tensor_mm=routemm.GgmlTensorMmPreference.FORCE_SIMD))
    return registry


@check("7.6-accounting", per_backend=True)
def _(rng, tmp_path, device):
    w, p, *_ = id_setup(device, rng)
    case = [routemm.DenseMatmulIdCalibrationCase(w, p)]
    _, cold = routemm.calibrate_dense_matmul_id_routes(
        _simd_registry(device), device, 1, None, case, _timer=grouped_wins
    )
    d = cold.decisions[0]
    assert d.candidates == (IdRoute.GROUPED_PREFILL,)
    assert (d.proof_submissions, d.timing_submissions, d.calibration_submissions) == (4, 20, 24)
    assert d.proof_dispatches + d.timing_dispatches == 36 and cold.calibration_submissions == 25
    _, warm = routemm.calibrate_dense_matmul_id_routes(_simd_registry(device), device, 2, None, case)
    h = warm.decisions[0]
    assert h.process_cache_hit and (h.proof_submissions, h.proof_dispatches, h.timing_submissions) == (4, 6, 0)
    limits = routemm.DenseMatmulIdCalibrationLimits(max_submissions=23)
    w2, p2, *_ = id_setup(device, rng)
    _, tight = routemm.calibrate_dense_matmul_id_routes(
        _simd_registry(device), device, 1, limits, [routemm.DenseMatmulIdCalibrationCase(w2, p2)]
    )
    assert tight.decisions[0].status is routemm.DenseMatmulIdSelectionStatus.BUDGET_FALLBACK


@check("7.6-poison", per_backend=True)
def _(rng, tmp_path, device):
    from routemm.plans import _expert_id_plan as ex
    from routemm.plans import dense_matmul_id_plan as dp

    assert dp.POISON_BITS == 0x7FC000C7 and routemm.calibration.GUARD_ELEMENTS == 16
    poison = np.full(8 + 16, dp.POISON_BITS, np.uint32)
    written = poison.copy()
    written[:8] = np.float32(1.0).view(np.uint32)
    assert ex.proof_status(written, written, 8) == 0
    assert ex.proof_status(poison, None, 8) & routemm.calibration.STATUS_CONTROL_UNWRITTEN
    hit = written.copy()
    hit[8 + 15] = 0  # the last guard word
    assert ex.proof_status(hit, None, 8) & routemm.calibration.STATUS_CONTROL_GUARD
    seen = []
    real = ex.proof_status

    def spy(control, candidate, logical):
        seen.append((control.copy(), None if candidate is None else candidate.copy(), logical))
        return real(control, candidate, logical)

    w, p, *_ = id_setup(device, rng)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ex, "proof_status", spy)
        routemm.calibrate_dense_matmul_id_routes(
            routemm.KernelRegistry(device), device, 1, None, [routemm.DenseMatmulIdCalibrationCase(w, p)]
        )
    assert seen, device.backend
    for control, candidate, logical in seen:  # every proof output: the logical words, then 16 guards
        for words in (control,) if candidate is None else (control, candidate):
            assert len(words) == logical + 16, device.backend
            assert (words[logical:] == dp.POISON_BITS).all() and not (words[:logical] == dp.POISON_BITS).any()


@check("7.6-tensor-routes", per_backend=True)
def _(rng, tmp_path, device):
    """The candidates beyond the spec's grouped_prefill are exactly the tensor routes whose
    pipelines the backend registers, each with a stated tolerance; the CPU registers none."""
    import ml_dtypes
    from routemm.plans import dense_matmul_id_plan as dp

    registry = routemm.KernelRegistry(device)
    if device.backend == "cpu":
        assert not any(registry.has_kernel(name) for name in routemm.DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES)
    E, n, k, m, top_k = 8, 16, 64, 16, 2
    stack = device.from_numpy(rng.standard_normal((E, n, k)).astype(ml_dtypes.bfloat16))
    params = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * 2)
    case = routemm.DenseMatmulIdCalibrationCase(stack, params)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ROUTEMM_DISABLE_TENSOR_MM_ID", raising=False)
        _, receipt = routemm.calibrate_dense_matmul_id_routes(registry, device, 1, None, [case], _timer=grouped_wins)
    tensor = [r for r in dp.TENSOR_TOLERANCE if registry.has_kernel(dp._tensor_pipeline(r, routemm.DType.BF16))]
    assert list(receipt.decisions[0].candidates) == [IdRoute.GROUPED_PREFILL, *tensor], device.backend
    assert all(0 < dp.TENSOR_TOLERANCE[r] < 1 for r in tensor)


@check("7.1-bf16-dot-routes", per_backend=True)
def _(rng, tmp_path, device):
    """Explicit opt-in only; within the bound of docs/api.md where the CPU registers the pipelines,
    refused by name elsewhere."""
    import ml_dtypes

    E, n, k, m, top_k = 8, 16, 64, 12, 2
    w = rng.standard_normal((E, n, k)).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = (np.arange(m)[:, None] + np.arange(top_k)[None, :]) % E
    for rows in (1, m):  # never chosen by default
        _, receipt = routemm.matmul_id(w, x[:rows], ids[:rows], device=device, return_receipt=True)
        assert "bf16_dot" not in receipt.route.value, device.backend
    available = [routemm.KernelRegistry(device).has_kernel(name) for name in BF16_DOT_PIPELINES]
    assert len(set(available)) == 1 and (device.backend == "cpu" or not available[0]), device.backend
    w64, x64 = w.astype(np.float64)[ids], x.astype(np.float64)[:, None, None, :]
    want = (w64 * x64).sum(-1).reshape(m * top_k, n)
    bound = 2.0**-8 * np.abs(w64 * x64).sum(-1).reshape(m * top_k, n)
    for route in (IdRoute.DIRECT_BF16_DOT, IdRoute.GROUPED_BF16_DOT):
        if not available[0]:
            with pytest.raises(routemm.KernelNotFoundError, match="bf16dot"):
                routemm.matmul_id(w, x, ids, device=device, route=route)
            continue
        got, receipt = routemm.matmul_id(w, x, ids, device=device, route=route, return_receipt=True)
        assert receipt.route is route
        assert (np.abs(got - want) <= bound).all() and np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


@check("7.6-error-fallback")
def _(rng, tmp_path):
    device = cpu()
    registry = routemm.KernelRegistry(device)
    w, p, *_ = id_setup(device, rng)
    registry.inject_next_pipeline_lookup_failure("dense_matmul_id_grouped_f32_f32")
    _, rec = routemm.calibrate_dense_matmul_id_routes(
        registry, device, 1, None, [routemm.DenseMatmulIdCalibrationCase(w, p)]
    )
    d = rec.decisions[0]
    assert d.status is routemm.DenseMatmulIdSelectionStatus.ERROR_FALLBACK
    assert "dense_matmul_id_grouped_f32_f32" in d.diagnostic and d.selected_route is IdRoute.DIRECT


@check("7.6-epoch-check")
def _(rng, tmp_path):
    device = cpu()
    registry = routemm.KernelRegistry(device)
    w, p, x, ids, out, scratch = id_setup(device, rng)
    routemm.calibrate_dense_matmul_id_routes(registry, device, 5, None, [routemm.DenseMatmulIdCalibrationCase(w, p)])
    assert routemm.resolve_dense_matmul_id_auto_route(registry, device, w.dtype, p, activation_epoch=5)[2] == 5
    enc = device.command_encoder()
    before = routemm.dispatch_count()
    for wrong in (6, True, None):
        with pytest.raises(routemm.InvalidArgumentError, match="activation epoch mismatch"):
            routemm.dense_matmul_id_auto(enc, registry, device, w, x, ids, out, scratch, p, activation_epoch=wrong)
        with pytest.raises(routemm.InvalidArgumentError, match="activation epoch mismatch"):
            routemm.trace_dense_matmul_id_auto(
                enc, registry, device, w, x, ids, out, scratch, p, activation_epoch=wrong
            )
    # The caller's epoch is required wherever the plan decides a route: leaving it out is an error.
    with pytest.raises(TypeError, match="activation_epoch"):
        routemm.resolve_dense_matmul_id_auto_route(registry, device, w.dtype, p)
    with pytest.raises(TypeError, match="activation_epoch"):
        routemm.dense_matmul_id_auto(enc, registry, device, w, x, ids, out, scratch, p)
    with pytest.raises(TypeError, match="activation_epoch"):
        routemm.trace_dense_matmul_id_auto(enc, registry, device, w, x, ids, out, scratch, p)
    assert routemm.dispatch_count() == before  # refused before anything was encoded


@check("7.6-traces")
def _(rng, tmp_path):
    device = cpu()
    registry = routemm.KernelRegistry(device)
    w, p, x, ids, out, scratch = id_setup(device, rng)
    plan, _ = routemm.calibrate_dense_matmul_id_routes(
        registry, device, 3, None, [routemm.DenseMatmulIdCalibrationCase(w, p)], _timer=grouped_wins
    )
    enc = device.command_encoder()
    t = routemm.trace_dense_matmul_id_auto(enc, registry, device, w, x, ids, out, scratch, p, activation_epoch=3)
    assert t.route is IdRoute.GROUPED_PREFILL and len(t.encoded) == 2 and t.plan_id == plan.plan_id
    assert t.theorem_sha256 == plan.theorem_sha256 and t.activation_epoch == 3
    direct = routemm.trace_dense_matmul_id(enc, registry, device, w, x, ids, out, None, p)
    assert [d.pipeline_label for d in direct.encoded] == ["dense_matmul_id_direct_f32_f32"]
    enc.commit_and_wait()
    assert routemm.DenseMatmulIdDispatchTrace.from_json(t.to_json()) == t
    # The §7.4 trace example's geometry on the reference (CPU) backend.
    ex = routemm.DenseMatmulIdParams(9, 7, 35, 6, 8, 7 * 35 * 2, route=IdRoute.GROUPED_PREFILL)
    got = routemm.dense_matmul_id_expected_dispatches(registry, routemm.DType.BF16, ex)
    assert [(d.grid, d.threads_per_threadgroup) for d in got] == [((1, 1, 1), (8, 1, 1)), ((2, 1, 8), (256, 1, 1))]
    assert got[1].threadgroup_memory == ((0, 4096),)


# ---- the table ----------------------------------------------------------------------------------


def test_table_rows_have_checks():
    table = rows()
    assert len(table) >= 40
    ids = [r["id"] for r in table]
    assert len(ids) == len(set(ids)), "row ids repeat"
    checked = {r["id"] for r in table if r["checked_by"] == "check"}
    assert checked == checked_rows(), (
        f"rows naming a check that does not exist: {sorted(checked - checked_rows())}; "
        f"checks without a row: {sorted(checked_rows() - checked)}"
    )
    here = Path(__file__).resolve().parent
    for r in table:
        assert not r["status"].lower().startswith("missing"), r
        if r["status"] == "same":
            assert r["checked_by"] not in ("", "—"), f"row {r['id']} is marked same but names no check"
        if r["status"] == "same" and r["checked_by"] != "check":
            # a row checked elsewhere names an existing test
            if re.fullmatch(r"check \([a-z0-9.\-]+\)", r["checked_by"]):
                continue  # another row's check asserts this row too (resolved by unresolved_references)
            path, _, name = r["checked_by"].partition("::")
            assert name and re.search(rf"^def {re.escape(name)}\(", (here / path).read_text(), re.M), r
        # exactly one of the four statuses: a qualified "same (...)" is a difference and says so as one
        assert re.fullmatch(r"same|(deliberately different|not applicable|planned) \(.+\)", r["status"]), r


def unresolved_references(table: list[dict]) -> list[str]:
    """Every test or check a row names, whatever its status, that does not exist: a `file.py::test`
    entry needs that file here to define that test; `check` / `check (row-id)` needs that row's check
    in this module."""
    here = Path(__file__).resolve().parent
    missing = []
    for r in table:
        cell = r["checked_by"]
        refs = re.findall(r"([\w/]+\.py)::(\w+)", cell)
        for path, name in refs:
            file = here / path
            if not (file.is_file() and re.search(rf"^\s*def {re.escape(name)}\(", file.read_text(), re.M)):
                missing.append(f"{r['id']}: {path}::{name}")
        for named in re.findall(r"\bcheck(?: \(([a-z0-9.\-]+)\))?", cell):
            if (named or r["id"]) not in checked_rows():
                missing.append(f"{r['id']}: check ({named or r['id']})")
        if not refs and not re.search(r"\bcheck\b", cell) and cell not in ("", "—"):
            missing.append(f"{r['id']}: unreadable reference {cell!r}")
    return missing


def test_every_named_test_exists():
    assert unresolved_references(rows()) == []


def test_a_row_naming_a_missing_test_is_caught():
    seeded = (
        "| `x.1-a` | 1 | a | b | test_core.py::test_no_such_test_here | deliberately different (c) |\n"
        "| `x.1-b` | 1 | a | b | test_nowhere.py::test_alloc_fields | same |\n"
        "| `x.1-c` | 1 | a | b | check (no-such-row) | deliberately different (c) |\n"
        "| `x.1-d` | 1 | a | b | test_core.py::test_alloc_fields | same |\n"
    )
    assert unresolved_references(rows(seeded)) == [
        "x.1-a: test_core.py::test_no_such_test_here",
        "x.1-b: test_nowhere.py::test_alloc_fields",
        "x.1-c: check (no-such-row)",
    ]


def _seed(row_id: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(row_id.encode()[-8:], "little"))


@pytest.mark.parametrize("row_id", sorted(CHECKS))
def test_same_row(row_id, tmp_path):
    CHECKS[row_id](_seed(row_id), tmp_path)


@pytest.mark.parametrize("row_id", sorted(BACKEND_CHECKS))
def test_row_on_backend(row_id, device, tmp_path):
    BACKEND_CHECKS[row_id](_seed(row_id), tmp_path, device)
