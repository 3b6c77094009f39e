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
between. from_gguf reads every architecture of models/_gguf_moe.py (qwen3moe, qwen2moe, llama /
Mixtral, deepseek2, glm4moe, gpt-oss, llama4): the gate renormalises the top-k weights when
`<arch>.expert_weights_norm` says so, and otherwise as the architecture does (RENORMALIZE_BY_ARCH);
the gating function, selection bias, expert groups, weight scale, shared experts, biases and
activation come from the file as llama.cpp reads them.

Arguments and metadata are checked as they are read, before any tensor is mapped or anything is
encoded, and never coerced: the counts must be integers (`expert_used_count` in [1, expert_count]),
`expert_weights_norm` a bool, `expert_gating_func` one of llama.cpp's values 0-4; anything else is an
InvalidArgumentError naming the argument or metadata key. What routemm does not compute (a gating
function other than softmax and sigmoid, mixed expert types in one layer, an option MoeLayer does
not take) is an UnsupportedError naming the key or tensor. top_k and renormalize share moe_gate's
checks.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Optional

import numpy as np

from .. import _core
from ..core._core_api import DType, check_type
from ..core._devices import _default_device, _registry_for
from ..core._errors import InvalidArgumentError, InvalidArgumentTypeError, UnsupportedError
from ..formats.gguf_io import _fspath, _gguf_index, _gguf_tensors
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
    _check_routing,
    _check_top_k,
    _check_weight_dtypes,
    _checked_ffn_options,
    _checked_ggml_type,
    _checked_route,
    _encode_experts,
    _encode_shared_expert,
    _ExpertShapes,
    _shared_expert,
    _shared_gate_weights,
    _stack_types,
)
from ..ops.quantized_matmul import GgmlType
from ..ops.quantized_matmul_id import SUPPORTED_TYPES as _BLOCK_TYPES
from ._gguf_moe import RENORMALIZE_BY_ARCH, LayerPlan, plan_layer  # noqa: F401 (RENORMALIZE_BY_ARCH: public)

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
        scoring_func: str = "softmax",
        e_score_correction_bias=None,
        num_expert_group: Optional[int] = None,
        topk_group: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
        router_bias=None,
        ggml_type: Optional[GgmlType] = None,
        device=None,
        name: str = "moe layer",
        expert_range: Optional[tuple[int, int]] = None,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        gate_bias=None,
        up_bias=None,
        down_bias=None,
        weights_before_ffn: bool = False,
        shared_gate_up=None,
        shared_down=None,
        shared_gate=None,
    ):
        """router: [E, H] float buffer; gate, up: [E, I, H]; down: [E, H, I] (float buffers of one
        dtype, or uint8 block stacks with ggml_type one of quantized_matmul_id's SUPPORTED_TYPES, a
        GgmlType or its value: Q4_0, Q8_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K; or a (gate,
        up, down) tuple of them for stacks of mixed types). All
        buffers live on `device` (default: the router's). top_k: an integer in [1, E]; renormalize:
        a bool (checked as moe_gate checks them). scoring_func, e_score_correction_bias (None or an
        F32 [E] buffer), num_expert_group, topk_group, routed_scaling_factor and router_bias (None or
        an F32 [E] buffer, gpt-oss's ffn_gate_inp.bias, added to the router's logits): the gate's
        routing options, as moe_gate takes them (the default is a softmax gate).

        The experts' FFN options, as routemm.moe_experts takes them: activation ("silu" or
        "swiglu_oai", with swiglu_alpha and swiglu_limit); expert biases gate_bias, up_bias
        [E, I] and down_bias [E, H] (F32 buffers; of a layer holding an expert_range, [E, ...] or
        the range's rows); weights_before_ffn (Llama-4); a shared expert shared_gate_up (a
        (gate, up) pair of [I_s, H] buffers or one [2 I_s, H]) and shared_down [H, I_s] of the
        routed stacks' kind, with shared_gate ([H] or [1, H] float buffer) its optional sigmoid gate."""
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
        # expert_range (first, count): the stacks hold experts first .. first + count - 1 of the
        # router's n_experts (an expert-parallel rank's slice), else all of them.
        first, stacked = _checked_expert_range(expert_range, n_experts, name)
        gate_type, up_type, down_type = _stack_types(ggml_type)
        gate_shape = _logical(gate.shape, gate_type)
        if len(gate_shape) != 3:
            raise InvalidArgumentError(f"{name}: gate experts must be [E, I, H], got {list(gate.shape)}")
        intermediate = gate_shape[1]
        if 0 in (n_experts, hidden, intermediate):
            raise InvalidArgumentError(
                f"{name}: extents must be nonzero, got E={n_experts}, H={hidden}, I={intermediate}"
            )
        expected = {
            "gate": (gate, (stacked, intermediate, hidden), gate_type),
            "up": (up, (stacked, intermediate, hidden), up_type),
            "down": (down, (stacked, hidden, intermediate), down_type),
        }
        for label, (buf, shape, stack_type) in expected.items():
            if _logical(buf.shape, stack_type) != shape:
                raise InvalidArgumentError(f"{name}: {label} experts must be {list(shape)}, got {list(buf.shape)}")
        _check_weight_dtypes((gate, up, down), ggml_type, f"{name}:")
        for label, buf in (("router", router), ("gate", gate), ("up", up), ("down", down)):
            if buf.device.backend != device.backend:
                raise InvalidArgumentError(
                    f"{name}: {label} lives on {buf.device.backend}, the layer on {device.backend}"
                )
        self.top_k = _check_top_k(top_k, n_experts, f"{name}: top_k")
        self.renormalize = _check_bool(renormalize, f"{name}: renormalize")
        # The gate's routing options (moe_gate's, checked as it checks them); each bias is an F32 [E]
        # buffer on the layer's device.
        self.routing = _check_routing(scoring_func, num_expert_group, topk_group, routed_scaling_factor, f"{name}:")
        _core._check_moe_gate_params(1, n_experts, self.top_k, self.renormalize, *self.routing.core_args())
        for label, bias in (("e_score_correction_bias", e_score_correction_bias), ("router_bias", router_bias)):
            check_type(f"{name}:", label, bias, _core.Buffer, optional=True)
            if bias is not None and (bias.dtype != DType.F32 or [int(d) for d in bias.shape] != [n_experts]):
                raise InvalidArgumentError(
                    f"{name}: {label} must be f32 [{n_experts}], got "
                    f"{bias.dtype.name.lower()} {[int(d) for d in bias.shape]}"
                )
            if bias is not None and bias.device.backend != device.backend:
                raise InvalidArgumentError(
                    f"{name}: {label} lives on {bias.device.backend}, the layer on {device.backend}"
                )
        self.e_score_correction_bias, self.router_bias = e_score_correction_bias, router_bias
        self.device = device
        self.router, self.gate, self.up, self.down = router, gate, up, down
        self.ggml_type = ggml_type
        self.name = name
        self.expert_range = None if expert_range is None else (first, stacked)
        self.n_experts, self.hidden, self.intermediate = n_experts, hidden, intermediate
        self._init_ffn(
            activation, swiglu_alpha, swiglu_limit, gate_bias, up_bias, down_bias, weights_before_ffn,
            shared_gate_up, shared_down, shared_gate, first, stacked,
        )  # fmt: skip

    def _init_ffn(
        self, activation, swiglu_alpha, swiglu_limit, gate_bias, up_bias, down_bias, weights_before_ffn,
        shared_gate_up, shared_down, shared_gate, first: int, stacked: int,
    ) -> None:  # fmt: skip
        """Checks and keeps the experts' FFN options (the constructor's docstring), each refusal an
        InvalidArgumentError naming the argument, before anything is encoded."""
        name, device = self.name, self.device
        self.ffn = _checked_ffn_options(
            activation, swiglu_alpha, swiglu_limit, weights_before_ffn, gate_bias is not None, down_bias is not None
        )
        if (gate_bias is None) != (up_bias is None):
            raise InvalidArgumentError(f"{name}: gate_bias and up_bias come together (both or neither)")
        biases = {}
        for label, buf, width in (
            ("gate_bias", gate_bias, self.intermediate),
            ("up_bias", up_bias, self.intermediate),
            ("down_bias", down_bias, self.hidden),
        ):
            if buf is None:
                continue
            check_type(f"{name}:", label, buf, _core.Buffer)
            shape = [int(d) for d in buf.shape]
            if buf.dtype != DType.F32 or shape not in ([stacked, width], [self.n_experts, width]):
                raise InvalidArgumentError(
                    f"{name}: {label} must be f32 [{stacked}, {width}], got {buf.dtype.name.lower()} {shape}"
                )
            if buf.device.backend != device.backend:
                raise InvalidArgumentError(
                    f"{name}: {label} lives on {buf.device.backend}, the layer on {device.backend}"
                )
            biases[label] = _experts_view(buf, first, stacked, self.n_experts) if shape[0] != stacked else buf
        self.gate_bias, self.up_bias, self.down_bias = (biases.get(k) for k in ("gate_bias", "up_bias", "down_bias"))
        self.shared = None
        if shared_gate_up is None and shared_down is None and shared_gate is None:
            return
        if shared_gate_up is None and shared_down is None:
            raise InvalidArgumentError(f"{name}: shared_gate needs shared_gate_up and shared_down")
        if shared_gate_up is None or shared_down is None:
            raise InvalidArgumentError(f"{name}: shared_gate_up and shared_down come together (both or neither)")
        pair = tuple(shared_gate_up) if isinstance(shared_gate_up, (tuple, list)) else (shared_gate_up,)
        for label, buf in [(f"shared_gate_up[{i}]", b) for i, b in enumerate(pair)] + [("shared_down", shared_down)]:
            check_type(f"{name}:", label, buf, _core.Buffer)
            if buf.device.backend != device.backend:
                raise InvalidArgumentError(
                    f"{name}: {label} lives on {buf.device.backend}, the layer on {device.backend}"
                )
        check_type(f"{name}:", "shared_gate", shared_gate, _core.Buffer, optional=True)
        try:
            shapes, (stacks, down, gate) = _shared_expert(
                None, (1, self.hidden), pair if len(pair) == 2 else pair[0], shared_down,
                None if shared_gate is None else shared_gate.numpy(), self.ggml_type,
            )  # fmt: skip
            _check_weight_dtypes((self.gate, self.up, self.down, *stacks, down), self.ggml_type)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{name}: {e}") from None
        self.shared = (shapes, stacks, down, gate)

    def _check_whole(self, op: str) -> None:
        """Refuses `op` on a layer that holds a slice of the experts (expert_range)."""
        if self.expert_range is not None:
            first, count = self.expert_range
            raise UnsupportedError(
                f"{self.name}: {op} needs every expert, the layer holds experts {first} .. {first + count - 1} "
                f"of {self.n_experts} (expert_range); run them with "
                "routemm.integrations.distributed.ep_moe_experts"
            )

    @classmethod
    def from_gguf(cls, path, layer: int, *, device=None, process_group=None) -> "MoeLayer":
        """Layer `layer` of the GGUF file at `path`, of any architecture models/_gguf_moe.py lists:
        the routing options and tensors come from the file's metadata and tensor names, checked as
        the module docstring says, before any tensor is mapped. Per-expert 2-D tensors (Mixtral's
        `blk.N.ffn_gate.E.weight`) are stacked into one buffer (a copy); every other tensor is
        mapped. What the layer would need and MoeLayer does not take is an UnsupportedError naming
        the tensor or key that asks for it.

        process_group (a torch.distributed group, initialised): the layer holds only this rank's
        experts, its contiguous share as ExpertPlacement.contiguous(n_experts, world_size) gives it
        (`expert_range` = (first, count)): views of those experts' bytes in the mapped file, or
        only the local per-expert tensors stacked, so only the slice is read. The router stays
        whole. Such a layer's experts run through
        routemm.integrations.distributed.ep_moe_experts (its stacks by torch.from_dlpack); calling
        the layer itself is refused."""
        path = _fspath(path, "MoeLayer.from_gguf")
        check_type("MoeLayer.from_gguf:", "device", device, _core.Device, optional=True)
        meta, index = _gguf_index(path, "MoeLayer.from_gguf")
        plan = plan_layer(meta, index, int(layer) if isinstance(layer, np.integer) else layer, path)
        where = f"MoeLayer.from_gguf: {path} ({plan.arch}) layer {plan.layer}"
        ggml_type = _expert_ggml_type(plan, where)
        takes = inspect.signature(cls.__init__).parameters
        for argument, source in plan.needs():
            if argument not in takes:
                raise UnsupportedError(
                    f"{where}: {source} needs MoeLayer's {argument}, which routemm does not have yet"
                )
        expert_range = None if process_group is None else _rank_experts(process_group, plan.n_experts)
        first, count = expert_range or (0, plan.n_experts)
        device = device or _default_device()
        loaded = _gguf_tensors(path, plan.types, device)  # one header read for every tensor
        stacks = {}
        for part, names in plan.experts.items():
            if len(names) == 1:
                stacks[part] = _experts_view(loaded[names[0]], first, count, plan.n_experts)
            else:  # one 2-D tensor per expert: stacked here, in expert order
                local = names[first : first + count]
                stacks[part] = device.from_numpy(np.stack([loaded[name].numpy() for name in local]))
        router = loaded[plan.router]
        count_key = f"{plan.arch}.expert_count"
        if [int(d) for d in router.shape][:1] != [plan.n_experts]:
            raise InvalidArgumentError(
                f"{where}: the router is {[int(d) for d in router.shape]}, {count_key} says {plan.n_experts} experts"
            )
        options = {}
        if plan.scoring_func != "softmax":
            options["scoring_func"] = plan.scoring_func
        if plan.e_score_correction_bias:
            options["e_score_correction_bias"] = loaded[plan.e_score_correction_bias]
        if plan.num_expert_group is not None:
            options["num_expert_group"], options["topk_group"] = plan.num_expert_group, plan.topk_group
        if plan.routed_scaling_factor != 1.0:
            options["routed_scaling_factor"] = plan.routed_scaling_factor
        if plan.router_bias:
            options["router_bias"] = loaded[plan.router_bias]
        for part, name in plan.expert_biases.items():
            options[f"{part}_bias"] = loaded[name]
        if plan.activation != "silu":
            options["activation"] = plan.activation
        if plan.weights_before_ffn:
            options["weights_before_ffn"] = True
        if plan.shared:
            options["shared_gate_up"] = (loaded[plan.shared["gate"]], loaded[plan.shared["up"]])
            options["shared_down"] = loaded[plan.shared["down"]]
        if plan.shared_gate:
            options["shared_gate"] = loaded[plan.shared_gate]
        return cls(
            router,
            stacks["gate"],
            stacks["up"],
            stacks["down"],
            top_k=plan.top_k,
            renormalize=plan.renormalize,
            ggml_type=ggml_type,
            device=device,
            name=f"{os.fsdecode(os.path.basename(path))} layer {plan.layer}",
            expert_range=expert_range,
            **options,
        )

    def __call__(self, hidden, *, route=None) -> np.ndarray:
        """float32 [m, H] -> float32 [m, H]: router, gate and experts in one submission. `route`:
        the experts' expert-ID route as moe_experts takes it (a DenseMatmulIdRoute for float
        stacks, a GgmlQuantizedMatmulIdRoute for block stacks, e.g. the CPU's direct_int8_dot);
        None: the automatic choice. The gate's ids are distinct per token, so grouped routes apply."""
        self._check_whole("__call__")
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
        _core._moe_gate(
            encoder, registry, logits, weights, ids, m, self.n_experts, self.top_k, self.renormalize,
            self.routing.scoring_func, self.e_score_correction_bias, self.routing.num_expert_group,
            self.routing.topk_group, self.routing.routed_scaling_factor, self.router_bias,
        )  # fmt: skip
        encoder.memory_barrier()

        def alloc(shape):
            return device.alloc(int(np.prod(shape)) * 4, DType.F32, list(shape))

        _encode_experts(
            encoder, registry, device, shapes, route, True, x_buf, ids, weights, (self.gate, self.up), self.down,
            alloc, out, self.ggml_type, self.ffn, (self.gate_bias, self.up_bias, self.down_bias),
        )  # fmt: skip
        if self.shared is None:
            encoder.commit_and_wait()
            return out.numpy()
        # The shared expert: the same block with one expert every token selects, its weight 1 or
        # sigmoid(x . shared_gate), in the same submission; added to the routed output.
        s_shapes, s_stacks, s_down, s_gate = self.shared
        s_shapes = dataclasses.replace(s_shapes, m=m)
        shared_out = device.alloc(m * self.hidden * 4, DType.F32, [m, self.hidden])
        _encode_shared_expert(
            encoder, registry, device, s_shapes, x_buf, router_ids,
            device.from_numpy(_shared_gate_weights(hidden, s_gate)), s_stacks, s_down, alloc, shared_out,
            self.ggml_type, self.ffn,
        )  # fmt: skip
        encoder.commit_and_wait()
        return out.numpy() + shared_out.numpy()

    def float_weights(self) -> dict[str, np.ndarray]:
        """The router and expert stacks as float arrays (quantised blocks dequantised exactly)."""
        from ..formats.ggml import dequantize

        self._check_whole("float_weights")
        arrays = {"router": self.router.numpy()}
        for label, buf, shape, stack_type in zip(
            ("gate", "up", "down"),
            (self.gate, self.up, self.down),
            (
                (self.n_experts, self.intermediate, self.hidden),
                (self.n_experts, self.intermediate, self.hidden),
                (self.n_experts, self.hidden, self.intermediate),
            ),
            _stack_types(self.ggml_type),
            strict=True,
        ):
            raw = buf.numpy()
            arrays[label] = raw if stack_type is None else dequantize(raw, stack_type, shape)
        for label in ("gate_bias", "up_bias", "down_bias"):
            if getattr(self, label) is not None:
                arrays[label] = getattr(self, label).numpy()
        if self.shared is not None:
            s_shapes, s_stacks, s_down, s_gate = self.shared
            i_s = s_shapes.intermediate
            s_types = _stack_types(self.ggml_type)
            if s_shapes.stacked:
                raw = s_stacks[0].numpy()
                both = raw if s_types[0] is None else dequantize(raw, s_types[0], (1, 2 * i_s, self.hidden))
                arrays["shared_gate"], arrays["shared_up"] = both[0, :i_s], both[0, i_s:]
            else:
                for key, buf, t in (("shared_gate", s_stacks[0], s_types[0]), ("shared_up", s_stacks[1], s_types[1])):
                    raw = buf.numpy()
                    arrays[key] = (raw if t is None else dequantize(raw, t, (1, i_s, self.hidden)))[0]
            raw = s_down.numpy()
            arrays["shared_down"] = (raw if s_types[2] is None else dequantize(raw, s_types[2], (1, self.hidden, i_s)))[
                0
            ]
            if s_gate is not None:
                arrays["shared_gate_weight"] = np.asarray(s_gate, np.float32)
        return arrays

    def reference(self, hidden, weights: Optional[dict] = None):
        """(out, ids, logits) in float64: the layer's contract computed from `float_weights()`;
        logits are those the gate ranks (the router's output plus router_bias, if any)."""
        w = weights or self.float_weights()
        hidden = np.asarray(hidden, dtype=np.float32)
        m = hidden.shape[0]
        logits = dense_matmul_id_reference(w["router"][None], hidden, np.zeros((m, 1), np.int64))
        if self.router_bias is not None:
            logits = logits + self.router_bias.numpy().astype(np.float64)[None, :]
        r, bias = self.routing, self.e_score_correction_bias
        gate_w, ids = moe_gate_reference(
            logits, self.top_k, self.renormalize, scoring_func=r.scoring_func,
            e_score_correction_bias=None if bias is None else bias.numpy(),
            num_expert_group=r.num_expert_group or None, topk_group=r.topk_group or None,
            routed_scaling_factor=r.routed_scaling_factor,
        )  # fmt: skip
        f = self.ffn
        out = moe_experts_reference(
            hidden, ids, gate_w, w["gate"], w["up"], w["down"], activation=f.activation, swiglu_alpha=f.swiglu_alpha,
            swiglu_limit=f.swiglu_limit, gate_bias=w.get("gate_bias"), up_bias=w.get("up_bias"),
            down_bias=w.get("down_bias"), weights_before_ffn=f.weights_before_ffn,
        )  # fmt: skip
        if "shared_down" in w:
            x = hidden.astype(np.float64)
            sg, su = (np.asarray(w[k], np.float64) for k in ("shared_gate", "shared_up"))
            g, u = x @ sg.T, x @ su.T
            if f.activation == "swiglu_oai":
                g, u = np.minimum(g, f.swiglu_limit), np.clip(u, -f.swiglu_limit, f.swiglu_limit)
                act = g / (1.0 + np.exp(-f.swiglu_alpha * g)) * (u + 1.0)
            else:
                act = g / (1.0 + np.exp(-g)) * u
            scale = 1.0
            if "shared_gate_weight" in w:
                scale = 1.0 / (1.0 + np.exp(-(x @ np.asarray(w["shared_gate_weight"], np.float64))))[:, None]
            out = out + scale * (act @ np.asarray(w["shared_down"], np.float64).T)
        return out, ids, logits


def _checked_expert_range(expert_range, n_experts: int, name: str) -> tuple[int, int]:
    """(first, count) of the experts a layer's stacks hold: all of them for None."""
    if expert_range is None:
        return 0, n_experts
    ok = isinstance(expert_range, tuple) and len(expert_range) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in expert_range)
    if not ok or not (0 <= expert_range[0] and 0 <= expert_range[1] and sum(expert_range) <= n_experts):
        raise InvalidArgumentError(
            f"{name}: expert_range must be a (first, count) tuple of ints within the router's "
            f"{n_experts} experts, got {expert_range!r}"
        )
    return expert_range


def _rank_experts(process_group, n_experts: int) -> tuple[int, int]:
    """(first, count): this rank's contiguous share of `n_experts` in `process_group`, split as
    ExpertPlacement.contiguous splits them (the first n_experts % world ranks take one more)."""
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise InvalidArgumentTypeError(
            f"MoeLayer.from_gguf process_group must be a torch.distributed ProcessGroup, got "
            f"{type(process_group).__name__}"
        )
    if not dist.is_initialized():
        raise InvalidArgumentError("MoeLayer.from_gguf process_group needs an initialised torch.distributed")
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    base, extra = divmod(n_experts, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def _experts_view(stack, first: int, count: int, n_experts: int):
    """Experts first .. first + count - 1 of an [E, ...] stack buffer: a view of their bytes (no
    copy; of a mapped file, only those pages are read), the whole buffer for all of them."""
    if (first, count) == (0, n_experts):
        return stack
    per = stack.nbytes // n_experts
    shape = [count, *(int(d) for d in stack.shape[1:])]
    return stack.view(first * per, count * per, stack.dtype, shape)


def _takes_stack_types() -> bool:
    """Whether the experts take a (gate, up, down) tuple of block types (stacks of mixed types)."""
    try:
        _checked_ggml_type((GgmlType.Q4_K, GgmlType.Q4_K, GgmlType.Q6_K))
    except InvalidArgumentError:
        return False
    return True


def _expert_ggml_type(plan: LayerPlan, where: str):
    """The experts' ggml_type: None for float stacks, the GgmlType of block stacks of one type, or
    a (gate, up, down) tuple where they differ (a Q4_K_M file's Q6_K down under Q4_K gate and up).
    The shared expert must have the routed stacks' types. Types without kernels, float stacks of
    mixed dtypes, and mixed block types where the experts take one type are an UnsupportedError
    naming the tensors."""
    routed = {}
    for part in ("gate", "up", "down"):
        kinds = {plan.types[n]: n for n in plan.experts[part]}
        if len(kinds) != 1:
            listed = ", ".join(f"{n} {t}" for t, n in kinds.items())
            raise UnsupportedError(f"{where}: its {part} experts differ in type ({listed})")
        routed[part] = next(iter(kinds))
    first = {part: plan.experts[part][0] for part in ("gate", "up", "down")}
    if plan.shared:
        for part, kind in routed.items():
            if plan.types[plan.shared[part]] != kind:
                raise UnsupportedError(
                    f"{where}: {plan.shared[part]} is {plan.types[plan.shared[part]]}, {first[part]} {kind}; the "
                    "shared expert runs the routed stacks' types"
                )
    known = "/".join(["f32", "f16", "bf16", *_QUANTIZED_TYPES])
    for part, kind in routed.items():
        if kind not in _FLOAT_TYPES and kind not in _QUANTIZED_TYPES:
            raise UnsupportedError(f"{where}: {first[part]} is {kind}; the experts run {known}")
    if len(set(routed.values())) == 1:
        return _QUANTIZED_TYPES.get(routed["gate"])
    listed = ", ".join(f"{first[p]} {k}" for p, k in routed.items())
    if any(kind in _FLOAT_TYPES for kind in routed.values()) or not _takes_stack_types():
        raise UnsupportedError(f"{where} mixes expert types ({listed}); routemm's experts take one type per layer")
    return tuple(_QUANTIZED_TYPES[kind] for kind in routed.values())


def _logical(shape, ggml_type: Optional[GgmlType]) -> tuple[int, ...]:
    """[E, n, k] in values: block stacks store k / values_per_block * block_bytes bytes per row."""
    shape = tuple(int(d) for d in shape)
    if ggml_type is None or len(shape) != 3:
        return shape
    values, block_bytes = ggml_type.block_layout
    if shape[2] % block_bytes != 0:
        return shape  # no whole number of blocks: never equal to a logical shape
    return (*shape[:2], shape[2] // block_bytes * values)
