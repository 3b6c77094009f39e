"""Property test: dense_matmul_id_capability against an independent model of spec §7.3.

The model below is written from the spec (and the seed for the exact overflow texts), with Python
big integers, checking the rules in the spec's order. For every generated (dtype, params) the
library must either return exactly the model's extents or raise InvalidArgumentError whose message
is exactly the model's message for the first failing rule -- and never anything else.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
import routemm  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from routemm import DenseMatmulIdInputLayout as Layout  # noqa: E402
from routemm import DenseMatmulIdMultiplicity as Mult  # noqa: E402
from routemm import DenseMatmulIdRoute as Route  # noqa: E402
from routemm import DType  # noqa: E402
from support import validate  # noqa: E402

U32 = 2**32 - 1
U64 = 2**64 - 1
SCALAR = {"f32": 4, "f16": 2, "bf16": 2}
P = "dense_matmul_id "


class Rejected(Exception):
    pass


def model(dtype_name: str, m, n, k, top_k, n_experts, stride, layout, mult, route):
    """Returns the capability as a dict, or raises Rejected(message)."""
    for name, value in (("m", m), ("n", n), ("k", k), ("top_k", top_k), ("n_experts", n_experts)):
        if isinstance(value, bool) or not 0 <= value <= U32:
            raise Rejected(f"{P}{name} must be a u32, got {value!r}")
    if isinstance(stride, bool) or not 0 <= stride <= U64:
        raise Rejected(f"{P}expert_stride_bytes must be a u64, got {stride!r}")
    # 1. nonzero
    if 0 in (m, n, k, top_k, n_experts):
        raise Rejected(f"{P}M, N, K, top_k, and n_experts must be nonzero")
    # 2. distinct top_k
    if mult == "distinct_per_token" and top_k > n_experts:
        raise Rejected(f"{P}distinct top_k {top_k} exceeds n_experts {n_experts}")
    # 3. weight dtype
    if dtype_name not in SCALAR:
        raise Rejected(f"{P}weights must be F32, F16, or BF16, got {dtype_name}")
    size = SCALAR[dtype_name]
    # 3b. the CPU bf16-dot routes take bf16 weights only
    if route in ("direct_bf16_dot", "grouped_bf16_dot") and dtype_name != "bf16":
        raise Rejected(f"{P}{route} requires BF16 weights, got {dtype_name}")
    # 4. one matrix, stride
    matrix = n * k * size
    if matrix > U64:
        raise Rejected(f"{P}expert matrix byte extent overflow")
    if stride < matrix:
        raise Rejected(f"{P}expert stride {stride} is smaller than one {matrix}-byte matrix")
    if stride % size:
        raise Rejected(f"{P}expert stride {stride} is not aligned to {dtype_name}")
    # 5. required weight bytes
    last = (n_experts - 1) * stride
    if last > U64:
        raise Rejected(f"{P}expert weight offset overflow")
    if last + matrix > U64:
        raise Rejected(f"{P}weight extent overflow")
    # 6. rows, input, ids, output
    rows = m * top_k
    if rows > U32:
        raise Rejected(f"{P}flattened routed rows exceed the u32 kernel ABI")
    input_bytes = (m if layout == "shared_per_token" else rows) * k * 4
    if input_bytes > U64:
        raise Rejected(f"{P}input byte extent overflow")
    ids_bytes = rows * 4
    output_bytes = rows * n * 4
    if output_bytes > U64:
        raise Rejected(f"{P}output byte extent overflow")
    # 7. grouped
    scratch = None
    if route not in ("direct", "direct_bf16_dot"):  # grouped_prefill and the other grouped routes
        if mult != "distinct_per_token":
            raise Rejected(f"{P}grouped prefill requires distinct expert IDs per token")
        if n_experts > 1024:
            raise Rejected(f"{P}grouped prefill supports at most 1024 experts")
        if route == "grouped_tensor_lowp" and dtype_name == "f32":
            raise Rejected(f"{P}grouped_tensor_lowp requires F16 or BF16 weights, got f32")
        scratch = {"expert_counts_bytes": n_experts * 4, "routed_rows_bytes": n_experts * m * 4}
    return {
        "schema_version": 3,
        "weight_dtype": dtype_name,
        "route": route,
        "required_weight_bytes": last + matrix,
        "required_input_bytes": input_bytes,
        "required_ids_bytes": ids_bytes,
        "required_output_bytes": output_bytes,
        "scratch": scratch,
    }


EDGE_U32 = [0, 1, 2, 6, 7, 8, 9, 35, 1023, 1024, 1025, 2**16, 2**31 - 1, 2**31, U32 - 1, U32]
dims = st.one_of(
    st.integers(0, 40),
    st.sampled_from(EDGE_U32),
    st.integers(0, U32),
    st.sampled_from([U32 + 1, 2**40, -1]),
    st.booleans(),  # not integers here, however Python counts them
)
DTYPES = list(DType.__members__.values())


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    m, n, k, top_k, n_experts = (draw(dims) for _ in range(5))
    size = dtype.size
    matrix = n * k * size if n >= 0 and k >= 0 else 0
    stride = draw(
        st.one_of(
            st.integers(0, 5000),
            st.builds(lambda d: matrix + d, st.integers(-3, 16)),  # around one matrix, aligned or not
            st.builds(lambda d: matrix + d * size, st.integers(0, 8)),  # valid padded strides
            st.sampled_from([U64, U64 - 1, U64 - 3, 2**63, 2**32, U64 + 1, -1, True]),
            st.integers(0, U64),
        )
    )
    layout = draw(st.sampled_from(list(Layout)))
    mult = draw(st.sampled_from(list(Mult)))
    route = draw(st.sampled_from(list(Route)))
    return dtype, m, n, k, top_k, n_experts, stride, layout, mult, route


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example((DType.BF16, 9, 7, 35, 6, U32, U64 - 1, Layout.SHARED_PER_TOKEN, Mult.DISTINCT_PER_TOKEN, Route.DIRECT))
@example((DType.F32, U32, U32, U32, U32, U32, U64, Layout.SLOTTED, Mult.MAY_REPEAT, Route.GROUPED_PREFILL))
@example((DType.U16, 1, 1, 1, 1, 1, 2, Layout.SLOTTED, Mult.MAY_REPEAT, Route.GROUPED_PREFILL))
@example((DType.F16, 9, 7, 35, 6, 1025, 490, Layout.SLOTTED, Mult.DISTINCT_PER_TOKEN, Route.GROUPED_PREFILL))
@example((DType.F32, True, 1, 1, 1, 1, 4, Layout.SLOTTED, Mult.MAY_REPEAT, Route.DIRECT))  # True is no token count
def test_capability_matches_independent_model(case):
    dtype, m, n, k, top_k, n_experts, stride, layout, mult, route = case
    try:
        want = model(dtype.type_name, m, n, k, top_k, n_experts, stride, layout.value, mult.value, route.value)
        want_error = None
    except Rejected as rejected:
        want, want_error = None, str(rejected)
    try:  # the params check their fields when built, the capability the rest
        params = routemm.DenseMatmulIdParams(
            m=m,
            n=n,
            k=k,
            top_k=top_k,
            n_experts=n_experts,
            expert_stride_bytes=stride,
            input_layout=layout,
            id_multiplicity=mult,
            route=route,
        )
        got = routemm.dense_matmul_id_capability(dtype, params)
    except routemm.InvalidArgumentError as error:
        assert want_error is not None, f"rejected valid params: {error}"
        assert str(error) == want_error
        return
    assert want_error is None, f"accepted params the model rejects with {want_error!r}"
    assert got.to_dict() == want
    validate(got)
    validate(params)
    assert routemm.DenseMatmulIdCapability.from_json(got.to_json()) == got
    assert routemm.DenseMatmulIdParams.from_json(params.to_json()) == params


@pytest.mark.parametrize(
    "case,message",
    [
        ((DType.BF16, 9, 7, 35, 6, U32, U64 - 1), f"{P}expert weight offset overflow"),
        ((DType.F32, 1, U32, U32, 1, 1, U64), f"{P}expert matrix byte extent overflow"),
        ((DType.F32, 2**31, 1, 1, 2, 8, 4), f"{P}flattened routed rows exceed the u32 kernel ABI"),
    ],
)
def test_model_spot_checks(case, message):
    """Fixed examples of the rarer rules, so they are exercised whatever hypothesis draws."""
    dtype, m, n, k, top_k, n_experts, stride = case
    params = routemm.DenseMatmulIdParams(m, n, k, top_k, n_experts, stride)
    with pytest.raises(Rejected) as model_error:
        model(dtype.type_name, m, n, k, top_k, n_experts, stride, "shared_per_token", "distinct_per_token", "direct")
    assert str(model_error.value) == message
    with pytest.raises(routemm.InvalidArgumentError) as info:
        routemm.dense_matmul_id_capability(dtype, params)
    assert str(info.value) == message


def test_non_dtype_weight_rejected():
    with pytest.raises(routemm.InvalidArgumentError):
        routemm.dense_matmul_id_capability("f32", routemm.DenseMatmulIdParams(1, 1, 1, 1, 1, 4))
