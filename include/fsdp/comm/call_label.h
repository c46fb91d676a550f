#pragma once
/// What a collective is for. Every collective the library issues carries one to the single
/// place that issues them ([Note: the collective choke point] in src/comm/collective_call.h):
/// the phase of training and its subject (an FSDP unit's path, a ZeRO bucket, a state-dict
/// entry), so that errors, traces and records can say which collective of which unit it was.
///
///     fsdp::comm::CallLabel label(fsdp::comm::Phase::Forward, "blocks.3");  // "forward blocks.3"
///     fsdp::comm::LabelScope scope({fsdp::comm::Phase::Checkpoint, "save"});
///
/// Every collective of collectives.h takes a label as its last argument; a call passed
/// none takes the innermost LabelScope of its thread, else stays Phase::Unlabelled.

#include <string>

namespace fsdp::comm {

enum class Phase {
  Unlabelled,  ///< nobody said
  Setup,       ///< process groups, wrapping, module-state synchronisation, sharded construction
  Forward,
  Backward,
  Step,        ///< optimizer step, gradient clipping, loss scaling
  StateDict,   ///< state dicts, full-parameter views, optimizer-state consolidation
  Checkpoint,  ///< checkpoint save and load
  Trainer,     ///< the Trainer's own agreements (loss, metrics, validation, resume)
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
  bool empty() const { return phase == Phase::Unlabelled && subject.empty(); }
  /// "forward blocks.3", "step", "unlabelled".
  std::string describe() const;
  /// "src/core/unit.cpp:120" (the path from its last "src/" or "tools/" on), "" when unknown.
  std::string site() const;

  Phase phase = Phase::Unlabelled;
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
