# PyTorch 2.x's FSDP2 checkpoint started from in Shoal (test_fsdp_sharded_checkpoint's
# Fsdp2CheckpointStartsShoalAtThreeRanks). Run with a PyTorch 2.x python:
#
#   python3 fsdp2_to_shoal_oracle.py save OUT
#       trains Shoal's MLP (fc1-relu-fc2-relu-fc3) under FSDP2 (fully_shard, gloo, CPU) on 2 ranks
#       for 3 Adam steps and dcp.saves {"model": ..., "optim": ...} of get_state_dict into OUT/ckpt;
#       writes OUT/data.pt (48 samples, --data's layout) and OUT/next.pt: the model and Adam state
#       after one more step over all 48 samples (the mean loss), from the saved state
# OUT/saved.pt: the saved state gathered whole ({"model": ..., "optim": ...}, full_state_dict),
# which Shoal's reading of OUT/ckpt must equal bit for bit; the test compares Shoal's step with
# OUT/next.pt ({"model": ..., "optim": {"state": {name: Adam's state}}}).
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


def data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 784, generator=g)
    y = torch.randint(0, 10, (48,), generator=g)
    return x, y


def train_fsdp2(rank, world, out, init):
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
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


def save(out):
    init = tempfile.mktemp()
    # fork: each spawned child would import torch again (seconds each on a loaded machine).
    mp.start_processes(train_fsdp2, args=(2, out, init), nprocs=2, start_method="fork")
    if os.path.exists(init):
        os.remove(init)
    x, y = data()
    torch.save({"train_x": x, "train_y": y, "test_x": x[:8], "test_y": y[:8]}, os.path.join(out, "data.pt"))
    next_step(out)
    print("ORACLE OK saved", torch.__version__)


if __name__ == "__main__":
    save(sys.argv[2])
