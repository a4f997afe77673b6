// `shoal ckpt inspect FILE` and `shoal ckpt convert IN OUT`: look into torch.save files (Shoal's or
// Python's) and turn Shoal checkpoints into plain state dicts for Python. A sharded checkpoint's
// folder (--checkpoint-format sharded) is read whole: every rank's file, assembled; so is a DCP
// folder (PyTorch's torch.distributed.checkpoint), its tensors assembled from their chunks.
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "commands.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/error.h"

namespace shoal::cli {
namespace {

namespace ckpt = shoal::checkpoint;

// Lists of plain values longer than this are summarised rather than printed in full.
constexpr size_t kMaxInlineItems = 16;
// A container of more items than this prints its first and last kShownItems and "... N more"
// between them: a state dict of a few thousand tensors prints whole, a million small dicts in a
// list (a few KB of file) print as a few lines rather than 29 MB.
constexpr size_t kMaxListedItems = 2000;
constexpr size_t kShownItems = 5;
// Containers nested in containers can still add up (a thousand lists of a thousand dicts): the
// listing stops after this many lines, saying so.
constexpr size_t kMaxLines = 100000;

/// The lines printed so far, against kMaxLines.
struct LineBudget {
  size_t printed = 0;
  /// False once the budget is spent (the first time, printing a line that says so).
  bool take(const std::string& pad) {
    if (printed == kMaxLines) {
      std::cout << pad << "... (the listing stops after " << kMaxLines << " lines)\n";
    }
    return printed++ < kMaxLines;
  }
};

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

/// The shortest text that reads back as the same double (Python's repr).
std::string double_text(double value) {
  char text[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(text, sizeof(text), "%.*g", precision, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  std::string out = text;
  if (out.find_first_of(".eni") == std::string::npos) out += ".0";
  return out;
}

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "[";
  for (int64_t i = 0; i < t.dim(); ++i) out << (i ? ", " : "") << t.size(i);
  out << "] " << ckpt::dtype_name(t.scalar_type()) << " " << human_bytes(static_cast<double>(t.nbytes()));
  return out.str();
}

std::string key_text(const c10::IValue& key) {
  if (key.isString()) return key.toStringRef();
  if (key.isDouble()) return double_text(key.toDouble());
  std::ostringstream out;
  out << key;
  return out.str();
}

bool is_plain(const c10::IValue& v) {
  return v.isNone() || v.isBool() || v.isInt() || v.isDouble() || v.isString();
}

/// Whether the item at `index` of a container of `size` items is printed, and prints the
/// "... N more" line in its place when it is the first one left out.
bool listed(size_t index, size_t size, const std::string& pad, LineBudget& budget) {
  if (size <= kMaxListedItems || index < kShownItems || index >= size - kShownItems) return true;
  if (index == kShownItems && budget.take(pad)) {
    std::cout << pad << "  ... " << size - 2 * kShownItems << " more\n";
  }
  return false;
}

void print_value(const std::string& name, const c10::IValue& v, int indent, LineBudget& budget) {
  const std::string pad(indent * 2, ' ');
  if (!budget.take(pad)) return;
  if (v.isTensor()) {
    std::cout << pad << name << ": " << describe(v.toTensor()) << "\n";
  } else if (v.isGenericDict()) {
    const auto dict = v.toGenericDict();
    int64_t tensors = 0;
    int64_t bytes = 0;
    for (const auto& item : dict) {
      if (item.value().isTensor()) {
        ++tensors;
        bytes += static_cast<int64_t>(item.value().toTensor().nbytes());
      }
    }
    std::cout << pad << name << ": dict of " << dict.size() << " entries";
    if (tensors > 0) std::cout << " (" << tensors << " tensors, " << human_bytes(static_cast<double>(bytes)) << ")";
    std::cout << "\n";
    const bool string_map = name == "config";
    size_t index = 0;
    for (const auto& item : dict) {
      if (!listed(index++, dict.size(), pad, budget)) continue;
      if (string_map && is_plain(item.value())) {
        if (!budget.take(pad)) return;
        std::cout << pad << "  " << key_text(item.key()) << " = " << key_text(item.value()) << "\n";
      } else {
        print_value(key_text(item.key()), item.value(), indent + 1, budget);
      }
    }
  } else if (v.isList() || v.isTuple()) {
    const auto items = v.isList() ? v.toListRef().vec() : v.toTupleRef().elements().vec();
    bool plain = items.size() <= kMaxInlineItems;
    for (const auto& item : items) plain = plain && is_plain(item);
    if (plain) {
      std::string text;
      for (size_t i = 0; i < items.size(); ++i) text += (i ? ", " : "") + key_text(items[i]);
      if (v.isTuple() && items.size() == 1) text += ",";
      std::cout << pad << name << ": " << (v.isList() ? "[" : "(") << text << (v.isList() ? "]" : ")") << "\n";
      return;
    }
    std::cout << pad << name << ": " << (v.isList() ? "list" : "tuple") << " of " << items.size() << " items\n";
    for (size_t i = 0; i < items.size(); ++i) {
      if (!listed(i, items.size(), pad, budget)) continue;
      if (!is_plain(items[i]) || i < kMaxInlineItems) {
        print_value("[" + std::to_string(i) + "]", items[i], indent + 1, budget);
      }
    }
  } else if (v.isString()) {
    std::cout << pad << name << ": '" << v.toStringRef() << "'\n";
  } else if (v.isDouble()) {
    std::cout << pad << name << ": " << double_text(v.toDouble()) << "\n";
  } else {
    std::cout << pad << name << ": " << v << "\n";
  }
}

/// The file's object; a sharded checkpoint's folder assembled into the whole checkpoint, a DCP
/// folder's tensors into a state dict (its non-tensor entries left out, with a note).
c10::IValue load_object(const std::string& path, const ckpt::LoadOptions& load) {
  if (ckpt::is_sharded_dcp_folder(path, load)) return ckpt::to_ivalue(ckpt::load_sharded_dcp(path, load));
  if (ckpt::is_dcp_folder(path)) return ckpt::state_dict_to_ivalue(ckpt::load_state_dict_file(path, load));
  if (ckpt::is_directory(path)) return ckpt::to_ivalue(ckpt::load_sharded_checkpoint(path, load));
  return ckpt::load(path, load);
}

int inspect(const std::string& file, const ckpt::LoadOptions& load) {
  const bool sharded_dcp = ckpt::is_sharded_dcp_folder(file, load);
  const bool dcp = ckpt::is_dcp_folder(file) && !sharded_dcp;
  const bool folder = ckpt::is_directory(file) && !dcp;
  const c10::IValue object = load_object(file, load);
  struct stat info {};
  ::stat(file.c_str(), &info);
  if (dcp) {
    std::cout << "folder: " << file << " (DCP checkpoint)\n";
  } else if (folder) {
    const int64_t world = object.toGenericDict().at(std::string("world_size")).toInt();
    int64_t bytes = 0;
    for (int64_t r = 0; r < world; ++r) {
      struct stat shard {};
      const std::string name = sharded_dcp ? ckpt::dcp_shard_file_name(r) : ckpt::shard_file_name(r);
      if (::stat((file + "/" + name).c_str(), &shard) == 0) bytes += shard.st_size;
    }
    std::cout << "folder: " << file << " (" << world << " rank files, "
              << human_bytes(static_cast<double>(bytes)) << ")\n";
  } else {
    std::cout << "file: " << file << " (" << human_bytes(static_cast<double>(info.st_size)) << ")\n";
  }
  LineBudget budget;
  if (object.isGenericDict()) {
    const auto dict = object.toGenericDict();
    const bool checkpoint = dict.contains(std::string("model")) || dict.contains(std::string("model_state_dict")) ||
                            dict.contains(std::string("state_dict"));
    std::cout << "content: "
              << (dcp                             ? "state dict, assembled from its chunks"
                  : folder                        ? "sharded training checkpoint, assembled whole"
                  : ckpt::is_shard_object(object) ? "one rank's file of a sharded checkpoint"
                  : checkpoint                    ? "training checkpoint"
                                                  : "dict")
              << "\n";
    // Metadata first, then the (possibly long) tensor dicts.
    for (const auto& item : dict) {
      if (!item.value().isGenericDict() && !item.value().isTensor()) {
        print_value(key_text(item.key()), item.value(), 0, budget);
      }
    }
    for (const auto& item : dict) {
      if (item.value().isGenericDict() || item.value().isTensor()) {
        print_value(key_text(item.key()), item.value(), 0, budget);
      }
    }
  } else {
    print_value("object", object, 0, budget);
  }
  return 0;
}

struct ConvertOptions {
  std::string input;
  std::string output;
  std::string strip_prefix;
  std::string add_prefix;
  bool model_only = false;
  std::string format = "torch";  ///< torch (a torch.save file) or dcp (a DCP folder)
  ckpt::LoadOptions load;
};

int convert(const ConvertOptions& o) {
  if (o.format == "dcp" && ckpt::is_directory(o.input) && !ckpt::is_dcp_folder(o.input)) {
    // A sharded checkpoint of the older layout: rewritten whole, optimizer state and all.
    ckpt::convert_sharded_to_dcp(o.input, o.output, o.load);
    std::cout << "wrote " << o.output << " (DCP): the sharded checkpoint " << o.input << "\n";
    return 0;
  }
  const c10::IValue object = load_object(o.input, o.load);
  // One rank's file holds a piece of the model: converting it alone would write a partial one.
  SHOAL_CHECK_T(CheckpointError, !ckpt::is_shard_object(object), o.input,
                ": is one rank's file of a sharded checkpoint; pass its folder (",
                ckpt::is_directory(o.input) ? o.input : std::filesystem::path(o.input).parent_path().string(),
                ") to convert the whole checkpoint");
  auto model = ckpt::state_dict_from_ivalue(object, o.input);
  if (!o.strip_prefix.empty()) model = ckpt::strip_prefix(model, o.strip_prefix);
  if (!o.add_prefix.empty()) model = ckpt::add_prefix(model, o.add_prefix);

  if (o.format == "dcp") {
    ckpt::save_dcp(model, o.output);
    std::cout << "wrote " << o.output << " (DCP): " << model.size() << " tensors\n";
    return 0;
  }
  c10::IValue result = ckpt::state_dict_to_ivalue(model);
  if (!o.model_only && object.isGenericDict()) {
    auto dict = object.toGenericDict();
    for (const char* key : {"model", "model_state_dict", "state_dict"}) {
      if (dict.contains(std::string(key))) {
        dict.insert_or_assign(std::string(key), result);
        result = dict;
        break;
      }
    }
  }
  ckpt::save(result, o.output);
  std::cout << "wrote " << o.output << ": " << model.size() << " tensors"
            << (result.isGenericDict() && result.toGenericDict().size() != model.size() ? " and metadata" : "")
            << "\n";
  return 0;
}

}  // namespace

void add_ckpt_command(CLI::App& root, std::vector<Command>& commands) {
  auto* app = root.add_subcommand("ckpt", "Inspect and convert checkpoints (torch.save files)");
  app->require_subcommand(1);

  // What a hostile file cannot make either command do unless asked (see LoadOptions).
  auto add_load_options = [](CLI::App* command, ckpt::LoadOptions& load) {
    command->add_option("--max-values", load.max_values,
                        "refuse files holding more values than this, shared containers counted at "
                        "each reference (default 4194304)");
    command->add_option("--max-container-bytes", load.max_container_bytes,
                        "refuse files whose dicts, lists and tuples would take more memory than "
                        "this, by Shoal's estimate (default 268435456, 256 MiB)");
    command->add_flag("--allow-expanded-views", load.allow_expanded_views,
                      "accept tensors whose view has more elements than their storage (stride 0); "
                      "convert writes them out in full");
  };
  auto file = std::make_shared<std::string>();
  auto inspect_load = std::make_shared<ckpt::LoadOptions>();
  auto* inspect_app = app->add_subcommand(
      "inspect", "Print a checkpoint's keys, shapes, dtypes, sizes and metadata (epoch, step, config)");
  inspect_app->add_option("FILE", *file,
                          "a file written by Shoal or by torch.save, a sharded checkpoint's folder, or "
                          "a DCP folder (torch.distributed.checkpoint)")
      ->required();
  add_load_options(inspect_app, *inspect_load);
  commands.push_back({inspect_app, [file, inspect_load] { return inspect(*file, *inspect_load); }});

  auto options = std::make_shared<ConvertOptions>();
  auto* convert_app = app->add_subcommand(
      "convert", "Rewrite a checkpoint, e.g. extract the model's state dict for Python's load_state_dict");
  convert_app->add_option("IN", options->input,
                          "the checkpoint to read (a file, a sharded checkpoint's folder, or a DCP folder: "
                          "its tensors, assembled whole)")
      ->required();
  convert_app->add_option("OUT", options->output,
                          "the file to write (torch.save format), or with --format dcp a new folder")
      ->required();
  convert_app->add_option("--strip-prefix", options->strip_prefix,
                          "remove this prefix from the model's keys (e.g. 'module.')");
  convert_app->add_option("--add-prefix", options->add_prefix,
                          "put this prefix in front of every model key (e.g. 'module.' for a DDP model)");
  convert_app->add_flag("--model-only", options->model_only,
                        "write only the model's state dict (what model.load_state_dict takes)");
  convert_app->add_option("--format", options->format,
                          "torch: a torch.save file; dcp: a folder of PyTorch's distributed "
                          "checkpoint of the model's state dict, which "
                          "torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=OUT) "
                          "reads (implies --model-only); a sharded checkpoint's folder of Shoal's older "
                          "layout (rank_N.pt files) becomes one of the DCP layout --checkpoint-format "
                          "sharded now writes, optimizer state and all, which --resume reads")
      ->check(CLI::IsMember({"torch", "dcp"}))
      ->capture_default_str();
  add_load_options(convert_app, options->load);
  commands.push_back({convert_app, [options] { return convert(*options); }});
}

}  // namespace shoal::cli
