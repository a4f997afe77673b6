#include "shoal/train/train_option_table.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>

#include "compat/autocast.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/train/trainer.h"
#include "train/number_text.h"

namespace shoal::train {
namespace {

// Larger learning rates only ever diverge; the bound catches "1e400"-style typos early.
constexpr double kMaxLearningRate = 1e4;

using Check = std::function<void(const TrainOptions&)>;

/// A row under construction: the table below reads as one call chain per option.
struct Row {
  TrainOption option;

  Row(const char* concern, const char* flag) {
    option.concern = concern;
    option.flag = flag;
  }
  /// Saved under `key` from `member`, read back as its type.
  template <typename T>
  Row& saved(const char* key, T TrainOptions::*member) {
    static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, double> ||
                  std::is_same_v<T, std::string>);
    option.key = key;
    option.type = std::is_same_v<T, int64_t>  ? SavedType::kInteger
                  : std::is_same_v<T, double> ? SavedType::kNumber
                                              : SavedType::kText;
    option.get = [member](const TrainOptions& o) { return c10::IValue(o.*member); };
    option.set = [member](TrainOptions& o, const c10::IValue& value, const std::string&) {
      if constexpr (std::is_same_v<T, int64_t>) o.*member = value.toInt();
      if constexpr (std::is_same_v<T, double>) o.*member = value.toDouble();
      if constexpr (std::is_same_v<T, std::string>) o.*member = value.toStringRef();
    };
    return *this;
  }
  /// Saved under `key` as the name of a closed choice (`name` writes it, `parse` reads it back),
  /// offered to the CLI as `names`; a saved name this build does not know is a CheckpointError.
  template <typename Enum>
  Row& saved_choice(const char* key, Enum TrainOptions::*member, const char* (*name)(Enum),
                    Enum (*parse)(const std::string&), std::vector<std::string> names) {
    option.key = key;
    option.type = SavedType::kText;
    option.get = [member, name](const TrainOptions& o) {
      return c10::IValue(std::string(name(o.*member)));
    };
    const std::string flag = option.flag;
    option.set = [member, parse, names, key, flag](TrainOptions& o, const c10::IValue& value,
                                                   const std::string& who) {
      const std::string& saved = value.toStringRef();
      SHOAL_CHECK_T(CheckpointError, std::find(names.begin(), names.end(), saved) != names.end(),
                    who, " has ", key, " '", saved, "', which this build does not know; pass ",
                    flag);
      o.*member = parse(saved);
    };
    option.choices = std::move(names);
    return *this;
  }
  /// Saved under `key` through accessors of its own (a field that is not a plain number or text).
  Row& saved(const char* key, SavedType type, decltype(TrainOption::get) get,
             decltype(TrainOption::set) set = nullptr) {
    option.key = key;
    option.type = type;
    option.get = std::move(get);
    option.set = std::move(set);
    return *this;
  }
  Row& resume(OnResume on_resume) {
    option.on_resume = on_resume;
    return *this;
  }
  Row& check(Check check) {
    option.check = std::move(check);
    return *this;
  }
  Row& when(std::function<bool(const TrainOptions&)> saved_when) {
    option.saved_when = std::move(saved_when);
    return *this;
  }
  Row& absent(const char* value) {
    option.absent = value;
    return *this;
  }
  /// Reads a saved value its own way (a check of what this build knows, or a parse).
  Row& reads(decltype(TrainOption::set) set) {
    option.set = std::move(set);
    return *this;
  }
  Row& mismatch(const char* why) {
    option.mismatch = why;
    return *this;
  }
  Row& choices(std::vector<std::string> names) {
    option.choices = std::move(names);
    return *this;
  }
  Row& hidden() {
    option.hidden = true;
    return *this;
  }
};

bool is_gpt(const TrainOptions& o) { return o.model == "gpt"; }

std::string join_milestones(const std::vector<int64_t>& milestones) {
  std::string text;
  for (int64_t m : milestones) text += (text.empty() ? "" : ",") + std::to_string(m);
  return text;
}

void set_milestones(TrainOptions& o, const c10::IValue& value, const std::string& who) {
  const std::string& saved = value.toStringRef();
  o.milestones.clear();
  std::istringstream text(saved);
  for (std::string item; std::getline(text, item, ',');) {
    char* end = nullptr;
    const long long step = std::strtoll(item.c_str(), &end, 10);
    SHOAL_CHECK_T(CheckpointError, !item.empty() && end != nullptr && *end == '\0', who,
                  " has milestones '", saved, "', not optimizer steps A,B,...");
    o.milestones.push_back(step);
  }
}

void check_milestones(const TrainOptions& o) {
  SHOAL_CHECK_T(InvalidArgument, o.lr_schedule != LrSchedule::kMultiStep || !o.milestones.empty(),
                "--lr-schedule multistep needs --milestones A,B,... (optimizer steps)");
  for (size_t i = 0; i < o.milestones.size(); ++i) {
    SHOAL_CHECK_T(InvalidArgument,
                  o.milestones[i] >= 1 && (i == 0 || o.milestones[i] > o.milestones[i - 1]),
                  "milestones must be increasing optimizer steps >= 1, got ", o.milestones[i],
                  " at position ", i + 1);
  }
}

void check_precision(const TrainOptions& o) {
  SHOAL_CHECK_T(InvalidArgument,
                o.precision != Precision::kFp16 || o.device != "cpu" ||
                    compat::cpu_autocast_supports(at::kHalf),
                "--precision fp16 needs --device cuda, or LibTorch >= 2.4 on the CPU (this is "
                "LibTorch ", TORCH_VERSION, ", whose CPU autocast has no float16): use --precision "
                "bf16 on the CPU");
}

/// A saved count a resume takes as it is only within [1, 1e9].
decltype(TrainOption::set) set_count(int64_t TrainOptions::*member, const char* key) {
  return [member, key](TrainOptions& o, const c10::IValue& value, const std::string& who) {
    const int64_t count = value.toInt();
    SHOAL_CHECK_T(CheckpointError, count >= 1 && count <= 1e9, who, " has ", key, " ", count);
    o.*member = count;
  };
}

// ---- What is trained -----------------------------------------------------------------------------

void add_model_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("model", "--model").saved("model", &TrainOptions::model)
                     .resume(OnResume::kMustEqual)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, !o.model.empty(),
                                     "no model given; pass a model name such as cnn");
                       if (is_gpt(o)) o.gpt.validate();
                     }).option);
  rows.push_back(Row("model", "--loss")
                     .saved_choice("loss", &TrainOptions::loss, loss_name, parse_loss, loss_names())
                     .resume(OnResume::kInherit)
                     .option);
  // The GPT's sizes: what `shoal generate` rebuilds it from and a resume continues with
  // (GptConfig::validate checks them, saved or given).
  const auto gpt = [&rows](const char* flag, const char* key, auto member) {
    using T = std::decay_t<decltype(std::declval<models::GptConfig&>().*member)>;
    const SavedType type = std::is_same_v<T, double> ? SavedType::kNumber : SavedType::kInteger;
    rows.push_back(
        Row("model", flag)
            .saved(key, type, [member](const TrainOptions& o) { return c10::IValue(o.gpt.*member); },
                   [member](TrainOptions& o, const c10::IValue& value, const std::string&) {
                     if constexpr (std::is_same_v<T, double>) {
                       o.gpt.*member = value.toDouble();
                     } else {
                       o.gpt.*member = value.toInt();
                     }
                   })
            .resume(OnResume::kInherit)
            .when(is_gpt)
            .option);
  };
  gpt("--n-layer", "gpt.n_layer", &models::GptConfig::n_layer);
  gpt("--n-head", "gpt.n_head", &models::GptConfig::n_head);
  gpt("--n-embd", "gpt.n_embd", &models::GptConfig::n_embd);
  gpt("--block-size", "gpt.block_size", &models::GptConfig::block_size);
  gpt("--vocab-size", "gpt.vocab_size", &models::GptConfig::vocab_size);
  gpt("--dropout", "gpt.dropout", &models::GptConfig::dropout);
  rows.push_back(Row("model", "--init-from").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.init_from.empty() || !o.resume,
                  "--init-from and --resume both set the weights; pass one of them");
  }).option);
}

// ---- The data ------------------------------------------------------------------------------------

void add_data_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("data", "--data-dir").option);
  rows.push_back(Row("data", "--data").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, !is_token_file(o.data_path) || is_gpt(o), "--data ",
                  o.data_path, " is a token file (.bin): it trains --model gpt, not --model ", o.model);
  }).option);
  rows.push_back(Row("data", "--val-data").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.val_data_path.empty() || is_token_file(o.data_path),
                  "--val-data ", o.val_data_path, " needs --data TRAIN.bin, a token file to train on");
    SHOAL_CHECK_T(InvalidArgument, o.val_data_path.empty() || is_token_file(o.val_data_path),
                  "--val-data ", o.val_data_path, " must be a token file (.bin), as --data");
  }).option);
  rows.push_back(Row("data", "--token-dtype")
                     .saved_choice("token_dtype", &TrainOptions::token_dtype, data::token_dtype_name,
                                   data::parse_token_dtype, {"uint16", "uint32"})
                     .resume(OnResume::kInherit)
                     .when([](const TrainOptions& o) { return is_gpt(o) && is_token_file(o.data_path); })
                     .option);
  rows.push_back(Row("data", "--train-samples").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.train_limit >= 0, "train limit must be >= 0 (0 = all), got ",
                  o.train_limit);
  }).option);
  rows.push_back(Row("data", "--test-samples").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.test_limit >= 0, "test limit must be >= 0 (0 = all), got ",
                  o.test_limit);
  }).option);
  rows.push_back(Row("data", "--max-decompression-ratio").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.max_decompression_ratio >= 0,
                  "--max-decompression-ratio must be >= 0 (0 = no check), got ",
                  o.max_decompression_ratio);
  }).option);
  rows.push_back(Row("data", "--num-workers").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.num_workers >= 0 && o.num_workers <= 256,
                  "num_workers must be in [0, 256], got ", o.num_workers);
  }).option);
  rows.push_back(Row("data", "--prefetch-factor").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.prefetch_factor >= 1 && o.prefetch_factor <= 1024,
                  "prefetch_factor must be in [1, 1024], got ", o.prefetch_factor);
  }).option);
}

// ---- How long and in what batches ----------------------------------------------------------------

void add_run_length_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("length", "--batch-size")
                     .saved("batch_size", SavedType::kInteger,
                            [](const TrainOptions& o) { return c10::IValue(o.batch_size); },
                            set_count(&TrainOptions::batch_size, "batch_size"))
                     .resume(OnResume::kInheritNoted)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.batch_size >= 1,
                                     "batch size must be at least 1, got ", o.batch_size);
                     }).option);
  rows.push_back(Row("length", "--epochs")
                     .saved("epochs", SavedType::kInteger,
                            [](const TrainOptions& o) { return c10::IValue(o.epochs); },
                            set_count(&TrainOptions::epochs, "epochs"))
                     .resume(OnResume::kInheritNoted)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.epochs >= 1, "epochs must be at least 1, got ",
                                     o.epochs);
                     }).option);
  rows.push_back(Row("length", "--accumulate").saved("accumulate", &TrainOptions::accumulate)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.accumulate >= 1 && o.accumulate <= 65536,
                                     "accumulate must be in [1, 65536] micro-batches per step, got ",
                                     o.accumulate);
                     }).option);
  rows.push_back(Row("length", "--eval-batch-size").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.eval_batch_size >= 0,
                  "evaluation batch size must be >= 0 (0 = the training batch size), got ",
                  o.eval_batch_size);
  }).option);
  // The seed fixes the order of the samples: another one cannot continue the same epochs.
  rows.push_back(Row("length", "--seed")
                     .saved("seed", SavedType::kInteger,
                            [](const TrainOptions& o) { return c10::IValue(static_cast<int64_t>(o.seed)); },
                            [](TrainOptions& o, const c10::IValue& value, const std::string&) {
                              o.seed = static_cast<uint64_t>(value.toInt());
                            })
                     .resume(OnResume::kInheritFixed)
                     .mismatch("would change the order of the samples it continues; drop --seed or "
                               "start without --resume").option);
}

// ---- The optimizer and its learning-rate schedule ------------------------------------------------

void add_optimizer_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("optimizer", "--optimizer")
                     .saved_choice("optimizer", &TrainOptions::optimizer, optimizer_name,
                                   parse_optimizer, optimizer_names())
                     .resume(OnResume::kInherit)
                     .absent("sgd")  // a checkpoint without the key was written by SGD
                     .option);
  rows.push_back(Row("optimizer", "--lr").saved("lr", &TrainOptions::lr)
                     .resume(OnResume::kInheritNoted)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, std::isfinite(o.lr) && o.lr > 0 && o.lr <= kMaxLearningRate,
                                     "learning rate must be a finite number in (0, ", kMaxLearningRate,
                                     "], got ", o.lr);
                     }).option);
  rows.push_back(Row("optimizer", "--momentum").saved("momentum", &TrainOptions::momentum)
                     .resume(OnResume::kInheritNoted)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.momentum >= 0 && o.momentum < 1,
                                     "momentum must be in [0, 1), got ", o.momentum);
                     }).option);
  rows.push_back(Row("optimizer", "--betas").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
                  "betas must be two numbers in [0, 1), got ", o.beta1, ",", o.beta2);
  }).option);
  rows.push_back(Row("optimizer", "--eps").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, std::isfinite(o.eps) && o.eps > 0, "eps must be > 0, got ", o.eps);
  }).option);
  rows.push_back(Row("optimizer", "--weight-decay").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument,
                  !o.weight_decay || (std::isfinite(*o.weight_decay) && *o.weight_decay >= 0),
                  "weight decay must be a finite number >= 0, got ", o.weight_decay.value_or(0));
  }).option);
  rows.push_back(Row("optimizer", "--clip-grad-norm").saved("clip_grad_norm", &TrainOptions::clip_grad_norm)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, std::isfinite(o.clip_grad_norm) && o.clip_grad_norm >= 0,
                                     "the gradient clipping norm must be a finite number >= 0 (0 = none), got ",
                                     o.clip_grad_norm);
                     }).option);
}

void add_schedule_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("schedule", "--lr-schedule")
                     .saved_choice("lr_schedule", &TrainOptions::lr_schedule, lr_schedule_name,
                                   parse_lr_schedule, lr_schedule_names())
                     .resume(OnResume::kInheritNoted)
                     .absent("constant")
                     .option);
  rows.push_back(Row("schedule", "--warmup-steps").saved("warmup_steps", &TrainOptions::warmup_steps)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.warmup_steps >= 0,
                                     "warm-up steps must be >= 0, got ", o.warmup_steps);
                     }).option);
  rows.push_back(Row("schedule", "--warmup-start-factor")
                     .saved("warmup_start_factor", &TrainOptions::warmup_start_factor)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.warmup_start_factor > 0 && o.warmup_start_factor <= 1,
                                     "warm-up start factor must be in (0, 1] (LinearLR's start_factor), got ",
                                     o.warmup_start_factor);
                     }).option);
  rows.push_back(Row("schedule", "--step-size").saved("step_size", &TrainOptions::step_size)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument,
                                     o.lr_schedule != LrSchedule::kStep || o.step_size >= 1,
                                     "--lr-schedule step needs --step-size N (N >= 1 optimizer steps), got ",
                                     o.step_size);
                     }).option);
  rows.push_back(Row("schedule", "--gamma").saved("gamma", &TrainOptions::gamma)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.gamma > 0 && o.gamma <= 1,
                                     "gamma must be in (0, 1], got ", o.gamma);
                     }).option);
  rows.push_back(Row("schedule", "--milestones")
                     .saved("milestones", SavedType::kText,
                            [](const TrainOptions& o) { return c10::IValue(join_milestones(o.milestones)); },
                            set_milestones)
                     .resume(OnResume::kInherit)
                     .check(check_milestones).option);
  rows.push_back(Row("schedule", "--t-max").saved("t_max", &TrainOptions::t_max)
                     .resume(OnResume::kInherit)
                     .check([](const TrainOptions& o) {
                       SHOAL_CHECK_T(InvalidArgument, o.t_max >= 0,
                                     "T_max must be >= 0 (0 = the rest of the run), got ", o.t_max);
                     }).option);
}

// ---- Where and in what precision the step runs ---------------------------------------------------

void add_compute_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("compute", "--device").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, is_device_name(o.device),
                  "--device must be cpu, cuda or cuda:N, got '", o.device, "'");
  }).option);
  rows.push_back(Row("compute", "--precision")
                     .saved_choice("precision", &TrainOptions::precision, precision_name,
                                   parse_precision, precision_names())
                     .resume(OnResume::kInherit)
                     .check(check_precision).option);
  rows.push_back(Row("compute", "--threads").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.threads >= 0,
                  "threads must be >= 0 (0 = LibTorch's default), got ", o.threads);
  }).option);
}

// ---- Checkpoints ---------------------------------------------------------------------------------

void add_checkpoint_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("checkpoint", "--checkpoint-dir").option);
  rows.push_back(Row("checkpoint", "--checkpoint-format").choices(checkpoint_format_names()).option);
  rows.push_back(Row("checkpoint", "--checkpoint-every").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.checkpoint_every >= 0,
                  "checkpoint interval must be >= 0 (0 = only after epochs), got ", o.checkpoint_every);
    SHOAL_CHECK_T(InvalidArgument, o.checkpoint_every == 0 || !o.checkpoint_dir.empty(),
                  "--checkpoint-every needs --checkpoint-dir DIR: where to save");
  }).option);
  rows.push_back(Row("checkpoint", "--checkpoint-keep").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.checkpoint_keep >= 0,
                  "checkpoints to keep must be >= 0 (0 = all), got ", o.checkpoint_keep);
  }).option);
  rows.push_back(Row("checkpoint", "--resume").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, !o.resume || !o.checkpoint_dir.empty(),
                  "--resume needs --checkpoint-dir DIR: the folder to resume from");
  }).option);
}

// ---- What the run reports ------------------------------------------------------------------------

void add_report_rows(std::vector<TrainOption>& rows) {
  rows.push_back(Row("report", "--metrics").option);
  rows.push_back(Row("report", "--trace").option);
  rows.push_back(Row("report", "--tensorboard").option);
  rows.push_back(Row("report", "--tensorboard-all-ranks").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, !o.tensorboard_all_ranks || !o.tensorboard_dir.empty(),
                  "--tensorboard-all-ranks needs --tensorboard DIR: where to write");
  }).option);
  rows.push_back(Row("report", "--histogram-interval").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.histogram_interval >= 0,
                  "histogram interval must be >= 0 (0 = no histograms), got ", o.histogram_interval);
  }).option);
  rows.push_back(Row("report", "--log-interval").check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.log_interval >= 0,
                  "log interval must be >= 0 (0 = no step logs), got ", o.log_interval);
  }).option);
  rows.push_back(Row("report", "--no-progress").option);
  // For tests.
  rows.push_back(Row("report", "--stop-after-steps").hidden().check([](const TrainOptions& o) {
    SHOAL_CHECK_T(InvalidArgument, o.stop_after_steps >= 0, "stop-after-steps must be >= 0, got ",
                  o.stop_after_steps);
  }).option);
  rows.push_back(Row("report", "--dump-parameters").hidden().option);
}

std::vector<TrainOption> make_table() {
  std::vector<TrainOption> rows;
  add_model_rows(rows);
  add_data_rows(rows);
  add_optimizer_rows(rows);
  add_schedule_rows(rows);
  add_run_length_rows(rows);
  add_compute_rows(rows);
  add_checkpoint_rows(rows);
  add_report_rows(rows);
  return rows;
}

/// The row's saved value read as its type; its `absent` value for a checkpoint without the key;
/// nullopt when neither.
std::optional<c10::IValue> saved_value(const TrainOption& row, const checkpoint::TrainingState& saved,
                                       const std::string& who) {
  if (saved.config.count(row.key) == 0) {
    if (row.absent == nullptr) return std::nullopt;
    return c10::IValue(std::string(row.absent));
  }
  switch (row.type) {
    case SavedType::kInteger:
      return c10::IValue(*checkpoint::config_integer(saved, row.key, who));
    case SavedType::kNumber:
      return c10::IValue(*checkpoint::config_number(saved, row.key, who));
    case SavedType::kText:
      break;
  }
  return c10::IValue(checkpoint::config_text(saved, row.key));
}

std::string value_text(const c10::IValue& value) {
  if (value.isInt()) return std::to_string(value.toInt());
  if (value.isDouble()) return number_text(value.toDouble());
  return value.toStringRef();
}

}  // namespace

const std::vector<TrainOption>& train_option_table() {
  static const std::vector<TrainOption> table = make_table();
  return table;
}

void check_train_options(const TrainOptions& options, OptionRows rows) {
  // A test counts these lines.
  log::debug("shoal: checked the training options", rows == OptionRows::kAll ? "" : " a checkpoint holds");
  for (const TrainOption& row : train_option_table()) {
    if (row.check && (rows == OptionRows::kAll || row.key != nullptr)) row.check(options);
  }
}

const TrainOption* find_train_option(const std::string& flag) {
  for (const TrainOption& row : train_option_table()) {
    if (flag == row.flag) return &row;
  }
  return nullptr;
}

const std::vector<std::string>& train_option_choices(const std::string& flag) {
  const TrainOption* row = find_train_option(flag);
  SHOAL_CHECK_T(InvalidArgument, row != nullptr && !row->choices.empty(), flag,
                " is not a training option with choices");
  return row->choices;
}

std::map<std::string, c10::IValue> saved_train_config(const TrainOptions& options) {
  std::map<std::string, c10::IValue> config;
  for (const TrainOption& row : train_option_table()) {
    if (row.key != nullptr && (!row.saved_when || row.saved_when(options))) {
      config.emplace(row.key, row.get(options));
    }
  }
  return config;
}

void inherit_checkpoint_config(TrainOptions& options, const checkpoint::TrainingState& saved,
                               const std::set<std::string>& given, const std::string& where) {
  const std::string who = "--resume: " + where;
  for (const TrainOption& row : train_option_table()) {
    if (row.on_resume == OnResume::kKeep || row.on_resume == OnResume::kMustEqual) continue;
    const std::optional<c10::IValue> value = saved_value(row, saved, who);
    if (!value) continue;
    const bool is_given = given.count(row.key) > 0;
    if (row.on_resume == OnResume::kInheritFixed) {
      const c10::IValue now = row.get(options);
      SHOAL_CHECK_T(InvalidArgument, !is_given || value_text(now) == value_text(*value), who,
                    " was trained with ", row.flag, " ", value_text(*value), "; ", row.flag, " ",
                    value_text(now), " ", row.mismatch);
    } else if (is_given) {
      continue;
    }
    row.set(options, *value, who);
  }
}

std::string train_config_changes(const TrainOptions& options,
                                 const checkpoint::TrainingState& saved, const std::string& path) {
  std::string changes;
  for (const TrainOption& row : train_option_table()) {
    if (row.on_resume != OnResume::kInheritNoted) continue;
    const c10::IValue now = row.get(options);
    std::string change;
    if (row.type == SavedType::kText) {
      const std::string before = checkpoint::config_text(saved, row.key, row.absent ? row.absent : "");
      if (before != now.toStringRef()) change = before + " -> " + now.toStringRef();
    } else {
      const std::optional<double> before = checkpoint::config_number(saved, row.key, path);
      const double value = now.isInt() ? static_cast<double>(now.toInt()) : now.toDouble();
      if (before && *before != value) {
        change = checkpoint::config_text(saved, row.key) + " -> " + number_text(value);
      }
    }
    if (!change.empty()) changes += (changes.empty() ? "" : ", ") + std::string(row.key) + " " + change;
  }
  return changes;
}

}  // namespace shoal::train
