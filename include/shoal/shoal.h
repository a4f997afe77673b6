// Shoal in one include: every public header (test_docs_flags checks that none is missing), and
// the names a training loop uses most lifted into namespace shoal.
//
// The namespaces follow the layers, as torch.distributed's modules do:
//   shoal::comm        process groups and collectives   (torch.distributed)
//   shoal::parallel    DistributedDataParallel, SyncBatchNorm, comm hooks (torch.nn.parallel)
//   shoal::data        DistributedSampler, datasets      (torch.utils.data)
//   shoal::checkpoint  torch.save-compatible files, state dicts, checkpoint folders
//   shoal::train       the built-in Trainer and its strategies
//   shoal::pipeline    pipeline and model parallelism  (torch.distributed.pipelining)
//   shoal::ps          the parameter server's servers and workers
//   shoal::models, shoal::launcher, shoal::memory: the built-in models and TorchScript files,
//   `shoal run` as a function, the CPU allocator tuning.
// A loop needs only the aliases below: shoal::init_process_group, shoal::DistributedDataParallel,
// shoal::DistributedSampler, shoal::save / shoal::load_state_dict_file, ... The module namespaces
// stay the reference (and hold the less common names).
#pragma once

#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/log.h"

#include "shoal/comm/device_mesh.h"
#include "shoal/comm/flight_recorder.h"
#include "shoal/comm/init.h"
#include "shoal/comm/op_label.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"
#include "shoal/comm/types.h"
#include "shoal/comm/work.h"

#include "shoal/parallel/comm_hooks.h"
#include "shoal/parallel/data_parallel.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/fault_tolerant_manager.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "shoal/parallel/grad_bucket.h"
#include "shoal/parallel/join.h"
#include "shoal/parallel/local_sgd.h"
#include "shoal/parallel/no_sync.h"
#include "shoal/parallel/sync_batch_norm.h"
#include "shoal/parallel/tensor_parallel.h"

#include "shoal/data/batch_dataset.h"
#include "shoal/data/cifar10.h"
#include "shoal/data/data_loader.h"
#include "shoal/data/distributed_sampler.h"
#include "shoal/data/exactly_once_sampler.h"
#include "shoal/data/fashion_mnist.h"
#include "shoal/data/image_folder.h"
#include "shoal/data/synthetic_dataset.h"
#include "shoal/data/tensor_file.h"
#include "shoal/data/token_block_dataset.h"
#include "shoal/data/token_file.h"
#include "shoal/data/tokenize.h"

#include "shoal/models/cnn.h"
#include "shoal/models/gpt.h"
#include "shoal/models/gpt_config.h"
#include "shoal/models/layer_forward_hooks.h"
#include "shoal/models/mlp.h"
#include "shoal/models/model.h"
#include "shoal/models/registry.h"
#include "shoal/models/script_model.h"
#include "shoal/models/transformer.h"

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/checkpoint/training_state.h"

#include "shoal/train/clip_grad.h"
#include "shoal/train/data_parallel_strategy.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/fault_tolerant_ddp_strategy.h"
#include "shoal/train/fsdp_strategy.h"
#include "shoal/train/grad_scaler.h"
#include "shoal/train/local_sgd_strategy.h"
#include "shoal/train/loss.h"
#include "shoal/train/metrics_writer.h"
#include "shoal/train/model_parallel_ddp_strategy.h"
#include "shoal/train/pipeline_strategy.h"
#include "shoal/train/progress.h"
#include "shoal/train/ps_strategy.h"
#include "shoal/train/strategy.h"
#include "shoal/train/strategy_spec.h"
#include "shoal/train/tp_strategy.h"
#include "shoal/train/train_option_table.h"
#include "shoal/train/train_options.h"
#include "shoal/train/trainer.h"

#include "shoal/pipeline/model_parallel.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/pipeline/pipeline_checkpoint.h"
#include "shoal/pipeline/pipeline_grid.h"
#include "shoal/pipeline/pipeline_partition.h"
#include "shoal/pipeline/pipeline_sequential.h"
#include "shoal/pipeline/schedule.h"
#include "shoal/pipeline/tied_parameters.h"

#include "shoal/ps/consistency.h"
#include "shoal/ps/job.h"
#include "shoal/ps/partition.h"
#include "shoal/ps/server.h"
#include "shoal/ps/shard_optimizer.h"
#include "shoal/ps/worker.h"

#include "shoal/launcher/launch.h"

#include "shoal/memory/cpu_allocator.h"

#include "shoal/summary/summary_writer.h"

#include "shoal/trace/tracer.h"

namespace shoal {

// torch.distributed
using comm::init_process_group;
using comm::InitOptions;
using comm::ProcessGroup;
using comm::ReduceOp;
// torch.nn.parallel / torch.nn (DistributedDataParallel is lifted by its own header)
using parallel::convert_sync_batchnorm;
using parallel::SyncBatchNorm;
// torch.utils.data
using data::DistributedSampler;
// torch.save / torch.load and state dicts
using checkpoint::CheckpointManager;
using checkpoint::load_state_dict;
using checkpoint::load_state_dict_file;
using checkpoint::save_state_dict;
using checkpoint::state_dict;
using checkpoint::StateDict;
// the built-in trainer
using train::DdpStrategy;
using train::Trainer;
using train::TrainOptions;

}  // namespace shoal
