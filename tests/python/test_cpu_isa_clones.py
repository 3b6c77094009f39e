"""The CPU kernels' instruction-set clones (portable, AVX2, AVX-512) give the same bits.

ROUTEMM_CPU_ISA caps the clone a process runs (it is read once, so each clone runs in its own
child process). Every child computes the same block-quantised products -- the Q4_0 / Q8_0 mat-vec
(every m <= 8, column tails) and matrix routes (row and column tails, K not a multiple of the panel
depth), the quantised expert-ID direct and grouped routes, weights with an infinite and a zero
block scale, and one block under each of the 65536 binary16 scales (the clones widen scales their
own ways) -- and the reduced-precision int8-dot routes of the dense product (mat-vec and matrix;
their clones are scalar, AVX2 vpmaddubsw and AVX512_VNNI vpdpbusd) and of the quantised expert-ID
matmul (direct and grouped), and the parent compares their
outputs bit for bit (NaN positions must agree; NaN payloads are not pinned by the contract). The
best clone also runs on one thread: the results do not depend on the thread count either. A clone
the CPU lacks is a skip, never a pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import routemm
from support import run_python

pytestmark = pytest.mark.skipif("cpu" not in routemm.available_backends(), reason="no cpu backend")

ISAS = ("portable", "avx2", "avx512")

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import routemm
    from routemm import DenseMatmulIdInputLayout as Layout
    from routemm import DType, GgmlType, q4_0, q8_0
    from routemm import GgmlQuantizedMatmulIdRoute as Route

    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(20240601)
    formats = {GgmlType.Q4_0: q4_0, GgmlType.Q8_0: q8_0}
    outputs = {}

    def blocks_with_special_scales(fmt, n, k):
        # Weight row 0, block 1: an infinite scale over quants of value +1 (every weight +inf);
        # with positive activations there the output is +inf, not NaN. Row n - 1, block 0: a zero
        # scale.
        blocks = fmt.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32))
        raw = blocks.reshape(n, k // 32, -1)
        raw[0, 1, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
        raw[0, 1, 2:] = 0x99 if fmt is q4_0 else 1
        raw[n - 1, 0, :2] = 0
        if fmt is q8_0:
            raw[1, 0, 2:] = 0x80  # -128, which the quantiser never writes (the int8 clones' edge)
        return blocks

    def activations(m, k):
        x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        x[:, 32:64] = np.abs(x[:, 32:64]) + 0.5
        return x

    def dense(ggml_type, m, n, k, policy=None):
        blocks = blocks_with_special_scales(formats[ggml_type], n, k)
        x = activations(m, k)
        out = device.alloc(m * n * 4, DType.F32, [m, n])
        encoder = device.command_encoder()
        routemm.quantized_matmul_ggml(
            encoder, registry, device.from_numpy(x), device.from_numpy(blocks), out,
            routemm.GgmlQuantizedMatmulParams(m, n, k, ggml_type), policy,
        )
        encoder.commit_and_wait()
        return out.numpy().reshape(m, n)

    def expert_id(ggml_type, route, m, n, k, top_k, n_experts):
        fmt = formats[ggml_type]
        stack = np.stack([blocks_with_special_scales(fmt, n, k) for _ in range(n_experts)])
        stride = stack[0].nbytes
        x = activations(m, k)
        ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(m)]).astype(np.uint32)
        out = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
        params = routemm.GgmlQuantizedMatmulIdParams(
            m, n, k, top_k, n_experts, ggml_type, stride, Layout.SHARED_PER_TOKEN, route
        )
        scratch = routemm.DenseMatmulIdScratch(device, n_experts, m) if route.is_grouped else None
        encoder = device.command_encoder()
        routemm.quantized_matmul_id_ggml(
            encoder, registry, device.from_numpy(x), device.from_numpy(stack.reshape(-1)),
            device.from_numpy(ids), out, scratch, params,
        )
        encoder.commit_and_wait()
        return out.numpy().reshape(m * top_k, n)

    def every_scale(ggml_type, m):
        # One block per weight row, row j scaled by the binary16 bit pattern j: every zero,
        # subnormal, normal, infinite and NaN scale of either sign, each through its own output.
        n = 1 << 16
        blocks = formats[ggml_type].quantize(rng.uniform(-1, 1, (n, 32)).astype(np.float32))
        raw = blocks.reshape(n, -1)
        raw[:, :2] = np.arange(n, dtype=np.uint16).view(np.uint8).reshape(n, 2)
        x = activations(m, 32)
        out = device.alloc(m * n * 4, DType.F32, [m, n])
        encoder = device.command_encoder()
        routemm.quantized_matmul_ggml(
            encoder, registry, device.from_numpy(x), device.from_numpy(blocks), out,
            routemm.GgmlQuantizedMatmulParams(m, n, 32, ggml_type),
        )
        encoder.commit_and_wait()
        return out.numpy().reshape(m, n)

    for ggml_type in formats:
        for m in (1, 3, 4, 6, 9):
            outputs[f"{ggml_type.value}/every_scale/m{m}"] = every_scale(ggml_type, m)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 70):
            for n, k in ((13, 96), (70, 608)):
                outputs[f"{ggml_type.value}/dense/m{m}/n{n}/k{k}"] = dense(ggml_type, m, n, k)
                outputs[f"{ggml_type.value}/int8_dot/m{m}/n{n}/k{k}"] = dense(
                    ggml_type, m, n, k, routemm.GgmlRoutingPolicy(dense_int8_dot=True)
                )
        for route in (Route.DIRECT, Route.GROUPED, Route.DIRECT_INT8_DOT, Route.GROUPED_INT8_DOT):
            for m in (1, 5, 40):
                outputs[f"{ggml_type.value}/{route.value}/m{m}"] = expert_id(ggml_type, route, m, 70, 608, 3, 6)
    # The K-quant int8-dot routes (ggml_kquant_int8_dot.h): dense mat-vec and matrix, direct and
    # grouped, K = 768 (three super-blocks), N = 70, weights with every code and scale in use.
    from routemm.formats import ggml as ggml_codecs

    def kquant_blocks(ggml_type, shape):
        return ggml_codecs.quantize(rng.standard_normal(shape).astype(np.float32), ggml_type)

    int8 = routemm.GgmlRoutingPolicy(dense_int8_dot=True)
    for ggml_type in (GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K):
        for m in (1, 3, 9, 40):
            blocks, x = kquant_blocks(ggml_type, (70, 768)), activations(m, 768)
            out = device.alloc(m * 70 * 4, DType.F32, [m, 70])
            encoder = device.command_encoder()
            routemm.quantized_matmul_ggml(
                encoder, registry, device.from_numpy(x), device.from_numpy(blocks), out,
                routemm.GgmlQuantizedMatmulParams(m, 70, 768, ggml_type), int8,
            )
            encoder.commit_and_wait()
            outputs[f"{ggml_type.value}/int8_dot/m{m}"] = out.numpy().reshape(m, 70)
        # One row, more super-blocks than a one-row item's chunk (16) and a column tail (19 = 8 +
        # 8 + 3): the AVX clones' register-decoded path against the portable clone.
        blocks, x = kquant_blocks(ggml_type, (19, 256 * 18)), activations(1, 256 * 18)
        out = device.alloc(19 * 4, DType.F32, [1, 19])
        encoder = device.command_encoder()
        routemm.quantized_matmul_ggml(
            encoder, registry, device.from_numpy(x), device.from_numpy(blocks), out,
            routemm.GgmlQuantizedMatmulParams(1, 19, 256 * 18, ggml_type), int8,
        )
        encoder.commit_and_wait()
        outputs[f"{ggml_type.value}/int8_dot/long"] = out.numpy().reshape(1, 19)
        for route in (Route.DIRECT_INT8_DOT, Route.GROUPED_INT8_DOT):
            for m in (1, 40):
                stack = kquant_blocks(ggml_type, (6, 70, 768))
                x = activations(m, 768)
                ids = np.stack([rng.permutation(6)[:3] for _ in range(m)]).astype(np.uint32)
                out = device.alloc(m * 3 * 70 * 4, DType.F32, [m * 3, 70])
                params = routemm.GgmlQuantizedMatmulIdParams(
                    m, 70, 768, 3, 6, ggml_type, stack[0].nbytes, Layout.SHARED_PER_TOKEN, route
                )
                scratch = routemm.DenseMatmulIdScratch(device, 6, m) if route.is_grouped else None
                encoder = device.command_encoder()
                routemm.quantized_matmul_id_ggml(
                    encoder, registry, device.from_numpy(x), device.from_numpy(stack.reshape(-1)),
                    device.from_numpy(ids), out, scratch, params,
                )
                encoder.commit_and_wait()
                outputs[f"{ggml_type.value}/{route.value}/m{m}"] = out.numpy().reshape(m * 3, 70)
    np.savez(sys.argv[1], **outputs)
    print(json.dumps({"isa": device.properties["isa"]}))
    """
)


def _run_clone(isa: str, path, threads: int = 2) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ROUTEMM_BACKEND"}
    env["ROUTEMM_CPU_ISA"] = isa
    env["ROUTEMM_CPU_THREADS"] = str(threads)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["isa"]


def _assert_same_bits(name: str, a: np.ndarray, b: np.ndarray) -> None:
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(nan_a, nan_b, err_msg=f"{name}: NaN positions differ")
    np.testing.assert_array_equal(
        np.where(nan_a, 0, a).view(np.uint32), np.where(nan_b, 0, b).view(np.uint32), err_msg=name
    )


def test_cpu_isa_clones_are_bit_identical(tmp_path):
    ran: dict[str, dict[str, np.ndarray]] = {}
    for isa in ISAS:
        path = tmp_path / f"{isa}.npz"
        if _run_clone(isa, path) != isa:
            continue  # the CPU lacks this clone (its cap selected a lower one)
        with np.load(path) as data:
            ran[isa] = {name: data[name] for name in data.files}
    if len(ran) < 2:
        pytest.skip(f"this CPU runs only the {', '.join(ran)} clone")
    best = list(ran)[-1]
    _run_clone(best, tmp_path / "one_thread.npz", threads=1)
    with np.load(tmp_path / "one_thread.npz") as data:
        ran[f"{best} on one thread"] = {name: data[name] for name in data.files}
    base_isa, base = next(iter(ran.items()))
    # The infinite scale reaches the outputs as the IEEE products d * (q - 8) give it: +inf in
    # weight row 0's column, finite elsewhere.
    names = ("q4_0/dense/m1/n70/k608", "q4_0/dense/m33/n70/k608", "q8_0/dense/m5/n13/k96")
    for name in names + tuple(name.replace("dense", "int8_dot") for name in names):
        assert np.all(np.isposinf(base[name][:, 0])) and np.all(np.isfinite(base[name][:, 1:])), name
    for isa, outputs in ran.items():
        assert outputs.keys() == base.keys()
        for name, value in outputs.items():
            _assert_same_bits(f"{isa} vs {base_isa}: {name}", value, base[name])


def test_cpu_isa_knob_caps_the_clone_and_is_recorded():
    code = (
        "import routemm; print(routemm.Device('cpu').properties['isa'], routemm.env.non_default()['ROUTEMM_CPU_ISA'])"
    )
    done = run_python(code, unset=("ROUTEMM_BACKEND",), ROUTEMM_CPU_ISA="portable")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["portable", "portable"]
    assert routemm.Device("cpu").properties["isa"] in ISAS
    assert "ROUTEMM_CPU_ISA" in routemm.env.table_markdown()


def test_cpu_isa_knob_rejects_unknown_values():
    code = "import routemm; routemm.Device('cpu').properties"
    done = run_python(code, unset=("ROUTEMM_BACKEND",), ROUTEMM_CPU_ISA="avx1024")
    assert done.returncode != 0
    assert "ROUTEMM_CPU_ISA must be portable, avx2 or avx512, got 'avx1024'" in done.stderr


_IDENTITY_CHILD = textwrap.dedent(
    """
    import numpy as np
    import routemm
    from routemm import DType, GgmlType, q4_0

    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    m, n, k = 1, 8, 64
    x = device.from_numpy(np.ones((m, k), np.float32))
    w = device.from_numpy(q4_0.quantize(np.ones((n, k), np.float32)))
    out = device.alloc(m * n * 4, DType.F32, [m, n])
    encoder = device.command_encoder()
    params = routemm.GgmlQuantizedMatmulParams(m, n, k, GgmlType.Q4_0)
    receipt = routemm.quantized_matmul_ggml(encoder, registry, x, w, out, params)
    encoder.commit_and_wait()
    print(device.properties["isa"], registry.pipeline_identity(receipt.pipeline_label).origin)
    """
)


@pytest.mark.parametrize("cap", [None, "portable", "avx2"])
def test_cpu_pipeline_identity_names_the_clone(cap):
    # A receipt's pipeline label resolves to the pipeline's identity, whose origin names the clone
    # the kernels ran (the same name as Device('cpu').properties['isa']); plan build fingerprints
    # and dispatch traces carry these identities.
    env = {} if cap is None else {"ROUTEMM_CPU_ISA": cap}
    unset = ("ROUTEMM_BACKEND", "ROUTEMM_CPU_ISA")
    done = run_python(_IDENTITY_CHILD, unset=unset, **env)
    assert done.returncode == 0, done.stderr
    isa, origin = done.stdout.split()
    if cap is not None and isa != cap:
        pytest.skip(f"this CPU has no {cap} clone")
    assert origin == f"builtin_cpu:{isa}"
