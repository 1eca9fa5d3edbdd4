// Shared regions between processes of one host: made by a client, mapped by a
// server through /proc (here the same process plays both, and a child
// process plays a client that goes away).
#include "transport/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

// Limits whose sweeps happen only where a test calls Sweep.
SharedRegionMap::Limits Manual() {
  SharedRegionMap::Limits limits;
  limits.sweep_every = absl::InfiniteDuration();
  return limits;
}

// A child process that makes a region, hands its reference over and exits
// when told to.
class ChildRegion {
 public:
  ChildRegion() {
    int to_parent[2];
    int to_child[2];
    if (pipe(to_parent) != 0 || pipe(to_child) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      absl::StatusOr<std::unique_ptr<SharedRegion>> mine = SharedRegion::Create(4096);
      const std::string ref = mine.ok() ? (*mine)->ref().SerializeAsString() : "";
      bool ok = write(to_parent[1], ref.data(), ref.size()) == static_cast<ssize_t>(ref.size());
      char go;
      ok = read(to_child[0], &go, 1) == 1 && ok;
      _exit(ok && mine.ok() ? 0 : 1);
    }
    char buf[256];
    const ssize_t n = pid_ > 0 ? read(to_parent[0], buf, sizeof(buf)) : -1;
    parsed_ = n > 0 && ref_.ParseFromArray(buf, static_cast<int>(n));
    close(to_parent[0]);
    close(to_parent[1]);
    close(to_child[0]);
    go_ = to_child[1];
  }
  ~ChildRegion() { Exit(); }

  // False where the child could not be started or sent no reference.
  bool ok() const { return pid_ > 0 && parsed_; }
  pid_t pid() const { return pid_; }
  const SharedRegionRef& ref() const { return ref_; }
  // Lets the child exit and waits for it; true when it exited cleanly.
  bool Exit() {
    if (go_ < 0) return exited_;
    const bool told = write(go_, "x", 1) == 1;
    close(go_);
    go_ = -1;
    int status = 0;
    exited_ = told && pid_ > 0 && waitpid(pid_, &status, 0) == pid_ && WIFEXITED(status) &&
              WEXITSTATUS(status) == 0;
    return exited_;
  }

 private:
  pid_t pid_ = -1;
  int go_ = -1;
  bool parsed_ = false;
  bool exited_ = false;
  SharedRegionRef ref_;
};

TEST(SharedRegion, AServerMapsTheClientsRegionOnceAndSeesItsBytes) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(10000);
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedSpan mine = (*region)->data();
  EXPECT_EQ(mine.size, 10000);
  EXPECT_EQ((*region)->ref().pid(), getpid());
  EXPECT_EQ((*region)->ref().token().size(), static_cast<size_t>(kRegionTokenBytes));

  SharedRegionMap map(Manual());
  absl::StatusOr<std::shared_ptr<const SharedMapping>> theirs = map.Attach((*region)->ref());
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  ASSERT_EQ((*theirs)->data.size, 10000);
  EXPECT_NE((*theirs)->data.data, mine.data);  // a mapping of its own
  std::memcpy(mine.data + 9990, "client", 6);
  EXPECT_EQ(std::string((*theirs)->data.data + 9990, 6), "client");
  std::memcpy((*theirs)->data.data, "server", 6);
  EXPECT_EQ(std::string(mine.data, 6), "server");
  // Found again by its token: the same mapping.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> again = map.Attach((*region)->ref());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), theirs->get());
  EXPECT_EQ(map.size(), 1);
  // The mapping outlives the client's region (a worker that went away).
  region->reset();
  EXPECT_EQ(std::string((*theirs)->data.data + 9990, 6), "client");
}

TEST(SharedRegion, ReferencesThatDoNotNameTheRegionAreRefused) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  SharedRegionMap map(Manual());
  auto refused = [&](const SharedRegionRef& ref, const std::string& why) {
    absl::StatusOr<std::shared_ptr<const SharedMapping>> got = map.Attach(ref);
    EXPECT_TRUE(IsSharedMemoryRefusal(got.status())) << got.status();
    EXPECT_THAT(got.status().message(), HasSubstr(why));
  };
  SharedRegionRef ref = (*region)->ref();
  ref.set_token(std::string(kRegionTokenBytes, 'x'));
  refused(ref, "another token");
  EXPECT_EQ(map.size(), 0);
  ref = (*region)->ref();
  ref.set_bytes(8192);
  refused(ref, "is not a region of 8192 bytes");
  ref = (*region)->ref();
  ref.set_token("short");
  refused(ref, "malformed");
  ref = (*region)->ref();
  ref.set_bytes(-1);
  refused(ref, "malformed");
  // A descriptor that is not a region is never opened.
  char path[] = "/tmp/psflow-region-test-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  unlink(path);
  ASSERT_EQ(ftruncate(fd, kRegionHeaderBytes + 4096), 0);
  ref = (*region)->ref();
  ref.set_fd(fd);
  refused(ref, "is not a psflow region");
  close(fd);
  ref = (*region)->ref();
  ref.set_fd(100000);
  refused(ref, "/fd/100000");
  EXPECT_EQ(map.size(), 0);
  // The right reference still maps; once mapped, another size for its token
  // is refused.
  ASSERT_TRUE(map.Attach((*region)->ref()).ok());
  ref = (*region)->ref();
  ref.set_bytes(8192);
  refused(ref, "size differs");
  // Other statuses are not refusals of shared memory.
  EXPECT_FALSE(IsSharedMemoryRefusal(absl::FailedPreconditionError("ps holds no job yet")));
  EXPECT_FALSE(IsSharedMemoryRefusal(absl::InvalidArgumentError("shared memory: no")));
}

TEST(SharedRegion, ARegionOfAProcessThatExitedCannotBeMapped) {
  ChildRegion child;
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(child.Exit());
  SharedRegionMap map(Manual());
  absl::Status s = map.Attach(child.ref()).status();
  EXPECT_TRUE(IsSharedMemoryRefusal(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("/proc/", child.pid(), "/fd/")));
}

// A region cannot change its size under a mapping (a shrink would make the
// ps fault on its next access), and a memory file that could is refused.
TEST(SharedRegion, ARegionsSizeIsSealedAndAnUnsealedFileIsRefused) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_NE(ftruncate((*region)->ref().fd(), 0), 0);
  EXPECT_NE(ftruncate((*region)->ref().fd(), 1 << 20), 0);
  // The same name, size and token, without the seals.
  const int fd = memfd_create("psflow-region", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kRegionHeaderBytes + 4096), 0);
  const std::string& token = (*region)->ref().token();
  ASSERT_EQ(pwrite(fd, token.data(), token.size(), 0), static_cast<ssize_t>(token.size()));
  SharedRegionRef ref = (*region)->ref();
  ref.set_fd(fd);
  SharedRegionMap map(Manual());
  absl::Status s = map.Attach(ref).status();
  EXPECT_TRUE(IsSharedMemoryRefusal(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("not sealed"));
  close(fd);
}

TEST(SharedRegion, UnusedRegionsAreUnmappedWhenIdleForgottenOrTheirProcessIsGone) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  SharedRegionMap map(Manual());
  const absl::Duration idle = Manual().idle;
  absl::StatusOr<std::shared_ptr<const SharedMapping>> used = map.Attach((*region)->ref());
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(map.mapped_bytes(), 4096);
  // In use: kept, however long, and its idle time counts from its release.
  const absl::Time t = absl::Now() + idle + absl::Seconds(1);
  map.Sweep(t);
  EXPECT_EQ(map.size(), 1);
  used->reset();
  map.Sweep(t + idle / 2);
  EXPECT_EQ(map.size(), 1) << "not idle long enough since its release, and its process is alive";
  map.Sweep(t + idle + absl::Seconds(1));
  EXPECT_EQ(map.size(), 0);
  EXPECT_EQ(map.mapped_bytes(), 0);
  // Forgotten: gone from the map, while a call that holds it keeps reading.
  used = map.Attach((*region)->ref());
  ASSERT_TRUE(used.ok()) << used.status();
  std::memcpy((*region)->data().data, "kept", 4);
  map.Forget((*region)->ref().token());
  EXPECT_EQ(map.size(), 0);
  EXPECT_EQ(std::string((*used)->data.data, 4), "kept");

  // A child's region, mapped while the child runs, unmapped once it exited.
  ChildRegion child;
  ASSERT_TRUE(child.ok());
  used = map.Attach(child.ref());
  ASSERT_TRUE(used.ok()) << used.status();
  used->reset();
  ASSERT_TRUE(child.Exit());
  EXPECT_EQ(map.size(), 1);
  map.Sweep(absl::Now());
  EXPECT_EQ(map.size(), 0);
}

// The map's own thread unmaps, without a call, the regions of a process
// that exited.
TEST(SharedRegion, TheSweeperUnmapsRegionsOfExitedProcessesByItself) {
  SharedRegionMap::Limits limits;
  limits.sweep_every = absl::Milliseconds(20);
  SharedRegionMap map(limits);
  ChildRegion child;
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(map.Attach(child.ref()).ok());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(map.size(), 1) << "its process is alive";
  ASSERT_TRUE(child.Exit());
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (map.size() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(map.size(), 0);
}

// At most so many regions and bytes are mapped: the least recently used
// idle ones make room, regions in use never do, and a reference that fails
// its checks unmaps nothing.
TEST(SharedRegion, TheMapsBoundsUnmapIdleRegionsOnlyForRealOnes) {
  SharedRegionMap::Limits limits = Manual();
  limits.max_regions = 2;
  limits.max_bytes = 3 * 4096;
  SharedRegionMap map(limits);
  std::vector<std::unique_ptr<SharedRegion>> regions;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::unique_ptr<SharedRegion>> r = SharedRegion::Create(4096);
    ASSERT_TRUE(r.ok()) << r.status();
    regions.push_back(*std::move(r));
  }
  absl::StatusOr<std::shared_ptr<const SharedMapping>> a = map.Attach(regions[0]->ref());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(map.Attach(regions[1]->ref()).ok());  // idle at once
  // A forged reference (a real region's descriptor, another token) is
  // refused without unmapping the idle region.
  SharedRegionRef forged = regions[2]->ref();
  forged.set_token(std::string(kRegionTokenBytes, 'f'));
  EXPECT_TRUE(IsSharedMemoryRefusal(map.Attach(forged).status()));
  EXPECT_EQ(map.size(), 2);
  // A third real one takes the idle region's place, not the one in use.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> c = map.Attach(regions[2]->ref());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(map.size(), 2);
  // Both in use: a fourth is refused.
  absl::Status full = map.Attach(regions[3]->ref()).status();
  EXPECT_TRUE(IsSharedMemoryRefusal(full)) << full;
  EXPECT_THAT(full.message(), HasSubstr("no room"));
  // The mapped ones still are the first and the third.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> again = map.Attach(regions[0]->ref());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), a->get());
  again = map.Attach(regions[2]->ref());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), c->get());
  // Bytes: a region larger than the bound is refused outright.
  absl::StatusOr<std::unique_ptr<SharedRegion>> big = SharedRegion::Create(4 * 4096);
  ASSERT_TRUE(big.ok()) << big.status();
  a->reset();
  c->reset();
  again->reset();
  EXPECT_TRUE(IsSharedMemoryRefusal(map.Attach((*big)->ref()).status()));
  EXPECT_EQ(map.size(), 2);
  EXPECT_EQ(map.mapped_bytes(), 2 * 4096);
}

TEST(SharedRegionPool, LeasesAreReusedAndBounded) {
  constexpr int64_t kMiB = SharedRegionPool::kQuantum;
  SharedRegionPool pool(4 * kMiB);
  SharedRegionPool::Lease a = pool.Acquire(kMiB + 1);
  ASSERT_TRUE(a);
  EXPECT_EQ(a.get()->data().size, 2 * kMiB);  // rounded up
  const char* a_data = a.get()->data().data;
  a.reset();
  EXPECT_FALSE(a);
  // The smallest free region that fits is leased again.
  SharedRegionPool::Lease b = pool.Acquire(100);
  ASSERT_TRUE(b);
  EXPECT_EQ(b.get()->data().data, a_data);
  // While b is leased: room for 2 more MiB, not 3.
  SharedRegionPool::Lease c = pool.Acquire(2 * kMiB);
  ASSERT_TRUE(c);
  EXPECT_FALSE(pool.Acquire(kMiB));
  EXPECT_EQ(pool.total_bytes(), 4 * kMiB);
  // A dropped region leaves room; a freed small one is dropped for a larger.
  c.Discard();
  EXPECT_EQ(pool.total_bytes(), 2 * kMiB);
  b.reset();
  SharedRegionPool::Lease d = pool.Acquire(4 * kMiB);
  ASSERT_TRUE(d);
  EXPECT_EQ(pool.total_bytes(), 4 * kMiB);
  EXPECT_FALSE(pool.Acquire(5 * kMiB));
}

// A call the bound leaves no room for, even with the free regions dropped,
// gets none and drops none.
TEST(SharedRegionPool, FreeRegionsAreKeptWhenDroppingThemWouldNotMakeRoom) {
  constexpr int64_t kMiB = SharedRegionPool::kQuantum;
  SharedRegionPool pool(4 * kMiB);
  SharedRegionPool::Lease held = pool.Acquire(2 * kMiB);
  ASSERT_TRUE(held);
  SharedRegionPool::Lease spare = pool.Acquire(kMiB);
  ASSERT_TRUE(spare);
  const char* spare_data = spare.get()->data().data;
  spare.reset();
  EXPECT_FALSE(pool.Acquire(3 * kMiB));
  EXPECT_EQ(pool.total_bytes(), 3 * kMiB);
  SharedRegionPool::Lease again = pool.Acquire(kMiB);
  ASSERT_TRUE(again);
  EXPECT_EQ(again.get()->data().data, spare_data);
}

// With pinning set, each region is pinned once, when first leased (not
// again when leased again), and unpinned as it is dropped; one the pin
// refused is not pinned and is not unpinned.
TEST(SharedRegionPool, RegionsArePinnedOnceAndUnpinnedWhenDropped) {
  constexpr int64_t kMiB = SharedRegionPool::kQuantum;
  std::vector<std::pair<void*, size_t>> pinned;
  std::vector<void*> unpinned;
  bool refuse = false;
  {
    SharedRegionPool pool(8 * kMiB);
    pool.SetPinning(
        [&](void* data, size_t bytes) {
          if (refuse) return false;
          pinned.emplace_back(data, bytes);
          return true;
        },
        [&](void* data) { unpinned.push_back(data); });
    SharedRegionPool::Lease a = pool.Acquire(kMiB);
    ASSERT_TRUE(a);
    EXPECT_TRUE(a.get()->pinned());
    char* const a_data = a.get()->data().data;
    ASSERT_EQ(pinned.size(), 1u);
    EXPECT_EQ(pinned[0].first, a_data);
    EXPECT_EQ(pinned[0].second, static_cast<size_t>(kMiB));
    a.reset();
    SharedRegionPool::Lease again = pool.Acquire(kMiB);
    EXPECT_EQ(again.get()->data().data, a_data);
    EXPECT_TRUE(again.get()->pinned());
    EXPECT_EQ(pinned.size(), 1u);
    refuse = true;
    SharedRegionPool::Lease b = pool.Acquire(2 * kMiB);
    ASSERT_TRUE(b);
    EXPECT_FALSE(b.get()->pinned());
    b.Discard();
    EXPECT_TRUE(unpinned.empty());
    again.Discard();
    ASSERT_EQ(unpinned.size(), 1u);
    EXPECT_EQ(unpinned[0], a_data);
    refuse = false;
    SharedRegionPool::Lease c = pool.Acquire(kMiB);
    ASSERT_TRUE(c);
    EXPECT_TRUE(c.get()->pinned());
    c.reset();  // free in the pool: unpinned as the pool goes
  }
  EXPECT_EQ(pinned.size(), 2u);
  EXPECT_EQ(unpinned.size(), 2u);
}

}  // namespace
}  // namespace psflow
