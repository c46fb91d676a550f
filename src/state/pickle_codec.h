#pragma once
// Python's pickle format (protocols 2 to 5), without torch: a value model, a reader and a
// writer. PyTorch's Distributed Checkpoint (DCP) writes its `.metadata` file with
// pickle.dump of dataclasses from torch.distributed.checkpoint (Metadata,
// TensorStorageMetadata, MetadataIndex, _StorageInfo, ...). libtorch's unpickler resolves
// only the classes TorchScript knows, so it cannot read them; this codec reads any pickle
// of plain data and class instances into a tree that names the classes, and writes such a
// tree back as bytes Python's pickle.loads reads.
//
// [Note: pickle]
// A pickle is a program for a stack machine: each opcode (one byte, then its operands)
// pushes a value, or pops some and pushes what it builds from them; STOP ends the program
// and its result is the value on top. MARK pushes a mark that TUPLE, LIST, DICT, APPENDS,
// SETITEMS, ADDITEMS and FROZENSET take everything above. The memo is a table of values by
// index: PUT, BINPUT and MEMOIZE store the top of the stack, GET and BINGET push a stored
// value again; that is how a value referenced twice is pickled once. A class instance is
// made by calling a global (module and name, e.g. `torch.distributed.checkpoint.metadata`
// `Metadata`): REDUCE calls it with an argument tuple, NEWOBJ calls `cls.__new__(cls,
// *args)`, NEWOBJ_EX also passes keyword arguments; BUILD then hands it its state
// (a dataclass's `__dict__`, or `(None, slots)` for a dataclass with slots, or whatever its
// `__getstate__` returned: DCP's TensorProperties gives a tuple). FRAME (protocol 4 and
// later) announces the length of the opcodes that follow; readers may ignore it.
//
// The model, Value: a handle to a node, shared like a Python reference. Copying a Value
// copies the handle; the reader gives a value the memo fetched twice as two handles to one
// node, and the writer memoizes every node it writes, so that a second handle to it is
// written as a memo get, as Python's pickler does. A Global keeps its module and name as
// String values for the same reason: what Python shared is shared again. Nothing calls a
// class: an Object records how it was made (the class, the construction and its
// arguments), what APPENDS and SETITEMS then added to it (an OrderedDict's items, a list
// subclass's elements) and its BUILD state.
//
// What the reader checks: every operand lies within the bytes (a truncated file ends in an
// error naming the opcode, never in a read past the end), a length is never believed
// before the bytes it counts are there (no allocation from a corrupt length), text is
// UTF-8, opcodes find on the stack what they take, the memo has what GET asks for, an
// integer fits int64, nothing follows STOP, and every value it built nests at most
// kMaxDepth deep and contains no cycle (the memo can make a list that holds itself, which
// a tree of shared handles cannot free). It refuses what the model has no place for:
// persistent IDs (PERSID, BINPERSID: torch.save's tensor storages), the extension registry
// (EXT1, EXT2, EXT4), out-of-band buffers (NEXT_BUFFER, READONLY_BUFFER), and the opcodes
// of protocols 0 and 1 that Python 3 no longer writes at 2 or later: text floats, longs and
// strings (FLOAT, LONG, STRING, UNICODE), Python 2's byte strings (BINSTRING,
// SHORT_BINSTRING) and old-style instances (INST, OBJ).
//
// Errors are std::runtime_error whose message starts "fsdp: pickle: '<what>': " (what:
// the file the bytes came from) and says what is wrong, at which byte offset, and for which
// opcode. Asking a Value for what it is not (as_int of a String) throws std::runtime_error
// starting "fsdp: pickle: "; write() throws std::invalid_argument starting "fsdp: pickle: ".

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fsdp::state::pickle {

/// The deepest nesting read() accepts and write() writes (a scalar is depth 1). DCP's
/// metadata nests a dozen levels deep; a far deeper value is damage or an attack, and
/// freeing it would recurse as deep as it nests.
constexpr int kMaxDepth = 1000;

/// How an Object was made ([Note: pickle]).
enum class Construction {
  Reduce,    // callable(*args)
  NewObj,    // cls.__new__(cls, *args)
  NewObjEx,  // cls.__new__(cls, *args, **kwargs) (protocol 4 and later)
};

class Value {
 public:
  enum class Kind { None, Bool, Int, Float, String, Bytes, Tuple, List, Dict, Set, FrozenSet, Global, Object };
  using Entry = std::pair<Value, Value>;

  Value();  // None
  static Value none() { return Value(); }
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value floating(double d);
  static Value string(std::string utf8);
  static Value bytes(std::string raw);
  static Value tuple(std::vector<Value> items);
  static Value list(std::vector<Value> items);
  static Value set(std::vector<Value> items);
  static Value frozenset(std::vector<Value> items);
  /// A dict's entries in order. A dict has unique keys; nothing here checks it (the reader
  /// keeps what the pickle holds, and Python's pickler never writes a key twice).
  static Value dict(std::vector<Entry> entries);
  static Value global(const std::string& module, const std::string& name);
  /// module and name are Strings (kept as values, so that shared ones stay shared).
  static Value global(Value module, Value name);
  /// An instance made by `how` from `cls` (a Global, or any value Python can call) and
  /// `args` (a Tuple); `kwargs` (a Dict) for NewObjEx only. Throws std::invalid_argument
  /// when args or kwargs are of another kind.
  static Value object(Construction how, Value cls, Value args, Value kwargs = Value());

  Kind kind() const;
  bool is_none() const { return kind() == Kind::None; }
  /// Whether the two are handles to one node (Python's `is`; a None is every None).
  bool same(const Value& other) const { return node_ == other.node_; }
  /// The node's identity (nullptr for None): what a memo is keyed by.
  const void* id() const { return node_.get(); }

  // Scalars; each throws unless the value is of that kind.
  bool as_bool() const;
  int64_t as_int() const;
  double as_float() const;
  const std::string& as_string() const;
  const std::string& as_bytes() const;
  /// The elements of a Tuple or List of Ints (a torch.Size's argument, a chunk's offsets).
  std::vector<int64_t> as_ints() const;

  /// A Tuple's, List's or Set's elements; an Object's appended ones (APPEND, APPENDS).
  const std::vector<Value>& items() const;
  /// A Dict's entries; an Object's set items (SETITEM, SETITEMS), e.g. an OrderedDict's.
  const std::vector<Entry>& entries() const;
  /// The value of a Dict's String key `key`: nullptr when absent. at() throws instead.
  const Value* find(std::string_view key) const;
  const Value& at(std::string_view key) const;

  // Globals.
  const std::string& module() const;
  const std::string& name() const;
  const Value& module_value() const;
  const Value& name_value() const;
  /// Whether this is the Global module.name (false for any other kind).
  bool is_global(std::string_view module, std::string_view name) const;

  // Objects.
  const Value& cls() const;
  Construction construction() const;
  const Value& args() const;    // a Tuple
  const Value& kwargs() const;  // a Dict for NewObjEx, else None
  bool has_state() const;
  const Value& state() const;   // throws when BUILD gave none
  /// Whether this is an Object whose class is the Global module.name.
  bool is_instance_of(std::string_view module, std::string_view name) const;
  /// The attribute `name` of an Object whose state is a Dict of attributes, or a 2-Tuple
  /// (None or Dict, Dict of slots) as Python pickles a class with __slots__: nullptr when
  /// the state lacks it (an attribute left at its class default is not pickled: DCP's
  /// MetadataIndex has no "offset" for a non-tensor). Throws naming the class when the
  /// Object has no state or a state of another shape. attr() throws for a missing one too.
  const Value* find_attr(std::string_view name) const;
  const Value& attr(std::string_view name) const;

  // Building and changing in place, as APPEND, SETITEM and BUILD do: every handle to the
  // node sees the change. A Value must not come to contain itself (write() refuses it).
  void append(Value item);             // List, Set, Object
  void set_item(Value key, Value v);   // Dict, Object: adds an entry at the end
  void set_state(Value state);         // Object

 private:
  struct Node;
  explicit Value(std::shared_ptr<Node> node) : node_(std::move(node)) {}
  // Drops what the node holds. read() does this to every value it built when it fails,
  // so that a damaged pickle's cycles are freed and a deep chain is not freed recursively.
  void release();
  friend Value read(std::string_view bytes, const std::string& what);
  const Node& node_of(Kind k, const char* as) const;
  std::shared_ptr<Node> node_;
};

/// The kind's name as messages print it ("Dict").
const char* kind_name(Value::Kind kind);
/// A short description for messages: "an Int", "the Global torch.float32", "an Object of
/// torch.Size".
std::string describe(const Value& v);
/// Equal as trees: same kinds, equal scalars (floats compared by bits, so a NaN equals
/// itself), equal elements in order; for Objects also the construction and the state.
/// Sharing is not compared: a shared node is compared at each place it appears.
bool operator==(const Value& a, const Value& b);
inline bool operator!=(const Value& a, const Value& b) { return !(a == b); }

/// Whether `text` is UTF-8 as Python's pickle encodes a str: well-formed, except that a
/// lone surrogate (U+D800 to U+DFFF, three bytes) is allowed, as its "surrogatepass" does.
bool is_utf8(std::string_view text);

/// The value the pickle `bytes` holds ([Note: pickle]). `what` names the source in errors.
Value read(std::string_view bytes, const std::string& what);

/// `v` pickled with `protocol` (2 to 5; 4 is Python 3.8's default, 5 is 3.14's), as
/// Python's pickler writes it: the same opcodes, memo and frames, so that a value read
/// from Python's bytes writes the same bytes again. Throws std::invalid_argument for a
/// protocol out of range, a value that contains itself or nests deeper than kMaxDepth, a
/// String that is not UTF-8, and what the protocol cannot say: Bytes, sets and NewObjEx
/// before protocol 4 (Bytes before 3; Python writes them as calls instead).
std::string write(const Value& v, int protocol = 4);

/// The opcodes, by the names pickletools gives them.
namespace op {
constexpr uint8_t MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2';
constexpr uint8_t INT = 'I', BININT = 'J', BININT1 = 'K', BININT2 = 'M', NONE = 'N';
constexpr uint8_t BINUNICODE = 'X', APPEND = 'a', BUILD = 'b', GLOBAL = 'c', DICT = 'd';
constexpr uint8_t EMPTY_DICT = '}', APPENDS = 'e', GET = 'g', BINGET = 'h', LONG_BINGET = 'j';
constexpr uint8_t LIST = 'l', EMPTY_LIST = ']', PUT = 'p', BINPUT = 'q', LONG_BINPUT = 'r';
constexpr uint8_t SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G';
constexpr uint8_t REDUCE = 'R', PERSID = 'P', BINPERSID = 'Q';
// Protocol 2.
constexpr uint8_t PROTO = 0x80, NEWOBJ = 0x81, EXT1 = 0x82, EXT2 = 0x83, EXT4 = 0x84;
constexpr uint8_t TUPLE1 = 0x85, TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89;
constexpr uint8_t LONG1 = 0x8a, LONG4 = 0x8b;
// Protocol 3.
constexpr uint8_t BINBYTES = 'B', SHORT_BINBYTES = 'C';
// Protocol 4.
constexpr uint8_t SHORT_BINUNICODE = 0x8c, BINUNICODE8 = 0x8d, BINBYTES8 = 0x8e, EMPTY_SET = 0x8f;
constexpr uint8_t ADDITEMS = 0x90, FROZENSET = 0x91, NEWOBJ_EX = 0x92, STACK_GLOBAL = 0x93;
constexpr uint8_t MEMOIZE = 0x94, FRAME = 0x95;
// Protocol 5.
constexpr uint8_t BYTEARRAY8 = 0x96, NEXT_BUFFER = 0x97, READONLY_BUFFER = 0x98;
}  // namespace op

}  // namespace fsdp::state::pickle
