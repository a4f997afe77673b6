"""PyTorch's ZeroRedundancyOptimizer under DistributedDataParallel (gloo, 2 processes) on the
model, closed-form weights and data of test_fsdp_vs_pytorch.cpp: the oracle of
FullyShardedDataParallel's stage 1.

usage: zero_oracle.py sgd|adam STEPS BATCH_PER_RANK OUT_FILE
Writes rank 0's parameters (named_parameters order, flattened) then its buffers (named_buffers
order) to OUT_FILE as raw little-endian float64; prints "ORACLE OK ..." last once both ranks ended
well.
"""
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

WORLD = 2


class PassThrough(nn.Module):
    """Passes its input through: its parameter never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return x


def make_model():
    return nn.Sequential(nn.Linear(6, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 11),
                         PassThrough(), nn.ReLU(), nn.Linear(11, 3), nn.LogSoftmax(1))


def set_initial_weights(model):
    with torch.no_grad():
        for index, p in enumerate(model.parameters()):
            k = torch.arange(p.numel(), dtype=torch.float64)
            p.copy_((0.3 * torch.sin(0.37 * k + float(index))).float().view_as(p))


def batch(step, size):
    x = (torch.sin(0.01 * (torch.arange(size * 6, dtype=torch.float64) + 977.0 * step)) * 2)
    y = (torch.arange(size) * 7 + step).remainder(3)
    return x.float().view(size, 6), y


def worker(rank, optimizer, steps, per_rank, out_path, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=WORLD)
    torch.manual_seed(10 + rank)  # different until DDP broadcasts rank 0's
    model = make_model()
    if rank == 0:
        set_initial_weights(model)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if optimizer == "adam":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=0.01, eps=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, per_rank * WORLD)
        opt.zero_grad(set_to_none=True)
        out = ddp(x[rank * per_rank:(rank + 1) * per_rank])
        F.nll_loss(out, y[rank * per_rank:(rank + 1) * per_rank]).backward()
        opt.step()
    if rank == 0:
        parts = [p.detach().double().flatten() for p in model.parameters()]
        parts += [b.detach().double().flatten() for b in model.buffers()]
        torch.cat(parts).numpy().astype("<f8").tofile(out_path)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown after the results are written (see ddp_oracle.py)


def main():
    optimizer, steps, per_rank, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    assert optimizer in ("sgd", "adam"), "optimizer must be sgd or adam, got %r" % optimizer
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(optimizer, steps, per_rank, out_path, os.path.join(tmp, "init")),
                 nprocs=WORLD, join=True)
    assert os.path.getsize(out_path) > 0 and not math.isnan(float(
        torch.from_numpy(__import__("numpy").fromfile(out_path, dtype="<f8")).sum()))
    print("ORACLE OK zero %s %d steps" % (optimizer, steps), flush=True)


if __name__ == "__main__":
    main()
