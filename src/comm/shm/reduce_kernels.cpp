#include "comm/shm/reduce_kernels.h"

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "shoal/error.h"

// The kernels are memory-bound loops that GCC vectorises at -O3 but not at the -O2 of a Release
// build (whose cheap cost model gives up on the widening float16/bfloat16 loops).
#pragma GCC optimize("O3")

namespace shoal::comm::shm {

namespace baseline {
#define SHOAL_KERNELS_F16C 0
#include "comm/shm/reduce_kernels_impl.h"
#undef SHOAL_KERNELS_F16C
}  // namespace baseline

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define SHOAL_KERNELS_F16C 1
#include "comm/shm/reduce_kernels_impl.h"
#undef SHOAL_KERNELS_F16C
}  // namespace avx2
#pragma GCC pop_options

namespace {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
}

// Decided once; the CPU does not change under a running process.
const bool kUseAvx2 = cpu_has_avx2();

}  // namespace

void reduce_sources(const ReduceArgs& args) {
  SHOAL_CHECK(args.num_src >= 1 && args.num_src <= kMaxSources, "shm: ", args.num_src,
              " sources to reduce; 1..", kMaxSources, " are supported per call");
  if (args.count == 0) return;
  if (kUseAvx2) {
    avx2::reduce(args);
  } else {
    baseline::reduce(args);
  }
}

bool reduce_kernels_use_avx2() { return kUseAvx2; }

}  // namespace shoal::comm::shm
