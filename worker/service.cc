#include "worker/service.h"

namespace psflow::worker {

grpc::Status StatusService::GetStatus(grpc::ServerContext*, const WorkerStatusRequest*,
                                      WorkerStatus* status) {
  const TrainerStatus s = trainer_->Status();
  status->set_worker(s.worker);
  status->set_job_id(s.job_id);
  status->set_step(s.step);
  status->set_finished(s.finished);
  return grpc::Status::OK;
}

}  // namespace psflow::worker
