#pragma once
// A span on the trace's phases track (Tracer::kPhase, include/fsdp/core/trace.h) for the
// enclosing scope: FSDP's own work on the compute thread (issuing and waiting for
// collectives, flattening gradients, optimizer steps in backward). It closes on every
// exit, an exception's too; with tracing off it records nothing and builds no name.
#include <string>

#include "fsdp/core/trace.h"

namespace fsdp::core::detail {

class PhaseSpan {
 public:
  PhaseSpan(Tracer* tracer, const char* what, const std::string& label)
      : tracer_(tracer != nullptr && tracer->enabled() ? tracer : nullptr) {
    if (!tracer_) return;
    name_ = std::string(what) + " " + label;
    mark_ = tracer_->begin();
  }
  ~PhaseSpan() {
    if (tracer_) tracer_->end(name_, Tracer::kPhase, mark_);
  }
  PhaseSpan(const PhaseSpan&) = delete;
  PhaseSpan& operator=(const PhaseSpan&) = delete;

 private:
  Tracer* tracer_;
  std::string name_;
  Tracer::Mark mark_;
};

}  // namespace fsdp::core::detail
