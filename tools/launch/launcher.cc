#include "tools/launch/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <openssl/rand.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/grpc_util.h"

namespace psflow::launch {
namespace {

struct Child {
  std::string name;  // "chief", "ps0", "worker1", "evaluator0"
  bool evaluator = false;
  std::string binary;
  std::vector<std::string> args;
  pid_t pid = -1;
  absl::Time restart_at = absl::InfiniteFuture();
  int out = -1;  // read end of its stdout+stderr
  std::string partial;
  bool exited = false;
  int code = 0;
};

void Say(const std::string& line) {
  std::string s = absl::StrCat("[launch] ", line, "\n");
  (void)!::write(STDOUT_FILENO, s.data(), s.size());
}

void EmitLines(Child& c, const char* data, size_t n, bool flush) {
  c.partial.append(data, n);
  size_t start = 0;
  while (true) {
    size_t nl = c.partial.find('\n', start);
    if (nl == std::string::npos) break;
    std::string line = absl::StrCat("[", c.name, "] ", c.partial.substr(start, nl - start), "\n");
    (void)!::write(STDOUT_FILENO, line.data(), line.size());
    start = nl + 1;
  }
  c.partial.erase(0, start);
  if (flush && !c.partial.empty()) {
    std::string line = absl::StrCat("[", c.name, "] ", c.partial, "\n");
    (void)!::write(STDOUT_FILENO, line.data(), line.size());
    c.partial.clear();
  }
}

// Flushes the last partial line of c's output and closes its pipe.
void ClosePipe(Child& c) {
  EmitLines(c, "", 0, true);
  ::close(c.out);
  c.out = -1;
}

// Starts c.binary with c.args, its output on a new pipe c.out. False, with
// errno set, when it cannot.
bool Spawn(Child& c, const sigset_t& old_mask) {
  const std::string& binary = c.binary;
  const std::vector<std::string>& args = c.args;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return false;
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    errno = err;
    return false;
  }
  if (pid == 0) {
    // Own process group: the terminal's Ctrl-C reaches the launcher only,
    // which forwards it once. Die with the launcher, however it ends.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(137);
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(binary.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(binary.c_str(), argv.data());
    std::fprintf(stderr, "cannot run %s: %s\n", binary.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  c.pid = pid;
  c.out = fds[0];
  return true;
}

// The security flags of task `index` of `role` ("chief", "ps", ...): the
// task's own certificate from `tls_dir` where the folder holds one
// (<role>-<index>.crt, as scripts/make-certs.sh issues them: it may then act
// only as itself), else its role's; none when `tls_dir` is empty. And the
// job token in `token_file`.
std::vector<std::string> SecurityArgs(const std::string& tls_dir, const std::string& role,
                                      int index, const std::string& token_file) {
  std::vector<std::string> args;
  if (!tls_dir.empty()) {
    std::string name = absl::StrCat(role, "-", index);
    if (role == "chief" || !std::filesystem::exists(absl::StrCat(tls_dir, "/", name, ".crt")) ||
        !std::filesystem::exists(absl::StrCat(tls_dir, "/", name, ".key"))) {
      name = role;
    }
    args = {
        absl::StrCat("--tls_cert=", tls_dir, "/", name, ".crt"),
        absl::StrCat("--tls_key=", tls_dir, "/", name, ".key"),
        absl::StrCat("--tls_ca=", tls_dir, "/ca.crt"),
    };
  }
  args.push_back(absl::StrCat("--auth_token_file=", token_file));
  return args;
}

}  // namespace

std::string NewJobToken() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) return "";
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

std::string WriteTokenFile(const std::string& path, const std::string& token) {
  // mkstemp makes the file 0600 and new, so no one else can hold it open;
  // rename replaces a link at `path` rather than writing through it.
  std::string temp = absl::StrCat(path, ".XXXXXX");
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) return absl::StrCat("cannot create ", temp, ": ", std::strerror(errno));
  const std::string text = absl::StrCat(token, "\n");
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const int write_errno = errno;
  if (::close(fd) != 0 || !written) {
    ::unlink(temp.c_str());
    return absl::StrCat("cannot write ", temp, ": ", std::strerror(written ? errno : write_errno));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return absl::StrCat("cannot create ", path, ": ", std::strerror(err));
  }
  return "";
}

std::string ParseWorkerDevices(const std::string& flag, int num_workers,
                               std::vector<std::string>* devices, int* replicas) {
  devices->clear();
  *replicas = 1;
  if (flag.empty()) return "";
  std::vector<std::string> entries;
  if (flag.find(';') != std::string::npos) {
    entries = absl::StrSplit(flag, ';');
  } else {
    std::vector<std::string> parts = absl::StrSplit(flag, ',');
    if (parts.size() == 1 || num_workers == 1) {
      entries = {flag};
    } else if (static_cast<int>(parts.size()) == num_workers) {
      entries = parts;  // one device per worker
    } else {
      return absl::StrCat("--worker_devices names ", parts.size(), " devices for ", num_workers,
                          " workers: give one per worker, or separate the workers' device lists "
                          "with ';' (cuda:0,cuda:1;cuda:2,cuda:3)");
    }
  }
  if (entries.size() == 1) entries.resize(num_workers, entries[0]);
  if (static_cast<int>(entries.size()) != num_workers) {
    return absl::StrCat("--worker_devices has ", entries.size(), " device lists for ", num_workers,
                        " workers");
  }
  int count = -1;
  for (const std::string& e : entries) {
    if (e.empty()) return "--worker_devices has an empty device list";
    const std::vector<std::string> list = absl::StrSplit(e, ',');
    const int n = e == "cuda:all" ? 0 : static_cast<int>(list.size());
    if (count >= 0 && n != count) {
      return "--worker_devices: every worker needs as many devices (--replicas_per_worker is one "
             "count for the job)";
    }
    count = n;
  }
  *devices = std::move(entries);
  *replicas = count;
  return "";
}

namespace {

// A signal for the cluster goes to the chief (children_[0]: the chief, or
// worker 0 with its duties) first, which checkpoints before it exits
// (within Timeouts::stop_checkpoint, 5 s); the rest get it once the chief has
// exited, or after this long, so that the ps still answer the checkpoint's
// snapshot.
constexpr absl::Duration kChiefStopWait = absl::Seconds(10);
// Processes still running this long after they were told to terminate are
// killed.
constexpr absl::Duration kKillAfter = absl::Seconds(10);

// One run of the cluster: starts the children, then, until every one has
// exited and its output is drained, forwards their output, signals and
// reaps them, restarts those that failed (when asked) and decides the exit
// code. Single-threaded; the signals arrive through a signalfd.
class ClusterRun {
 public:
  explicit ClusterRun(const LaunchOptions& options) : o_(options) {}
  ~ClusterRun() {
    if (sig_fd_ >= 0) ::close(sig_fd_);
    std::error_code ignored;
    if (!temp_dir_.empty()) std::filesystem::remove_all(temp_dir_, ignored);
  }
  ClusterRun(const ClusterRun&) = delete;
  ClusterRun& operator=(const ClusterRun&) = delete;

  // RunCluster's exit code.
  int Run();

 private:
  // Picks the ports and makes the cluster flags; false (said) without ports.
  bool LayOut();
  // Decides the job token's file (LaunchOptions::token_file), writing a new
  // token where the cluster has none; false (said) when it cannot.
  bool SetUpToken();
  std::string Address(int i) const { return absl::StrCat(o_.host, ":", ports_[i]); }
  // Blocks SIGINT, SIGTERM and SIGHUP, which come through sig_fd_ instead.
  void TakeSignals();
  // Starts every process, children_[0] first: the process whose exit
  // decides (the chief, or worker 0 in a cluster without one). False when
  // one cannot be started.
  bool StartAll();
  bool Start(const std::string& name, const std::string& role, int index,
             const std::vector<std::string>& extra);
  bool StartWorker(int i);
  // --metrics_port of the process with this index (chief 0, ps, workers,
  // evaluators).
  std::vector<std::string> MetricsArgs(int i) const;
  void SayLayout() const;

  // Waits for output or a signal (200 ms at most) and handles what came.
  void Poll();
  void HandleSignal(int sig);
  // Collects the children that exited; each is restarted later or has
  // exited for good.
  void Reap();
  void RestartDue();
  // c has exited with c.code and will not run again: the chief's exit
  // decides the result; another process failing first stops the cluster.
  void ExitedForGood(Child& c);
  bool AllDone() const;
  // The deadlines: the rest after kChiefStopWait, the grace after the chief
  // exited, SIGKILL after kKillAfter.
  void EnforceDeadlines();

  // Sends `sig` to every child still running, and marks the cluster as
  // terminating (no more restarts) if it was not yet.
  void Terminate(int sig);
  void SignalAll(int sig);
  // Sends the stop signal to all but the chief.
  void SignalRest();
  // Stops the cluster as a signal to the launcher does: the chief first (it
  // checkpoints while the ps answer), the rest after it.
  void StopChiefFirst(int sig);
  bool Terminating() const { return terminated_at_ != absl::InfiniteFuture(); }

  const LaunchOptions& o_;
  std::vector<int> ports_;
  std::vector<std::string> ps_hosts_, worker_hosts_, evaluator_hosts_;
  std::vector<std::string> cluster_args_;  // --chief_hosts, --ps_hosts, ...
  std::string token_file_;                 // every process's --auth_token_file
  std::string temp_dir_;                   // holds a token of this run only; removed at the end
  sigset_t old_mask_;                      // the children's signal mask
  int sig_fd_ = -1;
  std::vector<Child> children_;
  int result_ = -1;  // decided exit code
  int restarts_ = 0;
  absl::Time chief_exit_ = absl::InfiniteFuture();
  absl::Time terminated_at_ = absl::InfiniteFuture();
  int stop_signal_ = 0;  // the signal the rest are owed after the chief
  absl::Time chief_signalled_ = absl::InfiniteFuture();
};

int ClusterRun::Run() {
  if (!LayOut() || !SetUpToken()) return 1;
  TakeSignals();
  const bool started = StartAll();
  SayLayout();
  if (!started) {
    result_ = 1;
    Terminate(SIGTERM);
  }
  while (true) {
    Poll();
    Reap();
    RestartDue();
    if (AllDone()) break;
    EnforceDeadlines();
  }
  return result_ < 0 ? 1 : result_;
}

bool ClusterRun::LayOut() {
  const int total = 1 + o_.num_ps + o_.num_workers + o_.num_evaluators;
  ports_ = FreePorts(o_.host, total);
  if (static_cast<int>(ports_.size()) != total) {
    Say(absl::StrCat("cannot find ", total, " free ports on ", o_.host));
    return false;
  }
  for (int i = 0; i < o_.num_ps; ++i) ps_hosts_.push_back(Address(1 + i));
  for (int i = 0; i < o_.num_workers; ++i) worker_hosts_.push_back(Address(1 + o_.num_ps + i));
  for (int i = 0; i < o_.num_evaluators; ++i)
    evaluator_hosts_.push_back(Address(1 + o_.num_ps + o_.num_workers + i));
  cluster_args_ = {
      absl::StrCat("--ps_hosts=", absl::StrJoin(ps_hosts_, ",")),
      absl::StrCat("--worker_hosts=", absl::StrJoin(worker_hosts_, ",")),
  };
  if (o_.with_chief)
    cluster_args_.insert(cluster_args_.begin(), absl::StrCat("--chief_hosts=", Address(0)));
  if (!evaluator_hosts_.empty())
    cluster_args_.push_back(
        absl::StrCat("--evaluator_hosts=", absl::StrJoin(evaluator_hosts_, ",")));
  return true;
}

bool ClusterRun::SetUpToken() {
  if (!o_.tls_dir.empty() && std::filesystem::exists(o_.tls_dir + "/token")) {
    token_file_ = o_.tls_dir + "/token";
    Say(absl::StrCat("job token: ", token_file_, " (--tls_dir)"));
    return true;
  }
  const std::string token = NewJobToken();
  if (token.empty()) {
    Say("cannot generate a job token: the random generator failed");
    return false;
  }
  if (o_.token_file.empty()) {
    std::error_code ec;
    std::string dir = (std::filesystem::temp_directory_path(ec) / "psflow-launch-XXXXXX").string();
    if (ec || ::mkdtemp(dir.data()) == nullptr) {  // mode 0700
      Say(absl::StrCat("cannot make a private directory for the job token (", dir,
                       "): ", ec ? ec.message() : std::strerror(errno)));
      return false;
    }
    temp_dir_ = dir;
    token_file_ = dir + "/token";
  } else {
    token_file_ = std::filesystem::absolute(o_.token_file).string();
  }
  if (const std::string error = WriteTokenFile(token_file_, token); !error.empty()) {
    Say(absl::StrCat("job token: ", error));
    return false;
  }
  Say(absl::StrCat("the cluster runs with a job token generated for it, in ", token_file_,
                   temp_dir_.empty() ? " (kept: --token_file)" : " (removed at exit)",
                   "; calls without it are refused"));
  return true;
}

void ClusterRun::TakeSignals() {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGHUP);
  ::sigprocmask(SIG_BLOCK, &mask, &old_mask_);
  sig_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC);
}

bool ClusterRun::Start(const std::string& name, const std::string& role, int index,
                       const std::vector<std::string>& extra) {
  Child c;
  c.name = name;
  c.args = {absl::StrCat("--job_name=", role), absl::StrCat("--task_id=", index)};
  c.args.insert(c.args.end(), cluster_args_.begin(), cluster_args_.end());
  const std::vector<std::string> security = SecurityArgs(o_.tls_dir, role, index, token_file_);
  c.args.insert(c.args.end(), security.begin(), security.end());
  c.args.insert(c.args.end(), extra.begin(), extra.end());
  c.binary = absl::StrCat(o_.bin_dir, "/psflow-", role);
  c.evaluator = role == "evaluator";
  if (!Spawn(c, old_mask_)) {
    Say(absl::StrCat("cannot start ", name, ": ", std::strerror(errno)));
    return false;
  }
  children_.push_back(std::move(c));
  return true;
}

std::vector<std::string> ClusterRun::MetricsArgs(int i) const {
  if (o_.metrics_base_port <= 0) return {};
  return {absl::StrCat("--metrics_port=", o_.metrics_base_port + i)};
}

bool ClusterRun::StartWorker(int i) {
  std::vector<std::string> extra = MetricsArgs(1 + o_.num_ps + i);
  if (i < static_cast<int>(o_.worker_devices.size()))
    extra.push_back("--device=" + o_.worker_devices[i]);
  extra.insert(extra.end(), o_.trace_args.begin(), o_.trace_args.end());
  extra.insert(extra.end(), o_.worker_args.begin(), o_.worker_args.end());
  // Without a chief, worker 0 takes the chief's arguments.
  if (!o_.with_chief && i == 0)
    extra.insert(extra.end(), o_.chief_args.begin(), o_.chief_args.end());
  return Start(absl::StrCat("worker", i), "worker", i, extra);
}

bool ClusterRun::StartAll() {
  bool started = true;
  if (o_.with_chief) {
    std::vector<std::string> chief_extra = MetricsArgs(0);
    chief_extra.insert(chief_extra.end(), o_.chief_args.begin(), o_.chief_args.end());
    started = Start("chief", "chief", 0, chief_extra);
  } else {
    started = StartWorker(0);
  }
  for (int i = 0; started && i < o_.num_ps; ++i) {
    std::vector<std::string> extra = MetricsArgs(1 + i);
    extra.insert(extra.end(), o_.trace_args.begin(), o_.trace_args.end());
    extra.insert(extra.end(), o_.ps_args.begin(), o_.ps_args.end());
    started = Start(absl::StrCat("ps", i), "ps", i, extra);
  }
  for (int i = o_.with_chief ? 0 : 1; started && i < o_.num_workers; ++i) started = StartWorker(i);
  for (int i = 0; started && i < o_.num_evaluators; ++i) {
    std::vector<std::string> extra = MetricsArgs(1 + o_.num_ps + o_.num_workers + i);
    if (!o_.evaluator_device.empty()) extra.push_back("--device=" + o_.evaluator_device);
    started = Start(absl::StrCat("evaluator", i), "evaluator", i, extra);
  }
  return started;
}

void ClusterRun::SayLayout() const {
  Say(absl::StrCat("cluster: ",
                   o_.with_chief ? absl::StrCat("chief ", Address(0))
                                 : std::string("no chief (worker 0 runs its duties)"),
                   ps_hosts_.empty() ? ", no ps (the workers all-reduce)"
                                     : absl::StrCat(", ps ", absl::StrJoin(ps_hosts_, ",")),
                   ", workers ", absl::StrJoin(worker_hosts_, ","),
                   evaluator_hosts_.empty() ? "" : ", evaluators ",
                   absl::StrJoin(evaluator_hosts_, ",")));
  if (o_.metrics_base_port <= 0) return;
  const int last = o_.num_ps + o_.num_workers + o_.num_evaluators;
  const int first = o_.with_chief ? 0 : 1;
  Say(absl::StrCat("metrics: http://", o_.host, ":", o_.metrics_base_port + first,
                   o_.with_chief   ? "/metrics (chief) to :"
                   : o_.num_ps > 0 ? "/metrics (ps0) to :"
                                   : "/metrics (worker0) to :",
                   o_.metrics_base_port + last, " (",
                   o_.num_evaluators > 0 ? absl::StrCat("evaluator", o_.num_evaluators - 1)
                                         : absl::StrCat("worker", o_.num_workers - 1),
                   ")"));
}

void ClusterRun::Poll() {
  std::vector<pollfd> fds;
  fds.push_back({sig_fd_, POLLIN, 0});
  std::vector<Child*> polled;
  for (Child& c : children_) {
    if (c.out >= 0) {
      fds.push_back({c.out, POLLIN, 0});
      polled.push_back(&c);
    }
  }
  ::poll(fds.data(), fds.size(), 200);
  if (fds[0].revents & POLLIN) {
    signalfd_siginfo info;
    if (::read(sig_fd_, &info, sizeof(info)) == sizeof(info))
      HandleSignal(static_cast<int>(info.ssi_signo));
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Child& c = *polled[i - 1];
    char buf[8192];
    ssize_t n = ::read(c.out, buf, sizeof(buf));
    if (n > 0) {
      EmitLines(c, buf, static_cast<size_t>(n), false);
    } else if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
      ClosePipe(c);
    }
  }
}

void ClusterRun::HandleSignal(int sig) {
  Child& chief = children_[0];
  if (stop_signal_ == 0 && !Terminating() && !chief.exited) {
    Say(absl::StrCat("got signal ", sig, "; forwarding it to ", chief.name,
                     " first (it checkpoints), then to the rest of the cluster"));
    StopChiefFirst(sig == SIGHUP ? SIGTERM : sig);
  } else {
    // A second signal, or one while the cluster stops already: everyone now.
    Say(absl::StrCat("got signal ", sig, "; forwarding it to the cluster"));
    chief_signalled_ = absl::InfiniteFuture();
    Terminate(sig == SIGHUP ? SIGTERM : sig);
  }
}

void ClusterRun::Reap() {
  int status = 0;
  pid_t pid;
  while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
    for (Child& c : children_) {
      if (c.pid != pid) continue;
      c.exited = true;
      c.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      Say(absl::StrCat(c.name, " exited with code ", c.code));
      if (c.code != 0 && o_.restart_on_failure && !Terminating() && stop_signal_ == 0 &&
          restarts_ < o_.max_restarts) {
        c.restart_at = absl::Now() + absl::Seconds(1);
        ++restarts_;
        continue;
      }
      ExitedForGood(c);
    }
  }
}

void ClusterRun::RestartDue() {
  for (Child& c : children_) {
    if (c.restart_at == absl::InfiniteFuture()) continue;
    if (Terminating() || stop_signal_ != 0) {  // stopping: no restarts
      c.restart_at = absl::InfiniteFuture();
      continue;
    }
    if (c.restart_at > absl::Now()) continue;
    c.restart_at = absl::InfiniteFuture();
    if (c.out >= 0) ClosePipe(c);  // the old pipe's last lines
    if (Spawn(c, old_mask_)) {
      c.exited = false;
      Say(absl::StrCat("restarted ", c.name, " (restart ", restarts_, " of at most ",
                       o_.max_restarts, ")"));
    } else {
      Say(absl::StrCat("cannot restart ", c.name, ": ", std::strerror(errno)));
      // Its last exit is final, as if it had not been restartable.
      ExitedForGood(c);
    }
  }
}

void ClusterRun::ExitedForGood(Child& c) {
  if (&c == &children_[0]) {
    if (result_ < 0) result_ = c.code;
    chief_exit_ = absl::Now();
    if (chief_signalled_ != absl::InfiniteFuture()) {
      // Stopped by a signal, its checkpoint written (or given up): now the rest.
      SignalRest();
      return;
    }
    // A chief that failed releases nobody: stop the rest now rather than
    // after the grace period meant for a job that ended well.
    if (c.code != 0 && !Terminating()) {
      Say(o_.with_chief ? "the chief failed; stopping the cluster"
                        : "worker0 (the chief's duties) failed; stopping the cluster");
      Terminate(SIGTERM);
    }
  } else if (c.evaluator) {
    // Training goes on without it.
    if (c.code != 0 && !Terminating())
      Say(absl::StrCat(c.name, " failed; training goes on without it"));
  } else if (c.code != 0 && result_ < 0 && !Terminating() && stop_signal_ == 0) {
    result_ = c.code;
    if (children_[0].exited) {
      Say(absl::StrCat(c.name, " failed; stopping the cluster"));
      Terminate(SIGTERM);
    } else {
      // (Also a member that a signal from elsewhere stopped, as when the
      // whole cluster is told to stop: the chief's checkpoint then finds
      // the ps still serving.)
      Say(absl::StrCat(c.name, " failed; stopping the cluster, ", children_[0].name,
                       " first (it checkpoints)"));
      StopChiefFirst(SIGTERM);
    }
  }
}

bool ClusterRun::AllDone() const {
  bool all_exited = true, all_closed = true;
  for (const Child& c : children_) {
    all_exited &= c.exited && c.restart_at == absl::InfiniteFuture();
    all_closed &= c.out < 0;
  }
  return all_exited && all_closed;
}

void ClusterRun::EnforceDeadlines() {
  const absl::Time now = absl::Now();
  if (now - chief_signalled_ > kChiefStopWait) {
    Say(absl::StrCat(children_[0].name, " still running ", absl::ToInt64Seconds(kChiefStopWait),
                     " s after the signal; forwarding it to the rest of the cluster"));
    SignalRest();
  }
  if (now - chief_exit_ > absl::Seconds(o_.grace_seconds) && !Terminating()) {
    Say("processes still running after the chief exited; terminating them");
    Terminate(SIGTERM);
  }
  if (now - terminated_at_ > kKillAfter) SignalAll(SIGKILL);
}

void ClusterRun::SignalAll(int sig) {
  for (Child& c : children_) {
    if (!c.exited) ::kill(c.pid, sig);
  }
}

void ClusterRun::Terminate(int sig) {
  SignalAll(sig);
  if (!Terminating()) terminated_at_ = absl::Now();
}

void ClusterRun::SignalRest() {
  for (size_t i = 1; i < children_.size(); ++i) {
    if (!children_[i].exited) ::kill(children_[i].pid, stop_signal_);
  }
  chief_signalled_ = absl::InfiniteFuture();
  if (!Terminating()) terminated_at_ = absl::Now();
}

void ClusterRun::StopChiefFirst(int sig) {
  stop_signal_ = sig;
  ::kill(children_[0].pid, sig);
  chief_signalled_ = absl::Now();
}

}  // namespace

int RunCluster(const LaunchOptions& o) { return ClusterRun(o).Run(); }

}  // namespace psflow::launch
