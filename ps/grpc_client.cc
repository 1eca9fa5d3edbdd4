#include "ps/grpc_client.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "transport/call_channel.h"
#include "transport/channel_server.h"
#include "transport/chunk_messages.h"
#include "transport/grpc_util.h"

namespace psflow::ps {
namespace {

// Reads a server stream of chunked tensors (a snapshot) into `assembler`.
// Returns the first message (without its chunks; nothing if the stream was
// empty). The call's own failure comes first; chunks that do not fit are
// DATA_LOSS, and so are messages of differing versions. The stream is always
// drained, so that Finish() returns.
template <typename Response>
absl::StatusOr<std::optional<Response>> ReadChunks(grpc::ClientReader<Response>* reader,
                                                   ChunkAssembler* assembler) {
  std::optional<Response> first;
  Response response;
  absl::Status bad;
  while (reader->Read(&response)) {
    if (!bad.ok()) continue;
    if (first.has_value() && response.version() != first->version()) {
      bad = absl::DataLossError("answer mixes versions");
    }
    for (const TensorChunk& chunk : response.chunk()) {
      if (!bad.ok()) break;
      bad = assembler->Add(chunk);
    }
    if (!first.has_value()) {
      // Its chunks are in the assembler: keep the rest without copying them.
      response.clear_chunk();
      first = std::move(response);
    }
  }
  absl::Status s = FromGrpcStatus(reader->Finish());
  if (!s.ok()) return s;
  if (!bad.ok()) return absl::DataLossError(bad.message());
  return first;
}

// Sends `header` and then `tensors` in chunks on the client stream `writer`
// (Init or Push), and returns the call's status. A failed write is explained
// by that status.
template <typename Request, typename Header>
absl::Status WriteHeaderAndTensors(grpc::ClientWriter<Request>* writer, const Header& header,
                                   std::vector<TensorRef> tensors) {
  Request request;
  *request.mutable_header() = header;
  ChunkSplitter splitter(std::move(tensors), kChunkBytes);
  WriteChunked(writer, splitter, request, [](Request& r) { r.Clear(); });
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish());
}

// Bytes a push sends: its gradients in their wire dtype.
int64_t WireBytesOf(const std::vector<TensorRef>& tensors) {
  int64_t bytes = 0;
  for (const TensorRef& t : tensors) bytes += NumElements(t.shape) * WireBytes(t.dtype);
  return bytes;
}

constexpr char kService[] = "psflow.ParameterServer";
constexpr char kPushMethod[] = "/psflow.ParameterServer/Push";
constexpr char kPullMethod[] = "/psflow.ParameterServer/Pull";

// The caller's tensors lent to gRPC's slices for one call: Release waits
// until gRPC has let go of every slice (at the latest when the call is
// over), so that the caller may write to the memory again.
class Lent {
 public:
  Lent() : keep_(nullptr, [released = released_](const void*) { released->Notify(); }) {}
  const std::shared_ptr<const void>& keep() const { return keep_; }
  void Release() {
    keep_.reset();
    if (!released_->WaitForNotificationWithTimeout(absl::Seconds(10))) {
      PSLOG(WARNING) << "gRPC still holds pushed gradients 10 s after the push ended";
    }
  }

 private:
  // Shared with the last holder, which may outlive a Release that gave up.
  std::shared_ptr<absl::Notification> released_ = std::make_shared<absl::Notification>();
  std::shared_ptr<const void> keep_;
};

// What a pull asks whatever it waits for (a version, or a clock): the job,
// its slices (none: all of them) and how long the ps may hold it.
PullRequest PullRequestOf(uint64_t job_id, const std::vector<int>& slices,
                          absl::Duration max_wait) {
  PullRequest request;
  request.set_job_id(job_id);
  request.set_max_wait_ms(absl::ToInt64Milliseconds(max_wait));
  for (int i : slices) request.add_slices(i);
  return request;
}

}  // namespace

bool GrpcClient::Reachable(int ps) const {
  const grpc_connectivity_state state = links_[ps]->channels[0]->GetState(/*try_to_connect=*/false);
  return state == GRPC_CHANNEL_READY || state == GRPC_CHANNEL_IDLE;
}

void GrpcClient::CancelAll() {
  cancelled_ = true;
  calls_.CancelAll();
}

GrpcClient::GrpcClient(const std::vector<std::string>& addresses, GrpcClientOptions options)
    : retry_shared_after_(options.retry_shared_after),
      use_channels_(options.channels),
      errors_(options.metrics, kService),
      trace_(options.trace) {
  if (options.shared_memory) regions_ = std::make_shared<SharedRegionPool>(kMaxRegionBytes);
  metrics::Registry* m = metrics::Registry::OrPrivate(options.metrics, own_metrics_);
  push_bytes_ = m->GetHistogram("psflow_push_bytes",
                                "Gradient bytes (in the wire dtype) sent by one push call to a ps.",
                                metrics::ByteBuckets());
  push_seconds_ =
      m->GetHistogram("psflow_push_seconds",
                      "Duration of one successful push call to a ps (a push during the backward "
                      "pass opens with the step: the pass is included).",
                      metrics::LatencyBuckets());
  pull_bytes_ = m->GetHistogram(
      "psflow_pull_bytes",
      "Weight bytes (in the wire dtype) received by one pull call from a ps that carried them.",
      metrics::ByteBuckets());
  pull_seconds_ = m->GetHistogram(
      "psflow_pull_seconds",
      "Duration of one pull call from a ps that carried weights, the ps's wait for the version "
      "included.",
      metrics::LatencyBuckets());
  shared_calls_ = m->GetCounter(
      "psflow_shared_memory_calls_total",
      "Pushes and pulls that went through shared memory with a ps on this host (pulls answered "
      "'not yet', which carry no tensors, included).");
  channel_calls_ = m->GetCounter(
      "psflow_channel_calls_total",
      "Pushes and pulls that went through a same-host channel with a ps on this host (no gRPC "
      "thread on either side).");
  for (const std::string& a : addresses) {
    auto link = std::make_unique<Link>();
    for (int c = 0; c < std::max(options.connections_per_ps, 1); ++c) {
      link->channels.push_back(MakeChannel(a, options.server_role, options.security,
                                           /*own_connection=*/options.connections_per_ps > 1));
      link->raw.push_back(std::make_unique<grpc::GenericStub>(link->channels.back()));
    }
    link->stub = ParameterServer::NewStub(link->channels[0]);
    const std::string name = absl::StrCat("ps ", links_.size());
    if (regions_ != nullptr) {
      link->offers = std::make_unique<RegionOffers>(name, retry_shared_after_);
    }
    if (regions_ != nullptr && use_channels_) {
      link->channel_pool = std::make_unique<ChannelPool>(
          ChannelPool::Options{.max_open = kMaxChannelsPerPs,
                               .retry_after = retry_shared_after_,
                               .server_name = name},
          [this, stub = link->stub.get()](const SharedRegionRef& region) {
            return OpenChannel(stub, region);
          });
    }
    links_.push_back(std::move(link));
  }
}

grpc::GenericStub* GrpcClient::NextStub(int ps, ChannelMethod method) {
  Link& link = *links_[ps];
  std::atomic<unsigned>& next = method == ChannelMethod::kPush ? link.next_push : link.next_pull;
  return link.raw[next.fetch_add(1, std::memory_order_relaxed) % link.raw.size()].get();
}

absl::Status GrpcClient::Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                              absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  InitResponse response;
  return errors_.Count(
      "Init",
      WithPs(ps, WriteHeaderAndTensors(links_[ps]->stub->Init(call.context(), &response).get(),
                                       header, std::move(tensors))));
}

bool GrpcClient::OfferRegion(int ps, bool* probe) {
  *probe = false;
  return regions_ != nullptr && links_[ps]->offers->Offer(probe);
}

SharedRegionPool::Lease GrpcClient::RegionFor(int ps, int64_t bytes, int64_t count, bool* probe) {
  *probe = false;
  if (bytes == 0 || !OfferRegion(ps, probe)) return {};
  SharedRegionPool::Lease lease = regions_->Acquire(SharedBytesFor(bytes, count));
  if (!lease && *probe) {
    links_[ps]->offers->ProbeDropped();
    *probe = false;
  }
  return lease;
}

bool GrpcClient::RefusedRegion(int ps, const absl::Status& status, SharedRegionPool::Lease* lease,
                               bool probe) {
  if (status.ok()) shared_calls_->Add();
  // (The push region is not another call's afterwards: its owner writes it
  // again only after this push, or a retry of it, was answered.)
  return links_[ps]->offers->Answered(status, lease, probe);
}

void GrpcClient::SetRegionPinning(std::function<bool(void*, size_t)> pin,
                                  std::function<void(void*)> unpin) {
  if (regions_ != nullptr) regions_->SetPinning(std::move(pin), std::move(unpin));
}

bool GrpcClient::SetPushRegion(std::shared_ptr<const SharedRegion> region) {
  absl::MutexLock lock(&push_region_mu_);
  push_region_ = regions_ != nullptr ? std::move(region) : nullptr;
  return push_region_ != nullptr;
}

absl::StatusOr<PullResponse> GrpcClient::RunPull(
    int ps, PullRequest request, std::vector<TensorSink> sinks, absl::Time deadline,
    const std::function<bool(const PullResponse&)>& ready, std::shared_ptr<const void>* hold,
    const std::atomic<bool>* give_up) {
  absl::StatusOr<DataType> dtype = SinksDtype(sinks);
  if (!dtype.ok()) return WithPs(ps, dtype.status());
  request.set_dtype(*dtype);
  const absl::Time start = absl::Now();
  int64_t bytes = 0;
  int64_t want = 0;
  for (const TensorSink& s : sinks) want += NumElements(s.shape) * WireBytes(*dtype);
  absl::StatusOr<PullResponse> first;
  bool probe = false;
  SharedRegionPool::Lease region = RegionFor(ps, want, static_cast<int64_t>(sinks.size()), &probe);
  bool network = true;
  int borrowed = 0;
  if (region) {
    first = PullCall(ps, request, sinks, deadline, ready, region.get(), &bytes, &borrowed, give_up);
    network = RefusedRegion(ps, first.status(), &region, probe);
    if (first.ok() && borrowed > 0) {
      // The sinks' values stay in the region until the caller lets go (the
      // pool lives as long as the hold).
      *hold = std::shared_ptr<const void>(
          new SharedRegionPool::Lease(std::move(region)), [pool = regions_](const void* lease) {
            delete static_cast<const SharedRegionPool::Lease*>(lease);
          });
    }
    region.reset();
  }
  if (network) {
    first = PullCall(ps, std::move(request), std::move(sinks), deadline, ready, nullptr, &bytes,
                     &borrowed, give_up);
  }
  if (!first.ok() && give_up != nullptr && give_up->load()) {
    return WithPs(ps, absl::CancelledError("pull given up"));
  }
  if (!first.ok()) return errors_.Count("Pull", WithPs(ps, first.status()));
  if (ready(*first)) {
    pull_bytes_->Observe(static_cast<double>(bytes));
    pull_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  }
  return first;
}

absl::StatusOr<PullResponse> GrpcClient::PullCall(
    int ps, PullRequest request, std::vector<TensorSink> sinks, absl::Time deadline,
    const std::function<bool(const PullResponse&)>& ready, SharedRegion* region, int64_t* bytes,
    int* borrowed, const std::atomic<bool>* give_up) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  for (TensorSink& sink : sinks) {
    if (sink.borrow == nullptr) continue;
    *sink.borrow = nullptr;
    if (region == nullptr || !region->pinned()) sink.borrow = nullptr;
  }
  ChunkAssembler assembler(std::move(sinks));
  *borrowed = 0;
  SharedSpan span;
  if (region != nullptr) {
    *request.mutable_region() = region->ref();
    span = region->data();
  }
  std::optional<PullResponse> first;  // its fields, with the lowest version of all messages
  absl::Status bad;
  grpc::Status finished;
  *bytes = 0;
  std::unique_ptr<ChannelPool::Channel> channel = region != nullptr ? TakeChannel(ps) : nullptr;
  bool clean = false;  // the channel's call ended with the ps's status
  {
    std::unique_ptr<MessageCall> rpc =
        OpenCall(ps, ChannelMethod::kPull, kPullMethod, call.context(), deadline, channel.get());
    if (give_up != nullptr) rpc->CancelWhen(give_up);
    grpc::ByteBuffer message;
    bool own = false;
    if (grpc::SerializationTraits<PullRequest>::Serialize(request, &message, &own).ok() &&
        rpc->Write(message)) {
      rpc->WritesDone();
    }
    PullResponse fields;
    // (The version a step's pushes make: traced as that step.)
    const int64_t step = request.by_clock() ? request.clock() : request.min_version() - 1;
    // The stream is always drained, so that Finish returns.
    while (rpc->Read(&message)) {
      TraceSpan read_span(trace_, "pull message read", step);
      read_span.Arg("ps", ps);
      if (!bad.ok()) continue;
      // A slice may be one version ahead of another.
      bad = ReadChunkMessage(
          &message, PullResponse::kChunkFieldNumber, &fields,
          [&]() -> absl::StatusOr<ChunkAssembler*> { return &assembler; },
          [](int) { return absl::OkStatus(); }, bytes, &span);
      if (!bad.ok()) continue;
      if (!first.has_value()) {
        first = std::move(fields);
      } else {
        first->set_version(std::min(first->version(), fields.version()));
      }
    }
    // From the stream's end (its status has come) to the call's.
    TraceSpan finish_span(trace_, "pull finish", step);
    finished = rpc->Finish();
    clean = channel != nullptr && static_cast<ChannelCall*>(rpc.get())->clean();
  }
  if (channel != nullptr) links_[ps]->channel_pool->Give(std::move(channel), clean);
  if (absl::Status s = FromGrpcStatus(finished); !s.ok()) return s;
  if (!bad.ok()) return absl::DataLossError(bad.message());
  if (!first.has_value()) return absl::DataLossError("empty pull answer");
  if (!ready(*first)) return *first;  // not yet: no data
  if (absl::Status s = assembler.Finish(); !s.ok()) return absl::DataLossError(s.message());
  *borrowed = assembler.borrowed();
  return *first;
}

absl::StatusOr<GrpcClient::PullResult> GrpcClient::Pull(
    int ps, uint64_t job_id, int64_t min_version, std::vector<int> slices,
    std::vector<TensorSink> sinks, absl::Time deadline, absl::Duration max_wait) {
  return PullVersion(ps, job_id, min_version, std::move(slices), std::move(sinks), deadline,
                     max_wait, nullptr);
}

absl::StatusOr<GrpcClient::PullResult> GrpcClient::PullUnlessGivenUp(
    int ps, uint64_t job_id, int64_t min_version, std::vector<int> slices,
    std::vector<TensorSink> sinks, absl::Time deadline, absl::Duration max_wait,
    const std::atomic<bool>& give_up) {
  return PullVersion(ps, job_id, min_version, std::move(slices), std::move(sinks), deadline,
                     max_wait, &give_up);
}

absl::StatusOr<GrpcClient::PullResult> GrpcClient::PullVersion(
    int ps, uint64_t job_id, int64_t min_version, std::vector<int> slices,
    std::vector<TensorSink> sinks, absl::Time deadline, absl::Duration max_wait,
    const std::atomic<bool>* give_up) {
  PullRequest request = PullRequestOf(job_id, slices, max_wait);
  request.set_min_version(min_version);
  PullResult result;
  absl::StatusOr<PullResponse> first = RunPull(
      ps, std::move(request), std::move(sinks), deadline,
      [&](const PullResponse& r) { return r.version() >= min_version; }, &result.hold, give_up);
  if (!first.ok()) return first.status();
  result.version = first->version();
  result.wait_us = first->wait_us();
  return result;
}

absl::StatusOr<GrpcClient::ClockedPull> GrpcClient::PullByClock(
    int ps, uint64_t job_id, int worker, int64_t clock, std::vector<int> slices,
    std::vector<TensorSink> sinks, absl::Time deadline, absl::Duration max_wait) {
  PullRequest request = PullRequestOf(job_id, slices, max_wait);
  request.set_by_clock(true);
  request.set_worker(worker);
  request.set_clock(clock);
  ClockedPull result;
  absl::StatusOr<PullResponse> first = RunPull(
      ps, std::move(request), std::move(sinks), deadline,
      [](const PullResponse& r) { return r.ready(); }, &result.hold);
  if (!first.ok()) return first.status();
  result.ready = first->ready();
  result.version = first->version();
  result.wait_us = first->wait_us();
  result.clock = first->clock();
  result.lag = first->lag();
  return result;
}

absl::StatusOr<PushResponse> GrpcClient::Push(int ps, const PushHeader& header,
                                              std::vector<TensorRef> grads, absl::Time deadline) {
  return RunPush(ps, header, std::move(grads), nullptr, deadline);
}

absl::StatusOr<PushResponse> GrpcClient::PushInRuns(int ps, const PushHeader& header,
                                                    std::vector<TensorRef> grads,
                                                    const PushRuns& runs, absl::Time deadline) {
  return RunPush(ps, header, std::move(grads), &runs, deadline);
}

absl::StatusOr<PushResponse> GrpcClient::RunPush(int ps, const PushHeader& header,
                                                 std::vector<TensorRef> grads, const PushRuns* runs,
                                                 absl::Time deadline) {
  const int64_t bytes = WireBytesOf(grads);
  const absl::Time start = absl::Now();
  absl::StatusOr<PushResponse> response;
  bool probe = false;
  // Gradients that lie in the push region go from there as they lie;
  // others are copied into a region of the pool.
  std::shared_ptr<const SharedRegion> own;
  {
    absl::MutexLock lock(&push_region_mu_);
    own = push_region_;
  }
  const bool in_place = own != nullptr && bytes > 0 && AllLieIn(grads, own->data());
  SharedRegionPool::Lease lease;
  const SharedRegion* region = nullptr;
  if (in_place) {
    if (OfferRegion(ps, &probe)) region = own.get();
  } else {
    lease = RegionFor(ps, bytes, static_cast<int64_t>(grads.size()), &probe);
    region = lease.get();
  }
  bool network = true;
  bool waited = false;  // a run's wait ended the push: the caller's error, not the call's
  if (region != nullptr) {
    response = PushCall(ps, header, grads, runs, deadline, region, in_place, &waited);
    network = !waited && RefusedRegion(ps, response.status(), in_place ? nullptr : &lease, probe);
    if (waited) {
      if (!in_place) lease.Discard();
      if (probe) links_[ps]->offers->ProbeDropped();  // nothing learnt: the next call probes
    }
    lease.reset();
  }
  if (network) {
    response = PushCall(ps, header, std::move(grads), runs, deadline, nullptr, false, &waited);
  }
  if (waited) return response.status();
  if (!response.ok()) return errors_.Count("Push", WithPs(ps, response.status()));
  push_bytes_->Observe(static_cast<double>(bytes));
  push_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  return response;
}

// One push call's writes, as they go.
struct GrpcClient::PushWrite {
  int ps = 0;
  MessageCall* rpc = nullptr;
  const PushRuns* runs = nullptr;        // null: one run of every gradient
  const SharedRegion* region = nullptr;  // null: over the network
  bool in_place = false;                 // the gradients lie in `region` already
  bool check = false;                    // each run is checked (PushRuns::checked) before it leaves
  int64_t step = 0;                      // the trace's
  const std::shared_ptr<const void>* keep = nullptr;  // lends the gradients to gRPC
  PushRequest message;  // the fields of the next message (the header first)
  int64_t cursor = 0;   // where the next chunk goes in a region of the pool
  bool sent_any = false;
  bool written = true;  // false once a write failed (the call's status says why)
  bool waited = false;  // a run's wait or check ended the push
};

absl::StatusOr<PushResponse> GrpcClient::PushCall(int ps, PushHeader header,
                                                  std::vector<TensorRef> grads,
                                                  const PushRuns* runs, absl::Time deadline,
                                                  const SharedRegion* region, bool in_place,
                                                  bool* waited) {
  PushResponse response;
  absl::Status s;
  Lent lent;
  std::unique_ptr<ChannelPool::Channel> channel;
  bool clean = false;  // the channel's call ended with the ps's status
  {
    // The call (its context) ends before the memory is asked back: gRPC may
    // hold the slices until then.
    ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
    channel = region != nullptr ? TakeChannel(ps) : nullptr;
    std::unique_ptr<MessageCall> rpc =
        OpenCall(ps, ChannelMethod::kPush, kPushMethod, call.context(), deadline, channel.get());
    if (region != nullptr) *header.mutable_region() = region->ref();
    PushWrite w{.ps = ps,
                .rpc = rpc.get(),
                .runs = runs,
                .region = region,
                .in_place = in_place,
                .check = runs != nullptr && runs->checked != nullptr,
                .step = header.step(),
                .keep = &lent.keep()};
    *w.message.mutable_header() = std::move(header);
    s = WritePushRuns(w, grads);
    *waited = w.waited;
    if (s.ok()) s = AwaitPushAnswer(w, channel != nullptr, &response, &clean);
  }
  if (channel != nullptr) links_[ps]->channel_pool->Give(std::move(channel), clean);
  lent.Release();
  if (!s.ok()) return s;
  return response;
}

absl::Status GrpcClient::WritePushRuns(PushWrite& w, const std::vector<TensorRef>& grads) {
  auto waited = [&w](absl::Status s) {
    w.waited = true;
    return s;
  };
  // As WriteChunked: the header goes first, even with no chunks. In runs,
  // it goes alone and at once (the ps maps the region meanwhile), then each
  // run's chunks once it is final.
  std::vector<size_t> starts = {0};
  if (w.runs != nullptr) {
    starts = w.runs->starts;
    w.written =
        w.rpc->Write(EncodeChunkMessage(w.message, PushRequest::kChunkFieldNumber, {}, nullptr));
    w.message.Clear();
    w.sent_any = true;
  }
  for (size_t g = 0; g < starts.size() && w.written; ++g) {
    const int run = static_cast<int>(g);
    if (w.runs != nullptr) {
      if (absl::Status s = w.runs->wait(run); !s.ok()) return waited(s);
    }
    const size_t end = RunEnd(starts, grads.size(), g);
    // The run is checked before any of it leaves: as it is copied into the
    // region (one message a run there), else in a pass of its own.
    if (w.check && w.region == nullptr) {
      absl::Status s = w.runs->checked(run, Client::RunBelow(grads, *w.runs, run));
      if (!s.ok()) return waited(s);
    }
    std::vector<TensorRef> part(grads.begin() + static_cast<std::ptrdiff_t>(starts[g]),
                                grads.begin() + static_cast<std::ptrdiff_t>(end));
    if (part.empty() && w.sent_any) {
      if (w.check && w.region != nullptr) {
        if (absl::Status s = w.runs->checked(run, true); !s.ok()) return waited(s);
      }
      continue;
    }
    PSFLOW_RETURN_IF_ERROR(WritePushRun(w, run, std::move(part)));
  }
  return absl::OkStatus();
}

absl::Status GrpcClient::WritePushRun(PushWrite& w, int run, std::vector<TensorRef> part) {
  ChunkSplitter splitter(std::move(part), w.region != nullptr ? kSharedMessageBytes : kChunkBytes);
  std::vector<ChunkPiece> pieces;
  bool more = splitter.NextPieces(&pieces);
  while (true) {
    grpc::ByteBuffer buffer;
    if (w.region != nullptr) {
      PSFLOW_ASSIGN_OR_RETURN(buffer, EncodeInRegion(w, run, pieces));
    } else {
      buffer = EncodeChunkMessage(w.message, PushRequest::kChunkFieldNumber, pieces, *w.keep);
    }
    TraceSpan write_span(trace_, "push run write", w.step);
    write_span.Arg("ps", w.ps);
    write_span.Arg("run", run);
    w.written = w.rpc->Write(buffer);
    write_span.End();
    w.sent_any = true;
    w.message.Clear();
    if (!w.written || !more) break;
    pieces.clear();
    more = splitter.NextPieces(&pieces);
    if (!more) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<grpc::ByteBuffer> GrpcClient::EncodeInRegion(PushWrite& w, int run,
                                                            const std::vector<ChunkPiece>& pieces) {
  bool below = true;
  TraceSpan copy_span(trace_, w.in_place ? "push run check" : "push run copy", w.step);
  copy_span.Arg("ps", w.ps);
  copy_span.Arg("run", run);
  bool* const check = w.check ? &below : nullptr;
  const float limit = w.check ? w.runs->below : 0.0f;
  absl::StatusOr<grpc::ByteBuffer> encoded =
      w.in_place ? EncodeInPlaceChunkMessage(w.message, PushRequest::kChunkFieldNumber, pieces,
                                             w.region->data(), check, limit)
                 : EncodeSharedChunkMessage(w.message, PushRequest::kChunkFieldNumber, pieces,
                                            w.region->data(), &w.cursor, check, limit);
  if (!encoded.ok() || !w.check) return encoded;
  if (absl::Status s = w.runs->checked(run, below); !s.ok()) {
    w.waited = true;
    return s;
  }
  return encoded;
}

absl::Status GrpcClient::AwaitPushAnswer(PushWrite& w, bool on_channel, PushResponse* response,
                                         bool* clean) {
  TraceSpan answer_span(trace_, "push answer wait", w.step);
  answer_span.Arg("ps", w.ps);
  if (w.written) w.rpc->WritesDone();
  grpc::ByteBuffer answer;
  const bool answered = w.rpc->Read(&answer);
  absl::Status s = FromGrpcStatus(w.rpc->Finish());
  *clean = on_channel && static_cast<ChannelCall*>(w.rpc)->clean();
  if (s.ok() && (!answered ||
                 !grpc::SerializationTraits<PushResponse>::Deserialize(&answer, response).ok())) {
    s = absl::DataLossError("unreadable push answer");
  }
  return s;
}

std::unique_ptr<MessageCall> GrpcClient::OpenCall(int ps, ChannelMethod method,
                                                  const char* grpc_method,
                                                  grpc::ClientContext* context, absl::Time deadline,
                                                  ChannelPool::Channel* channel) {
  if (channel == nullptr)
    return std::make_unique<RawCall>(NextStub(ps, method), context, grpc_method);
  channel_calls_->Add();
  return std::make_unique<ChannelCall>(channel->end.get(), channel->next_call++,
                                       static_cast<uint8_t>(method), deadline, &cancelled_);
}

std::unique_ptr<ChannelPool::Channel> GrpcClient::TakeChannel(int ps) {
  ChannelPool* pool = links_[ps]->channel_pool.get();
  return pool == nullptr ? nullptr : pool->Take();
}

absl::StatusOr<int32_t> GrpcClient::OpenChannel(ParameterServer::Stub* stub,
                                                const SharedRegionRef& region) {
  OpenChannelRequest request;
  *request.mutable_region() = region;
  OpenChannelResponse response;
  // The ps took this process's regions: it is up, and answers at once.
  ActiveCalls::Scope call(&calls_, absl::Now() + absl::Seconds(10), /*wait_for_ready=*/false);
  PSFLOW_RETURN_IF_ERROR(FromGrpcStatus(stub->OpenChannel(call.context(), request, &response)));
  return response.pid();
}

absl::StatusOr<PsState> GrpcClient::GetState(int ps, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  PsState state;
  absl::Status s =
      FromGrpcStatus(links_[ps]->stub->GetState(call.context(), GetStateRequest(), &state));
  if (!s.ok()) return errors_.Count("GetState", WithPs(ps, s));
  return state;
}

absl::Status GrpcClient::SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                                        int64_t from_version, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  SetLiveWorkersRequest request;
  request.set_job_id(job_id);
  for (int w : live) request.add_live_workers(w);
  request.set_from_version(from_version);
  SetLiveWorkersResponse response;
  return errors_.Count("SetLiveWorkers", WithPs(ps, FromGrpcStatus(links_[ps]->stub->SetLiveWorkers(
                                                        call.context(), request, &response))));
}

absl::Status GrpcClient::Snapshot(int ps, uint64_t job_id, int64_t version,
                                  std::vector<TensorSink> sinks, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  SnapshotRequest request;
  request.set_job_id(job_id);
  request.set_version(version);
  // Sinks of values alone ask for no optimizer slots.
  request.set_values_only(
      std::all_of(sinks.begin(), sinks.end(), [](const TensorSink& s) { return s.slot.empty(); }));
  ChunkAssembler assembler(std::move(sinks));
  absl::StatusOr<std::optional<SnapshotResponse>> first =
      ReadChunks(links_[ps]->stub->Snapshot(call.context(), request).get(), &assembler);
  if (!first.ok()) return errors_.Count("Snapshot", WithPs(ps, first.status()));
  if (!first->has_value() || (*first)->version() != version) {
    return errors_.Count("Snapshot",
                         WithPs(ps, absl::DataLossError("snapshot of another version")));
  }
  absl::Status s = assembler.Finish();
  return s.ok() ? s : errors_.Count("Snapshot", WithPs(ps, absl::DataLossError(s.message())));
}

absl::Status GrpcClient::Shutdown(int ps, uint64_t job_id, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  grpc::ClientContext& context = *call.context();
  ShutdownRequest request;
  request.set_job_id(job_id);
  ShutdownResponse response;
  return errors_.Count(
      "Shutdown",
      WithPs(ps, FromGrpcStatus(links_[ps]->stub->Shutdown(&context, request, &response))));
}

absl::Status GrpcClient::CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) {
  // Not wait-for-ready: a ps that is down is not waiting for anyone.
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/false);
  CheckpointTakenRequest request;
  request.set_job_id(job_id);
  CheckpointTakenResponse response;
  return errors_.Count("CheckpointTaken",
                       WithPs(ps, FromGrpcStatus(links_[ps]->stub->CheckpointTaken(
                                      call.context(), request, &response))));
}

}  // namespace psflow::ps
