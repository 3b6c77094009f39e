"""The CUDA quantised expert-ID `direct` kernel has two data paths for operands that allow bulk
copies (a 16-byte aligned stack and input rows), chosen by ROUTEMM_CUDA_DIRECT_PATH (read once per
process): `bulk` (the copy engine stages weights and activations in shared memory, each row's
stage as the 16-byte units around it; sm_90a devices) and `loads` (the block's threads copy the
weights through shared memory). They run one lane contract, so every output bit must agree:
checked here in separate processes on fresh random Q4_0 and Q8_0 stacks with K long enough to
refill the stage ring, N tails, invalid ids, both input layouts, one and several tokens, and a K
whose rows are not whole 16-byte stages (the unit copies under `bulk`). The knob's validation runs
on every backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import routemm

_SCRIPT = """
    import sys
    import numpy as np, routemm
    sys.path.insert(0, {tests!r})
    from support import POISON_U32, distinct_ids, reference, sprinkle_invalid
    from routemm import DenseMatmulIdInputLayout as Layout, GgmlType, q4_0, q8_0

    device = routemm.Device("cuda")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng({seed})
    outputs = {{}}
    cases = [
        # (ggml type, m, n, k, top_k, experts, layout): K = 2304 is 3 stages of 32 blocks (a refill)
        (GgmlType.Q4_0, 1, 768, 2048, 8, 128, Layout.SHARED_PER_TOKEN),  # a Qwen3-30B-A3B token
        (GgmlType.Q4_0, 1, 40, 2304, 4, 8, Layout.SLOTTED),
        (GgmlType.Q8_0, 1, 40, 2304, 4, 8, Layout.SHARED_PER_TOKEN),
        (GgmlType.Q8_0, 2, 19, 256, 3, 4, Layout.SLOTTED),
        (GgmlType.Q4_0, 1, 16, 96, 2, 4, Layout.SHARED_PER_TOKEN),  # 54-byte rows: the unit copies
        # 1536 items (flat row x 16-column tile): more than a wave, so blocks take several items
        # and the ring runs on from one item into the next, past items with invalid ids
        (GgmlType.Q4_0, 64, 40, 2304, 8, 8, Layout.SLOTTED),
        (GgmlType.Q8_0, 64, 40, 2304, 8, 8, Layout.SHARED_PER_TOKEN),
    ]
    for i, (ggml_type, m, n, k, top_k, experts, layout) in enumerate(cases):
        fmt = q4_0 if ggml_type is GgmlType.Q4_0 else q8_0
        blocks = fmt.quantize(rng.uniform(-1.0, 1.0, (experts, n, k)).astype(np.float32))
        rows = m if layout is Layout.SHARED_PER_TOKEN else m * top_k
        x = rng.standard_normal((rows, k), dtype=np.float32)
        ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, experts), experts)
        params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, experts, ggml_type, blocks[0].nbytes,
                                                     layout, routemm.GgmlQuantizedMatmulIdRoute.DIRECT)
        out = device.from_numpy(np.full((m * top_k, n), POISON_U32, np.uint32).view(np.float32))
        encoder = device.command_encoder()
        routemm.quantized_matmul_id_ggml(encoder, registry, device.from_numpy(x),
                                         device.from_numpy(blocks.reshape(-1).view(np.uint8)),
                                         device.from_numpy(ids), out, None, params)
        encoder.commit_and_wait()
        got = out.numpy()
        assert not np.any(got.view(np.uint32) == POISON_U32), f"case {{i}}: an element was never written"
        ref, mag = reference(fmt.dequantize(blocks), x, ids, layout is Layout.SLOTTED)
        bad = np.abs(got - ref) > k * 2.0**-24 * mag * 1.01 + 1e-30
        assert not np.any(bad), f"case {{i}}: {{int(bad.sum())}} elements off the float64 reference"
        outputs[f"case{{i}}"] = got
    np.savez({path!r}, **outputs)
    print("knobs", routemm.env.non_default())
"""


def _run(path_value: str | None, out_path: str, seed: int) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("ROUTEMM_CUDA_DIRECT_PATH", None)
    if path_value is not None:
        env["ROUTEMM_CUDA_DIRECT_PATH"] = path_value
    tests = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(_SCRIPT.format(tests=tests, seed=seed, path=out_path))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


def test_bulk_and_load_paths_give_the_same_bits(backend, tmp_path):
    if backend != "cuda":
        pytest.skip("the data paths are the CUDA direct kernel's")
    seed = int(np.random.default_rng().integers(1 << 31))
    results = {}
    for value in (None, "loads", "bulk"):
        out_path = str(tmp_path / f"{value}.npz")
        run = _run(value, out_path, seed)
        assert run.returncode == 0, f"ROUTEMM_CUDA_DIRECT_PATH={value} (seed {seed}):\n{run.stderr[-3000:]}"
        if value is not None:
            assert f"'ROUTEMM_CUDA_DIRECT_PATH': '{value}'" in run.stdout, run.stdout
        results[value] = np.load(out_path)
    for value in ("loads", "bulk"):
        for name in results[None].files:
            np.testing.assert_array_equal(
                results[value][name].view(np.uint32),
                results[None][name].view(np.uint32),
                err_msg=f"{name}: ROUTEMM_CUDA_DIRECT_PATH={value} differs from the default (seed {seed})",
            )


def test_direct_path_knob_is_validated():
    env = dict(os.environ, ROUTEMM_CUDA_DIRECT_PATH="fast")
    run = subprocess.run(
        [sys.executable, "-c", "import routemm; routemm.env.non_default()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "ROUTEMM_CUDA_DIRECT_PATH must be bulk or loads, got 'fast'" in run.stderr


def test_direct_path_knob_is_in_the_table():
    names = {knob.name for knob in routemm.env.KNOBS}
    assert "ROUTEMM_CUDA_DIRECT_PATH" in names
