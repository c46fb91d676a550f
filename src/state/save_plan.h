#pragma once
// Internal to src/state: what one rank writes in a save, decided on the training thread.
//
// [Note: save plans]
// A save splits where the training thread must stop and where it need not. At the step
// boundary the training thread makes the plan: this rank's records in file order (each a
// tensor and the element range of the item it holds), the optimizer's step per parameter,
// and on rank 0 everything the metadata says that the rank files do not (items, order,
// aliases, groups' learning rates, extras). That is small and fast. Writing the records,
// fsyncing, agreeing and the metadata's file table follow from the plan alone
// (checkpoint_writer.h), on the same thread (save_checkpoint) or on a writer thread
// (save_checkpoint_async). A plan's tensors are views of the live state; an asynchronous
// save first snapshots them (snapshot()), so training may change the live state while
// the writer reads the plan's.

#include <exception>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include "checkpoint_subject.h"

namespace fsdp::state {

struct PlannedRecord {
  std::string item, kind;
  at::Tensor values;  // contiguous, flat: elements [begin, end) of the item
  int64_t begin = 0, end = 0;
};

struct SavePlan {
  std::string dir, tmp;                // the checkpoint and where it is written first
  std::vector<PlannedRecord> records;  // this rank's file, in order (none: no file)
  nlohmann::json steps = nlohmann::json::object();  // optimizer step of each parameter written here
  nlohmann::json metadata;             // rank 0: the metadata but for files, records and steps
  std::string error;                   // why this rank cannot save (the writer reports it)
};

/// The plan of a save of `subject` into `dir` (training thread). A state it cannot save (an
/// optimizer's state not shaped like the parameters' pieces) is the plan's error, not a
/// throw: the other ranks learn it through the writer's agreement instead of waiting.
SavePlan plan_save(const std::string& dir, const CheckpointSubject& subject,
                   const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra);

/// The plan's bytes in memory that training does not write: host copies of every record
/// (pinned when the record is on a CUDA device). Returns the bytes copied.
int64_t snapshot(SavePlan& plan);

/// An exception's message without the C++ context c10::Error appends (users read it).
std::string error_message(const std::exception& e);

/// The bytes the plan's records hold.
int64_t planned_bytes(const SavePlan& plan);

}  // namespace fsdp::state
