// Shared fixtures of the C++ tests: a loopback communicator, host lanes that count host waits,
// and a runtime built over them. Executors run in-process over these (world size 1, or a
// simulated world where every "rank" holds the same data), which exercises bucketing, flushing,
// accumulation and gather/release bookkeeping without a process group.
#pragma once

#include <deepcompile/communicator.h>
#include <deepcompile/lanes.h>
#include <deepcompile/runtime.h>

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace dctest {

using namespace deepcompile;

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
  void allReduce(const at::Tensor& buffer) override {
    all_reduced.push_back(buffer.numel());  // the average of equal buffers: the buffer itself
    // What it reads must be complete: the last reduce-scatter's or reduce's group has ended.
    all_reduce_after_group.push_back(groups);
  }
  CompletionPtr endGroup() override { return readyCompletion(); }
  std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) override {
    std::vector<int64_t> out;
    for (int r = 0; r < world_; ++r) out.insert(out.end(), values.begin(), values.end());
    return out;
  }
  int groups = 0, gathers = 0, reduce_scatters = 0, reduces = 0;
  std::vector<int> roots;
  std::vector<int64_t> all_reduced;           // numel of each all-reduce, in issue order
  std::vector<int> all_reduce_after_group;    // beginGroup count when each all-reduce was issued

 private:
  int rank_, world_;
};

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

// A world-of-one communicator whose collectives do nothing; it sets `aborted` when the runtime
// aborts it and, when `async_error` is not empty, reports that as its asynchronous error. The
// shutdown and cleanup tests use it to see that a stuck runtime's communicators get aborted.
class AbortFlagCommunicator final : public Communicator {
 public:
  explicit AbortFlagCommunicator(std::atomic<bool>& aborted, std::string async_error = {})
      : aborted_(aborted), async_(std::move(async_error)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "abort-flag"; }
  void beginGroup(Lane) override {}
  void allGather(const at::Tensor&, const at::Tensor&) override {}
  void reduceScatter(const at::Tensor&, const at::Tensor&) override {}
  void reduce(const at::Tensor&, int) override {}
  void allReduce(const at::Tensor&) override {}
  CompletionPtr endGroup() override { return readyCompletion(); }
  std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) override { return values; }
  std::string asyncError() override { return async_; }
  void abort() noexcept override { aborted_ = true; }

 private:
  std::atomic<bool>& aborted_;
  std::string async_;
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
};

// This rank's shard of `full`: the flattened parameter, zero-padded to a multiple of `world`.
inline at::Tensor shardOf(const at::Tensor& full, int rank, int world) {
  const int64_t ppr = ceilDiv(full.numel(), world);
  at::Tensor padded = at::zeros({ppr * world}, full.options());
  padded.narrow(0, 0, full.numel()).copy_(full.reshape({-1}));
  return padded.narrow(0, rank * ppr, ppr).clone();
}

// The message of the c10::Error `f` raises (fails the test when it raises none).
template <typename F>
std::string errorOf(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

inline at::Tensor cpuAlloc(int64_t n, at::ScalarType dtype) { return at::empty({n}, at::TensorOptions().dtype(dtype)); }

}  // namespace dctest
