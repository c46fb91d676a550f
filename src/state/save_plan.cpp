// See [Note: save plans] in save_plan.h.
#include "save_plan.h"

#include <map>

#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include "checkpoint_format.h"
#include "error_message.h"
#include "memory/own_pages.h"
#include "optim_state.h"

namespace fsdp::state {

using json = nlohmann::json;

namespace {

// The records of this rank's file: its pieces and their optimizer state (replicated values:
// rank 0 only), and on rank 0 the buffers and the extra tensors.
void plan_records(const CheckpointSubject& subject, const torch::optim::Optimizer* optimizer,
                  const CheckpointExtra& extra, SavePlan& plan) {
  const int rank = subject.group.rank();
  const std::string opt_kind = optimizer ? optimizer_kind(*optimizer) : "";
  auto put = [&](const std::string& item, const std::string& kind, const at::Tensor& t, int64_t b, int64_t e) {
    const auto skew = size_t(t.storage_offset() * int64_t(t.element_size())) % format::DirectFile::kBlock;
    plan.records.push_back({item, kind, t, b, e, skew});
  };
  for (const auto& p : subject.pieces) {
    if (!p.writer) continue;
    put(p.name, format::kParam, p.flat(), p.begin, p.end);
    if (!optimizer) continue;
    auto st = get_param_state(*optimizer, p.param);
    if (!st) continue;
    plan.steps[p.name] = st->step;
    for (const auto& kv : st->tensors) {
      TORCH_CHECK(kv.second.numel() == p.end - p.begin && kv.second.is_contiguous(), "fsdp: save_checkpoint: ",
                  opt_kind, " state '", kv.first, "' of parameter '", p.name, "' on rank ", rank, " has shape ",
                  kv.second.sizes(), ", not that of the parameter's piece (", p.end - p.begin,
                  " elements); was the optimizer built on the wrapped model's parameters?");
      put(p.name, kv.first, kv.second.reshape({-1}), p.begin, p.end);
    }
  }
  if (rank != 0) return;
  for (const auto& b : subject.module->named_buffers())
    put(b.key(), format::kBuffer, b.value().contiguous().view({-1}), 0, b.value().numel());
  for (const auto& kv : extra.tensors)
    put(kv.first, format::kExtra, kv.second.detach().cpu().contiguous().view({-1}), 0, kv.second.numel());
}

// Rank 0: what every item is (kind, shape, dtype), the parameters' order and aliases, the
// optimizer's groups by parameter name.
void describe_items(const CheckpointSubject& subject, const torch::optim::Optimizer* optimizer,
                    const CheckpointExtra& extra, json& meta) {
  json items = json::object();
  std::vector<std::string> order;
  std::map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& p : subject.pieces) {
    items[p.name] = {{"kind", format::kParam}, {"shape", p.shape}, {"dtype", format::dtype_name(p.param.scalar_type())}};
    order.push_back(p.name);
    name_of[p.param.unsafeGetTensorImpl()] = p.name;
  }
  for (const auto& b : subject.module->named_buffers())
    items[b.key()] = {{"kind", format::kBuffer}, {"shape", b.value().sizes().vec()},
                      {"dtype", format::dtype_name(b.value().scalar_type())}};
  for (const auto& kv : extra.tensors)
    items[kv.first] = {{"kind", format::kExtra}, {"shape", kv.second.sizes().vec()},
                       {"dtype", format::dtype_name(kv.second.scalar_type())}};
  // Tied parameters are stored once, under their first name; the other
  // names map to it (consolidate emits them all, as Python's state_dict does).
  json aliases = json::object();
  for (const auto& p : subject.pieces)
    for (const auto& a : p.aliases) aliases[a] = p.name;
  meta["parameter_order"] = order;
  meta["aliases"] = aliases;
  meta["items"] = items;
  json groups = json::array();
  if (optimizer) {
    for (const auto& g : optimizer->param_groups()) {
      json names = json::array();
      for (const auto& p : g.params()) {
        auto it = name_of.find(p.unsafeGetTensorImpl());
        names.push_back(it == name_of.end() ? json(nullptr) : json(it->second));
      }
      groups.push_back({{"lr", g.options().get_lr()}, {"params", names}});
    }
  }
  meta["param_groups"] = groups;
}

json metadata_of(const CheckpointSubject& subject, const torch::optim::Optimizer* optimizer,
                 const CheckpointExtra& extra) {
  json meta;
  meta["format"] = format::kFormatName;
  meta["version"] = format::kFormatVersion;
  meta["world_size"] = subject.group.size();
  meta["strategy"] = subject.strategy;
  meta["optimizer"] = optimizer ? json(optimizer_kind(*optimizer)) : json(nullptr);
  describe_items(subject, optimizer, extra, meta);
  meta["extra"] = extra.values;
  return meta;
}

}  // namespace

SavePlan plan_save(const std::string& dir, const CheckpointSubject& subject,
                   const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra) {
  TORCH_CHECK(!dir.empty(), "fsdp: save_checkpoint needs a directory");
  SavePlan plan;
  plan.dir = dir;
  plan.tmp = dir + ".tmp";
  plan.tracer = subject.tracer;
  try {
    plan_records(subject, optimizer, extra, plan);
    if (subject.group.rank() == 0) plan.metadata = metadata_of(subject, optimizer, extra);
  } catch (const std::exception& e) {
    plan.records.clear();
    plan.error = error_message(e);
  }
  return plan;
}

namespace {

bool may_be_protected(const PlannedRecord& r) {
  return r.kind != format::kBuffer && r.kind != format::kExtra && r.values.is_cpu() && r.values.is_contiguous() &&
         r.values.numel() > 0 && memory::move_to_own_pages(r.values);
}

// [Note: device records in a snapshot]: copies of `records` (all on `device`) on a side stream.
std::shared_ptr<c10::Event> copy_on_side_stream(std::vector<PlannedRecord*>& records, const c10::Device& device) {
  c10::impl::VirtualGuardImpl guard(device.type());
  const c10::Stream current = guard.getStream(device);
  const c10::Stream side = guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  c10::Event state_ready(device.type());
  state_ready.record(current);
  state_ready.block(side);
  {
    c10::StreamGuard on_side(side);
    for (PlannedRecord* r : records) {
      auto copy = at::empty(r->values.sizes(), r->values.options().device(at::kCPU).pinned_memory(true));
      copy.copy_(r->values, /*non_blocking=*/true);
      guard.recordDataPtrOnStream(r->values.storage().data_ptr(), side);
      r->values = copy;
    }
  }
  auto copied = std::make_shared<c10::Event>(device.type());
  copied->record(side);
  copied->block(current);
  return copied;
}

}  // namespace

int64_t move_protectable_records(const SavePlan& plan) {
  int64_t bytes = 0;
  for (const PlannedRecord& r : plan.records)
    if (may_be_protected(r)) bytes += int64_t(r.values.nbytes());
  return bytes;
}

SnapshotTaken snapshot(SavePlan& plan, int64_t copy_cap) {
  SnapshotTaken taken;
  std::vector<bool> protect(plan.records.size());
  for (size_t i = 0; i < plan.records.size(); ++i) {
    protect[i] = may_be_protected(plan.records[i]);
    if (!protect[i]) taken.copied_bytes += plan.records[i].values.nbytes();
  }
  if (taken.copied_bytes > copy_cap) {
    taken.fits = false;
    return taken;
  }
  std::map<const c10::StorageImpl*, int> region_of;
  std::vector<memory::CowRegion> regions;
  std::vector<PlannedRecord*> on_device;
  for (size_t i = 0; i < plan.records.size(); ++i) {
    PlannedRecord& r = plan.records[i];
    if (!protect[i]) {
      if (r.values.is_cpu()) r.values = r.values.clone();
      else on_device.push_back(&r);
      continue;
    }
    const auto* impl = r.values.storage().unsafeGetStorageImpl();
    auto it = region_of.find(impl);
    if (it == region_of.end()) {
      it = region_of.emplace(impl, int(regions.size())).first;
      regions.push_back(memory::own_pages_of(r.values));
      taken.cow_bytes += int64_t(regions.back().bytes);
    }
    r.region = it->second;
    r.offset = size_t(static_cast<const char*>(r.values.data_ptr()) - static_cast<const char*>(regions[it->second].base));
  }
  if (!on_device.empty()) plan.device_copies = copy_on_side_stream(on_device, on_device.front()->values.device());
  if (!regions.empty()) {
    memory::CowOptions options;
    options.copy_cap_bytes = size_t(copy_cap - taken.copied_bytes);
    plan.cow = std::make_shared<memory::CowSnapshot>(std::move(regions), options);
  }
  return taken;
}

}  // namespace fsdp::state
