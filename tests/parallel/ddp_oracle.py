"""PyTorch's own DistributedDataParallel (gloo, 2 processes) on the models and data of
test_ddp_vs_pytorch.cpp: the oracle Shoal's DDP is compared with.

usage: ddp_oracle.py MODEL INIT_FILE DATA_FILE OUT_FILE STEPS BATCH_PER_RANK WORLD
Files are raw little-endian float32: INIT_FILE the initial parameters (named_parameters order,
flattened), DATA_FILE for each step the global batch's inputs then its labels (as floats),
OUT_FILE rank 0's final parameters.

usage: ddp_oracle.py cases OUT_DIR CASE[,CASE...]
The less common DDP paths of test_ddp_vs_pytorch.cpp (see CASES), 2 processes, in one launch;
also LocalSGD and DiLoCo (local_sgd, diloco), torchft's own where torchft imports.
Weights and data are closed-form (sin of an index, see init_params and inputs), computed the same
way by the C++ test. Writes OUT_DIR/CASE.rankR.f64 for every rank R: raw little-endian float64,
each parameter (named_parameters order, flattened), then each parameter's .grad (NaN where it is
None), then each buffer (named_buffers order).
"""
import functools
import os
import sys
import tempfile
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.join import Join, Joinable, JoinHook


class SmallCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2).flatten(1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), 1)


class SmallMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), 1)


SAMPLE_SHAPES = {"cnn": (1, 12, 12), "mlp": (20,)}


def finish():
    """Ends a rank once its results are written: destroys the group, then leaves without the
    interpreter's finalization. On 2 busy cores PyTorch 2.x's gloo once aborted a rank there
    ("terminate called without an active exception", SIGABRT) after every result was written; what
    is left to run at that point is only teardown, so it is skipped."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(rank, args, init_file):
    model_name, init_path, data_path, out_path, steps, batch, world = args
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = SmallCnn() if model_name == "cnn" else SmallMlp()
    flat = torch.from_numpy(np.fromfile(init_path, dtype="<f4"))
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    assert offset == flat.numel(), "initial parameter file does not match the model"
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.from_numpy(np.fromfile(data_path, dtype="<f4"))
    shape = SAMPLE_SHAPES[model_name]
    per_sample = int(np.prod(shape))
    global_batch = batch * world
    step_floats = global_batch * (per_sample + 1)
    for step in range(steps):
        chunk = data[step * step_floats:(step + 1) * step_floats]
        x = chunk[:global_batch * per_sample].view(global_batch, *shape)
        y = chunk[global_batch * per_sample:].long()
        xr, yr = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
        opt.zero_grad(set_to_none=False)
        F.nll_loss(ddp(xr), yr).backward()
        opt.step()
    if rank == 0:
        out = torch.cat([p.detach().flatten() for p in model.parameters()])
        out.numpy().astype("<f4").tofile(out_path)
    finish()


# ---- cases ------------------------------------------------------------------------------------

def init_params(model):
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            n = p.numel()
            p.copy_((torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + k) * 0.4).view_as(p))


def inputs(rank, step, shape, offset=0.0, scale=1.0):
    n = int(np.prod(shape))
    x = torch.sin(torch.arange(n, dtype=torch.float64) * 0.113 + 1.7 * step + 0.9 * rank)
    return (x * scale + offset).view(*shape).float()


def labels(rank, step, batch, classes):
    return (torch.arange(batch) * 3 + step + rank) % classes


class JoinNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.bn(self.fc1(x)))), 1)


class BranchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)
        self.c = nn.Linear(6, 4)

    def forward(self, x, use_b, use_c):
        out = self.a(x)
        if use_b:
            out = out + self.b(x)
        if use_c:
            out = out + self.c(x)
        return F.log_softmax(out, 1)


class BnNet(nn.Module):
    # bn2 sits after a Linear: its input gradient (sums over every rank) reaches mid's parameters.
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.mid = nn.Linear(4, 4)
        self.bn2 = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return F.log_softmax(self.fc(self.bn2(self.mid(self.bn(x)))), 1)


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 6)
        self.fc2.weight = self.fc1.weight
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        return F.log_softmax(self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), 1)


class Fail(torch.autograd.Function):
    """Identity whose backward raises: an exception in the middle of DDP's backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward failed on purpose")


class FailNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x, fail):
        h = torch.relu(self.fc1(x))
        if fail:
            h = Fail.apply(h)
        return F.log_softmax(self.fc2(h), 1)


class ReorderNet(nn.Module):
    """Registered in the opposite order of use: gradients arrive in registration order."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(8, 4)
        self.hidden = nn.Linear(6, 8)

    def forward(self, x):
        return F.log_softmax(self.out(torch.relu(self.hidden(x))), 1)


class EmbNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, idx):
        return F.log_softmax(self.fc(self.emb(idx)), 1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = nn.Linear(64, 3)

    def forward(self, x):
        return F.log_softmax(self.fc(torch.relu(self.conv(x)).flatten(1)), 1)


def sgd(model, weight_decay=0.0):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)


def batches(shape, classes):
    """batch(rank, step) of closed-form inputs of `shape` and labels of `classes` classes."""
    return lambda rank, step: (inputs(rank, step, shape), labels(rank, step, shape[0], classes))


# 5 samples of 6 features, 4 classes: the batch of JoinNet, BranchNet, TiedNet and FailNet.
SMALL_BATCH = batches((5, 6), 4)


def train(module, opt, rank, steps, batch=SMALL_BATCH, forward_args=(), after_backward=None,
          after_step=None):
    """The step every case shares, for each of `steps`: zero_grad (to zeros, not None), forward of
    batch(rank, step) through `module`, nll_loss, backward, after_backward(), SGD step,
    after_step()."""
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=False)
        F.nll_loss(module(x, *forward_args), y).backward()
        if after_backward:
            after_backward()
        opt.step()
        if after_step:
            after_step()


# ---- LocalSGD and DiLoCo: torchft's own where it imports (the 2.x leg), else a reference --------

SYNC_EVERY = 2   # inner steps between syncs
OUTER_STEPS = 3  # syncs in each case


class DoneWork:
    """What the stand-in Manager's allreduce returns: the averaging already happened."""

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self, timeout=None):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self.tensor)
        return future


def without_telemetry():
    """Stands in for torchft.otel, the only module of torchft that imports OpenTelemetry (its
    package __init__ sets up a log exporter with it): the oracle installs torchft without its
    telemetry dependencies, and LocalSGD and DiLoCo never log through it."""
    import types
    otel = types.ModuleType("torchft.otel")
    otel.setup_logger = lambda *args, **kwargs: None
    sys.modules["torchft.otel"] = otel


def torchft_or_none():
    """torchft.local_sgd, or None where torchft does not import (PyTorch 1.13 has no torchft)."""
    try:
        try:
            import torchft  # noqa: F401
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("opentelemetry"):
                raise
            for name in [n for n in sys.modules if n == "torchft" or n.startswith("torchft.")]:
                del sys.modules[name]
            without_telemetry()
        from torchft import local_sgd
        from torchft.manager import Manager
    except Exception as e:  # ImportError, or a torchft that needs a newer torch
        print("ddp_oracle: torchft does not import (%s: %s); LocalSGD and DiLoCo against the "
              "reference in this file" % (type(e).__name__, e), file=sys.stderr, flush=True)
        return None
    print("ddp_oracle: LocalSGD and DiLoCo against torchft's own", file=sys.stderr, flush=True)
    return local_sgd, Manager


def averaging_manager(manager_class):
    """A torchft Manager stand-in, as torchft's own local_sgd_test.py drives LocalSGD and DiLoCo
    without a lighthouse (create_autospec): each quorum commits, and allreduce averages over the
    gloo group (sum, then / world size, as the Manager's allreduce averages over participants)."""
    from unittest.mock import create_autospec
    manager = create_autospec(manager_class)
    manager._use_async_quorum = False
    manager.should_commit.return_value = True
    manager.current_step.return_value = 0
    manager.errored.return_value = None

    def allreduce(tensor, *args, **kwargs):
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
        return DoneWork(tensor)

    manager.allreduce.side_effect = allreduce
    return manager


def average_(tensors):
    with torch.no_grad():
        for t in tensors:
            dist.all_reduce(t)
            t /= dist.get_world_size()


def reference_local_sgd(model):
    """After every SYNC_EVERY-th optimizer step, the parameters become their average."""
    def after_step():
        after_step.steps += 1
        if after_step.steps % SYNC_EVERY == 0:
            average_([p.data for p in model.parameters()])
    after_step.steps = 0
    return after_step


def reference_diloco(model, outer):
    """torchft's DiLoCo: the pseudo-gradient global - local, averaged, is the .grad of the
    parameters reset to the global copy; the outer optimizer steps them; that is the new global."""
    backup = [p.detach().clone() for p in model.parameters()]

    def after_step():
        after_step.steps += 1
        if after_step.steps % SYNC_EVERY != 0:
            return
        pseudo = [g - p.detach() for g, p in zip(backup, model.parameters())]
        average_(pseudo)
        with torch.no_grad():
            for p, g, d in zip(model.parameters(), backup, pseudo):
                p.copy_(g)
                p.grad = d
        outer.step()
        for g, p in zip(backup, model.parameters()):
            g.copy_(p.detach())
        outer.zero_grad(set_to_none=True)
    after_step.steps = 0
    return after_step


def outer_sgd(model):
    """DiLoCo's outer optimizer as the paper gives it: Nesterov SGD, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)


def inner_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


class SyncNet(nn.Module):
    """BatchNorm on the inputs, so that no parameter feeds a BatchNorm: each has a gradient well
    above rounding (JoinNet's fc1 bias, right before its BatchNorm, has none, and AdamW's
    normalised step turns that rounding noise into lr-sized steps that differ between PyTorch
    versions)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(self.bn(x)))), 1)


def periodic_sync(rank, diloco):
    """SyncNet (its BatchNorm's statistics stay each replica's own, as torchft leaves buffers),
    SYNC_EVERY x OUTER_STEPS inner steps, LocalSGD with momentum SGD or DiLoCo with AdamW."""
    model = SyncNet()
    init_params(model)
    inner = inner_adamw(model) if diloco else sgd(model)
    steps = range(SYNC_EVERY * OUTER_STEPS)
    torchft = torchft_or_none()
    if torchft is None:
        after = reference_diloco(model, outer_sgd(model)) if diloco else reference_local_sgd(model)
        train(model, inner, rank, steps, after_step=after)
        return model
    local_sgd, manager_class = torchft
    manager = averaging_manager(manager_class)
    if not diloco:
        wrapper = local_sgd.LocalSGD(manager, model, inner, sync_every=SYNC_EVERY)
    else:
        import inspect
        fragments = "model_fragments" in inspect.signature(local_sgd.DiLoCo).parameters
        wrapper = local_sgd.DiLoCo(manager, [model] if fragments else model, inner,
                                   outer_sgd(model), sync_every=SYNC_EVERY)
    with wrapper:
        train(model, inner, rank, steps)
    return model


def case_local_sgd(rank):
    return periodic_sync(rank, diloco=False)


def case_diloco(rank):
    return periodic_sync(rank, diloco=True)


# ---- the cases that are only the shared step: a table -----------------------------------------

class Case(NamedTuple):
    """A case that is only the shared step: build `model`, init_params, wrap it in DDP(**ddp),
    make `optimizer`, then train() over `steps`. The hooks take (model, ddp, rank)."""
    model: Callable[[], nn.Module]
    ddp: dict = {}
    optimizer: Callable = sgd
    steps: Sequence[int] = range(3)
    batch: Callable = SMALL_BATCH
    forward_args: tuple = ()
    after_backward: Optional[Callable] = None
    after_step: Optional[Callable] = None


def run(rank, case):
    model = case.model()
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model, **case.ddp)

    def hook(fn):  # a Case hook, bound to this model, DDP and rank
        return None if fn is None else lambda: fn(model, ddp, rank)

    train(ddp, case.optimizer(model), rank, case.steps, case.batch, case.forward_args,
          hook(case.after_backward), hook(case.after_step))
    return model


def evaluate_unevenly(model, ddp, rank):
    with torch.no_grad():  # a different number of evaluation batches on each rank
        for i in range(3 if rank == 0 else 1):
            ddp(inputs(rank, 10 + i, (4, 20)))


def ignoring(model, names):
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return model


def assert_grad_keeps_strides(model, ddp, rank):
    assert model.conv.weight.grad.stride() == model.conv.weight.stride()


TABLE = {
    "uneven_evaluation": Case(SmallMlp, batch=batches((4, 20), 10), after_step=evaluate_unevenly),
    "tied_weights": Case(TiedNet),
    # PyTorch 1.13 cannot continue after an exception in backward ("Expected to have finished
    # reduction in the prior iteration"); Shoal resets and continues, as if the failed step had
    # not been taken: the oracle skips it (step 1).
    "backward_exception": Case(FailNet, steps=(0, 2), forward_args=(False,)),
    # Shoal checkpoints fc2 (a backward() inside backward, re-entrant); checkpointing does not
    # change the math, so the oracle is the plain model.
    "reentrant_checkpoint": Case(FailNet, forward_args=(False,)),
    "sparse_embedding": Case(
        EmbNet, optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        # rows overlap partly between ranks
        batch=lambda rank, step: ((torch.arange(5) * (rank + 2) + step) % 10,
                                  labels(rank, step, 5, 3))),
    "static_graph": Case(BranchNet, ddp=dict(static_graph=True),
                         optimizer=lambda model: sgd(model, weight_decay=0.01),
                         forward_args=(True, False)),
    "ignored_parameters": Case(
        lambda: ignoring(JoinNet(), ["fc2.weight", "fc2.bias", "bn.running_mean"])),
    "channels_last_bucket_view": Case(
        lambda: ConvNet().to(memory_format=torch.channels_last),
        ddp=dict(gradient_as_bucket_view=True),
        batch=lambda rank, step: (
            inputs(rank, step, (3, 2, 6, 6)).contiguous(memory_format=torch.channels_last),
            labels(rank, step, 3, 3)),
        after_backward=assert_grad_keeps_strides),
}


# ---- the cases a table would hide the point of ------------------------------------------------

def join(rank, model, **join_args):
    """Rank 0 runs out of inputs after 1 step, rank 1 after 4."""
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = sgd(model)
    with ddp.join(**join_args):
        train(ddp, opt, rank, range(1 if rank == 0 else 4))
    return model


def case_join(rank):
    return join(rank, JoinNet())


def case_join_divide_by_active_ranks(rank):
    return join(rank, JoinNet(), divide_by_initial_world_size=False)


def case_join_throw_on_early_termination(rank):
    model = JoinNet()
    try:
        join(rank, model, throw_on_early_termination=True)
        raise AssertionError("no early termination")
    except RuntimeError as e:
        assert "exhausted" in str(e), str(e)
    return model


class StepCounter(Joinable):
    """A user's joinable that communicates each step: allreduces a 1 (a 0 when joined), adds the
    sum to `total`; its post_hook records is_last_joiner."""

    class Hook(JoinHook):
        def __init__(self, counter):
            self.counter = counter

        def main_hook(self):
            self.counter.add(torch.zeros(1, dtype=torch.float64))
            self.counter.shadowed += 1

        def post_hook(self, is_last_joiner):
            self.counter.last_joiner = float(is_last_joiner)

    def __init__(self):
        super().__init__()
        self.total, self.shadowed, self.last_joiner = 0.0, 0.0, -1.0

    def add(self, t):
        dist.all_reduce(t)
        self.total += t.item()

    def step(self):
        Join.notify_join_context(self)
        self.add(torch.ones(1, dtype=torch.float64))

    def join_hook(self, **kwargs):
        return StepCounter.Hook(self)

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD

    def results(self):
        return torch.tensor([self.total, self.shadowed, self.last_joiner], dtype=torch.float64)


def join_with_counter(rank, counter_first):
    """Join over DDP and a StepCounter, uneven inputs as join(); the counter steps after the
    optimizer (DDP first) or before the forward (counter first). The counter's results are
    dumped as a buffer of the model."""
    model = JoinNet()
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = sgd(model)
    counter = StepCounter()
    with Join([counter, ddp] if counter_first else [ddp, counter]):
        for step in range(1 if rank == 0 else 4):
            if counter_first:
                counter.step()
            x, y = SMALL_BATCH(rank, step)
            opt.zero_grad(set_to_none=False)
            F.nll_loss(ddp(x), y).backward()
            opt.step()
            if not counter_first:
                counter.step()
    model.register_buffer("counter", counter.results())
    return model


def case_join_joinable(rank):
    return join_with_counter(rank, counter_first=False)


def case_join_joinable_first(rank):
    return join_with_counter(rank, counter_first=True)


def power_sgd(rank, model, batch, matrix_rank):
    """PyTorch's own PowerSGD hook (error feedback, warm start, Qs from random_seed 0), from
    iteration 2, for 6 steps; one bucket (the default sizes)."""
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=matrix_rank,
                                   start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    train(ddp, sgd(model), rank, range(6), batch)
    return model


def case_powersgd_rank2(rank):  # Gram-Schmidt; conv2 viewed as 8 x 36; conv1 too small to gain
    return power_sgd(rank, SmallCnn(), batches((4, 1, 12, 12), 10), 2)


def case_powersgd_rank4(rank):  # QR; fc3 (10 x 32) fails min_compression_rate
    return power_sgd(rank, SmallMlp(), batches((4, 20), 10), 4)


def unused_accumulation(rank, view, set_to_none=False):
    model = BranchNet()
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True,
                                              gradient_as_bucket_view=view)
    opt = sgd(model, weight_decay=0.01)

    def loss(step, use_b, use_c):
        return F.nll_loss(ddp(inputs(rank, step, (5, 6)), use_b, use_c), labels(rank, step, 5, 4))

    opt.zero_grad(set_to_none=set_to_none)
    with ddp.no_sync():
        loss(0, True, True).backward()
    # b unused on rank 0 but used on rank 1: rank 0's accumulated .grad is reduced. c is used only
    # in the no_sync() pass: PyTorch 1.13 leaves its .grad alone on every rank (the replicas then
    # differ), except as a bucket view, which is reduced; PyTorch 2.x counts the no_sync() use and
    # reduces it (the replicas stay equal). Shoal does what the PyTorch it is built against does.
    loss(1, rank == 1, False).backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    loss(2, False, False).backward()  # b and c unused everywhere: .grad left alone
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    loss(3, rank == 0, False).backward()
    opt.step()
    return model


def case_unused_accumulation(rank):
    return unused_accumulation(rank, False)


def case_unused_accumulation_view(rank):
    return unused_accumulation(rank, True)


def case_unused_accumulation_none(rank):
    # zero_grad(set_to_none=True), PyTorch 2.x's default: an unused parameter's .grad stays None
    # (not reduced, not decayed by SGD) until a backward uses it.
    return unused_accumulation(rank, False, set_to_none=True)


def sync_batch_norm(rank, dtype):
    # PyTorch 1.13's SyncBatchNorm runs on CUDA only; over 2 ranks it is by definition BatchNorm
    # over both ranks' samples, with the loss averaged over them: the oracle (no DDP).
    model = BnNet().to(dtype)
    init_params(model)

    def both_ranks(rank, step):
        x = torch.cat([inputs(r, step, (6, 4), offset=1e4) for r in range(2)]).to(dtype)
        return x, torch.cat([labels(r, step, 6, 3) for r in range(2)])

    train(model, sgd(model), rank, range(3), batch=both_ranks)
    return model


def case_sync_batch_norm_float(rank):
    return sync_batch_norm(rank, torch.float32)


def case_sync_batch_norm_double(rank):
    return sync_batch_norm(rank, torch.float64)


def case_rebuild_after_no_sync(rank):
    model = ReorderNet()
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = sgd(model)
    opt.zero_grad(set_to_none=False)
    with ddp.no_sync():  # the first backward is not synchronised: no rebuild from it
        F.nll_loss(ddp(inputs(rank, 0, (5, 6))), labels(rank, 0, 5, 4)).backward()
    for step in range(1, 4):
        F.nll_loss(ddp(inputs(rank, step, (5, 6))), labels(rank, step, 5, 4)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return model


def case_retain_graph(rank):
    model = BranchNet()
    init_params(model)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = sgd(model)
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        loss = F.nll_loss(ddp(inputs(rank, step, (5, 6)), True, False), labels(rank, step, 5, 4))
        loss.backward(retain_graph=True)
        loss.backward()  # not prepared by a forward: accumulates locally, as PyTorch does
        opt.step()
    return model


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}
CASES.update({name: functools.partial(run, case=case) for name, case in TABLE.items()})


def dump(model, path):
    parts = [p.detach().double().flatten() for p in model.parameters()]
    for p in model.parameters():
        g = p.grad
        if g is not None and g.is_sparse:
            g = g.to_dense()
        parts.append(g.detach().double().flatten() if g is not None
                     else torch.full((p.numel(),), float("nan"), dtype=torch.float64))
    parts += [b.detach().double().flatten() for b in model.buffers()]
    torch.cat(parts).numpy().astype("<f8").tofile(path)


def cases_worker(rank, out_dir, names, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    for name in names:
        torch.manual_seed(0)
        model = CASES[name](rank)
        dump(model, os.path.join(out_dir, "%s.rank%d.f64" % (name, rank)))
        dist.barrier()
        print("ddp_oracle rank %d: case %s done" % (rank, name), file=sys.stderr, flush=True)
    finish()


def main():
    if sys.argv[1] == "cases":
        out_dir, names = sys.argv[2], sys.argv[3].split(",")
        unknown = [n for n in names if n not in CASES]
        assert not unknown, "unknown cases %s (known: %s)" % (unknown, sorted(CASES))
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(cases_worker, args=(out_dir, names, os.path.join(tmp, "init")), nprocs=2,
                     join=True)
        # The closing line (after every rank ended well): the C++ side requires it.
        print("ORACLE OK %d cases" % len(names), flush=True)
        return
    model, init_path, data_path, out_path = sys.argv[1:5]
    steps, batch, world = (int(v) for v in sys.argv[5:8])
    args = (model, init_path, data_path, out_path, steps, batch, world)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "init")), nprocs=world, join=True)
    print("ORACLE OK %s %d steps" % (model, steps), flush=True)


if __name__ == "__main__":
    main()
