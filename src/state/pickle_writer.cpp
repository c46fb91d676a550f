#include "pickle_codec.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

// The pickle writer ([Note: pickle] in pickle_codec.h). It makes the choices CPython's C
// pickler (the one pickle.dumps runs) makes: the smallest opcode for each integer, string
// and tuple, a memo entry for every value but scalars and the empty tuple, batches of 1000
// for APPENDS, SETITEMS and ADDITEMS, and protocol 4's frames. Writing what Python writes,
// byte for byte, is what lets a test hold our output against Python's own, and means a
// DCP `.metadata` read and written again is the file it was. One choice differs: at
// protocols 2 and 3 Python renames some modules for Python 2 (builtins to __builtin__); a
// Global here is written with the module it holds, which Python 3 reads either way.

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::pickle::write_detail {

using Kind = Value::Kind;

// [Note: pickle frames] From protocol 4 the pickler groups its output into frames: FRAME
// and an 8-byte length before each run of at least kFrameMin bytes, a frame closed at the
// first value boundary after kFrameTarget bytes, and a string or bytes payload of
// kFrameTarget or more written outside any frame. Readers may ignore frames, and this
// codec's reader does; they are written only so that our bytes are Python's.
constexpr size_t kFrameTarget = 64 * 1024;
constexpr size_t kFrameMin = 4;
constexpr size_t kFrameHeader = 9;
constexpr size_t kBatch = 1000;  // values per APPENDS, SETITEMS or ADDITEMS
constexpr size_t kNoFrame = static_cast<size_t>(-1);

// Whose batches save_batches writes: a List's, a Dict's, a Set's, or what an Object's
// reduction appends or sets (an OrderedDict's items).
enum class Batching { List, Dict, Set, Reduced };

class Writer {
 public:
  explicit Writer(int protocol);
  std::string finish(const Value& v);

 private:
  [[noreturn]] static void refuse(const std::string& why);
  // Output, framed from protocol 4.
  void emit(std::string_view bytes);
  void emit_op(uint8_t code) { emit(std::string_view(reinterpret_cast<const char*>(&code), 1)); }
  void emit_le(uint64_t v, int n);
  void emit_payload(uint8_t code, int length_bytes, std::string_view data);
  void commit_frame();
  void value_boundary();
  // Values.
  void save(const Value& v, int depth);
  void save_scalar(const Value& v);
  void save_int(int64_t i);
  void save_text(const Value& v);
  void save_tuple(const Value& v, int depth);
  void save_container(const Value& v, int depth);
  void save_global(const Value& v, int depth);
  void save_object(const Value& v, int depth);
  void save_batches(size_t size, Batching how, uint8_t one, uint8_t many, const std::function<void(size_t)>& save_at);
  void memoize(const Value& v);
  void emit_get(uint32_t index);

  const int protocol_;
  std::string out_;
  size_t frame_start_ = kNoFrame;  // where the open frame's header goes
  std::unordered_map<const void*, uint32_t> memo_;
  std::unordered_set<const void*> path_;  // the containers being written, to refuse a cycle
};

Writer::Writer(int protocol) : protocol_(protocol) {
  if (protocol < 2 || protocol > 5)
    throw std::invalid_argument("fsdp: pickle: protocol " + std::to_string(protocol) +
                                " is not one this writer writes (2 to 5)");
}

void Writer::refuse(const std::string& why) { throw std::invalid_argument("fsdp: pickle: cannot write " + why); }

void Writer::emit(std::string_view bytes) {
  if (protocol_ >= 4 && frame_start_ == kNoFrame) {
    frame_start_ = out_.size();
    out_.append(kFrameHeader, '\0');
  }
  out_.append(bytes.data(), bytes.size());
}

void Writer::emit_le(uint64_t v, int n) {
  char b[8];
  for (int i = 0; i < n; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  emit(std::string_view(b, n));
}

void Writer::emit_payload(uint8_t code, int length_bytes, std::string_view data) {
  if (protocol_ >= 4 && data.size() >= kFrameTarget) {
    // [Note: pickle frames]: a large payload goes between frames, with its opcode.
    commit_frame();
    out_.push_back(static_cast<char>(code));
    for (int i = 0; i < length_bytes; ++i) out_.push_back(static_cast<char>((data.size() >> (8 * i)) & 0xff));
    out_.append(data.data(), data.size());
    return;
  }
  emit_op(code);
  emit_le(data.size(), length_bytes);
  emit(data);
}

void Writer::commit_frame() {
  if (frame_start_ == kNoFrame) return;
  const size_t length = out_.size() - frame_start_ - kFrameHeader;
  if (length >= kFrameMin) {
    out_[frame_start_] = static_cast<char>(op::FRAME);
    for (size_t i = 0; i < 8; ++i) out_[frame_start_ + 1 + i] = static_cast<char>((length >> (8 * i)) & 0xff);
  } else {
    out_.erase(frame_start_, kFrameHeader);
  }
  frame_start_ = kNoFrame;
}

void Writer::value_boundary() {
  if (frame_start_ != kNoFrame && out_.size() - frame_start_ - kFrameHeader >= kFrameTarget) commit_frame();
}

void Writer::memoize(const Value& v) {
  const auto index = static_cast<uint32_t>(memo_.size());
  memo_.emplace(v.id(), index);
  if (protocol_ >= 4) {
    emit_op(op::MEMOIZE);
  } else {
    emit_op(index < 256 ? op::BINPUT : op::LONG_BINPUT);
    emit_le(index, index < 256 ? 1 : 4);
  }
}

void Writer::emit_get(uint32_t index) {
  emit_op(index < 256 ? op::BINGET : op::LONG_BINGET);
  emit_le(index, index < 256 ? 1 : 4);
}

bool is_scalar(Kind k) { return k == Kind::None || k == Kind::Bool || k == Kind::Int || k == Kind::Float; }

void Writer::save(const Value& v, int depth) {
  if (depth > kMaxDepth) refuse("a value that nests deeper than " + std::to_string(kMaxDepth) + " levels");
  if (path_.count(v.id())) refuse(describe(v) + " that contains itself");
  const auto memoized = memo_.find(v.id());
  if (!is_scalar(v.kind()) && memoized != memo_.end()) {
    emit_get(memoized->second);
  } else {
    path_.insert(v.id());
    switch (v.kind()) {
      case Kind::None: case Kind::Bool: case Kind::Int: case Kind::Float: save_scalar(v); break;
      case Kind::String: case Kind::Bytes: save_text(v); break;
      case Kind::Tuple: save_tuple(v, depth); break;
      case Kind::List: case Kind::Dict: case Kind::Set: case Kind::FrozenSet: save_container(v, depth); break;
      case Kind::Global: save_global(v, depth); break;
      case Kind::Object: save_object(v, depth); break;
    }
    path_.erase(v.id());
  }
  value_boundary();
}

void Writer::save_scalar(const Value& v) {
  switch (v.kind()) {
    case Kind::None: return emit_op(op::NONE);
    case Kind::Bool: return emit_op(v.as_bool() ? op::NEWTRUE : op::NEWFALSE);
    case Kind::Int: return save_int(v.as_int());
    default: {
      const double d = v.as_float();
      uint64_t bits = 0;
      std::memcpy(&bits, &d, sizeof d);
      char b[8];
      for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((bits >> (8 * (7 - i))) & 0xff);  // big-endian
      emit_op(op::BINFLOAT);
      return emit(std::string_view(b, 8));
    }
  }
}

void Writer::save_int(int64_t i) {
  if (i >= 0 && i <= 0xffff) {
    emit_op(i <= 0xff ? op::BININT1 : op::BININT2);
    return emit_le(i, i <= 0xff ? 1 : 2);
  }
  if (i >= INT32_MIN && i <= INT32_MAX) {
    emit_op(op::BININT);
    return emit_le(static_cast<uint32_t>(i), 4);
  }
  // LONG1: the shortest little-endian two's complement, as Python's encode_long gives it:
  // one byte more than |i| needs, less a redundant 0xff sign byte of a negative number.
  const uint64_t magnitude = i < 0 ? 0 - static_cast<uint64_t>(i) : static_cast<uint64_t>(i);
  int n = (64 - __builtin_clzll(magnitude)) / 8 + 1;
  const auto byte = [i](int k) -> uint8_t {
    return k < 8 ? (static_cast<uint64_t>(i) >> (8 * k)) & 0xff : (i < 0 ? 0xff : 0);
  };
  if (i < 0 && n > 1 && byte(n - 1) == 0xff && (byte(n - 2) & 0x80)) --n;
  emit_op(op::LONG1);
  emit_le(n, 1);
  for (int k = 0; k < n; ++k) emit_le(byte(k), 1);
}

void Writer::save_text(const Value& v) {
  const bool is_string = v.kind() == Kind::String;
  const std::string& data = is_string ? v.as_string() : v.as_bytes();
  if (is_string && !is_utf8(data)) refuse("a String that is not UTF-8");
  if (!is_string && protocol_ < 3)
    refuse("Bytes in protocol " + std::to_string(protocol_) + " (they need 3 or later)");
  const bool huge = data.size() > 0xffffffffu;
  if (huge && protocol_ < 4) refuse("a String or Bytes of 4 GiB or more before protocol 4");
  if (data.size() <= 0xff && (protocol_ >= 4 || !is_string))
    emit_payload(is_string ? op::SHORT_BINUNICODE : op::SHORT_BINBYTES, 1, data);
  else if (huge)
    emit_payload(is_string ? op::BINUNICODE8 : op::BINBYTES8, 8, data);
  else
    emit_payload(is_string ? op::BINUNICODE : op::BINBYTES, 4, data);
  memoize(v);
}

void Writer::save_tuple(const Value& v, int depth) {
  const std::vector<Value>& items = v.items();
  if (items.empty()) return emit_op(op::EMPTY_TUPLE);  // Python's one empty tuple, never memoized
  if (items.size() > 3) emit_op(op::MARK);
  for (const Value& item : items) save(item, depth + 1);
  emit_op(items.size() > 3 ? op::TUPLE : static_cast<uint8_t>(op::TUPLE1 + items.size() - 1));
  memoize(v);
}

void Writer::save_container(const Value& v, int depth) {
  const auto save_item = [&](size_t i) { save(v.items()[i], depth + 1); };
  const auto save_entry = [&](size_t i) {
    save(v.entries()[i].first, depth + 1);
    save(v.entries()[i].second, depth + 1);
  };
  switch (v.kind()) {
    case Kind::List:
      emit_op(op::EMPTY_LIST);
      memoize(v);
      return save_batches(v.items().size(), Batching::List, op::APPEND, op::APPENDS, save_item);
    case Kind::Dict:
      emit_op(op::EMPTY_DICT);
      memoize(v);
      return save_batches(v.entries().size(), Batching::Dict, op::SETITEM, op::SETITEMS, save_entry);
    case Kind::Set:
      if (protocol_ < 4) refuse("a Set before protocol 4");
      emit_op(op::EMPTY_SET);
      memoize(v);
      return save_batches(v.items().size(), Batching::Set, op::ADDITEMS, op::ADDITEMS, save_item);
    default:
      if (protocol_ < 4) refuse("a FrozenSet before protocol 4");
      emit_op(op::MARK);
      for (size_t i = 0; i < v.items().size(); ++i) save_item(i);
      emit_op(op::FROZENSET);
      return memoize(v);
  }
}

// CPython's batches: MARK, up to kBatch values, then `many`; a single value alone takes
// `one` instead (a Set's never does). Its list writer stops when every value is written;
// its dict and set writers go round again after a full batch, so that a multiple of kBatch
// values ends in an empty MARK `many`; the writer of what a reduced object appends or sets
// stops after a batch that is not full, and writes a last single value with `one`.
void Writer::save_batches(size_t size, Batching how, uint8_t one, uint8_t many,
                          const std::function<void(size_t)>& save_at) {
  if (size == 0) return;
  if (size == 1 && how != Batching::Set) {
    save_at(0);
    return emit_op(one);
  }
  size_t done = 0, n = 0;
  do {
    n = std::min(kBatch, size - done);
    if (how == Batching::Reduced && n <= 1) {
      if (n == 1) {
        save_at(done);
        emit_op(one);
      }
      return;
    }
    emit_op(op::MARK);
    for (const size_t end = done + n; done < end; ++done) save_at(done);
    emit_op(many);
  } while (how == Batching::List ? done < size : n == kBatch);
}

void Writer::save_global(const Value& v, int depth) {
  if (protocol_ >= 4) {
    save(v.module_value(), depth + 1);
    save(v.name_value(), depth + 1);
    emit_op(op::STACK_GLOBAL);
  } else {
    if (v.module().find('\n') != std::string::npos || v.name().find('\n') != std::string::npos)
      refuse(describe(v) + " before protocol 4: GLOBAL's text form cannot hold a newline");
    emit_op(op::GLOBAL);
    emit(v.module() + "\n" + v.name() + "\n");
  }
  memoize(v);
}

void Writer::save_object(const Value& v, int depth) {
  save(v.cls(), depth + 1);
  save(v.args(), depth + 1);
  switch (v.construction()) {
    case Construction::Reduce: emit_op(op::REDUCE); break;
    case Construction::NewObj: emit_op(op::NEWOBJ); break;
    case Construction::NewObjEx:
      if (protocol_ < 4) refuse(describe(v) + " made by NEWOBJ_EX before protocol 4");
      save(v.kwargs(), depth + 1);
      emit_op(op::NEWOBJ_EX);
      break;
  }
  memoize(v);
  save_batches(v.items().size(), Batching::Reduced, op::APPEND, op::APPENDS,
               [&](size_t i) { save(v.items()[i], depth + 1); });
  save_batches(v.entries().size(), Batching::Reduced, op::SETITEM, op::SETITEMS, [&](size_t i) {
    save(v.entries()[i].first, depth + 1);
    save(v.entries()[i].second, depth + 1);
  });
  if (v.has_state()) {
    save(v.state(), depth + 1);
    emit_op(op::BUILD);
  }
}

std::string Writer::finish(const Value& v) {
  out_.push_back(static_cast<char>(op::PROTO));
  out_.push_back(static_cast<char>(protocol_));
  save(v, 1);
  emit_op(op::STOP);
  commit_frame();
  return std::move(out_);
}

}  // namespace fsdp::state::pickle::write_detail

namespace fsdp::state::pickle {

std::string write(const Value& v, int protocol) { return write_detail::Writer(protocol).finish(v); }

}  // namespace fsdp::state::pickle
