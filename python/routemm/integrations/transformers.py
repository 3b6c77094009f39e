"""Hugging Face transformers: routemm as an experts implementation.

    import routemm.integrations.transformers as rt
    rt.register()
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="routemm")

`register()` adds `experts_forward` to transformers' experts registry
(`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`) under the name "routemm"; every experts
module built with `@use_experts_implementation` (Qwen3-MoE, Mixtral, ...) then runs its forward
through `routemm.moe_experts` when the model's experts implementation is "routemm".

Supported modules: gated SiLU experts stored as transformers stores them by default -- `gate_up_proj`
[E, 2I, H] (gate rows, then up rows), `down_proj` [E, H, I], no bias, no post-expert norm -- in
float32, float16 or bfloat16. Anything else raises routemm.InvalidArgumentError instead of computing
something else. The forward is one call of torch.ops.routemm.moe_experts: one crossing into the
core on the current stream, no host read of the ids and no host wait, so the block runs inside a
CUDA graph and under torch.compile; it takes and returns the model's dtype (the block computes in
F32 inside) and picks the block's route from the shapes (the tensor-core route from the crossover
on CUDA). Under expert parallelism transformers passes sentinel ids (>= the local expert count)
with zero weights; routemm skips them without reading a weight.

Which implementation ran: `calls()` counts the forwards routemm computed in this process (eager calls;
calls inside torch.compile'd code and CUDA graph replays run no Python of this module and are not
counted), and the first one logs an INFO line on the "routemm" logger. transformers records the
experts implementation in the config object a model is built from, so one config shared by two
models gives both the implementation of the last one built: calls() staying put shows it.

Training: the op has a backward for float stacks (routemm.integrations._moe_autograd), so loss.backward()
gives the experts, the hidden states and the routing weights their gradients; a forward with
parameters that require grad gives the no-grad result bit for bit.
"""

from __future__ import annotations

import logging

from ..core._errors import InvalidArgumentError

IMPLEMENTATION_NAME = "routemm"

_LOG = logging.getLogger("routemm.integrations.transformers")  # propagates to the "routemm" logger

# Forwards computed by routemm in this process (a dict, so torch.compile would not guard on it).
_CALLS = {"n": 0}


def calls() -> int:
    """How many experts forwards routemm has computed in this process (eager calls; calls traced by
    torch.compile and CUDA graph replays are not counted). A model built with
    experts_implementation="routemm" that leaves this unchanged did not run routemm."""
    return _CALLS["n"]


def _is_silu(act) -> bool:
    import torch

    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # older transformers use torch.nn.SiLU only
        SiLUActivation = torch.nn.SiLU
    return isinstance(act, (torch.nn.SiLU, SiLUActivation))


def _check_module(module) -> None:
    unsupported = [
        name
        for name, bad in (
            ("biases", getattr(module, "has_bias", False)),
            ("ungated experts", not getattr(module, "has_gate", True)),
            ("transposed expert weights", getattr(module, "is_transposed", False)),
            ("interleaved gate/up rows", not getattr(module, "is_concatenated", True)),
            ("a post-expert norm", getattr(module, "has_post_expert_norm", False)),
            ("an activation other than SiLU", not _is_silu(getattr(module, "act_fn", None))),
        )
        if bad
    ]
    if unsupported:
        raise InvalidArgumentError(
            f"routemm experts implementation: {type(module).__name__} has {', '.join(unsupported)}, "
            "which routemm.moe_experts does not compute"
        )


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts forward of transformers' experts modules, computed by torch.ops.routemm.moe_experts.

    hidden_states [tokens, H], top_k_index [tokens, top_k], top_k_weights [tokens, top_k] -> [tokens, H]
    in the dtype of hidden_states.
    """
    import torch

    from . import torch as _ops  # noqa: F401  (registers torch.ops.routemm.*)

    # The module's layout flags are fixed when the model is built: checked on its first call only
    # (the mark is not set while torch.compile traces, where the check costs nothing per call).
    if not getattr(self, "_routemm_checked", False):
        _check_module(self)
        if not torch.compiler.is_compiling():
            object.__setattr__(self, "_routemm_checked", True)
    # No torch.no_grad() here: where a gradient is asked for (grad mode on, parameters or hidden
    # states that require grad) the op records its backward.
    out = torch.ops.routemm.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
    if not torch.compiler.is_compiling():  # counting under a trace would guard on the count
        _CALLS["n"] += 1
        if _CALLS["n"] == 1:
            _LOG.info(
                "routemm experts implementation: first call (%s, %s, %d tokens)",
                type(self).__name__,
                hidden_states.dtype,
                hidden_states.shape[0],
            )
    return out


def register(name: str = IMPLEMENTATION_NAME) -> None:
    """Add routemm to transformers' experts implementations under `name` (default "routemm")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
