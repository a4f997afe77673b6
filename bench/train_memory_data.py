#!/usr/bin/python3
"""Two measurements of `shoal train`, each side by side in one run (JSON lines on stdout):

  peak_rss   peak resident memory (/usr/bin/time's %M, the largest process of the job) of the
             `make run` job (one epoch of the CNN, DDP over 2 processes) beside the same job
             stopped after its training steps (--stop-after-steps: no evaluation), and beside the
             full job evaluating in batches of 500 (the default before #29). Target: full <= 1.2 x
             steps only.
  data       training samples/s of the CNN on Fashion-MNIST's tensors in memory beside the same
             tensors read from a torch.save file (--data FILE.pt) through 2 worker threads
             (--num-workers 2), alternated A B A B; ratio = data / in-memory (target >= 0.95).

    bench/train_memory_data.py [SHOAL] [--rounds N] [--samples K] [--only peak_rss|data]

On a loaded machine one pair says little (single runs vary by +-20% there): the summary gives the
median of the per-round ratios; use --rounds 6 or more.
"""
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile

args = [a for a in sys.argv[1:]]
shoal = "build/apps/shoal/shoal"
rounds = 2
samples = 12800
only = None
i = 0
while i < len(args):
    if args[i] == "--rounds":
        rounds = int(args[i + 1]); i += 2
    elif args[i] == "--samples":
        samples = int(args[i + 1]); i += 2
    elif args[i] == "--only":
        only = args[i + 1]; i += 2
    else:
        shoal = args[i]; i += 1

FASHION = "/usr/share/datasets/fashion-mnist"
MAKE_RUN = ["--strategy", "ddp", "--nproc-per-node", "2", "--model", "cnn", "--epochs", "1",
            "--batch-size", "64", "--lr", "0.08", "--momentum", "0.9", "--no-progress"]


def peak_kb(extra):
    run = subprocess.run(["/usr/bin/time", "-f", "PEAK %M", shoal, "train", *MAKE_RUN, *extra],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"shoal train {' '.join(extra)} failed: {run.stderr[-600:]}")
    return int(re.findall(r"PEAK (\d+)", run.stderr)[-1])


def samples_per_s(extra):
    run = subprocess.run([shoal, "train", "--model", "cnn", "--threads", "1", "--batch-size", "64",
                          "--train-samples", str(samples), "--test-samples", "1", "--no-progress",
                          "--log-interval", "0", *extra], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"shoal train {' '.join(extra)} failed: {run.stderr[-600:]}")
    return float(re.search(r"\(([\d.]+) samples/s", run.stdout).group(1))


if only in (None, "peak_rss"):
    for r in range(rounds):
        steps = peak_kb(["--stop-after-steps", "400"])
        full = peak_kb([])
        old = peak_kb(["--eval-batch-size", "500"])
        print(json.dumps({"bench": "peak_rss", "round": r, "steps_only_kb": steps, "full_run_kb": full,
                          "full_run_eval500_kb": old, "ratio": round(full / steps, 3),
                          "ratio_eval500": round(old / steps, 3)}), flush=True)

if only in (None, "data"):
    import torch  # only to write the file, as a user would

    def idx(name, offset):
        with gzip.open(os.path.join(FASHION, name)) as f:
            return torch.frombuffer(bytearray(f.read()[offset:]), dtype=torch.uint8)

    with tempfile.TemporaryDirectory() as tmp:
        # The same normalised tensors shoal's FashionMnist reader makes, saved as a user would.
        def images(name):
            return ((idx(name, 16).reshape(-1, 1, 28, 28).float() / 255.0) - 0.2860) / 0.3530
        path = os.path.join(tmp, "fashion.pt")
        torch.save({"train_x": images("train-images-idx3-ubyte.gz"),
                    "train_y": idx("train-labels-idx1-ubyte.gz", 8).long(),
                    "test_x": images("t10k-images-idx3-ubyte.gz"),
                    "test_y": idx("t10k-labels-idx1-ubyte.gz", 8).long()}, path)
        a, b = [], []
        for r in range(rounds):
            a.append(samples_per_s(["--data-dir", FASHION]))
            b.append(samples_per_s(["--data", path, "--num-workers", "2"]))
            print(json.dumps({"bench": "data", "round": r, "in_memory_samples_per_s": a[-1],
                              "data_file_workers2_samples_per_s": b[-1],
                              "ratio": round(b[-1] / a[-1], 3)}), flush=True)
        ratios = sorted(y / x for x, y in zip(a, b))
        median = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
        print(json.dumps({"bench": "data", "summary": True, "rounds": rounds, "samples": samples,
                          "in_memory_median": sorted(a)[len(a) // 2],
                          "data_file_median": sorted(b)[len(b) // 2],
                          "median_ratio": round(median, 3),
                          "ratio_of_sums": round(sum(b) / sum(a), 3)}))
