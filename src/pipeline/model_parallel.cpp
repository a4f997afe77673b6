#include "shoal/pipeline/model_parallel.h"

#include <torch/torch.h>

#include <condition_variable>
#include <limits>
#include <mutex>

#include "parallel/replica_threads.h"
#include "shoal/error.h"

namespace shoal::pipeline {

std::vector<size_t> balanced_split(const std::vector<int64_t>& parameter_counts, size_t parts) {
  const size_t n = parameter_counts.size();
  SHOAL_CHECK_T(InvalidArgument, parts >= 1 && parts <= n, "ModelParallel: cannot split ", n,
                " children into ", parts, " non-empty parts");
  std::vector<int64_t> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + parameter_counts[i];
  // best[k][i]: the smallest possible largest part when the first i children form k parts.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(parts + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<size_t>> cut(parts + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= parts; ++k) {
    for (size_t i = k; i <= n; ++i) {
      for (size_t j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == kInf) continue;
        const int64_t largest = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        // Ties go to the later cut, so that parameter-free layers (activations) stay with the
        // layer before them.
        if (largest <= best[k][i]) {
          best[k][i] = largest;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<size_t> starts(parts);
  size_t end = n;
  for (size_t k = parts; k >= 1; --k) {
    starts[k - 1] = cut[k][end];
    end = cut[k][end];
  }
  return starts;
}

namespace {

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& p : module.parameters()) count += p.numel();
  return count;
}

}  // namespace

ModelParallelImpl::ModelParallelImpl(torch::nn::Sequential sequential,
                                     std::vector<at::Device> devices, ModelParallelOptions options)
    : options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument, !devices.empty(), "ModelParallel: no devices given");
  std::vector<int64_t> counts;
  for (const auto& child : sequential->named_children()) {
    counts.push_back(parameter_count(*child.value()));
  }
  const std::vector<size_t> starts = balanced_split(counts, devices.size());
  std::vector<size_t> child_parts;
  size_t part = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    while (part + 1 < starts.size() && i >= starts[part + 1]) ++part;
    child_parts.push_back(part);
  }
  build(std::move(sequential), child_parts, devices);
}

ModelParallelImpl::ModelParallelImpl(torch::nn::Sequential sequential,
                                     const std::map<std::string, at::Device>& placement,
                                     ModelParallelOptions options)
    : options_(std::move(options)) {
  // Consecutive children on the same device form one part.
  std::vector<size_t> child_parts;
  std::vector<at::Device> devices;
  for (const auto& child : sequential->named_children()) {
    auto found = placement.find(child.key());
    SHOAL_CHECK_T(InvalidArgument, found != placement.end(), "ModelParallel: child '", child.key(),
                  "' has no device in the placement map");
    if (devices.empty() || devices.back() != found->second) devices.push_back(found->second);
    child_parts.push_back(devices.size() - 1);
  }
  SHOAL_CHECK_T(InvalidArgument, placement.size() == child_parts.size(),
                "ModelParallel: the placement map names ", placement.size(),
                " children; the Sequential has ", child_parts.size());
  build(std::move(sequential), child_parts, devices);
}

ModelParallelImpl::~ModelParallelImpl() = default;

void ModelParallelImpl::build(torch::nn::Sequential sequential,
                              const std::vector<size_t>& child_parts,
                              const std::vector<at::Device>& devices) {
  const auto children = sequential->named_children();
  SHOAL_CHECK_T(InvalidArgument, !children.is_empty() && children.size() == sequential->size(),
                "ModelParallel: needs a non-empty Sequential");
  parts_.resize(devices.size());
  for (size_t p = 0; p < devices.size(); ++p) parts_[p].device = devices[p];
  size_t i = 0;
  for (auto it = sequential->begin(); it != sequential->end(); ++it, ++i) {
    Part& part = parts_[child_parts[i]];
    register_module(children[i].key(), children[i].value());
    children[i].value()->to(part.device);
    part.names.push_back(children[i].key());
    part.modules.push_back(*it);
  }
}

std::vector<std::string> ModelParallelImpl::part_names(int64_t part) const {
  return parts_.at(part).names;
}

at::Tensor ModelParallelImpl::run_part(size_t part, at::Tensor x) {
  Part& p = parts_[part];
  if (x.device() != p.device) x = x.to(p.device);
  for (auto& module : p.modules) x = module.forward(x);
  return x;
}

at::Tensor ModelParallelImpl::forward(at::Tensor input) {
  if (options_.chunks() <= 1 || parts_.size() == 1) {
    for (size_t p = 0; p < parts_.size(); ++p) input = run_part(p, std::move(input));
    return input;
  }
  return forward_micro_batches(input);
}

at::Tensor ModelParallelImpl::forward_micro_batches(const at::Tensor& input) {
  const int64_t dim = c10::maybe_wrap_dim(options_.dim(), input.dim());
  const std::vector<at::Tensor> micro = input.chunk(options_.chunks(), dim);
  const size_t parts = parts_.size();
  const size_t count = micro.size();
  if (!threads_) {
    threads_ = std::make_unique<parallel::ReplicaThreads>(static_cast<int>(parts),
                                                          options_.intra_op_threads());
  }
  // flow->activations[p][m]: micro-batch m's input to part p (p == parts: the outputs).
  struct Flow {
    std::mutex mutex;
    std::condition_variable ready;
    std::vector<std::vector<at::Tensor>> activations;
    bool failed = false;
  };
  auto flow = std::make_shared<Flow>();
  flow->activations.assign(parts + 1, std::vector<at::Tensor>(count));
  flow->activations[0] = micro;
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout();
  auto job = std::make_shared<const std::function<void(int)>>([this, flow, count, deadline](int p) {
    try {
      for (size_t m = 0; m < count; ++m) {
        at::Tensor x;
        {
          std::unique_lock<std::mutex> lock(flow->mutex);
          const bool ready = flow->ready.wait_until(lock, deadline, [&] {
            return flow->failed || flow->activations[p][m].defined();
          });
          if (flow->failed) return;  // another part failed; it reports why
          SHOAL_CHECK_T(TimeoutError, ready, "ModelParallel: part ", p, " waited past the deadline for micro-batch ", m,
                        " from part ", p - 1);
          x = std::move(flow->activations[p][m]);
        }
        at::Tensor y = run_part(static_cast<size_t>(p), std::move(x));
        std::lock_guard<std::mutex> lock(flow->mutex);
        flow->activations[p + 1][m] = std::move(y);
        flow->ready.notify_all();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(flow->mutex);
      flow->failed = true;
      flow->ready.notify_all();
      throw;
    }
  });
  const auto outcomes = threads_->run(static_cast<int>(parts), std::move(job), options_.timeout());
  for (size_t p = 0; p < outcomes.size(); ++p) {
    if (!outcomes[p].error) continue;
    SHOAL_THROW(Error, "ModelParallel: part ", p, " (", parts_[p].device.str(), ", children ",
                parts_[p].names.front(), "..", parts_[p].names.back(), ") failed in forward: ",
                parallel::ReplicaThreads::message_of(outcomes[p].error));
  }
  return at::cat(flow->activations[parts], dim);
}

}  // namespace shoal::pipeline
