"""Byte identity of routemm's reference quantisers with ggml's quantize_row_*_ref.

    python bench/peer/ggml_quant_check.py --src LLAMA_CPP_DIR [--build DIR] [--rows N] [--out JSON]

LLAMA_CPP_DIR is a llama.cpp tree holding ggml/ (e.g. the one the llama-cpp-python sdist vendors:
`pip download --no-deps --no-binary :all: --no-build-isolation llama-cpp-python`, unpacked, then
vendor/llama.cpp). The script configures that ggml through bench/peer/CMakeLists.txt (as
build_ggml_peer.sh does, CPU only) as shared libraries and builds the ggml-base target alone (it
holds ggml-quants.c, the reference quantisers), loads it with ctypes and compares, for every format
routemm has a quantiser for, routemm.quantize with ggml's quantize_row_<type>_ref on many rows:
random normal rows at magnitudes from 1e-30 to 1e30, and edge rows (all zeros, subnormals, values
near the float maximum, negative-only, positive-only, constant, mostly zero, one outlier, rows
whose blocks alternate zero and non-zero). Prints a summary, writes the JSON (with the markdown
beside it) and exits non-zero if any byte differs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# routemm format name -> ggml's reference function.
GGML_FUNCTIONS = {
    "q4_0": "quantize_row_q4_0_ref",
    "q4_1": "quantize_row_q4_1_ref",
    "q5_0": "quantize_row_q5_0_ref",
    "q5_1": "quantize_row_q5_1_ref",
    "q8_0": "quantize_row_q8_0_ref",
    "q4_k": "quantize_row_q4_K_ref",
    "q5_k": "quantize_row_q5_K_ref",
    "q6_k": "quantize_row_q6_K_ref",
    "mxfp4": "quantize_row_mxfp4_ref",
}


def build_ggml_base(src: Path, build: Path, jobs: int) -> Path:
    """Configures and builds ggml-base (shared) from `src`; returns the library's path."""
    args = [
        "cmake", "-G", "Ninja", "-S", str(HERE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
        f"-DGGML_SRC_DIR={src}", "-DBUILD_SHARED_LIBS=ON", "-DGGML_CUDA=OFF", "-DGGML_NATIVE=ON",
        "-DPEER_BUILD_BACKEND_OPS=OFF", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
    ]  # fmt: skip
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "ggml-base", "-j", str(jobs)], check=True)
    return build / "ggml" / "src" / "libggml-base.so"


def quants_compile_command(build: Path) -> str:
    """How ggml-quants.c was compiled (its optimisation and architecture flags decide contraction)."""
    commands = json.loads((build / "compile_commands.json").read_text())
    return next(c["command"] for c in commands if c["file"].endswith("ggml-quants.c"))


def cases(block_values: int, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Named sets of rows (each [n, 4 blocks]) of float32 values."""
    k = 4 * block_values
    out = {}
    scales = 10.0 ** rng.uniform(-30, 30, (rows, 1))
    out["normal, 1e-30..1e30"] = (rng.standard_normal((rows, k)) * scales).astype(np.float32)
    out["normal, unit"] = rng.standard_normal((rows, k)).astype(np.float32)
    out["uniform, unit"] = rng.uniform(-1, 1, (rows, k)).astype(np.float32)
    out["zeros"] = np.zeros((4, k), np.float32)
    out["subnormal"] = (rng.standard_normal((rows, k)) * 1e-40).astype(np.float32)
    out["tiny, 1e-20"] = (rng.standard_normal((rows, k)) * 1e-20).astype(np.float32)
    out["huge, 1e37"] = (rng.standard_normal((rows, k)) * 1e37).astype(np.float32)
    out["near float max"] = (rng.uniform(-1, 1, (rows, k)) * 3.4e38).astype(np.float32)
    out["negative only"] = -np.abs(rng.standard_normal((rows, k)) * scales).astype(np.float32)
    out["positive only"] = np.abs(rng.standard_normal((rows, k)) * scales).astype(np.float32)
    out["constant"] = np.repeat((rng.standard_normal((rows, 1)) * scales).astype(np.float32), k, axis=1)
    sparse = rng.standard_normal((rows, k)).astype(np.float32)
    sparse[rng.random((rows, k)) < 0.9] = 0.0
    out["mostly zero"] = sparse
    outlier = rng.standard_normal((rows, k)).astype(np.float32)
    outlier[np.arange(rows), rng.integers(0, k, rows)] = rng.choice([-1, 1], rows) * 1e4
    out["one outlier"] = outlier
    alternating = rng.standard_normal((rows, k)).astype(np.float32)
    alternating.reshape(rows, 4, block_values)[:, ::2] = 0.0
    out["zero and non-zero blocks"] = alternating
    integers = rng.integers(-40, 40, (rows, k)).astype(np.float32)
    out["small integers"] = integers
    return out


def ggml_quantize(lib, function: str, values: np.ndarray, nbytes: int) -> np.ndarray:
    """ggml's reference quantiser over the rows of `values` (contiguous), one call per row."""
    fn = getattr(lib, function)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    out = np.zeros((values.shape[0], nbytes), np.uint8)
    for i in range(values.shape[0]):
        row = np.ascontiguousarray(values[i])
        fn(row.ctypes.data, out[i].ctypes.data, row.size)
    return out


def revision(path: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, type=Path, help="llama.cpp tree holding ggml/")
    parser.add_argument("--build", type=Path, default=REPO / "build" / "ggml-quant-peer", help="build folder")
    parser.add_argument("--rows", type=int, default=200, help="rows per random case (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ggml_quant_check-cpu.json")
    args = parser.parse_args(argv)

    import routemm
    from routemm.formats.ggml import FORMATS

    src = args.src.resolve()
    lib_path = build_ggml_base(src, args.build.resolve(), args.jobs)
    lib = ctypes.CDLL(str(lib_path))
    lib.ggml_version.restype = ctypes.c_char_p
    lib.ggml_commit.restype = ctypes.c_char_p
    ggml_label = f"ggml {lib.ggml_version().decode()} (commit {lib.ggml_commit().decode()})"
    rng = np.random.default_rng(args.seed)
    results = []
    started = time.perf_counter()
    for name, fmt in FORMATS.items():
        if not fmt.has_quantizer:
            continue
        for case, values in cases(fmt.block_values, args.rows, rng).items():
            nbytes = values.shape[1] // fmt.block_values * fmt.block_bytes
            want = ggml_quantize(lib, GGML_FUNCTIONS[name], values, nbytes)
            got = routemm.quantize(values, name)
            differs = np.any(got.reshape(-1, fmt.block_bytes) != want.reshape(-1, fmt.block_bytes), axis=1)
            results.append(
                {
                    "format": name,
                    "case": case,
                    "rows": int(values.shape[0]),
                    "blocks": int(differs.size),
                    "blocks_differing": int(differs.sum()),
                }
            )
    report = {
        "command": "python " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "routemm_revision": revision(REPO),
        "ggml": ggml_label,
        "ggml_source": str(src),
        "ggml_quants_compile": quants_compile_command(args.build.resolve()),
        "machine": f"{cpu_model()} ({platform.machine()}, {platform.system()})",
        "seconds": round(time.perf_counter() - started, 1),
        "identical": all(r["blocks_differing"] == 0 for r in results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    total = sum(r["blocks"] for r in results)
    bad = sum(r["blocks_differing"] for r in results)
    print(f"{ggml_label}: {total} blocks over {len(results)} cases, {bad} differ; wrote {args.out}")
    return 0 if report["identical"] else 1


def markdown(report: dict) -> str:
    lines = [
        f"# routemm.quantize against ggml's quantize_row_*_ref — {report['machine']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"routemm revision {report['routemm_revision']}; {report['ggml']} from {report['ggml_source']}.",
        "",
        f"ggml-quants.c compiled as: `{report['ggml_quants_compile']}`",
        "",
        f"Result: {'every block byte-identical' if report['identical'] else 'BLOCKS DIFFER'}.",
        "",
        "| format | case | rows | blocks | blocks differing |",
        "|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(f"| {r['format']} | {r['case']} | {r['rows']} | {r['blocks']} | {r['blocks_differing']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
