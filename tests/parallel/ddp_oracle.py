"""PyTorch's own DistributedDataParallel (gloo, 2 processes) on the models and data of
test_ddp_vs_pytorch.cpp: the oracle Shoal's DDP is compared with.

usage: ddp_oracle.py MODEL INIT_FILE DATA_FILE OUT_FILE STEPS BATCH_PER_RANK WORLD
Files are raw little-endian float32: INIT_FILE the initial parameters (named_parameters order,
flattened), DATA_FILE for each step the global batch's inputs then its labels (as floats),
OUT_FILE rank 0's final parameters.
"""
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class SmallCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2).flatten(1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), 1)


class SmallMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), 1)


SAMPLE_SHAPES = {"cnn": (1, 12, 12), "mlp": (20,)}


def worker(rank, args, init_file):
    model_name, init_path, data_path, out_path, steps, batch, world = args
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = SmallCnn() if model_name == "cnn" else SmallMlp()
    flat = torch.from_numpy(np.fromfile(init_path, dtype="<f4"))
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    assert offset == flat.numel(), "initial parameter file does not match the model"
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.from_numpy(np.fromfile(data_path, dtype="<f4"))
    shape = SAMPLE_SHAPES[model_name]
    per_sample = int(np.prod(shape))
    global_batch = batch * world
    step_floats = global_batch * (per_sample + 1)
    for step in range(steps):
        chunk = data[step * step_floats:(step + 1) * step_floats]
        x = chunk[:global_batch * per_sample].view(global_batch, *shape)
        y = chunk[global_batch * per_sample:].long()
        xr, yr = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
        opt.zero_grad()
        F.nll_loss(ddp(xr), yr).backward()
        opt.step()
    if rank == 0:
        out = torch.cat([p.detach().flatten() for p in model.parameters()])
        out.numpy().astype("<f4").tofile(out_path)
    dist.destroy_process_group()


def main():
    model, init_path, data_path, out_path = sys.argv[1:5]
    steps, batch, world = (int(v) for v in sys.argv[5:8])
    args = (model, init_path, data_path, out_path, steps, batch, world)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "init")), nprocs=world, join=True)


if __name__ == "__main__":
    main()
