#include "parallel/module_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>
#include <unordered_set>

#include "parallel/shape_text.h"
#include "shoal/error.h"

namespace shoal::parallel {
namespace {

// Room for one parameter's description when ranks disagree ("name\tshape\tdtype").
constexpr int64_t kDescriptionBytes = 512;

std::string describe(const std::string& name, const at::Tensor& t) {
  return name + "\t" + shape_of(t) + "\t" + std::string(c10::toString(t.scalar_type())) + "\t" +
         (t.requires_grad() ? "grad" : "nograd");
}

// FNV-1a: the same value in every process of the same program, unlike std::hash's contract.
int64_t fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return static_cast<int64_t>(hash >> 1);
}

std::vector<at::Tensor> allgather(comm::ProcessGroup& group, const at::Tensor& input) {
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < group.size(); ++r) outputs.push_back(torch::empty_like(input));
  group.allgather(outputs, input)->wait();
  return outputs;
}

std::vector<std::string> split_tabs(const std::string& text) {
  std::vector<std::string> parts;
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, '\t')) parts.push_back(part);
  parts.resize(4);
  return parts;
}

}  // namespace

// The module's parameters, each tensor once under its first name (tied weights: one tensor
// registered under two names is reduced once, as PyTorch deduplicates by identity).
torch::OrderedDict<std::string, at::Tensor> unique_named_parameters(
    const torch::nn::Module& module) {
  torch::OrderedDict<std::string, at::Tensor> unique;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      unique.insert(item.key(), item.value());
    }
  }
  return unique;
}

// Checks that every rank holds the same parameters; on a mismatch every rank throws the same
// message naming the first parameter that differs and how.
void verify_same_parameters(comm::ProcessGroup& group,
                            const torch::OrderedDict<std::string, at::Tensor>& named,
                            const char* who) {
  std::vector<std::string> descriptions;
  uint64_t hash = 1469598103934665603ull;
  for (const auto& item : named) {
    descriptions.push_back(describe(item.key(), item.value()));
    hash = static_cast<uint64_t>(fnv1a(descriptions.back(), hash));
  }
  auto summary = torch::tensor({static_cast<int64_t>(hash), static_cast<int64_t>(named.size())},
                               torch::kLong);
  auto summaries = allgather(group, summary);
  int64_t max_count = 0;
  bool same = true;
  for (const auto& s : summaries) {
    same = same && torch::equal(s, summaries[0]);
    max_count = std::max(max_count, s[1].item<int64_t>());
  }
  if (same) return;

  // Find the first parameter index whose description differs on some rank.
  auto hashes = torch::full({max_count}, -1, torch::kLong);
  for (size_t i = 0; i < descriptions.size(); ++i) hashes[i] = fnv1a(descriptions[i]);
  auto all_hashes = allgather(group, hashes);
  int64_t index = 0;
  int other = 1;
  for (; index < max_count; ++index) {
    bool found = false;
    for (int r = 1; r < group.size() && !found; ++r) {
      if (all_hashes[r][index].item<int64_t>() != all_hashes[0][index].item<int64_t>()) {
        other = r;
        found = true;
      }
    }
    if (found) break;
  }
  auto text = torch::zeros({kDescriptionBytes}, torch::kByte);
  if (index < static_cast<int64_t>(descriptions.size())) {
    const auto& d = descriptions[index];
    std::memcpy(text.data_ptr(), d.data(), std::min<size_t>(d.size(), kDescriptionBytes - 1));
  }
  auto texts = allgather(group, text);
  auto read = [&](int r) {
    return split_tabs(std::string(static_cast<const char*>(texts[r].data_ptr())));
  };
  auto a = read(0), b = read(other);
  std::ostringstream why;
  why << group.rank_prefix() << " " << who << ": the model differs between ranks: ";
  if (a[0].empty() || b[0].empty()) {
    why << "rank 0 has " << summaries[0][1].item<int64_t>() << " parameters but rank " << other
        << " has " << summaries[other][1].item<int64_t>();
  } else if (a[0] != b[0]) {
    why << "parameter #" << index << " is '" << a[0] << "' on rank 0 but '" << b[0] << "' on rank "
        << other;
  } else if (a[1] != b[1]) {
    why << "parameter '" << a[0] << "' has shape " << a[1] << " on rank 0 but " << b[1]
        << " on rank " << other;
  } else if (a[2] != b[2]) {
    why << "parameter '" << a[0] << "' has dtype " << a[2] << " on rank 0 but " << b[2]
        << " on rank " << other;
  } else {
    why << "parameter '" << a[0] << "' requires grad on one of rank 0 and rank " << other
        << " but not on the other";
  }
  why << "; every rank must construct the same model";
  throw InvalidArgument(why.str());
}

// Broadcasts rank `root`'s tensors to every rank, one collective per dtype.
void broadcast_coalesced(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                         int root) {
  torch::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) by_type[t.scalar_type()].push_back(t);
  }
  for (auto& [type, list] : by_type) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.reshape({-1}));
    auto buffer = torch::cat(flat);
    comm::BroadcastOptions options;
    options.root = root;
    group.broadcast(buffer, options)->wait();
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace shoal::parallel
