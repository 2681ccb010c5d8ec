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
