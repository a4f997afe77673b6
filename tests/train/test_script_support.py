"""What the Python test scripts of tests/train share: how they skip for want of a dependency,
tally their checks and run shoal, and how the oracles compare Shoal's weights with PyTorch's.

Imported as a sibling module: CTest runs each script by path, which puts tests/train first on
sys.path."""
import os
import subprocess
import sys

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def skip(why):
    """Exit 77 (CTest: skipped); under SHOAL_REQUIRE_ORACLES=1 (CI, where the set-up installs
    everything) a missing dependency is a failure instead."""
    if os.environ.get("SHOAL_REQUIRE_ORACLES") == "1":
        print("FAILED: %s (required: SHOAL_REQUIRE_ORACLES=1)" % why)
        sys.exit(1)
    print("skipped: %s" % why)
    sys.exit(77)


def require_torch():
    """PyTorch (Debian's python3-torch), or a skip."""
    try:
        import torch
    except ImportError:
        skip("python3-torch is not installed")
    return torch


def require_fashion_mnist():
    if not os.path.exists(os.path.join(FASHION_MNIST, "train-images-idx3-ubyte.gz")):
        skip("Fashion-MNIST is not installed")


class Checks:
    """The tally of a test script's checks: check() records a failure (with the run's output when
    one is given) and goes on; finish() exits 1 if any failed, else prints the closing line CTest
    requires (tests/testing/require_closing_line.sh)."""

    def __init__(self, name):
        self.name = name
        self.failures = []
        self.checked = 0

    def check(self, condition, what, run=None):
        self.checked += 1
        if not condition:
            detail = ""
            if run is not None:
                detail = (f"\n  exit {run.returncode}\n  stdout: {run.stdout[-800:]}"
                          f"\n  stderr: {run.stderr[-1500:]}")
            self.failures.append(what + detail)
            print("FAIL:", what + detail, flush=True)

    def finish(self):
        if self.failures:
            print(f"{len(self.failures)} of {self.checked} checks failed")
            sys.exit(1)
        print(f"ORACLE OK {self.name}: {self.checked} checks passed", flush=True)


def run_shoal(binary, *args, env=None, timeout=300):
    """`binary args...` as a user starts it: one intra-op thread, outside any launcher (no RANK,
    WORLD_SIZE or LOCAL_RANK inherited), with `env` added."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full_env.pop(name, None)
    full_env.update(env or {})
    return subprocess.run([binary, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout)


def start_oracle(name):
    """An oracle script's start: the shoal program (its first argument), torch on one intra-op
    thread (a skip without it) and the script's Checks."""
    torch = require_torch()
    torch.set_num_threads(1)
    return sys.argv[1], torch, Checks(name)


def relative(a, b):
    """The largest difference of two tensors relative to the largest value of `b`; integer
    tensors (counters, BatchNorm's num_batches_tracked) must be equal (0, else infinity)."""
    import torch
    if not torch.is_floating_point(b):
        return 0.0 if torch.equal(a, b) else float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def state_matches(check, run, expected, dump, what, in_order=True, tolerance=1e-5):
    """Checks that `run` exited 0 and that the weights it dumped (DUMP.rank0.pt, from
    --dump-parameters) have the keys of the state dict `expected` (in its order when `in_order`)
    and its values to `tolerance` relative. Returns the dumped state dict, None after a failed run."""
    import torch
    check(run.returncode == 0, f"{what}: shoal train exits 0", run)
    if run.returncode != 0:
        return None
    state = torch.load(dump + ".rank0.pt")
    got, want = list(state.keys()), list(expected.keys())
    if not in_order:
        got, want = sorted(got), sorted(want)
    check(got == want, f"{what}: the state dict's keys are PyTorch's ({got[:4]}... against {want[:4]}...)")
    worst = max(relative(state[k], v) for k, v in expected.items() if k in state)
    check(worst <= tolerance,
          f"{what}: weights equal PyTorch's to {tolerance:g} relative (worst {worst:.3g})")
    print(f"{what}: worst relative difference {worst:.3g}", flush=True)
    return state


def average_gradients(replicas):
    """What DDP's allreduce leaves in each replica's .grad: the mean over the replicas."""
    for params in zip(*(m.parameters() for m in replicas)):
        mean = sum(p.grad for p in params) / len(params)
        for p in params:
            p.grad.copy_(mean)
