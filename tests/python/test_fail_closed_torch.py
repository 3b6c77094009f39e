"""Fail closed on the torch tensor path: expert ids of every integer dtype route as int32 ids do (or
are refused by name), no op hands out an output that claims a gradient it never delivers, and
arguments that no kernel can take (meta tensors, an array of another framework, impossible extents)
are refused by name before anything is allocated.

The torch ops come in two kernel sets (routemm.torch): the C++ kernels of routemm._torch_ops and the
Python kernels. Each case runs on both: the C++ set through torch.ops.routemm.* where it is loaded
(its refusals are ValueError with the Python set's message), the Python set through its kernels
directly, and the autograd cases also in a process started with ROUTEMM_TORCH_KERNELS=python.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch as rt  # noqa: E402
from routemm import q4_0  # noqa: E402

E, N, K, TOP_K = 8, 24, 64, 2
Q4_ROW_BYTES = K // 32 * 18

KERNEL_SETS = ["cpp", "python"]


def _kernel(kernel_set: str, name: str):
    """The kernel of torch.ops.routemm.<name> in `kernel_set`: the registered op for the C++ set
    (skipped where it is not loaded), the Python kernel itself for the Python set."""
    if kernel_set == "cpp":
        if rt.KERNELS != "cpp":
            pytest.skip(f"C++ kernels not loaded: {rt.KERNELS_REASON}")
        return getattr(torch.ops.routemm, name)
    return getattr(rt, "_" + name)


def _refusal(kernel_set: str) -> type:
    """What an invalid argument raises: the C++ kernels raise ValueError, the Python ones
    routemm.InvalidArgumentError (also a ValueError)."""
    return ValueError if kernel_set == "cpp" else routemm.InvalidArgumentError


def _refused(kernel_set: str, call, match: str) -> str:
    with pytest.raises(_refusal(kernel_set), match=match) as error:
        call()
    return str(error.value)


# ---- expert ids of every integer dtype ------------------------------------------------------------

# Slots of the ids: an expert, or None for an invalid id, which takes the dtype's invalid values in
# turn (INVALID below). Ids are distinct per token, so every route may take them.
SLOTS = [[1, None], [None, 3], [2, 5], [None, None], [7, 0], [4, None], [None, 6], [3, 2]]

# Per dtype, ids outside [0, E): negatives, E, the dtype's extremes, and values that a narrowing to
# int32 (or a clamp to -1 in the dtype) would turn into an expert: 2**32 + 1 wraps to 1, uint8's -1
# is 255, uint32's 2**32 - 7 reads as -7, uint64's 2**63 + 1 as a negative int64.
INVALID = {
    torch.int8: [-1, E, -128, 127, -3, 100],
    torch.int16: [-1, E, -(2**15), 2**15 - 1, -3, 1000],
    torch.int32: [-1, E, -(2**31), 2**31 - 1, -3, 1000],
    torch.int64: [-1, 2**32 + 1, -(2**40), 2**63 - 1, 2**32 + 3, E],
    torch.uint8: [E, 255, 128, 2**8 - 7, 9, 200],
    torch.uint16: [E, 2**16 - 1, 2**15, 2**16 - 7, 9, 1000],
    torch.uint32: [E, 2**32 - 1, 2**31, 2**32 - 7, 2**31 + 1, 1000],
    torch.uint64: [E, 2**64 - 1, 2**63 + 1, 2**32 + 1, 2**32 + 3, 2**63],
}
INT_DTYPES = list(INVALID)
REFUSED_ID_DTYPES = [torch.bool, torch.float32, torch.float16, torch.float64]

_NUMPY = {
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.uint16: np.uint16,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
}


def _ids(dtype) -> torch.Tensor:
    """SLOTS as `dtype` ids, the invalid slots filled from INVALID[dtype] (int32 -1 for the others)."""
    if dtype not in INVALID:
        return _ids(torch.int32).to(dtype)
    fill = iter(INVALID[dtype] * len(SLOTS))
    rows = [[next(fill) if e is None else e for e in row] for row in SLOTS]
    return torch.from_numpy(np.array(rows, dtype=_NUMPY[dtype]))


def _reference_ids() -> torch.Tensor:
    return torch.tensor([[-1 if e is None else e for e in row] for row in SLOTS], dtype=torch.int32)


def _invalid_rows() -> list[int]:
    return [t * TOP_K + s for t, row in enumerate(SLOTS) for s, e in enumerate(row) if e is None]


def _dense_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, N, K, generator=g), torch.randn(len(SLOTS), K, generator=g)


def _block_stack() -> torch.Tensor:
    rng = np.random.default_rng(1)
    return torch.from_numpy(q4_0.quantize(rng.standard_normal((E, N, K)).astype(np.float32)))


def _check_matches_int32(call, dtype) -> None:
    expected = call(_reference_ids())
    assert bool(torch.all(expected[_invalid_rows()] == 0)) and bool(torch.any(expected != 0))
    got = call(_ids(dtype))
    assert torch.equal(got, expected), dtype


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("m", [len(SLOTS), 32])  # direct; grouped_prefill from 32 tokens
def test_matmul_id_ids_of_every_integer_dtype_match_int32(kernel_set, dtype, m):
    op = _kernel(kernel_set, "matmul_id")
    w, x = _dense_inputs()
    repeat = -(-m // len(SLOTS))
    x = x.repeat(repeat, 1)[:m].contiguous()

    def call(ids):
        return op(w, x, ids.repeat(repeat, 1)[:m].contiguous())

    expected = call(_reference_ids())
    got = call(_ids(dtype))
    assert torch.equal(got, expected)
    assert bool(torch.all(got[_invalid_rows()] == 0)) and bool(torch.any(got != 0))


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_quantized_matmul_id_ids_of_every_integer_dtype_match_int32(kernel_set, dtype):
    op = _kernel(kernel_set, "quantized_matmul_id")
    stack, (_, x) = _block_stack(), _dense_inputs()
    _check_matches_int32(lambda ids: op(stack, x, ids, "q4_0"), dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", [None, "q4_0"])
def test_matmul_id_front_door_ids_of_every_integer_dtype_match_int32(dtype, ggml_type):
    w, x = _dense_inputs()
    if ggml_type is None:
        _check_matches_int32(lambda ids: routemm.matmul_id(w, x, ids), dtype)
    else:
        stack = _block_stack()
        _check_matches_int32(lambda ids: routemm.matmul_id(stack, x, ids, ggml_type=ggml_type), dtype)


def _moe_inputs(seed=2):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(SLOTS), K, generator=g)
    weights = torch.rand(len(SLOTS), TOP_K, generator=g)
    gate_up = torch.randn(E, 2 * 16, K, generator=g) * 0.1
    down = torch.randn(E, K, 16, generator=g) * 0.1
    return hidden, weights, gate_up, down


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("route", [None, "direct", "grouped_prefill"])
def test_moe_experts_ids_of_every_integer_dtype_match_int32(dtype, route):
    hidden, weights, gate_up, down = _moe_inputs()
    expected = routemm.moe_experts(hidden, _reference_ids(), weights, gate_up, down, route=route)
    assert bool(torch.all(expected[3] == 0)) and bool(torch.all(expected[[0, 1, 2, 4, 5, 6, 7]] != 0))
    got = routemm.moe_experts(hidden, _ids(dtype), weights, gate_up, down, route=route)
    assert torch.equal(got, expected)
    # The invalid slots contribute zero: the same as weights of 0 on them.
    zeroed = weights.clone()
    zeroed[_reference_ids() < 0] = 0
    valid_only = routemm.moe_experts(hidden, _reference_ids().clamp(0, E - 1), zeroed, gate_up, down, route="direct")
    torch.testing.assert_close(got, valid_only, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", REFUSED_ID_DTYPES, ids=str)
@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_ops_refuse_ids_that_are_not_integers(kernel_set, dtype):
    w, x = _dense_inputs()
    ids = _ids(dtype)
    match = f"matmul_id ids must be integers, got {dtype}"
    _refused(kernel_set, lambda: _kernel(kernel_set, "matmul_id")(w, x, ids), match)
    qop = _kernel(kernel_set, "quantized_matmul_id")
    _refused(kernel_set, lambda: qop(_block_stack(), x, ids, "q4_0"), match)


@pytest.mark.parametrize("dtype", REFUSED_ID_DTYPES, ids=str)
def test_front_doors_refuse_ids_that_are_not_integers(dtype):
    w, x = _dense_inputs()
    with pytest.raises(routemm.InvalidArgumentError, match=f"matmul_id ids must be integers, got {dtype}"):
        routemm.matmul_id(w, x, _ids(dtype))
    hidden, weights, gate_up, down = _moe_inputs()
    ids = torch.tensor([[1.7, 0.0]] * len(SLOTS)).to(dtype)  # 1.7 would run as expert 1
    with pytest.raises(routemm.InvalidArgumentError, match=f"moe_experts top_k_index must be integers, got {dtype}"):
        routemm.moe_experts(hidden, ids, weights, gate_up, down, route="direct")


# ---- gradients --------------------------------------------------------------------------------


def check_gradients_are_refused_at_backward() -> None:
    """Every routemm op on tensors, under the loaded kernel set: with an input that requires grad
    and grad mode on, the forward runs (bit for bit the no-grad result) and backward raises
    routemm.UnsupportedError naming the op and the arguments; without grad mode the output claims
    no gradient. No warning is the only sign. Runs in this process and in one with
    ROUTEMM_TORCH_KERNELS=python."""
    w, x = _dense_inputs()
    ids = _reference_ids()
    stack = _block_stack()
    blocks = stack[0].contiguous()
    hidden, weights, gate_up, down = _moe_inputs()
    logits = torch.randn(len(SLOTS), E)
    calls = {
        "routemm::matmul_id": (lambda a: torch.ops.routemm.matmul_id(a["w"], a["x"], ids), "weights, x"),
        "routemm::quantized_matmul_id": (
            lambda a: torch.ops.routemm.quantized_matmul_id(stack, a["x"], ids, "q4_0"),
            "x",
        ),
        "routemm::q4_matmul": (lambda a: torch.ops.routemm.q4_matmul(a["x"], blocks, N, K), "x"),
        "routemm.matmul_id": (lambda a: routemm.matmul_id(a["w"], a["x"], ids), "weights, x"),
        "routemm.moe_experts": (
            lambda a: routemm.moe_experts(a["hidden"], ids, weights, a["gate_up"], down, route="direct"),
            "hidden, gate_up",
        ),
        "routemm.moe_gate": (lambda a: routemm.moe_gate(a["logits"], TOP_K, renormalize=True)[0], "router_logits"),
    }
    plain = {"w": w, "x": x, "hidden": hidden, "gate_up": gate_up, "logits": logits}
    grad = {k: v.clone().requires_grad_() for k, v in plain.items()}
    for op, (call, names) in calls.items():
        expected = call(plain)
        assert not expected.requires_grad
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                assert not call(grad).requires_grad
            with torch.inference_mode():
                assert not call(grad).requires_grad
            out = call(grad)
            assert out.requires_grad and torch.equal(out.detach(), expected), op
            loss = (out * 2).sum()
            with pytest.raises(routemm.UnsupportedError) as error:
                loss.backward()
            assert f"{op} has no gradient" in str(error.value) and names in str(error.value), str(error.value)
            with pytest.raises(routemm.UnsupportedError):
                torch.autograd.grad(call(grad).sum(), list(grad.values()), allow_unused=True)
        assert all(t.grad is None for t in grad.values())
    assert isinstance(routemm.UnsupportedError("x"), NotImplementedError)


def test_gradients_are_refused_at_backward():
    check_gradients_are_refused_at_backward()


def test_gradients_are_refused_at_backward_by_the_python_kernels():
    here = Path(__file__).resolve().parent
    code = f"""
        import sys
        sys.path.insert(0, {str(here)!r})
        import routemm.torch as rt
        assert rt.KERNELS == "python", rt.KERNELS
        import test_fail_closed_torch as t
        t.check_gradients_are_refused_at_backward()
        print("ok")
    """
    env = dict(os.environ, ROUTEMM_TORCH_KERNELS="python")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_compiled_forward_with_grad_inputs_runs_and_its_backward_refuses():
    """torch.compile traces the backward of a forward whose inputs require grad while compiling:
    the refusal is compiled in and raised when the backward runs, so compiled inference with
    parameters that require grad still runs."""
    w, x = _dense_inputs()
    ids = _reference_ids()
    w.requires_grad_()

    def step(w, x, ids):
        return torch.ops.routemm.matmul_id(w, x, ids).relu()

    out = torch.compile(step, fullgraph=True)(w, x, ids)
    assert out.requires_grad and torch.equal(out.detach(), step(w.detach(), x, ids))
    with pytest.raises(routemm.UnsupportedError, match="routemm::matmul_id has no gradient.*reach weights"):
        out.sum().backward()
    assert w.grad is None


# ---- arguments no kernel can take -----------------------------------------------------------------


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("n", [-1, 0, 2**32, 2**40])
def test_q4_matmul_refuses_impossible_n_before_allocating(kernel_set, n):
    op = _kernel(kernel_set, "q4_matmul")
    blocks = _block_stack()[0].contiguous()  # [N, K / 32 * 18]
    x = torch.randn(3, K)
    if 1 <= n < 2**32:  # in range: the weight holds N rows, not n
        match = rf"q4_matmul weight must hold n = {n} rows of {K // 32} Q4_0 blocks"
    else:
        match = rf"q4_matmul n must be in \[1, 4294967295\], got {n}"
    _refused(kernel_set, lambda: op(x, blocks, n, K), match)


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_q4_matmul_checks_the_weight_against_n_and_k_before_allocating(kernel_set):
    op = _kernel(kernel_set, "q4_matmul")
    blocks = _block_stack()[0].contiguous()
    x = torch.randn(3, K)
    messages = [
        _refused(kernel_set, lambda: op(x, blocks, 2**31, K), r"weight must hold n = 2147483648 rows of 2 Q4_0 blocks"),
        _refused(kernel_set, lambda: op(x, blocks[:-1], N, K), rf"\({N * Q4_ROW_BYTES} bytes\), got "),
        _refused(kernel_set, lambda: op(torch.randn(3, 40), blocks, N, 40), r"k must be a multiple of 32, got 40"),
        _refused(kernel_set, lambda: op(torch.randn(3, 0), blocks, N, 0), r"k must be in \[1, 4294967295\], got 0"),
    ]
    assert all("q4_matmul" in m for m in messages)
    assert torch.equal(op(x, blocks, N, K), rt._q4_matmul(x, blocks, N, K))  # the valid call still runs


@pytest.mark.parametrize("n", [-1, 2**40])
def test_q4_matmul_fake_refuses_impossible_n(n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(routemm.InvalidArgumentError, match="q4_matmul n must be in"):
        torch.ops.routemm.q4_matmul(torch.empty(3, K), torch.empty(N, Q4_ROW_BYTES, dtype=torch.uint8), n, K)


def test_moe_gate_refuses_meta_tensors_by_name():
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate router_logits.*torch device meta"):
        routemm.moe_gate(torch.empty(4, E, device="meta"), TOP_K, renormalize=True)


@pytest.mark.parametrize("argument", ["hidden", "top_k_index", "top_k_weights", "gate_up", "down"])
def test_moe_experts_refuses_meta_tensors_by_name(argument):
    hidden, weights, gate_up, down = _moe_inputs()
    args = dict(hidden=hidden, top_k_index=_reference_ids(), top_k_weights=weights, gate_up=gate_up, down=down)
    args[argument] = args[argument].to("meta")
    with pytest.raises(routemm.InvalidArgumentError, match=f"moe_experts {argument}.*torch device meta"):
        routemm.moe_experts(**args, route="direct")


@pytest.mark.parametrize("argument", ["top_k_index", "top_k_weights", "gate_up", "down", "up"])
def test_moe_experts_refuses_arrays_of_another_framework_by_name(argument):
    hidden, weights, gate_up, down = _moe_inputs()
    gate, up = gate_up[:, :16].contiguous(), gate_up[:, 16:].contiguous()
    args = dict(top_k_index=_reference_ids(), top_k_weights=weights, gate_up=gate_up, down=down)
    if argument == "up":
        args["gate_up"] = (gate, up.numpy())
        argument = r"gate_up\[1\]"
    else:
        args[argument] = args[argument].numpy()
    with pytest.raises(routemm.InvalidArgumentError, match=f"so {argument} must be one too, got numpy.ndarray"):
        routemm.moe_experts(hidden, **args, route="direct")


# ---- transformers -------------------------------------------------------------------------------


def _tiny_qwen3_moe():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.moe")
    import routemm.integrations.transformers as routemm_transformers

    routemm_transformers.register()
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="routemm")
    return model, torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def test_transformers_training_with_routemm_experts_gives_the_eager_gradients():
    """Training through experts_implementation="routemm" reaches the experts: every parameter
    gets the gradient the "eager" experts give it (the block's backward, routemm.integrations._moe_autograd),
    and inference with parameters that require grad gives the no-grad logits bit for bit."""
    model, input_ids = _tiny_qwen3_moe()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    logits = model(input_ids).logits
    assert logits.requires_grad and torch.equal(logits.detach(), expected)
    model.train()
    grads = {}
    for implementation in ("routemm", "eager"):
        model.set_experts_implementation(implementation)
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["routemm"].keys() == grads["eager"].keys()
    assert any("experts" in n for n in grads["routemm"])
    for name, want in grads["eager"].items():
        got = grads["routemm"][name]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()) + 1e-9), name
