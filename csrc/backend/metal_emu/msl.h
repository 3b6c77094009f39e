// An implementation of the subset of the Metal Shading Language that metal/*.metal use, for the
// host C++ compiler: the shaders compile unchanged against it and run on the execution model of
// runtime.h (threadgroups of cooperative fibers, 32-lane simdgroups exchanging values in lockstep).
//
// What is modelled and how:
//   * address spaces (device, constant, threadgroup, thread) are plain pointers; the execution
//     model tells them apart by address (runtime.h) and checks every access the compiler
//     instruments (shader translation units are built with -fsanitize=thread, whose hooks the
//     runtime implements: no ThreadSanitizer runtime is linked);
//   * scalar types with MSL's sizes (half = IEEE binary16, bfloat = the high half of binary32),
//     vectors with MSL's sizes and alignments (a 3-vector occupies 4 elements);
//   * simd_* functions, barriers and simdgroup matrices are synchronisation points: the calling
//     lane blocks until the model has gathered the lanes that take part (runtime.h states the
//     rules, including what Metal leaves undefined and the model therefore reports);
//   * atomics are real host atomics, checked like any other access but never counted as races.
//
// Under ROUTEMM_MSL_SIGNATURES (the binder's preprocessing pass, bind_shaders.py) this header is
// empty, so that kernel signatures keep their MSL keywords and attributes as written.
#pragma once

#if !defined(__METAL_VERSION__)
#error "msl.h implements MSL for the execution model: compile shaders with -D__METAL_VERSION__"
#endif

#ifndef ROUTEMM_MSL_SIGNATURES

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <string>
#include <type_traits>

#include "backend/metal_emu/runtime_api.h"

// ---- Keywords --------------------------------------------------------------------------------------
// Kernels are ordinary functions (the binder wraps each file in a namespace of its own and calls
// them from generated entry points); address spaces are plain pointers.
#define kernel
#define device
#define constant
#define threadgroup
#define thread

// Helpers of this header that touch the model's own memory are not instrumented: only the
// shader's accesses are checked (the runtime checks matrix stores and atomics explicitly).
#define ROUTEMM_MSL_UNCHECKED __attribute__((no_sanitize("thread"), noinline))

// ---- Scalar types ----------------------------------------------------------------------------------
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
static_assert(sizeof(ulong) == 8, "MSL ulong is 64-bit");
typedef _Float16 half;

// bfloat: binary32's high 16 bits; conversions from float round to nearest even.
struct bfloat {
  ushort bits = 0;
  bfloat() = default;
  bfloat(float f) {  // NOLINT: implicit, as in MSL
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<ushort>((u >> 16) | 0x40u);  // quiet NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<ushort>(u >> 16);
    }
  }
  operator float() const { return std::bit_cast<float>(uint32_t{bits} << 16); }
};

namespace metal {

// ---- Vectors -----------------------------------------------------------------------------------
// MSL layout: an N-vector of T is aligned to its size; a 3-vector has the size of a 4-vector.
// Components are named x, y, z, w and indexable.
template <class T, int N>
struct vec;

}  // namespace metal

namespace metal {
#define ROUTEMM_MSL_VEC_COMMON(N)                                  \
  vec() = default;                                                 \
  explicit vec(T all) {                                            \
    for (int i = 0; i < N; ++i) (*this)[i] = all;                  \
  }                                                                \
  template <class U>                                               \
  explicit vec(const vec<U, N>& o) {                               \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]); \
  }                                                                \
  T& operator[](int i) { return reinterpret_cast<T*>(this)[i]; }   \
  const T& operator[](int i) const { return reinterpret_cast<const T*>(this)[i]; }

template <class T>
struct alignas(sizeof(T) * 2) vec<T, 2> {
  T x = {}, y = {};
  ROUTEMM_MSL_VEC_COMMON(2)
  template <class A, class B>
  vec(A a, B b) : x(static_cast<T>(a)), y(static_cast<T>(b)) {}
};
template <class T>
struct alignas(sizeof(T) * 4) vec<T, 3> {
  T x = {}, y = {}, z = {};
  ROUTEMM_MSL_VEC_COMMON(3)
  template <class A, class B, class C>
  vec(A a, B b, C c) : x(static_cast<T>(a)), y(static_cast<T>(b)), z(static_cast<T>(c)) {}
};
template <class T>
struct alignas(sizeof(T) * 4) vec<T, 4> {
  T x = {}, y = {}, z = {}, w = {};
  ROUTEMM_MSL_VEC_COMMON(4)
  template <class A, class B, class C, class D>
  vec(A a, B b, C c, D d)
      : x(static_cast<T>(a)), y(static_cast<T>(b)), z(static_cast<T>(c)), w(static_cast<T>(d)) {}
};
#undef ROUTEMM_MSL_VEC_COMMON

#define ROUTEMM_MSL_VEC_OP(op)                                    \
  template <class T, int N>                                       \
  vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {        \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];              \
    return a;                                                     \
  }                                                               \
  template <class T, int N, class S>                              \
    requires std::is_arithmetic_v<S>                              \
  vec<T, N> operator op(vec<T, N> a, S s) {                       \
    for (int i = 0; i < N; ++i) a[i] = a[i] op static_cast<T>(s); \
    return a;                                                     \
  }                                                               \
  template <class T, int N, class S>                              \
    requires std::is_arithmetic_v<S>                              \
  vec<T, N> operator op(S s, vec<T, N> a) {                       \
    for (int i = 0; i < N; ++i) a[i] = static_cast<T>(s) op a[i]; \
    return a;                                                     \
  }                                                               \
  template <class T, int N, class S>                              \
  vec<T, N>& operator op## = (vec<T, N> & a, const S& b) {        \
    a = a op b;                                                   \
    return a;                                                     \
  }
ROUTEMM_MSL_VEC_OP(+)
ROUTEMM_MSL_VEC_OP(-)
ROUTEMM_MSL_VEC_OP(*)
ROUTEMM_MSL_VEC_OP(/)
#undef ROUTEMM_MSL_VEC_OP

template <class T, int N>
bool operator==(const vec<T, N>& a, const vec<T, N>& b) {
  for (int i = 0; i < N; ++i) {
    if (!(a[i] == b[i])) return false;
  }
  return true;
}

// Packed vectors: N elements with the alignment of one, indexable and convertible to vec.
template <class T, int N>
struct packed_vec {
  T v[N];
  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }
  operator vec<T, N>() const {  // NOLINT: implicit, as in MSL
    vec<T, N> out;
    for (int i = 0; i < N; ++i) out[i] = v[i];
    return out;
  }
};

}  // namespace metal

#define ROUTEMM_MSL_VECTORS(T)   \
  typedef metal::vec<T, 2> T##2; \
  typedef metal::vec<T, 3> T##3; \
  typedef metal::vec<T, 4> T##4;
ROUTEMM_MSL_VECTORS(float)
ROUTEMM_MSL_VECTORS(half)
ROUTEMM_MSL_VECTORS(bfloat)
ROUTEMM_MSL_VECTORS(int)
ROUTEMM_MSL_VECTORS(uint)
ROUTEMM_MSL_VECTORS(short)
ROUTEMM_MSL_VECTORS(ushort)
ROUTEMM_MSL_VECTORS(char)
ROUTEMM_MSL_VECTORS(uchar)
ROUTEMM_MSL_VECTORS(long)
ROUTEMM_MSL_VECTORS(ulong)
ROUTEMM_MSL_VECTORS(bool)
#undef ROUTEMM_MSL_VECTORS
typedef metal::packed_vec<float, 2> packed_float2;
typedef metal::packed_vec<float, 4> packed_float4;

namespace metal {

// ---- Math --------------------------------------------------------------------------------------
// Single rounding as in MSL (fma is fused; the shaders' numeric contracts rely on it).
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) {
  return static_cast<half>(static_cast<double>(a) * static_cast<double>(b) +
                           static_cast<double>(c));
}
template <class T, int N>
vec<T, N> fma(vec<T, N> a, const vec<T, N>& b, const vec<T, N>& c) {
  for (int i = 0; i < N; ++i) a[i] = fma(a[i], b[i], c[i]);
  return a;
}
template <class T>
T min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return std::fmin(a, b);
  return b < a ? b : a;
}
template <class T>
T max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return std::fmax(a, b);
  return a < b ? b : a;
}
template <class T>
T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
using std::abs;
using std::ceil;
using std::cos;
using std::exp;
using std::exp2;
using std::fabs;
using std::floor;
using std::isfinite;
using std::isinf;
using std::isnan;
using std::log;
using std::log2;
using std::pow;
using std::round;
using std::sin;
using std::sqrt;
using std::tanh;
using std::trunc;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace precise {
using metal::exp;
using metal::fma;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
using metal::tanh;
}  // namespace precise
namespace fast {
using metal::exp;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
using metal::tanh;
}  // namespace fast

template <class To, class From>
To as_type(const From& value) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of one size");
  return std::bit_cast<To>(value);
}

// ---- Barriers ------------------------------------------------------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<uint>(a) | static_cast<uint>(b));
}
inline void threadgroup_barrier(mem_flags flags,
                                std::source_location at = std::source_location::current()) {
  routemm::metal_emu::barrier(routemm::metal_emu::BarrierScope::Threadgroup,
                              static_cast<uint>(flags), at);
}
inline void simdgroup_barrier(mem_flags flags,
                              std::source_location at = std::source_location::current()) {
  routemm::metal_emu::barrier(routemm::metal_emu::BarrierScope::Simdgroup, static_cast<uint>(flags),
                              at);
}

// ---- SIMD-group functions ------------------------------------------------------------------------
// Each is one exchange (runtime_api.h): every lane taking part deposits its value, and reads the
// deposits of the others. Reductions combine the active lanes along a butterfly (offsets 16, 8,
// 4, 2, 1), so every lane gets the same bits, as on hardware.
namespace simd_detail {
using routemm::metal_emu::Exchange;
using routemm::metal_emu::ExchangeRule;

template <class T>
ROUTEMM_MSL_UNCHECKED T value_of(const Exchange& ex, uint lane) {
  T v;
  std::memcpy(&v, ex.values + lane * routemm::metal_emu::kExchangeSlotBytes, sizeof(T));
  return v;
}

template <class T, class Op>
T butterfly(const Exchange& ex, T identity, Op op) {
  T v[32];
  for (uint l = 0; l < 32; ++l) v[l] = (ex.active >> l) & 1u ? value_of<T>(ex, l) : identity;
  for (uint offset = 16; offset >= 1; offset /= 2) {
    T next[32];
    for (uint l = 0; l < 32; ++l) next[l] = op(v[l], v[l ^ offset]);
    for (uint l = 0; l < 32; ++l) v[l] = next[l];
  }
  return v[ex.lane];
}

template <class T>
Exchange exchange(const char* op, const T& value, ExchangeRule rule, uint source,
                  const std::source_location& at) {
  static_assert(sizeof(T) <= routemm::metal_emu::kExchangeSlotBytes);
  return routemm::metal_emu::exchange(op, &value, sizeof(T), rule, source, at);
}

template <class T, class Op>
T scan(const char* name, T value, T identity, bool inclusive, Op op,
       const std::source_location& at) {
  const Exchange ex = exchange(name, value, ExchangeRule::ActiveLanes, 0, at);
  T acc = identity;
  for (uint l = 0; l < ex.lane; ++l) {
    if ((ex.active >> l) & 1u) acc = op(acc, value_of<T>(ex, l));
  }
  return inclusive ? op(acc, value) : acc;
}
}  // namespace simd_detail

#define ROUTEMM_MSL_AT std::source_location at = std::source_location::current()

template <class T>
T simd_sum(T value, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_sum", value, simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::butterfly(ex, T(0), [](T a, T b) { return a + b; });
}
template <class T>
T simd_product(T value, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_product", value, simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::butterfly(ex, T(1), [](T a, T b) { return a * b; });
}
template <class T>
T simd_max(T value, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_max", value, simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::butterfly(ex, value, [](T a, T b) { return metal::max(a, b); });
}
template <class T>
T simd_min(T value, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_min", value, simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::butterfly(ex, value, [](T a, T b) { return metal::min(a, b); });
}
template <class T>
T simd_or(T value, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_or", value, simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::butterfly(ex, T(0), [](T a, T b) { return T(a | b); });
}
template <class T>
T simd_and(T value, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_and", value, simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::butterfly(ex, T(~T(0)), [](T a, T b) { return T(a & b); });
}
inline bool simd_any(bool value, ROUTEMM_MSL_AT) { return simd_or(uint(value), at) != 0; }
inline bool simd_all(bool value, ROUTEMM_MSL_AT) { return simd_and(uint(value), at) != 0; }
template <class T>
T simd_prefix_inclusive_sum(T value, ROUTEMM_MSL_AT) {
  return simd_detail::scan(
      "simd_prefix_inclusive_sum", value, T(0), true, [](T a, T b) { return a + b; }, at);
}
template <class T>
T simd_prefix_exclusive_sum(T value, ROUTEMM_MSL_AT) {
  return simd_detail::scan(
      "simd_prefix_exclusive_sum", value, T(0), false, [](T a, T b) { return a + b; }, at);
}
template <class T>
T simd_prefix_inclusive_product(T value, ROUTEMM_MSL_AT) {
  return simd_detail::scan(
      "simd_prefix_inclusive_product", value, T(1), true, [](T a, T b) { return a * b; }, at);
}
template <class T>
T simd_prefix_exclusive_product(T value, ROUTEMM_MSL_AT) {
  return simd_detail::scan(
      "simd_prefix_exclusive_product", value, T(1), false, [](T a, T b) { return a * b; }, at);
}

// Reads of another lane: that lane must be active at the same call (the model reports a read of
// an inactive lane, which Metal leaves undefined). simd_broadcast's lane must also be the same for
// every active lane.
template <class T>
T simd_shuffle(T value, ushort lane, ROUTEMM_MSL_AT) {
  const auto ex =
      simd_detail::exchange("simd_shuffle", value, simd_detail::ExchangeRule::ReadsLane, lane, at);
  return simd_detail::value_of<T>(ex, lane);
}
template <class T>
T simd_broadcast(T value, ushort lane, ROUTEMM_MSL_AT) {
  const auto ex = simd_detail::exchange("simd_broadcast", value,
                                        simd_detail::ExchangeRule::UniformSource, lane, at);
  return simd_detail::value_of<T>(ex, lane);
}
template <class T>
T simd_broadcast_first(T value, ROUTEMM_MSL_AT) {
  const auto ex = simd_detail::exchange("simd_broadcast_first", value,
                                        simd_detail::ExchangeRule::ActiveLanes, 0, at);
  return simd_detail::value_of<T>(ex, static_cast<uint>(std::countr_zero(ex.active)));
}
// shuffle_up / down: lanes whose source falls outside the simdgroup keep their own value.
template <class T>
T simd_shuffle_up(T value, ushort delta, ROUTEMM_MSL_AT) {
  const uint self = routemm::metal_emu::current_lane();
  const bool inside = self >= delta;
  const auto ex = simd_detail::exchange(
      "simd_shuffle_up", value,
      inside ? simd_detail::ExchangeRule::ReadsLane : simd_detail::ExchangeRule::ActiveLanes,
      inside ? self - delta : 0, at);
  return inside ? simd_detail::value_of<T>(ex, self - delta) : value;
}
template <class T>
T simd_shuffle_down(T value, ushort delta, ROUTEMM_MSL_AT) {
  const uint self = routemm::metal_emu::current_lane();
  const bool inside = self + delta < 32;
  const auto ex = simd_detail::exchange(
      "simd_shuffle_down", value,
      inside ? simd_detail::ExchangeRule::ReadsLane : simd_detail::ExchangeRule::ActiveLanes,
      inside ? self + delta : 0, at);
  return inside ? simd_detail::value_of<T>(ex, self + delta) : value;
}
template <class T>
T simd_shuffle_xor(T value, ushort mask, ROUTEMM_MSL_AT) {
  const uint source = (routemm::metal_emu::current_lane() ^ mask) & 31u;
  const auto ex = simd_detail::exchange("simd_shuffle_xor", value,
                                        simd_detail::ExchangeRule::ReadsLane, source, at);
  return simd_detail::value_of<T>(ex, source);
}

// ---- Atomics -------------------------------------------------------------------------------------
enum memory_order { memory_order_relaxed };

template <class T>
struct atomic {
  static_assert(sizeof(T) == 4, "MSL atomics are 32-bit here");
  atomic() = delete;
  T value_;
};
typedef atomic<uint> atomic_uint;
typedef atomic<int> atomic_int;

namespace atomic_detail {
enum class Rmw { Add, Sub, And, Or, Xor, Min, Max, Exchange };
template <class T>
ROUTEMM_MSL_UNCHECKED T rmw(atomic<T>* object, T operand, Rmw op) {
  routemm::metal_emu::check_atomic(object, sizeof(T));
  T* p = &object->value_;
  switch (op) {
    case Rmw::Add: return __atomic_fetch_add(p, operand, __ATOMIC_RELAXED);
    case Rmw::Sub: return __atomic_fetch_sub(p, operand, __ATOMIC_RELAXED);
    case Rmw::And: return __atomic_fetch_and(p, operand, __ATOMIC_RELAXED);
    case Rmw::Or: return __atomic_fetch_or(p, operand, __ATOMIC_RELAXED);
    case Rmw::Xor: return __atomic_fetch_xor(p, operand, __ATOMIC_RELAXED);
    case Rmw::Exchange: return __atomic_exchange_n(p, operand, __ATOMIC_RELAXED);
    case Rmw::Min:
    case Rmw::Max: {
      T old = __atomic_load_n(p, __ATOMIC_RELAXED);
      for (;;) {
        const T want =
            op == Rmw::Min ? (operand < old ? operand : old) : (old < operand ? operand : old);
        if (__atomic_compare_exchange_n(p, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
          return old;
      }
    }
  }
  return T{};
}
template <class T>
ROUTEMM_MSL_UNCHECKED T load(const atomic<T>* object) {
  routemm::metal_emu::check_atomic(object, sizeof(T));
  return __atomic_load_n(&object->value_, __ATOMIC_RELAXED);
}
template <class T>
ROUTEMM_MSL_UNCHECKED void store(atomic<T>* object, T value) {
  routemm::metal_emu::check_atomic(object, sizeof(T));
  __atomic_store_n(&object->value_, value, __ATOMIC_RELAXED);
}
template <class T>
ROUTEMM_MSL_UNCHECKED bool compare_exchange(atomic<T>* object, T* expected, T desired) {
  routemm::metal_emu::check_atomic(object, sizeof(T));
  return __atomic_compare_exchange_n(&object->value_, expected, desired, false, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED);
}
}  // namespace atomic_detail

#define ROUTEMM_MSL_ATOMIC_RMW(name, op)                                   \
  template <class T, class U>                                              \
  T atomic_##name##_explicit(atomic<T>* object, U operand, memory_order) { \
    return atomic_detail::rmw(object, static_cast<T>(operand), op);        \
  }
ROUTEMM_MSL_ATOMIC_RMW(fetch_add, atomic_detail::Rmw::Add)
ROUTEMM_MSL_ATOMIC_RMW(fetch_sub, atomic_detail::Rmw::Sub)
ROUTEMM_MSL_ATOMIC_RMW(fetch_and, atomic_detail::Rmw::And)
ROUTEMM_MSL_ATOMIC_RMW(fetch_or, atomic_detail::Rmw::Or)
ROUTEMM_MSL_ATOMIC_RMW(fetch_xor, atomic_detail::Rmw::Xor)
ROUTEMM_MSL_ATOMIC_RMW(fetch_min, atomic_detail::Rmw::Min)
ROUTEMM_MSL_ATOMIC_RMW(fetch_max, atomic_detail::Rmw::Max)
ROUTEMM_MSL_ATOMIC_RMW(exchange, atomic_detail::Rmw::Exchange)
#undef ROUTEMM_MSL_ATOMIC_RMW
template <class T>
T atomic_load_explicit(const atomic<T>* object, memory_order) {
  return atomic_detail::load(object);
}
template <class T, class U>
void atomic_store_explicit(atomic<T>* object, U value, memory_order) {
  atomic_detail::store(object, static_cast<T>(value));
}
template <class T>
bool atomic_compare_exchange_weak_explicit(atomic<T>* object, T* expected, T desired, memory_order,
                                           memory_order) {
  return atomic_detail::compare_exchange(object, expected, desired);
}

// ---- SIMD-group matrices -------------------------------------------------------------------------
// Metal spreads an 8x8 matrix over the 32 lanes of a simdgroup; the model keeps a whole copy in
// every lane (every lane computes the same values) and makes each operation a simdgroup-uniform
// step: all 32 lanes must execute it together (runtime.h). A load reads every element (each lane
// its copy); a store writes each element once, element e by lane e / 2, as lanes own two elements
// each on hardware. multiply_accumulate computes d(i, j) = fma chain over k = 0..7 of a(i, k) *
// b(k, j) starting from c(i, j).
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the model implements 8x8 simdgroup matrices");
  T e[Rows][Cols] = {};
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Cols; ++c) m.e[r][c] = value;
  }
  return m;
}

// origin is (column, row); with transpose, element (r, c) comes from src[(origin.y + c) * stride
// + origin.x + r].
template <class T, class S, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const S* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false,
                    ROUTEMM_MSL_AT) {
  routemm::metal_emu::simdgroup_uniform("simdgroup_load", at);
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < Cols; ++c) {
      const ulong row = matrix_origin.y + ulong(transpose_matrix ? c : r);
      const ulong col = matrix_origin.x + ulong(transpose_matrix ? r : c);
      d.e[r][c] = static_cast<T>(src[row * elements_per_row + col]);
    }
  }
}
template <class T, class S, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, S* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0, 0),
                     bool transpose_matrix = false, ROUTEMM_MSL_AT) {
  routemm::metal_emu::simdgroup_uniform("simdgroup_store", at);
  const uint lane = routemm::metal_emu::current_lane();
  for (uint e = lane * 2; e < lane * 2 + 2; ++e) {
    const int r = static_cast<int>(e / Cols), c = static_cast<int>(e % Cols);
    const ulong row = matrix_origin.y + ulong(transpose_matrix ? c : r);
    const ulong col = matrix_origin.x + ulong(transpose_matrix ? r : c);
    dst[row * elements_per_row + col] = static_cast<S>(a.e[r][c]);
  }
}
template <class TD, class TA, class TB, class TC, int N>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, N>& d,
                                   const simdgroup_matrix<TA, N, N>& a,
                                   const simdgroup_matrix<TB, N, N>& b,
                                   const simdgroup_matrix<TC, N, N>& c, ROUTEMM_MSL_AT) {
  routemm::metal_emu::simdgroup_uniform("simdgroup_multiply_accumulate", at);
  simdgroup_matrix<TD, N, N> out;
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < N; ++j) {
      float acc = static_cast<float>(c.e[i][j]);
      for (int k = 0; k < N; ++k)
        acc = fma(static_cast<float>(a.e[i][k]), static_cast<float>(b.e[k][j]), acc);
      out.e[i][j] = static_cast<TD>(acc);
    }
  }
  d = out;
}
template <class TD, class TA, class TB, int N>
void simdgroup_multiply(simdgroup_matrix<TD, N, N>& d, const simdgroup_matrix<TA, N, N>& a,
                        const simdgroup_matrix<TB, N, N>& b, ROUTEMM_MSL_AT) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, N, N>(TD(0)), at);
}

#undef ROUTEMM_MSL_AT

}  // namespace metal

#endif  // ROUTEMM_MSL_SIGNATURES
