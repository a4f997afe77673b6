#include "shoal/train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

// Redrawing the bar more often than this costs terminal time and is unreadable anyway.
constexpr std::chrono::milliseconds kBarRedrawInterval{100};
// Width of the bar itself, leaving room for the numbers on an 80-column terminal.
constexpr int kBarWidth = 24;

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const auto total = static_cast<int64_t>(std::llround(seconds));
  char text[32];
  if (total >= 3600) {
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", static_cast<long long>(total / 3600),
                  static_cast<long long>(total / 60 % 60), static_cast<long long>(total % 60));
  } else {
    std::snprintf(text, sizeof text, "%lld:%02lld", static_cast<long long>(total / 60),
                  static_cast<long long>(total % 60));
  }
  return text;
}

}  // namespace

Progress::Progress(ProgressMode mode, int64_t epochs, int64_t total_samples, int64_t log_interval,
                   std::FILE* out, std::FILE* summary_out)
    : mode_(mode),
      epochs_(epochs),
      total_samples_(total_samples),
      log_interval_(log_interval),
      out_(out),
      summary_out_(summary_out) {
  if (mode_ == ProgressMode::kAuto) {
    mode_ = (out_ != nullptr && ::isatty(::fileno(out_))) ? ProgressMode::kBar : ProgressMode::kLines;
  }
  if (out_ == nullptr) mode_ = ProgressMode::kNone;
}

void Progress::start_epoch(int64_t epoch, int64_t steps, int64_t samples) {
  epoch_ = epoch;
  epoch_steps_ = steps;
  epoch_samples_ = samples;
  done_before_epoch_ = done_;
  epoch_start_ = Clock::now();
  last_draw_ = Clock::time_point{};
  if (mode_ == ProgressMode::kBar) draw_bar(0, 0, std::nan(""), true);
}

double Progress::rate() const {
  const double epoch_seconds = std::chrono::duration<double>(Clock::now() - epoch_start_).count();
  const double seconds = trained_seconds_before_epoch_ + epoch_seconds;
  return seconds > 0 ? static_cast<double>(done_) / seconds : 0;
}

void Progress::step(int64_t step, int64_t samples, double loss) {
  done_ = done_before_epoch_ + samples;
  if (mode_ == ProgressMode::kBar) {
    draw_bar(step, samples, loss, step == epoch_steps_);
  } else if (mode_ == ProgressMode::kLines && log_interval_ > 0 &&
             (step % log_interval_ == 0 || step == epoch_steps_)) {
    const double r = rate();
    const double eta = r > 0 ? static_cast<double>(total_samples_ - done_) / r : NAN;
    std::fprintf(out_, "epoch %lld/%lld step %lld/%lld  %lld/%lld samples  loss %.4f  %.0f samples/s  ETA %s\n",
                 static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_),
                 static_cast<long long>(step), static_cast<long long>(epoch_steps_),
                 static_cast<long long>(samples), static_cast<long long>(epoch_samples_), loss, r,
                 format_duration(eta).c_str());
    std::fflush(out_);
  }
}

void Progress::draw_bar(int64_t step, int64_t samples, double loss, bool force) {
  const Clock::time_point now = Clock::now();
  if (!force && now - last_draw_ < kBarRedrawInterval) return;
  last_draw_ = now;
  const double fraction =
      epoch_samples_ > 0 ? static_cast<double>(samples) / static_cast<double>(epoch_samples_) : 0;
  const int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar(kBarWidth, ' ');
  std::fill(bar.begin(), bar.begin() + std::min(filled, kBarWidth), '=');
  if (filled < kBarWidth) bar[filled] = '>';
  const double r = rate();
  const double eta = r > 0 ? static_cast<double>(total_samples_ - done_) / r : NAN;
  char loss_text[32] = "loss -";
  if (std::isfinite(loss)) std::snprintf(loss_text, sizeof loss_text, "loss %.4f", loss);
  // \r returns to the line start; \033[K clears what a longer previous line left behind.
  std::fprintf(out_, "\repoch %lld/%lld [%s] %3.0f%%  %s  %.0f samples/s  ETA %s\033[K",
               static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_), bar.c_str(),
               fraction * 100, loss_text, r, format_duration(eta).c_str());
  std::fflush(out_);
  bar_visible_ = true;
}

void Progress::end_epoch(const EpochResult& result) {
  trained_seconds_before_epoch_ += result.seconds;
  if (bar_visible_) {
    std::fprintf(out_, "\r\033[K");
    std::fflush(out_);
    bar_visible_ = false;
  }
  if (summary_out_ != nullptr) {
    // Accuracy only where it means something (class targets).
    char accuracy[48] = "";
    if (!std::isnan(result.test_accuracy)) {
      std::snprintf(accuracy, sizeof(accuracy), ", test accuracy %.4f", result.test_accuracy);
    }
    char perplexity[48] = "";
    if (!std::isnan(result.test_perplexity)) {
      std::snprintf(perplexity, sizeof(perplexity), ", test perplexity %.4g",
                    result.test_perplexity);
    }
    std::fprintf(summary_out_,
                 "epoch %lld/%lld: train loss %.4f, test loss %.4f%s%s (%.0f samples/s, %.1f s)\n",
                 static_cast<long long>(result.epoch), static_cast<long long>(epochs_),
                 result.train_loss, result.test_loss, accuracy, perplexity, result.samples_per_s,
                 result.seconds);
    std::fflush(summary_out_);
  }
}

}  // namespace shoal::train
