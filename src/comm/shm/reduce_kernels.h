// Element-wise reduction kernels of the shared-memory backend.
//
// reduce_sources() combines up to kMaxSources arrays of one dtype into one or two destinations:
// dst[i] = op(src[0][i], src[1][i], ...), applied in source order so that every rank that reduces
// the same sources gets bit-identical results. float16 and bfloat16 are widened to float32 in
// registers, combined there and rounded once; avg divides the combined value by `divisor`.
// The loops are written for the compiler to vectorise; an AVX2/F16C build of them is chosen at run
// time when the CPU has it.
//
// Thread safety: pure functions.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "shoal/comm/types.h"

namespace shoal::comm::shm {

/// Sources a single call may combine: the largest shm group (a bound on a sanity check only).
constexpr int kMaxSources = 1024;

struct ReduceArgs {
  void* dst = nullptr;          ///< may alias src[k] (element-wise in place)
  void* dst2 = nullptr;         ///< optional second destination, written with the same values
  const void* const* src = nullptr;
  int num_src = 0;
  size_t count = 0;             ///< elements
  at::ScalarType dtype = at::kFloat;
  ReduceOp op = ReduceOp::kSum;
  int divisor = 1;              ///< for kAvg: the number of ranks
};

void reduce_sources(const ReduceArgs& args);

/// True when the AVX2/F16C variant is in use (for benchmark reports).
bool reduce_kernels_use_avx2();

}  // namespace shoal::comm::shm
