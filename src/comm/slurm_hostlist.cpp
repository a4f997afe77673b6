#include "comm/slurm_hostlist.h"

#include <cctype>
#include <algorithm>
#include <cstdint>

#include "shoal/error.h"

namespace shoal::comm {
namespace {

// Why a bound: a bracket like "[1-99999999]" would otherwise fill memory; no cluster has a million
// nodes in one job. It holds for the whole list, counted before anything is expanded.
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

uint64_t saturating_mul(uint64_t a, uint64_t b) {
  uint64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? UINT64_MAX : product;
}

uint64_t saturating_add(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? UINT64_MAX : sum;
}

/// One range of a bracket ("08-10": 8 to 10, written 2 wide).
struct Range {
  uint64_t from = 0;
  uint64_t to = 0;
  size_t width = 0;
};

/// Text before a bracket and the bracket's ranges: "rack[1-2]" is {"rack", {1-2}}.
struct Group {
  std::string prefix;
  std::vector<Range> ranges;
  uint64_t count = 0;  // the numbers the ranges hold
};

// The ranges of one bracket's inside ("01-04,07"), checked; nothing is expanded.
Group parse_bracket(std::string prefix, const std::string& inside, const std::string& hostlist,
                    const std::string& what) {
  auto fail = [&](const std::string& why) {
    SHOAL_THROW(InvalidArgument, what, "='", hostlist, "' is not a SLURM hostlist: ", why,
                " (write names like gpu[01-04,07],login1)");
  };
  if (inside.empty()) fail("a bracket is empty");
  Group group{std::move(prefix), {}, 0};
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
    const Range parsed{std::stoull(low), std::stoull(high), low.size()};
    if (parsed.to < parsed.from) fail("the range '" + range + "' runs backwards");
    group.count = saturating_add(group.count, parsed.to - parsed.from + 1);
    if (group.count > kMaxHosts) fail("more than " + std::to_string(kMaxHosts) + " hosts");
    group.ranges.push_back(parsed);
    start = end + 1;
  }
  return group;
}

// One name with zero or more bracket groups ("rack[1-2]-n[01-02]"), checked; nothing is expanded.
std::vector<Group> parse_name(const std::string& name, const std::string& hostlist,
                              const std::string& what) {
  std::vector<Group> groups;
  size_t pos = 0;
  while (pos < name.size()) {
    const size_t open = name.find('[', pos);
    if (open == std::string::npos) {
      // Text after the last bracket group: SLURM refuses "n[1-3]x"; a plain name is fine.
      if (pos > 0) {
        SHOAL_THROW(InvalidArgument, what, "='", hostlist, "' is not a SLURM hostlist: '", name,
                    "' has text after its last bracket (write names like gpu[01-04,07],login1)");
      }
      groups.push_back(Group{name, {}, 1});
      break;
    }
    const size_t close = name.find(']', open);
    const size_t next_open = name.find('[', open + 1);
    SHOAL_CHECK_T(InvalidArgument, close != std::string::npos && close < next_open, what, "='",
                  hostlist, "' is not a SLURM hostlist: '", name,
                  "' has an unclosed bracket (write names like gpu[01-04,07],login1)");
    SHOAL_CHECK_T(InvalidArgument, name.find(']', pos) == close, what, "='", hostlist,
                  "' is not a SLURM hostlist: '", name, "' has a ']' without '['");
    groups.push_back(parse_bracket(name.substr(pos, open - pos),
                                   name.substr(open + 1, close - open - 1), hostlist, what));
    pos = close + 1;
  }
  SHOAL_CHECK_T(InvalidArgument, name.find(']', pos) == std::string::npos, what, "='", hostlist,
                "' is not a SLURM hostlist: '", name, "' has a ']' without '['");
  return groups;
}

// Appends the hosts of `groups` from group `g` on, after `head`, the first group the slowest,
// until `out` holds `limit`.
void generate(const std::vector<Group>& groups, size_t g, std::string& head, size_t limit,
              std::vector<std::string>& out) {
  if (g == groups.size()) {
    out.push_back(head);
    return;
  }
  const Group& group = groups[g];
  const size_t kept = head.size();
  if (group.ranges.empty()) {  // a plain name
    head += group.prefix;
    generate(groups, g + 1, head, limit, out);
    head.resize(kept);
    return;
  }
  for (const Range& range : group.ranges) {
    for (uint64_t n = range.from; n <= range.to && out.size() < limit; ++n) {
      head += group.prefix;
      head += pad(n, range.width);
      generate(groups, g + 1, head, limit, out);
      head.resize(kept);
    }
  }
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist, const std::string& what,
                                               size_t max_hosts) {
  // The whole list is checked and its hosts counted before any is written out: a few KB of
  // brackets can name billions, and a caller wanting the first host needs only that one.
  std::vector<std::vector<Group>> names;
  uint64_t total = 0;
  std::string name;
  int depth = 0;
  auto flush = [&] {
    if (name.empty()) return;
    names.push_back(parse_name(name, hostlist, what));
    uint64_t count = 1;
    for (const Group& group : names.back()) count = saturating_mul(count, group.count);
    total = saturating_add(total, count);
    SHOAL_CHECK_T(InvalidArgument, total <= kMaxHosts, what, " names more than ", kMaxHosts,
                  " hosts (", hostlist.size(), " characters; '", name.substr(0, 40),
                  name.size() > 40 ? "...'" : "'", " reaches ", total == UINT64_MAX ? std::string("2^64") : std::to_string(total),
                  "): not a SLURM job's node list");
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
  std::vector<std::string> hosts;
  hosts.reserve(static_cast<size_t>(std::min<uint64_t>(total, max_hosts)));
  for (const auto& groups : names) {
    if (hosts.size() >= max_hosts) break;
    std::string head;
    generate(groups, 0, head, max_hosts, hosts);
  }
  return hosts;
}

}  // namespace shoal::comm
