#!/usr/bin/python3
"""`shoal train --trace` and `shoal plot`, checked from their files.

    trace_and_plot.py SHOAL_BINARY

1. Two DDP ranks train an MLP for one epoch with --trace and a checkpoint, then a second epoch
   resumed from it: each file is JSON in the Chrome trace format in which every slice on every
   thread nests (the format's rule for X events and B/E pairs, applied by check_nesting, which is
   itself tested on an overlap). Perfetto's trace processor is not used: PyPI's `perfetto`
   downloads its trace_processor_shell binary at run time, which an offline machine cannot.
   Per rank: train step / forward / backward / optimizer step spans with epoch and step args,
   data, evaluation and checkpoint save spans (and a load in the resumed job), bucket
   reductions on named communication tracks whose bytes add up, per backward pass, to the
   model's parameter bytes, each starting inside a backward span with a flow arrow from it.
2. A 1-rank and a 2-rank DDP run with --metrics are drawn by `shoal plot --x samples` into one
   SVG: every panel's ticks are round values (1-2-5 steps, labelled with their values, evenly
   placed; samples/s from 0), each series' points are the metrics' values through those axes,
   the legend names the runs by strategy and world size. Then --x epochs --style print (greys,
   a dash pattern per run), and a one-epoch run whose test loss and accuracy are labelled values.
3. The two-run plot with -o run.png: a PNG (signature, IHDR) of the SVG's size, decoded here (zlib
   and PNG's row filters) to show the white page, dark text and axes, and both runs' colours.
   When the build has no PNG support (SHOAL_HAVE_PNG=OFF), it must say so: one line, exit 2.
Uses the real Fashion-MNIST (256 images); exit 77 (skipped) when it is missing.
"""
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib
import xml.etree.ElementTree as ET

from test_script_support import FASHION_MNIST, require_fashion_mnist

SHOAL = sys.argv[1]
DATA = FASHION_MNIST
require_fashion_mnist()

SMALL = ["--data-dir", DATA, "--model", "mlp", "--train-samples", "256", "--test-samples", "64",
         "--batch-size", "32", "--threads", "1", "--no-progress"]


def shoal(*args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([SHOAL, *args], capture_output=True, text=True, env=env, timeout=180)
    if check and run.returncode != 0:
        sys.exit(f"shoal {' '.join(args)} failed ({run.returncode}):\n{run.stderr}")
    return run


def read_png(path):
    """(width, height, rows of (r, g, b, a) pixels) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: no PNG signature: {data[:8]!r}"
    at, chunks = 8, []
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        crc, = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind}"
        chunks.append((kind, body))
        at += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", [c[0] for c in chunks]
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    channels = 4 if colour == 6 else 3
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * channels
    assert len(raw) == height * (stride + 1), (len(raw), width, height)
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
            else:
                assert kind == 0, f"{path}: row {y} has filter {kind}"
        rows.append([tuple(line[x:x + channels]) + ((255,) if channels == 3 else ())
                     for x in range(0, stride, channels)])
        previous = line
    return width, height, rows


def check_nesting(events, where):
    """Applies the Chrome trace format's rule that slices on one thread nest: complete events
    ("X": ts, dur) and begin/end pairs ("B"/"E", matched as a stack per thread) of each (pid, tid),
    ordered by start (the longer first on a tie), each lies wholly inside the open slice before it
    or after it. Returns the number of slices checked."""
    threads, stacks = {}, {}
    for e in sorted((e for e in events if e.get("ph") in ("X", "B", "E")), key=lambda e: e["ts"]):
        key = (e["pid"], e["tid"])
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, f"{where}: {e}"
            threads.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e["ph"] == "B":
            stacks.setdefault(key, []).append(e)
        else:
            assert stacks.get(key), f"{where}: E without B on {key}: {e}"
            b = stacks[key].pop()
            assert "name" not in e or e["name"] == b["name"], f"{where}: E {e} closes B {b}"
            threads.setdefault(key, []).append((b["ts"], e["ts"], b["name"]))
    assert not any(stacks.values()), f"{where}: B events never ended: {stacks}"
    count = 0
    for key, slices in threads.items():
        open_slices = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_slices and open_slices[-1][1] <= start:
                open_slices.pop()
            if open_slices:
                assert end <= open_slices[-1][1], \
                    f"{where}: pid {key[0]} tid {key[1]}: {name} [{start}, {end}] overlaps " \
                    f"{open_slices[-1][2]} [{open_slices[-1][0]}, {open_slices[-1][1]}]"
            open_slices.append((start, end, name))
            count += 1
    # The checker itself: a partial overlap is refused, nesting and touching are not.
    assert count > 0
    return count


def check_nesting_refuses_overlap():
    good = [{"ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 0, "name": "a"},
            {"ph": "X", "ts": 2, "dur": 3, "pid": 0, "tid": 0, "name": "b"},
            {"ph": "X", "ts": 10, "dur": 2, "pid": 0, "tid": 0, "name": "c"},
            {"ph": "B", "ts": 3, "pid": 0, "tid": 0, "name": "d"},
            {"ph": "E", "ts": 4, "pid": 0, "tid": 0},
            {"ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 1, "name": "other thread"}]
    assert check_nesting(good, "good") == 5
    for bad in ([{"ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 0, "name": "x"}],
                [{"ph": "B", "ts": 1, "pid": 0, "tid": 0, "name": "x"},
                 {"ph": "E", "ts": 11, "pid": 0, "tid": 0}]):
        try:
            check_nesting(good + bad, "bad")
        except AssertionError:
            continue
        raise AssertionError(f"the nesting check let {bad} pass")


def is_round_step(step):
    """Whether `step` is 1, 2 or 5 times a power of ten."""
    power = 10 ** math.floor(math.log10(step))
    return any(abs(step - m * power) < 1e-9 * step for m in (1, 2, 5, 10))


def tick_label_value(text):
    return float(text[:-1]) * 1000 if text.endswith("k") else float(text)


PLOTTED = {"loss": ("step", "loss"), "train_loss": ("epoch", "train_loss"),
           "test_loss": ("epoch", "test_loss"), "test_accuracy": ("epoch", "test_accuracy"),
           "samples_per_s": ("step", "samples_per_s")}


def x_value(row, axis, samples_per_epoch):
    if axis == "samples":
        return row["total_samples"]
    if axis == "epochs":
        return row["epoch"] if row["event"] == "epoch" else row["total_samples"] / samples_per_epoch
    return row["step"]


def check_plot(root, runs, axis):
    """Every panel's ticks are round (a step of 1, 2 or 5 times a power of ten, labelled with
    their values, evenly placed), the axes start and end on ticks and hold every point, and every
    series' points are its metrics' values mapped through its panel's ticks. Returns the number
    of series checked."""
    ns = "{http://www.w3.org/2000/svg}"
    found = 0
    for panel in (g for g in root.iter(ns + "g") if g.get("class") == "panel"):
        title = panel.get("data-title")
        lines = [p for p in panel.iter(ns + "polyline") if p.get("class") == "series"]
        if not lines:
            continue
        mapping = {}
        for which in ("x", "y"):
            ticks = [g for g in panel.iter(ns + "g") if g.get("class") == "tick" and g.get("data-axis") == which]
            values = [float(g.get("data-value")) for g in ticks]
            assert len(values) >= 3, (title, which, values)
            step = values[1] - values[0]
            assert is_round_step(step), f"{title}: {which} tick step {step} is not round"
            for v in values:
                assert abs(v / step - round(v / step)) < 1e-6, f"{title}: {which} tick {v} off {step}"
            for a, b in zip(values, values[1:]):
                assert abs(b - a - step) < 1e-9 * max(1, abs(step)), (title, which, values)
            for g, v in zip(ticks, values):
                label = g.find(ns + "text").text
                assert abs(tick_label_value(label) - v) <= 1e-9 * max(1, abs(v)), (title, label, v)
            pixels = [float(g.find(ns + "line").get("x1" if which == "x" else "y1")) for g in ticks]
            scale = (pixels[-1] - pixels[0]) / (values[-1] - values[0])
            for v, px in zip(values, pixels):
                assert abs(pixels[0] + (v - values[0]) * scale - px) < 0.01, (title, which, v, px)
            mapping[which] = (values, pixels[0], scale)
        if title == "training throughput":
            assert mapping["y"][0][0] == 0, f"samples/s must start at 0: {mapping['y'][0]}"
        if axis in ("samples", "epochs", "steps"):
            assert mapping["x"][0][0] == 0, f"{title}: x starts at {mapping['x'][0][0]}"
        for line in lines:
            run, metric = line.get("data-run"), line.get("data-metric")
            event, field = PLOTTED[metric]
            rows = [r for r in runs[run] if r["event"] == event]
            samples_per_epoch = runs[run][0]["samples_per_epoch"]
            points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
            assert len(points) == len(rows), (run, metric, len(points), len(rows))
            for row, (px, py) in zip(rows, points):
                for which, value, pixel in (("x", x_value(row, axis, samples_per_epoch), px),
                                            ("y", row[field], py)):
                    ticks, origin, scale = mapping[which]
                    assert ticks[0] <= value <= ticks[-1], (title, run, metric, which, value, ticks)
                    assert abs(origin + (value - ticks[0]) * scale - pixel) < 0.01, \
                        (title, run, metric, which, value, pixel)
            found += 1
    expected = {(run, metric) for run in runs for metric in PLOTTED}
    drawn = {(p.get("data-run"), p.get("data-metric")) for p in root.iter(ns + "polyline")}
    assert drawn == expected, f"series {sorted(drawn)} != {sorted(expected)}"
    return found


check_nesting_refuses_overlap()
with tempfile.TemporaryDirectory() as tmp:
    # ---- the trace -------------------------------------------------------------------------
    # Epoch 1 with a checkpoint (save spans), then epoch 2 resumed from it (a load span).
    trace_path, resumed_path, ckpt = f"{tmp}/trace.json", f"{tmp}/resumed.json", f"{tmp}/ckpt"
    # With progress on (--log-interval 0: no step lines), rank 0 names the parameter count.
    quiet = [a for a in SMALL if a != "--no-progress"]
    ddp = ["--strategy", "ddp", "--nproc-per-node", "2", "--checkpoint-dir", ckpt]
    run = shoal("train", *quiet, "--log-interval", "0", *ddp, "--trace", trace_path)
    parameters = int(re.search(r"mlp \((\d+) parameters\)", run.stderr).group(1))
    shoal("train", *SMALL, *ddp, "--epochs", "2", "--resume", "--trace", resumed_path)
    assert not [p for p in os.listdir(tmp) if ".rank" in p], "per-rank parts were left behind"
    steps = 256 // 2 // 32  # 128 samples per rank, batch 32
    for path, epoch in ((trace_path, 1), (resumed_path, 2)):
        with open(path) as f:
            events = json.load(f)["traceEvents"]  # valid JSON, or this raises
        slices = check_nesting(events, path)
        for rank in (0, 1):
            mine = [e for e in events if e.get("pid") == rank]
            names = [e["args"]["name"] for e in mine if e["ph"] == "M" and e["name"] == "process_name"]
            assert names == [f"rank {rank}"], names
            spans = sorted((e for e in mine if e["ph"] == "X" and e["cat"] == "train"),
                           key=lambda e: (e["ts"], -e["dur"]))
            assert [e["name"] for e in spans] == \
                ["train step", "forward", "backward", "optimizer step"] * steps, \
                f"rank {rank}: {[e['name'] for e in spans]}"
            first = (epoch - 1) * steps + 1
            for e in spans:
                assert e["dur"] >= 0 and isinstance(e["ts"], int), e
                assert e["args"]["epoch"] == epoch, e
            assert [e["args"]["step"] for e in spans if e["name"] == "train step"] == \
                list(range(first, first + steps)), spans
            # Data, evaluation and checkpoint spans; the load only in the resumed job.
            count = {}
            for e in mine:
                if e["ph"] == "X" and e["cat"] in ("data", "eval", "checkpoint"):
                    count[e["name"]] = count.get(e["name"], 0) + 1
            want = {"data": steps, "evaluation": 1, "checkpoint save": 1}
            if epoch == 2:
                want["checkpoint load"] = 1
            assert count == want, f"{path} rank {rank}: {count}"
            evaluation = next(e for e in mine if e.get("name") == "evaluation")
            assert evaluation["args"] == {"epoch": epoch, "step": first + steps - 1}, evaluation
            # Reductions: on communication tracks of their own (named threads), each with a flow
            # arrow from the backward pass that made its bucket ready, bytes adding up per step.
            tracks = {e["tid"]: e["args"]["name"] for e in mine
                      if e["ph"] == "M" and e["name"] == "thread_name"}
            assert tracks and all(n.startswith("communication") for n in tracks.values()), tracks
            backwards = [e for e in spans if e["name"] == "backward"]
            reductions = [e for e in mine if e["ph"] == "X" and e["cat"] == "comm"]
            assert reductions, f"rank {rank}: no bucket reductions in the trace"
            assert all(r["tid"] in tracks for r in reductions), "a reduction off its track"
            assert all(b["tid"] not in tracks for b in backwards), "backward on a comm track"
            flows = {}
            for e in mine:
                if e["ph"] in ("s", "f"):
                    flows.setdefault(e["id"], {})[e["ph"]] = e
            assert len(flows) == len(reductions), (len(flows), len(reductions))
            per_backward = [0] * len(backwards)
            for r in reductions:
                assert re.fullmatch(r"allreduce bucket \d+", r["name"]), r
                assert r["args"]["bucket"] == int(r["name"].split()[-1]), r
                inside = [i for i, b in enumerate(backwards)
                          if b["ts"] <= r["ts"] <= b["ts"] + b["dur"]]
                assert len(inside) == 1, f"rank {rank}: {r} starts outside every backward span"
                per_backward[inside[0]] += r["args"]["bytes"]
                assert r["args"]["step"] == backwards[inside[0]]["args"]["step"], r
                arrow = [f for f in flows.values()
                         if f["f"]["tid"] == r["tid"] and f["f"]["ts"] == r["ts"]]
                assert len(arrow) == 1, f"rank {rank}: {r} has {len(arrow)} flow arrows"
                tail = arrow[0]["s"]
                assert tail["tid"] == backwards[inside[0]]["tid"] and \
                    backwards[inside[0]]["ts"] <= tail["ts"] <= r["ts"], (tail, r)
                assert arrow[0]["f"].get("bp") == "e", arrow[0]["f"]
            assert per_backward == [4 * parameters] * steps, \
                f"rank {rank}: bytes reduced per backward {per_backward}, parameters {parameters}"
        print(f"trace {os.path.basename(path)}: 2 ranks x {steps} steps, {len(events)} events, "
              f"{slices} slices nest on every thread, {4 * parameters} bytes reduced per step")

    # ---- the plot --------------------------------------------------------------------------
    # One rank and two DDP ranks, overlaid against samples: the axes' ticks are round values, the
    # series' pixels are the metrics' values through those axes.
    runs = {}
    for name, extra in (("single, 1 rank", []),
                        ("ddp, 2 ranks", ["--strategy", "ddp", "--nproc-per-node", "2"])):
        path = f"{tmp}/{len(runs)}.jsonl"
        shoal("train", *SMALL, "--epochs", "2", "--log-interval", "2", "--metrics", path, *extra)
        with open(path) as f:
            runs[name] = [json.loads(line) for line in f if line.strip()]
    svg_path = f"{tmp}/run.svg"
    shoal("plot", f"{tmp}/0.jsonl", f"{tmp}/1.jsonl", "--x", "samples", "-o", svg_path)
    root = ET.parse(svg_path).getroot()  # well-formed XML, or this raises
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == ns + "svg", root.tag
    series_found = check_plot(root, runs, "samples")
    legend = [g.get("data-run") for g in root.iter(ns + "g") if g.get("class") == "legend"]
    assert legend == list(runs), legend
    print(f"plot --x samples: {series_found} series of {len(runs)} runs, round ticks")

    # Against epochs, in the print style: black and greys, a dash pattern per run.
    shoal("plot", f"{tmp}/0.jsonl", f"{tmp}/1.jsonl", "--x", "epochs", "--style", "print",
          "-o", f"{tmp}/print.svg")
    printed = ET.parse(f"{tmp}/print.svg").getroot()
    check_plot(printed, runs, "epochs")
    dashes = {}
    for line in printed.iter(ns + "polyline"):
        colour = line.get("stroke")
        assert colour[1:3] == colour[3:5] == colour[5:7], f"print style draws in {colour}"
        dashes.setdefault(line.get("data-run"), set()).add(line.get("stroke-dasharray"))
    assert all(len(d) == 1 for d in dashes.values()) and \
        dashes["single, 1 rank"] != dashes["ddp, 2 ranks"], dashes
    print("plot --x epochs --style print: greys, one dash pattern per run")

    # One epoch: the test metrics are one point each, shown as labelled values.
    shoal("train", *SMALL, "--epochs", "1", "--log-interval", "2", "--metrics", f"{tmp}/one.jsonl")
    shoal("plot", f"{tmp}/one.jsonl", "-o", f"{tmp}/one.svg")
    one = ET.parse(f"{tmp}/one.svg").getroot()
    with open(f"{tmp}/one.jsonl") as f:
        epoch_line = [r for r in map(json.loads, f) if r["event"] == "epoch"][0]
    values = {g.get("data-metric"): g for g in one.iter(ns + "g") if g.get("class") == "value"}
    assert sorted(values) == ["test_accuracy", "test_loss"], sorted(values)
    for metric, g in values.items():
        assert abs(float(g.get("data-value")) - epoch_line[metric]) < 1e-6, (metric, g.attrib)
        shown = "".join(t.text or "" for t in g.iter(ns + "text"))
        assert f"{epoch_line[metric]:.4g}" in shown, (metric, shown)
    drawn = {p.get("data-metric") for p in one.iter(ns + "polyline")}
    assert drawn == {"loss", "train_loss", "samples_per_s"}, drawn
    print("plot of one epoch: test loss and accuracy as labelled values")

    # ---- the same plot as PNG ------------------------------------------------------------
    png_path = f"{tmp}/run.png"
    run = shoal("plot", f"{tmp}/0.jsonl", f"{tmp}/1.jsonl", "-o", png_path, check=False)
    if os.environ.get("SHOAL_HAVE_PNG", "OFF") != "ON":
        assert run.returncode == 2, (run.returncode, run.stderr)
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("shoal: error: "), run.stderr
        assert "PNG support is not built in" in run.stderr and "librsvg2-dev" in run.stderr, run.stderr
        assert not os.path.exists(png_path)
        print("plot: PNG is not built in, and says so")
    else:
        assert run.returncode == 0, (run.returncode, run.stderr)
        width, height, rows = read_png(png_path)
        assert (width, height) == (int(float(root.get("width"))), int(float(root.get("height")))), \
            (width, height, root.get("width"), root.get("height"))
        counts = {}
        for row in rows:
            for pixel in row:
                counts[pixel] = counts.get(pixel, 0) + 1
        opaque = sum(n for p, n in counts.items() if p[3] == 255)
        assert opaque == width * height, f"{width * height - opaque} pixels are not opaque"
        white = counts.get((255, 255, 255, 255), 0)
        assert 0.5 * width * height < white < width * height, f"{white} white pixels"
        dark = sum(n for p, n in counts.items() if max(p[:3]) < 100)
        assert dark > 1000, f"only {dark} dark pixels (text, axes)"
        # The runs' colours (#1f77b4, #d62728) as drawn: legend squares and lines, antialiased
        # at their edges, so nearby colours count.
        for name, (r, g, b) in (("one rank", (0x1f, 0x77, 0xb4)), ("two", (0xd6, 0x27, 0x28))):
            near = sum(n for p, n in counts.items()
                       if abs(p[0] - r) + abs(p[1] - g) + abs(p[2] - b) < 30)
            assert near >= 14 * 14, f"run {name}: {near} pixels of its colour"
        print(f"plot: PNG {width}x{height}, {len(counts)} distinct colours, {white} white pixels")
# The closing line: CTest (tests/testing/require_closing_line.sh) fails the test without it.
print("ORACLE OK trace_and_plot: all checks passed", flush=True)
