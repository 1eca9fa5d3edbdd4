#include "ps/callers.h"

#include <vector>

#include "absl/strings/string_view.h"
#include "proto/ps.grpc.pb.h"

namespace psflow::ps {

CallerRoles ReplicaCallers(Role chief, bool worker0) {
  auto method = [](absl::string_view name) {
    return MethodName(ParameterServer::service_full_name(), name);
  };
  const std::vector<Role> loads =
      worker0 ? std::vector<Role>{chief} : std::vector<Role>{Role::kChief};
  return {
      {method("Init"), loads},
      {method("Shutdown"), loads},
      {method("CheckpointTaken"), loads},
      {method("SetLiveWorkers"), {Role::kChief}},
      {method("Push"), {Role::kChief}},
      // A replica serves no channels (they carry pushes).
      {method("OpenChannel"), {Role::kChief}},
      {method("Snapshot"), {chief, Role::kWorker, Role::kEvaluator}},
      {method("Pull"), {chief, Role::kWorker, Role::kEvaluator}},
  };
}

CallerRoles PsCallers(Role chief) {
  auto method = [](absl::string_view name) {
    return MethodName(ParameterServer::service_full_name(), name);
  };
  return {
      {method("Init"), {chief}},
      {method("SetLiveWorkers"), {chief}},
      {method("Shutdown"), {chief}},
      {method("CheckpointTaken"), {chief}},
      {method("Snapshot"), {chief, Role::kEvaluator}},
      // A channel carries its worker's pushes and pulls.
      {method("OpenChannel"), {Role::kWorker}},
      {method("Push"), {Role::kWorker}},
      {method("Pull"), {Role::kChief, Role::kWorker, Role::kEvaluator}},
  };
}

}  // namespace psflow::ps
