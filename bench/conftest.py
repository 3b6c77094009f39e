"""Benchmark harness: collects records in the results format of DESIGN.md and writes them at exit.

    python -m pytest bench/bench_dense_matmul_id.py --benchmark-only --results bench/results/dense_matmul_id-cpu.json

Each benchmark appends records through the `results` fixture; the file gets the device, git
revision, command line and measured ceilings, and a Markdown table is written beside it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

_RECORDS: list[dict] = []
_CEILINGS: dict = {}


def pytest_addoption(parser):
    parser.addoption("--results", default=None, help="write the results JSON (and a .md table) here")


@pytest.fixture(scope="module")
def device():
    """The CPU device the CPU suites (bench_dense_matmul_id.py, bench_q4_0_matmul.py) measure."""
    import routemm

    return routemm.Device("cpu")


@pytest.fixture(scope="module")
def registry(device):
    import routemm

    return routemm.KernelRegistry(device)


@pytest.fixture(scope="session")
def results():
    class Results:
        ceilings = _CEILINGS

        @staticmethod
        def add(**record):
            _RECORDS.append(record)

    return Results


def _git_rev() -> str:
    if os.environ.get("GIT_REV"):
        return os.environ["GIT_REV"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=os.path.dirname(__file__)).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_lines(doc: dict) -> list[str]:
    """The header's command: one line, or one per revision when records carry their own (merged files)."""
    if "records by revision" not in doc["git_rev"]:  # a single run
        return [f"Command: `{doc['command']}`"]
    by_rev: dict = {}
    for r in doc["records"]:
        if "command" in r:
            by_rev.setdefault(r.get("git_rev", "?"), r["command"])
    untold = sorted({r.get("git_rev", "?") for r in doc["records"] if "command" not in r})
    if not untold and len(set(by_rev.values())) <= 1:
        return [f"Command: `{doc['command']}`"]
    lines = ["Commands, by the revision of the records they measured:", ""]
    lines += [f"- {rev}: `{cmd}`" for rev, cmd in by_rev.items()]
    if untold:
        lines.append(f"- {', '.join(untold)}: merged before records kept their command; see bench/lab/records/logs")
    return lines


def _markdown(doc: dict) -> str:
    revision, _, detail = doc["git_rev"].partition(" ")  # a full hash, then any merge detail
    lines = [
        f"# {doc['device']} — {revision[:12]}{' ' + detail if detail else ''}",
        "",
        *_command_lines(doc),
        "",
        "Ceilings: " + ", ".join(f"{k} = {v:.3g}" for k, v in doc["ceilings"].items()),
        "",
        "| op | shape | m | weight dtype | route | impl | time (us) | GB/s | GFLOP/s | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        gbps = f"{r['TBps'] * 1e3:.2f}" if "TBps" in r else ""
        gflops = f"{r['TFLOPs'] * 1e3:.2f}" if "TFLOPs" in r else ""
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['m']} | {r['weight_dtype']} | {r['route']} | {r['impl']} | "
            f"{r['time_us']:.1f} | {gbps} | {gflops} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def write_results(path: str, *, device: str, tool: str, records: list, **extra) -> None:
    """Write a results document (DESIGN.md's format) to `path` and its Markdown table beside it:
    `tool` is the script's repo path, whose command line (or $BENCH_COMMAND) is recorded, with
    $GIT_REV as the revision; `extra` adds fields (torch's version, say)."""
    command = os.environ.get("BENCH_COMMAND", " ".join(["python3", tool, *sys.argv[1:]]))
    doc = {
        "device": device,
        "git_rev": os.environ.get("GIT_REV", "unknown"),
        "command": command,
        "ceilings": extra.pop("ceilings", {}),
        **extra,
        "records": records,
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(_markdown(doc))


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--results")
    if not path or not _RECORDS:
        return
    # A benchmark that runs on an accelerator names it in each record; the header takes that name.
    named = {r["device"] for r in _RECORDS if isinstance(r.get("device"), str) and r["device"]}
    doc = {
        "device": named.pop() if len(named) == 1 else f"cpu: {_cpu_name()} ({os.cpu_count()} threads)",
        "git_rev": _git_rev(),
        "command": "python -m pytest " + " ".join(sys.argv[1:]),
        "ceilings": dict(_CEILINGS),
        "records": _RECORDS,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(_markdown(doc))
