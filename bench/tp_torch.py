"""PyTorch 2.x's tensor parallelism (torch.distributed.tensor.parallel) on bench/gpt_torch.py's
GPT: the peer of `shoal bench tp`'s shoal_tp mode (gloo, CPU, one thread per rank, random token
blocks, SGD with momentum).

usage: tp_torch.py --steps N --warmup W --batch B --world R --result FILE
                   [--n-layer L --n-head H --n-embd C --block-size T --vocab-size V]
Every rank trains the whole global batch (--world x --batch blocks) through its shard, as Shoal's
TP ranks do. The plan is Shoal's (Megatron's): c_attn and c_fc ColwiseParallel, the c_proj
layers RowwiseParallel, the token embedding RowwiseParallel (vocabulary-split) and the tied head
ColwiseParallel with its logits left split over the vocabulary for loss_parallel's cross-entropy.
PyTorch's ColwiseParallel splits a fused Linear's rows contiguously, so before it does, c_attn's
rows are reordered (interleave_qkv) so that each rank's contiguous slice holds its own heads' q, k
and v, as Shoal's ColwiseParallel{3} splits them: the same computation as the whole model, which
tests/parallel/tp_oracle.py checks Shoal's TP against. Needs PyTorch >= 2.4; run with
PyTorch 2.x's Python (PYTHONPATH=<scripts/setup_torch_pypi.sh --prefix>/.. python3).
Writes one JSON object to FILE: samples_per_s (the global batch's samples), peak_rss_mb and
held_mb (parameters, gradients and momentum a rank keeps between steps), of the largest rank.
"""
import json
import math
import resource

import torch
import torch.nn.functional as F

from gpt_torch import GPT
from torch_common import argument_parser, run_ranks, timed_steps


def interleave_qkv(t, world):
    """c_attn's weight or bias, rows [q; k; v], reordered to [q_0 k_0 v_0; q_1 k_1 v_1; ...]: rank
    r's contiguous 1/world of them is then its heads' q, k and v."""
    return t.reshape(3, world, -1).transpose(0, 1).reshape(t.shape)


def deinterleave_qkv(t, world):
    """The inverse of interleave_qkv: rows [q; k; v] again."""
    return t.reshape(world, 3, -1).transpose(0, 1).reshape(t.shape)


def local_attention(self, x):
    """CausalSelfAttention.forward on this rank's slice of c_attn (its heads' q, k and v, see
    interleave_qkv): as many heads as it holds."""
    B, T, C = x.size()
    head = C // self.n_head
    qkv = self.c_attn(x)
    local = qkv.size(-1) // 3
    q, k, v = (t.reshape(B, T, local // head, head).transpose(1, 2) for t in qkv.split(local, dim=2))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    att = F.softmax(att.masked_fill(future, float("-inf")), dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, local)
    return self.c_proj(y)


def parallelize(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (world,))
    with torch.no_grad():
        for block in model.transformer.h:
            for p in block.attn.c_attn.parameters():
                p.copy_(interleave_qkv(p, world))
    plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            "transformer.wte": RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(model.transformer.h)):
        prefix = "transformer.h.%d." % i
        plan[prefix + "attn.c_attn"] = ColwiseParallel()
        plan[prefix + "attn.c_proj"] = RowwiseParallel()
        plan[prefix + "mlp.c_fc"] = ColwiseParallel()
        plan[prefix + "mlp.c_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # Both hold the [vocabulary, n_embd] weight split by rows (Shard(0)): tied again, as Shoal's.
    model.transformer.wte.weight = model.lm_head.weight
    for block in model.transformer.h:
        block.attn.forward = local_attention.__get__(block.attn)


def forward_backward(model, x, y):
    """The loss of the batch (targets -1 ignored, as Shoal's GPT ignores them), and its backward:
    both inside loss_parallel, as PyTorch requires."""
    from torch.distributed.tensor.parallel import loss_parallel
    pos = torch.arange(0, x.size(1), dtype=torch.long)
    h = model.transformer.wte(x) + model.transformer.wpe(pos)
    for block in model.transformer.h:
        h = block(h)
    logits = model.lm_head(model.transformer.ln_f(h))
    with loss_parallel():
        F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1), ignore_index=-1).backward()


def local_bytes(t):
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(rank, args):
    torch.manual_seed(0)
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    parallelize(model, args.world)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rows = args.world * args.batch
    torch.manual_seed(1)
    x = torch.randint(0, args.vocab_size, (rows, args.block_size))
    y = torch.randint(0, args.vocab_size, (rows, args.block_size))

    def step():
        opt.zero_grad(set_to_none=False)
        forward_backward(model, x, y)
        opt.step()

    seconds = timed_steps(step, args.warmup, args.steps)
    held = 0
    for p in model.parameters():
        held += local_bytes(p) + local_bytes(p.grad)
        held += local_bytes(opt.state.get(p, {}).get("momentum_buffer"))
    return {"seconds": seconds, "held_mb": held / 1048576.0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def main():
    parser = argument_parser(steps=10, warmup=2, batch=4)
    parser.add_argument("--world", type=int, default=2)
    for flag, default in (("--n-layer", 4), ("--n-head", 4), ("--n-embd", 128),
                          ("--block-size", 128), ("--vocab-size", 256)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    try:
        from torch.distributed.tensor.parallel import loss_parallel  # noqa: F401
    except ImportError as error:
        parser.error("needs PyTorch 2.x's torch.distributed.tensor.parallel (torch %s: %s)"
                     % (torch.__version__, error))
    ranks = run_ranks(worker, args, args.world)
    seconds = max(r["seconds"] for r in ranks)
    with open(args.result, "w") as f:
        json.dump({"samples_per_s": args.world * args.batch * args.steps / seconds,
                   "held_mb": max(r["held_mb"] for r in ranks),
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks)}, f)


if __name__ == "__main__":
    main()
