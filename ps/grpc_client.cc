#include "ps/grpc_client.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"

namespace psflow::ps {
namespace {

// Reads a server stream of chunked tensors into `assembler`. Returns the
// first message (without its chunks; nothing if the stream was empty). The
// call's own failure comes first; chunks that do not fit, or messages of
// differing versions, are DATA_LOSS. The stream is always drained, so that
// Finish() returns.
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

}  // namespace

bool GrpcClient::Reachable(int ps) const {
  const grpc_connectivity_state state = channels_[ps]->GetState(/*try_to_connect=*/false);
  return state == GRPC_CHANNEL_READY || state == GRPC_CHANNEL_IDLE;
}

void GrpcClient::CancelAll() { calls_.CancelAll(); }

GrpcClient::GrpcClient(const std::vector<std::string>& addresses) {
  for (const std::string& a : addresses) {
    channels_.push_back(MakeChannel(a));
    stubs_.push_back(ParameterServer::NewStub(channels_.back()));
  }
}

absl::Status GrpcClient::Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                              absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  InitResponse response;
  return WithPs(ps, WriteHeaderAndTensors(stubs_[ps]->Init(call.context(), &response).get(), header,
                                          std::move(tensors)));
}

absl::StatusOr<GrpcClient::PullResult> GrpcClient::Pull(int ps, uint64_t job_id,
                                                        int64_t min_version,
                                                        std::vector<TensorSink> sinks,
                                                        absl::Time deadline,
                                                        absl::Duration max_wait) {
  absl::StatusOr<DataType> dtype = SinksDtype(sinks);
  if (!dtype.ok()) return WithPs(ps, dtype.status());
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  PullRequest request;
  request.set_job_id(job_id);
  request.set_min_version(min_version);
  request.set_max_wait_ms(absl::ToInt64Milliseconds(max_wait));
  request.set_dtype(*dtype);
  ChunkAssembler assembler(std::move(sinks));
  absl::StatusOr<std::optional<PullResponse>> first =
      ReadChunks(stubs_[ps]->Pull(call.context(), request).get(), &assembler);
  if (!first.ok()) return WithPs(ps, first.status());
  if (!first->has_value()) return WithPs(ps, absl::DataLossError("empty pull answer"));
  PullResult result;
  result.version = (*first)->version();
  result.wait_us = (*first)->wait_us();
  if (result.version < min_version) return result;  // not yet
  absl::Status s = assembler.Finish();
  if (!s.ok()) return WithPs(ps, absl::DataLossError(s.message()));
  return result;
}

absl::StatusOr<PushResponse> GrpcClient::Push(int ps, const PushHeader& header,
                                              std::vector<TensorRef> grads, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  PushResponse response;
  absl::Status s = WriteHeaderAndTensors(stubs_[ps]->Push(call.context(), &response).get(), header,
                                         std::move(grads));
  if (!s.ok()) return WithPs(ps, s);
  return response;
}

absl::StatusOr<PsState> GrpcClient::GetState(int ps, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  PsState state;
  absl::Status s = FromGrpcStatus(stubs_[ps]->GetState(call.context(), GetStateRequest(), &state));
  if (!s.ok()) return WithPs(ps, s);
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
  return WithPs(ps, FromGrpcStatus(stubs_[ps]->SetLiveWorkers(call.context(), request, &response)));
}

absl::Status GrpcClient::Snapshot(int ps, uint64_t job_id, int64_t version,
                                  std::vector<TensorSink> sinks, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  SnapshotRequest request;
  request.set_job_id(job_id);
  request.set_version(version);
  ChunkAssembler assembler(std::move(sinks));
  absl::StatusOr<std::optional<SnapshotResponse>> first =
      ReadChunks(stubs_[ps]->Snapshot(call.context(), request).get(), &assembler);
  if (!first.ok()) return WithPs(ps, first.status());
  if (!first->has_value() || (*first)->version() != version) {
    return WithPs(ps, absl::DataLossError("snapshot of another version"));
  }
  absl::Status s = assembler.Finish();
  return s.ok() ? s : WithPs(ps, absl::DataLossError(s.message()));
}

absl::Status GrpcClient::Shutdown(int ps, uint64_t job_id, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  grpc::ClientContext& context = *call.context();
  ShutdownRequest request;
  request.set_job_id(job_id);
  ShutdownResponse response;
  return WithPs(ps, FromGrpcStatus(stubs_[ps]->Shutdown(&context, request, &response)));
}

}  // namespace psflow::ps
