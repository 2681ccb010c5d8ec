// ZeRO-3 gathering on its own: grouped launches, private copies and freeing the gathered storage.
#include <deepcompile/gather.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

namespace {

// A ZeRO-3 parameter of `numel` elements whose shard holds `value` everywhere.
DSParam z3Param(DsId id, int64_t numel, int world, float value, at::ScalarType gather_dtype = at::kFloat) {
  DSParam p;
  p.id = id;
  p.shape = {numel};
  p.numel = numel;
  p.world = world;
  p.partitioned = true;
  p.ppr = ceilDiv(numel, world);
  p.data = at::full({p.ppr}, value);
  p.gather_dtype = gather_dtype;
  return p;
}

}  // namespace

TEST(Gather, SeveralParamsGoOutAsOneGroupInTheirDtypes) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(/*rank=*/1, /*world=*/2);
  DSParam a = z3Param(1, 3, 2, 1.5f), b = z3Param(2, 4, 2, 2.5f);
  launchGathers(*lanes, comm, {&a, &b}, {at::kFloat, at::kBFloat16});
  EXPECT_EQ(comm.groups, 1);
  EXPECT_EQ(comm.gathers, 2);
  EXPECT_TRUE(a.valid && b.valid);
  EXPECT_EQ(a.gather_done, b.gather_done);  // one completion for the group
  EXPECT_EQ(b.gathered.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(a.gatheredView(), at::full({3}, 1.5f)));
  at::Tensor view = b.gatheredView();
  freeGathered(*lanes, b);
  EXPECT_EQ(view.storage().nbytes(), 0u);  // the storage itself, not just the registry's handle
  EXPECT_FALSE(b.valid);
  EXPECT_FALSE(b.gathered.defined());
  EXPECT_EQ(b.gather_done, nullptr);
}

TEST(Gather, PrivateCopyLeavesTheRegisteredBufferAlone) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(0, 2);
  DSParam p = z3Param(1, 3, 2, 1.0f / 3.0f, at::kBFloat16);
  launchGathers(*lanes, comm, {&p}, {at::kBFloat16});
  const void* registered = p.gathered.data_ptr();
  at::Tensor copy = gatherPrivateCopy(*lanes, comm, p, at::kFloat);
  EXPECT_EQ(copy.scalar_type(), at::kFloat);
  EXPECT_EQ(copy.sizes(), at::IntArrayRef({3}));
  EXPECT_NE(copy.data_ptr(), registered);
  EXPECT_EQ(p.gathered.data_ptr(), registered);
  // Every dtype sees the parameter's value: the shard rounded to its gather dtype.
  EXPECT_TRUE(at::equal(copy, p.data.to(at::kBFloat16).to(at::kFloat).narrow(0, 0, 1).repeat({3})));
}
