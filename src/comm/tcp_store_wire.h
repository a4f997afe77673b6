// The TCP store's frames (private to tcp_store*.cpp): after the handshake, each request is
// u32 length, u8 op, fields; each reply is u32 length, fields. Strings are u32 length + bytes,
// integers little-endian. Lengths are checked against kMaxFrame before any allocation.
//
// Requests and replies:
//   kSet       key value                      -> (empty)
//   kGet       key                            -> u8 found [value]        (never waits)
//   kAdd       key i64 delta                  -> i64 new value
//   kCheck     u32 n, n keys                  -> u8 all exist
//   kDelete    key                            -> u8 existed
//   kWait      u32 n, n keys, i64 timeout_ms  -> u8 all exist             (answered when they do,
//                                                                          or 0 at the time-out)
//   kMultiGet  u32 n, n keys, i64 timeout_ms  -> u8 all exist [n values] (waits as kWait)
//   kMultiSet  u32 n, n (key value)           -> (empty)
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace shoal::comm::wire {

// Largest frame either side accepts: store values are addresses and ids (bytes to kilobytes).
constexpr uint32_t kMaxFrame = 64u << 20;

enum Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCheck = 4,
  kDelete = 5,
  kWait = 6,
  kMultiGet = 7,
  kMultiSet = 8,
};
/// One past the largest op: the size of a per-op counter array.
constexpr int kOpCount = 9;
/// The ops' names, by value ("set", ...; "?" for unused values).
const char* op_name(int op);

inline void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void put_i64(std::vector<uint8_t>& out, int64_t value) {
  const auto v = static_cast<uint64_t>(value);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void put_bytes(std::vector<uint8_t>& out, const void* data, size_t size) {
  put_u32(out, static_cast<uint32_t>(size));
  const auto* p = static_cast<const uint8_t*>(data);
  out.insert(out.end(), p, p + size);
}
inline void put_string(std::vector<uint8_t>& out, const std::string& s) { put_bytes(out, s.data(), s.size()); }

/// Reads fields from a frame; every read is bounds-checked (ok() turns false instead).
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool ok() const { return ok_; }
  bool done() const { return p_ == end_; }
  uint8_t u8() { return ok_ && p_ < end_ ? *p_++ : fail(); }
  uint32_t u32() {
    if (!ok_ || end_ - p_ < 4) return fail();
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p_[i]) << (8 * i);
    p_ += 4;
    return v;
  }
  int64_t i64() {
    if (!ok_ || end_ - p_ < 8) return fail();
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p_[i]) << (8 * i);
    p_ += 8;
    return static_cast<int64_t>(v);
  }
  std::vector<uint8_t> bytes() {
    const uint32_t n = u32();
    if (!ok_ || static_cast<size_t>(end_ - p_) < n) return fail(), std::vector<uint8_t>();
    std::vector<uint8_t> out(p_, p_ + n);
    p_ += n;
    return out;
  }
  std::string string() {
    const auto b = bytes();
    return std::string(b.begin(), b.end());
  }

 private:
  uint8_t fail() {
    ok_ = false;
    return 0;
  }
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

/// The store's keys and values.
using Table = std::map<std::string, std::vector<uint8_t>>;

/// Runs one request frame's body of an op that never waits (all but kWait and kMultiGet) against
/// `table` and returns the reply's body; appends the keys it created or changed to `*changed`; sets
/// *ok to false when the request is malformed, so that the server drops the client.
std::vector<uint8_t> execute(Table& table, const uint8_t* request, size_t size, bool* ok,
                             std::vector<std::string>* changed);

/// A kWait or kMultiGet request.
struct WaitRequest {
  uint8_t op = 0;
  std::vector<std::string> keys;
  int64_t timeout_ms = 0;
};

/// Parses a kWait or kMultiGet body; false when malformed.
bool parse_wait(const uint8_t* request, size_t size, WaitRequest* out);

/// The index of the first of `keys` at or after `from` that `table` lacks; keys.size() when none.
size_t first_missing(const Table& table, const std::vector<std::string>& keys, size_t from = 0);

/// The reply to a wait request: `ready` (every key exists) and, for kMultiGet, the values.
std::vector<uint8_t> answer_wait(const Table& table, const WaitRequest& request, bool ready);

}  // namespace shoal::comm::wire
