"""MoE layers of GGUF files: qwen3moe-style files written with the gguf package's writer (the
tensor names and metadata a real conversion produces) load zero-copy and run router + gate +
experts against the float64 reference; `python -m routemm demo --gguf` does the same from the CLI."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm import DType
from tolerances import MOE_EXPERTS_TOLERANCE

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

E, TOP_K, H, INTER, LAYERS = 8, 2, 64, 32, 2
LAYER_ATOL, LAYER_RTOL = MOE_EXPERTS_TOLERANCE


def _encode(w: np.ndarray, kind: str):
    if kind == "f32":
        return w.astype(np.float32), None
    if kind == "f16":
        return w.astype(np.float16), None
    if kind == "bf16":
        return w.astype(ml_dtypes.bfloat16).view(np.uint16), Q.BF16
    qtype = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0}[kind]
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_qwen3moe(path, rng, kind: str, *, down_kind: str | None = None, arch: str = "qwen3moe", moe_keys=True):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(H)
    writer.add_string("general.name", "routemm-moe-test")
    if moe_keys:
        writer.add_expert_count(E)
        writer.add_expert_used_count(TOP_K)
        writer.add_expert_feed_forward_length(INTER)
    for layer in range(LAYERS):
        router = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
        for part, shape, scale in (
            ("gate", (E, INTER, H), H),
            ("up", (E, INTER, H), H),
            ("down", (E, H, INTER), INTER),
        ):
            w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(scale)
            data, raw = _encode(w, down_kind if part == "down" and down_kind else kind)
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_QUANTIZED_ID = pytest.mark.needs_kernels(*routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES)


@pytest.mark.parametrize(
    "kind", ["f32", "f16", "bf16", pytest.param("q4_0", marks=_QUANTIZED_ID), pytest.param("q8_0", marks=_QUANTIZED_ID)]
)
def test_layer_matches_float64_reference(tmp_path, rng, device, kind):
    path = write_qwen3moe(tmp_path / f"moe-{kind}.gguf", rng, kind)
    layer = routemm.MoeLayer.from_gguf(path, 1, device=device)
    assert (layer.n_experts, layer.top_k, layer.hidden, layer.intermediate) == (E, TOP_K, H, INTER)
    assert layer.renormalize  # qwen3moe renormalises its top-k weights
    assert (layer.ggml_type.value if layer.ggml_type else None) == (kind if kind.startswith("q") else None)
    for m in (1, 20):
        hidden = rng.standard_normal((m, H)).astype(np.float32)
        out = layer(hidden)
        ref, _, _ = layer.reference(hidden)
        np.testing.assert_allclose(out, ref, atol=LAYER_ATOL, rtol=LAYER_RTOL)


def test_expert_stacks_load_zero_copy(tmp_path, rng):
    path = write_qwen3moe(tmp_path / "moe.gguf", rng, "q4_0")
    layer = routemm.MoeLayer.from_gguf(path, 0, device=routemm.Device("cpu"))
    for buf in (layer.router, layer.gate, layer.up, layer.down):
        assert not buf.writable  # a view of the file's read-only memory map, not a copy
    assert layer.gate.dtype == DType.U8 and tuple(layer.gate.shape) == (E, INTER, H // 32 * 18)
    reader = gguf.GGUFReader(str(path))
    (t,) = [t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight"]
    np.testing.assert_array_equal(layer.down.numpy(), np.asarray(t.data))
    meta = routemm.gguf_metadata(path)
    assert meta["qwen3moe.expert_count"] == E and meta["qwen3moe.expert_used_count"] == TOP_K


def test_layer_equals_gate_then_experts(tmp_path, rng, device):
    path = write_qwen3moe(tmp_path / "moe.gguf", rng, "f32")
    layer = routemm.MoeLayer.from_gguf(path, 0, device=device)
    hidden = rng.standard_normal((12, H)).astype(np.float32)
    router = layer.router.numpy()
    logits = routemm.matmul_id(router[None], hidden, np.zeros((12, 1), np.int32), device=device)
    weights, ids = routemm.moe_gate(logits, TOP_K, renormalize=True, device=device)
    f = layer.float_weights()
    out = routemm.moe_experts(hidden, ids, weights, (f["gate"], f["up"]), f["down"], device=device)
    np.testing.assert_array_equal(layer(hidden), out)


def test_bad_files_are_refused(tmp_path, rng, device):
    dense = write_qwen3moe(tmp_path / "dense.gguf", rng, "f32", arch="llama", moe_keys=False)
    with pytest.raises(routemm.InvalidArgumentError, match="llama.expert_count: not a mixture-of-experts"):
        routemm.MoeLayer.from_gguf(dense, 0, device=device)
    path = write_qwen3moe(tmp_path / "moe.gguf", rng, "q4_0")
    with pytest.raises(routemm.InvalidArgumentError, match="layer 2 is out of range"):
        routemm.MoeLayer.from_gguf(path, 2, device=device)
    mixed = write_qwen3moe(tmp_path / "mixed.gguf", rng, "q4_0", down_kind="f32")
    with pytest.raises(routemm.UnsupportedError, match="mixes expert types"):
        routemm.MoeLayer.from_gguf(mixed, 0, device=device)
    layer = routemm.MoeLayer.from_gguf(path, 0, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="hidden must be float32"):
        layer(np.zeros((2, H)))


def test_cli_demo_runs_a_gguf_layer(tmp_path, rng, capsys):
    from routemm.__main__ import main

    path = write_qwen3moe(tmp_path / "moe.gguf", rng, "q8_0")
    assert main(["demo", "--gguf", str(path), "--layer", "1", "--tokens", "12", "--backend", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "layer 1 (E=8, top_k=2, H=64, I=32, q8_0 experts" in printed
    assert printed.strip().endswith("OK")


@pytest.mark.needs_kernels(*routemm.GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES)
def test_layer_takes_a_route(tmp_path, rng, device):
    """A Q4_0 layer runs the CPU's int8-dot routes when asked: direct and grouped agree bit for bit
    and stay within the int8-dot error of the exact layer; an unknown route is refused before
    anything runs."""
    layer = routemm.MoeLayer.from_gguf(write_qwen3moe(tmp_path / "moe.gguf", rng, "q4_0"), 0, device=device)
    hidden = rng.standard_normal((12, H)).astype(np.float32)
    exact = layer(hidden)
    np.testing.assert_array_equal(exact, layer(hidden, route="grouped"))
    direct = layer(hidden, route=routemm.GgmlQuantizedMatmulIdRoute.DIRECT_INT8_DOT)
    np.testing.assert_array_equal(direct.view(np.uint32), layer(hidden, route="grouped_int8_dot").view(np.uint32))
    assert not np.array_equal(direct, exact)
    assert np.linalg.norm(direct - exact) / np.linalg.norm(exact) <= 2e-2
    with pytest.raises(routemm.InvalidArgumentError, match="got 'direct_bf16_dot'"):
        layer(hidden, route="direct_bf16_dot")
