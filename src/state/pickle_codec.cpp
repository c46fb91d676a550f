#include "pickle_codec.h"

#include <cstring>
#include <stdexcept>
#include <variant>

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::pickle::value_detail {

using Kind = Value::Kind;

struct Global {
  Value module, name;  // Strings
};

struct Object {
  Value cls;
  Construction how = Construction::Reduce;
  Value args, kwargs;
  std::vector<Value> items;          // APPEND, APPENDS
  std::vector<Value::Entry> entries;  // SETITEM, SETITEMS
  bool has_state = false;
  Value state;                       // BUILD
};

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("fsdp: pickle: " + what); }

bool is_sequence(Kind k) { return k == Kind::Tuple || k == Kind::List || k == Kind::Set || k == Kind::FrozenSet; }

std::string article(Kind k) {
  const std::string name = kind_name(k);
  return (name[0] == 'I' || name[0] == 'O' ? "an " : "a ") + name;
}

// The byte count of the UTF-8 sequence led by `lead` (0 for a byte that cannot lead one),
// and the range its second byte must lie in (the rules that forbid overlong forms and
// code points past U+10FFFF; Python's surrogatepass allows ED A0..BF, the surrogates).
int sequence_length(unsigned char lead, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xbf;
  if (lead < 0x80) return 1;
  if (lead < 0xc2) return 0;
  if (lead < 0xe0) return 2;
  if (lead < 0xf0) {
    if (lead == 0xe0) *lo = 0xa0;
    return 3;
  }
  if (lead > 0xf4) return 0;
  if (lead == 0xf0) *lo = 0x90;
  if (lead == 0xf4) *hi = 0x8f;
  return 4;
}

}  // namespace fsdp::state::pickle::value_detail

namespace fsdp::state::pickle {

using value_detail::fail;

struct Value::Node {
  Kind kind = Kind::None;
  std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<Value>, std::vector<Entry>,
               value_detail::Global, value_detail::Object>
      data;
};

Value::Value() = default;

Value Value::boolean(bool b) { return Value(std::make_shared<Node>(Node{Kind::Bool, b})); }
Value Value::integer(int64_t i) { return Value(std::make_shared<Node>(Node{Kind::Int, i})); }
Value Value::floating(double d) { return Value(std::make_shared<Node>(Node{Kind::Float, d})); }
Value Value::string(std::string utf8) { return Value(std::make_shared<Node>(Node{Kind::String, std::move(utf8)})); }
Value Value::bytes(std::string raw) { return Value(std::make_shared<Node>(Node{Kind::Bytes, std::move(raw)})); }
Value Value::tuple(std::vector<Value> items) {
  return Value(std::make_shared<Node>(Node{Kind::Tuple, std::move(items)}));
}
Value Value::list(std::vector<Value> items) {
  return Value(std::make_shared<Node>(Node{Kind::List, std::move(items)}));
}
Value Value::set(std::vector<Value> items) {
  return Value(std::make_shared<Node>(Node{Kind::Set, std::move(items)}));
}
Value Value::frozenset(std::vector<Value> items) {
  return Value(std::make_shared<Node>(Node{Kind::FrozenSet, std::move(items)}));
}
Value Value::dict(std::vector<Entry> entries) {
  return Value(std::make_shared<Node>(Node{Kind::Dict, std::move(entries)}));
}

Value Value::global(const std::string& module, const std::string& name) {
  return global(string(module), string(name));
}

Value Value::global(Value module, Value name) {
  if (module.kind() != Kind::String || name.kind() != Kind::String)
    throw std::invalid_argument("fsdp: pickle: a Global's module and name are Strings, not " + describe(module) +
                                " and " + describe(name));
  return Value(std::make_shared<Node>(Node{Kind::Global, value_detail::Global{std::move(module), std::move(name)}}));
}

Value Value::object(Construction how, Value cls, Value args, Value kwargs) {
  if (args.kind() != Kind::Tuple)
    throw std::invalid_argument("fsdp: pickle: an Object's arguments are a Tuple, not " + describe(args));
  if (how == Construction::NewObjEx ? kwargs.kind() != Kind::Dict : !kwargs.is_none())
    throw std::invalid_argument("fsdp: pickle: an Object's keyword arguments are a Dict for NEWOBJ_EX and None "
                                "otherwise, not " + describe(kwargs));
  value_detail::Object o;
  o.cls = std::move(cls);
  o.how = how;
  o.args = std::move(args);
  o.kwargs = std::move(kwargs);
  return Value(std::make_shared<Node>(Node{Kind::Object, std::move(o)}));
}

Value::Kind Value::kind() const { return node_ ? node_->kind : Kind::None; }

const Value::Node& Value::node_of(Kind k, const char* as) const {
  if (kind() != k) fail(std::string("asked for ") + as + " of " + describe(*this) + ", which has none");
  return *node_;
}

bool Value::as_bool() const { return std::get<bool>(node_of(Kind::Bool, "the bool").data); }
int64_t Value::as_int() const { return std::get<int64_t>(node_of(Kind::Int, "the integer").data); }
double Value::as_float() const { return std::get<double>(node_of(Kind::Float, "the float").data); }
const std::string& Value::as_string() const { return std::get<std::string>(node_of(Kind::String, "the text").data); }
const std::string& Value::as_bytes() const { return std::get<std::string>(node_of(Kind::Bytes, "the bytes").data); }

std::vector<int64_t> Value::as_ints() const {
  if (kind() != Kind::Tuple && kind() != Kind::List) fail("asked for the integers of " + describe(*this));
  std::vector<int64_t> out;
  for (const Value& v : items()) out.push_back(v.as_int());
  return out;
}

const std::vector<Value>& Value::items() const {
  if (kind() == Kind::Object) return std::get<value_detail::Object>(node_->data).items;
  if (!value_detail::is_sequence(kind())) fail("asked for the elements of " + describe(*this));
  return std::get<std::vector<Value>>(node_->data);
}

const std::vector<Value::Entry>& Value::entries() const {
  if (kind() == Kind::Object) return std::get<value_detail::Object>(node_->data).entries;
  return std::get<std::vector<Entry>>(node_of(Kind::Dict, "the entries").data);
}

const Value* Value::find(std::string_view key) const {
  for (const Entry& e : std::get<std::vector<Entry>>(node_of(Kind::Dict, "a key").data))
    if (e.first.kind() == Kind::String && e.first.as_string() == key) return &e.second;
  return nullptr;
}

const Value& Value::at(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail("a Dict has no key '" + std::string(key) + "'");
  return *v;
}

const Value& Value::module_value() const {
  return std::get<value_detail::Global>(node_of(Kind::Global, "the module").data).module;
}
const Value& Value::name_value() const {
  return std::get<value_detail::Global>(node_of(Kind::Global, "the name").data).name;
}
const std::string& Value::module() const { return module_value().as_string(); }
const std::string& Value::name() const { return name_value().as_string(); }

bool Value::is_global(std::string_view module_name, std::string_view global_name) const {
  return kind() == Kind::Global && module() == module_name && name() == global_name;
}

const Value& Value::cls() const {
  return std::get<value_detail::Object>(node_of(Kind::Object, "the class").data).cls;
}
Construction Value::construction() const {
  return std::get<value_detail::Object>(node_of(Kind::Object, "the construction").data).how;
}
const Value& Value::args() const {
  return std::get<value_detail::Object>(node_of(Kind::Object, "the arguments").data).args;
}
const Value& Value::kwargs() const {
  return std::get<value_detail::Object>(node_of(Kind::Object, "the keyword arguments").data).kwargs;
}
bool Value::has_state() const {
  return std::get<value_detail::Object>(node_of(Kind::Object, "the state").data).has_state;
}

const Value& Value::state() const {
  const auto& o = std::get<value_detail::Object>(node_of(Kind::Object, "the state").data);
  if (!o.has_state) fail(describe(*this) + " has no state (no BUILD gave it one)");
  return o.state;
}

bool Value::is_instance_of(std::string_view module_name, std::string_view class_name) const {
  return kind() == Kind::Object && cls().is_global(module_name, class_name);
}

const Value* Value::find_attr(std::string_view name) const {
  const Value& s = state();
  // A class with __slots__ pickles (instance __dict__ or None, {slot: value}).
  const bool slotted = s.kind() == Kind::Tuple && s.items().size() == 2 &&
                       (s.items()[0].is_none() || s.items()[0].kind() == Kind::Dict) &&
                       s.items()[1].kind() == Kind::Dict;
  if (s.kind() != Kind::Dict && !slotted)
    fail(describe(*this) + " has state " + describe(s) + ", not a Dict of attributes: read its state() instead");
  if (!slotted) return s.find(name);
  if (const Value* v = s.items()[1].find(name)) return v;
  return s.items()[0].is_none() ? nullptr : s.items()[0].find(name);
}

const Value& Value::attr(std::string_view name) const {
  const Value* v = find_attr(name);
  if (!v) fail(describe(*this) + " has no attribute '" + std::string(name) + "' in its state");
  return *v;
}

void Value::append(Value item) {
  if (kind() == Kind::Object) {
    std::get<value_detail::Object>(node_->data).items.push_back(std::move(item));
    return;
  }
  if (kind() != Kind::List && kind() != Kind::Set) fail("cannot append to " + describe(*this));
  std::get<std::vector<Value>>(node_->data).push_back(std::move(item));
}

void Value::set_item(Value key, Value v) {
  if (kind() == Kind::Object) {
    std::get<value_detail::Object>(node_->data).entries.emplace_back(std::move(key), std::move(v));
    return;
  }
  if (kind() != Kind::Dict) fail("cannot set an item of " + describe(*this));
  std::get<std::vector<Entry>>(node_->data).emplace_back(std::move(key), std::move(v));
}

void Value::set_state(Value state) {
  if (kind() != Kind::Object) fail("cannot give state to " + describe(*this) + ": only an Object takes state");
  auto& o = std::get<value_detail::Object>(node_->data);
  o.state = std::move(state);
  o.has_state = true;
}

void Value::release() {
  if (!node_) return;
  node_->kind = Kind::None;
  node_->data = std::monostate{};
}

const char* kind_name(Value::Kind kind) {
  static const char* const names[] = {"None", "Bool", "Int",  "Float", "String", "Bytes",  "Tuple",
                                      "List", "Dict", "Set", "FrozenSet", "Global", "Object"};
  return names[static_cast<int>(kind)];
}

std::string describe(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None: return "None";
    case Value::Kind::Global: return "the Global " + v.module() + "." + v.name();
    case Value::Kind::Object:
      if (v.cls().kind() == Value::Kind::Global) return "an Object of " + v.cls().module() + "." + v.cls().name();
      return "an Object made by " + describe(v.cls());
    default: return value_detail::article(v.kind());
  }
}

bool operator==(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.same(b)) return true;
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::None: return true;
    case K::Bool: return a.as_bool() == b.as_bool();
    case K::Int: return a.as_int() == b.as_int();
    case K::Float: {
      const double x = a.as_float(), y = b.as_float();
      return std::memcmp(&x, &y, sizeof x) == 0;
    }
    case K::String: return a.as_string() == b.as_string();
    case K::Bytes: return a.as_bytes() == b.as_bytes();
    case K::Tuple: case K::List: case K::Set: case K::FrozenSet: return a.items() == b.items();
    case K::Dict: return a.entries() == b.entries();
    case K::Global: return a.module() == b.module() && a.name() == b.name();
    case K::Object:
      return a.cls() == b.cls() && a.construction() == b.construction() && a.args() == b.args() &&
             a.kwargs() == b.kwargs() && a.items() == b.items() && a.entries() == b.entries() &&
             a.has_state() == b.has_state() && (!a.has_state() || a.state() == b.state());
  }
  return false;
}

bool is_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    unsigned char lo = 0, hi = 0;
    const int len = value_detail::sequence_length(s[i], &lo, &hi);
    if (len == 0 || n - i < static_cast<size_t>(len)) return false;
    for (int k = 1; k < len; ++k) {
      const unsigned char c = s[i + k];
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xbf)) return false;
    }
    i += len;
  }
  return true;
}

}  // namespace fsdp::state::pickle
