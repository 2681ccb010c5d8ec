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

namespace {

// Two ranks' worth of tiling, like MirrorCommunicator, but the `fail_at`-th all-gather throws:
// an error inside an open group. Records how each group ended.
class FailingCommunicator final : public Communicator {
 public:
  explicit FailingCommunicator(int fail_at) : fail_at_(fail_at) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  const char* name() const override { return "failing"; }
  void beginGroup(Lane) override {
    TORCH_CHECK(!open, "groups cannot nest");
    open = true;
  }
  void allGather(const at::Tensor& send, const at::Tensor& recv) override {
    TORCH_CHECK(++gathers != fail_at_, "all-gather failed on purpose");
    for (int r = 0; r < 2; ++r) recv.narrow(0, r * send.numel(), send.numel()).copy_(send.reshape({-1}));
  }
  void reduceScatter(const at::Tensor&, const at::Tensor&) override {}
  void reduce(const at::Tensor&, int) override {}
  void allReduce(const at::Tensor&) override {}
  CompletionPtr endGroup() override {
    open = false;
    ++ended;
    return readyCompletion();
  }
  void abortGroup() noexcept override {
    open = false;
    ++aborted;
  }
  std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) override { return values; }
  bool open = false;
  int gathers = 0, ended = 0, aborted = 0;

 private:
  int fail_at_;
};

}  // namespace

// An exception inside a gather group aborts the group (the next one opens) and leaves no
// parameter of it valid or holding a buffer: a wait must never return on an unfilled buffer.
TEST(Gather, AFailedGroupIsAbortedAndLeavesNoParameterValid) {
  auto lanes = makeHostLanes();
  FailingCommunicator comm(/*fail_at=*/2);
  DSParam a = z3Param(1, 3, 2, 1.5f), b = z3Param(2, 4, 2, 2.5f);
  EXPECT_THROW(launchGathers(*lanes, comm, {&a.z3(), &b.z3()}, {at::kFloat, at::kFloat}), c10::Error);
  EXPECT_EQ(comm.aborted, 1);
  EXPECT_EQ(comm.ended, 0);
  for (DSParam* p : {&a, &b}) {
    EXPECT_FALSE(p->z3().valid) << "ds id " << p->id;
    EXPECT_FALSE(p->z3().gathered.defined()) << "ds id " << p->id;
    EXPECT_EQ(p->z3().gather_done, nullptr) << "ds id " << p->id;
  }
  launchGathers(*lanes, comm, {&a.z3()}, {at::kFloat});
  EXPECT_EQ(comm.ended, 1);
  EXPECT_TRUE(a.z3().valid);
  EXPECT_TRUE(at::equal(a.gatheredView(), at::full({3}, 1.5f)));
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

// ---- Parameter offload: the host shard as the gather source.

namespace {

// Host lanes that call themselves a GPU's (so the gather path takes its device branch) and log
// which lanes completions were recorded on; their streams stay the CPU's, so nothing needs CUDA.
class LoggingDeviceLanes final : public Lanes {
 public:
  c10::Device device() const override { return c10::Device(c10::kCUDA, 0); }
  c10::Stream stream(Lane) const override { return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)); }
  c10::Stream computeStream() const override { return stream(Lane::AllGather); }
  void waitCompute(Lane) override {}
  CompletionPtr record(Lane lane) override {
    recorded.push_back(lane);
    return readyCompletion();
  }
  void synchronize(Lane) override {}
  void synchronizeDevice() override {}
  void recordStream(const at::Tensor&, const c10::Stream&) override {}
  std::vector<Lane> recorded;
};

}  // namespace

TEST(GatherHostShard, AHostShardIsReadInsteadOfTheFreedDeviceShard) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(0, 2);
  DSParam p = z3Param(4, 3, 2, 1.0f, at::kBFloat16);
  Z3Layout& z3 = p.z3();
  z3.host_shard = at::full({2}, 2.5f);
  z3.shard.storage().unsafeGetStorageImpl()->reset();  // offloaded: no bytes behind it
  ASSERT_FALSE(shardHasStorage(z3.shard));
  launchGathers(*lanes, comm, {&z3}, {at::kBFloat16});
  EXPECT_TRUE(at::equal(p.gatheredView(), at::full({3}, 2.5f, at::kBFloat16)));
  // A private copy in another dtype reads it too, rounded through the gather dtype.
  at::Tensor copy = gatherPrivateCopy(*lanes, comm, z3, at::kFloat);
  EXPECT_TRUE(at::equal(copy, at::full({4}, 2.5f)));
}

TEST(GatherHostShard, WhileSetItWinsOverADeviceShardThatIsBeingReloaded) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(0, 1);
  DSParam p = z3Param(5, 2, 1, 1.0f);
  Z3Layout& z3 = p.z3();
  z3.host_shard = at::full({2}, 3.0f);  // the value; the device shard holds stale bytes
  launchGathers(*lanes, comm, {&z3}, {at::kFloat});
  EXPECT_TRUE(at::equal(p.gatheredView(), at::full({2}, 3.0f)));
  freeGathered(*lanes, z3);
  z3.host_shard = at::Tensor();  // reloaded: the device shard is the value again
  launchGathers(*lanes, comm, {&z3}, {at::kFloat});
  EXPECT_TRUE(at::equal(p.gatheredView(), at::full({2}, 1.0f)));
}

TEST(GatherHostShard, AnEmptyShardWithoutHostShardRaisesBeforeAnyCollective) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(0, 2);
  DSParam ok = z3Param(1, 4, 2, 1.0f), offloaded = z3Param(7, 4, 2, 1.0f);
  offloaded.z3().shard.storage().unsafeGetStorageImpl()->reset();
  const std::string message = errorOf([&] { launchGathers(*lanes, comm, {&ok.z3(), &offloaded.z3()}, {at::kFloat, at::kFloat}); });
  EXPECT_NE(message.find("ds id 7"), std::string::npos) << message;
  EXPECT_NE(message.find("no host shard"), std::string::npos) << message;
  EXPECT_EQ(comm.groups, 0);  // no group opened: no rank is left inside a collective
  EXPECT_FALSE(ok.z3().valid || offloaded.z3().valid);
  EXPECT_NE(errorOf([&] { gatherPrivateCopy(*lanes, comm, offloaded.z3(), at::kFloat); }).find("ds id 7"),
            std::string::npos);
}

TEST(GatherHostShard, OnADeviceTheGatherWaitsForTheOffloadLaneAndStagesACopy) {
  LoggingDeviceLanes lanes;
  MirrorCommunicator comm(0, 2);
  DSParam resident = z3Param(1, 2, 2, 1.0f), offloaded = z3Param(2, 2, 2, 1.0f);
  offloaded.z3().host_shard = at::full({1}, 4.0f);
  launchGathers(lanes, comm, {&resident.z3()}, {at::kFloat});
  EXPECT_TRUE(lanes.recorded.empty());  // nothing to wait for without a host shard
  launchGathers(lanes, comm, {&resident.z3(), &offloaded.z3()}, {at::kFloat, at::kFloat});
  ASSERT_EQ(lanes.recorded.size(), 1u);  // once per group, not per parameter
  EXPECT_EQ(lanes.recorded[0], Lane::Offload);
  EXPECT_TRUE(at::equal(offloaded.gatheredView(), at::full({2}, 4.0f)));
  // The staging copy is a buffer of its own on the device side, not the host tensor itself.
  at::Tensor source;
  {
    LaneScope scope(lanes, Lane::AllGather);
    source = gatherSource(lanes, offloaded.z3());
  }
  EXPECT_NE(source.data_ptr(), offloaded.z3().host_shard.data_ptr());
  EXPECT_TRUE(at::equal(source, offloaded.z3().host_shard));
}

TEST(GatherHostShard, ShardStorageCheckCoversOffsetsAndEmptyParameters) {
  at::Tensor base = at::zeros({6});
  EXPECT_TRUE(shardHasStorage(base.narrow(0, 3, 3)));
  EXPECT_TRUE(shardHasStorage(at::zeros({0})));  // a 0-element parameter's shard has no bytes to need
  at::Tensor view = base.narrow(0, 3, 3);
  base.storage().unsafeGetStorageImpl()->set_nbytes(4 * 4);  // shorter than the view needs
  EXPECT_FALSE(shardHasStorage(view));
  EXPECT_FALSE(shardHasStorage(at::Tensor()));
}

// hpZ: a parameter whose secondary copy is current is gathered from it over the secondary group;
// the others go over the whole group, as two groups.
TEST(Gather, HpzReadsACurrentSecondaryCopyOverTheSecondaryGroup) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(/*rank=*/1, /*world=*/4);
  MirrorCommunicator node(/*rank=*/1, /*world=*/2);
  DSParam a = z3Param(1, 6, 4, 1.0f), b = z3Param(2, 6, 4, 2.0f);  // padded to 8, 4 per secondary rank
  provideSecondary(*lanes, node, a.z3(), true);
  provideSecondary(*lanes, node, b.z3(), true);
  ASSERT_EQ(a.z3().secondary.numel(), 4);
  EXPECT_FALSE(a.z3().secondary_valid);  // nothing kept yet: gathers read the shards
  launchGathers(*lanes, comm, {&a.z3(), &b.z3()}, {at::kFloat, at::kFloat}, &node);
  EXPECT_EQ(comm.groups, 1);
  EXPECT_EQ(node.groups, 0);
  // Released after a use: this rank's chunk of the secondary group (elements 4..7) is kept.
  a.z3().gathered.copy_(at::arange(8, at::kFloat));
  keepSecondary(*lanes, node, a.z3());
  EXPECT_TRUE(a.z3().secondary_valid);
  EXPECT_TRUE(at::equal(a.z3().secondary, at::arange(4, 8, at::kFloat)));
  freeGathered(*lanes, a.z3());
  EXPECT_TRUE(a.z3().secondary_valid);  // freeing the gathered buffer keeps the secondary copy
  launchGathers(*lanes, comm, {&a.z3(), &b.z3()}, {at::kFloat, at::kFloat}, &node);
  EXPECT_EQ(comm.groups, 2);  // b
  EXPECT_EQ(node.groups, 1);  // a
  EXPECT_EQ(node.gathers, 1);
  EXPECT_TRUE(at::equal(a.z3().gathered, at::arange(4, 8, at::kFloat).repeat({2})));  // tiled by the mirror
  // Dropping it (a persistent parameter needs none) sends the next gather over the whole group.
  freeGathered(*lanes, a.z3());
  provideSecondary(*lanes, node, a.z3(), false);
  EXPECT_FALSE(a.z3().secondary.defined() || a.z3().secondary_valid);
  launchGathers(*lanes, comm, {&a.z3()}, {at::kFloat}, &node);
  EXPECT_EQ(comm.groups, 3);
  EXPECT_EQ(node.groups, 1);
}

TEST(Gather, HpzKeepsOnlyABufferInTheGatherDtype) {
  auto lanes = makeHostLanes();
  MirrorCommunicator comm(0, 2), node(0, 2);
  DSParam p = z3Param(1, 4, 2, 1.0f);  // gathered as fp32
  provideSecondary(*lanes, node, p.z3(), true);
  launchGathers(*lanes, comm, {&p.z3()}, {at::kBFloat16});  // another dtype was asked for
  keepSecondary(*lanes, node, p.z3());
  EXPECT_FALSE(p.z3().secondary_valid);  // a bf16 rounding is not the parameter's value
  freeGathered(*lanes, p.z3());
  keepSecondary(*lanes, node, p.z3());  // nothing gathered: nothing to keep
  EXPECT_FALSE(p.z3().secondary_valid);
}
