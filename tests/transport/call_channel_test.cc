// Calls through a shared-memory channel: both ends in this process on one
// region (threads play the server), and a child process that serves a call
// and goes away.
#include "transport/call_channel.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

grpc::ByteBuffer Buffer(const std::string& text) { return MessageBuffer(text); }

// One region with a formatted channel and both its ends.
struct Pair {
  Pair() {
    absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(ChannelRegionBytes());
    EXPECT_TRUE(made.ok()) << made.status();
    region = *std::move(made);
    EXPECT_TRUE(ChannelEnd::Format(region->data()).ok());
    client = *ChannelEnd::Open(region->data(), ChannelEnd::Side::kClient,
                               [this] { return server_alive.load(); });
    server = *ChannelEnd::Open(region->data(), ChannelEnd::Side::kServer, nullptr);
  }
  // The server's next record, waiting for it for at most `timeout`.
  std::optional<ChannelEnd::Record> ServerRead(absl::Duration timeout = absl::Seconds(5)) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      const uint32_t seen = server->bell();
      absl::StatusOr<std::optional<ChannelEnd::Record>> r = server->TryRead();
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return std::nullopt;
      if (r->has_value()) return *std::move(*r);
      server->Wait(seen, end - absl::Now());
    }
    return std::nullopt;
  }
  std::unique_ptr<SharedRegion> region;
  std::atomic<bool> server_alive{true};
  std::unique_ptr<ChannelEnd> client, server;
};

TEST(CallChannelTest, ACallGoesBothWays) {
  Pair p;
  std::thread server([&] {
    std::optional<ChannelEnd::Record> start = p.ServerRead();
    ASSERT_TRUE(start.has_value());
    EXPECT_EQ(start->kind, ChannelEnd::kStart);
    uint8_t method = 0;
    absl::Time deadline;
    ASSERT_TRUE(DecodeStart(start->payload, &method, &deadline).ok());
    EXPECT_EQ(method, 7);
    EXPECT_GT(deadline, absl::Now());
    std::optional<ChannelEnd::Record> message = p.ServerRead();
    ASSERT_TRUE(message.has_value());
    EXPECT_EQ(message->kind, ChannelEnd::kMessage);
    EXPECT_EQ(message->payload, "question");
    EXPECT_EQ(p.ServerRead()->kind, ChannelEnd::kWritesDone);
    const absl::Time later = absl::Now() + absl::Seconds(5);
    ASSERT_TRUE(p.server->Write(ChannelEnd::kMessage, start->call, "answer", later).ok());
    ASSERT_TRUE(p.server->Write(ChannelEnd::kMessage, start->call, "", later).ok());
    ASSERT_TRUE(p.server
                    ->Write(ChannelEnd::kFinish, start->call,
                            EncodeFinish(grpc::Status(grpc::StatusCode::NOT_FOUND, "no such")),
                            later)
                    .ok());
  });
  ChannelCall call(p.client.get(), 1, 7, absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(call.Write(Buffer("question")));
  EXPECT_TRUE(call.WritesDone());
  grpc::ByteBuffer answer;
  ASSERT_TRUE(call.Read(&answer));
  EXPECT_EQ(MessageBytes(answer), "answer");
  ASSERT_TRUE(call.Read(&answer));
  EXPECT_EQ(MessageBytes(answer), "");
  EXPECT_FALSE(call.Read(&answer));
  const grpc::Status status = call.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "no such");
  EXPECT_TRUE(call.clean());
  server.join();
}

// Records of 300 KB through a 1 MiB ring, many times round it: the writer
// waits for room while the reader, slower, takes them.
TEST(CallChannelTest, LargeRecordsWrapAndWaitForRoom) {
  Pair p;
  constexpr int kRecords = 40;
  std::thread server([&] {
    for (int i = 0; i < kRecords; ++i) {
      std::optional<ChannelEnd::Record> r = p.ServerRead();
      ASSERT_TRUE(r.has_value()) << i;
      ASSERT_EQ(r->payload.size(), 300000u + i);
      EXPECT_EQ(r->payload.front(), static_cast<char>('a' + i % 26));
      EXPECT_EQ(r->payload.back(), static_cast<char>('a' + i % 26));
      if (i % 8 == 0) absl::SleepFor(absl::Milliseconds(20));
    }
  });
  for (int i = 0; i < kRecords; ++i) {
    const std::string body(300000 + i, static_cast<char>('a' + i % 26));
    ASSERT_TRUE(
        p.client->Write(ChannelEnd::kMessage, 1, body, absl::Now() + absl::Seconds(10)).ok());
  }
  server.join();
}

TEST(CallChannelTest, ARecordLargerThanTheRingIsRefused) {
  Pair p;
  const std::string body(kChannelRingBytes, 'x');
  absl::Status s = p.client->Write(ChannelEnd::kMessage, 1, body, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
}

TEST(CallChannelTest, NoRoomUntilTheDeadline) {
  Pair p;
  const std::string body(kChannelRingBytes / 2, 'x');
  ASSERT_TRUE(p.client->Write(ChannelEnd::kMessage, 1, body, absl::InfiniteFuture()).ok());
  const absl::Time start = absl::Now();
  absl::Status s = p.client->Write(ChannelEnd::kMessage, 1, body, start + absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
}

TEST(CallChannelTest, ACallEndsAtItsDeadlineAndCancelsOnTheServer) {
  Pair p;
  const absl::Time start = absl::Now();
  {
    ChannelCall call(p.client.get(), 3, 1, start + absl::Milliseconds(300));
    EXPECT_TRUE(call.WritesDone());
    grpc::ByteBuffer answer;
    EXPECT_FALSE(call.Read(&answer));
    EXPECT_EQ(call.Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_FALSE(call.clean());
  }
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  EXPECT_EQ(p.ServerRead()->kind, ChannelEnd::kStart);
  EXPECT_EQ(p.ServerRead()->kind, ChannelEnd::kWritesDone);
  std::optional<ChannelEnd::Record> cancel = p.ServerRead();
  ASSERT_TRUE(cancel.has_value());
  EXPECT_EQ(cancel->kind, ChannelEnd::kCancel);
  EXPECT_EQ(cancel->call, 3u);
}

TEST(CallChannelTest, ACancelFlagEndsAWait) {
  Pair p;
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(100));
    cancel = true;
  });
  ChannelCall call(p.client.get(), 1, 1, absl::Now() + absl::Seconds(30));
  call.CancelWhen(&cancel);
  const absl::Time start = absl::Now();
  EXPECT_EQ(call.Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  canceller.join();
}

TEST(CallChannelTest, AServerThatIsGoneEndsTheCall) {
  Pair p;
  p.server_alive = false;
  ChannelCall call(p.client.get(), 1, 1, absl::Now() + absl::Seconds(30));
  const absl::Time start = absl::Now();
  const grpc::Status status = call.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("gone"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(CallChannelTest, WhatIsLeftOfAnEarlierCallIsSkipped) {
  Pair p;
  const absl::Time later = absl::Now() + absl::Seconds(5);
  // The server's late answers to call 1, then call 2's.
  ASSERT_TRUE(p.server->Write(ChannelEnd::kMessage, 1, "old", later).ok());
  ASSERT_TRUE(
      p.server->Write(ChannelEnd::kFinish, 1, EncodeFinish(grpc::Status::CANCELLED), later).ok());
  ASSERT_TRUE(p.server->Write(ChannelEnd::kMessage, 2, "new", later).ok());
  ASSERT_TRUE(p.server->Write(ChannelEnd::kFinish, 2, EncodeFinish(grpc::Status::OK), later).ok());
  ChannelCall call(p.client.get(), 2, 1, later);
  grpc::ByteBuffer answer;
  ASSERT_TRUE(call.Read(&answer));
  EXPECT_EQ(MessageBytes(answer), "new");
  EXPECT_TRUE(call.Finish().ok());
  EXPECT_TRUE(call.clean());
}

// A peer that scribbles on the control block or the ring breaks the
// channel with DATA_LOSS, and both sides see it closed.
TEST(CallChannelTest, GarbageBreaksTheChannel) {
  {
    Pair p;
    ASSERT_TRUE(p.client->Write(ChannelEnd::kMessage, 1, "fine", absl::InfiniteFuture()).ok());
    // The client claims to have written more than the ring holds.
    auto* control = reinterpret_cast<ChannelEnd::Control*>(p.region->data().data);
    std::atomic<uint64_t>* up_head = &control->up.head;
    up_head->store(uint64_t{1} << 40);
    absl::StatusOr<std::optional<ChannelEnd::Record>> r = p.server->TryRead();
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
    EXPECT_TRUE(p.client->closed());
    ChannelCall call(p.client.get(), 2, 1, absl::Now() + absl::Seconds(5));
    EXPECT_EQ(call.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  {
    Pair p;
    ASSERT_TRUE(p.client->Write(ChannelEnd::kMessage, 1, "fine", absl::InfiniteFuture()).ok());
    // The record's kind, overwritten.
    const uint32_t bad_kind = 99;
    std::memcpy(p.region->data().data + kChannelControlBytes, &bad_kind, sizeof(bad_kind));
    absl::StatusOr<std::optional<ChannelEnd::Record>> r = p.server->TryRead();
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
  }
  {
    Pair p;
    ASSERT_TRUE(p.client->Write(ChannelEnd::kMessage, 1, "fine", absl::InfiniteFuture()).ok());
    // The record's length, past what was written.
    const uint32_t long_length = 4000;
    std::memcpy(p.region->data().data + kChannelControlBytes + 4, &long_length,
                sizeof(long_length));
    absl::StatusOr<std::optional<ChannelEnd::Record>> r = p.server->TryRead();
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
  }
}

TEST(CallChannelTest, AnotherLayoutIsRefused) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(ChannelRegionBytes());
  ASSERT_TRUE(region.ok());
  // Never formatted: zeros.
  absl::StatusOr<std::unique_ptr<ChannelEnd>> end =
      ChannelEnd::Open((*region)->data(), ChannelEnd::Side::kServer, nullptr);
  EXPECT_TRUE(absl::IsDataLoss(end.status())) << end.status();
  SharedSpan small = (*region)->data();
  small.size = 4096;
  EXPECT_TRUE(absl::IsInvalidArgument(ChannelEnd::Format(small)));
}

TEST(CallChannelTest, StatusRecordsAreChecked) {
  EXPECT_FALSE(DecodeFinish("ab").ok());
  const uint32_t code = 1000;
  EXPECT_FALSE(DecodeFinish(std::string(reinterpret_cast<const char*>(&code), 4)).ok());
  uint8_t method = 0;
  absl::Time deadline;
  EXPECT_FALSE(DecodeStart("short", &method, &deadline).ok());
  ASSERT_TRUE(DecodeStart(EncodeStart(2, absl::InfiniteFuture()), &method, &deadline).ok());
  EXPECT_EQ(deadline, absl::InfiniteFuture());
}

// A child process serves one call through the shared mapping, then exits:
// the next call sees it gone.
TEST(CallChannelTest, AServerProcessThatExitsIsSeenGone) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(ChannelRegionBytes());
  ASSERT_TRUE(made.ok());
  std::unique_ptr<SharedRegion> region = *std::move(made);
  ASSERT_TRUE(ChannelEnd::Format(region->data()).ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::unique_ptr<ChannelEnd> server =
        *ChannelEnd::Open(region->data(), ChannelEnd::Side::kServer, nullptr);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      const uint32_t seen = server->bell();
      absl::StatusOr<std::optional<ChannelEnd::Record>> r = server->TryRead();
      if (!r.ok()) _exit(2);
      if (r->has_value() && (*r)->kind == ChannelEnd::kWritesDone) {
        const uint64_t call = (*r)->call;
        if (!server->Write(ChannelEnd::kMessage, call, "from the child", end).ok()) _exit(3);
        if (!server->Write(ChannelEnd::kFinish, call, EncodeFinish(grpc::Status::OK), end).ok()) {
          _exit(4);
        }
        _exit(0);
      }
      if (!r->has_value()) server->Wait(seen, absl::Milliseconds(50));
    }
    _exit(5);
  }
  std::unique_ptr<ChannelEnd> client = *ChannelEnd::Open(region->data(), ChannelEnd::Side::kClient,
                                                         [child] { return ProcessAlive(child); });
  {
    ChannelCall call(client.get(), 1, 1, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(call.WritesDone());
    grpc::ByteBuffer answer;
    ASSERT_TRUE(call.Read(&answer));
    EXPECT_EQ(MessageBytes(answer), "from the child");
    EXPECT_TRUE(call.Finish().ok());
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ChannelCall call(client.get(), 2, 1, absl::Now() + absl::Seconds(10));
  const absl::Time start = absl::Now();
  EXPECT_EQ(call.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace psflow
