// A declaration-only model of the Metal Shading Language, so that a host C++20 compiler can parse
// and type-check metal/*.metal on a machine without the Metal toolchain (tests/metal/CMakeLists.txt
// runs `<c++> -fsyntax-only -D__METAL_VERSION__=310 -Itests/metal/include ...` on every file).
//
// What it catches: undeclared names, typos, wrong argument counts and types against the MSL
// functions declared here, template errors, and C++ errors in the shader code itself. What it does
// not: address-space rules (the qualifiers expand to nothing), attribute spelling (unknown
// attributes are ignored), MSL-only restrictions and anything about execution. Only the subset of
// MSL the shaders use is declared; a shader that reaches for more fails here first, and this header
// grows with it. It declares; it never implements: the only bodies are the member initialisers of a
// constexpr constructor, which constant expressions need.
#pragma once

#if !defined(__METAL_VERSION__)
#error "msl_shim.h stands in for the Metal compiler: compile with -D__METAL_VERSION__=<version>"
#endif

#include <cstddef>
#include <cstdint>

// ---- Keywords ------------------------------------------------------------------------------------
// Function qualifier and address spaces. Attributes ([[buffer(0)]], [[thread_position_in_grid]],
// [[function_constant(700)]], ...) are standard C++11 attribute syntax and need no macro; the host
// compiler ignores them (-Wno-attributes / -Wno-unknown-attributes).
#define kernel
#define device
#define constant
#define threadgroup
#define thread

// ---- Scalar and vector types ---------------------------------------------------------------------
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
static_assert(sizeof(ulong) == 8, "MSL ulong is 64-bit");

struct half {
  half();
  half(float);
  operator float() const;
};

namespace metal {

template <class T, int N>
struct vec;
template <class T>
struct vec<T, 2> {
  T x, y;
  vec();
  explicit vec(T all);
  vec(T x_, T y_);
};
template <class T>
struct vec<T, 3> {
  T x, y, z;
  vec();
  explicit vec(T all);
  vec(T x_, T y_, T z_);
};
template <class T>
struct vec<T, 4> {
  T x, y, z, w;
  vec();
  explicit vec(T all);
  vec(T x_, T y_, T z_, T w_);
};
template <class T, int N>
vec<T, N> operator+(vec<T, N>, vec<T, N>);
template <class T, int N>
vec<T, N> operator-(vec<T, N>, vec<T, N>);
template <class T, int N>
vec<T, N> operator*(vec<T, N>, vec<T, N>);
template <class T, int N>
vec<T, N> operator*(vec<T, N>, T);

// Packed vectors: the alignment of one element, indexable, convertible to the vector.
template <class T, int N>
struct packed_vec {
  T& operator[](int i);
  const T& operator[](int i) const;
  operator vec<T, N>() const;
};

}  // namespace metal

#define ROUTEMM_MSL_VECTORS(T)   \
  typedef metal::vec<T, 2> T##2; \
  typedef metal::vec<T, 3> T##3; \
  typedef metal::vec<T, 4> T##4;
ROUTEMM_MSL_VECTORS(float)
ROUTEMM_MSL_VECTORS(half)
ROUTEMM_MSL_VECTORS(int)
ROUTEMM_MSL_VECTORS(uint)
ROUTEMM_MSL_VECTORS(short)
ROUTEMM_MSL_VECTORS(ushort)
ROUTEMM_MSL_VECTORS(long)
ROUTEMM_MSL_VECTORS(ulong)
#undef ROUTEMM_MSL_VECTORS
typedef metal::packed_vec<float, 2> packed_float2;
typedef metal::packed_vec<float, 4> packed_float4;

namespace metal {

// ---- Math, reinterpretation, SIMD-group reductions -------------------------------------------------
float fma(float a, float b, float c);
float exp(float x);
half fma(half a, half b, half c);
template <class T>
T min(T a, T b);
template <class T>
T max(T a, T b);
template <class To, class From>
To as_type(From value);

template <class T>
T simd_sum(T value);
template <class T>
T simd_max(T value);
template <class T>
T simd_shuffle(T value, ushort lane);
template <class T>
T simd_prefix_exclusive_sum(T value);
template <class T>
T simd_broadcast(T value, ushort lane);

// ---- Barriers ----------------------------------------------------------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

// ---- Atomics -----------------------------------------------------------------------------------------
enum memory_order { memory_order_relaxed };
struct atomic_uint {
  atomic_uint() = delete;
  uint opaque_;
};
uint atomic_fetch_or_explicit(atomic_uint* object, uint operand, memory_order order);
uint atomic_fetch_add_explicit(atomic_uint* object, uint operand, memory_order order);
uint atomic_load_explicit(const atomic_uint* object, memory_order order);
void atomic_store_explicit(atomic_uint* object, uint value, memory_order order);

// ---- SIMD-group matrices (<metal_simdgroup_matrix>) ----------------------------------------------
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  simdgroup_matrix();
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value);
template <class T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0, 0),
                     bool transpose_matrix = false);
template <class TD, class TA, class TB, class TC, int N>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, N>& d,
                                   const simdgroup_matrix<TA, N, N>& a,
                                   const simdgroup_matrix<TB, N, N>& b,
                                   const simdgroup_matrix<TC, N, N>& c);

// ---- Tensors (<metal_tensor>, Metal 4) ---------------------------------------------------------------
inline constexpr size_t dynamic_extent = static_cast<size_t>(-1);
struct tensor_handle {};
struct tensor_offset {};
struct tensor_inline {};

template <class Index, int Rank>
struct dextents {
  template <class... Sizes>
  explicit dextents(Sizes... sizes);
  Index extent(int dimension) const;
};

template <class Element, class Extents, class Kind = tensor_handle>
struct tensor {
  tensor(Element* data, Extents extents);
  Extents extents() const;
  tensor<Element, Extents, tensor_offset> slice(int32_t origin0, int32_t origin1) const;
  template <size_t Extent0, size_t Extent1>
  tensor<Element, Extents, tensor_offset> static_slice(int32_t origin0, int32_t origin1) const;
};

template <int Simdgroups>
struct execution_simdgroups {};

// The destination of a tensor op held in registers, spread over the op's threads in an
// implementation-defined layout; only valid elements (is_valid_element) may be used.
template <class Element>
struct cooperative_tensor {
  uint16_t get_capacity() const;
  bool is_valid_element(uint16_t index) const;
  Element& operator[](uint16_t index);
  template <class Tensor>
  void store(const Tensor& destination) const;
  template <class Tensor>
  void load(const Tensor& source);
};

}  // namespace metal

// ---- MetalPerformancePrimitives tensor ops ---------------------------------------------------------
namespace mpp::tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = -1, bool transpose_left_ = false,
                                bool transpose_right_ = false, bool relaxed_precision_ = false,
                                mode matmul_mode_ = mode::multiply)
      : m(m_),
        n(n_),
        k(k_),
        transpose_left(transpose_left_),
        transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_),
        matmul_mode(matmul_mode_) {}
};

template <matmul2d_descriptor Descriptor, class Scope>
struct matmul2d {
  template <class Left, class Right, class Element>
  metal::cooperative_tensor<Element> get_destination_cooperative_tensor() const;
  // Operands are lvalue references, as in MetalPerformancePrimitives (a temporary slice is refused).
  template <class Left, class Right, class Destination>
  void run(Left& left, Right& right, Destination& destination) const;
};

}  // namespace mpp::tensor_ops
