// GradReducer: bucketing, flushing, padding and buffer reuse without host waits.
#include <deepcompile/grad_reducer.h>
#include <deepcompile/runtime.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

namespace {

// Reductions driven through a runtime, so gradients arrive the way reduce_grad hands them over.
struct Reduction : RuntimeFixture {};

// ZeRO-1/2 parameter 3: 5 elements at [1, 6) of a group split into partitions of 3 over 2 ranks
// (rank 0 owns [0, 2) of it, rank 1 [2, 5)), with a gradient target of what this rank owns.
DSParam ownedRangeParam(int64_t owned_numel) {
  Z12Layout layout;
  layout.param = at::zeros({5});
  layout.group_offset = 1;
  layout.partition_numel = 3;
  DSParam p(3, {5}, 2, std::move(layout));
  p.grad_target = at::empty({owned_numel});
  return p;
}

}  // namespace

TEST_F(Reduction, Zero3ReduceOverflowsBucketsAndZeroesPadding) {
  make(/*rank=*/2, /*world=*/3, /*bucket=*/4);
  at::Tensor t1 = at::empty({3}), t2 = at::empty({2}), t3 = at::empty({1});
  rt->registerZ3Params({{1, {7}, at::zeros({3}), t1, false, std::nullopt},
                        {2, {5}, at::zeros({2}), t2, false, std::nullopt},
                        {3, {2}, at::zeros({1}), t3, false, std::nullopt}});
  rt->registerGraph(1, {1, 2, 3}, 3);
  rt->startBackward(true);
  auto& ex = rt->executor(1, "test");
  ex.reduceGrad(at::ones({7}), 1, "test");  // padded slot of 9 > bucket of 4: grows to 9, full
  EXPECT_EQ(comm->reduce_scatters, 1);      // a full bucket is reduced at once
  ex.reduceGrad(at::full({2}, 3.0f), 3, "test");  // the other bucket: 3 of 4, waits for more
  EXPECT_EQ(comm->reduce_scatters, 1);
  ex.reduceGrad(at::full({5}, 2.0f), 2, "test");  // slot of 6 does not fit: flushes the second
  EXPECT_EQ(comm->reduce_scatters, 2);            // and takes 6 of the grown bucket's 9
  rt->reducer().flushAll();
  EXPECT_EQ(comm->reduce_scatters, 3);
  // Rank 2 holds elements [6, 9) of the 9-element padded gradient: one real value, then zeros.
  EXPECT_TRUE(at::equal(t1, at::tensor({1.0f, 0.0f, 0.0f})));
  // Rank 2 of the 5-element parameter: element 4 and one zero of padding.
  EXPECT_TRUE(at::equal(t2, at::tensor({2.0f, 0.0f})));
  // Rank 2 of the 2-element parameter: padding only.
  EXPECT_TRUE(at::equal(t3, at::tensor({0.0f})));
}

TEST(GradReducer, GrowingABucketAfterAFlushDoesNotWaitOnTheHost) {
  auto lanes = std::make_unique<CountingLanes>();
  CountingLanes* counting = lanes.get();
  RuntimeConfig cfg;
  cfg.reduce_bucket_size = 4;
  cfg.double_buffer = false;  // the flushed buffer is the one that must grow
  Runtime rt(std::move(lanes), std::make_unique<MirrorCommunicator>(0, 1), cfg);
  at::Tensor small = at::empty({3}), large = at::empty({9});
  rt.registerZ3Params({{1, {3}, at::zeros({3}), small, false, std::nullopt},
                       {2, {9}, at::zeros({9}), large, false, std::nullopt}});
  rt.registerGraph(1, {1, 2}, 3);
  rt.startBackward(true);
  auto& ex = rt.executor(1, "test");
  ex.reduceGrad(at::full({3}, 1.0f), 1, "test");
  ex.reduceGrad(at::arange(9, at::kFloat), 2, "test");  // flushes the first, then grows to 9
  rt.reducer().flushAll();
  EXPECT_EQ(counting->host_waits, 0);
  EXPECT_TRUE(at::equal(small, at::full({3}, 1.0f)));
  EXPECT_TRUE(at::equal(large, at::arange(9, at::kFloat)));
}

TEST_F(Reduction, GradientCopiesWaitForTheFlushAndThenLetGo) {
  make(/*rank=*/0, /*world=*/2, /*bucket=*/16);
  at::Tensor t1 = at::empty({2}), t2 = at::empty({3});
  rt->registerZ3Params({{1, {3}, at::zeros({2}), t1, false, std::nullopt},
                        {2, {6}, at::zeros({3}), t2, false, std::nullopt}});
  rt->registerGraph(1, {1, 2}, 3);
  rt->startBackward(true);
  auto& ex = rt->executor(1, "test");
  at::Tensor g1 = at::full({3}, 1.0f);
  at::Tensor g2 = at::arange(6, at::kFloat).view({2, 3}).t();  // strided: copied on its own
  const auto held_before = g1.storage().use_count();
  ex.reduceGrad(g1, 1, "test");
  ex.reduceGrad(g2, 2, "test");
  EXPECT_EQ(comm->reduce_scatters, 0);
  EXPECT_GT(g1.storage().use_count(), held_before);  // the task holds the gradient until the flush
  rt->reducer().flushAll();
  EXPECT_EQ(g1.storage().use_count(), held_before);  // and lets it go once copied
  // Mirrored ranks: each rank's half of the padded gradient, averaged over 2 equal contributions.
  EXPECT_TRUE(at::equal(t1, at::tensor({1.0f, 1.0f})));
  EXPECT_TRUE(at::equal(t2, at::tensor({0.0f, 3.0f, 1.0f})));  // g2 flattened: 0 3 1 4 2 5
}

// The reducer needs only the registry, lanes and communicator: ZeRO-1/2 gradients go to their
// owning ranks with one reduce each, and land in this rank's target.
TEST(GradReducer, ReducesReplicatedParamsToTheirOwnersWithoutARuntime) {
  DSParamRegistry registry;
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(/*rank=*/0, /*world=*/2);
  GradReducer reducer(registry, *lanes, comm, /*bucket_size=*/16, /*double_buffer=*/true);
  registry.add(ownedRangeParam(2));  // rank 0 owns [0, 2)
  reducer.enqueue(registry.get(3), at::arange(5, at::kFloat));
  EXPECT_EQ(reducer.pendingTasks(), 1u);
  reducer.flushAll();
  EXPECT_EQ(reducer.pendingTasks(), 0u);
  EXPECT_EQ(comm.roots, (std::vector<int>{0, 1}));
  EXPECT_TRUE(at::equal(registry.get(3).grad_target, at::tensor({0.0f, 1.0f})));
  EXPECT_TRUE(registry.get(3).has_acc_grad);
  reducer.releaseBuckets();
  EXPECT_EQ(reducer.bucketNumel(), 0);
}

// Hybrid sharding: each partition a rank receives from its shard group is averaged once more over
// the replica communicator, in its own group on the same lane.
TEST(GradReducer, HybridAveragesEachReceivedPartitionOverTheReplicas) {
  auto shard = std::make_unique<MirrorCommunicator>(/*rank=*/1, /*world=*/2);
  auto replica = std::make_unique<MirrorCommunicator>(/*rank=*/0, /*world=*/2);
  MirrorCommunicator* shard_comm = shard.get();
  MirrorCommunicator* replica_comm = replica.get();
  RuntimeConfig cfg;
  cfg.reduce_bucket_size = 64;
  Runtime rt(makeHostLanes(), std::move(shard), cfg, std::move(replica));
  at::Tensor t1 = at::empty({3}), t2 = at::empty({2});
  rt.registerZ3Params({{1, {5}, at::zeros({3}), t1, false, std::nullopt},
                       {2, {4}, at::zeros({2}), t2, false, std::nullopt}});
  rt.registerGraph(1, {1, 2}, 3);
  rt.startBackward(true);
  auto& ex = rt.executor(1, "test");
  ex.reduceGrad(at::arange(5, at::kFloat), 1, "test");
  ex.reduceGrad(at::full({4}, 2.0f), 2, "test");
  rt.reducer().flushAll();
  EXPECT_EQ(shard_comm->reduce_scatters, 2);
  EXPECT_EQ(replica_comm->all_reduced, (std::vector<int64_t>{3, 2}));  // one per partition, ppr each
  EXPECT_EQ(replica_comm->groups, 1);
  EXPECT_EQ(replica_comm->gathers + replica_comm->reduce_scatters + replica_comm->reduces, 0);
  // Rank 1 of the shard group holds [3, 6) of the 6-element padded gradient 0 1 2 3 4 (0).
  EXPECT_TRUE(at::equal(t1, at::tensor({3.0f, 4.0f, 0.0f})));
  EXPECT_TRUE(at::equal(t2, at::tensor({2.0f, 2.0f})));
  EXPECT_EQ(rt.world(), 2);  // parameters are partitioned over the shard group only
}

TEST(GradReducer, HybridZero12AllReducesOnlyTheOwnedPieces) {
  DSParamRegistry registry;
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(/*rank=*/1, /*world=*/2);
  MirrorCommunicator replicas(/*rank=*/1, /*world=*/3);
  GradReducer reducer(registry, *lanes, comm, /*bucket_size=*/16, /*double_buffer=*/true, &replicas);
  registry.add(ownedRangeParam(3));  // rank 1 owns [2, 5)
  reducer.enqueue(registry.get(3), at::arange(5, at::kFloat));
  reducer.flushAll();
  EXPECT_EQ(comm.roots, (std::vector<int>{0, 1}));
  EXPECT_EQ(replicas.all_reduced, (std::vector<int64_t>{3}));
  EXPECT_TRUE(at::equal(registry.get(3).grad_target, at::tensor({2.0f, 3.0f, 4.0f})));
}
