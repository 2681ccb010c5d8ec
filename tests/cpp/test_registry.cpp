// DSParam layouts and the registry that owns them.
#include <deepcompile/registry.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

TEST(Registry, UnknownIdThrowsClearError) {
  DSParamRegistry reg;
  try {
    reg.get(42);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown ds id 42"), std::string::npos);
  }
}

TEST(Registry, AddReplacesWholeEntry) {
  DSParamRegistry reg;
  DSParam a;
  a.id = 1;
  a.valid = true;
  a.gathered = at::ones({4});
  reg.add(a);
  DSParam b;
  b.id = 1;
  reg.add(b);
  EXPECT_FALSE(reg.get(1).valid);
  EXPECT_FALSE(reg.get(1).gathered.defined());
}

TEST(Registry, Zero12OwnedRangesSplitAcrossPartitions) {
  // Group of 3 ranks x 4 elements; a 6-element parameter at offset 2 spans ranks 0 and 1.
  DSParam p;
  p.world = 3;
  p.numel = 6;
  p.group_offset = 2;
  p.partition_numel = 4;
  auto ranges = p.ownedRanges();
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].owner, 0);
  EXPECT_EQ(ranges[0].begin, 0);
  EXPECT_EQ(ranges[0].end, 2);
  EXPECT_EQ(ranges[1].owner, 1);
  EXPECT_EQ(ranges[1].begin, 2);
  EXPECT_EQ(ranges[1].end, 6);
  EXPECT_EQ(p.localGradNumel(0), 2);
  EXPECT_EQ(p.localGradNumel(1), 4);
  EXPECT_EQ(p.localGradNumel(2), 0);
  EXPECT_EQ(p.localGradOffset(1), 2);
}

TEST(Registry, Zero3RangesArePaddedShards) {
  DSParam p;
  p.partitioned = true;
  p.world = 3;
  p.numel = 7;
  p.ppr = 3;
  EXPECT_EQ(p.paddedNumel(), 9);
  EXPECT_EQ(p.localGradNumel(2), 3);
  EXPECT_EQ(p.ownedRanges().size(), 3u);
}
