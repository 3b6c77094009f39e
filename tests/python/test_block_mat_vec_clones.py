"""The exact mat-vec on the CPU of the K-quants (Q4_K, Q5_K, Q6_K) and of Q4_1, Q5_0, Q5_1, MXFP4, which
decodes each 32-value (sub-)block in registers: every instruction-set clone gives the portable
clone's bits, and the mat-vec (m <= 8) gives the bits of the decoded-panel matrix route (m = 9)
row for row, for random block headers (negative and zero d / dmin / m, every 6-bit scale and min,
negative Q6_K scales), K = 256 .. 2048 and an odd N (tails of every column split). The expert-ID
direct and grouped routes run the same mat-vec on their rows and must give the same bits too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import routemm

FORMATS = ("q4_k", "q5_k", "q6_k", "q4_1", "q5_0", "q5_1", "mxfp4")
KS = (256, 768, 2048)
N = 71  # odd: neither the 64-column item nor the 8-column mat-vec pass divides it
MS = tuple(range(1, 10))

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import routemm
    from routemm import DType, GgmlType
    from routemm import DenseMatmulIdInputLayout as Layout
    from routemm import GgmlQuantizedMatmulIdRoute as Route

    FORMATS, KS, N, MS = json.loads(sys.argv[2])
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(20261207)
    GEOMETRY = {f[0]: (f[2], f[3]) for f in routemm._core.GGML_KERNEL_FORMATS}  # values, bytes
    HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "mxfp4": ()}

    def blocks_of(name, shape):
        # Random bytes (every scale, min and code), with binary16 d / dmin / m of either sign, a
        # tenth of them zero.
        values, block_bytes = GEOMETRY[name]
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // values, block_bytes), dtype=np.uint8)
        for offset in HALVES[name]:
            d = rng.uniform(-2e-2, 2e-2, raw.shape[:-1])
            d[rng.random(d.shape) < 0.1] = 0.0
            raw[..., offset : offset + 2] = d.astype(np.float16)[..., None].view(np.uint8)
        if name == "mxfp4":  # E8M0 exponents, subnormal scales (e < 2) included, no overflow
            raw[..., 0] = rng.choice(np.r_[0:4, 100:140], raw.shape[:-1])
        return raw.reshape(*shape[:-1], -1)

    def dense(x, w, name, k):
        m = x.shape[0]
        out = device.alloc(m * N * 4, DType.F32, [m, N])
        encoder = device.command_encoder()
        routemm.quantized_matmul_ggml(
            encoder, registry, device.from_numpy(x), device.from_numpy(w), out,
            routemm.GgmlQuantizedMatmulParams(m, N, k, GgmlType(name)),
        )
        encoder.commit_and_wait()
        return out.numpy().reshape(m, N)

    outputs = {}
    for name in FORMATS:
        for k in KS:
            w = blocks_of(name, (N, k))
            x = rng.uniform(-1, 1, (max(MS), k)).astype(np.float32)
            outputs[f"{name}/k{k}/weights"] = routemm.dequantize(w, GgmlType(name), (N, k))
            outputs[f"{name}/k{k}/x"] = x
            for m in MS:
                outputs[f"{name}/k{k}/m{m}"] = dense(x[:m], w, name, k)
        k = KS[-1]
        stack = blocks_of(name, (4, N, k))
        x = rng.uniform(-1, 1, (9, k)).astype(np.float32)
        ids = np.stack([rng.permutation(4)[:2] for _ in range(9)]).astype(np.uint32)
        outputs[f"{name}/experts/ids"] = ids
        outputs[f"{name}/experts/x"] = x
        for e in range(4):
            outputs[f"{name}/experts/dense{e}"] = dense(x, stack[e], name, k)
        for route in (Route.DIRECT, Route.GROUPED):
            out = device.alloc(18 * N * 4, DType.F32, [18, N])
            params = routemm.GgmlQuantizedMatmulIdParams(
                9, N, k, 2, 4, GgmlType(name), stack[0].nbytes, Layout.SHARED_PER_TOKEN, route
            )
            scratch = routemm.DenseMatmulIdScratch(device, 4, 9) if route.is_grouped else None
            encoder = device.command_encoder()
            routemm.quantized_matmul_id_ggml(
                encoder, registry, device.from_numpy(x), device.from_numpy(stack.reshape(-1)),
                device.from_numpy(ids), out, scratch, params,
            )
            encoder.commit_and_wait()
            outputs[f"{name}/experts/{route.value}"] = out.numpy().reshape(18, N)
    np.savez(sys.argv[1], **outputs)
    print(json.dumps({"isa": device.properties["isa"]}))
    """
)


def _run(isa: str, path, threads: int = 2) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ROUTEMM_BACKEND"}
    env["ROUTEMM_CPU_ISA"] = isa
    env["ROUTEMM_CPU_THREADS"] = str(threads)
    args = json.dumps([FORMATS, KS, N, MS])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["isa"]


def _load(path) -> dict:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def _same_bits(got, want, what):
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=what)


@pytest.fixture(scope="module")
def clones(tmp_path_factory) -> dict:
    """The outputs of every clone this CPU runs (portable first), plus the best on one thread."""
    tmp = tmp_path_factory.mktemp("kquant_clones")
    ran = {}
    for isa in ("portable", "avx2", "avx512"):
        path = tmp / f"{isa}.npz"
        if _run(isa, path) == isa:  # else the CPU lacks this clone (its cap selected a lower one)
            ran[isa] = _load(path)
    best = list(ran)[-1]
    _run(best, tmp / "one_thread.npz", threads=1)
    ran[f"{best} on one thread"] = _load(tmp / "one_thread.npz")
    return ran


pytestmark = pytest.mark.skipif("cpu" not in routemm.available_backends(), reason="no cpu backend")


def test_portable_clone_meets_the_reference(clones):
    out = clones["portable"]
    for name in FORMATS:
        for k in KS:
            w = out[f"{name}/k{k}/weights"].astype(np.float64)
            x = out[f"{name}/k{k}/x"].astype(np.float64)
            ref = x @ w.T
            mag = np.abs(x) @ np.abs(w).T
            for m in MS:
                got = out[f"{name}/k{k}/m{m}"].astype(np.float64)
                err = np.abs(got - ref[:m])
                assert np.all(err <= 2.0**-20 * mag[:m] * k**0.5 + 1e-30), f"{name} k={k} m={m}: {err.max()}"


def test_every_clone_gives_the_portable_bits(clones):
    if len(clones) < 3:
        pytest.skip("this CPU runs only the portable clone")
    base = clones["portable"]
    for isa, outputs in clones.items():
        assert outputs.keys() == base.keys()
        for key, value in outputs.items():
            _same_bits(value, base[key], f"{isa} vs portable: {key}")


def test_mat_vec_rows_equal_the_matrix_route_and_the_expert_routes(clones):
    for isa, out in clones.items():
        for name in FORMATS:
            for k in KS:
                panel = out[f"{name}/k{k}/m9"]  # m > 8: the decoded-panel matrix route
                for m in MS[:-1]:
                    _same_bits(out[f"{name}/k{k}/m{m}"], panel[:m], f"{isa} {name} k={k} m={m} vs m=9")
            ids = out[f"{name}/experts/ids"]
            # Flat row token * top_k + slot is expert ids[token, slot]'s dense row of the token.
            want = np.stack([out[f"{name}/experts/dense{ids[t, s]}"][t] for t, s in np.ndindex(*ids.shape)])
            for route in ("direct", "grouped"):
                _same_bits(out[f"{name}/experts/{route}"], want, f"{isa} {name} {route}")
