"""PyTorch's Python DistributedDataParallel on the models of `shoal bench ddp`: the peer Shoal's
DDP is measured against, side by side (gloo, one thread per rank, synthetic data).

usage: ddp_torch.py --model cnn|mlp|transformer --steps N --warmup W --batch B --world R --result FILE
                    [--gradient-as-bucket-view] [--zero]
--zero steps SGD through ZeroRedundancyOptimizer (each rank keeps its part of the momentum): the
peer of `shoal bench fsdp`'s stage 1.
Writes one JSON object to FILE: samples_per_s (all ranks together), peak_rss_mb, pss_mb (PSS after
the timed steps) and live_mb (heap in use at the end of forward and of backward, the larger, over
two more steps), each of the largest rank; MB = MiB.
"""
import ctypes
import json
import resource

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_common import argument_parser, make_model, run_ranks, timed_steps


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


def worker(rank, args):
    model = make_model(args.model)
    ddp = nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=args.gradient_as_bucket_view)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.01, momentum=0.9)
    else:
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

    seconds = timed_steps(step, args.warmup, args.steps)
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
    return {"seconds": seconds, "peak_rss_mb": rss_mb, "pss_mb": pss_mb, "live_mb": live_mb}


def main():
    parser = argument_parser(steps=20, warmup=3, batch=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument("--zero", action="store_true")
    args = parser.parse_args()
    ranks = run_ranks(worker, args, args.world)
    seconds = max(r["seconds"] for r in ranks)
    with open(args.result, "w") as f:
        json.dump({"samples_per_s": args.world * args.batch * args.steps / seconds,
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
                   "pss_mb": max(r["pss_mb"] for r in ranks),
                   "live_mb": max(r["live_mb"] for r in ranks)}, f)


if __name__ == "__main__":
    main()
