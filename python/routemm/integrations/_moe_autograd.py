"""The gradients of the MoE experts block (torch.ops.routemm.moe_experts) for float stacks.

For every token t and valid slot s (e = ids[t, s] in [0, E)), with x = hidden[t] and w = the
routing weight, the forward computes

    g = W_gate[e] x,  u = W_up[e] x,  a = SiLU(g) * u,  y = W_down[e] a,  out[t] += w * y

so, with gy = dL/dout[t] and dy = w * gy:

    dL/dw         = <gy, y>
    dL/dW_down[e] += dy a^T,                      da = W_down[e]^T dy
    dg = da * u * SiLU'(g),  du = da * SiLU(g),   SiLU'(g) = s (1 + g (1 - s)), s = sigmoid(g)
    dL/dW_gate[e] += dg x^T,  dL/dW_up[e] += du x^T
    dL/dx         += W_gate[e]^T dg + W_up[e]^T du

Invalid ids contribute nothing and receive nothing. The backward recomputes g, u, a and y (nothing
is saved beyond the inputs) expert by expert in F32 with torch's matmuls, on the inputs' device;
each gradient comes back in its input's dtype. Block stacks (uint8 GGML blocks) are frozen weights,
as in QLoRA: the gradients reach hidden, the routing weights and the biases, each expert's weights
dequantised on the device when its turn comes (_ggml_torch, the reference dequantiser's values);
the stacks themselves, integer tensors, cannot ask for a gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._ggml_torch import dequantize


class _Experts:
    """Expert e's gate, up and down matrices in F32: float stacks sliced (any leaf that wants a
    gradient included), GGML block stacks of `ggml_type` dequantised one expert at a time, never
    the whole stack. gate_up [E, 2I, .] (gate rows, then up rows) or, with `up`, the gate stack."""

    def __init__(self, gate_up, down, up, ggml_type: Optional[str]):
        self._stacks = (gate_up, up, down)
        self._ggml_type = ggml_type
        self.inter = int(gate_up.shape[1]) if up is not None else int(gate_up.shape[1]) // 2

    def _f32(self, weights: torch.Tensor) -> torch.Tensor:
        return weights.float() if self._ggml_type is None else dequantize(weights, self._ggml_type)

    def gate(self, e: int) -> torch.Tensor:
        gate_up, up, _ = self._stacks
        return self._f32(gate_up[e] if up is not None else gate_up[e, : self.inter])

    def up(self, e: int) -> torch.Tensor:
        gate_up, up, _ = self._stacks
        return self._f32(up[e] if up is not None else gate_up[e, self.inter :])

    def down(self, e: int) -> torch.Tensor:
        return self._f32(self._stacks[2][e])


def moe_experts_backward(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    up: Optional[torch.Tensor],
    needs: tuple[bool, bool, bool, bool, bool],
    ggml_type: Optional[str] = None,
) -> tuple[Optional[torch.Tensor], ...]:
    """(d hidden, d weights, d gate_up, d down, d up) of the block for the inputs `needs` names
    (None for the others), given d out. Block stacks (ggml_type) give none of their own."""
    experts = _Experts(gate_up, down, up, ggml_type)
    n_experts, inter = int(down.shape[0]), experts.inter
    m, top_k = (int(d) for d in ids.shape)
    x = hidden.detach().float()
    gy_all = grad_out.detach().float()
    w_all = weights.detach().float().reshape(-1)
    flat = ids.detach().reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < n_experts)
    key = torch.where(valid, flat, torch.full_like(flat, n_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts].tolist()  # one host read
    token = torch.arange(m, device=ids.device).repeat_interleave(top_k)
    need_x, need_w, need_gu, need_down, need_up = needs
    dx = torch.zeros_like(x) if need_x else None
    dw = torch.zeros(m * top_k, dtype=torch.float32, device=x.device) if need_w else None
    split = up is not None
    dgu = torch.zeros(gate_up.shape, dtype=torch.float32, device=x.device) if need_gu else None
    dup = torch.zeros(up.shape, dtype=torch.float32, device=x.device) if split and need_up else None
    ddown = torch.zeros(down.shape, dtype=torch.float32, device=x.device) if need_down else None
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        t = token[slots]
        xs, gy = x[t], gy_all[t]
        w_gate, w_up, w_down = experts.gate(e), experts.up(e), experts.down(e)
        g, u = xs @ w_gate.T, xs @ w_up.T
        s = torch.sigmoid(g)
        silu = g * s
        a = silu * u
        if dw is not None:
            dw[slots] = (gy * (a @ w_down.T)).sum(-1)
        dy = gy * w_all[slots, None]
        if ddown is not None:
            ddown[e] += dy.T @ a
        if not (need_x or need_gu or need_up):
            continue
        da = dy @ w_down
        dg = da * u * (s * (1 + g * (1 - s)))
        du = da * silu
        if dgu is not None:
            if split:
                dgu[e] += dg.T @ xs
            else:
                dgu[e, :inter] += dg.T @ xs
                dgu[e, inter:] += du.T @ xs
        if dup is not None:
            dup[e] += du.T @ xs
        if dx is not None:
            dx.index_add_(0, t, dg @ w_gate + du @ w_up)
    return (
        None if dx is None else dx.to(hidden.dtype),
        None if dw is None else dw.reshape(m, top_k).to(weights.dtype),
        None if dgu is None else dgu.to(gate_up.dtype),
        None if ddown is None else ddown.to(down.dtype),
        None if dup is None else dup.to(up.dtype),
    )


def moe_experts_ffn_backward(grad_out, hidden, ids, weights, gate_up, down, up, biases, options, needs, ggml_type=None):
    """The gradients of the block with FFN options (activation swiglu_oai, biases,
    weights_before_ffn): the forward recomputed expert by expert in F32 with torch's operations
    (each option as routemm.moe_experts defines it) and differentiated by torch autograd. `biases`:
    (gate_up or gate, up, down) or None each; `needs`: which of (hidden, weights, gate_up, down, up,
    gate_up_bias, up_bias, down_bias) want a gradient. Returns those gradients (None elsewhere), each
    in its input's dtype. Block stacks (ggml_type) are not leaves: their experts come dequantised."""
    activation, alpha, limit, before = options
    inputs = (hidden, weights, gate_up, down, up, *biases)
    leaves = [
        None if t is None or (ggml_type is not None and i in (2, 3, 4)) else t.detach().float().requires_grad_(need)
        for i, (t, need) in enumerate(zip(inputs, needs, strict=True))
    ]
    x, w_all, gu, dn, upw, b_gu, b_up, b_dn = leaves
    experts = _Experts(gate_up, down, up, ggml_type) if ggml_type is not None else _Experts(gu, dn, upw, None)
    n_experts, inter = int(down.shape[0]), experts.inter
    m, top_k = (int(d) for d in ids.shape)
    flat = ids.detach().reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < n_experts)
    key = torch.where(valid, flat, torch.full_like(flat, n_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts].tolist()  # one host read
    token = torch.arange(m, device=ids.device).repeat_interleave(top_k)
    split = up is not None
    with torch.enable_grad():
        out = torch.zeros((m, int(down.shape[1])), dtype=torch.float32, device=hidden.device)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            t = token[slots]
            w = w_all.reshape(-1)[slots, None]
            xs = x[t] * w if before else x[t]
            g = xs @ experts.gate(e).T
            u = xs @ experts.up(e).T
            if b_gu is not None:
                g = g + (b_gu[e] if split else b_gu[e, :inter])
                u = u + (b_up[e] if split else b_gu[e, inter:])
            if activation == "swiglu_oai":
                g = torch.clamp(g, max=limit)
                u = torch.clamp(u, min=-limit, max=limit)
                a = g * torch.sigmoid(alpha * g) * (u + 1)
            else:
                a = g * torch.sigmoid(g) * u
            y = a @ experts.down(e).T
            if b_dn is not None:
                y = y + b_dn[e]
            out = out.index_add(0, t, y if before else y * w)
        wanted = [leaf for leaf, need in zip(leaves, needs, strict=True) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_out.detach().float(), allow_unused=True))
    result = []
    for t, leaf, need in zip(inputs, leaves, needs, strict=True):
        if not need:
            result.append(None)
            continue
        grad = next(grads)
        result.append((torch.zeros_like(leaf) if grad is None else grad).to(t.dtype))
    return tuple(result)


class MoeExpertsFunction(torch.autograd.Function):
    """torch.ops.routemm.moe_experts with its gradients: the forward is the op itself (run below
    autograd), the backward moe_experts_backward (moe_experts_ffn_backward with FFN options)."""

    @staticmethod
    def forward(
        ctx, hidden, ids, weights, gate_up, down, up, ggml_type, exact, activation="silu", swiglu_alpha=1.702,
        swiglu_limit=7.0, gate_up_bias=None, up_bias=None, down_bias=None, weights_before_ffn=False,
        batch_invariant=False,
    ):  # fmt: skip
        with torch._C._AutoDispatchBelowAutograd():
            out = torch.ops.routemm.moe_experts(
                hidden, ids, weights, gate_up, down, up, ggml_type, exact, activation, swiglu_alpha, swiglu_limit,
                gate_up_bias, up_bias, down_bias, weights_before_ffn, batch_invariant,
            )  # fmt: skip
        ctx.ggml_type = ggml_type
        ctx.options = (activation, float(swiglu_alpha), float(swiglu_limit), bool(weights_before_ffn))
        ctx.plain = activation == "silu" and weights_before_ffn is False and gate_up_bias is None and down_bias is None
        ctx.save_for_backward(hidden, ids, weights, gate_up, down, up, gate_up_bias, up_bias, down_bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, ids, weights, gate_up, down, up, gate_up_bias, up_bias, down_bias = ctx.saved_tensors
        n = ctx.needs_input_grad
        # Block stacks are uint8: torch never asks a gradient of them (n[3], n[4], n[5] False).
        blocks = ctx.ggml_type
        if ctx.plain:
            needs = (n[0], n[2], n[3], n[4], n[5])
            dx, dw, dgu, ddown, dup = moe_experts_backward(
                grad_out, hidden, ids, weights, gate_up, down, up, needs, blocks
            )
            return dx, None, dw, dgu, ddown, dup, None, None, None, None, None, None, None, None, None, None
        needs = (n[0], n[2], n[3], n[4], n[5], n[11], n[12], n[13])
        dx, dw, dgu, ddown, dup, dgub, dupb, ddb = moe_experts_ffn_backward(
            grad_out, hidden, ids, weights, gate_up, down, up, (gate_up_bias, up_bias, down_bias), ctx.options, needs,
            blocks,
        )  # fmt: skip
        return dx, None, dw, dgu, ddown, dup, None, None, None, None, None, dgub, dupb, ddb, None, None
