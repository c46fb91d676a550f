// The pickle codec without torch (src/state/pickle_codec.h): values of every kind written at
// protocols 2 to 5 and read back; shared values written once and read back shared; pickles
// Python wrote (below, in hex) read into the values they hold and written again byte for
// byte, among them a DCP `.metadata` whose fields the test reads as a DCP loader would; and
// every damaged pickle refused with a message that names the source, the opcode and the
// byte, never a crash: each truncation and each flipped byte of that metadata, and one
// pickle for each rule of the reader.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "state/pickle_codec.h"
#include "harness/error_of.h"
#include "harness/hex.h"

using fsdp::testing::error_of;
using fsdp::testing::from_hex;

namespace {

namespace pk = fsdp::state::pickle;
using pk::Construction;
using pk::Value;
using Kind = Value::Kind;

// The pickles below were written by Python 3.11 with torch 2.11:
//   @dataclasses.dataclass
//   class Point: x: int; y: float; tags: list
//   @dataclasses.dataclass(slots=True)
//   class Slotted: a: int; b: str
//   class Color(enum.Enum): RED = 1; GREEN = 2
//   shared = [1, 2]
//   kNested = pickle.dumps({"a": [shared, shared, (1, "x", None), ()],
//       "b": (True, False, 1.5, -7, 300, 70000, 2**40, -2**63, "\u00e9"),
//       3: {"k": shared, "e": {}, "l": []}, (1, 2): b"\x00\xff", "s": {5}, "f": frozenset([6])}, protocol=4)
//   kObjects = pickle.dumps([Point(1, 2.5, ["a", "b"]), Slotted(7, "q"), Color.GREEN], protocol=4)
//   kSame2, kSame5 = (pickle.dumps([Point(-1, 0.25, []), {"k": (1, 2)}, "s", 2**40], protocol=p) for p in (2, 5))
//   kDcpMetadata: /tmp/dcp-golden/.metadata after, in one process with no process group,
//   dcp.save({"model": {"w": torch.randn(13, 17), "b": torch.randn(5, dtype=torch.bfloat16)},
//             "optim": {"step": torch.tensor(3.), "lr": 0.1}},
//            storage_writer=dcp.FileSystemWriter("/tmp/dcp-golden"))
const char* const kNested =
    "8004958d000000000000007d94288c0161945d94285d94284b014b026568034b018c0178944e879429658c01629428888947"
    "3ff80000000000004af9ffffff4d2c014a701101008a060000000000018a0800000000000000808c02c3a99474944b037d94"
    "288c016b9468038c0165947d948c016c945d94754b014b028694430200ff948c0173948f94284b05908c016694284b069194"
    "752e";
const char* const kObjects =
    "8004957d000000000000005d94288c085f5f6d61696e5f5f948c05506f696e749493942981947d94288c0178944b018c0179"
    "944740040000000000008c0474616773945d94288c0161948c01629465756268018c07536c6f747465649493942981944e7d"
    "9428680a4b07680b8c0171947586946268018c05436f6c6f729493944b0285945294652e";
const char* const kSame2 =
    "80025d710028635f5f6d61696e5f5f0a506f696e740a7101298171027d71032858010000007871044affffffff5801000000"
    "797105473fd000000000000058040000007461677371065d710775627d710858010000006b71094b014b0286710a73580100"
    "000073710b8a06000000000001652e";
const char* const kSame5 =
    "8005955a000000000000005d94288c085f5f6d61696e5f5f948c05506f696e749493942981947d94288c0178944affffffff"
    "8c017994473fd00000000000008c0474616773945d9475627d948c016b944b014b028694738c0173948a0600000000000165"
    "2e";
const char* const kDcpMetadata =
    "800495ec040000000000008c25746f7263682e64697374726962757465642e636865636b706f696e742e6d65746164617461"
    "948c084d657461646174619493942981947d94288c1373746174655f646963745f6d65746164617461947d94288c076d6f64"
    "656c2e779468008c1554656e736f7253746f726167654d657461646174619493942981947d94288c0a70726f706572746965"
    "739468008c1054656e736f7250726f70657274696573949394298194288c05746f726368948c07666c6f617433329493948c"
    "13746f7263682e73657269616c697a6174696f6e948c0b5f6765745f6c61796f75749493948c0d746f7263682e7374726964"
    "656494859452948968008c145f4d454d5f464f524d41545f454e434f44494e479493944b0085945294897494628c0473697a"
    "65948c05746f726368948c0453697a659493944b0d4b118694859452948c066368756e6b73945d9468008c144368756e6b53"
    "746f726167654d657461646174619493942981947d94288c076f6666736574739468214b004b008694859452948c0573697a"
    "65739468214b0d4b1186948594529475626175628c076d6f64656c2e629468092981947d9428680c680e2981942868108c08"
    "62666c6f61743136949394681889681c89749462681e68214b0585948594529468255d9468282981947d9428682b68214b00"
    "859485945294682f68214b0585948594529475626175628c0a6f7074696d2e737465709468092981947d9428680c680e2981"
    "94286812681889681c89749462681e6821298594529468255d9468282981947d9428682b68212985945294682f6821298594"
    "529475626175628c086f7074696d2e6c729468008c14427974657353746f726167654d65746164617461949394298194758c"
    "0c706c616e6e65725f64617461947d942868078c056d6f64656c948c01779486946833685a8c016294869468468c056f7074"
    "696d948c04737465709486946854685f8c026c72948694758c0c73746f726167655f64617461947d942868008c0d4d657461"
    "64617461496e6465789493942981947d94288c0366716e9468548c05696e646578944e75628c27746f7263682e6469737472"
    "6962757465642e636865636b706f696e742e66696c6573797374656d948c0c5f53746f72616765496e666f9493942981947d"
    "94288c0d72656c61746976655f70617468948c0c5f5f305f302e646973746370948c066f6666736574944b008c066c656e67"
    "7468944ded04756268672981947d9428686a6807686b4b00687368214b004b008694859452947562686e2981947d94286871"
    "687268734ded0468744d6909756268672981947d9428686a6833686b4b00687368214b008594859452947562686e2981947d"
    "94286871687268734d560e68744d2906756268672981947d9428686a6846686b4b006873682129859452947562686e298194"
    "7d94286871687268734d7f1468744d29067562758c0c73746f726167655f6d6574619468008c0b53746f726167654d657461"
    "9493942981947d94288c0d636865636b706f696e745f6964948c07706174686c6962948c09506f736978506174689493948c"
    "012f948c03746d70948c0a6463702d676f6c64656e94879452948c07736176655f6964948c2437616337663832652d393162"
    "622d343638642d623665372d383337326466363262636361948c076c6f61645f6964944e8c076d6f64756c6573945d947562"
    "8c0776657273696f6e948c05312e302e309475622e";

constexpr const char* kDcp = "torch.distributed.checkpoint.metadata";


Value str(const char* s) { return Value::string(s); }
Value num(int64_t i) { return Value::integer(i); }
std::string le(uint64_t v, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out;
}

// A dataclass-like instance: NEWOBJ of module.name with no arguments, BUILD with `attrs`.
Value instance(const char* module, const char* name, std::vector<Value::Entry> attrs) {
  Value v = Value::object(Construction::NewObj, Value::global(module, name), Value::tuple({}));
  v.set_state(Value::dict(std::move(attrs)));
  return v;
}

// One value of each kind the protocol can write, nested as DCP's metadata nests.
Value every_kind(int protocol) {
  const Value shared = Value::list({num(1), str("shared")});
  std::vector<Value> scalars = {Value(), Value::boolean(true), Value::boolean(false)};
  for (int64_t i : {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536}, int64_t{-1},
                    int64_t{INT32_MIN}, int64_t{INT32_MAX} + 1, std::numeric_limits<int64_t>::min(),
                    std::numeric_limits<int64_t>::max(), -(int64_t{1} << 47)})
    scalars.push_back(num(i));
  for (double d : {0.5, -0.0, std::numeric_limits<double>::infinity(), std::nan("")})
    scalars.push_back(Value::floating(d));
  for (const char* s : {"", "\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80", "\xed\xa0\x80"}) scalars.push_back(str(s));
  scalars.push_back(Value::string(std::string(300, 'x')));
  if (protocol >= 3) {
    scalars.push_back(Value::bytes(std::string("\0\xff", 2)));
    scalars.push_back(Value::bytes(std::string(70000, 'b')));  // past a frame's target: written between frames
  }
  Value ordered = Value::object(Construction::Reduce, Value::global("collections", "OrderedDict"), Value::tuple({}));
  ordered.set_item(str("k"), shared);
  ordered.append(num(4));
  Value slotted = Value::object(Construction::NewObj, Value::global("m", "Slotted"), Value::tuple({}));
  slotted.set_state(Value::tuple({Value(), Value::dict({{str("a"), num(7)}})}));
  const Value key = instance(kDcp, "MetadataIndex", {{str("fqn"), str("w")}});
  std::vector<Value> many;
  for (int i = 0; i < 2001; ++i) many.push_back(num(i));  // two full batches and one more
  std::vector<Value> all = {
      Value::tuple(scalars), Value::tuple({}), Value::tuple({num(1)}), Value::tuple({num(1), num(2)}),
      Value::tuple({num(1), num(2), num(3)}), Value::list(many), shared, shared,
      Value::dict({{num(3), shared}, {Value::tuple({num(1), num(2)}), Value()}, {key, str("v")}}),
      Value::global("torch", "float32"), ordered, slotted,
      Value::object(Construction::Reduce, Value::global("torch", "Size"),
                    Value::tuple({Value::tuple({num(13), num(17)})}))};
  if (protocol >= 4) {
    all.push_back(Value::set({num(5), str("s")}));
    all.push_back(Value::frozenset({num(6)}));
    all.push_back(Value::object(Construction::NewObjEx, Value::global("m", "C"), Value::tuple({num(1)}),
                                Value::dict({{str("k"), num(2)}})));
  }
  return Value::list(all);
}

TEST(PickleValue, AccessorsSayWhatAValueIsNot) {
  const Value point = instance("m", "Point", {{str("x"), num(1)}});
  EXPECT_EQ(point.attr("x").as_int(), 1);
  EXPECT_EQ(point.find_attr("y"), nullptr);
  EXPECT_TRUE(point.is_instance_of("m", "Point"));
  EXPECT_FALSE(point.cls().is_global("m", "Other"));
  EXPECT_EQ(pk::describe(point), "an Object of m.Point");
  EXPECT_EQ(pk::describe(Value::global("torch", "float32")), "the Global torch.float32");
  EXPECT_EQ(error_of([] { str("a").as_int(); }), "fsdp: pickle: asked for the integer of a String, which has none");
  EXPECT_EQ(error_of([&] { point.attr("y"); }),
            "fsdp: pickle: an Object of m.Point has no attribute 'y' in its state");
  EXPECT_EQ(error_of([] { Value::dict({}).at("k"); }), "fsdp: pickle: a Dict has no key 'k'");
  const Value bare = Value::object(Construction::NewObj, Value::global("m", "Empty"), Value::tuple({}));
  EXPECT_NE(error_of([&] { bare.attr("x"); }).find("an Object of m.Empty has no state"), std::string::npos);
  Value tuple_state = bare;
  tuple_state.set_state(Value::tuple({num(1)}));
  EXPECT_NE(error_of([&] { bare.attr("x"); }).find("has state a Tuple, not a Dict of attributes"), std::string::npos);
  EXPECT_THROW(Value::object(Construction::Reduce, Value::global("m", "f"), Value::list({})), std::invalid_argument);
  EXPECT_THROW(Value::global(num(1), str("x")), std::invalid_argument);

  // Handles share their node: a change through one is seen through the other.
  Value a = Value::list({});
  const Value b = a;
  a.append(num(1));
  EXPECT_TRUE(a.same(b));
  EXPECT_EQ(b.items().size(), 1u);
  EXPECT_EQ(a, Value::list({num(1)}));
  EXPECT_FALSE(a.same(Value::list({num(1)})));

  EXPECT_TRUE(pk::is_utf8("\xc3\xa9\xf0\x9f\x98\x80"));
  EXPECT_TRUE(pk::is_utf8("\xed\xa0\x80"));  // a lone surrogate, as surrogatepass writes it
  EXPECT_FALSE(pk::is_utf8("\xc0\x80"));      // overlong
  EXPECT_FALSE(pk::is_utf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_FALSE(pk::is_utf8("\xe2\x82"));
}

TEST(PickleRoundTrip, EveryKindAtEveryProtocol) {
  for (int protocol = 2; protocol <= 5; ++protocol) {
    const Value v = every_kind(protocol);
    const std::string bytes = pk::write(v, protocol);
    EXPECT_EQ(static_cast<uint8_t>(bytes[1]), protocol);
    EXPECT_EQ(pk::read(bytes, "every_kind"), v) << "protocol " << protocol;
  }
}

TEST(PickleRoundTrip, SharedValuesAreWrittenOnceAndReadShared) {
  const Value text = Value::string(std::string(1000, 'z'));
  std::vector<Value> strings;
  for (int i = 0; i < 300; ++i) strings.push_back(Value::string("s" + std::to_string(i)));
  const Value many = Value::list(strings);  // memo indices past 255: LONG_BINPUT, LONG_BINGET
  const Value v = Value::list({text, many, text, Value::tuple({text}), many});
  for (int protocol = 2; protocol <= 5; ++protocol) {
    const std::string bytes = pk::write(v, protocol);
    EXPECT_EQ(bytes.find(std::string(1000, 'z')), bytes.rfind(std::string(1000, 'z')));
    const Value back = pk::read(bytes, "shared");
    ASSERT_EQ(back, v);
    EXPECT_TRUE(back.items()[0].same(back.items()[2]));
    EXPECT_TRUE(back.items()[0].same(back.items()[3].items()[0]));
    EXPECT_TRUE(back.items()[1].same(back.items()[4]));
  }
}

TEST(PickleRoundTrip, WriteRefusesWhatTheProtocolCannotSay) {
  const auto refused = [](const Value& v, int protocol, const std::string& part) {
    const std::string message = error_of([&] { pk::write(v, protocol); });
    EXPECT_EQ(message.rfind("fsdp: pickle: ", 0), 0u) << message;
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  };
  refused(Value(), 1, "protocol 1 is not one this writer writes (2 to 5)");
  refused(Value(), 6, "protocol 6");
  refused(Value::bytes("x"), 2, "Bytes in protocol 2 (they need 3 or later)");
  refused(Value::set({}), 3, "a Set before protocol 4");
  refused(Value::frozenset({}), 2, "a FrozenSet before protocol 4");
  refused(Value::object(Construction::NewObjEx, Value::global("m", "C"), Value::tuple({}), Value::dict({})), 3,
          "NEWOBJ_EX before protocol 4");
  refused(str("\xff"), 4, "a String that is not UTF-8");
  refused(Value::global("m\nx", "C"), 2, "cannot hold a newline");
  Value deep = num(0);
  for (int i = 0; i < pk::kMaxDepth; ++i) deep = Value::tuple({deep});
  refused(deep, 4, "nests deeper than 1000 levels");
  Value self = Value::object(Construction::NewObj, Value::global("m", "C"), Value::tuple({}));
  self.set_state(Value::list({self}));
  refused(self, 4, "an Object of m.C that contains itself");
  self.set_state(Value());  // breaks the cycle, so that the test frees it
}

TEST(PicklePython, NestedContainersAndTheMemo) {
  const std::string bytes = from_hex(kNested);
  const Value v = pk::read(bytes, "nested");
  ASSERT_EQ(v.kind(), Kind::Dict);
  ASSERT_EQ(v.entries().size(), 6u);
  const Value& a = v.at("a");
  EXPECT_EQ(a.items()[0].as_ints(), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(a.items()[0].same(a.items()[1]));  // `shared`, through BINGET
  EXPECT_EQ(a.items()[2], Value::tuple({num(1), str("x"), Value()}));
  EXPECT_EQ(a.items()[3], Value::tuple({}));
  const std::vector<Value>& b = v.at("b").items();
  EXPECT_TRUE(b[0].as_bool());
  EXPECT_FALSE(b[1].as_bool());
  EXPECT_EQ(b[2].as_float(), 1.5);
  const std::vector<int64_t> ints = {b[3].as_int(), b[4].as_int(), b[5].as_int(), b[6].as_int(), b[7].as_int()};
  EXPECT_EQ(ints, (std::vector<int64_t>{-7, 300, 70000, int64_t{1} << 40, std::numeric_limits<int64_t>::min()}));
  EXPECT_EQ(b[8].as_string(), "\xc3\xa9");
  EXPECT_EQ(v.entries()[2].first.as_int(), 3);  // keys need not be strings
  EXPECT_TRUE(v.entries()[2].second.at("k").same(a.items()[0]));
  EXPECT_EQ(v.entries()[3].first, Value::tuple({num(1), num(2)}));
  EXPECT_EQ(v.entries()[3].second.as_bytes(), std::string("\0\xff", 2));
  EXPECT_EQ(v.at("s"), Value::set({num(5)}));
  EXPECT_EQ(v.at("f"), Value::frozenset({num(6)}));
  EXPECT_EQ(pk::write(v, 4), bytes);
}

TEST(PicklePython, DataclassSlotsAndEnum) {
  const std::string bytes = from_hex(kObjects);
  const Value v = pk::read(bytes, "objects");
  const Value& point = v.items().at(0);
  ASSERT_TRUE(point.is_instance_of("__main__", "Point"));
  EXPECT_EQ(point.construction(), Construction::NewObj);
  EXPECT_EQ(point.args(), Value::tuple({}));
  EXPECT_EQ(point.attr("x").as_int(), 1);
  EXPECT_EQ(point.attr("y").as_float(), 2.5);
  EXPECT_EQ(point.attr("tags"), Value::list({str("a"), str("b")}));
  const Value& slotted = v.items().at(1);  // state (None, {slot: value})
  EXPECT_EQ(slotted.attr("a").as_int(), 7);
  EXPECT_EQ(slotted.attr("b").as_string(), "q");
  const Value& color = v.items().at(2);  // Color(2): the Enum's class called with its value
  EXPECT_TRUE(color.is_instance_of("__main__", "Color"));
  EXPECT_EQ(color.construction(), Construction::Reduce);
  EXPECT_EQ(color.args(), Value::tuple({num(2)}));
  EXPECT_FALSE(color.has_state());
  EXPECT_TRUE(color.cls().module_value().same(point.cls().module_value()));  // '__main__' pickled once
  EXPECT_EQ(pk::write(v, 4), bytes);
}

TEST(PicklePython, ProtocolsTwoAndFiveHoldTheSameValue) {
  const std::string p2 = from_hex(kSame2), p5 = from_hex(kSame5);
  const Value two = pk::read(p2, "same2"), five = pk::read(p5, "same5");
  EXPECT_EQ(two, five);
  EXPECT_EQ(two.items()[0].attr("x").as_int(), -1);
  EXPECT_EQ(two.items()[3].as_int(), int64_t{1} << 40);
  EXPECT_EQ(pk::write(two, 2), p2);
  EXPECT_EQ(pk::write(two, 5), p5);
  EXPECT_EQ(pk::write(five, 2), p2);
}

struct StorageEntry {
  const char* fqn;
  std::vector<int64_t> offset;  // empty with no_offset: a non-tensor
  bool no_offset;
  int64_t file_offset, length;
};

TEST(PickleDcp, MetadataFieldsAsALoaderReadsThem) {
  const std::string bytes = from_hex(kDcpMetadata);
  const Value md = pk::read(bytes, ".metadata");
  ASSERT_TRUE(md.is_instance_of(kDcp, "Metadata"));
  EXPECT_EQ(md.attr("version").as_string(), "1.0.0");
  const Value& tensors = md.attr("state_dict_metadata");
  std::vector<std::string> keys;
  for (const Value::Entry& e : tensors.entries()) keys.push_back(e.first.as_string());
  EXPECT_EQ(keys, (std::vector<std::string>{"model.w", "model.b", "optim.step", "optim.lr"}));

  const Value& w = tensors.at("model.w");
  ASSERT_TRUE(w.is_instance_of(kDcp, "TensorStorageMetadata"));
  const Value& size = w.attr("size");
  EXPECT_TRUE(size.is_instance_of("torch", "Size"));
  EXPECT_EQ(size.args().items().at(0).as_ints(), (std::vector<int64_t>{13, 17}));
  // TensorProperties' __getstate__: (dtype, layout, requires_grad, memory_format, pin_memory).
  const Value& properties = w.attr("properties");
  ASSERT_TRUE(properties.is_instance_of(kDcp, "TensorProperties"));
  const std::vector<Value>& p = properties.state().items();
  ASSERT_EQ(p.size(), 5u);
  EXPECT_TRUE(p[0].is_global("torch", "float32"));
  EXPECT_TRUE(p[1].is_instance_of("torch.serialization", "_get_layout"));
  EXPECT_EQ(p[1].args(), Value::tuple({str("torch.strided")}));
  EXPECT_FALSE(p[2].as_bool());
  EXPECT_TRUE(p[3].is_instance_of(kDcp, "_MEM_FORMAT_ENCODING"));  // an Enum member
  EXPECT_EQ(p[3].args(), Value::tuple({num(0)}));
  EXPECT_NE(error_of([&] { properties.attr("dtype"); }).find("not a Dict of attributes"), std::string::npos);
  const std::vector<Value>& chunks = w.attr("chunks").items();
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_TRUE(chunks[0].is_instance_of(kDcp, "ChunkStorageMetadata"));
  EXPECT_EQ(chunks[0].attr("offsets").args().items().at(0).as_ints(), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(chunks[0].attr("sizes").args().items().at(0).as_ints(), (std::vector<int64_t>{13, 17}));
  const Value& b = tensors.at("model.b");
  EXPECT_TRUE(b.attr("properties").state().items().at(0).is_global("torch", "bfloat16"));
  EXPECT_EQ(b.attr("size").args().items().at(0).as_ints(), (std::vector<int64_t>{5}));
  EXPECT_TRUE(tensors.at("optim.step").attr("size").args().items().at(0).as_ints().empty());
  EXPECT_TRUE(tensors.at("optim.lr").is_instance_of(kDcp, "BytesStorageMetadata"));
  EXPECT_FALSE(tensors.at("optim.lr").has_state());
  EXPECT_TRUE(b.attr("size").cls().same(size.cls()));  // torch.Size memoized once

  EXPECT_EQ(md.attr("planner_data").at("model.w"), Value::tuple({str("model"), str("w")}));
  EXPECT_TRUE(md.attr("planner_data").entries()[0].first.same(tensors.entries()[0].first));

  // storage_data: MetadataIndex -> _StorageInfo, the chunks laid end to end in one file.
  const std::vector<StorageEntry> expected = {{"optim.lr", {}, true, 0, 1261},
                                              {"model.w", {0, 0}, false, 1261, 2409},
                                              {"model.b", {0}, false, 3670, 1577},
                                              {"optim.step", {}, false, 5247, 1577}};
  const std::vector<Value::Entry>& storage = md.attr("storage_data").entries();
  ASSERT_EQ(storage.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const Value& index = storage[i].first;
    const Value& info = storage[i].second;
    ASSERT_TRUE(index.is_instance_of(kDcp, "MetadataIndex"));
    EXPECT_EQ(index.attr("fqn").as_string(), expected[i].fqn);
    const Value* offset = index.find_attr("offset");  // absent: the class default, None
    ASSERT_EQ(offset == nullptr, expected[i].no_offset) << expected[i].fqn;
    if (offset) {
      EXPECT_EQ(offset->args().items().at(0).as_ints(), expected[i].offset);
    }
    ASSERT_TRUE(info.is_instance_of("torch.distributed.checkpoint.filesystem", "_StorageInfo"));
    EXPECT_EQ(info.attr("relative_path").as_string(), "__0_0.distcp");
    EXPECT_EQ(info.attr("offset").as_int(), expected[i].file_offset);
    EXPECT_EQ(info.attr("length").as_int(), expected[i].length);
    EXPECT_EQ(info.find_attr("transform_descriptors"), nullptr);
  }
  const Value& meta = md.attr("storage_meta");
  EXPECT_TRUE(meta.attr("checkpoint_id").is_instance_of("pathlib", "PosixPath"));
  EXPECT_TRUE(meta.attr("load_id").is_none());

  EXPECT_EQ(pk::write(md, 4), bytes);
  std::string as_five = bytes;
  as_five[1] = 5;
  EXPECT_EQ(pk::write(md, 5), as_five);
  EXPECT_EQ(pk::read(pk::write(md, 2), "p2"), md);
}

// The message `bytes` is refused with ("" when read() accepts them).
std::string refusal(const std::string& bytes, const std::string& what = "bad.pkl") {
  try {
    pk::read(bytes, what);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(PickleMalformed, EveryTruncationAndFlippedByteOfTheMetadata) {
  const std::string bytes = from_hex(kDcpMetadata);
  // Protocol 4's frame gives the truncation away at once; protocol 2 has none, so each cut
  // of its form is found by the opcode it cuts through.
  const std::string unframed = pk::write(pk::read(bytes, ".metadata"), 2);
  for (const std::string& whole : {bytes, unframed})
    for (size_t n = 0; n < whole.size(); ++n)
      ASSERT_EQ(refusal(whole.substr(0, n), "cut").rfind("fsdp: pickle: 'cut': ", 0), 0u) << n << " bytes";
  EXPECT_NE(refusal(bytes.substr(0, 20)).find("FRAME (0x95) at byte 2: its frame of 1260 bytes runs past the end"),
            std::string::npos);
  EXPECT_NE(refusal(unframed.substr(0, 20)).find("GLOBAL (0x63) at byte 2: the pickle ends inside its text operand"),
            std::string::npos);
  const size_t at = unframed.find("state_dict_metadata") - 5;  // its BINUNICODE
  EXPECT_NE(refusal(unframed.substr(0, at + 10))
                .find("BINUNICODE (0x58) at byte " + std::to_string(at) +
                      ": the pickle ends inside its operand (it needs 19 bytes, 5 remain)"),
            std::string::npos);
  // A flipped byte may still make a pickle; anything else must be refused in our words.
  for (size_t i = 0; i < bytes.size(); ++i)
    for (const uint8_t flip : {0xff, 0x01, 0x80}) {
      std::string damaged = bytes;
      damaged[i] = static_cast<char>(damaged[i] ^ flip);
      try {
        pk::read(damaged, "flip");
      } catch (const std::runtime_error& e) {
        ASSERT_EQ(std::string(e.what()).rfind("fsdp: pickle: 'flip': ", 0), 0u) << e.what();
      }
    }
}

std::string deep_chain_through_the_memo(int n) {
  // n lists, each memoized; list i+1 appended to list i after all are built: a chain that
  // no count at construction sees, n deep.
  std::string p = "\x80\x04";
  for (int i = 0; i < n; ++i) p += "]\x94" "0";
  for (int i = 0; i + 1 < n; ++i) p += "j" + le(i, 4) + "j" + le(i + 1, 4) + "a0";
  return p + "j" + le(0, 4) + ".";
}

TEST(PickleMalformed, EachRuleOfTheReader) {
  const std::string p4 = "\x80\x04";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"", {"the pickle ends at byte 0 without STOP"}},
      {p4 + "N", {"ends at byte 3 without STOP"}},
      {p4 + "\xff.", {"unknown opcode 0xff at byte 2"}},
      {p4 + "X" + le(5, 4) + "ab.", {"BINUNICODE (0x58) at byte 2", "needs 5 bytes, 3 remain", "truncated"}},
      {p4 + "\x8d" + le(uint64_t{1} << 60, 8) + "abc.", {"BINUNICODE8", "needs 1152921504606846976 bytes"}},
      {p4 + "\x95" + le(1000, 8) + "N.", {"FRAME (0x95) at byte 2", "frame of 1000 bytes runs past the end"}},
      {p4 + "]h\x07.", {"BINGET (0x68) at byte 3", "memo index 7 was never stored"}},
      {p4 + "g-1\n.", {"GET", "memo index -1 is negative"}},
      {p4 + "gx\n.", {"GET", "'x' is not a decimal int64"}},
      {p4 + "a.", {"APPEND (0x61) at byte 2", "stack underflow"}},
      {p4 + "K\x01\x86.", {"TUPLE2", "stack underflow"}},
      {p4 + "](a.", {"APPEND", "stack underflow", "above its last MARK"}},
      {p4 + "K\x01t.", {"TUPLE (0x74) at byte 4", "MARK missing"}},
      {p4 + "NN.", {"STOP", "leaves 1 more value(s) and 0 open MARK(s)"}},
      {p4 + "N.N", {"STOP", "1 byte(s) follow it"}},
      {p4 + "]" + std::string(100000, '\x85') + ".", {"nests deeper than 1000 levels"}},
      {deep_chain_through_the_memo(1500), {"nests deeper than 1000 levels"}},
      {p4 + "]\x94h" + le(0, 1) + "a.", {"the value contains itself", "a List holds itself"}},
      {p4 + "]\x94h" + le(0, 1) + "a0N.", {"the value contains itself"}},  // even when dropped before STOP
      {p4 + "\x8a\x09" + std::string(8, '\0') + "\x01.", {"LONG1", "an integer of 9 bytes does not fit in int64"}},
      {p4 + "\x8b\xff\xff\xff\xff.", {"LONG4", "length -1 is negative"}},
      {p4 + "\x8c\x01\xff.", {"SHORT_BINUNICODE", "not valid UTF-8"}},
      {"P0\n.", {"PERSID (0x50) at byte 0", "persistent IDs are not supported"}},
      {p4 + "N\x94Q.", {"BINPERSID", "persistent IDs"}},
      {p4 + "\x82\x01.", {"EXT1", "extension registry"}},
      {p4 + "\x97.", {"NEXT_BUFFER", "out-of-band buffers"}},
      {"S'a'\n.", {"STRING (0x53) at byte 0", "this opcode of protocols 0 and 1"}},
      {"\x80\x06N.", {"PROTO", "protocol 6 is newer than this reader's 5"}},
      {p4 + "}(K\x01u.", {"SETITEMS", "odd number (1)"}},
      {p4 + "}(K\x01" "e.", {"APPENDS", "adds to a Dict, which takes no elements"}},
      {p4 + "]}b.", {"BUILD", "gives state to a List, which is not an object"}},
      {p4 + "cm\nC\n)\x81}b}b.", {"BUILD (0x62) at byte 12", "already has state"}},
      {p4 + "K\x01)R.", {"REDUCE", "calls an Int, which Python could not call"}},
      {p4 + "cm\nf\n]R.", {"REDUCE", "its arguments are a List, not a Tuple"}},
      {p4 + "K\x01K\x02\x93.", {"STACK_GLOBAL", "takes two Strings"}},
      {p4 + "cm\nC\n)K\x01\x92.", {"NEWOBJ_EX", "keyword arguments are an Int, not a Dict"}},
  };
  for (const auto& [bytes, parts] : cases) {
    const std::string message = refusal(bytes);
    EXPECT_EQ(message.rfind("fsdp: pickle: 'bad.pkl': ", 0), 0u) << "refused with: '" << message << "'";
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

TEST(PickleMalformed, AcceptsWhatPythonAccepts) {
  const std::string p4 = "\x80\x04";
  EXPECT_EQ(pk::read("I01\n.", "p0"), Value::boolean(true));  // protocol 0's bools and ints
  EXPECT_EQ(pk::read("I-42\n.", "p0"), num(-42));
  EXPECT_EQ(pk::read("(lp0\nI1\na0g0\n.", "p0"), Value::list({num(1)}));  // LIST, PUT, POP, GET
  EXPECT_EQ(pk::read("(I1\nI2\nd.", "p0"), Value::dict({{num(1), num(2)}}));
  EXPECT_EQ(pk::read(p4 + "(0N.", "pop"), Value());  // POP with nothing above a MARK drops it
  EXPECT_EQ(pk::read(p4 + "N(K\x01" "1.", "pop_mark"), Value());
  const Value dup = pk::read(p4 + "]2\x86.", "dup");
  EXPECT_TRUE(dup.items()[0].same(dup.items()[1]));
  EXPECT_EQ(pk::read(p4 + "\x8a\x09" + std::string(9, '\xff') + ".", "long"), num(-1));  // sign extension fits
  EXPECT_EQ(pk::read(p4 + "\x8a" + le(0, 1) + ".", "long"), num(0));
  EXPECT_EQ(pk::read("\x80\x05\x96" + le(2, 8) + "ab.", "bytearray"), Value::bytes("ab"));
  Value depth = Value::list({});
  for (int i = 1; i < pk::kMaxDepth; ++i) depth = Value::tuple({depth});
  EXPECT_EQ(pk::read(p4 + "]" + std::string(pk::kMaxDepth - 1, '\x85') + ".", "deepest"), depth);
  EXPECT_EQ(pk::read(pk::write(depth, 4), "deepest"), depth);
}

}  // namespace
