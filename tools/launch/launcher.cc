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
#include <cstring>
#include <filesystem>

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

// The security flags of a process of `role` ("chief", "ps", ...) for
// `tls_dir` (none when it is empty).
std::vector<std::string> SecurityArgs(const std::string& tls_dir, const std::string& role) {
  if (tls_dir.empty()) return {};
  std::vector<std::string> args = {
      absl::StrCat("--tls_cert=", tls_dir, "/", role, ".crt"),
      absl::StrCat("--tls_key=", tls_dir, "/", role, ".key"),
      absl::StrCat("--tls_ca=", tls_dir, "/ca.crt"),
  };
  const std::string token = absl::StrCat(tls_dir, "/token");
  if (std::filesystem::exists(token)) args.push_back(absl::StrCat("--auth_token_file=", token));
  return args;
}

}  // namespace

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

int RunCluster(const LaunchOptions& o) {
  const int total = 1 + o.num_ps + o.num_workers + o.num_evaluators;
  std::vector<int> ports = FreePorts(o.host, total);
  if (static_cast<int>(ports.size()) != total) {
    Say(absl::StrCat("cannot find ", total, " free ports on ", o.host));
    return 1;
  }
  auto addr = [&](int i) { return absl::StrCat(o.host, ":", ports[i]); };
  std::vector<std::string> ps_hosts, worker_hosts, evaluator_hosts;
  for (int i = 0; i < o.num_ps; ++i) ps_hosts.push_back(addr(1 + i));
  for (int i = 0; i < o.num_workers; ++i) worker_hosts.push_back(addr(1 + o.num_ps + i));
  for (int i = 0; i < o.num_evaluators; ++i)
    evaluator_hosts.push_back(addr(1 + o.num_ps + o.num_workers + i));
  std::vector<std::string> cluster = {
      absl::StrCat("--ps_hosts=", absl::StrJoin(ps_hosts, ",")),
      absl::StrCat("--worker_hosts=", absl::StrJoin(worker_hosts, ",")),
  };
  if (o.with_chief) cluster.insert(cluster.begin(), absl::StrCat("--chief_hosts=", addr(0)));
  if (!evaluator_hosts.empty())
    cluster.push_back(absl::StrCat("--evaluator_hosts=", absl::StrJoin(evaluator_hosts, ",")));

  sigset_t mask, old_mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGHUP);
  ::sigprocmask(SIG_BLOCK, &mask, &old_mask);
  int sig_fd = ::signalfd(-1, &mask, SFD_CLOEXEC);

  std::vector<Child> children;
  auto start = [&](const std::string& name, const std::string& role, int index,
                   const std::vector<std::string>& extra) {
    Child c;
    c.name = name;
    c.args = {absl::StrCat("--job_name=", role), absl::StrCat("--task_id=", index)};
    c.args.insert(c.args.end(), cluster.begin(), cluster.end());
    const std::vector<std::string> security = SecurityArgs(o.tls_dir, role);
    c.args.insert(c.args.end(), security.begin(), security.end());
    c.args.insert(c.args.end(), extra.begin(), extra.end());
    c.binary = absl::StrCat(o.bin_dir, "/psflow-", role);
    c.evaluator = role == "evaluator";
    if (!Spawn(c, old_mask)) {
      Say(absl::StrCat("cannot start ", name, ": ", std::strerror(errno)));
      return false;
    }
    children.push_back(std::move(c));
    return true;
  };
  // --metrics_port of the process with this index (chief 0, ps, workers,
  // evaluators).
  auto metrics = [&](int i) -> std::vector<std::string> {
    if (o.metrics_base_port <= 0) return {};
    return {absl::StrCat("--metrics_port=", o.metrics_base_port + i)};
  };
  // children[0] is the process whose exit decides: the chief, or worker 0
  // in a cluster without one (it takes the chief's arguments).
  auto start_worker = [&](int i) {
    std::vector<std::string> extra = metrics(1 + o.num_ps + i);
    if (i < static_cast<int>(o.worker_devices.size()))
      extra.push_back("--device=" + o.worker_devices[i]);
    extra.insert(extra.end(), o.trace_args.begin(), o.trace_args.end());
    extra.insert(extra.end(), o.worker_args.begin(), o.worker_args.end());
    if (!o.with_chief && i == 0)
      extra.insert(extra.end(), o.chief_args.begin(), o.chief_args.end());
    return start(absl::StrCat("worker", i), "worker", i, extra);
  };
  bool started = true;
  if (o.with_chief) {
    std::vector<std::string> chief_extra = metrics(0);
    chief_extra.insert(chief_extra.end(), o.chief_args.begin(), o.chief_args.end());
    started = start("chief", "chief", 0, chief_extra);
  } else {
    started = start_worker(0);
  }
  for (int i = 0; started && i < o.num_ps; ++i) {
    std::vector<std::string> extra = metrics(1 + i);
    extra.insert(extra.end(), o.trace_args.begin(), o.trace_args.end());
    extra.insert(extra.end(), o.ps_args.begin(), o.ps_args.end());
    started = start(absl::StrCat("ps", i), "ps", i, extra);
  }
  for (int i = o.with_chief ? 0 : 1; started && i < o.num_workers; ++i) started = start_worker(i);
  for (int i = 0; started && i < o.num_evaluators; ++i) {
    std::vector<std::string> extra = metrics(1 + o.num_ps + o.num_workers + i);
    if (!o.evaluator_device.empty()) extra.push_back("--device=" + o.evaluator_device);
    started = start(absl::StrCat("evaluator", i), "evaluator", i, extra);
  }
  Say(absl::StrCat("cluster: ",
                   o.with_chief ? absl::StrCat("chief ", addr(0))
                                : std::string("no chief (worker 0 runs its duties)"),
                   ps_hosts.empty() ? ", no ps (the workers all-reduce)"
                                    : absl::StrCat(", ps ", absl::StrJoin(ps_hosts, ",")),
                   ", workers ", absl::StrJoin(worker_hosts, ","),
                   evaluator_hosts.empty() ? "" : ", evaluators ",
                   absl::StrJoin(evaluator_hosts, ",")));
  if (o.metrics_base_port > 0) {
    const int last = o.num_ps + o.num_workers + o.num_evaluators;
    const int first = o.with_chief ? 0 : 1;
    Say(absl::StrCat("metrics: http://", o.host, ":", o.metrics_base_port + first,
                     o.with_chief   ? "/metrics (chief) to :"
                     : o.num_ps > 0 ? "/metrics (ps0) to :"
                                    : "/metrics (worker0) to :",
                     o.metrics_base_port + last, " (",
                     o.num_evaluators > 0 ? absl::StrCat("evaluator", o.num_evaluators - 1)
                                          : absl::StrCat("worker", o.num_workers - 1),
                     ")"));
  }

  auto signal_all = [&](int sig) {
    for (Child& c : children) {
      if (!c.exited) ::kill(c.pid, sig);
    }
  };
  int result = -1;  // decided exit code
  int restarts = 0;
  absl::Time chief_exit = absl::InfiniteFuture();
  absl::Time terminated_at = absl::InfiniteFuture();
  // A signal for the cluster goes to the chief (children[0]: the chief, or
  // worker 0 with its duties) first, which checkpoints before it exits
  // (within Timeouts::stop_checkpoint, 5 s); the rest get it once the chief
  // has exited, or after kChiefStopWait, so that the ps still answer the
  // checkpoint's snapshot. `stop_signal`: the signal they are owed.
  constexpr absl::Duration kChiefStopWait = absl::Seconds(10);
  int stop_signal = 0;
  absl::Time chief_signalled = absl::InfiniteFuture();
  auto signal_rest = [&] {
    for (size_t i = 1; i < children.size(); ++i) {
      if (!children[i].exited) ::kill(children[i].pid, stop_signal);
    }
    chief_signalled = absl::InfiniteFuture();
    if (terminated_at == absl::InfiniteFuture()) terminated_at = absl::Now();
  };
  // Stops the cluster as a signal to the launcher does: the chief first
  // (it checkpoints while the ps answer), the rest after it.
  auto stop_chief_first = [&](int sig) {
    stop_signal = sig;
    ::kill(children[0].pid, sig);
    chief_signalled = absl::Now();
  };
  if (!started) {
    result = 1;
    signal_all(SIGTERM);
    terminated_at = absl::Now();
  }
  // c has exited with c.code and will not run again: the chief's exit decides
  // the result; another process failing first stops the cluster.
  auto exited_for_good = [&](Child& c) {
    if (&c == &children[0]) {
      if (result < 0) result = c.code;
      chief_exit = absl::Now();
      if (chief_signalled != absl::InfiniteFuture()) {
        // Stopped by a signal, its checkpoint written (or given up): now the rest.
        signal_rest();
        return;
      }
      // A chief that failed releases nobody: stop the rest now rather than
      // after the grace period meant for a job that ended well.
      if (c.code != 0 && terminated_at == absl::InfiniteFuture()) {
        Say(o.with_chief ? "the chief failed; stopping the cluster"
                         : "worker0 (the chief's duties) failed; stopping the cluster");
        signal_all(SIGTERM);
        terminated_at = absl::Now();
      }
    } else if (c.evaluator) {
      // Training goes on without it.
      if (c.code != 0 && terminated_at == absl::InfiniteFuture())
        Say(absl::StrCat(c.name, " failed; training goes on without it"));
    } else if (c.code != 0 && result < 0 && terminated_at == absl::InfiniteFuture() &&
               stop_signal == 0) {
      result = c.code;
      if (children[0].exited) {
        Say(absl::StrCat(c.name, " failed; stopping the cluster"));
        signal_all(SIGTERM);
        terminated_at = absl::Now();
      } else {
        // (Also a member that a signal from elsewhere stopped, as when the
        // whole cluster is told to stop: the chief's checkpoint then finds
        // the ps still serving.)
        Say(absl::StrCat(c.name, " failed; stopping the cluster, ", children[0].name,
                         " first (it checkpoints)"));
        stop_chief_first(SIGTERM);
      }
    }
  };

  while (true) {
    std::vector<pollfd> fds;
    fds.push_back({sig_fd, POLLIN, 0});
    std::vector<Child*> polled;
    for (Child& c : children) {
      if (c.out >= 0) {
        fds.push_back({c.out, POLLIN, 0});
        polled.push_back(&c);
      }
    }
    ::poll(fds.data(), fds.size(), 200);
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info;
      if (::read(sig_fd, &info, sizeof(info)) == sizeof(info)) {
        const int sig = static_cast<int>(info.ssi_signo);
        Child& chief = children[0];
        if (stop_signal == 0 && terminated_at == absl::InfiniteFuture() && !chief.exited) {
          Say(absl::StrCat("got signal ", sig, "; forwarding it to ", chief.name,
                           " first (it checkpoints), then to the rest of the cluster"));
          stop_chief_first(sig == SIGHUP ? SIGTERM : sig);
        } else {
          // A second signal, or one while the cluster stops already: everyone now.
          Say(absl::StrCat("got signal ", sig, "; forwarding it to the cluster"));
          signal_all(sig == SIGHUP ? SIGTERM : sig);
          chief_signalled = absl::InfiniteFuture();
          if (terminated_at == absl::InfiniteFuture()) terminated_at = absl::Now();
        }
      }
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
    // Reap.
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (Child& c : children) {
        if (c.pid != pid) continue;
        c.exited = true;
        c.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        Say(absl::StrCat(c.name, " exited with code ", c.code));
        if (c.code != 0 && o.restart_on_failure && terminated_at == absl::InfiniteFuture() &&
            stop_signal == 0 && restarts < o.max_restarts) {
          c.restart_at = absl::Now() + absl::Seconds(1);
          ++restarts;
          continue;
        }
        exited_for_good(c);
      }
    }
    for (Child& c : children) {
      if (c.restart_at == absl::InfiniteFuture()) continue;
      if (terminated_at != absl::InfiniteFuture() || stop_signal != 0) {  // stopping: no restarts
        c.restart_at = absl::InfiniteFuture();
        continue;
      }
      if (c.restart_at > absl::Now()) continue;
      c.restart_at = absl::InfiniteFuture();
      if (c.out >= 0) ClosePipe(c);  // the old pipe's last lines
      if (Spawn(c, old_mask)) {
        c.exited = false;
        Say(absl::StrCat("restarted ", c.name, " (restart ", restarts, " of at most ",
                         o.max_restarts, ")"));
      } else {
        Say(absl::StrCat("cannot restart ", c.name, ": ", std::strerror(errno)));
        // Its last exit is final, as if it had not been restartable.
        exited_for_good(c);
      }
    }
    bool all_exited = true, all_closed = true;
    for (const Child& c : children) {
      all_exited &= c.exited && c.restart_at == absl::InfiniteFuture();
      all_closed &= c.out < 0;
    }
    if (all_exited && all_closed) break;
    const absl::Time now = absl::Now();
    if (now - chief_signalled > kChiefStopWait) {
      Say(absl::StrCat(children[0].name, " still running ", absl::ToInt64Seconds(kChiefStopWait),
                       " s after the signal; forwarding it to the rest of the cluster"));
      signal_rest();
    }
    if (now - chief_exit > absl::Seconds(o.grace_seconds) &&
        terminated_at == absl::InfiniteFuture()) {
      Say("processes still running after the chief exited; terminating them");
      signal_all(SIGTERM);
      terminated_at = now;
    }
    if (now - terminated_at > absl::Seconds(10)) signal_all(SIGKILL);
  }
  ::close(sig_fd);
  return result < 0 ? 1 : result;
}

}  // namespace psflow::launch
