// Lanes and completions. The device lanes go through c10's virtual device guard, so they work
// for CUDA without including CUDA headers (and keep this file cheap to compile).
#include <deepcompile/lanes.h>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace deepcompile {

const char* laneName(Lane lane) {
  switch (lane) {
    case Lane::AllGather: return "allgather";
    case Lane::ReduceScatter: return "reduce-scatter";
    case Lane::Copy: return "copy";
    case Lane::Offload: return "offload";
    case Lane::Reload: return "reload";
  }
  return "?";
}

namespace {

class ReadyCompletion final : public Completion {
 public:
  void blockStream(const c10::Stream&) override {}
  void hostWait() override {}
};

// An event recorded on a device stream.
class EventCompletion final : public Completion {
 public:
  EventCompletion(const c10::Stream& stream)
      : event_(stream.device_type(), c10::EventFlag::PYTORCH_DEFAULT) {
    event_.record(stream);
  }
  void blockStream(const c10::Stream& stream) override { event_.block(stream); }
  void hostWait() override { event_.synchronize(); }

 private:
  c10::Event event_;
};

class HostLanes final : public Lanes {
 public:
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  c10::Stream stream(Lane) const override { return c10::Stream(c10::Stream::DEFAULT, device()); }
  c10::Stream computeStream() const override { return stream(Lane::AllGather); }
  void waitCompute(Lane) override {}
  CompletionPtr record(Lane) override { return readyCompletion(); }
  void synchronize(Lane) override {}
  void synchronizeDevice() override {}
  void recordStream(const at::Tensor&, const c10::Stream&) override {}
};

class DeviceLanes final : public Lanes {
 public:
  explicit DeviceLanes(c10::Device device) : device_(device), guard_(device.type()) {
    TORCH_CHECK(device.has_index(), "deepcompile: device lanes need an explicit device index, got ", device);
    for (int i = 0; i < kNumLanes; ++i) {
      // High priority: communication should not queue behind long compute kernels.
      streams_.push_back(guard_.getStreamFromGlobalPool(device_, /*isHighPriority=*/true));
    }
  }
  c10::Device device() const override { return device_; }
  c10::Stream stream(Lane lane) const override { return streams_.at(static_cast<int>(lane)); }
  c10::Stream computeStream() const override { return guard_.getStream(device_); }
  void waitCompute(Lane lane) override {
    c10::Event event(device_.type(), c10::EventFlag::PYTORCH_DEFAULT);
    event.record(computeStream());
    event.block(stream(lane));
  }
  CompletionPtr record(Lane lane) override { return std::make_shared<EventCompletion>(stream(lane)); }
  void synchronize(Lane lane) override { guard_.synchronizeStream(stream(lane)); }
  bool idle(Lane lane) override { return guard_.queryStream(stream(lane)); }
  void synchronizeDevice() override { guard_.synchronizeDevice(device_.index()); }
  void recordStream(const at::Tensor& tensor, const c10::Stream& stream) override {
    if (tensor.defined() && tensor.device().type() == device_.type() && tensor.storage().data_ptr()) {
      guard_.recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
    }
  }

 private:
  c10::Device device_;
  c10::impl::VirtualGuardImpl guard_;
  std::vector<c10::Stream> streams_;
};

}  // namespace

CompletionPtr readyCompletion() {
  static const CompletionPtr ready = std::make_shared<ReadyCompletion>();
  return ready;
}

std::unique_ptr<Lanes> makeHostLanes() { return std::make_unique<HostLanes>(); }

std::unique_ptr<Lanes> makeDeviceLanes(c10::Device device) { return std::make_unique<DeviceLanes>(device); }

LaneScope::LaneScope(Lanes& lanes, Lane lane)
    : previous_(lanes.computeStream()), switched_(lanes.device().type() != c10::kCPU) {
  if (switched_) {
    c10::impl::VirtualGuardImpl guard(previous_.device_type());
    guard.exchangeStream(lanes.stream(lane));
  }
}

LaneScope::~LaneScope() {
  if (switched_) {
    c10::impl::VirtualGuardImpl guard(previous_.device_type());
    guard.exchangeStream(previous_);
  }
}

}  // namespace deepcompile
