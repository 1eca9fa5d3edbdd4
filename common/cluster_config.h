// Resolves which role and task this process is, and the addresses of every
// member of the cluster, from (highest first) command-line flags, TF_CONFIG as
// the Kubeflow training operator writes it, or CLUSTER_CONFIG + POD_NAME.
//
// Resolution is a pure function of its inputs (no environment is read here:
// ConfigEnv::FromProcess() does that once in main), so it is thread-safe and
// testable. Every error is INVALID_ARGUMENT with one line that names the
// problem, suitable for printing before exiting 1.
#ifndef PSFLOW_COMMON_CLUSTER_CONFIG_H_
#define PSFLOW_COMMON_CLUSTER_CONFIG_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace psflow {

enum class Role { kChief, kPs, kWorker, kEvaluator };

// "chief", "ps", "worker", "evaluator".
std::string RoleName(Role role);
// Accepts the names above and "master" (= chief), case-insensitively.
absl::StatusOr<Role> ParseRole(const std::string& name);

// Address lists per role, "host:port" each, in task-index order.
struct ClusterSpec {
  std::vector<std::string> chief;
  std::vector<std::string> ps;
  std::vector<std::string> worker;
  std::vector<std::string> evaluator;  // not a training member
  const std::vector<std::string>& Addresses(Role role) const;
  // A cluster without a chief task (the Helm/Estimator shape): worker 0
  // runs the chief's duties in-process and answers the chief's RPCs.
  bool ChiefInWorker0() const { return chief.empty() && !worker.empty(); }
  // Where the chief's RPCs go: the chief, or worker 0 in a cluster without one.
  const std::string& ChiefAddress() const { return chief.empty() ? worker[0] : chief[0]; }
  // The role whose certificate the chief's address presents (chief, or
  // worker in a cluster without one).
  Role ChiefHostRole() const { return chief.empty() ? Role::kWorker : Role::kChief; }
  // A cluster without ps (workers only, or a chief and workers): the
  // workers average their gradients among themselves (JobConfig.exchange
  // ALL_REDUCE), and each keeps a replica of the weights served on its own
  // address; worker 0's is where the chief reads the job's state.
  bool AllReduce() const { return ps.empty(); }
};

struct ClusterConfig {
  ClusterSpec cluster;
  Role role = Role::kWorker;
  int task_index = 0;
  std::string self_address;  // cluster.Addresses(role)[task_index]
  int self_port = 0;         // the port of self_address; the process listens on it
};

// Values of the cluster flags; an unset flag is nullopt (empty host lists
// given explicitly as "" are also treated as unset).
struct ClusterFlags {
  std::optional<std::string> job_name;
  std::optional<int> task_id;              // --task_id
  std::optional<int> task_index;           // --task_index, an alias; both given must agree
  std::optional<std::string> chief_hosts;  // comma-separated host:port
  std::optional<std::string> ps_hosts;
  std::optional<std::string> worker_hosts;
  std::optional<std::string> evaluator_hosts;
};

// The environment variables that configure a cluster.
struct ConfigEnv {
  std::optional<std::string> tf_config;       // TF_CONFIG
  std::optional<std::string> cluster_config;  // CLUSTER_CONFIG
  std::optional<std::string> pod_name;        // POD_NAME, "<role>-<index>"
  // What the training operator sets in a PyTorchJob's pods (used when
  // neither TF_CONFIG nor CLUSTER_CONFIG is set): MASTER_ADDR, MASTER_PORT,
  // WORLD_SIZE, RANK, or their elastic forms PET_MASTER_ADDR,
  // PET_MASTER_PORT, PET_NNODES, PET_NODE_RANK (read where the first are
  // unset; PET_NNODES wins over WORLD_SIZE, which then counts processes).
  std::optional<std::string> master_addr, master_port, world_size, rank;
  std::optional<std::string> pet_master_addr, pet_master_port, pet_nnodes, pet_node_rank;
  static ConfigEnv FromProcess();
};

// The workers of a PyTorchJob, one process (pod) per rank, as psflow
// addresses them: rank 0 at MASTER_ADDR:MASTER_PORT; rank r at
//  - MASTER_ADDR:(MASTER_PORT + r) when MASTER_ADDR is a loopback address
//    (127.x.y.z, ::1 or localhost: every rank on one machine);
//  - <job>-worker-(r-1):MASTER_PORT when MASTER_ADDR is <job>-master-0 (the
//    operator's name for the Master pod and its service), or
//    <job>-worker-r:MASTER_PORT when it is <job>-worker-0 (a job of Worker
//    replicas only).
// Any other MASTER_ADDR is INVALID_ARGUMENT (pass --worker_hosts then).
absl::StatusOr<std::vector<std::string>> PyTorchJobWorkers(const std::string& master_addr,
                                                           int master_port, int world_size);

// Resolves the configuration of a process that must run as `expected`.
// Flags override the environment field by field (a host-list flag replaces
// that role's list; --job_name/--task_id replace the task). Errors: nothing
// configured; malformed JSON; unknown role; index out of range; an address
// that is not host:port; the same address twice; neither a chief nor a
// worker, or no ps (for training roles); and a task whose role is not
// `expected`. A cluster without a chief task is valid when it has workers:
// worker 0 is its chief (ClusterSpec::ChiefInWorker0).
absl::StatusOr<ClusterConfig> ResolveClusterConfig(const ClusterFlags& flags, const ConfigEnv& env,
                                                   Role expected);

// Splits "host:port" and validates the port (1..65535).
absl::Status ParseHostPort(const std::string& address, std::string* host, int* port);

// Whether a ps of the cluster listens on this process's host, as far as the
// addresses tell: a loopback host (localhost, 127.x.x.x, ::1) or the host
// of self_address.
bool PsOnThisHost(const ClusterConfig& config);

}  // namespace psflow

#endif  // PSFLOW_COMMON_CLUSTER_CONFIG_H_
