// OpenMPI's MPI_Allreduce (float32, sum, in place) for comparison with shm_allreduce_bench:
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_allreduce_bench [rounds] [min] [max]
//
// Same loop as shm_allreduce_bench (rank 0's time per operation over ~0.15 s of back-to-back
// calls, sizes 4 KiB x4 ... 64 MiB), one JSON object per line.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  const size_t min_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 4096;
  const size_t max_bytes = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : (64u << 20);
  for (int round = 0; round < rounds; ++round) {
    for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      const int count = static_cast<int>(bytes / 4);
      std::vector<float> buf(count, 0.0f);
      for (int i = 0; i < 3; ++i) {
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
      long long iters = 0;
      if (rank == 0) {
        const double s = MPI_Wtime();
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        iters = std::clamp<long long>(static_cast<long long>(0.15 / (MPI_Wtime() - s)), 3, 20000);
      } else {
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
      MPI_Bcast(&iters, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
      MPI_Barrier(MPI_COMM_WORLD);
      const double s = MPI_Wtime();
      for (long long i = 0; i < iters; ++i) {
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
      const double per_op = (MPI_Wtime() - s) / iters;
      if (rank == 0) {
        std::printf("{\"round\":%d,\"op\":\"allreduce\",\"backend\":\"openmpi\",\"ranks\":%d,"
                    "\"bytes\":%zu,\"seconds\":%.9g,\"busbw\":%.6g}\n",
                    round, size, bytes, per_op, bytes * 2.0 * (size - 1) / size / per_op);
      }
    }
  }
  MPI_Finalize();
  return 0;
}
