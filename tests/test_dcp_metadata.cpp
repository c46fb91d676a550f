// DCP metadata without torch (src/state/dcp_metadata.h): two `.metadata` files that torch
// wrote (tests/fixtures/dcp_metadata.h) read field by field as a loader reads them and written again byte
// for byte; metadata built by hand written and read back; fields a dataclass leaves out
// read as their defaults; and every damaged file refused in our words, naming the file and
// the entry: each truncation, and one edit of the real file for each rule of the reader.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fixtures/dcp_metadata.h"
#include "state/dcp_metadata.h"
#include "state/pickle_codec.h"
#include "harness/error_of.h"
#include "harness/hex.h"

using fsdp::testing::error_of;
using fsdp::testing::from_hex;

namespace {

namespace dcp = fsdp::state::dcp;
namespace pk = fsdp::state::pickle;
using pk::Construction;
using pk::Value;
using fsdp::testing::kReplicated;
using fsdp::testing::kThreeRanks;

constexpr const char* kDcp = "torch.distributed.checkpoint.metadata";


std::vector<std::string> fqns(const dcp::Metadata& m) {
  std::vector<std::string> out;
  for (const dcp::Entry& e : m.entries) out.push_back(e.fqn);
  return out;
}

dcp::PathPart key(const char* k) { return dcp::PathPart{false, k, 0}; }
dcp::PathPart index(int64_t i) { return dcp::PathPart{true, "", i}; }
dcp::StorageInfo stored(const char* path, int64_t offset, int64_t length) {
  return dcp::StorageInfo{path, offset, length, false, {}};
}

TEST(DcpMetadata, ThreeRanksOfAShardedBf16ModelAndItsAdam) {
  const dcp::Metadata m = dcp::parse_metadata(from_hex(kThreeRanks), "n3/.metadata");
  EXPECT_EQ(m.version, "1.0.0");
  EXPECT_EQ(m.save_id, "4063333c-35cb-40d1-a669-be846272b792");
  EXPECT_EQ(m.checkpoint_id, "/tmp/dcpw/n3");
  EXPECT_EQ(m.load_id, "");
  EXPECT_TRUE(m.modules.empty());
  // Rank 0's items, then what later ranks saved first: each replicated value (a step, a
  // param group's field) was given to one rank, so they come after the sharded tensors.
  const std::string pg = "optim.param_groups.0.";
  EXPECT_EQ(fqns(m), (std::vector<std::string>{
                         "model.weight", "model.bias", "optim.state.weight.exp_avg", "optim.state.weight.exp_avg_sq",
                         "optim.state.bias.exp_avg", "optim.state.bias.exp_avg_sq", "optim.state.weight.step",
                         pg + "lr", pg + "eps", pg + "amsgrad", pg + "foreach", pg + "differentiable",
                         pg + "decoupled_weight_decay", "optim.state.bias.step", pg + "betas", pg + "weight_decay",
                         pg + "maximize", pg + "capturable", pg + "fused", pg + "params"}));

  // 13 rows over three ranks: 5, 5 and 3; each rank's chunk in its own file.
  const dcp::Entry* w = m.find("model.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(w->is_tensor);
  EXPECT_EQ(w->size, (std::vector<int64_t>{13, 17}));
  EXPECT_EQ(w->dtype, "bfloat16");
  EXPECT_FALSE(w->requires_grad);
  EXPECT_FALSE(w->pin_memory);
  EXPECT_EQ(w->chunks, (std::vector<dcp::Chunk>{{{0, 0}, {5, 17}}, {{5, 0}, {5, 17}}, {{10, 0}, {3, 17}}}));
  EXPECT_EQ(w->storage, (std::vector<dcp::StorageInfo>{stored("__0_0.distcp", 0, 1705),
                                                       stored("__1_0.distcp", 7566, 1705),
                                                       stored("__2_0.distcp", 7566, 1641)}));
  EXPECT_EQ(w->path, (std::vector<dcp::PathPart>{key("model"), key("weight")}));
  EXPECT_EQ(m.find("model.bias")->chunks[2], (dcp::Chunk{{10}, {3}}));
  EXPECT_EQ(m.find("model.bias")->storage[1], stored("__1_0.distcp", 9271, 1577));

  // Adam's step: a 0-dim float32 tensor on every rank, saved once.
  const dcp::Entry* step = m.find("optim.state.bias.step");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->dtype, "float32");
  EXPECT_TRUE(step->size.empty());
  EXPECT_EQ(step->chunks, (std::vector<dcp::Chunk>{{{}, {}}}));
  EXPECT_EQ(step->storage, (std::vector<dcp::StorageInfo>{stored("__2_0.distcp", 14066, 1577)}));
  EXPECT_EQ(step->path, (std::vector<dcp::PathPart>{key("optim"), key("state"), key("bias"), key("step")}));

  // A param group's field: pickled bytes, its path through a list index.
  const dcp::Entry* lr = m.find(pg + "lr");
  ASSERT_NE(lr, nullptr);
  EXPECT_FALSE(lr->is_tensor);
  EXPECT_TRUE(lr->chunks.empty());
  EXPECT_EQ(lr->storage, (std::vector<dcp::StorageInfo>{stored("__1_0.distcp", 0, 1261)}));
  EXPECT_EQ(lr->path, (std::vector<dcp::PathPart>{key("optim"), key("param_groups"), index(0), key("lr")}));
  EXPECT_EQ(m.find(pg + "params")->storage[0], stored("__2_0.distcp", 6305, 1261));
  EXPECT_EQ(m.find("optim.state"), nullptr);

  // planner_data keeps the flattened state dict's order, which differs.
  std::vector<std::string> planner;
  for (size_t i : m.planner_order) planner.push_back(m.entries.at(i).fqn);
  EXPECT_EQ(planner, (std::vector<std::string>{
                         "model.weight", "model.bias", "optim.state.weight.step", "optim.state.weight.exp_avg",
                         "optim.state.weight.exp_avg_sq", "optim.state.bias.step", "optim.state.bias.exp_avg",
                         "optim.state.bias.exp_avg_sq", pg + "lr", pg + "betas", pg + "eps", pg + "weight_decay",
                         pg + "amsgrad", pg + "maximize", pg + "foreach", pg + "capturable", pg + "differentiable",
                         pg + "fused", pg + "decoupled_weight_decay", pg + "params"}));
}

TEST(DcpMetadata, ReplicatedValuesAtTopLevelAndNested) {
  const dcp::Metadata m = dcp::parse_metadata(from_hex(kReplicated), "s2/.metadata");
  EXPECT_EQ(fqns(m), (std::vector<std::string>{"w", "step", "cfg.lr", "cfg.betas", "h"}));
  EXPECT_EQ(m.checkpoint_id, "/tmp/dcpw/s2");
  EXPECT_TRUE(m.planner_order.empty());  // planner_data lists the entries in their own order
  const dcp::Entry& w = m.entries[0];
  EXPECT_EQ(w.dtype, "float32");
  EXPECT_EQ(w.chunks, (std::vector<dcp::Chunk>{{{0, 0}, {3, 4}}}));
  EXPECT_EQ(w.storage, (std::vector<dcp::StorageInfo>{stored("__0_0.distcp", 0, 1577)}));
  EXPECT_EQ(w.path, (std::vector<dcp::PathPart>{key("w")}));
  EXPECT_EQ(m.entries[1].storage, (std::vector<dcp::StorageInfo>{stored("__1_0.distcp", 0, 1261)}));
  EXPECT_EQ(m.entries[1].path, (std::vector<dcp::PathPart>{key("step")}));
  EXPECT_EQ(m.entries[3].path, (std::vector<dcp::PathPart>{key("cfg"), key("betas")}));
  EXPECT_EQ(m.entries[4].dtype, "float16");
  EXPECT_EQ(m.entries[4].storage[0], stored("__1_0.distcp", 3783, 1577));
}

TEST(DcpMetadata, PythonsFilesAreWrittenAgainByteForByte) {
  for (const char* hex : {kThreeRanks, kReplicated}) {
    const std::string bytes = from_hex(hex);
    const dcp::Metadata m = dcp::parse_metadata(bytes, "python");
    EXPECT_EQ(dcp::serialize_metadata(m), bytes);
  }
}

dcp::Metadata by_hand() {
  dcp::Metadata m;
  dcp::Entry t;
  t.fqn = "layer.weight";
  t.is_tensor = true;
  t.size = {4, 3};
  t.dtype = "float32";
  t.requires_grad = true;
  t.chunks = {{{2, 0}, {2, 3}}, {{0, 0}, {2, 3}}};
  t.storage = {stored("__1_0.distcp", 0, 900), stored("__0_0.distcp", 100, 900)};
  t.path = {key("model"), key("layer.weight")};
  dcp::Entry b;
  b.fqn = "epoch";
  b.storage = {stored("__0_0.distcp", 0, 100)};
  b.path = {key("epoch")};
  m.entries = {t, b};
  m.version = "1.0.0";
  m.save_id = "id";
  m.checkpoint_id = "//ck/./x/";
  return m;
}

TEST(DcpMetadata, MetadataBuiltByHandIsWrittenAsDcpWritesIt) {
  const dcp::Metadata m = by_hand();
  const std::string bytes = dcp::serialize_metadata(m);
  dcp::Metadata back = dcp::parse_metadata(bytes, "ours");
  EXPECT_EQ(back.checkpoint_id, "//ck/x");  // as pathlib normalizes it
  back.checkpoint_id = m.checkpoint_id;
  EXPECT_EQ(back, m);

  const Value md = pk::read(bytes, "ours");
  ASSERT_TRUE(md.is_instance_of(kDcp, "Metadata"));
  EXPECT_EQ(md.construction(), Construction::NewObj);
  // storage_data in FileSystemWriter's order: rank 0's file, by offset, then rank 1's.
  std::vector<std::string> order;
  for (const Value::Entry& kv : md.attr("storage_data").entries())
    order.push_back(kv.first.attr("fqn").as_string() + "@" + kv.second.attr("relative_path").as_string() + ":" +
                    std::to_string(kv.second.attr("offset").as_int()));
  EXPECT_EQ(order, (std::vector<std::string>{"epoch@__0_0.distcp:0", "layer.weight@__0_0.distcp:100",
                                             "layer.weight@__1_0.distcp:0"}));
  const Value& first = md.attr("storage_data").entries()[0].first;
  EXPECT_TRUE(first.attr("index").is_none());
  EXPECT_EQ(first.find_attr("offset"), nullptr);  // a non-tensor's MetadataIndex has none
  EXPECT_EQ(md.attr("storage_data").entries()[1].first.attr("index").as_int(), 1);  // its chunk's position
  const Value& id = md.attr("storage_meta").attr("checkpoint_id");
  EXPECT_TRUE(id.is_instance_of("pathlib", "PosixPath"));
  EXPECT_EQ(id.args(), Value::tuple({Value::string("//"), Value::string("ck"), Value::string("x")}));
  const Value& properties = md.attr("state_dict_metadata").at("layer.weight").attr("properties");
  EXPECT_EQ(properties.state().items().size(), 5u);
  EXPECT_TRUE(properties.state().items()[2].as_bool());

  // Nothing optional set: planner_data and storage_meta are None, version too.
  dcp::Metadata bare = m;
  bare.version = bare.save_id = bare.checkpoint_id = "";
  for (dcp::Entry& e : bare.entries) e.path.clear();
  const Value none = pk::read(dcp::serialize_metadata(bare), "bare");
  EXPECT_TRUE(none.attr("planner_data").is_none());
  EXPECT_TRUE(none.attr("storage_meta").is_none());
  EXPECT_TRUE(none.attr("version").is_none());
  EXPECT_EQ(dcp::parse_metadata(dcp::serialize_metadata(bare), "bare"), bare);

  // A given planner order is kept; transform descriptors are written back.
  dcp::Metadata ordered = m;
  ordered.planner_order = {1, 0};
  ordered.entries[0].storage[0].transformed = true;
  ordered.entries[0].storage[0].transform_descriptors = {"stream.zstd/1"};
  back = dcp::parse_metadata(dcp::serialize_metadata(ordered), "ordered");
  back.checkpoint_id = m.checkpoint_id;
  EXPECT_EQ(back, ordered);
}

TEST(DcpMetadata, SerializeRefusesWhatParseWouldRefuse) {
  const auto refused = [](const std::function<void(dcp::Metadata&)>& edit, const std::string& part) {
    dcp::Metadata m = by_hand();
    edit(m);
    EXPECT_EQ(dcp::metadata_problem(m).empty(), false) << part;
    try {
      dcp::serialize_metadata(m);
      ADD_FAILURE() << "serialize_metadata accepted metadata with: " << part;
    } catch (const std::invalid_argument& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("fsdp: dcp: ", 0), 0u) << message;
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  };
  refused([](dcp::Metadata& m) { m.entries[1].fqn = "layer.weight"; }, "'layer.weight' appears twice");
  refused([](dcp::Metadata& m) { m.entries[0].dtype = "float8"; },
          "'layer.weight': dtype 'float8' is not a torch dtype");
  refused([](dcp::Metadata& m) { m.entries[0].chunks[0].sizes = {3, 3}; },
          "chunk 0 (offsets [2, 0], sizes [3, 3]) lies outside the tensor's size [4, 3]");
  refused([](dcp::Metadata& m) { m.entries[0].chunks[1].offsets = {0}; }, "does not have the tensor's 2 dimensions");
  refused([](dcp::Metadata& m) { m.entries[0].storage.pop_back(); }, "2 chunk(s) but 1 storage entries");
  refused([](dcp::Metadata& m) { m.entries[1].storage.clear(); }, "'epoch': a non-tensor entry has 0 storage entries");
  refused([](dcp::Metadata& m) { m.entries[1].chunks = {{{}, {}}}; }, "which only a tensor has");
  refused([](dcp::Metadata& m) { m.entries[1].storage[0].transformed = true; }, "names no transform_descriptors");
  refused([](dcp::Metadata& m) { m.entries[1].storage[0].length = -1; }, "negative offset or length (0, -1)");
  refused([](dcp::Metadata& m) { m.entries[1].path = {index(-2)}; }, "negative list index -2");
  refused([](dcp::Metadata& m) { m.planner_order = {0}; }, "planner_order leaves out 'epoch'");
  refused([](dcp::Metadata& m) { m.planner_order = {0, 0, 1}; }, "planner_order names 'layer.weight' twice");
  refused([](dcp::Metadata& m) { m.planner_order = {0, 2}; }, "planner_order names entry 2 of 2");
}

// Editing the real file's values: each case reads it afresh and changes one thing.
Value three_ranks() { return pk::read(from_hex(kThreeRanks), "n3"); }

Value torch_size(std::vector<int64_t> dims) {
  std::vector<Value> items;
  for (int64_t d : dims) items.push_back(Value::integer(d));
  return Value::object(Construction::Reduce, Value::global("torch", "Size"), Value::tuple({Value::tuple(items)}));
}

// `obj`'s field `name` set to `v` (added when absent), or dropped when `drop`.
void set_field(Value obj, const char* name, const Value& v, bool drop = false) {
  std::vector<Value::Entry> fields;
  bool found = false;
  for (const Value::Entry& kv : obj.state().entries()) {
    if (kv.first.as_string() != name) {
      fields.push_back(kv);
    } else if (!drop) {
      fields.emplace_back(kv.first, v);
    }
    found = found || kv.first.as_string() == name;
  }
  if (!found && !drop) fields.emplace_back(Value::string(name), v);
  obj.set_state(Value::dict(std::move(fields)));
}
void drop_field(Value obj, const char* name) { set_field(obj, name, Value(), true); }

// The storage_data items, and the position of the n-th one of `fqn`.
std::vector<Value::Entry> storage_of(const Value& md) { return md.attr("storage_data").entries(); }
size_t storage_at(const Value& md, const std::string& fqn, int nth = 0) {
  const std::vector<Value::Entry> items = storage_of(md);
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].first.attr("fqn").as_string() == fqn && nth-- == 0) return i;
  throw std::logic_error("no storage for " + fqn);
}
void set_storage(Value md, std::vector<Value::Entry> items) {
  set_field(md, "storage_data", Value::dict(std::move(items)));
}

Value entry_of(const Value& md, const char* fqn) { return md.attr("state_dict_metadata").at(fqn); }
Value chunk_of(const Value& md, size_t i) { return entry_of(md, "model.weight").attr("chunks").items().at(i); }
void set_property(const Value& md, size_t i, const Value& v) {
  Value properties = entry_of(md, "model.weight").attr("properties");
  std::vector<Value> p = properties.state().items();
  p.at(i) = v;
  properties.set_state(Value::tuple(p));
}

// The message parse_metadata refuses `md` with ("" when it accepts it).
std::string refusal(const Value& md) {
  try {
    dcp::parse_metadata(pk::write(md, 4), "bad.metadata");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(DcpMetadata, FieldsLeftOutReadAsTheirDefaults) {
  Value md = three_ranks();
  drop_field(md, "version");
  drop_field(md, "planner_data");
  set_field(md, "storage_meta", Value());
  std::vector<Value::Entry> items = storage_of(md);
  for (Value::Entry& kv : items) drop_field(kv.first, "index");  // only a hint
  // A transformed chunk (compressed, say) is read and marked, for the loader to refuse.
  set_field(items[0].second, "transform_descriptors", Value::list({Value::string("stream.zstd/1")}));
  set_storage(md, items);
  const dcp::Metadata m = dcp::parse_metadata(pk::write(md, 4), "defaults");
  EXPECT_EQ(m.version, "");
  EXPECT_EQ(m.save_id, "");
  EXPECT_EQ(m.checkpoint_id, "");
  EXPECT_TRUE(m.planner_order.empty());
  EXPECT_TRUE(m.find("model.weight")->path.empty());
  const dcp::StorageInfo& s = m.find("model.weight")->storage[0];
  EXPECT_TRUE(s.transformed);
  EXPECT_EQ(s.transform_descriptors, (std::vector<std::string>{"stream.zstd/1"}));
  EXPECT_FALSE(m.find("model.weight")->storage[1].transformed);
  EXPECT_EQ(m.find("model.bias")->storage.size(), 3u);
  EXPECT_EQ(dcp::parse_metadata(dcp::serialize_metadata(m), "again"), m);
}

struct Damage {
  std::function<void(Value& md)> edit;
  std::vector<std::string> parts;  // each in the message
};

TEST(DcpMetadata, DamagedFilesAreRefusedNamingTheEntry) {
  const std::string weight = "state_dict_metadata['model.weight']";
  const std::vector<Damage> cases = {
      {[](Value& md) { md = Value::dict({}); },
       {"the file's value: is a Dict, not a torch.distributed.checkpoint.metadata.Metadata"}},
      {[](Value& md) { drop_field(md, "state_dict_metadata"); }, {"Metadata: has no 'state_dict_metadata'"}},
      {[](Value& md) { set_property(md, 0, Value::global("torch", "bfloat99")); },
       {weight + ".properties.dtype: torch.bfloat99 is not a dtype this reader knows"}},
      {[](Value& md) { set_property(md, 0, Value::string("bfloat16")); }, {"is a String, not a torch dtype"}},
      {[](Value& md) {
         set_property(md, 1, Value::object(Construction::Reduce, Value::global("torch.serialization", "_get_layout"),
                                           Value::tuple({Value::string("torch.sparse_coo")})));
       },
       {weight + ".properties.layout: is torch.sparse_coo; only torch.strided tensors are read"}},
      {[](Value& md) {
         set_property(md, 3, Value::object(Construction::Reduce, Value::global(kDcp, "_MEM_FORMAT_ENCODING"),
                                           Value::tuple({Value::integer(1)})));
       },
       {weight + ".properties.memory_format: is _MEM_FORMAT_ENCODING(1); only torch.contiguous_format (0)"}},
      {[](Value& md) { set_property(md, 2, Value::integer(0)); }, {".requires_grad: is an Int, not a bool"}},
      {[](Value& md) { set_field(entry_of(md, "model.weight"), "properties", Value()); },
       {weight + ": has no 'properties'"}},
      {[](Value& md) { set_field(chunk_of(md, 2), "sizes", torch_size({5, 17})); },
       {"'model.weight': chunk 2 (offsets [10, 0], sizes [5, 17]) lies outside the tensor's size [13, 17]"}},
      {[](Value& md) { set_field(chunk_of(md, 1), "sizes", torch_size({5})); },
       {"'model.weight': chunk 1 (offsets [5, 0], sizes [5]) does not have the tensor's 2 dimensions"}},
      {[](Value& md) { set_field(entry_of(md, "model.weight"), "size", Value::tuple({})); },
       {weight + ".size: is a Tuple, not a torch.Size"}},
      {[](Value& md) {
         Value sdm = md.attr("state_dict_metadata");
         sdm.set_item(Value::string("model.weight"), entry_of(md, "model.bias"));
       },
       {weight + ": the key appears twice"}},
      {[](Value& md) {
         Value sdm = md.attr("state_dict_metadata");
         sdm.set_item(Value::string("odd"), Value::list({}));
       },
       {"state_dict_metadata['odd']: is a List, not a TensorStorageMetadata or BytesStorageMetadata"}},
      {[](Value& md) {
         std::vector<Value::Entry> items = storage_of(md);
         items.erase(items.begin() + storage_at(md, "model.bias", 1));
         set_storage(md, items);
       },
       {"fsdp: dcp: 'bad.metadata': 'model.bias': chunk 1 has no storage_data entry"}},
      {[](Value& md) {
         std::vector<Value::Entry> items = storage_of(md);
         items.erase(items.begin() + storage_at(md, "optim.param_groups.0.lr"));
         set_storage(md, items);
       },
       {"'optim.param_groups.0.lr': has no storage_data entry"}},
      {[](Value& md) { set_field(storage_of(md)[3].first, "fqn", Value::string("model.nothing")); },
       {"storage_data entry 3 ('model.nothing'): names no entry of state_dict_metadata"}},
      {[](Value& md) { set_field(storage_of(md)[0].first, "offset", torch_size({4, 0})); },
       {"storage_data entry 0 ('model.weight'): matches none of the tensor's chunks by offset"}},
      {[](Value& md) { drop_field(storage_of(md)[0].first, "offset"); },
       {"storage_data entry 0 ('model.weight'): has no offset, but 'model.weight' is a tensor"}},
      {[](Value& md) {
         set_field(storage_of(md)[storage_at(md, "optim.param_groups.0.lr")].first, "offset", torch_size({}));
       },
       {"has an offset, but 'optim.param_groups.0.lr' is not a tensor"}},
      {[](Value& md) {
         std::vector<Value::Entry> items = storage_of(md);
         items.push_back(items[1]);
         set_storage(md, items);
       },
       {"('model.bias'): names a chunk that an earlier entry named"}},
      {[](Value& md) { set_field(storage_of(md)[0].second, "length", Value::integer(-1)); },
       {"'model.weight': the storage of chunk 0 has a negative offset or length (0, -1)"}},
      {[](Value& md) { set_field(storage_of(md)[0].second, "relative_path", Value::integer(0)); },
       {"storage_data entry 0 ('model.weight') relative_path: is an Int, not a str"}},
      {[](Value& md) { set_storage(md, {{storage_of(md)[0].second, storage_of(md)[0].first}}); },
       {"storage_data entry 0: is an Object of torch.distributed.checkpoint.filesystem._StorageInfo, not a "
        "torch.distributed.checkpoint.metadata.MetadataIndex"}},
      {[](Value& md) { set_field(storage_of(md)[0].second, "offset", Value::string("0")); },
       {"storage_data entry 0 ('model.weight') offset: is a String, not an int"}},
      {[](Value& md) {
         Value planner = md.attr("planner_data");
         planner.set_item(Value::string("ghost"), Value::tuple({Value::string("ghost")}));
       },
       {"planner_data['ghost']: names no entry of state_dict_metadata"}},
      {[](Value& md) {
         Value planner = md.attr("planner_data");
         planner.set_item(Value::string("model.weight"), Value::tuple({Value::string("model")}));
       },
       {"planner_data['model.weight']: the key appears twice"}},
      {[](Value& md) {
         const Value path = Value::tuple({Value::floating(1)});
         set_field(md, "planner_data", Value::dict({{Value::string("model.bias"), path}}));
       },
       {"planner_data['model.bias']: holds a Float, not a str key or an int index"}},
      {[](Value& md) { set_field(md, "version", Value::integer(1)); }, {"Metadata.version: is an Int, not a str"}},
      {[](Value& md) {
         set_field(md.attr("storage_meta"), "checkpoint_id",
                   Value::object(Construction::Reduce, Value::global("pathlib", "PureWindowsPath"),
                                 Value::tuple({Value::string("C:\\")})));
       },
       {"storage_meta.checkpoint_id: is an Object of pathlib.PureWindowsPath, not a str or a pathlib.PosixPath"}},
  };
  for (const Damage& d : cases) {
    Value md = three_ranks();
    d.edit(md);
    const std::string message = refusal(md);
    EXPECT_EQ(message.rfind("fsdp: dcp: 'bad.metadata': ", 0), 0u) << "refused with: '" << message << "'";
    for (const std::string& part : d.parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

TEST(DcpMetadata, EveryTruncationAndFlippedByteIsRefusedInOurWords) {
  for (const char* hex : {kReplicated, kThreeRanks}) {
    const std::string bytes = from_hex(hex);
    for (size_t n = 0; n < bytes.size(); ++n) {
      const std::string message = error_of([&] { dcp::parse_metadata(bytes.substr(0, n), "cut"); });
      ASSERT_EQ(message.rfind("fsdp: dcp: 'cut': reading the pickle: ", 0), 0u) << n << ": " << message;
    }
  }
  // A flipped byte may still make metadata; anything else must be refused in our words,
  // never by an accessor of the pickle's values or a crash. (The smaller file holds every
  // class and field the larger one does.)
  const std::string bytes = from_hex(kReplicated);
  for (size_t i = 0; i < bytes.size(); ++i)
    for (const uint8_t flip : {0xff, 0x01, 0x80}) {
      std::string damaged = bytes;
      damaged[i] = static_cast<char>(damaged[i] ^ flip);
      const std::string message = error_of([&] { dcp::parse_metadata(damaged, "flip"); });
      ASSERT_TRUE(message.empty() || message.rfind("fsdp: dcp: 'flip': ", 0) == 0) << i << ": " << message;
    }
  EXPECT_EQ(error_of([] { dcp::parse_metadata("\xff junk", "g"); }),
            "fsdp: dcp: 'g': reading the pickle: unknown opcode 0xff at byte 0: not a pickle of protocol 5 or older, "
            "or damaged");
}

}  // namespace
