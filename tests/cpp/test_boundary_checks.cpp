// Checks at the runtime's boundary (issue 42 item 3): whole-device checks, the pinned-host-shard
// check, the collective trace's line format, and the runtime lock that serializes ops and control
// calls across threads (docs/design/runtime.md, "Checks at the boundary" and "Threads").
#include "fixtures.h"

#include <atomic>
#include <chrono>
#include <thread>

namespace dctest {

namespace {

const c10::Device kCuda0(c10::kCUDA, 0);
const c10::Device kCuda1(c10::kCUDA, 1);
const c10::Device kCpu(c10::kCPU);

}  // namespace

// A tensor on cuda:1 handed to a runtime on cuda:0 used to pass: only the device type was checked.
TEST(DeviceCheck, AnotherIndexOfTheSameTypeIsRefusedNamingBothDevices) {
  const std::string error = errorOf([] { checkSameDevice(kCuda1, kCuda0, "reduce_grad", "the gradient"); });
  EXPECT_NE(error.find("dc.reduce_grad: the gradient is on cuda:1"), std::string::npos) << error;
  EXPECT_NE(error.find("initialized for cuda:0"), std::string::npos) << error;
}

TEST(DeviceCheck, SameDeviceAndHostTensorsPass) {
  EXPECT_NO_THROW(checkSameDevice(kCuda0, kCuda0, "op", "x"));
  EXPECT_NO_THROW(checkSameDevice(kCuda1, kCuda1, "op", "x"));
  EXPECT_NO_THROW(checkSameDevice(kCpu, kCpu, "op", "x"));
  EXPECT_NO_THROW(checkSameDevice(c10::Device(c10::kCPU, 0), kCpu, "op", "x"));
}

TEST(DeviceCheck, AnotherTypeIsRefused) {
  const std::string error = errorOf([] { checkSameDevice(kCpu, kCuda0, "allgather_param", "the parameter input"); });
  EXPECT_NE(error.find("is on cpu but the deepcompile runtime was initialized for cuda:0"), std::string::npos)
      << error;
  EXPECT_ANY_THROW(checkSameDevice(kCuda0, kCpu, "op", "x"));
}

// Registration reports a shard on another device with both devices, on every rank.
TEST_F(RuntimeFixture, RegistrationNamesTheDeviceOfAMisplacedShard) {
  make(0, 1);
  at::Tensor meta_shard = at::empty({4}, at::TensorOptions().device(c10::kMeta));
  const std::string error = errorOf([&] {
    rt->registerZ3Params({{1, {4}, meta_shard, at::Tensor(), false, std::nullopt}});
  });
  EXPECT_NE(error.find("shard of ds id 1 is on meta, not on the runtime's device cpu"), std::string::npos) << error;
}

// A pageable host shard makes every gather's host-to-device copy synchronous (warned at
// set_host_shard); a pinned one, or a CPU runtime's, does not.
TEST(HostShardCheck, OnlyAPageableShardOfADeviceRuntimeBlocks) {
  EXPECT_TRUE(hostShardCopiesBlock(kCuda0, /*pinned=*/false));
  EXPECT_FALSE(hostShardCopiesBlock(kCuda0, /*pinned=*/true));
  EXPECT_FALSE(hostShardCopiesBlock(kCpu, /*pinned=*/false));
}

// Both communicators print the same line per collective under DC_DEBUG_COLLECTIVES=1.
TEST(CollectiveTrace, LineFormat) {
  EXPECT_EQ(formatCollectiveTrace(3, 12, "reduce-scatter", 4096),
            "[deepcompile rank 3] #12 reduce-scatter numel=4096\n");
}

// The lock is held by one thread at a time (ops on autograd's device thread, control calls on the
// main thread), and re-entered by the thread that holds it (the slot overloads call the others).
TEST(RuntimeLock, SerializesThreadsAndIsReentrant) {
  auto outer = lockRuntime();
  auto inner = lockRuntime();  // same thread: does not deadlock
  std::atomic<bool> other_got_it{true};
  std::thread other([&] { other_got_it = runtimeMutex().try_lock(); });
  other.join();
  EXPECT_FALSE(other_got_it) << "another thread entered the runtime while this one held it";
}

// A thread stuck inside the runtime (an op waiting in a collective whose peer is gone) must not
// make cleanup wait for ever: at the deadline the communicators are aborted without the lock,
// which ends the stuck call, and the shutdown then completes and empties the slot.
TEST(RuntimeLock, CleanupAbortsTheCommunicatorsOfARuntimeHeldByAStuckThread) {
  std::atomic<bool> aborted{false};
  RuntimeConfig cfg;
  cfg.reduce_bucket_size = 4;
  installRuntime(std::make_unique<Runtime>(makeHostLanes(), std::make_unique<AbortFlagCommunicator>(aborted), cfg));
  std::atomic<bool> holding{false};
  std::thread stuck([&] {
    auto lock = lockRuntime();
    holding = true;
    // "In a collective" until the communicator is aborted (then the call would raise and unwind).
    while (!aborted) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  while (!holding) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto start = std::chrono::steady_clock::now();
  destroyRuntime(0.2);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stuck.join();
  EXPECT_TRUE(aborted) << "the stuck thread's communicator was not aborted";
  EXPECT_FALSE(runtimeInitialized()) << "the runtime was left installed";
  EXPECT_GE(seconds, 0.2);
  EXPECT_LT(seconds, 5.0);
}

}  // namespace dctest
