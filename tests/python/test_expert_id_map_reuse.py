"""One routing map for several grouped expert-ID matmuls (reuse_map): a reusing call encodes its
grouped dispatch alone, gives the bits of a building call on every valid row, leaves invalid ids'
rows unwritten, and is refused (before anything is encoded) unless its scratch holds a map of the
same ids, m, top_k and n_experts.

Runs on every backend that registers the grouped routes (ROUTEMM_TEST_BACKENDS selects them)."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdRoute as Route
from routemm import DType, GgmlType, q4_0
from routemm import GgmlQuantizedMatmulIdRoute as QRoute
from support import distinct_ids, guarded_output, poison_words, sprinkle_invalid, validate

MAP = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3]
pytestmark = pytest.mark.needs_kernels(MAP, *routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES)

M, TOP_K, N_EXPERTS, K = 11, 3, 7, 64
N_GATE, N_DOWN = 64, 24  # the two matmuls' widths differ, as gate/up and down do


class Case:
    """A dense f32 stack and a Q4_0 stack over one set of ids (some invalid); the Q4_0 matmul
    reads the dense one's output rows as its slotted input, like a MoE block's down projection."""

    def __init__(self, device, rng):
        self.device = device
        self.ids = sprinkle_invalid(rng, distinct_ids(rng, M, TOP_K, N_EXPERTS), N_EXPERTS)
        self.invalid = self.ids.reshape(-1) >= N_EXPERTS
        self.x = device.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        self.dense_w = device.from_numpy((rng.standard_normal((N_EXPERTS, N_GATE, K)) / 8).astype(np.float32))
        q = q4_0.quantize(rng.uniform(-1, 1, (N_EXPERTS, N_DOWN, N_GATE)).astype(np.float32))
        self.q_w = device.from_numpy(q)
        self.ids_buf = device.from_numpy(self.ids)
        self.dense_params = routemm.DenseMatmulIdParams(
            M, N_GATE, K, TOP_K, N_EXPERTS, N_GATE * K * 4, route=Route.GROUPED_PREFILL
        )
        self.q_params = routemm.GgmlQuantizedMatmulIdParams(
            M, N_DOWN, N_GATE, TOP_K, N_EXPERTS, GgmlType.Q4_0, q[0].nbytes, Layout.SLOTTED, QRoute.GROUPED
        )

    def encode(self, encoder, registry, scratch, reuse_map):
        """Dense grouped (builds the map), barrier, Q4_0 grouped on its output (builds or reuses)."""
        hidden = self.device.alloc(M * TOP_K * N_GATE * 4, DType.F32, [M * TOP_K, N_GATE])
        down = guarded_output(self.device, M * TOP_K, N_DOWN)
        first = routemm.dense_matmul_id(
            encoder, registry, self.dense_w, self.x, self.ids_buf, hidden, scratch, self.dense_params
        )
        encoder.memory_barrier()
        second = routemm.quantized_matmul_id_ggml(
            encoder, registry, hidden, self.q_w, self.ids_buf, down.view, scratch, self.q_params, reuse_map=reuse_map
        )
        return hidden, down, first, second


def test_reused_map_gives_the_built_maps_bits_with_one_map_dispatch(device, registry, rng):
    case = Case(device, rng)
    results = {}
    for reuse_map in (False, True):
        scratch = routemm.DenseMatmulIdScratch(device, N_EXPERTS, M)
        encoder = device.command_encoder()
        encoder.start_encoded_dispatch_receipt(8)
        hidden, down, first, second = case.encode(encoder, registry, scratch, reuse_map)
        labels = [d.pipeline_label for d in encoder.take_encoded_dispatch_receipt()]
        encoder.commit_and_wait()
        validate(first)
        validate(second)
        assert first.dispatch_count == 2 and second.dispatch_count == (1 if reuse_map else 2)
        assert labels.count(MAP) == (1 if reuse_map else 2)
        assert labels[-1] == "quantized_matmul_id_grouped_q4_0_f32"
        down.assert_guards_intact("down output")
        results[reuse_map] = (hidden.numpy(), down.view.numpy().reshape(M * TOP_K, N_DOWN))
    built, reused = results[False][1], results[True][1]
    valid = ~case.invalid
    assert case.invalid.any() and valid.any()
    np.testing.assert_array_equal(reused[valid].view(np.uint32), built[valid].view(np.uint32))
    # The map zeroes invalid ids' rows of the call that builds it; a reusing call leaves them as
    # they were (here: the poison the output was filled with).
    assert np.all(built[case.invalid].view(np.uint32) == 0)
    poison = poison_words(M * TOP_K * N_DOWN).reshape(M * TOP_K, N_DOWN)
    np.testing.assert_array_equal(reused[case.invalid].view(np.uint32), poison[case.invalid].view(np.uint32))


def test_map_reuse_is_refused_before_encoding(device, registry, rng):
    case = Case(device, rng)
    out = device.alloc(M * TOP_K * N_DOWN * 4, DType.F32, [M * TOP_K, N_DOWN])
    hidden = device.alloc(M * TOP_K * N_GATE * 4, DType.F32, [M * TOP_K, N_GATE])
    scratch = routemm.DenseMatmulIdScratch(device, N_EXPERTS, M)
    encoder = device.command_encoder()

    def reuse(params=case.q_params, ids=case.ids_buf, scratch=scratch, flag=True):
        routemm.quantized_matmul_id_ggml(encoder, registry, hidden, case.q_w, ids, out, scratch, params, reuse_map=flag)

    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match="the scratch holds no map"):
        reuse()
    # Build a map of the case's ids, then ask for it with other ids or other extents.
    routemm.dense_matmul_id(encoder, registry, case.dense_w, case.x, case.ids_buf, hidden, scratch, case.dense_params)
    built = routemm.dispatch_count()
    assert built - before == 2
    other_ids = device.from_numpy(case.ids.copy())
    with pytest.raises(routemm.InvalidArgumentError, match="another ids view"):
        reuse(ids=other_ids)
    fewer_tokens = routemm.GgmlQuantizedMatmulIdParams(
        M - 1, N_DOWN, N_GATE, TOP_K, N_EXPERTS, GgmlType.Q4_0, case.q_params.expert_stride_bytes,
        Layout.SLOTTED, QRoute.GROUPED,
    )  # fmt: skip
    with pytest.raises(routemm.InvalidArgumentError, match=r"m/top_k/E 11/3/7, this call 10/3/7\)"):
        reuse(params=fewer_tokens)
    with pytest.raises(routemm.InvalidArgumentError, match="the scratch holds no map"):
        reuse(scratch=routemm.DenseMatmulIdScratch(device, N_EXPERTS, M))
    direct = routemm.GgmlQuantizedMatmulIdParams(
        M, N_DOWN, N_GATE, TOP_K, N_EXPERTS, GgmlType.Q4_0, case.q_params.expert_stride_bytes, Layout.SLOTTED
    )
    with pytest.raises(routemm.InvalidArgumentError, match="map reuse needs a grouped route"):
        reuse(params=direct, scratch=None)
    with pytest.raises(routemm.InvalidArgumentError, match="reuse_map must be a bool"):
        reuse(flag=1)
    dense_direct = routemm.DenseMatmulIdParams(M, N_GATE, K, TOP_K, N_EXPERTS, N_GATE * K * 4)
    with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id map reuse needs a grouped route"):
        routemm.dense_matmul_id(
            encoder, registry, case.dense_w, case.x, case.ids_buf, hidden, None, dense_direct, reuse_map=True
        )
    assert routemm.dispatch_count() == built
    # The matching call is accepted and encodes the grouped dispatch alone.
    reuse()
    assert routemm.dispatch_count() == built + 1
    encoder.commit_and_wait()


def test_dense_calls_reuse_a_map_built_by_the_quantized_op(device, registry, rng):
    """The map is one mechanism for both ops: a dense grouped call reuses a Q4_0 call's map."""
    case = Case(device, rng)
    hidden = device.from_numpy(rng.standard_normal((M * TOP_K, N_GATE)).astype(np.float32))
    x2 = device.from_numpy(rng.standard_normal((M * TOP_K, K)).astype(np.float32))
    slotted = routemm.DenseMatmulIdParams(
        M, N_GATE, K, TOP_K, N_EXPERTS, N_GATE * K * 4, Layout.SLOTTED, route=Route.GROUPED_PREFILL
    )
    outs = []
    for reuse_map in (False, True):
        scratch = routemm.DenseMatmulIdScratch(device, N_EXPERTS, M)
        q_out = device.alloc(M * TOP_K * N_DOWN * 4, DType.F32, [M * TOP_K, N_DOWN])
        d_out = device.alloc(M * TOP_K * N_GATE * 4, DType.F32, [M * TOP_K, N_GATE])
        encoder = device.command_encoder()
        routemm.quantized_matmul_id_ggml(
            encoder, registry, hidden, case.q_w, case.ids_buf, q_out, scratch, case.q_params
        )
        receipt = routemm.dense_matmul_id(
            encoder, registry, case.dense_w, x2, case.ids_buf, d_out, scratch, slotted, reuse_map=reuse_map
        )
        encoder.commit_and_wait()
        assert receipt.dispatch_count == (1 if reuse_map else 2)
        outs.append(d_out.numpy()[~case.invalid])
    np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32))
