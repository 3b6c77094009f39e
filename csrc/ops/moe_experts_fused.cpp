// The fused experts block (routemm/ops/moe_experts_fused.h): checks, then two dispatches.
#include "routemm/ops/moe_experts_fused.h"

#include <string>
#include <utility>
#include <vector>

#include "backend/common/moe_fused_params.h"
#include "routemm/checked.h"
#include "routemm/error.h"

namespace routemm {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("moe_experts_fused " + message);
}

size_t dtype_index(DType d) {
  switch (d) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::BF16: return 2;
    default: fail("dtype must be f32, f16 or bf16, got " + std::string(dtype_name(d)));
  }
}

// A valid buffer of at least `required` logical bytes whose first byte is 16-byte aligned;
// returns its logical byte range.
ByteRange checked_buffer(const char* label, const Buffer& b, uint64_t required, uint64_t align) {
  if (!b.valid()) fail(std::string(label) + " is an empty buffer");
  if (b.nbytes() < required) {
    fail(std::string(label) + " requires " + std::to_string(required) + " logical bytes, got " +
         std::to_string(b.nbytes()));
  }
  if ((b.address() + b.byte_offset()) % align != 0) {
    fail(std::string(label) + " must start at a " + std::to_string(align) +
         "-byte aligned address");
  }
  const uint64_t start = b.address() + b.byte_offset();
  return {start, start + required};
}

bool overlaps(ByteRange a, ByteRange b) { return a.start < b.end && b.start < a.end; }

}  // namespace

uint64_t moe_experts_fused_workspace_bytes(const MoeExpertsFusedParams& p) {
  if (p.m == 0 || p.top_k == 0 || p.n_experts == 0 || p.hidden == 0 || p.intermediate == 0) {
    fail("extents must be nonzero, got m=" + std::to_string(p.m) +
         ", top_k=" + std::to_string(p.top_k) + ", n_experts=" + std::to_string(p.n_experts) +
         ", H=" + std::to_string(p.hidden) + ", I=" + std::to_string(p.intermediate));
  }
  if (p.hidden % 8 != 0 || p.intermediate % 8 != 0) {
    fail("H and I must be multiples of 8, got H=" + std::to_string(p.hidden) +
         ", I=" + std::to_string(p.intermediate));
  }
  if (p.top_k > kMoeExpertsFusedMaxTopK) {
    fail("top_k must be at most " + std::to_string(kMoeExpertsFusedMaxTopK) + ", got " +
         std::to_string(p.top_k));
  }
  if (p.id_bytes != 4 && p.id_bytes != 8) {
    fail("id_bytes must be 4 or 8, got " + std::to_string(p.id_bytes));
  }
  dtype_index(p.dtype);
  dtype_index(p.weights_dtype);
  if (!p.split_gate_up && p.intermediate > 0x7FFFFFFFu) fail("2 * I must fit a u32");
  const uint64_t rows = checked_mul(p.m, p.top_k, "moe_experts_fused rows");
  if (rows > 0xFFFFFFFFull) fail("m * top_k must fit a u32");
  return checked_product({rows, p.intermediate, 4}, "moe_experts_fused workspace");
}

bool moe_experts_fused_serves(std::string_view backend, const MoeExpertsFusedParams& p) {
  if (backend != "cuda" && backend != "cpu") return false;
  try {
    moe_experts_fused_workspace_bytes(p);
  } catch (const InvalidArgument&) {
    return false;
  }
  // At most kMoeFusedRowsPerExpert rows per expert: each row re-reads its expert's weights, which
  // costs more than the direct route's reuse from there (Qwen3-30B-A3B bf16 block on an H100, in
  // a CUDA graph: fused 41.8 / 60.5 / 113.7 / 203.6 us against direct 45.7 / 67.0 / 109.6 / 183.5
  // at m = 1 / 2 / 4 / 8, i.e. 1/16 to 1/2 rows per expert).
  return uint64_t{p.m} * p.top_k * kMoeFusedExpertsPerRow <= p.n_experts;
}

void moe_experts_fused(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& hidden,
                       const Buffer& ids, const Buffer& weights, const Buffer& gate_up,
                       const Buffer* up, const Buffer& down, const Buffer& output,
                       const Buffer& workspace, const MoeExpertsFusedParams& p) {
  const uint64_t act_bytes = moe_experts_fused_workspace_bytes(p);
  if (p.split_gate_up != (up != nullptr)) {
    fail(p.split_gate_up ? "split gate/up stacks need the up stack"
                         : "one gate_up stack takes no separate up stack");
  }
  const size_t type = dtype_index(p.dtype);
  const uint64_t es = dtype_size(p.dtype), ws = dtype_size(p.weights_dtype);
  const uint64_t m = p.m, k = p.top_k, e = p.n_experts, h = p.hidden, inter = p.intermediate;
  const uint64_t rows = m * k;
  const auto dtype_is = [&](const char* label, const Buffer& b, DType want) {
    if (b.valid() && b.dtype() != want) {
      fail(std::string(label) + " must be " + std::string(dtype_name(want)) + ", got " +
           std::string(dtype_name(b.dtype())));
    }
  };
  for (const auto& [label, b] : {std::pair<const char*, const Buffer*>{"hidden", &hidden},
                                 {"gate_up", &gate_up},
                                 {"down", &down},
                                 {"output", &output}}) {
    dtype_is(label, *b, p.dtype);
  }
  if (up) dtype_is("up", *up, p.dtype);
  dtype_is("weights", weights, p.weights_dtype);
  const ByteRange hidden_r =
      checked_buffer("hidden", hidden, checked_product({m, h, es}, "hidden"), 16);
  const ByteRange ids_r =
      checked_buffer("ids", ids, checked_mul(rows, p.id_bytes, "ids"), p.id_bytes);
  const ByteRange weights_r =
      checked_buffer("weights", weights, checked_mul(rows, ws, "weights"), ws);
  const uint64_t gate_rows = p.split_gate_up ? inter : 2 * inter;
  const ByteRange gate_up_r = checked_buffer(p.split_gate_up ? "gate" : "gate_up", gate_up,
                                             checked_product({e, gate_rows, h, es}, "gate_up"), 16);
  const ByteRange up_r =
      up ? checked_buffer("up", *up, checked_product({e, inter, h, es}, "up"), 16) : gate_up_r;
  const ByteRange down_r =
      checked_buffer("down", down, checked_product({e, h, inter, es}, "down"), 16);
  const ByteRange out_r =
      checked_buffer("output", output, checked_product({m, h, es}, "output"), 16);
  const ByteRange act_r = checked_buffer("workspace", workspace, act_bytes, 16);
  if (!output.writable()) fail("output is read-only");
  if (!workspace.writable()) fail("workspace is read-only");
  for (const auto& [label, r] : {std::pair<const char*, ByteRange>{"hidden", hidden_r},
                                 {"ids", ids_r},
                                 {"weights", weights_r},
                                 {"workspace", act_r}}) {
    if (overlaps(out_r, r)) fail(std::string("output must not overlap ") + label);
  }
  for (const auto& [label, r] : {std::pair<const char*, ByteRange>{"hidden", hidden_r},
                                 {"ids", ids_r},
                                 {"weights", weights_r}}) {
    if (overlaps(act_r, r)) fail(std::string("workspace must not overlap ") + label);
  }
  for (const Buffer* b : {&hidden, &ids, &weights, &gate_up, &down, &output, &workspace}) {
    if (b->backend() != encoder.backend()) fail("buffers must all live on the encoder's device");
  }
  if (up && up->backend() != encoder.backend())
    fail("buffers must all live on the encoder's device");
  if (registry.device().backend() != encoder.backend()) {
    fail("encoder, registry and buffers must belong to one device (encoder/device mismatch)");
  }
  const PipelinePtr first = registry.get_pipeline(kMoeExpertsFusedPipelineNames[type]);
  const PipelinePtr second = registry.get_pipeline(kMoeExpertsFusedPipelineNames[3 + type]);
  if (encoder.receipt_slots_left() < 2) {
    fail("open dispatch receipt has no room for the block's 2 dispatches");
  }

  const kernels::MoeFusedKernelParams gpu{p.m,
                                          p.top_k,
                                          p.n_experts,
                                          p.hidden,
                                          p.intermediate,
                                          p.split_gate_up ? 1u : 0u,
                                          static_cast<uint32_t>(dtype_index(p.weights_dtype)),
                                          p.id_bytes};
  const Buffer act = workspace.view(0, act_bytes, DType::F32, {rows, inter});
  CommandEncoder::Transaction transaction(encoder, "moe_experts_fused");
  // gate_up: group (x, y) covers 8 act columns (one warp each on CUDA) of row y.
  const std::pair<uint32_t, KernelArg> first_args[] = {{0, KernelArg::pod(gpu)},
                                                       {1, KernelArg::of(hidden)},
                                                       {2, KernelArg::of(ids)},
                                                       {3, KernelArg::of(gate_up)},
                                                       {4, KernelArg::of(up ? *up : gate_up)},
                                                       {5, KernelArg::of(act)}};
  if (encoder.is_capturing()) {
    std::vector<ByteRange> reads = {hidden_r, ids_r, gate_up_r, up_r};
    encoder.set_pending_buffer_ranges(std::move(reads), {act_r});
  }
  encoder.dispatch(*first, first_args, Dim3{(inter + 7) / 8, rows, 1}, Dim3{256, 1, 1});
  encoder.memory_barrier();
  // down: group (x, y) covers 8 output columns of token y.
  const std::pair<uint32_t, KernelArg> second_args[] = {
      {0, KernelArg::pod(gpu)},    {1, KernelArg::of(act)},  {2, KernelArg::of(ids)},
      {3, KernelArg::of(weights)}, {4, KernelArg::of(down)}, {5, KernelArg::of(output)}};
  if (encoder.is_capturing()) {
    std::vector<ByteRange> reads = {act_r, ids_r, weights_r, down_r};
    encoder.set_pending_buffer_ranges(std::move(reads), {out_r});
  }
  encoder.dispatch(*second, second_args, Dim3{(h + 7) / 8, m, 1}, Dim3{256, 1, 1});
  transaction.commit();
}

}  // namespace routemm
