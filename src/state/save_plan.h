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
//
// [Note: snapshots of a save]
// snapshot() takes each record one of two ways. Parameter and optimizer-state records in
// plain host memory are moved (once: by prepare_async_checkpoint after the first step, else
// by the first asynchronous save) onto pages of their own
// ([Note: state on pages of its own]) and protected copy-on-write ([Note: copy-on-write
// snapshots]): the training thread's stall is the protection, and a page is copied only when
// training writes it before the writer has taken it. Everything else is copied whole at the
// call: device tensors (into pinned memory; DMA bypasses page protection), pinned host
// memory, the exchange arena's (peers write it: ZeRO's flat parameters, zero-copy shards),
// buffers and extras (small, and a buffer may be a receive target).
//
// [Note: device records in a snapshot]
// A CUDA model's records are copied into pinned host memory on a side stream, so the call
// does not wait for them: the side stream first waits for an event recorded on the current
// stream (the state as of the step boundary, whatever kernels are still queued), and the
// current stream then waits for an event after the copies, so the next step's kernels,
// queued on it later, cannot overwrite a tensor before its copy has read it. The writer
// synchronizes on that event before it writes the first device record. Device-generic
// (c10's stream and event interfaces), as src/core/cuda_streams.cpp's are.

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include "checkpoint_subject.h"
#include "memory/cow_snapshot.h"

namespace fsdp::state {

struct PlannedRecord {
  std::string item, kind;
  at::Tensor values;  // contiguous, flat: elements [begin, end) of the item
  int64_t begin = 0, end = 0;
  size_t skew = 0;    // [Note: aligned records] in checkpoint_format.h, of the live values
  int region = -1;    // after snapshot(): the copy-on-write region holding the values (-1: values)
  size_t offset = 0;  // their byte offset in it
};

struct SavePlan {
  std::string dir, tmp;                // the checkpoint and where it is written first
  std::vector<PlannedRecord> records;  // this rank's file, in order (none: no file)
  nlohmann::json steps = nlohmann::json::object();  // optimizer step of each parameter written here
  nlohmann::json metadata;             // rank 0: the metadata but for files, records and steps
  std::string error;                   // why this rank cannot save (the writer reports it)
  std::shared_ptr<memory::CowSnapshot> cow;  // after snapshot(): the records' protected pages
  std::shared_ptr<c10::Event> device_copies;  // after snapshot(): the device records' copies are done
  std::shared_ptr<Tracer> tracer;      // the subject's schedule trace, if on
};

/// What snapshot() did.
struct SnapshotTaken {
  bool fits = true;          // false: the copies would exceed the cap; nothing was taken
  int64_t copied_bytes = 0;  // records copied whole (device, pinned, shared or pooled memory; buffers)
  int64_t cow_bytes = 0;     // bytes under copy-on-write protection
};

/// The plan of a save of `subject` into `dir` (training thread). A state it cannot save (an
/// optimizer's state not shaped like the parameters' pieces) is the plan's error, not a
/// throw: the other ranks learn it through the writer's agreement instead of waiting.
SavePlan plan_save(const std::string& dir, const CheckpointSubject& subject,
                   const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra);

/// The plan's bytes as they are now, whatever training writes next ([Note: snapshots of a
/// save]). `copy_cap` bounds the host memory it holds (copies and copy-on-write pages);
/// takes nothing (fits false) when the records it would copy whole exceed it.
SnapshotTaken snapshot(SavePlan& plan, int64_t copy_cap);

/// What snapshot() would protect copy-on-write, moved onto pages of its own now (the first
/// snapshot's copy, taken ahead of it). Returns those records' bytes.
int64_t move_protectable_records(const SavePlan& plan);


}  // namespace fsdp::state
