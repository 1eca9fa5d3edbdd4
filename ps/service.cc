#include "ps/service.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include <unistd.h>

#include <grpcpp/alarm.h>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/cpu_count.h"
#include "common/deferred_work.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "ps/limits.h"
#include "ps/pull_session.h"
#include "ps/push_session.h"
#include "ps/snapshot_session.h"
#include "ps/tensors.h"
#include "transport/call_channel.h"
#include "transport/chunk_messages.h"
#include "transport/first_message_timer.h"
#include "transport/grpc_util.h"
#include "transport/tensor_chunks.h"
#include "transport/waiting_writer.h"

namespace psflow::ps {
namespace {

// Feeds the chunks of `request` and of every later message on `reader` to
// `assembler`, then checks that nothing is missing.
template <typename Request>
absl::Status ReadChunks(grpc::ServerReader<Request>* reader, Request& request,
                        ChunkAssembler& assembler) {
  do {
    for (const TensorChunk& chunk : request.chunk()) {
      absl::Status s = assembler.Add(chunk);
      if (!s.ok()) return s;
    }
  } while (reader->Read(&request));
  return assembler.Finish();
}

// Reads the first message of a client stream into `request` and takes its
// header out; INVALID_ARGUMENT if there is none. `rpc` names the call.
template <typename Request>
auto ReadHeader(grpc::ServerReader<Request>* reader, Request& request, absl::string_view rpc)
    -> absl::StatusOr<std::decay_t<decltype(request.header())>> {
  if (!reader->Read(&request) || !request.has_header()) {
    return absl::InvalidArgumentError(absl::StrCat(rpc, " stream must start with a header"));
  }
  return std::move(*request.mutable_header());
}

// Cancels a synchronous call's context from another thread (a timer's)
// until its handler lets go of it.
class ContextCanceller {
 public:
  explicit ContextCanceller(grpc::ServerContext* context) : context_(context) {}
  // Calls `first` (before the caller can see the call end), then cancels
  // the call, unless its handler let go of it.
  void Cancel(const std::function<void()>& first) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (context_ == nullptr) return;
    first();
    context_->TryCancel();
  }
  void Release() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    context_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  grpc::ServerContext* context_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

// Drives a PullSession: its messages as chunk messages (their data into the
// call's region, when it names one), its waits on the shard's waiter and an
// alarm. Keeps the values it sends alive until written.
template <typename Base>
class PsService::PullWriter final : public WaitingWriter<grpc::ByteBuffer, Base> {
  using Writer = WaitingWriter<grpc::ByteBuffer, Base>;
  using Writer::Arm;
  using Writer::Disarm;
  using Writer::finish_after_write_;
  using Writer::FinishLocked;
  using Writer::mu_;
  using Writer::response_;
  using Writer::Start;
  using Writer::WaitUntil;
  using Writer::WriteLocked;

 public:
  template <typename... BaseArgs>
  PullWriter(PsService* service, std::string peer, std::optional<PeerIdentity> caller,
             absl::Time deadline, const grpc::ByteBuffer* request, BaseArgs... base_args)
      : Writer(service, std::move(peer), deadline, base_args...),
        service_(service),
        caller_(std::move(caller)),
        start_(absl::Now()),
        parsed_(Parse(*request, &request_)),
        session_(service->shard_, request_, start_, deadline) {
    Start(parsed_ ? Prepare() : absl::InvalidArgumentError("unreadable pull request"));
  }

 private:
  static bool Parse(const grpc::ByteBuffer& request, PullRequest* parsed) {
    grpc::ByteBuffer copy = request;  // shares the slices
    return grpc::SerializationTraits<PullRequest>::Deserialize(&copy, parsed).ok();
  }

  absl::Status Prepare() ABSL_LOCKS_EXCLUDED(mu_) {
    // Only a pull by clock names its worker (other pulls leave it 0).
    if (request_.by_clock()) {
      PSFLOW_RETURN_IF_ERROR(CheckCallerIndex(caller_, Role::kWorker, request_.worker()));
    }
    {
      absl::MutexLock lock(&mu_);
      PSFLOW_RETURN_IF_ERROR(session_.Prepare());
    }
    if (request_.has_region()) {
      PSFLOW_ASSIGN_OR_RETURN(region_, service_->AttachRegion(request_.region()));
    }
    return absl::OkStatus();
  }

  void Next() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (splitter_ != nullptr && NextPiecesLocked()) return;
    const PullSession::Step step =
        session_.Next([this](int first, int last) { Arm(first, last); }, &message_);
    switch (step.action) {
      case PullSession::Action::kWait:
        return WaitUntil(step.until);
      case PullSession::Action::kFinish:
        return FinishLocked(step.status);
      case PullSession::Action::kSend:
        Disarm();
        return StartMessageLocked();
    }
  }

  // The session's message: its first chunks (or none, for the version
  // alone) in the call's first message of it.
  void StartMessageLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pieces_.clear();
    if (message_.slices == 0) {
      finish_after_write_ = message_.last;
      SendLocked();
      return;
    }
    // (The version a step's pushes make: traced as that step.)
    TraceSpan span(service_->trace_, "pull slices", message_.fields.version() - 1);
    span.Arg("slices", message_.slices, " from ", message_.first_slice);
    span.Arg("bytes", message_.bytes);
    value_ = std::move(message_.keep);
    splitter_ = std::make_unique<ChunkSplitter>(
        std::move(message_.refs), region_ != nullptr ? kSharedMessageBytes : kChunkBytes);
    splitter_->NextPieces(&pieces_);
    SendLocked();  // the first message of a slice goes even without chunks
  }

  // The current slices' next chunks: true when a message went.
  bool NextPiecesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    message_.fields.clear_wait_us();
    pieces_.clear();
    if (splitter_->NextPieces(&pieces_)) {
      SendLocked();
      return true;
    }
    splitter_.reset();
    value_ = nullptr;
    return false;
  }

  // Writes message_'s fields and the chunks in pieces_ as one message
  // (their data into the call's region, when it has one).
  void SendLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (region_ != nullptr) {
      absl::StatusOr<grpc::ByteBuffer> encoded = EncodeSharedChunkMessage(
          message_.fields, PullResponse::kChunkFieldNumber, pieces_, region_->data, &cursor_);
      if (!encoded.ok()) return FinishLocked(encoded.status());
      response_ = *std::move(encoded);
    } else {
      response_ =
          EncodeChunkMessage(message_.fields, PullResponse::kChunkFieldNumber, pieces_, value_);
    }
    // (gRPC may send the message on this thread.)
    TraceSpan span(service_->trace_, "pull message write", message_.fields.version() - 1);
    WriteLocked();
  }

  // A pull that carried what it asked for (slices, or the version alone)
  // goes to the service's metrics; a "not yet" answer or a failure does not.
  void Finishing(const absl::Status& status) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Its worker drops a region whose call failed: so does the ps.
    if (!status.ok() && region_ != nullptr) service_->ForgetRegion(request_.region());
    if (!status.ok() || session_.not_yet()) return;
    service_->pull_bytes_->Observe(static_cast<double>(session_.bytes()));
    service_->pull_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start_));
  }

  PsService* const service_;
  const std::optional<PeerIdentity> caller_;  // its certificate's (with TLS)
  const absl::Time start_;
  PullRequest request_;  // set once, in the constructor
  const bool parsed_;
  PullSession session_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const SharedMapping> region_;        // the worker's, if it named one
  int64_t cursor_ ABSL_GUARDED_BY(mu_) = 0;            // where the next chunk goes in it
  PullSession::Message message_ ABSL_GUARDED_BY(mu_);  // what the session hands out
  // The values of the slices being sent (kept alive while gRPC holds them).
  std::shared_ptr<const void> value_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ChunkSplitter> splitter_ ABSL_GUARDED_BY(mu_);
  std::vector<ChunkPiece> pieces_ ABSL_GUARDED_BY(mu_);  // the next message's chunks
};

// Drives a SnapshotSession: waits on the shard's waiter and an alarm until
// the snapshot is taken, then streams it (values, and optimizer slots
// unless values_only) in chunk messages.
class PsService::SnapshotWriter final
    : public WaitingWriter<SnapshotResponse, grpc::ServerWriteReactor<SnapshotResponse>> {
 public:
  SnapshotWriter(PsService* service, grpc::CallbackServerContext* context,
                 const SnapshotRequest* request)
      : WaitingWriter(service, context->peer(), absl::FromChrono(context->deadline())),
        session_(service->shard_, *request, call_deadline_) {
    absl::Status asked;
    {
      absl::MutexLock lock(&mu_);
      asked = session_.Request();
    }
    Start(asked);
  }

 private:
  void Next() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (splitter_ != nullptr) {
      response_.clear_chunk();
      if (splitter_->Next(response_.mutable_chunk())) {
        WriteLocked();
      } else {
        FinishLocked(absl::OkStatus());
      }
      return;
    }
    const SnapshotSession::Step step = session_.Next([this] { Arm(); });
    switch (step.action) {
      case SnapshotSession::Action::kWait:
        return WaitUntil(step.until);
      case SnapshotSession::Action::kFinish:
        return FinishLocked(step.status);
      case SnapshotSession::Action::kSend:
        break;
    }
    Disarm();
    splitter_ = std::make_unique<ChunkSplitter>(session_.Refs(), kChunkBytes);
    response_.set_version(session_.snapshot()->weights->version);
    splitter_->Next(response_.mutable_chunk());
    WriteLocked();
  }
  void Done() override {
    absl::MutexLock lock(&mu_);
    session_.Release();
  }

  SnapshotSession session_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ChunkSplitter> splitter_ ABSL_GUARDED_BY(mu_);
};

PsService::PsService(Shard* shard, PsServiceOptions options)
    : ps_index_(options.ps_index),
      shard_(shard),
      on_shutdown_(options.on_shutdown ? std::move(options.on_shutdown) : [] {}),
      on_job_(std::move(options.on_job)),
      streams_(options.limits),
      trace_(options.trace),
      apply_in_place_(options.apply_in_place),
      spread_wakes_(options.spread_wakes),
      wakers_(options.wakers),
      pushers_(options.pushers),
      regions_(options.shared_memory ? std::make_unique<SharedRegionMap>() : nullptr),
      channels_(options.channels && options.shared_memory) {
  metrics::Registry* m = metrics::Registry::OrPrivate(options.metrics, own_metrics_);
  push_bytes_ = m->GetHistogram("psflow_ps_push_bytes",
                                "Gradient bytes (in the wire dtype) received by one push call.",
                                metrics::ByteBuckets());
  push_seconds_ =
      m->GetHistogram("psflow_ps_push_seconds",
                      "Duration of one push call on the ps, from its header to the answer (a "
                      "push during the worker's backward pass opens with its step).",
                      metrics::LatencyBuckets());
  pull_bytes_ = m->GetHistogram("psflow_ps_pull_bytes",
                                "Weight bytes (in the wire dtype) sent by one pull call (the "
                                "answers 'not yet' left out).",
                                metrics::ByteBuckets());
  pull_seconds_ = m->GetHistogram(
      "psflow_ps_pull_seconds",
      "Duration of one pull call on the ps, waiting for the version included (the answers "
      "'not yet' left out).",
      metrics::LatencyBuckets());
  m->SetCounterFunction(
      "psflow_ps_refused_streams_total",
      "Init, Pull, Push and Snapshot streams refused (RESOURCE_EXHAUSTED) over the bound per "
      "client connection, of unproven peers, or in all, since this ps started.",
      [this] { return static_cast<double>(refused_streams()); });
  m->SetCounterFunction("psflow_ps_streams_timed_out_total",
                        "Init and Push streams cancelled for sending no valid header within "
                        "--stream_first_message_timeout, since this ps started.",
                        [this] { return static_cast<double>(streams_.timed_out()); });
  m->SetGaugeFunction(
      "psflow_ps_shared_regions",
      "Shared memory regions of workers on this host mapped by this ps (their pushes and pulls "
      "do not cross the network).",
      [this] { return regions_ == nullptr ? 0.0 : static_cast<double>(regions_->size()); });
  m->SetGaugeFunction("psflow_ps_channels",
                      "Same-host channels of workers open on this ps (their pushes and pulls "
                      "pass no gRPC thread).",
                      [this] { return static_cast<double>(open_channels()); });
  refused_regions_ = m->GetCounter(
      "psflow_ps_refused_regions_total",
      "Shared memory regions this ps refused to map (its calls went again over the network), "
      "since it started.");
  // A woken pull encodes its next slice (into a worker's shared region, or
  // a message) on this pool: a few threads, as pulls beside pushes wait for
  // most slices.
  if (wakers_ == nullptr) {
    own_wakers_ = std::make_unique<ThreadPool>(std::max(2, UsableCores() / 4));
    wakers_ = own_wakers_.get();
  }
  // Decoding is CPU work: about as many threads as cores (a slice's apply
  // may run on the thread that completes it, when the shard has no appliers).
  if (pushers_ == nullptr) {
    own_pushers_ = std::make_unique<ThreadPool>(std::max(4, UsableCores()));
    pushers_ = own_pushers_.get();
  }
}

PsService::~PsService() {
  // The channels' calls end (cancelled) while everything they use is here.
  std::vector<std::unique_ptr<ChannelServer>> servers;
  {
    absl::MutexLock lock(&channels_mu_);
    servers.swap(channel_servers_);
  }
  for (auto& server : servers) server->Stop();
  servers.clear();
}

int PsService::open_channels() const {
  absl::MutexLock lock(&channels_mu_);
  int open = 0;
  for (const auto& server : channel_servers_) open += server->ended() ? 0 : 1;
  return open;
}

absl::StatusOr<std::shared_ptr<const SharedMapping>> PsService::AttachRegion(
    const SharedRegionRef& ref) {
  absl::StatusOr<std::shared_ptr<const SharedMapping>> mapping =
      regions_ == nullptr ? SharedMemoryRefusal("this ps runs with --shared_memory=false")
                          : regions_->Attach(ref);
  if (!mapping.ok()) refused_regions_->Add();
  return mapping;
}

void PsService::ForgetRegion(const SharedRegionRef& ref) {
  if (regions_ != nullptr) regions_->Forget(ref.token());
}

absl::Status PsService::Admit(const std::string& peer) { return streams_.Admit(peer); }

void PsService::LetOut(const std::string& peer) { streams_.LetOut(peer); }

absl::Status PsService::SilentStream() const {
  return absl::DeadlineExceededError(absl::StrCat(
      "no valid header within ", absl::FormatDuration(streams_.limits().first_message_timeout),
      " of the stream's start (--stream_first_message_timeout)"));
}

void PsService::LogRefusedPush(const std::string& peer, const absl::Status& why) {
  const int64_t refused = ++refused_pushes_;
  if (refused <= 10 || refused % 1000 == 0) {
    PSLOG(WARNING) << "refused a push of " << peer << " (" << refused
                   << " refused so far): " << why.message();
  }
}

int64_t PsService::pushes_admitted() const {
  absl::MutexLock lock(&pushes_mu_);
  return pushes_admitted_;
}

bool PsService::pushes_open_up_to(int64_t seq) const {
  absl::MutexLock lock(&pushes_mu_);
  return !open_pushes_.empty() && *open_pushes_.begin() <= seq;
}

int64_t PsService::refused_streams() const { return streams_.refused(); }

int64_t PsService::timed_out_streams() const { return streams_.timed_out(); }

grpc::Status PsService::Init(grpc::ServerContext* context, grpc::ServerReader<InitRequest>* reader,
                             InitResponse* response) {
  const std::string peer = context->peer();
  bool pending = false;
  if (absl::Status s = streams_.Admit(peer, &pending); !s.ok()) return ToGrpcStatus(s);
  // A silent stream is cancelled: its Read returns.
  auto cancel = std::make_shared<ContextCanceller>(context);
  FirstMessageTimer timer(streams_.limits().first_message_timeout, [this, cancel, peer] {
    cancel->Cancel([&] { streams_.TimedOut(peer); });
  });
  absl::Cleanup let_out = [&] {
    cancel->Release();
    LetOut(peer);
  };
  InitRequest request;
  absl::StatusOr<InitHeader> read = ReadHeader(reader, request, "init");
  if (!read.ok()) return ToGrpcStatus(read.status());
  const InitHeader& header = *read;
  if (header.ps_index() != ps_index_) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("init for ps ", header.ps_index(), " reached ps ", ps_index_)));
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(header.job().optimizer());
  if (!opt.ok()) return ToGrpcStatus(opt.status());
  const std::vector<std::string> slot_names = (*opt)->SlotNames();
  // Check every size before allocating anything: the header may be garbage.
  if (absl::Status s = CheckInitHeader(header, slot_names.size()); !s.ok()) return ToGrpcStatus(s);
  if (!timer.Validated()) return ToGrpcStatus(SilentStream());
  std::vector<Shard::SliceValues> values;
  std::vector<TensorSink> sinks = InitSinks(header, slot_names, &values);
  ChunkAssembler assembler(std::move(sinks));
  absl::Status s = ReadChunks(reader, request, assembler);
  if (s.ok()) s = shard_->Init(header, std::move(values));
  if (!s.ok()) return ToGrpcStatus(s);
  if (pending) streams_.Vouch(peer);  // the chief's connection
  PSLOG(INFO) << "holding " << header.slice_size() << " slices of job " << header.job_id()
              << " at version " << header.version() << " for " << header.live_workers_size()
              << " workers";
  if (on_job_) on_job_(true);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* PsService::Pull(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request) {
  return new PullWriter<grpc::ServerWriteReactor<grpc::ByteBuffer>>(
      this, context->peer(), CallerIdentity(*context), absl::FromChrono(context->deadline()),
      request);
}

// A push's message that can carry at most this many bytes of data still to
// come is read on gRPC's thread that received it, not handed to a pusher.
constexpr int64_t kInlineReadBytes = 64 << 10;

// Reads a push message by message on the service's pushers pool (gRPC's
// threads stay free for the network), but for the stream's end and for
// messages that can carry at most kInlineReadBytes more (the last small
// slices of a push): for those a hand-off would cost more than the read.
// Each chunk is decoded from the message's slices (or the worker's region)
// into its slice's gradient, in the job's wire dtype, or left and checked
// where it lies in the region (below), and each slice goes to the shard as
// soon as it is complete, so that it can be applied while the rest of the
// push is still on its way. One message is read at a time, so the reader
// needs no lock.
//
// Gradients the shard applies where they lie in the worker's region
// (PsService's apply_in_place) each hold the push's Hold: the push is
// answered once the stream has ended and the shard has let go of the last
// of them (the worker reuses the region after the answer), or at once when
// the call fails or is cancelled.
template <typename Base>
class PsService::PushReader final : public Base {
 public:
  // The answer goes into `response` (gRPC's), or one of the reader's own
  // (null) that the base (a channel's, given `base_args`) sends.
  template <typename... BaseArgs>
  PushReader(PsService* service, std::string peer, std::optional<PeerIdentity> caller,
             grpc::ByteBuffer* response, BaseArgs... base_args)
      : Base(base_args...),
        service_(service),
        peer_(std::move(peer)),
        caller_(std::move(caller)),
        response_(response != nullptr ? response : &own_response_),
        session_(service->shard_),
        gate_(std::make_shared<Gate>(this)) {
    if constexpr (std::is_base_of_v<ChannelReadReactor, Base>) this->SetResponse(response_);
    if (absl::Status s = service_->streams_.Admit(peer_, &pending_); !s.ok()) {
      gate_->Answer(ToGrpcStatus(s));
      return;
    }
    admitted_ = true;
    {
      absl::MutexLock lock(&service_->pushes_mu_);
      seq_ = ++service_->pushes_admitted_;
      service_->open_pushes_.insert(seq_);
    }
    // A silent stream is cancelled (a channel's thread is its worker's own:
    // it only ever waits for that worker).
    if constexpr (!std::is_base_of_v<ChannelReadReactor, Base>) {
      timer_ = std::make_unique<FirstMessageTimer>(
          service_->streams_.limits().first_message_timeout,
          [service = service_, peer = peer_, gate = gate_] {
            gate->Answer(ToGrpcStatus(service->SilentStream()),
                         [&] { service->streams_.TimedOut(peer); });
          });
    }
    this->StartRead(&message_);
  }

 private:
  // Finishes the call once, whoever asks first. It outlives the reader
  // (holds keep it), which it does not touch once the call is finished.
  struct Gate {
    explicit Gate(PushReader* r) : reader(r) {}
    // `first` runs if this answers the call, before the caller can see it.
    void Answer(const grpc::Status& status, const std::function<void()>& first = nullptr) {
      if (answered.exchange(true)) return;
      if (first) first();
      reader->Finish(status);
    }
    PushReader* const reader;
    std::atomic<bool> answered{false};
    std::atomic<bool> ended{false};      // End() has prepared the answer
    std::atomic<bool> cancelled{false};  // OnCancel came
  };
  // What each borrowed gradient keeps alive: the region's mapping, and
  // the answer, given (OK) when the last hold goes, where the shard's
  // thread lets go of its lock if it deferred work, else at once.
  struct Hold {
    Hold(std::shared_ptr<const SharedMapping> r, std::shared_ptr<Gate> g)
        : region(std::move(r)), gate(std::move(g)) {}
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() {
      std::function<void()> answer = [gate = gate] { gate->Answer(grpc::Status::OK); };
      if (!DeferredWork::Defer(answer)) answer();
    }
    const std::shared_ptr<const SharedMapping> region;
    const std::shared_ptr<Gate> gate;
  };

  void OnCancel() override {
    gate_->cancelled = true;
    // Before End() the read in flight fails, and End() answers.
    if (gate_->ended) gate_->Answer(grpc::Status::CANCELLED);
  }

  void OnReadDone(bool ok) override {
    // A channel's thread is its worker's own: it reads every message.
    if (std::is_base_of_v<ChannelReadReactor, Base> || !ok ||
        (assembler_ != nullptr && assembler_->remaining_bytes() <= kInlineReadBytes)) {
      Process(ok);
      return;
    }
    service_->pushers_->Schedule([this, ok] { Process(ok); });
  }
  void OnDone() override {
    if (admitted_) {
      {
        absl::MutexLock lock(&service_->pushes_mu_);
        service_->open_pushes_.erase(seq_);
      }
      service_->LetOut(peer_);
    }
    delete this;
  }

  void Process(bool ok) {
    StepTrace* const trace = service_->trace_;
    const int64_t start_us = trace != nullptr ? StepTrace::NowMicros() : 0;
    if (!ok) {
      // An End that answers finishes the call, after which gRPC may delete
      // this reader at any moment: what the trace needs is taken first.
      const bool traced = trace != nullptr && started_ && trace->Wants(session_.header().step());
      const int64_t step = session_.header().step();
      std::string worker = absl::StrCat(session_.header().worker());
      absl::Status s = End();
      if (traced) {
        trace->Record("push answered", step, start_us, StepTrace::NowMicros(),
                      {{"worker", std::move(worker)}});
      }
      if (!s.ok()) Fail(s);
      return;
    }
    const int64_t bytes_before = bytes_;
    absl::Status s = Take();
    if (trace != nullptr && started_ && trace->Wants(session_.header().step())) {
      trace->Record("push message", session_.header().step(), start_us, StepTrace::NowMicros(),
                    {{"worker", absl::StrCat(session_.header().worker())},
                     {"bytes", absl::StrCat(bytes_ - bytes_before)}});
    }
    if (!s.ok()) {
      Fail(s);
    } else {
      this->StartRead(&message_);
    }
  }

  // Ends the call with `s` (not OK).
  void Fail(const absl::Status& s) {
    // Its worker drops a region whose call failed: so does the ps.
    if (region_ != nullptr) service_->ForgetRegion(session_.header().region());
    gate_->Answer(ToGrpcStatus(s));
  }

  // One message: the header (first message only) and chunks.
  absl::Status Take() {
    if (session_.skip()) return absl::InvalidArgumentError("a skip push carries no chunks");
    PushRequest fields;
    return ReadChunkMessage(
        &message_, PushRequest::kChunkFieldNumber, &fields,
        [&]() -> absl::StatusOr<ChunkAssembler*> {
          if (!started_) PSFLOW_RETURN_IF_ERROR(Begin(fields));
          return assembler_.get();
        },
        [&](int completed) {
          // A pull that a small slice's apply here wakes is answered on
          // this thread, once the shard's lock is let go.
          DeferredWork wakes;
          return Refused(session_.HandOver({completed}, hold_));
        },
        &bytes_, &region_span_);
  }

  absl::Status Begin(const PushRequest& first) {
    if (!first.has_header()) {
      return absl::InvalidArgumentError("push stream must start with a header");
    }
    started_ = true;
    const PushHeader& header = first.header();
    PSFLOW_RETURN_IF_ERROR(CheckCallerIndex(caller_, Role::kWorker, header.worker()));
    start_ = absl::Now();  // an answered push goes to the metrics
    if (service_->trace_ != nullptr) service_->trace_->Reached(header.step());
    // Gradients in a region are applied where they lie (16-bit ones widened
    // as the apply reads them), in a synchronous job.
    PSFLOW_RETURN_IF_ERROR(
        Refused(session_.Begin(header, header.has_region() && service_->apply_in_place_)));
    // An accepted header: the stream is in time, and its peer a member.
    if (timer_ != nullptr && !timer_->Validated()) return service_->SilentStream();
    if (pending_) service_->streams_.Vouch(peer_);
    if (header.has_region()) {
      PSFLOW_ASSIGN_OR_RETURN(region_, service_->AttachRegion(header.region()));
      region_span_ = region_->data;
    }
    if (session_.borrows()) hold_ = std::make_shared<Hold>(region_, gate_);
    // A skip push has no data: no assembler, so that a chunk is refused.
    if (!session_.skip()) assembler_ = std::make_unique<ChunkAssembler>(session_.TakeSinks());
    return absl::OkStatus();
  }

  // A push refused for its contents is logged.
  absl::Status Refused(absl::Status s) {
    if (absl::IsInvalidArgument(s)) service_->LogRefusedPush(peer_, s);
    return s;
  }

  // The stream ended (or broke): the answer.
  absl::Status End() {
    if (!started_) return absl::InvalidArgumentError("push stream must start with a header");
    if (!session_.skip()) PSFLOW_RETURN_IF_ERROR(assembler_->Finish());
    absl::StatusOr<PushResponse> response;
    {
      DeferredWork wakes;  // as in a HandOver
      response = session_.End();
    }
    if (!response.ok()) return Refused(response.status());
    bool own = false;
    if (!grpc::SerializationTraits<PushResponse>::Serialize(*response, response_, &own).ok()) {
      return absl::InternalError("could not encode the push answer");
    }
    service_->push_bytes_->Observe(static_cast<double>(bytes_));
    service_->push_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start_));
    gate_->ended = true;
    if (gate_->cancelled) {
      gate_->Answer(grpc::Status::CANCELLED);
    } else if (hold_ != nullptr) {
      hold_.reset();  // the answer goes with the shard's last hold (maybe this one)
    } else {
      gate_->Answer(grpc::Status::OK);
    }
    return absl::OkStatus();
  }

  PsService* const service_;
  const std::string peer_;
  const std::optional<PeerIdentity> caller_;  // its certificate's (with TLS)
  grpc::ByteBuffer own_response_;             // a channel's call's answer
  grpc::ByteBuffer* const response_;
  int64_t seq_ = 0;  // its number among the pushes admitted (pushes_admitted)
  bool admitted_ = false;
  bool pending_ = false;  // admitted as a stream of a peer not vouched for
  // Until the header is accepted; none on a channel.
  std::unique_ptr<FirstMessageTimer> timer_;
  grpc::ByteBuffer message_;
  bool started_ = false;  // the header came
  absl::Time start_;
  PushSession session_;
  std::unique_ptr<ChunkAssembler> assembler_;  // into the session's sinks
  // The worker's region, if the header named one: the chunks' data are there.
  std::shared_ptr<const SharedMapping> region_;
  SharedSpan region_span_;
  int64_t bytes_ = 0;
  const std::shared_ptr<Gate> gate_;
  std::shared_ptr<Hold> hold_;  // while gradients are borrowed, until End()
};

grpc::ServerReadReactor<grpc::ByteBuffer>* PsService::Push(grpc::CallbackServerContext* context,
                                                           grpc::ByteBuffer* response) {
  return new PushReader<grpc::ServerReadReactor<grpc::ByteBuffer>>(
      this, context->peer(), CallerIdentity(*context), response);
}

grpc::Status PsService::GetState(grpc::ServerContext* context, const GetStateRequest* request,
                                 PsState* response) {
  if (finished_) return ToGrpcStatus(absl::UnavailableError("this ps has finished its job"));
  Shard::State st = shard_->state();
  response->set_ps_index(ps_index_);
  response->set_holds_job(st.has_job);
  response->set_job_id(st.job_id);
  response->set_version(st.version);
  *response->mutable_job() = std::move(st.job);
  for (int w : st.live_workers) response->add_live_workers(w);
  for (int w : st.joining_workers) response->add_joining_workers(w);
  for (int64_t c : st.clocks) response->add_clocks(c);
  for (int64_t step : st.pushed_steps) response->add_pushed_steps(step);
  response->set_lag_count(st.lag_count);
  response->set_lag_sum(st.lag_sum);
  response->set_lag_max(st.lag_max);
  response->set_clock_gap_max(st.clock_gap_max);
  response->set_stopping(stopping_.load());
  return grpc::Status::OK;
}

grpc::Status PsService::SetLiveWorkers(grpc::ServerContext* context,
                                       const SetLiveWorkersRequest* request,
                                       SetLiveWorkersResponse* response) {
  if (finished_) return ToGrpcStatus(absl::UnavailableError("this ps has finished its job"));
  absl::Status s = shard_->SetLiveWorkers(
      request->job_id(), {request->live_workers().begin(), request->live_workers().end()},
      request->from_version());
  if (!s.ok()) return ToGrpcStatus(s);
  response->set_version(shard_->stats().version);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<SnapshotResponse>* PsService::Snapshot(
    grpc::CallbackServerContext* context, const SnapshotRequest* request) {
  return new SnapshotWriter(this, context, request);
}

grpc::Status PsService::Shutdown(grpc::ServerContext* context, const ShutdownRequest* request,
                                 ShutdownResponse* response) {
  if (!shard_->Slices(request->job_id()).ok()) {
    return ToGrpcStatus(absl::FailedPreconditionError("shutdown names another job"));
  }
  finished_ = true;
  on_shutdown_();
  return grpc::Status::OK;
}

grpc::Status PsService::CheckpointTaken(grpc::ServerContext* context,
                                        const CheckpointTakenRequest* request,
                                        CheckpointTakenResponse* response) {
  if (!shard_->Slices(request->job_id()).ok()) {
    return ToGrpcStatus(absl::FailedPreconditionError("the checkpoint taken is of another job"));
  }
  if (on_checkpoint_taken_) on_checkpoint_taken_();
  return grpc::Status::OK;
}

grpc::Status PsService::OpenChannel(grpc::ServerContext* context, const OpenChannelRequest* request,
                                    OpenChannelResponse* response) {
  if (!channels_) {
    return ToGrpcStatus(SharedMemoryRefusal(regions_ == nullptr
                                                ? "this ps runs with --shared_memory=false"
                                                : "this ps serves no same-host channels"));
  }
  const SharedRegionRef& ref = request->region();
  if (ref.bytes() < ChannelRegionBytes()) {
    return ToGrpcStatus(SharedMemoryRefusal("the region is too small for a channel"));
  }
  absl::StatusOr<std::shared_ptr<const SharedMapping>> mapping = AttachRegion(ref);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  const int32_t pid = ref.pid();
  absl::StatusOr<std::unique_ptr<ChannelEnd>> end = ChannelEnd::Open(
      (*mapping)->data, ChannelEnd::Side::kServer, [pid] { return ProcessAlive(pid); });
  if (!end.ok()) return ToGrpcStatus(SharedMemoryRefusal(std::string(end.status().message())));
  const std::string peer = absl::StrCat("channel:pid=", pid);
  std::vector<std::unique_ptr<ChannelServer>> ended;  // joined outside the lock
  {
    absl::MutexLock lock(&channels_mu_);
    auto split = std::stable_partition(channel_servers_.begin(), channel_servers_.end(),
                                       [](const auto& c) { return !c->ended(); });
    std::move(split, channel_servers_.end(), std::back_inserter(ended));
    channel_servers_.erase(split, channel_servers_.end());
    const int of_peer =
        static_cast<int>(std::count_if(channel_servers_.begin(), channel_servers_.end(),
                                       [&](const auto& c) { return c->peer() == peer; }));
    if (of_peer >= streams_.limits().per_peer ||
        static_cast<int>(channel_servers_.size()) >= streams_.limits().total) {
      return ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat("too many same-host channels open (", of_peer, " of this worker, ",
                       channel_servers_.size(), " in all)")));
    }
    channel_servers_.push_back(std::make_unique<ChannelServer>(
        *std::move(end), *std::move(mapping), peer,
        // The channel's calls are its opener's: they act as its identity.
        [this, caller = CallerIdentity(*context)](ChannelServer* host, ChannelMethod method,
                                                  const std::string& peer, absl::Time deadline,
                                                  const grpc::ByteBuffer* request) {
          if (method == ChannelMethod::kPush) {
            new PushReader<ChannelReadReactor>(this, peer, caller, nullptr, host);
          } else {
            new PullWriter<ChannelWriteReactor>(this, peer, caller, deadline, request, host);
          }
        }));
  }
  response->set_pid(getpid());
  return grpc::Status::OK;
}

}  // namespace psflow::ps
