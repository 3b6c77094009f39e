"""The build's CUDA default: ROUTEMM_CUDA=AUTO builds the CUDA backend only where a GPU driver is present."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CMAKE = shutil.which("cmake")
pytestmark = pytest.mark.skipif(CMAKE is None, reason="cmake not on PATH")


def _probe(tmp_path, *, smi_output=None, smi_status=0, proc_dir=False):
    """Runs routemm_gpu_driver_present with a fake nvidia-smi and /proc/driver/nvidia; returns ON or OFF."""
    smi = tmp_path / "nvidia-smi"
    if smi_output is not None:
        smi.write_text(f"#!/bin/sh\nprintf '%s' '{smi_output}'\nexit {smi_status}\n")
        smi.chmod(0o755)
    proc = tmp_path / "proc-driver-nvidia"
    if proc_dir:
        proc.mkdir()
    script = tmp_path / "probe.cmake"
    script.write_text(
        f'list(APPEND CMAKE_MODULE_PATH "{REPO / "cmake"}")\n'
        "include(RoutemmCudaDriver)\n"
        "routemm_gpu_driver_present(present reason)\n"
        'message(STATUS "present=${present} reason=${reason}")\n'
    )
    run = subprocess.run(
        [CMAKE, f"-DROUTEMM_NVIDIA_SMI={smi}", f"-DROUTEMM_NVIDIA_PROC_DIR={proc}", "-P", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split("present=")[1].split()[0]


def test_no_nvidia_smi_and_no_proc_driver_is_no_driver(tmp_path):
    assert _probe(tmp_path) == "OFF"


def test_nvidia_smi_listing_a_gpu_is_a_driver(tmp_path):
    listing = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\n"
    assert _probe(tmp_path, smi_output=listing) == "ON"


def test_nvidia_smi_without_a_gpu_or_failing_is_no_driver(tmp_path):
    assert _probe(tmp_path, smi_output="No devices found.\\n") == "OFF"
    assert _probe(tmp_path, smi_output="GPU 0: x\\n", smi_status=9) == "OFF"


def test_proc_driver_nvidia_is_a_driver(tmp_path):
    assert _probe(tmp_path, proc_dir=True) == "ON"


def _configure(tmp_path, cuda):
    run = subprocess.run(
        [
            CMAKE,
            "-S",
            str(REPO),
            "-B",
            str(tmp_path / "build"),
            f"-DROUTEMM_CUDA={cuda}",
            "-DROUTEMM_BUILD_TESTS=OFF",
            "-DROUTEMM_BUILD_PYTHON=OFF",
            f"-DROUTEMM_NVIDIA_SMI={tmp_path / 'absent-nvidia-smi'}",
            f"-DROUTEMM_NVIDIA_PROC_DIR={tmp_path / 'absent-proc'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run


def test_auto_without_a_driver_configures_without_cuda_and_says_why(tmp_path):
    run = _configure(tmp_path, "AUTO")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ROUTEMM_CUDA=AUTO leaves the CUDA backend off; ROUTEMM_CUDA=ON builds it anyway" in run.stdout
    assert "routemm backends: cpu=ON cuda=OFF" in run.stdout


def test_an_unknown_cuda_switch_is_a_configure_error(tmp_path):
    run = _configure(tmp_path, "MAYBE")
    assert run.returncode != 0
    assert "ROUTEMM_CUDA must be AUTO, ON or OFF (got 'MAYBE')" in run.stderr


# ---- the package's metadata and version ------------------------------------------------------------


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_one_version_in_pyproject_cmake_the_module_and_the_changelog():
    import re

    import routemm

    version = _pyproject()["project"]["version"]
    cmake_version = re.search(r"project\(routemm VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert cmake_version and cmake_version.group(1) == version
    assert routemm.__version__ == version
    changelog = (REPO / "CHANGELOG.md").read_text()
    first_release = re.search(r"^## \[?([0-9][0-9.]*)\]?", changelog, re.M)
    assert first_release and first_release.group(1) == version, "the changelog's newest entry is this version"


def test_metadata_names_the_authors_and_does_not_call_the_library_gpu_only():
    project = _pyproject()["project"]
    assert project["authors"] and all(a.get("name") for a in project["authors"])
    assert "GPU kernels" not in project["description"] and "CPU" in project["description"]
    assert set(project["optional-dependencies"]) >= {"schemas", "test", "torch", "transformers"}


# ---- the bindings build without -Wshadow warnings ----------------------------------------------------


def test_binding_lambdas_do_not_shadow_the_module_parameter():
    """-Wshadow (cmake/RoutemmWarnings.cmake) warns where a binding lambda's parameter takes the name
    of the module (`py::module_& m`) of the function that defines it."""
    import re

    lambda_params = re.compile(r"\[[^\]]*\]\s*\(([^()]*)\)\s*(?:->[^{]*)?\{")
    offenders = []
    for source in sorted((REPO / "python" / "src").rglob("*.cpp")):
        text = source.read_text()
        if not re.search(r"py::module_\s*&\s*m\b", text):
            continue
        for match in lambda_params.finditer(text):
            names = [p.strip().split()[-1].lstrip("&*") for p in match.group(1).split(",") if p.strip()]
            if "m" in names:
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{source.relative_to(REPO)}:{line}")
    assert not offenders, f"binding lambdas with a parameter m shadowing the module: {offenders}"


def test_metal_emu_runtime_compiles_without_shadowing():
    """csrc/backend/metal_emu/runtime.cpp builds under the project's -Wshadow without a warning (a
    lambda's local once took the name of the static it initialises)."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    source = REPO / "csrc" / "backend" / "metal_emu" / "runtime.cpp"
    flags = ["-std=c++20", "-fsyntax-only", "-Wshadow", "-Werror=shadow"]
    includes = [f"-I{REPO / 'csrc' / 'include'}", f"-I{REPO / 'csrc'}"]
    done = subprocess.run([compiler, *flags, *includes, str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
