#include "ps/service.h"

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
  const absl::Time call_deadline = absl::FromChrono(context->deadline());
  const absl::Time wait_deadline =
      request->max_wait_ms() > 0
          ? std::min(call_deadline, absl::Now() + absl::Milliseconds(request->max_wait_ms()))
          : call_deadline;
  absl::StatusOr<Shard::Pulled> pulled =
      shard_->Pull(request->job_id(), request->min_version(), wait_deadline,
                   [context] { return context->IsCancelled(); });
  if (absl::IsDeadlineExceeded(pulled.status()) && wait_deadline < call_deadline) {
    PullResponse not_yet;  // the version only: the caller asks again
    not_yet.set_version(shard_->stats().version);
    writer->Write(not_yet);
    return grpc::Status::OK;
  }
  if (!pulled.ok()) return ToGrpcStatus(pulled.status());
  absl::StatusOr<DataType> dtype = request->dtype();
  if (request->dtype() == DT_INVALID) dtype = shard_->WireDtype(request->job_id());
  if (!dtype.ok()) return ToGrpcStatus(dtype.status());
  // Streamed from the version's shared copy, which `pulled` keeps alive,
  // converted chunk by chunk to the dtype asked for.
  const Shard::Weights& weights = *pulled->weights;
  ChunkSplitter splitter(WeightRefs(weights, *dtype), kChunkBytes);
  PullResponse response;
  response.set_version(weights.version);
  response.set_wait_us(absl::ToInt64Microseconds(pulled->waited));
  // At least one message, so that a ps holding no slices still reports its version.
  if (!WriteChunked(writer, splitter, response, [](PullResponse& r) { r.clear_wait_us(); })) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
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
  // The chunks come in the job's wire dtype and are decoded into fp32.
  std::vector<std::vector<float>> grads;
  std::vector<TensorSink> sinks = GradientSinks(specs, *dtype, &grads);
  ChunkAssembler assembler(std::move(sinks));
  absl::Status s = ReadChunks(reader, request, assembler);
  if (!s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<PushResponse::Outcome> outcome =
      shard_->Push(header->job_id(), header->worker(), header->step(), std::move(grads));
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  response->set_outcome(*outcome);
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
  ChunkSplitter splitter(SnapshotRefs(taken), kChunkBytes);
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
