// ggml_mul_mat_peer: times ggml's own MUL_MAT and MUL_MAT_ID on one ggml backend (CUDA when the ggml
// tree was built with it, else CPU), so routemm's kernels can be read beside the peer measured the same
// way on the same machine. It uses only ggml's public API.
//
// What it measures
//   MUL_MAT     weight [n rows, k] (ggml ne0 = k, ne1 = n) of type q4_0, F32 activations of m tokens;
//               shapes 4096 x 14336 and the Qwen3 q_proj 4096 x 2048, m in {1, 2, 3, 4, 5, 8}.
//   MUL_MAT_ID  Qwen3-30B-A3B experts: 128 experts of [768, 2048], top-8, bf16 and q4_0 stacks,
//               activations [2048, 1, m] broadcast to the 8 slots, m in {1, 8, 32}; ids are random
//               and distinct per token. --moe-shapes picks others: Qwen3-30B-A3B's down projection
//               (qwen3_30b_a3b_down, [2048, 768]), Qwen3.6-35B-A3B (256 experts of [512, 2048],
//               top-8) and gpt-oss-20b (32 experts of [2880, 2880], top-4); --moe-types narrows the
//               stack types, --moe-ms the token counts.
//   Each case in two modes:
//     l2       one weight (one expert stack and one ids tensor) reused by every node, as
//              test-backend-ops perf does: the weight stays in L2 when it fits;
//     rotated  C weight copies (expert stacks) whose bytes touched per node add up to at least
//              --rotate-mb (256 MB, over twice an H200's L2); node j uses copy j % C, and for
//              MUL_MAT_ID each node also has its own random ids, so no node finds its weight in L2.
//
// How
//   One ggml graph holds N (--nodes, at least C) independent mul_mat nodes sharing one input. After
//   warm-up computes (the first one also captures ggml-cuda's CUDA graph), each of --batches batches
//   queues --reps graph computes and waits on ggml_backend_synchronize; per-op time is the batch's wall
//   time / (reps * N), and the reported value is the median batch. Bandwidth counts weight bytes only
//   (for MUL_MAT_ID, the distinct experts the node's ids touch, averaged over nodes).
//   Correctness: node 0's output is compared with a float64 reference built from the dequantised weight
//   (ggml's to_float traits); rel_err = max |out - ref| / max |ref| over the checked rows.
//
// Output: one line per case, `peer op=... type=... n= k= m= experts= top_k= mode= copies= nodes= us=
// tbps= rel_err= ok|FAIL`, and with --json PATH a JSON list of the same records. Exit status 1 when a
// case fails its error check.
//
// Usage: ggml_mul_mat_peer [--backend cuda|cpu] [--json PATH] [--only mul_mat|mul_mat_id]
//   [--small] [--ms 1,2,8] [--moe-ms 1,8,32] [--moe-shapes qwen3_30b_a3b,gpt_oss_20b]
//   [--moe-types bf16,q4_0] [--nodes 32] [--reps 4] [--batches 5] [--warmup 2]
//   [--rotate-mb 256] [--max-mb 16384] [--threads T] [--tol 0.03]
//   [--shapes 4096x14336,q_proj] [--modes l2,rotated] [--stat median|min] [--read-bandwidth-mb 0]
//   [--serve]
// --small replaces every shape with a small one of the same kind (a quick check on a CPU).
//
// --serve: after each case's warm-up, the harness prints `serve op=... type=... shape=... m=...
// mode=...` and reads commands from stdin: `go` times --batches batches and prints `us=<per-op us of
// the --stat batch>`; `next` (or the end of input) goes on with the case's check and its result line.
// A driver can then take turns with another program batch by batch (bench/cpu_peer_turns.py), so the
// two see the same memory bandwidth where it drifts between runs.
//
// --moe-types picks the expert stack types (any ggml type name: bf16, q4_0, q4_K, q6_K, mxfp4, ...;
// the random quantised stacks come from ggml's own quantiser); --shapes and --modes filter
// the cases; --stat min reports the fastest batch instead of the median one. --read-bandwidth-mb S
// first prints `bandwidth read_gbps=...`: the best of 10 passes of --threads threads summing an
// S-MB buffer (each thread its own contiguous part), the machine's read bandwidth beside the cases.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#ifndef PEER_SOURCE_LABEL
#define PEER_SOURCE_LABEL ""
#endif

namespace {

struct Options {
  std::string backend;  // "" = CUDA when present, else CPU
  std::string json_path;
  std::string only;
  bool small = false;
  std::vector<int> ms = {1, 2, 3, 4, 5, 8};
  std::vector<int> moe_ms = {1, 8, 32};
  std::vector<std::string> moe_shapes = {"qwen3_30b_a3b"};
  std::vector<ggml_type> moe_types = {GGML_TYPE_BF16, GGML_TYPE_Q4_0};
  int nodes = 32;
  int reps = 4;
  int batches = 5;
  int warmup = 2;
  double rotate_mb = 256.0;
  double max_mb = 16384.0;
  int threads = 0;
  double tol = 0.03;
  std::string shapes;  // comma-separated shape names, "" = all
  std::string modes;   // comma-separated l2/rotated, "" = both
  bool min_stat = false;
  bool serve = false;
  double read_bandwidth_mb = 0;
};

bool listed(const std::string& list, const std::string& item) {
  if (list.empty()) return true;
  return ("," + list + ",").find("," + item + ",") != std::string::npos;
}

ggml_type parse_type(const std::string& name) {
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const char* type_name = ggml_type_name((ggml_type)t);
    if (type_name != nullptr && name == type_name) return (ggml_type)t;
  }
  std::fprintf(stderr, "unknown ggml type %s\n", name.c_str());
  std::exit(2);
}

std::vector<ggml_type> parse_types(const char* s) {
  std::vector<ggml_type> v;
  std::string item;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!item.empty()) v.push_back(parse_type(item));
      item.clear();
      if (*p == '\0') break;
    } else {
      item += *p;
    }
  }
  return v;
}

struct Case {
  bool moe = false;
  ggml_type type = GGML_TYPE_Q4_0;
  int64_t n = 0, k = 0, m = 0;
  int64_t experts = 0, top_k = 0;
  bool rotated = false;
  std::string shape_name;
};

struct Result {
  Case c;
  int copies = 0, nodes = 0;
  double us = 0, tbps = 0, rel_err = 0;
  bool ok = false;
};

// splitmix64: a small, fast, reproducible generator for weights, activations and ids.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return (float)((next() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }
};

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

std::vector<std::string> parse_names(const char* s) {
  std::vector<std::string> v;
  std::string item;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!item.empty()) v.push_back(item);
      item.clear();
      if (*p == '\0') break;
    } else {
      item += *p;
    }
  }
  return v;
}

// The MUL_MAT_ID expert shapes --moe-shapes may name: experts of [n, k], top_k of them per token.
struct MoeShape {
  const char* name;
  int64_t n, k, experts, top_k;
};
constexpr MoeShape kMoeShapes[] = {{"qwen3_30b_a3b", 768, 2048, 128, 8},
                                   {"qwen3_30b_a3b_down", 2048, 768, 128, 8},
                                   {"qwen3.6_35b_a3b", 512, 2048, 256, 8},
                                   {"gpt_oss_20b", 2880, 2880, 32, 4}};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Host bytes of one weight (rows x k of `type`), random uniform in [-1, 1] before conversion, built in
// chunks so a 128-expert stack never needs its whole F32 image. Cached per (type, rows, k, seed).
const std::vector<uint8_t>& host_weight(ggml_type type, int64_t rows, int64_t k, uint64_t seed) {
  static std::map<std::tuple<int, int64_t, int64_t, uint64_t>, std::vector<uint8_t>> cache;
  auto key = std::make_tuple((int)type, rows, k, seed);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const size_t row_bytes = ggml_row_size(type, k);
  std::vector<uint8_t> bytes(row_bytes * rows);
  const int64_t chunk = 1024;
  std::vector<float> f((size_t)(chunk * k));
  Rng rng(seed);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t nr = std::min(chunk, rows - r0);
    for (int64_t i = 0; i < nr * k; ++i) f[i] = rng.uniform();
    if (type == GGML_TYPE_F32) {  // stored as is (ggml_quantize_chunk has no F32 path)
      std::memcpy(bytes.data() + r0 * row_bytes, f.data(), (size_t)(nr * k) * sizeof(float));
    } else {
      ggml_quantize_chunk(type, f.data(), bytes.data() + r0 * row_bytes, 0, nr, k, nullptr);
    }
  }
  return cache.emplace(key, std::move(bytes)).first->second;
}

// Random distinct expert ids for each of m tokens: ids[t * top_k + s].
std::vector<int32_t> random_ids(int64_t experts, int64_t top_k, int64_t m, Rng& rng) {
  std::vector<int32_t> ids((size_t)(top_k * m));
  std::vector<int32_t> perm((size_t)experts);
  for (int64_t t = 0; t < m; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t s = 0; s < top_k; ++s) {
      const int64_t j = s + (int64_t)(rng.next() % (uint64_t)(experts - s));
      std::swap(perm[s], perm[j]);
      ids[t * top_k + s] = perm[s];
    }
  }
  return ids;
}

int64_t distinct_experts(const std::vector<int32_t>& ids) {
  return (int64_t)std::set<int32_t>(ids.begin(), ids.end()).size();
}

// Float64 reference of row `row` of a weight (or expert) at `w`, dotted with token vector x.
double ref_dot(const ggml_type_traits* tr, const uint8_t* w_row, int64_t k, const float* x,
               std::vector<float>& scratch) {
  if (tr->to_float != nullptr) {
    tr->to_float(w_row, scratch.data(), k);
  } else {  // F32 rows have no conversion
    std::memcpy(scratch.data(), w_row, (size_t)k * sizeof(float));
  }
  double acc = 0;
  for (int64_t i = 0; i < k; ++i) acc += (double)scratch[i] * (double)x[i];
  return acc;
}

// Expected bytes of weight a node touches: the whole weight for MUL_MAT, the expected distinct experts
// of m tokens choosing top_k of `experts` for MUL_MAT_ID (used only to size the rotation).
double touched_bytes(const Case& c, size_t weight_bytes) {
  if (!c.moe) return (double)weight_bytes;
  const double p_miss = std::pow(1.0 - (double)c.top_k / (double)c.experts, (double)c.m);
  const double expected = (double)c.experts * (1.0 - p_miss);
  return (double)weight_bytes / (double)c.experts * expected;
}

bool run_case(ggml_backend_t backend, const Options& opt, const Case& c, Result& res) {
  const int64_t rows = c.moe ? c.n * c.experts : c.n;
  const size_t weight_bytes = ggml_row_size(c.type, c.k) * rows;
  const std::vector<uint8_t>& wbytes = host_weight(c.type, rows, c.k, 1234 + c.k * 7 + c.n);

  int copies = 1;
  if (c.rotated) {
    const double touched = touched_bytes(c, weight_bytes);
    copies = std::max(2, (int)std::ceil(opt.rotate_mb * 1e6 / touched));
    const int cap = std::max(2, (int)(opt.max_mb * 1e6 / (double)weight_bytes));
    copies = std::min(copies, cap);
  }
  const int nodes = std::max(opt.nodes, copies);
  const int n_ids = c.moe ? (c.rotated ? nodes : 1) : 0;

  const size_t n_tensors = (size_t)(copies + 1 + n_ids + nodes) + 8;  // graph size: nodes + leafs
  ggml_init_params ip = {
      n_tensors * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_tensors, false), nullptr,
      true};
  ggml_context* ctx = ggml_init(ip);

  std::vector<ggml_tensor*> w(copies), ids(n_ids), out(nodes);
  for (int i = 0; i < copies; ++i) {
    w[i] = c.moe ? ggml_new_tensor_3d(ctx, c.type, c.k, c.n, c.experts)
                 : ggml_new_tensor_2d(ctx, c.type, c.k, c.n);
  }
  ggml_tensor* x = c.moe ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.k, 1, c.m)
                         : ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.k, c.m);
  for (int i = 0; i < n_ids; ++i) ids[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, c.top_k, c.m);
  ggml_cgraph* gf = ggml_new_graph_custom(ctx, n_tensors, false);
  for (int j = 0; j < nodes; ++j) {
    ggml_tensor* wj = w[j % copies];
    out[j] = c.moe ? ggml_mul_mat_id(ctx, wj, x, ids[c.rotated ? j : 0]) : ggml_mul_mat(ctx, wj, x);
    ggml_build_forward_expand(gf, out[j]);
  }
  ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
  if (!buf) {
    std::fprintf(stderr, "allocation failed (%d copies of %.1f MB)\n", copies, weight_bytes / 1e6);
    ggml_free(ctx);
    return false;
  }

  for (int i = 0; i < copies; ++i) ggml_backend_tensor_set(w[i], wbytes.data(), 0, weight_bytes);
  Rng rng(99 + c.m);
  std::vector<float> xh((size_t)(c.k * c.m));
  for (float& v : xh) v = rng.uniform();
  ggml_backend_tensor_set(x, xh.data(), 0, xh.size() * sizeof(float));
  std::vector<std::vector<int32_t>> idh(n_ids);
  double touched_sum = 0;
  for (int i = 0; i < n_ids; ++i) {
    idh[i] = random_ids(c.experts, c.top_k, c.m, rng);
    ggml_backend_tensor_set(ids[i], idh[i].data(), 0, idh[i].size() * sizeof(int32_t));
    touched_sum += (double)distinct_experts(idh[i]) * (double)weight_bytes / (double)c.experts;
  }
  const double bytes_per_node = c.moe ? touched_sum / n_ids : (double)weight_bytes;

  for (int i = 0; i < opt.warmup; ++i) ggml_backend_graph_compute(backend, gf);
  ggml_backend_synchronize(backend);
  // Per-op seconds of opt.batches batches, the median or (--stat min) the fastest.
  const auto time_batches = [&] {
    std::vector<double> per_op;
    for (int b = 0; b < opt.batches; ++b) {
      const double t0 = now_s();
      for (int r = 0; r < opt.reps; ++r) ggml_backend_graph_compute_async(backend, gf);
      ggml_backend_synchronize(backend);
      per_op.push_back((now_s() - t0) / ((double)opt.reps * nodes));
    }
    std::sort(per_op.begin(), per_op.end());
    return opt.min_stat ? per_op.front() : per_op[per_op.size() / 2];
  };
  double sec = 0;
  if (opt.serve) {  // see --serve in the header; the reported time is the best `go`
    std::printf("serve op=%s type=%s shape=%s m=%lld mode=%s\n", c.moe ? "MUL_MAT_ID" : "MUL_MAT",
                ggml_type_name(c.type), c.shape_name.c_str(), (long long)c.m,
                c.rotated ? "rotated" : "l2");
    std::fflush(stdout);
    sec = 1e30;
    char line[64];
    while (std::fgets(line, sizeof line, stdin) != nullptr && std::strncmp(line, "next", 4) != 0) {
      if (std::strncmp(line, "go", 2) != 0) {
        std::fprintf(stderr, "unknown serve command %s", line);
        continue;
      }
      const double t = time_batches();
      sec = std::min(sec, t);
      std::printf("us=%.3f\n", t * 1e6);
      std::fflush(stdout);
    }
    if (sec == 1e30) sec = time_batches();
  } else {
    sec = time_batches();
  }

  // Check node 0 against float64 over a row subset sized to ~64M multiply-adds.
  std::vector<float> oh((size_t)ggml_nelements(out[0]));
  ggml_backend_tensor_get(out[0], oh.data(), 0, oh.size() * sizeof(float));
  const ggml_type_traits* tr = ggml_get_type_traits(c.type);
  const size_t row_bytes = ggml_row_size(c.type, c.k);
  const int64_t slots = c.moe ? c.top_k : 1;
  const double work = (double)c.n * c.k * c.m * slots;
  const int64_t stride = std::max<int64_t>(1, (int64_t)(work / 64e6));
  std::vector<int64_t> check_rows;
  for (int64_t i = 0; i < c.n; i += stride) check_rows.push_back(i);
  if (check_rows.back() != c.n - 1) check_rows.push_back(c.n - 1);
  std::vector<float> scratch((size_t)c.k);
  double max_diff = 0, max_ref = 0;
  for (int64_t t = 0; t < c.m; ++t) {
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t e = c.moe ? idh[0][t * c.top_k + s] : 0;
      for (int64_t i : check_rows) {
        const uint8_t* row = wbytes.data() + (e * c.n + i) * row_bytes;
        const double ref = ref_dot(tr, row, c.k, xh.data() + t * c.k, scratch);
        const double got = oh[(size_t)((t * slots + s) * c.n + i)];
        max_diff = std::max(max_diff, std::fabs(got - ref));
        max_ref = std::max(max_ref, std::fabs(ref));
      }
    }
  }

  res.c = c;
  res.copies = copies;
  res.nodes = nodes;
  res.us = sec * 1e6;
  res.tbps = bytes_per_node / sec / 1e12;
  res.rel_err = max_ref > 0 ? max_diff / max_ref : max_diff;
  res.ok = std::isfinite(res.rel_err) && res.rel_err <= opt.tol;

  ggml_backend_buffer_free(buf);
  ggml_free(ctx);
  return true;
}

// Best of 10 passes of `threads` threads each summing its contiguous part of an `mb`-MB buffer
// (eight independent 64-bit accumulators per thread, which compilers vectorise), in GB/s.
double read_bandwidth_gbps(double mb, int threads) {
  const size_t words = (size_t)(mb * 1e6) / sizeof(uint64_t) / 8 * 8;
  std::vector<uint64_t> buffer(words);
  for (size_t i = 0; i < words; ++i) buffer[i] = i;
  std::vector<uint64_t> sink(threads);
  double best = 1e30;
  for (int pass = 0; pass < 10; ++pass) {
    const double t0 = now_s();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        const size_t begin = words * t / threads / 8 * 8, end = words * (t + 1) / threads / 8 * 8;
        uint64_t acc[8] = {};
        for (size_t i = begin; i < end; i += 8) {
          for (int l = 0; l < 8; ++l) acc[l] += buffer[i + l];
        }
        sink[t] = acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7];
      });
    }
    for (std::thread& w : workers) w.join();
    best = std::min(best, now_s() - t0);
  }
  volatile uint64_t keep = 0;
  for (uint64_t v : sink) keep = keep ^ v;
  (void)keep;
  return (double)words * sizeof(uint64_t) / best / 1e9;
}

std::vector<Case> build_cases(const Options& opt) {
  std::vector<Case> cases;
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  std::vector<Shape> dense = {{"4096x14336", 4096, 14336}, {"q_proj", 4096, 2048}};
  std::vector<MoeShape> moe;
  for (const std::string& name : opt.moe_shapes) {
    for (const MoeShape& shape : kMoeShapes) {
      if (name == shape.name) moe.push_back(shape);
    }
  }
  if (opt.small) {
    dense = {{"small", 256, 1024}};
    moe = {{"small_moe", 64, 256, 16, 4}};
  }
  for (bool rotated : {false, true}) {
    if (!listed(opt.modes, rotated ? "rotated" : "l2")) continue;
    if (opt.only.empty() || opt.only == "mul_mat") {
      for (const Shape& s : dense) {
        if (!listed(opt.shapes, s.name)) continue;
        for (int m : opt.ms) {
          Case c;
          c.type = GGML_TYPE_Q4_0, c.n = s.n, c.k = s.k, c.m = m, c.rotated = rotated;
          c.shape_name = s.name;
          cases.push_back(c);
        }
      }
    }
    if (opt.only.empty() || opt.only == "mul_mat_id") {
      for (const MoeShape& shape : moe) {
        for (ggml_type t : opt.moe_types) {
          if (shape.k % ggml_blck_size(t) != 0) continue;  // a K-quant needs K % 256 == 0
          for (int m : opt.moe_ms) {
            Case c;
            c.moe = true, c.type = t, c.n = shape.n, c.k = shape.k, c.m = m;
            c.experts = shape.experts, c.top_k = shape.top_k, c.rotated = rotated;
            c.shape_name = shape.name;
            cases.push_back(c);
          }
        }
      }
    }
  }
  return cases;
}

// The widest x86 / Arm vector extension ggml's CPU backend was compiled for (its ggml_cpu_has_*
// report the build's instruction set): the CPU rows of a comparison name it.
std::string cpu_isa() {
  if (ggml_cpu_has_avx512()) return "avx512";
  if (ggml_cpu_has_avx2()) return "avx2";
  if (ggml_cpu_has_sve()) return "sve";
  if (ggml_cpu_has_neon()) return "neon";
  return "portable";
}

std::string peer_label(ggml_backend_t backend) {
  std::string s =
      std::string("llama.cpp ggml-") + ggml_backend_name(backend) + " " + ggml_version();
  if (std::strlen(PEER_SOURCE_LABEL)) s += std::string(" (") + PEER_SOURCE_LABEL + ")";
  return s;
}

void write_json(const std::string& path, const std::string& peer, const std::string& device,
                const std::vector<Result>& results) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(f, "[\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const double rel_err = std::isfinite(r.rel_err) ? r.rel_err : 1e30;  // JSON has no NaN
    std::fprintf(f,
                 "  {\"peer\": \"%s\", \"device\": \"%s\", \"op\": \"%s\", \"type\": \"%s\", "
                 "\"shape\": \"%s\", \"n\": %lld, \"k\": %lld, \"m\": %lld, \"experts\": %lld, "
                 "\"top_k\": %lld, \"mode\": \"%s\", \"copies\": %d, \"nodes\": %d, \"us\": %.4f, "
                 "\"tbps\": %.4f, \"rel_err\": %.3e, \"ok\": %s, \"cpu_isa\": \"%s\"}%s\n",
                 peer.c_str(), device.c_str(), r.c.moe ? "MUL_MAT_ID" : "MUL_MAT",
                 ggml_type_name(r.c.type), r.c.shape_name.c_str(), (long long)r.c.n,
                 (long long)r.c.k, (long long)r.c.m, (long long)r.c.experts, (long long)r.c.top_k,
                 r.c.rotated ? "rotated" : "l2", r.copies, r.nodes, r.us, r.tbps, rel_err,
                 r.ok ? "true" : "false", cpu_isa().c_str(), i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "]\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--backend")
      opt.backend = val();
    else if (a == "--json")
      opt.json_path = val();
    else if (a == "--only")
      opt.only = val();
    else if (a == "--small")
      opt.small = true;
    else if (a == "--ms")
      opt.ms = parse_list(val());
    else if (a == "--moe-ms")
      opt.moe_ms = parse_list(val());
    else if (a == "--moe-shapes") {
      opt.moe_shapes = parse_names(val());
      for (const std::string& name : opt.moe_shapes) {
        const bool known = std::any_of(std::begin(kMoeShapes), std::end(kMoeShapes),
                                       [&](const MoeShape& shape) { return name == shape.name; });
        if (!known) {
          std::fprintf(stderr,
                       "unknown --moe-shapes entry %s (qwen3_30b_a3b, qwen3_30b_a3b_down, "
                       "qwen3.6_35b_a3b, gpt_oss_20b)\n",
                       name.c_str());
          return 2;
        }
      }
    } else if (a == "--nodes")
      opt.nodes = std::atoi(val());
    else if (a == "--reps")
      opt.reps = std::atoi(val());
    else if (a == "--batches")
      opt.batches = std::atoi(val());
    else if (a == "--warmup")
      opt.warmup = std::atoi(val());
    else if (a == "--rotate-mb")
      opt.rotate_mb = std::atof(val());
    else if (a == "--max-mb")
      opt.max_mb = std::atof(val());
    else if (a == "--threads")
      opt.threads = std::atoi(val());
    else if (a == "--tol")
      opt.tol = std::atof(val());
    else if (a == "--moe-types")
      opt.moe_types = parse_types(val());
    else if (a == "--shapes")
      opt.shapes = val();
    else if (a == "--modes")
      opt.modes = val();
    else if (a == "--stat")
      opt.min_stat = std::string(val()) == "min";
    else if (a == "--serve")
      opt.serve = true;
    else if (a == "--read-bandwidth-mb")
      opt.read_bandwidth_mb = std::atof(val());
    else {
      std::fprintf(stderr, "unknown argument %s (see the header of ggml_mul_mat_peer.cpp)\n",
                   a.c_str());
      return 2;
    }
  }

  ggml_backend_t backend = nullptr;
  if (opt.backend.empty() || opt.backend == "cuda") {
    backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_GPU, nullptr);
    if (!backend && opt.backend == "cuda") {
      std::fprintf(stderr, "no GPU backend in this ggml build\n");
      return 2;
    }
  }
  if (!backend) backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
  if (!backend) {
    std::fprintf(stderr, "no ggml backend\n");
    return 2;
  }
  if (ggml_backend_is_cpu(backend)) {
    const int t =
        opt.threads > 0 ? opt.threads : (int)std::max(1u, std::thread::hardware_concurrency());
    ggml_backend_cpu_set_n_threads(backend, t);
  }
  ggml_backend_dev_t dev = ggml_backend_get_device(backend);
  const std::string device = dev ? ggml_backend_dev_description(dev) : "";
  const std::string peer = peer_label(backend);
  std::printf("# peer: %s on %s\n", peer.c_str(), device.c_str());
  std::fflush(stdout);

  if (opt.read_bandwidth_mb > 0) {
    const int t =
        opt.threads > 0 ? opt.threads : (int)std::max(1u, std::thread::hardware_concurrency());
    std::printf("bandwidth read_gbps=%.2f threads=%d mb=%.0f\n",
                read_bandwidth_gbps(opt.read_bandwidth_mb, t), t, opt.read_bandwidth_mb);
    std::fflush(stdout);
  }

  std::vector<Result> results;
  bool all_ok = true;
  for (const Case& c : build_cases(opt)) {
    Result r;
    if (!run_case(backend, opt, c, r)) {
      all_ok = false;
      continue;
    }
    all_ok = all_ok && r.ok;
    std::printf(
        "peer op=%s type=%s shape=%s n=%lld k=%lld m=%lld experts=%lld top_k=%lld mode=%s "
        "copies=%d "
        "nodes=%d us=%.3f tbps=%.3f rel_err=%.2e %s\n",
        c.moe ? "MUL_MAT_ID" : "MUL_MAT", ggml_type_name(c.type), c.shape_name.c_str(),
        (long long)c.n, (long long)c.k, (long long)c.m, (long long)c.experts, (long long)c.top_k,
        c.rotated ? "rotated" : "l2", r.copies, r.nodes, r.us, r.tbps, r.rel_err,
        r.ok ? "ok" : "FAIL");
    std::fflush(stdout);
    results.push_back(r);
  }
  if (!opt.json_path.empty()) write_json(opt.json_path, peer, device, results);
  ggml_backend_free(backend);
  return all_ok ? 0 : 1;
}
