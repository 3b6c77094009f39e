"""`python -m routemm gguf-sample FILE`: a small MoE GGUF file of a named architecture and expert type,
which MoeLayer.from_gguf and `demo --gguf` run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import routemm
from routemm.cli.main import main
from tolerances import MOE_EXPERTS_TOLERANCE

pytest.importorskip("gguf")

_QUANTIZED_ID = pytest.mark.needs_kernels(*routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES)


@pytest.mark.parametrize(
    ("arch", "file_arch"),
    [("qwen3moe", "qwen3moe"), ("mixtral", "llama")],
)
@pytest.mark.parametrize(
    "kind", ["f32", "f16", "bf16", pytest.param("q4_0", marks=_QUANTIZED_ID), pytest.param("q8_0", marks=_QUANTIZED_ID)]
)
def test_sample_file_loads_and_matches_the_reference(tmp_path, device, capsys, arch, file_arch, kind):
    path = tmp_path / "moe.gguf"
    assert main(["gguf-sample", str(path), "--arch", arch, "--type", kind, "--layers", "3", "--experts", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {path}: {file_arch}, 3 layers, 4 experts (top 2)")
    assert f"python -m routemm demo --gguf {path}" in printed
    assert routemm.gguf_metadata(path)["general.architecture"] == file_arch
    layer = routemm.MoeLayer.from_gguf(path, 2, device=device)
    assert (layer.n_experts, layer.top_k, layer.hidden, layer.intermediate) == (4, 2, 64, 32)
    assert (layer.ggml_type.value if layer.ggml_type else None) == (kind if kind.startswith("q") else None)
    hidden = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    atol, rtol = MOE_EXPERTS_TOLERANCE
    np.testing.assert_allclose(layer(hidden), layer.reference(hidden)[0], atol=atol, rtol=rtol)


def test_the_same_seed_writes_the_same_file(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for path in (a, b):
        assert main(["gguf-sample", str(path), "--type", "q4_0", "--seed", "7"]) == 0
    assert a.read_bytes() == b.read_bytes()


def test_demo_runs_the_sample(tmp_path, capsys):
    path = tmp_path / "moe.gguf"
    assert main(["gguf-sample", str(path), "--type", "q8_0"]) == 0
    assert main(["demo", "--gguf", str(path), "--layer", "1", "--tokens", "8", "--backend", "cpu"]) == 0
    assert capsys.readouterr().out.strip().endswith("OK")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--type", "q3_k"], "argument --type: invalid choice: 'q3_k'"),
        (["--arch", "qwen3moe", "--split-experts"], "--split-experts is for --arch mixtral only"),
        (["--arch", "deepseek2", "--experts", "6"], "6 experts in 4 groups, 2 used, do not fit"),
        (["--arch", "llama"], "argument --arch: invalid choice: 'llama'"),
        (["--experts", "0"], "argument --experts: must be a positive integer, got 0"),
        (["--experts", "4", "--top-k", "5"], "--top-k 5 is more than --experts 4"),
        (["--type", "q4_0", "--hidden", "48"], "--hidden 48 must be a multiple of 32 for q4_0 experts"),
        (["--type", "q8_0", "--intermediate", "40"], "--intermediate 40 must be a multiple of 32 for q8_0 experts"),
    ],
)
def test_argument_errors_are_one_line_and_exit_status_2(tmp_path, args, message):
    path = tmp_path / "moe.gguf"
    result = subprocess.run(
        [sys.executable, "-m", "routemm", "gguf-sample", str(path), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"routemm gguf-sample: error: {message}")
    assert not path.exists()
