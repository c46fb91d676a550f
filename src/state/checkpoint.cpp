#include "fsdp/state/checkpoint.h"

#include "checkpoint_testing.h"
#include "fsdp/comm/call_label.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "core/state_view.h"
#include "checkpoint_format.h"
#include "checkpoint_subject.h"
#include "fsdp/comm/collectives.h"
#include "optim_state.h"
#include "shared_directory.h"

namespace fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;
using core::detail::LocalPiece;
using state::format::Record;

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

state::CheckpointSubject subject_of(FullyShardedBase& model, const char* what) {
  return {model.process_group(), to_string(model.options().sharding_strategy()),
          core::detail::StateView(model).local_pieces(what), model.module_ptr().get()};
}

}  // namespace

void state::detail::set_checkpoint_record_hook(CheckpointRecordHook hook) { record_hook() = std::move(hook); }

void save_checkpoint(const std::string& dir, FullyShardedBase& model, const torch::optim::Optimizer* optimizer,
                     const CheckpointExtra& extra) {
  state::save_checkpoint_of(dir, subject_of(model, "save_checkpoint"), optimizer, extra);
}

void state::save_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                               const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "save"});
  TORCH_CHECK(!dir.empty(), "fsdp: save_checkpoint needs a directory");
  const auto& pg = subject.group;
  const int rank = pg.rank();
  const auto& pieces = subject.pieces;
  const std::string opt_kind = optimizer ? state::optimizer_kind(*optimizer) : "";
  const std::string tmp = dir + ".tmp";

  std::string error;
  if (rank == 0) {
    try {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // left by a crashed save
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = std::string("fsdp: save_checkpoint cannot create '") + tmp + "': " + e.what();
    }
  }
  agree_or_throw(pg, error, "save_checkpoint");
  // Before anything is written: does every rank see the directory rank 0 created?
  // ([Note: checkpoint directories are shared] in shared_directory.h)
  const std::string unshared = state::check_shared_directory(pg, tmp, dir, "save_checkpoint");
  if (!unshared.empty()) {
    std::error_code ec;
    if (rank == 0) fs::remove_all(tmp, ec);
    TORCH_CHECK(false, unshared);
  }

  // 1. Every rank writes its own pieces (replicated values: rank 0 only).
  json mine = {{"records", json::array()}, {"steps", json::object()}, {"file", nullptr}};
  try {
    const state::detail::CheckpointRecordHook& after_record = record_hook();
    int64_t written = 0;
    std::unique_ptr<state::format::RankFileWriter> writer;
    auto put = [&](const std::string& item, const std::string& kind, const at::Tensor& t, int64_t b, int64_t e) {
      if (!writer) writer = std::make_unique<state::format::RankFileWriter>(tmp, state::format::rank_file_name(rank));
      writer->write(item, kind, t, b, e);
      ++written;
      if (after_record) after_record(written);
    };
    for (const auto& p : pieces) {
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
        put(kv.first, state::format::kExtra, kv.second.detach().cpu().contiguous().view({-1}), 0,
            kv.second.numel());
    }
    if (writer) {
      const int64_t bytes = writer->finish();
      for (const auto& r : writer->records()) mine["records"].push_back(r);
      mine["file"] = {{"name", writer->name()}, {"bytes", bytes}, {"crc32", writer->file_crc()}};
    }
  } catch (const std::exception& e) {
    error = std::string("fsdp: save_checkpoint on rank ") + std::to_string(rank) + ": " + e.what();
  }
  agree_or_throw(pg, error, "save_checkpoint");

  // 2. Rank 0 writes the metadata and renames the directory into place.
  const auto parts = comm::all_gather_object(pg, mine.dump());
  if (rank == 0) {
    try {
      json meta;
      meta["format"] = state::format::kFormatName;
      meta["version"] = state::format::kFormatVersion;
      meta["world_size"] = pg.size();
      meta["strategy"] = subject.strategy;
      meta["optimizer"] = optimizer ? json(opt_kind) : json(nullptr);
      json items = json::object();
      std::vector<std::string> order;
      std::map<const c10::TensorImpl*, std::string> name_of;
      for (const auto& p : pieces) {
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
      for (const auto& p : pieces)
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
      state::format::write_file_synced(tmp + "/" + state::format::kMetadataFile, meta.dump(1));
      state::format::fsync_dir(tmp);
      // Only now, with every rank's files fsync'd and the metadata written, does
      // the new checkpoint replace the old one.
      const std::string old = dir + ".old";
      std::error_code ec;
      fs::remove_all(old, ec);
      if (fs::exists(dir)) fs::rename(dir, old);
      fs::rename(tmp, dir);
      const auto parent = fs::absolute(dir).parent_path();
      state::format::fsync_dir(parent.string());
      fs::remove_all(old, ec);
    } catch (const std::exception& e) {
      error = std::string("fsdp: save_checkpoint (rank 0, metadata and rename): ") + e.what();
    }
  }
  agree_or_throw(pg, error, "save_checkpoint");
}

namespace {

struct Loaded {
  std::string dir;
  json meta;
  std::map<std::pair<std::string, std::string>, std::vector<Record>> records;  // (item, kind)
};

Loaded open_checkpoint(const std::string& dir) {
  Loaded l;
  l.dir = dir;
  const std::string mf = std::string("/") + state::format::kMetadataFile;
  if (!fs::exists(dir + mf) && fs::exists(dir + ".old" + mf)) l.dir = dir + ".old";  // crash between renames
  TORCH_CHECK(fs::exists(l.dir + mf), "fsdp: load_checkpoint: '", dir, mf,
              "' does not exist (no checkpoint there, or a save that never completed)");
  try {
    l.meta = json::parse(state::format::read_text_file(l.dir + mf));
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "fsdp: load_checkpoint: '", l.dir, mf, "' is not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK(l.meta.value("format", "") == state::format::kFormatName &&
                  l.meta.value("version", 0) == state::format::kFormatVersion,
              "fsdp: load_checkpoint: '", l.dir, mf, "' is not an fsdp-cpp checkpoint of version ",
              state::format::kFormatVersion);
  // A truncated file is reported up front, by name.
  for (const auto& f : l.meta["files"]) {
    const std::string path = l.dir + "/" + f["name"].get<std::string>();
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    TORCH_CHECK(!ec, "fsdp: load_checkpoint: file '", path, "' is missing: ", ec.message());
    TORCH_CHECK(static_cast<int64_t>(size) == f["bytes"].get<int64_t>(), "fsdp: load_checkpoint: file '", path,
                "' has ", size, " bytes, metadata says ", f["bytes"].get<int64_t>(),
                ": the file is truncated or corrupted");
  }
  for (const auto& rj : l.meta["records"]) {
    Record r = rj.get<Record>();
    l.records[{r.item, r.kind}].push_back(std::move(r));
  }
  return l;
}

// [Note: atomic load]
// A load changes everything or nothing, on every rank: it runs in three steps
// with one collective between the first two.
//  1. Prepare (may fail; changes nothing the caller holds): read the metadata,
//     match every parameter piece, buffer and optimizer-state tensor this rank
//     holds with the records that cover it (names, shapes, dtypes, coverage),
//     and verify each of those records: the file holds its bytes and their
//     CRC-32 matches. Records are read through a read-only mmap of the rank
//     files (MappedRecords), so verifying reads the page cache in place and
//     copies nothing. New optimizer-state tensors (for an optimizer that has not
//     stepped) are allocated here; they are not the optimizer's yet.
//  2. Agree: one all-reduce of one failure flag per rank. If any rank failed,
//     the ranks all-gather the messages and every rank throws all of them (the
//     failing rank, the file, the record), with nothing changed anywhere.
//  3. Commit (nothing left that can fail): copy each verified record's bytes
//     from the mapping into its target (parameters, buffers, and optimizer state
//     in place when the optimizer has some), with streaming stores for large
//     records ([Note: streaming commit copies] in checkpoint_format.cpp), then
//     install the optimizer-state entries and the learning rates.
// Why not read into staging buffers and swap them in: staging needs fresh
// memory as large as everything the rank loads (3x its parameter bytes under
// Adam), and first-touching fresh memory (page faults, kernel zero-fill) costs
// about as much as the read itself; that is why a load reads into the
// optimizer's existing state. The page cache holds the records'
// bytes anyway once they are read, so mapping it makes it the staging area: no
// allocation, and the commit is the one copy any load makes. What atomicity adds
// to a load that reads and checksums straight into its targets: the checksum
// pass reads the records from memory rather than from the CPU cache right after
// the copy, the mapping's page faults and page tables (8 bytes per 4 KiB
// mapped, freed at the end), and one all-reduce of P int64 flags: measured
// ~10-20% more CPU per cached load, 40 bytes allocated, and each rank's resident
// set grows by the rank files it maps (page cache) while it loads
// (docs/benchmarks.md, bench_checkpoint, "All-or-nothing load: its cost").
// Limits: the commit copies the bytes the checksum saw as long as no process
// writes into the checkpoint's files during the load. Checkpoints are never
// modified in place (saves write `<dir>.tmp` and rename it), and deleting or
// replacing a checkpoint meanwhile is harmless (the mapping keeps the old
// files). A page the kernel drops under memory pressure between the steps is
// read again from the same file; a file truncated by another process during the
// load would end it with SIGBUS.

// [Note: reads in file order]
// A rank file holds each unit's records together (parameter, then its optimizer
// state), but a load visits parameters first, then buffers, then optimizer state.
// Reading in that order jumps back and forth in the file, which resets the kernel's
// read-ahead at every jump: on a cold cache each jump becomes a synchronous small
// read (measured at 4 ranks on 2 cores: 0.48-0.58 of a plain read of the same bytes).
// So a load first plans every copy (which record lands where), then verifies the
// records sorted by file and offset, and commits in the same order.

// One copy of the commit: dst's elements from a record's verified bytes.
struct PendingCopy {
  const Record* record;
  at::Tensor dst;            // 1-D slice of the target
  int64_t first = 0;         // the record's element that lands at dst[0] (relative to record->begin)
  const char* src = nullptr;  // set by verify_in_file_order: MappedRecords::verified() + first
};

// Everything a load changes, prepared and verified (step 1 of [Note: atomic load]).
struct LoadPlan {
  std::vector<PendingCopy> copies;
  struct Optim {
    at::Tensor param;
    std::optional<state::ParamOptimState> state;  // nullopt: erase the parameter's state
  };
  std::vector<Optim> optim;
  std::vector<std::pair<size_t, double>> lrs;  // param group -> saved learning rate
  CheckpointExtra extra;                        // its tensors filled by the commit
};

// Plans the copies that fill `target` (flat, elements [begin, end) of `item`)
// from the records of (item, kind) that overlap it.
void plan_fill(const Loaded& l, LoadPlan& plan, const std::string& item, const std::string& kind,
               const at::Tensor& target, int64_t begin, int64_t end) {
  auto it = l.records.find({item, kind});
  TORCH_CHECK(it != l.records.end() || begin == end, "fsdp: load_checkpoint: checkpoint '", l.dir, "' has no ",
              kind, " data for '", item, "'");
  int64_t covered = 0;
  if (it != l.records.end()) {
    for (const auto& r : it->second) {
      const int64_t lo = std::max(begin, r.begin), hi = std::min(end, r.end);
      if (lo >= hi) continue;
      const auto dtype = state::format::parse_dtype(r.dtype);
      TORCH_CHECK(dtype == target.scalar_type(), "fsdp: load_checkpoint: '", item, "' (", kind, ") is ", dtype,
                  " in checkpoint '", l.dir, "' but ", target.scalar_type(), " in the model");
      plan.copies.push_back({&r, target.slice(0, lo - begin, hi - begin), lo - r.begin});
      covered += hi - lo;
    }
  }
  TORCH_CHECK(covered == end - begin, "fsdp: load_checkpoint: checkpoint '", l.dir, "' covers ", covered, " of ",
              end - begin, " needed elements of '", item, "' (", kind, "): its records are incomplete");
}

// Step 1 of [Note: atomic load], without the checksums: what lands where.
LoadPlan plan_load(const Loaded& l, torch::nn::Module& module, const std::vector<LocalPiece>& pieces,
                   torch::optim::Optimizer* optimizer, int rank) {
  LoadPlan plan;
  const auto& items = l.meta.at("items");
  auto check_item = [&](const std::string& name, const char* kind, c10::IntArrayRef shape, at::ScalarType dtype) {
    TORCH_CHECK(items.contains(name) && items[name]["kind"] == kind, "fsdp: load_checkpoint on rank ", rank,
                ": checkpoint '", l.dir, "' has no ", kind, " '", name, "' (saved from a different model?)");
    const auto saved = items[name]["shape"].get<std::vector<int64_t>>();
    TORCH_CHECK(saved == shape.vec(), "fsdp: load_checkpoint: ", kind, " '", name, "' has shape ", shape,
                " in the model but ", c10::IntArrayRef(saved), " in checkpoint '", l.dir, "'");
    TORCH_CHECK(items[name]["dtype"] == state::format::dtype_name(dtype), "fsdp: load_checkpoint: ", kind, " '",
                name, "' is ", state::format::dtype_name(dtype), " in the model but ",
                items[name]["dtype"].get<std::string>(), " in checkpoint '", l.dir,
                "'; convert the model before wrapping");
  };

  // The name each piece was saved under: its own, or, for a tied parameter
  // saved under another of its names, that one.
  const json saved_aliases = l.meta.value("aliases", json::object());
  std::map<const c10::TensorImpl*, std::string> saved_name_of;
  for (const auto& p : pieces) {
    std::string name = p.name;
    if (!items.contains(name)) {
      if (saved_aliases.contains(name)) name = saved_aliases[name].get<std::string>();
      for (const auto& a : p.aliases)
        if (!items.contains(name) && items.contains(a)) name = a;
    }
    saved_name_of[p.param.unsafeGetTensorImpl()] = name;
    check_item(name, state::format::kParam, p.shape, p.param.scalar_type());
    plan_fill(l, plan, name, state::format::kParam, p.flat(), p.begin, p.end);
  }
  for (const auto& b : module.named_buffers()) {
    check_item(b.key(), state::format::kBuffer, b.value().sizes(), b.value().scalar_type());
    auto v = b.value();
    TORCH_INTERNAL_ASSERT(v.is_contiguous());
    plan_fill(l, plan, b.key(), state::format::kBuffer, v.view({-1}), 0, v.numel());
  }

  if (optimizer) {
    const std::string kind = state::optimizer_kind(*optimizer);
    TORCH_CHECK(!l.meta.at("optimizer").is_null(), "fsdp: load_checkpoint: checkpoint '", l.dir,
                "' holds no optimizer state; pass nullptr as the optimizer to load parameters only");
    const std::string saved_kind = l.meta.at("optimizer").get<std::string>();
    TORCH_CHECK(state::optimizer_family(saved_kind) == state::optimizer_family(kind), "fsdp: load_checkpoint: "
                "checkpoint '", l.dir, "' holds ", saved_kind, " state, which a ", kind, " optimizer cannot use");
    std::map<const c10::TensorImpl*, const LocalPiece*> piece_of;
    for (const auto& p : pieces) piece_of[p.param.unsafeGetTensorImpl()] = &p;
    std::map<std::string, std::set<std::string>> kinds_of;  // item -> optimizer-state kinds
    for (const auto& kv : l.records)
      if (kv.first.second != state::format::kParam && kv.first.second != state::format::kBuffer &&
          kv.first.second != state::format::kExtra)
        kinds_of[kv.first.first].insert(kv.first.second);
    const auto& steps = l.meta.at("steps");
    const auto& groups = optimizer->param_groups();
    const auto& saved_groups = l.meta.at("param_groups");
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      if (gi < saved_groups.size()) plan.lrs.emplace_back(gi, saved_groups.at(gi).at("lr").get<double>());
      for (const auto& param : groups[gi].params()) {
        auto pit = piece_of.find(param.unsafeGetTensorImpl());
        TORCH_CHECK(pit != piece_of.end(), "fsdp: load_checkpoint: the optimizer holds a tensor of shape ",
                    param.sizes(), " that is not a parameter of the wrapped model; build the optimizer on the "
                    "wrapped model's parameters()");
        const LocalPiece& p = *pit->second;
        const std::string& name = saved_name_of.at(param.unsafeGetTensorImpl());
        auto kit = kinds_of.find(name);
        if (kit == kinds_of.end() && !steps.contains(name)) {
          plan.optim.push_back({param, std::nullopt});
          continue;
        }
        state::ParamOptimState s;
        s.step = steps.value(name, int64_t{0});
        if (kit != kinds_of.end()) {
          // The optimizer's own state tensors are the targets when they have the
          // parameter's shape and dtype (a resume into a model that has already
          // stepped, or a second load): no allocation, and no page faults and
          // kernel zero-fill of fresh memory, which cost as much as the read.
          // They are only written by the commit.
          const auto current = state::get_param_state(*optimizer, param);
          for (const auto& k : kit->second) {
            at::Tensor t;
            if (current && current->tensors.count(k)) {
              const at::Tensor& c = current->tensors.at(k);
              if (c.sizes() == param.sizes() && c.scalar_type() == param.scalar_type() && c.is_contiguous() &&
                  c.device() == param.device() && !c.requires_grad())
                t = c;
            }
            if (!t.defined()) t = at::empty(param.sizes(), param.options().requires_grad(false));
            plan_fill(l, plan, name, k, t.view({-1}), p.begin, p.end);
            s.tensors[k] = t;
          }
        }
        plan.optim.push_back({param, std::move(s)});
      }
    }
  }

  if (l.meta.contains("extra")) plan.extra.values = l.meta["extra"].get<std::map<std::string, std::string>>();
  for (const auto& it : items.items()) {
    if (it.value()["kind"] != state::format::kExtra) continue;
    const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    auto t = at::empty(shape, at::TensorOptions().dtype(state::format::parse_dtype(it.value()["dtype"])));
    plan_fill(l, plan, it.key(), state::format::kExtra, t.view({-1}), 0, t.numel());
    plan.extra.tensors[it.key()] = t;
  }
  return plan;
}

// The rest of step 1: verifies every record the plan copies from, in file order
// ([Note: reads in file order]), and points each copy at its verified bytes.
void verify_in_file_order(LoadPlan& plan, state::format::MappedRecords& records) {
  std::stable_sort(plan.copies.begin(), plan.copies.end(), [](const PendingCopy& a, const PendingCopy& b) {
    return std::tie(a.record->file, a.record->offset) < std::tie(b.record->file, b.record->offset);
  });
  for (auto& c : plan.copies)
    c.src = records.verified(*c.record) + c.first * static_cast<int64_t>(c.dst.element_size());
}

// Step 2 of [Note: atomic load]: returns when every rank prepared its part;
// otherwise throws, on every rank, what failed where.
void agree_to_commit(const comm::ProcessGroup& pg, const std::string& my_error, const std::string& dir) {
  const int world = pg.size();
  std::vector<std::string> errors{my_error};
  if (world > 1) {
    auto flags = torch::zeros({world}, torch::kLong);
    flags.data_ptr<int64_t>()[pg.rank()] = my_error.empty() ? 0 : 1;
    comm::all_reduce(pg, flags).wait();
    if (flags.sum().item<int64_t>() == 0) return;
    errors = comm::all_gather_object(pg, my_error);  // every rank takes this branch
  } else if (my_error.empty()) {
    return;
  }
  // Ranks that failed alike (a file every rank reads) are named together.
  std::vector<std::pair<std::string, std::vector<int>>> by_message;
  int failed = 0;
  for (int r = 0; r < static_cast<int>(errors.size()); ++r) {
    if (errors[r].empty()) continue;
    ++failed;
    auto same = std::find_if(by_message.begin(), by_message.end(), [&](const auto& m) { return m.first == errors[r]; });
    if (same == by_message.end()) by_message.push_back({errors[r], {r}});
    else same->second.push_back(r);
  }
  std::string msg = "fsdp: load_checkpoint('" + dir + "') failed on " + std::to_string(failed) + " of " +
                    std::to_string(world) + (world == 1 ? " rank" : " ranks") +
                    "; no rank changed its parameters, buffers or optimizer state:";
  for (const auto& m : by_message) {
    msg += "\n  rank";
    if (m.second.size() > 1) msg += "s";
    for (size_t i = 0; i < m.second.size(); ++i) msg += (i ? ", " : " ") + std::to_string(m.second[i]);
    msg += ": " + m.first;
  }
  TORCH_CHECK(false, msg);
}

// Step 3 of [Note: atomic load]. A target on a device (a CUDA model's parameters and
// optimizer state) is written in place by one host-to-device copy per record piece, from
// the mapping: checkpoints hold host bytes whatever device saved them, so a GPU run's
// checkpoint loads into a CPU run and the other way round.
void commit(LoadPlan& plan, torch::optim::Optimizer* optimizer) {
  for (const auto& c : plan.copies) {
    const int64_t n = c.dst.numel();
    if (c.dst.is_contiguous() && c.dst.device().is_cpu()) {
      state::format::copy_out(c.dst.data_ptr(), c.src, static_cast<size_t>(n) * c.dst.element_size());
    } else {
      c.dst.copy_(at::from_blob(const_cast<char*>(c.src), {n}, at::TensorOptions().dtype(c.dst.scalar_type())));
    }
  }
  if (!optimizer) return;
  for (auto& o : plan.optim) {
    if (o.state) state::set_param_state(*optimizer, o.param, std::move(*o.state));
    else state::erase_param_state(*optimizer, o.param);
  }
  auto& groups = optimizer->param_groups();
  for (const auto& [gi, lr] : plan.lrs) groups[gi].options().set_lr(lr);
}

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

CheckpointExtra load_checkpoint(const std::string& dir, FullyShardedBase& model, torch::optim::Optimizer* optimizer) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "load"});
  // Fails alike on every rank (a model inside its step), before any collective.
  return state::load_checkpoint_of(dir, subject_of(model, "load_checkpoint"), optimizer);
}

CheckpointExtra state::load_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                                          torch::optim::Optimizer* optimizer) {
  const auto& pg = subject.group;
  const int rank = pg.rank();
  const auto& pieces = subject.pieces;
  torch::NoGradGuard no_grad;
  std::unique_ptr<state::format::MappedRecords> records;  // the verified bytes live here until the commit
  LoadPlan plan;
  std::string error;
  try {
    Loaded l = open_checkpoint(dir);
    plan = plan_load(l, *subject.module, pieces, optimizer, rank);
    records = std::make_unique<state::format::MappedRecords>(l.dir);
    verify_in_file_order(plan, *records);
  } catch (const std::exception& e) {
    error = message_of(e);
  } catch (...) {
    error = "unknown exception";
  }
  if (!error.empty()) plan = LoadPlan();  // drops the tensors it allocated
  agree_to_commit(pg, error, dir);
  commit(plan, optimizer);
  return std::move(plan.extra);
}

}  // namespace fsdp
