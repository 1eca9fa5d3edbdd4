#include "common/float16.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace psflow {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

bool HalfIsNan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0; }
bool Bfloat16IsNan(uint16_t h) { return (h & 0x7F80u) == 0x7F80u && (h & 0x007Fu) != 0; }

TEST(HalfTest, ExactValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.5f), 0x3800);
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(-65504.0f), 0xFBFF);
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
  EXPECT_EQ(HalfToFloat(0x8000), 0.0f);
}

TEST(HalfTest, OverflowToInfinity) {
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);  // below the halfway point
  EXPECT_EQ(FloatToHalf(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // the tie goes to the even "2^16": infinity
  EXPECT_EQ(FloatToHalf(-65520.0f), 0xFC00);
  EXPECT_EQ(FloatToHalf(1e10f), 0x7C00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(FloatToHalf(kInf), 0x7C00);
  EXPECT_EQ(FloatToHalf(-kInf), 0xFC00);
  EXPECT_EQ(HalfToFloat(0x7C00), kInf);
  EXPECT_EQ(HalfToFloat(0xFC00), -kInf);
  EXPECT_EQ(WireOverflow(DT_HALF), 65520.0f);
}

TEST(HalfTest, Subnormals) {
  const float tiny = std::ldexp(1.0f, -24);  // the smallest subnormal
  EXPECT_EQ(FloatToHalf(tiny), 0x0001);
  EXPECT_EQ(HalfToFloat(0x0001), tiny);
  EXPECT_EQ(FloatToHalf(-tiny), 0x8001);
  EXPECT_EQ(FloatToHalf(1023 * tiny), 0x03FF);  // the largest
  EXPECT_EQ(HalfToFloat(0x03FF), 1023 * tiny);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // the smallest normal
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));
  // Ties to even: half of the smallest goes to zero, 1.5 of it to 2.
  EXPECT_EQ(FloatToHalf(0.5f * tiny), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.5f * tiny), 0x8000);
  EXPECT_EQ(FloatToHalf(std::nextafter(0.5f * tiny, 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(1.5f * tiny), 0x0002);
  EXPECT_EQ(FloatToHalf(2.5f * tiny), 0x0002);
  EXPECT_EQ(FloatToHalf(0.75f * tiny), 0x0001);
  EXPECT_EQ(FloatToHalf(0.25f * tiny), 0x0000);
  // Rounding the largest subnormal up carries into the smallest normal.
  EXPECT_EQ(FloatToHalf(1023.5f * tiny), 0x0400);
  // fp32 subnormals and the smallest normals are far below: zero.
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::min()), 0x0000);
}

TEST(HalfTest, RoundsToNearestEven) {
  const float ulp = std::ldexp(1.0f, -10);             // of 1.0 in half
  EXPECT_EQ(FloatToHalf(1.0f + ulp / 2), 0x3C00);      // tie: to the even 1.0
  EXPECT_EQ(FloatToHalf(1.0f + 3 * ulp / 2), 0x3C02);  // tie: to the even 1 + 2 ulp
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + ulp / 2, 2.0f)), 0x3C01);
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + ulp / 2, 0.0f)), 0x3C00);
  // A carry out of the significand moves into the exponent.
  EXPECT_EQ(FloatToHalf(2.0f - ulp / 4), 0x4000);
}

TEST(HalfTest, NanStaysNan) {
  const uint16_t q = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(HalfIsNan(q)) << std::hex << q;
  // A signalling NaN whose payload lies only in the dropped bits.
  EXPECT_TRUE(HalfIsNan(FloatToHalf(FloatFromBits(0x7F800001u))));
  EXPECT_EQ(FloatToHalf(FloatFromBits(0xFFFFFFFFu)), 0xFFFF);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
}

// Every half value survives a trip through fp32; every boundary between two
// neighbours rounds to the even one, and the floats next to it to the nearer.
TEST(HalfTest, EveryValueAndEveryBoundary) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    if (HalfIsNan(bits)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(bits)));
      EXPECT_TRUE(HalfIsNan(FloatToHalf(HalfToFloat(bits)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToHalf(HalfToFloat(bits)), bits) << std::hex << h;
  }
  for (uint32_t h = 0; h < 0x7BFF; ++h) {
    const float lo = HalfToFloat(static_cast<uint16_t>(h));
    const float hi = HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = lo + (hi - lo) / 2;  // exact: 12 significant bits at most
    const uint32_t even = (h & 1u) == 0 ? h : h + 1;
    ASSERT_EQ(FloatToHalf(mid), even) << std::hex << h;
    ASSERT_EQ(FloatToHalf(-mid), even | 0x8000u) << std::hex << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, kInf)), h + 1) << std::hex << h;
  }
}

// The buffer conversions (F16C or AVX2 instructions where the CPU has them)
// give the bits of the one-value functions for every kind of value: each
// 16-bit value, each rounding boundary and the floats next to it, fp32
// subnormals, overflow, NaNs with many payload patterns, and a sweep over all
// 2^32 bit patterns; and they decode every 16-bit value as the one-value
// function does (a NaN as a NaN of the same sign).
void ExpectBuffersMatchOneValueConversions(DataType dtype, uint16_t (*encode)(float),
                                           float (*decode)(uint16_t)) {
  SCOPED_TRACE(DataType_Name(dtype));
  std::vector<float> in;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float lo = decode(static_cast<uint16_t>(h));
    in.push_back(lo);
    const float hi = decode(static_cast<uint16_t>(h + 1));
    if ((h & 0x7FFFu) == 0x7FFFu || !std::isfinite(lo) || !std::isfinite(hi)) continue;
    // Halfway to the next value (exact in fp32), and the floats next to it.
    const float mid = lo + (hi - lo) / 2;
    for (const float v :
         {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf), std::nextafter(mid, -kInf)}) {
      in.push_back(v);
    }
  }
  for (uint32_t payload = 1; payload < (1u << 23); payload = payload * 3 + 1) {
    in.push_back(FloatFromBits(0x7F800000u | payload));  // signalling and quiet NaNs
    in.push_back(FloatFromBits(0xFF800000u | payload));
    in.push_back(FloatFromBits(payload));  // fp32 subnormals
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65537) {
    in.push_back(FloatFromBits(static_cast<uint32_t>(u)));
  }
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> wire(in.size());
  EncodeFloats(dtype, in.data(), n, reinterpret_cast<char*>(wire.data()));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(wire[i], encode(in[i])) << i << " " << std::hex << FloatBits(in[i]);
  }

  std::vector<uint16_t> all(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) all[h] = static_cast<uint16_t>(h);
  std::vector<float> out(all.size());
  DecodeFloats(dtype, reinterpret_cast<const char*>(all.data()), 0x10000, out.data());
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float expected = decode(static_cast<uint16_t>(h));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(out[h])) << std::hex << h;
      ASSERT_EQ(std::signbit(out[h]), std::signbit(expected)) << std::hex << h;
    } else {
      ASSERT_EQ(FloatBits(out[h]), FloatBits(expected)) << std::hex << h;
    }
  }
}

TEST(HalfTest, BuffersMatchTheOneValueConversionEverywhere) {
  ExpectBuffersMatchOneValueConversions(DT_HALF, FloatToHalf, HalfToFloat);
}

TEST(Bfloat16Test, BuffersMatchTheOneValueConversionEverywhere) {
  ExpectBuffersMatchOneValueConversions(DT_BFLOAT16, FloatToBfloat16, Bfloat16ToFloat);
}

TEST(Bfloat16Test, ExactValuesAndRounding) {
  EXPECT_EQ(FloatToBfloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBfloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBfloat16(-0.0f), 0x8000);
  EXPECT_EQ(Bfloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bfloat16ToFloat(0x4049), 3.140625f);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties to the even 1.
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x3F808000u)), 0x3F80);
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x3F807FFFu)), 0x3F80);
  // Halfway above an odd value: up to the even one.
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x3F818000u)), 0x3F82);
  EXPECT_EQ(FloatToBfloat16(3.14159265f), 0x4049);
  // A carry out of the significand moves into the exponent.
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x3FFFFFFFu)), 0x4000);
  // Subnormals keep their top bits.
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x00010000u)), 0x0001);
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x00008000u)), 0x0000);
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x00018000u)), 0x0002);
}

TEST(Bfloat16Test, InfinityAndNan) {
  EXPECT_EQ(FloatToBfloat16(kInf), 0x7F80);
  EXPECT_EQ(FloatToBfloat16(-kInf), 0xFF80);
  EXPECT_EQ(Bfloat16ToFloat(0x7F80), kInf);
  // Only within half an ulp of fp32's largest value does it round to infinity.
  EXPECT_EQ(FloatToBfloat16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(FloatToBfloat16(WireOverflow(DT_BFLOAT16)), 0x7F80);
  EXPECT_EQ(FloatToBfloat16(std::nextafter(WireOverflow(DT_BFLOAT16), 0.0f)), 0x7F7F);
  // NaN stays NaN, even where rounding would carry into the exponent or
  // the payload lies only in the dropped bits.
  EXPECT_TRUE(Bfloat16IsNan(FloatToBfloat16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(Bfloat16IsNan(FloatToBfloat16(FloatFromBits(0x7F800001u))));
  EXPECT_TRUE(Bfloat16IsNan(FloatToBfloat16(FloatFromBits(0x7FFFFFFFu))));
  EXPECT_EQ(FloatToBfloat16(FloatFromBits(0xFFFFFFFFu)), 0xFFFF);
  EXPECT_TRUE(std::isnan(Bfloat16ToFloat(0x7FC0)));
}

TEST(Bfloat16Test, EveryValueAndEveryBoundary) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    if (Bfloat16IsNan(bits)) {
      EXPECT_TRUE(Bfloat16IsNan(FloatToBfloat16(Bfloat16ToFloat(bits)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToBfloat16(Bfloat16ToFloat(bits)), bits) << std::hex << h;
  }
  for (uint32_t h = 0; h < 0x7F7F; ++h) {
    const uint32_t mid_bits = (h << 16) | 0x8000u;  // halfway to the next value
    const uint32_t even = (h & 1u) == 0 ? h : h + 1;
    ASSERT_EQ(FloatToBfloat16(FloatFromBits(mid_bits)), even) << std::hex << h;
    ASSERT_EQ(FloatToBfloat16(FloatFromBits(mid_bits - 1)), h) << std::hex << h;
    ASSERT_EQ(FloatToBfloat16(FloatFromBits(mid_bits + 1)), h + 1) << std::hex << h;
  }
}

TEST(WireTest, Sizes) {
  EXPECT_EQ(WireBytes(DT_FLOAT), 4);
  EXPECT_EQ(WireBytes(DT_BFLOAT16), 2);
  EXPECT_EQ(WireBytes(DT_HALF), 2);
  EXPECT_EQ(WireBytes(DT_INVALID), 0);
  EXPECT_EQ(WireOverflow(DT_FLOAT), kInf);
}

// Buffers: more than one block, an odd count, unaligned output and input.
TEST(WireTest, EncodeDecodeBuffers) {
  const int64_t n = 1237;
  std::vector<float> in(n);
  for (int64_t i = 0; i < n; ++i) in[i] = (static_cast<float>(i) - 600.5f) * 0.37f;
  in[5] = kInf;
  in[6] = -70000.0f;
  for (DataType dtype : {DT_FLOAT, DT_BFLOAT16, DT_HALF}) {
    SCOPED_TRACE(DataType_Name(dtype));
    std::string bytes(static_cast<size_t>(n * WireBytes(dtype)) + 1, '\x55');
    EncodeFloats(dtype, in.data(), n, bytes.data() + 1);
    EXPECT_EQ(bytes[0], '\x55') << "nothing written before the output";
    std::vector<float> out(n + 1, -1.0f);
    DecodeFloats(dtype, bytes.data() + 1, n, out.data());
    EXPECT_EQ(out[n], -1.0f) << "nothing written past the output";
    for (int64_t i = 0; i < n; ++i) {
      float expected = in[i];
      if (dtype == DT_BFLOAT16) expected = Bfloat16ToFloat(FloatToBfloat16(in[i]));
      if (dtype == DT_HALF) expected = HalfToFloat(FloatToHalf(in[i]));
      ASSERT_EQ(out[i], expected) << i;
      uint16_t wire;
      std::memcpy(&wire, bytes.data() + 1 + 2 * i, 2);
      if (dtype == DT_BFLOAT16) {
        ASSERT_EQ(wire, FloatToBfloat16(in[i])) << i;
      }
      if (dtype == DT_HALF) {
        ASSERT_EQ(wire, FloatToHalf(in[i])) << i;
      }
    }
  }
  EXPECT_EQ(HalfToFloat(FloatToHalf(in[6])), -kInf);
}

TEST(AnyNonFinite, FindsANanOrAnInfinityAnywhereAndNothingElse) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) - 500.0f;
  v[1] = std::numeric_limits<float>::max();
  v[2] = -std::numeric_limits<float>::max();
  v[3] = std::numeric_limits<float>::denorm_min();
  v[4] = -0.0f;
  EXPECT_FALSE(AnyNonFinite(v.data(), static_cast<int64_t>(v.size())));
  EXPECT_FALSE(AnyNonFinite(v.data(), 0));
  for (float bad :
       {inf, -inf, std::numeric_limits<float>::quiet_NaN(),
        -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::signaling_NaN()}) {
    for (size_t at : {size_t{0}, size_t{17}, v.size() - 1}) {
      std::vector<float> w = v;
      w[at] = bad;
      EXPECT_TRUE(AnyNonFinite(w.data(), static_cast<int64_t>(w.size()))) << bad << " at " << at;
      // Outside the range looked at, it is not seen.
      if (at == v.size() - 1) {
        EXPECT_FALSE(AnyNonFinite(w.data(), static_cast<int64_t>(at)));
      }
    }
  }
}

// AnyAtOrAboveIn: for every 16-bit pattern of either format and limits that
// fall on, between and beyond the format's values, it agrees with
// !(|decoded| < limit); fp32 the same on chosen values; an infinite limit
// is the finiteness check.
TEST(AnyAtOrAboveIn, AgreesWithTheDecodedMagnitude) {
  for (const DataType dtype : {DT_BFLOAT16, DT_HALF}) {
    for (const float limit : {1.0f, 1.001f, 3.5f, 1000.0f, 65504.0f, 70000.0f, 1e9f}) {
      for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
        const uint16_t h = static_cast<uint16_t>(bits);
        float decoded = 0;
        DecodeFloats(dtype, reinterpret_cast<const char*>(&h), 1, &decoded);
        ASSERT_EQ(AnyAtOrAboveIn(dtype, reinterpret_cast<const char*>(&h), 1, limit),
                  !(std::fabs(decoded) < limit))
            << DataType_Name(dtype) << " 0x" << std::hex << bits << " limit " << limit;
      }
    }
  }
  const std::vector<float> v = {0.5f, -2.0f, 99.9f};
  const char* in = reinterpret_cast<const char*>(v.data());
  EXPECT_FALSE(AnyAtOrAboveIn(DT_FLOAT, in, 3, 100.0f));
  EXPECT_TRUE(AnyAtOrAboveIn(DT_FLOAT, in, 3, 99.9f));
  EXPECT_TRUE(AnyAtOrAboveIn(DT_FLOAT, in, 3, 2.0f)) << "-2 reaches 2 in magnitude";
  EXPECT_FALSE(AnyAtOrAboveIn(DT_FLOAT, in, 3, std::numeric_limits<float>::infinity()));
  const std::vector<float> nan = {1, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_TRUE(AnyAtOrAboveIn(DT_FLOAT, reinterpret_cast<const char*>(nan.data()), 2, 1e9f));
}

// AnyNonFiniteIn reads 16-bit values as they lie: for every bit pattern of
// either format, it agrees with the decoded value's isfinite, alone and
// anywhere in a run of finite values; for fp32 it is AnyNonFinite.
TEST(AnyNonFiniteIn, AgreesWithTheDecodedValueForEvery16BitPattern) {
  for (const DataType dtype : {DT_BFLOAT16, DT_HALF}) {
    std::vector<uint16_t> run(100);
    const std::vector<float> ones(run.size(), 1.0f);
    EncodeFloats(dtype, ones.data(), static_cast<int64_t>(ones.size()),
                 reinterpret_cast<char*>(run.data()));
    ASSERT_FALSE(AnyNonFiniteIn(dtype, reinterpret_cast<const char*>(run.data()),
                                static_cast<int64_t>(run.size())));
    int bad_patterns = 0;
    for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
      const uint16_t h = static_cast<uint16_t>(bits);
      float decoded = 0;
      DecodeFloats(dtype, reinterpret_cast<const char*>(&h), 1, &decoded);
      const bool bad = !std::isfinite(decoded);
      bad_patterns += bad;
      ASSERT_EQ(AnyNonFiniteIn(dtype, reinterpret_cast<const char*>(&h), 1), bad)
          << DataType_Name(dtype) << " 0x" << std::hex << bits;
      if (bits % 97 == 0) {
        std::vector<uint16_t> w = run;
        w[bits % w.size()] = h;
        ASSERT_EQ(AnyNonFiniteIn(dtype, reinterpret_cast<const char*>(w.data()),
                                 static_cast<int64_t>(w.size())),
                  bad)
            << DataType_Name(dtype) << " 0x" << std::hex << bits;
      }
    }
    // Both signs of the exponent-all-ones patterns: 2 x (1 infinity + NaNs).
    EXPECT_EQ(bad_patterns, dtype == DT_BFLOAT16 ? 2 * 128 : 2 * 1024) << DataType_Name(dtype);
  }
  const std::vector<float> f = {1.0f, std::numeric_limits<float>::infinity()};
  EXPECT_TRUE(AnyNonFiniteIn(DT_FLOAT, reinterpret_cast<const char*>(f.data()), 2));
  EXPECT_FALSE(AnyNonFiniteIn(DT_FLOAT, reinterpret_cast<const char*>(f.data()), 1));
}

// AllBelow(v, n, WireOverflow(dtype)) is the worker's check that a gradient
// survives the wire: every value's magnitude strictly below the limit, a NaN
// never, the sign ignored; each limit's edge, anywhere in a vectorized run.
TEST(AllBelow, TakesMagnitudesStrictlyBelowTheLimitAndNoNan) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DataType dtype : {DT_FLOAT, DT_BFLOAT16, DT_HALF}) {
    const float limit = WireOverflow(dtype);
    SCOPED_TRACE(limit);
    std::vector<float> v(1000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = (static_cast<float>(i) - 500.0f) * 100.0f;
    v[3] = std::numeric_limits<float>::denorm_min();
    v[4] = -0.0f;
    v[5] = std::nextafter(limit, 0.0f);
    v[6] = -std::nextafter(limit, 0.0f);
    EXPECT_TRUE(AllBelow(v.data(), static_cast<int64_t>(v.size()), limit));
    EXPECT_TRUE(AllBelow(v.data(), 0, limit));
    std::vector<float> bad_values = {nan, -nan, std::numeric_limits<float>::signaling_NaN(), inf,
                                     -inf};
    if (limit != inf) {
      bad_values.insert(bad_values.end(), {limit, -limit, std::nextafter(limit, inf),
                                           std::numeric_limits<float>::max()});
    }
    for (float bad : bad_values) {
      for (size_t at : {size_t{0}, size_t{17}, v.size() - 1}) {
        std::vector<float> w = v;
        w[at] = bad;
        EXPECT_FALSE(AllBelow(w.data(), static_cast<int64_t>(w.size()), limit))
            << bad << " at " << at;
        if (at == v.size() - 1) {
          EXPECT_TRUE(AllBelow(w.data(), static_cast<int64_t>(at), limit));
        }
      }
    }
  }
}

}  // namespace
}  // namespace psflow
