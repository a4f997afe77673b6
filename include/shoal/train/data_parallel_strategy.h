// DataParallelStrategy: `shoal train --strategy dp --replicas K`, one process whose model is
// wrapped in DataParallel over K CPU slots (K GPUs with CUDA): each step's batch is split into K
// chunks that run forward and backward in parallel on the slots' threads, and the summed
// gradients land on the model, so training equals single-process training on the same batches.
//
// Thread safety: as Strategy; one instance per trainer.
#pragma once

#include <memory>
#include <string>

#include "shoal/train/strategy.h"

namespace shoal::parallel {
class DataParallelBase;
}

namespace shoal::train {

class DataParallelStrategy : public Strategy {
 public:
  std::string name() const override { return "dp"; }
  /// `model_name` names the built-in model (replicas are made by models::create).
  DataParallelStrategy(int replicas, std::string model_name);
  ~DataParallelStrategy() override;

  void prepare(TrainState& state) override;

 private:
  int replicas_;
  std::string model_name_;
  std::shared_ptr<parallel::DataParallelBase> dp_;
};

}  // namespace shoal::train
