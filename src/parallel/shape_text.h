// A tensor's shape as text ("[2, 3]"), for the error messages of the parallel wrappers.
// Stateless; any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <sstream>
#include <string>

namespace shoal::parallel {

inline std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace shoal::parallel
