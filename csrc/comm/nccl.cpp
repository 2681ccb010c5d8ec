// Communicator over a private NCCL communicator, issuing collectives on the runtime's lanes.
// A c10d ProcessGroup does not let us choose its stream; a raw communicator does, which is what
// lets gathers and reductions overlap compute on dedicated streams. The price is that these
// collectives are invisible to c10d's watchdog, so every NCCL result is checked here.
#include <deepcompile/communicator.h>
#include <deepcompile/fault_injection.h>
#include <deepcompile/lanes.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <nccl.h>

#include <cstring>
#include <string>

#define DC_NCCL_CHECK(call, what)                                                                   \
  do {                                                                                              \
    ncclResult_t dc_result = (call);                                                                \
    TORCH_CHECK(dc_result == ncclSuccess, "deepcompile: NCCL ", what, " failed: ", ncclGetErrorString(dc_result), \
                " (", static_cast<int>(dc_result), ")");                                             \
  } while (0)

namespace deepcompile {

namespace {

ncclDataType_t toNccl(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    default: TORCH_CHECK(false, "deepcompile: NCCL cannot communicate dtype ", dtype);
  }
}

cudaStream_t rawStream(const c10::Stream& stream) {
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device, Lanes& lanes)
      : device_(device), lanes_(lanes), rank_(group->getRank()), size_(group->getSize()) {
    TORCH_CHECK(device.is_cuda() && device.has_index(), "deepcompile: NCCL needs a CUDA device with an index");
    c10::cuda::CUDAGuard guard(device_);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (rank_ == 0) DC_NCCL_CHECK(ncclGetUniqueId(&id), "ncclGetUniqueId");
    at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(bytes.data_ptr(), &id, sizeof(id));
    // The group is the user's (NCCL or gloo); both accept a CUDA tensor for broadcast.
    std::vector<at::Tensor> tensors{bytes.to(device_)};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    group->broadcast(tensors, opts)->wait();
    bytes = tensors[0].cpu();
    std::memcpy(&id, bytes.data_ptr(), sizeof(id));
    DC_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
  }

  ~NcclCommunicator() override {
    if (comm_ != nullptr && !aborted_) {
      // Destroy waits for outstanding operations; a failed destroy at teardown is not actionable.
      ncclCommDestroy(comm_);
      comm_ = nullptr;
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }
  bool carries(at::ScalarType dtype) const override { return isWireDtype(dtype); }

  std::string asyncError() override {
    if (comm_ == nullptr || aborted_) return {};
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return "ncclCommGetAsyncError failed";
    if (state == ncclSuccess || state == ncclInProgress) return {};
    return std::string(ncclGetErrorString(state)) + " (" + std::to_string(static_cast<int>(state)) + ")";
  }

  void abort() noexcept override {
    if (comm_ == nullptr || aborted_) return;
    aborted_ = true;
    // Returns once NCCL's kernels of this communicator have stopped; the communicator's
    // resources are freed by it (no ncclCommDestroy afterwards).
    (void)ncclCommAbort(comm_);
  }

  void beginGroup(Lane lane) override {
    TORCH_CHECK(!in_group_, "deepcompile: communicator groups cannot nest");
    lane_ = lane;
    stream_ = rawStream(lanes_.stream(lane));
    DC_NCCL_CHECK(ncclGroupStart(), "ncclGroupStart");
    in_group_ = true;
  }

  void allGather(const at::Tensor& send, const at::Tensor& recv) override {
    checkCall(send, recv);
    TORCH_CHECK(recv.numel() == send.numel() * size_, "deepcompile: all-gather of ", send.numel(),
                " elements per rank needs ", send.numel() * size_, " output elements, got ", recv.numel());
    bytes_.all_gather += nbytes(recv);
    trace("allgather", send.numel());
    DC_NCCL_CHECK(ncclAllGather(send.data_ptr(), recv.data_ptr(), send.numel(), toNccl(send.scalar_type()), comm_,
                                stream_),
                  "AllGather");
  }

  void reduceScatter(const at::Tensor& send, const at::Tensor& recv) override {
    checkCall(send, recv);
    TORCH_CHECK(send.numel() == recv.numel() * size_, "deepcompile: reduce-scatter into ", recv.numel(),
                " elements needs ", recv.numel() * size_, " input elements, got ", send.numel());
    bytes_.reduce_scatter += nbytes(send);
    trace("reduce-scatter", send.numel());
    DC_NCCL_CHECK(ncclReduceScatter(send.data_ptr(), recv.data_ptr(), recv.numel(), toNccl(send.scalar_type()),
                                    averageOp(), comm_, stream_),
                  "ReduceScatter");
  }

  void reduce(const at::Tensor& buffer, int root) override {
    checkCall(buffer, buffer);
    bytes_.reduce += nbytes(buffer);
    trace("reduce", buffer.numel());
    DC_NCCL_CHECK(ncclReduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(), toNccl(buffer.scalar_type()),
                             averageOp(), root, comm_, stream_),
                  "Reduce");
  }

  void allReduce(const at::Tensor& buffer) override {
    checkCall(buffer, buffer);
    bytes_.all_reduce += nbytes(buffer);
    trace("all-reduce", buffer.numel());
    DC_NCCL_CHECK(ncclAllReduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(), toNccl(buffer.scalar_type()),
                                averageOp(), comm_, stream_),
                  "AllReduce");
  }

  void abortGroup() noexcept override {
    if (!in_group_) return;
    in_group_ = false;
    // ncclGroupStart/End nest per thread: a group left open would swallow every later NCCL call
    // of this thread into it. Ending it launches what was queued, which the other ranks may
    // match (a failure every rank hits alike); the buffers involved were allocated on this lane,
    // so the allocator reuses them only after those collectives. An error here is not actionable
    // during unwinding; the next collective reports a broken communicator.
    (void)ncclGroupEnd();
  }

  CompletionPtr endGroup() override {
    TORCH_CHECK(in_group_, "deepcompile: endGroup without beginGroup");
    in_group_ = false;
    DC_NCCL_CHECK(ncclGroupEnd(), "ncclGroupEnd");
    return lanes_.record(lane_);
  }

  std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) override {
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor in = at::tensor(values, at::kLong).to(device_);
    at::Tensor out = at::empty({static_cast<int64_t>(values.size()) * size_}, in.options());
    // Issued on the reduce lane, which must first see the host-to-device copy of `in`.
    lanes_.waitCompute(Lane::ReduceScatter);
    const CommBytes counted = bytes_;  // a control exchange: not part of the counted traffic
    trace("allgather-ints", static_cast<int64_t>(values.size()));  // traced as itself, like gloo's
    const bool tracing = trace_;
    trace_ = false;
    try {
      CommGroup group(*this, Lane::ReduceScatter);
      allGather(in, out);
      group.end();
    } catch (...) {
      trace_ = tracing;
      throw;
    }
    trace_ = tracing;
    bytes_ = counted;
    lanes_.synchronize(Lane::ReduceScatter);
    at::Tensor host = out.cpu();
    return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  }

 private:
  // The average of one rank is a copy: ncclSum lets NCCL do it as a memcpy, while ncclAvg would
  // launch a scaling kernel.
  ncclRedOp_t averageOp() const { return size_ == 1 ? ncclSum : ncclAvg; }
  void checkCall(const at::Tensor& a, const at::Tensor& b) const {
    TORCH_CHECK(in_group_, "deepcompile: collective issued outside beginGroup/endGroup");
    faultPoint(FaultKind::Collective, "an NCCL collective");
    TORCH_CHECK(a.is_cuda() && b.is_cuda(), "deepcompile: NCCL collectives need CUDA tensors");
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "deepcompile: NCCL collectives need contiguous tensors");
    TORCH_CHECK(a.scalar_type() == b.scalar_type(), "deepcompile: NCCL collective with mismatched dtypes ",
                a.scalar_type(), " and ", b.scalar_type());
  }

  c10::Device device_;
  Lanes& lanes_;
  int rank_;
  int size_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  bool in_group_ = false;
  Lane lane_ = Lane::AllGather;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> makeNcclCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device,
                                                   Lanes& lanes) {
  return std::make_unique<NcclCommunicator>(std::move(group), device, lanes);
}

}  // namespace deepcompile
