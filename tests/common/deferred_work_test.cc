#include "common/deferred_work.h"

#include <functional>
#include <string>

#include "gtest/gtest.h"

namespace psflow {
namespace {

TEST(DeferredWorkTest, WithoutAScopeWorkIsRefusedAndLeftToTheCaller) {
  bool ran = false;
  std::function<void()> fn = [&] { ran = true; };
  EXPECT_FALSE(DeferredWork::Defer(fn));
  ASSERT_TRUE(fn) << "a refused function stays with the caller";
  fn();
  EXPECT_TRUE(ran);
}

TEST(DeferredWorkTest, TheOutermostScopeRunsEverythingInOrderWhenItCloses) {
  std::string log;
  {
    DeferredWork outer;
    std::function<void()> a = [&] { log += "a"; };
    ASSERT_TRUE(DeferredWork::Defer(a));
    {
      DeferredWork inner;
      std::function<void()> b = [&] {
        log += "b";
        // Work deferred while deferred work runs runs too, after it.
        std::function<void()> c = [&] { log += "c"; };
        EXPECT_TRUE(DeferredWork::Defer(c));
      };
      ASSERT_TRUE(DeferredWork::Defer(b));
    }
    EXPECT_EQ(log, "") << "an inner scope leaves its work to the outer one";
  }
  EXPECT_EQ(log, "abc");
  // Closed: nothing is kept any more.
  std::function<void()> d = [&] { log += "d"; };
  EXPECT_FALSE(DeferredWork::Defer(d));
}

TEST(DeferredWorkTest, DeferFirstKeepsOnlyTheScopesFirstWork) {
  std::string log;
  std::function<void()> none = [&] { log += "x"; };
  EXPECT_FALSE(DeferredWork::DeferFirst(none)) << "no scope is open";
  ASSERT_TRUE(none);
  {
    DeferredWork scope;
    std::function<void()> a = [&] { log += "a"; };
    std::function<void()> b = [&] { log += "b"; };
    ASSERT_TRUE(DeferredWork::DeferFirst(a));
    EXPECT_FALSE(DeferredWork::DeferFirst(b)) << "the scope holds work already";
    ASSERT_TRUE(b) << "a refused function stays with the caller";
    b();
    EXPECT_EQ(log, "b");
  }
  EXPECT_EQ(log, "ba");
  // Any work held counts, whatever deferred it.
  {
    DeferredWork scope;
    std::function<void()> c = [&] { log += "c"; };
    std::function<void()> d = [&] { log += "d"; };
    ASSERT_TRUE(DeferredWork::Defer(c));
    EXPECT_FALSE(DeferredWork::DeferFirst(d));
  }
  EXPECT_EQ(log, "bac");
}

}  // namespace
}  // namespace psflow
