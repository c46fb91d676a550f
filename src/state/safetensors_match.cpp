#include "safetensors_match.h"

#include <map>
#include <set>
#include <sstream>

#include "error_message.h"

namespace fsdp::state {

namespace safetensors_match_detail {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// The bookkeeping of one match: which model tensor is filled, by what, under which name.
class Matcher {
 public:
  Matcher(const SafetensorsSource& source, const std::vector<LoadTarget>& targets,
          const SafetensorsLoadOptions& options)
      : source_(source), targets_(targets), options_(options), filled_by_(targets.size()), filled_as_(targets.size()) {
    for (size_t t = 0; t < targets.size(); ++t) {
      target_of_[targets[t].name] = t;
      for (const auto& a : targets[t].aliases) target_of_[a] = t;
    }
  }

  NameMatch run() {
    for (size_t k = 0; k < options_.rules.size() && m_.error.empty(); ++k) take_rule(k);
    for (const std::string& name : source_.names()) {
      if (!m_.error.empty()) break;
      if (!used_.count(name)) take_file_tensor(name);
    }
    if (!m_.error.empty()) return m_;
    for (size_t t = 0; t < targets_.size(); ++t)
      if (filled_by_[t].empty()) m_.missing.push_back(targets_[t].name);
    if (options_.strict && (!m_.missing.empty() || !m_.unexpected.empty())) m_.error = strict_error();
    return m_;
  }

 private:
  const SafetensorsSource& source_;
  const std::vector<LoadTarget>& targets_;
  const SafetensorsLoadOptions& options_;
  std::map<std::string, size_t> target_of_;  // every model name, aliases included
  std::vector<std::string> filled_by_;       // per target: what filled it ("" nothing yet)
  std::vector<std::string> filled_as_;       // per target: under which model name
  std::set<std::string> used_;               // file names a rule reads
  NameMatch m_;

  void fail(const std::string& what) {
    if (m_.error.empty()) m_.error = what;
  }

  bool readable(const std::string& file_name, const std::string& who) {
    const SafetensorsSource::Tensor* t = source_.find(file_name);
    if (t == nullptr) {
      fail(who + " reads '" + file_name + "', which '" + source_.path() + "' lacks");
      return false;
    }
    if (!scalar_type_of(t->entry->dtype)) {
      fail("tensor '" + file_name + "' of " + source_.where(*t) + " is " + safetensors::dtype_name(t->entry->dtype) +
           ", which torch has no dtype for; leave it out (a name_map entry to \"\")");
      return false;
    }
    return true;
  }

  void take_rule(size_t k) {
    const TensorRule& rule = options_.rules[k];
    const std::string who = "rule #" + std::to_string(k);
    if (rule.to.empty() || !rule.fn) return fail(who + " has no `to` names or no `fn`");
    for (const auto& f : rule.from) {
      if (!readable(f, who)) return;
      used_.insert(f);
    }
    NameMatch::RuleUse use;
    use.rule = k;
    for (const auto& name : rule.to) {
      const auto it = target_of_.find(name);
      if (it == target_of_.end())
        return fail(who + " fills '" + name + "', which is not a parameter or buffer of the model");
      if (!filled_by_[it->second].empty())
        return fail(who + " fills '" + name + "', which " + filled_by_[it->second] + " fills too");
      filled_by_[it->second] = who;
      filled_as_[it->second] = name;
      use.targets.push_back(it->second);
    }
    m_.rules.push_back(std::move(use));
  }

  std::string model_name_of(const std::string& file_name) const {
    const auto it = options_.name_map.find(file_name);
    if (it != options_.name_map.end()) return it->second;
    return options_.rename ? options_.rename(file_name) : file_name;
  }

  void take_file_tensor(const std::string& file_name) {
    const std::string name = model_name_of(file_name);
    if (name.empty()) return;  // left out on purpose
    const auto it = target_of_.find(name);
    if (it == target_of_.end()) {
      m_.unexpected.push_back(file_name);
      return;
    }
    const size_t t = it->second;
    const SafetensorsSource::Tensor& src = *source_.find(file_name);
    const std::string label = "tensor '" + file_name + "' of " + source_.where(src);
    if (src.entry->shape != targets_[t].shape)
      return fail(label + " has shape " + shape_text(src.entry->shape) + ", the model's '" + name + "' " +
                  shape_text(targets_[t].shape) + (name == file_name ? "" : " (renamed from '" + file_name + "')"));
    if (!readable(file_name, label)) return;
    if (!filled_by_[t].empty()) {
      // A tied parameter saved under two of its names: one is read, the other accepted.
      if (filled_as_[t] != name && filled_by_[t].rfind("rule #", 0) != 0) return;
      return fail(label + " fills '" + name + "', which " + filled_by_[t] + " fills too; map one of them elsewhere");
    }
    filled_by_[t] = "tensor '" + file_name + "'";
    filled_as_[t] = name;
    m_.direct.push_back(NameMatch::Direct{t, file_name});
  }

  std::string strict_error() const {
    std::ostringstream os;
    os << "the file and the model do not match (strict):";
    if (!m_.unexpected.empty())
      os << " " << m_.unexpected.size() << " tensor(s) of the file fill nothing in the model: "
         << names_text(m_.unexpected) << ";";
    if (!m_.missing.empty())
      os << " " << m_.missing.size() << " parameter(s) or buffer(s) of the model are not in the file: "
         << names_text(m_.missing) << ";";
    os << " map names with SafetensorsLoadOptions::rename, name_map or rules, or set strict = false";
    return os.str();
  }
};

}  // namespace safetensors_match_detail

NameMatch match_names(const SafetensorsSource& source, const std::vector<LoadTarget>& targets,
                      const SafetensorsLoadOptions& options) {
  return safetensors_match_detail::Matcher(source, targets, options).run();
}

}  // namespace fsdp::state
