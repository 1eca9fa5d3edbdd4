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
  static ConfigEnv FromProcess();
};

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

}  // namespace psflow

#endif  // PSFLOW_COMMON_CLUSTER_CONFIG_H_
