// Keeping a helper thread's tensor work on that thread, and setting a process's compute threads.
//
// LibTorch's intra-op parallelism (at::parallel_for) runs, in builds with OpenMP (Debian's 1.13 and
// PyPI's 2.x both), an `omp parallel` region whose team size is the calling thread's own OpenMP
// setting: at::set_num_threads(n) sets it for the thread that calls it only, and a thread started
// later (a DataLoader worker) gets OpenMP's default, one thread per core. Its index_select and
// normalisation then wake a team of threads that spin after the region and take the cores from
// the training step (measured: the step ran ~20% slower with 2 workers on 2 cores). PyTorch's
// DataLoader workers call torch.set_num_threads(1) for the same reason; here at::set_num_threads
// would also resize the process-wide thread pools the training step uses, so only this thread's
// OpenMP team size is set (omp_set_num_threads, found at run time: no link-time OpenMP dependency;
// nothing to do in a build without OpenMP).
//
// OpenBLAS (Debian's LibTorch calls it for matrix products) keeps a thread pool of its own, sized
// from OPENBLAS_NUM_THREADS or OMP_NUM_THREADS when it loads, else one thread per core, and
// at::set_num_threads does not resize it. Its products round differently with another count of
// threads, so a run's weights depended on the environment it was started in (shoal's launcher
// sets OMP_NUM_THREADS=1, srun passes the user's, usually none). set_compute_threads sets both.
//
// Thread safety: run_intra_op_serially_on_this_thread affects the calling thread only;
// set_compute_threads the whole process (call it before training starts).
#pragma once

namespace shoal::compat {

/// Makes LibTorch's parallel regions started by the calling thread run on it alone.
void run_intra_op_serially_on_this_thread();

/// LibTorch's intra-op threads (at::set_num_threads) and OpenBLAS's, when it is loaded: `threads`
/// each, so that the same count gives the same results however the process was started.
void set_compute_threads(int threads);

}  // namespace shoal::compat
