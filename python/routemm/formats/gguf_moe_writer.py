"""Synthetic MoE GGUF files of every architecture routemm loads, laid out as llama.cpp's conversions
and its quantiser lay them out (tensor names and metadata keys of llama.cpp's src/llama-arch.cpp),
with seeded random weights: what `python -m routemm gguf-sample` writes and what the tests and
benchmarks load.

Architectures (`arch`, the name the file records in brackets):

- qwen3moe: router `blk.N.ffn_gate_inp.weight` [E, H] and the stacks `blk.N.ffn_{gate,up}_exps.weight`
  [E, I, H] / `blk.N.ffn_down_exps.weight` [E, H, I] in every layer.
- qwen2moe: those, plus a shared expert `blk.N.ffn_{gate,up}_shexp.weight` [I_s, H],
  `blk.N.ffn_down_shexp.weight` [H, I_s] and its sigmoid gate `blk.N.ffn_gate_inp_shexp.weight` [H]
  (`qwen2moe.expert_shared_feed_forward_length` = I_s).
- mixtral ("llama"): the stacks, or with `split_experts` the per-expert 2-D tensors
  `blk.N.ffn_{gate,up,down}.E.weight` that 2023 conversions wrote.
- deepseek2: `deepseek2.leading_dense_block_count` dense layers first (`blk.N.ffn_{gate,up,down}.weight`,
  width `feed_forward_length`), then MoE layers with the selection bias `blk.N.exp_probs_b.bias` [E],
  shared experts (`expert_shared_count` x I wide) and the keys `expert_gating_func` (2: sigmoid),
  `expert_group_count`, `expert_group_used_count`, `expert_weights_norm`, `expert_weights_scale`.
- glm4moe: as deepseek2 without expert groups.
- gpt-oss ("gpt-oss"): MXFP4 expert stacks (whatever the mix, as the files ship) with biases
  `blk.N.ffn_{gate,up}_exps.bias` [E, I], `blk.N.ffn_down_exps.bias` [E, H] and a router bias
  `blk.N.ffn_gate_inp.bias` [E] (llama.cpp: softmax over the selected logits, swiglu_oai).
- llama4: `llama4.interleave_moe_layer_step` S, so layers N with (N + 1) % S == 0 are MoE (top-1,
  sigmoid weight applied before the FFN, a shared expert `ffn_*_shexp`) and the others dense.

Type mixes (`mix`): one type for every quantised weight (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1,
q8_0, q4_k, q5_k, q6_k, mxfp4), or llama.cpp's q4_k_m / q5_k_m: gate and up Q4_K (Q5_K), down
Q6_K in the layers llama.cpp's use_more_bits picks (the first and last eighth, every third
between) and Q4_K (Q5_K) elsewhere. A row length that is not a multiple of 256 takes llama.cpp's
fallback (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Routers, biases, the shared gate and 1-D
tensors stay F32, as llama.cpp's quantiser keeps them. Quantisation is routemm.quantize (byte-
identical to ggml's reference quantisers). Needs the `gguf` package.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..core._errors import InvalidArgumentError, MissingDependencyError
from .ggml import FORMATS
from .ggml import quantize as _quantize

# arch -> the architecture name the file records.
ARCHITECTURES = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "mixtral": "llama",
    "deepseek2": "deepseek2",
    "glm4moe": "glm4moe",
    "gpt-oss": "gpt-oss",
    "llama4": "llama4",
}
SINGLE_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")
TYPE_MIXES = (*SINGLE_TYPES, "q4_k_m", "q5_k_m")
FLOAT_TYPES = ("f32", "f16", "bf16")
# llama.cpp's fallback for a 256-value type on a row that is not a multiple of 256.
K_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}

# Per-architecture defaults of the routing metadata (small files; `real_shape` gives real sizes).
_ARCH_DEFAULTS = {
    "deepseek2": {"leading_dense": 1, "shared_count": 1, "groups": 4, "group_used": 2, "weights_scale": 2.5},
    "glm4moe": {"leading_dense": 1, "shared_count": 1, "weights_scale": 1.0},
    "llama4": {"top_k": 1, "interleave": 2},
}

# Real layer shapes (H, I, E, top-k, layers and the architecture's extras), for benchmarks: write
# one or two layers of them with `layers=`.
REAL_SHAPES = {
    "qwen3moe": dict(hidden=2048, intermediate=768, experts=128, top_k=8, layers=48),  # Qwen3-30B-A3B
    "qwen2moe": dict(hidden=2048, intermediate=1408, experts=60, top_k=4, layers=24, shared_intermediate=5632),
    "mixtral": dict(hidden=4096, intermediate=14336, experts=8, top_k=2, layers=32),  # Mixtral-8x7B
    "deepseek2": dict(
        hidden=7168, intermediate=2048, experts=256, top_k=8, layers=61, leading_dense=3, dense_intermediate=18432,
        groups=8, group_used=4, weights_scale=2.5,
    ),  # DeepSeek-V3
    "glm4moe": dict(
        hidden=4096, intermediate=1408, experts=128, top_k=8, layers=46, leading_dense=1, dense_intermediate=10944
    ),  # GLM-4.5-Air
    "gpt-oss": dict(hidden=2880, intermediate=2880, experts=32, top_k=4, layers=24),  # gpt-oss-20b
    "llama4": dict(
        hidden=5120, intermediate=8192, experts=128, top_k=1, layers=48, interleave=2, dense_intermediate=16384
    ),  # Llama-4-Maverick
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MoeGgufSpec:
    """What write_moe_gguf writes. None fields take the architecture's default: shared_intermediate
    I (qwen2moe, llama4) or I per shared expert (deepseek2, glm4moe); dense_intermediate 2 I;
    leading_dense, shared_count, groups / group_used, weights_scale and interleave as _ARCH_DEFAULTS
    (deepseek2: 1 dense layer, 1 shared expert, 4 groups of which 2 are used, scale 2.5; glm4moe:
    1 dense layer, 1 shared expert, scale 1; llama4: top-1, every second layer MoE)."""

    arch: str = "qwen3moe"
    mix: str = "q4_0"
    layers: int = 2
    experts: int = 8
    top_k: Optional[int] = None  # 2, llama4 1
    hidden: int = 64
    intermediate: int = 32
    shared_intermediate: Optional[int] = None
    dense_intermediate: Optional[int] = None
    shared_count: Optional[int] = None
    leading_dense: Optional[int] = None
    groups: Optional[int] = None
    group_used: Optional[int] = None
    weights_scale: Optional[float] = None
    weights_norm: bool = True  # deepseek2 / glm4moe's expert_weights_norm
    interleave: Optional[int] = None
    split_experts: bool = False  # mixtral only: per-expert 2-D tensors
    seed: int = 0

    def resolved(self) -> "MoeGgufSpec":
        """This spec with the architecture's defaults filled in, checked."""
        if self.arch not in ARCHITECTURES:
            raise InvalidArgumentError(
                f"gguf writer: arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}"
            )
        if self.mix not in TYPE_MIXES:
            raise InvalidArgumentError(f"gguf writer: mix must be one of {', '.join(TYPE_MIXES)}, got {self.mix!r}")
        defaults = {"top_k": 2, **_ARCH_DEFAULTS.get(self.arch, {})}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in defaults.items():
            if values[key] is None:
                values[key] = value
        if values["shared_intermediate"] is None:
            values["shared_intermediate"] = self.intermediate
        if values["dense_intermediate"] is None:
            values["dense_intermediate"] = 2 * self.intermediate
        spec = MoeGgufSpec(**values)
        if spec.split_experts and spec.arch != "mixtral":
            raise InvalidArgumentError("gguf writer: split_experts is for mixtral files only")
        if not 1 <= spec.top_k <= spec.experts:
            raise InvalidArgumentError(f"gguf writer: top_k {spec.top_k} must be in [1, experts {spec.experts}]")
        if spec.groups is not None and (spec.experts % spec.groups or not 1 <= spec.group_used <= spec.groups):
            raise InvalidArgumentError(
                f"gguf writer: {spec.experts} experts in {spec.groups} groups, {spec.group_used} used, do not fit"
            )
        if spec.groups is not None and spec.top_k > spec.group_used * (spec.experts // spec.groups):
            raise InvalidArgumentError(f"gguf writer: top_k {spec.top_k} is more than the used groups hold")
        if not any(spec.is_moe_layer(n) for n in range(spec.layers)):
            raise InvalidArgumentError(f"gguf writer: {spec.layers} layers of {spec.arch} hold no MoE layer")
        return spec

    def is_moe_layer(self, layer: int) -> bool:
        if self.leading_dense is not None and layer < self.leading_dense:
            return False
        if self.interleave is not None and (layer + 1) % self.interleave != 0:
            return False
        return True


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the ffn_down layers that get Q6_K in a Q4_K_M / Q5_K_M file."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(mix: str, part: str, layer: int, n_layers: int, row: int) -> str:
    """The type of a weight with rows of `row` values: `part` is "gate", "up" or "down"."""
    if mix == "q4_k_m" or mix == "q5_k_m":
        base = "q4_k" if mix == "q4_k_m" else "q5_k"
        kind = "q6_k" if part == "down" and use_more_bits(layer, n_layers) else base
    else:
        kind = mix
    if kind in K_FALLBACK and row % 256:
        kind = K_FALLBACK[kind]
    if kind not in FLOAT_TYPES and row % FORMATS[kind].block_values:
        raise InvalidArgumentError(
            f"gguf writer: a {part} row of {row} values is not a multiple of {FORMATS[kind].block_values} for {kind}"
        )
    return kind


def write_moe_gguf(path, spec: MoeGgufSpec) -> dict[str, str]:
    """Writes the file; returns {tensor name: type name} of what it wrote."""
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError("the GGUF writer needs the gguf package: python -m pip install gguf") from None
    s = spec.resolved()
    rng = np.random.default_rng(s.seed)
    writer = gguf.GGUFWriter(str(path), arch=ARCHITECTURES[s.arch])
    _write_metadata(writer, gguf, s)
    written: dict[str, str] = {}

    def add(name: str, array: np.ndarray, kind: str = "f32") -> None:
        data, raw = _encode(gguf, array, kind)
        writer.add_tensor(name, data, raw_dtype=raw)
        written[name] = kind

    def weight(shape, fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def ffn(prefix: str, suffix: str, width: int, layer: int, experts: Optional[int] = None) -> None:
        lead = () if experts is None else (experts,)
        for part, shape, fan_in in (
            ("gate", (*lead, width, s.hidden), s.hidden),
            ("up", (*lead, width, s.hidden), s.hidden),
            ("down", (*lead, s.hidden, width), width),
        ):
            kind = "mxfp4" if s.arch == "gpt-oss" and experts else tensor_type(s.mix, part, layer, s.layers, shape[-1])
            w = weight(shape, fan_in)
            if s.split_experts and experts:  # the same weights as the stacked file, one tensor per expert
                for e in range(experts):
                    add(f"{prefix}.ffn_{part}.{e}.weight", w[e], kind)
            else:
                add(f"{prefix}.ffn_{part}{suffix}.weight", w, kind)

    for n in range(s.layers):
        blk = f"blk.{n}"
        if not s.is_moe_layer(n):
            ffn(blk, "", s.dense_intermediate, n)
            continue
        add(f"{blk}.ffn_gate_inp.weight", weight((s.experts, s.hidden), s.hidden))
        if s.arch == "gpt-oss":
            add(f"{blk}.ffn_gate_inp.bias", 0.5 * weight((s.experts,), 1))
        if s.arch in ("deepseek2", "glm4moe"):
            add(f"{blk}.exp_probs_b.bias", 0.1 * weight((s.experts,), 1))
        ffn(blk, "_exps", s.intermediate, n, s.experts)
        if s.arch == "gpt-oss":
            for part, width in (("gate", s.intermediate), ("up", s.intermediate), ("down", s.hidden)):
                add(f"{blk}.ffn_{part}_exps.bias", 0.1 * weight((s.experts, width), 1))
        if s.arch in ("qwen2moe", "llama4"):
            ffn(blk, "_shexp", s.shared_intermediate, n)
        elif s.arch in ("deepseek2", "glm4moe"):
            ffn(blk, "_shexp", s.shared_intermediate * s.shared_count, n)
        if s.arch == "qwen2moe":
            add(f"{blk}.ffn_gate_inp_shexp.weight", weight((s.hidden,), s.hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _write_metadata(writer, gguf, s: MoeGgufSpec) -> None:
    writer.add_string("general.name", f"routemm synthetic {s.arch} {s.mix}")
    writer.add_block_count(s.layers)
    writer.add_embedding_length(s.hidden)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.top_k)
    writer.add_expert_feed_forward_length(s.intermediate)
    if s.leading_dense is not None or s.interleave is not None:
        writer.add_feed_forward_length(s.dense_intermediate)
    if s.arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(s.shared_intermediate)
    if s.arch in ("deepseek2", "glm4moe"):
        writer.add_leading_dense_block_count(s.leading_dense)
        writer.add_expert_shared_count(s.shared_count)
        writer.add_expert_weights_scale(float(s.weights_scale))
        writer.add_expert_weights_norm(s.weights_norm)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if s.groups is not None:
        writer.add_expert_group_count(s.groups)
        writer.add_expert_group_used_count(s.group_used)
    if s.interleave is not None:
        writer.add_interleave_moe_layer_step(s.interleave)


def _encode(gguf, w: np.ndarray, kind: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor: floats as themselves, bf16 as its bits, blocks
    quantised by routemm.quantize."""
    if kind == "f32":
        return w, None
    if kind == "f16":
        return w.astype(np.float16), None
    if kind == "bf16":
        import ml_dtypes

        return w.astype(ml_dtypes.bfloat16).view(np.uint16), gguf.GGMLQuantizationType.BF16
    return _quantize(w, kind), gguf.GGMLQuantizationType[kind.upper()]
