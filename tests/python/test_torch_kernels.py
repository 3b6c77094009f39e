"""The torch ops' two kernel sets: the C++ kernels (routemm._torch_ops) and the Python kernels give
the same bits, the same errors and messages, share the core's device table, and the choice between
them (built torch version, ROUTEMM_TORCH_KERNELS) is honoured and explained."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch as rt  # noqa: E402
from routemm import _core, q4_0, q8_0  # noqa: E402
from routemm.ops import _tensor_ops  # noqa: E402
from tolerances import q4_cuda_default_bound  # noqa: E402

E, N, K = 8, 40, 64

cpp_only = pytest.mark.skipif(rt.KERNELS != "cpp", reason=f"C++ kernels not loaded: {rt.KERNELS_REASON}")


def test_kernel_choice_is_stated():
    assert rt.KERNELS in ("cpp", "python") and rt.KERNELS_REASON
    # CI builds the C++ kernels and says so through the knob: their absence must fail loudly there.
    if os.environ.get("ROUTEMM_TORCH_KERNELS", "").lower() == "cpp":
        assert rt.KERNELS == "cpp"


def _moe(tdev, m, top_k=2, dtype=torch.bfloat16, slotted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    x = torch.randn(*((m, top_k, K) if slotted else (m, K)), generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    return w.to(tdev), x.to(tdev), ids.to(tdev)


def _reference(w, x, ids):
    w64, x64 = w.double().cpu(), x.double().cpu()
    rows = []
    for t in range(ids.shape[0]):
        for s, e in enumerate(ids[t].tolist()):
            row = x64[t, s] if x64.dim() == 3 else x64[t]
            rows.append(w64[e] @ row if 0 <= e < w.shape[0] else torch.zeros(w.shape[1], dtype=torch.float64))
    return torch.stack(rows)


def _python_kernel(w, x, ids):
    """The Python kernel of routemm::matmul_id, called as the dispatcher would."""
    return rt._matmul_id(w, x, ids)


@cpp_only
@pytest.mark.parametrize("m", [1, 32])  # direct, grouped_prefill (12 rows per expert: every backend)
@pytest.mark.parametrize("slotted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmul_id_kernel_sets_agree(tdev, m, slotted, dtype):
    w, x, ids = _moe(tdev, m, top_k=3, dtype=dtype, slotted=slotted)
    cpp = torch.ops.routemm.matmul_id(w, x, ids)
    py = _python_kernel(w, x, ids)
    assert cpp.shape == (m * 3, N) and cpp.dtype == torch.float32 and cpp.device == x.device
    assert torch.equal(cpp.view(torch.int32), py.view(torch.int32))
    assert torch.allclose(cpp.double().cpu(), _reference(w, x, ids), rtol=1e-5, atol=1e-4)


@cpp_only
@pytest.mark.parametrize("m", [3, 12])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64, torch.int16])
def test_invalid_and_wide_ids_agree(tdev, m, id_dtype):
    w, x, ids = _moe(tdev, m)
    ids = ids.to(id_dtype)
    ids[0, 1] = E
    ids[1, 0] = -3
    if id_dtype == torch.int64:
        ids[2, 1] = 2**32 + 1  # would wrap to expert 1 as int32
    cpp = torch.ops.routemm.matmul_id(w, x, ids)
    assert torch.equal(cpp, _python_kernel(w, x, ids))
    expected = _reference(w, x, ids.clamp(-1, E))
    assert torch.allclose(cpp.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    assert bool(torch.all(cpp[1] == 0)) and bool(torch.all(cpp[2] == 0))


@cpp_only
def test_non_contiguous_ids_are_converted(tdev):
    w, x, ids = _moe(tdev, 4)
    wide = torch.cat([ids, ids], dim=1)[:, ::2]  # int32, not contiguous
    assert not wide.is_contiguous()
    assert torch.equal(torch.ops.routemm.matmul_id(w, x, wide), _python_kernel(w, x, wide.contiguous()))


def _q4_blocks(n, k, seed=1):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32)))


@cpp_only
@pytest.mark.parametrize("m", [1, 9])
def test_q4_matmul_kernel_sets_agree(tdev, m):
    blocks = _q4_blocks(N, K).to(tdev)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(tdev)
    cpp = torch.ops.routemm.q4_matmul(x, blocks, N, K)
    py = rt._q4_matmul(x, blocks, N, K)
    assert torch.equal(cpp.view(torch.int32), py.view(torch.int32))
    w = torch.from_numpy(q4_0.dequantize(blocks.cpu().numpy())).double()
    xd = x.double().cpu()
    if tdev == "cuda":
        bound = q4_cuda_default_bound(m, K, (xd.abs() @ w.abs().T).numpy())
        assert np.all(np.abs((cpp.double().cpu() - xd @ w.T).numpy()) <= bound)
    else:
        assert torch.allclose(cpp.double().cpu(), xd @ w.T, rtol=1e-4, atol=1e-3)


def _block_stack(ggml_type: str, seed: int = 2):
    """(uint8 block stack [E, N, K / 32 * block_bytes], the module that quantised it)."""
    fmt = {"q4_0": q4_0, "q8_0": q8_0}[ggml_type]
    rng = np.random.default_rng(seed)
    return torch.from_numpy(fmt.quantize(rng.standard_normal((E, N, K)).astype(np.float32))), fmt


@cpp_only
@pytest.mark.parametrize("m", [1, 32])  # direct; grouped on the CPU (12 rows per expert)
@pytest.mark.parametrize("ggml_type", ["q4_0", "q8_0"])
@pytest.mark.parametrize("slotted", [False, True])
def test_quantized_matmul_id_kernel_sets_agree(tdev, m, ggml_type, slotted):
    stack, fmt = _block_stack(ggml_type)
    _, x, ids = _moe(tdev, m, top_k=3, slotted=slotted)
    ids = ids.long()
    ids[0, 1] = E  # an invalid id: a zero row from both sets
    stack = stack.to(tdev)
    cpp = torch.ops.routemm.quantized_matmul_id(stack, x, ids, ggml_type)
    py = rt._quantized_matmul_id(stack, x, ids, ggml_type)
    assert cpp.shape == (m * 3, N) and cpp.dtype == torch.float32 and cpp.device == x.device
    assert torch.equal(cpp.view(torch.int32), py.view(torch.int32))
    deq = torch.from_numpy(fmt.dequantize(stack.cpu().numpy()))
    assert torch.allclose(cpp.double().cpu(), _reference(deq, x, ids), rtol=1e-5, atol=1e-4)
    assert bool(torch.all(cpp[1] == 0))


def _bad_quantized_calls():
    stack, _ = _block_stack("q4_0")
    _, x, ids = _moe("cpu", 3)
    return {
        "ggml type": (stack, x, ids, "q4_k"),
        "row bytes": (stack, x, ids, "q8_0"),
        "weights rank": (stack[0], x, ids, "q4_0"),
        "x width": (stack, x[:, :-32].contiguous(), ids, "q4_0"),
        "x dtype": (stack, x.double(), ids, "q4_0"),
        "weight dtype": (stack.to(torch.int8), x, ids, "q4_0"),
        "float ids": (stack, x, ids.float(), "q4_0"),
        "ids tokens": (stack, x, ids[:2], "q4_0"),
        "x not contiguous": (stack, torch.randn(K, 3).T, ids, "q4_0"),
    }


@cpp_only
@pytest.mark.parametrize("case", list(_bad_quantized_calls()))
def test_quantized_matmul_id_errors_are_the_same(case):
    args = _bad_quantized_calls()[case]
    with pytest.raises(ValueError) as py_error:
        rt._quantized_matmul_id(*args)
    with pytest.raises(ValueError) as cpp_error:
        torch.ops.routemm.quantized_matmul_id(*args)
    assert str(cpp_error.value) == str(py_error.value)


def _bad_matmul_id_calls():
    w, x, ids = _moe("cpu", 3)
    return {
        "weights rank": (w[0], x, ids),
        "ids rank": (w, x, ids[:, 0]),
        "x width": (w, x[:, :-1].contiguous(), ids),
        "ids tokens": (w, x, ids[:2]),
        "slots": (w, x.unsqueeze(1).expand(3, 3, K).contiguous(), ids),
        "x dtype": (w, x.double(), ids),
        "weight dtype": (w.to(torch.int64), x, ids),
        "weight dtype the op refuses": (w.to(torch.uint8), x, ids),
        "float ids": (w, x, ids.float()),
        "bool ids": (w, x, ids.bool()),
        "weights not contiguous": (w.transpose(1, 2).contiguous().transpose(1, 2), x, ids),
        "x not contiguous": (w, torch.randn(K, 3).T, ids),
    }


@cpp_only
@pytest.mark.parametrize("case", list(_bad_matmul_id_calls()))
def test_matmul_id_errors_are_the_same(case):
    args = _bad_matmul_id_calls()[case]
    with pytest.raises(ValueError) as py_error:
        _python_kernel(*args)
    with pytest.raises(ValueError) as cpp_error:
        torch.ops.routemm.matmul_id(*args)
    assert str(cpp_error.value) == str(py_error.value)


def _bad_q4_calls():
    blocks = _q4_blocks(N, K)
    x = torch.randn(2, K)
    return {
        "x width": (x[:, :-1].contiguous(), blocks, N, K),
        "x rank": (x[0], blocks, N, K),
        "weight dtype": (x, blocks.float(), N, K),
        "x dtype": (x.double(), blocks, N, K),
        "x not contiguous": (torch.randn(K, 2).T, blocks, N, K),
        "weight not contiguous": (x, blocks.T.contiguous().T, N, K),
        "weight too small": (x, blocks[:-1], N, K),
        "k not a multiple of 32": (torch.randn(2, 40), blocks, N, 40),
    }


@cpp_only
@pytest.mark.parametrize("case", list(_bad_q4_calls()))
def test_q4_matmul_errors_are_the_same(case):
    args = _bad_q4_calls()[case]
    errors = []
    for kernel in (rt._q4_matmul, torch.ops.routemm.q4_matmul):
        with pytest.raises((ValueError, RuntimeError)) as error:
            kernel(*args)
        errors.append(error)
    py_error, cpp_error = errors
    if isinstance(py_error.value, ValueError):
        assert isinstance(cpp_error.value, ValueError)
    assert str(cpp_error.value) == str(py_error.value)


@cpp_only
def test_plans_are_cached_in_cpp_and_python_kernels_are_not_entered(monkeypatch):
    from routemm import _torch_ops

    w, x, ids = _moe("cpu", 5, top_k=3)
    first = torch.ops.routemm.matmul_id(w, x, ids)
    planned = _torch_ops.plan_cache_size()
    python_plans = len(_tensor_ops.framework("torch").matmul_id_plans)

    def forbidden(*args, **kwargs):
        raise AssertionError("the C++ kernel entered a Python kernel")

    monkeypatch.setattr(_tensor_ops, "matmul_id", forbidden)
    monkeypatch.setattr(_tensor_ops, "q4_matmul", forbidden)
    monkeypatch.setattr(_tensor_ops, "quantized_matmul_id", forbidden)
    for _ in range(3):
        assert torch.equal(torch.ops.routemm.matmul_id(w, x, ids), first)
    stack, _ = _block_stack("q8_0")
    torch.ops.routemm.quantized_matmul_id(stack, x, ids, "q8_0")  # a plan of its own
    assert _torch_ops.plan_cache_size() == planned + 1
    torch.ops.routemm.quantized_matmul_id(stack, x, ids, "q8_0")
    planned += 1
    torch.ops.routemm.q4_matmul(x, _q4_blocks(N, K), N, K)
    assert _torch_ops.plan_cache_size() == planned
    torch.ops.routemm.matmul_id(w, x[:4].contiguous(), ids[:4].contiguous())  # a new shape
    assert _torch_ops.plan_cache_size() == planned + 1
    assert len(_tensor_ops.framework("torch").matmul_id_plans) == python_plans


def test_both_kernel_sets_share_the_core_device_table():
    device, registry = _core._tensor_op_target(1, 0)
    again_device, again_registry = _tensor_ops._target(1, 0)
    assert again_registry.authority_id == registry.authority_id and again_device == device
    with pytest.raises(routemm.InvalidArgumentError, match="DLPack device type 7 has no routemm backend"):
        _core._tensor_op_target(7, 0)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=120
    )


_REPORT = """
    import sys, torch, routemm.torch as rt
    w = torch.randn(4, 16, 32)
    x = torch.randn(1, 32)
    ids = torch.tensor([[1, 3]], dtype=torch.int32)
    y = torch.ops.routemm.matmul_id(w, x, ids)
    assert torch.allclose(y, torch.stack([w[1] @ x[0], w[3] @ x[0]]), atol=1e-5)
    print(rt.KERNELS)
    print("routemm._torch_ops" in sys.modules)
    print(rt.KERNELS_REASON)
"""


def test_environment_knob_forces_the_python_kernels():
    result = _run(_REPORT, ROUTEMM_TORCH_KERNELS="python")
    assert result.returncode == 0, result.stderr
    kernels, loaded, reason = result.stdout.strip().splitlines()
    assert (kernels, loaded) == ("python", "False") and "ROUTEMM_TORCH_KERNELS=python" in reason


def test_unknown_knob_value_is_refused():
    result = _run("import routemm.torch", ROUTEMM_TORCH_KERNELS="fast")
    assert result.returncode != 0 and "ROUTEMM_TORCH_KERNELS must be auto, cpp or python" in result.stderr


_MISMATCH = """
    import sys, types
    record = types.ModuleType("routemm._torch_ops_build")
    record.TORCH_VERSION = "0.0.1"
    sys.modules["routemm._torch_ops_build"] = record
"""


def test_torch_version_mismatch_falls_back_with_a_reason():
    result = _run(_MISMATCH + _REPORT, ROUTEMM_TORCH_KERNELS="auto")
    assert result.returncode == 0, result.stderr
    kernels, loaded, reason = result.stdout.strip().splitlines()
    assert (kernels, loaded) == ("python", "False")
    assert "built against torch 0.0.1" in reason and torch.__version__ in reason


def test_knob_cpp_refuses_a_mismatched_build():
    result = _run(_MISMATCH + "    import routemm.torch\n", ROUTEMM_TORCH_KERNELS="cpp")
    assert result.returncode != 0 and "ROUTEMM_TORCH_KERNELS=cpp, but" in result.stderr


@cpp_only
def test_fake_tensors_and_compile_run_with_the_cpp_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.ops.routemm.matmul_id(
            torch.empty(E, N, K), torch.empty(9, 3, K), torch.empty(9, 3, dtype=torch.int64)
        )
        assert y.shape == (27, N)
    w, x, ids = _moe("cpu", 9, top_k=3)
    blocks = _q4_blocks(N, K)

    def step(w, x, ids, blocks):
        return torch.ops.routemm.matmul_id(w, x, ids), torch.ops.routemm.q4_matmul(x, blocks, N, K)

    compiled = torch.compile(step, fullgraph=True)(w, x, ids, blocks)
    for a, b in zip(compiled, step(w, x, ids, blocks), strict=True):
        assert torch.equal(a, b)


def _call_arguments(code: str, name: str) -> list[list[str]]:
    """The top-level arguments of every call of `name` in C++ `code` whose string literals are
    blanked (so commas and parentheses count only as code)."""
    calls = []
    for piece in code.split(name + "(")[1:]:
        depth, args, current = 1, [], ""
        for ch in piece:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 or (depth == 1 and ch == ","):
                args.append(current.strip())
                current = ""
                if depth == 0:
                    break
            else:
                current += ch
        calls.append(args)
    return calls


def test_cpp_kernels_use_no_iostreams():
    """An integer formatted by an ostringstream of routemm._torch_ops crashed the process under
    torch 2.11 (the error cases above, on a CUDA machine). Its messages are single strings, which
    c10::str passes through, and it streams nothing itself."""
    source = (Path(__file__).resolve().parents[2] / "python" / "src" / "torch" / "torch_ops.cpp").read_text()
    code = "\n".join(line.split("//")[0] for line in source.splitlines())
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)  # literals may hold commas and brackets
    for banned in ("<sstream>", "<iostream>", "<ostream>", "stringstream", "std::cout", "std::cerr"):
        assert banned not in code, banned
    checks = {"TORCH_CHECK_VALUE": 2, "TORCH_CHECK_WITH": 3, "TORCH_CHECK": 2}
    seen = 0
    for name, most in checks.items():  # "TORCH_CHECK(" is not a part of "TORCH_CHECK_VALUE("
        for args in _call_arguments(code, name):
            seen += 1
            assert len(args) <= most, f"{name} with a message of several parts: {args}"
    assert seen >= 10


_NOT_BUILT = """
    import sys
    sys.modules["routemm._torch_ops_build"] = None  # as where the extension was not built
"""

_FIX = "ROUTEMM_TORCH_OPS=ON python -m pip install --no-build-isolation -v ."


@pytest.mark.parametrize("case", [_NOT_BUILT, _MISMATCH], ids=["not_built", "torch_mismatch"])
def test_falling_back_to_the_python_kernels_warns_once_naming_the_fix(case):
    again = "    import routemm.integrations.torch\n    torch.ops.routemm.matmul_id(w, x, ids)\n"
    code = case + _REPORT + again
    result = _run(code, ROUTEMM_TORCH_KERNELS="auto", PYTHONWARNINGS="default")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "python"
    assert result.stderr.count("RuntimeWarning: routemm.torch: torch.ops.routemm.* run on the Python kernels") == 1
    assert _FIX in result.stderr and "ROUTEMM_TORCH_KERNELS=python" in result.stderr


def test_the_python_kernels_chosen_by_the_knob_do_not_warn():
    result = _run(_REPORT, ROUTEMM_TORCH_KERNELS="python", PYTHONWARNINGS="default")
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr
