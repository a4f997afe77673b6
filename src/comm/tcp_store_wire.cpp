#include "comm/tcp_store_wire.h"

#include <cstdlib>

namespace shoal::comm::wire {

namespace {

std::vector<std::string> read_keys(Reader& in) {
  const uint32_t count = in.u32();
  std::vector<std::string> keys;
  // Each key takes at least its 4-byte length: a count beyond what the frame holds is malformed.
  for (uint32_t i = 0; i < count && in.ok(); ++i) keys.push_back(in.string());
  return keys;
}

// One key and value from `in` into `table` (nothing when the request is cut short).
void set_one(Table& table, Reader& in, std::vector<std::string>* changed) {
  std::string key = in.string();
  std::vector<uint8_t> value = in.bytes();
  if (!in.ok()) return;
  changed->push_back(key);
  table[std::move(key)] = std::move(value);
}

}  // namespace

const char* op_name(int op) {
  static const char* const kNames[kOpCount] = {"?",     "set",  "get",      "add",      "check",
                                               "delete", "wait", "multi_get", "multi_set"};
  return op >= 0 && op < kOpCount ? kNames[op] : "?";
}

bool parse_wait(const uint8_t* request, size_t size, WaitRequest* out) {
  Reader in(request, size);
  out->op = in.u8();
  out->keys = read_keys(in);
  out->timeout_ms = in.i64();
  return in.ok() && in.done() && (out->op == kWait || out->op == kMultiGet);
}

size_t first_missing(const Table& table, const std::vector<std::string>& keys, size_t from) {
  while (from < keys.size() && table.count(keys[from]) > 0) ++from;
  return from;
}

std::vector<uint8_t> answer_wait(const Table& table, const WaitRequest& request, bool ready) {
  std::vector<uint8_t> out{static_cast<uint8_t>(ready ? 1 : 0)};
  if (!ready || request.op != kMultiGet) return out;
  for (const auto& key : request.keys) {
    const auto& value = table.at(key);
    put_bytes(out, value.data(), value.size());
  }
  return out;
}

std::vector<uint8_t> execute(Table& table, const uint8_t* request, size_t size, bool* ok,
                             std::vector<std::string>* changed) {
  Reader in(request, size);
  std::vector<uint8_t> out;
  const uint8_t op = in.u8();
  switch (op) {
    case kSet:
      set_one(table, in, changed);
      break;
    case kMultiSet: {
      const uint32_t count = in.u32();
      for (uint32_t i = 0; i < count && in.ok(); ++i) set_one(table, in, changed);
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
      changed->push_back(key);
      put_i64(out, value);
      break;
    }
    case kCheck: {
      const auto keys = read_keys(in);
      out.push_back(first_missing(table, keys) == keys.size() ? 1 : 0);
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
