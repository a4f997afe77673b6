# PyTorch 2.x's DCP both ways with Shoal's FSDP (test_fsdp_sharded_checkpoint), in one run (each
# run of a PyTorch 2.x python costs seconds to import torch). Run with a PyTorch 2.x python:
#
#   python3 sharded_dcp_oracle.py FOLDER FULL OUT
#
# Shoal to PyTorch: FOLDER is a sharded checkpoint `shoal train --strategy fsdp --checkpoint-format
# sharded` wrote (the built-in MLP, Adam), FULL the same checkpoint as `shoal ckpt convert` writes
# it. Checks, bit for bit against FULL:
#   plain   dcp.load into an unsharded state dict {"model": ..., "optim": {"state": ...}} (the keys
#           get_state_dict uses)
#   fsdp2   dcp.load into the MLP under FSDP2 (fully_shard, gloo, CPU) on 2 ranks: its model state
#           dict and its Adam state (get_optimizer_state_dict), each rank's shards gathered whole
# PyTorch to Shoal: on the same 2 ranks, trains Shoal's MLP (fc1-relu-fc2-relu-fc3) under FSDP2 for
# 3 Adam steps and dcp.saves {"model": ..., "optim": ...} of get_state_dict into OUT/ckpt; writes
#   OUT/saved.pt  the saved state gathered whole ({"model": ..., "optim": ...}, full_state_dict),
#                 which Shoal's reading of OUT/ckpt must equal bit for bit
#   OUT/data.pt   48 samples, --data's layout
#   OUT/next.pt   the model and Adam state after one more step over all 48 samples (the mean loss),
#                 from the saved state ({"model": ..., "optim": {"state": {name: Adam's state}}}),
#                 which Shoal's step from OUT/ckpt must equal
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict)
from torch.distributed.fsdp import fully_shard  # noqa: E402

LR = 0.001


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 1024)
        self.fc2 = torch.nn.Linear(1024, 1024)
        self.fc3 = torch.nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


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


def load_fsdp2(folder, full):
    m = Mlp()
    for layer in (m.fc1, m.fc2, m.fc3):
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.001)
    m(torch.zeros(1, 784)).sum().backward()  # makes Adam's state to load into
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


def data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 784, generator=g)
    y = torch.randint(0, 10, (48,), generator=g)
    return x, y


def save_fsdp2(rank, out):
    torch.manual_seed(0)
    m = Mlp()
    for layer in (m.fc1, m.fc2, m.fc3):
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    x, y = data()
    for step in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x[16 * step:16 * step + 16]), y[16 * step:16 * step + 16]).backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(out, "ckpt"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole_model = get_model_state_dict(m, options=full)
    whole_optim = get_optimizer_state_dict(m, opt, options=full)
    if rank == 0:
        torch.save({"model": whole_model, "optim": whole_optim}, os.path.join(out, "saved.pt"))


def on_two_ranks(rank, world, folder, full, out, init):
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    load_fsdp2(folder, full)
    save_fsdp2(rank, out)
    dist.destroy_process_group()


def next_step(out):
    saved = torch.load(os.path.join(out, "saved.pt"), weights_only=False)
    m = Mlp()
    m.load_state_dict(saved["model"])
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    names = [n for n, _ in m.named_parameters()]
    opt.load_state_dict({"state": {i: saved["optim"]["state"][n] for i, n in enumerate(names)},
                         "param_groups": [dict(saved["optim"]["param_groups"][0], params=list(range(len(names))))]})
    x, y = data()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    state = {n: opt.state[p] for n, p in m.named_parameters()}
    torch.save({"model": m.state_dict(), "optim": {"state": state}}, os.path.join(out, "next.pt"))


def main(folder, full_path, out):
    full = torch.load(full_path, weights_only=False)
    check_plain(folder, full)
    init = tempfile.mktemp()
    # fork: each spawned child would import torch again (seconds each on a loaded machine).
    mp.start_processes(on_two_ranks, args=(2, folder, full, out, init), nprocs=2, start_method="fork")
    if os.path.exists(init):
        os.remove(init)
    print("fsdp2: 2 ranks loaded the model and Adam state, equal when gathered", flush=True)
    x, y = data()
    torch.save({"train_x": x, "train_y": y, "test_x": x[:8], "test_y": y[:8]}, os.path.join(out, "data.pt"))
    next_step(out)
    print("ORACLE OK", torch.__version__)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
