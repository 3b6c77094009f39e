"""One MoE layer of a GGUF model: router, gate and experts on routemm, loaded without copying.

    layer = routemm.MoeLayer.from_gguf("Qwen3-30B-A3B-Q4_0.gguf", layer=0)
    out = layer(hidden)                  # float32 [m, H] -> float32 [m, H]

A GGUF conversion of a MoE model (llama.cpp's tensor names) stores layer N's router as
`blk.N.ffn_gate_inp.weight` [E, H] and its experts as 3-D stacks `blk.N.ffn_{gate,up}_exps.weight`
[E, I, H] and `blk.N.ffn_down_exps.weight` [E, H, I]; the metadata gives `<arch>.expert_count` and
`<arch>.expert_used_count` (top-k). On the CPU backend every tensor is a read-only view of the
file's memory map (zero copy).

A call is one encoder submission: router logits (the router as a one-expert expert-ID matmul),
moe_gate, then moe_experts' matmuls, SiLU*up and the ordered combine; nothing returns to the host in
between. The gate renormalises the top-k weights when `<arch>.expert_weights_norm` says so, and
otherwise as the architecture does (RENORMALIZE_BY_ARCH).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from . import _core
from ._core_api import DType
from ._errors import InvalidArgumentError
from ._reference import dense_matmul_id_reference, moe_experts_reference, moe_gate_reference
from .dense_matmul_id import (
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    _default_device,
    _registry_for,
    dense_matmul_id,
)
from .gguf_io import _gguf_header, _gguf_tensors
from .moe import _checked_route, _encode_experts, _ExpertShapes
from .quantized_matmul import GgmlType

# Whether an architecture's router renormalises its top-k weights, where the file does not say
# (`<arch>.expert_weights_norm`): Qwen3-MoE and Mixtral (GGUF architecture "llama") do.
RENORMALIZE_BY_ARCH = {"qwen3moe": True, "llama": True, "mixtral": True, "qwen2moe": False}

_FLOAT_TYPES = {"f32", "f16", "bf16"}
_QUANTIZED_TYPES = {"q4_0": GgmlType.Q4_0, "q8_0": GgmlType.Q8_0}


class MoeLayer:
    """Router, top-k gate and SiLU experts of one MoE layer (see the module docstring)."""

    def __init__(
        self,
        router,
        gate,
        up,
        down,
        *,
        top_k: int,
        renormalize: bool,
        ggml_type: Optional[GgmlType] = None,
        device=None,
        name: str = "moe layer",
    ):
        """router: [E, H] float buffer; gate, up: [E, I, H]; down: [E, H, I] (float buffers, or uint8
        block stacks with ggml_type Q4_0 / Q8_0). All buffers live on `device`."""
        self.device = device or router.device
        self.router, self.gate, self.up, self.down = router, gate, up, down
        self.ggml_type = ggml_type
        self.name = name
        n_experts, hidden = (int(d) for d in router.shape)
        self.n_experts, self.hidden = n_experts, hidden
        if router.dtype not in (DType.F32, DType.F16, DType.BF16):
            raise InvalidArgumentError(f"{name}: the router must be f32, f16 or bf16, got {router.dtype.name.lower()}")
        gate_shape = _logical(gate.shape, ggml_type)
        self.intermediate = gate_shape[1]
        expected = {
            "gate": (gate, (n_experts, self.intermediate, hidden)),
            "up": (up, (n_experts, self.intermediate, hidden)),
            "down": (down, (n_experts, hidden, self.intermediate)),
        }
        for label, (buf, shape) in expected.items():
            if _logical(buf.shape, ggml_type) != shape:
                raise InvalidArgumentError(f"{name}: {label} experts must be {list(shape)}, got {list(buf.shape)}")
        if isinstance(top_k, bool) or not 1 <= int(top_k) <= n_experts:
            raise InvalidArgumentError(f"{name}: experts per token {top_k} must be in [1, {n_experts}]")
        self.top_k = int(top_k)
        self.renormalize = bool(renormalize)

    @classmethod
    def from_gguf(cls, path, layer: int, *, device=None) -> "MoeLayer":
        """Layer `layer` of the GGUF file at `path`; expert count and experts per token come from
        the file's metadata."""
        path = os.fspath(path)
        meta, _ = _gguf_header(path, ())
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise InvalidArgumentError(f"MoeLayer.from_gguf: {path} has no general.architecture")
        where = f"MoeLayer.from_gguf: {path} ({arch})"
        for key in (f"{arch}.expert_count", f"{arch}.expert_used_count"):
            if key not in meta:
                raise InvalidArgumentError(f"{where} has no {key}: not a mixture-of-experts model")
        gating = meta.get(f"{arch}.expert_gating_func", 1)  # llama.cpp: 1 softmax, 2 sigmoid
        if gating != 1:
            raise InvalidArgumentError(f"{where}: expert gating function {gating} is not softmax")
        renormalize = meta.get(f"{arch}.expert_weights_norm", RENORMALIZE_BY_ARCH.get(arch))
        if renormalize is None:
            raise InvalidArgumentError(
                f"{where}: the file does not say whether the top-k weights are renormalised "
                f"({arch}.expert_weights_norm) and {arch} is not in RENORMALIZE_BY_ARCH"
            )
        n_blocks = meta.get(f"{arch}.block_count")
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise InvalidArgumentError(f"{where}: layer must be a non-negative integer, got {layer!r}")
        if n_blocks is not None and layer >= n_blocks:
            raise InvalidArgumentError(f"{where}: layer {layer} is out of range (block_count {n_blocks})")
        names = {part: f"blk.{layer}.ffn_{part}.weight" for part in ("gate_inp", "gate_exps", "up_exps", "down_exps")}
        _, by_name = _gguf_header(path, names.values())
        types = {part: by_name[name] for part, name in names.items()}
        expert_types = {types["gate_exps"], types["up_exps"], types["down_exps"]}
        if len(expert_types) != 1:
            raise InvalidArgumentError(f"{where}: layer {layer} mixes expert types {sorted(expert_types)}")
        (expert_type,) = expert_types
        if expert_type not in _FLOAT_TYPES and expert_type not in _QUANTIZED_TYPES:
            raise InvalidArgumentError(f"{where}: layer {layer} experts are {expert_type}, not f32/f16/bf16/q4_0/q8_0")
        device = device or _default_device()
        loaded = _gguf_tensors(path, names.values(), device)  # one header read for the four
        bufs = {part: loaded[name] for part, name in names.items()}
        layer_obj = cls(
            bufs["gate_inp"],
            bufs["gate_exps"],
            bufs["up_exps"],
            bufs["down_exps"],
            top_k=int(meta[f"{arch}.expert_used_count"]),
            renormalize=bool(renormalize),
            ggml_type=_QUANTIZED_TYPES.get(expert_type),
            device=device,
            name=f"{os.path.basename(path)} layer {layer}",
        )
        if layer_obj.n_experts != int(meta[f"{arch}.expert_count"]):
            raise InvalidArgumentError(
                f"{where}: the router has {layer_obj.n_experts} experts, {arch}.expert_count says "
                f"{meta[f'{arch}.expert_count']}"
            )
        return layer_obj

    def __call__(self, hidden, *, route=None) -> np.ndarray:
        """float32 [m, H] -> float32 [m, H]: router, gate and experts in one submission. `route`:
        the experts' expert-ID route as moe_experts takes it (a DenseMatmulIdRoute for float
        stacks, a GgmlQuantizedMatmulIdRoute for block stacks, e.g. the CPU's direct_int8_dot);
        None: the automatic choice. The gate's ids are distinct per token, so grouped routes apply."""
        hidden = np.asarray(hidden)
        if hidden.dtype != np.float32 or hidden.ndim != 2 or hidden.shape[1] != self.hidden or hidden.shape[0] == 0:
            raise InvalidArgumentError(
                f"{self.name}: hidden must be float32 [m, {self.hidden}], got {hidden.dtype} {list(hidden.shape)}"
            )
        m = int(hidden.shape[0])
        device, registry = self.device, _registry_for(self.device)
        shapes = _ExpertShapes(m, self.top_k, self.n_experts, self.hidden, self.intermediate, stacked=False)
        route = _checked_route(route, True, shapes, device, self.ggml_type)  # gate ids: distinct
        x_buf = device.from_numpy(np.ascontiguousarray(hidden))
        logits = device.alloc(m * self.n_experts * 4, DType.F32, [m, self.n_experts])
        weights = device.alloc(m * self.top_k * 4, DType.F32, [m, self.top_k])
        ids = device.alloc(m * self.top_k * 4, DType.U32, [m, self.top_k])
        router_ids = device.from_numpy(np.zeros((m, 1), np.uint32))
        out = device.alloc(m * self.hidden * 4, DType.F32, [m, self.hidden])
        encoder = device.command_encoder()
        # The router is a one-expert expert-ID matmul: logits[t] = W_router @ x[t].
        router_params = DenseMatmulIdParams(
            m, self.n_experts, self.hidden, 1, 1, self.n_experts * self.hidden * self.router.dtype.size,
            DenseMatmulIdInputLayout.SHARED_PER_TOKEN, DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN,
            DenseMatmulIdRoute.DIRECT,
        )  # fmt: skip
        dense_matmul_id(encoder, registry, self.router, x_buf, router_ids, logits, None, router_params)
        encoder.memory_barrier()
        _core._moe_gate(encoder, registry, logits, weights, ids, m, self.n_experts, self.top_k, self.renormalize)
        encoder.memory_barrier()

        def alloc(shape):
            return device.alloc(int(np.prod(shape)) * 4, DType.F32, list(shape))

        _encode_experts(
            encoder, registry, device, shapes, route, True, x_buf, ids, weights, (self.gate, self.up), self.down,
            alloc, out, self.ggml_type,
        )  # fmt: skip
        encoder.commit_and_wait()
        return out.numpy()

    def float_weights(self) -> dict[str, np.ndarray]:
        """The router and expert stacks as float arrays (quantised blocks dequantised exactly)."""
        from . import q4_0, q8_0

        arrays = {"router": self.router.numpy()}
        for label, buf, shape in (
            ("gate", self.gate, (self.n_experts, self.intermediate, self.hidden)),
            ("up", self.up, (self.n_experts, self.intermediate, self.hidden)),
            ("down", self.down, (self.n_experts, self.hidden, self.intermediate)),
        ):
            raw = buf.numpy()
            if self.ggml_type is GgmlType.Q4_0:
                raw = q4_0.dequantize(raw, shape)
            elif self.ggml_type is GgmlType.Q8_0:
                raw = q8_0.dequantize(raw, shape)
            arrays[label] = raw
        return arrays

    def reference(self, hidden, weights: Optional[dict] = None):
        """(out, ids, logits) in float64: the layer's contract computed from `float_weights()`."""
        w = weights or self.float_weights()
        hidden = np.asarray(hidden, dtype=np.float32)
        m = hidden.shape[0]
        logits = dense_matmul_id_reference(w["router"][None], hidden, np.zeros((m, 1), np.int64))
        gate_w, ids = moe_gate_reference(logits, self.top_k, self.renormalize)
        out = moe_experts_reference(hidden, ids, gate_w, w["gate"], w["up"], w["down"])
        return out, ids, logits


def _logical(shape, ggml_type: Optional[GgmlType]) -> tuple[int, ...]:
    """[E, n, k] in values: block stacks store k / values_per_block * block_bytes bytes per row."""
    shape = tuple(int(d) for d in shape)
    if ggml_type is None or len(shape) != 3:
        return shape
    values, block_bytes = ggml_type.block_layout
    if shape[2] % block_bytes != 0:
        return shape  # no whole number of blocks: never equal to a logical shape
    return (*shape[:2], shape[2] // block_bytes * values)
