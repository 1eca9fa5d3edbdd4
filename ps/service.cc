#include "ps/service.h"

#include <algorithm>

#include <memory>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/float16.h"
#include "common/grpc_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/tensor_chunks.h"
#include "ps/limits.h"
#include "ps/tensors.h"

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

}  // namespace

PsService::PsService(int ps_index, Shard* shard, std::function<void()> on_shutdown)
    : ps_index_(ps_index), shard_(shard), on_shutdown_(std::move(on_shutdown)) {}

grpc::Status PsService::Init(grpc::ServerContext* context, grpc::ServerReader<InitRequest>* reader,
                             InitResponse* response) {
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
  std::vector<Shard::SliceValues> values;
  std::vector<TensorSink> sinks = InitSinks(header, slot_names, &values);
  ChunkAssembler assembler(std::move(sinks));
  absl::Status s = ReadChunks(reader, request, assembler);
  if (s.ok()) s = shard_->Init(header, std::move(values));
  if (!s.ok()) return ToGrpcStatus(s);
  PSLOG(INFO) << "holding " << header.slice_size() << " slices of job " << header.job_id()
              << " at version " << header.version() << " for " << header.live_workers_size()
              << " workers";
  return grpc::Status::OK;
}

grpc::Status PsService::Pull(grpc::ServerContext* context, const PullRequest* request,
                             grpc::ServerWriter<PullResponse>* writer) {
  if (request->dtype() != DT_INVALID && WireBytes(request->dtype()) == 0) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("pull asks for dtype ", request->dtype(), ", not a wire dtype")));
  }
  absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> slices =
      shard_->Slices(request->job_id());
  if (!slices.ok()) return ToGrpcStatus(slices.status());
  const std::vector<SliceSpec>& specs = **slices;
  absl::StatusOr<std::vector<int>> indices =
      SliceIndices(request->slices(), static_cast<int>(specs.size()), "pull");
  if (!indices.ok()) return ToGrpcStatus(indices.status());
  absl::StatusOr<DataType> dtype = request->dtype();
  if (request->dtype() == DT_INVALID) dtype = shard_->WireDtype(request->job_id());
  if (!dtype.ok()) return ToGrpcStatus(dtype.status());
  const absl::Time call_deadline = absl::FromChrono(context->deadline());
  const absl::Time wait_deadline =
      request->max_wait_ms() > 0
          ? std::min(call_deadline, absl::Now() + absl::Milliseconds(request->max_wait_ms()))
          : call_deadline;
  auto cancelled = [context] { return context->IsCancelled(); };
  auto not_yet = [&] {
    PullResponse response;  // the version only: the caller asks again
    response.set_version(shard_->stats().version);
    writer->Write(response);
    return grpc::Status::OK;
  };
  if (indices->empty()) {
    // No slices: the answer is the version, once it is reached.
    absl::StatusOr<Shard::Pulled> pulled =
        shard_->Pull(request->job_id(), request->min_version(), wait_deadline, cancelled);
    if (absl::IsDeadlineExceeded(pulled.status()) && wait_deadline < call_deadline) {
      return not_yet();
    }
    if (!pulled.ok()) return ToGrpcStatus(pulled.status());
    PullResponse response;
    response.set_version(pulled->weights->version);
    response.set_wait_us(absl::ToInt64Microseconds(pulled->waited));
    writer->Write(response);
    return grpc::Status::OK;
  }
  // Slice by slice, each as soon as it is there, streamed from its published
  // value (which `pulled` keeps alive) and converted chunk by chunk to the
  // dtype asked for. max_wait only bounds the wait for the first slice.
  absl::Duration waited;
  for (size_t k = 0; k < indices->size(); ++k) {
    const int i = (*indices)[k];
    absl::StatusOr<Shard::PulledSlice> pulled =
        shard_->PullSlice(request->job_id(), i, request->min_version(),
                          k == 0 ? wait_deadline : call_deadline, cancelled);
    if (k == 0 && absl::IsDeadlineExceeded(pulled.status()) && wait_deadline < call_deadline) {
      return not_yet();
    }
    if (!pulled.ok()) return ToGrpcStatus(pulled.status());
    waited += pulled->waited;
    ChunkSplitter splitter({SliceValueRef(specs[i], pulled->value, *dtype)}, kChunkBytes);
    PullResponse response;
    response.set_version(pulled->version);
    if (k == 0) response.set_wait_us(absl::ToInt64Microseconds(waited));
    if (!WriteChunked(writer, splitter, response, [](PullResponse& r) { r.clear_wait_us(); })) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status PsService::Push(grpc::ServerContext* context, grpc::ServerReader<PushRequest>* reader,
                             PushResponse* response) {
  PushRequest request;
  absl::StatusOr<PushHeader> header = ReadHeader(reader, request, "push");
  if (!header.ok()) return ToGrpcStatus(header.status());
  absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> slices =
      shard_->Slices(header->job_id());
  if (!slices.ok()) return ToGrpcStatus(slices.status());
  absl::StatusOr<DataType> dtype = shard_->WireDtype(header->job_id());
  if (!dtype.ok()) return ToGrpcStatus(dtype.status());
  const std::vector<SliceSpec>& specs = **slices;
  absl::StatusOr<std::vector<int>> indices =
      SliceIndices(header->slices(), static_cast<int>(specs.size()), "push");
  if (!indices.ok()) return ToGrpcStatus(indices.status());
  if (header->skip()) {
    // No data: every slice named (all when none is) counts as pushed, skipped.
    if (!request.chunk().empty() || reader->Read(&request)) {
      return ToGrpcStatus(absl::InvalidArgumentError("a skip push carries no chunks"));
    }
    absl::StatusOr<PushResponse::Outcome> outcome =
        shard_->PushSlices(header->job_id(), header->worker(), header->step(),
                           SkipGradients(*indices, static_cast<int>(specs.size())));
    if (!outcome.ok()) return ToGrpcStatus(outcome.status());
    shard_->CountOutcome(*outcome);
    response->set_outcome(*outcome);
    response->set_version(shard_->stats().version);
    return grpc::Status::OK;
  }
  // The chunks come in the job's wire dtype and are decoded into fp32; each
  // slice goes to the shard as soon as it is complete, so that it can be
  // applied while the rest of the push is still on its way.
  std::vector<Shard::SliceGradient> grads;
  ChunkAssembler assembler(GradientSinks(specs, *indices, *dtype, &grads));
  bool accepted = false, stale = false;
  auto hand_over = [&](std::vector<Shard::SliceGradient> part) -> absl::Status {
    absl::StatusOr<PushResponse::Outcome> outcome =
        shard_->PushSlices(header->job_id(), header->worker(), header->step(), std::move(part));
    if (!outcome.ok()) return outcome.status();
    accepted |= *outcome == PushResponse::ACCEPTED;
    stale |= *outcome == PushResponse::STALE;
    return absl::OkStatus();
  };
  do {
    for (const TensorChunk& chunk : request.chunk()) {
      int completed = -1;
      absl::Status s = assembler.Add(chunk, &completed);
      if (s.ok() && completed >= 0) {
        std::vector<Shard::SliceGradient> part;
        part.push_back(std::move(grads[completed]));
        s = hand_over(std::move(part));
      }
      if (!s.ok()) return ToGrpcStatus(s);
    }
  } while (reader->Read(&request));
  if (absl::Status s = assembler.Finish(); !s.ok()) return ToGrpcStatus(s);
  if (indices->empty()) {  // a ps without slices: the push itself counts
    if (absl::Status s = hand_over({}); !s.ok()) return ToGrpcStatus(s);
  }
  const PushResponse::Outcome outcome =
      accepted ? PushResponse::ACCEPTED : (stale ? PushResponse::STALE : PushResponse::DUPLICATE);
  shard_->CountOutcome(outcome);
  response->set_outcome(outcome);
  response->set_version(shard_->stats().version);
  return grpc::Status::OK;
}

grpc::Status PsService::GetState(grpc::ServerContext* context, const GetStateRequest* request,
                                 PsState* response) {
  Shard::State st = shard_->state();
  response->set_ps_index(ps_index_);
  response->set_holds_job(st.has_job);
  response->set_job_id(st.job_id);
  response->set_version(st.version);
  *response->mutable_job() = std::move(st.job);
  for (int w : st.live_workers) response->add_live_workers(w);
  for (int w : st.joining_workers) response->add_joining_workers(w);
  return grpc::Status::OK;
}

grpc::Status PsService::SetLiveWorkers(grpc::ServerContext* context,
                                       const SetLiveWorkersRequest* request,
                                       SetLiveWorkersResponse* response) {
  absl::Status s = shard_->SetLiveWorkers(
      request->job_id(), {request->live_workers().begin(), request->live_workers().end()},
      request->from_version());
  if (!s.ok()) return ToGrpcStatus(s);
  response->set_version(shard_->stats().version);
  return grpc::Status::OK;
}

grpc::Status PsService::Snapshot(grpc::ServerContext* context, const SnapshotRequest* request,
                                 grpc::ServerWriter<SnapshotResponse>* writer) {
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap = shard_->SnapshotAt(
      request->job_id(), request->version(), absl::FromChrono(context->deadline()),
      [context] { return context->IsCancelled(); });
  if (!snap.ok()) return ToGrpcStatus(snap.status());
  // Streamed from the shared, immutable snapshot, which `snap` keeps alive.
  const Shard::Snapshot& taken = **snap;
  std::vector<TensorRef> refs = SnapshotRefs(taken);
  if (request->values_only()) {
    refs.erase(std::remove_if(refs.begin(), refs.end(),
                              [](const TensorRef& r) { return !r.slot.empty(); }),
               refs.end());
  }
  ChunkSplitter splitter(std::move(refs), kChunkBytes);
  SnapshotResponse response;
  response.set_version(taken.weights->version);
  if (!WriteChunked(writer, splitter, response, [](SnapshotResponse&) {})) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  return grpc::Status::OK;
}

grpc::Status PsService::Shutdown(grpc::ServerContext* context, const ShutdownRequest* request,
                                 ShutdownResponse* response) {
  if (!shard_->Slices(request->job_id()).ok()) {
    return ToGrpcStatus(absl::FailedPreconditionError("shutdown names another job"));
  }
  on_shutdown_();
  return grpc::Status::OK;
}

}  // namespace psflow::ps
