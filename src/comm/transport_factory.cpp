// See [Note: transports] in transport.h.
#include "transport_factory.h"

#include "comm/device/device_transport.h"
#include "comm/gloo/gloo_transport.h"
#include "comm/shm/shm_channel.h"
#include "comm/shm/shm_engine.h"
#include "comm/shm/shm_transport.h"

namespace fsdp::comm::detail {

TransportFactory::TransportFactory(TransportConfig config, CudaCollectiveBackend cuda)
    : config_(config), cuda_(cuda) {
  if (config_.shared_memory) engine_ = std::make_shared<ShmEngine>();
}

const std::shared_ptr<const TransportFactory>& TransportFactory::plain() {
  static const auto factory = std::make_shared<const TransportFactory>(TransportConfig{}, CudaCollectiveBackend{});
  return factory;
}

std::shared_ptr<Transport> TransportFactory::host_transport(const GroupDesc& g) const {
  auto gloo = std::make_shared<GlooTransport>(engine_);
  if (!config_.shared_memory || !engine_) return gloo;
  auto channel = make_shm_channel(g, engine_, config_.shm_slot_bytes, config_.shm_direct);
  if (!channel) return gloo;  // some member on another host, or no segments: Gloo throughout
  return std::make_shared<ShmTransport>(std::move(channel), std::move(gloo));
}

std::shared_ptr<Transport> TransportFactory::device_transport() const { return make_device_transport(cuda_); }

const std::shared_ptr<ShmChannel>& shm_channel_of(const Transport* t) {
  static const std::shared_ptr<ShmChannel> none;
  const auto* shm = dynamic_cast<const ShmTransport*>(t);
  return shm ? shm->channel() : none;
}

}  // namespace fsdp::comm::detail
