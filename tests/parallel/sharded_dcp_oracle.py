# A sharded checkpoint `shoal train --strategy fsdp --checkpoint-format sharded` wrote (the built-in
# MLP, Adam), read by PyTorch 2.x's torch.distributed.checkpoint (test_fsdp_sharded_checkpoint's
# LoadsIntoPyTorchPlainAndFsdp2). Run with a PyTorch 2.x python:
#
#   python3 sharded_dcp_oracle.py FOLDER FULL
#
# FULL: the same checkpoint as `shoal ckpt convert` writes it (torch.load reads it). Checks, bit for
# bit against FULL:
#   plain   dcp.load into an unsharded state dict {"model": ..., "optim": {"state": ...}} (the keys
#           get_state_dict uses)
#   fsdp2   dcp.load into the MLP under FSDP2 (fully_shard, gloo, CPU) on 2 ranks: its model state
#           dict and its Adam state (get_optimizer_state_dict), each rank's shards gathered whole
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def mlp():
    m = torch.nn.Module()
    m.fc1 = torch.nn.Linear(784, 1024)
    m.fc2 = torch.nn.Linear(1024, 1024)
    m.fc3 = torch.nn.Linear(1024, 10)
    return m


def expect_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    assert torch.equal(got, want), (what, (got.double() - want.double()).abs().max().item())


def check_plain(folder, full):
    names = list(full["model"].keys())
    state = {i: fields for i, fields in full["optimizer"]["state"].items()}
    sd = {"model": {k: torch.empty_like(v) for k, v in full["model"].items()},
          "optim": {"state": {names[i]: {f: torch.empty_like(t) for f, t in fields.items()}
                              for i, fields in state.items()}}}
    dcp.load(sd, checkpoint_id=folder)
    for k, v in full["model"].items():
        expect_equal(sd["model"][k], v, k)
    for i, fields in state.items():
        for f, t in fields.items():
            expect_equal(sd["optim"]["state"][names[i]][f], t, names[i] + "." + f)
    print("plain: %d tensors and %d optimizer states equal" % (len(names), len(state)), flush=True)


def fsdp2(rank, world, folder, full, init):
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    m = mlp()
    for layer in (m.fc1, m.fc2, m.fc3):
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.001)
    m.fc3(m.fc2(m.fc1(torch.zeros(1, 784)))).sum().backward()  # makes Adam's state to load into
    opt.step()
    model_sd = get_model_state_dict(m)
    optim_sd = get_optimizer_state_dict(m, opt)
    dcp.load({"model": model_sd, "optim": {"state": optim_sd["state"]}}, checkpoint_id=folder)
    names = list(full["model"].keys())
    for k, v in full["model"].items():
        expect_equal(model_sd[k].full_tensor(), v, "fsdp2 " + k)
    for i, fields in full["optimizer"]["state"].items():
        for f, t in fields.items():
            got = optim_sd["state"][names[i]][f]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            expect_equal(got, t, "fsdp2 " + names[i] + "." + f)
    dist.destroy_process_group()


def main(folder, full_path):
    full = torch.load(full_path, weights_only=False)
    check_plain(folder, full)
    init = tempfile.mktemp()
    # fork: each spawned child would import torch again (seconds each on a loaded machine).
    mp.start_processes(fsdp2, args=(2, folder, full, init), nprocs=2, start_method="fork")
    if os.path.exists(init):
        os.remove(init)
    print("fsdp2: 2 ranks loaded the model and Adam state, equal when gathered", flush=True)
    print("ORACLE OK", torch.__version__)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
