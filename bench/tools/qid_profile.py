"""One quantised expert-ID matmul call per case, for Nsight Compute: each case runs twice (warm-up,
then the launch to profile with --launch-skip 1), on random blocks and router-like ids.

    ncu --clock-control none -k regex:'grouped_tensor_kernel|direct' --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats \
        python3 bench/tools/qid_profile.py q4_k:qwen3-30b-a3b-up:512:lowp

A case is TYPE:SHAPE-PROJ:M:ROUTE, ROUTE one of direct, grouped, lowp (grouped_tensor_lowp); shapes
and projections as bench/tools/qid_format_timing.py names them (qwen3-30b-a3b-up, gpt-oss-20b-down).
`--time` instead prints each case's GPU time per call (median of 5 batches of 20 calls, one weight
copy: L2-warm where it fits), without a profiler.
"""

import statistics
import sys
from pathlib import Path

import numpy as np
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import GgmlQuantizedMatmulIdRoute as Route
from routemm import GgmlType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qid_format_timing import projection, random_stack  # noqa: E402

ROUTES = {"direct": Route.DIRECT, "grouped": Route.GROUPED, "lowp": Route.GROUPED_TENSOR_LOWP}


def run(device, registry, case: str, timed: bool) -> None:
    name, shape_proj, m, route = case.split(":")
    shape, proj = shape_proj.rsplit("-", 1)
    m = int(m)
    experts, top_k, n, k = projection(shape, proj)
    rng = np.random.default_rng(0)
    stack = random_stack(rng, name, experts, n, k)
    w = device.from_numpy(stack.reshape(-1))
    x = device.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    ids = device.from_numpy(np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.uint32))
    out = device.alloc(m * top_k * n * 4, routemm.DType.F32, [m * top_k, n])
    r = ROUTES[route]
    params = routemm.GgmlQuantizedMatmulIdParams(
        m, n, k, top_k, experts, GgmlType(name), stack[0].nbytes, Layout.SHARED_PER_TOKEN, r
    )
    scratch = routemm.DenseMatmulIdScratch(device, experts, m) if r.is_grouped else None
    calls = 20 if timed else 1
    samples = []
    for _ in range(6 if timed else 2):
        enc = device.command_encoder()
        for _ in range(calls):
            routemm.quantized_matmul_id_ggml(enc, registry, x, w, ids, out, scratch, params)
        start, end = enc.commit_wait_with_gpu_time()
        samples.append((end - start) / calls)
    if timed:
        print(f"{case}: {statistics.median(samples[1:]) * 1e6:.1f} us per call", flush=True)
    else:
        print(case, "done", flush=True)


def main(argv: list[str]) -> None:
    timed = "--time" in argv
    device = routemm.Device("cuda")
    registry = routemm.KernelRegistry(device)
    for case in [a for a in argv if a != "--time"]:
        run(device, registry, case, timed)


if __name__ == "__main__":
    main(sys.argv[1:])
