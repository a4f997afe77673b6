// Store's default batched calls, and the prefix store.
#include <utility>

#include "shoal/comm/store.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// Keys of a base store under "prefix/", as c10d's PrefixStore names them; batched calls reach the
// base store as one batch.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base)
      : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    base_->set(prefix_ + key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override { return base_->get(prefix_ + key); }
  int64_t add(const std::string& key, int64_t delta) override { return base_->add(prefix_ + key, delta); }
  bool check(const std::vector<std::string>& keys) override { return base_->check(prefixed(keys)); }
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    base_->wait(prefixed(keys), timeout);
  }
  bool delete_key(const std::string& key) override { return base_->delete_key(prefix_ + key); }
  std::vector<std::vector<uint8_t>> multi_get(const std::vector<std::string>& keys) override {
    return base_->multi_get(prefixed(keys));
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<uint8_t>>& values) override {
    base_->multi_set(prefixed(keys), values);
  }
  Milliseconds timeout() const override { return base_->timeout(); }
  void set_timeout(Milliseconds timeout) override { base_->set_timeout(timeout); }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& key : keys) out.push_back(prefix_ + key);
    return out;
  }

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace

std::vector<std::vector<uint8_t>> Store::multi_get(const std::vector<std::string>& keys) {
  std::vector<std::vector<uint8_t>> values;
  values.reserve(keys.size());
  for (const auto& key : keys) values.push_back(get(key));
  return values;
}

void Store::multi_set(const std::vector<std::string>& keys,
                      const std::vector<std::vector<uint8_t>>& values) {
  SHOAL_CHECK_T(InvalidArgument, keys.size() == values.size(), "store multi_set: ", keys.size(),
                " keys but ", values.size(), " values");
  for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
}

std::shared_ptr<Store> make_prefix_store(const std::string& prefix, std::shared_ptr<Store> base) {
  return std::make_shared<PrefixStore>(prefix, std::move(base));
}

}  // namespace shoal::comm
