// [Note: groups and stores]
// One key-value store per job serves every rendezvous: rank 0 serves a TCPStore
// (or torchrun's agent serves it, or a FileStore on a shared path), and every
// process group lives under its own key prefix inside it:
//   fsdp/init/...            world-size agreement and the peer table (host, pid)
//   fsdp/pg/world/...        the world group's Gloo rendezvous
//   fsdp/pg/world/sub<k>/... the k-th sub-group created from the world group
// Sub-groups are numbered by a per-group counter that every rank advances on every
// new_subgroup call, members or not, so all ranks agree on the prefixes without
// talking to each other. This is why sub-groups must be created in the same order
// on every rank (as in torch.distributed.new_group).
#include "fsdp/comm/process_group.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/device/cuda_backend.h"
#include "comm/store_bytes.h"
#include "flight_recorder.h"
#include "group_desc.h"
#include "route.h"
#include "transport_factory.h"

namespace fsdp::comm {

using detail::Peer;

namespace {

bool is_loopback(const std::string& addr) { return detail::is_loopback_address(addr); }

/// The address this rank's Gloo device listens on, chosen as make_gloo_device chooses it
/// ("" when Gloo picks it: a GLOO_SOCKET_IFNAME without an address).
std::string gloo_address(const LaunchEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) return detail::interface_address(ifname);
  if (is_loopback(env.master_addr)) return "127.0.0.1";
  return detail::local_route_to(env.master_addr, env.master_port, env.rank).address;
}

/// Fails at once, with the fix, when a rank on another host advertises a loopback address:
/// every connection to it would reach this host instead, and Gloo would wait out the whole
/// timeout. Reads the peer table of phase 3 of init_process_group.
void check_no_remote_loopback(const std::vector<std::string>& hosts, const std::vector<std::string>& addrs,
                              int rank) {
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    if (hosts[r] == hosts[rank] || !is_loopback(addrs[r])) continue;
    TORCH_CHECK(false, "fsdp: rank ", rank, " (on ", hosts[rank], "): rank ", r, " on host ", hosts[r],
                " advertises the loopback address ", addrs[r], " to Gloo, which no other host can reach; "
                "on ", hosts[r], " unset GLOO_SOCKET_IFNAME or set it to the interface that reaches "
                "MASTER_ADDR, and give MASTER_ADDR as that host's routable address, not localhost");
  }
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const LaunchEnv& env) {
  // GLOO_SOCKET_IFNAME is read here, where the device is made, rather than in InitOptions:
  // it is Gloo's and torch.distributed's own switch, with the same meaning for every
  // program on the machine (ours, Python peers, torchrun), and the device is made once per
  // world, in init_process_group (its sub-groups reuse it; only a group built directly
  // from the public constructor makes its own in new_subgroup).
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return ::c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  // A job whose rendezvous is on loopback runs on one machine: bind Gloo there too,
  // which also works in sandboxes whose hostname does not resolve.
  if (is_loopback(env.master_addr)) {
    return ::c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  // Otherwise bind to the address this host uses to reach the master (see route.h), not to
  // what the hostname resolves to: that is loopback on hosts missing from DNS.
  const detail::LocalRoute route = detail::local_route_to(env.master_addr, env.master_port, env.rank);
  return ::c10d::ProcessGroupGloo::createDeviceForHostname(route.address);
}

// The transport settings of a world: InitOptions and two documented user switches from
// the environment, read once per world here rather than where they are used.
detail::TransportConfig transport_config(const InitOptions& options, int rank) {
  detail::TransportConfig config;
  const char* shm_env = std::getenv("FSDP_SHARED_MEMORY");
  config.shared_memory = options.shared_memory() && !(shm_env && std::string(shm_env) == "0");
  if (const char* v = std::getenv("FSDP_SHM_SLOT_KIB")) {
    char* end = nullptr;
    const long long kib = std::strtoll(v, &end, 10);
    TORCH_CHECK(end != v && *end == '\0' && kib > 0 && kib <= (int64_t(1) << 20), "fsdp: rank ", rank,
                ": FSDP_SHM_SLOT_KIB='", v, "' is not a slot size in KiB between 1 and 1048576; "
                "unset it for the default (", detail::kDefaultShmSlotBytes >> 10, ")");
    config.shm_slot_bytes = int64_t(kib) << 10;
  }
  const char* direct_env = std::getenv("FSDP_SHM_DIRECT");
  config.shm_direct = !(direct_env && std::string(direct_env) == "0");
  const char* check_env = std::getenv("FSDP_CHECK_COLLECTIVES");
  config.check_collectives = options.check_collectives() || (check_env && std::string(check_env) == "1");
  return config;
}

}  // namespace

struct ProcessGroup::State {
  detail::GroupDesc desc;  // c10d group, root store, name, members, timeout, peer table
  LaunchEnv env;
  int subgroup_counter = 0;
  std::shared_ptr<::gloo::transport::Device> device;
  // The world's, inherited by sub-groups: its transport settings, CUDA collective backend and
  // shared-memory engine, and what makes each group's transports from them.
  std::shared_ptr<const detail::TransportFactory> transports;
  std::shared_ptr<detail::Transport> transport;         // chosen when the group is created
  std::shared_ptr<detail::Transport> device_transport;  // CUDA tensors; null when none
  std::shared_ptr<detail::FlightRecorder> recorder;     // this group's own, never inherited

  // NCCL's backend warns at exit, and may leak its communicators, unless shut down first
  // (Python's destroy_process_group); the last copy of a group shuts it down.
  ~State() {
    if (!transports || transports->cuda().backend != Backend::kNccl || !desc.c10d()) return;
    try {
      desc.c10d()->getBackend(c10::kCUDA)->shutdown();
    } catch (const std::exception&) {
      // Nothing to do at teardown: the process is leaving the group either way.
    }
  }
};

ProcessGroup::ProcessGroup(c10::intrusive_ptr<::c10d::ProcessGroup> pg,
                           c10::intrusive_ptr<::c10d::Store> store, std::string name,
                           std::vector<int> global_ranks, LaunchEnv env,
                           std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  state_->desc = detail::GroupDesc({std::move(pg), std::move(store), std::move(name), std::move(global_ranks),
                                    env.rank, timeout});
  state_->env = std::move(env);
  state_->recorder = std::make_shared<detail::FlightRecorder>();
  const detail::GroupDesc& d = state_->desc;
  detail::register_recorder({d.name(), d.rank(), d.global_ranks(), d.store().get(), state_->recorder});
  // Until the creator chooses (init_process_group, new_subgroup): Gloo, which every group can use.
  state_->transports = detail::TransportFactory::plain();
  state_->transport = state_->transports->host_transport(state_->desc);
}

#define FSDP_PG_STATE()                                                                   \
  TORCH_CHECK(state_ != nullptr,                                                          \
              "fsdp: use of an undefined ProcessGroup (this rank is not a member of the " \
              "sub-group, or init_process_group was not called)")

int ProcessGroup::rank() const { FSDP_PG_STATE(); return state_->desc.rank(); }
int ProcessGroup::size() const { FSDP_PG_STATE(); return state_->desc.size(); }
int ProcessGroup::global_rank() const { FSDP_PG_STATE(); return state_->env.rank; }
int ProcessGroup::local_rank() const { FSDP_PG_STATE(); return state_->env.local_rank; }
int ProcessGroup::local_world_size() const { FSDP_PG_STATE(); return state_->env.local_world_size; }
const std::string& ProcessGroup::name() const { FSDP_PG_STATE(); return state_->desc.name(); }
const std::vector<int>& ProcessGroup::global_ranks() const { FSDP_PG_STATE(); return state_->desc.global_ranks(); }
std::chrono::milliseconds ProcessGroup::timeout() const { FSDP_PG_STATE(); return state_->desc.timeout(); }
const LaunchEnv& ProcessGroup::launch_env() const { FSDP_PG_STATE(); return state_->env; }
const c10::intrusive_ptr<::c10d::ProcessGroup>& ProcessGroup::c10d() const { FSDP_PG_STATE(); return state_->desc.c10d(); }
const c10::intrusive_ptr<::c10d::Store>& ProcessGroup::store() const { FSDP_PG_STATE(); return state_->desc.store(); }
const detail::GroupDesc& ProcessGroup::desc() const { FSDP_PG_STATE(); return state_->desc; }
const std::shared_ptr<detail::Transport>& ProcessGroup::transport() const { FSDP_PG_STATE(); return state_->transport; }
const std::shared_ptr<detail::Transport>& ProcessGroup::device_transport() const {
  FSDP_PG_STATE();
  return state_->device_transport;
}
int ProcessGroup::cuda_device() const { FSDP_PG_STATE(); return state_->transports->cuda().device_index; }
Backend ProcessGroup::cuda_backend() const {
  FSDP_PG_STATE();
  const detail::CudaCollectiveBackend& cuda = state_->transports->cuda();
  return cuda.enabled() ? cuda.backend : Backend::kAuto;
}

const std::shared_ptr<detail::ShmChannel>& ProcessGroup::shm_channel() const {
  FSDP_PG_STATE();
  return detail::shm_channel_of(state_->transport.get());
}

std::string ProcessGroup::describe_peer(int r) const { FSDP_PG_STATE(); return state_->desc.describe_peer(r); }

bool ProcessGroup::checks_collectives() const {
  FSDP_PG_STATE();
  return state_->transports->config().check_collectives;
}

detail::FlightRecorder& ProcessGroup::flight_recorder() const {
  FSDP_PG_STATE();
  return *state_->recorder;
}

bool ProcessGroup::peer_gone(int r) const { FSDP_PG_STATE(); return state_->desc.peer_gone(r); }

std::string ProcessGroup::dead_peers_hint() const { FSDP_PG_STATE(); return state_->desc.dead_peers_hint(); }

namespace {

c10::intrusive_ptr<::c10d::ProcessGroup> make_gloo(const c10::intrusive_ptr<::c10d::Store>& store,
                                                   int rank, int size,
                                                   std::shared_ptr<::gloo::transport::Device> device,
                                                   std::chrono::milliseconds timeout) {
  auto opts = ::c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(std::move(device));
  // Gloo's worker threads run the async collectives. Two is enough for one
  // collective in flight per direction; more only competes for the 1-2 cores a
  // rank typically has on CPU jobs.
  opts->threads = 2;
  // In libtorch 2.x Gloo is a c10d::Backend; a ProcessGroup dispatches each collective to
  // the backend registered for its tensors' device. Gloo serves CPU and CUDA tensors alike
  // (it stages CUDA tensors through host memory), as torch.distributed's "cpu:gloo,cuda:gloo".
  auto backend = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, opts);
  auto pg = c10::make_intrusive<::c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(::c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::kCPU, ::c10d::ProcessGroup::BackendType::GLOO, backend);
  pg->setBackend(c10::kCUDA, ::c10d::ProcessGroup::BackendType::GLOO, backend);
  return pg;
}

}  // namespace

ProcessGroup ProcessGroup::new_subgroup(std::vector<int> ranks) {
  FSDP_PG_STATE();
  const int id = state_->subgroup_counter++;
  std::sort(ranks.begin(), ranks.end());
  TORCH_CHECK(std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(),
              "fsdp: new_subgroup ranks contain duplicates");
  TORCH_CHECK(!ranks.empty() && ranks.front() >= 0 && ranks.back() < size(),
              "fsdp: new_subgroup ranks must lie in [0, ", size(), ") of group '", name(), "'");
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  std::ostringstream sub;
  sub << name() << "/sub" << id;
  if (it == ranks.end()) return ProcessGroup();  // not a member: nothing to set up
  const int sub_rank = static_cast<int>(it - ranks.begin());
  std::vector<int> global;
  for (int r : ranks) global.push_back(global_ranks()[r]);
  auto prefixed = c10::make_intrusive<::c10d::PrefixStore>("fsdp/pg/" + sub.str(), store());
  if (!state_->device) state_->device = make_gloo_device(state_->env);
  auto pg = make_gloo(prefixed, sub_rank, static_cast<int>(ranks.size()), state_->device, timeout());
  const detail::CudaCollectiveBackend& cuda = state_->transports->cuda();
  if (cuda.backend == Backend::kNccl)
    detail::attach_nccl(pg, prefixed, sub_rank, static_cast<int>(ranks.size()), timeout(), cuda.device_index);
  ProcessGroup out(pg, store(), sub.str(), std::move(global), state_->env, timeout());
  out.state_->desc.set_world_peers(state_->desc.world_peers());
  out.state_->device = state_->device;
  out.state_->transports = state_->transports;
  out.state_->device_transport = state_->transports->device_transport();
  // Gloo's constructor returns once *this* rank's pairs are connected; a peer may
  // still be finishing its handshake. Without a barrier, a fast rank that drops
  // the group at once (say, a constructor that then throws) closes sockets a slow
  // peer is still reading: "Connection closed by peer". torch.distributed.new_group
  // waits on a store barrier for the same reason.
  try {
    pg->getBackend(c10::kCPU)->barrier()->wait(timeout());  // not ProcessGroup::barrier: see GlooTransport::barrier
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: rank ", rank(), " of group '", name(), "' could not complete sub-group '",
                sub.str(), "': ", e.what(), "; every member must create sub-groups in the same order");
  }
  out.state_->transport = state_->transports->host_transport(out.state_->desc);
  return out;
}

ProcessGroup ProcessGroup::split_consecutive(int group_size) {
  TORCH_CHECK(group_size >= 1 && size() % group_size == 0, "fsdp: cannot split group '", name(),
              "' of ", size(), " ranks into consecutive groups of ", group_size,
              ": the size must divide the group size");
  ProcessGroup mine;
  for (int start = 0; start < size(); start += group_size) {
    std::vector<int> ranks;
    for (int r = start; r < start + group_size; ++r) ranks.push_back(r);
    auto g = new_subgroup(ranks);
    if (g.defined()) mine = g;
  }
  return mine;
}

ProcessGroup ProcessGroup::split_strided(int group_size) {
  TORCH_CHECK(group_size >= 1 && size() % group_size == 0, "fsdp: cannot split group '", name(),
              "' of ", size(), " ranks into strided groups with block size ", group_size);
  ProcessGroup mine;
  for (int i = 0; i < group_size; ++i) {
    std::vector<int> ranks;
    for (int r = i; r < size(); r += group_size) ranks.push_back(r);
    auto g = new_subgroup(ranks);
    if (g.defined()) mine = g;
  }
  return mine;
}

namespace {

// Gloo writes to peers' sockets; when a peer dies the write raises SIGPIPE, whose default
// action kills this rank silently (exit 141) instead of letting the collective fail with a
// message naming the peer. Python ignores SIGPIPE for the same reason. A handler the
// program installed itself is kept.
void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

// Phase 1 of init_process_group: the job's store (TCP, served by rank 0 or torchrun's
// agent, or a file), under the prefixes that keep attempts and jobs apart.
c10::intrusive_ptr<::c10d::Store> open_store(const InitOptions& options, const LaunchEnv& env) {
  const auto timeout = options.timeout();
  c10::intrusive_ptr<::c10d::Store> store;
  if (!options.file_store_path().empty()) {
    store = c10::make_intrusive<::c10d::FileStore>(options.file_store_path(), env.world_size);
  } else {
    ::c10d::TCPStoreOptions topts;
    topts.port = static_cast<uint16_t>(env.master_port);
    // With torchrun's agent store the agent already listens on MASTER_PORT.
    topts.isServer = env.rank == 0 && !env.use_agent_store;
    topts.numWorkers = c10::nullopt;  // agreement is checked below with a clear message
    topts.waitWorkers = false;
    topts.timeout = timeout;
    try {
      store = c10::make_intrusive<::c10d::TCPStore>(env.master_addr, topts);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "fsdp: rank ", env.rank, " could not ",
                  topts.isServer ? "serve" : "reach", " the rendezvous store at ", env.master_addr,
                  ":", env.master_port, " (", to_string(env.source), "): ", e.what(),
                  topts.isServer ? "; is the port in use by another job? set MASTER_PORT"
                                 : "; is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?");
    }
  }
  if (env.use_agent_store) {
    // Same prefix as Python's torchrun rendezvous: a restarted job never reads
    // the keys of an earlier attempt.
    store = c10::make_intrusive<::c10d::PrefixStore>(
        "/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  if (!options.store_prefix().empty()) {
    store = c10::make_intrusive<::c10d::PrefixStore>(options.store_prefix(), store);
  }
  store->setTimeout(timeout);
  return store;
}

// Phase 2: one world size per job, one process per rank.
void agree_on_world(::c10d::Store& store, const LaunchEnv& env) {
  const std::string ws = std::to_string(env.world_size);
  auto seen = detail::store_string(store.compareSet("fsdp/init/world_size", {}, detail::store_bytes(ws)));
  TORCH_CHECK(seen == ws, "fsdp: rank ", env.rank, " was started with world size ", ws,
              " but another rank of this job registered world size ", seen,
              "; every rank must be launched with the same WORLD_SIZE (or this store at ",
              env.master_addr, ":", env.master_port, " belongs to another job)");
  const int64_t claims = store.add("fsdp/init/rank_claims/" + std::to_string(env.rank), 1);
  TORCH_CHECK(claims == 1, "fsdp: rank ", env.rank,
              " was claimed by two processes; each process needs a distinct RANK, or the store at ",
              env.master_addr, ":", env.master_port, " is shared with another job (pick another "
              "MASTER_PORT)");
}

// Phase 3: the peer table (host, pid; by world rank). For error messages, and to refuse a
// cross-host loopback address before Gloo waits for it (every rank registers before
// connecting, so this waits for no one extra).
std::shared_ptr<const std::vector<Peer>> exchange_peer_table(::c10d::Store& store, const LaunchEnv& env,
                                                             std::chrono::milliseconds timeout) {
  const std::string address = gloo_address(env);
  const std::string me = detail::this_host_name() + " " + std::to_string(::getpid()) + " " +
                         (address.empty() ? "-" : address);
  store.set("fsdp/init/peer/" + std::to_string(env.rank), detail::store_bytes(me));
  auto peers = std::make_shared<std::vector<Peer>>(env.world_size);
  std::vector<std::string> hosts(env.world_size), addrs(env.world_size);
  for (int r = 0; r < env.world_size; ++r) {
    std::string entry;
    try {
      entry = detail::store_string(store.get("fsdp/init/peer/" + std::to_string(r)));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "fsdp: rank ", env.rank, " of ", env.world_size, ": rank ", r,
                  " did not register within ", timeout.count(), " ms: ", e.what(),
                  "; are all ", env.world_size, " ranks running?");
    }
    std::istringstream is(entry);
    is >> (*peers)[r].host >> (*peers)[r].pid >> addrs[r];
    hosts[r] = (*peers)[r].host;
  }
  check_no_remote_loopback(hosts, addrs, env.rank);
  return peers;
}

// Phase 4: the world's c10d group over Gloo (and NCCL for CUDA tensors when the world
// placed them there), connected under "fsdp/pg/world".
c10::intrusive_ptr<::c10d::ProcessGroup> connect_world(const c10::intrusive_ptr<::c10d::Store>& store,
                                                       const LaunchEnv& env, std::chrono::milliseconds timeout,
                                                       const detail::CudaCollectiveBackend& cuda,
                                                       const std::shared_ptr<::gloo::transport::Device>& device) {
  auto pg_store = c10::make_intrusive<::c10d::PrefixStore>("fsdp/pg/world", store);
  c10::intrusive_ptr<::c10d::ProcessGroup> pg;
  try {
    pg = make_gloo(pg_store, env.rank, env.world_size, device, timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: rank ", env.rank, " of ", env.world_size,
                " failed to connect the Gloo process group within ", timeout.count(),
                " ms: ", e.what(), "; are all ", env.world_size, " ranks running?");
  }
  if (cuda.backend == Backend::kNccl) detail::attach_nccl(pg, pg_store, env.rank, env.world_size, timeout, cuda.device_index);
  return pg;
}

}  // namespace

ProcessGroup init_process_group(const InitOptions& options) {
  ignore_sigpipe();
  LaunchEnv env = parse_launch_env(process_env(), options.overrides());
  const auto timeout = options.timeout();
  TORCH_CHECK(timeout.count() > 0, "fsdp: init_process_group timeout must be positive");
  TORCH_CHECK(options.backend() != Backend::kNccl || detail::nccl_built(), "fsdp: rank ", env.rank,
              ": Backend::kNccl needs a libtorch built with CUDA and NCCL; this build has none. "
              "Use Backend::kGloo (CPU tensors)");
  // Checked before the rendezvous, so that a bad value fails at once on the rank that has it.
  const detail::TransportConfig config = transport_config(options, env.rank);

  const c10::intrusive_ptr<::c10d::Store> store = open_store(options, env);
  agree_on_world(*store, env);
  auto peers = exchange_peer_table(*store, env, timeout);
  // Where CUDA tensors go ([Note: CUDA tensors in a process group]), then the world group.
  const detail::CudaCollectiveBackend cuda = detail::decide_cuda_backend(options, env, *store);
  auto device = make_gloo_device(env);
  auto pg = connect_world(store, env, timeout, cuda, device);

  // Phase 5: the group, then its transports: same-host ranks talk through shared memory
  // ([Note: transports]).
  std::vector<int> global(env.world_size);
  for (int r = 0; r < env.world_size; ++r) global[r] = r;
  ProcessGroup out(pg, store, "world", std::move(global), env, timeout);
  out.state_->device = device;
  out.state_->desc.set_world_peers(std::move(peers));
  out.state_->transports = std::make_shared<const detail::TransportFactory>(config, cuda);
  out.state_->transport = out.state_->transports->host_transport(out.state_->desc);
  out.state_->device_transport = out.state_->transports->device_transport();
  return out;
}

}  // namespace fsdp::comm
