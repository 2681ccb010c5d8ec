// Communicator over a c10d ProcessGroup (gloo on CPU). Collectives return c10d Work handles;
// whatever must happen after the communication (copying back from an fp32 staging buffer,
// taking this rank's chunk of an all-reduce) runs when the completion is first waited on.
#include <deepcompile/communicator.h>
#include <deepcompile/fault_injection.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

namespace deepcompile {

namespace {

// gloo's support for half types varies with the torch version; staging them in fp32 is exact
// for all-gathers and more precise for sums, so do it always.
bool needsStaging(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

class WorkCompletion final : public Completion {
 public:
  WorkCompletion(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<std::function<void()>> then,
                 std::vector<at::Tensor> keep_alive)
      : works_(std::move(works)), then_(std::move(then)), keep_alive_(std::move(keep_alive)) {}
  void blockStream(const c10::Stream&) override { hostWait(); }
  void hostWait() override {
    if (done_) {
      // A failed collective stays failed: its buffers were never filled, so every later wait
      // (a consumer, the shutdown) gets the error, and none waits on the works again.
      TORCH_CHECK(error_.empty(), "deepcompile: this collective failed earlier: ", error_);
      return;
    }
    try {
      faultPoint(FaultKind::CompletionWait, "a collective's completion");
      for (auto& work : works_) work->wait();
      for (auto& action : then_) action();
    } catch (const std::exception& e) {
      error_ = e.what();
      if (error_.empty()) error_ = "unknown error";
      settle();
      finish();
      throw;
    }
    finish();
  }

 private:
  // After a failure: the works not yet waited for may still read or write the kept buffers in
  // gloo's threads; let each end (its own error dropped: the first one is reported) before the
  // buffers go, so that nobody frees memory a collective still uses.
  void settle() noexcept {
    for (auto& work : works_) {
      try {
        work->wait();
      } catch (...) {
      }
    }
  }

  void finish() {
    works_.clear();
    then_.clear();
    keep_alive_.clear();
    done_ = true;
  }

  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<std::function<void()>> then_;
  std::vector<at::Tensor> keep_alive_;  // buffers gloo reads or writes until the work is done
  bool done_ = false;
  std::string error_;  // why the wait failed, once it has
};

class ProcessGroupCommunicator final : public Communicator {
 public:
  explicit ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group) : group_(std::move(group)) {
    TORCH_CHECK(group_, "deepcompile: a process group is required");
  }
  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  const char* name() const override { return "process-group"; }
  bool carries(at::ScalarType dtype) const override { return isWireDtype(dtype); }

  void beginGroup(Lane) override {
    TORCH_CHECK(!in_group_, "deepcompile: communicator groups cannot nest");
    in_group_ = true;
  }

  void allGather(const at::Tensor& send, const at::Tensor& recv) override {
    enterCollective("all-gather");
    TORCH_CHECK(recv.numel() == send.numel() * size(), "deepcompile: all-gather of ", send.numel(),
                " elements per rank needs ", send.numel() * size(), " output elements, got ", recv.numel());
    trace("allgather", send.numel());
    bytes_.all_gather += nbytes(recv);
    at::Tensor in = stage(send);
    // An in-place gather (send is our own chunk of recv): gloo must not read and write one buffer.
    if (in.is_alias_of(recv)) in = in.clone();
    at::Tensor out = needsStaging(recv) ? at::empty({recv.numel()}, recv.options().dtype(at::kFloat)) : recv;
    std::vector<at::Tensor> inputs{in.contiguous()};
    std::vector<std::vector<at::Tensor>> outputs{out.view({-1}).chunk(size())};
    issue(group_->allgather(outputs, inputs), {inputs[0], out});
    if (!out.is_same(recv)) then_.push_back([out, recv]() { recv.view({-1}).copy_(out); });
  }

  void reduceScatter(const at::Tensor& send, const at::Tensor& recv) override {
    enterCollective("reduce-scatter");
    TORCH_CHECK(send.numel() == recv.numel() * size(), "deepcompile: reduce-scatter into ", recv.numel(),
                " elements needs ", recv.numel() * size(), " input elements, got ", send.numel());
    trace("reduce-scatter", send.numel());
    bytes_.reduce_scatter += nbytes(send);
    // gloo has no reduce-scatter on every torch version: all-reduce a scratch copy, keep our chunk.
    at::Tensor scratch = send.to(needsStaging(send) ? at::kFloat : send.scalar_type(), /*non_blocking=*/false,
                                 /*copy=*/true);
    divideBySize(scratch);  // gloo has no average: divide first, then sum
    std::vector<at::Tensor> tensors{scratch};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    issue(group_->allreduce(tensors, opts), {scratch});
    const int64_t n = recv.numel();
    const int64_t offset = n * rank();
    then_.push_back([scratch, recv, n, offset]() { recv.view({-1}).copy_(scratch.narrow(0, offset, n)); });
  }

  void reduce(const at::Tensor& buffer, int root) override {
    enterCollective("reduce");
    trace("reduce", buffer.numel());
    bytes_.reduce += nbytes(buffer);
    averageInPlace(buffer, [&](std::vector<at::Tensor>& tensors) {
      c10d::ReduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      opts.rootRank = root;
      return group_->reduce(tensors, opts);
    });
  }

  void allReduce(const at::Tensor& buffer) override {
    enterCollective("all-reduce");
    trace("all-reduce", buffer.numel());
    bytes_.all_reduce += nbytes(buffer);
    averageInPlace(buffer, [&](std::vector<at::Tensor>& tensors) {
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      return group_->allreduce(tensors, opts);
    });
  }

  CompletionPtr endGroup() override {
    checkInGroup();
    in_group_ = false;
    auto done = std::make_shared<WorkCompletion>(std::move(works_), std::move(then_), std::move(keep_alive_));
    works_.clear();
    then_.clear();
    keep_alive_.clear();
    return done;
  }

  void abortGroup() noexcept override {
    in_group_ = false;
    // The collectives already issued may be matched by the other ranks (a failure every rank
    // hits alike): they run to the end in gloo's threads. Their follow-up copies are dropped
    // (what they would deliver belongs to the abandoned group); the works and their buffers are
    // kept for settleAborted, so no wait happens during unwinding.
    try {
      for (auto& work : works_) aborted_.push_back(std::move(work));
      for (auto& buffer : keep_alive_) aborted_keep_alive_.push_back(std::move(buffer));
    } catch (...) {
      // Out of memory while unwinding: the works are dropped unwaited; gloo's own references
      // keep their buffers alive until they ran.
    }
    works_.clear();
    then_.clear();
    keep_alive_.clear();
  }

  void settleAborted() override {
    std::vector<c10::intrusive_ptr<c10d::Work>> works = std::move(aborted_);
    std::vector<at::Tensor> buffers = std::move(aborted_keep_alive_);  // released once the works ran
    aborted_.clear();
    aborted_keep_alive_.clear();
    for (auto& work : works) {
      try {
        work->wait();
      } catch (const std::exception& e) {
        // Not rethrown: the step is being abandoned for the error that aborted the group.
        std::fprintf(stderr, "[deepcompile rank %d] a collective of an aborted group failed: %s\n", rank(), e.what());
      }
    }
  }

  std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) override {
    trace("allgather-ints", static_cast<int64_t>(values.size()));
    at::Tensor in = at::tensor(values, at::kLong);
    at::Tensor out = at::empty({static_cast<int64_t>(values.size()) * size()}, at::kLong);
    std::vector<at::Tensor> inputs{in};
    std::vector<std::vector<at::Tensor>> outputs{out.chunk(size())};
    group_->allgather(outputs, inputs)->wait();
    return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  }

 private:
  void checkInGroup() const { TORCH_CHECK(in_group_, "deepcompile: collective issued outside beginGroup/endGroup"); }
  // Every collective of a group starts here: the group must be open, and a test may make it fail.
  void enterCollective(const char* what) const {
    checkInGroup();
    faultPoint(FaultKind::Collective, what);
  }
  void divideBySize(const at::Tensor& t) const {
    if (size() > 1) t.div_(size());
  }
  // A contiguous tensor gloo can communicate; the original when it already is one.
  static at::Tensor stage(const at::Tensor& t) {
    if (needsStaging(t)) return t.to(at::kFloat);
    return t.is_contiguous() ? t : t.contiguous();
  }
  void issue(c10::intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> buffers) {
    works_.push_back(std::move(work));
    for (auto& b : buffers) keep_alive_.push_back(std::move(b));
  }
  // reduce and allReduce: `sum` issues a SUM over the staged copy of `buffer`; gloo has no
  // average, so the copy is divided first; the result lands back in `buffer` when the group ends
  // (staging made a copy) or in place.
  template <typename Sum>
  void averageInPlace(const at::Tensor& buffer, Sum&& sum) {
    at::Tensor staged = stage(buffer);
    divideBySize(staged);
    std::vector<at::Tensor> tensors{staged};
    issue(sum(tensors), {staged});
    if (!staged.is_same(buffer)) then_.push_back([staged, buffer]() { buffer.copy_(staged); });
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool in_group_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<std::function<void()>> then_;
  std::vector<at::Tensor> keep_alive_;
  std::vector<c10::intrusive_ptr<c10d::Work>> aborted_;  // issued in aborted groups (settleAborted)
  std::vector<at::Tensor> aborted_keep_alive_;            // their buffers
};

}  // namespace

std::unique_ptr<Communicator> makeProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_unique<ProcessGroupCommunicator>(std::move(group));
}

}  // namespace deepcompile
