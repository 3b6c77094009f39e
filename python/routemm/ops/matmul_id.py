"""`routemm.matmul_id`: the expert-ID product on NumPy arrays and PyTorch / CuPy tensors, over a
dense expert stack or a GGML block stack.

The one front door above the explicit ops: NumPy arrays run through dense_matmul_id or
quantized_matmul_id (copied to a device, encoded, waited for), tensors through the tensor call path
(_tensor_ops: in place, on the framework's current stream). routemm Buffers belong to the explicit
front doors and are refused here.
"""

from __future__ import annotations

from .. import _core
from ..core._devices import _resolve_device
from ..core._errors import InvalidArgumentError
from . import _tensor_ops, dense_matmul_id, quantized_matmul_id
from .dense_matmul_id import _framework


def matmul_id(
    weights,
    x,
    ids,
    *,
    route=None,
    out=None,
    device=None,
    ggml_type=None,
    return_receipt: bool = False,
):
    """Expert-ID matmul on arrays; returns the [m*top_k, n] float32 result.

    weights: [n_experts, n, k] float32, float16 or bfloat16; with ``ggml_type`` (GgmlType.Q4_0 or
        GgmlType.Q8_0) a uint8 block stack [n_experts, n, k / 32 * block_bytes] as routemm.q4_0 /
        routemm.q8_0 quantise it (and GGUF stores it), run by quantized_matmul_id_ggml.
    x: [m, k] float32 (one row per token) or [m, top_k, k] (one row per token and slot).
    ids: [m, top_k] integers; ids outside [0, n_experts) give zero rows and never count as experts.
    route: None picks grouped_prefill (quantised: grouped) when the valid ids are distinct per
        token, top_k <= n_experts, m > 8 and, on CUDA, at least 8 rows are routed per expert on
        average (256 with ggml_type), else direct (auto_grouped); explicit routes are
        DenseMatmulIdRoute values, or GgmlQuantizedMatmulIdRoute values with ggml_type.
    out: optional C-contiguous float32 array of [m*top_k, n] to write the result into.
    device: a routemm.Device or a backend name ("cpu", ...) for NumPy inputs (default: the best
        available backend).
    return_receipt: return (result, receipt) instead, the receipt (DenseMatmulIdDispatchReceipt,
        or GgmlQuantizedMatmulIdDispatchReceipt with ggml_type) saying which route ran (the one
        the automatic choice took when `route` is None).

    NumPy inputs are copied to the device and the result comes back as a NumPy array. PyTorch and
    CuPy tensors (CPU or CUDA) are used in place through DLPack, on the device they live on, and the
    result is a tensor of the same framework and device; they must be C-contiguous. On tensors
    the call is enqueued on the framework's current stream and returns without waiting (CPU
    tensors: once the result is written), and route None picks by the shapes and the backend only
    (auto_grouped, ids taken as distinct when top_k <= n_experts): device ids are never read on the
    host.
    """
    _refuse_buffers(weights=weights, x=x, ids=ids, out=out)
    framework = _framework(x)
    if ggml_type is not None:
        device = _resolve_device(device)
        ggml_type = quantized_matmul_id._supported_type(ggml_type)
        if framework != "numpy":
            result, receipt = _matmul_id_quantized_tensors(framework, weights, x, ids, ggml_type, route, out)
        else:
            result, receipt = quantized_matmul_id._matmul_id_numpy(weights, x, ids, ggml_type, route, out, device)
    elif framework != "numpy":
        result, receipt = _matmul_id_tensors(framework, weights, x, ids, route, out)
    else:
        result, receipt = dense_matmul_id._matmul_id_numpy(weights, x, ids, route, out, device)
    return (result, receipt) if return_receipt else result


def _refuse_buffers(**arguments) -> None:
    """matmul_id shapes arrays; routemm Buffers belong to the explicit path."""
    for name, value in arguments.items():
        if isinstance(value, _core.Buffer):
            raise InvalidArgumentError(
                f"matmul_id takes NumPy arrays or PyTorch / CuPy tensors, and {name} is a routemm.Buffer: "
                "call dense_matmul_id with buffers, or pass buffer.numpy()"
            )


def _matmul_id_tensors(framework, weights, x, ids, route, out):
    """matmul_id for PyTorch / CuPy tensors: in place, on the framework's current stream, route by
    shape only (see _tensor_ops.matmul_id)."""
    return _tensor_ops.matmul_id(_tensor_ops.framework(framework), weights, x, ids, route, out, with_receipt=True)


def _matmul_id_quantized_tensors(framework, weights, x, ids, ggml_type, route, out):
    """The tensor path of a block stack: PyTorch / CuPy tensors used in place on their device,
    through the tensor ops' call path (_tensor_ops.quantized_matmul_id): enqueued on the
    framework's current stream with no host wait, and route None picks by the shapes and the
    backend only. Device ids are never read on the host; every route computes repeated ids."""
    if route is not None:
        route = quantized_matmul_id._quantized_route(route, False, 0, None, 0, 0).value
    out, native = _tensor_ops.quantized_matmul_id(
        _tensor_ops.framework(framework), weights, x, ids, ggml_type.value, route, out, with_receipt=True
    )
    return out, quantized_matmul_id._receipt_of(native)
