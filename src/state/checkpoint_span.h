#pragma once
// Internal to src/state: a span of a save on the model's schedule trace (include/fsdp/core/
// trace.h): its snapshot on the phases track, its writing on the checkpoint track. Nothing
// when the model traces nothing.

#include <memory>
#include <string>
#include <utility>

#include "fsdp/core/trace.h"

namespace fsdp::state {

class CheckpointSpan {
 public:
  CheckpointSpan(std::shared_ptr<Tracer> tracer, std::string name, int tid)
      : tracer_(std::move(tracer)), name_(std::move(name)), tid_(tid) {
    if (tracer_) mark_ = tracer_->begin();
  }
  ~CheckpointSpan() {
    if (tracer_) tracer_->end(name_, tid_, mark_);
  }
  CheckpointSpan(const CheckpointSpan&) = delete;
  CheckpointSpan& operator=(const CheckpointSpan&) = delete;

 private:
  std::shared_ptr<Tracer> tracer_;
  std::string name_;
  int tid_;
  Tracer::Mark mark_;
};

}  // namespace fsdp::state
