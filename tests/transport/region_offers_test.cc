#include "transport/region_offers.h"

#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace psflow {
namespace {

constexpr absl::Duration kRetry = absl::Milliseconds(200);

TEST(RegionOffersTest, AServerThatTakesRegionsIsOfferedOneEveryCall) {
  RegionOffers offers("ps 0", kRetry);
  for (int call = 0; call < 3; ++call) {
    bool probe = true;
    ASSERT_TRUE(offers.Offer(&probe));
    EXPECT_FALSE(probe);
    EXPECT_FALSE(offers.Answered(absl::OkStatus(), nullptr, probe));
  }
}

TEST(RegionOffersTest, ARefusalStopsOffersUntilOneProbeAfterTheWait) {
  RegionOffers offers("ps 0", kRetry);
  bool probe = false;
  ASSERT_TRUE(offers.Offer(&probe));
  EXPECT_TRUE(offers.Answered(SharedMemoryRefusal("another host"), nullptr, probe));
  EXPECT_FALSE(offers.Offer(&probe));  // within the wait
  absl::SleepFor(kRetry + absl::Milliseconds(50));
  ASSERT_TRUE(offers.Offer(&probe));
  EXPECT_TRUE(probe);
  bool second_probe = false;
  EXPECT_FALSE(offers.Offer(&second_probe));  // one probe at a time
  // The probe's region is taken: every call offers one again.
  EXPECT_FALSE(offers.Answered(absl::OkStatus(), nullptr, probe));
  ASSERT_TRUE(offers.Offer(&probe));
  EXPECT_FALSE(probe);
}

TEST(RegionOffersTest, ADroppedProbeLetsTheNextCallProbe) {
  RegionOffers offers("ps 0", absl::ZeroDuration());
  bool probe = false;
  ASSERT_TRUE(offers.Offer(&probe));
  offers.Answered(SharedMemoryRefusal("no"), nullptr, probe);
  ASSERT_TRUE(offers.Offer(&probe));
  ASSERT_TRUE(probe);
  bool other = false;
  EXPECT_FALSE(offers.Offer(&other));
  offers.ProbeDropped();
  EXPECT_TRUE(offers.Offer(&other));
  EXPECT_TRUE(other);
}

TEST(RegionOffersTest, OtherFailuresAreNoRefusal) {
  RegionOffers offers("ps 0", kRetry);
  bool probe = false;
  ASSERT_TRUE(offers.Offer(&probe));
  EXPECT_FALSE(offers.Answered(absl::UnavailableError("gone"), nullptr, probe));
  EXPECT_TRUE(offers.Offer(&probe));
}

}  // namespace
}  // namespace psflow
