// Host lanes: trivially ordered, completions always ready.
#include <deepcompile/lanes.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

namespace {

Lane laneAt(int i) { return static_cast<Lane>(i); }

}  // namespace

// Work on host lanes runs synchronously on the caller, so a recorded completion must already be
// satisfied. Completion has no "is it done?" query; readyCompletion() is the runtime's one
// completion that is satisfied by contract, so readiness shows as identity with it (anything else,
// an event or a pending collective, would be a different object).
TEST(HostLanes, EveryLaneRecordsTheReadyCompletion) {
  auto lanes = makeHostLanes();
  ASSERT_TRUE(lanes->device().is_cpu());
  for (int i = 0; i < kNumLanes; ++i) {
    CompletionPtr done = lanes->record(laneAt(i));
    ASSERT_NE(done, nullptr) << laneName(laneAt(i));
    EXPECT_EQ(done, readyCompletion()) << "lane " << laneName(laneAt(i)) << " recorded a completion that is not "
                                       << "the ready one";
    // Waiting on a ready completion returns at once (a hang here is a readiness failure too).
    done->hostWait();
    done->blockStream(lanes->computeStream());
  }
}

// One host thread: every lane is the caller's stream, and a LaneScope switches nothing.
TEST(HostLanes, EveryLaneIsTheComputeStreamAndScopesSwitchNothing) {
  auto lanes = makeHostLanes();
  const c10::Stream compute = lanes->computeStream();
  EXPECT_TRUE(compute.device().is_cpu());
  for (int i = 0; i < kNumLanes; ++i) {
    EXPECT_EQ(lanes->stream(laneAt(i)), compute) << laneName(laneAt(i));
    LaneScope scope(*lanes, laneAt(i));
    EXPECT_EQ(lanes->computeStream(), compute) << "inside the scope of lane " << laneName(laneAt(i));
  }
  EXPECT_EQ(lanes->computeStream(), compute);
  EXPECT_STREQ(laneName(Lane::Reload), "reload");
}
