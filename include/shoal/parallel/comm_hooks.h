// The built-in communication hooks of DistributedDataParallel (PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.default_hooks): plain allreduce, and allreduce with
// the bucket compressed to float16 or bfloat16 (half the bytes on the wire, ~3 significant digits);
// the compress wrappers around any hook, and PowerSGD (powerSGD_hook) low-rank compression.
//
// Thread safety: the returned hooks hold the process group; DDP calls them from one thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>

#include "shoal/comm/process_group.h"
#include "shoal/parallel/grad_bucket.h"

namespace shoal::parallel {

/// Averages the bucket across ranks with an allreduce of ReduceOp::kAvg (DDP's default).
/// async_op = false: the hook returns the bucket reduced (comm::AllreduceOptions::async_op).
CommHook allreduce_hook(std::shared_ptr<comm::ProcessGroup> group, bool async_op = true);

/// Casts the bucket to float16, averages it across ranks, and casts the result back.
CommHook fp16_compress_hook(std::shared_ptr<comm::ProcessGroup> group);

/// Casts the bucket to bfloat16, averages it across ranks, and casts the result back.
CommHook bf16_compress_hook(std::shared_ptr<comm::ProcessGroup> group);

/// PyTorch's fp16_compress_wrapper / bf16_compress_wrapper: runs `hook` on the bucket cast to
/// float16 / bfloat16 and casts its result back (e.g. around powerSGD_hook).
CommHook fp16_compress_wrapper(CommHook hook);
CommHook bf16_compress_wrapper(CommHook hook);

/// PyTorch's PowerSGDState: the options (PyTorch's names and defaults) and the state kept between
/// iterations. Keep one per DDP instance.
struct PowerSGDState {
  /// Rank r of the approximation P Q^T of each gradient matrix (n x m sends (n + m) r values).
  int64_t matrix_approximation_rank = 1;
  /// Plain allreduce for this many iterations first (PyTorch's default 1000): compression from
  /// the start hurts accuracy. At least 2 with error feedback or warm start (DDP rebuilds its
  /// buckets after iteration 1, which would scramble the per-bucket memories).
  int64_t start_powerSGD_iter = 1000;
  /// A matrix is compressed only when (n + m) r * min_compression_rate < n m.
  double min_compression_rate = 2;
  /// Add last step's compression error to this step's gradients (error feedback).
  bool use_error_feedback = true;
  /// Start each step's power iteration from last step's Q (warm start).
  bool warm_start = true;
  /// Added to each column's norm in the orthogonalisation (0, PyTorch's default: an all-zero
  /// gradient matrix then gives NaN, as in PyTorch; 1e-8 avoids that).
  double orthogonalization_epsilon = 0;
  /// Seeds the random initial Qs, identical on every rank. As in PyTorch: each bucket that needs
  /// fresh Qs draws a seed from a Mersenne Twister seeded with random_seed (numpy's
  /// RandomState(random_seed).randint(10^9)), and its Qs are torch::randn from a generator with
  /// that seed, matrix after matrix (grouped by shape): the same Qs as PyTorch's hook.
  uint64_t random_seed = 0;

  int64_t iteration = 0;  ///< synchronised backward passes seen (incremented at the last bucket)
  double bytes_sent = 0;  ///< bytes this rank passed to allreduces (all iterations)
  std::map<size_t, at::Tensor> error, p_memory, q_memory;  ///< per bucket index
  /// Per bucket index, reused from step to step (no allocation once the buckets are stable): the
  /// gradients with the error added, and the uncompressed tensors flattened.
  std::map<size_t, at::Tensor> input_copy, uncompressed_memory;
  std::mt19937 rng;         ///< the seeds' generator, seeded from random_seed at the first use
  bool rng_seeded = false;
};

/// PyTorch's powerSGD_hook: each gradient matrix M (a parameter's gradient viewed as
/// shape[0] x rest) worth compressing (min_compression_rate) is averaged as a rank-r
/// approximation: P = M Q allreduced and orthonormalised, Q = M^T P allreduced,
/// M ~ P Q^T / world (with warm start, last step's Q, orthonormalised, starts the iteration);
/// the other tensors (vectors, small matrices) are allreduced whole in one flat tensor. The
/// collectives are issued in the same order on every rank (P's allreduce is waited for in the
/// hook, Q's completes at the bucket's wait).
CommHook powerSGD_hook(std::shared_ptr<comm::ProcessGroup> group,
                       std::shared_ptr<PowerSGDState> state);

}  // namespace shoal::parallel
