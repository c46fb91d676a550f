#pragma once
/// [Note: nested backward]
/// A C++ activation checkpoint is the reentrant kind (activation_checkpoint.h): its
/// backward re-runs a piece of the forward (a *recompute*) and then a *nested backward*
/// through that piece, a graph task of its own inside the enclosing one. Two things
/// every end-of-backward consumer needs follow from that, and this is the one place that
/// knows them:
///  * Engine::queue_callback lands on the innermost graph task, so work meant for the end
///    of the whole backward would run when a nested backward ends. queue_end_of_backward
///    holds such a callback while a nested backward runs and queues it on the enclosing
///    task when the outermost nested backward returns.
///  * A module's forward can run three ways: normally, as a checkpoint's first forward
///    (without grad, but its backward will come through a recompute), and as that
///    recompute (with grad, inside backward). The two predicates below tell them apart.
/// All three are per thread: the autograd engine runs a nested backward on the thread
/// that runs the checkpoint's backward.
#include <functional>

namespace fsdp::autograd {

/// Runs `fn` when the outermost backward of this thread ends (once). Call only while a
/// backward runs (from a hook); outside one, libtorch refuses.
void queue_end_of_backward(std::function<void()> fn);

/// True while a checkpoint re-runs a forward inside backward on this thread.
bool in_recompute();

/// True while a checkpoint runs its first forward (without grad) on this thread, and not
/// inside a recompute: what runs now will be recomputed before its backward.
bool in_checkpointed_forward();

}  // namespace fsdp::autograd
