// `shoal train`: the built-in trainer on the real Fashion-MNIST data, in one process or
// data-parallel (--strategy ddp), with checkpoints and resume.
//
// With --strategy ddp outside a launcher (no RANK / OMPI_COMM_WORLD_RANK / PMI_RANK in the
// environment), `shoal train` starts itself --nproc-per-node times through the launcher, with the
// same arguments, and returns the job's exit status; under `shoal run`, torchrun or mpirun it runs
// as the rank the environment names.
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "commands.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"
#include "shoal/models/registry.h"
#include "shoal/train/data_parallel_strategy.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/model_parallel_ddp_strategy.h"
#include "shoal/train/trainer.h"

namespace shoal::cli {
namespace {

struct TrainArgs {
  std::string strategy = "single";
  int nproc_per_node = 2;
  std::string backend = "auto";
  bool no_progress = false;
  int replicas = 2;        // --strategy dp
  int model_parallel = 1;  // --strategy ddp: parts each rank's model is split into
};

/// True when a launcher (shoal run, torchrun, mpirun, SLURM's srun) started this process as a rank.
bool started_as_rank() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

/// This process's own command line, read back from /proc (argv is not kept by CLI11).
std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  SHOAL_CHECK(in.good(), "shoal train: cannot read /proc/self/cmdline to re-launch itself");
  std::vector<std::string> words;
  std::string word;
  while (std::getline(in, word, '\0')) words.push_back(word);
  SHOAL_CHECK(!words.empty(), "shoal train: /proc/self/cmdline is empty");
  char exe[PATH_MAX];
  const ssize_t length = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  SHOAL_CHECK(length > 0, "shoal train: cannot resolve /proc/self/exe to re-launch itself");
  words[0] = std::string(exe, static_cast<size_t>(length));
  return words;
}

}  // namespace

void add_train_command(CLI::App& root, std::vector<Command>& commands) {
  auto options = std::make_shared<train::TrainOptions>();
  auto args = std::make_shared<TrainArgs>();
  auto* app = root.add_subcommand(
      "train",
      "Train a built-in model on Fashion-MNIST (SGD with momentum, cross-entropy), evaluating on\n"
      "the test set after every epoch, in one process or data-parallel over N processes\n"
      "(--strategy ddp). The defaults reach >= 0.85 test accuracy in one epoch.");
  app->footer(
      "SGD with momentum and cross-entropy; the test set is evaluated after every epoch.\n"
      "The last stdout line is 'final test accuracy: A'. Progress goes to stderr: a live bar on\n"
      "a terminal, plain lines otherwise. Under --strategy ddp, --batch-size is per rank\n"
      "(the global batch is N x batch size, as in PyTorch DDP).");
  // A repeated option takes its last value, so that `make run RUN_ARGS="--epochs 2"` overrides.
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  std::string models;
  for (const auto& name : models::list_models()) models += (models.empty() ? "" : ", ") + name;
  app->add_option("--model", options->model, "Model to train: " + models)->capture_default_str();
  app->add_option("--epochs", options->epochs, "Passes over the 60000 training images")
      ->capture_default_str();
  app->add_option("--batch-size", options->batch_size,
                  "Images per SGD step on each process: with --strategy ddp the global batch is\n"
                  "nproc x batch size, as in PyTorch's DDP")
      ->capture_default_str();
  app->add_option("--lr", options->lr, "SGD learning rate")->capture_default_str();
  app->add_option("--momentum", options->momentum, "SGD momentum, in [0, 1)")
      ->capture_default_str();
  app->add_option("--seed", options->seed,
                  "Seeds the initial weights and the shuffle: the same seed gives the same run")
      ->capture_default_str();
  auto* threads = app->add_option(
      "--threads", options->threads,
      "LibTorch intra-op threads per process (0 = LibTorch's default); default 2, or 1 per rank\n"
      "with --strategy ddp");
  app->add_option("--strategy", args->strategy,
                  "single: one process; ddp: DistributedDataParallel over --nproc-per-node\n"
                  "processes on this host (or the ranks of shoal run / torchrun / mpirun);\n"
                  "dp: DataParallel over --replicas threads in one process")
      ->check(CLI::IsMember({"single", "ddp", "dp"}))
      ->capture_default_str();
  app->add_option("--nproc-per-node,--nproc_per_node", args->nproc_per_node,
                  "With --strategy ddp started directly: processes to launch on this host")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--replicas", args->replicas,
                  "With --strategy dp: replicas (CPU slots, one thread each; GPUs with CUDA)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--model-parallel", args->model_parallel,
                  "With --strategy ddp: split each rank's model into K parts (micro-batched,\n"
                  "one thread per part)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app->add_option("--backend", args->backend,
                  "Process-group backend for ddp: auto (shm on one host), shm, gloo, mpi")
      ->check(CLI::IsMember({"auto", "shm", "gloo", "mpi", "hierarchical"}))
      ->capture_default_str();
  app->add_option("--checkpoint-dir", options->checkpoint_dir,
                  "Save a checkpoint (torch.save format) here after every epoch; rank 0 writes")
      ->type_name("DIR");
  app->add_option("--checkpoint-every", options->checkpoint_every,
                  "Also save every N SGD steps (0 = only after epochs)")
      ->capture_default_str();
  app->add_option("--checkpoint-keep", options->checkpoint_keep,
                  "Checkpoints kept in DIR (0 = all)")
      ->capture_default_str();
  app->add_flag("--resume", options->resume,
                "Continue from the newest checkpoint in --checkpoint-dir: its weights, optimizer,\n"
                "epoch, step and position in the epoch. The number of processes may differ: the\n"
                "epoch continues after the samples the whole job had consumed (each rank skips\n"
                "its share of them; shards are re-dealt for the new world size)");
  app->add_option("--data-dir", options->data_dir,
                  "Directory with the Fashion-MNIST *-ubyte.gz files (Debian: dataset-fashion-mnist)")
      ->capture_default_str();
  app->add_option("--metrics", options->metrics_path,
                  "Write metrics as JSON lines to FILE: one object per log interval and per epoch")
      ->type_name("FILE");
  app->add_option("--log-interval", options->log_interval,
                  "SGD steps between progress lines and step metrics (0 = none)")
      ->capture_default_str();
  app->add_flag("--no-progress", args->no_progress,
                "No progress bar or lines on stderr; only epoch summaries and the result");
  // Hidden options for quick runs and tests (an empty group hides them from --help).
  app->add_option("--train-samples", options->train_limit, "Use the first K training images")
      ->group("");
  app->add_option("--test-samples", options->test_limit, "Use the first K test images")
      ->group("");
  app->add_option("--stop-after-steps", options->stop_after_steps,
                  "Stop after N SGD steps in all, as if interrupted")
      ->group("");
  app->add_option("--dump-parameters", options->dump_parameters,
                  "Every rank saves its final weights to PREFIX.rank<R>.pt")
      ->group("");
  app->footer(
      "Examples:\n"
      "  shoal train --model cnn --epochs 2\n"
      "  shoal train --strategy ddp --nproc-per-node 2 --model cnn --checkpoint-dir ckpt\n"
      "  shoal train --strategy ddp --nproc-per-node 2 --checkpoint-dir ckpt --resume\n"
      "  shoal run --nproc-per-node 2 shoal train --strategy ddp");

  commands.push_back({app, [options, args, threads] {
                        if (args->no_progress) options->progress = train::ProgressMode::kNone;
                        options->validate();
                        std::unique_ptr<train::Strategy> strategy;
                        if (args->strategy == "ddp") {
                          if (!started_as_rank()) {
                            // Refuse a hopeless resume once, here, rather than once per rank.
                            if (options->resume) train::load_resume_checkpoint(*options);
                            auto launch = launcher::LaunchOptions::workers(args->nproc_per_node,
                                                                           own_command_line());
                            launch.master_port = 0;  // a free port: jobs may run side by side
                            launch.log_name = "shoal train";
                            launch.verbose = false;
                            return launcher::launch(launch);
                          }
                          // One intra-op thread per rank: N ranks share the host's cores.
                          if (threads->count() == 0) options->threads = 1;
                          comm::InitOptions init;
                          init.backend = args->backend;
                          if (args->model_parallel > 1) {
                            strategy = std::make_unique<train::ModelParallelDdpStrategy>(
                                args->model_parallel, init);
                          } else {
                            strategy = std::make_unique<train::DdpStrategy>(init);
                          }
                        } else if (args->strategy == "dp") {
                          // One intra-op thread per replica slot (DataParallelOptions' default).
                          strategy = std::make_unique<train::DataParallelStrategy>(args->replicas,
                                                                                  options->model);
                        }
                        const bool reports = !strategy || strategy->rank() == 0;
                        const train::TrainResult result =
                            train::run_training(*options, std::move(strategy));
                        if (reports) {
                          if (result.stopped) {
                            std::printf("stopped after step %lld\n",
                                        static_cast<long long>(options->stop_after_steps));
                          } else {
                            std::printf("final test accuracy: %.4f\n",
                                        result.final_test_accuracy());
                          }
                          std::fflush(stdout);
                        }
                        return 0;
                      }});
}

}  // namespace shoal::cli
