"""PyTorch 2.x's own tensor parallelism (parallelize_module and loss_parallel, gloo on CPU) on the
GPT of test_tensor_parallel.cpp: the oracle Shoal's TP is compared with. The model and the plan are
bench/tp_torch.py's (one plan for the benchmark and the test); SGD, every TP rank on the whole
batch, float64.

usage: tp_oracle.py DIR WORLD STEPS LR N_LAYER N_HEAD N_EMBD BLOCK_SIZE VOCAB_SIZE BATCH TOKENS
DIR holds (raw little-endian float64 files, written by the C++ test):
  names.txt  the parameters, one "NAME NUMEL" a line (the tied lm_head.weight once, as
             transformer.wte.weight)
  init.f64   their initial values, in that order, flattened
  data.f64   for each step the token ids [BATCH, TOKENS], then the targets (-1: ignored)
Writes DIR/pytorch.f64: the parameters after STEPS steps, whole (the shards gathered), in the
order of names.txt. Prints "ORACLE OK ..." last.
"""
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.device_mesh  # noqa: F401  (imported once, before the ranks fork)
import torch.distributed.tensor.parallel  # noqa: F401
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from gpt_torch import GPT  # noqa: E402
from tp_torch import deinterleave_qkv, forward_backward, parallelize  # noqa: E402


def read_names(directory):
    with open(os.path.join(directory, "names.txt")) as f:
        return [(name, int(numel)) for name, numel in (line.split() for line in f if line.strip())]


def whole(param, name, world):
    """The parameter as the unsplit model holds it: all-gathered (a collective), c_attn's rows
    put back in q, k, v order."""
    full = param.full_tensor() if hasattr(param, "full_tensor") else param
    return deinterleave_qkv(full, world) if ".attn.c_attn." in name else full


def worker(rank, args, init_file):
    directory, world, steps, lr, n_layer, n_head, n_embd, block_size, vocab, batch, tokens = args
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    model = GPT(n_layer, n_head, n_embd, block_size, vocab).double()
    names = read_names(directory)
    flat = torch.from_numpy(np.fromfile(os.path.join(directory, "init.f64"), dtype="<f8"))
    offset = 0
    with torch.no_grad():
        for name, numel in names:
            p = model.get_parameter(name)
            p.copy_(flat[offset:offset + numel].view(p.shape))
            offset += numel
    assert offset == flat.numel(), "init.f64 holds %d values, names.txt %d" % (flat.numel(), offset)
    parallelize(model, world)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = np.fromfile(os.path.join(directory, "data.f64"), dtype="<f8")
    data = torch.from_numpy(data).long().view(steps, 2, batch, tokens)
    for step in range(steps):
        opt.zero_grad()
        forward_backward(model, data[step, 0], data[step, 1])
        opt.step()
    with torch.no_grad():
        state = [whole(model.get_parameter(name), name, world) for name, _ in names]
    if rank == 0:
        out = torch.cat([t.detach().flatten() for t in state]).numpy().astype("<f8")
        out.tofile(os.path.join(directory, "pytorch.f64"))
    dist.destroy_process_group()


def main():
    directory = sys.argv[1]
    world, steps = int(sys.argv[2]), int(sys.argv[3])
    lr = float(sys.argv[4])
    sizes = [int(v) for v in sys.argv[5:12]]
    args = (directory, world, steps, lr, *sizes)
    # Forked, not spawned (bench/torch_common.run_ranks): a spawned rank imports torch again,
    # which is most of this oracle's time on a loaded machine.
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "init")), nprocs=world,
                           join=True, start_method="fork")
    print("ORACLE OK %d TP ranks, %d steps" % (world, steps), flush=True)


if __name__ == "__main__":
    main()
