"""What the Python test scripts of tests/train share: how they skip for want of a dependency."""
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
