#include "shoal/parallel/join.h"

#include <torch/torch.h>

#include <exception>

#include "shoal/error.h"

namespace shoal::parallel {
namespace {

Joinable& non_null(Joinable* joinable) {
  SHOAL_CHECK_T(InvalidArgument, joinable != nullptr, "Join: the joinable is null");
  return *joinable;
}

}  // namespace

namespace detail {

JoinStep allreduce_join_step(comm::ProcessGroup& group, const c10::Device& device, bool has_data,
                             const std::vector<int>& flags) {
  std::vector<int> values{has_data ? 1 : 0};
  values.insert(values.end(), flags.begin(), flags.end());
  auto tensor = torch::tensor(values, torch::kInt).to(device);
  comm::AllreduceOptions options;
  options.note = "join";
  group.allreduce(tensor, options)->wait();
  auto summed = tensor.cpu();
  auto acc = summed.accessor<int, 1>();
  JoinStep step;
  step.active_ranks = acc[0];
  for (size_t i = 1; i < values.size(); ++i) step.flags.push_back(acc[static_cast<int64_t>(i)]);
  return step;
}

}  // namespace detail

Join::Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options)
    : options_(options) {
  SHOAL_CHECK_T(InvalidArgument, !joinables.empty(), "Join: needs at least one joinable");
  for (auto& j : joinables) joinables_.push_back(&j.get());
  group_ = joinables_[0]->join_process_group();
  device_ = joinables_[0]->join_device();
  for (Joinable* joinable : joinables_) {
    SHOAL_CHECK_T(InvalidArgument, joinable->join_process_group() == group_,
                  "Join: every joinable must use the same process group");
    SHOAL_CHECK_T(InvalidArgument, !joinable->join_config_.enable,
                  "Join: a joinable is already in an open join scope");
  }
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "Join: the joinable's process group is null");
  for (Joinable* joinable : joinables_) hooks_.push_back(joinable->join_hook(options_));
  bool first = true;
  for (Joinable* joinable : joinables_) {
    joinable->join_config_ = JoinConfig{options_.enable, options_.throw_on_early_termination,
                                        first};
    first = false;
  }
}

Join::Join(Joinable* joinable, JoinOptions options)
    : Join(std::vector<std::reference_wrapper<Joinable>>{non_null(joinable)}, options) {}

Join::Join(Join&& other) noexcept
    : joinables_(std::move(other.joinables_)),
      hooks_(std::move(other.hooks_)),
      options_(other.options_),
      group_(std::move(other.group_)),
      device_(other.device_),
      finished_(other.finished_) {
  other.finished_ = true;
}

Join::~Join() noexcept(false) {
  if (finished_) return;
  if (std::uncaught_exceptions() > 0) {
    end_scope();
    return;
  }
  finish();
}

void Join::end_scope() {
  finished_ = true;
  for (Joinable* joinable : joinables_) joinable->join_config_ = JoinConfig{};
}

int64_t Join::finish() {
  SHOAL_CHECK(!finished_, "Join::finish() called twice");
  if (!options_.enable) {
    end_scope();
    return 0;
  }
  int64_t shadowed = 0;
  try {
    const std::vector<int> no_flags(joinables_[0]->join_flag_count(), 0);
    while (true) {
      const JoinStep step =
          detail::allreduce_join_step(*group_, device_, /*has_data=*/false, no_flags);
      if (step.active_ranks == 0) break;
      SHOAL_CHECK(!options_.throw_on_early_termination, group_->rank_prefix(),
                  " Join: this rank exhausted its inputs while ", step.active_ranks,
                  " rank(s) still have data (throw_on_early_termination)");
      for (auto& hook : hooks_) hook->main_hook(step);
      ++shadowed;
    }
    for (auto& hook : hooks_) hook->post_hook(/*is_last_joiner=*/shadowed == 0);
  } catch (...) {
    end_scope();
    throw;
  }
  end_scope();
  return shadowed;
}

std::optional<JoinStep> Join::notify_join_context(Joinable& joinable,
                                                  const std::vector<int>& flags) {
  const JoinConfig& config = joinable.join_config();
  if (!config.enable || !config.is_first_joinable) return std::nullopt;
  SHOAL_CHECK_T(InvalidArgument, flags.size() == joinable.join_flag_count(),
                "Join::notify_join_context: ", flags.size(), " flags given, the joinable declares ",
                joinable.join_flag_count());
  auto group = joinable.join_process_group();
  JoinStep step =
      detail::allreduce_join_step(*group, joinable.join_device(), /*has_data=*/true, flags);
  if (config.throw_on_early_termination && step.active_ranks < group->size()) {
    SHOAL_THROW(Error, group->rank_prefix(), " Join: ", group->size() - step.active_ranks,
                " rank(s) exhausted their inputs (throw_on_early_termination): stopping on every "
                "rank");
  }
  return step;
}

}  // namespace shoal::parallel
