#include "comm/tcp_store_wire.h"

#include <cstdlib>

namespace shoal::comm::wire {

std::vector<uint8_t> execute(Table& table, const uint8_t* request, size_t size, bool* ok) {
  Reader in(request, size);
  std::vector<uint8_t> out;
  const uint8_t op = in.u8();
  switch (op) {
    case kSet: {
      std::string key = in.string();
      std::vector<uint8_t> value = in.bytes();
      if (in.ok()) table[std::move(key)] = std::move(value);
      break;
    }
    case kGet: {
      const std::string key = in.string();
      auto it = table.find(key);
      out.push_back(it != table.end() ? 1 : 0);
      if (it != table.end()) put_bytes(out, it->second.data(), it->second.size());
      break;
    }
    case kAdd: {
      const std::string key = in.string();
      const int64_t delta = in.i64();
      if (!in.ok()) break;
      auto& stored = table[key];
      const std::string text(stored.begin(), stored.end());
      int64_t value = 0;
      if (__builtin_add_overflow(text.empty() ? 0 : std::strtoll(text.c_str(), nullptr, 10), delta, &value)) {
        *ok = false;
        break;
      }
      const std::string updated = std::to_string(value);  // as c10d stores counters: decimal text
      stored.assign(updated.begin(), updated.end());
      put_i64(out, value);
      break;
    }
    case kCheck: {
      const uint32_t count = in.u32();
      bool all = true;
      for (uint32_t i = 0; i < count && in.ok(); ++i) all = table.count(in.string()) > 0 && all;
      out.push_back(all ? 1 : 0);
      break;
    }
    case kDelete: {
      const std::string key = in.string();
      out.push_back(in.ok() && table.erase(key) > 0 ? 1 : 0);
      break;
    }
    default:
      *ok = false;
  }
  if (!in.ok() || !in.done()) *ok = false;
  return out;
}

}  // namespace shoal::comm::wire
