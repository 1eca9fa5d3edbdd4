// Which roles may call each method of a ps (and of a worker's replica),
// for the CallGate that StartServer puts in front of every call
// (transport/grpc_util.h) when members have certificates.
#ifndef PSFLOW_PS_CALLERS_H_
#define PSFLOW_PS_CALLERS_H_

#include "common/cluster_config.h"
#include "transport/grpc_util.h"

namespace psflow::ps {

// Who may call what on a ps when members have certificates (mutual TLS; the
// server's CallGate enforces it): Init, SetLiveWorkers and Shutdown only the
// chief; Snapshot the chief or an evaluator; Push a worker; Pull the chief, a
// worker or an evaluator; GetState any member. `chief` is the role that
// runs the chief's duties: kChief, or kWorker in a cluster without a chief
// (worker 0 is its chief; under TLS a worker's certificate then carries the
// chief's rights, as the certificate names a role, not a task).
CallerRoles PsCallers(Role chief = Role::kChief);
// The same for a worker's replica in a job without ps (JobConfig.exchange
// ALL_REDUCE): it is read over the network (Pull, Snapshot) by the chief,
// the other workers (loading theirs from worker 0's) and evaluators, and
// changed only by the chief on worker 0's (Init, Shutdown); its own worker
// pushes in-process, so Push and SetLiveWorkers are the chief's alone,
// which never calls them on a replica.
CallerRoles ReplicaCallers(Role chief, bool worker0);

}  // namespace psflow::ps

#endif  // PSFLOW_PS_CALLERS_H_
