#!/usr/bin/env python3
"""Start-up of `shoal`: how long a user waits from launch to the first completed training step,
against the time `shoal --version` takes (LibTorch's load and static initialisers, the floor every
shoal command pays). Issue #32's target: launch to first step <= --version + 0.3 s.

usage: startup.py [--shoal PATH] [--baseline PATH] [--rounds N] [--data-dir DIR]

Three measurements per binary, interleaved A B A B over --rounds rounds (these machines are
shared and noisy: medians, measured side by side, are what to compare):
  version  wall time of `shoal --version` (spawn to exit)
  single   `shoal train --model mlp --stop-after-steps 1 --trace FILE`: the end of the first
           "train step" span in the trace (system-clock microseconds) minus the time just before
           the spawn; also the wall time to exit
  ddp      the same with `--strategy ddp --nproc-per-node 2`: the latest rank's first step end
--baseline (optional) is a second build of shoal (e.g. main's) measured in the same rounds.
Prints one JSON line per binary and measurement (medians, in seconds) and the margin against the
--version + 0.3 s target; a benchmark, not a test: it never fails on a slow machine.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_MARGIN_S = 0.3


def first_step_end_s(trace_path):
    """The end of the first 'train step' span, in seconds since the epoch: the latest over ranks
    (a DDP step is complete when every rank's is)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    first = {}
    for e in events:
        if e.get("name") == "train step" and e.get("ph") == "X":
            end = e["ts"] + e["dur"]
            pid = e.get("pid", 0)
            first[pid] = min(first.get(pid, end), end)
    if not first:
        raise RuntimeError(f"{trace_path}: no 'train step' span")
    return max(first.values()) / 1e6


def run_version(shoal):
    start = time.time()
    subprocess.run([shoal, "--version"], check=True, stdout=subprocess.DEVNULL)
    return {"wall": time.time() - start}


def run_train(shoal, extra, data_dir, workdir):
    trace = os.path.join(workdir, "trace.json")
    if os.path.exists(trace):
        os.remove(trace)
    cmd = [shoal, "train", "--model", "mlp", "--stop-after-steps", "1", "--no-progress",
           "--trace", trace] + extra
    if data_dir:
        cmd += ["--data-dir", data_dir]
    start = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - start
    return {"first_step": first_step_end_s(trace) - start, "wall": wall}


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
    cases = {
        "version": lambda b, w: run_version(b),
        "single": lambda b, w: run_train(b, [], args.data_dir, w),
        "ddp": lambda b, w: run_train(b, ["--strategy", "ddp", "--nproc-per-node", "2"],
                                      args.data_dir, w),
    }
    samples = {(name, case): {} for name in binaries for case in cases}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="shoal-startup-") as workdir:
        # One warm-up of each (page cache), not counted.
        for shoal in binaries.values():
            for run in cases.values():
                run(shoal, workdir)
        for r in range(args.rounds):
            for case, run in cases.items():
                # A B A B ...; the order alternates per round so neither always goes first.
                order = list(binaries.items())
                if r % 2 == 1:
                    order.reverse()
                for name, shoal in order:
                    for key, value in run(shoal, workdir).items():
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
