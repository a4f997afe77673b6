// `shoal bench ...`: benchmarks that print a table, or JSON lines with --json.
#include "commands.h"

namespace shoal::cli {

void add_bench_command(CLI::App& root, std::vector<Command>& commands) {
  auto* bench = root.add_subcommand("bench", "Benchmarks (ratios measured side by side in one run)");
  bench->require_subcommand(1);
  add_bench_allreduce_command(*bench, commands);
  add_bench_ddp_command(*bench, commands);
  add_bench_ps_command(*bench, commands);
  add_bench_pipeline_command(*bench, commands);
  add_bench_dp_command(*bench, commands);
  add_bench_fsdp_command(*bench, commands);
  add_bench_tp_command(*bench, commands);
  add_bench_faults_command(*bench, commands);
  add_bench_tokens_command(*bench, commands);
  add_bench_images_command(*bench, commands);
  add_bench_heartbeat_command(*bench, commands);
  add_bench_rendezvous_command(*bench, commands);
}

}  // namespace shoal::cli
