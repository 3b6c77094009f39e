// Linux-side checks of the Metal backend's pipeline table (csrc/backend/metal/kernels.cpp) against
// the core and against the shader sources (metal/*.metal), without Metal:
//   * the table registers exactly the core's pipeline names (expert-ID, Q4_0, calibration proof);
//   * every name is a `kernel void` in metal/*.metal, in the library the table says, and no shader
//     defines a kernel the table lacks;
//   * driven through the real op front doors on a stand-in backend that carries the Metal
//     KernelDefs, every dispatch has spec §5.5/§5.6/§7.4's Metal geometry, and every launch binds
//     exactly the slots the shader declares: inline bytes where it takes `constant T&`, buffers
//     where it takes `device T*`, threadgroup memory where it takes [[threadgroup(i)]].
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "backend/common/calibration_params.h"
#include "backend/metal/kernels.h"
#include "routemm/backend.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/ggml_formats.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/ops/quantized_matmul_id.h"
#include "routemm/registry.h"

#ifndef ROUTEMM_METAL_SHADER_DIR
#error "ROUTEMM_METAL_SHADER_DIR must name the metal/ folder"
#endif

namespace routemm::metal {

// What the stand-in queue saw: the MSL function each launch resolved to, and the launch.
struct RecordedLaunch {
  std::string function;
  KernelLaunch launch;
};
std::vector<RecordedLaunch>& recorded() {
  static std::vector<RecordedLaunch> launches;
  return launches;
}

namespace {

// ---- Shader sources --------------------------------------------------------------------------------

struct ShaderKernel {
  std::string file;
  std::map<int, bool> buffers;  // [[buffer(i)]] -> true when `constant T&` (inline bytes)
  std::set<int> threadgroup;    // [[threadgroup(i)]]
};

std::string read(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The body of `#define name` with its continuation lines joined.
std::string macro_body(const std::string& source, const std::string& name) {
  const size_t at = source.find("#define " + name);
  if (at == std::string::npos) return {};
  std::string body;
  size_t pos = at + 8 + name.size();
  while (pos < source.size()) {
    const size_t eol = source.find('\n', pos);
    std::string line = source.substr(pos, eol - pos);
    const bool more = !line.empty() && line.back() == '\\';
    if (more) line.pop_back();
    body += line + " ";
    if (!more || eol == std::string::npos) break;
    pos = eol + 1;
  }
  return body;
}

std::map<std::string, ShaderKernel> shader_kernels() {
  std::map<std::string, ShaderKernel> out;
  const std::regex kernel_re(R"(kernel\s+void\s+(\w+)\s*\()");
  const std::regex buffer_re(R"(\[\[\s*buffer\((\d+)\)\s*\]\])");
  const std::regex group_re(R"(\[\[\s*threadgroup\((\d+)\)\s*\]\])");
  for (const auto& entry : std::filesystem::directory_iterator(ROUTEMM_METAL_SHADER_DIR)) {
    if (entry.path().extension() != ".metal") continue;
    const std::string source = read(entry.path());
    for (auto it = std::sregex_iterator(source.begin(), source.end(), kernel_re);
         it != std::sregex_iterator(); ++it) {
      // The parameter list, up to the matching ')'.
      size_t pos = static_cast<size_t>(it->position(0) + it->length(0));
      int depth = 1;
      const size_t start = pos;
      while (pos < source.size() && depth > 0) {
        depth += source[pos] == '(' ? 1 : source[pos] == ')' ? -1 : 0;
        ++pos;
      }
      std::string params = source.substr(start, pos - start - 1);
      const std::string trimmed = std::regex_replace(params, std::regex(R"(\s+)"), "");
      if (std::regex_match(trimmed, std::regex(R"(\w+)"))) params = macro_body(source, trimmed);
      ShaderKernel k;
      k.file = entry.path().filename().string();
      // Split at top-level commas.
      std::vector<std::string> parts;
      std::string cur;
      int nest = 0;
      for (char c : params) {
        if (c == '(' || c == '[' || c == '<') ++nest;
        if (c == ')' || c == ']' || c == '>') --nest;
        if (c == ',' && nest == 0) {
          parts.push_back(cur);
          cur.clear();
        } else {
          cur += c;
        }
      }
      parts.push_back(cur);
      for (const std::string& part : parts) {
        std::smatch m;
        if (std::regex_search(part, m, buffer_re)) {
          const bool bytes = std::regex_search(part, std::regex(R"(^\s*constant\b[^*]*&)"));
          const bool device = std::regex_search(part, std::regex(R"(^\s*device\b[^&]*\*)"));
          EXPECT_TRUE(bytes != device) << k.file << ": cannot classify parameter '" << part << "'";
          k.buffers[std::stoi(m[1])] = bytes;
        } else if (std::regex_search(part, m, group_re)) {
          k.threadgroup.insert(std::stoi(m[1]));
        }
      }
      EXPECT_TRUE(out.emplace((*it)[1], k).second) << "kernel " << (*it)[1] << " defined twice";
    }
  }
  return out;
}

std::vector<std::string> core_pipeline_names() {
  std::vector<std::string> names(kDenseMatmulIdPipelineNames.begin(),
                                 kDenseMatmulIdPipelineNames.end());
  names.insert(names.end(), kQ4MatmulPipelineNames.begin(), kQ4MatmulPipelineNames.end());
  names.push_back("routemm_calibration_poison_f32");
  names.push_back("routemm_calibration_compare_f32");
  names.insert(names.end(), kMoePipelineNames.begin(), kMoePipelineNames.end());
  names.insert(names.end(), kQ8MatmulPipelineNames.begin(), kQ8MatmulPipelineNames.end());
  names.insert(names.end(), kGgmlQuantizedMatmulIdPipelineNames.begin(),
               kGgmlQuantizedMatmulIdPipelineNames.end());
  names.emplace_back(kQ8_0MatVecNr2Pipeline);
  names.emplace_back(kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline);
  for (const ggml_formats::KernelFormat& f : ggml_formats::kKernelFormats) {
    for (const std::string_view name : {f.mat_vec, f.matrix, f.id_direct, f.id_grouped}) {
      names.emplace_back(name);
    }
  }
  return names;
}

TEST(MetalKernelTable, RegistersExactlyTheCorePipelineNames) {
  std::vector<std::string> table;
  for (const auto& spec : metal_pipeline_specs()) table.emplace_back(spec.name);
  EXPECT_EQ(table, core_pipeline_names());
}

TEST(MetalKernelTable, EveryPipelineIsAKernelInItsLibrary) {
  const auto kernels = shader_kernels();
  std::set<std::string> names;
  for (const auto& spec : metal_pipeline_specs()) {
    names.emplace(spec.name);
    const auto it = kernels.find(std::string(spec.name));
    ASSERT_NE(it, kernels.end()) << "no `kernel void " << spec.name << "(` in metal/*.metal";
    const bool tensor_file = it->second.file == "q4_matmul_tensor.metal";
    EXPECT_EQ(tensor_file, spec.library == MetalLibrary::Tensor)
        << spec.name << " is in " << it->second.file;
    EXPECT_EQ(it->second.threadgroup.empty(), spec.threadgroup_memory_bytes == 0) << spec.name;
  }
  for (const auto& [name, kernel] : kernels) {
    EXPECT_TRUE(names.count(name))
        << kernel.file << " defines kernel " << name << " that no table registers";
  }
}

// ---- Front doors on a stand-in backend ---------------------------------------------------------------

// Records what the Objective-C++ queue would encode.
class TableQueue final : public Queue, public MetalLaunchTarget {
 public:
  void submit(QueuedCommand command) override { commands_.push_back(std::move(command)); }
  void encode(std::string_view function, const KernelLaunch& launch) override {
    recorded().push_back({std::string(function), launch});
  }
  void commit(const std::string&, bool) override {
    for (const auto& c : commands_) {
      if (c.kind == QueuedCommand::Kind::Dispatch)
        c.fn(c.launch, static_cast<MetalLaunchTarget*>(this));
    }
    commands_.clear();
  }
  GpuInterval wait() override { return {0.0, 1e-6}; }

 private:
  std::vector<QueuedCommand> commands_;
};

// Host memory and the Metal KernelDefs, built by the helper device.mm uses.
class TableBackend final : public Backend {
 public:
  TableBackend() {
    for (const auto& spec : metal_pipeline_specs())
      kernels_.push_back(metal_kernel_def(spec, 1024, "metallib", ""));
  }
  std::string_view name() const override { return "metal"; }
  std::string device_name() const override { return "metal kernel table"; }
  uint64_t registry_id() const override { return 1; }
  bool host_accessible() const override { return true; }
  int32_t dlpack_device_type() const override { return 8; }
  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    void* data = std::aligned_alloc(64, ((nbytes + 63) / 64) * 64 + 64);
    return std::make_shared<Storage>(shared_from_this(), data, nbytes, true);
  }
  void deallocate(void* data, size_t) noexcept override { std::free(data); }
  void copy_from_host(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void copy_to_host(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  std::unique_ptr<Queue> create_queue(const QueueOptions&) override {
    return std::make_unique<TableQueue>();
  }
  const std::vector<KernelDef>& kernels() const override { return kernels_; }

 private:
  std::vector<KernelDef> kernels_;
};

Buffer zeros(const Device& device, uint64_t nbytes, DType dtype) {
  Buffer b = device.alloc(nbytes, dtype, {nbytes / dtype_size(dtype)});
  std::vector<uint8_t> z(nbytes, 0);
  b.copy_from_host(z.data(), nbytes);
  return b;
}

// Every recorded launch binds exactly what its shader declares.
void expect_bindings_match_shaders() {
  static const auto kernels = shader_kernels();
  ASSERT_FALSE(recorded().empty());
  for (const RecordedLaunch& r : recorded()) {
    const auto it = kernels.find(r.function);
    ASSERT_NE(it, kernels.end()) << r.function;
    const ShaderKernel& k = it->second;
    for (size_t slot = 0; slot < kMaxKernelSlots; ++slot) {
      const BoundArg& arg = r.launch.args[slot];
      const auto param = k.buffers.find(static_cast<int>(slot));
      if (param == k.buffers.end()) {
        EXPECT_EQ(arg.kind, BoundArg::Kind::Empty)
            << r.function << " binds slot " << slot << " it does not declare";
        continue;
      }
      const BoundArg::Kind want = param->second ? BoundArg::Kind::Bytes : BoundArg::Kind::Buffer;
      EXPECT_EQ(arg.kind, want) << r.function << " slot " << slot;
    }
    std::set<int> memory;
    for (const auto& [index, bytes] : r.launch.threadgroup_memory)
      memory.insert(static_cast<int>(index));
    EXPECT_EQ(memory, k.threadgroup) << r.function;
  }
}

TEST(MetalKernelTable, ExpertIdGeometryAndBindings) {
  const Device device(std::make_shared<TableBackend>());
  KernelRegistry registry(device);
  // Spec §7.4 trace case: m = 9, top_k = 6, n = 7, k = 35, 8 experts.
  DenseMatmulIdParams p;
  p.m = 9;
  p.n = 7;
  p.k = 35;
  p.top_k = 6;
  p.n_experts = 8;
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    p.expert_stride_bytes = uint64_t{p.n} * p.k * dtype_size(dtype);
    const Buffer weights = zeros(device, p.expert_stride_bytes * p.n_experts, dtype);
    const Buffer input = zeros(device, uint64_t{p.m} * p.k * 4, DType::F32);
    std::vector<uint32_t> ids;
    for (uint32_t t = 0; t < p.m; ++t) {
      for (uint32_t s = 0; s < p.top_k; ++s) ids.push_back((t + s) % p.n_experts);
    }
    Buffer id_buffer = device.alloc(ids.size() * 4, DType::U32, {p.m, p.top_k});
    id_buffer.copy_from_host(ids.data(), ids.size() * 4);
    const Buffer output = zeros(device, uint64_t{p.m} * p.top_k * p.n * 4, DType::F32);
    const DenseMatmulIdScratch scratch(device, 8, 9);
    recorded().clear();

    CommandEncoder encoder = device.command_encoder();
    encoder.start_encoded_dispatch_receipt(3);
    p.route = DenseMatmulIdRoute::Direct;
    dense_matmul_id(encoder, registry, weights, input, id_buffer, output, nullptr, p);
    p.route = DenseMatmulIdRoute::GroupedPrefill;
    dense_matmul_id(encoder, registry, weights, input, id_buffer, output, &scratch, p);
    const auto receipt = encoder.take_encoded_dispatch_receipt();
    encoder.commit_and_wait();

    ASSERT_EQ(receipt.size(), 3u);
    const auto names = dense_matmul_id_route_pipelines(dtype, DenseMatmulIdRoute::GroupedPrefill);
    EXPECT_EQ(receipt[0].pipeline_label,
              std::string(dense_matmul_id_route_pipelines(dtype, DenseMatmulIdRoute::Direct)[0]));
    EXPECT_EQ(receipt[0].grid, (std::array<uint64_t, 3>{1, 54, 1}));
    EXPECT_EQ(receipt[0].threads_per_threadgroup, (std::array<uint64_t, 3>{64, 1, 1}));
    EXPECT_TRUE(receipt[0].threadgroup_memory.empty());
    EXPECT_EQ(receipt[1].pipeline_label, std::string(names[0]));
    EXPECT_EQ(receipt[1].grid, (std::array<uint64_t, 3>{1, 1, 1}));
    // The map: one fixed threadgroup of 128 threads with its cursors in threadgroup memory.
    EXPECT_EQ(receipt[1].threads_per_threadgroup, (std::array<uint64_t, 3>{128, 1, 1}));
    EXPECT_EQ(receipt[1].threadgroup_memory,
              (std::vector<std::pair<uint64_t, uint64_t>>{{0, 16400}}));
    EXPECT_EQ(receipt[2].pipeline_label, std::string(names[1]));
    EXPECT_EQ(receipt[2].grid, (std::array<uint64_t, 3>{2, 1, 8}));
    EXPECT_EQ(receipt[2].threads_per_threadgroup, (std::array<uint64_t, 3>{256, 1, 1}));
    EXPECT_EQ(receipt[2].threadgroup_memory,
              (std::vector<std::pair<uint64_t, uint64_t>>{{0, 4096}}));
    ASSERT_EQ(recorded().size(), 3u);
    EXPECT_EQ(recorded()[0].function, receipt[0].pipeline_label);
    expect_bindings_match_shaders();
  }
}

TEST(MetalKernelTable, Q4GeometryAndBindings) {
  const Device device(std::make_shared<TableBackend>());
  KernelRegistry registry(device);
  const uint32_t n = 769, k = 64;
  const Buffer weight = zeros(device, uint64_t{n} * (k / 32) * 18, DType::U8);
  for (uint32_t m : {3u, 129u}) {
    const Buffer input = zeros(device, uint64_t{m} * k * 4, DType::F32);
    const Buffer output = zeros(device, uint64_t{m} * n * 4, DType::F32);
    const GgmlQuantizedMatmulParams params{m, n, k, GgmlType::Q4_0};
    recorded().clear();
    CommandEncoder encoder = device.command_encoder();
    if (m <= kGgmlMmRoutingThreshold) {
      const auto r = quantized_matmul_ggml(encoder, registry, input, weight, output, params,
                                           GgmlRoutingPolicy{});
      // Spec §5.5: grid [ceil(N/8), M, 1], threads [8, 8, 1], no threadgroup memory.
      EXPECT_EQ(r.dispatch.pipeline_label, "kernel_mul_mv_q4_0_f32|700:i1|701:i1|702:i1");
      EXPECT_EQ(r.dispatch.grid, (std::array<uint64_t, 3>{97, m, 1}));
      EXPECT_EQ(r.dispatch.threads_per_threadgroup, (std::array<uint64_t, 3>{8, 8, 1}));
      EXPECT_TRUE(r.dispatch.threadgroup_memory.empty());
    } else {
      for (DenseQ4Route route : kAllDenseQ4Routes) {
        const auto r = encode_q4_route(encoder, registry, input, weight, output, params, route);
        EXPECT_EQ(r.dispatch, q4_expected_dispatch(route, m, n)) << to_string(route);
      }
    }
    encoder.commit_and_wait();
    for (const RecordedLaunch& launch : recorded()) {
      EXPECT_EQ(launch.launch.int_constants,
                (std::vector<std::pair<uint32_t, int32_t>>(kQ4PipelineConstants.begin(),
                                                           kQ4PipelineConstants.end())));
    }
    expect_bindings_match_shaders();
  }
}

TEST(MetalKernelTable, CalibrationBindings) {
  // The calibration (python/routemm/plans/calibration.py) dispatches the proof kernels as Threads
  // over the guarded elements: poison (control, candidate, params), compare (control, candidate,
  // statuses, params).
  const Device device(std::make_shared<TableBackend>());
  KernelRegistry registry(device);
  const Buffer control = zeros(device, 64 * 4, DType::F32);
  const Buffer candidate = zeros(device, 64 * 4, DType::F32);
  const Buffer statuses = zeros(device, 4, DType::U32);
  const kernels::CalibrationKernelParams params{48, 64, 0, 0};
  recorded().clear();
  CommandEncoder encoder = device.command_encoder();
  const auto poison = registry.get_pipeline("routemm_calibration_poison_f32");
  const auto compare = registry.get_pipeline("routemm_calibration_compare_f32");
  const std::pair<uint32_t, KernelArg> poison_args[] = {
      {0, KernelArg::of(control)}, {1, KernelArg::of(candidate)}, {2, KernelArg::pod(params)}};
  encoder.dispatch(*poison, poison_args, Dim3{64, 1, 1}, Dim3{64, 1, 1}, DispatchKind::Threads);
  const std::pair<uint32_t, KernelArg> compare_args[] = {{0, KernelArg::of(control)},
                                                         {1, KernelArg::of(candidate)},
                                                         {2, KernelArg::of(statuses)},
                                                         {3, KernelArg::pod(params)}};
  encoder.dispatch(*compare, compare_args, Dim3{64, 1, 1}, Dim3{64, 1, 1}, DispatchKind::Threads);
  encoder.commit_and_wait();
  EXPECT_EQ(poison->def().threads_per_group, 256u);
  expect_bindings_match_shaders();
}

TEST(MetalKernelTable, MoeGeometryAndBindings) {
  // moe.metal: one thread per token row (gate) or per output element (silu_mul, combine), 64 per
  // threadgroup, no threadgroup memory.
  const Device device(std::make_shared<TableBackend>());
  KernelRegistry registry(device);
  const uint32_t m = 70, experts = 8, top_k = 2, width = 65;
  const Buffer logits = zeros(device, uint64_t{m} * experts * 4, DType::F32);
  const Buffer weights = zeros(device, uint64_t{m} * top_k * 4, DType::F32);
  const Buffer ids = zeros(device, uint64_t{m} * top_k * 4, DType::U32);
  const Buffer rows = zeros(device, uint64_t{m} * top_k * width * 4, DType::F32);
  const Buffer act = zeros(device, uint64_t{m} * top_k * width * 4, DType::F32);
  const Buffer out = zeros(device, uint64_t{m} * width * 4, DType::F32);
  recorded().clear();
  CommandEncoder encoder = device.command_encoder();
  encoder.start_encoded_dispatch_receipt(3);
  moe_gate(encoder, registry, logits, weights, ids, MoeGateParams{m, experts, top_k, true});
  moe_silu_mul(encoder, registry, rows, rows, act,
               MoeSiluMulParams{m * top_k, width, width, width});
  moe_combine(encoder, registry, act, weights, ids, out,
              MoeCombineParams{m, top_k, width, experts});
  const auto receipt = encoder.take_encoded_dispatch_receipt();
  encoder.commit_and_wait();
  ASSERT_EQ(receipt.size(), 3u);
  EXPECT_EQ(receipt[0].grid, (std::array<uint64_t, 3>{2, 1, 1}));
  EXPECT_EQ(receipt[1].grid, (std::array<uint64_t, 3>{2, m * top_k, 1}));
  EXPECT_EQ(receipt[2].grid, (std::array<uint64_t, 3>{2, m, 1}));
  for (const auto& dispatch : receipt) {
    EXPECT_EQ(dispatch.threads_per_threadgroup, (std::array<uint64_t, 3>{64, 1, 1}));
    EXPECT_TRUE(dispatch.threadgroup_memory.empty());
  }
  expect_bindings_match_shaders();
}

TEST(MetalKernelTable, QuantizedGeometryAndBindings) {
  // Q8_0's default mat-vec is the nr2 one ([ceil(N/2), M, 1] x [32, 4, 1], 256 bytes); with
  // dense_q8_0_mv_nr2 off it takes the Q4_0 geometry (mat-vec [ceil(N/8), M, 1] x [8, 8, 1]); its
  // matrix route [ceil(M/32), ceil(N/64), 1] x 128, 8192 bytes. The quantised expert-ID direct route the dense direct
  // geometry, its grouped route the matrix tile over routed rows after the shared map.
  const Device device(std::make_shared<TableBackend>());
  KernelRegistry registry(device);
  const uint32_t n = 70, k = 64;
  const Buffer q8_weight = zeros(device, uint64_t{n} * (k / 32) * 34, DType::U8);
  recorded().clear();
  CommandEncoder encoder = device.command_encoder();
  for (uint32_t m : {3u, 33u}) {
    const Buffer input = zeros(device, uint64_t{m} * k * 4, DType::F32);
    const Buffer output = zeros(device, uint64_t{m} * n * 4, DType::F32);
    const auto r = quantized_matmul_ggml(encoder, registry, input, q8_weight, output,
                                         GgmlQuantizedMatmulParams{m, n, k, GgmlType::Q8_0},
                                         GgmlRoutingPolicy{});
    if (m <= kGgmlMmRoutingThreshold) {
      EXPECT_EQ(r.dispatch.pipeline_label, "kernel_mul_mv_q8_0_f32_nr2|700:i1|701:i1|702:i1");
      EXPECT_EQ(r.dispatch.grid, (std::array<uint64_t, 3>{35, m, 1}));
      EXPECT_EQ(r.dispatch.threads_per_threadgroup, (std::array<uint64_t, 3>{32, 4, 1}));
      EXPECT_EQ(r.dispatch.threadgroup_memory,
                (std::vector<std::pair<uint64_t, uint64_t>>{{0, 256}}));
      GgmlRoutingPolicy without_nr2;
      without_nr2.dense_q8_0_mv_nr2 = false;
      const auto old =
          quantized_matmul_ggml(encoder, registry, input, q8_weight, output,
                                GgmlQuantizedMatmulParams{m, n, k, GgmlType::Q8_0}, without_nr2);
      EXPECT_EQ(old.dispatch.pipeline_label, "kernel_mul_mv_q8_0_f32|700:i1|701:i1|702:i1");
      EXPECT_EQ(old.dispatch.grid, (std::array<uint64_t, 3>{9, m, 1}));
      EXPECT_EQ(old.dispatch.threads_per_threadgroup, (std::array<uint64_t, 3>{8, 8, 1}));
      EXPECT_TRUE(old.dispatch.threadgroup_memory.empty());
    } else {
      EXPECT_EQ(r.dispatch.pipeline_label, "kernel_mul_mm_q8_0_f32|700:i1|701:i1|702:i1");
      EXPECT_EQ(r.dispatch.grid, (std::array<uint64_t, 3>{2, 2, 1}));
      EXPECT_EQ(r.dispatch.threads_per_threadgroup, (std::array<uint64_t, 3>{128, 1, 1}));
      EXPECT_EQ(r.dispatch.threadgroup_memory,
                (std::vector<std::pair<uint64_t, uint64_t>>{{0, 8192}}));
    }
  }

  GgmlQuantizedMatmulIdParams p;
  p.m = 9;
  p.n = 70;
  p.k = k;
  p.top_k = 2;
  p.n_experts = 4;
  p.ggml_type = GgmlType::Q4_0;
  p.expert_stride_bytes = uint64_t{n} * (k / 32) * 18;
  const Buffer weights = zeros(device, p.expert_stride_bytes * p.n_experts, DType::U8);
  const Buffer input = zeros(device, uint64_t{p.m} * k * 4, DType::F32);
  const Buffer ids = zeros(device, uint64_t{p.m} * p.top_k * 4, DType::U32);
  const Buffer output = zeros(device, uint64_t{p.m} * p.top_k * n * 4, DType::F32);
  const DenseMatmulIdScratch scratch(device, p.n_experts, p.m);
  encoder.start_encoded_dispatch_receipt(3);
  p.route = GgmlQuantizedMatmulIdRoute::Direct;
  quantized_matmul_id_ggml(encoder, registry, input, weights, ids, output, nullptr, p);
  p.route = GgmlQuantizedMatmulIdRoute::Grouped;
  quantized_matmul_id_ggml(encoder, registry, input, weights, ids, output, &scratch, p);
  const auto receipt = encoder.take_encoded_dispatch_receipt();
  encoder.commit_and_wait();
  ASSERT_EQ(receipt.size(), 3u);
  EXPECT_EQ(receipt[0].pipeline_label, "quantized_matmul_id_direct_q4_0_f32");
  EXPECT_EQ(receipt[0].grid, (std::array<uint64_t, 3>{9, 18, 1}));
  EXPECT_EQ(receipt[0].threads_per_threadgroup, (std::array<uint64_t, 3>{64, 1, 1}));
  EXPECT_EQ(receipt[1].pipeline_label, std::string(kDenseMatmulIdMapPipeline));
  EXPECT_EQ(receipt[2].pipeline_label, "quantized_matmul_id_grouped_q4_0_f32");
  EXPECT_EQ(receipt[2].grid, (std::array<uint64_t, 3>{1, 2, 4}));
  EXPECT_EQ(receipt[2].threads_per_threadgroup, (std::array<uint64_t, 3>{128, 1, 1}));
  EXPECT_EQ(receipt[2].threadgroup_memory, (std::vector<std::pair<uint64_t, uint64_t>>{{0, 8192}}));
  expect_bindings_match_shaders();
}

}  // namespace
}  // namespace routemm::metal
