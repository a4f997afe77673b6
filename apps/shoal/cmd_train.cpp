// `shoal train`: the built-in trainer on the real Fashion-MNIST data, in one process or
// data-parallel (--strategy ddp), with checkpoints and resume.
//
// With --strategy ddp outside a launcher (comm::detect_rank_info().launched is false: no torchrun,
// mpirun or PMI variables, and not a task of a multi-task srun step), `shoal train` starts itself
// --nproc-per-node times through the launcher, with the same arguments, and returns the job's exit
// status; under `shoal run`, torchrun, mpirun or srun it runs as the rank the environment names
// and never launches a job of its own.
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>
#include <set>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "commands.h"
#include "compat/thread_parallelism.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"
#include "shoal/comm/init.h"
#include "shoal/launcher/launch.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/ps/job.h"
#include "shoal/train/data_parallel_strategy.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/fsdp_strategy.h"
#include "shoal/train/model_parallel_ddp_strategy.h"
#include "shoal/train/pipeline_strategy.h"
#include "shoal/train/ps_strategy.h"
#include "shoal/train/train_option_table.h"
#include "shoal/train/strategy_spec.h"
#include "shoal/train/trainer.h"

namespace shoal::cli {
namespace {

/// What `shoal train`'s flags fill in, and the flags whose presence matters.
struct TrainCli {
  train::TrainOptions options;
  train::StrategySpec spec;
  bool no_progress = false;
  CLI::App* app = nullptr;
  CLI::Option* threads = nullptr;  ///< given: no core-based default
  CLI::Option* nproc = nullptr;    ///< given: needs a job that launches processes
  /// --resume: the checkpoint the options were inherited from, trained on from there.
  std::optional<checkpoint::ResumePoint> resumed;
};

/// The shard's checkpoints beside the workers': "ps-server<i>.step<N>.pt", saved whenever the
/// workers save theirs (PsStrategy::synchronize), the step in its name and inside; on --resume
/// (or a restart) the file of the step the workers resume from is restored, and refused when it
/// is missing or holds another step. A file of an older Shoal ("ps-server<i>.pt", no step) is
/// restored with a warning, since nothing ties it to a step.
void configure_server_checkpoints(const train::TrainOptions& options, const ps::Job& job,
                                  ps::ServerOptions& server) {
  std::filesystem::create_directories(options.checkpoint_dir);
  const std::string name = "ps-server" + std::to_string(job.role_rank);
  server.step_checkpoint_prefix = options.checkpoint_dir + "/" + name;
  // One more than the workers keep: the newest may be a step whose workers' save was cut off.
  server.step_checkpoint_keep = options.checkpoint_keep > 0 ? options.checkpoint_keep + 1 : 0;
  const bool restarted = launcher::restart_count() > 0;
  if (!options.resume && !restarted) return;
  // The checkpoint the workers resume from (they pick it the same way).
  const auto point = checkpoint::load_latest_intact(options.checkpoint_dir);
  if (!point) return;
  const int64_t step = point->state.step;
  const std::string path = ps::step_checkpoint_path(server.step_checkpoint_prefix, step);
  const std::string old_path = options.checkpoint_dir + "/" + name + ".pt";
  if (std::filesystem::exists(path)) {
    server.restore_path = path;
    server.restore_step = step;
    return;
  }
  if (std::filesystem::exists(old_path)) {
    log::warn("shoal: ", old_path, " (an older Shoal's server checkpoint) holds no step: "
              "restored as the shard of step ", step, " of ", point->path, " unchecked");
    server.restore_path = old_path;
    return;
  }
  // The workers resume from their checkpoint; a server that started afresh beside them would
  // serve its initial values and momentum as if nothing were lost. --resume asks for the saved
  // state, so it is refused; an automatic restart (shoal run --max-restarts) goes on, since
  // stopping would defeat it, but names what it lost.
  const std::string what = path + " is missing, though the workers resume from " + point->path +
                           " (step " + std::to_string(step) + "): parameter server " +
                           std::to_string(job.role_rank) +
                           "'s shard (its values and momentum buffers) cannot be restored";
  SHOAL_CHECK_T(CheckpointError, !options.resume, "--resume: ", what,
                " and would start afresh; put the file back, or start from scratch in another "
                "--checkpoint-dir");
  log::warn("shoal: restart: ", what, "; the server starts afresh (momentum zero)");
}

/// A parameter-server process of `shoal train --strategy ps`: serves the workers with SGD of the
/// run's learning rate and momentum, and says what it observed.
int run_ps_server(const train::TrainOptions& options, const train::StrategySpec& spec) {
  const ps::Job job = ps::job_from_env();
  if (options.threads > 0) compat::set_compute_threads(options.threads);
  ps::ServerOptions server;
  server.consistency = ps::parse_consistency(spec.consistency);
  server.staleness = spec.staleness;
  server.worker_timeout =
      std::chrono::milliseconds(static_cast<long long>(spec.worker_timeout_s * 1000));
  const train::Optimizer optimizer = options.optimizer;
  if (optimizer == train::Optimizer::kSgd) {
    server.optimizer = std::make_shared<ps::Sgd>(ps::SgdOptions{options.lr, options.momentum});
  } else {
    // Adam / AdamW on the servers, with the run's hyper-parameters.
    ps::AdamOptions adam;
    adam.lr = options.lr;
    adam.beta1 = options.beta1;
    adam.beta2 = options.beta2;
    adam.eps = options.eps;
    adam.decoupled_weight_decay = optimizer == train::Optimizer::kAdamW;
    adam.weight_decay = options.weight_decay.value_or(adam.decoupled_weight_decay ? 1e-2 : 0);
    server.optimizer = std::make_shared<ps::Adam>(adam);
  }
  if (!options.checkpoint_dir.empty()) configure_server_checkpoints(options, job, server);
  const ps::ServerStats stats = ps::serve(job, server);
  log::info("ps server ", job.role_rank, ": ", stats.pushes, " pushes, ", stats.updates,
            " updates, max staleness ", stats.max_staleness, ", ", stats.deferred_pulls,
            " pulls waited, ", stats.rejected, " messages rejected, ", stats.dead_workers.size(),
            " workers presumed dead");
  return 0;
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

/// True when the launcher bound this process to cores of its own: its mask is narrower than the
/// launcher's (its parent: mpirun's daemon, slurmstepd, shoal run). A process that inherited its
/// launcher's whole mask shares those cores with the other local ranks; a bound one does not (a
/// launcher binds ranks to disjoint cores: --bind-to core, --cpu-bind=cores).
bool bound_by_launcher() {
  cpu_set_t own;
  cpu_set_t parent;
  if (sched_getaffinity(0, sizeof(own), &own) != 0 ||
      sched_getaffinity(getppid(), sizeof(parent), &parent) != 0) {
    return false;
  }
  cpu_set_t both;
  CPU_AND(&both, &own, &parent);
  return CPU_EQUAL(&both, &own) && CPU_COUNT(&own) < CPU_COUNT(&parent);
}

/// A closed choice's flag: the name given is parsed into `field` here, at the edge; --help
/// offers the table's choices and shows the default's name.
template <typename Enum>
CLI::Option* add_choice(CLI::App& app, const std::string& flag, Enum& field,
                        Enum (*parse)(const std::string&), const char* (*name)(Enum),
                        const std::string& description) {
  return app
      .add_option_function<std::string>(
          flag, [&field, parse](const std::string& given) { field = parse(given); }, description)
      ->check(CLI::IsMember(train::train_option_choices(flag)))
      ->default_str(name(field));
}

/// The options of the training features, named after PyTorch's arguments.
void add_training_feature_options(CLI::App& app, train::TrainOptions& options) {
  add_choice(app, "--optimizer", options.optimizer, train::parse_optimizer, train::optimizer_name,
             "sgd (--lr, --momentum), adam or adamw (torch.optim.Adam / AdamW: --lr, --betas,\n"
             "--eps, --weight-decay)");
  app.add_option_function<std::vector<double>>(
         "--betas",
         [&options](const std::vector<double>& values) {
           if (values.size() != 2) {
             throw CLI::ValidationError("--betas",
                                        "takes two numbers, BETA1,BETA2 (e.g. 0.9,0.999)");
           }
           options.beta1 = values[0];
           options.beta2 = values[1];
         },
         "Adam/AdamW's betas: BETA1,BETA2 (default 0.9,0.999)")
      ->delimiter(',')
      ->expected(2);
  app.add_option("--eps", options.eps, "Adam/AdamW's eps")->capture_default_str();
  app.add_option_function<double>(
      "--weight-decay", [&options](const double& value) { options.weight_decay = value; },
      "Weight decay, >= 0 (default: PyTorch's for the optimizer: 0 for sgd and adam, 0.01 for\n"
      "adamw)");
  app.add_option("--warmup-steps", options.warmup_steps,
                 "Optimizer steps of linear warm-up (LinearLR's total_iters) before --lr-schedule")
      ->capture_default_str();
  app.add_option("--warmup-start-factor", options.warmup_start_factor,
                 "LinearLR's start_factor: the first warm-up step trains at lr x this")
      ->capture_default_str();
  app.add_option("--step-size", options.step_size,
                 "--lr-schedule step: StepLR's step_size, in optimizer steps");
  app.add_option("--gamma", options.gamma, "StepLR's / MultiStepLR's gamma")->capture_default_str();
  app.add_option("--milestones", options.milestones,
                 "--lr-schedule multistep: MultiStepLR's milestones, optimizer steps A,B,...")
      ->delimiter(',');
  app.add_option("--t-max", options.t_max,
                 "--lr-schedule cosine: CosineAnnealingLR's T_max (0 = every step after the warm-up)")
      ->capture_default_str();
  app.add_option("--clip-grad-norm", options.clip_grad_norm,
                 "Clip the gradients to this global L2 norm before each step (clip_grad_norm_;\n"
                 "after DDP's averaging, across all pipeline stages); 0 = no clipping")
      ->capture_default_str();
  app.add_option("--accumulate", options.accumulate,
                 "Micro-batches of --batch-size per optimizer step (gradient accumulation; DDP\n"
                 "reduces once per step, in no_sync before)")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}))
      ->capture_default_str();
  add_choice(app, "--precision", options.precision, train::parse_precision, train::precision_name,
             "fp32, or bf16: forward and loss under CPU autocast to bfloat16 (weights, gradients\n"
             "and optimizer stay float32), or fp16: autocast to float16 with a loss scaler\n"
             "(torch.amp.GradScaler: inf/NaN steps skipped); needs --device cuda or LibTorch >= 2.4");
  app.add_option("--device", options.device,
                 "cpu, or cuda / cuda:N: the model, each batch and autocast on that GPU (cuda = the\n"
                 "GPU of this rank's local rank); --strategy single or ddp")
      ->capture_default_str();
}

/// --model gpt on token files: --data TRAIN.bin's companions.
void add_token_data_options(CLI::App& app, train::TrainOptions& options) {
  app.add_option("--val-data", options.val_data_path,
                 "--model gpt with --data TRAIN.bin: the validation token file (nanoGPT's\n"
                 "val.bin), evaluated after each epoch: loss and perplexity")
      ->type_name("FILE");
  add_choice(app, "--token-dtype", options.token_dtype, data::parse_token_dtype,
             data::token_dtype_name,
             "Token files' id width: uint16 (nanoGPT's, `shoal data tokenize`) or uint32");
}

/// What is trained and on what loss.
void add_model_options(CLI::App& app, train::TrainOptions& options) {
  add_choice(app, "--loss", options.loss, train::parse_loss, train::loss_name,
             "The loss minimized on the model's output, with PyTorch's mean reduction:\n"
             "cross_entropy or nll (class targets; accuracy reported), mse, l1, smooth_l1\n"
             "or bce_with_logits (float targets of the output's shape, from --data). A\n"
             "model that computes its own loss (forward(inputs, targets)) ignores it");
  add_gpt_size_options(app, options.gpt);
  app.add_option("--dropout", options.gpt.dropout, "--model gpt: dropout in training, in [0, 1)")
      ->capture_default_str();
  add_token_data_options(app, options);
}

/// The run's last stdout line: the test accuracy where it means something, else the test loss.
void print_result(const train::TrainResult& result) {
  const double accuracy = result.final_test_accuracy();
  if (!std::isnan(accuracy) || result.epochs.empty()) {
    std::printf("final test accuracy: %.4f\n", accuracy);
  } else {
    std::printf("final test loss: %.6g\n", result.epochs.back().test_loss);
  }
}

/// Exit status of a run stopped by the preemption warning, after its checkpoint was saved: 75,
/// EX_TEMPFAIL of <sysexits.h> ("try again later"); the batch script requeues on it.
constexpr int kExitPreempted = 75;

volatile std::sig_atomic_t g_preempt_requested = 0;

void on_preemption_signal(int) { g_preempt_requested = 1; }

/// SIGUSR1 (what `sbatch --signal=USR1@90` sends before a time limit or preemption) asks the
/// trainer to save a checkpoint at the next step boundary and stop. Replaces the flight recorder's
/// dump-on-SIGUSR1 in this process (install_dump_on_sigusr1 keeps a program's own handler).
void install_preemption_handler() {
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &action, nullptr);
}

}  // namespace

std::string bucket_cap_mb_error(const std::string& value) {
  try {
    parallel::parse_bucket_cap_mb(value);
    return "";
  } catch (const InvalidArgument& e) {
    return e.what();
  }
}

namespace {

/// --strategy ps: the servers, the workers and their consistency.
void add_ps_options(CLI::App& app, train::StrategySpec& spec) {
  app.add_option("--consistency", spec.consistency,
                 "With --strategy ps: bsp (synchronous, DDP's math), asp (asynchronous) or ssp\n"
                 "(bounded staleness, see --staleness)")
      ->check(CLI::IsMember({"bsp", "asp", "ssp"}))
      ->capture_default_str();
  app.add_option("--staleness", spec.staleness,
                 "With --consistency ssp: how many clocks the fastest worker may run ahead")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--servers", spec.servers, "With --strategy ps: parameter-server processes")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--workers", spec.workers, "With --strategy ps: worker processes")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--worker-timeout", spec.worker_timeout_s,
                 "With --strategy ps: seconds of silence after which a server presumes a worker\n"
                 "dead (asp/ssp then go on without it; bsp fails)")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
}

/// --strategy ddp: replicas that synchronise every few steps (LocalSGD, DiLoCo).
void add_sync_options(CLI::App& app, train::StrategySpec& spec) {
  app.add_option_function<std::string>(
         "--sync", [&spec](const std::string& name) { spec.sync = train::parse_sync(name); },
         "With --strategy ddp: every-step (DDP: gradients averaged in every backward);\n"
         "localsgd: each rank steps alone, parameters averaged every --sync-every steps;\n"
         "diloco: as localsgd, then an outer Nesterov-SGD step (--outer-lr, --outer-momentum)\n"
         "on the averaged change; --optimizer is the inner one (DiLoCo: adamw). CPU only,\n"
         "no --resume")
      ->check(CLI::IsMember(train::sync_names()))
      ->default_str("every-step");
  app.add_option("--sync-every", spec.sync_every,
                 "With --sync localsgd or diloco: optimizer steps between syncs (H); each sync\n"
                 "allreduces the parameters once")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--outer-lr", spec.outer_lr, "With --sync diloco: the outer SGD's learning rate")
      ->check(CLI::Range(1e-8, 1e4))
      ->capture_default_str();
  app.add_option("--outer-momentum", spec.outer_momentum,
                 "With --sync diloco: the outer SGD's Nesterov momentum, in [0, 1)")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
}

/// --strategy ddp: how gradients travel.
void add_ddp_options(CLI::App& app, train::StrategySpec& spec) {
  app.add_option_function<std::string>(
         "--comm-hook",
         [&spec](const std::string& name) { spec.comm_hook = train::parse_comm_hook(name); },
         "With --strategy ddp: how gradients are reduced (PyTorch's register_comm_hook):\n"
         "allreduce (average), fp16 or bf16 (compressed on the wire), powersgd\n"
         "(low-rank, see --powersgd-rank and --powersgd-start-iter)")
      ->check(CLI::IsMember(train::comm_hook_names()))
      ->default_str("allreduce");
  app.add_option_function<std::string>(
         "--bucket-cap-mb",
         [&spec](const std::string& cap) { spec.bucket_cap_mb = parallel::parse_bucket_cap_mb(cap); },
         "With --strategy ddp: size of DDP's gradient buckets after the first, in MiB\n"
         "(PyTorch's bucket_cap_mb), or auto: the first steps time each candidate cap\n"
         "and keep the fastest (logged, and bucket_cap_mb in --metrics)")
      ->check(bucket_cap_mb_error)
      ->default_str("25");
  add_sync_options(app, spec);
  app.add_option("--powersgd-rank", spec.powersgd_rank,
                 "With --comm-hook powersgd: rank of each gradient matrix's approximation")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}))
      ->capture_default_str();
  app.add_option("--powersgd-start-iter", spec.powersgd_start_iter,
                 "With --comm-hook powersgd: plain allreduce for this many steps first (PyTorch's\n"
                 "start_powerSGD_iter)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
}

/// --strategy pipeline: stages, micro-batches and their schedule.
void add_pipeline_options(CLI::App& app, train::StrategySpec& spec) {
  app.add_option("--stages", spec.stages,
                 "With --strategy pipeline: pipeline stages (one process each)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--micro-batches", spec.micro_batches,
                 "With --strategy pipeline: micro-batches each batch is split into")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--schedule", spec.schedule, "With --strategy pipeline: gpipe or 1f1b")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->capture_default_str();
  app.add_flag("--recompute", spec.recompute,
               "With --strategy pipeline: recompute activations in backward (less memory)");
}

/// What is trained, for how long and how: the model, the run's length, the optimizer and its
/// schedule. Returns --threads, whose presence decides the default thread count.
CLI::Option* add_run_options(CLI::App& app, train::TrainOptions& options) {
  std::string models;
  for (const auto& name : models::list_models()) models += name + ", ";
  app.add_option("--model", options.model,
                 "Model to train: " + models + "or a TorchScript file (model.pt, saved with\n"
                 "torch.jit.script(model).save) under single, ddp, fsdp, dp or ps; pipeline when\n"
                 "it is a scripted nn.Sequential")
      ->capture_default_str();
  app.add_option("--epochs", options.epochs,
                 "Passes over the training set (60000 Fashion-MNIST images)")
      ->capture_default_str();
  app.add_option("--batch-size", options.batch_size,
                 "Samples per optimizer step on each process: with --strategy ddp the global\n"
                 "batch is nproc x batch size, as in PyTorch's DDP")
      ->capture_default_str();
  app.add_option("--lr", options.lr,
                 "Learning rate (of SGD, Adam or AdamW), in (0, 1e4]")
      ->capture_default_str();
  app.add_option("--momentum", options.momentum, "SGD momentum, in [0, 1)")
      ->capture_default_str();
  add_choice(app, "--lr-schedule", options.lr_schedule, train::parse_lr_schedule,
             train::lr_schedule_name,
             "constant; cosine: PyTorch's CosineAnnealingLR (T_max = --t-max, default every\n"
             "step of the run after the warm-up; eta_min 0); step: StepLR (--step-size,\n"
             "--gamma); multistep: MultiStepLR (--milestones, --gamma). Stepped after each\n"
             "optimizer step, after --warmup-steps of LinearLR (SequentialLR); with\n"
             "--strategy ps the servers' optimizer follows it");
  add_training_feature_options(app, options);
  add_model_options(app, options);
  app.add_option("--seed", options.seed,
                 "Seeds the initial weights, the shuffle and dropout: the same seed "
                 "gives the same run (>= 0)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  return app.add_option(
      "--threads", options.threads,
      "Compute threads per process, LibTorch's intra-op and OpenBLAS's (0 = their defaults);\n"
      "default: this machine's cores divided among the processes on it");
}

/// --strategy and what a job of processes needs: how many, over which backend, restarts.
void add_strategy_options(CLI::App& app, TrainCli& cli) {
  train::StrategySpec& spec = cli.spec;
  app.add_option_function<std::string>(
         "--strategy", [&spec](const std::string& name) { spec.kind = train::parse_strategy(name); },
         "single: one process; ddp: DistributedDataParallel over --nproc-per-node\n"
         "processes on this host (or the ranks of shoal run / torchrun / mpirun);\n"
         "dp: DataParallel over --replicas threads in one process;\n"
         "ps: parameter server, --servers S and --workers W processes;\n"
         "pipeline: --stages x --replicas processes, the model split into stages;\n"
         "fsdp: sharded data parallelism (ZeRO stage --shard) over the processes of ddp")
      ->check(CLI::IsMember(train::strategy_names()))
      ->default_str("single");
  cli.nproc = app.add_option("--nproc-per-node,--nproc_per_node", spec.nproc_per_node,
                             "With --strategy ddp started directly: processes to launch on "
                             "this host")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--max-restarts,--max_restarts", spec.max_restarts,
                 "ddp: when a rank dies, restart all ranks up to this many times, resuming from the "
                 "last intact checkpoint in --checkpoint-dir; with --fault-tolerant, restart the "
                 "dead rank alone, which rejoins the others from a live rank's state")
      ->capture_default_str();
  app.add_flag("--fault-tolerant", spec.fault_tolerant,
               "ddp: when a rank dies, the others discard the step in flight and go on without\n"
               "it; the rest of the epoch is dealt over them (and a replacement, with\n"
               "--max-restarts). CPU (gloo) only");
  app.add_option("--min-replicas", spec.min_replicas,
                 "With --fault-tolerant: the job fails when fewer ranks than this are left")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--replicas", spec.replicas,
                 "With --strategy dp: replicas (CPU slots, one thread each; GPUs with CUDA),\n"
                 "default 2; with --strategy pipeline: data-parallel replicas of the pipeline\n"
                 "(DDP per stage), default 1")
      ->check(CLI::Range(1, 1024));
  app.add_option("--shard", spec.shard,
                 "With --strategy fsdp: what each rank keeps only its 1/N of (ZeRO's stages):\n"
                 "1 optimizer state, 2 + gradients, 3 + parameters")
      ->check(CLI::Range(1, 3))
      ->capture_default_str();
  app.add_option("--model-parallel", spec.model_parallel,
                 "With --strategy ddp: split each rank's model into K parts (micro-batched,\n"
                 "one thread per part)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--mesh", spec.mesh,
                 "--model gpt or transformer on a device mesh, e.g. dp=2,tp=2: tensor parallelism\n"
                 "over tp ranks (attention heads and MLP split, and the GPT's vocabulary; tp\n"
                 "divides the heads and widths) and DDP over dp; launches dp x tp processes as ddp does")
      ->type_name("dp=D,tp=T");
  app.add_option("--backend", spec.backend,
                 "Process-group backend for ddp: auto (shm on one host), shm, gloo, mpi")
      ->check(CLI::IsMember({"auto", "shm", "gloo", "mpi", "hierarchical"}))
      ->capture_default_str();
  add_ps_options(app, spec);
  add_ddp_options(app, spec);
  add_pipeline_options(app, spec);
}

/// Checkpoints, and where a run's weights start from.
void add_checkpoint_options(CLI::App& app, train::TrainOptions& options) {
  app.add_option("--checkpoint-dir", options.checkpoint_dir,
                 "Save a checkpoint (torch.save format) here after every epoch; rank 0 writes")
      ->type_name("DIR");
  add_choice(app, "--checkpoint-format", options.checkpoint_format,
             train::parse_checkpoint_format, train::checkpoint_format_name,
             "full: one file with the whole model and optimizer state, gathered to rank 0\n"
             "(torch.load reads it). sharded (--strategy fsdp): each rank writes its own\n"
             "shard, DIR/checkpoint_N.sharded/rank_R.pt, nothing gathered; --resume at any\n"
             "number of processes re-shards it; `shoal ckpt convert` makes it one full file\n"
             "(PyTorch FSDP's FULL_STATE_DICT and SHARDED_STATE_DICT)");
  app.add_option("--checkpoint-every", options.checkpoint_every,
                 "Also save every N SGD steps (0 = only after epochs)")
      ->capture_default_str();
  app.add_option("--checkpoint-keep", options.checkpoint_keep,
                 "Checkpoints kept in DIR (0 = all)")
      ->capture_default_str();
  app.add_flag("--resume", options.resume,
               "Continue from the newest checkpoint in --checkpoint-dir: its weights, optimizer,\n"
               "epoch, step and position in the epoch. The number of processes may differ: the\n"
               "rest of the epoch's order, after the samples the whole job had consumed, is\n"
               "dealt over the processes there are now, each of its samples once");
  app.add_option("--init-from", options.init_from,
                 "Start from the weights of this state dict (torch.save(model.state_dict()) from\n"
                 "Python, a file Shoal saved, or a DCP folder from torch.distributed.checkpoint)\n"
                 "instead of the seed's initialisation; a DCP folder holding the optimizer's state\n"
                 "(dcp.save of FSDP2's get_state_dict, a sharded checkpoint of the DCP layout, not\n"
                 "the older rank_N.pt one) starts the optimizer's state from it too, matched by\n"
                 "parameter name (this run's optimizer options apply)")
      ->type_name("FILE");
}

/// Where the samples come from and how they are loaded.
void add_data_options(CLI::App& app, train::TrainOptions& options) {
  app.add_option("--data-dir", options.data_dir,
                 "Directory with the Fashion-MNIST *-ubyte.gz files (Debian: dataset-fashion-mnist),\n"
                 "with CIFAR-10's binary files (data_batch_1.bin, ..., test_batch.bin), or a folder\n"
                 "of images, one subfolder per class (DIR/train with DIR/val or DIR/test, or DIR\n"
                 "alone: then no evaluation), PNG or JPEG")
      ->capture_default_str();
  add_image_folder_options(app, options.image_folder);
  // Data: the user's own tensors, and the workers that load batches ahead of the step.
  app.add_option("--data", options.data_path,
                 "Train on the tensors of FILE, written by Python's torch.save({'train_x': X,\n"
                 "'train_y': y, 'test_x': Xt, 'test_y': yt}): float inputs and class targets\n"
                 "(0-9 for the built-in models, any number of classes for a TorchScript model),\n"
                 "float targets under a regression --loss, or --model gpt's blocks of token ids\n"
                 "(int64 [N, T] inputs, and targets: the next tokens, -1 ignored). A FILE\n"
                 "ending in .bin is a token stream for --model gpt (`shoal data tokenize`'s\n"
                 "train.bin): blocks of --block-size + 1 tokens, each trained on once an epoch")
      ->type_name("FILE");
  app.add_option("--num-workers,--num_workers", options.num_workers,
                 "Threads loading batches ahead of the step (PyTorch's DataLoader num_workers)")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  app.add_option("--eval-batch-size", options.eval_batch_size,
                 "Samples per evaluation batch (0 = --batch-size); does not change the results")
      ->capture_default_str();
  app.add_option("--prefetch-factor,--prefetch_factor", options.prefetch_factor,
                 "Batches each worker loads ahead (PyTorch's prefetch_factor)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--max-decompression-ratio", options.max_decompression_ratio,
                 "Refuse a data file that decodes to more than this multiple of its own size\n"
                 "(beyond 64 MiB; real image files decode to 2-5x): a decompression bomb. 0: no check")
      ->capture_default_str();
}

/// What the run reports: metrics, traces, TensorBoard, progress; and the hidden test options.
void add_report_options(CLI::App& app, TrainCli& cli) {
  train::TrainOptions& options = cli.options;
  app.add_option("--metrics", options.metrics_path,
                 "Write metrics as JSON lines to FILE: one object per log interval and per epoch")
      ->type_name("FILE");
  app.add_option("--trace", options.trace_path,
                 "Write a timeline of every rank's steps (data, forward, backward, optimizer), evaluation,\n"
                 "checkpoints and bucket reductions to FILE (Chrome trace format: open in https://ui.perfetto.dev)")
      ->type_name("FILE");
  app.add_option("--tensorboard", options.tensorboard_dir,
                 "Write TensorBoard event files into the run folder DIR (rank 0's): every metrics "
                 "value as a scalar, parameter histograms; view with tensorboard --logdir DIR/..")
      ->type_name("DIR");
  app.add_flag("--tensorboard-all-ranks", options.tensorboard_all_ranks,
               "With --tensorboard: every rank writes, into DIR/rank<R>");
  app.add_option("--histogram-interval", options.histogram_interval,
                 "With --tensorboard: optimizer steps between parameter histograms (0 = none)")
      ->capture_default_str();
  app.add_option("--log-interval", options.log_interval,
                 "SGD steps between progress lines and step metrics (0 = none)")
      ->capture_default_str();
  app.add_flag("--no-progress", cli.no_progress,
               "No progress bar or lines on stderr; only epoch summaries and the result");
  app.add_option("--train-samples", options.train_limit,
                 "Train on the first K training samples only (0 = all): a quick run")
      ->capture_default_str();
  app.add_option("--test-samples", options.test_limit,
                 "Evaluate on the first K test samples only (0 = all)")
      ->capture_default_str();
  // Hidden options for tests (an empty group hides them from --help).
  app.add_option("--stop-after-steps", options.stop_after_steps,
                 "Stop after N SGD steps in all, as if interrupted")
      ->group("");
  app.add_option("--dump-parameters", options.dump_parameters,
                 "Every rank saves its final weights to PREFIX.rank<R>.pt")
      ->group("");
}

/// Refuses what this process cannot do as it was started: a rank of torchrun, shoal run, mpirun
/// or srun -n N never launches a job of its own. Returns the exit status of a rank that stops
/// without a word (a refused job's rank 0 says why once).
std::optional<int> check_how_started(const TrainCli& cli, const comm::RankInfo& rank_info) {
  const train::StrategySpec& spec = cli.spec;
  const bool as_rank = rank_info.launched;
  const std::string strategy = train::strategy_name(spec.kind);
  // Independent copies of one training are never what was meant.
  SHOAL_CHECK_T(InvalidArgument,
                spec.kind == train::StrategyKind::kDdp || spec.kind == train::StrategyKind::kFsdp ||
                    cli.nproc->count() == 0,
                "--nproc-per-node ", spec.nproc_per_node,
                " needs --strategy ddp (without it every process would train alone)");
  SHOAL_CHECK_T(InvalidArgument,
                spec.mesh.empty() || cli.nproc->count() == 0 ||
                    spec.nproc_per_node == spec.local_processes(),
                "--mesh ", spec.mesh, " runs ", spec.local_processes(), " processes, but "
                "--nproc-per-node is ", spec.nproc_per_node, "; leave --nproc-per-node out");
  if (!spec.runs_as_job() && as_rank && rank_info.world_size > 1) {
    if (rank_info.rank != 0) return 2;
    SHOAL_THROW(InvalidArgument, "started as rank ", rank_info.rank, " of ", rank_info.world_size,
                " by ", rank_info.source, ", but --strategy is ", strategy,
                ": pass --strategy ddp to train one job of ", rank_info.world_size,
                " ranks (or start one process), or the ranks would train independently");
  }
  // (Not under torchrun's names: shoal train's own launcher passes it on.)
  if (as_rank && cli.nproc->count() > 0 && rank_info.rank == 0 && rank_info.source != "torchrun") {
    log::warn("shoal train: --nproc-per-node ", spec.nproc_per_node, " is ignored: started as rank 0 of ",
              rank_info.world_size, " by ", rank_info.source, ", whose ranks are the job");
  }
  // srun and mpirun give ranks, not the server and worker roles.
  SHOAL_CHECK_T(InvalidArgument,
                spec.kind != train::StrategyKind::kPs || !as_rank || rank_info.source == "torchrun",
                "--strategy ps was started as rank ", rank_info.rank, " of ", rank_info.world_size,
                " by ", rank_info.source,
                ", which assigns no server and worker roles: start one process (srun -n1 shoal "
                "train --strategy ps --servers S --workers W), which starts them");
  return std::nullopt;
}

/// --resume: the options not given continue as the checkpoint had them; the ones given apply
/// (never silently the checkpoint's).
checkpoint::ResumePoint inherit_on_resume(const CLI::App& app, train::TrainOptions& options) {
  checkpoint::ResumePoint point = train::load_resume_checkpoint(options);
  std::set<std::string> given;
  for (const train::TrainOption& row : train::train_option_table()) {
    if (row.key != nullptr && app.get_option(row.flag)->count() > 0) given.insert(row.key);
  }
  train::inherit_checkpoint_config(options, point.state, given, point.path);
  return point;
}

/// Checks the options once each; a resume's twice: every row before the checkpoint is read (a
/// given option's mistake is said before any file is read, with its own exit code), and the rows
/// a checkpoint holds again on the options the resume ends with (an inherited value may not suit
/// a given one).
void check_options(TrainCli& cli) {
  train::TrainOptions& options = cli.options;
  cli.spec.validate_sync(options);
  options.validate();
  if (options.resume) {
    cli.resumed = inherit_on_resume(*cli.app, options);
    train::check_train_options(options, train::OptionRows::kSaved);
  }
  cli.spec.validate_settings(options);
}

/// Threads: the cores in this process's own affinity mask, divided among the local ranks that
/// really share them (all of them, unless the launcher bound each rank to cores of its own).
void choose_threads(TrainCli& cli, const comm::RankInfo& rank_info) {
  train::TrainOptions& options = cli.options;
  const bool as_rank = rank_info.launched;
  const int local = as_rank ? rank_info.local_world_size : cli.spec.local_processes();
  const int cores = launcher::available_cores();
  const bool bound = as_rank && bound_by_launcher();
  const int sharing = bound ? 1 : local;
  if (cli.threads->count() == 0) options.threads = std::max(1, cores / sharing);
  const int threads = std::max(1, options.threads);
  log::debug("shoal train: ", options.threads, " intra-op thread", options.threads == 1 ? "" : "s",
             ": ", cores, " core", cores == 1 ? "" : "s", " in this process's affinity mask, ",
             bound ? "bound to this rank by the launcher"
                   : "shared by " + std::to_string(sharing) + " local process" +
                         (sharing == 1 ? "" : "es"));
  // A parent that launches ranks does not train itself.
  const bool launches = cli.spec.runs_as_job() && cli.spec.kind != train::StrategyKind::kPs;
  if (threads * sharing > cores && (!launches || as_rank) && rank_info.local_rank == 0) {
    log::warn("shoal: warning: ", sharing, " process", sharing == 1 ? "" : "es", " x ", threads,
              " thread", options.threads == 1 ? "" : "s", " on ", cores, " core",
              cores == 1 ? "" : "s", bound ? " (bound by the launcher)" : "",
              ": oversubscribed, steps will be slow (see --threads)");
  }
}

/// Starts the job's processes, each this command line again, and returns the job's status.
int launch_job(const train::StrategySpec& spec) {
  launcher::LaunchOptions launch = spec.launch_options(own_command_line());
  launch.log_name = "shoal train";
  launch.verbose = false;
  return launcher::launch(launch);
}

/// What the run ended with, on rank 0: its result line, or how it was stopped; the exit status.
int report(const train::TrainResult& result, const TrainCli& cli,
           const parallel::PowerSGDState* power_sgd) {
  const train::TrainOptions& options = cli.options;
  if (result.preempted) {
    log::warn("shoal train: SIGUSR1 (preemption warning): stopped after step ", result.step,
              options.checkpoint_dir.empty()
                  ? std::string(" with nothing saved (no --checkpoint-dir)")
                  : ", checkpoint saved in " + options.checkpoint_dir +
                        "; run again with --resume to continue",
              " (exit status ", kExitPreempted, ")");
    return kExitPreempted;
  }
  if (result.stopped) {
    std::printf("stopped after step %lld\n", static_cast<long long>(options.stop_after_steps));
  } else {
    print_result(result);
  }
  if (power_sgd != nullptr && power_sgd->iteration > 0) {
    log::info("powersgd: ",
              static_cast<long long>(std::llround(power_sgd->bytes_sent /
                                                  static_cast<double>(power_sgd->iteration))),
              " bytes per step sent by this rank over ", power_sgd->iteration, " steps (rank ",
              cli.spec.powersgd_rank, ", from step ", cli.spec.powersgd_start_iter, ")");
  }
  std::fflush(stdout);
  return 0;
}

/// `shoal train`: checks, then launches the job, serves as a parameter server, or trains.
int run_train(TrainCli& cli) {
  train::TrainOptions& options = cli.options;
  const train::StrategySpec& spec = cli.spec;
  const bool ps = spec.kind == train::StrategyKind::kPs;
  if (cli.no_progress) options.progress = train::ProgressMode::kNone;
  const comm::RankInfo rank_info = comm::detect_rank_info();
  // Preemption warnings from the start (SIGUSR1's default would kill): not for ps, whose
  // asynchronous workers do not step together.
  if (!ps) install_preemption_handler();
  if (const std::optional<int> status = check_how_started(cli, rank_info)) return *status;
  check_options(cli);
  choose_threads(cli, rank_info);
  if (spec.runs_as_job() && !rank_info.launched) {
    cli.resumed.reset();  // each rank reads its own: the launcher holds none while they run
    return launch_job(spec);
  }
  if (ps && cli.threads->count() == 0) options.threads = 1;
  if (ps && ps::job_from_env().is_server()) {
    cli.resumed.reset();  // the server restores its own shard's file
    return run_ps_server(options, spec);
  }
  std::unique_ptr<train::Strategy> strategy = spec.make_strategy(options);
  const auto* ddp = dynamic_cast<const train::DdpStrategy*>(strategy.get());
  const std::shared_ptr<parallel::PowerSGDState> power_sgd = ddp ? ddp->power_sgd() : nullptr;
  if (!ps) options.stop_requested = [] { return g_preempt_requested != 0; };
  const bool reports = strategy->rank() == 0;
  const train::TrainResult result =
      train::detail::run_validated_training(options, std::move(strategy), std::move(cli.resumed));
  if (!reports) return result.preempted ? kExitPreempted : 0;
  return report(result, cli, power_sgd.get());
}

}  // namespace

void add_train_command(CLI::App& root, std::vector<Command>& commands) {
  auto cli = std::make_shared<TrainCli>();
  auto* app = root.add_subcommand(
      "train",
      "Train a built-in model or a TorchScript file on Fashion-MNIST, CIFAR-10, a folder of images\n"
      "or your own tensors (SGD with momentum and cross-entropy by default; Adam or AdamW; any --loss,\n"
      "or the model's own), evaluating on the test set after every epoch, in one process\n"
      "or over many (--strategy ddp, fsdp, dp, ps or pipeline). The defaults reach >= 0.85 test\n"
      "accuracy in one epoch on Fashion-MNIST.");
  cli->app = app;
  // A repeated option takes its last value, so that `make run RUN_ARGS="--epochs 2"` overrides.
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cli->threads = add_run_options(*app, cli->options);
  add_strategy_options(*app, *cli);
  add_checkpoint_options(*app, cli->options);
  add_data_options(*app, cli->options);
  add_report_options(*app, *cli);
  app->footer(
      "The last stdout line is 'final test accuracy: A'. Progress goes to stderr: a live bar on\n"
      "a terminal, plain lines otherwise. Under --strategy ddp, --batch-size is per rank (the\n"
      "global batch is N x batch size, as in PyTorch DDP).\n\n"
      "Examples:\n"
      "  shoal train --model cnn --epochs 2\n"
      "  shoal train --strategy ddp --nproc-per-node 2 --model cnn --checkpoint-dir ckpt\n"
      "  shoal train --strategy ddp --nproc-per-node 2 --checkpoint-dir ckpt --resume\n"
      "  shoal run --nproc-per-node 2 shoal train --strategy ddp\n"
      "  shoal train --strategy pipeline --stages 2 --micro-batches 4 --schedule 1f1b\n"
      "  shoal train --strategy ps --consistency ssp --staleness 2 --servers 2 --workers 4\n"
      "  shoal train --strategy ddp --sync diloco --sync-every 100 --optimizer adamw");

  commands.push_back({app, [cli] { return run_train(*cli); }});
}

void add_gpt_size_options(CLI::App& app, models::GptConfig& gpt) {
  app.add_option("--n-layer", gpt.n_layer, "--model gpt: transformer blocks")
      ->capture_default_str();
  app.add_option("--n-head", gpt.n_head, "--model gpt: attention heads (divides --n-embd)")
      ->capture_default_str();
  app.add_option("--n-embd", gpt.n_embd, "--model gpt: embedding width")->capture_default_str();
  app.add_option("--block-size", gpt.block_size, "--model gpt: the longest sequence, in tokens")
      ->capture_default_str();
  app.add_option("--vocab-size", gpt.vocab_size, "--model gpt: token ids are < this (256: bytes)")
      ->capture_default_str();
}

}  // namespace shoal::cli
