"""bench/engine_decode.py in its CPU smoke form: both measurements run and write DESIGN.md's
results format (no timing claims on CPU)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("torch")

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "engine_decode.py"


def _bench():
    spec = importlib.util.spec_from_file_location("engine_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("what", ["host-cost", "decode-graph"])
def test_smoke_writes_results(tmp_path, what):
    out = tmp_path / "out.json"
    args = [what, str(out), "--smoke"] + (["--calls", "5", "--batches", "2"] if what == "host-cost" else [])
    assert _bench().main(args) == 0
    doc = json.loads(out.read_text())
    assert {"device", "git_rev", "command", "ceilings", "records"} <= set(doc)
    assert doc["records"]
    for record in doc["records"]:
        assert {"op", "shape", "m", "weight_dtype", "route", "impl", "time_us"} <= set(record)
        assert record["time_us"] > 0
    if what == "host-cost":
        counted = doc["records"][0]
        assert counted["host_syncs"] == 0
        assert counted["routemm_streams_created"] == 0
        assert counted["routemm_device_allocations"] == 0  # buffers wrap the tensors; scratch is torch's


@pytest.mark.parametrize("ggml_type", ["q4_0", "q8_0"])
def test_decode_graph_smoke_over_block_stacks(tmp_path, ggml_type):
    """--ggml-type runs the step through torch.ops.routemm.quantized_matmul_id over random block
    stacks (valid f16 scales, so every output is finite)."""
    out = tmp_path / "out.json"
    assert _bench().main(["decode-graph", str(out), "--smoke", "--ggml-type", ggml_type]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["op"] == "quantized_matmul_id" and record["weight_dtype"] == ggml_type
    assert record["expert_calls"] == 6 and record["time_us"] > 0
