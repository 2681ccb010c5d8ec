// ZeRO-3 gathering on its own: grouped launches, private copies and freeing the gathered storage.
#include <deepcompile/gather.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

namespace {

// A ZeRO-3 parameter of `numel` elements whose shard holds `value` everywhere.
DSParam z3Param(DsId id, int64_t numel, int world, float value, at::ScalarType gather_dtype = at::kFloat) {
  Z3Layout layout;
  layout.shard = at::full({ceilDiv(numel, world)}, value);
  layout.gather_dtype = gather_dtype;
  return DSParam(id, {numel}, world, std::move(layout));
}

}  // namespace

TEST(Gather, SeveralParamsGoOutAsOneGroupInTheirDtypes) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(/*rank=*/1, /*world=*/2);
  DSParam a = z3Param(1, 3, 2, 1.5f), b = z3Param(2, 4, 2, 2.5f);
  launchGathers(*lanes, comm, {&a.z3(), &b.z3()}, {at::kFloat, at::kBFloat16});
  EXPECT_EQ(comm.groups, 1);
  EXPECT_EQ(comm.gathers, 2);
  EXPECT_TRUE(a.z3().valid && b.z3().valid);
  EXPECT_EQ(a.z3().gather_done, b.z3().gather_done);  // one completion for the group
  EXPECT_EQ(b.z3().gathered.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(a.gatheredView(), at::full({3}, 1.5f)));
  at::Tensor view = b.gatheredView();
  freeGathered(*lanes, b.z3());
  EXPECT_EQ(view.storage().nbytes(), 0u);  // the storage itself, not just the registry's handle
  EXPECT_FALSE(b.z3().valid);
  EXPECT_FALSE(b.z3().gathered.defined());
  EXPECT_EQ(b.z3().gather_done, nullptr);
}

TEST(Gather, PrivateCopyLeavesTheRegisteredBufferAlone) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(0, 2);
  DSParam p = z3Param(1, 3, 2, 1.0f / 3.0f, at::kBFloat16);
  Z3Layout& z3 = p.z3();
  launchGathers(*lanes, comm, {&z3}, {at::kBFloat16});
  const void* registered = z3.gathered.data_ptr();
  at::Tensor copy = gatherPrivateCopy(*lanes, comm, z3, at::kFloat);
  EXPECT_EQ(copy.scalar_type(), at::kFloat);
  EXPECT_EQ(copy.sizes(), at::IntArrayRef({4}));  // the flat padded buffer: 2 ranks x 2
  EXPECT_NE(copy.data_ptr(), registered);
  EXPECT_EQ(z3.gathered.data_ptr(), registered);
  // Every dtype sees the parameter's value: the shard rounded to its gather dtype.
  EXPECT_TRUE(at::equal(copy, z3.shard.to(at::kBFloat16).to(at::kFloat).narrow(0, 0, 1).repeat({4})));
}
