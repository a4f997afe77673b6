// The `shoal` command line: each subcommand lives in its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace shoal::models {
struct GptConfig;
}  // namespace shoal::models

namespace shoal::data {
struct ImageFolderOptions;
}

namespace shoal::cli {

/// A registered subcommand: its CLI11 node and what runs when it is chosen (returns exit code).
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

/// `--bucket-cap-mb`'s check (shoal train, shoal bench ddp): "" for MiB > 0 or auto, else what is
/// wrong (cmd_train.cpp).
std::string bucket_cap_mb_error(const std::string& value);

/// --image-size, --random-crop, --hflip, --normalize: the transforms of a folder of images
/// (image_folder_flags.cpp).
void add_image_folder_options(CLI::App& app, data::ImageFolderOptions& options);

/// --n-layer, --n-head, --n-embd, --block-size, --vocab-size: the GPT's sizes (shoal train, shoal
/// bench ddp; cmd_train.cpp).
void add_gpt_size_options(CLI::App& app, models::GptConfig& gpt);

void add_train_command(CLI::App& root, std::vector<Command>& commands);   // cmd_train.cpp
void add_run_command(CLI::App& root, std::vector<Command>& commands);     // cmd_run.cpp
void add_bench_command(CLI::App& root, std::vector<Command>& commands);   // cmd_bench.cpp
void add_ckpt_command(CLI::App& root, std::vector<Command>& commands);    // cmd_ckpt.cpp
void add_plot_command(CLI::App& root, std::vector<Command>& commands);    // cmd_plot.cpp
void add_generate_command(CLI::App& root, std::vector<Command>& commands);  // cmd_generate.cpp
void add_data_command(CLI::App& root, std::vector<Command>& commands);    // cmd_data.cpp
void add_env_command(CLI::App& root, std::vector<Command>& commands);     // cmd_env.cpp
void add_bench_allreduce_command(CLI::App& bench, std::vector<Command>& commands);  // bench_allreduce.cpp
void add_bench_ddp_command(CLI::App& bench, std::vector<Command>& commands);        // bench_ddp.cpp
void add_bench_ps_command(CLI::App& bench, std::vector<Command>& commands);         // bench_ps.cpp
void add_bench_pipeline_command(CLI::App& bench, std::vector<Command>& commands);   // bench_pipeline.cpp
void add_bench_dp_command(CLI::App& bench, std::vector<Command>& commands);         // bench_dp.cpp
void add_bench_fsdp_command(CLI::App& bench, std::vector<Command>& commands);       // bench_fsdp.cpp
void add_bench_tp_command(CLI::App& bench, std::vector<Command>& commands);         // bench_tp.cpp
void add_bench_faults_command(CLI::App& bench, std::vector<Command>& commands);     // bench_faults.cpp
void add_bench_tokens_command(CLI::App& bench, std::vector<Command>& commands);     // bench_tokens.cpp
void add_bench_images_command(CLI::App& bench, std::vector<Command>& commands);     // bench_images.cpp
void add_bench_heartbeat_command(CLI::App& bench, std::vector<Command>& commands);  // bench_heartbeat.cpp
void add_bench_rendezvous_command(CLI::App& bench, std::vector<Command>& commands); // bench_rendezvous.cpp

}  // namespace shoal::cli
