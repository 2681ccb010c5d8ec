// DSParam layouts and the registry that owns them.
#include <deepcompile/registry.h>

#include "fixtures.h"

#include <gtest/gtest.h>

#include <algorithm>

using namespace deepcompile;
using namespace dctest;

namespace {

DSParam z12Param(DsId id, int64_t numel, int world, int64_t group_offset, int64_t partition_numel) {
  Z12Layout layout;
  layout.param = at::zeros({numel});
  layout.group_offset = group_offset;
  layout.partition_numel = partition_numel;
  return DSParam(id, {numel}, world, std::move(layout));
}

}  // namespace

TEST(Registry, UnknownIdThrowsClearError) {
  DSParamRegistry reg;
  EXPECT_NE(errorOf([&] { reg.get(42); }).find("unknown ds id 42"), std::string::npos);
  EXPECT_EQ(reg.find(42), nullptr);
}

TEST(Registry, AddReplacesWholeEntry) {
  DSParamRegistry reg;
  DSParam a(1, {4}, 1, Z3Layout{});
  a.z3().valid = true;
  a.z3().gathered = at::ones({4});
  a.reduce_count = 3;
  reg.add(a);
  reg.add(DSParam(1, {4}, 1, Z3Layout{}));
  EXPECT_FALSE(reg.get(1).z3().valid);
  EXPECT_FALSE(reg.get(1).z3().gathered.defined());
  EXPECT_EQ(reg.get(1).reduce_count, 0);
  // Replaced by the other stage: the ZeRO-3 state is gone with the layout.
  reg.add(z12Param(1, 4, 1, 0, 4));
  EXPECT_FALSE(reg.get(1).isZ3());
  EXPECT_EQ(reg.get(1).maybeZ3(), nullptr);
}

TEST(Registry, CoreIsDerivedFromShapeAndWorld) {
  DSParam p(5, {2, 3, 2}, 5, Z3Layout{});
  EXPECT_EQ(p.numel, 12);
  EXPECT_EQ(p.stage(), ParamStage::Zero3);
  EXPECT_EQ(p.z3().ppr, 3);  // ceil(12 / 5)
  EXPECT_EQ(p.z3().padded_numel, 15);
  EXPECT_NE(errorOf([] { DSParam(1, {2, -1}, 2, Z3Layout{}); }).find("negative dimension"), std::string::npos);
  EXPECT_NE(errorOf([] { DSParam(1, {2}, 0, Z12Layout{}); }).find("world size"), std::string::npos);
}

TEST(Registry, Zero12OwnedRangesSplitAcrossPartitions) {
  // Group of 3 ranks x 4 elements; a 6-element parameter at offset 2 spans ranks 0 and 1.
  DSParam p = z12Param(1, 6, 3, 2, 4);
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
  DSParam p(1, {7}, 3, Z3Layout{});
  EXPECT_EQ(p.z3().padded_numel, 9);
  EXPECT_EQ(p.localGradNumel(2), 3);
  auto ranges = p.ownedRanges();
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[2].begin, 6);
  EXPECT_EQ(ranges[2].end, 9);  // the last shard includes the padding
  EXPECT_EQ(p.localGradOffset(2), 6);
}

// Reading the other stage's layout is a clear error naming the id and both stages, never a read
// of fields that mean nothing for this parameter.
TEST(Registry, WrongStageAccessNamesIdAndStages) {
  DSParam z12 = z12Param(7, 6, 2, 0, 3);
  EXPECT_EQ(z12.stage(), ParamStage::Zero12);
  EXPECT_NE(errorOf([&] { z12.z3("dc.allgather_param"); })
                .find("dc.allgather_param: ds id 7 is registered for ZeRO-1/2, not ZeRO-3"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { z12.gatheredView(); }).find("ds id 7 is registered for ZeRO-1/2, not ZeRO-3"),
            std::string::npos);
  const DSParam& const_z12 = z12;
  EXPECT_NE(errorOf([&] { const_z12.z3(); }).find("not ZeRO-3"), std::string::npos);

  DSParam z3(8, {6}, 2, Z3Layout{});
  EXPECT_NE(errorOf([&] { z3.z12("dc.reduce_grad"); })
                .find("dc.reduce_grad: ds id 8 is registered for ZeRO-3, not ZeRO-1/2"),
            std::string::npos);
  EXPECT_EQ(z3.maybeZ12(), nullptr);
  EXPECT_NE(z3.maybeZ3(), nullptr);
}

TEST(Registry, ForEachZ3SkipsZero12Params) {
  DSParamRegistry reg;
  reg.add(DSParam(1, {4}, 2, Z3Layout{}));
  reg.add(z12Param(2, 4, 2, 0, 2));
  reg.add(DSParam(3, {4}, 2, Z3Layout{}));
  std::vector<DsId> seen;
  reg.forEachZ3([&](DSParam& p, Z3Layout&) { seen.push_back(p.id); });
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<DsId>{1, 3}));
}
