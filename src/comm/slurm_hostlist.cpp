#include "comm/slurm_hostlist.h"

#include <cctype>
#include <cstdint>

#include "shoal/error.h"

namespace shoal::comm {
namespace {

// Why a bound: a bracket like "[1-99999999]" would otherwise fill memory; no cluster has a million
// nodes in one job.
constexpr uint64_t kMaxHosts = 1u << 20;

bool all_digits(const std::string& text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

std::string pad(uint64_t value, size_t width) {
  std::string digits = std::to_string(value);
  if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
  return digits;
}

// The numbers of one bracket's inside ("01-04,07"), as written (zero-padded to each range's width).
std::vector<std::string> expand_bracket(const std::string& inside, const std::string& hostlist,
                                        const std::string& what) {
  auto fail = [&](const std::string& why) {
    SHOAL_THROW(InvalidArgument, what, "='", hostlist, "' is not a SLURM hostlist: ", why,
                " (write names like gpu[01-04,07],login1)");
  };
  if (inside.empty()) fail("a bracket is empty");
  std::vector<std::string> numbers;
  size_t start = 0;
  while (start <= inside.size()) {
    size_t end = inside.find(',', start);
    if (end == std::string::npos) end = inside.size();
    const std::string range = inside.substr(start, end - start);
    const size_t dash = range.find('-');
    const std::string low = range.substr(0, dash);
    const std::string high = dash == std::string::npos ? low : range.substr(dash + 1);
    if (!all_digits(low) || !all_digits(high) || low.size() > 18 || high.size() > 18) {
      fail("'" + range + "' in a bracket is not a number or a range a-b");
    }
    const uint64_t from = std::stoull(low);
    const uint64_t to = std::stoull(high);
    if (to < from) fail("the range '" + range + "' runs backwards");
    if (to - from >= kMaxHosts || numbers.size() + (to - from) >= kMaxHosts) {
      fail("more than " + std::to_string(kMaxHosts) + " hosts");
    }
    for (uint64_t n = from; n <= to; ++n) numbers.push_back(pad(n, low.size()));
    start = end + 1;
  }
  return numbers;
}

// One name with zero or more bracket groups: "rack[1-2]-n[01-02]".
void expand_name(const std::string& name, const std::string& hostlist, const std::string& what,
                 std::vector<std::string>& out) {
  std::vector<std::string> partial{""};
  size_t pos = 0;
  while (pos < name.size()) {
    const size_t open = name.find('[', pos);
    if (open == std::string::npos) {
      // Text after the last bracket group: SLURM refuses "n[1-3]x"; a plain name is fine.
      if (pos > 0) {
        SHOAL_THROW(InvalidArgument, what, "='", hostlist, "' is not a SLURM hostlist: '", name,
                    "' has text after its last bracket (write names like gpu[01-04,07],login1)");
      }
      partial.front() = name;
      break;
    }
    const size_t close = name.find(']', open);
    const size_t next_open = name.find('[', open + 1);
    SHOAL_CHECK_T(InvalidArgument, close != std::string::npos && close < next_open, what, "='",
                  hostlist, "' is not a SLURM hostlist: '", name,
                  "' has an unclosed bracket (write names like gpu[01-04,07],login1)");
    SHOAL_CHECK_T(InvalidArgument, name.find(']', pos) == close, what, "='", hostlist,
                  "' is not a SLURM hostlist: '", name, "' has a ']' without '['");
    const std::string prefix = name.substr(pos, open - pos);
    const auto numbers = expand_bracket(name.substr(open + 1, close - open - 1), hostlist, what);
    SHOAL_CHECK_T(InvalidArgument, partial.size() * numbers.size() < kMaxHosts, what, "='",
                  hostlist, "' names more than ", kMaxHosts, " hosts");
    std::vector<std::string> grown;
    grown.reserve(partial.size() * numbers.size());
    for (const auto& head : partial) {
      for (const auto& number : numbers) grown.push_back(head + prefix + number);
    }
    partial = std::move(grown);
    pos = close + 1;
  }
  SHOAL_CHECK_T(InvalidArgument, name.find(']', pos) == std::string::npos, what, "='", hostlist,
                "' is not a SLURM hostlist: '", name, "' has a ']' without '['");
  for (auto& host : partial) out.push_back(std::move(host));
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist,
                                               const std::string& what) {
  std::vector<std::string> hosts;
  std::string name;
  int depth = 0;
  auto flush = [&] {
    if (!name.empty()) expand_name(name, hostlist, what, hosts);
    name.clear();
  };
  for (char c : hostlist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    SHOAL_CHECK_T(InvalidArgument, depth == 0 || depth == 1, what, "='", hostlist,
                  "' is not a SLURM hostlist: brackets do not nest (write names like "
                  "gpu[01-04,07],login1)");
    if (depth == 0 && (c == ',' || std::isspace(static_cast<unsigned char>(c)))) {
      flush();
    } else {
      name += c;
    }
  }
  SHOAL_CHECK_T(InvalidArgument, depth == 0, what, "='", hostlist,
                "' is not a SLURM hostlist: a bracket is not closed (write names like "
                "gpu[01-04,07],login1)");
  flush();
  return hosts;
}

}  // namespace shoal::comm
