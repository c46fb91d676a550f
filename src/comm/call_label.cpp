#include "fsdp/comm/call_label.h"

namespace fsdp::comm {

namespace {
thread_local CallLabel current_scope;
}  // namespace

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::kUnlabelled: return "unlabelled";
    case Phase::kSetup: return "setup";
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kStep: return "step";
    case Phase::kStateDict: return "state_dict";
    case Phase::kCheckpoint: return "checkpoint";
    case Phase::kTrainer: return "trainer";
  }
  return "?";
}

std::string CallLabel::describe() const {
  std::string s = to_string(phase);
  if (!subject.empty()) s += " " + subject;
  return s;
}

std::string CallLabel::site() const { return describe_site(file, line); }

std::string describe_site(const char* file, int line) {
  if (file == nullptr) return "";
  std::string f = file;
  for (const char* root : {"/src/", "/tools/", "/tests/", "/examples/"}) {
    const size_t at = f.rfind(root);
    if (at != std::string::npos) {
      f = f.substr(at + 1);
      break;
    }
  }
  return f + ":" + std::to_string(line);
}

LabelScope::LabelScope(CallLabel label) : previous_(std::move(current_scope)) {
  current_scope = std::move(label);
}

LabelScope::~LabelScope() { current_scope = std::move(previous_); }

const CallLabel& scope_label() { return current_scope; }

}  // namespace fsdp::comm
