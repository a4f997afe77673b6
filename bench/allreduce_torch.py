#!/usr/bin/python3
"""PyTorch's own allreduce (torch.distributed, gloo) over the sizes `shoal bench allreduce` sweeps.

The performance peer of Shoal's backends. Same method as the C++ bench: float32 sum, warm-up
(checked once), then per repeat a barrier, `iters` timed allreduces, and the slowest rank's time
per allreduce; the median of the repeats is reported as JSON lines with backend "torch_gloo".

Alone (run with Debian's /usr/bin/python3):
    /usr/bin/python3 bench/allreduce_torch.py --nproc 2 [--min-bytes 4096 --max-bytes 67108864]

As a contender inside `shoal bench allreduce --backend gloo,torch_gloo` it runs with --serve:
rank 0 (this process) reads "BYTES ITERS WARMUP" lines on stdin, runs that one measurement on
every rank and answers one JSON line; end of input stops every rank. Ranks 1..n-1 are child
processes; rank 0 stays in this process so that it keeps stdin.
"""
import argparse
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

# Why these: the same per-repeat budget as the C++ bench (about 64 MiB moved, 3..200 iterations).
BYTES_PER_REPEAT = 64 << 20
MIN_ITERS, MAX_ITERS = 3, 200
# Why 300 s: as the C++ bench, a loaded 2-core machine can stall a peer for a long time.
TIMEOUT_S = 300


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init(rank, world_size, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


class Buffers:
    def __init__(self):
        self.tensor = torch.zeros(0)

    def get(self, nbytes):
        if self.tensor.numel() != nbytes // 4:
            self.tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        return self.tensor


def warm_up(buffers, nbytes, iterations):
    t = buffers.get(nbytes)
    rank, n = dist.get_rank(), dist.get_world_size()
    t.fill_(rank + 1)
    dist.all_reduce(t)
    if not bool((t == n * (n + 1) // 2).all()):
        raise RuntimeError(f"torch gloo returned a wrong allreduce result for {nbytes} bytes")
    t.zero_()
    for _ in range(iterations):
        dist.all_reduce(t)


def measure(buffers, nbytes, iterations):
    """Seconds per allreduce, the slowest rank's."""
    t = buffers.get(nbytes)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(t)
    seconds = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def result_line(nbytes, iterations, repeats, seconds):
    n = dist.get_world_size()
    busbw = nbytes * 2 * (n - 1) / n / seconds / 1e9
    return json.dumps({"backend": "torch_gloo", "world_size": n, "bytes": nbytes,
                       "iters": iterations, "repeats": repeats,
                       "latency_us": round(seconds * 1e6, 3), "busbw_gbps": round(busbw, 4)})


def serve_follower(rank, world_size, port):
    """Ranks 1..n-1 in --serve mode: do what rank 0 broadcasts until it says stop."""
    init(rank, world_size, port)
    buffers = Buffers()
    command = torch.zeros(3, dtype=torch.int64)
    while True:
        dist.broadcast(command, 0)
        nbytes, iterations, warmup = (int(v) for v in command)
        if nbytes < 0:
            break
        if warmup > 0:
            warm_up(buffers, nbytes, warmup)
        if iterations > 0:
            measure(buffers, nbytes, iterations)
    dist.destroy_process_group()


def serve(args):
    port = args.port or free_port()
    ctx = multiprocessing.get_context("spawn")
    followers = [ctx.Process(target=serve_follower, args=(r, args.nproc, port))
                 for r in range(1, args.nproc)]
    for p in followers:
        p.start()
    try:
        init(0, args.nproc, port)
        buffers = Buffers()
        print("ready", flush=True)
        for line in sys.stdin:
            nbytes, iterations, warmup = (int(v) for v in line.split())
            dist.broadcast(torch.tensor([nbytes, iterations, warmup], dtype=torch.int64), 0)
            seconds = 0.0
            if warmup > 0:
                warm_up(buffers, nbytes, warmup)
            if iterations > 0:
                seconds = measure(buffers, nbytes, iterations)
            print(result_line(nbytes, iterations, 1, seconds) if iterations > 0 else
                  json.dumps({"backend": "torch_gloo", "latency_us": 0}), flush=True)
        dist.broadcast(torch.tensor([-1, 0, 0], dtype=torch.int64), 0)
        dist.destroy_process_group()
    finally:
        for p in followers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def sweep_rank(rank, args, port):
    init(rank, args.nproc, port)
    buffers = Buffers()
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        iterations = args.iters or max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_REPEAT // nbytes))
        warm_up(buffers, nbytes, args.warmup)
        times = [measure(buffers, nbytes, iterations) for _ in range(args.repeats)]
        if rank == 0:
            print(result_line(nbytes, iterations, args.repeats, statistics.median(times)),
                  flush=True)
        nbytes *= 4
    dist.destroy_process_group()


def sweep(args):
    port = args.port or free_port()
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=sweep_rank, args=(r, args, port)) for r in range(args.nproc)]
    for p in ranks:
        p.start()
    failed = False
    for p in ranks:
        p.join(timeout=TIMEOUT_S * 4)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        failed = failed or p.exitcode != 0
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--iters", type=int, default=0, help="0: about 64 MiB worth per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--serve", action="store_true", help="be driven over stdin (see above)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2")
    if args.serve:
        serve(args)
        return 0
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
