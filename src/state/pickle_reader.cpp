#include "pickle_codec.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

// The pickle reader ([Note: pickle] in pickle_codec.h): the stack machine, run over bytes
// it checks before it believes them.

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::pickle::read_detail {

using Kind = Value::Kind;

constexpr int kNewestProtocol = 5;

struct OpcodeName {
  uint8_t code;
  const char* name;
};
// Every opcode of protocols 0 to 5, so that an error names even the ones we refuse.
constexpr OpcodeName kOpcodeNames[] = {
    {'(', "MARK"}, {'.', "STOP"}, {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"}, {'F', "FLOAT"},
    {'I', "INT"}, {'J', "BININT"}, {'K', "BININT1"}, {'L', "LONG"}, {'M', "BININT2"}, {'N', "NONE"},
    {'P', "PERSID"}, {'Q', "BINPERSID"}, {'R', "REDUCE"}, {'S', "STRING"}, {'T', "BINSTRING"},
    {'U', "SHORT_BINSTRING"}, {'V', "UNICODE"}, {'X', "BINUNICODE"}, {'a', "APPEND"}, {'b', "BUILD"},
    {'c', "GLOBAL"}, {'d', "DICT"}, {'}', "EMPTY_DICT"}, {'e', "APPENDS"}, {'g', "GET"}, {'h', "BINGET"},
    {'i', "INST"}, {'j', "LONG_BINGET"}, {'l', "LIST"}, {']', "EMPTY_LIST"}, {'o', "OBJ"}, {'p', "PUT"},
    {'q', "BINPUT"}, {'r', "LONG_BINPUT"}, {'s', "SETITEM"}, {'t', "TUPLE"}, {')', "EMPTY_TUPLE"},
    {'u', "SETITEMS"}, {'G', "BINFLOAT"}, {'B', "BINBYTES"}, {'C', "SHORT_BINBYTES"}, {0x80, "PROTO"},
    {0x81, "NEWOBJ"}, {0x82, "EXT1"}, {0x83, "EXT2"}, {0x84, "EXT4"}, {0x85, "TUPLE1"}, {0x86, "TUPLE2"},
    {0x87, "TUPLE3"}, {0x88, "NEWTRUE"}, {0x89, "NEWFALSE"}, {0x8a, "LONG1"}, {0x8b, "LONG4"},
    {0x8c, "SHORT_BINUNICODE"}, {0x8d, "BINUNICODE8"}, {0x8e, "BINBYTES8"}, {0x8f, "EMPTY_SET"},
    {0x90, "ADDITEMS"}, {0x91, "FROZENSET"}, {0x92, "NEWOBJ_EX"}, {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"},
    {0x95, "FRAME"}, {0x96, "BYTEARRAY8"}, {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"},
};

const char* opcode_name(uint8_t code) {
  for (const OpcodeName& o : kOpcodeNames)
    if (o.code == code) return o.name;
  return nullptr;
}

std::string hex_byte(uint8_t b) {
  static const char digits[] = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

// Why a known opcode is refused: what the model has no place for.
const char* refusal(uint8_t code) {
  switch (code) {
    case op::PERSID: case op::BINPERSID:
      return "persistent IDs are not supported (torch.save refers to tensor storages this way; "
             "read such a file with torch::pickle_load)";
    case op::EXT1: case op::EXT2: case op::EXT4: return "the copyreg extension registry is not supported";
    case op::NEXT_BUFFER: case op::READONLY_BUFFER: return "out-of-band buffers are not supported";
    default:
      return "this opcode of protocols 0 and 1 (a text float, long or string, a Python 2 byte string, an "
             "old-style instance) is not supported: Python 3 does not write it at protocol 2 or later";
  }
}

// The machine's state while it runs: the input, the stack with its marks, and the memo.
class Reader {
 public:
  Reader(std::string_view bytes, const std::string& what) : in_(bytes), what_(what) {}
  Value run();
  std::vector<Value>& made() { return made_; }

 private:
  // Input: each take checks that the bytes are there before it reads them.
  [[noreturn]] void fail(const std::string& problem) const;
  std::string_view take(uint64_t n);
  uint64_t take_le(int n);
  std::string_view take_line();
  int64_t take_decimal();
  std::string take_text(uint64_t n);
  // The stack.
  void push(Value v) { stack_.push_back(std::move(v)); }
  void push_made(Value v);
  Value pop();
  Value& top();
  std::vector<Value> pop_mark();
  // One opcode: false after STOP. Each group returns whether the opcode was one of its own.
  bool step();
  bool scalar(uint8_t code);
  bool text(uint8_t code);
  bool container(uint8_t code);
  bool add(uint8_t code);
  std::vector<Value::Entry> pairs(std::vector<Value> flat);
  bool memo(uint8_t code);
  bool object(uint8_t code);
  bool control(uint8_t code);
  int64_t long_int(uint64_t n);
  Value& memo_get(uint64_t index);
  [[noreturn]] void fail_value(const std::string& problem) const;
  void check_nesting();

  std::string_view in_;
  const std::string& what_;
  size_t pos_ = 0;
  size_t op_at_ = 0;  // the offset of the opcode being run
  uint8_t op_ = 0;
  bool stopped_ = false;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;  // stack_'s size at each open MARK
  std::unordered_map<uint64_t, Value> memo_;
  std::vector<Value> made_;  // every container and object built (read() releases them on failure)
};

void Reader::fail(const std::string& problem) const {
  const char* name = opcode_name(op_);
  throw std::runtime_error("fsdp: pickle: '" + what_ + "': " + (name ? name : "opcode") + " (" + hex_byte(op_) +
                           ") at byte " + std::to_string(op_at_) + ": " + problem);
}

std::string_view Reader::take(uint64_t n) {
  const size_t left = in_.size() - pos_;
  if (n > left)
    fail("the pickle ends inside its operand (it needs " + std::to_string(n) + " bytes, " + std::to_string(left) +
         " remain): the file is truncated or damaged");
  const std::string_view out = in_.substr(pos_, n);
  pos_ += n;
  return out;
}

uint64_t Reader::take_le(int n) {
  const std::string_view b = take(n);
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[i]);
  return v;
}

std::string_view Reader::take_line() {
  const size_t end = in_.find('\n', pos_);
  if (end == std::string_view::npos) fail("the pickle ends inside its text operand (no end of line)");
  const size_t length = end - pos_;
  return take(length + 1).substr(0, length);
}

int64_t Reader::take_decimal() {
  const std::string_view line = take_line();
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
  if (ec != std::errc() || end != line.data() + line.size() || line.empty())
    fail("its operand '" + std::string(line.substr(0, 40)) + "' is not a decimal int64");
  return v;
}

std::string Reader::take_text(uint64_t n) {
  const std::string_view t = take(n);
  if (!is_utf8(t)) fail("its text is not valid UTF-8");
  return std::string(t);
}

void Reader::push_made(Value v) {
  made_.push_back(v);
  push(std::move(v));
}

Value Reader::pop() {
  if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
    fail("stack underflow: it takes a value, but the stack is empty" +
         std::string(marks_.empty() ? "" : " above its last MARK"));
  Value v = std::move(stack_.back());
  stack_.pop_back();
  return v;
}

Value& Reader::top() {
  if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
    fail("stack underflow: it works on the value on top, but the stack is empty" +
         std::string(marks_.empty() ? "" : " above its last MARK"));
  return stack_.back();
}

std::vector<Value> Reader::pop_mark() {
  if (marks_.empty()) fail("MARK missing: it takes the values above a MARK, but no MARK is open");
  std::vector<Value> items(std::make_move_iterator(stack_.begin() + marks_.back()),
                           std::make_move_iterator(stack_.end()));
  stack_.resize(marks_.back());
  marks_.pop_back();
  return items;
}

// A LONG1 or LONG4 operand: n bytes of little-endian two's complement.
int64_t Reader::long_int(uint64_t n) {
  const std::string_view b = take(n);
  if (n == 0) return 0;
  const bool negative = static_cast<uint8_t>(b[n - 1]) & 0x80;
  // Bytes past the eighth may only extend the sign of the eighth.
  for (uint64_t i = 8; i < n; ++i)
    if (static_cast<uint8_t>(b[i]) != (negative ? 0xff : 0x00) ||
        (static_cast<uint8_t>(b[7]) & 0x80) != (negative ? 0x80 : 0))
      fail("an integer of " + std::to_string(n) + " bytes does not fit in int64");
  uint64_t v = negative ? ~uint64_t{0} : 0;
  for (uint64_t i = std::min<uint64_t>(n, 8); i-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[i]);
  return static_cast<int64_t>(v);
}

bool Reader::scalar(uint8_t code) {
  switch (code) {
    case op::NONE: push(Value()); return true;
    case op::NEWTRUE: push(Value::boolean(true)); return true;
    case op::NEWFALSE: push(Value::boolean(false)); return true;
    case op::INT: {
      // Protocol 0's bools are INT "01" and "00".
      const std::string_view peek = in_.substr(pos_, 3);
      if (peek == "00\n" || peek == "01\n") {
        take(3);
        push(Value::boolean(peek[1] == '1'));
      } else {
        push(Value::integer(take_decimal()));
      }
      return true;
    }
    case op::BININT: push(Value::integer(static_cast<int32_t>(take_le(4)))); return true;
    case op::BININT1: push(Value::integer(static_cast<int64_t>(take_le(1)))); return true;
    case op::BININT2: push(Value::integer(static_cast<int64_t>(take_le(2)))); return true;
    case op::LONG1: push(Value::integer(long_int(take_le(1)))); return true;
    case op::LONG4: {
      const auto n = static_cast<int32_t>(take_le(4));
      if (n < 0) fail("its length " + std::to_string(n) + " is negative");
      push(Value::integer(long_int(static_cast<uint64_t>(n))));
      return true;
    }
    case op::BINFLOAT: {
      const std::string_view b = take(8);
      uint64_t bits = 0;
      for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);  // big-endian
      double d = 0;
      std::memcpy(&d, &bits, sizeof d);
      push(Value::floating(d));
      return true;
    }
    default: return false;
  }
}

bool Reader::text(uint8_t code) {
  switch (code) {
    case op::SHORT_BINUNICODE: push(Value::string(take_text(take_le(1)))); return true;
    case op::BINUNICODE: push(Value::string(take_text(take_le(4)))); return true;
    case op::BINUNICODE8: push(Value::string(take_text(take_le(8)))); return true;
    case op::SHORT_BINBYTES: push(Value::bytes(std::string(take(take_le(1))))); return true;
    case op::BINBYTES: push(Value::bytes(std::string(take(take_le(4))))); return true;
    case op::BINBYTES8: case op::BYTEARRAY8: push(Value::bytes(std::string(take(take_le(8))))); return true;
    default: return false;
  }
}

std::vector<Value::Entry> Reader::pairs(std::vector<Value> flat) {
  if (flat.size() % 2)
    fail("it takes keys and values, but an odd number (" + std::to_string(flat.size()) +
         ") of values is above its MARK");
  std::vector<Value::Entry> entries;
  for (size_t i = 0; i < flat.size(); i += 2) entries.emplace_back(std::move(flat[i]), std::move(flat[i + 1]));
  return entries;
}

bool Reader::container(uint8_t code) {
  switch (code) {
    case op::EMPTY_TUPLE: push_made(Value::tuple({})); return true;
    case op::TUPLE: push_made(Value::tuple(pop_mark())); return true;
    case op::TUPLE1: case op::TUPLE2: case op::TUPLE3: {
      std::vector<Value> items(code - op::TUPLE1 + 1);
      for (size_t i = items.size(); i-- > 0;) items[i] = pop();
      push_made(Value::tuple(std::move(items)));
      return true;
    }
    case op::EMPTY_LIST: push_made(Value::list({})); return true;
    case op::LIST: push_made(Value::list(pop_mark())); return true;
    case op::EMPTY_DICT: push_made(Value::dict({})); return true;
    case op::DICT: push_made(Value::dict(pairs(pop_mark()))); return true;
    case op::EMPTY_SET: push_made(Value::set({})); return true;
    case op::FROZENSET: push_made(Value::frozenset(pop_mark())); return true;
    case op::APPEND: case op::APPENDS: case op::SETITEM: case op::SETITEMS: case op::ADDITEMS: return add(code);
    default: return false;
  }
}

// APPEND(S), SETITEM(S), ADDITEMS: what Python adds to the value below the new ones.
bool Reader::add(uint8_t code) {
  const bool elements = code == op::APPEND || code == op::APPENDS || code == op::ADDITEMS;
  std::vector<Value> values;
  if (code == op::APPEND) {
    values.push_back(pop());
  } else if (code == op::SETITEM) {
    Value v = pop();
    values = {pop(), std::move(v)};
  } else {
    values = pop_mark();
  }
  Value& target = top();
  const Kind k = target.kind();
  const bool takes =
      code == op::ADDITEMS ? k == Kind::Set : k == Kind::Object || k == (elements ? Kind::List : Kind::Dict);
  if (!takes) fail("it adds to " + describe(target) + ", which takes no " + (elements ? "elements" : "items"));
  if (elements) {
    for (Value& v : values) target.append(std::move(v));
  } else {
    for (Value::Entry& e : pairs(std::move(values))) target.set_item(std::move(e.first), std::move(e.second));
  }
  return true;
}

Value& Reader::memo_get(uint64_t index) {
  const auto it = memo_.find(index);
  if (it == memo_.end())
    fail("memo index " + std::to_string(index) + " was never stored (the memo holds " + std::to_string(memo_.size()) +
         " values): the file is damaged");
  return it->second;
}

bool Reader::memo(uint8_t code) {
  switch (code) {
    case op::GET: {
      const int64_t i = take_decimal();
      if (i < 0) fail("memo index " + std::to_string(i) + " is negative");
      push(memo_get(static_cast<uint64_t>(i)));
      return true;
    }
    case op::BINGET: push(memo_get(take_le(1))); return true;
    case op::LONG_BINGET: push(memo_get(take_le(4))); return true;
    case op::PUT: {
      const int64_t i = take_decimal();
      if (i < 0) fail("memo index " + std::to_string(i) + " is negative");
      memo_[static_cast<uint64_t>(i)] = top();
      return true;
    }
    case op::BINPUT: { const uint64_t i = take_le(1); memo_[i] = top(); return true; }
    case op::LONG_BINPUT: { const uint64_t i = take_le(4); memo_[i] = top(); return true; }
    case op::MEMOIZE: { const uint64_t i = memo_.size(); memo_[i] = top(); return true; }
    default: return false;
  }
}

bool Reader::object(uint8_t code) {
  const auto callable = [this](Value v) {
    if (v.kind() != Kind::Global && v.kind() != Kind::Object)
      fail("it calls " + describe(v) + ", which Python could not call: the pickle is damaged");
    return v;
  };
  const auto of_kind = [this](Value v, Kind k, const char* role) {
    if (v.kind() != k)
      fail(std::string("its ") + role + " are " + describe(v) + ", not " + (k == Kind::Tuple ? "a Tuple" : "a Dict"));
    return v;
  };
  switch (code) {
    case op::GLOBAL: {
      const std::string module(take_line()), name(take_line());
      if (!is_utf8(module) || !is_utf8(name)) fail("its module or name is not valid UTF-8");
      push(Value::global(module, name));
      return true;
    }
    case op::STACK_GLOBAL: {
      Value name = pop(), module = pop();
      if (module.kind() != Kind::String || name.kind() != Kind::String)
        fail("it takes two Strings, the module and the name, not " + describe(module) + " and " + describe(name));
      push(Value::global(std::move(module), std::move(name)));
      return true;
    }
    case op::REDUCE: case op::NEWOBJ: {
      Value args = of_kind(pop(), Kind::Tuple, "arguments");
      Value cls = callable(pop());
      const auto how = code == op::REDUCE ? Construction::Reduce : Construction::NewObj;
      push_made(Value::object(how, std::move(cls), std::move(args)));
      return true;
    }
    case op::NEWOBJ_EX: {
      Value kwargs = of_kind(pop(), Kind::Dict, "keyword arguments");
      Value args = of_kind(pop(), Kind::Tuple, "arguments");
      Value cls = callable(pop());
      push_made(Value::object(Construction::NewObjEx, std::move(cls), std::move(args), std::move(kwargs)));
      return true;
    }
    case op::BUILD: {
      Value state = pop();
      Value& target = top();
      if (target.kind() != Kind::Object) fail("it gives state to " + describe(target) + ", which is not an object");
      if (target.has_state()) fail(describe(target) + " already has state from an earlier BUILD");
      target.set_state(std::move(state));
      return true;
    }
    default: return false;
  }
}

bool Reader::control(uint8_t code) {
  switch (code) {
    case op::PROTO: {
      const uint64_t p = take_le(1);
      if (p > kNewestProtocol)
        fail("protocol " + std::to_string(p) + " is newer than this reader's " + std::to_string(kNewestProtocol));
      return true;
    }
    case op::FRAME: {
      // Frames only group the opcodes for buffered reading; this reader has all the bytes.
      const uint64_t n = take_le(8);
      if (n > in_.size() - pos_)
        fail("its frame of " + std::to_string(n) + " bytes runs past the end (" + std::to_string(in_.size() - pos_) +
             " bytes remain): the file is truncated");
      return true;
    }
    case op::MARK: marks_.push_back(stack_.size()); return true;
    case op::POP:
      // Python's POP drops an open MARK when nothing is above it.
      if (!marks_.empty() && stack_.size() == marks_.back()) marks_.pop_back();
      else pop();
      return true;
    case op::POP_MARK: pop_mark(); return true;
    case op::DUP: push(Value(top())); return true;
    case op::STOP: stopped_ = true; return true;
    default: return false;
  }
}

bool Reader::step() {
  op_at_ = pos_;
  if (pos_ == in_.size())
    throw std::runtime_error("fsdp: pickle: '" + what_ + "': the pickle ends at byte " + std::to_string(pos_) +
                             " without STOP: the file is truncated or is not a pickle");
  op_ = static_cast<uint8_t>(in_[pos_++]);
  if (scalar(op_) || text(op_) || container(op_) || memo(op_) || object(op_) || control(op_)) return !stopped_;
  if (opcode_name(op_)) fail(refusal(op_));
  throw std::runtime_error("fsdp: pickle: '" + what_ + "': unknown opcode " + hex_byte(op_) + " at byte " +
                           std::to_string(op_at_) + ": not a pickle of protocol " + std::to_string(kNewestProtocol) +
                           " or older, or damaged");
}

Value Reader::run() {
  while (step()) {
  }
  Value result = pop();
  if (!stack_.empty() || !marks_.empty())
    fail("it leaves " + std::to_string(stack_.size()) + " more value(s) and " + std::to_string(marks_.size()) +
         " open MARK(s) behind: the pickle is damaged");
  if (pos_ != in_.size())
    fail(std::to_string(in_.size() - pos_) +
         " byte(s) follow it: the file holds more than one pickle, or is damaged");
  check_nesting();
  return result;
}

void Reader::fail_value(const std::string& problem) const {
  throw std::runtime_error("fsdp: pickle: '" + what_ + "': " + problem);
}

bool is_container(const Value& v) {
  const Kind k = v.kind();
  return k == Kind::Tuple || k == Kind::List || k == Kind::Dict || k == Kind::Set || k == Kind::FrozenSet ||
         k == Kind::Object;
}

std::vector<Value> children_of(const Value& v) {
  std::vector<Value> out;
  if (v.kind() == Kind::Object) {
    out = {v.cls(), v.args(), v.kwargs()};
    if (v.has_state()) out.push_back(v.state());
  }
  if (v.kind() != Kind::Dict) out.insert(out.end(), v.items().begin(), v.items().end());
  if (v.kind() == Kind::Dict || v.kind() == Kind::Object)
    for (const Value::Entry& e : v.entries()) out.insert(out.end(), {e.first, e.second});
  return out;
}

// Every value the pickle built, used or not, nests at most kMaxDepth deep and does not
// contain itself: a depth-first walk that keeps the path on the heap, not on the call stack.
void Reader::check_nesting() {
  struct Step {
    Value v;
    std::vector<Value> children;
    size_t next = 0;
    int deepest = 0;  // the depth of its deepest child so far (a scalar's is 1)
  };
  std::unordered_map<const void*, int> depth;  // of each node walked; 0 while it is on the path
  const auto too_deep = [this] {
    fail_value("the value nests deeper than " + std::to_string(kMaxDepth) +
               " levels: the file is damaged, or is not plain data");
  };
  for (const Value& root : made_) {
    if (depth.count(root.id())) continue;
    std::vector<Step> path;
    path.push_back({root, children_of(root)});
    depth[root.id()] = 0;
    while (!path.empty()) {
      if (path.back().next == path.back().children.size()) {
        const int d = path.back().deepest + 1;
        if (d > kMaxDepth) too_deep();
        depth[path.back().v.id()] = d;
        path.pop_back();
        if (!path.empty()) path.back().deepest = std::max(path.back().deepest, d);
        continue;
      }
      const Value child = path.back().children[path.back().next++];
      if (!is_container(child)) {
        path.back().deepest = std::max(path.back().deepest, 1);
        continue;
      }
      const auto seen = depth.find(child.id());
      if (seen != depth.end() && seen->second == 0)
        fail_value("the value contains itself (" + describe(child) +
                   " holds itself through the memo), which this reader does not represent");
      if (seen != depth.end()) {
        path.back().deepest = std::max(path.back().deepest, seen->second);
        continue;
      }
      if (static_cast<int>(path.size()) >= kMaxDepth) too_deep();
      depth[child.id()] = 0;
      path.push_back({child, children_of(child)});
    }
  }
}

}  // namespace fsdp::state::pickle::read_detail

namespace fsdp::state::pickle {

Value read(std::string_view bytes, const std::string& what) {
  read_detail::Reader reader(bytes, what);
  try {
    return reader.run();
  } catch (...) {
    for (Value& v : reader.made()) v.release();
    throw;
  }
}

}  // namespace fsdp::state::pickle
