// Sharded checkpoints: each rank of a sharded data-parallel job (FullyShardedDataParallel) writes
// its own piece of the parameters and of the optimizer state, the counterpart of PyTorch FSDP's
// SHARDED_STATE_DICT saved through torch.distributed.checkpoint. No rank ever holds the whole
// model or optimizer state to save it.
//
// A sharded checkpoint is a folder "<dir>/checkpoint_000012.sharded/" beside the numbered files
// of CheckpointManager. CheckpointManager::save_sharded writes it as a PyTorch DCP folder (the
// keys FSDP2's get_state_dict gives, nested under "model" and "optim"):
//   "__<rank>_0.distcp"  each rank's chunks: its piece of every flat unit cut into boxes of the
//                        parameters it covers ('model.<name>') and the same boxes of the piece's
//                        optimizer state ('optim.state.<name>.<field>'), and its element of
//                        'shoal.save_id' (random, drawn by rank 0 for that save)
//   rank 0's file also   each parameter's 'optim.state.<name>.step', the replicated tensors
//                        ('model.<name>' whole), the param_groups as bytes entries, and the bytes
//                        entry 'shoal': epoch, step, sampler, config, RNG, state-dict keys, save id
//   ".metadata"          written by rank 0 once every rank's file is complete (the chunks' places
//                        gathered by one allreduce), then "latest" points at it
// A folder without `.metadata` is an abandoned save (CheckpointManager removes it at the next
// save). load_sharded_dcp() assembles every tensor whole and refuses a rank file whose save id
// differs from Shoal's entry.
//
// The earlier layout (still read, and rewritten by convert_sharded_to_dcp): "rank_0.pt" ...
// "rank_<N-1>.pt", one per rank, each an ordinary Shoal torch.save file (atomic write, checksum
// manifest) holding:
//   'shoal_sharded'      metadata: format version, this file's rank, the world size, the model's
//                        parameter count and state-dict key order, and every flat unit's name,
//                        parameter names, shapes, offsets in the flat buffer, parameter indices
//                        (in model.parameters() order), element count and padded count
//   'flat_param_shards'  [tensor per unit]: this rank's piece of the unit's flat parameters, the
//                        rank-th of world_size equal pieces of the padded buffer
//   'optimizer_shards'   [dict per unit]: the optimizer state of that piece ('exp_avg', ...,
//                        'step'), as Python's optimizer.state_dict() names it
//   'model', 'optimizer', 'epoch', 'step', ...  what a full checkpoint holds, except the sharded
//                        parameters and the optimizer's per-parameter state
// and "<folder>/manifest" (the save id and the world size), written last. Folders and files of
// Shoal versions before the id (no 'save_id', no manifest) still load.
//
// load_sharded_checkpoint() reads either layout whole (for the earlier one: every rank's file,
// refusing a set that disagrees: a missing or extra rank file, another world size, other units, a
// piece of the wrong size, files of another save), so a resume at any world size, with any
// strategy, and `shoal ckpt convert` (a file torch.load reads) start from it.
//
// Thread safety: plain values and reentrant functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shoal/checkpoint/dcp.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/training_state.h"

namespace shoal::checkpoint {

/// One flat unit of FullyShardedDataParallel: its parameters laid end to end in one buffer
/// padded to a multiple of the world size.
struct FlatUnitMetadata {
  std::string name;                          ///< the submodule's name; "" for the root unit
  std::vector<std::string> param_names;      ///< state-dict keys of its parameters
  std::vector<std::vector<int64_t>> shapes;  ///< of each parameter
  std::vector<int64_t> offsets;              ///< of each parameter in the flat buffer
  std::vector<int64_t> param_indices;        ///< of each parameter in model.parameters()
  int64_t numel = 0;                         ///< the parameters' elements
  int64_t padded = 0;                        ///< numel rounded up to a multiple of world_size
};

/// What one rank saves (see the file comment).
struct ShardedTrainingState {
  /// Everything but the sharded tensors: model = buffers and parameters outside every unit;
  /// optimizer = param_groups over the whole model, state empty; epoch, step, sampler, config.
  TrainingState replicated;
  int64_t rank = 0;
  int64_t world_size = 1;
  /// The save these files belong to, the same in every rank's file (CheckpointManager draws it);
  /// 0: none written (files of Shoal versions before the id, or a caller that sets none).
  int64_t save_id = 0;
  int64_t num_parameters = 0;               ///< len(model.parameters())
  std::vector<std::string> state_dict_keys; ///< the whole state dict's keys, in order
  std::vector<FlatUnitMetadata> units;
  std::vector<at::Tensor> flat_param_shards;  ///< [padded / world_size] per unit
  /// Per unit: the optimizer state of this rank's piece (tensors of padded / world_size
  /// elements, and 'step'); empty before the first step.
  std::vector<std::map<std::string, at::Tensor>> optimizer_shards;
};

/// The extension of a sharded checkpoint's folder name ("checkpoint_000012.sharded").
inline const char* const kShardedExtension = ".sharded";

/// "manifest": the file rank 0 writes into the folder once every rank's file is complete.
inline const char* const kShardedManifest = "manifest";

/// "rank_<rank>.pt": a rank's file in a sharded checkpoint's folder.
std::string shard_file_name(int64_t rank);

/// A new random save id (never 0), for ShardedTrainingState::save_id.
int64_t new_save_id();

/// Writes "<folder>/manifest" (atomically): the save id and world size every rank's file holds.
void write_sharded_manifest(const std::string& folder, int64_t save_id, int64_t world_size);

/// True when `folder` holds a manifest or a DCP `.metadata`, i.e. its save completed (see the
/// file comment).
bool has_sharded_manifest(const std::string& folder);

/// Writes one rank's file (atomically, with a checksum manifest).
void save_shard(const ShardedTrainingState& state, const std::string& path);

/// Reads one rank's file, checking its metadata against its own tensors.
ShardedTrainingState load_shard(const std::string& path, const LoadOptions& options = {});

/// True when `path` is a folder (a sharded checkpoint, or something else that load refuses).
bool is_directory(const std::string& path);

/// Reads every rank's file of the sharded checkpoint in `folder` and assembles the whole
/// training state (the full checkpoint's layout). Throws CheckpointError naming the file and
/// what to do when the set is incomplete or disagrees.
TrainingState load_sharded_checkpoint(const std::string& folder, const LoadOptions& options = {});

/// True when a loaded object is one rank's file of a sharded checkpoint.
bool is_shard_object(const c10::IValue& object);

// The DCP layout (what CheckpointManager::save_sharded writes; see the file comment).

/// "__<rank>_0.distcp": a rank's data file in a sharded checkpoint's DCP folder.
std::string dcp_shard_file_name(int64_t rank);

/// How many chunks rank `rank` of the save `state` describes writes (computed alike on every
/// rank: every rank's units and optimizer fields are the same).
int64_t dcp_chunk_count(const ShardedTrainingState& state, int64_t rank);

/// Writes this rank's data file into `folder` (atomically) and returns each chunk's offset and
/// length in it, in order: the pairs rank 0 needs for `.metadata`.
std::vector<int64_t> save_dcp_shard(const ShardedTrainingState& state, const std::string& folder);

/// Rank 0, once every rank's file is whole: writes `<folder>/.metadata` (atomically) covering
/// every rank's chunks; `places[r]` is what save_dcp_shard returned on rank r.
void write_dcp_sharded_metadata(const ShardedTrainingState& rank0, const std::string& folder,
                                const std::vector<std::vector<int64_t>>& places);

/// True when `folder` is a DCP checkpoint holding Shoal's entry: a sharded checkpoint of this
/// layout.
bool is_sharded_dcp_folder(const std::string& folder, const LoadOptions& options = {});

/// Reads a sharded checkpoint of the DCP layout whole (every tensor assembled from its chunks, on
/// the calling rank). Throws CheckpointError naming the file: a rank file of another save, a
/// missing or truncated one, chunks that do not add up.
TrainingState load_sharded_dcp(const std::string& folder, const LoadOptions& options = {});

/// Reads a DCP folder Shoal did not write (PyTorch's dcp.save) as a training state: the model's
/// tensors (see dcp_model_entries) and, when the folder holds the optimizer as FSDP2's
/// get_state_dict saves it ({"model": ..., "optim": ...}), its state by parameter
/// ("optim.state.<name>.<field>", numbered as "optim.param_groups.<g>.params" list the names,
/// group after group) and the groups' options, merged into one group; epoch and step 0, no
/// sampler or config. Throws CheckpointError as load_dcp does, naming an optimizer state of no
/// listed parameter, and naming two groups and an option where the groups' options differ.
TrainingState load_foreign_dcp(const std::string& folder, const LoadOptions& options = {});

/// load_foreign_dcp for a model whose named parameters (in the optimizer's order) are
/// `parameters`: the optimizer state is numbered by them, matched by name (a "module." prefix on
/// every saved name and none of the model's is dropped, as for the weights). Throws
/// CheckpointError naming the parameter when a name is missing on either side or a state
/// tensor's shape differs from its parameter's.
TrainingState load_foreign_dcp_for(const std::string& folder, const StateDict& parameters,
                                   const LoadOptions& options = {});

/// The model's tensors of a DCP checkpoint: its "model." entries without the prefix when it has
/// any (a dcp.save of {"model": ..., "optim": ...}), else every tensor; a wrapper prefix
/// ("module.") on every key removed.
StateDict dcp_model_entries(const DcpContents& dcp);

/// Rewrites the sharded checkpoint of Shoal's older layout in `folder` (rank_<r>.pt files) as the
/// DCP layout in `out` (new or empty), rank by rank, at the world size that saved it.
void convert_sharded_to_dcp(const std::string& folder, const std::string& out, const LoadOptions& options = {});

}  // namespace shoal::checkpoint
