"""PyTorch custom ops over routemm's front doors (importing this module registers them).

    import routemm.torch  # registers torch.ops.routemm.*
    y = torch.ops.routemm.matmul_id(w, x, ids)          # [m * top_k, n] float32
    y = torch.ops.routemm.q4_matmul(x, blocks, n, k)    # [m, n] float32
    y = torch.ops.routemm.quantized_matmul_id(stack, x, ids, "q4_0")  # [m*top_k, n] float32
    w, ids = torch.ops.routemm.moe_gate(logits, top_k, True)  # [m, top_k] float32, int32
    w, ids = torch.ops.routemm.moe_gate(logits, 8, True, "sigmoid", bias, 8, 4, 2.5)  # DeepSeek-V3
    w, ids = torch.ops.routemm.moe_gate(logits, 4, True, router_bias=router_bias)  # gpt-oss
    y = torch.ops.routemm.moe_experts(h, ids, w, gate_up, down)  # [m, H], h's dtype

Each op has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through it and
fake tensors propagate shapes. CUDA tensors run on torch.cuda.current_stream() with no host sync,
no stream created and temporaries from PyTorch's caching allocator, so a call can be captured in
torch.cuda.graph; CPU tensors run on the CPU backend. The route depends on shapes only.

Kernels: matmul_id, q4_matmul and quantized_matmul_id run C++ kernels (the extension
routemm._torch_ops, built when the build's Python imports torch) when that extension was built
against the running torch; otherwise, or with ROUTEMM_TORCH_KERNELS=python, their Python kernels
(the same checks, messages and results; more host time per call, see bench/engine_decode.py
host-cost). KERNELS says which ("cpp" or "python") and KERNELS_REASON why. Both run the core
through one table of devices and registries.

Gradients: moe_experts has a backward for float stacks (routemm.integrations._moe_autograd: d hidden, d
top_k_weights, d gate_up, d up, d down); when grad mode is on and one of its inputs requires grad,
its autograd kernel runs routemm::_moe_experts_grad, whose autograd.Function computes the forward
with the op and the gradients in its backward. The other ops compute the forward pass only: their
autograd kernel runs the op below autograd and, when grad mode is on and an input requires grad,
hands the output to routemm::_no_gradient, which gives it a grad_fn whose backward raises
routemm.UnsupportedError naming the op and those inputs: a forward with parameters that require
grad runs (bit for bit the no-grad result), training through the op fails loudly. The C++ kernels
bring their autograd kernel in C++ (no Python on a call whose inputs need no gradient; an op
`routemm::_<name>_grad`, where one is registered, takes a call that needs one); the Python
kernels' is `_autograd_kernel`.

Registration: every op goes through `define_op` (its schema, real and fake implementations), which
records it in OPS; an op of another module registers the same way.
"""

import importlib
import math
import os
import warnings
from typing import Callable, Optional

import numpy as np
import torch

from ..core._errors import InvalidArgumentError
from ..ops import _tensor_ops
from ..ops.dense_matmul_id import _check_shapes
from ..ops.quantized_matmul_id import SUPPORTED_TYPES as _QUANTIZED_TYPES
from ..ops.quantized_matmul_id import GgmlType, _element_width

# The block-stack types quantized_matmul_id takes, by their ggml_type values ("q4_0", "q4_k", ...).
_QUANTIZED_EXPERT_TYPES = frozenset(t.value for t in _QUANTIZED_TYPES)
_TYPE_NAMES = ", ".join(repr(t.value) for t in _QUANTIZED_TYPES)

NAMESPACE = "routemm"

_TORCH = _tensor_ops.framework("torch")

# name -> the registered op (torch.ops.routemm.<name>), for every op this package registered.
OPS: dict[str, object] = {}

KERNELS_KNOB = "ROUTEMM_TORCH_KERNELS"


def _choose_kernels() -> tuple[str, str, frozenset]:
    """("cpp" or "python", the reason, the ops the C++ kernels serve). Loading routemm._torch_ops
    registers its kernels, so it is loaded only when it will be used."""
    wanted = os.environ.get(KERNELS_KNOB, "").strip().lower() or "auto"
    if wanted not in ("auto", "cpp", "python"):
        raise InvalidArgumentError(f"{KERNELS_KNOB} must be auto, cpp or python, got {wanted!r}")
    if wanted == "python":
        return "python", f"{KERNELS_KNOB}=python", frozenset()
    try:
        from .. import _torch_ops_build
    except ImportError:
        why = "routemm._torch_ops was not built (the build's Python could not import torch, or ROUTEMM_TORCH_OPS=OFF)"
    else:
        if _torch_ops_build.TORCH_VERSION != torch.__version__:
            why = (
                f"routemm._torch_ops was built against torch {_torch_ops_build.TORCH_VERSION}, "
                f"this process runs torch {torch.__version__}: rebuild routemm with this torch"
            )
        else:
            try:
                extension = importlib.import_module("routemm._torch_ops")
            except ImportError as error:
                why = f"routemm._torch_ops failed to load: {error}"
            else:
                return (
                    "cpp",
                    f"routemm._torch_ops, built against torch {extension.TORCH_VERSION}",
                    frozenset(extension.OPS),
                )
    if wanted == "cpp":
        raise ImportError(f"{KERNELS_KNOB}=cpp, but {why}")
    return "python", why, frozenset()


# KERNELS: "cpp" (routemm._torch_ops) or "python"; KERNELS_REASON: why.
KERNELS, KERNELS_REASON, _CPP_OPS = _choose_kernels()

# How a checkout builds the C++ kernels against the torch it has (the README's torch install line).
BUILD_CPP_KERNELS = (
    "python -m pip install scikit-build-core pybind11 && "
    "ROUTEMM_TORCH_OPS=ON python -m pip install --no-build-isolation -v ."
)

if KERNELS == "python" and os.environ.get(KERNELS_KNOB, "").strip().lower() != "python":
    # A fallback the user did not ask for is said once, at import: the ops still work, but each call
    # costs more host time than the C++ kernels'.
    warnings.warn(
        f"routemm.torch: torch.ops.routemm.* run on the Python kernels (more host time per call): "
        f"{KERNELS_REASON}. Build the C++ kernels from a checkout with `{BUILD_CPP_KERNELS}`, or set "
        f"{KERNELS_KNOB}=python to choose the Python kernels without this warning",
        RuntimeWarning,
        stacklevel=2,
    )

# The ops are defined through the low-level torch.library.Library API with the real implementation
# registered per dispatch key (CPU, CUDA) and a fake for tracing: the call goes straight from the
# dispatcher to the implementation (about 2 us on the host), where torch.library.custom_op's
# wrapper adds about 8 us more per call, the whole budget of an eager decode-loop call.
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")

_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _no_gradient(out: torch.Tensor, inputs: list[torch.Tensor], op: str, names: str) -> torch.Tensor:
    """routemm::_no_gradient: `out`, the result of `op`, with a grad_fn whose backward raises
    routemm.UnsupportedError naming `op` and the arguments `names` (", "-separated, one per
    tensor of `inputs`, those that require grad); the autograd kernels of both kernel sets call it
    (see _tensor_ops.Framework.forward_only)."""
    return _TORCH.forward_only(op, out, zip(names.split(", "), inputs, strict=True))


_LIBRARY.define("_no_gradient" + torch.library.infer_schema(_no_gradient, mutates_args=()))
_LIBRARY.impl("_no_gradient", _no_gradient, "CompositeImplicitAutograd")


def refuse_backward(grad: torch.Tensor, inputs: list[torch.Tensor], message: str) -> list[torch.Tensor]:
    """The gradients of `inputs` through an output that has none: raises routemm.UnsupportedError
    (message) when run, through routemm::_refuse_backward (defined with the torch framework of the
    tensor call path, _tensor_ops)."""
    return torch.ops.routemm._refuse_backward(grad, inputs, message)


# Ops with a backward: name -> the callable that runs the op with its gradients (an
# autograd.Function's apply, reached through the op routemm::_<name>_grad).
_GRADIENTS: dict[str, Callable] = {}


def _autograd_kernel(name: str) -> Callable:
    """The autograd kernel of `routemm::<name>` served by Python kernels (for every autograd key):
    the op runs below autograd, and with grad mode on and an input that requires grad its output
    goes through routemm::_no_gradient. The C++ kernels register the same in C++."""
    overload = getattr(getattr(torch.ops, NAMESPACE), name).default
    arguments = [a.name for a in overload._schema.arguments]
    qualified = f"{NAMESPACE}::{name}"

    gradient = _GRADIENTS.get(name)

    def kernel(keyset, *args, **kwargs):
        if gradient is not None and torch.is_grad_enabled():
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return gradient(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            out = overload.redispatch(keyset & _AFTER_AUTOGRAD, *args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        needs = [
            (n, a) for n, a in zip(arguments, args, strict=False) if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        if not needs:
            return out
        names, inputs = ", ".join(n for n, _ in needs), [a for _, a in needs]

        def refused(t):  # every floating-point output refuses at backward; index outputs have no grad
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                return t
            return torch.ops.routemm._no_gradient(t, inputs, qualified, names)

        return tuple(refused(t) for t in out) if isinstance(out, tuple) else refused(out)

    return kernel


def define_op(name: str, impl: Callable, fake: Callable, *, mutates_args=()) -> object:
    """Register `routemm::<name>` with its real and fake implementations (once per process); the
    schema is inferred from `impl`'s type annotations. An op the C++ kernels serve keeps them as
    its CPU, CUDA and autograd kernels, and `impl` is not registered; any other op gets `impl` and
    _autograd_kernel (its backward raises routemm.UnsupportedError)."""
    if name in OPS:
        return OPS[name]
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=mutates_args))
    if name not in _CPP_OPS:
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, impl, key)
        _LIBRARY.impl(name, _autograd_kernel(name), "Autograd", with_keyset=True)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
    OPS[name] = op = getattr(getattr(torch.ops, NAMESPACE), name)
    return op


# ---- matmul_id ----------------------------------------------------------------------------------


def _matmul_id_shape(weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> tuple[int, int]:
    m, top_k, _, n, _, _ = _check_shapes(weights.shape, x.shape, ids.shape)
    if x.dtype != torch.float32:
        raise InvalidArgumentError(f"matmul_id activations must be float32, got {x.dtype}")
    return m * top_k, n


def _matmul_id(weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """out[t*top_k + s] = weights[ids[t, s]] @ x[t] (or x[t, s] for [m, top_k, k] input); ids
    outside [0, n_experts) give zero rows."""
    return _tensor_ops.matmul_id(_TORCH, weights, x, ids, op_kernel=True)


def _matmul_id_fake(weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    rows, n = _matmul_id_shape(weights, x, ids)
    return x.new_empty((rows, n), dtype=torch.float32)


# ---- quantized_matmul_id ------------------------------------------------------------------------


def _check_ggml_type(ggml_type: str) -> None:
    if ggml_type not in _QUANTIZED_EXPERT_TYPES:
        raise InvalidArgumentError(f"quantized_matmul_id ggml_type must be one of {_TYPE_NAMES}, got {ggml_type!r}")


def _quantized_matmul_id_shape(
    weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, ggml_type: str
) -> tuple[int, int]:
    _check_ggml_type(ggml_type)
    if x.dtype != torch.float32:
        raise InvalidArgumentError(f"matmul_id activations must be float32, got {x.dtype}")
    if weights.dtype != torch.uint8:
        raise InvalidArgumentError(f"matmul_id {ggml_type} weights must be uint8 blocks, got {weights.dtype}")
    k = _element_width(weights.shape, GgmlType(ggml_type))
    m, top_k, _, n, _, _ = _check_shapes((*weights.shape[:2], k), x.shape, ids.shape)
    return m * top_k, n


def _quantized_matmul_id(weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """out[t*top_k + s] = dequantize(weights[ids[t, s]]) @ x[t] (or x[t, s] for [m, top_k, k]
    input) for a GGML block stack (uint8 [n_experts, n, k / block_values * block_bytes], ggml_type
    one of routemm.quantized_matmul_id.SUPPORTED_TYPES' values); ids outside [0, n_experts) give zero rows, and repeated ids are computed."""
    _check_ggml_type(ggml_type)  # the rest is checked once per call shape, by its plan
    return _tensor_ops.quantized_matmul_id(_TORCH, weights, x, ids, ggml_type, op_kernel=True)


def _quantized_matmul_id_fake(
    weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, ggml_type: str
) -> torch.Tensor:
    rows, n = _quantized_matmul_id_shape(weights, x, ids, ggml_type)
    return x.new_empty((rows, n), dtype=torch.float32)


# ---- q4_matmul ----------------------------------------------------------------------------------


def _q4_shape(x: torch.Tensor, weight: torch.Tensor, n: int, k: int) -> int:
    if x.dim() != 2 or x.shape[1] != k:
        raise InvalidArgumentError(f"q4_matmul x must be [m, {k}], got shape {tuple(x.shape)}")
    if weight.dtype != torch.uint8:
        raise InvalidArgumentError(f"q4_matmul weight must be uint8 Q4_0 blocks, got {weight.dtype}")
    return int(x.shape[0])


def _q4_matmul(x: torch.Tensor, weight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """out[m, n] = x @ dequantize(weight).T for raw GGUF Q4_0 blocks (n rows of k / 32 blocks of
    18 bytes, as uint8)."""
    _q4_shape(x, weight, n, k)
    return _tensor_ops.q4_matmul(_TORCH, x, weight, n, k)


def _q4_matmul_fake(x: torch.Tensor, weight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    m = _q4_shape(x, weight, n, k)
    _tensor_ops.check_q4_extents(n, k, weight.numel() * weight.element_size())
    return x.new_empty((m, n), dtype=torch.float32)


# ---- moe_experts ----------------------------------------------------------------------------------

_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_model_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _MODEL_DTYPES:
        raise InvalidArgumentError(f"moe_experts {name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_block_type(ggml_type: Optional[str]) -> None:
    if ggml_type is not None and ggml_type not in _QUANTIZED_EXPERT_TYPES:
        raise InvalidArgumentError(f"moe_experts ggml_type must be None or one of {_TYPE_NAMES}, got {ggml_type!r}")


def _float_text(value: float) -> str:
    """A real as the C++ kernels print it (std::to_string: six decimals, nan, inf)."""
    return f"{value:f}"


def _check_ffn_options(
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float,
    gate_up_bias: Optional[torch.Tensor],
    up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    weights_before_ffn: bool,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    up: Optional[torch.Tensor],
) -> dict:
    """The FFN options checked (the C++ kernels' check_ffn_options, in its order and words): the
    activation and its parameters, each bias's dtype and shape against the stacks'. Returns the
    plan's options (the core binding's keywords)."""
    if activation not in ("silu", "swiglu_oai"):
        raise InvalidArgumentError(f"moe_experts activation must be 'silu' or 'swiglu_oai', got '{activation}'")
    with np.errstate(over="ignore"):  # as the C++ kernels cast: a real past float32 becomes inf
        alpha32, limit32 = (float(np.float32(v)) for v in (swiglu_alpha, swiglu_limit))
    if not math.isfinite(alpha32):
        raise InvalidArgumentError(f"moe_experts swiglu_alpha must be finite, got {_float_text(swiglu_alpha)}")
    if not limit32 > 0:
        raise InvalidArgumentError(f"moe_experts swiglu_limit must be > 0, got {_float_text(swiglu_limit)}")
    split = up is not None

    def expect(name: str, b: torch.Tensor, want: tuple) -> None:
        if not b.dtype.is_floating_point:
            raise InvalidArgumentError(f"moe_experts {name} must be a float tensor, got {b.dtype}")
        if tuple(b.shape) != want:
            raise InvalidArgumentError(f"moe_experts {name} must be {want}, got shape {tuple(b.shape)}")

    if gate_up.dim() == 3 and down.dim() == 3:
        # E and I from the gate/up stack's rows (values also for block stacks), H from down's.
        e, h = int(gate_up.shape[0]), int(down.shape[1])
        inter = int(gate_up.shape[1]) if split else int(gate_up.shape[1]) // 2
        if gate_up_bias is not None:
            expect("gate_up_bias", gate_up_bias, (e, inter if split else 2 * inter))
        if up_bias is not None:
            if not (split and gate_up_bias is not None):
                raise InvalidArgumentError("moe_experts up_bias goes with split stacks (up) and gate_up_bias")
            expect("up_bias", up_bias, (e, inter))
        if split and gate_up_bias is not None and up_bias is None:
            raise InvalidArgumentError("moe_experts split stacks take gate_up_bias (the gate's) and up_bias together")
        if down_bias is not None:
            expect("down_bias", down_bias, (e, h))
    return {
        "activation": activation, "swiglu_alpha": alpha32, "swiglu_limit": limit32,
        "gate_up_bias": gate_up_bias is not None, "down_bias": down_bias is not None,
        "weights_before_ffn": bool(weights_before_ffn),
    }  # fmt: skip


def _check_batch_invariant(batch_invariant) -> None:
    if not isinstance(batch_invariant, bool):
        raise InvalidArgumentError(f"moe_experts batch_invariant must be a bool, got {batch_invariant!r}")


def _moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    up: Optional[torch.Tensor] = None,
    ggml_type: Optional[str] = None,
    exact: bool = False,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_up_bias: Optional[torch.Tensor] = None,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    weights_before_ffn: bool = False,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The MoE experts block in the model's dtype: out[t] = sum over slots s (in order) of
    top_k_weights[t, s] * down[e] @ (SiLU(gate[e] @ x[t]) * (up[e] @ x[t])), e = top_k_index[t, s],
    ids outside [0, E) contributing nothing. gate_up [E, 2I, H] (gate rows, then up rows), or the
    gate stack [E, I, H] with `up` the up stack; down [E, H, I]; float stacks, or uint8 GGML block
    stacks of `ggml_type` (a SUPPORTED_TYPES value: 'q4_0', 'q4_k', ...). hidden and top_k_weights float32 / float16 / bfloat16;
    the block computes in F32 and returns hidden's dtype. Route: the block's shape-only rule
    (tensor-core routes from the crossover on CUDA), or the bit-exact F32 routes with exact=True.
    FFN options (routemm.moe_experts'): activation "silu" or "swiglu_oai" with swiglu_alpha and
    swiglu_limit; biases in any float dtype (used as float32): gate_up_bias [E, 2I] (with `up`:
    the gate's [E, I], and up_bias [E, I]), down_bias [E, H]; weights_before_ffn (Llama-4).
    batch_invariant=True: a token's output bits do not depend on m or on the batch's other tokens
    (one accumulation order per row at every m: on CUDA the tensor-core route at every m for the
    stacks that have it, elsewhere the default's per-row-ordered routes; never the fused decode
    route; the default switches routes at the crossovers)."""
    _check_batch_invariant(batch_invariant)
    _check_model_dtype("hidden", hidden)
    _check_model_dtype("top_k_weights", top_k_weights)
    _check_block_type(ggml_type)
    ffn = _check_ffn_options(
        activation, swiglu_alpha, swiglu_limit, gate_up_bias, up_bias, down_bias, weights_before_ffn, gate_up, down, up
    )
    x = hidden.to(torch.float32).contiguous()
    w = top_k_weights.to(torch.float32).contiguous()
    biases = tuple(None if b is None else b.to(torch.float32).contiguous() for b in (gate_up_bias, up_bias, down_bias))
    out = _tensor_ops.moe_experts(
        _TORCH, x, top_k_index, w, gate_up, down, up, ggml_type, exact, ffn=ffn, biases=biases,
        batch_invariant=batch_invariant,
    )  # fmt: skip
    return out if hidden.dtype == torch.float32 else out.to(hidden.dtype)


def _moe_experts_fake(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    up: Optional[torch.Tensor] = None,
    ggml_type: Optional[str] = None,
    exact: bool = False,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_up_bias: Optional[torch.Tensor] = None,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    weights_before_ffn: bool = False,
    batch_invariant: bool = False,
) -> torch.Tensor:
    _check_batch_invariant(batch_invariant)
    _check_model_dtype("hidden", hidden)
    _check_model_dtype("top_k_weights", top_k_weights)
    _check_block_type(ggml_type)
    _check_ffn_options(
        activation, swiglu_alpha, swiglu_limit, gate_up_bias, up_bias, down_bias, weights_before_ffn, gate_up, down, up
    )
    if hidden.dim() != 2:
        raise InvalidArgumentError(f"moe_experts hidden must be [m, H], got shape {tuple(hidden.shape)}")
    return hidden.new_empty(hidden.shape)


matmul_id = define_op("matmul_id", _matmul_id, _matmul_id_fake)
q4_matmul = define_op("q4_matmul", _q4_matmul, _q4_matmul_fake)
quantized_matmul_id = define_op("quantized_matmul_id", _quantized_matmul_id, _quantized_matmul_id_fake)


def _moe_experts_grad(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    up: Optional[torch.Tensor] = None,
    ggml_type: Optional[str] = None,
    exact: bool = False,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_up_bias: Optional[torch.Tensor] = None,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    weights_before_ffn: bool = False,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """routemm::_moe_experts_grad: moe_experts with its gradients (routemm.integrations._moe_autograd), the
    path of a call whose inputs require grad in grad mode."""
    from ._moe_autograd import MoeExpertsFunction

    _check_batch_invariant(batch_invariant)
    return MoeExpertsFunction.apply(
        hidden, top_k_index, top_k_weights, gate_up, down, up, ggml_type, exact, activation, swiglu_alpha,
        swiglu_limit, gate_up_bias, up_bias, down_bias, weights_before_ffn, batch_invariant,
    )  # fmt: skip


_LIBRARY.define("_moe_experts_grad" + torch.library.infer_schema(_moe_experts_grad, mutates_args=()))
_LIBRARY.impl("_moe_experts_grad", _moe_experts_grad, "CompositeImplicitAutograd")
_GRADIENTS["moe_experts"] = torch.ops.routemm._moe_experts_grad
moe_experts = define_op("moe_experts", _moe_experts, _moe_experts_fake)


# ---- moe_gate -------------------------------------------------------------------------------------


def _moe_gate(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: Optional[torch.Tensor] = None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    router_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router scores and top-k selection (routemm.moe_gate's contract and routing options):
    (weights float32 [m, top_k], ids int32 [m, top_k]) from float32 logits [m, n_experts], on the
    current stream."""
    return _tensor_ops.moe_gate(
        _TORCH, router_logits, top_k, renormalize, scoring_func, e_score_correction_bias, num_expert_group,
        topk_group, routed_scaling_factor, router_bias,
    )  # fmt: skip


def _moe_gate_fake(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: Optional[torch.Tensor] = None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    router_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if router_logits.dim() != 2:
        raise InvalidArgumentError(f"moe_gate router_logits must be 2-D, got shape {tuple(router_logits.shape)}")
    if router_logits.dtype != torch.float32:
        raise InvalidArgumentError(f"moe_gate router_logits must be float32, got {router_logits.dtype}")
    m, n_experts = router_logits.shape
    if not 1 <= top_k <= n_experts:
        raise InvalidArgumentError(f"moe_gate top_k {top_k} must be in [1, n_experts = {n_experts}]")
    for name, bias in (("e_score_correction_bias", e_score_correction_bias), ("router_bias", router_bias)):
        if bias is not None and bias.dtype != torch.float32:
            raise InvalidArgumentError(f"moe_gate {name} must be float32, got {bias.dtype}")
        if bias is not None and tuple(bias.shape) != (n_experts,):
            raise InvalidArgumentError(
                f"moe_gate {name} must have shape (n_experts,) = ({n_experts},), got {tuple(bias.shape)}"
            )
    return router_logits.new_empty((m, top_k)), router_logits.new_empty((m, top_k), dtype=torch.int32)


moe_gate = define_op("moe_gate", _moe_gate, _moe_gate_fake)


def op(name: str) -> Optional[object]:
    """The registered op `routemm::<name>`, or None."""
    return OPS.get(name)
