#include "shoal/ps/consistency.h"

#include "shoal/error.h"

namespace shoal::ps {

const char* consistency_name(Consistency consistency) {
  switch (consistency) {
    case Consistency::kBsp: return "bsp";
    case Consistency::kAsp: return "asp";
    case Consistency::kSsp: return "ssp";
  }
  return "unknown";
}

Consistency parse_consistency(const std::string& name) {
  if (name == "bsp") return Consistency::kBsp;
  if (name == "asp") return Consistency::kAsp;
  if (name == "ssp") return Consistency::kSsp;
  SHOAL_THROW(InvalidArgument, "unknown consistency '", name, "'; give bsp, asp or ssp");
}

}  // namespace shoal::ps
