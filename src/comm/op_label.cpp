#include "shoal/comm/op_label.h"

#include <cstdio>

#include "shoal/error.h"

namespace shoal::comm {

const char* dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    default: return c10::toString(type);
  }
}

std::string describe_elements(int64_t numel, at::ScalarType dtype) {
  const double bytes = static_cast<double>(numel) * c10::elementSize(dtype);
  char text[48];
  if (bytes >= 1e6) {
    std::snprintf(text, sizeof text, "%.1f MB %s", bytes / 1e6, dtype_name(dtype));
  } else if (bytes >= 1e3) {
    std::snprintf(text, sizeof text, "%.1f kB %s", bytes / 1e3, dtype_name(dtype));
  } else {
    std::snprintf(text, sizeof text, "%.0f B %s", bytes, dtype_name(dtype));
  }
  return text;
}

std::string rank_prefix(int rank, int size) {
  return detail::str_cat("[rank ", rank, "/", size, "]");
}

std::string OpLabel::description() const {
  std::string text = detail::str_cat(name, " #", sequence);
  std::string inner = this->detail;
  if (inner.empty() && numel >= 0 && dtype != at::ScalarType::Undefined) {
    inner = describe_elements(numel, dtype);
    if (device != c10::DeviceType::CPU) {
      inner += detail::str_cat(" on ", c10::DeviceTypeName(device, /*lower_case=*/true));
    }
    if (peer_role == PeerRole::kDestination) inner += detail::str_cat(" to rank ", peer);
    if (peer_role == PeerRole::kSource) inner += detail::str_cat(" from rank ", peer);
    if (reduce_op >= 0) {
      inner += detail::str_cat(", ", to_string(static_cast<ReduceOp>(reduce_op)));
    }
    if (root >= 0) inner += detail::str_cat(", root ", root);
    if (tag >= 0) inner += detail::str_cat(", tag ", tag);
  }
  if (!inner.empty()) text += detail::str_cat(" (", inner, ")");
  return text;
}

std::string OpLabel::prefix() const {
  return detail::str_cat(rank_prefix(rank, size), " ", description());
}

}  // namespace shoal::comm
