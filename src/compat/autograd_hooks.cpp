// compat/autograd_hooks.h for LibTorch 1.13 and 2.x: a post hook on the parameter's
// AccumulateGrad node (FunctionPostHook's signature is the same in both; the node pointer is a
// std::shared_ptr in 1.13 and a c10::intrusive_ptr in recent 2.x, hence NodePtr below).
#include "compat/autograd_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <unordered_set>

namespace shoal::compat {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
// A node's owning pointer: std::shared_ptr in LibTorch 1.13, c10::intrusive_ptr in later 2.x.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

class PostHook : public torch::autograd::FunctionPostHook {
 public:
  explicit PostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

class AccumulatorHook : public GradAccumulatedHook {
 public:
  AccumulatorHook(NodePtr node, std::function<void()> fn) : node_(std::move(node)) {
    key_ = node_->add_post_hook(std::make_unique<PostHook>(std::move(fn)));
  }
  ~AccumulatorHook() override { node_->del_post_hook(key_); }
  const void* accumulator() const override { return node_.get(); }

 private:
  NodePtr node_;
  uintptr_t key_ = 0;
};

}  // namespace

std::unique_ptr<GradAccumulatedHook> add_grad_accumulated_hook(const at::Tensor& param,
                                                               std::function<void()> fn) {
  auto node = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(node, "add_grad_accumulated_hook: the tensor is not a leaf that requires grad");
  return std::make_unique<AccumulatorHook>(std::move(node), std::move(fn));
}

void queue_backward_callback(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

bool in_reentrant_backward() {
  // LibTorch 1.13 exposes the current GraphTask only through pointers to its members; the task's
  // re-entrant depth (0 for a backward() called outside any other) is read next to one of them.
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr) return false;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
  const auto* task = reinterpret_cast<const torch::autograd::GraphTask*>(
      reinterpret_cast<const char*>(nodes) - offsetof(torch::autograd::GraphTask, nodes_in_graph_));
#pragma GCC diagnostic pop
  return task->reentrant_depth_ > 0;
}

std::vector<bool> reachable_parameters(const std::vector<at::Tensor>& outputs,
                                       const std::vector<const GradAccumulatedHook*>& hooks) {
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    // A leaf output's own accumulator is reached through grad_accumulator, not grad_fn.
    auto fn = out.grad_fn() ? out.grad_fn() : torch::autograd::impl::try_get_grad_accumulator(out);
    if (fn && seen.insert(fn.get()).second) stack.push_back(fn.get());
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      Node* next = edge.function.get();
      if (next != nullptr && seen.insert(next).second) stack.push_back(next);
    }
  }
  std::vector<bool> reachable(hooks.size());
  for (size_t i = 0; i < hooks.size(); ++i) {
    reachable[i] = seen.count(static_cast<const Node*>(hooks[i]->accumulator())) > 0;
  }
  return reachable;
}

}  // namespace shoal::compat
