// MpiRuntime: the MPI library of this process (MPI_Init_thread once, MPI_Finalize once at exit).
//
// MPI's state is process-wide by definition, so this is the one place that holds process-wide
// state in the MPI backend: whether Shoal initialized MPI (then it finalizes it at exit), the
// thread level MPI granted (below MPI_THREAD_MULTIPLE every MPI call is serialized through lock()),
// and whether an operation was abandoned after a time-out (then MPI_Finalize is skipped, because
// it would wait forever for the abandoned request).
//
// Thread safety: every method may be called from any thread.
#pragma once

// Only MPI's C API is used; its deprecated C++ bindings would need libmpi_cxx at link time.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <mutex>

namespace shoal::comm {

class MpiRuntime {
 public:
  /// Initializes MPI (MPI_THREAD_MULTIPLE asked, at least MPI_THREAD_SERIALIZED required) unless
  /// someone else already did, and returns the runtime. Throws shoal::Error when MPI cannot run.
  static MpiRuntime& get();

  /// Held around every MPI call when MPI did not grant MPI_THREAD_MULTIPLE; empty otherwise.
  std::unique_lock<std::mutex> lock();

  /// An MPI request was abandoned (time-out, dead peer): do not call MPI_Finalize at exit.
  void note_abandoned_request();

  /// The thread level MPI granted.
  int thread_level() const { return thread_level_; }

  ~MpiRuntime();

 private:
  MpiRuntime();
  bool initialized_here_ = false;
  int thread_level_ = MPI_THREAD_SINGLE;
  bool abandoned_ = false;
  std::mutex mutex_;
  std::mutex state_mutex_;
};

/// MPI_Error_string of an MPI return code.
std::string mpi_error_string(int code);

}  // namespace shoal::comm
