#!/usr/bin/python3
"""`shoal train --trace` and `shoal plot`, checked from their files.

    trace_and_plot.py SHOAL_BINARY

1. Two DDP ranks train an MLP for 4 steps with --trace: the file is JSON in the Chrome trace
   format with, for each rank, 4 forward / backward / optimizer-step spans in order and bucket
   reductions whose bytes add up, per backward pass, to the model's parameter bytes, each
   starting inside a backward span of the same rank.
2. Two single-process runs with --metrics are drawn by `shoal plot` into one SVG: it parses as
   XML and holds, per run, one polyline per metric and axis whose points are the metrics' values
   mapped linearly (checked against the JSON lines).
3. The same plot with -o run.png: a PNG (signature, IHDR) of the SVG's size, decoded here (zlib
   and PNG's row filters) to show the white page, dark text and axes, and both runs' colours.
   When the build has no PNG support (SHOAL_HAVE_PNG=OFF), it must say so: one line, exit 2.
Uses the real Fashion-MNIST (256 images); exit 77 (skipped) when it is missing.
"""
import json
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
    runs = {}
    for name, lr in (("a", "0.05"), ("b", "0.01")):
        path = f"{tmp}/{name}.jsonl"
        shoal("train", *SMALL, "--epochs", "2", "--lr", lr, "--log-interval", "2", "--metrics", path)
        with open(path) as f:
            runs[f"{name}.jsonl"] = [json.loads(line) for line in f if line.strip()]
    svg_path = f"{tmp}/run.svg"
    shoal("plot", f"{tmp}/a.jsonl", f"{tmp}/b.jsonl", "-o", svg_path)
    root = ET.parse(svg_path).getroot()  # well-formed XML, or this raises
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == ns + "svg", root.tag
    lines = [p for p in root.iter(ns + "polyline") if p.get("class") == "series"]
    expected = {("loss", "step", "loss"), ("test_accuracy", "epoch", "test_accuracy"),
                ("samples_per_s", "step", "samples_per_s")}
    found = set()
    for line in lines:
        run, metric, axis = line.get("data-run"), line.get("data-metric"), line.get("data-x")
        event = "epoch" if metric == "test_accuracy" else "step"
        rows = [r for r in runs[run] if r["event"] == event]
        points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        assert len(points) == len(rows), (run, metric, axis, len(points), len(rows))
        # Pixels are a linear function of the values (y flipped): check every point against
        # the line through the two most distant ones.
        for coord, key in ((0, axis), (1, metric)):
            values = [r[key] for r in rows]
            pixels = [p[coord] for p in points]
            lo, hi = values.index(min(values)), values.index(max(values))
            if values[hi] == values[lo]:
                continue
            scale = (pixels[hi] - pixels[lo]) / (values[hi] - values[lo])
            assert (scale < 0) == (coord == 1), f"{run} {metric} {axis}: axis direction"
            for v, px in zip(values, pixels):
                assert abs(pixels[lo] + (v - values[lo]) * scale - px) < 0.01, (run, metric, axis, v, px)
        found.add((run, metric, axis))
    for run in runs:
        for metric, _, _ in expected:
            for axis in ("step", "time"):
                assert (run, metric, axis) in found, f"missing series {run} {metric} vs {axis}"
    legend = [t.text for t in root.iter(ns + "text") if t.text in runs]
    assert sorted(legend) == sorted(runs), legend
    print(f"plot: {len(lines)} series of {len(runs)} runs")

    # ---- the same plot as PNG ------------------------------------------------------------
    png_path = f"{tmp}/run.png"
    run = shoal("plot", f"{tmp}/a.jsonl", f"{tmp}/b.jsonl", "-o", png_path, check=False)
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
        for name, (r, g, b) in (("a", (0x1f, 0x77, 0xb4)), ("b", (0xd6, 0x27, 0x28))):
            near = sum(n for p, n in counts.items()
                       if abs(p[0] - r) + abs(p[1] - g) + abs(p[2] - b) < 30)
            assert near >= 14 * 14, f"run {name}: {near} pixels of its colour"
        print(f"plot: PNG {width}x{height}, {len(counts)} distinct colours, {white} white pixels")
# The closing line: CTest (tests/testing/require_closing_line.sh) fails the test without it.
print("ORACLE OK trace_and_plot: all checks passed", flush=True)
