#include "shoal/checkpoint/sharded_checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <variant>

#include "checkpoint/atomic_file.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/torch_save_writer.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/error.h"

namespace shoal::checkpoint {
namespace sharded_detail {

// The layout of the metadata; a reader refuses a version it does not know.
constexpr int64_t kFormatVersion = 1;
constexpr const char* kFormatName = "shoal.fsdp.flat_shards";
constexpr const char* kMetadataKey = "shoal_sharded";
// Far above any job's rank count, low enough that a corrupt world size cannot make the reader
// loop over billions of file names.
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;
constexpr const char* kManifestTitle = "shoal sharded checkpoint";
// A manifest is three short lines; a larger file is not one, and is not read whole.
constexpr std::streamsize kMaxManifestBytes = 4096;

using c10::impl::GenericDict;
using c10::impl::GenericList;

GenericDict new_string_dict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

GenericList int_list(const std::vector<int64_t>& values) {
  GenericList list(c10::AnyType::get());
  for (int64_t v : values) list.push_back(v);
  return list;
}

c10::IValue find_key(const GenericDict& dict, const char* key) {
  auto it = dict.find(c10::IValue(std::string(key)));
  return it == dict.end() ? c10::IValue() : it->value();
}

// Readers of the metadata: each names the file and the field that is wrong.
struct Fields {
  GenericDict dict;
  std::string where;

  c10::IValue get(const char* key) const {
    c10::IValue v = find_key(dict, key);
    SHOAL_CHECK_T(CheckpointError, !v.isNone(), where, ": sharded-checkpoint metadata lacks '",
                  key, "': the file is damaged or not a Shoal shard");
    return v;
  }
  int64_t integer(const char* key) const {
    c10::IValue v = get(key);
    SHOAL_CHECK_T(CheckpointError, v.isInt(), where, ": sharded-checkpoint metadata '", key,
                  "' is a ", v.tagKind(), ", not an integer");
    return v.toInt();
  }
  std::string text(const char* key) const {
    c10::IValue v = get(key);
    SHOAL_CHECK_T(CheckpointError, v.isString(), where, ": sharded-checkpoint metadata '", key,
                  "' is not a string");
    return v.toStringRef();
  }
  std::vector<c10::IValue> list(const char* key) const {
    c10::IValue v = get(key);
    SHOAL_CHECK_T(CheckpointError, v.isList() || v.isTuple(), where,
                  ": sharded-checkpoint metadata '", key, "' is not a list");
    return v.isList() ? v.toListRef().vec() : v.toTupleRef().elements().vec();
  }
  std::vector<int64_t> integers(const char* key) const {
    std::vector<int64_t> out;
    for (const auto& item : list(key)) {
      SHOAL_CHECK_T(CheckpointError, item.isInt(), where, ": sharded-checkpoint metadata '", key,
                    "' holds a ", item.tagKind(), " where an integer belongs");
      out.push_back(item.toInt());
    }
    return out;
  }
  std::vector<std::string> texts(const char* key) const {
    std::vector<std::string> out;
    for (const auto& item : list(key)) {
      SHOAL_CHECK_T(CheckpointError, item.isString(), where, ": sharded-checkpoint metadata '",
                    key, "' holds a ", item.tagKind(), " where a name belongs");
      out.push_back(item.toStringRef());
    }
    return out;
  }
};

Fields fields_of(const c10::IValue& value, const std::string& where, const std::string& what) {
  SHOAL_CHECK_T(CheckpointError, value.isGenericDict(), where, ": ", what, " is a ",
                value.tagKind(), ", not a dict: the file is damaged or not a Shoal shard");
  return Fields{value.toGenericDict(), where};
}

c10::IValue unit_to_ivalue(const FlatUnitMetadata& unit) {
  GenericDict out = new_string_dict();
  out.insert("name", unit.name);
  GenericList names(c10::AnyType::get());
  for (const auto& n : unit.param_names) names.push_back(n);
  out.insert("params", names);
  GenericList shapes(c10::AnyType::get());
  for (const auto& s : unit.shapes) shapes.push_back(int_list(s));
  out.insert("shapes", shapes);
  out.insert("offsets", int_list(unit.offsets));
  out.insert("indices", int_list(unit.param_indices));
  out.insert("numel", unit.numel);
  out.insert("padded", unit.padded);
  return out;
}

FlatUnitMetadata unit_from_ivalue(const c10::IValue& value, const std::string& where) {
  const Fields f = fields_of(value, where, "a unit's metadata");
  FlatUnitMetadata unit;
  unit.name = f.text("name");
  unit.param_names = f.texts("params");
  for (const auto& shape : f.list("shapes")) {
    SHOAL_CHECK_T(CheckpointError, shape.isList() || shape.isTuple(), where, ": unit '",
                  unit.name, "' has a shape that is not a list of sizes");
    std::vector<int64_t> sizes;
    for (const auto& d : shape.isList() ? shape.toListRef().vec() : shape.toTupleRef().elements().vec()) {
      SHOAL_CHECK_T(CheckpointError, d.isInt(), where, ": unit '", unit.name,
                    "' has a size that is not an integer");
      sizes.push_back(d.toInt());
    }
    unit.shapes.push_back(std::move(sizes));
  }
  unit.offsets = f.integers("offsets");
  unit.param_indices = f.integers("indices");
  unit.numel = f.integer("numel");
  unit.padded = f.integer("padded");
  return unit;
}

bool same_unit(const FlatUnitMetadata& a, const FlatUnitMetadata& b) {
  return a.name == b.name && a.param_names == b.param_names && a.shapes == b.shapes &&
         a.offsets == b.offsets && a.param_indices == b.param_indices && a.numel == b.numel &&
         a.padded == b.padded;
}

// The layout must add up before any flat buffer is built from it: parameters laid end to end
// from offset 0, their elements summing to numel, padded the next multiple of the world size.
void check_units(const ShardedTrainingState& s, const std::string& where) {
  std::set<int64_t> indices;
  std::set<std::string> names;
  for (const auto& unit : s.units) {
    const std::string who = where + ": unit '" + unit.name + "'";
    const size_t n = unit.param_names.size();
    SHOAL_CHECK_T(CheckpointError, n > 0 && unit.shapes.size() == n && unit.offsets.size() == n &&
                                       unit.param_indices.size() == n,
                  who, " lists ", n, " parameters but ", unit.shapes.size(), " shapes, ",
                  unit.offsets.size(), " offsets and ", unit.param_indices.size(),
                  " indices: the file is damaged");
    int64_t next = 0;
    for (size_t i = 0; i < n; ++i) {
      int64_t elements = 1;
      for (int64_t d : unit.shapes[i]) {
        // Bounded before multiplying: the product must stay within the unit's element count.
        SHOAL_CHECK_T(CheckpointError, d >= 0 && (d == 0 || elements <= unit.numel / std::max<int64_t>(d, 1)),
                      who, ": parameter '", unit.param_names[i], "' has a size ", d,
                      " that does not fit the unit's ", unit.numel, " elements: the file is damaged");
        elements *= d;
      }
      SHOAL_CHECK_T(CheckpointError, unit.offsets[i] == next, who, ": parameter '",
                    unit.param_names[i], "' starts at ", unit.offsets[i], ", not at ", next,
                    " where the previous one ends: the file is damaged");
      SHOAL_CHECK_T(CheckpointError, unit.param_indices[i] >= 0 && unit.param_indices[i] < s.num_parameters &&
                                         indices.insert(unit.param_indices[i]).second,
                    who, ": parameter '", unit.param_names[i], "' has index ", unit.param_indices[i],
                    " (the model has ", s.num_parameters, " parameters, each listed once)");
      SHOAL_CHECK_T(CheckpointError, names.insert(unit.param_names[i]).second, who,
                    ": parameter '", unit.param_names[i], "' is listed twice");
      next += elements;
      SHOAL_CHECK_T(CheckpointError, next <= unit.numel, who, " holds more elements than its ",
                    unit.numel, ": the file is damaged");
    }
    SHOAL_CHECK_T(CheckpointError, next == unit.numel && unit.numel > 0, who, " says ", unit.numel,
                  " elements, its parameters hold ", next, ": the file is damaged");
    const int64_t padded = (unit.numel + s.world_size - 1) / s.world_size * s.world_size;
    SHOAL_CHECK_T(CheckpointError, unit.padded == padded, who, " says ", unit.padded,
                  " padded elements; ", unit.numel, " elements over ", s.world_size,
                  " ranks pad to ", padded, ": the file is damaged");
  }
}

// Each tensor must be this rank's equal piece of its unit: checked before any piece is copied.
void check_pieces(const ShardedTrainingState& s, const std::string& where) {
  SHOAL_CHECK_T(CheckpointError, s.flat_param_shards.size() == s.units.size() &&
                                     s.optimizer_shards.size() == s.units.size(),
                where, ": holds ", s.flat_param_shards.size(), " parameter pieces and ",
                s.optimizer_shards.size(), " optimizer pieces for ", s.units.size(),
                " units: the file is damaged");
  for (size_t u = 0; u < s.units.size(); ++u) {
    const int64_t piece = s.units[u].padded / s.world_size;
    const at::Tensor& t = s.flat_param_shards[u];
    SHOAL_CHECK_T(CheckpointError, t.dim() == 1 && t.numel() == piece, where, ": the piece of unit '",
                  s.units[u].name, "' holds ", t.numel(), " elements, not the ", piece,
                  " of 1/", s.world_size, " of its ", s.units[u].padded,
                  ": the file is damaged or from another save");
    for (const auto& [name, field] : s.optimizer_shards[u]) {
      if (name == "step") {
        SHOAL_CHECK_T(CheckpointError, field.numel() == 1, where, ": optimizer 'step' of unit '",
                      s.units[u].name, "' is not one number");
        continue;
      }
      SHOAL_CHECK_T(CheckpointError, field.dim() == 1 && field.numel() == piece, where,
                    ": optimizer state '", name, "' of unit '", s.units[u].name, "' holds ",
                    field.numel(), " elements, not ", piece, ": the file is damaged");
    }
  }
}

// How a message names a save: "save 5f3a...", or what an older Shoal's file holds.
std::string save_text(int64_t id) {
  if (id == 0) return "no save id (written by a Shoal before save ids)";
  char text[32];
  std::snprintf(text, sizeof(text), "save %016llx", static_cast<unsigned long long>(id));
  return text;
}

struct Manifest {
  int64_t save_id = 0;
  int64_t world_size = 0;
};

// The folder's manifest, or nullopt when it has none (a save of an older Shoal).
std::optional<Manifest> read_manifest(const std::string& folder) {
  const std::string path = folder + "/" + kShardedManifest;
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string text(static_cast<size_t>(kMaxManifestBytes), '\0');
  in.read(text.data(), kMaxManifestBytes);
  text.resize(static_cast<size_t>(in.gcount()));
  std::istringstream lines(text);
  std::string title, id_key, world_key, id_hex;
  Manifest m;
  const bool ok = std::getline(lines, title) && title == kManifestTitle &&
                  (lines >> id_key >> id_hex >> world_key >> m.world_size) && id_key == "save_id" &&
                  world_key == "world_size" && id_hex.size() == 16 &&
                  id_hex.find_first_not_of("0123456789abcdef") == std::string::npos;
  SHOAL_CHECK_T(CheckpointError, ok, path,
                ": is not a sharded-checkpoint manifest (the file is damaged); resume from an "
                "older checkpoint");
  m.save_id = static_cast<int64_t>(std::stoull(id_hex, nullptr, 16));
  return m;
}

std::vector<std::string> rank_files_in(const std::string& folder) {
  std::vector<std::string> out;
  DIR* d = ::opendir(folder.c_str());
  if (d == nullptr) return out;
  while (dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name.compare(0, 5, "rank_") == 0 && name.size() > 8 &&
        name.compare(name.size() - 3, 3, ".pt") == 0) {
      out.push_back(name);
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace sharded_detail

using namespace sharded_detail;

std::string shard_file_name(int64_t rank) { return "rank_" + std::to_string(rank) + ".pt"; }

int64_t new_save_id() {
  std::random_device device;
  std::uniform_int_distribution<int64_t> draw(1, std::numeric_limits<int64_t>::max());
  return draw(device);
}

void write_sharded_manifest(const std::string& folder, int64_t save_id, int64_t world_size) {
  char id[32];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(save_id));
  detail::write_file_atomically(folder + "/" + kShardedManifest,
                                std::string(kManifestTitle) + "\nsave_id " + id + "\nworld_size " +
                                    std::to_string(world_size) + "\n");
}

bool has_sharded_manifest(const std::string& folder) {
  struct stat info {};
  auto is_file = [&info](const std::string& path) { return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode); };
  return is_file(folder + "/" + kShardedManifest) || is_dcp_folder(folder);
}

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool is_shard_object(const c10::IValue& object) {
  return object.isGenericDict() && !find_key(object.toGenericDict(), kMetadataKey).isNone();
}

void save_shard(const ShardedTrainingState& state, const std::string& path) {
  SHOAL_CHECK_T(InvalidArgument, state.replicated.optimizer.state.empty(),
                "save_shard: the replicated part holds per-parameter optimizer state");
  GenericDict out = to_ivalue(state.replicated).toGenericDict();
  GenericDict meta = new_string_dict();
  meta.insert("format", std::string(kFormatName));
  meta.insert("version", kFormatVersion);
  meta.insert("rank", state.rank);
  meta.insert("world_size", state.world_size);
  if (state.save_id != 0) meta.insert("save_id", state.save_id);
  meta.insert("num_parameters", state.num_parameters);
  GenericList keys(c10::AnyType::get());
  for (const auto& k : state.state_dict_keys) keys.push_back(k);
  meta.insert("state_dict_keys", keys);
  GenericList units(c10::AnyType::get());
  for (const auto& unit : state.units) units.push_back(unit_to_ivalue(unit));
  meta.insert("units", units);
  out.insert(kMetadataKey, meta);
  GenericList pieces(c10::AnyType::get());
  for (const auto& t : state.flat_param_shards) pieces.push_back(t.detach().contiguous());
  out.insert("flat_param_shards", pieces);
  GenericList optimizer(c10::AnyType::get());
  for (const auto& fields : state.optimizer_shards) {
    GenericDict entry = new_string_dict();
    for (const auto& [name, t] : fields) entry.insert(name, t.detach().contiguous());
    optimizer.push_back(entry);
  }
  out.insert("optimizer_shards", optimizer);
  save(out, path);
}

ShardedTrainingState load_shard(const std::string& path, const LoadOptions& options) {
  const c10::IValue object = load(path, options);
  SHOAL_CHECK_T(CheckpointError, is_shard_object(object), path,
                ": is not a rank's file of a sharded checkpoint (no '", kMetadataKey, "')");
  GenericDict dict = object.toGenericDict().copy();
  const Fields meta = fields_of(find_key(dict, kMetadataKey), path, "'" + std::string(kMetadataKey) + "'");
  ShardedTrainingState s;
  SHOAL_CHECK_T(CheckpointError, meta.text("format") == kFormatName && meta.integer("version") == kFormatVersion,
                path, ": is a sharded checkpoint of format '", meta.text("format"), "' version ",
                meta.integer("version"), "; this build reads '", kFormatName, "' version ",
                kFormatVersion, " (convert it with the Shoal that wrote it)");
  s.rank = meta.integer("rank");
  s.world_size = meta.integer("world_size");
  SHOAL_CHECK_T(CheckpointError, s.world_size >= 1 && s.world_size <= kMaxWorldSize && s.rank >= 0 &&
                                     s.rank < s.world_size,
                path, ": says rank ", s.rank, " of world size ", s.world_size, ": the file is damaged");
  if (!find_key(meta.dict, "save_id").isNone()) {
    s.save_id = meta.integer("save_id");
    SHOAL_CHECK_T(CheckpointError, s.save_id != 0, path,
                  ": says save id 0, which no save draws: the file is damaged");
  }
  s.num_parameters = meta.integer("num_parameters");
  s.state_dict_keys = meta.texts("state_dict_keys");
  for (const auto& unit : meta.list("units")) s.units.push_back(unit_from_ivalue(unit, path));
  for (const auto& piece : Fields{dict, path}.list("flat_param_shards")) {
    SHOAL_CHECK_T(CheckpointError, piece.isTensor(), path, ": a flat parameter piece is a ",
                  piece.tagKind(), ", not a tensor");
    s.flat_param_shards.push_back(piece.toTensor());
  }
  for (const auto& entry : Fields{dict, path}.list("optimizer_shards")) {
    const Fields f = fields_of(entry, path, "an optimizer piece");
    std::map<std::string, at::Tensor> fields;
    for (const auto& item : f.dict) {
      SHOAL_CHECK_T(CheckpointError, item.key().isString() && item.value().isTensor(), path,
                    ": an optimizer piece holds something other than named tensors");
      fields[item.key().toStringRef()] = item.value().toTensor();
    }
    s.optimizer_shards.push_back(std::move(fields));
  }
  for (const char* key : {kMetadataKey, "flat_param_shards", "optimizer_shards"}) {
    (void)dict.erase(c10::IValue(std::string(key)));  // absent keys are fine
  }
  s.replicated = training_state_from_ivalue(dict, path);
  check_units(s, path);
  check_pieces(s, path);
  return s;
}

namespace {

// The folder holds one save: its manifest (when there is one) names rank 0's save, and every
// rank file is one of rank 0's world (a file beyond the world size is from another save).
void check_one_save(const std::string& folder, const std::string& first_path,
                    const ShardedTrainingState& first) {
  const int64_t world = first.world_size;
  if (const auto manifest = read_manifest(folder)) {
    SHOAL_CHECK_T(CheckpointError,
                  manifest->save_id == first.save_id && manifest->world_size == world, first_path,
                  ": is a file of ", save_text(first.save_id), " by ", world,
                  " ranks, the folder's manifest names ", save_text(manifest->save_id), " by ",
                  manifest->world_size, ": the folder mixes two saves; put back this save's file "
                  "or resume from an older checkpoint");
  }
  for (const auto& name : rank_files_in(folder)) {
    const std::string number = name.substr(5, name.size() - 8);
    const bool in_range = !number.empty() && number.size() <= 7 &&
                          number.find_first_not_of("0123456789") == std::string::npos &&
                          std::stoll(number) < world;
    SHOAL_CHECK_T(CheckpointError, in_range, folder, "/", name, ": is not one of the ", world,
                  " rank files ", shard_file_name(0), " saved with; the folder mixes two saves: "
                  "remove the file or resume from an older checkpoint");
  }
}

// Rank r's file `s` (at `path`) belongs to the save of rank 0's `first`.
void check_same_save(const ShardedTrainingState& s, int64_t r, const std::string& path,
                     const ShardedTrainingState& first, const std::string& first_path) {
  const int64_t world = first.world_size;
  SHOAL_CHECK_T(CheckpointError, s.world_size == world && s.rank == r, path, ": says rank ",
                s.rank, " of ", s.world_size, " where rank ", r, " of ", world,
                " belongs: the folder mixes two saves");
  // Same step and layout is not enough: another run (another seed) saves the same shapes.
  SHOAL_CHECK_T(CheckpointError, s.save_id == first.save_id, path, ": is a file of ",
                save_text(s.save_id), ", ", first_path, " of ", save_text(first.save_id),
                ": the folder mixes two saves; put back this save's file or resume from an "
                "older checkpoint");
  bool same = s.units.size() == first.units.size() && s.num_parameters == first.num_parameters &&
              s.state_dict_keys == first.state_dict_keys && s.replicated.step == first.replicated.step &&
              s.replicated.epoch == first.replicated.epoch &&
              s.replicated.sampler.samples_seen == first.replicated.sampler.samples_seen;
  for (size_t u = 0; same && u < s.units.size(); ++u) {
    same = same_unit(s.units[u], first.units[u]) &&
           s.flat_param_shards[u].scalar_type() == first.flat_param_shards[u].scalar_type();
  }
  SHOAL_CHECK_T(CheckpointError, same, path, ": disagrees with ", first_path,
                " (units, parameters, dtypes, epoch or step): the folder mixes two saves; "
                "resume from an older checkpoint");
}

// Every rank's file of the folder's save, in rank order, checked to be of one save.
std::deque<ShardedTrainingState> load_every_rank(const std::string& folder,
                                                 const LoadOptions& options) {
  const std::string first_path = folder + "/" + shard_file_name(0);
  struct stat info {};
  SHOAL_CHECK_T(CheckpointError, ::stat(first_path.c_str(), &info) == 0, folder,
                ": sharded checkpoint lacks ", shard_file_name(0),
                " (rank 0's file, which says how many ranks saved it): the save was interrupted or "
                "the files were not all copied; resume from an older checkpoint or copy the file");
  std::deque<ShardedTrainingState> ranks;  // grows without moving `first`
  ranks.push_back(load_shard(first_path, options));
  const ShardedTrainingState& first = ranks.front();
  SHOAL_CHECK_T(CheckpointError, first.rank == 0, first_path, ": says it is rank ", first.rank,
                "'s file: the files were renamed or mixed");
  check_one_save(folder, first_path, first);
  for (int64_t r = 1; r < first.world_size; ++r) {
    const std::string path = folder + "/" + shard_file_name(r);
    SHOAL_CHECK_T(CheckpointError, ::stat(path.c_str(), &info) == 0, path,
                  ": is missing; the sharded checkpoint was saved by ", first.world_size,
                  " ranks and needs every rank's file: copy it from where rank ", r,
                  " saved it, or resume from an older checkpoint");
    ranks.push_back(load_shard(path, options));
    check_same_save(ranks.back(), r, path, first, first_path);
  }
  return ranks;
}

// Unit u's optimizer fields other than "step", concatenated over the ranks (those of rank 0's
// piece, every rank's alike); `step` gets the unit's step count when it has one.
std::map<std::string, at::Tensor> flat_optimizer_fields(const std::deque<ShardedTrainingState>& ranks,
                                                        size_t u, const std::string& folder,
                                                        at::Tensor& step) {
  std::map<std::string, at::Tensor> flat_fields;
  for (const auto& [name, field] : ranks.front().optimizer_shards[u]) {
    if (name == "step") {
      step = field;
      continue;
    }
    std::vector<at::Tensor> parts;
    for (const auto& s : ranks) {
      auto it = s.optimizer_shards[u].find(name);
      SHOAL_CHECK_T(CheckpointError, it != s.optimizer_shards[u].end(), folder, "/",
                    shard_file_name(s.rank), ": lacks optimizer state '", name, "' of unit '",
                    ranks.front().units[u].name, "' that rank 0 holds: the folder mixes two saves");
      parts.push_back(it->second);
    }
    flat_fields[name] = at::cat(parts);
  }
  return flat_fields;
}

// Unit u put back together: its parameters into `assembled`, their optimizer state into
// `optimizer` (by parameter index).
void assemble_unit(const std::deque<ShardedTrainingState>& ranks, size_t u,
                   const std::string& folder, const std::string& first_path, StateDict& assembled,
                   std::map<int64_t, std::map<std::string, at::Tensor>>& optimizer) {
  const FlatUnitMetadata& unit = ranks.front().units[u];
  std::vector<at::Tensor> pieces;
  for (const auto& s : ranks) pieces.push_back(s.flat_param_shards[u]);
  const at::Tensor flat = at::cat(pieces);
  at::Tensor step;
  const auto flat_fields = flat_optimizer_fields(ranks, u, folder, step);
  for (size_t i = 0; i < unit.param_names.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : unit.shapes[i]) n *= d;  // bounded by check_units
    SHOAL_CHECK_T(CheckpointError, !assembled.contains(unit.param_names[i]), first_path,
                  ": parameter '", unit.param_names[i], "' is both sharded and replicated");
    assembled.insert(unit.param_names[i], flat.narrow(0, unit.offsets[i], n).view(unit.shapes[i]).clone());
    if (flat_fields.empty() && !step.defined()) continue;
    auto& state = optimizer[unit.param_indices[i]];
    for (const auto& [name, field] : flat_fields) {
      state[name] = field.narrow(0, unit.offsets[i], n).view(unit.shapes[i]).clone();
    }
    if (step.defined()) state["step"] = step.reshape({}).clone();
  }
}

// `assembled` in the model's own order (what model.state_dict() gives), when the keys are all
// there.
StateDict in_model_order(const StateDict& assembled, const ShardedTrainingState& first,
                         const std::string& first_path) {
  SHOAL_CHECK_T(CheckpointError, first.state_dict_keys.size() == assembled.size(), first_path,
                ": lists ", first.state_dict_keys.size(), " state-dict keys but holds ",
                assembled.size(), " tensors: the file is damaged");
  StateDict model;
  for (const auto& key : first.state_dict_keys) {
    const at::Tensor* t = assembled.find(key);
    SHOAL_CHECK_T(CheckpointError, t != nullptr, first_path, ": lists state-dict key '", key,
                  "' but holds no tensor for it: the file is damaged");
    model.insert(key, *t);
  }
  return model;
}

}  // namespace

TrainingState load_sharded_checkpoint(const std::string& folder, const LoadOptions& options) {
  if (is_dcp_folder(folder)) return load_sharded_dcp(folder, options);
  struct stat info {};
  SHOAL_CHECK_T(CheckpointError, ::stat((folder + "/" + dcp_shard_file_name(0)).c_str(), &info) != 0, folder,
                ": has rank files but no .metadata, which rank 0 writes once every rank's file is "
                "complete: the save was interrupted; resume from an older checkpoint");
  const std::deque<ShardedTrainingState> ranks = load_every_rank(folder, options);
  const ShardedTrainingState& first = ranks.front();
  const std::string first_path = folder + "/" + shard_file_name(0);
  // The whole state: rank 0's replicated part, and each unit put back together.
  TrainingState out = first.replicated;
  out.world_size = first.world_size;
  StateDict assembled = out.model;
  std::map<int64_t, std::map<std::string, at::Tensor>> optimizer;
  for (size_t u = 0; u < first.units.size(); ++u) {
    assemble_unit(ranks, u, folder, first_path, assembled, optimizer);
  }
  out.model = in_model_order(assembled, first, first_path);
  out.optimizer.state = std::move(optimizer);
  for (const auto& group : out.optimizer.param_groups) {
    for (int64_t p : group.params) {
      SHOAL_CHECK_T(CheckpointError, p >= 0 && p < first.num_parameters, first_path,
                    ": the optimizer's param_groups name parameter ", p, " of ",
                    first.num_parameters, ": the file is damaged");
    }
  }
  return out;
}

}  // namespace shoal::checkpoint

namespace shoal::checkpoint {

// The DCP layout of a sharded checkpoint (see the file comment of sharded_checkpoint.h).
namespace {

using detail::DcpChunk;
using detail::DcpEntry;
using DcpPath = std::vector<std::variant<std::string, int64_t>>;

constexpr const char* kDcpFormatName = "shoal.fsdp.dcp";
constexpr int64_t kDcpFormatVersion = 1;
// Shoal's own entries: what a full checkpoint holds besides the tensors, and the save's id in
// every rank's file.
constexpr const char* kDcpShoalEntry = "shoal";
constexpr const char* kDcpSaveIdEntry = "shoal.save_id";
constexpr const char* kDcpMetadataKey = "shoal_sharded";
constexpr int64_t kDcpMaxWorldSize = int64_t{1} << 20;

// One chunk a rank writes: a box of a tensor entry (its data a view of the rank's piece), or a
// bytes entry's object.
struct DcpItem {
  std::string fqn;
  DcpPath path;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> size;  // the whole tensor's
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  at::Tensor data;            // undefined when only the layout is wanted
  std::optional<c10::IValue> object;  // a bytes entry
};

// A box of a row-major tensor and where its elements start in the tensor's flat order.
struct DcpBox {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t start = 0;
};

// Splits elements [begin, end) of a row-major tensor of `shape` into boxes, each a contiguous run
// of the flat order: the rest of a partial first row, whole rows, the start of a partial last
// row (recursively along the next dimension). `prefix` fixes the dimensions before `dim`.
void split_into_boxes(const std::vector<int64_t>& shape, size_t dim, int64_t begin, int64_t end,
           std::vector<int64_t> prefix, int64_t base, std::vector<DcpBox>& out) {
  if (begin >= end) return;
  if (shape.empty()) {
    out.push_back({{}, {}, 0});
    return;
  }
  const size_t rest = shape.size() - dim - 1;
  int64_t stride = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) stride *= shape[d];
  auto row_box = [&](int64_t first, int64_t rows) {
    DcpBox box{prefix, std::vector<int64_t>(prefix.size(), 1), base + first * stride};
    box.offsets.push_back(first);
    box.sizes.push_back(rows);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(box));
  };
  if (rest == 0) {
    row_box(begin, end - begin);
    return;
  }
  auto partial = [&](int64_t row, int64_t from, int64_t to) {
    std::vector<int64_t> inner = prefix;
    inner.push_back(row);
    split_into_boxes(shape, dim + 1, from, to, inner, base + row * stride, out);
  };
  if (begin % stride != 0) {
    const int64_t row = begin / stride;
    const int64_t stop = std::min(end, (row + 1) * stride);
    partial(row, begin - row * stride, stop - row * stride);
    begin = stop;
  }
  if (end / stride > begin / stride && begin < end) {
    row_box(begin / stride, end / stride - begin / stride);
    begin = end / stride * stride;
  }
  if (begin < end) partial(begin / stride, 0, end - begin);
}

int64_t dcp_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded by the units' check when read back
  return n;
}

// The tensor fields of a unit's optimizer piece (exp_avg, ...), "step" apart.
std::vector<std::string> dcp_piece_fields(const ShardedTrainingState& s, size_t u) {
  std::vector<std::string> out;
  if (u < s.optimizer_shards.size()) {
    for (const auto& [name, field] : s.optimizer_shards[u]) {
      if (name != "step") out.push_back(name);
    }
  }
  return out;
}

at::Tensor dcp_field_of(const ShardedTrainingState& s, size_t u, const std::string& name) {
  return u < s.optimizer_shards.size() && s.optimizer_shards[u].count(name) ? s.optimizer_shards[u].at(name)
                                                                           : at::Tensor();
}

// The chunks of unit u's parameters (and their optimizer state) rank `rank` holds.
void dcp_unit_items(const ShardedTrainingState& s, size_t u, int64_t rank, bool with_data,
                std::vector<DcpItem>& out) {
  const FlatUnitMetadata& unit = s.units[u];
  const int64_t piece = unit.padded / s.world_size;
  const int64_t first = rank * piece;
  const std::vector<std::string> fields = dcp_piece_fields(s, u);
  for (size_t i = 0; i < unit.param_names.size(); ++i) {
    const std::vector<int64_t>& shape = unit.shapes[i];
    const int64_t n = dcp_numel(shape);
    const int64_t begin = std::max(unit.offsets[i], first);
    const int64_t end = std::min(unit.offsets[i] + n, first + piece);
    std::vector<DcpBox> boxes;
    if (n == 0 && rank == 0) boxes.push_back({std::vector<int64_t>(shape.size(), 0), shape, 0});
    split_into_boxes(shape, 0, begin - unit.offsets[i], end - unit.offsets[i], {}, 0, boxes);
    const std::string& name = unit.param_names[i];
    auto add = [&](const std::string& fqn, DcpPath path, const at::Tensor& source, const DcpBox& box) {
      DcpItem item{fqn, std::move(path), source.scalar_type(), shape, box.offsets, box.sizes, {}, {}};
      if (with_data && n == 0) {
        // Rank 0 writes an empty parameter's chunk wherever its offset lies, maybe past its piece.
        item.data = at::empty(box.sizes, source.options());
      } else if (with_data) {
        const int64_t at_piece = unit.offsets[i] + box.start - first;
        item.data = source.narrow(0, at_piece, dcp_numel(box.sizes)).view(box.sizes);
      }
      out.push_back(std::move(item));
    };
    for (const DcpBox& box : boxes) {
      add("model." + name, {"model", name}, s.flat_param_shards[u], box);
      for (const auto& field : fields) {
        add("optim.state." + name + "." + field, {"optim", "state", name, field}, dcp_field_of(s, u, field), box);
      }
    }
  }
}

// Rank 0's whole entries: each sharded parameter's optimizer step (the same on every rank, as
// FSDP2's replicated step), the replicated tensors, the optimizer's param_groups (by name, as
// get_state_dict gives them) and Shoal's own entry.
void dcp_rank0_items(const ShardedTrainingState& s, std::vector<DcpItem>& out) {
  auto whole = [&](const std::string& fqn, DcpPath path, const at::Tensor& t) {
    const std::vector<int64_t> size = t.sizes().vec();
    out.push_back({fqn, std::move(path), t.scalar_type(), size, std::vector<int64_t>(size.size(), 0), size, t, {}});
  };
  std::vector<std::string> names(static_cast<size_t>(std::max<int64_t>(s.num_parameters, 0)));
  for (size_t u = 0; u < s.units.size(); ++u) {
    const at::Tensor step = dcp_field_of(s, u, "step");
    for (size_t i = 0; i < s.units[u].param_names.size(); ++i) {
      const std::string& name = s.units[u].param_names[i];
      names.at(static_cast<size_t>(s.units[u].param_indices[i])) = name;
      if (step.defined()) whole("optim.state." + name + ".step", {"optim", "state", name, "step"}, step.reshape({}));
    }
  }
  for (const auto& item : s.replicated.model) whole("model." + item.key(), {"model", item.key()}, item.value());
  for (size_t g = 0; g < s.replicated.optimizer.param_groups.size(); ++g) {
    const ParamGroupState& group = s.replicated.optimizer.param_groups[g];
    const auto index = static_cast<int64_t>(g);
    for (const auto& [option, value] : group.options) {
      out.push_back({"optim.param_groups." + std::to_string(g) + "." + option,
                     {"optim", "param_groups", index, option}, {}, {}, {}, {}, {}, value});
    }
    c10::impl::GenericList params(c10::StringType::get());
    for (int64_t p : group.params) params.push_back(p >= 0 && p < s.num_parameters ? names[p] : std::string());
    out.push_back({"optim.param_groups." + std::to_string(g) + ".params",
                   {"optim", "param_groups", index, "params"}, {}, {}, {}, {}, {}, c10::IValue(params)});
  }
  TrainingState rest = s.replicated;
  rest.model = StateDict();
  c10::impl::GenericDict object = to_ivalue(rest).toGenericDict();
  c10::impl::GenericDict meta(c10::StringType::get(), c10::AnyType::get());
  meta.insert("format", std::string(kDcpFormatName));
  meta.insert("version", kDcpFormatVersion);
  meta.insert("world_size", s.world_size);
  meta.insert("save_id", s.save_id);
  meta.insert("state_dict_keys", c10::List<std::string>(s.state_dict_keys));
  meta.insert("parameters", c10::List<std::string>(names));
  object.insert(kDcpMetadataKey, meta);
  out.push_back({kDcpShoalEntry, {kDcpShoalEntry}, {}, {}, {}, {}, {}, c10::IValue(object)});
}

// Every chunk rank `rank` of the save `s` describes writes, in file order. Rank 0 lists its
// neighbours' from its own state: every rank's units and optimizer fields are alike.
std::vector<DcpItem> dcp_rank_items(const ShardedTrainingState& s, int64_t rank, bool with_data) {
  std::vector<DcpItem> out;
  const at::Tensor id = at::full({1}, s.save_id, at::kLong);
  out.push_back({kDcpSaveIdEntry, {kDcpSaveIdEntry}, at::kLong, {s.world_size}, {rank}, {1}, id, {}});
  for (size_t u = 0; u < s.units.size(); ++u) dcp_unit_items(s, u, rank, with_data, out);
  if (rank == 0) dcp_rank0_items(s, out);
  return out;
}

}  // namespace

std::string dcp_shard_file_name(int64_t rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

int64_t dcp_chunk_count(const ShardedTrainingState& state, int64_t rank) {
  return static_cast<int64_t>(dcp_rank_items(state, rank, false).size());
}

std::vector<int64_t> save_dcp_shard(const ShardedTrainingState& state, const std::string& folder) {
  detail::TorchSaveSequence data(folder + "/" + dcp_shard_file_name(state.rank));
  std::vector<int64_t> places;
  for (const DcpItem& item : dcp_rank_items(state, state.rank, true)) {
    const auto place =
        data.append(item.object ? *item.object : c10::IValue(item.data.detach().contiguous()));
    places.push_back(place.offset);
    places.push_back(place.length);
  }
  data.commit();
  return places;
}

void write_dcp_sharded_metadata(const ShardedTrainingState& rank0, const std::string& folder,
                                const std::vector<std::vector<int64_t>>& places) {
  std::vector<DcpEntry> entries;
  std::map<std::string, size_t> where;
  for (int64_t r = 0; r < rank0.world_size; ++r) {
    const std::vector<DcpItem> items = dcp_rank_items(rank0, r, false);
    SHOAL_CHECK_T(CheckpointError, places.at(r).size() == 2 * items.size(), folder, ": rank ", r,
                  " wrote ", places.at(r).size() / 2, " chunks where ", items.size(), " belong");
    for (size_t i = 0; i < items.size(); ++i) {
      const DcpItem& item = items[i];
      auto [it, added] = where.emplace(item.fqn, entries.size());
      if (added) entries.push_back({item.fqn, item.path, item.object.has_value(), item.dtype, item.size, {}});
      entries[it->second].chunks.push_back(
          {item.offsets, item.sizes, dcp_shard_file_name(r), places[r][2 * i], places[r][2 * i + 1]});
    }
  }
  detail::write_file_atomically(folder + "/.metadata", detail::dcp_metadata_pickle(entries));
}

namespace {

c10::IValue dcp_find_key(const c10::impl::GenericDict& dict, const std::string& key) {
  auto it = dict.find(c10::IValue(key));
  return it == dict.end() ? c10::IValue() : it->value();
}

std::vector<std::string> dcp_names_in(const c10::IValue& value, const std::string& where, const char* what) {
  SHOAL_CHECK_T(CheckpointError, value.isList(), where, ": '", what, "' is not a list of names: the file is damaged");
  std::vector<std::string> out;
  for (const auto& item : value.toListRef()) {
    SHOAL_CHECK_T(CheckpointError, item.isString(), where, ": '", what, "' holds a ", item.tagKind(),
                  " where a name belongs: the file is damaged");
    out.push_back(item.toStringRef());
  }
  return out;
}

int64_t dcp_integer_in(const c10::impl::GenericDict& meta, const char* key, const std::string& where) {
  const c10::IValue v = dcp_find_key(meta, key);
  SHOAL_CHECK_T(CheckpointError, v.isInt(), where, ": Shoal's entry lacks the integer '", key,
                "': the checkpoint is damaged");
  return v.toInt();
}

// Every rank's file holds the save id Shoal's entry names: a file of another save is refused.
// Read before the rest is assembled, so that a mixed folder is named as such.
void check_dcp_save_ids(int64_t save_id, int64_t world, const std::string& folder, const LoadOptions& options) {
  const std::optional<at::Tensor> ids = load_dcp_tensor(folder, kDcpSaveIdEntry, options);
  SHOAL_CHECK_T(CheckpointError, ids.has_value() && ids->dim() == 1 && ids->size(0) == world &&
                                     ids->scalar_type() == at::kLong,
                folder, "/.metadata: lacks the save id of each of the ", world,
                " ranks: the checkpoint is damaged; resume from an older checkpoint");
  for (int64_t r = 0; r < world; ++r) {
    const int64_t got = (*ids)[r].item<int64_t>();
    SHOAL_CHECK_T(CheckpointError, got == save_id, folder, "/", dcp_shard_file_name(r),
                  ": is a file of another save (id ", got, ", .metadata names ", save_id,
                  "): the folder mixes two saves; put back this save's file or resume from an older "
                  "checkpoint");
  }
}

// The optimizer state by parameter index, from the "optim.state.<name>.<field>" entries.
std::map<int64_t, std::map<std::string, at::Tensor>> dcp_optimizer_state(
    const DcpContents& dcp, const std::vector<std::string>& parameters, const std::string& where) {
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (!parameters[i].empty()) index.emplace(parameters[i], static_cast<int64_t>(i));
  }
  const std::string prefix = "optim.state.";
  std::map<int64_t, std::map<std::string, at::Tensor>> out;
  for (const auto& item : dcp.tensors) {
    const std::string& key = item.key();
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t dot = key.rfind('.');
    const std::string name = dot > prefix.size() ? key.substr(prefix.size(), dot - prefix.size()) : "";
    auto it = index.find(name);
    SHOAL_CHECK_T(CheckpointError, it != index.end(), where, ": optimizer state '", key,
                  "' is of no parameter the checkpoint lists: the checkpoint is damaged");
    out[it->second][key.substr(dot + 1)] = item.value();
  }
  return out;
}

}  // namespace

namespace {

std::string dcp_option_text(const c10::IValue& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// The optimizer's param_groups as get_state_dict saves them (DCP's bytes entries
// "optim.param_groups.<g>.<option>"), merged into one, as Shoal trains one group: their
// parameters' names in order and the options Shoal's optimizers take. Groups whose options differ
// are refused. Empty when the folder holds none.
std::optional<std::pair<std::vector<std::string>, ParamGroupState>> foreign_param_groups(
    const std::string& folder, const LoadOptions& options) {
  const std::string where = folder + "/.metadata";
  const std::map<std::string, c10::IValue> objects = load_dcp_objects(folder, "optim.param_groups.", options);
  std::vector<std::string> names;
  ParamGroupState group;
  int64_t g = 0;
  for (;; ++g) {
    const std::string prefix = "optim.param_groups." + std::to_string(g) + ".";
    auto params = objects.find(prefix + "params");
    if (params == objects.end()) break;
    for (auto& name : dcp_names_in(params->second, where, params->first.c_str())) names.push_back(std::move(name));
    for (const char* option : {"lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov"}) {
      auto value = objects.find(prefix + option);
      if (value == objects.end()) continue;
      auto [first, added] = group.options.emplace(option, value->second);
      SHOAL_CHECK_T(CheckpointError, added || dcp_option_text(first->second) == dcp_option_text(value->second),
                    where, ": the optimizer's param_groups 0 and ", g, " differ in ", option, " (",
                    dcp_option_text(first->second), " and ", dcp_option_text(value->second),
                    "): Shoal trains one group; save the optimizer with one group, or start from the "
                    "weights alone (a folder without the optimizer)");
    }
  }
  if (g == 0) return std::nullopt;
  for (size_t i = 0; i < names.size(); ++i) group.params.push_back(static_cast<int64_t>(i));
  return std::make_pair(std::move(names), std::move(group));
}

// Which of the checkpoint's parameter names (`names`) each of the model's `parameters` takes, by
// name after the prefix handling the weights get ("module." on every saved name and on none of
// the model's). Refuses a name either side lacks.
std::vector<std::string> dcp_names_for(const std::vector<std::string>& names, const StateDict& parameters,
                                       const std::string& where) {
  const std::string wrapper = kWrapperPrefix;
  bool wrapped = !names.empty();
  for (const auto& name : names) wrapped = wrapped && name.compare(0, wrapper.size(), wrapper) == 0;
  wrapped = wrapped && !all_keys_have_prefix(parameters, wrapper);
  std::map<std::string, std::string> saved;  // the model's name -> the checkpoint's
  for (const auto& name : names) {
    const std::string key = wrapped ? name.substr(wrapper.size()) : name;
    SHOAL_CHECK_T(CheckpointError, parameters.find(key) != nullptr, where, ": the optimizer's parameter '",
                  name, "' is no parameter of this model; start from a checkpoint of the same model");
    saved.emplace(key, name);
  }
  std::vector<std::string> out;
  for (const auto& item : parameters) {
    auto it = saved.find(item.key());
    SHOAL_CHECK_T(CheckpointError, it != saved.end(), where, ": the optimizer's param_groups do not list the "
                  "model's parameter '", item.key(), "'; start from a checkpoint of the same model");
    out.push_back(it->second);
  }
  return out;
}

// Each optimizer state tensor has the shape of the parameter it belongs to ("step" apart).
void check_dcp_state_shapes(const OptimizerState& optimizer, const StateDict& parameters,
                            const std::vector<std::string>& names, const std::string& where) {
  for (const auto& [index, fields] : optimizer.state) {
    const at::Tensor& param = parameters[static_cast<size_t>(index)].value();
    for (const auto& [field, tensor] : fields) {
      SHOAL_CHECK_T(CheckpointError, field == "step" || tensor.sizes() == param.sizes(), where,
                    ": optimizer state 'optim.state.", names[static_cast<size_t>(index)], ".", field,
                    "' has shape ", tensor.sizes(), " but the model's parameter '",
                    parameters[static_cast<size_t>(index)].key(), "' has ", param.sizes(),
                    "; start from a checkpoint of the same model");
    }
  }
}

TrainingState read_foreign_dcp(const std::string& folder, const LoadOptions& options, const StateDict* parameters) {
  const DcpContents dcp = load_dcp(folder, options);
  TrainingState out;
  out.model = dcp_model_entries(dcp);
  if (auto group = foreign_param_groups(folder, options)) {
    const std::string where = folder + "/.metadata";
    std::vector<std::string> names = parameters ? dcp_names_for(group->first, *parameters, where) : group->first;
    out.optimizer.state = dcp_optimizer_state(dcp, names, where);
    if (parameters) check_dcp_state_shapes(out.optimizer, *parameters, names, where);
    out.optimizer.param_groups.push_back(std::move(group->second));
  }
  return out;
}

}  // namespace

StateDict dcp_model_entries(const DcpContents& dcp) {
  // A dcp.save of {"model": ..., "optim": ...} has every key under one of the two; a plain
  // state dict whose model has a child named "model" has others too and is kept whole.
  StateDict out;
  const std::string prefix = "model.";
  for (const auto& item : dcp.tensors) {
    const std::string& key = item.key();
    if (key.compare(0, prefix.size(), prefix) == 0) {
      out.insert(key.substr(prefix.size()), item.value());
    } else if (key.compare(0, 6, "optim.") != 0) {
      out = StateDict();
      break;
    }
  }
  if (out.is_empty()) out = dcp.tensors;
  if (all_keys_have_prefix(out, kWrapperPrefix)) out = strip_prefix(out, kWrapperPrefix);
  return out;
}

TrainingState load_foreign_dcp(const std::string& folder, const LoadOptions& options) {
  return read_foreign_dcp(folder, options, nullptr);
}

TrainingState load_foreign_dcp_for(const std::string& folder, const StateDict& parameters,
                                   const LoadOptions& options) {
  return read_foreign_dcp(folder, options, &parameters);
}

bool is_sharded_dcp_folder(const std::string& folder, const LoadOptions& options) {
  return is_dcp_folder(folder) && load_dcp_object(folder, kDcpShoalEntry, options).has_value();
}

TrainingState load_sharded_dcp(const std::string& folder, const LoadOptions& options) {
  const std::string where = folder + "/.metadata";
  const std::optional<c10::IValue> shoal = load_dcp_object(folder, kDcpShoalEntry, options);
  if (!shoal) return load_foreign_dcp(folder, options);
  SHOAL_CHECK_T(CheckpointError, shoal->isGenericDict(), where,
                ": Shoal's entry is not a dict: the checkpoint is damaged");
  c10::impl::GenericDict object = shoal->toGenericDict().copy();
  const c10::IValue meta_value = dcp_find_key(object, kDcpMetadataKey);
  SHOAL_CHECK_T(CheckpointError, meta_value.isGenericDict(), where, ": Shoal's entry lacks '", kDcpMetadataKey,
                "': the checkpoint is damaged");
  const auto meta = meta_value.toGenericDict();
  const c10::IValue format = dcp_find_key(meta, "format");
  SHOAL_CHECK_T(CheckpointError, format.isString() && format.toStringRef() == kDcpFormatName &&
                                     dcp_integer_in(meta, "version", where) == kDcpFormatVersion,
                where, ": is a sharded checkpoint of another format or version; this build reads '",
                kDcpFormatName, "' version ", kDcpFormatVersion);
  const int64_t world = dcp_integer_in(meta, "world_size", where);
  SHOAL_CHECK_T(CheckpointError, world >= 1 && world <= kDcpMaxWorldSize, where, ": says world size ", world,
                ": the checkpoint is damaged");
  const std::vector<std::string> keys = dcp_names_in(dcp_find_key(meta, "state_dict_keys"), where, "state_dict_keys");
  const std::vector<std::string> parameters = dcp_names_in(dcp_find_key(meta, "parameters"), where, "parameters");
  (void)object.erase(c10::IValue(std::string(kDcpMetadataKey)));

  check_dcp_save_ids(dcp_integer_in(meta, "save_id", where), world, folder, options);
  const DcpContents dcp = load_dcp(folder, options);
  TrainingState out = training_state_from_ivalue(object, where);
  for (const auto& key : keys) {
    const at::Tensor* t = dcp.tensors.find("model." + key);
    SHOAL_CHECK_T(CheckpointError, t != nullptr, where, ": lists state-dict key '", key,
                  "' but holds no tensor 'model.", key, "': the checkpoint is damaged");
    out.model.insert(key, *t);
  }
  out.optimizer.state = dcp_optimizer_state(dcp, parameters, where);
  for (const auto& group : out.optimizer.param_groups) {
    for (int64_t p : group.params) {
      SHOAL_CHECK_T(CheckpointError, p >= 0 && p < static_cast<int64_t>(parameters.size()), where,
                    ": the optimizer's param_groups name parameter ", p, " of ", parameters.size(),
                    ": the checkpoint is damaged");
    }
  }
  out.world_size = world;
  return out;
}

void convert_sharded_to_dcp(const std::string& folder, const std::string& out, const LoadOptions& options) {
  std::deque<ShardedTrainingState> ranks = load_every_rank(folder, options);
  detail::make_empty_folder(out);
  const int64_t id = new_save_id();
  std::vector<std::vector<int64_t>> places;
  for (auto& rank : ranks) {
    rank.save_id = id;
    places.push_back(save_dcp_shard(rank, out));
  }
  write_dcp_sharded_metadata(ranks.front(), out, places);
}

}  // namespace shoal::checkpoint
