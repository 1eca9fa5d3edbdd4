// 16-bit floats for the wire: conversions between fp32 and bfloat16 or IEEE
// binary16 (half), one value at a time and over buffers.
//
// fp32 -> 16 bit rounds to nearest, ties to even. bfloat16 keeps fp32's
// exponent: only values within half an ulp of fp32's largest finite value
// round up to infinity. Half rounds to infinity from 65520 in magnitude on
// (65504 is its largest finite value) and has subnormals down to 2^-24;
// smaller magnitudes round to (signed) zero. A NaN stays a NaN (quiet, sign
// and leading payload bits kept) and an infinity stays infinite. 16 bit ->
// fp32 is exact. The functions are pure and thread-safe. The buffer versions
// give the same bits, with the CPU's F16C (half) or AVX2 (bfloat16)
// instructions where it has them (chosen at run time; a half NaN decoded by
// F16C may come back with its quiet bit set), otherwise with branch-free
// loops the compiler can vectorize.
#ifndef PSFLOW_COMMON_FLOAT16_H_
#define PSFLOW_COMMON_FLOAT16_H_

#include <cstdint>
#include <cstring>

#include "proto/tensor.pb.h"

namespace psflow {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float FloatFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t FloatToBfloat16(float f) {
  const uint32_t u = FloatBits(f);
  // Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly
  // when the dropped half is above one half, or equal to it with an odd
  // kept part; a carry out of the significand moves into the exponent.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? (u >> 16) | 0x0040u : rounded);
}

inline float Bfloat16ToFloat(uint16_t h) { return FloatFromBits(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal results (|f| >= 2^-14): rebias the exponent (127 -> 15) and round
  // the 13 dropped significand bits as in FloatToBfloat16; from 0x7C00 on
  // (65520 and up, infinity) the result is infinity.
  uint32_t normal = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  normal = normal < 0x7C00u ? normal : 0x7C00u;
  // Subnormal results: the significand (with its implicit bit) times
  // 2^(e - 126) is the count of 2^-24 steps, rounded to nearest even. Shifts
  // of 25 and more give zero; 31 keeps the shift defined.
  const uint32_t e = a >> 23;
  const uint32_t significand = (a & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = e < 95u ? 31u : 126u - e;  // only used for e <= 112
  const uint32_t kept = significand >> (shift & 31u);
  const uint32_t dropped = significand & ((1u << (shift & 31u)) - 1u);
  const uint32_t halfway = 1u << ((shift - 1u) & 31u);
  const uint32_t subnormal =
      kept + static_cast<uint32_t>((dropped > halfway) | ((dropped == halfway) & (kept & 1u)));
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a > 0x7F800000u ? 0x7E00u | ((a >> 13) & 0x03FFu) : h;  // NaN: quiet
  return static_cast<uint16_t>(sign | h);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x03FFu;
  // Normal: rebias the exponent (15 -> 127); infinity and NaN: all ones.
  uint32_t bits = exponent == 0x1Fu ? 0x7F800000u | (mantissa << 13)
                                    : ((exponent + 112u) << 23) | (mantissa << 13);
  // Zero and subnormals: mantissa * 2^-24, exact in fp32.
  const uint32_t small = FloatBits(static_cast<float>(mantissa) * 0x1p-24f);
  bits = exponent == 0 ? small : bits;
  return FloatFromBits(sign | bits);
}

// Bytes one element of `dtype` takes on the wire: 4 for DT_FLOAT, 2 for
// DT_BFLOAT16 and DT_HALF, 0 for any other value.
int64_t WireBytes(DataType dtype);

// The smallest fp32 magnitude that `dtype` turns into infinity (infinity for
// DT_FLOAT): a value v survives encoding as a finite number iff
// |v| < WireOverflow(dtype), which is false for NaN too.
float WireOverflow(DataType dtype);

// Writes `n` values of `in` as `dtype` (DT_FLOAT, DT_BFLOAT16 or DT_HALF) to
// `out`: n * WireBytes(dtype) bytes, little-endian, any alignment.
void EncodeFloats(DataType dtype, const float* in, int64_t n, char* out);
// Reads `n` values of `dtype` from `in` (any alignment) into `out` as fp32.
void DecodeFloats(DataType dtype, const char* in, int64_t n, float* out);

// Whether any of the `n` values at `v` is a NaN or an infinity.
bool AnyNonFinite(const float* v, int64_t n);
// Whether any of the `n` values of `dtype` (DT_FLOAT, DT_BFLOAT16 or
// DT_HALF) at `in` is a NaN or an infinity, read as they lie (no decoding;
// `in` aligned to the element's size).
bool AnyNonFiniteIn(DataType dtype, const char* in, int64_t n);
// The same for values at or above `limit` in magnitude (NaNs included; an
// infinite limit is AnyNonFiniteIn). 16-bit values compare exactly: the
// limit is rounded up to the format's next value.
bool AnyAtOrAboveIn(DataType dtype, const char* in, int64_t n, float limit);
// Whether every one of the `n` values at `v` is below `limit` in magnitude
// (false for a NaN): with limit = WireOverflow(dtype), whether each survives
// encoding as a finite number. `limit` must be positive (infinity included).
bool AllBelow(const float* v, int64_t n, float limit);

}  // namespace psflow

#endif  // PSFLOW_COMMON_FLOAT16_H_
