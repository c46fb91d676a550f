#include "fsdp/comm/call_label.h"

namespace fsdp::comm {

namespace {
thread_local CallLabel current_scope;
}  // namespace

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::Unlabelled: return "unlabelled";
    case Phase::Setup: return "setup";
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Step: return "step";
    case Phase::StateDict: return "state_dict";
    case Phase::Checkpoint: return "checkpoint";
    case Phase::Trainer: return "trainer";
  }
  return "?";
}

std::string CallLabel::describe() const {
  std::string s = to_string(phase);
  if (!subject.empty()) s += " " + subject;
  return s;
}

LabelScope::LabelScope(CallLabel label) : previous_(std::move(current_scope)) {
  current_scope = std::move(label);
}

LabelScope::~LabelScope() { current_scope = std::move(previous_); }

const CallLabel& scope_label() { return current_scope; }

}  // namespace fsdp::comm
