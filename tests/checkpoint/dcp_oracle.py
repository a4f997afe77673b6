# DCP checkpoints written by PyTorch 2.x's torch.distributed.checkpoint.save, for Shoal to read
# (test_checkpoint_format's DcpFromPyTorch tests). Run with a PyTorch 2.x python:
#
#   python3 dcp_oracle.py OUT
#
# writes into OUT:
#   plain/, plain.pt     a plain model's state dict (float32, bfloat16, int64, a 0-d tensor, and a
#                        non-tensor entry 'note') saved by dcp.save, and its tensors by torch.save
#   fsdp/, fsdp.pt       the state dict of the same kind of model under FSDP2 (fully_shard) on 2
#                        ranks over gloo on CPU (each rank's shard a chunk; uneven shards), and the
#                        unsharded model's state dict by torch.save
#   outside/, overlap/, dtype/, evil/: copies of plain/ whose .metadata puts a chunk outside its
#                        tensor, makes two chunks overlap, says the wrong dtype, or names
#                        builtins.eval
import dataclasses
import os
import pickle
import shutil
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def save_fsdp(rank, world, folder, init):
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    m = model()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    dcp.save(m.state_dict(), checkpoint_id=folder)
    dist.destroy_process_group()


def edited(out, name, edit):
    folder = os.path.join(out, name)
    shutil.copytree(os.path.join(out, "plain"), folder)
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def main(out):
    state = model().state_dict()
    state["extra.bf16"] = torch.randn(3, 5).to(torch.bfloat16)
    state["extra.steps"] = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    state["extra.scalar"] = torch.tensor(2.5, dtype=torch.float64)
    torch.save(state, os.path.join(out, "plain.pt"))
    dcp.save(dict(state, note={"lr": 0.1}), checkpoint_id=os.path.join(out, "plain"))

    init = tempfile.mktemp()
    # fork: each spawned child would import torch again (seconds each on a loaded machine).
    mp.start_processes(save_fsdp, args=(2, os.path.join(out, "fsdp"), init), nprocs=2, start_method="fork")
    torch.save(model().state_dict(), os.path.join(out, "fsdp.pt"))

    def outside(m):
        m.state_dict_metadata["0.weight"].chunks[0] = ChunkStorageMetadata(
            offsets=torch.Size([1, 0]), sizes=torch.Size([7, 5]))

    def overlap(m):
        chunk = m.state_dict_metadata["0.weight"].chunks[0]
        m.state_dict_metadata["0.weight"].chunks.append(chunk)

    def dtype(m):
        tensor = m.state_dict_metadata["0.weight"]
        tensor.properties = dataclasses.replace(tensor.properties, dtype=torch.float64)

    def evil(m):
        m.planner_data["note"] = eval

    for name, edit in [("outside", outside), ("overlap", overlap), ("dtype", dtype), ("evil", evil)]:
        edited(out, name, edit)
    print("ORACLE OK", torch.__version__)


if __name__ == "__main__":
    main(sys.argv[1])
