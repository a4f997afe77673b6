#!/usr/bin/python3
"""`shoal train --model m.pt` on a TorchScript module written and scripted here (convolutions,
BatchNorm, dropout, a residual block), against the same nn.Module trained by PyTorch on the same
data in the same order:

  single       20 SGD steps equal PyTorch's (weights and BatchNorm statistics, 1e-5 relative)
  ddp, 2 ranks 20 steps equal PyTorch's DDP, simulated exactly: each rank's DistributedSampler
               shard, BatchNorm on the rank's own batch, rank 0's buffers broadcast before every
               forward, gradients averaged
  dp, 2 slots  20 steps equal PyTorch's DataParallel semantics: the batch split in two chunks,
               BatchNorm per chunk, replica 0's running statistics kept, gradients summed
  traced       a torch.jit.trace module (conv, residual, linear): 20 steps equal PyTorch's
  dropout on   (p = 0.5) the run trains (the loss falls), differs from p = 0, its test accuracy
               is PyTorch's eval() of the saved weights (dropout off in evaluation), and a second
               run with the same --seed is the same run (weights bit-equal, the same output)
  ps           trains (2 workers, 1 server) and saves a state dict Python loads
  pipeline     a scripted nn.Sequential over 2 stages x 4 micro-batches: 20 steps equal PyTorch's;
               any other module refused in one line saying why
  own loss     a module whose forward(x, y) returns {"loss", "accuracy"}: 20 steps under ddp and
               fsdp (2 ranks) equal PyTorch's DDP; evaluation reports its loss, no accuracy; a
               forward(x, y) returning a tuple is one line naming the file

Every saved state dict loads into the Python module with load_state_dict (strict).

    script_model.py SHOAL_BINARY
"""
import copy
import os
import tempfile
from typing import Dict

from test_script_support import average_gradients, relative, run_shoal, start_oracle, state_matches

SHOAL, torch, checks = start_oracle("script_model")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

check = checks.check


def shoal(*args):
    return run_shoal(SHOAL, "train", *args)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return F.relu(x + self.conv2(F.relu(self.bn1(self.conv1(x)))))


class Net(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.stem = nn.Conv2d(2, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.block = Block(8)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(8 * 10 * 10, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block(x)
        x = self.drop(torch.flatten(x, 1))
        return self.fc(x)


SEED, LR, MOMENTUM, N = 4, 0.05, 0.9, 640
g = torch.Generator().manual_seed(21)
x = torch.randn(N, 2, 12, 12, generator=g)
teacher = torch.randn(x[0].numel(), 10, generator=g)
y = (x.reshape(N, -1).double() @ teacher.double()).argmax(1)
xt, yt = x[:128].clone(), y[:128].clone()
torch.manual_seed(0)
initial = Net(0.0)


def compare(run, reference, dump, what):
    state = state_matches(check, run, reference.state_dict(), dump, what, in_order=False)
    if state is not None:
        Net(0.0).load_state_dict(state)  # strict: every key of the Python module, nothing else
    return state


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def order(epoch=0):
    return torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))


def sgd_steps(model, steps=20, batch=32):
    """`model` after `steps` SGD steps of `batch` samples in epoch 0's order, one process."""
    opt = sgd(model)
    perm = order()
    for step in range(steps):
        idx = perm[step * batch:(step + 1) * batch]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


with tempfile.TemporaryDirectory() as tmp:
    data = os.path.join(tmp, "data.pt")
    torch.save({"train_x": x, "train_y": y, "test_x": xt, "test_y": yt}, data)
    script = os.path.join(tmp, "m.pt")
    torch.jit.script(initial).save(script)
    common = ["--model", script, "--data", data, "--seed", str(SEED), "--lr", str(LR),
              "--momentum", str(MOMENTUM), "--threads", "1", "--no-progress"]

    # --- single: 20 steps of 32
    model = sgd_steps(copy.deepcopy(initial))
    perm = order()
    dump = os.path.join(tmp, "single")
    compare(shoal(*common, "--batch-size", "32", "--dump-parameters", dump), model, dump,
            "single")

    # --- ddp, 2 ranks of 16: PyTorch's DDP, one replica per rank, simulated step by step
    ranks = [copy.deepcopy(initial) for _ in range(2)]
    opts = [sgd(m) for m in ranks]
    shards = []
    for r in range(2):
        sampler = torch.utils.data.DistributedSampler(range(N), num_replicas=2, rank=r, shuffle=True,
                                                      seed=SEED)
        sampler.set_epoch(0)
        shards.append(torch.tensor(list(sampler)))
    for step in range(20):
        for name, buf in ranks[0].named_buffers():  # broadcast_buffers: rank 0's, every forward
            dict(ranks[1].named_buffers())[name].copy_(buf)
        for r in range(2):
            idx = shards[r][step * 16:(step + 1) * 16]
            opts[r].zero_grad()
            F.cross_entropy(ranks[r](x[idx]), y[idx]).backward()
        average_gradients(ranks)
        for o in opts:
            o.step()
    dump = os.path.join(tmp, "ddp")
    compare(shoal(*common, "--strategy", "ddp", "--nproc-per-node", "2", "--batch-size", "16",
                  "--dump-parameters", dump), ranks[0], dump, "ddp, 2 ranks")

    # --- dp, 2 slots: chunks of 16 through replica 0 (the module) and a replica, grads summed
    model = copy.deepcopy(initial)
    opt = sgd(model)
    for step in range(20):
        idx = perm[step * 32:(step + 1) * 32]
        replica = copy.deepcopy(model)  # fresh parameters and buffers from the module each step
        opt.zero_grad()
        out = torch.cat([model(x[idx[:16]]), replica(x[idx[16:]])])
        F.cross_entropy(out, y[idx]).backward()
        for p, q in zip(model.parameters(), replica.parameters()):
            p.grad += q.grad
        opt.step()
    dump = os.path.join(tmp, "dp")
    compare(shoal(*common, "--strategy", "dp", "--replicas", "2", "--batch-size", "32",
                  "--dump-parameters", dump), model, dump, "dp, 2 slots")

    # --- dropout on: trains, differs from p = 0, evaluates with dropout off
    torch.manual_seed(0)
    dropping = Net(0.5)
    script_drop = os.path.join(tmp, "m_dropout.pt")
    torch.jit.script(dropping).save(script_drop)
    dump = os.path.join(tmp, "dropout")
    args = [a if a != script else script_drop for a in common]
    run = shoal(*args, "--batch-size", "32", "--epochs", "4", "--dump-parameters", dump)
    check(run.returncode == 0, "dropout on: shoal train exits 0", run)
    if run.returncode == 0:
        losses = [float(l.split("train loss ")[1].split(",")[0]) for l in run.stdout.splitlines()
                  if "train loss" in l]
        check(len(losses) == 4 and losses[-1] < 0.9 * losses[0],
              f"dropout on: the training loss falls over 4 epochs ({losses})", run)
        state = torch.load(dump + ".rank0.pt")
        single = torch.load(os.path.join(tmp, "single.rank0.pt"))
        check(relative(state["fc.weight"], single["fc.weight"]) > 1e-3,
              "dropout on: the weights differ from the p = 0 run")
        # --seed promises the same run: the dropout masks too (torch's default generator, which
        # LibTorch seeds at random in every process unless it is seeded).
        again = shoal(*args, "--batch-size", "32", "--epochs", "4", "--dump-parameters",
                      dump + "-again")
        check(again.returncode == 0, "dropout on, again: shoal train exits 0", again)
        if again.returncode == 0:
            repeat = torch.load(dump + "-again.rank0.pt")
            differing = [k for k in state if not torch.equal(state[k], repeat[k])]
            untimed = lambda out: [l.split(" (")[0] for l in out.splitlines() if "loss" in l]
            check(not differing and untimed(again.stdout) == untimed(run.stdout),
                  f"dropout on: the same --seed gives the same run (differing: {differing})", again)
        fresh = Net(0.5)
        fresh.load_state_dict(state)
        fresh.eval()
        with torch.no_grad():
            accuracy = (fresh(xt).argmax(1) == yt).double().mean().item()
        line = [l for l in run.stdout.splitlines() if l.startswith("final test accuracy")]
        check(len(line) == 1 and abs(float(line[0].split()[-1]) - accuracy) < 1e-4,
              f"dropout on: test accuracy {line} is PyTorch's eval() accuracy {accuracy:.4f}", run)

    # --- torch.jit.trace: a module without train/eval-dependent layers (tracing freezes those),
    # conv and a residual connection, 20 steps single equal PyTorch's
    class Traced(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(2, 4, 3)
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.fc = nn.Linear(4 * 10 * 10, 10)

        def forward(self, x):
            h = F.relu(self.stem(x))
            h = F.relu(h + self.conv(h))
            return self.fc(torch.flatten(h, 1))

    torch.manual_seed(1)
    traced_initial = Traced()
    traced_file = os.path.join(tmp, "traced.pt")
    torch.jit.trace(traced_initial, x[:2]).save(traced_file)
    model = sgd_steps(copy.deepcopy(traced_initial))
    dump = os.path.join(tmp, "traced")
    run = shoal(*[a if a != script else traced_file for a in common], "--batch-size", "32",
                "--dump-parameters", dump)
    state = state_matches(check, run, model.state_dict(), dump, "traced, 20 steps", in_order=False)
    if state is not None:
        Traced().load_state_dict(state)

    # --- ps: trains, and its state dict loads
    dump = os.path.join(tmp, "ps")
    run = shoal(*common, "--strategy", "ps", "--workers", "2", "--servers", "1", "--batch-size",
                "16", "--dump-parameters", dump)
    check(run.returncode == 0 and "final test accuracy" in run.stdout, "ps: trains", run)
    if run.returncode == 0:
        Net(0.0).load_state_dict(torch.load(dump + ".rank0.pt"))

    # --- pipeline: a module that is not an nn.Sequential is refused in one line saying why
    run = shoal(*common, "--strategy", "pipeline", "--stages", "2", "--batch-size", "32")
    lines = [l for l in run.stderr.splitlines() if l.strip() and "error" in l]
    check(0 < run.returncode < 126, "pipeline, not a Sequential: refused with a non-zero exit", run)
    check(len(lines) >= 1 and "splits into pipeline stages only when it is a torch.nn.Sequential"
          in lines[0], "pipeline, not a Sequential: the refusal says why", run)

    # --- pipeline: a scripted nn.Sequential, 2 stages x 4 micro-batches, 20 steps equal PyTorch's
    # single-process training (the micro-batches' gradients add up to the batch's)
    torch.manual_seed(2)
    sequential = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 10 * 10, 32),
                               nn.ReLU(), nn.Linear(32, 10))
    seq_file = os.path.join(tmp, "sequential.pt")
    torch.jit.script(sequential).save(seq_file)
    model = sgd_steps(copy.deepcopy(sequential))
    dump = os.path.join(tmp, "pipeline")
    run = shoal(*[a if a != script else seq_file for a in common], "--strategy", "pipeline",
                "--stages", "2", "--micro-batches", "4", "--batch-size", "32", "--dump-parameters", dump)
    state = state_matches(check, run, model.state_dict(), dump, "pipeline, Sequential, 20 steps",
                          in_order=False)
    if state is not None:
        copy.deepcopy(sequential).load_state_dict(state)

    # --- a model that computes its own loss: forward(x, y) returns {"loss": ..., "accuracy": ...}
    # (Hugging Face's convention); 20 steps under ddp and fsdp (2 ranks of 16) equal PyTorch's DDP
    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(2 * 12 * 12, 32)
            self.fc2 = nn.Linear(32, 10)

        def forward(self, x, y) -> Dict[str, torch.Tensor]:
            logits = self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
            accuracy = (logits.argmax(1) == y).float().mean()
            return {"loss": F.cross_entropy(logits, y), "accuracy": accuracy}

    torch.manual_seed(3)
    own = OwnLoss()
    own_file = os.path.join(tmp, "own_loss.pt")
    torch.jit.script(own).save(own_file)
    ranks = [copy.deepcopy(own) for _ in range(2)]
    opts = [sgd(m) for m in ranks]
    for step in range(20):
        for r in range(2):
            idx = shards[r][step * 16:(step + 1) * 16]
            opts[r].zero_grad()
            ranks[r](x[idx], y[idx])["loss"].backward()
        average_gradients(ranks)
        for o in opts:
            o.step()
    with torch.no_grad():
        own_test_loss = ranks[0](xt, yt)["loss"].item()
    own_common = [a if a != script else own_file for a in common]
    for strategy in ("ddp", "fsdp"):
        what = f"own loss (dict), {strategy}, 2 ranks"
        dump = os.path.join(tmp, "own_" + strategy)
        run = shoal(*own_common, "--strategy", strategy, "--nproc-per-node", "2", "--batch-size", "16",
                    "--dump-parameters", dump)
        state = state_matches(check, run, ranks[0].state_dict(), dump, what + ", 20 steps",
                              in_order=False)
        if state is not None:
            OwnLoss().load_state_dict(state)
    # A whole epoch (40 steps of 16 x 2): the test loss is the model's own, no accuracy.
    run = shoal(*own_common, "--batch-size", "32")
    line = [l for l in run.stdout.splitlines() if l.startswith("final test loss")]
    check(run.returncode == 0 and len(line) == 1 and "accuracy" not in run.stdout,
          "own loss, single: reports the model's test loss and no accuracy", run)

    # --- a model whose forward(x, y) returns neither a tensor nor a dict with "loss": one line
    class Tupled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2 * 12 * 12, 10)

        def forward(self, x, y):
            logits = self.fc(torch.flatten(x, 1))
            return logits, y

    tupled = os.path.join(tmp, "tupled.pt")
    torch.jit.script(Tupled()).save(tupled)
    run = shoal("--model", tupled, "--data", data, "--no-progress", "--threads", "1")
    lines = [l for l in run.stderr.splitlines() if l.strip()]
    check(0 < run.returncode < 126 and len(lines) == 1 and tupled in lines[0] and
          "neither a tensor nor a dict with 'loss'" in lines[0],
          "forward(x, y) returning a tuple: one line naming the file", run)

    # --- a file that is not TorchScript
    run = shoal("--model", data, "--data", data, "--no-progress", "--threads", "1")
    lines = [l for l in run.stderr.splitlines() if l.strip()]
    check(0 < run.returncode < 126 and len(lines) == 1 and "not a TorchScript model" in lines[0],
          "a .pt that is not TorchScript: one line", run)

checks.finish()
