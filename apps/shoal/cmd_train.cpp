// `shoal train`: the built-in trainer on the real Fashion-MNIST data, in one process.
#include <cstdio>

#include "commands.h"
#include "shoal/models/registry.h"
#include "shoal/train/trainer.h"

namespace shoal::cli {

void add_train_command(CLI::App& root, std::vector<Command>& commands) {
  auto options = std::make_shared<train::TrainOptions>();
  auto no_progress = std::make_shared<bool>(false);
  auto* app = root.add_subcommand(
      "train",
      "Train a built-in model on Fashion-MNIST in one process (defaults: CNN, 1 epoch, >= 0.85)");
  app->footer(
      "SGD with momentum and cross-entropy; the test set is evaluated after every epoch.\n"
      "The last stdout line is 'final test accuracy: A'. Progress goes to stderr: a live bar on\n"
      "a terminal, plain lines otherwise.");

  std::string models;
  for (const auto& name : models::list_models()) models += (models.empty() ? "" : ", ") + name;
  app->add_option("--model", options->model, "Model to train: " + models)->capture_default_str();
  app->add_option("--epochs", options->epochs, "Passes over the 60000 training images")
      ->capture_default_str();
  app->add_option("--batch-size", options->batch_size, "Images per SGD step")
      ->capture_default_str();
  app->add_option("--lr", options->lr, "SGD learning rate")->capture_default_str();
  app->add_option("--momentum", options->momentum, "SGD momentum, in [0, 1)")
      ->capture_default_str();
  app->add_option("--seed", options->seed,
                  "Seeds the initial weights and the shuffle: the same seed gives the same run")
      ->capture_default_str();
  app->add_option("--threads", options->threads,
                  "LibTorch intra-op threads (0 = LibTorch's default)")
      ->capture_default_str();
  app->add_option("--data-dir", options->data_dir,
                  "Directory with the Fashion-MNIST *-ubyte.gz files (Debian: dataset-fashion-mnist)")
      ->capture_default_str();
  app->add_option("--metrics", options->metrics_path,
                  "Write metrics as JSON lines to FILE: one object per log interval and per epoch")
      ->type_name("FILE");
  app->add_option("--log-interval", options->log_interval,
                  "SGD steps between progress lines and step metrics (0 = none)")
      ->capture_default_str();
  app->add_flag("--no-progress", *no_progress,
                "No progress bar or lines on stderr; only epoch summaries and the result");

  commands.push_back({app, [options, no_progress] {
                        if (*no_progress) options->progress = train::ProgressMode::kNone;
                        const train::TrainResult result = train::run_training(*options);
                        std::printf("final test accuracy: %.4f\n", result.final_test_accuracy());
                        std::fflush(stdout);
                        return 0;
                      }});
}

}  // namespace shoal::cli
