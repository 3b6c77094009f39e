// GGML Q4_0 and Q8_0 block layouts and the kernel-argument structs of the block-quantised dense
// projections (spec §5.1, §5.5, §5.6), shared by the host, CUDA and Metal. Fixed-width fields
// only; the layouts are part of the kernel ABI and are checked below.
#pragma once

#ifdef __METAL_VERSION__
#define ROUTEMM_I16 short
#define ROUTEMM_I32 int
#define ROUTEMM_U32 uint
#define ROUTEMM_I64 long
#define ROUTEMM_U64 ulong
#define ROUTEMM_U16 ushort
#define ROUTEMM_U8 uchar
#define ROUTEMM_I8 char
#define ROUTEMM_CONSTANT \
  constant  // MSL: program-scope constants live in the constant address space
#else
#include <cstddef>
#include <cstdint>
#define ROUTEMM_CONSTANT
#define ROUTEMM_I16 int16_t
#define ROUTEMM_I32 int32_t
#define ROUTEMM_U32 uint32_t
#define ROUTEMM_I64 int64_t
#define ROUTEMM_U64 uint64_t
#define ROUTEMM_U16 uint16_t
#define ROUTEMM_U8 uint8_t
#define ROUTEMM_I8 int8_t
#endif

namespace routemm::kernels {

// Values per Q4_0 block and bytes per block.
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kQ4_0BlockValues = 32;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kQ4_0BlockBytes = 18;
// Values per Q8_0 block and bytes per block.
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kQ8_0BlockValues = 32;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kQ8_0BlockBytes = 34;

// One GGUF-native Q4_0 block: a little-endian IEEE binary16 scale `d` (raw bits), then 16 bytes of
// nibbles. Value j (j < 16) is the low nibble of qs[j], value j + 16 its high nibble; the value
// is d * (nibble - 8). Blocks are only 2-byte aligned inside a row (18-byte stride).
struct BlockQ4_0 {
  ROUTEMM_U16 d_bits;
  ROUTEMM_U8 qs[kQ4_0BlockValues / 2];
};

// One GGUF-native Q8_0 block: a little-endian binary16 scale `d` (raw bits), then 32 signed
// bytes; value j is d * qs[j]. Blocks are only 2-byte aligned inside a row (34-byte stride).
struct BlockQ8_0 {
  ROUTEMM_U16 d_bits;
  ROUTEMM_I8 qs[kQ8_0BlockValues];
};

// Mat-vec params of `kernel_mul_mv_q4_0_f32` (spec §5.5), 64 bytes: weight [ne01 = N, ne00 = K],
// input [ne1 = M, ne10 = K], output [ne1 = M, ne0 = N], batch ne02 = ne12 (always 1 here), and
// the broadcast ratios r2 = r3 = 1.
struct GgmlMatmulMvParams {
  ROUTEMM_I64 ne00;  // K
  ROUTEMM_I64 ne01;  // N
  ROUTEMM_I64 ne02;  // batch
  ROUTEMM_I64 ne10;  // K
  ROUTEMM_I64 ne12;  // batch
  ROUTEMM_I64 ne0;   // N
  ROUTEMM_I64 ne1;   // M
  ROUTEMM_U32 r2;
  ROUTEMM_U32 r3;
};

// Matrix-matrix params of the four `kernel_mul_mm_q4_0_*` routes (spec §5.6), 88 bytes. Byte
// strides: nb01 = weight row bytes, nb02 = nb01 * N, nb10 = 4, nb11 = input row bytes, nb12 =
// nb11 * M; nb03 = nb13 = 0.
struct GgmlMatmulMmParams {
  ROUTEMM_I32 ne00;  // K
  ROUTEMM_I32 ne02;  // batch
  ROUTEMM_U64 nb01;
  ROUTEMM_U64 nb02;
  ROUTEMM_U64 nb03;
  ROUTEMM_I32 ne12;  // batch
  ROUTEMM_U32 pad0;
  ROUTEMM_U64 nb10;
  ROUTEMM_U64 nb11;
  ROUTEMM_U64 nb12;
  ROUTEMM_U64 nb13;
  ROUTEMM_I32 ne0;  // N
  ROUTEMM_I32 ne1;  // M
  ROUTEMM_I16 r2;
  ROUTEMM_I16 r3;
  ROUTEMM_U32 pad1;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(BlockQ4_0) == kQ4_0BlockBytes);
static_assert(offsetof(BlockQ4_0, qs) == 2);
static_assert(alignof(BlockQ4_0) == 2);
static_assert(sizeof(BlockQ8_0) == kQ8_0BlockBytes);
static_assert(offsetof(BlockQ8_0, qs) == 2);
static_assert(alignof(BlockQ8_0) == 2);

static_assert(sizeof(GgmlMatmulMvParams) == 64);
static_assert(offsetof(GgmlMatmulMvParams, ne1) == 48);
static_assert(offsetof(GgmlMatmulMvParams, r2) == 56);
static_assert(offsetof(GgmlMatmulMvParams, r3) == 60);

static_assert(sizeof(GgmlMatmulMmParams) == 88);
static_assert(offsetof(GgmlMatmulMmParams, ne02) == 4);
static_assert(offsetof(GgmlMatmulMmParams, nb01) == 8);
static_assert(offsetof(GgmlMatmulMmParams, nb02) == 16);
static_assert(offsetof(GgmlMatmulMmParams, nb03) == 24);
static_assert(offsetof(GgmlMatmulMmParams, ne12) == 32);
static_assert(offsetof(GgmlMatmulMmParams, nb10) == 40);
static_assert(offsetof(GgmlMatmulMmParams, nb11) == 48);
static_assert(offsetof(GgmlMatmulMmParams, nb12) == 56);
static_assert(offsetof(GgmlMatmulMmParams, nb13) == 64);
static_assert(offsetof(GgmlMatmulMmParams, ne0) == 72);
static_assert(offsetof(GgmlMatmulMmParams, ne1) == 76);
static_assert(offsetof(GgmlMatmulMmParams, r2) == 80);
static_assert(offsetof(GgmlMatmulMmParams, r3) == 82);
static_assert(offsetof(GgmlMatmulMmParams, pad1) == 84);
#endif

}  // namespace routemm::kernels

#undef ROUTEMM_I16
#undef ROUTEMM_I32
#undef ROUTEMM_U32
#undef ROUTEMM_I64
#undef ROUTEMM_U64
#undef ROUTEMM_U16
#undef ROUTEMM_U8
#undef ROUTEMM_I8
#undef ROUTEMM_CONSTANT
