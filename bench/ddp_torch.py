"""PyTorch's Python DistributedDataParallel on the models of `shoal bench ddp`: the peer Shoal's
DDP is measured against, side by side (gloo, one thread per rank, synthetic data).

usage: ddp_torch.py --model cnn|mlp --steps N --warmup W --batch B --world R --result FILE
                    [--gradient-as-bucket-view]
Writes one JSON object to FILE: samples_per_s (all ranks together), peak_rss_mb, pss_mb (PSS after
the timed steps) and live_mb (heap in use at the end of forward and of backward, the larger, over
two more steps), each of the largest rank; MB = MiB.
"""
import ctypes
import argparse
import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


# The Python twins of Shoal's model registry (the same ones the oracle tests compare against), so
# that both sides of the benchmark train exactly the same architecture.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
from pytorch_models import Cnn, Mlp  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_bytes_in_use():
    """glibc's mallinfo2 over all arenas: heap blocks in use plus mmap'ed blocks (the same figure as
    shoal::memory::heap_bytes_in_use, which Shoal's side of the benchmark reports)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def worker(rank, args, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=args.world)
    torch.manual_seed(0)
    model = Cnn() if args.model == "cnn" else Mlp()
    ddp = nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=args.gradient_as_bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))

    def step(samples=None):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if samples is not None:
            samples.append(heap_bytes_in_use())
        loss.backward()
        if samples is not None:
            samples.append(heap_bytes_in_use())
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - start
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    pss_mb = float("nan")
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                pss_mb = int(line.split()[1]) / 1024.0
                break
    samples = []
    for _ in range(2):
        step(samples)
    live_mb = max(samples) / 1048576.0
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump({"seconds": seconds, "peak_rss_mb": rss_mb, "pss_mb": pss_mb, "live_mb": live_mb},
                  f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--result", required=True)
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "init"), tmp), nprocs=args.world, join=True)
        ranks = [json.load(open(os.path.join(tmp, "rank%d.json" % r))) for r in range(args.world)]
    seconds = max(r["seconds"] for r in ranks)
    with open(args.result, "w") as f:
        json.dump({"samples_per_s": args.world * args.batch * args.steps / seconds,
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
                   "pss_mb": max(r["pss_mb"] for r in ranks),
                   "live_mb": max(r["live_mb"] for r in ranks)}, f)


if __name__ == "__main__":
    main()
