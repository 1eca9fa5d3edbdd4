#include "common/cluster_config.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace psflow {
namespace {

using ::google::protobuf::ListValue;
using ::google::protobuf::Struct;
using ::google::protobuf::Value;

constexpr Role kAllRoles[] = {Role::kChief, Role::kPs, Role::kWorker, Role::kEvaluator};

// Status messages are printed as one line: keep newlines from JSON parser
// messages or user input out of them.
std::string OneLine(absl::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(OneLine(message));
}

std::string BinaryName(Role role) { return "psflow-" + RoleName(role); }

std::vector<std::string>* MutableAddresses(ClusterSpec* spec, Role role) {
  switch (role) {
    case Role::kChief:
      return &spec->chief;
    case Role::kPs:
      return &spec->ps;
    case Role::kWorker:
      return &spec->worker;
    case Role::kEvaluator:
      return &spec->evaluator;
  }
  return &spec->worker;  // unreachable
}

// The task a source names, and where the role came from (for messages).
struct Task {
  Role role = Role::kWorker;
  int index = 0;
  std::string origin;  // e.g. "in TF_CONFIG", "in POD_NAME 'worker-1'"
};

// What one environment source contributes: per-role lists it sets, and
// possibly the task.
struct Partial {
  std::map<Role, std::vector<std::string>> lists;
  std::optional<Task> task;
};

// Removes a ',' that is followed (after whitespace) by ']' or '}', outside
// JSON strings, so Helm-rendered lists like ["a", "b",] parse. (Applied to
// TF_CONFIG too, so that what parses does not depend on how lenient the
// protobuf version's JSON parser is.)
std::string StripTrailingCommas(absl::string_view json) {
  std::string out;
  out.reserve(json.size());
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      out.push_back(c);
      if (c == '\\' && i + 1 < json.size()) {
        out.push_back(json[++i]);
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == ',') {
      size_t j = i + 1;
      while (j < json.size() && absl::ascii_isspace(static_cast<unsigned char>(json[j]))) ++j;
      if (j < json.size() && (json[j] == ']' || json[j] == '}')) continue;  // drop it
    }
    out.push_back(c);
  }
  return out;
}

absl::StatusOr<Struct> ParseJsonObject(const std::string& json, absl::string_view source) {
  Struct root;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &root);
  if (!status.ok()) {
    return Invalid(absl::StrCat(source, " is not valid JSON: ",
                                std::string(status.message().data(), status.message().size())));
  }
  return root;
}

// Reads a role's address list from a JSON value; `where` is e.g.
// "TF_CONFIG: cluster.ps".
absl::StatusOr<std::vector<std::string>> AddressList(const Value& value, const std::string& where) {
  if (value.kind_case() != Value::kListValue) {
    return Invalid(absl::StrCat(where, " is not a list of \"host:port\" strings"));
  }
  std::vector<std::string> out;
  const ListValue& list = value.list_value();
  for (int i = 0; i < list.values_size(); ++i) {
    const Value& item = list.values(i);
    if (item.kind_case() != Value::kStringValue) {
      return Invalid(absl::StrFormat("%s[%d] is not a \"host:port\" string", where, i));
    }
    std::string host;
    int port = 0;
    if (absl::Status s = ParseHostPort(item.string_value(), &host, &port); !s.ok()) {
      return Invalid(absl::StrFormat("%s[%d] %s", where, i, s.message()));
    }
    out.push_back(item.string_value());
  }
  return out;
}

// Reads {"role": [addresses], ...}. "master" is the chief; both is an error.
absl::Status ParseClusterObject(const Struct& cluster, absl::string_view source,
                                absl::string_view prefix, Partial* partial) {
  // Sorted, so that the first error reported does not depend on map order.
  std::map<std::string, const Value*> sorted;
  for (const auto& [name, value] : cluster.fields()) sorted.emplace(name, &value);
  std::map<Role, std::string> key_of_role;
  for (const auto& [name, value] : sorted) {
    absl::StatusOr<Role> role = ParseRole(name);
    if (!role.ok()) {
      return Invalid(absl::StrCat(source, ": unknown role '", name, "' in ",
                                  prefix.empty() ? "the cluster" : "cluster",
                                  " (expected chief, master, ps, worker or evaluator)"));
    }
    if (auto [it, inserted] = key_of_role.emplace(*role, name); !inserted) {
      if (*role == Role::kChief &&
          absl::AsciiStrToLower(it->second) != absl::AsciiStrToLower(name)) {
        return Invalid(absl::StrCat(source, ": the cluster lists both 'chief' and 'master'"));
      }
      return Invalid(absl::StrCat(source, ": role '", name, "' is listed twice"));
    }
    absl::StatusOr<std::vector<std::string>> list =
        AddressList(*value, absl::StrCat(source, ": ", prefix, name));
    if (!list.ok()) return list.status();
    partial->lists[*role] = *std::move(list);
  }
  return absl::OkStatus();
}

absl::StatusOr<Partial> ParseTfConfig(const std::string& json) {
  absl::StatusOr<Struct> root = ParseJsonObject(json, "TF_CONFIG");
  if (!root.ok()) return root.status();
  Partial partial;
  const auto& fields = root->fields();
  if (fields.contains("sparseCluster") && !fields.contains("cluster")) {
    // The training operator's form for dynamic workers lists only some
    // members; psflow needs every address of the job.
    return Invalid(
        "TF_CONFIG has \"sparseCluster\" (the training operator's dynamic-worker form), which "
        "psflow does not support: set enableDynamicWorker to false in the TFJob");
  }
  if (auto it = fields.find("cluster"); it != fields.end()) {
    if (it->second.kind_case() != Value::kStructValue) {
      return Invalid("TF_CONFIG: \"cluster\" is not an object");
    }
    if (absl::Status s =
            ParseClusterObject(it->second.struct_value(), "TF_CONFIG", "cluster.", &partial);
        !s.ok()) {
      return s;
    }
  }
  if (auto it = fields.find("task"); it != fields.end()) {
    if (it->second.kind_case() != Value::kStructValue) {
      return Invalid("TF_CONFIG: \"task\" is not an object");
    }
    const auto& task_fields = it->second.struct_value().fields();
    auto type = task_fields.find("type");
    if (type == task_fields.end() || type->second.kind_case() != Value::kStringValue) {
      return Invalid("TF_CONFIG: task.type is missing or not a string");
    }
    absl::StatusOr<Role> role = ParseRole(type->second.string_value());
    if (!role.ok()) {
      return Invalid(absl::StrCat("TF_CONFIG: task.type: ", role.status().message()));
    }
    int index = 0;
    if (auto idx = task_fields.find("index"); idx != task_fields.end()) {
      const Value& v = idx->second;
      double number = -1;
      if (v.kind_case() == Value::kNumberValue) {
        number = v.number_value();
      } else if (v.kind_case() != Value::kStringValue ||
                 !absl::SimpleAtod(v.string_value(), &number)) {
        return Invalid("TF_CONFIG: task.index is not a number");
      }
      if (number != std::floor(number) || number < 0 || number > std::numeric_limits<int>::max()) {
        return Invalid(
            absl::StrCat("TF_CONFIG: task.index ", number, " is not a non-negative integer"));
      }
      index = static_cast<int>(number);
    }
    partial.task = Task{*role, index, "in TF_CONFIG"};
  }
  return partial;
}

absl::StatusOr<Task> ParsePodName(const std::string& pod_name) {
  std::vector<absl::string_view> parts = absl::StrSplit(pod_name, '-');
  if (parts.size() < 2) {
    return Invalid(absl::StrCat("POD_NAME '", pod_name, "' is not <role>-<index>"));
  }
  const std::string role_name(parts[parts.size() - 2]);
  const absl::string_view index_text = parts.back();
  absl::StatusOr<Role> role = ParseRole(role_name);
  if (!role.ok()) {
    return Invalid(absl::StrCat("POD_NAME '", pod_name, "': ", role.status().message()));
  }
  int index = -1;
  if (index_text.empty() || !absl::ascii_isdigit(static_cast<unsigned char>(index_text[0])) ||
      !absl::SimpleAtoi(index_text, &index)) {
    return Invalid(
        absl::StrCat("POD_NAME '", pod_name, "': '", index_text, "' is not a task index"));
  }
  return Task{*role, index, absl::StrCat("in POD_NAME '", pod_name, "'")};
}

// Splits a --*_hosts flag; surrounding spaces and one trailing comma are
// tolerated, empty entries are not (they would shift the indices).
absl::StatusOr<std::vector<std::string>> ParseHostsFlag(const std::string& value, Role role) {
  const std::string flag = absl::StrCat("--", RoleName(role), "_hosts");
  absl::string_view text = absl::StripAsciiWhitespace(value);
  if (!text.empty() && text.back() == ',') text.remove_suffix(1);
  std::vector<std::string> out;
  int i = 0;
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    const std::string address(absl::StripAsciiWhitespace(piece));
    std::string host;
    int port = 0;
    if (absl::Status s = ParseHostPort(address, &host, &port); !s.ok()) {
      return Invalid(absl::StrFormat("%s: entry %d %s", flag, i, s.message()));
    }
    out.push_back(address);
    ++i;
  }
  return out;
}

bool IsSet(const std::optional<std::string>& value) { return value.has_value() && !value->empty(); }

// The first of `names`' values that is set.
const std::optional<std::string>* FirstSet(
    std::initializer_list<const std::optional<std::string>*> values) {
  for (const std::optional<std::string>* v : values) {
    if (IsSet(*v)) return v;
  }
  return nullptr;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

// The cluster a PyTorchJob's environment describes: workers only (their
// addresses left to --worker_hosts when `workers_from_flags`).
absl::StatusOr<Partial> ParsePyTorchEnv(const ConfigEnv& env, bool workers_from_flags) {
  const bool pet = !IsSet(env.master_addr);
  const std::string addr = pet ? *env.pet_master_addr : *env.master_addr;
  const std::optional<std::string>* port_text = FirstSet({&env.master_port, &env.pet_master_port});
  const std::optional<std::string>* size_text = FirstSet({&env.pet_nnodes, &env.world_size});
  const std::optional<std::string>* rank_text = FirstSet({&env.rank, &env.pet_node_rank});
  auto number = [](const std::optional<std::string>* text, const char* name, int lo,
                   int hi) -> absl::StatusOr<int> {
    int value = 0;
    if (text == nullptr) return Invalid(absl::StrCat(name, " is not set (a PyTorchJob sets it)"));
    if (!absl::SimpleAtoi(**text, &value) || value < lo || value > hi) {
      return Invalid(
          absl::StrCat(name, " '", **text, "' is not an integer in [", lo, ", ", hi, "]"));
    }
    return value;
  };
  absl::StatusOr<int> port = number(port_text, "MASTER_PORT", 1, 65535);
  if (!port.ok()) return port.status();
  absl::StatusOr<int> size = number(size_text, "WORLD_SIZE (or PET_NNODES)", 1, 4096);
  if (!size.ok()) return size.status();
  absl::StatusOr<int> rank = number(rank_text, "RANK (or PET_NODE_RANK)", 0, 4095);
  if (!rank.ok()) return rank.status();
  if (*rank >= *size) {
    return Invalid(absl::StrFormat("RANK %d out of range: WORLD_SIZE is %d", *rank, *size));
  }
  Partial out;
  if (!workers_from_flags) {
    absl::StatusOr<std::vector<std::string>> workers = PyTorchJobWorkers(addr, *port, *size);
    if (!workers.ok()) return workers.status();
    out.lists[Role::kWorker] = *std::move(workers);
  }
  out.task = Task{Role::kWorker, *rank, "(RANK in a PyTorchJob's environment)"};
  return out;
}

constexpr absl::string_view kNothingConfigured =
    "no cluster configuration: pass --job_name, --task_id and "
    "--chief_hosts/--ps_hosts/--worker_hosts, or set TF_CONFIG, or CLUSTER_CONFIG and POD_NAME, "
    "or a PyTorchJob's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK";

}  // namespace

std::string RoleName(Role role) {
  switch (role) {
    case Role::kChief:
      return "chief";
    case Role::kPs:
      return "ps";
    case Role::kWorker:
      return "worker";
    case Role::kEvaluator:
      return "evaluator";
  }
  return "unknown";
}

absl::StatusOr<Role> ParseRole(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "chief" || lower == "master") return Role::kChief;
  if (lower == "ps") return Role::kPs;
  if (lower == "worker") return Role::kWorker;
  if (lower == "evaluator") return Role::kEvaluator;
  return Invalid(
      absl::StrCat("unknown role '", name, "' (expected chief, master, ps, worker or evaluator)"));
}

const std::vector<std::string>& ClusterSpec::Addresses(Role role) const {
  return *MutableAddresses(const_cast<ClusterSpec*>(this), role);
}

ConfigEnv ConfigEnv::FromProcess() {
  ConfigEnv env;
  auto read = [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
  env.tf_config = read("TF_CONFIG");
  env.cluster_config = read("CLUSTER_CONFIG");
  env.pod_name = read("POD_NAME");
  env.master_addr = read("MASTER_ADDR");
  env.master_port = read("MASTER_PORT");
  env.world_size = read("WORLD_SIZE");
  env.rank = read("RANK");
  env.pet_master_addr = read("PET_MASTER_ADDR");
  env.pet_master_port = read("PET_MASTER_PORT");
  env.pet_nnodes = read("PET_NNODES");
  env.pet_node_rank = read("PET_NODE_RANK");
  return env;
}

absl::Status ParseHostPort(const std::string& address, std::string* host, int* port) {
  auto bad = [&](absl::string_view why) {
    return Invalid(absl::StrCat("'", address, "' is not host:port (", why, ")"));
  };
  absl::string_view host_part, port_part;
  if (!address.empty() && address[0] == '[') {  // [ipv6]:port
    const size_t close = address.find(']');
    if (close == std::string::npos) return bad("unterminated '['");
    if (close + 1 >= address.size() || address[close + 1] != ':') return bad("no ':port'");
    host_part = absl::string_view(address).substr(1, close - 1);
    port_part = absl::string_view(address).substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad("no ':port'");
    host_part = absl::string_view(address).substr(0, colon);
    port_part = absl::string_view(address).substr(colon + 1);
    if (absl::StrContains(host_part, ':')) return bad("IPv6 hosts need brackets: [::1]:2222");
  }
  if (host_part.empty()) return bad("empty host");
  for (char c : host_part) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == '/' || c == '[' || c == ']') {
      return bad("bad character in host");
    }
  }
  int value = 0;
  if (port_part.empty() || port_part.size() > 5 ||
      !std::all_of(port_part.begin(), port_part.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); }) ||
      !absl::SimpleAtoi(port_part, &value) || value < 1 || value > 65535) {
    return bad("port must be an integer in 1..65535");
  }
  if (host != nullptr) *host = std::string(host_part);
  if (port != nullptr) *port = value;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> PyTorchJobWorkers(const std::string& master_addr,
                                                           int master_port, int world_size) {
  auto address = [](const std::string& host, int port) {
    return absl::StrContains(host, ':') ? absl::StrCat("[", host, "]:", port)
                                        : absl::StrCat(host, ":", port);
  };
  std::vector<std::string> out;
  if (IsLoopbackHost(master_addr)) {
    if (master_port + world_size - 1 > 65535) {
      return Invalid(absl::StrFormat("MASTER_PORT %d + WORLD_SIZE %d runs past port 65535",
                                     master_port, world_size));
    }
    for (int r = 0; r < world_size; ++r) out.push_back(address(master_addr, master_port + r));
    return out;
  }
  out.push_back(address(master_addr, master_port));
  std::string job;
  int first = 0;  // the worker replica index of rank 1
  if (absl::EndsWith(master_addr, "-master-0")) {
    job = master_addr.substr(0, master_addr.size() - std::string("-master-0").size());
  } else if (absl::EndsWith(master_addr, "-worker-0")) {
    job = master_addr.substr(0, master_addr.size() - std::string("-worker-0").size());
    first = 1;
  } else if (world_size > 1) {
    return Invalid(absl::StrCat(
        "MASTER_ADDR '", master_addr,
        "' is neither a loopback address nor a PyTorchJob pod name (<job>-master-0 or "
        "<job>-worker-0), so the other ranks' addresses are unknown: pass --worker_hosts"));
  }
  for (int r = 1; r < world_size; ++r) {
    out.push_back(address(absl::StrCat(job, "-worker-", r - 1 + first), master_port));
  }
  return out;
}

namespace {

// Step 1 of ResolveClusterConfig: the environment's cluster and task
// (TF_CONFIG, else CLUSTER_CONFIG and/or POD_NAME, else PyTorch's).
absl::StatusOr<Partial> FromEnvironment(const ClusterFlags& flags, const ConfigEnv& env) {
  Partial from_env;
  if (IsSet(env.tf_config)) return ParseTfConfig(StripTrailingCommas(*env.tf_config));
  if (IsSet(env.cluster_config)) {
    absl::StatusOr<Struct> root =
        ParseJsonObject(StripTrailingCommas(*env.cluster_config), "CLUSTER_CONFIG");
    if (!root.ok()) return root.status();
    if (absl::Status s = ParseClusterObject(*root, "CLUSTER_CONFIG", "", &from_env); !s.ok()) {
      return s;
    }
  }
  if (IsSet(env.pod_name)) {
    absl::StatusOr<Task> task = ParsePodName(*env.pod_name);
    if (!task.ok()) return task.status();
    from_env.task = *std::move(task);
  }
  if (!IsSet(env.cluster_config) && !IsSet(env.pod_name) &&
      (IsSet(env.master_addr) || IsSet(env.pet_master_addr))) {
    return ParsePyTorchEnv(env, IsSet(flags.worker_hosts));
  }
  return from_env;
}

// Step 2: flags replace whole lists and the task.
absl::Status ApplyFlags(const ClusterFlags& flags, Role expected, Partial* merged) {
  const std::pair<Role, const std::optional<std::string>*> host_flags[] = {
      {Role::kChief, &flags.chief_hosts},
      {Role::kPs, &flags.ps_hosts},
      {Role::kWorker, &flags.worker_hosts},
      {Role::kEvaluator, &flags.evaluator_hosts}};
  for (const auto& [role, value] : host_flags) {
    if (!IsSet(*value)) continue;
    absl::StatusOr<std::vector<std::string>> list = ParseHostsFlag(**value, role);
    if (!list.ok()) return list.status();
    merged->lists[role] = *std::move(list);
  }
  if (flags.task_id && flags.task_index && *flags.task_id != *flags.task_index) {
    return Invalid(absl::StrFormat("--task_id %d and --task_index %d disagree", *flags.task_id,
                                   *flags.task_index));
  }
  const std::optional<int> flag_index = flags.task_id ? flags.task_id : flags.task_index;
  if (IsSet(flags.job_name)) {
    if (!flag_index) return Invalid("--job_name given without --task_id");
    absl::StatusOr<Role> role = ParseRole(*flags.job_name);
    if (!role.ok()) return Invalid(absl::StrCat("--job_name: ", role.status().message()));
    merged->task = Task{*role, *flag_index, "in --job_name"};
  } else if (flag_index) {
    // --task_id alone: the role stays as the environment says, or is this binary's.
    if (merged->task) {
      merged->task->index = *flag_index;
    } else {
      merged->task = Task{expected, *flag_index, "(this binary's role)"};
    }
  }
  return absl::OkStatus();
}

// Step 3: the merged cluster's own checks (each address once, one chief at
// most, a chief or a worker).
absl::Status CheckCluster(const ClusterSpec& cluster) {
  std::map<std::string, std::string> seen;  // address -> "role[i]"
  for (Role role : kAllRoles) {
    const auto& list = cluster.Addresses(role);
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string where = absl::StrFormat("%s[%d]", RoleName(role), i);
      auto [it, inserted] = seen.emplace(list[i], where);
      if (!inserted) {
        return Invalid(
            absl::StrFormat("address '%s' appears twice (%s and %s)", list[i], it->second, where));
      }
    }
  }
  if (cluster.chief.empty() && cluster.worker.empty()) {
    return Invalid("the cluster has neither a chief nor a worker");
  }
  if (cluster.chief.size() > 1) {
    return Invalid(absl::StrFormat("the cluster has %d chief tasks; there must be exactly one",
                                   cluster.chief.size()));
  }
  return absl::OkStatus();
}

// The task's own address and port in `config`.
absl::Status PlaceTask(const Task& task, ClusterConfig* config) {
  const auto& own = config->cluster.Addresses(task.role);
  config->role = task.role;
  config->task_index = task.index;
  // An evaluator's TF_CONFIG may leave the evaluator out of the cluster; it
  // then has no address of its own (it listens on nothing).
  const bool unlisted_evaluator = task.role == Role::kEvaluator && own.empty();
  if (unlisted_evaluator) {
    if (task.index < 0) return Invalid(absl::StrFormat("task index %d out of range", task.index));
    return absl::OkStatus();
  }
  if (task.index < 0 || static_cast<size_t>(task.index) >= own.size()) {
    return Invalid(absl::StrFormat("task index %d out of range: the cluster has %d %s tasks",
                                   task.index, own.size(), RoleName(task.role)));
  }
  config->self_address = own[task.index];
  std::string host;
  // Validated with the lists; kept for safety.
  return ParseHostPort(config->self_address, &host, &config->self_port);
}

}  // namespace

absl::StatusOr<ClusterConfig> ResolveClusterConfig(const ClusterFlags& flags, const ConfigEnv& env,
                                                   Role expected) {
  absl::StatusOr<Partial> from_env = FromEnvironment(flags, env);
  if (!from_env.ok()) return from_env.status();
  if (absl::Status s = ApplyFlags(flags, expected, &*from_env); !s.ok()) return s;
  bool any_address = false;
  for (const auto& [role, list] : from_env->lists) any_address |= !list.empty();
  if (!any_address) return Invalid(kNothingConfigured);
  if (!from_env->task) {
    return Invalid(
        "no task: pass --job_name and --task_id, or set the task in TF_CONFIG, or set POD_NAME");
  }
  ClusterConfig config;
  for (auto& [role, list] : from_env->lists) *MutableAddresses(&config.cluster, role) = list;
  const Task& task = *from_env->task;
  if (task.role != expected) {
    return Invalid(absl::StrFormat("task type '%s' %s, but this is the %s binary (%s)",
                                   RoleName(task.role), task.origin, RoleName(expected),
                                   BinaryName(expected)));
  }
  if (absl::Status s = CheckCluster(config.cluster); !s.ok()) return s;
  if (absl::Status s = PlaceTask(task, &config); !s.ok()) return s;
  return config;
}

bool PsOnThisHost(const ClusterConfig& config) {
  std::string self_host;
  int port = 0;
  if (!ParseHostPort(config.self_address, &self_host, &port).ok()) self_host.clear();
  for (const std::string& address : config.cluster.ps) {
    std::string host;
    if (!ParseHostPort(address, &host, &port).ok()) continue;
    if (IsLoopbackHost(host) || (!self_host.empty() && host == self_host)) return true;
  }
  return false;
}

}  // namespace psflow
