#include "tests/integration/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"

extern char** environ;

namespace psflow::itest {
namespace {

bool IsUnsetVariable(const char* entry) {
  for (const char* name : {"TF_CONFIG=", "CLUSTER_CONFIG=", "POD_NAME="}) {
    if (std::strncmp(entry, name, std::strlen(name)) == 0) return true;
  }
  return false;
}

}  // namespace

Process::Process(const std::string& binary, const std::vector<std::string>& args,
                 const std::map<std::string, std::string>& env)
    : start_(Clock::now()) {
  command_ = binary;
  for (const std::string& a : args) command_ += " " + a;
  for (const auto& [name, value] : env) command_ = name + "='" + value + "' " + command_;

  // Everything the child needs is prepared before fork(): between fork and
  // exec only async-signal-safe calls are allowed (this process has threads).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (IsUnsetVariable(*e) || env.count(name) > 0) continue;
    env_strings.push_back(entry);
  }
  for (const auto& [name, value] : env) env_strings.push_back(name + "=" + value);
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings = {binary};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    all_ = err_ = std::string("pipe2: ") + std::strerror(errno);
    exit_code_ = 127;
    end_ = Clock::now();
    return;
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(137);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    const char msg[] = "exec failed\n";
    (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  out_fd_ = out[0];
  err_fd_ = err[0];
  if (pid < 0) {
    all_ = err_ = std::string("fork: ") + std::strerror(errno);
    exit_code_ = 127;
    end_ = Clock::now();
    ::close(out_fd_);
    ::close(err_fd_);
    out_fd_ = err_fd_ = -1;
    return;
  }
  ::setpgid(pid, pid);  // also here, so that the group exists before any kill(-pid)
  pid_ = pid;
  reader_ = std::thread([this] { ReadLoop(); });
}

Process::~Process() {
  if (pid_ > 0 && exit_code_ < 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    Reap(true);
  }
  FinishOutput();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Process::ReadLoop() {
  enum ReadResult { kData, kAgain, kEnd };
  bool out_open = true, err_open = true;
  auto read_one = [this](int fd, std::string* sink) {
    char buf[8192];
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return kAgain;
    if (n <= 0) return kEnd;
    std::lock_guard<std::mutex> lock(mu_);
    sink->append(buf, static_cast<size_t>(n));
    all_.append(buf, static_cast<size_t>(n));
    return kData;
  };
  while (out_open || err_open) {
    pollfd fds[3] = {{out_open ? out_fd_ : -1, POLLIN, 0},
                     {err_open ? err_fd_ : -1, POLLIN, 0},
                     {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 3, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents != 0) out_open = read_one(out_fd_, &out_) != kEnd;
    if (fds[1].revents != 0) err_open = read_one(err_fd_, &err_) != kEnd;
    if (fds[2].revents != 0) {
      // Told to stop (a grandchild may hold the pipes open): take what is
      // buffered without blocking, then stop.
      for (int fd : {out_fd_, err_fd_}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      while (out_open && read_one(out_fd_, &out_) == kData) {
      }
      while (err_open && read_one(err_fd_, &err_) == kData) {
      }
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  eof_ = true;
  eof_cv_.notify_all();
}

void Process::FinishOutput() {
  if (!reader_.joinable()) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    eof_cv_.wait_for(lock, seconds(2), [this] { return eof_; });
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  reader_.join();
  ::close(out_fd_);
  ::close(err_fd_);
  out_fd_ = err_fd_ = -1;
}

bool Process::Reap(bool block) {
  if (exit_code_ >= 0) return true;
  if (pid_ <= 0) return true;
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r != pid_) return false;
  end_ = Clock::now();
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  FinishOutput();
  return true;
}

bool Process::running() { return !Reap(false); }

bool Process::WaitFor(milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (true) {
    if (Reap(false)) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
}

int Process::WaitOrKill(milliseconds timeout) {
  if (!WaitFor(timeout)) {
    timed_out_ = true;
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    Reap(true);
  }
  return exit_code_;
}

bool Process::WaitForOutput(const std::string& text, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (all_.find(text) != std::string::npos) return true;
    }
    if (!running() || Clock::now() >= deadline) {
      std::lock_guard<std::mutex> lock(mu_);
      return all_.find(text) != std::string::npos;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
}

void Process::Signal(int sig) {
  if (pid_ > 0 && exit_code_ < 0) ::kill(pid_, sig);
}

double Process::elapsed_seconds() const {
  const Clock::time_point end = exit_code_ >= 0 ? end_ : Clock::now();
  return std::chrono::duration<double>(end - start_).count();
}

std::string Process::output() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_;
}

std::string Process::stdout_text() const {
  std::lock_guard<std::mutex> lock(mu_);
  return out_;
}

std::string Process::stderr_text() const {
  std::lock_guard<std::mutex> lock(mu_);
  return err_;
}

std::string Process::Describe() const {
  std::ostringstream s;
  s << "command: " << command_ << "\nexit code: " << exit_code_
    << (timed_out_ ? " (killed: timed out)" : "") << " after " << elapsed_seconds()
    << " s\n----- output -----\n"
    << output() << "\n----- end of output -----";
  return s.str();
}

RunResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                     const std::map<std::string, std::string>& env, milliseconds timeout) {
  Process p(binary, args, env);
  RunResult r;
  r.exit_code = p.WaitOrKill(timeout);
  r.timed_out = p.timed_out();
  r.seconds = p.elapsed_seconds();
  r.output = p.output();
  r.out = p.stdout_text();
  r.err = p.stderr_text();
  r.description = p.Describe();
  return r;
}

std::vector<int> FreePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    fds.push_back(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = 0;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      break;
    }
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

namespace {

// Pids of the live processes other than this one whose command line
// (arguments separated by NULs) `match` accepts.
std::vector<pid_t> FindByCommandLine(const std::function<bool(const std::string&)>& match) {
  std::vector<pid_t> found;
  const pid_t self = ::getpid();
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    if (pid == self) continue;
    std::ifstream in(it->path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.empty()) continue;  // a zombie or a kernel thread
    if (match(cmdline)) found.push_back(pid);
  }
  return found;
}

}  // namespace

std::vector<pid_t> FindProcesses(const std::string& text) {
  return FindByCommandLine([&text](std::string cmdline) {
    for (char& c : cmdline) {
      if (c == '\0') c = ' ';
    }
    return cmdline.find(text) != std::string::npos;
  });
}

std::vector<pid_t> FindMember(const std::string& chief, const std::string& role, int index) {
  const std::vector<std::string> wanted = {"--chief_hosts=" + chief, "--job_name=" + role,
                                           "--task_id=" + std::to_string(index)};
  return FindByCommandLine([&wanted](const std::string& cmdline) {
    // Whole arguments: --task_id=1 is not --task_id=10.
    const std::string args = std::string(1, '\0') + cmdline;
    for (const std::string& w : wanted) {
      if (args.find(std::string(1, '\0') + w + std::string(1, '\0')) == std::string::npos)
        return false;
    }
    return true;
  });
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string LaunchChiefAddress(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m,
                         std::regex(R"(\[launch\] cluster: chief (127\.0\.0\.1:[0-9]+),)")))
    return "";
  return m[1].str();
}

std::string EvalAccuracyText(const std::string& eval_stdout) {
  std::smatch m;
  if (!std::regex_search(eval_stdout, m, std::regex(R"((^|\n)accuracy: ([0-9.]+)\n)"))) return "";
  return m[2].str();
}

RunResult RunEval(const std::string& model_dir, const std::vector<std::string>& flags,
                  milliseconds timeout) {
  std::vector<std::string> args = {"--saved_model=" + model_dir + "/saved_model"};
  args.insert(args.end(), flags.begin(), flags.end());
  return RunProcess(Bin("psflow-eval"), args, {}, timeout);
}

std::string SavedModelFigures(const std::string& model_dir) {
  RunResult eval = RunEval(model_dir);
  std::smatch m;
  if (eval.exit_code != 0 ||
      !std::regex_search(eval.out, m, std::regex(R"(accuracy: ([0-9.]+)\nloss: ([0-9.]+)\n)"))) {
    ADD_FAILURE() << eval.description;
    return "";
  }
  return m[1].str() + " " + m[2].str();
}

void TempDirTest::SetUp() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  dir_ = (std::filesystem::path(::testing::TempDir()) /
          ("psflow_" + std::string(info->name()) + "_" + std::to_string(::getpid())))
             .string();
  std::filesystem::remove_all(dir_);
  std::filesystem::create_directories(dir_);
}

void TempDirTest::TearDown() {
  if (HasFailure()) {
    std::printf("(kept %s)\n", dir_.c_str());
  } else {
    std::filesystem::remove_all(dir_);
  }
}

std::vector<std::string> TempDirTest::HandStartedMlpArgs(int64_t steps) const {
  return {"--model=mlp",
          "--compute_threads=1",
          "--train_steps=" + std::to_string(steps),
          "--optimizer=adam",
          "--learning_rate=0.001",
          "--log_every_steps=100",
          "--checkpoint_every_steps=100",
          "--model_dir=" + dir_ + "/model"};
}

void ExpectNoProcessesLeft(const std::string& text) {
  std::vector<pid_t> left;
  for (int i = 0; i < 300; ++i) {
    left = FindProcesses(text);
    if (left.empty()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string pids;
  for (pid_t pid : left) {
    pids += " " + std::to_string(pid);
    ::kill(pid, SIGKILL);
  }
  ADD_FAILURE() << left.size() << " process(es) with '" << text
                << "' in their command line remain:" << pids;
}

void ExpectIdenticalReplicas(const std::string& output, int workers) {
  std::map<std::string, std::string> digests;  // by worker
  const std::regex line(R"((worker[0-9]+)\] replica at step [0-9]+: crc32c ([0-9a-f]{8}))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    digests[(*it)[1].str()] = (*it)[2].str();
  }
  ASSERT_EQ(digests.size(), static_cast<size_t>(workers)) << output;
  std::set<std::string> distinct;
  for (const auto& [worker, crc] : digests) distinct.insert(crc);
  EXPECT_EQ(distinct.size(), 1u) << "the replicas differ:\n" << output;
}

void ExpectStoppedWorkersResume(const std::function<std::unique_ptr<Process>(int)>& start,
                                const std::string& at, int64_t min_step, int64_t steps) {
  std::unique_ptr<Process> w0 = start(0), w1 = start(1);
  ASSERT_TRUE(w0->WaitForOutput(at, seconds(120))) << w0->Describe();
  w0->Signal(SIGTERM);
  w1->Signal(SIGTERM);
  EXPECT_EQ(w0->WaitOrKill(seconds(30)), 143) << w0->Describe();
  EXPECT_EQ(w1->WaitOrKill(seconds(30)), 143) << w1->Describe();
  std::smatch m;
  const std::string first = w0->output();
  ASSERT_TRUE(std::regex_search(first, m, std::regex(R"(checkpoint of step ([0-9]+) written)")))
      << first;
  const std::string step = m[1].str();
  EXPECT_GE(std::stoll(step), min_step);
  std::unique_ptr<Process> r0 = start(0), r1 = start(1);
  EXPECT_EQ(r0->WaitOrKill(seconds(240)), 0) << r0->Describe();
  EXPECT_EQ(r1->WaitOrKill(seconds(60)), 0) << r1->Describe();
  EXPECT_NE(r0->output().find("restoring from the checkpoint of step " + step), std::string::npos)
      << r0->output();
  EXPECT_NE(r0->output().find("done: " + std::to_string(steps) + " steps"), std::string::npos)
      << r0->output();
  ExpectIdenticalReplicas(r0->output() + r1->output(), 2);
}

}  // namespace psflow::itest
