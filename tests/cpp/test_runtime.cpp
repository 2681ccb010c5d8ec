// The runtime: registration checks, accumulation windows, end of backward and error reporting.
#include <deepcompile/runtime.h>

#include "fixtures.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>

using namespace deepcompile;
using namespace dctest;

namespace {

struct RuntimeTest : RuntimeFixture {};

}  // namespace

TEST_F(RuntimeTest, NonFloatingGatherDtypeIsRejectedWithItsId) {
  make(0, 2);
  Runtime::Z3ParamSpec spec{9, {4}, at::ones({2}), at::Tensor(), false, std::nullopt, at::kInt};
  try {
    rt->registerZ3Params({spec});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("gather dtype of ds id 9"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(rt->registry().contains(9));
}

// dc.end_backward flushes the last reductions and orders the compute stream after them on the
// device; the host goes on to queue the optimizer step. DeepSpeed synchronises the host there.
TEST(RuntimeHostWaits, EndOfBackwardDoesNotWaitOnTheHost) {
  auto lanes = std::make_unique<CountingLanes>();
  CountingLanes* counting = lanes.get();
  RuntimeConfig cfg;
  cfg.reduce_bucket_size = 4;
  Runtime rt(std::move(lanes), std::make_unique<MirrorCommunicator>(0, 1), cfg);
  at::Tensor target = at::empty({3});
  rt.registerZ3Params({{1, {3}, at::zeros({3}), target, false, std::nullopt}});
  rt.registerGraph(1, {1}, 3);
  rt.startBackward(true);
  rt.executor(1, "test").reduceGrad(at::full({3}, 2.0f), 1, "test");
  rt.endBackward(1, /*release_reduce_buckets=*/true);
  EXPECT_EQ(counting->host_waits, 0);
  EXPECT_EQ(rt.reducer().pendingTasks(), 0u);
  EXPECT_TRUE(at::equal(target, at::full({3}, 2.0f)));
}

TEST_F(RuntimeTest, AccumulationWindowsAndSharedParams) {
  make(0, 1);
  at::Tensor target = at::empty({2});
  rt->registerZ3Params({{1, {2}, at::zeros({2}), target, false, std::nullopt}});
  rt->registerGraph(1, {1}, 3);
  rt->registerGraph(2, {1}, 3);  // the same parameter in a second graph
  auto step = [&](bool update, std::vector<std::pair<GraphId, float>> grads) {
    rt->startBackward(update);
    for (auto& g : grads) rt->executor(g.first, "test").reduceGrad(at::full({2}, g.second), 1, "test");
    rt->reducer().flushAll();
  };
  step(false, {{1, 1.0f}});
  step(true, {{1, 2.0f}, {2, 3.0f}});  // two graphs, one window: 1 + 2 + 3
  EXPECT_EQ(target[0].item<float>(), 6.0f);
  step(false, {{2, 4.0f}});  // a new window starts by overwriting
  EXPECT_EQ(target[0].item<float>(), 4.0f);
}

TEST_F(RuntimeTest, ErrorsForBadIdsAndStages) {
  make(0, 2);
  rt->registerZ3Params({{1, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  rt->registerZ12Param(2, {4}, at::ones({4}), 0, 2);
  EXPECT_THROW(rt->executor(99, "test"), c10::Error);                 // unknown graph
  EXPECT_THROW(rt->registerGraph(1, {77}, 3), c10::Error);            // unknown ds id
  EXPECT_THROW(rt->registerGraph(1, {2}, 3), c10::Error);             // ZeRO-1/2 param in a ZeRO-3 graph
  rt->registerGraph(1, {1}, 3);
  rt->registerGraph(2, {2}, 2);
  EXPECT_THROW(rt->z3Executor(2, "test"), c10::Error);                // wrong stage
  EXPECT_THROW(rt->z3Executor(1, "test").allgather(2, std::nullopt), c10::Error);  // id not in graph
  EXPECT_THROW(rt->registerZ3Params({{3, {4}, at::ones({3}), at::Tensor(), false, std::nullopt}}), c10::Error);
  EXPECT_THROW(rt->bindGradTarget(2, at::empty({5}), true), c10::Error);  // wrong target size
}

// The debug count behind reduce_counts(): gradients accepted per parameter in the current
// accumulation window, from any graph, reset only when a backward opens a new window.
TEST_F(RuntimeTest, ReduceCountsFollowTheAccumulationWindow) {
  make(0, 1);
  rt->registerZ3Params({{1, {2}, at::zeros({2}), at::empty({2}), false, std::nullopt},
                        {2, {2}, at::zeros({2}), at::empty({2}), false, std::nullopt}});
  rt->registerGraph(1, {1, 2}, 3);
  rt->registerGraph(2, {1}, 3);
  auto count = [&](DsId id) { return rt->registry().get(id).reduce_count; };
  rt->startBackward(false);
  rt->executor(1, "test").reduceGrad(at::ones({2}), 1, "test");
  EXPECT_EQ(count(1), 1);
  EXPECT_EQ(count(2), 0);
  rt->startBackward(true);  // the second micro-step of the same window
  rt->executor(1, "test").reduceGrad(at::ones({2}), 1, "test");
  rt->executor(2, "test").reduceGrad(at::ones({2}), 1, "test");
  EXPECT_THROW(rt->executor(1, "test").reduceGrad(at::ones({3}), 1, "test"), c10::Error);  // not accepted
  EXPECT_EQ(count(1), 3);
  rt->endBackward(1, /*release_reduce_buckets=*/false);
  rt->bindGradTarget(1, at::empty({2}), true);  // rebinding a target does not open a window
  EXPECT_EQ(count(1), 3);
  rt->startBackward(false);  // the update step closed the window: this backward opens a new one
  EXPECT_EQ(count(1), 0);
  rt->executor(2, "test").reduceGrad(at::ones({2}), 1, "test");
  EXPECT_EQ(count(1), 1);
  EXPECT_EQ(count(2), 0);
}

TEST_F(RuntimeTest, ProfilingEndOfBackwardFlushesNothing) {
  make(0, 1);
  rt->registerZ3Params({{1, {2}, at::zeros({2}), at::empty({2}), false, std::nullopt}});
  rt->registerGraph(1, {1}, 3);
  rt->startBackward(true);
  rt->executor(1, "test").reduceGrad(at::ones({2}), 1, "test");
  rt->setProfiling(true);
  EXPECT_TRUE(rt->profiling());
  rt->endBackward(1, /*release_reduce_buckets=*/false);
  EXPECT_EQ(rt->reducer().pendingTasks(), 1u);
  rt->setProfiling(false);
  rt->endBackward(1, /*release_reduce_buckets=*/true);
  EXPECT_EQ(rt->reducer().pendingTasks(), 0u);
}

// abort_step after a backward that failed part-way: its queued reductions are dropped, release
// counts forgotten, gathered buffers freed, and the next backward opens a new window.
TEST_F(RuntimeTest, AbortStepStartsTheNextStepClean) {
  make(0, 1);
  rt->registerZ3Params({{1, {2}, at::zeros({2}), at::empty({2}), false, std::nullopt}});
  rt->registerGraph(1, {1}, 3);
  rt->startBackward(false);
  rt->executor(1, "test").reduceGrad(at::ones({2}), 1, "test");
  Z3Executor& ex = rt->z3Executor(1, "test");
  ex.allgather(1, std::nullopt);
  ex.release(1, 3);  // the first of three uses; the step fails before the others
  EXPECT_EQ(rt->reducer().pendingTasks(), 1u);
  rt->abortStep();
  EXPECT_EQ(rt->reducer().pendingTasks(), 0u);
  EXPECT_EQ(rt->reducer().bucketNumel(), 0);
  EXPECT_FALSE(ex.holdsGather(1));
  EXPECT_FALSE(rt->registry().get(1).z3("test").isGathered());
  EXPECT_EQ(rt->registry().get(1).reduce_count, 0);
  rt->startBackward(false);  // a new window: the first reduction overwrites the target
  EXPECT_FALSE(rt->registry().get(1).has_acc_grad);
}

// The ZeRO-3 control calls name the id and both stages for a ZeRO-1/2 parameter; the calls over
// all parameters only visit ZeRO-3 ones.
TEST_F(RuntimeTest, Zero3ControlCallsRejectZero12Params) {
  make(0, 2);
  rt->registerZ12Param(2, {4}, at::ones({4}), 0, 2);
  rt->registerZ3Params({{1, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  const std::string mismatch = "ds id 2 is registered for ZeRO-1/2, not ZeRO-3";
  EXPECT_NE(errorOf([&] { rt->setPersistent(2, true); }).find("set_persistent: " + mismatch), std::string::npos);
  EXPECT_NE(errorOf([&] { rt->invalidateGathered(2); }).find("invalidate_gathered_param: " + mismatch),
            std::string::npos);
  EXPECT_NE(errorOf([&] { rt->registerGraph(5, {1, 2}, 3); }).find(mismatch), std::string::npos);
  EXPECT_NE(errorOf([&] { rt->registerGraph(5, {2, 1}, 2); })
                .find("ds id 1 is registered for ZeRO-3, not ZeRO-1/2"),
            std::string::npos);
  rt->setPersistent(1, true);
  EXPECT_TRUE(rt->registry().get(1).z3().isGathered());
  rt->invalidateAllGathered();  // skips the ZeRO-1/2 parameter
  EXPECT_FALSE(rt->registry().get(1).z3().valid);
  EXPECT_TRUE(rt->registry().get(1).z3().gathered.defined());  // persistent: buffer kept
  rt->clearAllGathered();  // skips the ZeRO-1/2 parameter and keeps the persistent one
  EXPECT_TRUE(rt->registry().get(1).z3().gathered.defined());
  rt->setPersistent(1, false);
  EXPECT_FALSE(rt->registry().get(1).z3().gathered.defined());
  // ZeRO-1/2 state stays with its layout: the replicated parameter and where it sits.
  EXPECT_EQ(rt->registry().get(2).z12().partition_numel, 2);
}

TEST_F(RuntimeTest, HostShardsAreCheckedAndCleared) {
  make(0, 2);
  rt->registerZ3Params({{3, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  const Z3Layout& z3 = rt->registry().get(3).z3();
  EXPECT_NE(errorOf([&] { rt->setHostShard(3, at::ones({3})); }).find("ds id 3"), std::string::npos);
  EXPECT_NE(errorOf([&] { rt->setHostShard(3, at::ones({2}, at::kDouble)); }).find("Float with 2 elements"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { rt->setHostShard(3, at::ones({4}).as_strided({2}, {2})); })
                .find("contiguous"),
            std::string::npos);
  EXPECT_FALSE(z3.host_shard.defined());
  at::Tensor host = at::full({2}, 5.0f);
  rt->setHostShard(3, host);
  EXPECT_EQ(z3.host_shard.data_ptr(), host.data_ptr());
  rt->setHostShard(3, std::nullopt);
  EXPECT_FALSE(z3.host_shard.defined());
  // Re-registration starts from a fresh layout: no host shard carried over.
  rt->setHostShard(3, host);
  rt->registerZ3Params({{3, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  EXPECT_FALSE(rt->registry().get(3).z3().host_shard.defined());
  EXPECT_EQ(rt->registry().get(3).z3().ds_id, 3);
}

TEST_F(RuntimeTest, SetHostShardRejectsZero12Params) {
  make(0, 1);
  rt->registerZ12Param(8, {2}, at::ones({2}), 0, 2);
  EXPECT_NE(errorOf([&] { rt->setHostShard(8, at::ones({2})); }).find("not ZeRO-3"), std::string::npos);
}

// hpZ through the runtime: secondary copies exist for parameters that are not persistent, a
// release keeps one, the next gather reads it over the secondary communicator, and every
// invalidation (the shards changed) sends gathers back to the whole group.
TEST(RuntimeHpz, ReleaseKeepsTheSecondaryCopyUntilTheShardsChange) {
  auto primary = std::make_unique<MirrorCommunicator>(0, 4);
  auto secondary = std::make_unique<MirrorCommunicator>(0, 2);
  MirrorCommunicator* world = primary.get();
  MirrorCommunicator* node = secondary.get();
  Runtime rt(makeHostLanes(), std::move(primary), RuntimeConfig{}, nullptr, std::move(secondary));
  rt.registerZ3Params({{1, {8}, at::ones({2}), at::Tensor(), false, std::nullopt},
                       {2, {8}, at::ones({2}), at::Tensor(), /*persistent=*/true, std::nullopt}});
  EXPECT_EQ(rt.secondaryBytes(), 4 * 4);  // id 1 only: 8 / 2 fp32 elements
  rt.registerGraph(1, {1}, 3);
  Z3Executor& ex = rt.z3Executor(1, "test");
  const int before = world->gathers;
  ex.allgather(1, std::nullopt);
  EXPECT_EQ(world->gathers, before + 1);
  ex.release(1, 1);
  EXPECT_TRUE(rt.registry().get(1).z3("test").secondary_valid);
  ex.allgather(1, std::nullopt);  // e.g. the backward's gather
  EXPECT_EQ(world->gathers, before + 1);
  EXPECT_EQ(node->gathers, 1);
  ex.release(1, 1);
  rt.invalidateAllGathered();  // after the optimizer step
  EXPECT_FALSE(rt.registry().get(1).z3("test").secondary_valid);
  ex.allgather(1, std::nullopt);
  EXPECT_EQ(world->gathers, before + 2);
  ex.release(1, 1);
  rt.invalidateGathered(1);
  EXPECT_FALSE(rt.registry().get(1).z3("test").secondary_valid);
  rt.setPersistent(1, true);  // persistent: no secondary copy
  EXPECT_EQ(rt.secondaryBytes(), 0);
  rt.setPersistent(2, false);
  EXPECT_EQ(rt.secondaryBytes(), 4 * 4);
}

namespace {

// Lanes whose work never finishes until the communicator is aborted: a collective waiting for a
// peer that is gone.
class StuckLanes final : public Lanes {
 public:
  explicit StuckLanes(const std::atomic<bool>& aborted) : aborted_(aborted) {}
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Stream stream(Lane) const override { return c10::Stream(c10::Stream::DEFAULT, device()); }
  c10::Stream computeStream() const override { return stream(Lane::AllGather); }
  void waitCompute(Lane) override {}
  CompletionPtr record(Lane) override { return readyCompletion(); }
  void synchronize(Lane) override { EXPECT_TRUE(aborted_) << "a blocking wait on a lane that never finishes"; }
  bool idle(Lane) override { return aborted_; }
  void synchronizeDevice() override {}
  void recordStream(const at::Tensor&, const c10::Stream&) override {}

 private:
  const std::atomic<bool>& aborted_;
};

std::string shutdownOfStuckRuntime(const std::string& async_error, double timeout_s, double* seconds) {
  std::atomic<bool> aborted{false};
  RuntimeConfig cfg;
  cfg.reduce_bucket_size = 4;
  Runtime rt(std::make_unique<StuckLanes>(aborted), std::make_unique<AbortFlagCommunicator>(aborted, async_error), cfg);
  const auto start = std::chrono::steady_clock::now();
  std::string error = rt.shutdown(timeout_s);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(aborted) << "the communicator was not aborted";
  EXPECT_EQ(rt.shutdown(timeout_s), "") << "a second shutdown found work left";
  return error;
}

}  // namespace

// A shutdown whose collectives never finish (a peer gone) used to wait for ever; it now aborts
// the communicators at the deadline and reports it.
TEST(RuntimeShutdown, AbortsTheCommunicatorsAtTheDeadline) {
  double seconds = 0;
  const std::string error = shutdownOfStuckRuntime("", 0.2, &seconds);
  EXPECT_NE(error.find("still in flight after"), std::string::npos) << error;
  EXPECT_GE(seconds, 0.2);
  EXPECT_LT(seconds, 5.0);
}

// An asynchronous communicator error ends the wait at once, whatever the deadline.
TEST(RuntimeShutdown, AbortsAtOnceOnAnAsynchronousError) {
  double seconds = 0;
  const std::string error = shutdownOfStuckRuntime("unhandled system error (2)", 600.0, &seconds);
  EXPECT_NE(error.find("asynchronous error (unhandled system error (2))"), std::string::npos) << error;
  EXPECT_LT(seconds, 5.0);
}
