#include "fsdp/core/memory_tracer.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <set>

#include <c10/core/CachingDeviceAllocator.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "counting_allocator.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/memory/optimizer_state_bytes.h"

namespace fsdp {

namespace memory {

void enable_allocator_counting() { install_counting_allocator(); }

bool allocator_counting_enabled() { return installed_counting_allocator() != nullptr; }

int64_t counted_allocator_bytes() {
  auto* c = installed_counting_allocator();
  return c ? c->live() : 0;
}

int64_t counted_allocations() {
  auto* c = installed_counting_allocator();
  return c ? c->allocations() : 0;
}

}  // namespace memory

namespace {
std::mutex tracers_mutex;
std::set<MemoryTracer*> live_tracers;

/// The CUDA device of the model's parameters, -1 when they are not on one.
int cuda_device_of(FullyShardedBase& model) {
  for (const auto& p : model.parameters())
    if (p.defined()) return p.is_cuda() ? p.device().index() : -1;
  return -1;
}

/// The CUDA caching allocator's statistics of `device`, through the device-generic
/// allocator interface it implements (c10::DeviceAllocator): no CUDA header here, and only
/// asked for a model whose parameters are on CUDA, so the CUDA allocator is registered.
CudaAllocatorBytes cuda_allocator_bytes(int device) {
  CudaAllocatorBytes out;
  if (device < 0) return out;
  const auto stats =
      c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(static_cast<c10::DeviceIndex>(device));
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  out.allocated = stats.allocated_bytes[kAll].current;
  out.reserved = stats.reserved_bytes[kAll].current;
  out.peak_allocated = stats.allocated_bytes[kAll].peak;
  return out;
}
}  // namespace

MemoryTracer::MemoryTracer(FullyShardedBase& model, torch::optim::Optimizer* optimizer)
    : model_(model),
      optimizer_(optimizer),
      rank_(model.process_group().global_rank()),
      cuda_device_(cuda_device_of(model)) {
  optimizer_bytes_ = optimizer_state_bytes();
  model_.set_unit_boundary_observer(
      [this](const std::string& unit, const char* phase) { sample(unit, phase); });
  std::lock_guard<std::mutex> lock(tracers_mutex);
  live_tracers.insert(this);
}

MemoryTracer::~MemoryTracer() {
  model_.set_unit_boundary_observer(nullptr);
  std::lock_guard<std::mutex> lock(tracers_mutex);
  live_tracers.erase(this);
}

int64_t MemoryTracer::optimizer_state_bytes() const {
  return optimizer_ == nullptr ? 0 : memory::optimizer_state_bytes(*optimizer_);
}

MemoryUsage MemoryTracer::get_memory_usage() {
  const MemoryStats s = model_.memory_stats();
  MemoryUsage u;
  u[MemoryCategory::kParameterShards] = s.param_shard_bytes;
  u[MemoryCategory::kUnshardedParameters] = s.unsharded_bytes;
  u[MemoryCategory::kGradients] = s.grad_shard_bytes;
  u[MemoryCategory::kOptimizerState] = optimizer_bytes_;
  if (cuda_device_ >= 0) {
    const int64_t known = u.total();
    u[MemoryCategory::kOther] = std::max<int64_t>(0, cuda_allocator_bytes(cuda_device_).allocated - known);
  } else if (memory::allocator_counting_enabled()) {
    const int64_t known = u.total();
    u[MemoryCategory::kOther] = std::max<int64_t>(0, memory::counted_allocator_bytes() - known);
  }
  return u;
}

void MemoryTracer::sample(const std::string& unit, const char* phase) {
  MemorySample m;
  m.step = step_;
  m.unit = unit;
  m.phase = phase;
  m.usage = get_memory_usage();
  if (memory::allocator_counting_enabled()) m.allocator_bytes = memory::counted_allocator_bytes();
  m.cuda = cuda_allocator_bytes(cuda_device_);
  samples_.push_back(std::move(m));
}

void MemoryTracer::step() {
  optimizer_bytes_ = optimizer_state_bytes();
  sample("-", "optimizer_step");
  ++step_;
}

namespace {
void write_samples(std::ostream& out, const std::vector<MemorySample>& samples, int rank) {
  for (const auto& m : samples) {
    nlohmann::json j = {{"rank", rank}, {"step", m.step}, {"unit", m.unit}, {"phase", m.phase}};
    nlohmann::json bytes;
    for (int c = 0; c < kNumMemoryCategories; ++c)
      bytes[memory_category_name(static_cast<MemoryCategory>(c))] = m.usage.bytes[c];
    j["bytes"] = bytes;
    j["allocator_bytes"] = m.allocator_bytes;
    if (m.cuda.allocated >= 0)
      j["cuda"] = {{"allocated_bytes", m.cuda.allocated}, {"reserved_bytes", m.cuda.reserved},
                   {"peak_allocated_bytes", m.cuda.peak_allocated}};
    out << j.dump() << '\n';
  }
}
}  // namespace

void MemoryTracer::dump(const std::string& path) const {
  std::ofstream out(path, std::ios::out | std::ios::trunc);
  TORCH_CHECK(out, "fsdp: MemoryTracer::dump cannot create '", path, "' (does the directory exist?)");
  write_samples(out, samples_, rank_);
  TORCH_CHECK(out.good(), "fsdp: MemoryTracer::dump failed writing '", path, "'");
}

int64_t dump_memory_stats(const std::string& path) {
  std::ofstream out(path, std::ios::out | std::ios::trunc);
  TORCH_CHECK(out, "fsdp: dump_memory_stats cannot create '", path, "' (does the directory exist?)");
  std::lock_guard<std::mutex> lock(tracers_mutex);
  int64_t n = 0;
  for (const auto* t : live_tracers) {
    write_samples(out, t->samples(), t->rank());
    n += static_cast<int64_t>(t->samples().size());
  }
  TORCH_CHECK(out.good(), "fsdp: dump_memory_stats failed writing '", path, "'");
  return n;
}

}  // namespace fsdp
