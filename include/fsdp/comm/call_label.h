#pragma once
/// What a collective is for. Every collective the library issues carries one to the single
/// place that issues them ([Note: the collective choke point] in src/comm/collective_call.h):
/// the phase of training and its subject (an FSDP unit's path, a ZeRO bucket, a state-dict
/// entry), so that errors, traces and records can say which collective of which unit it was.
///
///     fsdp::comm::CallLabel label(fsdp::comm::Phase::kForward, "blocks.3");  // "forward blocks.3"
///     fsdp::comm::LabelScope scope({fsdp::comm::Phase::kCheckpoint, "save"});
///
/// Every collective of collectives.h takes a label as its last argument; a call passed
/// none takes the innermost LabelScope of its thread, else stays Phase::kUnlabelled.

#include <string>

namespace fsdp::comm {

enum class Phase {
  kUnlabelled,  ///< nobody said
  kSetup,       ///< process groups, wrapping, module-state synchronisation, sharded construction
  kForward,
  kBackward,
  kStep,        ///< optimizer step, gradient clipping, loss scaling
  kStateDict,   ///< state dicts, full-parameter views, optimizer-state consolidation
  kCheckpoint,  ///< checkpoint save and load
  kTrainer,     ///< the Trainer's own agreements (loss, metrics, validation, resume)
  Unlabelled [[deprecated("use kUnlabelled")]] = kUnlabelled,
  Setup [[deprecated("use kSetup")]] = kSetup,
  Forward [[deprecated("use kForward")]] = kForward,
  Backward [[deprecated("use kBackward")]] = kBackward,
  Step [[deprecated("use kStep")]] = kStep,
  StateDict [[deprecated("use kStateDict")]] = kStateDict,
  Checkpoint [[deprecated("use kCheckpoint")]] = kCheckpoint,
  Trainer [[deprecated("use kTrainer")]] = kTrainer,
};
/// "unlabelled", "setup", "forward", "backward", "step", "state_dict", "checkpoint", "trainer".
const char* to_string(Phase phase);

struct CallLabel {
  CallLabel() = default;
  /// The file and line default to where the label is written: the call site that the flight
  /// recorder names (src/comm/flight_recorder.h).
  /* implicit */ CallLabel(Phase p, std::string s = {}, const char* file = __builtin_FILE(),
                           int line = __builtin_LINE())
      : phase(p), subject(std::move(s)), file(file), line(line) {}
  bool empty() const { return phase == Phase::kUnlabelled && subject.empty(); }
  /// "forward blocks.3", "step", "unlabelled".
  std::string describe() const;
  /// "src/core/unit.cpp:120" (the path from its last "src/" or "tools/" on), "" when unknown.
  std::string site() const;

  Phase phase = Phase::kUnlabelled;
  std::string subject;  ///< unit path, bucket, entry; "" when the phase says enough
  const char* file = nullptr;  ///< where the label was made (a string literal)
  int line = 0;
};

/// "src/core/unit.cpp:120": `file` from its last "src/", "tools/", "tests/" or "examples/"
/// on; "" when `file` is null.
std::string describe_site(const char* file, int line);

/// Within its lifetime, collectives issued on this thread without a label of their own take
/// `label`. Scopes nest; the innermost wins.
class LabelScope {
 public:
  explicit LabelScope(CallLabel label);
  ~LabelScope();
  LabelScope(const LabelScope&) = delete;
  LabelScope& operator=(const LabelScope&) = delete;

 private:
  CallLabel previous_;
};
/// The innermost scope's label on this thread (empty when none).
const CallLabel& scope_label();

}  // namespace fsdp::comm
