"""PyTorch's own DDP with its own PowerSGD hook on the CNN and the real Fashion-MNIST: the Python
side of `shoal train --strategy ddp --model cnn --comm-hook powersgd`, to see what PyTorch itself
reaches on the same setting (gloo, one thread per rank).

usage: powersgd_torch.py [--rank R] [--start-iter N] [--batch 64] [--lr 0.08] [--momentum 0.9]
                         [--world 2] [--epochs 1] [--train-samples N] [--test-samples N]
--rank 0 trains without a hook (plain DDP). Prints the final test accuracy and, with PowerSGD, the
elements sent per step after compression started.
"""
import argparse
import gzip
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
from pytorch_models import Cnn  # noqa: E402

ROOT = "/usr/share/datasets/fashion-mnist"


def powersgd_in_order(state, bucket):
    """PyTorch's powerSGD_hook, waited for in the hook: its later allreduces are issued from gloo's
    callback thread, where they can cross the next bucket's on the other rank (gloo then fails
    with a size mismatch on this two-bucket CNN); waiting keeps every rank's order the same."""
    fut = powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut
MEAN, STD = 0.2860, 0.3530  # shoal::data::FashionMnist's normalisation


def load(prefix):
    with gzip.open(os.path.join(ROOT, prefix + "-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(ROOT, prefix + "-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (torch.from_numpy(images.astype(np.float32)) / 255 - MEAN) / STD
    return x, torch.from_numpy(labels.astype(np.int64))


def worker(rank, args, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=args.world)
    x, y = load("train")
    tx, ty = load("t10k")
    if args.train_samples > 0:  # the first N, as shoal train --train-samples
        x, y = x[:args.train_samples], y[:args.train_samples]
    if args.test_samples > 0:
        tx, ty = tx[:args.test_samples], ty[:args.test_samples]
    torch.manual_seed(0)
    model = Cnn()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if args.rank > 0:
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=args.rank,
                                       start_powerSGD_iter=args.start_iter)
        ddp.register_comm_hook(state, powersgd_in_order)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sampler = torch.utils.data.DistributedSampler(range(len(x)), args.world, rank, shuffle=True,
                                                  seed=0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for begin in range(0, len(order), args.batch):
            idx = order[begin:begin + args.batch]
            opt.zero_grad()
            F.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
    if rank == 0:
        with torch.no_grad():
            correct = sum((model(tx[i:i + 1000]).argmax(1) == ty[i:i + 1000]).sum().item()
                          for i in range(0, len(tx), 1000))
        line = "final test accuracy: %.4f" % (correct / len(tx))
        if state is not None:
            line += "; compression %.2fx (elements before/after)" % state.compression_stats()[0]
        print(line, flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--start-iter", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.08)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--train-samples", type=int, default=0)
    parser.add_argument("--test-samples", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "init")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
