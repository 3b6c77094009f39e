"""bench/cpu_peer.py's side-by-side table: the ratio of each side's minimum, and the per-round ratios
that pair the two sides measured in the same round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("numpy")
PATH = Path(__file__).resolve().parents[2] / "bench" / "cpu_peer.py"


def _module():
    spec = importlib.util.spec_from_file_location("cpu_peer_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(impl, route, time_us, rnd, protocol=None):
    r = dict(op="dense_matmul_id", weight_dtype="bf16", m=1, impl=impl, route=route, time_us=time_us, round=rnd)
    if protocol:
        r["protocol"] = protocol
    return r


def test_per_round_ratios_pair_the_sides_of_each_round():
    cp = _module()
    proto = cp._protocol(cp.BATCH)
    # Each side's minimum falls in another round (ggml's 400 in round 1, routemm's 450 in round 2:
    # 0.89x); paired by round the ratios are 400 / 480 and 500 / 450.
    records = [
        _record("ggml_cpu", "ggml_plain", 400.0, 1),
        _record("ggml_cpu", "ggml_repack", 650.0, 1),
        _record("routemm", "direct", 480.0, 1, proto),
        _record("ggml_cpu", "ggml_plain", 500.0, 2),
        _record("routemm", "direct", 450.0, 2, proto),
        _record("routemm", "direct", 100.0, 2, "one dispatch per commit-and-wait"),  # another protocol
    ]
    ours = min(
        (r for r in records if r["impl"] == "routemm" and r.get("protocol") == proto), key=lambda r: r["time_us"]
    )
    ratios = cp._per_round_ratios(records, proto, "dense_matmul_id", "bf16", 1, ours)
    assert ratios == pytest.approx([400 / 480, 500 / 450])
    lines = cp._comparison(records, proto)
    row = next(line for line in lines if line.startswith("| expert-ID Qwen3 bf16 | 1 |"))
    assert "| 0.89x | 0.97x (0.83-1.11) |" in row


def test_one_round_gives_no_per_round_column():
    cp = _module()
    proto = cp._protocol(cp.BATCH)
    records = [_record("ggml_cpu", "ggml_plain", 500.0, 1), _record("routemm", "direct", 400.0, 1, proto)]
    row = next(line for line in cp._comparison(records, proto) if line.startswith("| expert-ID"))
    assert row.endswith("| 1.25x |  |")
