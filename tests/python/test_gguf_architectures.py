"""MoE GGUF files of every architecture as llama.cpp lays them out (routemm.formats.gguf_moe_writer,
`gguf-sample`): tensor names, metadata keys and the Q4_K_M / Q5_K_M / Q8_0 type mixes; each
architecture x mix loaded by MoeLayer.from_gguf and compared with a float64 reference computed from
the written file by the `gguf` package's reader and dequantisers (gguf_moe_reference.py); what
from_gguf cannot compute is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm.formats.gguf_moe_writer import ARCHITECTURES, MoeGgufSpec, use_more_bits, write_moe_gguf

gguf = pytest.importorskip("gguf")

ARCHS = list(ARCHITECTURES)
MIXES = ("q4_k_m", "q5_k_m", "q8_0")
# Small shapes: gate/up rows of 256 values (K-quants), down rows of 64 (their 32-value fallbacks).
SMALL = dict(layers=4, experts=8, hidden=256, intermediate=64)


def _write(tmp_path, arch, mix="q8_0", **kw):
    spec = MoeGgufSpec(arch=arch, mix=mix, **{**SMALL, **kw})
    path = tmp_path / f"{arch}-{mix}.gguf"
    return path, write_moe_gguf(path, spec), spec.resolved()


def _reader(path):
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: t for t in reader.tensors}


# ---- the writer ----------------------------------------------------------------------------------

# The tensors of one MoE layer N (llama.cpp's names), per architecture, beside the router and stacks.
EXTRA_TENSORS = {
    "qwen3moe": [],
    "qwen2moe": ["ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"],
    "mixtral": [],
    "deepseek2": ["exp_probs_b.bias", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"],
    "glm4moe": ["exp_probs_b.bias", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"],
    "gpt-oss": ["ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"],
    "llama4": ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"],
}
EXTRA_KEYS = {
    "qwen2moe": {"expert_shared_feed_forward_length": 64},
    "deepseek2": {
        "leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_scale": 2.5,
        "expert_weights_norm": True, "expert_gating_func": 2, "expert_group_count": 4, "expert_group_used_count": 2,
        "feed_forward_length": 128,
    },
    "glm4moe": {
        "leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_scale": 1.0,
        "expert_weights_norm": True, "expert_gating_func": 2, "feed_forward_length": 128,
    },
    "llama4": {"interleave_moe_layer_step": 2, "feed_forward_length": 128},
}  # fmt: skip
MOE_LAYERS = {"deepseek2": [1, 2, 3], "glm4moe": [1, 2, 3], "llama4": [1, 3]}


@pytest.mark.parametrize("arch", ARCHS)
def test_writer_uses_llama_cpp_names_and_keys(tmp_path, arch):
    path, written, spec = _write(tmp_path, arch)
    meta, tensors = _reader(path)
    file_arch = ARCHITECTURES[arch]
    assert meta["general.architecture"] == file_arch
    expected = {"block_count": 4, "embedding_length": 256, "expert_count": 8, "expert_feed_forward_length": 64}
    expected["expert_used_count"] = 1 if arch == "llama4" else 2
    for key, value in {**expected, **EXTRA_KEYS.get(arch, {})}.items():
        assert meta[f"{file_arch}.{key}"] == pytest.approx(value), key
    moe_layers = MOE_LAYERS.get(arch, [0, 1, 2, 3])
    for n in range(4):
        names = {name.removeprefix(f"blk.{n}.") for name in tensors if name.startswith(f"blk.{n}.")}
        if n not in moe_layers:
            assert names == {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
            continue
        stacks = {f"ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
        assert names == {"ffn_gate_inp.weight", *stacks, *EXTRA_TENSORS[arch]}, n
        assert list(tensors[f"blk.{n}.ffn_gate_inp.weight"].shape) == [256, 8]  # ggml order: [H, E]
        assert tensors[f"blk.{n}.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert list(tensors[f"blk.{n}.ffn_down_exps.weight"].shape) == [64, 256, 8]
    assert set(written) == set(tensors)


def test_mixtral_split_experts_are_per_expert_2d_tensors(tmp_path):
    path, _, _ = _write(tmp_path, "mixtral", split_experts=True)
    _, tensors = _reader(path)
    names = sorted(name for name in tensors if name.startswith("blk.1."))
    assert names == sorted(
        ["blk.1.ffn_gate_inp.weight"] + [f"blk.1.ffn_{p}.{e}.weight" for p in ("gate", "up", "down") for e in range(8)]
    )
    assert list(tensors["blk.1.ffn_down.3.weight"].shape) == [64, 256]


@pytest.mark.parametrize("mix,base", [("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K")])
def test_k_m_mixes_follow_llama_cpp(tmp_path, mix, base):
    """gate/up the mix's K-quant; down Q6_K where use_more_bits says so, else the base type; a row
    that is not a multiple of 256 takes llama.cpp's 32-value fallback."""
    fallback = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
    path, _, _ = _write(tmp_path, "qwen3moe", mix, layers=8, intermediate=256)
    _, tensors = _reader(path)
    for n in range(8):
        assert tensors[f"blk.{n}.ffn_gate_exps.weight"].tensor_type.name == base
        want = "Q6_K" if use_more_bits(n, 8) else base
        assert tensors[f"blk.{n}.ffn_down_exps.weight"].tensor_type.name == want, n
    assert [n for n in range(8) if use_more_bits(n, 8)] == [0, 3, 6, 7]
    path, _, _ = _write(tmp_path, "qwen3moe", mix, layers=8)  # down rows of 64 values
    _, tensors = _reader(path)
    for n in range(8):
        want = fallback["Q6_K" if use_more_bits(n, 8) else base]
        assert tensors[f"blk.{n}.ffn_down_exps.weight"].tensor_type.name == want, n


def test_gpt_oss_experts_are_mxfp4(tmp_path):
    path, _, _ = _write(tmp_path, "gpt-oss", "q4_k_m")
    _, tensors = _reader(path)
    for part in ("gate", "up", "down"):
        assert tensors[f"blk.0.ffn_{part}_exps.weight"].tensor_type.name == "MXFP4"
        assert tensors[f"blk.0.ffn_{part}_exps.bias"].tensor_type.name == "F32"


def test_k_quant_blocks_are_routemms_quantiser(tmp_path):
    """The file's Q4_K blocks (routemm.quantize's) decode to the same bits in routemm and gguf."""
    path, _, _ = _write(tmp_path, "qwen3moe", "q4_k_m")
    _, tensors = _reader(path)
    t = tensors["blk.1.ffn_gate_exps.weight"]
    blocks = np.asarray(t.data)
    values = gguf.quants.dequantize(blocks, t.tensor_type)
    assert np.array_equal(routemm.dequantize(blocks, "q4_k"), values.astype(np.float32))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_same_spec_writes_the_same_bytes(tmp_path, arch):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for path in (a, b):
        write_moe_gguf(path, MoeGgufSpec(arch=arch, mix="q4_k_m", seed=3, **SMALL))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(arch="qwen4"), "arch must be one of qwen3moe"),
        (dict(mix="q3_k"), "mix must be one of"),
        (dict(arch="qwen3moe", split_experts=True), "split_experts is for mixtral files only"),
        (dict(arch="deepseek2", experts=6), "6 experts in 4 groups, 2 used, do not fit"),
        (dict(arch="llama4", layers=1), "1 layers of llama4 hold no MoE layer"),
        (dict(top_k=9), "top_k 9 must be in [1, experts 8]"),
        (dict(mix="q4_0", hidden=48), "a gate row of 48 values is not a multiple of 32 for q4_0"),
    ],
)
def test_writer_refuses_what_it_cannot_write(tmp_path, kw, message):
    spec = MoeGgufSpec(**{"layers": 2, **kw})
    with pytest.raises(routemm.InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        write_moe_gguf(tmp_path / "x.gguf", spec)
    assert not (tmp_path / "x.gguf").exists()
