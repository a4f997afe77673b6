"""PyTorch's Python DistributedDataParallel on the models of `shoal bench ddp`: the peer Shoal's
DDP is measured against, side by side (gloo, one thread per rank, synthetic data).

usage: ddp_torch.py --model cnn|mlp|transformer|gpt --steps N --warmup W --batch B --world R --result FILE
                    [--gradient-as-bucket-view] [--zero | --fsdp 2|3]
                    [--n-layer L --n-head H --n-embd C --block-size T --vocab-size V]
--model gpt trains bench/gpt_torch.py's GPT (nanoGPT's, as Shoal's built-in one) of those sizes
(`shoal train --model gpt`'s flags and defaults) on random token blocks; a sample is a block.
--zero steps SGD through ZeroRedundancyOptimizer (each rank keeps its part of the momentum): the
peer of `shoal bench fsdp`'s stage 1.
--fsdp shards the model with PyTorch 2.x's FSDP2 (torch.distributed.fsdp.fully_shard, on a CPU
device mesh over gloo) instead of wrapping it in DDP: every module with parameters of its own
whose forward runs is a unit (as `shoal bench fsdp` wraps every layer), then the root. 3 is
FULL_SHARD (reshard_after_forward=True: parameters gathered again for backward); 2 is
SHARD_GRAD_OP (reshard_after_forward=False: gathered once per step). The peers of `shoal bench
fsdp`'s stages 3 and 2. Needs PyTorch >= 2.6 (fully_shard's public home); run with PyTorch 2.x's
Python (PYTHONPATH=<scripts/setup_torch_pypi.sh --prefix>/.. python3).
Writes one JSON object to FILE: samples_per_s (all ranks together), peak_rss_mb, pss_mb (PSS after
the timed steps) and live_mb (heap in use at the end of forward and of backward, the larger, over
two more steps), each of the largest rank; MB = MiB.
"""
import ctypes
import json
import resource

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gpt_torch import GPT
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


def fully_shard_units(model, reshard_after_forward):
    """FSDP2 over `model`: each module with parameters of its own whose forward runs is a unit,
    innermost first, then the root (which takes the rest)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # A module whose weight is read without calling it (the Transformer's pos.weight) gets no
    # forward hook, where FSDP2 gathers: one unsharded forward finds the modules that run.
    ran = set()
    hooks = [m.register_forward_pre_hook(lambda m, _: ran.add(m)) for m in model.modules()]
    with torch.no_grad():
        model(torch.zeros(1, 1, 28, 28))
    for hook in hooks:
        hook.remove()
    units = [m for m in model.modules() if m is not model and m in ran and
             any(True for _ in m.parameters(recurse=False))]
    for module in reversed(units):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def workload(args):
    """The model and its batch, and the loss of the model (or of its DDP wrapper) on the batch."""
    if args.model != "gpt":
        model = make_model(args.model)
        x = torch.randn(args.batch, 1, 28, 28)
        y = torch.randint(0, 10, (args.batch,))
        return model, lambda module: F.cross_entropy(module(x), y)
    torch.manual_seed(0)
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    x = torch.randint(0, args.vocab_size, (args.batch, args.block_size))
    y = torch.randint(0, args.vocab_size, (args.batch, args.block_size))
    return model, lambda module: module(x, y)


def worker(rank, args):
    model, batch_loss = workload(args)
    if args.fsdp:
        ddp = fully_shard_units(model, reshard_after_forward=args.fsdp == 3)
    else:
        ddp = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=args.gradient_as_bucket_view)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step(samples=None):
        opt.zero_grad()
        loss = batch_loss(ddp)
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
    parser.add_argument("--fsdp", type=int, choices=(2, 3))
    for flag, default in (("--n-layer", 4), ("--n-head", 4), ("--n-embd", 128),
                          ("--block-size", 128), ("--vocab-size", 256)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    if args.fsdp and args.zero:
        parser.error("--zero and --fsdp are two different peers: give one")
    if args.fsdp:
        # Not even FSDP1 imports in Debian's torch 1.13 under Python 3.11 (a dataclass of
        # torch.distributed._shard has a mutable default: ValueError).
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except Exception as error:  # noqa: BLE001 (ImportError, or 1.13's ValueError)
            parser.error("--fsdp needs PyTorch 2.x's torch.distributed.fsdp.fully_shard (>= 2.6); "
                         "torch %s: %s: %s" % (torch.__version__, type(error).__name__, error))
    ranks = run_ranks(worker, args, args.world)
    seconds = max(r["seconds"] for r in ranks)
    with open(args.result, "w") as f:
        json.dump({"samples_per_s": args.world * args.batch * args.steps / seconds,
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
                   "pss_mb": max(r["pss_mb"] for r in ranks),
                   "live_mb": max(r["live_mb"] for r in ranks)}, f)


if __name__ == "__main__":
    main()
