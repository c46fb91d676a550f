#pragma once
// Internal to src/comm: where a group's transports are made ([Note: transports] in
// transport.h). ProcessGroup asks for them when it makes a group; this is the one place
// that knows every kind of transport and what decides between them.
#include <cstdint>
#include <memory>

#include "comm/device/cuda_backend.h"
#include "transport.h"

namespace fsdp::comm::detail {

class ShmChannel;
class ShmEngine;

/// Slots of 256 KiB: big enough that the per-fragment handshake (two atomics, maybe a futex
/// wake) is noise next to the copy, small enough that a fragment is still in cache when its
/// reader takes it.
constexpr int64_t kDefaultShmSlotBytes = int64_t(256) << 10;

/// What init_process_group decided for the transports of its world, once (from
/// InitOptions and the environment); sub-groups inherit it.
struct TransportConfig {
  /// InitOptions::shared_memory, and FSDP_SHARED_MEMORY is not "0".
  bool shared_memory = false;
  /// Slot size of the shared-memory rings: FSDP_SHM_SLOT_KIB (tuning; every rank must
  /// agree, or the group falls back to Gloo naming the mismatch), else the default.
  int64_t shm_slot_bytes = kDefaultShmSlotBytes;
  /// Fragments that lie in the exchange arena are read by peers in place (FSDP_SHM_DIRECT
  /// is not "0"; [Note: exchange arena] in shm_arena.cpp).
  bool shm_direct = true;
  /// InitOptions::check_collectives, or FSDP_CHECK_COLLECTIVES=1 (collective_check.h).
  bool check_collectives = false;
};

/// The transports of every group of one world. init_process_group makes one with what it
/// decided; every sub-group shares its parent's, so the groups of a world share one
/// shared-memory progress engine ([Note: shared-memory progress engine] in shm_engine.h).
class TransportFactory {
 public:
  /// Makes the world's progress engine when `config` turns shared memory on.
  TransportFactory(TransportConfig config, CudaCollectiveBackend cuda);
  /// The factory of a group no init_process_group made (the public ProcessGroup
  /// constructor): Gloo for CPU tensors, no CUDA tensors, default settings.
  static const std::shared_ptr<const TransportFactory>& plain();

  const TransportConfig& config() const { return config_; }
  const CudaCollectiveBackend& cuda() const { return cuda_; }

  /// The transport of the CPU tensors of the new group `g` (its peer table set): shared
  /// memory when every member runs on this host and maps the others' segments, else Gloo.
  /// Collective over `g` when shared memory is on: the members agree through its store.
  std::shared_ptr<Transport> host_transport(const GroupDesc& g) const;
  /// The transport of a group's CUDA tensors; nullptr when the world moves none.
  std::shared_ptr<Transport> device_transport() const;

 private:
  TransportConfig config_;
  CudaCollectiveBackend cuda_;
  std::shared_ptr<ShmEngine> engine_;  // nullptr when shared memory is off
};

/// The shared-memory channel behind `t`, or nullptr when `t` is not a shared-memory transport.
const std::shared_ptr<ShmChannel>& shm_channel_of(const Transport* t);

}  // namespace fsdp::comm::detail
