// Saving a checkpoint of any subject ([Note: checkpoint subjects] in checkpoint_subject.h), in
// phases: the temporary directory, every rank's file, rank 0's metadata, publication by rename
// (docs/checkpoint-format.md, "Atomicity").
#include "fsdp/state/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>

#include <torch/torch.h>

#include "checkpoint_format.h"
#include "checkpoint_subject.h"
#include "checkpoint_testing.h"
#include "comm/object_collectives.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "optim_state.h"
#include "shared_directory.h"

namespace fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Every rank learns whether any rank failed, so no rank waits for a peer that
// gave up; the failing rank's own error is rethrown by that rank.
void agree_or_throw(const comm::ProcessGroup& pg, const std::string& my_error, const char* what) {
  auto flags = torch::zeros({pg.size()}, torch::kLong);
  flags[pg.rank()] = my_error.empty() ? 0 : 1;
  if (pg.size() > 1) comm::all_reduce(pg, flags).wait();
  TORCH_CHECK(my_error.empty(), my_error);
  for (int r = 0; r < pg.size(); ++r)
    TORCH_CHECK(flags[r].item<int64_t>() == 0, "fsdp: ", what, " failed on rank ", r,
                " (see its error); nothing was renamed into place");
}

// Fault injection (checkpoint_testing.h); empty unless a test installed one.
state::detail::CheckpointRecordHook& record_hook() {
  static state::detail::CheckpointRecordHook hook;
  return hook;
}

}  // namespace

void state::detail::set_checkpoint_record_hook(CheckpointRecordHook hook) { record_hook() = std::move(hook); }

namespace {

// Phase 0 of a save: rank 0 makes `<dir>.tmp` afresh, and every rank sees it ([Note: checkpoint
// directories are shared] in shared_directory.h) before anything is written.
void make_tmp_directory(const comm::ProcessGroup& pg, const std::string& tmp, const std::string& dir) {
  std::string error;
  if (pg.rank() == 0) {
    try {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // left by a crashed save
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = std::string("fsdp: save_checkpoint cannot create '") + tmp + "': " + e.what();
    }
  }
  agree_or_throw(pg, error, "save_checkpoint");
  const std::string unshared = state::check_shared_directory(pg, tmp, dir, "save_checkpoint");
  if (!unshared.empty()) {
    std::error_code ec;
    if (pg.rank() == 0) fs::remove_all(tmp, ec);
    TORCH_CHECK(false, unshared);
  }
}

// Phase 1: this rank's file in `tmp`: its pieces and their optimizer state (replicated values:
// rank 0 only), and on rank 0 the buffers and the extra tensors. Returns what rank 0 needs for
// the metadata: the records, the optimizer steps, the file (name, bytes, CRC-32).
json write_rank_file(const std::string& tmp, const state::CheckpointSubject& subject,
                     const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra,
                     const std::string& opt_kind) {
  const int rank = subject.group.rank();
  json mine = {{"records", json::array()}, {"steps", json::object()}, {"file", nullptr}};
  const state::detail::CheckpointRecordHook& after_record = record_hook();
  int64_t written = 0;
  std::unique_ptr<state::format::RankFileWriter> writer;
  auto put = [&](const std::string& item, const std::string& kind, const at::Tensor& t, int64_t b, int64_t e) {
    if (!writer) writer = std::make_unique<state::format::RankFileWriter>(tmp, state::format::rank_file_name(rank));
    writer->write(item, kind, t, b, e);
    ++written;
    if (after_record) after_record(written);
  };
  for (const auto& p : subject.pieces) {
    if (!p.writer) continue;
    put(p.name, state::format::kParam, p.flat(), p.begin, p.end);
    if (!optimizer) continue;
    auto st = state::get_param_state(*optimizer, p.param);
    if (!st) continue;
    mine["steps"][p.name] = st->step;
    for (const auto& kv : st->tensors) {
      TORCH_CHECK(kv.second.numel() == p.end - p.begin && kv.second.is_contiguous(), "fsdp: save_checkpoint: ",
                  opt_kind, " state '", kv.first, "' of parameter '", p.name, "' on rank ", rank, " has shape ",
                  kv.second.sizes(), ", not that of the parameter's piece (", p.end - p.begin,
                  " elements); was the optimizer built on the wrapped model's parameters?");
      put(p.name, kv.first, kv.second.reshape({-1}), p.begin, p.end);
    }
  }
  if (rank == 0) {
    for (const auto& b : subject.module->named_buffers())
      put(b.key(), state::format::kBuffer, b.value().contiguous().view({-1}), 0, b.value().numel());
    for (const auto& kv : extra.tensors)
      put(kv.first, state::format::kExtra, kv.second.detach().cpu().contiguous().view({-1}), 0, kv.second.numel());
  }
  if (writer) {
    const int64_t bytes = writer->finish();
    for (const auto& r : writer->records()) mine["records"].push_back(r);
    mine["file"] = {{"name", writer->name()}, {"bytes", bytes}, {"crc32", writer->file_crc()}};
  }
  return mine;
}

// Phase 2, rank 0: what every item is (kind, shape, dtype), the parameters' order and aliases,
// the optimizer's groups by parameter name, into `meta`.
void describe_items(const state::CheckpointSubject& subject, const torch::optim::Optimizer* optimizer,
                    const CheckpointExtra& extra, json& meta) {
  json items = json::object();
  std::vector<std::string> order;
  std::map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& p : subject.pieces) {
    items[p.name] = {{"kind", state::format::kParam}, {"shape", p.shape},
                     {"dtype", state::format::dtype_name(p.param.scalar_type())}};
    order.push_back(p.name);
    name_of[p.param.unsafeGetTensorImpl()] = p.name;
  }
  for (const auto& b : subject.module->named_buffers())
    items[b.key()] = {{"kind", state::format::kBuffer}, {"shape", b.value().sizes().vec()},
                      {"dtype", state::format::dtype_name(b.value().scalar_type())}};
  for (const auto& kv : extra.tensors)
    items[kv.first] = {{"kind", state::format::kExtra}, {"shape", kv.second.sizes().vec()},
                       {"dtype", state::format::dtype_name(kv.second.scalar_type())}};
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

// Phase 2, rank 0: the metadata, from the subject and every rank's part (write_rank_file).
json checkpoint_metadata(const state::CheckpointSubject& subject, const torch::optim::Optimizer* optimizer,
                         const CheckpointExtra& extra, const std::string& opt_kind,
                         const std::vector<std::string>& parts) {
  json meta;
  meta["format"] = state::format::kFormatName;
  meta["version"] = state::format::kFormatVersion;
  meta["world_size"] = subject.group.size();
  meta["strategy"] = subject.strategy;
  meta["optimizer"] = optimizer ? json(opt_kind) : json(nullptr);
  describe_items(subject, optimizer, extra, meta);
  json files = json::array(), records = json::array(), steps = json::object();
  for (const auto& part : parts) {
    auto j = json::parse(part);
    if (!j["file"].is_null()) files.push_back(j["file"]);
    for (auto& r : j["records"]) records.push_back(r);
    for (auto& kv : j["steps"].items())
      steps[kv.key()] = std::max<int64_t>(steps.value(kv.key(), int64_t{0}), kv.value().get<int64_t>());
  }
  meta["files"] = files;
  meta["records"] = records;
  meta["steps"] = steps;
  meta["extra"] = extra.values;
  return meta;
}

// Phase 3, rank 0: the metadata written and fsync'd, then `tmp` renamed into place. Only now,
// with every rank's files fsync'd and the metadata written, does the new checkpoint replace the
// old one.
void publish(const std::string& tmp, const std::string& dir, const json& meta) {
  state::format::write_file_synced(tmp + "/" + state::format::kMetadataFile, meta.dump(1));
  state::format::fsync_dir(tmp);
  const std::string old = dir + ".old";
  std::error_code ec;
  fs::remove_all(old, ec);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  const auto parent = fs::absolute(dir).parent_path();
  state::format::fsync_dir(parent.string());
  fs::remove_all(old, ec);
}

}  // namespace

void state::save_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                               const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "save"});
  TORCH_CHECK(!dir.empty(), "fsdp: save_checkpoint needs a directory");
  const auto& pg = subject.group;
  const int rank = pg.rank();
  const std::string opt_kind = optimizer ? state::optimizer_kind(*optimizer) : "";
  const std::string tmp = dir + ".tmp";
  make_tmp_directory(pg, tmp, dir);

  // 1. Every rank writes its own file; 2. rank 0 gathers what they wrote; 3. it publishes.
  std::string error;
  json mine;
  try {
    mine = write_rank_file(tmp, subject, optimizer, extra, opt_kind);
  } catch (const std::exception& e) {
    error = std::string("fsdp: save_checkpoint on rank ") + std::to_string(rank) + ": " + e.what();
  }
  agree_or_throw(pg, error, "save_checkpoint");
  const auto parts = comm::all_gather_object(pg, mine.dump());
  if (rank == 0) {
    try {
      publish(tmp, dir, checkpoint_metadata(subject, optimizer, extra, opt_kind, parts));
    } catch (const std::exception& e) {
      error = std::string("fsdp: save_checkpoint (rank 0, metadata and rename): ") + e.what();
    }
  }
  agree_or_throw(pg, error, "save_checkpoint");
}

}  // namespace fsdp
