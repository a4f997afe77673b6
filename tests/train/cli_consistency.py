#!/usr/bin/python3
"""`shoal` as a user meets its command line: one error style for every bad flag, limits checked,
the same flag names across train/run/bench, --init-from and --resume with changed hyperparameters.

    cli_consistency.py SHOAL_BINARY
Uses the real Fashion-MNIST (a few hundred images) and Debian's PyTorch to read and write
state dicts. Exit 77 (skipped) when either is missing.
"""
import math
import os
import sys
import tempfile

from test_script_support import FASHION_MNIST, Checks, require_fashion_mnist, require_torch, run_shoal

SHOAL = sys.argv[1]
DATA = FASHION_MNIST
require_fashion_mnist()
torch = require_torch()

checks = Checks("cli_consistency")
check = checks.check


def shoal(*args, env=None):
    return run_shoal(SHOAL, *args, env=env, timeout=120)


SMALL = ["--data-dir", DATA, "--model", "mlp", "--train-samples", "256", "--test-samples", "64",
         "--batch-size", "32", "--no-progress", "--threads", "1"]


def usage_error(args, must_mention, env=None):
    """A bad command line: exit 2, exactly one stderr line 'shoal: error: ...' naming the problem."""
    run = shoal(*args, env=env)
    lines = run.stderr.strip().splitlines()
    name = " ".join(args)
    check(run.returncode == 2, f"'{name}' exits 2", run)
    check(len(lines) == 1, f"'{name}' gives one stderr line", run)
    check(run.stderr.startswith("shoal: error: "), f"'{name}' starts 'shoal: error: '", run)
    check("error: shoal" not in run.stderr and run.stderr.count("error:") == 1,
          f"'{name}' has no doubled prefix", run)
    check(must_mention in run.stderr, f"'{name}' mentions {must_mention!r}", run)


# CLI11's parse errors and Shoal's own checks look alike.
usage_error(["train", "--lr", "abc"], "--lr")
usage_error(["train", "--no-such-flag"], "--no-such-flag")
usage_error(["train", "--strategy", "gossip"], "--strategy")
usage_error(["run", "--bogus", "/bin/true"], "--bogus")
usage_error(["bench", "ddp", "--batch-size", "many"], "--batch-size")
usage_error(["plot"], "FILE")
# Limits: a negative seed does not wrap; a non-finite or absurd learning rate is refused.
usage_error(["train", "--seed", "-1"], "--seed")
usage_error(["train", "--lr", "1e400"], "learning rate")
usage_error(["train", "--lr", "nan"], "learning rate")
usage_error(["train", "--lr", "1e9"], "learning rate")
# Several processes without a distributed strategy would be independent trainings: refused.
usage_error(["train", "--nproc-per-node", "2"], "--strategy ddp")
# Started as one rank of a bigger job without a distributed strategy: refused once for the job
# (rank 0 says why; the other ranks exit 2 without a second copy of the message), never trained
# once per rank.
def rank_env(rank):
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
usage_error(["train", *SMALL], "--strategy ddp", env=rank_env(0))
run = shoal("train", *SMALL, env=rank_env(1))
check(run.returncode == 2 and run.stderr.strip() == "" and "accuracy" not in run.stdout,
      "rank 1 of a job without --strategy exits 2, silently, without training", run)
# Help and version are not errors.
run = shoal("train", "--help")
check(run.returncode == 0 and "--init-from" in run.stdout and "--trace" in run.stdout,
      "train --help lists --init-from and --trace", run)
# The same flag names across train, run and bench.
for command in (["train"], ["run"], ["bench", "ddp"], ["bench", "allreduce"]):
    run = shoal(*command, "--help")
    check("--nproc-per-node" in run.stdout, f"{' '.join(command)} --help has --nproc-per-node", run)
for command in (["train"], ["bench", "ddp"]):
    run = shoal(*command, "--help")
    check("--batch-size" in run.stdout, f"{' '.join(command)} --help has --batch-size", run)

with tempfile.TemporaryDirectory() as tmp:
    # --init-from: a state dict saved by Python, all zeros. From zero weights an MLP's hidden
    # layers get zero gradients (ReLU(0) = 0), so after training only the last bias can differ
    # from zero: proof that the run started from the file, not from the seed.
    run = shoal("train", *SMALL, "--train-samples", "32", "--dump-parameters", f"{tmp}/seeded")
    check(run.returncode == 0, "a one-step run", run)
    seeded = torch.load(f"{tmp}/seeded.rank0.pt")
    zeros = {k: torch.zeros_like(v) for k, v in seeded.items()}
    torch.save(zeros, f"{tmp}/zeros.pt")
    run = shoal("train", *SMALL, "--train-samples", "96", "--init-from", f"{tmp}/zeros.pt",
                "--dump-parameters", f"{tmp}/from_zeros")
    check(run.returncode == 0, "--init-from zeros.pt trains", run)
    trained = torch.load(f"{tmp}/from_zeros.rank0.pt")
    names = list(trained)
    check(all(trained[k].abs().sum().item() == 0 for k in names[:-1]),
          f"--init-from: every tensor but the last bias stayed zero ({names})")
    check(trained[names[-1]].abs().sum().item() > 0, "--init-from: the last bias trained")
    # A state dict of another model is refused with the keys named.
    torch.save({"weight": torch.zeros(3)}, f"{tmp}/other.pt")
    run = shoal("train", *SMALL, "--init-from", f"{tmp}/other.pt")
    check(run.returncode != 0 and run.stderr.startswith("shoal: error: ") and "weight" in run.stderr,
          "--init-from another model's state dict is refused naming the keys", run)
    usage_error(["train", *SMALL, "--init-from", f"{tmp}/zeros.pt", "--resume",
                 "--checkpoint-dir", tmp], "--init-from")

    # --resume with other hyperparameters: applied (and said), never silently the checkpoint's.
    ckpt = f"{tmp}/ckpt"
    run = shoal("train", *SMALL, "--lr", "0.03", "--epochs", "1", "--checkpoint-dir", ckpt)
    check(run.returncode == 0, "first epoch with a checkpoint", run)

    def saved_lr():
        files = sorted(f for f in os.listdir(ckpt) if f.endswith(".pt"))
        state = torch.load(os.path.join(ckpt, files[-1]))
        return state["optimizer"]["param_groups"][0]["lr"], state["config"]

    lr, config = saved_lr()
    check(abs(lr - 0.03) < 1e-12 and config["lr"] == 0.03, f"checkpoint holds lr 0.03 ({lr}, {config})")
    # The configuration holds numbers, not strings (torch.load gives float and int).
    check(type(config["lr"]) is float and type(config["momentum"]) is float
          and all(type(config[k]) is int for k in ("batch_size", "epochs", "seed", "world_size"))
          and config["batch_size"] == 32 and config["epochs"] == 1 and type(config["model"]) is str,
          f"checkpoint config types ({config})")
    run = shoal("train", *SMALL, "--epochs", "2", "--lr", "0.01", "--checkpoint-dir", ckpt, "--resume")
    check(run.returncode == 0 and "lr 0.03 -> 0.01" in run.stderr,
          "--resume --lr 0.01 says the lr changed", run)
    lr, config = saved_lr()
    check(abs(lr - 0.01) < 1e-12 and config["lr"] == 0.01,
          f"--resume --lr 0.01 trained at 0.01 ({lr}, {config})")
    # Without --lr the resumed run keeps the checkpoint's (0.01 now), not the default 0.05.
    run = shoal("train", *SMALL, "--epochs", "3", "--checkpoint-dir", ckpt, "--resume")
    check(run.returncode == 0 and "lr " not in run.stderr.split("resumed from")[-1].split("\n")[0],
          "--resume without --lr changes nothing", run)
    lr, config = saved_lr()
    check(abs(lr - 0.01) < 1e-12, f"--resume without --lr keeps the checkpoint's lr ({lr})")
    # Another seed would reorder the samples being continued: refused.
    usage_error(["train", *SMALL, "--epochs", "4", "--seed", "5", "--checkpoint-dir", ckpt,
                 "--resume"], "--seed")

    # --lr-schedule is inherited on --resume like lr: a cosine run resumed without the option
    # keeps annealing, over the resumed run's epochs (T steps in all), its last step at
    # lr x (1 + cos(pi (T-1) / T)) / 2, the base lr staying in the config; given again as
    # constant, the change is said and the lr is the base. 256 samples / batch 32: 8 steps an epoch.
    def last_cosine_lr(base, total_steps):
        return base * (1 + math.cos(math.pi * (total_steps - 1) / total_steps)) / 2

    ckpt = f"{tmp}/ckpt_cosine"
    run = shoal("train", *SMALL, "--lr", "0.04", "--epochs", "1", "--lr-schedule", "cosine",
                "--checkpoint-dir", ckpt)
    check(run.returncode == 0, "first epoch with --lr-schedule cosine", run)
    lr, config = saved_lr()
    check(config["lr_schedule"] == "cosine" and config["lr"] == 0.04
          and abs(lr - last_cosine_lr(0.04, 8)) < 1e-12,
          f"a one-epoch cosine run anneals over 8 steps and saves the schedule ({lr}, {config})")
    run = shoal("train", *SMALL, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume")
    check(run.returncode == 0 and "lr_schedule" not in run.stderr,
          "--resume without --lr-schedule changes nothing", run)
    lr, config = saved_lr()
    check(config["lr_schedule"] == "cosine" and config["lr"] == 0.04
          and abs(lr - last_cosine_lr(0.04, 16)) < 1e-12,
          f"--resume --epochs 2 without --lr-schedule keeps cosine, over 16 steps ({lr}, {config})")
    run = shoal("train", *SMALL, "--epochs", "3", "--checkpoint-dir", ckpt, "--resume",
                "--lr-schedule", "constant")
    check(run.returncode == 0 and "lr_schedule cosine -> constant" in run.stderr,
          "--resume --lr-schedule constant says the schedule changed", run)
    lr, config = saved_lr()
    check(config["lr_schedule"] == "constant" and abs(lr - 0.04) < 1e-12,
          f"--resume --lr-schedule constant trains at the base lr ({lr}, {config})")

    # A diverging run (lr at the limit) stops with an error and a non-zero exit.
    run = shoal("train", *SMALL, "--lr", "10000", "--momentum", "0.9")
    check(run.returncode == 1 and "diverged" in run.stderr and run.stderr.startswith("shoal: error:"),
          "--lr 1e4 stops with 'training diverged' and exit 1", run)

checks.finish()
