"""The machine code of the CUDA tensor-core kernels, read back from the built extension: on sm_90a the
expert-ID tensor routes and the bf16 Q4_0 routes run warpgroup MMA fed by TMA, the portable kernel
(and the quantised expert-ID tensor route built on it) runs warp-level MMA, and none touches local memory (no register spills); no other kernel spills
beyond a short, capped list. Needs cuobjdump and a build carrying CUDA code; skips otherwise (a
CPU-only build, or a toolkit without cuobjdump)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest
import routemm


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = os.path.join(home, "bin", "cuobjdump")
    return candidate if os.access(candidate, os.X_OK) else None


def _functions_by_arch() -> dict[str, dict[str, str]]:
    """{arch: {mangled function name: SASS text}} of the extension's fatbin."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    libs = glob.glob(os.path.join(os.path.dirname(routemm.__file__), "_core*.so"))
    if not libs:
        pytest.skip("routemm's extension module not found")
    run = subprocess.run([tool, "-sass", libs[0]], capture_output=True, text=True, check=False)
    if run.returncode != 0 or "Function :" not in run.stdout:
        pytest.skip("the extension carries no CUDA machine code")
    arches: dict[str, dict[str, str]] = {}
    arch, name, body = None, None, []
    for line in run.stdout.splitlines():
        arch_match = re.match(r"\s*arch = (sm_\w+)", line)
        func_match = re.match(r"\s*Function : (\S+)", line)
        if arch_match or func_match:
            if arch and name:
                arches.setdefault(arch, {})[name] = "\n".join(body)
            name, body = None, []
            if arch_match:
                arch = arch_match.group(1)
            else:
                name = func_match.group(1)
        elif name:
            body.append(line)
    if arch and name:
        arches.setdefault(arch, {})[name] = "\n".join(body)
    return arches


def _local_memory(sass: str) -> list[str]:
    return [line.strip() for line in sass.splitlines() if re.search(r"\b(LDL|STL)(\.\w+)*\b", line)]


def _assert_wgmma_fed_by_tma(name_part: str, count: int) -> None:
    """`count` sm_90a functions named with `name_part`, each with HGMMA and UTMALDG and no local memory."""
    arches = _functions_by_arch()
    if "sm_90a" not in arches:
        pytest.skip("the build carries no sm_90a code")
    kernels = {name: sass for name, sass in arches["sm_90a"].items() if name_part in name}
    assert len(kernels) == count, sorted(kernels)
    for name, sass in kernels.items():
        assert "HGMMA" in sass, name
        assert "UTMALDG" in sass, name
        assert not _local_memory(sass), (name, _local_memory(sass)[:5])


def test_hopper_tensor_routes_use_wgmma_and_tma():
    # Five operand kinds (lowp f16/bf16, tf32 from f16/bf16/f32) x two column tiles.
    _assert_wgmma_fed_by_tma("grouped_wgmma_kernel", 10)


def test_hopper_q4_kernel_uses_wgmma_and_tma():
    """The bf16 Q4_0 routes' Hopper kernel: one instantiation per token tile (128 for V2, 32 for
    64x32)."""
    _assert_wgmma_fed_by_tma("q4_wgmma_kernel", 2)


def test_portable_tensor_kernel_uses_warp_mma_without_spills():
    """Every instantiation of the portable warp-MMA kernel (grouped_tensor_kernel.cuh) runs HMMA and
    keeps its registers out of local memory, but for the Q6_K block-stack tiles, whose few local
    accesses _KNOWN_SPILLS caps (test_no_kernel_spills_beyond_the_known_ones)."""
    arches = _functions_by_arch()
    checked = 0
    for arch, functions in arches.items():
        for name, sass in functions.items():
            if "grouped_tensor_kernel" not in name:
                continue
            checked += 1
            assert "HMMA" in sass, (arch, name)
            if "Q6_KBlocks" not in name:
                assert not _local_memory(sass), (arch, name, _local_memory(sass)[:5])
    if checked == 0:
        pytest.skip("no portable tensor kernel in this build")


def test_quantized_tensor_route_uses_warp_mma_without_spills():
    """quantized_matmul_id's grouped_tensor_lowp: the shared warp-MMA kernel with the Q4_0 / Q8_0
    weight tiles (GgmlTiles), one instantiation per format and activation-load path on every
    architecture: HMMA.16816 with F32 accumulation, weights read 2 bytes at a time (LDG.E.U16:
    GGUF blocks are 2-byte aligned), and no local memory."""
    arches = _functions_by_arch()
    checked = 0
    for arch, functions in arches.items():
        kernels = {name: sass for name, sass in functions.items() if "GgmlTiles" in name}
        if not kernels:
            continue
        assert len(kernels) == 4, (arch, sorted(kernels))
        for name, sass in kernels.items():
            checked += 1
            assert "HMMA.16816.F32" in sass, (arch, name)
            assert "LDG.E.U16" in sass, (arch, name)
            assert not _local_memory(sass), (arch, name, _local_memory(sass)[:5])
    if checked == 0:
        pytest.skip("no quantised tensor-route kernel in this build")


# Kernels known to touch local memory, by a regular expression over the mangled name, with the most
# local loads and stores allowed (about 1.2x what nvcc 13.0 emits for sm_80 and sm_90a) and why.
_KNOWN_SPILLS = {
    # The exact grouped route's 8 x 8 thread tile (64 accumulators and a slice of loads in flight)
    # with element-wise loads (unaligned views); the aligned F32 variant reloads one pair per slice.
    r"grouped_outer_kernel": 44,
    # The gathered direct kernel: one value reloaded per group of gathered rows.
    r"direct_gathered_kernel": 12,
    # The mat-vec for m > 4 (eight hi and eight lo token columns): one value outside the block loop.
    r"q4_matvec_kernel.*Lb0EEEv": 6,
    # V2's warp-MMA kernel at two CTAs per SM (128 registers): the portable bf16 128-row kernel,
    # which Hopper runs only where its warpgroup-MMA kernel does not apply (k % 256 != 0, unaligned).
    r"q4_kernel.*TileILi4ELi4ELi2ELi4ELi2ELi2E": 48,
    # The block-stack tensor route's Q6_K tiles at 64 routed rows (a scale row per 16-value K-step):
    # one or two values at the 128 registers of two CTAs per SM, cheaper than 32-row tiles.
    r"grouped_tensor_kernel.*Q6_KBlocks": 16,
}


def test_no_kernel_spills_beyond_the_known_ones():
    """Every CUDA kernel of the build, on every architecture it carries, keeps its registers out of
    local memory, except the few listed in _KNOWN_SPILLS, whose local loads and stores are capped
    so that they cannot grow unnoticed."""
    arches = _functions_by_arch()
    checked = 0
    for arch, functions in arches.items():
        for name, sass in functions.items():
            checked += 1
            local = _local_memory(sass)
            if not local:
                continue
            caps = [cap for pattern, cap in _KNOWN_SPILLS.items() if re.search(pattern, name)]
            assert caps, (arch, name, local[:5])
            assert len(local) <= caps[0], (arch, name, len(local), caps[0])
    assert checked > 0


def test_hopper_q4_mat_vec_uses_bulk_copies_and_warp_mma():
    """The Hopper Q4_0 mat-vec for one or two tokens (q4_matvec_rows.cu): bulk copies into an
    mbarrier ring (UBLKCP, SYNCS), the split numerics on warp-level MMA (HMMA) and no local memory.
    Three instantiations: 8 or 4 consumer warps for one token, 8 for two."""
    arches = _functions_by_arch()
    if "sm_90a" not in arches:
        pytest.skip("the build carries no sm_90a code")
    kernels = {name: sass for name, sass in arches["sm_90a"].items() if "q4_matvec_rows_kernel" in name}
    assert len(kernels) == 3, sorted(kernels)
    for name, sass in kernels.items():
        for instruction in ("UBLKCP", "SYNCS", "HMMA"):
            assert instruction in sass, (name, instruction)
        assert not _local_memory(sass), (name, _local_memory(sass)[:5])


def test_hopper_quantized_direct_uses_bulk_copies():
    """The quantised expert-ID direct kernel's bulk-copy data path (quantized_matmul_id.cu): per
    format, an instance for rows of whole 16-byte stages (Q4_0, Q8_0, Q4_1, Q5_0, Q5_1, MXFP4,
    Q4_K, Q5_K) and one for any rows, each stage the 16-byte units around a row's blocks (those
    eight and Q6_K): its stages arrive by bulk copies into an mbarrier ring
    (UBLKCP, SYNCS), the lanes load no weights or activations from global memory (the only global
    loads are 32-bit expert ids), and nothing touches local memory."""
    arches = _functions_by_arch()
    if "sm_90a" not in arches:
        pytest.skip("the build carries no sm_90a code")
    kernels = {
        name: sass
        for name, sass in arches["sm_90a"].items()
        if "direct_bulk_kernel" in name and "quantized_matmul_id" in name
    }
    assert len(kernels) == 17, sorted(kernels)
    for name, sass in kernels.items():
        for instruction in ("UBLKCP", "SYNCS"):
            assert instruction in sass, (name, instruction)
        wide = [op for op in re.findall(r"\bLDG[\w.]*", sass) if re.search(r"\.(64|128|U8|S8|U16|S16)\b", op)]
        assert not wide, (name, wide)
        assert not _local_memory(sass), (name, _local_memory(sass)[:5])


def test_q8_0_kernels_stream_16_byte_copies_without_conversions():
    """The Q8_0 dense kernels (q8_matmul.cu), one instantiation per token count (1, 2, 4, 8) and copy
    path on every architecture: the weights stream into shared memory by 16-byte cp.async
    (LDGSTS.E.BYPASS.128) and nothing touches local memory; the vector instantiations read the
    activations 16 bytes at a time (LDG.E.128) and decode the int8 weights with byte permutes and
    F32 adds, with no conversion instruction (I2F / I2FP) in the kernel."""
    arches = _functions_by_arch()
    checked = 0
    for arch, functions in arches.items():
        kernels = {name: sass for name, sass in functions.items() if "q8_kernel" in name}
        if not kernels:
            continue
        assert len(kernels) == 8, (arch, sorted(kernels))
        for name, sass in kernels.items():
            checked += 1
            assert "LDGSTS.E.BYPASS.128" in sass, (arch, name)
            assert not _local_memory(sass), (arch, name, _local_memory(sass)[:5])
            if re.search(r"ELb1EEEv", name):  # kVec = true
                assert "LDG.E.128" in sass, (arch, name)
                assert not re.search(r"\bI2FP?\b", sass), (arch, name)
                assert "PRMT" in sass, (arch, name)
    assert checked > 0, "the build carries CUDA code but no Q8_0 dense kernel"
