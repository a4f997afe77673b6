"""What the PyTorch peers of `shoal bench` (ddp_torch.py, dp_torch.py) share: their common
arguments, the models, ranks spawned from one script into a gloo group, and DDP's timed loop.

Imported as a sibling module: the scripts are run by path (/usr/bin/python3 bench/ddp_torch.py),
which puts this folder first on sys.path, and spawned ranks get the parent's sys.path.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The Python twins of Shoal's model registry (the same ones the oracle tests compare against), so
# that both sides of a benchmark train exactly the same architecture.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
from pytorch_models import MODELS  # noqa: E402


def argument_parser(steps, warmup, batch):
    """A parser of the arguments every peer takes (as `shoal bench` passes them), with these
    defaults; a peer adds its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--result", required=True)
    return parser


def make_model(name):
    """The model `name` (cnn, mlp or transformer), initialised from seed 0 as Shoal's side
    initialises it."""
    torch.manual_seed(0)
    return MODELS[name]()


def _rank_main(rank, worker, args, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"), rank=rank,
                            world_size=world)
    result = worker(rank, args)
    with open(os.path.join(tmp, "rank%d.json" % rank), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_ranks(worker, args, world):
    """Runs worker(rank, args) in `world` spawned processes, one thread each, joined in a gloo
    process group; returns the dicts they return (JSON-serialisable), by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank_main, args=(worker, args, world, tmp), nprocs=world, join=True)
        except mp.ProcessExitedException as e:
            # PyTorch's gloo ranks sometimes abort while tearing down ("terminate called without
            # an active exception", seen with 1.13's ZeroRedundancyOptimizer and 2.15's
            # fully_shard), after every rank wrote its result: the measurement stands. A rank
            # that died before writing still fails the run.
            if not all(os.path.exists(os.path.join(tmp, "rank%d.json" % r)) for r in range(world)):
                raise
            print("bench peer: a rank died after writing its result (%s); the result is kept" % e,
                  file=sys.stderr)
        results = []
        for r in range(world):
            with open(os.path.join(tmp, "rank%d.json" % r)) as f:
                results.append(json.load(f))
        return results


def timed_steps(step, warmup, steps):
    """Seconds that `steps` calls of step() take after `warmup` untimed ones, from a barrier of the
    group to a barrier after them: the slowest rank's time."""
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return time.perf_counter() - start
