"""routemm as a Hugging Face transformers experts implementation, against transformers' own eager
experts, on small random Qwen3-MoE and Mixtral models (CPU tensors; skipped without torch or
transformers).

Tolerances: the float32 models run every expert product in float32 on both sides with different
summation orders (measured: logits of magnitude ~0.6 differ by <= 1.5e-7), checked at 1e-5 absolute
+ relative; the eager bfloat16 models round the experts' activations to bfloat16 where routemm keeps
float32 (measured: <= 3.9e-3), checked at 2e-2.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import routemm  # noqa: E402
import routemm.integrations.transformers as routemm_transformers  # noqa: E402
from torch_devices import torch_devices  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward  # noqa: E402

F32_TOL = 1e-5
BF16_TOL = 2e-2


def _qwen3_moe(norm_topk_prob: bool):
    return transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
    )


def _mixtral():
    return transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


CONFIGS = {
    "qwen3_moe": lambda: _qwen3_moe(True),
    "qwen3_moe_unnormalized": lambda: _qwen3_moe(False),
    "mixtral": _mixtral,
}


@pytest.fixture(autouse=True)
def _registered():
    routemm_transformers.register()
    assert "routemm" in ALL_EXPERTS_FUNCTIONS


@pytest.mark.parametrize("torch_device", torch_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tokens", [1, 24])
def test_model_logits_match_eager_experts(name, dtype, tokens, torch_device):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    # from_config records the implementation in the config it is given: one copy per model.
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), experts_implementation="routemm", dtype=dtype
    )
    model.eval()
    assert model.config._experts_implementation == "routemm"
    eager = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), experts_implementation="eager", dtype=dtype
    )
    assert eager.config._experts_implementation == "eager"
    eager.load_state_dict(model.state_dict())
    eager.eval()
    model.to(torch_device)
    eager.to(torch_device)
    input_ids = torch.randint(0, config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(torch_device)
    before = routemm.dispatch_count()
    with torch.no_grad():
        ours = model(input_ids).logits.float()
        theirs = eager(input_ids).logits.float()
    # Every MoE block ran through routemm: per layer gate_up, SiLU*up, down and the combine, or on
    # CUDA's fused decode route (few rows per expert) its two launches.
    n_experts = getattr(config, "num_experts", None) or config.num_local_experts
    fused = str(torch_device).startswith("cuda") and input_ids.numel() * config.num_experts_per_tok < 2 * n_experts
    per_layer = 2 if fused else 4
    assert routemm.dispatch_count() - before >= per_layer * config.num_hidden_layers
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


def _experts_module(config, dtype=torch.float32):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config._experts_implementation = "routemm"
    module = Qwen3MoeExperts(config).to(dtype)
    torch.nn.init.normal_(module.gate_up_proj, std=0.1)
    torch.nn.init.normal_(module.down_proj, std=0.1)
    return module


def test_expert_parallel_sentinel_ids_contribute_zero():
    """The expert-parallel contract at the experts function: the module holds this rank's experts
    (num_experts = the local count, _is_expert_parallel set) and off-rank slots carry sentinel ids
    >= that count with zero weights. routemm's result equals transformers' batched_mm experts,
    which clamps and masks those slots."""
    torch.manual_seed(3)
    module = _experts_module(_qwen3_moe(True))
    module._is_expert_parallel = True
    tokens, top_k, local = 16, 2, module.num_experts
    hidden = torch.randn(tokens, 64)
    ids = torch.randint(0, local, (tokens, top_k))
    ids[::3, 1] = local  # off-rank slots: sentinels
    ids[1::4, 0] = local
    weights = torch.rand(tokens, top_k)
    weights[ids >= local] = 0.0
    with torch.no_grad():
        ours = routemm_transformers.experts_forward(module, hidden, ids, weights)
        theirs = batched_mm_experts_forward(module, hidden, ids, weights)
    torch.testing.assert_close(ours, theirs, atol=F32_TOL, rtol=F32_TOL)
    # Every slot off-rank: exactly zero, with NaN weights in place of the local experts.
    with torch.no_grad():
        module.gate_up_proj.fill_(float("nan"))
        module.down_proj.fill_(float("nan"))
        zero = routemm_transformers.experts_forward(module, hidden, torch.full_like(ids, local), weights)
    assert torch.equal(zero, torch.zeros_like(zero))


def test_unsupported_experts_are_refused():
    module = _experts_module(_qwen3_moe(True))
    module.act_fn = torch.nn.GELU()
    with pytest.raises(routemm.InvalidArgumentError, match="activation other than SiLU"):
        routemm_transformers.experts_forward(module, torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.long),
                                             torch.zeros(2, 2))  # fmt: skip


def test_result_is_in_the_hidden_dtype():
    module = _experts_module(_qwen3_moe(True), torch.bfloat16)
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0]])
    weights = torch.rand(5, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        out = routemm_transformers.experts_forward(module, hidden, ids, weights)
        ref = batched_mm_experts_forward(module.float(), hidden.float(), ids, weights.float())
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().numpy(), ref.numpy(), atol=BF16_TOL, rtol=BF16_TOL)


def test_calls_counts_the_routemm_experts_forwards_and_shows_a_shared_config():
    """calls() says whether routemm ran: one per MoE layer per forward; none for a model built eager,
    and none where one config object made both models eager (from_config records the implementation
    in the config it is given)."""
    config = _qwen3_moe(True)
    input_ids = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="eager")
    before = routemm_transformers.calls()
    with torch.no_grad():
        eager(input_ids)
    assert routemm_transformers.calls() == before
    shared = copy.deepcopy(config)
    ours = transformers.AutoModelForCausalLM.from_config(shared, experts_implementation="routemm")
    with torch.no_grad():
        ours(input_ids)
    assert routemm_transformers.calls() == before + config.num_hidden_layers
    transformers.AutoModelForCausalLM.from_config(shared, experts_implementation="eager")
    with torch.no_grad():
        ours(input_ids)
    assert routemm_transformers.calls() == before + config.num_hidden_layers, "the shared config made it eager"


def test_a_refused_call_is_not_counted():
    module = _experts_module(_qwen3_moe(True))
    module.act_fn = torch.nn.GELU()
    before = routemm_transformers.calls()
    with pytest.raises(routemm.InvalidArgumentError):
        routemm_transformers.experts_forward(module, torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.long),
                                             torch.zeros(2, 2))  # fmt: skip
    assert routemm_transformers.calls() == before


def test_first_use_is_logged_once_on_the_routemm_logger(monkeypatch, caplog):
    monkeypatch.setitem(routemm_transformers._CALLS, "n", 0)  # as in a fresh process
    module = _experts_module(_qwen3_moe(True))
    hidden, ids, weights = torch.randn(3, 64), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
    with caplog.at_level("INFO", logger="routemm"), torch.no_grad():
        routemm_transformers.experts_forward(module, hidden, ids, weights)
        routemm_transformers.experts_forward(module, hidden, ids, weights)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("routemm")]
    assert lines == ["routemm experts implementation: first call (Qwen3MoeExperts, torch.float32, 3 tokens)"]
    assert routemm_transformers.calls() == 2
