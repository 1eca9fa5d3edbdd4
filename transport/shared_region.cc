#include "transport/shared_region.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace psflow {
namespace {

// The name every region's memory file has; /proc shows its descriptor as a
// link to "/memfd:<name> (deleted)".
constexpr char kMemfdName[] = "psflow-region";
constexpr char kLinkPrefix[] = "/memfd:psflow-region";

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

absl::Status SharedMemoryRefusal(const std::string& why) {
  return absl::FailedPreconditionError(absl::StrCat(kSharedMemoryRefused, ": ", why));
}

bool IsSharedMemoryRefusal(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) &&
         absl::StartsWith(status.message(), absl::StrCat(kSharedMemoryRefused, ":"));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(int64_t bytes) {
  if (bytes <= 0 || bytes > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a shared region of ", bytes, " bytes"));
  }
  const int fd = ::memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::UnavailableError(Errno("memfd_create"));
  const size_t length = static_cast<size_t>(kRegionHeaderBytes + bytes);
  if (::ftruncate(fd, static_cast<off_t>(length)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const std::string why = Errno("sizing the region");
    ::close(fd);
    return absl::ResourceExhaustedError(why);
  }
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const std::string why = Errno("mmap");
    ::close(fd);
    return absl::ResourceExhaustedError(why);
  }
  char token[kRegionTokenBytes];
  if (::getrandom(token, sizeof(token), 0) != static_cast<ssize_t>(sizeof(token))) {
    const std::string why = Errno("getrandom");
    ::munmap(base, length);
    ::close(fd);
    return absl::UnavailableError(why);
  }
  std::memcpy(base, token, sizeof(token));
  SharedRegionRef ref;
  ref.set_pid(static_cast<int32_t>(::getpid()));
  ref.set_fd(fd);
  ref.set_bytes(bytes);
  ref.set_token(token, sizeof(token));
  return std::unique_ptr<SharedRegion>(
      new SharedRegion(fd, static_cast<char*>(base), bytes, std::move(ref)));
}

SharedRegion::~SharedRegion() {
  if (unpin_ != nullptr) unpin_(base_ + kRegionHeaderBytes);
  ::munmap(base_, static_cast<size_t>(kRegionHeaderBytes + bytes_));
  ::close(fd_);
}

bool SharedRegion::Pin(const std::function<bool(void*, size_t)>& pin,
                       std::function<void(void*)> unpin) {
  if (!pin(data().data, static_cast<size_t>(data().size))) return false;
  unpin_ = std::move(unpin);
  return true;
}

SharedRegionPool::Lease& SharedRegionPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = other.pool_;
    region_ = std::move(other.region_);
    other.pool_ = nullptr;
  }
  return *this;
}

void SharedRegionPool::Lease::reset() {
  if (region_ != nullptr) pool_->Return(std::move(region_));
  pool_ = nullptr;
}

void SharedRegionPool::Lease::Discard() {
  if (region_ != nullptr) pool_->Drop(std::move(region_));
  pool_ = nullptr;
}

void SharedRegionPool::SetPinning(std::function<bool(void*, size_t)> pin,
                                  std::function<void(void*)> unpin) {
  absl::MutexLock lock(&mu_);
  pin_ = std::move(pin);
  unpin_ = std::move(unpin);
}

SharedRegionPool::Lease SharedRegionPool::Acquire(int64_t bytes) {
  Lease lease = Take(bytes);
  if (!lease || lease.region_->pin_tried_) return lease;
  std::function<bool(void*, size_t)> pin;
  std::function<void(void*)> unpin;
  {
    absl::MutexLock lock(&mu_);
    pin = pin_;
    unpin = unpin_;
  }
  if (pin == nullptr) return lease;
  // Outside the pool's lock: registering takes a while, and the region is
  // this lease's alone.
  lease.region_->pin_tried_ = true;
  lease.region_->Pin(pin, std::move(unpin));
  return lease;
}

SharedRegionPool::Lease SharedRegionPool::Take(int64_t bytes) {
  Lease lease;
  const int64_t want = std::max<int64_t>(1, (bytes + kQuantum - 1) / kQuantum) * kQuantum;
  absl::MutexLock lock(&mu_);
  if (absl::Now() < retry_at_) return lease;
  // The smallest free region that fits.
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const int64_t size = (*it)->data().size;
    if (size >= bytes && (best == free_.end() || size < (*best)->data().size)) best = it;
  }
  if (best != free_.end()) {
    lease.pool_ = this;
    lease.region_ = std::move(*best);
    free_.erase(best);
    return lease;
  }
  // A new one, dropping free regions (too small for this call) for room,
  // but only if that makes enough.
  int64_t free_bytes = 0;
  for (const std::unique_ptr<SharedRegion>& r : free_) free_bytes += r->data().size;
  if (total_ - free_bytes + want > max_bytes_) return lease;
  while (total_ + want > max_bytes_) {
    total_ -= free_.back()->data().size;
    free_.pop_back();
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(want);
  if (!made.ok()) {
    retry_at_ = absl::Now() + kRetryAfter;
    return lease;
  }
  total_ += want;
  lease.pool_ = this;
  lease.region_ = *std::move(made);
  return lease;
}

int64_t SharedRegionPool::total_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

void SharedRegionPool::Return(std::unique_ptr<SharedRegion> region) {
  absl::MutexLock lock(&mu_);
  free_.push_back(std::move(region));
}

void SharedRegionPool::Drop(std::unique_ptr<SharedRegion> region) {
  absl::MutexLock lock(&mu_);
  total_ -= region->data().size;
}

SharedMapping::~SharedMapping() { ::munmap(base, length); }

namespace {

// Opens and maps the region `ref` names, checking all it must be (see
// SharedRegionMap::Attach).
absl::StatusOr<std::shared_ptr<const SharedMapping>> MapRegion(const SharedRegionRef& ref) {
  // The worker's descriptor, opened with O_PATH: that opens nothing (no
  // device's open, no FIFO's wait), and the file it names can no longer be
  // swapped. Only a sealed psflow region is then opened for real, through
  // this process's own descriptor.
  const std::string path = absl::StrCat("/proc/", ref.pid(), "/fd/", ref.fd());
  const int handle = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (handle < 0) return SharedMemoryRefusal(Errno(path.c_str()));
  const std::string own = absl::StrCat("/proc/self/fd/", handle);
  const int64_t length = kRegionHeaderBytes + ref.bytes();
  const std::string not_region = absl::StrCat(path, " is not a psflow region");
  char link[256];
  const ssize_t n = ::readlink(own.c_str(), link, sizeof(link) - 1);
  struct stat st {};
  struct statfs fs {};
  if (n < 0 || !absl::StartsWith(absl::string_view(link, static_cast<size_t>(n)), kLinkPrefix) ||
      ::fstat(handle, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 0 ||
      ::fstatfs(handle, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    ::close(handle);
    return SharedMemoryRefusal(not_region);
  }
  if (st.st_size != length) {
    ::close(handle);
    return SharedMemoryRefusal(absl::StrCat(path, " is not a region of ", ref.bytes(), " bytes"));
  }
  const int fd = ::open(own.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  ::close(handle);
  if (fd < 0) return SharedMemoryRefusal(Errno(path.c_str()));
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    ::close(fd);
    return SharedMemoryRefusal(absl::StrCat(path, " is not sealed at its size"));
  }
  // The file was checked through the handle; this descriptor is the same
  // file, sealed, so its size cannot have changed since.
  void* base =
      ::mmap(nullptr, static_cast<size_t>(length), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return SharedMemoryRefusal(Errno("mmap"));
  auto mapping =
      std::make_shared<const SharedMapping>(static_cast<char*>(base), static_cast<size_t>(length));
  if (std::memcmp(base, ref.token().data(), kRegionTokenBytes) != 0) {
    return SharedMemoryRefusal(absl::StrCat(path, " holds another token"));
  }
  return mapping;
}

}  // namespace

SharedRegionMap::SharedRegionMap(const Limits& limits) : limits_(limits) {
  if (limits_.sweep_every < absl::InfiniteDuration()) {
    sweeper_ = std::thread([this] { SweepEvery(limits_.sweep_every); });
  }
}

SharedRegionMap::~SharedRegionMap() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
}

void SharedRegionMap::SweepEvery(absl::Duration period) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), period)) return;
    }
    Sweep(absl::Now());
  }
}

absl::StatusOr<std::shared_ptr<const SharedMapping>> SharedRegionMap::Attach(
    const SharedRegionRef& ref) {
  if (ref.token().size() != kRegionTokenBytes || ref.pid() <= 0 || ref.fd() < 0 ||
      ref.bytes() <= 0 || ref.bytes() > kMaxRegionBytes) {
    return SharedMemoryRefusal("malformed region reference");
  }
  {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(ref.token()); it != entries_.end()) {
      if (it->second.bytes != ref.bytes()) {
        return SharedMemoryRefusal("the region's size differs from the one it was mapped with");
      }
      it->second.used = absl::Now();
      return it->second.mapping;
    }
  }
  // Opened, checked and mapped without the lock: calls through regions
  // already mapped go on meanwhile.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> mapping = MapRegion(ref);
  if (!mapping.ok()) return mapping.status();
  Unmapped unmapped;  // unmapped after the lock is let go, as is a mapping lost to a race
  absl::MutexLock lock(&mu_);
  if (auto it = entries_.find(ref.token()); it != entries_.end()) {
    // Another call of the same region mapped it meanwhile.
    unmapped.push_back(*std::move(mapping));
    if (it->second.bytes != ref.bytes()) {
      return SharedMemoryRefusal("the region's size differs from the one it was mapped with");
    }
    it->second.used = absl::Now();
    return it->second.mapping;
  }
  if (!MakeRoomLocked(ref.bytes(), &unmapped)) {
    unmapped.push_back(*std::move(mapping));
    return SharedMemoryRefusal(absl::StrCat("no room for a region of ", ref.bytes(),
                                            " bytes beside the ", entries_.size(), " in use"));
  }
  entries_[ref.token()] = Entry{*mapping, ref.bytes(), ref.pid(), absl::Now()};
  mapped_ += ref.bytes();
  return mapping;
}

void SharedRegionMap::Forget(const std::string& token) {
  Unmapped unmapped;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(token);
  if (it == entries_.end()) return;
  mapped_ -= it->second.bytes;
  unmapped.push_back(std::move(it->second.mapping));
  entries_.erase(it);
}

void SharedRegionMap::Sweep(absl::Time now) {
  Unmapped unmapped;
  absl::MutexLock lock(&mu_);
  SweepLocked(now, &unmapped);
}

void SharedRegionMap::SweepLocked(absl::Time now, Unmapped* unmapped) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.mapping.use_count() > 1) {
      e.used = std::max(e.used, now);  // idle time counts from the end of its last call
      ++it;
      continue;
    }
    const bool gone = ::kill(e.pid, 0) != 0 && errno == ESRCH;
    if (gone || now - e.used > limits_.idle) {
      mapped_ -= e.bytes;
      unmapped->push_back(std::move(e.mapping));
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
}

bool SharedRegionMap::MakeRoomLocked(int64_t bytes, Unmapped* unmapped) {
  if (bytes > limits_.max_bytes) return false;
  while (entries_.size() >= static_cast<size_t>(limits_.max_regions) ||
         mapped_ + bytes > limits_.max_bytes) {
    auto lru = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.mapping.use_count() == 1 &&
          (lru == entries_.end() || it->second.used < lru->second.used)) {
        lru = it;
      }
    }
    if (lru == entries_.end()) return false;
    mapped_ -= lru->second.bytes;
    unmapped->push_back(std::move(lru->second.mapping));
    entries_.erase(lru);
  }
  return true;
}

int SharedRegionMap::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

int64_t SharedRegionMap::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  return mapped_;
}

}  // namespace psflow
