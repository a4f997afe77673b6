// What `shoal train --tensorboard` costs a training step, measured beside the step itself: the
// built-in model's SGD steps on one thread, in alternating rounds without and with a
// SummaryWriter fed at every step (the worst case; the trainer writes every --log-interval
// steps) with the 8 scalars of a metrics line; then, timed alone, one add_scalar (the caller's
// cost: encoding and queueing; a background thread writes), one set of parameter histograms,
// and the gradient norm the metrics line computes. The last field is the cost per step at the
// trainer's defaults (scalars every 100 steps, histograms every 500) as a fraction of a step.
//
//   summary_writer_bench [--rounds 5] [--steps 40] [--model cnn]
//
// Prints one JSON line.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "shoal/models/registry.h"
#include "shoal/summary/summary_writer.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  int steps = 40;
  std::string model_name = "cnn";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--model") model_name = argv[i + 1];
  }
  torch::set_num_threads(1);
  auto model = shoal::models::create(model_name, 0);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const torch::Tensor x = torch::randn({64, 1, 28, 28});
  const torch::Tensor y = torch::randint(0, 10, {64});
  const std::string dir = std::filesystem::temp_directory_path() / "shoal-summary-bench";
  std::filesystem::remove_all(dir);
  shoal::SummaryWriter writer(dir);
  int64_t global_step = 0;
  const auto step = [&](bool log) {
    sgd.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    sgd.step();
    ++global_step;
    if (!log) return;
    const double value = loss.item<double>();
    for (const char* tag : {"train/loss", "train/samples_per_s", "train/lr", "train/grad_norm",
                            "train/comm_bytes", "train/comm_wait_s", "epoch/a", "epoch/b"}) {
      writer.add_scalar(tag, value, global_step);
    }
  };
  const auto ms_since = [](Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };
  for (int i = 0; i < 5; ++i) step(false);  // warm-up
  std::vector<double> without, with, histograms, norms;
  for (int r = 0; r < rounds; ++r) {
    for (const bool log : {false, true}) {
      const auto start = Clock::now();
      for (int s = 0; s < steps; ++s) step(log);
      (log ? with : without).push_back(ms_since(start) / steps);
    }
    auto start = Clock::now();
    for (const auto& p : model->named_parameters()) {
      writer.add_histogram("parameters/" + p.key(), p.value(), global_step);
    }
    histograms.push_back(ms_since(start));
    start = Clock::now();
    double squares = 0;  // as the trainer's gradient_norm
    for (const auto& p : model->parameters()) {
      const double norm = p.grad().norm().item<double>();
      squares += norm * norm;
    }
    norms.push_back(ms_since(start) + (squares < 0 ? 1 : 0));
  }
  // The caller's cost of add_scalar alone.
  const int calls = 100000;
  const auto start = Clock::now();
  for (int i = 0; i < calls; ++i) writer.add_scalar("bench/scalar", i * 0.5, i);
  const double call_us = ms_since(start) * 1000 / calls;
  writer.flush();
  const double a = median(without);
  const double b = median(with);
  const double h = median(histograms);
  const double g = median(norms);
  const double per_step_at_defaults = (8 * call_us / 1000 + g) / 100 + h / 500;
  std::printf("{\"bench\":\"summary_writer\",\"model\":\"%s\",\"step_ms_without\":%.3f,"
              "\"step_ms_with_8_scalars\":%.3f,\"ratio\":%.4f,\"add_scalar_us\":%.3f,"
              "\"histograms_ms\":%.3f,\"grad_norm_ms\":%.3f,\"defaults_cost_fraction\":%.6f,"
              "\"rounds\":%d,\"steps\":%d}\n",
              model_name.c_str(), a, b, b / a, call_us, h, g, per_step_at_defaults / a, rounds,
              steps);
  writer.close();
  std::filesystem::remove_all(dir);
  return 0;
}
