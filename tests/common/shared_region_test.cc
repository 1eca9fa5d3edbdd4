// Shared regions between processes of one host: made by a client, mapped by a
// server through /proc (here the same process plays both, and a child
// process plays a client that goes away).
#include "common/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

TEST(SharedRegion, AServerMapsTheClientsRegionOnceAndSeesItsBytes) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(10000);
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedSpan mine = (*region)->data();
  EXPECT_EQ(mine.size, 10000);
  EXPECT_EQ((*region)->ref().pid(), getpid());
  EXPECT_EQ((*region)->ref().token().size(), static_cast<size_t>(kRegionTokenBytes));

  SharedRegionMap map;
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
  SharedRegionMap map;
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
  // A child makes a region and reports its reference, then exits.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(4096);
    const std::string ref = region.ok() ? (*region)->ref().SerializeAsString() : "";
    const bool sent =
        write(pipe_fds[1], ref.data(), ref.size()) == static_cast<ssize_t>(ref.size());
    _exit(sent && region.ok() ? 0 : 1);
  }
  close(pipe_fds[1]);
  std::string bytes;
  char buf[256];
  ssize_t n;
  while ((n = read(pipe_fds[0], buf, sizeof(buf))) > 0) bytes.append(buf, n);
  close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  SharedRegionRef ref;
  ASSERT_TRUE(ref.ParseFromString(bytes));
  SharedRegionMap map;
  absl::Status s = map.Attach(ref).status();
  EXPECT_TRUE(IsSharedMemoryRefusal(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("/proc/", child, "/fd/")));
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
  SharedRegionMap map;
  absl::Status s = map.Attach(ref).status();
  EXPECT_TRUE(IsSharedMemoryRefusal(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("not sealed"));
  close(fd);
}

TEST(SharedRegion, UnusedRegionsAreUnmappedWhenIdleForgottenOrTheirProcessIsGone) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  SharedRegionMap map;
  absl::StatusOr<std::shared_ptr<const SharedMapping>> used = map.Attach((*region)->ref());
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(map.mapped_bytes(), 4096);
  // In use: kept, however long idle.
  map.Sweep(absl::Now() + SharedRegionMap::kIdle + absl::Seconds(1));
  EXPECT_EQ(map.size(), 1);
  used->reset();
  map.Sweep(absl::Now());
  EXPECT_EQ(map.size(), 1) << "not idle yet, and its process is alive";
  map.Sweep(absl::Now() + SharedRegionMap::kIdle + absl::Seconds(1));
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
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<std::unique_ptr<SharedRegion>> mine = SharedRegion::Create(4096);
    const std::string ref = mine.ok() ? (*mine)->ref().SerializeAsString() : "";
    const uint32_t size = static_cast<uint32_t>(ref.size());
    bool ok = write(to_parent[1], &size, 4) == 4 &&
              write(to_parent[1], ref.data(), size) == static_cast<ssize_t>(size);
    char go;
    ok = read(to_child[0], &go, 1) == 1 && ok;
    _exit(ok && mine.ok() ? 0 : 1);
  }
  uint32_t size = 0;
  ASSERT_EQ(read(to_parent[0], &size, 4), 4);
  std::string bytes(size, '\0');
  ASSERT_EQ(read(to_parent[0], bytes.data(), size), static_cast<ssize_t>(size));
  SharedRegionRef ref;
  ASSERT_TRUE(ref.ParseFromString(bytes));
  used = map.Attach(ref);
  ASSERT_TRUE(used.ok()) << used.status();
  used->reset();
  ASSERT_EQ(write(to_child[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(map.size(), 1);
  map.Sweep(absl::Now());
  EXPECT_EQ(map.size(), 0);
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) close(fd);
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

}  // namespace
}  // namespace psflow
