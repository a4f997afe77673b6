#include "shoal/checkpoint/sharded_checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "checkpoint/atomic_file.h"
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
  return ::stat((folder + "/" + kShardedManifest).c_str(), &info) == 0 && S_ISREG(info.st_mode);
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
