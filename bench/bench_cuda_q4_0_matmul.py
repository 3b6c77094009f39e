"""H200 benchmark of the GGML Q4_0 dense projection (routemm.quantized_matmul_ggml) on "cuda".

    python -m pytest bench/bench_cuda_q4_0_matmul.py -q -s -p no:cacheprovider \
        --results bench/results/q4_0_matmul-h200.json

(no --benchmark-only: these cases time themselves with CUDA events and CUPTI, not with the
pytest-benchmark fixture, and that flag would skip them.)

Shapes (n x k): 4096x14336 (llama.cpp's perf case) and the Qwen3-30B-A3B dense attention
projections (hidden 2048): q_proj 4096x2048, k_proj 512x2048, o_proj 2048x4096. m in {1, 2, 4, 8,
9, 16, 32, 64, 128, 512, 4096} for 4096x14336 and {1, 8, 9, 32, 128, 512, 4096} for the others.
Restrict with pytest -k (ids are `<shape>-m<m>-<impl>`) or the environment:
    ROUTEMM_BENCH_Q4_SHAPES=4096x14336,q_proj   shapes (key or suffix; "all" = every shape)
    ROUTEMM_BENCH_Q4_MS=1,8,512                 m values for every selected shape ("all" = all 11)
    ROUTEMM_BENCH_Q4_PEERS=0                    no PyTorch baselines
    ROUTEMM_BENCH_Q4_CUPTI=0                    no CUPTI kernel times (CUDA-event times only)
    ROUTEMM_BENCH_Q4_TARGET_S=0.05              device seconds per measurement (5 batches)
    ROUTEMM_BENCH_Q4_L2_RESIDENT=1              one weight per shape, reused by every call (the
                                                weights stay in L2, as in llama.cpp's
                                                test-backend-ops perf); records say "L2-resident"

Per (shape, m), in this order:
  - torch_cublas_f16: x.half() @ w16.T with the weights already dequantised to f16 [n, k] (cuBLAS);
  - torch_dequant_cublas_f16: the same, dequantising from the raw GGUF blocks on the GPU in torch
    ops inside every call;
  - routemm, m <= 8: the default path (explicit GgmlRoutingPolicy(), i.e. the mat-vec pipeline);
  - routemm, m > 8: each DenseQ4Route forced through encode_q4_route, then the default policy path
    (without a frozen plan that is the compatibility fallback; the receipt says which route ran).

Every implementation is first run on rotation copy 0 and compared against a float64 reference
(dequantised weights, up to 64 sampled rows of x): relative Frobenius error above 1e-2, or a
non-finite value, fails the case and records it with time_us = -1 instead of a time.

Timing. Weights rotate among distinct buffers totalling >= 256 MB (more than 2x the H200's L2),
one buffer per call, so no call reads its weights from L2; the f16 baseline rotates its own
copies the same way. Two numbers per case, both per call:
  - kernel_us: the median over calls of the summed durations of each call's kernels, memcpys and
    memsets, from CUPTI (torch.profiler). This is time_us when the profiler is available.
  - event_us: CUDA-event time over N back-to-back calls divided by N (routemm: one encoder and
    commit_wait_with_gpu_time; torch: events on its stream), median of 5 batches. Before each batch
    a spin kernel on the legacy default stream holds the GPU (routemm's streams are blocking
    streams, so they wait for it) while the host enqueues all N calls, so host launch overhead is
    not timed; inter-kernel gaps are. `held` says whether the enqueue finished inside the hold.
Bytes are what the op must read and write: routemm n*k/32*18 (Q4_0 blocks) + m*k*4 + m*n*4;
f16 baseline n*k*2 + m*k*4 + m*n*2; dequant baseline adds the f16 weight write and re-read.
FLOPs = 2*m*n*k. frac_copy = TB/s / 4.17, frac_bf16 = TFLOP/s / 794 (the H200 ceilings of DESIGN.md).
Targets (issue 4, 4096x14336): m=1 <= 9.5 us, m=8 <= 14 us, m=512 >= 276 TFLOP/s and faster than
the dequant+cuBLAS baseline; the tensor_64x32 candidate faster than compatibility_v2 for
9 <= m <= 128 (on at least one shape) and compatibility_v2 faster for m >= 2048. Records carry
`target`/`target_met`, the candidate's `speedup_vs_v2`, and every routemm record its
`speedup_vs_torch_f16` / `speedup_vs_torch_dequant` (baseline time / routemm time). Each record
also names its GPU (`device`), pipeline label, receipt decision, rotation and relative error.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import pytest
import routemm
from routemm import q4_0

torch = pytest.importorskip("torch")

SHAPES = {  # name -> (n, k)
    "4096x14336": (4096, 14336),
    "qwen3-30b-a3b.q_proj": (4096, 2048),
    "qwen3-30b-a3b.k_proj": (512, 2048),
    "qwen3-30b-a3b.o_proj": (2048, 4096),
}
MS_ALL = [1, 2, 4, 8, 9, 16, 32, 64, 128, 512, 4096]
MS_SUBSET = [1, 8, 9, 32, 128, 512, 4096]
MAT_VEC_MAX_M = 8
CEILINGS = {"copy_TBps": 4.17, "bf16_TFLOPs": 794}
ROTATE_BYTES = 256e6  # > 2 x the H200's L2, per rotated weight set
BATCHES = 5
MAX_CALLS = 200
CUPTI_CALLS = 20
TOLERANCE = 1e-2  # relative Frobenius error against the float64 reference
REF_ROWS = 64
SPIN_HZ = 2.0e9  # >= the H200's SM clock, so a spin of c cycles lasts at least c / SPIN_HZ seconds
POLICY = routemm.GgmlRoutingPolicy()  # explicit: never reads the environment
ROUTES = list(routemm.DenseQ4Route)
PEERS = ["torch_cublas_f16", "torch_dequant_cublas_f16"]
TORCH_DEVICE = "cuda"  # where the torch tensors live (the routemm buffers wrap them zero-copy)

TARGET_SHAPE = "4096x14336"
TARGET_M1_US = 9.5
TARGET_M8_US = 14.0
TARGET_M512_TFLOPS = 276.0


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default).strip()


TARGET_S = float(_env("ROUTEMM_BENCH_Q4_TARGET_S", "0.05"))
WITH_PEERS = _env("ROUTEMM_BENCH_Q4_PEERS", "1") not in ("0", "false", "off")
WITH_CUPTI = _env("ROUTEMM_BENCH_Q4_CUPTI", "1") not in ("0", "false", "off")
L2_RESIDENT = _env("ROUTEMM_BENCH_Q4_L2_RESIDENT", "0") in ("1", "true", "on")


def _selected_shapes() -> list[str]:
    spec = _env("ROUTEMM_BENCH_Q4_SHAPES", "all")
    if spec in ("", "all"):
        return list(SHAPES)
    chosen = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        hits = [s for s in SHAPES if s == word or s.endswith("." + word)]
        if not hits:
            raise ValueError(f"ROUTEMM_BENCH_Q4_SHAPES: unknown shape {word!r} (known: {', '.join(SHAPES)})")
        chosen += [h for h in hits if h not in chosen]
    return chosen


def _selected_ms(shape: str) -> list[int]:
    spec = _env("ROUTEMM_BENCH_Q4_MS", "")
    if spec == "all":
        return MS_ALL
    if spec:
        return [int(v) for v in spec.split(",") if v.strip()]
    return MS_ALL if shape == TARGET_SHAPE else MS_SUBSET


def _cases() -> list[tuple[str, int, str]]:
    cases = []
    for shape in _selected_shapes():
        for m in _selected_ms(shape):
            impls = list(PEERS) if WITH_PEERS else []
            if m > MAT_VEC_MAX_M:
                impls += [r.value for r in ROUTES]
            impls.append("default")
            cases += [(shape, m, impl) for impl in impls]
    return cases


# ---- helpers (device-agnostic: they run on CPU tensors as well) -------------------------------


def q4_bytes(m: int, n: int, k: int) -> int:
    """Bytes a Q4_0 projection must move: the weight blocks, the F32 input, the F32 output."""
    return n * k // 32 * 18 + m * k * 4 + m * n * 4


def f16_bytes(m: int, n: int, k: int) -> int:
    """x.half() @ w16.T: f16 weights, the F32 input, an f16 output."""
    return n * k * 2 + m * k * 4 + m * n * 2


def dequant_f16_bytes(m: int, n: int, k: int) -> int:
    """Dequantise then matmul: the blocks, the f16 weights written and read again, x, out."""
    return n * k // 32 * 18 + 2 * n * k * 2 + m * k * 4 + m * n * 2


def random_q4_blocks(copies: int, n: int, k: int, generator, device) -> torch.Tensor:
    """`copies` distinct [n, k/32*18] Q4_0 weights as uint8 [copies, n, k/32*18]: random nibbles and
    finite f16 scales of either sign (|d| in [0.004, 0.012], what N(0, 0.02) weights quantise to)."""
    nb = k // 32
    raw = torch.empty((copies, n, nb, 18), dtype=torch.uint8, device=device)
    scale = torch.rand((copies, n, nb, 1), generator=generator, device=device) * 0.008 + 0.004
    sign = torch.randint(0, 2, (copies, n, nb, 1), generator=generator, device=device) * 2 - 1
    raw[..., :2] = (scale * sign).to(torch.float16).view(torch.uint8)  # little-endian f16
    raw[..., 2:] = torch.randint(0, 256, (copies, n, nb, 16), generator=generator, device=device, dtype=torch.uint8)
    return raw.view(copies, n, nb * 18)


def torch_dequantize(blocks: torch.Tensor, dtype=None) -> torch.Tensor:
    """Raw GGUF Q4_0 bytes [n, k/32*18] -> [n, k] in torch ops: value j of a block is the low nibble
    of byte j, value j+16 the high nibble, each d * (nibble - 8). Exact in float32/float64; in f16
    it equals f16(exact), since an f16 product is correctly rounded."""
    dtype = torch.float16 if dtype is None else dtype
    n = blocks.shape[0]
    raw = blocks.reshape(n, -1, 18)
    d = raw[..., :2].contiguous().view(torch.float16)  # [n, nb, 1]
    qs = raw[..., 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [n, nb, 32]
    return ((q.to(dtype) - 8) * d.to(dtype)).reshape(n, -1)


def reference_rows(m: int, limit: int = REF_ROWS) -> torch.Tensor:
    """Up to `limit` row indices spread over [0, m), first and last included."""
    if m <= limit:
        return torch.arange(m)
    return torch.linspace(0, m - 1, limit).round().long().unique()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error ||got - want|| / ||want|| in float64 (inf if got is not finite)."""
    got = got.double()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    den = float(want.double().norm())
    return float((got - want.double()).norm()) / (den if den > 0 else 1.0)


def performance(t_s: float, nbytes: int, flops: int) -> dict:
    tbps, tflops = nbytes / t_s / 1e12, flops / t_s / 1e12
    return dict(
        time_us=t_s * 1e6,
        bytes=int(nbytes),
        flops=int(flops),
        TBps=tbps,
        TFLOPs=tflops,
        frac_copy=tbps / CEILINGS["copy_TBps"],
        frac_bf16=tflops / CEILINGS["bf16_TFLOPs"],
    )


# ---- timing ----------------------------------------------------------------------------------


def _legacy_default_stream() -> bool:
    return torch.cuda.current_stream().cuda_stream == 0


def _hold(seconds: float) -> float:
    """Spin the GPU on the legacy default stream for at least `seconds` (0 when it cannot):
    routemm's blocking streams and torch's default stream queue behind it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None or not _legacy_default_stream():
        return 0.0
    seconds = min(max(seconds, 50e-6), 0.2)
    sleep(int(seconds * SPIN_HZ))
    return seconds


def _calls_for(estimate_s: float) -> int:
    return int(max(3, min(MAX_CALLS, TARGET_S / BATCHES / max(estimate_s, 1e-7))))


def _cupti(run, n_calls: int):
    """Per-call device time from the CUPTI kernel, memcpy and memset records of run() (n_calls
    calls on one stream): when every call left the same number of records, the median over calls
    of each call's summed durations; otherwise the total / n_calls. None without the profiler."""
    if not WITH_CUPTI:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as g:
                trace = json.load(g)
    except Exception as exc:  # noqa: BLE001 - the event time still stands
        print(f"   profiler unavailable: {type(exc).__name__}: {str(exc)[:160]}")
        return None
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and "spin_kernel" not in e.get("name", "")
        ),
        key=lambda e: e["ts"],
    )
    if not gpu:
        return None
    if len(gpu) % n_calls == 0:
        per = len(gpu) // n_calls
        return statistics.median(sum(e["dur"] for e in gpu[i * per : (i + 1) * per]) for i in range(n_calls)) / 1e6
    return sum(e["dur"] for e in gpu) / 1e6 / n_calls


def time_routemm(device, encode) -> dict:
    """encode(encoder, j) encodes call j (rotation index j). Returns kernel/event times (s)."""
    enc = device.command_encoder()
    t0 = time.perf_counter()
    for j in range(3):
        encode(enc, j)
    host_s = (time.perf_counter() - t0) / 3
    enc.commit_and_wait()  # warm-up
    enc = device.command_encoder()
    encode(enc, 3)
    start, end = enc.commit_wait_with_gpu_time()
    n_calls = _calls_for(end - start)
    samples, held = [], True
    for b in range(BATCHES):
        hold = _hold(n_calls * host_s * 2 + 100e-6)
        t0 = time.perf_counter()
        enc = device.command_encoder()
        for i in range(n_calls):
            encode(enc, b * n_calls + i)
        held &= hold > 0 and time.perf_counter() - t0 < hold
        start, end = enc.commit_wait_with_gpu_time()
        samples.append((end - start) / n_calls)
    n_k = min(n_calls, CUPTI_CALLS)

    def run():
        enc = device.command_encoder()
        for i in range(n_k):
            encode(enc, i + 7)
        enc.commit_and_wait()

    return dict(event_s=statistics.median(samples), kernel_s=_cupti(run, n_k), calls=n_calls, held=held)


def time_torch(fn) -> dict:
    """fn(j) runs call j (rotation index j) on torch's current stream."""
    t0 = time.perf_counter()
    for j in range(3):
        fn(j)
    host_s = (time.perf_counter() - t0) / 3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(3)
    end.record()
    end.synchronize()
    n_calls = _calls_for(start.elapsed_time(end) / 1e3)
    samples, held = [], True
    for b in range(BATCHES):
        hold = _hold(n_calls * host_s * 2 + 100e-6)
        t0 = time.perf_counter()
        start.record()
        for i in range(n_calls):
            fn(b * n_calls + i)
        end.record()
        held &= hold > 0 and time.perf_counter() - t0 < hold
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n_calls)
    n_k = min(n_calls, CUPTI_CALLS)

    def run():
        for i in range(n_k):
            fn(i + 7)

    return dict(event_s=statistics.median(samples), kernel_s=_cupti(run, n_k), calls=n_calls, held=held)


# ---- per-shape state ---------------------------------------------------------------------------


class Bench:
    """The cuda device and registry, and one shape's rotated weights and per-m inputs at a time."""

    def __init__(self):
        self.device = routemm.Device("cuda")
        self.registry = routemm.KernelRegistry(self.device)
        self.gpu = torch.cuda.get_device_name(0)
        self.shape = None
        self.times: dict = {}  # (shape, m, impl) -> seconds, for cross-case notes

    def has(self, pipeline: str) -> bool:
        return bool(self.registry.has_kernel(pipeline))

    def load(self, shape: str):
        if self.shape == shape:
            return self.state
        self.shape, self.state = None, None
        torch.cuda.empty_cache()
        n, k = SHAPES[shape]
        gen = torch.Generator(device=TORCH_DEVICE)
        gen.manual_seed(0x5104 + n + k)
        wbytes = n * k // 32 * 18
        copies = 1 if L2_RESIDENT else max(4, math.ceil(ROTATE_BYTES / wbytes))
        q4 = random_q4_blocks(copies, n, k, gen, TORCH_DEVICE)
        # The torch dequantiser (also the reference's) must match routemm's exact host dequantiser.
        head = q4[0, :8].cpu()
        want = q4_0.dequantize(head.numpy(), (head.shape[0], k))
        got = torch_dequantize(head, torch.float32).numpy()
        if not np.array_equal(got, want):
            pytest.fail(f"{shape}: torch dequantiser disagrees with routemm.q4_0.dequantize")
        f16_copies = 1 if L2_RESIDENT else max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
        w16 = torch.stack([torch_dequantize(q4[j % copies]) for j in range(f16_copies)]) if WITH_PEERS else None
        torch.cuda.synchronize()
        self.state = dict(
            n=n,
            k=k,
            q4=q4,
            copies=copies,
            wbytes=wbytes,
            gen=gen,
            w_bufs=[routemm.from_dlpack(q4[j], self.device) for j in range(copies)],
            w16=w16,
            f16_copies=f16_copies,
            w64=torch_dequantize(q4[0], torch.float64),
            ms={},
        )
        self.shape = shape
        return self.state

    def inputs(self, shape: str, m: int):
        st = self.load(shape)
        if m not in st["ms"]:
            st["ms"].clear()
            x = torch.randn((m, st["k"]), device=TORCH_DEVICE, generator=st["gen"])
            out = torch.empty((m, st["n"]), device=TORCH_DEVICE)
            rows = reference_rows(m).to(TORCH_DEVICE)
            ref = x[rows].double() @ st["w64"].T
            torch.cuda.synchronize()
            st["ms"][m] = dict(
                x=x,
                out=out,
                x_buf=routemm.from_dlpack(x, self.device),
                out_buf=routemm.from_dlpack(out, self.device),
                rows=rows,
                ref=ref,
            )
        return st, st["ms"][m]


@pytest.fixture(scope="module")
def bench(results):
    ok = {name: (avail, why) for name, avail, why in routemm.backend_status()}
    avail, why = ok.get("cuda", (False, "unknown backend"))
    if not avail:
        pytest.skip(f"routemm cuda backend unavailable: {why}")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    b = Bench()
    if not any(b.has(p) for p in routemm.Q4_MATMUL_PIPELINE_NAMES):
        pytest.skip("the cuda registry has no Q4_0 pipelines (" + ", ".join(routemm.Q4_MATMUL_PIPELINE_NAMES) + ")")
    results.ceilings.update(CEILINGS)
    yield b
    b.state = None
    torch.cuda.empty_cache()


def _targets(shape: str, m: int, route: str, impl: str, perf: dict, bench: Bench) -> tuple[dict, list[str]]:
    extra, notes = {}, []
    t_us = perf["time_us"]
    if impl == "routemm":  # against the PyTorch baselines of the same (shape, m), when they ran
        for peer, key in (
            ("torch_cublas_f16", "speedup_vs_torch_f16"),
            ("torch_dequant_cublas_f16", "speedup_vs_torch_dequant"),
        ):
            if (shape, m, peer) in bench.times:
                extra[key] = bench.times[(shape, m, peer)] / (t_us * 1e-6)
        if "speedup_vs_torch_f16" in extra:
            notes.append(f"{extra['speedup_vs_torch_f16']:.2f}x cuBLAS f16")
    if impl == "routemm" and shape == TARGET_SHAPE:
        goal = None
        if m == 1:
            goal, met = f"<= {TARGET_M1_US} us", t_us <= TARGET_M1_US
        elif m == 8:
            goal, met = f"<= {TARGET_M8_US} us", t_us <= TARGET_M8_US
        elif m == 512:
            met = perf["TFLOPs"] >= TARGET_M512_TFLOPS
            goal = f">= {TARGET_M512_TFLOPS:g} TFLOP/s"
            peer = bench.times.get((shape, m, "torch_dequant_cublas_f16"))
            if peer is not None:
                goal += " and < dequant+cuBLAS"
                met = met and t_us * 1e-6 < peer
        if goal:
            extra.update(target=goal, target_met=bool(met))
            notes.append(f"target {goal}: {'met' if met else 'MISSED'}")
    if route == routemm.DenseQ4Route.TENSOR_64X32.value and impl == "routemm":
        v2 = bench.times.get((shape, m, routemm.DenseQ4Route.COMPATIBILITY_V2.value))
        if v2 is not None:
            speedup = v2 / (t_us * 1e-6)
            extra["speedup_vs_v2"] = speedup
            notes.append(f"{speedup:.2f}x V2")
            if 9 <= m <= 128:
                extra.update(target="faster than compatibility_v2", target_met=speedup > 1.0)
            elif m >= 2048:
                extra.update(target="compatibility_v2 faster", target_met=speedup < 1.0)
    return extra, notes


@pytest.mark.parametrize("shape,m,impl", _cases(), ids=lambda v: v if isinstance(v, str) else f"m{v}")
def test_q4_0_matmul(bench, results, shape, m, impl):
    n, k = SHAPES[shape]
    flops = 2 * m * n * k
    params = routemm.GgmlQuantizedMatmulParams(m, n, k)
    base = dict(op="q4_0_matmul", shape=shape, n=n, k=k, m=m, device=bench.gpu)
    extra, notes = {}, []

    if impl in PEERS:
        pipeline = None
    elif impl == "default":
        pipeline = (
            routemm.Q4_MATMUL_PIPELINE_NAMES[0]
            if m <= MAT_VEC_MAX_M
            else routemm.select_dense_q4_route(params, POLICY)[0].pipeline_name
        )
    else:
        pipeline = routemm.DenseQ4Route(impl).pipeline_name
    if pipeline is not None and not bench.has(pipeline):
        pytest.skip(f"cuda registry has no {pipeline}")

    st, io = bench.inputs(shape, m)
    copies = st["copies"]
    base["rotation"] = f"{copies} x {st['wbytes'] / 1e6:.2f} MB" + (" (L2-resident)" if L2_RESIDENT else "")

    if impl in PEERS:
        x, w16, q4, f16_copies = io["x"], st["w16"], st["q4"], st["f16_copies"]
        if impl == "torch_cublas_f16":

            def fn(j):
                return torch.matmul(x.half(), w16[j % f16_copies].T)

            route, weight_dtype, nbytes = "dequantized_f16_cublas", "f16", f16_bytes(m, n, k)
            base["rotation"] = f"{f16_copies} x {n * k * 2 / 1e6:.2f} MB" + (" (L2-resident)" if L2_RESIDENT else "")
        else:

            def fn(j):
                return torch.matmul(x.half(), torch_dequantize(q4[j % copies]).T)

            route, weight_dtype, nbytes = "torch_dequantize+cublas_f16", "q4_0", dequant_f16_bytes(m, n, k)
        got = fn(0)[io["rows"]]
        err = relative_error(got, io["ref"])
        label = None
    else:
        x_buf, out_buf, w_bufs = io["x_buf"], io["out_buf"], st["w_bufs"]
        if impl == "default":

            def encode(enc, j):
                return routemm.quantized_matmul_ggml(
                    enc, bench.registry, x_buf, w_bufs[j % copies], out_buf, params, POLICY
                )
        else:
            forced = routemm.DenseQ4Route(impl)

            def encode(enc, j):
                return routemm.encode_q4_route(enc, bench.registry, x_buf, w_bufs[j % copies], out_buf, params, forced)

        io["out"].fill_(float("nan"))
        torch.cuda.synchronize()
        enc = bench.device.command_encoder()
        receipt = encode(enc, 0)
        enc.commit_and_wait()
        err = relative_error(io["out"][io["rows"]], io["ref"])
        route, weight_dtype, nbytes = receipt.route, "q4_0", q4_bytes(m, n, k)
        label = receipt.pipeline_label
        extra.update(
            pipeline=label,
            decision=receipt.decision.value,
            dispatch_count=receipt.dispatch_count,
            path="default" if impl == "default" else "forced",
        )
        notes.append("default policy" if impl == "default" else "forced")
    rec_impl = impl if impl in PEERS else "routemm"
    if not err <= TOLERANCE:
        results.add(
            **base,
            weight_dtype=weight_dtype,
            route=route,
            impl=rec_impl,
            time_us=-1.0,
            rel_err=err if math.isfinite(err) else -1.0,
            **extra,
            note=f"WRONG: rel err {err:.3e} > {TOLERANCE:g} (not timed)",
        )
        pytest.fail(f"{shape} m={m} {impl} ({label or route}): relative error {err:.3e} > {TOLERANCE:g}")

    if impl in PEERS:
        timing = time_torch(fn)
    else:
        timing = time_routemm(bench.device, encode)
    t = timing["kernel_s"] if timing["kernel_s"] is not None else timing["event_s"]
    perf = performance(t, nbytes, flops)
    bench.times[(shape, m, impl)] = t
    more, target_notes = _targets(shape, m, route, rec_impl, perf, bench)
    extra.update(more)
    notes.append("kernel time (CUPTI)" if timing["kernel_s"] is not None else "event time")
    if not timing["held"]:
        notes.append("event time incl. launch gaps")
    notes += target_notes
    if label:
        notes.append(label)
    record = dict(
        base,
        weight_dtype=weight_dtype,
        route=route,
        impl=rec_impl,
        rel_err=err,
        event_us=timing["event_s"] * 1e6,
        calls=timing["calls"],
        held=bool(timing["held"]),
        **perf,
        **extra,
        note="; ".join(notes),
    )
    if timing["kernel_s"] is not None:
        record["kernel_us"] = timing["kernel_s"] * 1e6
    results.add(**record)
    print(
        f"\n{shape:22s} m={m:5d} {rec_impl:25s} {route:28s} {perf['time_us']:10.1f} us "
        f"(events {timing['event_s'] * 1e6:9.1f}) {perf['TBps']:6.3f} TB/s {perf['TFLOPs']:7.2f} TFLOP/s "
        f"copy {perf['frac_copy']:.2f} bf16 {perf['frac_bf16']:.3f} err {err:.1e} {' '.join(target_notes)}"
    )
