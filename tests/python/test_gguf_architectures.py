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


# ---- MoeLayer.from_gguf against the float64 reference of the file --------------------------------

from gguf_moe_reference import layer_reference, near_tie, read_tensors  # noqa: E402
from tolerances import MOE_EXPERTS_TOLERANCE  # noqa: E402

# What a layer of each architecture needs of MoeLayer beyond a softmax SiLU layer (its arguments),
# as the writer's files have it.
ARCH_NEEDS = {
    "qwen3moe": [],
    "mixtral": [],
    "qwen2moe": ["shared_gate_up", "shared_down", "shared_gate"],
    "deepseek2": [
        "scoring_func", "e_score_correction_bias", "num_expert_group", "topk_group", "routed_scaling_factor",
        "shared_gate_up", "shared_down",
    ],
    "glm4moe": ["scoring_func", "e_score_correction_bias", "shared_gate_up", "shared_down"],
    "gpt-oss": ["router_bias", "gate_bias", "up_bias", "down_bias", "activation"],
    "llama4": ["scoring_func", "weights_before_ffn", "shared_gate_up", "shared_down"],
}  # fmt: skip
# Mixes, with the intermediate size: the single K-quant types with rows of 256 values everywhere.
MIX_SHAPES = {"q4_k_m": 64, "q5_k_m": 64, "q8_0": 64, "q4_k": 256, "q6_k": 256}


def _takes_stack_types() -> bool:
    """Whether the experts take a (gate, up, down) tuple of block types yet."""
    from routemm.ops.moe import _checked_ggml_type

    try:
        _checked_ggml_type(("q4_k", "q4_k", "q6_k"))
    except routemm.InvalidArgumentError:
        return False
    return True


def _missing_arguments_for(arguments) -> list[str]:
    import inspect

    takes = inspect.signature(routemm.MoeLayer.__init__).parameters
    return [a for a in arguments if a not in takes]


def _missing_arguments(arch: str) -> list[str]:
    return _missing_arguments_for(ARCH_NEEDS[arch])


def _expert_types(tensors, layer: int) -> set:
    return {
        t.tensor_type.name
        for name, t in tensors.items()
        if name.startswith(f"blk.{layer}.ffn_") and name.endswith(".weight") and "gate_inp" not in name
    }


@pytest.mark.parametrize("mix", list(MIX_SHAPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_moe_layer_matches_the_float64_reference(tmp_path, device, arch, mix):
    """Each MoE layer of the file either runs and matches the reference computed from the file by
    the gguf package (tokens at a top-k near-tie left out), or is refused with an UnsupportedError
    naming what it needs: mixed expert types, or a MoeLayer argument routemm does not have yet."""
    path, _, spec = _write(tmp_path, arch, mix, intermediate=MIX_SHAPES[mix])
    read = read_tensors(path)
    _, tensors = _reader(path)
    moe = [n for n in range(spec.layers) if spec.is_moe_layer(n)]
    assert routemm.gguf_io.gguf_moe_layers(path) == moe
    hidden = np.random.default_rng(1).standard_normal((6, spec.hidden)).astype(np.float32)
    atol, rtol = MOE_EXPERTS_TOLERANCE
    for n in moe:
        kinds = _expert_types(tensors, n)
        if len(kinds) > 1 and not _takes_stack_types():
            with pytest.raises(routemm.UnsupportedError, match=f"layer {n} mixes expert types"):
                routemm.MoeLayer.from_gguf(path, n, device=device)
            continue
        missing = _missing_arguments(arch)
        if missing:
            with pytest.raises(routemm.UnsupportedError, match="needs MoeLayer's (" + "|".join(missing) + ")"):
                routemm.MoeLayer.from_gguf(path, n, device=device)
            continue
        for kind in kinds:
            pipeline = f"quantized_matmul_id_direct_{kind.lower()}_f32"
            if kind not in ("F32", "F16", "BF16") and not routemm.KernelRegistry(device).has_kernel(pipeline):
                pytest.skip(f"backend {device.backend} has no {pipeline}")
        layer = routemm.MoeLayer.from_gguf(path, n, device=device)
        assert (layer.n_experts, layer.top_k, layer.hidden) == (spec.experts, spec.top_k, spec.hidden)
        out = layer(hidden)
        ref, select, top_k = layer_reference(path, n, hidden, read=read)
        keep = ~near_tie(select, top_k)
        assert keep.sum() >= 4
        np.testing.assert_allclose(out[keep], ref[keep], atol=atol * 10, rtol=rtol * 10)


def test_split_mixtral_experts_load_as_the_stacked_ones(tmp_path, device):
    """2023 Mixtral files' per-expert tensors are stacked at load: the same layer as the stacked file
    of the same weights, bit for bit."""
    split, _, _ = _write(tmp_path, "mixtral", "q8_0", split_experts=True)
    stacked = tmp_path / "stacked.gguf"
    write_moe_gguf(stacked, MoeGgufSpec(arch="mixtral", mix="q8_0", **SMALL))
    a = routemm.MoeLayer.from_gguf(split, 1, device=device)
    b = routemm.MoeLayer.from_gguf(stacked, 1, device=device)
    assert a.ggml_type == b.ggml_type == routemm.GgmlType.Q8_0
    for part in ("gate", "up", "down"):
        assert np.array_equal(getattr(a, part).numpy(), getattr(b, part).numpy()), part
    hidden = np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32)
    assert np.array_equal(a(hidden), b(hidden))


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_gpt_oss_layers_load_the_router_bias_and_match_llama_cpp(tmp_path, device, mix):
    """gpt-oss layers (MXFP4 experts whatever the mix, as the files ship) load
    blk.N.ffn_gate_inp.bias as MoeLayer's router_bias and match llama.cpp's graph computed from the
    file in float64: the bias added to the router's logits, top-k of those, softmax over the k,
    swiglu_oai with the expert biases. The bias moves the routes of some tokens."""
    path, _, spec = _write(tmp_path, "gpt-oss", mix, layers=2)
    read = read_tensors(path)
    if not routemm.KernelRegistry(device).has_kernel("quantized_matmul_id_direct_mxfp4_f32"):
        pytest.skip(f"backend {device.backend} has no MXFP4 expert kernels")
    hidden = np.random.default_rng(3).standard_normal((8, spec.hidden)).astype(np.float32)
    atol, rtol = MOE_EXPERTS_TOLERANCE
    for n in range(spec.layers):
        layer = routemm.MoeLayer.from_gguf(path, n, device=device)
        assert layer.ggml_type == routemm.GgmlType.MXFP4 and layer.ffn.activation == "swiglu_oai"
        bias = read[1][f"blk.{n}.ffn_gate_inp.bias"]
        assert np.array_equal(layer.router_bias.numpy(), bias.astype(np.float32))
        ref, select, top_k = layer_reference(path, n, hidden, read=read)
        keep = ~near_tie(select, top_k)
        assert keep.sum() >= 6
        _, ids, _ = layer.reference(hidden)
        np.testing.assert_array_equal(ids[keep], np.argsort(-select, axis=1, kind="stable")[keep, :top_k])
        np.testing.assert_allclose(layer(hidden)[keep], ref[keep], atol=atol * 10, rtol=rtol * 10)
        unbiased = np.argsort(-(select - bias), axis=1, kind="stable")[:, :top_k]
        assert not np.array_equal(np.sort(ids, axis=1), np.sort(unbiased, axis=1))


# ---- refusals, by name ---------------------------------------------------------------------------


def _rewrite(src, dst, *, keys=None, drop=(), rename=None):
    """A copy of the GGUF file `src` at `dst` with metadata `keys` ({key: (value, GGUFValueType)})
    set, the tensors or keys in `drop` left out and tensors renamed by `rename`."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in (keys or {}):
            continue
        writer.add_key_value(key, field.contents(), field.types[0])
    for key, (value, vtype) in (keys or {}).items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        writer.add_tensor((rename or {}).get(t.name, t.name), np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


V = gguf.GGUFValueType


def test_dense_layers_are_refused_as_such(tmp_path, device):
    for arch, layer in (("deepseek2", 0), ("glm4moe", 0), ("llama4", 2)):
        path, _, _ = _write(tmp_path, arch)
        with pytest.raises(
            routemm.InvalidArgumentError, match=f"has no router blk.{layer}.ffn_gate_inp.weight: a dense FFN layer"
        ):
            routemm.MoeLayer.from_gguf(path, layer, device=device)


@pytest.mark.parametrize(
    "arch,change,error,message",
    [
        ("deepseek2", dict(keys={"deepseek2.expert_gating_func": (3, V.UINT32)}), routemm.UnsupportedError,
         r"deepseek2.expert_gating_func 3 \(softmax_weight\) is not 1 \(softmax\) or 2 \(sigmoid\)"),
        ("deepseek2", dict(keys={"deepseek2.expert_gating_func": (7, V.UINT32)}), routemm.InvalidArgumentError,
         "deepseek2.expert_gating_func must be one of llama.cpp's gating functions 0-4, got 7"),
        ("llama4", dict(keys={"llama4.expert_gating_func": (1, V.UINT32)}), routemm.InvalidArgumentError,
         "llama4.expert_gating_func 1 contradicts llama4's sigmoid gate"),
        ("deepseek2", dict(keys={"deepseek2.expert_group_count": (3, V.UINT32)}), routemm.InvalidArgumentError,
         "deepseek2.expert_group_count 3 and deepseek2.expert_group_used_count 2 do not fit deepseek2.expert_count 8"),
        ("deepseek2", dict(drop=("deepseek2.expert_group_used_count",)), routemm.InvalidArgumentError,
         "deepseek2.expert_group_count 4 without deepseek2.expert_group_used_count"),
        ("deepseek2", dict(keys={"deepseek2.expert_weights_scale": ("2.5", V.STRING)}), routemm.InvalidArgumentError,
         "deepseek2.expert_weights_scale must be a finite number, got '2.5'"),
        ("glm4moe", dict(keys={"glm4moe.expert_weights_norm": (1, V.UINT32)}), routemm.InvalidArgumentError,
         "glm4moe.expert_weights_norm must be a bool, got 1"),
        ("qwen3moe", dict(keys={"qwen3moe.swiglu_clamp_exp": (7.0, V.FLOAT32)}), routemm.UnsupportedError,
         "qwen3moe.swiglu_clamp_exp .clamped SwiGLU experts. is not computed"),
        ("qwen3moe", dict(rename={"blk.1.ffn_gate_exps.weight": "blk.1.ffn_gate_up_exps.weight"}),
         routemm.UnsupportedError, "blk.1.ffn_gate_up_exps.weight .a merged gate/up stack. is not loaded"),
        ("qwen3moe", dict(drop=("blk.1.ffn_down_exps.weight",)), routemm.InvalidArgumentError,
         r"layer 1 has no blk.1.ffn_down_exps.weight \(nor per-expert blk.1.ffn_down.E.weight\)"),
        ("qwen2moe", dict(drop=("blk.1.ffn_up_shexp.weight",)), routemm.InvalidArgumentError,
         "layer 1 has blk.1.ffn_gate_shexp.weight but no blk.1.ffn_up_shexp.weight"),
    ],
)  # fmt: skip
def test_what_from_gguf_cannot_compute_is_refused_by_name(tmp_path, device, arch, change, error, message):
    src, _, _ = _write(tmp_path, arch)
    path = _rewrite(src, tmp_path / "changed.gguf", **change)
    with pytest.raises(error, match=message):
        routemm.MoeLayer.from_gguf(path, 1, device=device)


def test_a_split_mixtral_file_missing_an_expert_names_it(tmp_path, device):
    src, _, _ = _write(tmp_path, "mixtral", split_experts=True)
    path = _rewrite(src, tmp_path / "changed.gguf", drop=("blk.1.ffn_up.5.weight",))
    with pytest.raises(
        routemm.InvalidArgumentError, match=r"layer 1 has no blk.1.ffn_up.5.weight \(llama.expert_count 8\)"
    ):
        routemm.MoeLayer.from_gguf(path, 1, device=device)


def test_selection_bias_must_be_f32(tmp_path, device):
    src, _, _ = _write(tmp_path, "deepseek2")
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), arch="deepseek2")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.exp_probs_b.bias":
            writer.add_tensor(t.name, data.astype(np.float16))
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(routemm.InvalidArgumentError, match="blk.1.exp_probs_b.bias must be f32, got f16"):
        routemm.MoeLayer.from_gguf(tmp_path / "f16.gguf", 1, device=device)


# ---- python -m routemm demo --gguf: every MoE layer ----------------------------------------------


def test_demo_runs_every_moe_layer_with_a_progress_bar(tmp_path, capsys):
    import json

    from routemm.cli.main import main

    path, _, _ = _write(tmp_path, "qwen3moe", "q8_0", layers=3)
    assert main(["demo", "--gguf", str(path), "--tokens", "4", "--backend", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "3 MoE layers on cpu" in captured.out
    for n in range(3):
        assert f"layer {n} (E=8, top_k=2, H=256, I=64, q8_0 experts" in captured.out
    assert captured.out.strip().endswith("OK")
    assert "[##############################] 3/3" in captured.err and "[" not in captured.out
    assert main(["demo", "--gguf", str(path), "--tokens", "4", "--backend", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [entry["layer"] for entry in report["layers"]] == [0, 1, 2] and report["ok"]
    assert all(len(entry["runs"]) == 2 for entry in report["layers"])


def test_demo_skips_dense_layers_and_reports_refused_ones(tmp_path, capsys):
    from routemm.cli.main import main

    path, _, _ = _write(tmp_path, "llama4", "q8_0")  # MoE layers 1 and 3
    rc = main(["demo", "--gguf", str(path), "--tokens", "4", "--backend", "cpu"])
    out = capsys.readouterr().out
    assert "2 MoE layers on cpu" in out and "layer 0 " not in out and "layer 2 " not in out
    if _missing_arguments("llama4"):
        assert rc == 1 and out.count("refused: MoeLayer.from_gguf") == 2
        assert out.strip().endswith("FAILED: layers 1, 3 were refused or differ from the float64 reference")
    else:
        assert rc == 0 and out.strip().endswith("OK")


def test_real_shapes_with_few_layers_keep_a_moe_layer():
    import argparse

    from routemm.cli import gguf_sample

    parser = argparse.ArgumentParser()
    gguf_sample.add_arguments(parser)
    args = parser.parse_args(["x.gguf", "--arch", "deepseek2", "--shape", "real", "--layers", "2"])
    spec = gguf_sample._spec(args, parser)
    assert (spec.hidden, spec.intermediate, spec.experts, spec.top_k, spec.groups) == (7168, 2048, 256, 8, 8)
    assert spec.leading_dense == 1 and [n for n in range(2) if spec.is_moe_layer(n)] == [1]


def test_expert_groups_apply_to_every_architecture(tmp_path, device):
    """llama.cpp reads expert_group_count / expert_group_used_count for any architecture: a qwen3moe
    file with groups routes within the best groups (the test's tokens route otherwise without them)."""
    src, _, _ = _write(tmp_path, "qwen3moe", "q8_0")
    keys = {"qwen3moe.expert_group_count": (4, V.UINT32), "qwen3moe.expert_group_used_count": (1, V.UINT32)}
    path = _rewrite(src, tmp_path / "groups.gguf", keys=keys)
    hidden = np.random.default_rng(4).standard_normal((16, 256)).astype(np.float32)
    ref, select, top_k = layer_reference(path, 1, hidden)
    plain, plain_select, _ = layer_reference(src, 1, hidden)
    chosen = np.sort(np.argsort(-select, axis=1, kind="stable")[:, :top_k], axis=1)
    assert not np.array_equal(chosen, np.sort(np.argsort(-plain_select, axis=1, kind="stable")[:, :top_k], axis=1))
    if _missing_arguments_for(["num_expert_group", "topk_group"]):
        with pytest.raises(routemm.UnsupportedError, match="qwen3moe.expert_group_count 4 needs MoeLayer's"):
            routemm.MoeLayer.from_gguf(path, 1, device=device)
        return
    layer = routemm.MoeLayer.from_gguf(path, 1, device=device)
    keep = ~near_tie(select, top_k)
    atol, rtol = MOE_EXPERTS_TOLERANCE
    np.testing.assert_allclose(layer(hidden)[keep], ref[keep], atol=atol * 10, rtol=rtol * 10)
