#include "parallel/bucket_cap_tuner.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

namespace shoal::parallel {

BucketCapTuner::Caps BucketCapTuner::start(const LayoutOf& layout_of, int64_t step) {
  started_ = true;
  std::vector<double> caps = options_.bucket_cap_candidates_mb;
  std::sort(caps.begin(), caps.end());
  caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
  std::vector<Caps> candidates;
  for (double cap : caps) candidates.push_back({options_.first_bucket_cap_mb, cap});
  for (double cap : caps) candidates.push_back({cap, cap});
  std::vector<std::vector<std::vector<size_t>>> layouts;  // the first candidate met names each
  for (const Caps& candidate : candidates) {
    auto layout = layout_of(candidate);
    if (std::find(layouts.begin(), layouts.end(), layout) != layouts.end()) continue;
    layouts.push_back(std::move(layout));
    caps_.push_back(candidate);
  }
  samples_.assign(caps_.size(), {});
  slot_ = 0;
  slot_start_ = step;
  ends_.clear();
  if (caps_.size() == 1) {  // nothing to choose between
    done_ = true;
    trials_.push_back({caps_[0].first_mb, caps_[0].cap_mb, std::nan("")});
  }
  return caps_[0];
}

std::optional<BucketCapTuner::Caps> BucketCapTuner::advance(int64_t step,
                                                             comm::ProcessGroup& group) {
  if (done_) return std::nullopt;
  const int64_t per_slot = 1 + options_.bucket_cap_tuning_steps;
  if (step - slot_start_ < per_slot) return std::nullopt;
  const size_t candidate = slot_ % caps_.size();
  for (size_t i = 1; i < ends_.size(); ++i) {
    samples_[candidate].push_back(std::chrono::duration<double>(ends_[i] - ends_[i - 1]).count());
  }
  ends_.clear();
  ++slot_;
  slot_start_ = step;
  if (slot_ < caps_.size() * static_cast<size_t>(options_.bucket_cap_tuning_rounds)) {
    return caps_[slot_ % caps_.size()];
  }
  return decide(group);
}

BucketCapTuner::Caps BucketCapTuner::decide(comm::ProcessGroup& group) {
  auto medians = torch::empty({static_cast<int64_t>(caps_.size())}, torch::kDouble);
  for (size_t c = 0; c < caps_.size(); ++c) {
    auto& v = samples_[c];
    double m = std::numeric_limits<double>::infinity();
    if (!v.empty()) {
      std::sort(v.begin(), v.end());
      m = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    }
    medians[static_cast<int64_t>(c)] = m;
  }
  comm::AllreduceOptions max;
  max.op = comm::ReduceOp::kMax;
  group.allreduce(medians, max)->wait();
  auto m = medians.accessor<double, 1>();
  size_t best = 0;
  for (size_t c = 0; c < caps_.size(); ++c) {
    trials_.push_back({caps_[c].first_mb, caps_[c].cap_mb, m[static_cast<int64_t>(c)]});
    if (m[static_cast<int64_t>(c)] < m[static_cast<int64_t>(best)]) best = c;
  }
  done_ = true;
  samples_.clear();
  return caps_[best];
}

void BucketCapTuner::backward_ended() {
  if (started_ && !done_) ends_.push_back(std::chrono::steady_clock::now());
}

std::string BucketCapTuner::describe_trials() const {
  std::ostringstream tried;
  tried << std::setprecision(3);
  for (size_t c = 0; c < trials_.size(); ++c) {
    tried << (c ? ", " : "") << trials_[c].first_bucket_cap_mb << "/" << trials_[c].bucket_cap_mb
          << " MiB " << trials_[c].seconds * 1e3 << " ms";
  }
  return tried.str();
}

}  // namespace shoal::parallel
