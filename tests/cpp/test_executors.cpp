// Executors: ZeRO-3 gather/release bookkeeping and dtypes, ZeRO-1 accumulation and owners.
#include <deepcompile/runtime.h>
#include <deepcompile/z3_executor.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

namespace {

struct Executors : RuntimeFixture {};

}  // namespace

TEST_F(Executors, GatherReturnsFullParamAndReleaseFreesStorage) {
  make(/*rank=*/1, /*world=*/3);
  at::Tensor full = at::arange(7, at::kFloat).view({7});
  // Mirror semantics: every rank holds rank 1's shard, so the gathered padded buffer repeats it.
  at::Tensor shard = shardOf(full, 1, 3);
  rt->registerZ3Params({{5, {7}, shard, at::zeros({3}), false, std::nullopt}});
  rt->registerGraph(10, {5}, 3);
  Z3Executor& ex = rt->z3Executor(10, "test");
  at::Tensor out = ex.allgather(5, at::kBFloat16);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(out.sizes(), at::IntArrayRef({7}));
  EXPECT_TRUE(at::equal(out.narrow(0, 0, 3), shard.to(at::kBFloat16)));
  ex.wait(5);
  ex.release(5, 2);
  EXPECT_GT(out.storage().nbytes(), 0u);  // first of two releases keeps it
  ex.release(5, 2);
  EXPECT_EQ(out.storage().nbytes(), 0u);  // final release frees the padded storage itself
  EXPECT_FALSE(rt->registry().get(5).z3().valid);
  EXPECT_THROW(ex.wait(5), c10::Error);
}

TEST_F(Executors, ReleaseRejectsInconsistentUseCounts) {
  make(0, 2);
  rt->registerZ3Params({{1, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  rt->registerGraph(3, {1}, 3);
  Z3Executor& ex = rt->z3Executor(3, "test");
  ex.allgather(1, std::nullopt);
  ex.release(1, 3);
  EXPECT_THROW(ex.release(1, 2), c10::Error);
}

TEST_F(Executors, PersistentRegatherHonoursDtype) {
  make(0, 2);
  at::Tensor shard = at::full({2}, 1.5f);
  rt->registerZ3Params({{1, {3}, shard, at::Tensor(), false, std::nullopt}});
  rt->registerGraph(3, {1}, 3);
  rt->setPersistent(1, true);  // gathers in fp32 right away
  Z3Executor& ex = rt->z3Executor(3, "test");
  EXPECT_EQ(ex.allgather(1, std::nullopt).scalar_type(), at::kFloat);
  ex.release(1, 1);
  EXPECT_TRUE(rt->registry().get(1).z3().valid);  // persistent: not freed
  shard.fill_(2.5f);
  rt->invalidateAllGathered();
  at::Tensor again = ex.allgather(1, at::kBFloat16);
  EXPECT_EQ(again.scalar_type(), at::kBFloat16);
  EXPECT_EQ(again[0].item<float>(), 2.5f);
}

TEST_F(Executors, Fp32ShardGathersInItsGatherDtype) {
  make(0, 2);
  // An fp32 master shard of a bf16 parameter: 1/3 is not exact in bf16.
  at::Tensor shard = at::full({2}, 1.0f / 3.0f);
  Runtime::Z3ParamSpec spec{1, {3}, shard, at::Tensor(), false, std::nullopt, at::kBFloat16};
  rt->registerZ3Params({spec});
  rt->registerGraph(3, {1}, 3);
  EXPECT_EQ(rt->registry().get(1).z3().gather_dtype, at::kBFloat16);
  EXPECT_EQ(rt->registry().get(1).z3().shard.scalar_type(), at::kFloat);
  Z3Executor& ex = rt->z3Executor(3, "test");
  at::Tensor out = ex.allgather(1, std::nullopt);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(out, shard.narrow(0, 0, 1).repeat({3}).to(at::kBFloat16)));
  ex.release(1, 1);
  // An fp32 request sees the parameter's bf16-rounded value, not the unrounded master.
  at::Tensor wide = ex.allgather(1, at::kFloat);
  EXPECT_EQ(wide[0].item<float>(), shard.to(at::kBFloat16).to(at::kFloat)[0].item<float>());
  EXPECT_NE(wide[0].item<float>(), 1.0f / 3.0f);
  ex.release(1, 1);
  rt->setPersistent(1, true);  // gathers in bf16 right away
  ASSERT_TRUE(rt->registry().get(1).z3().gathered.defined());
  EXPECT_EQ(rt->registry().get(1).z3().gathered.scalar_type(), at::kBFloat16);
  const int gathers = comm->gathers;
  at::Tensor again = ex.allgather(1, std::nullopt);
  EXPECT_EQ(comm->gathers, gathers);  // served from the persistent buffer
  EXPECT_EQ(again.data_ptr(), rt->registry().get(1).z3().gathered.data_ptr());
  // A default gather dtype is the shard's own.
  rt->registerZ3Params({{2, {4}, at::ones({2}, at::kBFloat16), at::Tensor(), false, std::nullopt}});
  EXPECT_EQ(rt->registry().get(2).z3().gather_dtype, at::kBFloat16);
}

TEST_F(Executors, Zero1ReducesOnlyAtUpdateToOwners) {
  make(/*rank=*/1, /*world=*/2);
  // One 6-element parameter at offset 0 of a group split into partitions of 3.
  rt->registerZ12Param(4, {6}, at::zeros({6}), 0, 3);
  rt->registerGraph(1, {4}, 1);
  at::Tensor target = at::empty({3});
  rt->bindGradTarget(4, target, true);
  rt->startBackward(false);
  rt->executor(1, "test").reduceGrad(at::arange(6, at::kFloat), 4, "test");
  rt->reducer().flushAll();
  EXPECT_EQ(comm->reduces, 0);  // micro-step: accumulated locally only
  EXPECT_EQ(rt->registry().get(4).reduce_count, 1);  // but counted as received
  rt->startBackward(true);
  rt->executor(1, "test").reduceGrad(at::arange(6, at::kFloat), 4, "test");
  rt->reducer().flushAll();
  EXPECT_EQ(comm->reduces, 2);  // one reduce per owning rank
  EXPECT_EQ(comm->roots, (std::vector<int>{0, 1}));
  EXPECT_EQ(rt->registry().get(4).reduce_count, 2);
  // (2 * arange) pre-divided by 2 then summed over 2 mirrored ranks = 2 * arange; rank 1 owns [3, 6).
  EXPECT_TRUE(at::equal(target, at::tensor({6.0f, 8.0f, 10.0f})));
  rt->unbindGradTargets(std::nullopt);
  EXPECT_FALSE(rt->registry().get(4).grad_target.defined());
  rt->reducer().releaseBuckets();
  EXPECT_EQ(rt->reducer().bucketNumel(), 0);
}

// A graph keeps the ids it was registered with; when one of them is registered again for the
// other stage, the graph's ops raise an error naming the id and both stages instead of reading a
// layout the parameter no longer has.
TEST_F(Executors, Zero3OpsOnAParameterReRegisteredForZero12Fail) {
  make(0, 2);
  rt->registerZ3Params({{7, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  rt->registerGraph(3, {7}, 3);
  Z3Executor& ex = rt->z3Executor(3, "test");
  rt->registerZ12Param(7, {4}, at::ones({4}), 0, 2);
  const std::string mismatch = "ds id 7 is registered for ZeRO-1/2, not ZeRO-3";
  for (const std::string& msg : {errorOf([&] { ex.allgather(7, std::nullopt); }),
                                 errorOf([&] { ex.prefetch({7}, {at::kFloat}); }),
                                 errorOf([&] { ex.wait(7); }),
                                 errorOf([&] { ex.release(7, 1); }),
                                 errorOf([&] { ex.endBackward(true); })}) {
    EXPECT_NE(msg.find(mismatch), std::string::npos) << msg;
    EXPECT_NE(msg.find("graph 3"), std::string::npos) << msg;
  }
  EXPECT_EQ(comm->gathers, 0);
}

TEST_F(Executors, Zero1ReductionOfAParameterReRegisteredForZero3Fails) {
  make(0, 2);
  rt->registerZ12Param(4, {6}, at::zeros({6}), 0, 3);
  rt->registerGraph(1, {4}, 1);
  rt->registerGraph(2, {4}, 2);
  rt->registerZ3Params({{4, {6}, at::zeros({3}), at::zeros({3}), false, std::nullopt}});
  rt->startBackward(false);
  for (GraphId graph : {1, 2}) {
    const std::string msg = errorOf([&] { rt->executor(graph, "test").reduceGrad(at::ones({6}), 4, "reduce_grad"); });
    EXPECT_NE(msg.find("dc.reduce_grad: ds id 4 is registered for ZeRO-3, not ZeRO-1/2"), std::string::npos) << msg;
  }
  EXPECT_EQ(rt->reducer().pendingTasks(), 0u);  // nothing was queued
  EXPECT_EQ(rt->registry().get(4).reduce_count, 0);
}
