#include "fsdp/autograd/end_of_backward.h"

#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include "autograd/nesting.h"

namespace fsdp::autograd {

namespace {

struct Nesting {
  int nested_backwards = 0;     // nested backward passes running on this thread
  int checkpointed_forwards = 0;
  int recomputes = 0;
  std::vector<std::function<void()>> held;  // queued while a nested backward runs
};

Nesting& nesting() {
  thread_local Nesting n;
  return n;
}

}  // namespace

void queue_end_of_backward(std::function<void()> fn) {
  Nesting& n = nesting();
  if (n.nested_backwards > 0) {
    n.held.push_back(std::move(fn));
    return;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

bool in_recompute() { return nesting().recomputes > 0; }

bool in_checkpointed_forward() { return nesting().checkpointed_forwards > 0 && nesting().recomputes == 0; }

namespace detail {

void run_nested_backward(const std::function<void()>& body) {
  Nesting& n = nesting();
  ++n.nested_backwards;
  try {
    body();
  } catch (...) {
    if (--n.nested_backwards == 0) n.held.clear();
    throw;
  }
  if (--n.nested_backwards > 0) return;  // an enclosing nested backward still runs
  // Back on the outermost graph task: what the nested passes held ends it.
  std::vector<std::function<void()>> held = std::move(n.held);
  n.held.clear();
  for (auto& fn : held) torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

CheckpointedForwardScope::CheckpointedForwardScope() { ++nesting().checkpointed_forwards; }
CheckpointedForwardScope::~CheckpointedForwardScope() { --nesting().checkpointed_forwards; }

RecomputeScope::RecomputeScope() { ++nesting().recomputes; }
RecomputeScope::~RecomputeScope() { --nesting().recomputes; }

}  // namespace detail

}  // namespace fsdp::autograd
