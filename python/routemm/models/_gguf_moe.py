"""What one MoE layer of a GGUF file asks of MoeLayer, read from the file's header alone: the
tensors (llama.cpp's names) and the routing and FFN options of its architecture, as llama.cpp's
build_moe_ffn computes them (src/llama-graph.cpp and src/models/<arch>.cpp).

| arch | gate | renormalise | extras |
|---|---|---|---|
| qwen3moe, llama (Mixtral) | softmax | yes | Mixtral's experts stacked or per expert (`blk.N.ffn_gate.E.weight`) |
| qwen2moe | softmax | no | shared expert with a sigmoid gate `ffn_gate_inp_shexp` |
| deepseek2 | `expert_gating_func` (1 softmax, default; 2 sigmoid) | `expert_weights_norm` (default no) | `exp_probs_b` selection bias, `expert_group_count` / `expert_group_used_count`, `expert_weights_scale`, shared experts, `leading_dense_block_count` dense layers |
| glm4moe | `expert_gating_func` (default sigmoid) | `expert_weights_norm` (default no) | as deepseek2 |
| gpt-oss | softmax over the selected logits (= softmax, renormalised) | yes | router bias, expert biases, swiglu_oai (alpha 1.702, limit 7) |
| llama4 | sigmoid of the selected logits | no | top-1 weight applied before the FFN, shared expert, `interleave_moe_layer_step` dense layers |

`<arch>.expert_weights_norm`, where a file has it, decides renormalisation for every architecture,
and `<arch>.expert_group_count` / `expert_group_used_count` the expert groups (llama.cpp reads both
for any architecture); `<arch>.expert_gating_func` must be 1 or 2 where present. Keys that change the computation in a
way routemm does not implement (`<arch>.swiglu_clamp_exp`, a merged `ffn_gate_up_exps` stack, other
gating functions) are refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..core._errors import InvalidArgumentError, UnsupportedError

# Whether an architecture's router renormalises its top-k weights, where the file does not say
# (`<arch>.expert_weights_norm`).
RENORMALIZE_BY_ARCH = {
    "qwen3moe": True,
    "llama": True,
    "mixtral": True,
    "qwen2moe": False,
    "deepseek2": False,
    "glm4moe": False,
    "gpt-oss": True,
    "llama4": False,
}
ARCHITECTURES = tuple(a for a in RENORMALIZE_BY_ARCH if a != "mixtral")
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's llama_expert_gating_func_type values
_LLAMA_GATING_FUNCS = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
_DEFAULT_GATING = {"glm4moe": 2, "llama4": 2}  # others: 1 (softmax)
_FIXED_GATING = {"llama4": 2, "gpt-oss": 1}  # llama.cpp does not read the key for these
_SHARED_ARCHS = {"qwen2moe", "deepseek2", "glm4moe", "llama4"}
_ROUTING_KEYS_OF = {"deepseek2", "glm4moe"}  # read exp_probs_b and the weight scale


@dataclasses.dataclass
class LayerPlan:
    """One MoE layer: tensor names by role, their GGML types, and MoeLayer's arguments."""

    arch: str
    layer: int
    n_experts: int
    top_k: int
    renormalize: bool
    router: str
    experts: dict  # part -> [names]: one stack, or one 2-D tensor per expert
    types: dict  # tensor name -> type name
    scoring_func: str = "softmax"
    e_score_correction_bias: Optional[str] = None
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    router_bias: Optional[str] = None
    expert_biases: dict = dataclasses.field(default_factory=dict)  # part -> name
    activation: str = "silu"
    weights_before_ffn: bool = False
    shared: dict = dataclasses.field(default_factory=dict)  # part -> name
    shared_gate: Optional[str] = None

    @property
    def split(self) -> bool:
        return len(self.experts["gate"]) > 1

    def needs(self) -> list[tuple[str, str]]:
        """(MoeLayer argument, what in the file asks for it) for every option beyond a plain
        softmax SiLU layer."""
        where = f"{self.arch} layer {self.layer}"
        out = []
        if self.scoring_func != "softmax":
            out.append(("scoring_func", f"{where}'s {self.scoring_func} gate"))
        if self.e_score_correction_bias:
            out.append(("e_score_correction_bias", self.e_score_correction_bias))
        if self.num_expert_group is not None:
            out.append(("num_expert_group", f"{self.arch}.expert_group_count {self.num_expert_group}"))
            out.append(("topk_group", f"{self.arch}.expert_group_used_count {self.topk_group}"))
        if self.routed_scaling_factor != 1.0:
            out.append(("routed_scaling_factor", f"{self.arch}.expert_weights_scale {self.routed_scaling_factor}"))
        if self.router_bias:
            out.append(("router_bias", self.router_bias))
        for part, name in self.expert_biases.items():
            out.append((f"{part}_bias", name))
        if self.activation != "silu":
            out.append(("activation", f"{where}'s {self.activation} activation"))
        if self.weights_before_ffn:
            out.append(("weights_before_ffn", f"{where}'s routing weight before the FFN"))
        if self.shared:
            out.append(("shared_gate_up", self.shared["gate"]))
            out.append(("shared_down", self.shared["down"]))
        if self.shared_gate:
            out.append(("shared_gate", self.shared_gate))
        return out


def _int(meta: dict, key: str, where: str, *, minimum: int) -> int:
    """meta[key], which must be a GGUF integer (not a bool, float, string or array) >= minimum."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(meta: dict, key: str, where: str) -> float:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{where}: {key} must be a finite number, got {value!r}")
    return float(value)


def _bool(meta: dict, key: str, where: str) -> bool:
    value = meta[key]
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{where}: {key} must be a bool, got {value!r}")
    return value


def plan_layer(meta: dict, tensors: dict, layer, path: str) -> LayerPlan:
    """The plan of layer `layer` from the metadata and the {tensor name: (type name, shape)} index;
    InvalidArgumentError naming the key or tensor for a file that is not what its architecture
    says, UnsupportedError for what routemm does not compute."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise InvalidArgumentError(f"MoeLayer.from_gguf: {path} has no general.architecture")
    if not isinstance(arch, str):
        raise InvalidArgumentError(f"MoeLayer.from_gguf: {path}: general.architecture must be a string, got {arch!r}")
    where = f"MoeLayer.from_gguf: {path} ({arch})"
    count_key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
    for key in (count_key, used_key):
        if key not in meta:
            raise InvalidArgumentError(f"{where} has no {key}: not a mixture-of-experts model")
    n_experts = _int(meta, count_key, where, minimum=1)
    from ..ops.moe import _check_top_k

    top_k = _check_top_k(meta[used_key], n_experts, f"{where}: {used_key}", count_key)
    gating_key = f"{arch}.expert_gating_func"
    gating = _DEFAULT_GATING.get(arch, 1)
    if gating_key in meta:
        gating = meta[gating_key]
        if isinstance(gating, bool) or not isinstance(gating, int) or gating not in _LLAMA_GATING_FUNCS:
            raise InvalidArgumentError(
                f"{where}: {gating_key} must be one of llama.cpp's gating functions 0-4, got {gating!r}"
            )
        if gating == 0:  # llama.cpp: none given, the architecture's default
            gating = _DEFAULT_GATING.get(arch, 1)
        if gating not in GATING_FUNCS:
            raise UnsupportedError(
                f"{where}: {gating_key} {gating} ({_LLAMA_GATING_FUNCS[gating]}) is not 1 (softmax) or 2 (sigmoid), "
                "the gates routemm has"
            )
        if arch in _FIXED_GATING and gating != _FIXED_GATING[arch]:
            raise InvalidArgumentError(
                f"{where}: {gating_key} {gating} contradicts {arch}'s {GATING_FUNCS[_FIXED_GATING[arch]]} gate"
            )
    gating = _FIXED_GATING.get(arch, gating)
    norm_key = f"{arch}.expert_weights_norm"
    if norm_key in meta:
        renormalize = _bool(meta, norm_key, where)
    elif arch in RENORMALIZE_BY_ARCH:
        renormalize = RENORMALIZE_BY_ARCH[arch]
    else:
        raise InvalidArgumentError(
            f"{where}: the file does not say whether the top-k weights are renormalised "
            f"({norm_key}) and {arch} is not in RENORMALIZE_BY_ARCH"
        )
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise InvalidArgumentError(f"{where}: layer must be a non-negative integer, got {layer!r}")
    blocks_key = f"{arch}.block_count"
    if blocks_key in meta:
        n_blocks = _int(meta, blocks_key, where, minimum=0)
        if layer >= n_blocks:
            raise InvalidArgumentError(f"{where}: layer {layer} is out of range ({blocks_key} {n_blocks})")
    clamp_key = f"{arch}.swiglu_clamp_exp"
    if clamp_key in meta:
        raise UnsupportedError(f"{where}: {clamp_key} (clamped SwiGLU experts) is not computed by routemm")
    blk = f"blk.{layer}"
    router = f"{blk}.ffn_gate_inp.weight"
    if router not in tensors:
        dense = any(f"{blk}.ffn_{p}.weight" in tensors for p in ("gate", "up", "down"))
        raise InvalidArgumentError(
            f"{where}: layer {layer} has no router {router}: "
            + ("a dense FFN layer, not a MoE layer" if dense else "not a MoE layer")
        )
    if f"{blk}.ffn_gate_up_exps.weight" in tensors:
        raise UnsupportedError(f"{where}: {blk}.ffn_gate_up_exps.weight (a merged gate/up stack) is not loaded yet")
    experts = {}
    for part in ("gate", "up", "down"):
        stacked = f"{blk}.ffn_{part}_exps.weight"
        if stacked in tensors:
            experts[part] = [stacked]
            continue
        split = [f"{blk}.ffn_{part}.{e}.weight" for e in range(n_experts)]
        missing = [name for name in split if name not in tensors]
        if len(missing) == n_experts:
            raise InvalidArgumentError(
                f"{where}: layer {layer} has no {stacked} (nor per-expert {blk}.ffn_{part}.E.weight)"
            )
        if missing:
            raise InvalidArgumentError(f"{where}: layer {layer} has no {missing[0]} ({count_key} {n_experts})")
        experts[part] = split
    if len({len(names) for names in experts.values()}) != 1:
        raise InvalidArgumentError(f"{where}: layer {layer} stacks some expert tensors and splits others")
    plan = LayerPlan(
        arch=arch, layer=layer, n_experts=n_experts, top_k=top_k, renormalize=renormalize, router=router,
        experts=experts, types={}, scoring_func=GATING_FUNCS[gating],
    )  # fmt: skip
    # Expert groups: llama.cpp reads them for every architecture.
    groups_key, used_groups_key = f"{arch}.expert_group_count", f"{arch}.expert_group_used_count"
    groups = _int(meta, groups_key, where, minimum=1) if groups_key in meta else 1
    if groups > 1:
        if used_groups_key not in meta:
            raise InvalidArgumentError(f"{where}: {groups_key} {groups} without {used_groups_key}")
        used = _int(meta, used_groups_key, where, minimum=1)
        if n_experts % groups or used > groups:
            raise InvalidArgumentError(
                f"{where}: {groups_key} {groups} and {used_groups_key} {used} do not fit {count_key} {n_experts}"
            )
        plan.num_expert_group, plan.topk_group = groups, used
    if arch in _ROUTING_KEYS_OF:
        bias = f"{blk}.exp_probs_b.bias"
        plan.e_score_correction_bias = bias if bias in tensors else None
        scale_key = f"{arch}.expert_weights_scale"
        if scale_key in meta:
            scale = _float(meta, scale_key, where)
            plan.routed_scaling_factor = 1.0 if scale == 0.0 else scale  # llama.cpp: 0 means none
    if arch == "gpt-oss":
        plan.activation = "swiglu_oai"
        bias = f"{blk}.ffn_gate_inp.bias"
        plan.router_bias = bias if bias in tensors else None
    for part in ("gate", "up", "down"):
        bias = f"{blk}.ffn_{part}_exps.bias"
        if bias in tensors:
            plan.expert_biases[part] = bias
    if arch == "llama4":
        plan.weights_before_ffn = True
    if arch in _SHARED_ARCHS:
        shared = {part: f"{blk}.ffn_{part}_shexp.weight" for part in ("gate", "up", "down")}
        present = [name for name in shared.values() if name in tensors]
        if present and len(present) != 3:
            missing = next(name for name in shared.values() if name not in tensors)
            raise InvalidArgumentError(f"{where}: layer {layer} has {present[0]} but no {missing}")
        if present:
            plan.shared = shared
        gate = f"{blk}.ffn_gate_inp_shexp.weight"
        if gate in tensors:
            if not present:
                raise InvalidArgumentError(f"{where}: layer {layer} has {gate} but no shared expert")
            plan.shared_gate = gate
    names = [router, *(n for names in experts.values() for n in names), *plan.expert_biases.values()]
    names += [n for n in (plan.e_score_correction_bias, plan.router_bias, plan.shared_gate) if n]
    names += list(plan.shared.values())
    plan.types = {name: tensors[name][0] for name in names}
    weights = {router, *(n for names in experts.values() for n in names), *plan.shared.values()}
    for name in names:
        if name not in weights and plan.types[name] != "f32":  # biases and the shared gate
            raise InvalidArgumentError(f"{where}: {name} must be f32, got {plan.types[name]}")
    return plan
