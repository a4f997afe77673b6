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

#include "shoal/comm/process_group.h"
#include "shoal/parallel/grad_bucket.h"

namespace shoal::parallel {

/// Averages the bucket across ranks with an allreduce of ReduceOp::kAvg (DDP's default).
CommHook allreduce_hook(std::shared_ptr<comm::ProcessGroup> group);

/// Casts the bucket to float16, averages it across ranks, and casts the result back.
CommHook fp16_compress_hook(std::shared_ptr<comm::ProcessGroup> group);

/// Casts the bucket to bfloat16, averages it across ranks, and casts the result back.
CommHook bf16_compress_hook(std::shared_ptr<comm::ProcessGroup> group);

/// PyTorch's fp16_compress_wrapper / bf16_compress_wrapper: runs `hook` on the bucket cast to
/// float16 / bfloat16 and casts its result back (e.g. around powerSGD_hook).
CommHook fp16_compress_wrapper(CommHook hook);
CommHook bf16_compress_wrapper(CommHook hook);

/// PyTorch's PowerSGDState: the options and the state kept between iterations.
struct PowerSGDState {
  /// Rank r of the approximation P Q^T of each gradient matrix (n x m sends (n + m) r values).
  int64_t matrix_approximation_rank = 1;
  /// Plain allreduce for this many iterations first (PyTorch's default 1000): compression from
  /// the start hurts accuracy.
  int64_t start_powerSGD_iter = 1000;
  /// Add last step's compression error to this step's gradients (error feedback).
  bool use_error_feedback = true;
  /// Start each step's power iteration from last step's Q (warm start).
  bool warm_start = true;
  /// Seed of the random initial Q (identical on every rank).
  uint64_t random_seed = 0;

  int64_t iteration = 0;  ///< synchronised backward passes seen (incremented at the last bucket)
  double bytes_sent = 0;  ///< bytes this rank passed to allreduces (all iterations)
  std::map<size_t, at::Tensor> error, p_memory, q_memory;  ///< per bucket index
};

/// PyTorch's powerSGD_hook: each gradient matrix M (a parameter's gradient viewed as
/// shape[0] x rest) is averaged as a rank-r approximation: P = M Q allreduced and
/// orthonormalised, Q = M^T P allreduced, M ~ P Q^T / world; vectors and matrices too small to
/// gain are allreduced whole. The state is shared by the hook calls; keep one per DDP instance.
CommHook powerSGD_hook(std::shared_ptr<comm::ProcessGroup> group,
                       std::shared_ptr<PowerSGDState> state);

}  // namespace shoal::parallel
