// The c10d store held behind compat::C10dStoreRef (compat-internal: includes c10d headers).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace shoal::compat {

struct C10dStoreRef {
  c10::intrusive_ptr<c10d::Store> store;
};

}  // namespace shoal::compat
