"""The command line (`python -m routemm ...`), the demo behind it, and tests/run.sh without its tools."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import routemm
import routemm.__main__ as cli
from routemm import env
from routemm.cli import demo

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("demo", "gguf-sample", "backends", "knobs", "help")


def routemm_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "routemm", *args], capture_output=True, text=True, timeout=300, **kwargs
    )


# ---- help ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"], []], ids=["--help", "-h", "help", "bare"])
def test_top_level_help_lists_every_command(args):
    result = routemm_cli(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m routemm")
    for command in COMMANDS:
        assert command in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_own_help(command):
    for args in ([command, "--help"], ["help", command]):
        result = routemm_cli(*args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python -m routemm {command}")


def test_demo_help_names_its_options():
    out = routemm_cli("demo", "--help").stdout
    for option in ("--model", "--tokens", "--dtype", "--backend", "--repeats", "--json"):
        assert option in out


def test_version_prints_the_package_version():
    result = routemm_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"routemm {routemm.__version__}\n"


def test_unknown_command_is_a_usage_error():
    result = routemm_cli("frobnicate")
    assert result.returncode == 2
    assert "invalid choice: 'frobnicate'" in result.stderr


# ---- commands ----------------------------------------------------------------------------------------


def test_backends_lists_every_backend_with_its_reason():
    lines = routemm_cli("backends").stdout.splitlines()
    assert [line.split()[0] for line in lines] == [name for name, _, _ in routemm.backend_status()]
    for line, (_, available, reason) in zip(lines, routemm.backend_status(), strict=True):
        assert line.split()[1] == "available" if available else line.endswith(reason)


@pytest.mark.skipif("cpu" not in routemm.available_backends(), reason="no cpu backend")
@pytest.mark.parametrize("cap", [None, "portable"])
def test_backends_names_the_cpu_kernels_clone(cap):
    env_vars = {k: v for k, v in os.environ.items() if k != "ROUTEMM_CPU_ISA"}
    if cap:
        env_vars["ROUTEMM_CPU_ISA"] = cap
    result = routemm_cli("backends", env=env_vars)
    assert result.returncode == 0, result.stderr
    cpu = [line for line in result.stdout.splitlines() if line.split()[0] == "cpu"]
    if cap:
        assert cpu == ["cpu    available (portable kernels, capped by ROUTEMM_CPU_ISA=portable)"]
    else:
        isa = routemm.Device("cpu").properties["isa"]
        assert cpu == [f"cpu    available ({isa} kernels)"]


def test_knobs_prints_the_table_from_the_code():
    result = routemm_cli("knobs")
    assert result.returncode == 0
    assert result.stdout.strip() == env.table_markdown()


# ---- errors: one line on stderr, no traceback ---------------------------------------------------------


def test_an_error_is_one_line_and_exit_status_1():
    result = routemm_cli("demo", "--backend", "nosuch")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("routemm demo: error: unknown backend 'nosuch' (known: ")
    assert result.stdout == ""


def test_unavailable_cuda_is_one_line_saying_why():
    status = {name: (available, reason) for name, available, reason in routemm.backend_status()}
    available, reason = status["cuda"]
    if available:
        pytest.skip("cuda is available here")
    result = routemm_cli("demo", "--backend", "cuda")
    assert result.returncode == 1
    assert result.stderr == f"routemm demo: error: backend 'cuda' is unavailable: {reason}\n"
    no_driver = shutil.which("nvidia-smi") is None and not Path("/dev/nvidiactl").exists()
    if not reason.startswith("not built") and no_driver:
        # A build with CUDA on a machine without an NVIDIA driver: the runtime's own words would be
        # "driver version is insufficient", which sends the user after a driver upgrade.
        assert reason.startswith("no NVIDIA GPU or driver found (")
        assert "insufficient" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "-1"], "argument --seed: must be a non-negative integer, got -1"),
        (["--seed", "x"], "argument --seed: must be a non-negative integer, got 'x'"),
        (["--tokens", "0"], "argument --tokens: must be a positive integer, got 0"),
        (["--repeats", "-3"], "argument --repeats: must be a positive integer, got -3"),
        (["--layer", "-1", "--gguf", "model.gguf"], "argument --layer: must be a non-negative integer, got -1"),
        (["--layer", "2"], "--layer applies only with --gguf"),
        (["--gguf", "model.gguf", "--model", "mixtral-8x7b"], "--model does not apply with --gguf"),
        (["--gguf", "model.gguf", "--dtype", "f32"], "--dtype does not apply with --gguf"),
        (["--gguf", "model.gguf", "--repeats", "3"], "--repeats does not apply with --gguf"),
        (["--dtype", "f64"], "argument --dtype: invalid choice: 'f64'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_demo_argument_errors_are_one_line_and_exit_status_2(args, message):
    result = routemm_cli("demo", *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"routemm demo: error: {message}"), result.stderr
    assert result.stderr.endswith(" (python -m routemm demo --help lists the options)\n"), result.stderr


def test_top_level_argument_errors_are_one_line_and_exit_status_2():
    result = routemm_cli("--frobnicate")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("routemm: error: unrecognized arguments: --frobnicate"), result.stderr


def test_a_core_error_inside_a_command_is_caught_in_process(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_available_host_bytes", lambda: 1000)
    assert cli.main(["demo", "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("routemm demo: error: demo: this run needs about ")
    assert err.count("\n") == 1


# ---- the demo ----------------------------------------------------------------------------------------


def test_demo_table_says_which_backend_ran_why_and_what_the_columns_mean():
    result = routemm_cli("demo", "--repeats", "1", "--tokens", "16")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    chosen = routemm.available_backends()[0]
    assert f"backend: {chosen} (" in out
    if chosen == "cpu":
        assert f"backend: cpu (cpu, {routemm.Device('cpu').properties['isa']} kernels), " in out
    for name, available, reason in routemm.backend_status():
        if name != chosen:
            assert f"  {name}: {'available, not chosen' if available else 'unavailable: ' + reason}" in out
    for column in ("time_us", "GB/s", "GFLOP/s", "max rel err"):
        assert f"\n{column} " in out
    assert "max|out - ref| / max|ref|" in out and f"below {demo.OK_MAX_REL_ERROR:g}" in out
    assert out.rstrip().endswith("OK")
    assert result.stderr == ""  # the reduced default reports no progress


def test_demo_json_records_the_choice_memory_and_cache_residency():
    result = routemm_cli("demo", "--repeats", "1", "--tokens", "16", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["reduced"]
    assert report["backend_choice"]["chosen"] == report["backend"]
    isa = routemm.Device("cpu").properties["isa"] if report["backend"] == "cpu" else None
    assert report["cpu_isa"] == isa
    assert set(report["backend_choice"]["others"]) == {n for n, _, _ in routemm.backend_status()} - {report["backend"]}
    assert report["memory"]["host_bytes"] > 0 and report["memory"]["device_bytes"] > 0
    assert [(r["m"], r["route"]) for r in report["runs"]] == [(1, "direct"), (16, "direct"), (16, "grouped_prefill")]
    for r in report["runs"]:
        if report["cache_bytes"] is None:
            assert r["cache_resident"] is False
        else:
            touched = r["experts_touched"] * report["shape"]["n"] * report["shape"]["k"] * 2
            assert r["cache_resident"] == (touched <= report["cache_bytes"])


@pytest.mark.skipif("cpu" not in routemm.available_backends(), reason="no cpu backend")
def test_demo_gguf_report_names_the_cpu_kernels_clone(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    assert cli.main(["gguf-sample", str(path), "--layers", "1", "--type", "q8_0"]) == 0
    capsys.readouterr()
    isa = routemm.Device("cpu").properties["isa"]
    assert cli.main(["demo", "--gguf", str(path), "--tokens", "2", "--backend", "cpu"]) == 0
    assert f"1 MoE layers on cpu (cpu, {isa} kernels)" in capsys.readouterr().out
    assert cli.main(["demo", "--gguf", str(path), "--tokens", "2", "--backend", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_isa"] == isa


def test_a_cache_resident_run_is_flagged(monkeypatch):
    monkeypatch.setattr(demo, "_last_level_cache_bytes", lambda device: 1 << 40)
    report = demo.run(None, 8, "bf16", "cpu", 1, 0)
    assert all(r["cache_resident"] for r in report["runs"])
    out = io.StringIO()
    demo.print_report(report, out)
    assert "*            cache-resident: the touched weights fit in the" in out.getvalue()
    assert "--model takes full sizes" in out.getvalue()
    monkeypatch.setattr(demo, "_last_level_cache_bytes", lambda device: 1)
    report = demo.run(None, 8, "bf16", "cpu", 1, 0)
    assert not any(r["cache_resident"] for r in report["runs"])
    out = io.StringIO()
    demo.print_report(report, out)
    assert "cache-resident" not in out.getvalue()


# A small stand-in for a full-size model: the full-size code path at a test's cost.
SMALL_MODEL = ("small-test-model", (64, 4, 512, 512))


def test_full_size_weights_never_hold_the_stack_in_float32_on_the_host(monkeypatch):
    monkeypatch.setitem(demo.MODELS, SMALL_MODEL[0], SMALL_MODEL[1])
    n_experts, _, n, k = SMALL_MODEL[1]
    stack_f32 = n_experts * n * k * 4  # 64 MiB; the host may hold a few experts' worth of it at once
    tracemalloc.start()
    try:
        report = demo.run(SMALL_MODEL[0], 8, "f32", "cpu", 1, 0, progress=demo.Progress(enabled=False))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report["ok"]
    assert peak < stack_f32 / 4, f"host peak {peak} bytes for a {stack_f32}-byte float32 stack"


def test_full_size_run_states_its_memory_and_reports_progress(monkeypatch):
    monkeypatch.setitem(demo.MODELS, SMALL_MODEL[0], SMALL_MODEL[1])
    stream = io.StringIO()  # not a terminal: one line per phase start and end, no bar
    report = demo.run(SMALL_MODEL[0], 8, "bf16", "cpu", 1, 0, progress=demo.Progress(enabled=True, stream=stream))
    lines = stream.getvalue().splitlines()
    needed = demo.memory_needed(SMALL_MODEL[1], "bf16", 8, host_accessible=True)
    assert (
        lines[0]
        == f"routemm demo: full-size small-test-model needs about {demo._gb(needed['host_bytes'])} of host memory"
    )
    assert "routemm demo: generating weights (64 experts) ..." in lines
    assert any(line.startswith("routemm demo: generating weights done in ") for line in lines)
    assert any(line.startswith("routemm demo: timing at m=8 (2 routes)") for line in lines)
    assert report["memory"]["host_bytes"] == needed["host_bytes"]


def test_progress_uses_tqdm_only_on_a_terminal():
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert demo.Progress(enabled=True, stream=Terminal())._tqdm is not None
    assert demo.Progress(enabled=True, stream=io.StringIO())._tqdm is None
    assert demo.Progress(enabled=False, stream=Terminal())._tqdm is None
    stream = Terminal()
    with demo.Progress(enabled=True, stream=stream).phase("generating weights", 3, "experts") as advance:
        for _ in range(3):
            advance()
    assert "generating weights" in stream.getvalue()


def test_memory_needed_counts_the_weights_once():
    n_experts, top_k, n, k = demo.MODELS["deepseek-v3"]
    weights = n_experts * n * k * 2
    gpu = demo.memory_needed(demo.MODELS["deepseek-v3"], "bf16", 64, host_accessible=False)
    cpu = demo.memory_needed(demo.MODELS["deepseek-v3"], "bf16", 64, host_accessible=True)
    assert weights < gpu["device_bytes"] < weights * 1.01
    assert gpu["host_bytes"] < weights / 10  # the host never holds the stack when the device does
    assert cpu["host_bytes"] == gpu["host_bytes"] + gpu["device_bytes"]


# ---- tests/run.sh without its tools ----------------------------------------------------------------


def _path_without_build_tools(tmp_path: Path) -> str:
    """A PATH holding only what run.sh needs besides cmake, ninja and nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mktemp", "grep", "cat", "rm", "nproc"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} not found")
        (bin_dir / tool).symlink_to(found)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return str(bin_dir)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
def test_run_sh_without_cmake_says_how_to_install_and_keeps_pytest_status(tmp_path):
    path = _path_without_build_tools(tmp_path)
    environment = {**os.environ, "PATH": path}
    run_sh = [shutil.which("bash"), str(REPO / "tests" / "run.sh")]
    # One quick test selected: pytest passes, the C++ part is skipped, exit status 0.
    passed = subprocess.run(
        [*run_sh, "-k", "test_knobs_prints_the_table"], env=environment, capture_output=True, text=True, timeout=300
    )
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "1 passed" in passed.stdout
    assert "run.sh: C++ tests NOT run: cmake ninja not found on PATH." in passed.stderr
    assert "sudo apt-get install cmake ninja-build libgtest-dev" in passed.stderr
    assert "brew install cmake ninja googletest" in passed.stderr
    # Nothing selected: pytest's exit status (5, no tests ran) is the script's.
    empty = subprocess.run(
        [*run_sh, "-k", "no_test_has_this_name"], env=environment, capture_output=True, text=True, timeout=300
    )
    assert empty.returncode == 5
    assert "C++ tests NOT run" in empty.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
def test_run_sh_installs_the_checkout_first_where_routemm_is_not_installed(tmp_path):
    """On a fresh machine `bash tests/run.sh` alone installs this checkout with its test extra, then
    tests it; where routemm imports it installs nothing. A stand-in `python` records the calls."""
    log = tmp_path / "calls.txt"
    for installed, expect_install in ((False, True), (True, False)):
        folder = tmp_path / ("installed" if installed else "fresh")
        folder.mkdir()
        path = _path_without_build_tools(folder)
        (Path(path) / "python").write_text(
            "#!/bin/sh\n"
            f'echo "$*" >> "{log}"\n'
            'case "$*" in *"import routemm"*) exit ' + ("0" if installed else "1") + " ;; esac\n"
            "exit 0\n"
        )
        log.write_text("")
        run = subprocess.run(
            [shutil.which("bash"), str(REPO / "tests" / "run.sh")],
            env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        calls = log.read_text().splitlines()
        installs = [c for c in calls if c.startswith("-m pip install")]
        assert bool(installs) == expect_install, calls
        if expect_install:
            assert installs == [f"-m pip install {REPO}[test]"], installs
            assert "routemm or its test dependencies are not installed" in run.stdout
        assert any(c.startswith("-m pytest") for c in calls), calls
        assert run.returncode == 0, run.stdout + run.stderr


def _last_line(run: subprocess.CompletedProcess) -> str:
    return (run.stdout + run.stderr).strip().splitlines()[-1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
def test_run_sh_says_last_that_the_cpp_tests_did_not_run_and_the_command_that_fixes_it(tmp_path):
    environment = {**os.environ, "PATH": _path_without_build_tools(tmp_path)}
    run_sh = [shutil.which("bash"), str(REPO / "tests" / "run.sh")]
    passed = subprocess.run(
        [*run_sh, "-k", "test_knobs_prints_the_table"], env=environment, capture_output=True, text=True, timeout=300
    )
    assert passed.returncode == 0
    # stderr is what a terminal shows last; its last line is the summary.
    last = passed.stderr.strip().splitlines()[-1]
    assert last.startswith("run.sh: pytest passed; C++ tests NOT run (cmake ninja not found on PATH). Fix: "), last
    assert last.endswith(" && bash tests/run.sh"), last
    assert "libgtest-dev" in last or "googletest" in last or "gtest-devel" in last, last
    failed = subprocess.run(
        [*run_sh, "-k", "no_test_has_this_name"], env=environment, capture_output=True, text=True, timeout=300
    )
    assert failed.stderr.strip().splitlines()[-1].startswith("run.sh: pytest FAILED (exit 5); C++ tests NOT run (")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("cmake") is None or shutil.which("ninja") is None,
                    reason="bash, cmake or ninja not found")  # fmt: skip
def test_run_sh_without_googletest_says_so_last(tmp_path):
    environment = {
        **os.environ,
        "ROUTEMM_CTEST_BUILD_DIR": str(tmp_path / "ctest"),
        "ROUTEMM_CTEST_CMAKE_ARGS": "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON",
    }
    run = subprocess.run(
        [shutil.which("bash"), str(REPO / "tests" / "run.sh"), "-k", "test_knobs_prints_the_table"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("run.sh: pytest passed; C++ tests NOT run (CMake found no GoogleTest"), last
    assert " Fix: " in last and last.endswith(" && bash tests/run.sh"), last
