// Host lanes: trivially ordered, completions always ready.
#include <deepcompile/lanes.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

TEST(HostLanes, CompletionsAreReadyAndScopesAreNoops) {
  auto lanes = makeHostLanes();
  EXPECT_TRUE(lanes->device().is_cpu());
  auto done = lanes->record(Lane::ReduceScatter);
  done->hostWait();
  { LaneScope scope(*lanes, Lane::Copy); }
  lanes->synchronize(Lane::AllGather);
  EXPECT_STREQ(laneName(Lane::Reload), "reload");
}

namespace {

// A completion that counts how often the host waited on it.
class CountingCompletion final : public Completion {
 public:
  void blockStream(const c10::Stream&) override {}
  void hostWait() override { ++waits; }
  int waits = 0;
};

}  // namespace

TEST(ReleaseWindow, WaitsForTheOldestReleasesOnlyBeyondTheLimit) {
  ReleaseWindow window;
  std::vector<std::shared_ptr<CountingCompletion>> released;
  auto note = [&](int64_t bytes) {
    released.push_back(std::make_shared<CountingCompletion>());
    window.note(released.back(), bytes);
  };
  note(100);  // no limit: nothing is kept, nobody waits
  EXPECT_EQ(window.size(), 0u);
  window.setLimit(250);
  note(100);
  note(100);
  EXPECT_EQ(window.pendingBytes(), 200);  // within the limit: the host runs on
  note(100);  // 300 > 250: wait for the oldest kept release, then 200 remain
  EXPECT_EQ(released[1]->waits, 1);
  EXPECT_EQ(released[2]->waits, 0);
  EXPECT_EQ(window.pendingBytes(), 200);
  note(1000);  // a buffer larger than the limit: every older one is waited for, the newest stays
  EXPECT_EQ(released[2]->waits, 1);
  EXPECT_EQ(released[3]->waits, 1);
  EXPECT_EQ(released[4]->waits, 0);
  EXPECT_EQ(window.size(), 1u);
  window.setLimit(0);  // off again: the window forgets
  EXPECT_EQ(window.size(), 0u);
  EXPECT_THROW(window.setLimit(-1), c10::Error);
}

TEST(HostLanes, ReleasesNeverWait) {
  auto lanes = makeHostLanes();
  lanes->setReleaseLimit(1);
  lanes->noteRelease(1 << 20);  // host lanes: the release was synchronous, nothing to wait for
}
