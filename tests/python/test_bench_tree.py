"""bench/ keeps its layout: the suites and results at its top, device runs behind one entry point
(bench/device.sh), the labs and their records under bench/lab/; every script parses and names only
files that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
DEVICE_COMMANDS = (
    "suite", "session", "quick", "demo", "q4-matvec", "tensor", "profile", "peer", "qid", "engine", "host-cost", "lab",
    "direct-path", "ab", "batch", "block",
)  # fmt: skip

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _device(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(BENCH / "device.sh"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", **env},
    )


@pytest.mark.parametrize("script", sorted(p.relative_to(REPO).as_posix() for p in BENCH.rglob("*.sh")))
def test_every_bench_script_parses(script):
    result = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_device_scripts_are_one_entry_point_and_its_helper():
    assert sorted(p.name for p in BENCH.glob("device*")) == ["device.sh", "device_common.sh"]
    assert not list(REPO.glob("bench/**/*.diff")) and not list(REPO.glob("bench/**/*.patch"))


def test_device_help_lists_every_command():
    result = _device("help")
    assert result.returncode == 0
    listed = re.findall(r"^  ([a-z0-9-]+)", result.stdout, re.M)
    assert set(DEVICE_COMMANDS) | {"help"} == set(listed)


@pytest.mark.parametrize(
    "args,message",
    [
        (("bogus",), "unknown command 'bogus'"),
        (("profile",), "profile needs one of"),
        (("lab", "x"), "lab needs one of"),
        (("batch",), "batch needs at least one command"),
        (("ab", "only-a-patch"), "ab needs PATCH CMD"),
    ],
)
def test_device_refuses_what_it_does_not_know(tmp_path, args, message):
    result = _device(*args, OUT=str(tmp_path))
    assert result.returncode == 2 and message in result.stderr


def test_device_batch_packs_each_command_as_it_ends(tmp_path):
    result = _device("batch", "help", "help:SKIP_BUILD=1 FOO=a,b", OUT=str(tmp_path))
    assert result.returncode == 0
    assert "batch: help (SKIP_BUILD=1 FOO=a,b)" in result.stdout
    with tarfile.open(tmp_path / "help.tar.gz") as packed:
        console = packed.extractfile("help/console.txt").read().decode()
    assert "usage: bash bench/device.sh COMMAND" in console and "exit: 0" in console


def test_device_ab_refuses_a_change_the_tree_does_not_hold(tmp_path):
    diff = tmp_path / "change.diff"
    diff.write_text("--- a/README.md\n+++ b/README.md\n@@ -1,1 +1,2 @@\n+a line README.md does not have\n # routemm\n")
    result = _device("ab", str(diff), "true", OUT=str(tmp_path))
    assert result.returncode == 2 and "is not applied to this tree" in result.stderr


def test_device_ab_runs_a_stack_of_changes_reverting_the_last_first(tmp_path):
    """`ab P1:P2 CMD` in a scratch tree with a stand-in build (a python3 that only exits): each round
    runs CMD on the tree as it is, without P2, then without P2 and P1; the tree ends as it came."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    for name in ("device.sh", "device_common.sh"):
        shutil.copy(BENCH / name, tree / "bench" / name)
    (tree / "state.txt").write_text("c\n")
    (tree / "p1.diff").write_text("--- a/state.txt\n+++ b/state.txt\n@@ -1 +1 @@\n-a\n+b\n")
    (tree / "p2.diff").write_text("--- a/state.txt\n+++ b/state.txt\n@@ -1 +1 @@\n-b\n+c\n")
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 0\n")
    (fake / "python3").chmod(0o755)
    out = tmp_path / "out"

    def ab(patches: str, cmd: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "bench/device.sh", "ab", patches, cmd],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), **env},
        )

    result = ab("p1.diff:p2.diff", "cat state.txt", ROUNDS="2")
    assert result.returncode == 0, result.stdout + result.stderr
    labels = ["with", "without-p2", "without-p2-p1"] * 2
    for n, (label, state) in enumerate(zip(labels, "cbacba", strict=True), 1):
        assert (out / f"ab-{n}-{label}.log").read_text().split() == [state, "exit:", "0"]
    assert (tree / "state.txt").read_text() == "c\n"
    missing = ab("p2.diff:p1.diff", "true")
    assert missing.returncode == 2 and "p1.diff is not applied to this tree" in missing.stderr
    assert (tree / "state.txt").read_text() == "c\n"
    # A refusal after reverting the later changes puts them back.
    twice = ab("p1.diff:p2.diff:p2.diff", "true")
    assert twice.returncode == 2 and "p2.diff is not applied to this tree" in twice.stderr
    assert (tree / "state.txt").read_text() == "c\n"


def test_device_peer_without_a_ggml_tree_says_what_to_carry(tmp_path):
    result = _device("peer", OUT=str(tmp_path), LLAMA_SRC=str(tmp_path / "none"))
    assert result.returncode == 2 and "carry .dev/llama" in result.stdout


def test_files_the_device_runs_name_exist():
    text = (BENCH / "device.sh").read_text()
    named = set(re.findall(r"\b(bench/[\w./-]+\.(?:py|sh|cu))\b", text)) | set(
        re.findall(r"\b(tests/python/[\w.]+\.py)\b", text)
    )
    assert len(named) > 15
    missing = sorted(name for name in named if not (REPO / name).exists())
    assert not missing, missing


def test_results_hold_results_and_the_labs_their_records():
    results = {p.name for p in (BENCH / "results").iterdir()}
    assert not {"experiments", "logs"} & results
    assert (BENCH / "lab" / "records" / "logs").is_dir() and list((BENCH / "lab" / "records").glob("*.md"))


@pytest.mark.parametrize("tool", sorted(p.name for p in (BENCH / "tools").glob("*.py")))
def test_bench_tools_compile(tool):
    subprocess.run([sys.executable, "-m", "py_compile", str(BENCH / "tools" / tool)], check=True)


def test_sass_summary_reads_a_listing(tmp_path):
    listing = tmp_path / "sass.txt"
    listing.write_text(
        "\n\tFunction : q4_matvec_kernel\n"
        "        /*0000*/                   LDG.E.128 R4, [R2.64] ;\n"
        "        /*0010*/               @P0 FFMA R1, R2, R3, R4 ;\n"
        "        /*0020*/                   FFMA R1, R2, R3, R4 ;\n"
        "\n\tFunction : other_kernel\n"
        "        /*0000*/                   EXIT ;\n"
    )
    mix = subprocess.run(
        [sys.executable, str(BENCH / "tools" / "sass_summary.py"), str(listing), "mix", "q4_"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "q4_matvec_kernel" in mix and "3 instructions" in mix and "('FFMA', 2)" in mix and "other" not in mix
    loads = subprocess.run(
        [sys.executable, str(BENCH / "tools" / "sass_summary.py"), str(listing), "loads"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "'LDG.E.128': 1" in loads and "'FFMA': 2" in loads and loads.count("SASS") == 2


def test_qid_timing_smoke_runs_on_cpu(tmp_path):
    """bench/tools/qid_timing.py --smoke: every mode on the CPU backend with small shapes, records in
    the results format, each routemm record checked against float64 (a failed check exits 1)."""
    pytest.importorskip("torch")
    result = subprocess.run(
        [sys.executable, str(BENCH / "tools" / "qid_timing.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    for name, op in (("quantized_matmul_id-cpu-smoke", "quantized_matmul_id"), ("moe_block-cpu-smoke", "moe_block")):
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        assert {"device", "git_rev", "command", "ceilings", "records"} <= set(doc)
        records = doc["records"]
        assert records and all(r["op"] == op and r["time_us"] > 0 for r in records)
        assert all(r in lines for r in records)  # the JSON lines are the records
        assert (tmp_path / f"{name}.md").read_text().count(f"| {op} |") == len(records)
        routemm_records = [r for r in records if r["impl"] == "routemm"]
        assert routemm_records and all("rel err" in r["note"] for r in routemm_records)
    matmul = json.loads((tmp_path / "quantized_matmul_id-cpu-smoke.json").read_text())["records"]
    assert {(r["weight_dtype"], r["route"]) for r in matmul if r["impl"] == "routemm"} == {
        (t, route) for t in ("q4_0", "q8_0") for route in ("direct", "grouped")
    }
    assert {r["impl"] for r in matmul} >= {"routemm", "copy_floor"}


def test_peer_compare_joins_routemm_fastest_route_with_the_peer(tmp_path):
    """bench/tools/peer_compare.py: per (format, shape, projection, m) routemm's fastest finite
    record (qid_timing's Q4_0 rows as the up projection, qid_format_timing's by their proj) beside
    the peer's rotated time, speed = peer / routemm; the peer's L2 rows and unmatched rows dropped."""
    qid = tmp_path / "qid.jsonl"
    rows = [
        {"op": "quantized_matmul_id", "shape": "qwen3-30b-a3b", "m": 8, "weight_dtype": "q4_0",
         "route": "direct", "impl": "routemm", "time_us": 40.0},
        {"op": "quantized_matmul_id", "shape": "qwen3-30b-a3b", "m": 8, "weight_dtype": "q4_0",
         "route": "grouped_mm", "impl": "torch_grouped_mm", "time_us": 10.0},
        {"shape": "qwen3-30b-a3b", "proj": "down", "type": "q6_k", "m": 512, "route": "direct",
         "time_us": 900.0},
        {"shape": "qwen3-30b-a3b", "proj": "down", "type": "q6_k", "m": 512,
         "route": "grouped_tensor_lowp", "time_us": 450.0},
        {"shape": "qwen3-30b-a3b", "proj": "down", "type": "q6_k", "m": 1, "route": "direct",
         "time_us": float("nan")},
    ]  # fmt: skip
    qid.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"peer": "llama.cpp test", "device": "test card", "op": "MUL_MAT_ID", "rel_err": 4e-3}
    peer = [
        common | {"type": "q4_0", "shape": "qwen3_30b_a3b", "m": 8, "mode": "rotated", "us": 20.0},
        common | {"type": "q4_0", "shape": "qwen3_30b_a3b", "m": 8, "mode": "l2", "us": 1.0},
        common | {"type": "q6_K", "shape": "qwen3_30b_a3b_down", "m": 512, "mode": "rotated", "us": 900.0},
        common | {"type": "q6_K", "shape": "qwen3_30b_a3b_down", "m": 1, "mode": "rotated", "us": 9.0},
    ]
    peer_json = tmp_path / "llama_peer.json"
    peer_json.write_text(json.dumps(peer))
    subprocess.run(
        [sys.executable, str(BENCH / "tools" / "peer_compare.py"), str(qid), str(peer_json),
         "--out", str(tmp_path), "--card", "test"],
        check=True, capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    doc = json.loads((tmp_path / "qid_vs_llama-test.json").read_text())
    got = {
        (r["weight_dtype"], r["shape"], r["m"]): (r["route"], r["time_us"], r["speed_vs_peer"]) for r in doc["records"]
    }
    assert got == {
        ("q4_0", "qwen3-30b-a3b up", 8): ("direct", 40.0, 0.5),
        ("q6_k", "qwen3-30b-a3b down", 512): ("grouped_tensor_lowp", 450.0, 2.0),
    }
    assert doc["device"] == "test card"
