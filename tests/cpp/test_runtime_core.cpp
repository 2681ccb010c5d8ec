// GoogleTest for the runtime pieces that need no process group. Executors run over a loopback
// communicator (world size 1, or a simulated world where every "rank" holds the same data), which
// exercises bucketing, flushing, accumulation and gather/release bookkeeping in-process.
#include <deepcompile/reduce_bucket.h>
#include <deepcompile/registry.h>
#include <deepcompile/runtime.h>
#include <deepcompile/lanes.h>

#include <gtest/gtest.h>

using namespace deepcompile;

namespace {

// Every rank is assumed to hold this rank's tensors: all-gather tiles them, reductions (averages)
// leave them as they are. Enough to check layouts and bookkeeping without a process group.
class MirrorCommunicator final : public Communicator {
 public:
  MirrorCommunicator(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int size() const override { return world_; }
  const char* name() const override { return "mirror"; }
  void beginGroup(Lane) override { ++groups; }
  void allGather(const at::Tensor& send, const at::Tensor& recv) override {
    ++gathers;
    for (int r = 0; r < world_; ++r) recv.narrow(0, r * send.numel(), send.numel()).copy_(send.reshape({-1}));
  }
  void reduceScatter(const at::Tensor& send, const at::Tensor& recv) override {
    ++reduce_scatters;
    recv.copy_(send.narrow(0, rank_ * recv.numel(), recv.numel()));  // the average of equal tensors
  }
  void reduce(const at::Tensor& buffer, int root) override {
    ++reduces;
    roots.push_back(root);  // the average of equal buffers: the buffer itself
  }
  CompletionPtr endGroup() override { return readyCompletion(); }
  std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) override {
    std::vector<int64_t> out;
    for (int r = 0; r < world_; ++r) out.insert(out.end(), values.begin(), values.end());
    return out;
  }
  int groups = 0, gathers = 0, reduce_scatters = 0, reduces = 0;
  std::vector<int> roots;

 private:
  int rank_, world_;
};

struct RuntimeFixture : ::testing::Test {
  MirrorCommunicator* comm = nullptr;
  std::unique_ptr<Runtime> rt;
  void make(int rank, int world, int64_t bucket = 1000, bool double_buffer = true) {
    auto c = std::make_unique<MirrorCommunicator>(rank, world);
    comm = c.get();
    RuntimeConfig cfg;
    cfg.reduce_bucket_size = bucket;
    cfg.double_buffer = double_buffer;
    rt = std::make_unique<Runtime>(makeHostLanes(), std::move(c), cfg);
  }
  at::Tensor shardOf(const at::Tensor& full, int rank, int world) {
    const int64_t ppr = ceilDiv(full.numel(), world);
    at::Tensor padded = at::zeros({ppr * world}, full.options());
    padded.narrow(0, 0, full.numel()).copy_(full.reshape({-1}));
    return padded.narrow(0, rank * ppr, ppr).clone();
  }
};

at::Tensor cpuAlloc(int64_t n, at::ScalarType dtype) { return at::empty({n}, at::TensorOptions().dtype(dtype)); }

}  // namespace

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

TEST(ReduceBucket, SlotsFlushAndGrow) {
  ReduceBucket bucket(8, at::kFloat, cpuAlloc);
  EXPECT_FALSE(bucket.allocated());  // lazily allocated
  EXPECT_FALSE(bucket.shouldFlush(100));  // an empty bucket never needs a flush
  at::Tensor a = bucket.allocate(5);
  EXPECT_EQ(a.numel(), 5);
  EXPECT_TRUE(bucket.shouldFlush(4));
  EXPECT_FALSE(bucket.shouldFlush(3));
  EXPECT_THROW(bucket.allocate(4), c10::Error);
  EXPECT_THROW(bucket.reserve(20), c10::Error);  // cannot grow with pending slots
  bucket.reset();
  bucket.reserve(20);
  EXPECT_EQ(bucket.capacity(), 20);
  EXPECT_EQ(bucket.allocate(20).numel(), 20);
}

TEST(ReduceBucket, DoubleBufferAlternatesAndClears) {
  DoubleBufferedReduceBucket buckets(4, /*double_buffer=*/true, cpuAlloc);
  ReduceBucket* first = &buckets.current(at::kFloat);
  first->allocate(2);
  buckets.swap(at::kFloat, readyCompletion());
  ReduceBucket* second = &buckets.current(at::kFloat);
  EXPECT_NE(first, second);
  EXPECT_EQ(first->offset(), 0);
  EXPECT_TRUE(first->last_use != nullptr);
  second->allocate(1);
  buckets.current(at::kBFloat16).allocate(1);
  EXPECT_EQ(buckets.allocatedNumel(), 12);  // two float buffers + one bf16 buffer of 4
  buckets.swap(at::kFloat, readyCompletion());
  EXPECT_EQ(&buckets.current(at::kFloat), first);
  buckets.clear();
  EXPECT_EQ(buckets.allocatedNumel(), 0);
}

TEST(ReduceBucket, SingleBufferKeepsSameBucket) {
  DoubleBufferedReduceBucket buckets(4, /*double_buffer=*/false, cpuAlloc);
  ReduceBucket* first = &buckets.current(at::kFloat);
  buckets.swap(at::kFloat, readyCompletion());
  EXPECT_EQ(&buckets.current(at::kFloat), first);
}

TEST(HostLanes, CompletionsAreReadyAndScopesAreNoops) {
  auto lanes = makeHostLanes();
  EXPECT_TRUE(lanes->device().is_cpu());
  auto done = lanes->record(Lane::ReduceScatter);
  done->hostWait();
  { LaneScope scope(*lanes, Lane::Copy); }
  lanes->synchronize(Lane::AllGather);
  EXPECT_STREQ(laneName(Lane::Reload), "reload");
}

TEST_F(RuntimeFixture, GatherReturnsFullParamAndReleaseFreesStorage) {
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
  EXPECT_FALSE(rt->registry().get(5).valid);
  EXPECT_THROW(ex.wait(5), c10::Error);
}

TEST_F(RuntimeFixture, ReleaseRejectsInconsistentUseCounts) {
  make(0, 2);
  rt->registerZ3Params({{1, {4}, at::ones({2}), at::Tensor(), false, std::nullopt}});
  rt->registerGraph(3, {1}, 3);
  Z3Executor& ex = rt->z3Executor(3, "test");
  ex.allgather(1, std::nullopt);
  ex.release(1, 3);
  EXPECT_THROW(ex.release(1, 2), c10::Error);
}

TEST_F(RuntimeFixture, PersistentRegatherHonoursDtype) {
  make(0, 2);
  at::Tensor shard = at::full({2}, 1.5f);
  rt->registerZ3Params({{1, {3}, shard, at::Tensor(), false, std::nullopt}});
  rt->registerGraph(3, {1}, 3);
  rt->setPersistent(1, true);  // gathers in fp32 right away
  Z3Executor& ex = rt->z3Executor(3, "test");
  EXPECT_EQ(ex.allgather(1, std::nullopt).scalar_type(), at::kFloat);
  ex.release(1, 1);
  EXPECT_TRUE(rt->registry().get(1).valid);  // persistent: not freed
  shard.fill_(2.5f);
  rt->invalidateAllGathered();
  at::Tensor again = ex.allgather(1, at::kBFloat16);
  EXPECT_EQ(again.scalar_type(), at::kBFloat16);
  EXPECT_EQ(again[0].item<float>(), 2.5f);
}

TEST_F(RuntimeFixture, Fp32ShardGathersInItsGatherDtype) {
  make(0, 2);
  // An fp32 master shard of a bf16 parameter: 1/3 is not exact in bf16.
  at::Tensor shard = at::full({2}, 1.0f / 3.0f);
  Runtime::Z3ParamSpec spec{1, {3}, shard, at::Tensor(), false, std::nullopt, at::kBFloat16};
  rt->registerZ3Params({spec});
  rt->registerGraph(3, {1}, 3);
  EXPECT_EQ(rt->registry().get(1).gather_dtype, at::kBFloat16);
  EXPECT_EQ(rt->registry().get(1).data.scalar_type(), at::kFloat);
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
  ASSERT_TRUE(rt->registry().get(1).gathered.defined());
  EXPECT_EQ(rt->registry().get(1).gathered.scalar_type(), at::kBFloat16);
  const int gathers = comm->gathers;
  at::Tensor again = ex.allgather(1, std::nullopt);
  EXPECT_EQ(comm->gathers, gathers);  // served from the persistent buffer
  EXPECT_EQ(again.data_ptr(), rt->registry().get(1).gathered.data_ptr());
  // A default gather dtype is the shard's own.
  rt->registerZ3Params({{2, {4}, at::ones({2}, at::kBFloat16), at::Tensor(), false, std::nullopt}});
  EXPECT_EQ(rt->registry().get(2).gather_dtype, at::kBFloat16);
}

TEST_F(RuntimeFixture, NonFloatingGatherDtypeIsRejectedWithItsId) {
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

TEST_F(RuntimeFixture, Zero3ReduceOverflowsBucketsAndZeroesPadding) {
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

// Host lanes whose completions count host waits: the reduce path must order buffer reuse on the
// lanes (blockStream), never by blocking the host.
class CountingLanes final : public Lanes {
 public:
  struct Counted final : Completion {
    explicit Counted(int& waits) : waits_(waits) {}
    void blockStream(const c10::Stream&) override {}
    void hostWait() override { ++waits_; }
    int& waits_;
  };
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Stream stream(Lane) const override { return c10::Stream(c10::Stream::DEFAULT, device()); }
  c10::Stream computeStream() const override { return stream(Lane::AllGather); }
  void waitCompute(Lane) override {}
  CompletionPtr record(Lane) override { return std::make_shared<Counted>(host_waits); }
  void synchronize(Lane) override { ++host_waits; }
  void synchronizeDevice() override { ++host_waits; }
  void recordStream(const at::Tensor&, const c10::Stream&) override {}
  int host_waits = 0;  // completions waited on and lanes synchronised by the host
};

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

// dc.end_backward flushes the last reductions and orders the compute stream after them on the
// device; the host goes on to queue the optimizer step. DeepSpeed synchronises the host there.
TEST(GradReducer, EndOfBackwardDoesNotWaitOnTheHost) {
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

TEST_F(RuntimeFixture, GradientCopiesWaitForTheFlushAndThenLetGo) {
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

TEST_F(RuntimeFixture, AccumulationWindowsAndSharedParams) {
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

TEST_F(RuntimeFixture, Zero1ReducesOnlyAtUpdateToOwners) {
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
  rt->startBackward(true);
  rt->executor(1, "test").reduceGrad(at::arange(6, at::kFloat), 4, "test");
  rt->reducer().flushAll();
  EXPECT_EQ(comm->reduces, 2);  // one reduce per owning rank
  EXPECT_EQ(comm->roots, (std::vector<int>{0, 1}));
  // (2 * arange) pre-divided by 2 then summed over 2 mirrored ranks = 2 * arange; rank 1 owns [3, 6).
  EXPECT_TRUE(at::equal(target, at::tensor({6.0f, 8.0f, 10.0f})));
  rt->unbindGradTargets(std::nullopt);
  EXPECT_FALSE(rt->registry().get(4).grad_target.defined());
  rt->reducer().releaseBuckets();
  EXPECT_EQ(rt->reducer().bucketNumel(), 0);
}

TEST_F(RuntimeFixture, ErrorsForBadIdsAndStages) {
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
