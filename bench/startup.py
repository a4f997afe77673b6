#!/usr/bin/env python3
"""Start-up of `shoal`: how long a user waits from launch to the first completed training step,
against the time `shoal --version` takes (LibTorch's load and static initialisers, the floor every
shoal command pays). Issue #32's target: launch to first step <= --version + 0.3 s.

usage: startup.py [--shoal PATH] [--baseline PATH] [--rounds N] [--data-dir DIR]

Four measurements per binary, interleaved A B A B over --rounds rounds (these machines are
shared and noisy: medians, measured side by side, are what to compare):
  version   wall time of `shoal --version` (spawn to exit)
  single    `shoal train --model mlp --log-interval 1`: from just before the spawn to the line of
            step 1 on its output (printed once the step is complete); the job is then killed
  ddp       the same with `--strategy ddp --nproc-per-node 2` (rank 0's line: a DDP step is
            complete on every rank once its gradients are averaged), its workers forked from the
            launcher without exec (launcher::set_self_entry, the default)
  ddp_exec  the same with SHOAL_LAUNCH_EXEC=1: each worker exec'd, loading LibTorch again
--baseline (optional) is a second build of shoal (e.g. main's) measured in the same rounds.
Prints one JSON line per binary and measurement (medians, in seconds) and the margin against the
--version + 0.3 s target; a benchmark, not a test: it never fails on a slow machine.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

TARGET_MARGIN_S = 0.3


def run_version(shoal):
    start = time.time()
    subprocess.run([shoal, "--version"], check=True, stdout=subprocess.DEVNULL)
    return {"wall": time.time() - start}


def run_train(shoal, extra, data_dir, env=None, timeout=300):
    cmd = [shoal, "train", "--model", "mlp", "--log-interval", "1"] + extra
    if data_dir:
        cmd += ["--data-dir", data_dir]
    start = time.time()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, start_new_session=True)
    first = None
    try:
        for line in job.stdout:
            if " step 1/" in line:
                first = time.time() - start
                break
            if time.time() - start > timeout:
                break
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    if first is None:
        raise RuntimeError(f"`{' '.join(cmd)}` printed no first step")
    return {"first_step": first}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shoal", default="build/apps/shoal/shoal")
    parser.add_argument("--baseline", default=None, help="a second shoal binary, measured interleaved")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()

    binaries = {"shoal": args.shoal}
    if args.baseline:
        binaries["baseline"] = args.baseline
    execed = dict(os.environ, SHOAL_LAUNCH_EXEC="1")
    forked = {k: v for k, v in os.environ.items() if k != "SHOAL_LAUNCH_EXEC"}
    ddp = ["--strategy", "ddp", "--nproc-per-node", "2"]
    cases = {
        "version": lambda b: run_version(b),
        "single": lambda b: run_train(b, [], args.data_dir, forked),
        "ddp": lambda b: run_train(b, ddp, args.data_dir, forked),
        "ddp_exec": lambda b: run_train(b, ddp, args.data_dir, execed),
    }
    samples = {(name, case): {} for name in binaries for case in cases}
    load_before = os.getloadavg()
    # One warm-up of each (page cache), not counted.
    for shoal in binaries.values():
        for run in cases.values():
            run(shoal)
    for r in range(args.rounds):
        for case, run in cases.items():
            # A B A B ...; the order alternates per round so neither always goes first.
            order = list(binaries.items())
            if r % 2 == 1:
                order.reverse()
            for name, shoal in order:
                for key, value in run(shoal).items():
                    samples[(name, case)].setdefault(key, []).append(value)
    load_after = os.getloadavg()

    for name in binaries:
        version = statistics.median(samples[(name, "version")]["wall"])
        for case in cases:
            line = {"binary": name, "path": binaries[name], "case": case, "rounds": args.rounds}
            for key, values in samples[(name, case)].items():
                line[key + "_median_s"] = round(statistics.median(values), 4)
                line[key + "_min_s"] = round(min(values), 4)
            if case != "version":
                first = statistics.median(samples[(name, case)]["first_step"])
                line["target_s"] = round(version + TARGET_MARGIN_S, 4)
                line["margin_s"] = round(version + TARGET_MARGIN_S - first, 4)  # > 0: target met
            print(json.dumps(line))
    print(json.dumps({"loadavg_before": [round(x, 2) for x in load_before],
                      "loadavg_after": [round(x, 2) for x in load_after],
                      "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
