// See checkpoint_writer.h.
#include "checkpoint_writer.h"

#include <algorithm>
#include <filesystem>
#include <memory>

#include <c10/util/Exception.h>

#include "checkpoint_format.h"
#include "checkpoint_testing.h"
#include "error_message.h"
#include "shared_directory.h"
#include "snapshot_reader.h"

namespace fsdp::state {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Fault injection (checkpoint_testing.h); empty unless a test installed one.
detail::CheckpointRecordHook& record_hook() {
  static detail::CheckpointRecordHook hook;
  return hook;
}

// Phase 0: rank 0 makes `<dir>.tmp` afresh, and every rank sees it ([Note: checkpoint
// directories are shared] in shared_directory.h) before anything is written.
void make_tmp_directory(const SavePlan& plan, const StoreAgreement& agree) {
  std::string error;
  if (agree.rank() == 0) {
    try {
      std::error_code ec;
      fs::remove_all(plan.tmp, ec);  // left by a crashed save
      fs::create_directories(plan.tmp);
    } catch (const std::exception& e) {
      error = std::string("fsdp: save_checkpoint cannot create '") + plan.tmp + "': " + error_message(e);
    }
    agree.post("tmp", error);
  }
  error = agree.from(0, "tmp");
  TORCH_CHECK(error.empty(), error);
  const std::string unshared = check_shared_directory(agree, plan.tmp, plan.dir, "save_checkpoint");
  if (!unshared.empty()) {
    std::error_code ec;
    if (agree.rank() == 0) fs::remove_all(plan.tmp, ec);
    TORCH_CHECK(false, unshared);
  }
}

// A copy-on-write snapshot gives its pages back however the writing ends: a page still
// protected would make training wait for a writer that has stopped.
struct ReleasedAtExit {
  memory::CowSnapshot* cow;
  void now() {
    if (cow) cow->release();
  }
  ~ReleasedAtExit() { now(); }
};

// Phase 1: this rank's file in `tmp`. Returns what rank 0 needs for the metadata: the records,
// the optimizer steps, the file (name, bytes, CRC-32).
json write_rank_file(const SavePlan& plan, int rank) {
  TORCH_CHECK(plan.error.empty(), plan.error);
  json mine = {{"records", json::array()}, {"steps", plan.steps}, {"file", nullptr}};
  if (plan.records.empty()) return mine;
  const detail::CheckpointRecordHook& after_record = record_hook();
  ReleasedAtExit released{plan.cow.get()};
  std::unique_ptr<SnapshotReader> protected_pages;
  if (plan.cow) protected_pages = std::make_unique<SnapshotReader>(*plan.cow);
  if (plan.device_copies) plan.device_copies->synchronize();  // [Note: device records in a snapshot]
  format::RankFileWriter writer(plan.tmp, format::rank_file_name(rank), format::RankFileWriter::Layout::kAligned);
  int64_t written = 0;
  for (const auto& r : plan.records) {
    if (r.region < 0) {
      writer.write(r.item, r.kind, r.values, r.begin, r.end, r.skew);
    } else {
      writer.write_streamed(r.item, r.kind, r.values.scalar_type(), r.begin, r.end,
                            [&](const format::RankFileWriter::Sink& sink) {
                              protected_pages->read(size_t(r.region), r.offset, r.values.nbytes(), sink);
                            },
                            r.skew);
    }
    ++written;
    if (after_record) after_record(written);
  }
  released.now();  // every page back to training before the fsync
  const int64_t bytes = writer.finish();
  for (const auto& r : writer.records()) mine["records"].push_back(r);
  mine["file"] = {{"name", writer.name()}, {"bytes", bytes}, {"crc32", writer.file_crc()}};
  mine["direct_bytes"] = writer.direct_bytes();  // this rank's statistic, not the metadata's
  return mine;
}

// Phase 2, rank 0: the metadata, from the plan and every rank's part.
json complete_metadata(const SavePlan& plan, const std::vector<json>& parts) {
  json meta = plan.metadata;
  json files = json::array(), records = json::array(), steps = json::object();
  for (const auto& j : parts) {
    if (!j["file"].is_null()) files.push_back(j["file"]);
    for (const auto& r : j["records"]) records.push_back(r);
    for (const auto& kv : j["steps"].items())
      steps[kv.key()] = std::max<int64_t>(steps.value(kv.key(), int64_t{0}), kv.value().get<int64_t>());
  }
  meta["files"] = files;
  meta["records"] = records;
  meta["steps"] = steps;
  return meta;
}

// The first failed rank's error, or "" when every part is a written file.
std::string first_failure(const std::vector<json>& parts) {
  for (size_t r = 0; r < parts.size(); ++r) {
    if (parts[r].contains("error"))
      return "fsdp: save_checkpoint failed on rank " + std::to_string(r) + " (" +
             parts[r]["error"].get<std::string>() + "); nothing was renamed into place";
  }
  return "";
}

// Phase 2, rank 0: the metadata written and fsync'd into `tmp` once every rank's file is;
// with kNow, the directory renamed into place too. Returns the error every rank raises, or "".
std::string finish_on_rank0(const SavePlan& plan, const StoreAgreement& agree, Publication publication) {
  std::vector<json> parts;
  for (const auto& text : agree.gather("part")) parts.push_back(json::parse(text));
  std::string error = first_failure(parts);
  if (!error.empty()) return error;
  try {
    format::write_file_synced(plan.tmp + "/" + format::kMetadataFile, complete_metadata(plan, parts).dump(1));
    format::fsync_dir(plan.tmp);
    if (publication == Publication::kNow) publish(plan.tmp, plan.dir);
  } catch (const std::exception& e) {
    error = std::string("fsdp: save_checkpoint (rank 0, metadata and rename): ") + error_message(e);
  }
  return error;
}

}  // namespace

void detail::set_checkpoint_record_hook(CheckpointRecordHook hook) { record_hook() = std::move(hook); }

WrittenSave write_checkpoint(const SavePlan& plan, const StoreAgreement& agree, Publication publication) {
  make_tmp_directory(plan, agree);
  WrittenSave done;
  std::string my_error;
  json mine;
  try {
    mine = write_rank_file(plan, agree.rank());
    if (!mine["file"].is_null()) done.file_bytes = mine["file"]["bytes"].get<int64_t>();
    done.direct_bytes = mine.value("direct_bytes", int64_t{0});
  } catch (const std::exception& e) {
    // A plan's error is not about the file; a failed write is.
    const std::string what = plan.error.empty()
        ? "writing '" + plan.tmp + "/" + format::rank_file_name(agree.rank()) + "': " + error_message(e) : plan.error;
    my_error = "fsdp: save_checkpoint on rank " + std::to_string(agree.rank()) + ": " + what +
               "; nothing was renamed into place";
    mine = {{"error", what}};
  }
  agree.post("part", mine.dump());
  if (agree.rank() == 0) agree.post("done", finish_on_rank0(plan, agree, publication));
  const std::string outcome = agree.from(0, "done");
  TORCH_CHECK(my_error.empty(), my_error);
  TORCH_CHECK(outcome.empty(), outcome);
  return done;
}

void publish(const std::string& tmp, const std::string& dir) {
  const std::string old = dir + ".old";
  std::error_code ec;
  fs::remove_all(old, ec);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  const auto parent = fs::absolute(dir).parent_path();
  format::fsync_dir(parent.string());
  fs::remove_all(old, ec);
}

}  // namespace fsdp::state
