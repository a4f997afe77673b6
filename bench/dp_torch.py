"""PyTorch's side of `shoal bench dp`: data parallelism in one process (nn.DataParallel) and across
processes (DistributedDataParallel, gloo) on the models of `shoal bench`, one thread per replica.

usage: dp_torch.py --mode dp|dp_module|ddp --model cnn|mlp|transformer --replicas K --batch B --steps N
                   --warmup W --result FILE

dp_module: torch.nn.DataParallel as it is. Without a GPU it keeps device_ids=[] and calls the
           module itself: one thread, no replicas (what a CPU user of nn.DataParallel gets).
dp:        nn.DataParallel's algorithm on K CPU "devices", written out because its replicate()
           and parallel_apply() refuse CPU tensors (Broadcast and torch.cuda.device): each step,
           replicate = the module's parameters cloned differentiably into K-1 shallow replicas
           (Broadcast's copies), scatter = chunk, parallel_apply = one Python thread per replica
           (under the GIL), gather = cat; backward runs autograd once over all replicas.
ddp:       K processes, DistributedDataParallel over gloo, batch B/K each.
Writes one JSON object to FILE: samples_per_s, and for dp the per-step phase times in ms.
"""
import json
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_common import argument_parser, make_model, run_ranks, timed_steps


def data(batch):
    torch.manual_seed(1)
    return torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))


def shallow_replica(module):
    """A replica sharing nothing but structure (as Module._replicate_for_data_parallel)."""
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    replica._parameters = dict(module._parameters)
    replica._buffers = dict(module._buffers)
    replica._modules = {k: shallow_replica(v) for k, v in module._modules.items()}
    return replica


def set_parameters(replica, tensors):
    it = iter(tensors)
    for m in replica.modules():
        for k in m._parameters:
            m._parameters[k] = next(it)


def run_dp(args):
    torch.set_num_threads(1)
    model = make_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = data(args.batch)
    replicas = [model] + [shallow_replica(model) for _ in range(args.replicas - 1)]
    phases = {"scatter": 0.0, "replicate": 0.0, "forward": 0.0, "gather": 0.0, "backward": 0.0,
              "optimizer": 0.0}
    replica_forward = [0.0] * args.replicas

    def step(timed):
        t0 = time.perf_counter()
        opt.zero_grad()
        inputs = x.chunk(args.replicas)
        t1 = time.perf_counter()
        params = list(model.parameters())
        for r in range(1, len(inputs)):
            set_parameters(replicas[r], [p.clone() for p in params])  # Broadcast: differentiable
        t2 = time.perf_counter()
        outputs = [None] * len(inputs)
        grad_enabled = torch.is_grad_enabled()

        def work(r):
            torch.set_grad_enabled(grad_enabled)
            torch.set_num_threads(1)
            s = time.perf_counter()
            outputs[r] = replicas[r](inputs[r])
            replica_forward[r] += time.perf_counter() - s if timed else 0.0

        threads = [threading.Thread(target=work, args=(r,)) for r in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t3 = time.perf_counter()
        out = torch.cat(outputs, 0)
        t4 = time.perf_counter()
        F.cross_entropy(out, y).backward()
        t5 = time.perf_counter()
        opt.step()
        t6 = time.perf_counter()
        if timed:
            for name, d in zip(("scatter", "replicate", "forward", "gather", "backward", "optimizer"),
                               (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                phases[name] += d

    for _ in range(args.warmup):
        step(False)
    start = time.perf_counter()
    for _ in range(args.steps):
        step(True)
    seconds = time.perf_counter() - start
    result = {"samples_per_s": args.batch * args.steps / seconds}
    for name, total in phases.items():
        result[name + "_ms"] = 1e3 * total / args.steps
    result["slowest_replica_forward_ms"] = 1e3 * max(replica_forward) / args.steps
    return result


def run_dp_module(args):
    torch.set_num_threads(1)
    model = nn.DataParallel(make_model(args.model))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = data(args.batch)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return {"samples_per_s": args.batch * args.steps / (time.perf_counter() - start),
            "device_ids": len(model.device_ids)}


def ddp_worker(rank, args):
    ddp = nn.parallel.DistributedDataParallel(make_model(args.model))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x, y = data(args.batch)
    per_rank = args.batch // args.replicas
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]

    def step():
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    return {"seconds": timed_steps(step, args.warmup, args.steps)}


def run_ddp(args):
    seconds = max(r["seconds"] for r in run_ranks(ddp_worker, args, args.replicas))
    per_rank = args.batch // args.replicas
    return {"samples_per_s": per_rank * args.replicas * args.steps / seconds}


def main():
    parser = argument_parser(steps=10, warmup=2, batch=128)
    parser.add_argument("--mode", required=True, choices=["dp", "dp_module", "ddp"])
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    run = {"dp": run_dp, "dp_module": run_dp_module, "ddp": run_ddp}[args.mode]
    with open(args.result, "w") as f:
        json.dump(run(args), f)


if __name__ == "__main__":
    main()
