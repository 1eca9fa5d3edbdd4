// The gRPC face of a parameter server: ParameterServer::Service over a Shard.
// Turns streams of TensorChunks into checked slices and back; every problem
// with a request becomes an error status for that call only. The shard holds
// fp32 only: pulls are encoded here in the dtype the request names (the
// job's wire dtype when it names none) and pushes, which come in the job's
// wire dtype, decoded here; Init and Snapshot are fp32.
#ifndef PSFLOW_PS_SERVICE_H_
#define PSFLOW_PS_SERVICE_H_

#include <functional>

#include "proto/ps.grpc.pb.h"
#include "ps/shard.h"

namespace psflow::ps {

class PsService final : public ParameterServer::Service {
 public:
  // `ps_index` is this server's task index: an Init for another index is
  // refused. `on_shutdown` is called for an accepted Shutdown; it
  // must only signal (the caller stops the server, letting this call finish).
  PsService(int ps_index, Shard* shard, std::function<void()> on_shutdown);

  grpc::Status Init(grpc::ServerContext* context, grpc::ServerReader<InitRequest>* reader,
                    InitResponse* response) override;
  grpc::Status Pull(grpc::ServerContext* context, const PullRequest* request,
                    grpc::ServerWriter<PullResponse>* writer) override;
  grpc::Status Push(grpc::ServerContext* context, grpc::ServerReader<PushRequest>* reader,
                    PushResponse* response) override;
  grpc::Status Shutdown(grpc::ServerContext* context, const ShutdownRequest* request,
                        ShutdownResponse* response) override;
  grpc::Status GetState(grpc::ServerContext* context, const GetStateRequest* request,
                        PsState* response) override;
  grpc::Status SetLiveWorkers(grpc::ServerContext* context, const SetLiveWorkersRequest* request,
                              SetLiveWorkersResponse* response) override;
  grpc::Status Snapshot(grpc::ServerContext* context, const SnapshotRequest* request,
                        grpc::ServerWriter<SnapshotResponse>* writer) override;

 private:
  int ps_index_;
  Shard* shard_;
  std::function<void()> on_shutdown_;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SERVICE_H_
