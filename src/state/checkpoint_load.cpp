// Loading a checkpoint into any subject ([Note: checkpoint subjects] in checkpoint_subject.h),
// all or nothing on every rank ([Note: atomic load]).
#include "fsdp/state/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include <torch/torch.h>

#include "async_save.h"
#include "error_message.h"
#include "checkpoint_format.h"
#include "checkpoint_subject.h"
#include "comm/object_collectives.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "optim_state.h"

namespace fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;
using core::detail::LocalPiece;
using state::format::Record;

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

// The checkpoint holds `name` as an item of `kind`, with the model's shape and dtype.
void check_item(const Loaded& l, int rank, const std::string& name, const char* kind, c10::IntArrayRef shape,
                at::ScalarType dtype) {
  const auto& items = l.meta.at("items");
  TORCH_CHECK(items.contains(name) && items[name]["kind"] == kind, "fsdp: load_checkpoint on rank ", rank,
              ": checkpoint '", l.dir, "' has no ", kind, " '", name, "' (saved from a different model?)");
  const auto saved = items[name]["shape"].get<std::vector<int64_t>>();
  TORCH_CHECK(saved == shape.vec(), "fsdp: load_checkpoint: ", kind, " '", name, "' has shape ", shape,
              " in the model but ", c10::IntArrayRef(saved), " in checkpoint '", l.dir, "'");
  TORCH_CHECK(items[name]["dtype"] == state::format::dtype_name(dtype), "fsdp: load_checkpoint: ", kind, " '",
              name, "' is ", state::format::dtype_name(dtype), " in the model but ",
              items[name]["dtype"].get<std::string>(), " in checkpoint '", l.dir,
              "'; convert the model before wrapping");
}

using SavedNames = std::map<const c10::TensorImpl*, std::string>;

// The parameters' pieces and the buffers. Returns the name each piece was saved under: its
// own, or, for a tied parameter saved under another of its names, that one.
SavedNames plan_parameters_and_buffers(const Loaded& l, LoadPlan& plan, torch::nn::Module& module,
                                       const std::vector<LocalPiece>& pieces, int rank) {
  const auto& items = l.meta.at("items");
  const json saved_aliases = l.meta.value("aliases", json::object());
  SavedNames saved_name_of;
  for (const auto& p : pieces) {
    std::string name = p.name;
    if (!items.contains(name)) {
      if (saved_aliases.contains(name)) name = saved_aliases[name].get<std::string>();
      for (const auto& a : p.aliases)
        if (!items.contains(name) && items.contains(a)) name = a;
    }
    saved_name_of[p.param.unsafeGetTensorImpl()] = name;
    check_item(l, rank, name, state::format::kParam, p.shape, p.param.scalar_type());
    plan_fill(l, plan, name, state::format::kParam, p.flat(), p.begin, p.end);
  }
  for (const auto& b : module.named_buffers()) {
    check_item(l, rank, b.key(), state::format::kBuffer, b.value().sizes(), b.value().scalar_type());
    auto v = b.value();
    TORCH_INTERNAL_ASSERT(v.is_contiguous());
    plan_fill(l, plan, b.key(), state::format::kBuffer, v.view({-1}), 0, v.numel());
  }
  return saved_name_of;
}

// One parameter's optimizer state, saved under `name` with the kinds `kinds` (Adam's
// exp_avg, ...). The optimizer's own state tensors are the targets when they have the
// parameter's shape and dtype (a resume into a model that has already stepped, or a second
// load): no allocation, and no page faults and kernel zero-fill of fresh memory, which cost as
// much as the read. They are only written by the commit.
state::ParamOptimState plan_param_state(const Loaded& l, LoadPlan& plan, const torch::optim::Optimizer& optimizer,
                                        const at::Tensor& param, const LocalPiece& p, const std::string& name,
                                        const std::set<std::string>* kinds) {
  state::ParamOptimState s;
  s.step = l.meta.at("steps").value(name, int64_t{0});
  if (!kinds) return s;
  const auto current = state::get_param_state(optimizer, param);
  for (const auto& k : *kinds) {
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
  return s;
}

// The optimizer's state and learning rates, for an optimizer of the saved one's family.
void plan_optimizer(const Loaded& l, LoadPlan& plan, torch::optim::Optimizer& optimizer,
                    const std::vector<LocalPiece>& pieces, const SavedNames& saved_name_of) {
  const std::string kind = state::optimizer_kind(optimizer);
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
  const auto& groups = optimizer.param_groups();
  const auto& saved_groups = l.meta.at("param_groups");
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (gi < saved_groups.size()) plan.lrs.emplace_back(gi, saved_groups.at(gi).at("lr").get<double>());
    for (const auto& param : groups[gi].params()) {
      auto pit = piece_of.find(param.unsafeGetTensorImpl());
      TORCH_CHECK(pit != piece_of.end(), "fsdp: load_checkpoint: the optimizer holds a tensor of shape ",
                  param.sizes(), " that is not a parameter of the wrapped model; build the optimizer on the "
                  "wrapped model's parameters()");
      const std::string& name = saved_name_of.at(param.unsafeGetTensorImpl());
      auto kit = kinds_of.find(name);
      if (kit == kinds_of.end() && !steps.contains(name)) {
        plan.optim.push_back({param, std::nullopt});
        continue;
      }
      plan.optim.push_back({param, plan_param_state(l, plan, optimizer, param, *pit->second, name,
                                                    kit == kinds_of.end() ? nullptr : &kit->second)});
    }
  }
}

// The extra values and tensors (CheckpointExtra) saved beside the model.
void plan_extra(const Loaded& l, LoadPlan& plan) {
  if (l.meta.contains("extra")) plan.extra.values = l.meta["extra"].get<std::map<std::string, std::string>>();
  for (const auto& it : l.meta.at("items").items()) {
    if (it.value()["kind"] != state::format::kExtra) continue;
    const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    auto t = at::empty(shape, at::TensorOptions().dtype(state::format::parse_dtype(it.value()["dtype"])));
    plan_fill(l, plan, it.key(), state::format::kExtra, t.view({-1}), 0, t.numel());
    plan.extra.tensors[it.key()] = t;
  }
}

// Step 1 of [Note: atomic load], without the checksums: what lands where.
LoadPlan plan_load(const Loaded& l, torch::nn::Module& module, const std::vector<LocalPiece>& pieces,
                   torch::optim::Optimizer* optimizer, int rank) {
  LoadPlan plan;
  const SavedNames saved_name_of = plan_parameters_and_buffers(l, plan, module, pieces, rank);
  if (optimizer) plan_optimizer(l, plan, *optimizer, pieces, saved_name_of);
  plan_extra(l, plan);
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

}  // namespace


CheckpointExtra state::load_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                                          torch::optim::Optimizer* optimizer) {
  state::detail::settle_in_flight();  // a save still writing these tensors' snapshot
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
    error = state::error_message(e);
  } catch (...) {
    error = "unknown exception";
  }
  if (!error.empty()) plan = LoadPlan();  // drops the tensors it allocated
  agree_to_commit(pg, error, dir);
  commit(plan, optimizer);
  return std::move(plan.extra);
}

}  // namespace fsdp
