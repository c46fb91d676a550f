#pragma once
// The per-thread facts of [Note: nested backward] (include/fsdp/autograd/end_of_backward.h)
// as scopes, set only by the checkpoint (activation_checkpoint.cpp).
#include <functional>

namespace fsdp::autograd::detail {

/// Runs `body`, a nested backward: callbacks queued meanwhile are held and queued on the
/// enclosing graph task when the outermost nested backward returns. On an exception they
/// are dropped with the backward that failed.
void run_nested_backward(const std::function<void()>& body);

/// The checkpoint's first forward (no grad) while alive.
class CheckpointedForwardScope {
 public:
  CheckpointedForwardScope();
  ~CheckpointedForwardScope();
  CheckpointedForwardScope(const CheckpointedForwardScope&) = delete;
  CheckpointedForwardScope& operator=(const CheckpointedForwardScope&) = delete;
};

/// A recompute while alive.
class RecomputeScope {
 public:
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

}  // namespace fsdp::autograd::detail
