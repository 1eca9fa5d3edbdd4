#include "transport/chunk_messages.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <gtest/gtest.h>

#include "common/float16.h"
#include "proto/ps.pb.h"
#include "transport/call_channel.h"
#include "transport/shared_region.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

std::vector<float> Ramp(int64_t n, float scale = 0.25f) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i % 977) - 3.0f;
  return v;
}

// `bytes` as a buffer of slices cut every `cut` bytes (odd cuts split
// 16-bit elements and varints across slices).
grpc::ByteBuffer Cut(const std::string& bytes, size_t cut) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += cut) {
    slices.emplace_back(bytes.data() + at, std::min(cut, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::vector<TensorRef> Refs(const std::vector<float>& big, const std::vector<float>& small,
                            DataType dtype) {
  return {{"big", "", {static_cast<int64_t>(big.size())}, big.data(), dtype},
          {"small", "m", {3, 2}, small.data(), dtype}};
}

// Every group of `refs` as one encoded PushRequest (the first with a header).
std::vector<grpc::ByteBuffer> EncodeAll(std::vector<TensorRef> refs, size_t chunk_bytes,
                                        const std::shared_ptr<const void>& keep) {
  ChunkSplitter splitter(std::move(refs), chunk_bytes);
  std::vector<grpc::ByteBuffer> out;
  PushRequest fields;
  fields.mutable_header()->set_job_id(42);
  fields.mutable_header()->set_step(7);
  std::vector<ChunkPiece> pieces;
  while (splitter.NextPieces(&pieces)) {
    out.push_back(EncodeChunkMessage(fields, PushRequest::kChunkFieldNumber, pieces, keep));
    pieces.clear();
    fields.Clear();
  }
  return out;
}

class ChunkMessagesTest : public ::testing::TestWithParam<DataType> {};

TEST_P(ChunkMessagesTest, TheBytesAreProtobufsOwnEncoding) {
  const DataType dtype = GetParam();
  const std::vector<float> big = Ramp(300000), small = Ramp(6, 1.5f);
  std::vector<grpc::ByteBuffer> raw = EncodeAll(Refs(big, small, dtype), 1 << 18, nullptr);
  // What protobuf makes of the same groups.
  ChunkSplitter splitter(Refs(big, small, dtype), 1 << 18);
  PushRequest expected;
  expected.mutable_header()->set_job_id(42);
  expected.mutable_header()->set_step(7);
  size_t k = 0;
  while (splitter.Next(expected.mutable_chunk())) {
    ASSERT_LT(k, raw.size());
    PushRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(MessageBytes(raw[k])));
    EXPECT_EQ(parsed.SerializeAsString(), expected.SerializeAsString()) << "message " << k;
    expected.Clear();
    ++k;
  }
  EXPECT_EQ(k, raw.size());
  EXPECT_GT(k, 2u);
}

TEST_P(ChunkMessagesTest, ReadsIntoTheSinksAcrossAnySliceCuts) {
  const DataType dtype = GetParam();
  const std::vector<float> big = Ramp(100001), small = Ramp(6, 1.5f);
  for (size_t cut : {size_t{1}, size_t{3}, size_t{4097}, size_t{1} << 30}) {
    std::vector<float> got_big(big.size(), -1.0f), got_small(6, -1.0f);
    std::vector<TensorSink> sinks = {
        {"big", "", {static_cast<int64_t>(big.size())}, got_big.data(), true, dtype},
        {"small", "m", {3, 2}, got_small.data(), true, dtype}};
    ChunkAssembler assembler(sinks);
    std::vector<int> completed;
    int64_t bytes = 0;
    int headers = 0;
    for (grpc::ByteBuffer& m : EncodeAll(Refs(big, small, dtype), 100000, nullptr)) {
      grpc::ByteBuffer cut_up = Cut(MessageBytes(m), cut);
      PushRequest fields;
      absl::Status s = ReadChunkMessage(
          &cut_up, PushRequest::kChunkFieldNumber, &fields,
          [&]() -> absl::StatusOr<ChunkAssembler*> {
            headers += fields.has_header();
            if (fields.has_header()) {
              EXPECT_EQ(fields.header().step(), 7);
            }
            return &assembler;
          },
          [&](int i) {
            completed.push_back(i);
            return absl::OkStatus();
          },
          &bytes);
      ASSERT_TRUE(s.ok()) << "cut " << cut << ": " << s;
    }
    ASSERT_TRUE(assembler.Finish().ok());
    EXPECT_EQ(headers, 1);
    EXPECT_EQ(completed, (std::vector<int>{0, 1}));
    EXPECT_EQ(bytes, (100001 + 6) * WireBytes(dtype));
    // The values are those of the wire dtype.
    std::vector<char> wire(big.size() * WireBytes(dtype));
    std::vector<float> want(big.size());
    EncodeFloats(dtype, big.data(), static_cast<int64_t>(big.size()), wire.data());
    DecodeFloats(dtype, wire.data(), static_cast<int64_t>(big.size()), want.data());
    EXPECT_EQ(got_big, want) << "cut " << cut;
    EXPECT_EQ(got_small[5], small[5]);
  }
}

INSTANTIATE_TEST_SUITE_P(WireDtypes, ChunkMessagesTest,
                         ::testing::Values(DT_FLOAT, DT_BFLOAT16, DT_HALF));

// Whether one of `buffer`'s slices starts at `data` (lent, not copied).
bool HasSliceAt(const grpc::ByteBuffer& buffer, const void* data) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  for (const grpc::Slice& s : slices) {
    if (s.begin() == static_cast<const uint8_t*>(data)) return true;
  }
  return false;
}

TEST(ChunkMessages, Fp32DataIsLentUntilGrpcLetsGo) {
  const std::vector<float> big = Ramp(50000), small = Ramp(6);
  bool released = false;
  {
    std::shared_ptr<const void> keep(nullptr, [&](const void*) { released = true; });
    std::vector<grpc::ByteBuffer> raw = EncodeAll(Refs(big, small, DT_FLOAT), 1 << 20, keep);
    keep.reset();
    EXPECT_FALSE(released);  // the buffer's slices point into `big`
    EXPECT_TRUE(HasSliceAt(raw[0], big.data()));
  }
  EXPECT_TRUE(released);
}

// One message of a push for sink "t" (4 floats), as raw bytes.
std::string OneChunk(const std::vector<float>& values, bool header = true) {
  PushRequest r;
  if (header) r.mutable_header()->set_job_id(1);
  TensorChunk* c = r.add_chunk();
  c->set_name("t");
  c->set_dtype(DT_FLOAT);
  c->add_shape(static_cast<int64_t>(values.size()));
  c->set_data(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  return r.SerializeAsString();
}

absl::Status Read(const std::string& bytes, std::vector<float>* out, bool* non_finite = nullptr,
                  bool refuse_chunks = false, PushRequest* fields_out = nullptr) {
  TensorSink sink{"t", "", {4}, out->data(), true, DT_FLOAT};
  sink.non_finite = non_finite;
  ChunkAssembler assembler({sink});
  grpc::ByteBuffer buffer = Cut(bytes, 5);
  PushRequest fields;
  int64_t data_bytes = 0;
  absl::Status s = ReadChunkMessage(
      &buffer, PushRequest::kChunkFieldNumber, &fields,
      [&]() -> absl::StatusOr<ChunkAssembler*> { return refuse_chunks ? nullptr : &assembler; },
      [](int) { return absl::OkStatus(); }, &data_bytes);
  if (fields_out != nullptr) *fields_out = fields;
  return s;
}

TEST(ChunkMessages, RefusesWhatIsNotTheWireFormat) {
  std::vector<float> out(4);
  const std::string good = OneChunk({1, 2, 3, 4});
  ASSERT_TRUE(Read(good, &out).ok());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 4}));
  // Cut short anywhere: never read past the end, always refused.
  const std::string chunk_only = OneChunk({1, 2, 3, 4}, /*header=*/false);
  for (size_t n = 1; n < chunk_only.size(); ++n) {
    absl::Status s = Read(chunk_only.substr(0, n), &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "first " << n << " bytes: " << s;
  }
  EXPECT_EQ(Read(std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11), &out).code(),
            absl::StatusCode::kInvalidArgument);
  // A field after the data that is cut short (name, dtype, shape, data,
  // then a name of 5 bytes with 1 left in the chunk).
  std::string data_first = "\x12";  // field 2 (chunk), length-delimited
  std::string chunk = std::string("\x0a\x01t\x18\x01\x22\x01\x04\x32\x10", 10) +
                      std::string(16, '\0') + std::string("\x0a\x05t", 3);
  data_first += static_cast<char>(chunk.size());
  data_first += chunk;
  absl::Status s = Read(data_first, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("malformed message: chunk name"));
  // A chunk length past INT_MAX (a negative limit to protobuf, which would
  // ignore it) and a packed shape longer than its chunk.
  std::string huge = "\x12\x80\x80\x80\x80\x08";  // field 2, length 2^31
  huge += chunk_only.substr(2);
  s = Read(huge, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  std::string long_shape = "\x12\x08\x0a\x01t\x22\x30\x04\x04\x04\x04";
  s = Read(long_shape, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("chunk shape"));
  // Data cut short inside its chunk: not the wire format either.
  std::string short_data = chunk_only.substr(0, chunk_only.size() - 3);
  short_data[1] = static_cast<char>(short_data.size() - 2);  // the chunk's length fits
  s = Read(short_data, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Chunks where none are expected.
  s = Read(good, &out, nullptr, /*refuse_chunks=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // A chunk that does not fit its sink.
  s = Read(OneChunk({1, 2, 3, 4, 5}), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChunkMessages, FindsNonFiniteValuesAsTheyAreDecoded) {
  std::vector<float> out(4);
  bool non_finite = false;
  ASSERT_TRUE(Read(OneChunk({1, 2, 3, 4}), &out, &non_finite).ok());
  EXPECT_FALSE(non_finite);
  ASSERT_TRUE(
      Read(OneChunk({1, std::numeric_limits<float>::quiet_NaN(), 3, 4}), &out, &non_finite).ok());
  EXPECT_TRUE(non_finite);
  non_finite = false;
  ASSERT_TRUE(
      Read(OneChunk({1, 2, -std::numeric_limits<float>::infinity(), 4}), &out, &non_finite).ok());
  EXPECT_TRUE(non_finite);
}

TEST(ChunkMessages, FieldsAfterTheChunksAreKept) {
  std::vector<float> out(4);
  PushRequest tail;
  tail.mutable_header()->set_step(9);
  PushRequest fields;
  ASSERT_TRUE(Read(OneChunk({1, 2, 3, 4}, /*header=*/false) + tail.SerializeAsString(), &out,
                   nullptr, false, &fields)
                  .ok());
  EXPECT_EQ(fields.header().step(), 9);
}

// A region's data as the decoder sees it.
TEST_P(ChunkMessagesTest, ChunksInSharedMemoryReadIntoTheSinks) {
  const DataType dtype = GetParam();
  // Over a million bytes: the decoder works through it in blocks.
  const std::vector<float> big = Ramp(300001), small = Ramp(6, 1.5f);
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(SharedBytesFor((300001 + 6) * WireBytes(dtype), 2));
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedSpan span = (*region)->data();
  ChunkSplitter splitter(Refs(big, small, dtype), kSharedMessageBytes);
  std::vector<ChunkPiece> pieces;
  ASSERT_TRUE(splitter.NextPieces(&pieces));
  ASSERT_EQ(pieces.size(), 2u);  // one message, one chunk per tensor
  PushRequest header;
  header.mutable_header()->set_step(7);
  int64_t cursor = 0;
  absl::StatusOr<grpc::ByteBuffer> message =
      EncodeSharedChunkMessage(header, PushRequest::kChunkFieldNumber, pieces, span, &cursor);
  ASSERT_TRUE(message.ok()) << message.status();
  // The message holds where the data lie, not the data.
  EXPECT_LT(MessageBytes(*message).size(), 200u);
  EXPECT_GE(cursor, (300001 + 6) * WireBytes(dtype));
  EXPECT_LE(cursor, span.size);

  std::vector<float> got_big(big.size(), -1.0f), got_small(6, -1.0f);
  bool non_finite = false;
  std::vector<TensorSink> sinks = {
      {"big", "", {static_cast<int64_t>(big.size())}, got_big.data(), true, dtype},
      {"small", "m", {3, 2}, got_small.data(), true, dtype}};
  sinks[0].non_finite = &non_finite;
  ChunkAssembler assembler(sinks);
  std::vector<int> completed;
  int64_t bytes = 0;
  PushRequest fields;
  absl::Status s = ReadChunkMessage(
      &*message, PushRequest::kChunkFieldNumber, &fields,
      [&]() -> absl::StatusOr<ChunkAssembler*> { return &assembler; },
      [&](int i) {
        completed.push_back(i);
        return absl::OkStatus();
      },
      &bytes, &span);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(assembler.Finish().ok());
  EXPECT_EQ(fields.header().step(), 7);
  EXPECT_EQ(completed, (std::vector<int>{0, 1}));
  EXPECT_EQ(bytes, (300001 + 6) * WireBytes(dtype));
  EXPECT_FALSE(non_finite);
  std::vector<char> wire(big.size() * WireBytes(dtype));
  std::vector<float> want(big.size());
  EncodeFloats(dtype, big.data(), static_cast<int64_t>(big.size()), wire.data());
  DecodeFloats(dtype, wire.data(), static_cast<int64_t>(big.size()), want.data());
  EXPECT_EQ(got_big, want);
  EXPECT_EQ(got_small[5], small[5]);

  // A NaN written into the region after the message (the last block of the
  // big tensor) is found as it is decoded.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<char> nan_wire(WireBytes(dtype));
  EncodeFloats(dtype, &nan, 1, nan_wire.data());
  std::vector<float> again(big.size());
  std::vector<TensorSink> one = {
      {"big", "", {static_cast<int64_t>(big.size())}, again.data(), true, dtype}};
  one[0].non_finite = &non_finite;
  ChunkAssembler check(one);
  ChunkSplitter big_only({Refs(big, small, dtype)[0]}, kSharedMessageBytes);
  pieces.clear();
  ASSERT_TRUE(big_only.NextPieces(&pieces));
  cursor = 0;
  message = EncodeSharedChunkMessage(header, PushRequest::kChunkFieldNumber, pieces, span, &cursor);
  ASSERT_TRUE(message.ok());
  std::memcpy(span.data + (big.size() - 1) * WireBytes(dtype), nan_wire.data(), nan_wire.size());
  s = ReadChunkMessage(
      &*message, PushRequest::kChunkFieldNumber, &fields,
      [&]() -> absl::StatusOr<ChunkAssembler*> { return &check; },
      [](int) { return absl::OkStatus(); }, &bytes, &span);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(non_finite);
}

// `values` in `dtype`, as the wire carries them.
std::vector<char> Encoded(DataType dtype, const std::vector<float>& values) {
  std::vector<char> out(values.size() * WireBytes(dtype));
  EncodeFloats(dtype, values.data(), static_cast<int64_t>(values.size()), out.data());
  return out;
}

// Refs(big, small, dtype), but of the same values in the wire dtype already
// (TensorRef::encoded).
std::vector<TensorRef> EncodedRefs(const std::vector<char>& big, const std::vector<char>& small,
                                   DataType dtype) {
  std::vector<TensorRef> refs = Refs({}, {}, dtype);
  refs[0].shape = {static_cast<int64_t>(big.size()) / WireBytes(dtype)};
  refs[0].encoded = big.data();
  refs[1].encoded = small.data();
  for (TensorRef& r : refs) r.data = nullptr;
  return refs;
}

// Values already in the wire dtype make the same messages as the floats
// they were encoded from, over the network (borrowed where large, copied
// where small) and into a shared region; the region's check reads them as
// they lie.
TEST_P(ChunkMessagesTest, ValuesInTheWireDtypeAlreadyGoAsTheyLie) {
  const DataType dtype = GetParam();
  const std::vector<float> big = Ramp(300001), small = Ramp(6, 1.5f);
  std::vector<char> big_wire = Encoded(dtype, big);
  const std::vector<char> small_wire = Encoded(dtype, small);
  bool released = false;
  {
    std::shared_ptr<const void> keep(nullptr, [&](const void*) { released = true; });
    std::vector<grpc::ByteBuffer> from_floats =
        EncodeAll(Refs(big, small, dtype), 1 << 18, nullptr);
    std::vector<grpc::ByteBuffer> as_they_lie =
        EncodeAll(EncodedRefs(big_wire, small_wire, dtype), 1 << 18, keep);
    keep.reset();
    ASSERT_EQ(as_they_lie.size(), from_floats.size());
    for (size_t k = 0; k < from_floats.size(); ++k) {
      EXPECT_EQ(MessageBytes(as_they_lie[k]), MessageBytes(from_floats[k])) << "message " << k;
    }
    // The large chunks point into the encoded values: no copy.
    EXPECT_FALSE(released);
    EXPECT_TRUE(HasSliceAt(as_they_lie[0], big_wire.data()));
    // protobuf's chunks (ChunkSplitter::Next) are the same too.
    ChunkSplitter floats(Refs(big, small, dtype), 1 << 18);
    ChunkSplitter lying(EncodedRefs(big_wire, small_wire, dtype), 1 << 18);
    PushRequest a, b;
    while (floats.Next(a.mutable_chunk())) {
      ASSERT_TRUE(lying.Next(b.mutable_chunk()));
      EXPECT_EQ(b.SerializeAsString(), a.SerializeAsString());
      a.Clear();
      b.Clear();
    }
    EXPECT_FALSE(lying.Next(b.mutable_chunk()));
  }
  EXPECT_TRUE(released);

  const int64_t bytes = SharedBytesFor((300001 + 6) * WireBytes(dtype), 2);
  absl::StatusOr<std::unique_ptr<SharedRegion>> r0 = SharedRegion::Create(bytes);
  absl::StatusOr<std::unique_ptr<SharedRegion>> r1 = SharedRegion::Create(bytes);
  ASSERT_TRUE(r0.ok() && r1.ok());
  const float limit = WireOverflow(dtype);
  // Into a region: the message and the region's bytes are those of the
  // floats, and the check passes (then fails with one infinity among the
  // encoded values).
  auto shared = [&](std::vector<TensorRef> refs, const SharedSpan& span, bool* below) {
    ChunkSplitter splitter(std::move(refs), kSharedMessageBytes);
    std::vector<ChunkPiece> pieces;
    EXPECT_TRUE(splitter.NextPieces(&pieces));
    PushRequest header;
    int64_t cursor = 0;
    *below = true;
    absl::StatusOr<grpc::ByteBuffer> m = EncodeSharedChunkMessage(
        header, PushRequest::kChunkFieldNumber, pieces, span, &cursor, below, limit);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? MessageBytes(*m) : std::string();
  };
  bool below_floats = false, below_lying = false;
  const SharedSpan s0 = (*r0)->data(), s1 = (*r1)->data();
  EXPECT_EQ(shared(EncodedRefs(big_wire, small_wire, dtype), s1, &below_lying),
            shared(Refs(big, small, dtype), s0, &below_floats));
  EXPECT_TRUE(below_floats);
  EXPECT_TRUE(below_lying);
  EXPECT_EQ(std::memcmp(s0.data, s1.data, static_cast<size_t>(bytes)), 0);
  const float inf = std::numeric_limits<float>::infinity();
  EncodeFloats(dtype, &inf, 1, big_wire.data() + 200000 * WireBytes(dtype));
  shared(EncodedRefs(big_wire, small_wire, dtype), s1, &below_lying);
  EXPECT_FALSE(below_lying);
}

// Tensors that lie in a region already (fp32 values, or values in the wire
// dtype) are named where they lie: nothing in the region changes, the
// reader finds them there, and the check reads them as they lie. A tensor
// outside the region, or reaching past its end, is refused.
TEST_P(ChunkMessagesTest, TensorsInTheRegionAlreadyAreNamedWhereTheyLie) {
  const DataType dtype = GetParam();
  const int64_t element = WireBytes(dtype);
  const std::vector<float> big = Ramp(300001), small = Ramp(6, 1.5f);
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(8192 + SharedBytesFor((300001 + 6) * element, 2));
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedSpan span = (*region)->data();
  std::memset(span.data, 0x5a, static_cast<size_t>(span.size));
  // Not where a copy into the region would put them (from byte 0 on).
  char* const at_big = span.data + 8192;
  char* const at_small = at_big + (300001 * element + 63) / 64 * 64;
  std::vector<TensorRef> refs = Refs(big, small, dtype);
  auto place = [&](TensorRef& ref, const std::vector<float>& values, char* at) {
    EncodeFloats(dtype, values.data(), static_cast<int64_t>(values.size()), at);
    if (dtype == DT_FLOAT) {
      ref.data = reinterpret_cast<const float*>(at);
    } else {
      ref.data = nullptr;
      ref.encoded = at;
    }
  };
  place(refs[0], big, at_big);
  place(refs[1], small, at_small);
  ASSERT_TRUE(AllLieIn(refs, span));
  auto encode = [&](const std::vector<TensorRef>& tensors, bool* below) {
    ChunkSplitter splitter(tensors, kSharedMessageBytes);
    std::vector<ChunkPiece> pieces;
    EXPECT_TRUE(splitter.NextPieces(&pieces));
    PushRequest header;
    header.mutable_header()->set_step(3);
    *below = true;
    return EncodeInPlaceChunkMessage(header, PushRequest::kChunkFieldNumber, pieces, span, below,
                                     WireOverflow(dtype));
  };
  const std::string before(span.data, static_cast<size_t>(span.size));
  bool below = false;
  absl::StatusOr<grpc::ByteBuffer> message = encode(refs, &below);
  ASSERT_TRUE(message.ok()) << message.status();
  EXPECT_TRUE(below);
  EXPECT_LT(MessageBytes(*message).size(), 200u);
  EXPECT_TRUE(std::string(span.data, static_cast<size_t>(span.size)) == before)
      << "the region was written";

  std::vector<float> got_big(big.size(), -1.0f), got_small(6, -1.0f);
  ChunkAssembler assembler(
      {{"big", "", {static_cast<int64_t>(big.size())}, got_big.data(), true, dtype},
       {"small", "m", {3, 2}, got_small.data(), true, dtype}});
  PushRequest fields;
  int64_t bytes = 0;
  absl::Status s = ReadChunkMessage(
      &*message, PushRequest::kChunkFieldNumber, &fields,
      [&]() -> absl::StatusOr<ChunkAssembler*> { return &assembler; },
      [](int) { return absl::OkStatus(); }, &bytes, &span);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(assembler.Finish().ok());
  EXPECT_EQ(fields.header().step(), 3);
  EXPECT_EQ(bytes, (300001 + 6) * element);
  std::vector<float> want_big(big.size()), want_small(6);
  DecodeFloats(dtype, at_big, static_cast<int64_t>(big.size()), want_big.data());
  DecodeFloats(dtype, at_small, 6, want_small.data());
  EXPECT_EQ(got_big, want_big);
  EXPECT_EQ(got_small, want_small);
  if (dtype == DT_FLOAT) {
    EXPECT_EQ(got_big, big);
  }

  // The check reads the values where they lie.
  const float inf = std::numeric_limits<float>::infinity();
  EncodeFloats(dtype, &inf, 1, at_small + 4 * element);
  ASSERT_TRUE(encode(refs, &below).ok());
  EXPECT_FALSE(below);

  // Outside the region, or past its end: refused.
  std::vector<char> elsewhere(6 * element);
  std::vector<TensorRef> outside = refs;
  place(outside[1], small, elsewhere.data());
  EXPECT_FALSE(AllLieIn(outside, span));
  EXPECT_EQ(encode(outside, &below).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<TensorRef> past = refs;  // its last 2 values beyond the end (only named)
  char* const near_end = span.data + span.size - 4 * element;
  if (dtype == DT_FLOAT) {
    past[1].data = reinterpret_cast<const float*>(near_end);
  } else {
    past[1].encoded = near_end;
  }
  EXPECT_FALSE(AllLieIn(past, span));
  absl::StatusOr<grpc::ByteBuffer> refused = encode(past, &below);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("do not lie in the shared region"));
}

// Whether encoded values are below a limit: read as they lie at the wire
// dtype's overflow and above (whether each is finite), decoded below it.
TEST(ChunkMessages, EncodedValuesAreBelowALimitAsTheirDecodedValuesAre) {
  for (const DataType dtype : {DT_FLOAT, DT_BFLOAT16, DT_HALF}) {
    SCOPED_TRACE(DataType_Name(dtype));
    std::vector<float> values = Ramp(10000);  // up to 241
    const std::vector<char> wire = Encoded(dtype, values);
    TensorRef ref{"t", "", {10000}, nullptr, dtype};
    ref.encoded = wire.data();
    EXPECT_TRUE(WireValuesBelow(ref, 0, 10000, WireOverflow(dtype)));
    EXPECT_TRUE(WireValuesBelow(ref, 0, 10000, std::numeric_limits<float>::infinity()));
    EXPECT_TRUE(WireValuesBelow(ref, 0, 10000, 250.0f));
    EXPECT_FALSE(WireValuesBelow(ref, 0, 10000, 200.0f));
    EXPECT_TRUE(WireValuesBelow(ref, 0, 800, 200.0f));  // the first 800 stay below 197
    values[9999] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<char> with_nan = Encoded(dtype, values);
    ref.encoded = with_nan.data();
    EXPECT_FALSE(WireValuesBelow(ref, 0, 10000, WireOverflow(dtype)));
    EXPECT_TRUE(WireValuesBelow(ref, 0, 9999, WireOverflow(dtype)));
    EXPECT_FALSE(WireValuesBelow(ref, 9990, 10, 1e30f));
  }
}

// A ps may hold several slices of one variable: they share name and slot
// and are told apart by their first row, which the raw messages carry.
TEST(ChunkMessages, SlicesOfOneVariableAreToldApartByTheirFirstRow) {
  const std::vector<float> top = Ramp(4 * 300), bottom = Ramp(2 * 300, 2.0f);
  std::vector<TensorRef> refs = {{"w", "", {4, 300}, top.data(), DT_FLOAT, 0},
                                 {"w", "", {2, 300}, bottom.data(), DT_FLOAT, 6},
                                 {"w", "m", {2, 300}, bottom.data(), DT_FLOAT, 6}};
  std::vector<float> got_top(top.size()), got_bottom(bottom.size()), got_slot(bottom.size());
  std::vector<TensorSink> sinks = {{"w", "", {4, 300}, got_top.data()},
                                   {"w", "", {2, 300}, got_bottom.data()},
                                   {"w", "m", {2, 300}, got_slot.data()}};
  sinks[1].row_begin = sinks[2].row_begin = 6;
  ChunkAssembler assembler(sinks);
  std::vector<int> completed;
  int64_t bytes = 0;
  for (grpc::ByteBuffer& m : EncodeAll(refs, 1000, nullptr)) {
    // protobuf reads the same row.
    PushRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(MessageBytes(m)));
    for (const TensorChunk& c : parsed.chunk()) {
      EXPECT_EQ(c.row_begin(), c.shape(0) == 4 ? 0 : 6) << c.ShortDebugString();
    }
    PushRequest fields;
    absl::Status s = ReadChunkMessage(
        &m, PushRequest::kChunkFieldNumber, &fields,
        [&]() -> absl::StatusOr<ChunkAssembler*> { return &assembler; },
        [&](int i) {
          completed.push_back(i);
          return absl::OkStatus();
        },
        &bytes);
    ASSERT_TRUE(s.ok()) << s;
  }
  ASSERT_TRUE(assembler.Finish().ok()) << assembler.Finish();
  EXPECT_EQ(completed, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(got_top, top);
  EXPECT_EQ(got_bottom, bottom);
  EXPECT_EQ(got_slot, bottom);
  EXPECT_TRUE(assembler.Complete("w", "", 6));
  EXPECT_FALSE(assembler.Complete("w", "", 5));

  // A slice the receiver does not hold (another first row) is refused,
  // naming the row.
  std::vector<float> scratch(top.size());
  std::vector<TensorSink> other = {{"w", "", {2, 300}, scratch.data()}};
  other[0].row_begin = 4;
  ChunkAssembler refusing(other);
  std::vector<grpc::ByteBuffer> messages = EncodeAll({refs[1]}, 1 << 20, nullptr);
  PushRequest fields;
  absl::Status s = ReadChunkMessage(
      &messages[0], PushRequest::kChunkFieldNumber, &fields,
      [&]() -> absl::StatusOr<ChunkAssembler*> { return &refusing; },
      [](int) { return absl::OkStatus(); }, &bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unknown tensor 'w' from row 6"));
}

// `chunks`, each a TensorChunk's bytes, as the chunk field of a PushRequest.
std::string AsPushChunks(const std::vector<std::string>& chunks) {
  using google::protobuf::internal::WireFormatLite;
  std::string message;
  {
    google::protobuf::io::StringOutputStream out(&message);
    google::protobuf::io::CodedOutputStream coded(&out);
    for (const std::string& c : chunks) {
      WireFormatLite::WriteBytes(PushRequest::kChunkFieldNumber, c, &coded);
    }
  }
  return message;
}

// `c` with its fields in the reverse of their numbers' order (each shape
// dimension a field of its own), as protobuf's parser takes them too.
std::string ReversedChunk(const TensorChunk& c) {
  using google::protobuf::internal::WireFormatLite;
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    WireFormatLite::WriteInt64(TensorChunk::kRowBeginFieldNumber, c.row_begin(), &coded);
    WireFormatLite::WriteBytes(TensorChunk::kDataFieldNumber, c.data(), &coded);
    WireFormatLite::WriteInt64(TensorChunk::kOffsetFieldNumber, c.offset(), &coded);
    for (int64_t d : c.shape()) {
      WireFormatLite::WriteInt64(TensorChunk::kShapeFieldNumber, d, &coded);
    }
    WireFormatLite::WriteEnum(TensorChunk::kDtypeFieldNumber, c.dtype(), &coded);
    WireFormatLite::WriteString(TensorChunk::kSlotFieldNumber, c.slot(), &coded);
    WireFormatLite::WriteString(TensorChunk::kNameFieldNumber, c.name(), &coded);
  }
  return bytes;
}

// protobuf writes a chunk's fields in their numbers' order, so its own
// encoding puts row_begin (9) after the data (6); another writer may put
// them in any order, and the data of one chunk may even come twice (the
// last counts). Each reads into the slice protobuf's parser names, with the
// values protobuf's parser reads, across any cut of gRPC's slices; the slice
// of row 0, of the same name and shape, is left alone.
TEST(ChunkMessages, ChunkFieldsAreReadInAnyOrder) {
  const std::vector<float> values = Ramp(6, 1.5f), slot_values = Ramp(6, -0.5f);
  TensorChunk rows;  // the value's slice from row 6
  rows.set_name("w");
  rows.set_dtype(DT_FLOAT);
  rows.add_shape(2);
  rows.add_shape(3);
  rows.set_row_begin(6);
  rows.set_data(reinterpret_cast<const char*>(values.data()), 6 * 4);
  TensorChunk slot = rows;  // its optimizer slot, fields reversed
  slot.set_slot("m");
  slot.set_data(reinterpret_cast<const char*>(slot_values.data()), 6 * 4);
  TensorChunk twice = rows;  // a third slice's data, first a wrong one then the right one
  twice.set_row_begin(8);
  twice.set_data(std::string(6 * 4, '\x7f'));
  // field 6 (data) again, 24 bytes, after row_begin
  const std::string twice_bytes =
      twice.SerializeAsString() + std::string("\x32\x18", 2) + rows.data();
  const std::string message =
      AsPushChunks({rows.SerializeAsString(), ReversedChunk(slot), twice_bytes});
  PushRequest parsed;  // what protobuf reads
  ASSERT_TRUE(parsed.ParseFromString(message));
  ASSERT_EQ(parsed.chunk_size(), 3);
  EXPECT_EQ(parsed.chunk(0).row_begin(), 6);
  EXPECT_EQ(parsed.chunk(1).slot(), "m");
  EXPECT_EQ(parsed.chunk(2).data(), rows.data());

  for (size_t cut : {size_t{1}, size_t{5}, size_t{1} << 20}) {
    SCOPED_TRACE(cut);
    std::vector<float> row0(6, -1.0f), row6(6, -1.0f), row6_m(6, -1.0f), row8(6, -1.0f);
    std::vector<TensorSink> sinks = {{"w", "", {2, 3}, row0.data()},
                                     {"w", "", {2, 3}, row6.data()},
                                     {"w", "m", {2, 3}, row6_m.data()},
                                     {"w", "", {2, 3}, row8.data()}};
    sinks[1].row_begin = sinks[2].row_begin = 6;
    sinks[3].row_begin = 8;
    ChunkAssembler assembler(sinks);
    std::vector<int> completed;
    int64_t bytes = 0;
    grpc::ByteBuffer buffer = Cut(message, cut);
    PushRequest fields;
    absl::Status s = ReadChunkMessage(
        &buffer, PushRequest::kChunkFieldNumber, &fields,
        [&]() -> absl::StatusOr<ChunkAssembler*> { return &assembler; },
        [&](int i) {
          completed.push_back(i);
          return absl::OkStatus();
        },
        &bytes);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(completed, (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(bytes, 3 * 6 * 4);
    EXPECT_EQ(row0, std::vector<float>(6, -1.0f));
    EXPECT_FALSE(assembler.Complete("w", "", 0));
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(row6.data()), 24), parsed.chunk(0).data());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(row6_m.data()), 24),
              parsed.chunk(1).data());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(row8.data()), 24), parsed.chunk(2).data());
  }
}

TEST(ChunkMessages, ChunksInSharedMemoryMustStayInsideTheRegion) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(64);
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedSpan span = (*region)->data();
  const std::vector<float> four = {1, 2, 3, 4};
  // A chunk of the 4 floats at `at` (16 bytes) as a PushRequest.
  auto at = [&](int64_t offset, int64_t size) {
    PushRequest m;
    TensorChunk* c = m.add_chunk();
    c->set_name("t");
    c->set_dtype(DT_FLOAT);
    c->add_shape(4);
    c->set_shared_offset(offset);
    c->set_shared_bytes(size);
    return m.SerializeAsString();
  };
  auto read = [&](const std::string& bytes, const SharedSpan* region_span) {
    std::vector<float> out(4);
    ChunkAssembler assembler({{"t", "", {4}, out.data(), true, DT_FLOAT}});
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    PushRequest fields;
    int64_t n = 0;
    return ReadChunkMessage(
        &buffer, PushRequest::kChunkFieldNumber, &fields,
        [&]() -> absl::StatusOr<ChunkAssembler*> { return &assembler; },
        [](int) { return absl::OkStatus(); }, &n, region_span);
  };
  std::memcpy(span.data + 48, four.data(), 16);
  EXPECT_TRUE(read(at(48, 16), &span).ok());
  for (const auto& [offset, size] : std::vector<std::pair<int64_t, int64_t>>{
           {49 + span.size, 16}, {span.size - 8, 16}, {-16, 16}, {0, -4}, {span.size, 16}}) {
    absl::Status s = read(at(offset, size), &span);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << offset << " " << size << ": " << s;
  }
  // Without a region, or with data as well.
  absl::Status s = read(at(0, 16), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("has no region"));
  PushRequest both;
  TensorChunk* c = both.add_chunk();
  c->set_name("t");
  c->set_dtype(DT_FLOAT);
  c->add_shape(4);
  c->set_data(std::string(16, '\0'));
  c->set_shared_bytes(16);
  s = read(both.SerializeAsString(), &span);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("both data and a place"));
  // Encoding into a region too small for the tensors.
  const std::vector<float> big = Ramp(100);
  ChunkSplitter splitter({{"big", "", {100}, big.data(), DT_FLOAT}}, kSharedMessageBytes);
  std::vector<ChunkPiece> pieces;
  ASSERT_TRUE(splitter.NextPieces(&pieces));
  int64_t cursor = 0;
  absl::StatusOr<grpc::ByteBuffer> encoded = EncodeSharedChunkMessage(
      PushRequest(), PushRequest::kChunkFieldNumber, pieces, span, &cursor);
  EXPECT_EQ(encoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(encoded.status().message(), HasSubstr("too small"));
}

}  // namespace
}  // namespace psflow
