#include "comm/mpi/mpi_runtime.h"

#include <string>

#include "shoal/error.h"

namespace shoal::comm {

MpiRuntime& MpiRuntime::get() {
  // Process-wide because MPI is: MPI_Init may run once per process and MPI_Finalize once at exit.
  static MpiRuntime runtime;
  return runtime;
}

MpiRuntime::MpiRuntime() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&thread_level_);
  } else {
    int finalized = 0;
    MPI_Finalized(&finalized);
    SHOAL_CHECK(!finalized, "mpi: MPI was already finalized in this process; create the mpi "
                            "process group before anything calls MPI_Finalize");
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level_);
    SHOAL_CHECK(rc == MPI_SUCCESS, "mpi: MPI_Init_thread failed: ", mpi_error_string(rc));
    initialized_here_ = true;
  }
  // One worker thread per group issues MPI calls; the caller's thread issues point-to-point ones.
  // Below SERIALIZED that is not allowed at all; SERIALIZED is made safe by lock().
  SHOAL_CHECK(thread_level_ >= MPI_THREAD_SERIALIZED,
              "mpi: the MPI library grants thread level ", thread_level_,
              " but Shoal needs MPI_THREAD_SERIALIZED or better; initialize MPI with "
              "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let Shoal initialize it");
}

MpiRuntime::~MpiRuntime() {
  if (!initialized_here_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  std::lock_guard<std::mutex> guard(state_mutex_);
  // MPI_Finalize waits for every pending request; after a time-out one never completes, and a
  // process that exits without finalizing is reported by mpirun, which is right after a failure.
  if (!abandoned_) MPI_Finalize();
}

std::unique_lock<std::mutex> MpiRuntime::lock() {
  if (thread_level_ >= MPI_THREAD_MULTIPLE) return std::unique_lock<std::mutex>();
  return std::unique_lock<std::mutex>(mutex_);
}

void MpiRuntime::note_abandoned_request() {
  std::lock_guard<std::mutex> guard(state_mutex_);
  abandoned_ = true;
}

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return "MPI error " + std::to_string(code);
  }
  return std::string(text, length);
}

}  // namespace shoal::comm
