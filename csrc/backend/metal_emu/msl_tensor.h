// The Metal 4 tensor API for the execution model: the subset of <metal_tensor> and of
// MetalPerformancePrimitives' tensor ops (matmul2d) that metal/*.metal use, compiled by the host
// compiler as msl.h is, and run on the model of runtime.h.
//
// What is modelled and how (docs/metal.md states where the model had to choose):
//   * tensor<Element, dextents<Index, Rank>, tensor_inline>: a non-owning view of device or
//     threadgroup memory with extents (innermost first) and strides in elements (packed by
//     default: stride 0 is 1, stride d the product of the extents below it). Making a view whose
//     elements do not all lie inside one bound buffer or one [[threadgroup(i)]] block is an error
//     ("tensor view out of extent"), as the hardware would read or write past it.
//   * slice(origin...) gives a tensor_offset view of the same memory: element (i, j) is the
//     parent's (origin0 + i, origin1 + j), and its extents are what remains of the parent's, so an
//     operation bounded by the slice is bounded by the parent tensor's edges.
//   * matmul2d<matmul2d_descriptor(M, N, K, transpose_left, transpose_right, relaxed_precision,
//     mode), Scope>: destination(M x N) = left(M x K) * right(K x N), plus the destination's
//     previous values in mode multiply_accumulate (mode multiply overwrites). Operand extents are
//     innermost first: left (K, M) or, transposed, (M, K); right (N, K) or, transposed, (K, N);
//     destination (N, M). Elements outside an operand's extents count as zero (their products
//     are skipped) and destination elements outside its extents are not written (the op's edge
//     checking). K is the descriptor's, or the left operand's when it is dynamic_extent.
//   * Arithmetic: each destination element is one F32 fused multiply-add chain over k = 0, 1,
//     ..., K - 1 starting from its previous value (accumulate) or zero; relaxed_precision changes
//     nothing. Metal does not specify the order, so results are held to the routes' accumulation
//     bound, never to bit identity with another backend.
//   * Execution scope: execution_simdgroups<N> is every thread of a threadgroup of exactly N
//     simdgroups, execution_simdgroup the 32 lanes of one simdgroup. run() is entered by every
//     thread of the scope together (the model reports a thread that returned or waits elsewhere);
//     entering it orders no memory, so the shader's barriers remain its own.
//   * cooperative_tensor (the destination of get_destination_cooperative_tensor): thread-private
//     elements spread over the scope's threads; thread s of S holds tile elements s, s + S,
//     s + 2S, ... in row-major order (an implementation-defined layout, as in Metal). Elements
//     start as NaN (undefined in Metal). store() writes each thread's valid elements inside the
//     destination's extents.
//
// Under ROUTEMM_MSL_SIGNATURES (the binder's preprocessing pass) this header is empty, as msl.h is.
#pragma once

#include "backend/metal_emu/msl.h"

#ifndef ROUTEMM_MSL_SIGNATURES

namespace metal {

inline constexpr size_t dynamic_extent = static_cast<size_t>(-1);

// A fixed-size array (MSL's metal::array), as tensor strides and indices are passed.
template <class T, size_t N>
struct array {
  T elements[N];
  constexpr T& operator[](size_t i) { return elements[i]; }
  constexpr const T& operator[](size_t i) const { return elements[i]; }
};

struct tensor_inline {};  // a view made in the shader from a pointer and extents
struct tensor_offset {};  // a slice of another view

template <class Index, size_t Rank>
struct dextents {
  static_assert(Rank >= 1, "a tensor has at least one dimension");
  Index sizes[Rank];
  template <class... Sizes>
    requires(sizeof...(Sizes) == Rank)
  constexpr explicit dextents(Sizes... s) : sizes{static_cast<Index>(s)...} {}
  static constexpr size_t rank() { return Rank; }
  constexpr Index extent(size_t dimension) const { return sizes[dimension]; }
};

template <class Element, class Extents, class Kind = tensor_inline>
class tensor;

namespace tensor_detail {
template <class T>
struct extents_of;
template <class Index, size_t Rank>
struct extents_of<dextents<Index, Rank>> {
  using index_type = Index;
  static constexpr size_t rank = Rank;
};
struct unchecked_view {};  // a slice lies inside its parent, which was checked when made
}  // namespace tensor_detail

template <class Element, class Extents, class Kind>
class tensor {
 public:
  using element_type = Element;
  using extents_type = Extents;
  using index_type = typename tensor_detail::extents_of<Extents>::index_type;
  static constexpr size_t rank = tensor_detail::extents_of<Extents>::rank;
  using strides_type = array<index_type, rank>;

  // A packed view: stride 0 is 1, each further stride the product of the extents below it.
  tensor(Element* data, Extents extents, std::source_location at = std::source_location::current())
      : tensor(data, extents, packed_strides(extents), at) {}
  tensor(Element* data, Extents extents, strides_type strides,
         std::source_location at = std::source_location::current())
      : data_(data), extents_(extents), strides_(strides) {
    check_inside_memory(at);
  }

  Extents extents() const { return extents_; }
  index_type get_extent(size_t dimension) const { return extents_.extent(dimension); }
  index_type get_stride(size_t dimension) const { return strides_[dimension]; }
  Element* data() const { return data_; }

  // The view from `origin` on: extents are what remains of this view's (zero past its end).
  template <class... Origin>
    requires(sizeof...(Origin) == rank)
  tensor<Element, Extents, tensor_offset> slice(Origin... origin) const {
    const index_type o[rank] = {static_cast<index_type>(origin)...};
    Extents remaining = extents_;
    std::ptrdiff_t offset = 0;
    for (size_t d = 0; d < rank; ++d) {
      remaining.sizes[d] = o[d] < extents_.extent(d) ? extents_.extent(d) - o[d] : index_type(0);
      offset += std::ptrdiff_t(o[d] < extents_.extent(d) ? o[d] : index_type(0)) * strides_[d];
    }
    return tensor<Element, Extents, tensor_offset>(data_ + offset, remaining, strides_,
                                                   tensor_detail::unchecked_view{});
  }

  // Element (i0, i1, ...), which must lie inside the extents (the tensor ops check first).
  Element& at(const index_type (&index)[rank]) const {
    std::ptrdiff_t offset = 0;
    for (size_t d = 0; d < rank; ++d) offset += std::ptrdiff_t(index[d]) * strides_[d];
    return data_[offset];
  }
  bool contains(const index_type (&index)[rank]) const {
    for (size_t d = 0; d < rank; ++d) {
      if (index[d] < 0 || index[d] >= extents_.extent(d)) return false;
    }
    return true;
  }

 private:
  template <class, class, class>
  friend class tensor;
  tensor(Element* data, Extents extents, strides_type strides, tensor_detail::unchecked_view)
      : data_(data), extents_(extents), strides_(strides) {}

  static strides_type packed_strides(const Extents& extents) {
    strides_type s{};
    index_type stride = 1;
    for (size_t d = 0; d < rank; ++d) {
      s[d] = stride;
      stride *= extents.extent(d);
    }
    return s;
  }

  // Every element of the view inside one bound buffer or threadgroup block (runtime.cpp).
  void check_inside_memory(const std::source_location& at) const {
    std::ptrdiff_t last = 0;
    for (size_t d = 0; d < rank; ++d) {
      if (extents_.extent(d) <= 0) return;  // an empty view touches nothing
      last += std::ptrdiff_t(extents_.extent(d) - 1) * strides_[d];
    }
    routemm::metal_emu::check_tensor_view(data_, size_t(last + 1) * sizeof(Element), at);
  }

  Element* data_;
  Extents extents_;
  strides_type strides_;
};

// Execution scopes of tensor operations.
struct execution_simdgroup {};
template <int Simdgroups>
struct execution_simdgroups {
  static_assert(Simdgroups >= 1, "execution_simdgroups<N> needs N >= 1");
};

namespace tensor_detail {
template <class Scope>
struct scope;
template <>
struct scope<execution_simdgroup> {
  static constexpr uint32_t threads = routemm::metal_emu::kSimdWidth;
  static uint32_t index() { return routemm::metal_emu::current_lane(); }
  static void enter(const char* op, const std::source_location& at) {
    routemm::metal_emu::simdgroup_uniform(op, at);
  }
};
template <int Simdgroups>
struct scope<execution_simdgroups<Simdgroups>> {
  static constexpr uint32_t threads = routemm::metal_emu::kSimdWidth * Simdgroups;
  static uint32_t index() { return routemm::metal_emu::current_thread_index(); }
  static void enter(const char* op, const std::source_location& at) {
    routemm::metal_emu::threadgroup_scope(op, Simdgroups, at);
  }
};
}  // namespace tensor_detail

// Thread-private elements of a tile spread over the threads of an execution scope; Layout says
// which (runtime-free: the tensor ops define it).
template <class Element, class Extents, class Layout>
class cooperative_tensor {
 public:
  using element_type = Element;
  cooperative_tensor() : owner_(Layout::owner()) {
    for (Element& e : values_) {
      if constexpr (std::numeric_limits<Element>::has_quiet_NaN)
        e = std::numeric_limits<Element>::quiet_NaN();
      else
        e = Element{};
    }
  }

  uint16_t get_capacity() const { return Layout::capacity; }
  bool is_valid_element(uint16_t i) const {
    return i < Layout::capacity && Layout::valid(owner_, i);
  }
  // (column, row) of element i in the tile: dimension 0 innermost, as the destination's extents.
  array<int, 2> get_multidimensional_index(uint16_t i) const {
    return {Layout::column(owner_, i), Layout::row(owner_, i)};
  }
  Element& operator[](uint16_t i) {
    check_index(i);
    return values_[i];
  }
  const Element& operator[](uint16_t i) const {
    check_index(i);
    return values_[i];
  }

  // Writes this thread's valid elements that lie inside the destination's extents.
  template <class E, class X, class K>
  void store(const tensor<E, X, K>& destination) const {
    static_assert(tensor<E, X, K>::rank == 2, "a matrix tile is stored into a rank-2 tensor");
    for (uint16_t i = 0; i < Layout::capacity; ++i) {
      if (!Layout::valid(owner_, i)) continue;
      const typename tensor<E, X, K>::index_type index[2] = {Layout::column(owner_, i),
                                                             Layout::row(owner_, i)};
      if (destination.contains(index)) destination.at(index) = static_cast<E>(values_[i]);
    }
  }

  uint32_t owner() const { return owner_; }

 private:
  void check_index(uint16_t i) const {
    if (i >= Layout::capacity)
      routemm::metal_emu::shader_error("cooperative tensor index " + std::to_string(i) +
                                       " is past its capacity " + std::to_string(Layout::capacity));
  }

  uint32_t owner_;  // the thread's index in the execution scope
  Element values_[Layout::capacity];
};

}  // namespace metal

namespace mpp::tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_),
        n(n_),
        k(k_),
        transpose_left(transpose_left_),
        transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_),
        matmul_mode(matmul_mode_) {}
};

namespace matmul2d_detail {
constexpr int kDynamic = static_cast<int>(metal::dynamic_extent);

// The destination tile (M rows x N columns) spread over the scope's threads: thread s of S holds
// tile elements s + i * S (row-major), i < capacity.
template <matmul2d_descriptor D, class Scope>
struct destination_layout {
  static_assert(D.m > 0 && D.n > 0, "a destination cooperative tensor needs static M and N");
  static constexpr uint32_t threads = metal::tensor_detail::scope<Scope>::threads;
  static constexpr uint32_t elements = uint32_t(D.m) * uint32_t(D.n);
  static constexpr uint16_t capacity = uint16_t((elements + threads - 1) / threads);
  static uint32_t owner() { return metal::tensor_detail::scope<Scope>::index(); }
  static constexpr uint32_t flat(uint32_t owner, uint16_t i) { return owner + i * threads; }
  static constexpr bool valid(uint32_t owner, uint16_t i) { return flat(owner, i) < elements; }
  static constexpr int row(uint32_t owner, uint16_t i) { return int(flat(owner, i) / D.n); }
  static constexpr int column(uint32_t owner, uint16_t i) { return int(flat(owner, i) % D.n); }
};

template <class T>
struct is_cooperative : std::false_type {};
template <class E, class X, class L>
struct is_cooperative<metal::cooperative_tensor<E, X, L>> : std::true_type {};

// Dimension d of a rank-2 operand (0 innermost); cooperative input operands are not modelled.
template <class Tensor>
int extent(const Tensor& t, int d) {
  static_assert(!is_cooperative<Tensor>::value, "cooperative input operands are not modelled");
  static_assert(Tensor::rank == 2, "matmul2d operands are rank-2 tensors");
  return int(t.get_extent(size_t(d)));
}
}  // namespace matmul2d_detail

template <matmul2d_descriptor Descriptor, class Scope>
class matmul2d {
  using scope = metal::tensor_detail::scope<Scope>;
  using layout = matmul2d_detail::destination_layout<Descriptor, Scope>;

 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;

  template <class Left, class Right, class Element>
  metal::cooperative_tensor<Element, metal::dextents<int, 2>, layout>
  get_destination_cooperative_tensor() const {
    return {};
  }

  // Operands are taken as lvalues, as Metal's run() takes them.
  template <class Left, class Right, class Destination>
  void run(Left& left, Right& right, Destination& destination,
           std::source_location at = std::source_location::current()) const {
    scope::enter("matmul2d::run", at);
    constexpr bool accumulate =
        Descriptor.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    constexpr bool tl = Descriptor.transpose_left, tr = Descriptor.transpose_right;
    using matmul2d_detail::extent;
    const int rows = extent(left, tl ? 0 : 1), columns = extent(right, tr ? 1 : 0);
    const int k_total =
        Descriptor.k != matmul2d_detail::kDynamic ? Descriptor.k : extent(left, tl ? 1 : 0);
    // Elements past an operand's extents count as zero: their products are skipped.
    const int k_end = std::min({k_total, extent(left, tl ? 1 : 0), extent(right, tr ? 0 : 1)});
    // One destination element: an F32 fma chain over k in ascending order.
    const auto element = [&](int row, int column, float start) {
      if (row >= rows || column >= columns) return start;
      float acc = start;
      for (int k = 0; k < k_end; ++k) {
        const float a = static_cast<float>(tl ? left.at({row, k}) : left.at({k, row}));
        const float b = static_cast<float>(tr ? right.at({k, column}) : right.at({column, k}));
        acc = metal::fma(a, b, acc);
      }
      return acc;
    };
    if constexpr (matmul2d_detail::is_cooperative<Destination>::value) {
      static_assert(
          std::is_same_v<Destination, metal::cooperative_tensor<typename Destination::element_type,
                                                                metal::dextents<int, 2>, layout>>,
          "the cooperative destination must come from this op");
      using E = typename Destination::element_type;
      const uint32_t owner = destination.owner();
      for (uint16_t i = 0; i < layout::capacity; ++i) {
        if (!layout::valid(owner, i)) continue;
        const float start = accumulate ? static_cast<float>(destination[i]) : 0.0f;
        destination[i] =
            static_cast<E>(element(layout::row(owner, i), layout::column(owner, i), start));
      }
    } else {
      // A tensor destination: this thread's share of the tile, as a cooperative tensor's.
      using E = typename Destination::element_type;
      const uint32_t owner = layout::owner();
      for (uint16_t i = 0; i < layout::capacity; ++i) {
        if (!layout::valid(owner, i)) continue;
        const typename Destination::index_type index[2] = {layout::column(owner, i),
                                                           layout::row(owner, i)};
        if (!destination.contains(index)) continue;
        const float start = accumulate ? static_cast<float>(destination.at(index)) : 0.0f;
        destination.at(index) = static_cast<E>(element(index[1], index[0], start));
      }
    }
  }
};

}  // namespace mpp::tensor_ops

#endif  // ROUTEMM_MSL_SIGNATURES
