"""`python -m routemm demo`: a random MoE expert projection of a real model's shape, both routes, checked.

Runs `direct` at decode (m=1) and `direct` and `grouped_prefill` at prefill on the best available
backend (or the one named), compares every output with a float64 NumPy reference, and reports the
receipts, achieved GB/s and GFLOP/s and the error. The default is a Qwen3-30B-A3B layer reduced to
run in seconds on two CPU cores; `--model` takes a model's full sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

from .. import _core
from ..core import env
from ..core._core_api import DType, dtype_of
from ..core._errors import Error
from ..ops._reference import dense_matmul_id_reference
from ..ops.dense_matmul_id import (
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    DenseMatmulIdScratch,
    dense_matmul_id,
    dense_matmul_id_capability,
)

# (n_experts, top_k, n, k) of one expert projection.
MODELS = {
    "qwen3-30b-a3b": (128, 8, 768, 2048),
    "deepseek-v3": (256, 8, 2048, 7168),
    "mixtral-8x7b": (8, 2, 14336, 4096),
}
# The default: a Qwen3-30B-A3B layer reduced to run in seconds on two CPU cores.
REDUCED = ("qwen3-30b-a3b-reduced", (32, 8, 384, 1024))

# A run is correct when max|out - ref| / max|ref| stays below this. F32 accumulation over k <= 7168
# on these unit-variance inputs stays near 1e-6; a wrong row or a lost expert is of order 1.
OK_MAX_REL_ERROR = 1e-4

_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

_COLUMNS = (
    "time_us      median kernel time of the timed runs (one warm-up run first)",
    "GB/s         bytes one call must move (the weights of the experts it touches, once each, plus activations,",
    "             ids and output) / time_us",
    "GFLOP/s      2 * m * top_k * n * k / time_us",
    f"max rel err  max|out - ref| / max|ref| against a float64 NumPy reference; OK needs it below {OK_MAX_REL_ERROR:g},",
    "             every output element written, and direct and grouped_prefill bit-identical",
)


# ---- backend choice ------------------------------------------------------------------------------


def _open_device(requested: str | None):
    """The device the demo runs on, and why: which backend, chosen how, and why each other one was not."""
    device = _core.Device(requested)
    if requested:
        how = "named by --backend"
    elif os.environ.get("ROUTEMM_BACKEND"):
        how = "named by ROUTEMM_BACKEND"
    else:
        how = "the best available backend (cuda, then metal, then cpu)"
    others = {
        name: ("available, not chosen" if available else f"unavailable: {reason}")
        for name, available, reason in _core.backend_status()
        if name != device.backend
    }
    return device, {"chosen": device.backend, "how": how, "others": others}


def cpu_clone(device) -> str | None:
    """The instruction-set clone the CPU backend's kernels run in this process (portable, avx2,
    avx512 or neon: the best the CPU has, capped by ROUTEMM_CPU_ISA); None on other backends."""
    return str(device.properties["isa"]) if device.backend == "cpu" else None


def _last_level_cache_bytes(device) -> int | None:
    """Size of the cache a repeated call re-reads its weights from: the GPU's L2 on CUDA, the CPU's
    largest cache level on Linux; None where it cannot be read."""
    if device.backend == "cuda":
        return int(device.properties.get("l2_bytes", 0)) or None
    if device.backend != "cpu":
        return None
    sizes = []
    cache_dir = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(cache_dir) if e.startswith("index")]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(cache_dir, entry, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=None)


# ---- parameters and memory -----------------------------------------------------------------------


def _params(shape, m: int, itemsize: int, route: DenseMatmulIdRoute) -> DenseMatmulIdParams:
    n_experts, top_k, n, k = shape
    return DenseMatmulIdParams(
        m,
        n,
        k,
        top_k,
        n_experts,
        n * k * itemsize,
        DenseMatmulIdInputLayout.SHARED_PER_TOKEN,
        DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN,
        route,
    )


# Host memory of the interpreter with NumPy and routemm loaded, before the demo allocates anything.
_BASELINE_HOST_BYTES = 150 * 10**6


def memory_needed(shape, dtype_name: str, m_prefill: int, host_accessible: bool) -> dict[str, int]:
    """Bytes the demo holds at its peak: device memory for the prefill run's buffers (the exact
    extents its capability gives), host memory for the reference and the outputs it compares, plus
    the device's buffers where they live in host memory.

    The weights exist once, on the device: the host generates them and reads them back one expert
    at a time, so a full-size model needs its weight bytes once, never a float32 copy of the stack.
    """
    _, top_k, n, k = shape
    np_dtype = np.dtype(_DTYPES[dtype_name])
    params = _params(shape, m_prefill, np_dtype.itemsize, DenseMatmulIdRoute.GROUPED_PREFILL)
    cap = dense_matmul_id_capability(dtype_of(np_dtype), params)
    device = cap.required_weight_bytes + cap.required_input_bytes + cap.required_ids_bytes
    device += cap.required_output_bytes + cap.scratch.expert_counts_bytes + cap.scratch.routed_rows_bytes
    rows = m_prefill * top_k * n  # output elements of the prefill run
    one_expert = n * k * (8 + np_dtype.itemsize)  # read back, then widened to float64 for the reference
    # The reference, one expert's contribution, two error temporaries (float64); three float32 outputs.
    compared = rows * (4 * 8 + 3 * 4) + m_prefill * k * 8
    host = _BASELINE_HOST_BYTES + max(one_expert, n * k * 4 * 2) + compared
    return {"device_bytes": device, "host_bytes": host + (device if host_accessible else 0)}


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(needed: dict[str, int], device) -> dict[str, int | None]:
    """Refuse, before anything is allocated, a run that cannot fit; return what was compared."""
    available = {
        "host_available_bytes": _available_host_bytes(),
        "device_total_bytes": int(device.properties["global_memory_bytes"])
        if "global_memory_bytes" in device.properties
        else None,
    }
    for kind, have in (("host", available["host_available_bytes"]), ("device", available["device_total_bytes"])):
        if kind == "device" and device.host_accessible:
            continue
        if have is not None and needed[f"{kind}_bytes"] > have:
            raise Error(
                f"demo: this run needs about {_gb(needed[f'{kind}_bytes'])} of {kind} memory and "
                f"{_gb(have)} {'are available' if kind == 'host' else 'exist'}; "
                "choose a smaller model, --dtype bf16, or fewer --tokens"
            )
    return available


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


# ---- progress ------------------------------------------------------------------------------------


class Progress:
    """Progress of a long run on `stream` (stderr): a tqdm bar when tqdm is installed and the stream is
    a terminal, else one line when a phase starts and one when it ends; nothing when disabled."""

    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self._tqdm = None
        if enabled and self.stream.isatty():
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:
                pass

    @contextlib.contextmanager
    def phase(self, description: str, total: int, unit: str):
        """Yields `advance(count=1)`, to be called as the phase's `total` units complete."""
        if not self.enabled:
            yield lambda count=1: None
            return
        if self._tqdm is not None:
            with self._tqdm(total=total, desc=description, unit=unit, file=self.stream, leave=False) as bar:
                yield bar.update
            return
        started = time.perf_counter()
        unit = unit if total != 1 else unit.removesuffix("s")
        print(f"routemm demo: {description} ({total} {unit}) ...", file=self.stream, flush=True)
        yield lambda count=1: None
        print(
            f"routemm demo: {description} done in {time.perf_counter() - started:.1f} s", file=self.stream, flush=True
        )


# ---- the case ------------------------------------------------------------------------------------


def upload_random_weights(device, rng, shape, dtype, progress: Progress):
    """A random [E, n, k] weight stack (scaled by 1/sqrt(k)) written straight into a device buffer,
    one expert at a time: the host holds one expert in float32, never the whole stack."""
    n_experts, _, n, k = shape
    np_dtype = np.dtype(dtype)
    expert_bytes = n * k * np_dtype.itemsize
    weights = device.alloc(n_experts * expert_bytes, dtype_of(np_dtype), [n_experts, n, k])
    scratch = np.empty((n, k), dtype=np.float32)
    with progress.phase("generating weights", n_experts, "experts") as advance:
        for e in range(n_experts):
            rng.standard_normal(out=scratch, dtype=np.float32)
            scratch *= np.float32(1.0 / np.sqrt(k))
            expert = weights.view(e * expert_bytes, expert_bytes, dtype_of(np_dtype), [n, k])
            expert.copy_from_numpy(scratch.astype(np_dtype))
            advance()
    return weights


def _random_tokens(rng, n_experts, top_k, k, m):
    x = rng.standard_normal((m, k), dtype=np.float32)
    # Distinct experts per token, as a router's top-k gives.
    ids = np.argsort(rng.random((m, n_experts)), axis=1)[:, :top_k].astype(np.uint32)
    return x, ids


def reference_from_device(weights, x, ids, progress: Progress) -> np.ndarray:
    """The float64 reference, reading the weights back from the device one touched expert at a time
    (ids of other experts are out of range for that call, which gives their rows zero)."""
    n_experts, n, k = weights.shape
    expert_bytes = weights.nbytes // n_experts
    out = np.zeros((ids.size, n), dtype=np.float64)
    touched = np.unique(ids)
    with progress.phase(f"float64 reference at m={len(x)}", len(touched), "experts") as advance:
        for e in touched:
            expert = weights.view(int(e) * expert_bytes, expert_bytes, weights.dtype, [1, n, k]).numpy()
            out += dense_matmul_id_reference(expert, x, np.where(ids == e, 0, 1).astype(np.uint32))
            advance()
    return out


def _run_route(device, registry, bufs, params, repeats):
    w_buf, x_buf, id_buf, out_buf = bufs
    scratch = (
        DenseMatmulIdScratch(device, params.n_experts, params.m)
        if params.route is DenseMatmulIdRoute.GROUPED_PREFILL
        else None
    )
    receipt = encoded = None
    times = []
    for i in range(repeats + 1):
        encoder = device.command_encoder()
        if i == 0:
            encoder.start_encoded_dispatch_receipt(2)
        receipt = dense_matmul_id(encoder, registry, w_buf, x_buf, id_buf, out_buf, scratch, params)
        if i == 0:
            encoded = encoder.take_encoded_dispatch_receipt()
        start, end = encoder.commit_wait_with_gpu_time()
        if i > 0:  # the first run is a warm-up
            times.append(end - start)
    return receipt, encoded, statistics.median(times)


def run(
    model: str | None, m_prefill: int, dtype_name: str, backend: str | None, repeats: int, seed: int, progress=None
):
    """The demo's report as a dict (what `--json` prints). `progress` defaults to stderr progress on
    full-size runs."""
    name, shape = REDUCED if model is None else (model, MODELS[model])
    n_experts, top_k, n, k = shape
    progress = Progress(enabled=model is not None) if progress is None else progress
    wdtype = _DTYPES[dtype_name]
    itemsize = np.dtype(wdtype).itemsize
    device, choice = _open_device(backend)
    needed = memory_needed(shape, dtype_name, m_prefill, device.host_accessible)
    available = _check_memory(needed, device)
    cache_bytes = _last_level_cache_bytes(device)
    report = {
        "model": name,
        "reduced": model is None,
        "backend": device.backend,
        "device": device.name,
        "cpu_isa": cpu_clone(device),
        "backend_choice": choice,
        "shape": {"n_experts": n_experts, "top_k": top_k, "n": n, "k": k},
        "weight_dtype": dtype_name,
        "memory": {**needed, **available},
        "cache_bytes": cache_bytes,
        "ok_max_rel_error": OK_MAX_REL_ERROR,
        "env": env.non_default(),
        "runs": [],
    }
    if model is not None and progress.enabled:
        print(
            f"routemm demo: full-size {name} needs about {_gb(needed['host_bytes'])} of host memory"
            + ("" if device.host_accessible else f" and {_gb(needed['device_bytes'])} of {device.backend} memory"),
            file=progress.stream,
            flush=True,
        )
    rng = np.random.default_rng(seed)
    registry = _core.KernelRegistry(device)
    w_buf = upload_random_weights(device, rng, shape, wdtype, progress)
    for m, routes in (
        (1, [DenseMatmulIdRoute.DIRECT]),
        (m_prefill, [DenseMatmulIdRoute.DIRECT, DenseMatmulIdRoute.GROUPED_PREFILL]),
    ):
        x, ids = _random_tokens(rng, n_experts, top_k, k, m)
        reference = reference_from_device(w_buf, x, ids, progress)
        x_buf, id_buf = device.from_numpy(x), device.from_numpy(ids)
        out_buf = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
        touched = len(np.unique(ids))
        weight_bytes = touched * n * k * itemsize
        nbytes = weight_bytes + x.nbytes + ids.nbytes + m * top_k * n * 4
        flops = 2 * m * top_k * n * k
        outputs = {}
        scale = float(np.max(np.abs(reference))) or 1.0
        with progress.phase(f"timing at m={m}", len(routes), "routes") as advance:
            for route in routes:
                params = _params(shape, m, itemsize, route)
                out_buf.copy_from_numpy(np.full((m * top_k, n), np.nan, np.float32))
                bufs = (w_buf, x_buf, id_buf, out_buf)
                receipt, encoded, seconds = _run_route(device, registry, bufs, params, repeats)
                out = out_buf.numpy()
                outputs[route] = out
                max_abs_error = float(np.max(np.abs(out - reference)))
                report["runs"].append(
                    {
                        "m": m,
                        "route": route.value,
                        "time_us": seconds * 1e6,
                        "GBps": nbytes / seconds / 1e9,
                        "GFLOPs": flops / seconds / 1e9,
                        "experts_touched": touched,
                        "bytes": nbytes,
                        "flops": flops,
                        "cache_resident": cache_bytes is not None and weight_bytes <= cache_bytes,
                        "max_abs_error": max_abs_error,
                        "max_rel_error": max_abs_error / scale,
                        "all_written": bool(np.all(np.isfinite(out))),
                        "receipt": receipt.to_dict(),
                        "dispatches": [d.to_dict() for d in encoded],
                    }
                )
                advance()
        if len(outputs) == 2:
            a, b = outputs.values()
            report["routes_bit_identical_at_m%d" % m] = bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
    report["ok"] = all(r["all_written"] and r["max_rel_error"] < OK_MAX_REL_ERROR for r in report["runs"]) and all(
        v for key, v in report.items() if key.startswith("routes_bit_identical")
    )
    return report


# ---- output --------------------------------------------------------------------------------------


def print_report(report, stream=None) -> None:
    stream = sys.stdout if stream is None else stream
    s, choice = report["shape"], report["backend_choice"]
    size = "reduced to run in seconds; --model takes full sizes" if report["reduced"] else "full size"
    print(
        f"routemm demo: {report['model']} expert projection (E={s['n_experts']}, top_k={s['top_k']}, "
        f"n={s['n']}, k={s['k']}, {report['weight_dtype']} weights; {size})",
        file=stream,
    )
    clone = f", {report['cpu_isa']} kernels" if report.get("cpu_isa") else ""
    print(f"backend: {report['backend']} ({report['device']}{clone}), {choice['how']}", file=stream)
    for name, why in choice["others"].items():
        print(f"  {name}: {why}", file=stream)
    print(
        f"{'m':>6} {'route':>16} {'time_us':>10} {'GB/s':>9} {'GFLOP/s':>9} {'max rel err':>12}  dispatches",
        file=stream,
    )
    for r in report["runs"]:
        labels = ", ".join(f"{d['pipeline_label']} grid={tuple(d['grid'])}" for d in r["dispatches"])
        gbps = f"{r['GBps']:.2f}" + ("*" if r["cache_resident"] else " ")
        print(
            f"{r['m']:>6} {r['route']:>16} {r['time_us']:>10.1f} {gbps:>9} {r['GFLOPs']:>9.2f} "
            f"{r['max_rel_error']:>12.2e}  {labels}",
            file=stream,
        )
    for line in _COLUMNS:
        print(line, file=stream)
    if any(r["cache_resident"] for r in report["runs"]):
        print(
            f"*            cache-resident: the touched weights fit in the {_gb(report['cache_bytes'])} last-level cache\n"
            "             and the timed runs re-read them from there, so GB/s may exceed memory bandwidth"
            + (" (--model takes full sizes)" if report["reduced"] else ""),
            file=stream,
        )
    for key, value in report.items():
        if key.startswith("routes_bit_identical"):
            print(f"direct and grouped_prefill bit-identical ({key.rsplit('_', 1)[1]}): {value}", file=stream)
    print("OK" if report["ok"] else "FAILED: an output differs from the float64 reference", file=stream)


def _integer(least: int, what: str):
    """An argparse type: an int >= least, else the usage error `must be <what>, got <value>`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


_POSITIVE = _integer(1, "a positive integer")
_NON_NEGATIVE = _integer(0, "a non-negative integer")

# Options of the random run that a --gguf run does not take (the file gives the model and its types).
_NOT_WITH_GGUF = ("model", "dtype", "repeats")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults are None where an option given with the wrong mode must be refused; main fills them in.
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="full sizes of this model's expert projection (default: a reduced Qwen3-30B-A3B layer)",
    )
    parser.add_argument("--tokens", type=_POSITIVE, default=64, help="tokens of the prefill run (default 64)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="weight dtype (default bf16)")
    parser.add_argument("--backend", default=None, help="cpu, cuda or metal (default: the best available)")
    parser.add_argument(
        "--repeats", type=_POSITIVE, default=None, help="timed runs per route, median reported (default 5)"
    )
    parser.add_argument(
        "--seed", type=_NON_NEGATIVE, default=0, help="seed of the random weights, activations and ids (default 0)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--gguf", metavar="FILE", default=None, help="run every MoE layer of this GGUF model instead")
    parser.add_argument(
        "--layer", type=_NON_NEGATIVE, default=None, help="the one layer --gguf runs (default: every MoE layer)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the demo for parsed `args`; 0 when every output matched the reference, 1 otherwise."""
    if args.gguf is not None:
        return _gguf_main(args, parser)
    if args.layer is not None:
        parser.error("--layer applies only with --gguf")
    started = time.perf_counter()
    dtype = "bf16" if args.dtype is None else args.dtype
    repeats = 5 if args.repeats is None else args.repeats
    report = run(args.model, args.tokens, dtype, args.backend, repeats, args.seed)
    report["elapsed_s"] = time.perf_counter() - started
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        print()
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def _gguf_main(args, parser) -> int:
    """--gguf: the MoE layers of a GGUF file against their float64 reference (cli/gguf_demo.py)."""
    from . import gguf_demo

    for name in _NOT_WITH_GGUF:
        if getattr(args, name) is not None:
            parser.error(f"--{name} does not apply with --gguf (the file gives the model and its types)")
    report = gguf_demo.run(args.gguf, args.layer, args.tokens, args.backend, args.seed)
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        print()
    else:
        gguf_demo.print_report(report)
    return 0 if report["ok"] else 1
