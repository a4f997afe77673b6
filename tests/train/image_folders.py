#!/usr/bin/python3
"""`shoal train --data-dir DIR` on a folder of images (torchvision's ImageFolder layout), written
here with PIL: three classes, each a distinct colour with a bright square somewhere, plus noise.

  * DIR/train + DIR/val under --strategy ddp, 2 processes, 2 loader workers each, with
    --image-size, --random-crop, --hflip and --normalize: the test accuracy beats chance (1/3)
    clearly;
  * a run resumed from its checkpoint after epoch 1 ends with the uninterrupted run's weights;
  * DIR alone (no evaluation split): trains, and says it has no test samples;
  * a corrupt image in the folder: one line on stderr naming the file, a non-zero exit;
  * a malformed transform flag: one line naming the flag;
  * `shoal bench images` on the same folders, 2 loader workers: a JSON line whose step time
    splits into the wait for data and the rest (wait_fraction = wait_ms / step_ms, in [0, 1]).

    image_folders.py SHOAL_BINARY
"""
import json
import os
import random
import sys
import tempfile

from test_script_support import Checks, run_shoal, skip

SHOAL = sys.argv[1]
try:
    from PIL import Image
except ImportError:
    skip("/usr/bin/python3 has no PIL (Debian's python3-pil) to write the images")

checks = Checks("image_folders")
check = checks.check
COLOURS = {"blue": (40, 60, 200), "green": (50, 190, 60), "red": (210, 50, 40)}


def write_split(root, per_class, rng):
    for name, colour in COLOURS.items():
        os.makedirs(os.path.join(root, name))
        for i in range(per_class):
            side = rng.choice((20, 24, 28))  # sizes differ: --image-size makes them equal
            pixels = [tuple(max(0, min(255, c + rng.randint(-60, 60))) for c in colour)
                      for _ in range(side * side)]
            image = Image.new("RGB", (side, side))
            image.putdata(pixels)
            x, y = rng.randint(0, side - 6), rng.randint(0, side - 6)
            image.paste((255, 255, 255), (x, y, x + 5, y + 5))
            extension = "png" if i % 2 else "jpg"
            image.save(os.path.join(root, name, f"{i:04d}.{extension}"))


def shoal(*args):
    return run_shoal(SHOAL, "train", "--threads", "1", *args)


def stderr_lines(run):
    return [l for l in run.stderr.splitlines() if l.strip()]


def final_accuracy(run):
    lines = [l for l in run.stdout.splitlines() if "final test accuracy:" in l]
    return float(lines[-1].split()[-1]) if lines else None


TRANSFORMS = ["--image-size", "24", "--random-crop", "20:2", "--hflip",
              "--normalize", "0.5,0.5,0.5,0.25,0.25,0.25"]

with tempfile.TemporaryDirectory() as tmp:
    rng = random.Random(7)
    data = os.path.join(tmp, "images")
    write_split(os.path.join(data, "train"), 100, rng)
    write_split(os.path.join(data, "val"), 30, rng)

    run = shoal("--strategy", "ddp", "--nproc-per-node", "2", "--num-workers", "2",
                "--data-dir", data, "--model", "cnn", "--epochs", "2", "--batch-size", "16",
                "--lr", "0.02", *TRANSFORMS)
    accuracy = final_accuracy(run)
    print("ddp x 2 on train/ + val/:", accuracy, flush=True)
    check(run.returncode == 0 and accuracy is not None and accuracy >= 0.8,
          "ddp, 2 processes, 2 workers: test accuracy >= 0.8 (chance 0.33)", run)
    check("images 300 train / 90 test samples" in run.stderr,
          "the start line counts the folders' images", run)

    # A run resumed after its first epoch ends with the weights of the run that did not stop: the
    # second epoch's augmentation is drawn from epoch 1 either way.
    def weights(*args):
        run = shoal("--data-dir", data, "--model", "cnn", "--num-workers", "2", "--epochs", "2",
                    "--no-progress", *TRANSFORMS, *args)
        check(run.returncode == 0, f"{' '.join(args)}: exits 0", run)
        return run

    weights("--dump-parameters", os.path.join(tmp, "whole"))
    stopped = os.path.join(tmp, "ckpt")
    weights("--checkpoint-dir", stopped, "--epochs", "1")
    weights("--checkpoint-dir", stopped, "--resume", "--dump-parameters", os.path.join(tmp, "resumed"))
    try:
        import torch
        whole = torch.load(os.path.join(tmp, "whole.rank0.pt"))
        resumed = torch.load(os.path.join(tmp, "resumed.rank0.pt"))
        check(list(whole) == list(resumed) and all(torch.equal(whole[k], resumed[k]) for k in whole),
              "resumed after epoch 1: the weights of the run that did not stop")
    except ImportError:
        print("python3-torch is not installed: the resumed weights are not compared", flush=True)

    run = run_shoal(SHOAL, "bench", "images", "--data-dir", data, "--num-workers", "2",
                    "--batch-size", "8", "--steps", "4", "--warmup", "1", "--json", *TRANSFORMS)
    try:
        line = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        line = {}
    print("bench images:", line, flush=True)
    check(run.returncode == 0 and line.get("workers") == 2 and line.get("step_ms", 0) > 0 and
          0 <= line.get("wait_ms", -1) <= line["step_ms"] and
          abs(line.get("wait_fraction", -1) - line["wait_ms"] / line["step_ms"]) < 1e-3 and
          line.get("loader_batches_per_s", 0) > 0,
          "bench images: the step's wait for data and its share of the step", run)

    alone = os.path.join(data, "train")
    run = shoal("--data-dir", alone, "--model", "cnn", "--epochs", "1", *TRANSFORMS)
    check(run.returncode == 0 and "300 train / 0 test samples" in run.stderr,
          "a folder without val/ or test/ trains without evaluation", run)

    bad = os.path.join(data, "train", "green", "0003.png")
    with open(bad, "r+b") as f:
        f.truncate(60)
    run = shoal("--data-dir", alone, "--model", "cnn", "--num-workers", "2", "--no-progress",
                *TRANSFORMS)
    lines = stderr_lines(run)
    print("corrupt image:", lines[-1] if lines else "(nothing)", flush=True)
    check(0 < run.returncode < 126 and len(lines) == 1 and bad in lines[0],
          "a corrupt image: one line naming the file, a non-zero exit", run)

    for flag, value in (("--image-size", "0x5"), ("--random-crop", "8:x"),
                        ("--normalize", "1,2,3")):
        run = shoal("--data-dir", alone, "--no-progress", flag, value)
        lines = stderr_lines(run)
        check(run.returncode != 0 and len(lines) >= 1 and flag in lines[0],
              f"{flag} {value}: refused naming the flag", run)

checks.finish()
