// The one list of the trainer's options: for each, the `shoal train` flag that sets it, the key a
// checkpoint's config saves it under, the TrainOptions field it reads and writes, the check
// TrainOptions::validate() runs on it, and what a resume does with it. The CLI's list of options
// given on a resume, validate(), the config map Trainer::save_checkpoint writes,
// inherit_checkpoint_config and the resume's "changed from the checkpoint" notes all walk it, so
// a new option is one row here (and its flag in the CLI).
//
// Thread safety: the table is built on first use (a function-local static, so thread-safe) and
// only read after; the functions are pure.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shoal/train/train_options.h"

namespace shoal::checkpoint {
struct TrainingState;
}

namespace shoal::train {

/// What a resume does with an option.
enum class OnResume {
  kKeep,          ///< the run's own value, never the checkpoint's
  kInherit,       ///< the checkpoint's value unless the flag is given
  kInheritNoted,  ///< as kInherit; a given value that differs is named in the resume's log line
  kInheritFixed,  ///< the checkpoint's value; a given one must equal it (the seed)
  kMustEqual,     ///< the run's value must be the checkpoint's (load_resume_checkpoint: the model)
};

/// How a saved value reads back: checkpoint::config_integer, config_number or config_text.
enum class SavedType { kInteger, kNumber, kText };

/// One option of the trainer (see the file comment).
struct TrainOption {
  const char* concern = "";   ///< what it is about: "model", "optimizer", "schedule", ...
  const char* flag = "";      ///< `shoal train`'s flag ("--lr")
  const char* key = nullptr;  ///< the checkpoint config key; nullptr: not saved
  SavedType type = SavedType::kNumber;
  OnResume on_resume = OnResume::kKeep;
  bool hidden = false;  ///< a flag for tests, kept out of --help
  /// The names a text option takes (the CLI offers these); empty: any value its check allows.
  std::vector<std::string> choices;
  /// The value as a checkpoint saves it (set for saved options).
  std::function<c10::IValue(const TrainOptions&)> get;
  /// Sets the field from a saved value, as read by `type`; `who` names the checkpoint in errors
  /// (CheckpointError for a value this build cannot take). Set for saved options.
  std::function<void(TrainOptions&, const c10::IValue&, const std::string& who)> set;
  /// Throws InvalidArgument naming the flag when the value (with those it depends on) cannot
  /// work; null: any value does.
  std::function<void(const TrainOptions&)> check;
  /// Saved only when this holds; null: always.
  std::function<bool(const TrainOptions&)> saved_when;
  /// What a checkpoint without the key stands for (older ones were written before the option
  /// existed), as text; nullptr: a missing key leaves the option as it is.
  const char* absent = nullptr;
  /// kInheritFixed: why a different value cannot continue the run.
  const char* mismatch = nullptr;
};

/// Every option, grouped by concern.
const std::vector<TrainOption>& train_option_table();

/// Which rows' checks check_train_options runs.
enum class OptionRows {
  kAll,    ///< every row (TrainOptions::validate)
  kSaved,  ///< rows a checkpoint holds (key set)
};

/// Runs the checks of `rows` (InvalidArgument naming the flag). `shoal train --resume` checks
/// kAll before it reads the checkpoint (a given option's mistake is said before any file is
/// read) and kSaved again once it has inherited from it.
void check_train_options(const TrainOptions& options, OptionRows rows);

/// The row of `flag` ("--lr"), or nullptr.
const TrainOption* find_train_option(const std::string& flag);

/// The choices of `flag`'s row; InvalidArgument when it has no row or no choices.
const std::vector<std::string>& train_option_choices(const std::string& flag);

/// The config a checkpoint of a run with `options` saves: every saved option's key and value.
std::map<std::string, c10::IValue> saved_train_config(const TrainOptions& options);

/// The options the resume changed from the checkpoint (kInheritNoted: "lr 0.05 -> 0.1, ..."),
/// empty when none; `path` names the checkpoint in errors.
std::string train_config_changes(const TrainOptions& options,
                                 const checkpoint::TrainingState& saved, const std::string& path);

}  // namespace shoal::train
