#include "shoal/memory/cpu_allocator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "shoal/env.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace shoal::memory {
namespace {

#if defined(__GLIBC__)
// glibc's upper bound for M_MMAP_THRESHOLD on 64-bit systems (4 MiB * sizeof(long)); blocks
// above it are mmap'ed whatever is set.
constexpr int kMmapThreshold = 32 << 20;
// Free memory at the top of the heap kept rather than returned to the system.
constexpr int kTrimThreshold = 1 << 30;
// Extra heap grown at once, so that a step's first large allocations do not each move the break.
constexpr int kTopPad = 64 << 20;

bool user_set(const char* name) { return std::getenv(name) != nullptr; }

bool apply() {
  if (!env::flag(env::Var::kTuneMalloc)) return false;
  bool ok = true;
  // Each setting is left alone when the user chose it through glibc's own variables.
  if (!user_set("MALLOC_MMAP_THRESHOLD_")) ok = mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && ok;
  if (!user_set("MALLOC_TRIM_THRESHOLD_")) ok = mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1 && ok;
  if (!user_set("MALLOC_TOP_PAD_")) ok = mallopt(M_TOP_PAD, kTopPad) == 1 && ok;
  return ok;
}
#else
bool apply() { return false; }
#endif

}  // namespace

bool tune_cpu_allocator() {
  static const bool applied = apply();
  return applied;
}

long long heap_bytes_in_use() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return static_cast<long long>(info.uordblks + info.hblkhd);
#else
  return -1;
#endif
}

}  // namespace shoal::memory
