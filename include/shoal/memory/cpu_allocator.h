// Keeping freed CPU memory for reuse, so that training steps stop page-faulting.
//
// A training step allocates and frees the same large tensors (activations, gradients, buckets)
// every iteration. glibc serves blocks above its mmap threshold with mmap and gives them back on
// free, and trims the top of the heap when enough of it is free; either way the next step's
// allocation of the same size is fresh memory that faults in page by page (~1-11 us a page on the
// machines Shoal is tested on: thousands of faults a step for a small CNN, a third of its step
// time). Worse, glibc moves its thresholds as it sees frees, so two ranks of one DDP job that
// allocated in a different order fault at different rates and the faster one waits at every
// gradient reduction.
//
// tune_cpu_allocator() fixes glibc's thresholds instead: blocks up to 32 MiB (glibc's largest
// threshold) come from the heap, and freed memory is kept, so after the first step a training
// loop reuses the same pages. Peak memory does not change (the process already needed it at the
// peak); what changes is that it is not returned to the system between steps.
//
// DistributedDataParallel and Trainer call it unless told not to; a user's own MALLOC_* settings
// (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_) and SHOAL_TUNE_MALLOC=0 win.
// Without glibc (or under another allocator preloaded, which glibc's mallopt no longer governs)
// it does nothing.
//
// Thread safety: call from any thread; the first call decides, later calls do nothing.
#pragma once

namespace shoal::memory {

/// Applies the settings above once per process. Returns true if they are in effect (applied now
/// or earlier), false if the environment opted out or the C library is not glibc.
bool tune_cpu_allocator();

/// Bytes the C library's allocator has handed out and not had back, over all its arenas (glibc's
/// mallinfo2: heap blocks in use plus mmap'ed blocks): the memory a process's tensors and other
/// objects hold right now, without the freed memory the allocator keeps (which peak RSS counts, and
/// which varies from run to run with the order of frees). -1 without glibc. Walks the allocator's
/// free lists under its locks: microseconds, not for every operation.
long long heap_bytes_in_use();

}  // namespace shoal::memory
