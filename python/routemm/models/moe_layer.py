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

Arguments and metadata are checked as they are read, before any tensor is mapped or anything is
encoded, and never coerced: the counts must be integers (`expert_used_count` in [1, expert_count]),
`expert_weights_norm` a bool, `expert_gating_func` the integer 1 (softmax); anything else is an
InvalidArgumentError naming the argument or metadata key. top_k and renormalize share moe_gate's
checks.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from .. import _core
from ..core._core_api import DType, check_type
from ..core._devices import _default_device, _registry_for
from ..core._errors import InvalidArgumentError
from ..formats.gguf_io import _fspath, _gguf_header, _gguf_tensors
from ..ops._reference import dense_matmul_id_reference, moe_experts_reference, moe_gate_reference
from ..ops.dense_matmul_id import (
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    dense_matmul_id,
)
from ..ops.moe import (
    _check_bool,
    _check_top_k,
    _check_weight_dtypes,
    _checked_ggml_type,
    _checked_route,
    _encode_experts,
    _ExpertShapes,
)
from ..ops.quantized_matmul import GgmlType
from ..ops.quantized_matmul_id import SUPPORTED_TYPES as _BLOCK_TYPES

# Whether an architecture's router renormalises its top-k weights, where the file does not say
# (`<arch>.expert_weights_norm`): Qwen3-MoE and Mixtral (GGUF architecture "llama") do.
RENORMALIZE_BY_ARCH = {"qwen3moe": True, "llama": True, "mixtral": True, "qwen2moe": False}

_FLOAT_TYPES = {"f32", "f16", "bf16"}
# The block stack types the experts run (quantized_matmul_id_ggml's), by their GGUF type names.
_QUANTIZED_TYPES = {t.value: t for t in _BLOCK_TYPES}


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
        """router: [E, H] float buffer; gate, up: [E, I, H]; down: [E, H, I] (float buffers of one
        dtype, or uint8 block stacks with ggml_type one of quantized_matmul_id's SUPPORTED_TYPES, a
        GgmlType or its value: Q4_0, Q8_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K). All
        buffers live on `device` (default: the router's). top_k: an integer in [1, E]; renormalize:
        a bool (checked as moe_gate checks them)."""
        for label, buf in (("router", router), ("gate", gate), ("up", up), ("down", down)):
            check_type(f"{name}:", label, buf, _core.Buffer)
        check_type(f"{name}:", "device", device, _core.Device, optional=True)
        device = device or router.device
        ggml_type = _checked_ggml_type(ggml_type, f"{name}: ggml_type")
        router_shape = tuple(int(d) for d in router.shape)
        if len(router_shape) != 2:
            raise InvalidArgumentError(f"{name}: router must be [E, H], got {list(router_shape)}")
        if router.dtype not in (DType.F32, DType.F16, DType.BF16):
            raise InvalidArgumentError(f"{name}: router must be f32, f16 or bf16, got {router.dtype.name.lower()}")
        n_experts, hidden = router_shape
        gate_shape = _logical(gate.shape, ggml_type)
        if len(gate_shape) != 3:
            raise InvalidArgumentError(f"{name}: gate experts must be [E, I, H], got {list(gate.shape)}")
        intermediate = gate_shape[1]
        if 0 in (n_experts, hidden, intermediate):
            raise InvalidArgumentError(
                f"{name}: extents must be nonzero, got E={n_experts}, H={hidden}, I={intermediate}"
            )
        expected = {
            "gate": (gate, (n_experts, intermediate, hidden)),
            "up": (up, (n_experts, intermediate, hidden)),
            "down": (down, (n_experts, hidden, intermediate)),
        }
        for label, (buf, shape) in expected.items():
            if _logical(buf.shape, ggml_type) != shape:
                raise InvalidArgumentError(f"{name}: {label} experts must be {list(shape)}, got {list(buf.shape)}")
        _check_weight_dtypes((gate, up, down), ggml_type, f"{name}:")
        for label, buf in (("router", router), ("gate", gate), ("up", up), ("down", down)):
            if buf.device.backend != device.backend:
                raise InvalidArgumentError(
                    f"{name}: {label} lives on {buf.device.backend}, the layer on {device.backend}"
                )
        self.top_k = _check_top_k(top_k, n_experts, f"{name}: top_k")
        self.renormalize = _check_bool(renormalize, f"{name}: renormalize")
        self.device = device
        self.router, self.gate, self.up, self.down = router, gate, up, down
        self.ggml_type = ggml_type
        self.name = name
        self.n_experts, self.hidden, self.intermediate = n_experts, hidden, intermediate

    @classmethod
    def from_gguf(cls, path, layer: int, *, device=None) -> "MoeLayer":
        """Layer `layer` of the GGUF file at `path`; expert count and experts per token come from
        the file's metadata (checked as the module docstring says)."""
        path = _fspath(path, "MoeLayer.from_gguf")
        check_type("MoeLayer.from_gguf:", "device", device, _core.Device, optional=True)
        meta, _ = _gguf_header(path, ())
        arch = meta.get("general.architecture")
        if arch is None:
            raise InvalidArgumentError(f"MoeLayer.from_gguf: {path} has no general.architecture")
        if not isinstance(arch, str):
            raise InvalidArgumentError(
                f"MoeLayer.from_gguf: {path}: general.architecture must be a string, got {arch!r}"
            )
        where = f"MoeLayer.from_gguf: {path} ({arch})"
        count_key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
        for key in (count_key, used_key):
            if key not in meta:
                raise InvalidArgumentError(f"{where} has no {key}: not a mixture-of-experts model")
        n_experts = _metadata_int(meta, count_key, where, minimum=1)
        top_k = _check_top_k(meta[used_key], n_experts, f"{where}: {used_key}", count_key)
        gating_key = f"{arch}.expert_gating_func"
        gating = meta.get(gating_key, 1)  # llama.cpp: 1 softmax, 2 sigmoid
        if isinstance(gating, bool) or not isinstance(gating, int) or gating != 1:
            raise InvalidArgumentError(
                f"{where}: {gating_key} {gating!r} is not 1 (softmax), the only gate routemm has"
            )
        norm_key = f"{arch}.expert_weights_norm"
        if norm_key in meta:
            renormalize = _check_bool(meta[norm_key], f"{where}: {norm_key}")
        elif arch in RENORMALIZE_BY_ARCH:
            renormalize = RENORMALIZE_BY_ARCH[arch]
        else:
            raise InvalidArgumentError(
                f"{where}: the file does not say whether the top-k weights are renormalised "
                f"({norm_key}) and {arch} is not in RENORMALIZE_BY_ARCH"
            )
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise InvalidArgumentError(f"{where}: layer must be a non-negative integer, got {layer!r}")
        blocks_key = f"{arch}.block_count"
        if blocks_key in meta:
            n_blocks = _metadata_int(meta, blocks_key, where, minimum=0)
            if layer >= n_blocks:
                raise InvalidArgumentError(f"{where}: layer {layer} is out of range ({blocks_key} {n_blocks})")
        names = {part: f"blk.{layer}.ffn_{part}.weight" for part in ("gate_inp", "gate_exps", "up_exps", "down_exps")}
        _, by_name = _gguf_header(path, names.values())
        types = {part: by_name[name] for part, name in names.items()}
        expert_types = {types["gate_exps"], types["up_exps"], types["down_exps"]}
        if len(expert_types) != 1:
            raise InvalidArgumentError(f"{where}: layer {layer} mixes expert types {sorted(expert_types)}")
        (expert_type,) = expert_types
        if expert_type not in _FLOAT_TYPES and expert_type not in _QUANTIZED_TYPES:
            known = "/".join(["f32", "f16", "bf16", *_QUANTIZED_TYPES])
            raise InvalidArgumentError(f"{where}: layer {layer} experts are {expert_type}, not {known}")
        device = device or _default_device()
        loaded = _gguf_tensors(path, names.values(), device)  # one header read for the four
        bufs = {part: loaded[name] for part, name in names.items()}
        router_shape = [int(d) for d in bufs["gate_inp"].shape]
        if router_shape[:1] != [n_experts]:
            raise InvalidArgumentError(f"{where}: the router is {router_shape}, {count_key} says {n_experts} experts")
        return cls(
            bufs["gate_inp"],
            bufs["gate_exps"],
            bufs["up_exps"],
            bufs["down_exps"],
            top_k=top_k,
            renormalize=renormalize,
            ggml_type=_QUANTIZED_TYPES.get(expert_type),
            device=device,
            name=f"{os.fsdecode(os.path.basename(path))} layer {layer}",
        )

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
        from ..formats.ggml import dequantize

        arrays = {"router": self.router.numpy()}
        for label, buf, shape in (
            ("gate", self.gate, (self.n_experts, self.intermediate, self.hidden)),
            ("up", self.up, (self.n_experts, self.intermediate, self.hidden)),
            ("down", self.down, (self.n_experts, self.hidden, self.intermediate)),
        ):
            raw = buf.numpy()
            arrays[label] = raw if self.ggml_type is None else dequantize(raw, self.ggml_type, shape)
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


def _metadata_int(meta: dict, key: str, where: str, *, minimum: int) -> int:
    """meta[key], which must be an integer (a GGUF integer type, not a bool, float or string) >= minimum."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _logical(shape, ggml_type: Optional[GgmlType]) -> tuple[int, ...]:
    """[E, n, k] in values: block stacks store k / values_per_block * block_bytes bytes per row."""
    shape = tuple(int(d) for d in shape)
    if ggml_type is None or len(shape) != 3:
        return shape
    values, block_bytes = ggml_type.block_layout
    if shape[2] % block_bytes != 0:
        return shape  # no whole number of blocks: never equal to a logical shape
    return (*shape[:2], shape[2] // block_bytes * values)
