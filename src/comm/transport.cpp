// See [Note: transports] in transport.h.
#include "transport.h"

#include "comm/gloo/gloo_transport.h"
#include "comm/shm/shm_channel.h"
#include "comm/shm/shm_transport.h"

namespace fsdp::comm::detail {

std::shared_ptr<Transport> make_transport(const ProcessGroup& g, const TransportConfig& config,
                                          const std::shared_ptr<ShmEngine>& engine) {
  auto gloo = std::make_shared<GlooTransport>(engine);
  if (!config.shared_memory || !engine) return gloo;
  auto channel = make_shm_channel(g, engine, config.shm_slot_bytes, config.shm_direct);
  if (!channel) return gloo;  // some member on another host, or no segments: Gloo throughout
  return std::make_shared<ShmTransport>(std::move(channel), std::move(gloo));
}

}  // namespace fsdp::comm::detail
