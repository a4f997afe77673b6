#include "compat/optimizer_state.h"

#include <sstream>
#include <string>
#include <type_traits>

namespace shoal::compat {
namespace {

template <typename Map>
typename Map::key_type state_key(const at::Tensor& param) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    // As 1.13's c10::guts::to_string (gone in 2.x) writes the address: through an ostream.
    std::ostringstream key;
    key << static_cast<const void*>(param.unsafeGetTensorImpl());
    return key.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

}  // namespace

torch::optim::OptimizerParamState* find_param_state(torch::optim::Optimizer& optimizer,
                                                    const at::Tensor& param) {
  auto& state = optimizer.state();
  auto it = state.find(state_key<std::decay_t<decltype(state)>>(param));
  return it == state.end() ? nullptr : it->second.get();
}

void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                     std::unique_ptr<torch::optim::OptimizerParamState> value) {
  auto& state = optimizer.state();
  state[state_key<std::decay_t<decltype(state)>>(param)] = std::move(value);
}

}  // namespace shoal::compat
