// GradScaler without Python: the scale's backoff and growth, skipped steps, the once-per-step
// rules, state_dict round trips with PyTorch's keys, agreement across ranks, and the trainer's
// fp16/scaler path (an overflowing step skipped instead of stopping the run).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "compat/autocast.h"
#include "shoal/error.h"
#include "shoal/train/grad_scaler.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

struct OneWeight {
  at::Tensor w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1)};
};

/// One scaled step of loss = sum(w * x); returns whether the optimizer stepped.
bool scaled_step(GradScaler& scaler, OneWeight& m, const at::Tensor& x) {
  m.opt.zero_grad();
  scaler.scale((m.w * x).sum()).backward();
  const bool stepped = scaler.step(m.opt);
  scaler.update();
  return stepped;
}

TEST(GradScaler, DefaultsArePyTorchs) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_factor(), 2.0);
  EXPECT_EQ(scaler.options().backoff_factor(), 0.5);
  EXPECT_EQ(scaler.options().growth_interval(), 2000);
  EXPECT_TRUE(scaler.is_enabled());
}

TEST(GradScaler, UnscalesSkipsBacksOffAndGrows) {
  GradScaler scaler(GradScalerOptions().init_scale(8).growth_interval(3));
  OneWeight m;
  const at::Tensor x = torch::tensor({1.0f, 2.0f, 3.0f});
  // A clean step: the gradient the optimizer sees is the true one (x), so w = 1 - 0.1 x.
  EXPECT_TRUE(scaled_step(scaler, m, x));
  EXPECT_TRUE(torch::allclose(m.w, 1 - 0.1 * x));
  EXPECT_EQ(scaler.growth_tracker(), 1);
  // An inf gradient: no step, scale halves, tracker resets.
  const at::Tensor before = m.w.detach().clone();
  EXPECT_FALSE(scaled_step(scaler, m, torch::tensor({1.0f, INFINITY, 3.0f})));
  EXPECT_TRUE(torch::equal(m.w, before));
  EXPECT_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // NaN as well.
  EXPECT_FALSE(scaled_step(scaler, m, torch::tensor({NAN, 1.0f, 1.0f})));
  EXPECT_EQ(scaler.get_scale(), 2.0);
  // growth_interval clean steps: the scale doubles and the tracker restarts.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(scaled_step(scaler, m, x));
  EXPECT_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, OnceAStepRules) {
  GradScaler scaler;
  OneWeight m;
  m.opt.zero_grad();
  scaler.scale((m.w * 2).sum()).backward();
  EXPECT_THROW(scaler.update(), Error);  // no inf check recorded yet
  scaler.unscale_(m.opt);
  EXPECT_TRUE(torch::allclose(m.w.grad(), torch::full({3}, 2.0f)));
  EXPECT_THROW(scaler.unscale_(m.opt), Error);  // a second unscale_ would divide twice
  EXPECT_TRUE(scaler.step(m.opt));              // does not unscale again
  EXPECT_TRUE(torch::allclose(m.w, torch::full({3}, 0.8f)));
  EXPECT_THROW(scaler.step(m.opt), Error);
  scaler.update();
  scaler.update(1024.0);  // an explicit new scale
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

TEST(GradScaler, GrowthThatOverflowsKeepsTheScale) {
  GradScaler scaler(GradScalerOptions().init_scale(3e38).growth_interval(1));
  OneWeight m;
  // 3e38 * tiny gradient stays finite; growing to 6e38 overflows float32 and is not taken.
  EXPECT_TRUE(scaled_step(scaler, m, torch::full({3}, 1e-10f)));
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(3e38f));
}

TEST(GradScaler, DisabledIsATransparentWrapper) {
  GradScaler scaler(GradScalerOptions().enabled(false));
  OneWeight m;
  const at::Tensor loss = (m.w * 2).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  EXPECT_TRUE(scaler.step(m.opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

TEST(GradScaler, StateDictRoundTripsWithPyTorchsKeys) {
  GradScaler a(GradScalerOptions().init_scale(16).growth_interval(5));
  OneWeight m;
  scaled_step(a, m, torch::ones({3}));
  scaled_step(a, m, torch::ones({3}));
  const auto state = a.state_dict();
  EXPECT_EQ(state.size(), 5u);
  EXPECT_EQ(state.at("scale"), 16.0);
  EXPECT_EQ(state.at("growth_interval"), 5.0);
  EXPECT_EQ(state.at("_growth_tracker"), 2.0);
  EXPECT_EQ(state.at("growth_factor"), 2.0);
  EXPECT_EQ(state.at("backoff_factor"), 0.5);
  GradScaler b;
  b.load_state_dict(state);
  EXPECT_EQ(b.state_dict(), state);
  // Both grow at the same step from here.
  for (int i = 0; i < 3; ++i) {
    scaled_step(a, m, torch::ones({3}));
    scaled_step(b, m, torch::ones({3}));
  }
  EXPECT_EQ(a.get_scale(), 32.0);
  EXPECT_EQ(b.get_scale(), 32.0);
  EXPECT_THROW(b.load_state_dict({{"scale", 1.0}}), InvalidArgument);
}

TEST(GradScaler, FoundInfIsAgreedAcrossProcesses) {
  // This rank's gradients are clean, another's overflowed: the sum says skip, here too.
  GradScaler scaler;
  scaler.set_found_inf_across([](std::vector<double>& values) { values[0] += 1; });
  OneWeight m;
  const at::Tensor before = m.w.detach().clone();
  EXPECT_FALSE(scaled_step(scaler, m, torch::ones({3})));
  EXPECT_TRUE(torch::equal(m.w, before));
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScaler, TrainerSkipsAnOverflowingStepInsteadOfStopping) {
  // A float32 model with a scaler (TrainOptions::grad_scaler): a batch with an inf input gives a
  // NaN loss and NaN gradients; the step is skipped and training goes on.
  torch::manual_seed(0);
  auto net = torch::nn::Linear(4, 2);
  TrainState state;
  state.model = net.ptr();
  state.forward = [net](const at::Tensor& x) mutable { return net->forward(x); };
  state.optimizer = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
  state.grad_scaler = std::make_unique<GradScaler>(GradScalerOptions().growth_interval(1));
  const at::Tensor x = torch::randn({6, 4});
  const at::Tensor y = torch::tensor({0, 1, 0, 1, 1, 0});
  at::Tensor bad = x.clone();
  bad[2][1] = std::numeric_limits<float>::infinity();
  const at::Tensor w0 = net->weight.detach().clone();
  EXPECT_TRUE(std::isnan(train_step(state, bad, y)));
  EXPECT_TRUE(torch::equal(net->weight, w0));
  EXPECT_EQ(state.grad_scaler->get_scale(), 32768.0);
  EXPECT_TRUE(std::isfinite(train_step(state, x, y)));
  EXPECT_FALSE(torch::equal(net->weight, w0));
  EXPECT_EQ(state.grad_scaler->get_scale(), 65536.0);
  // Without a scaler the same batch stops the run with its one-line reason.
  state.grad_scaler.reset();
  EXPECT_THROW(train_step(state, bad, y), Error);
}

TEST(GradScaler, Fp16PrecisionIsRefusedWhereTheCpuAutocastHasNoFloat16) {
  TrainOptions options;
  options.precision = ::shoal::train::Precision::kFp16;
  if (compat::cpu_autocast_supports(at::kHalf)) {
    EXPECT_NO_THROW(options.validate());
  } else {
    try {
      options.validate();
      FAIL() << "fp16 accepted without CPU float16 autocast";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("needs --device cuda"), std::string::npos) << what;
      EXPECT_NE(what.find("--precision bf16"), std::string::npos) << what;
    }
  }
  // On a GPU, fp16 passes validation on every LibTorch (CUDA autocast has float16 everywhere).
  options.device = "cuda";
  EXPECT_NO_THROW(options.validate());
  options.device = "gpu";
  EXPECT_THROW(options.validate(), InvalidArgument);
  options.device = "cuda:x";
  EXPECT_THROW(options.validate(), InvalidArgument);
}

}  // namespace
}  // namespace shoal::train
