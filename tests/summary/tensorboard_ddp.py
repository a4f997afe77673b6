#!/usr/bin/python3
"""`shoal train --tensorboard` from a 2-rank DDP run, read back by TensorBoard itself.

    tensorboard_ddp.py SHOAL_BINARY

1. Two DDP ranks train an MLP with --metrics and --tensorboard: only rank 0 writes (one run
   folder). Every record's framing and masked CRC-32C is checked here (CRC-32C written out in
   Python, bit by bit), then TensorBoard's own reader (event_accumulator from PyPI's tensorboard)
   loads the folder: every numeric value of every "step" metrics line is the scalar train/<key> at
   that step, every "epoch" line's is epoch/<key>, as the float32 TensorBoard stores; no other
   steps. Parameter histograms come every --histogram-interval steps, of each parameter's size;
   the run's configuration is a text summary.
2. The same job with --tensorboard-all-ranks: DIR/rank0 and DIR/rank1, each rank's own losses,
   the same gradient norm (DDP averaged the gradients).
3. TensorBoard itself serves the runs: `tensorboard --logdir` on loopback (a free port), its HTTP
   scalars endpoint answers with the metrics' values; then it is stopped (deadlines throughout).
Exit 77 (skipped) when Fashion-MNIST or tensorboard is missing (a failure under
SHOAL_REQUIRE_ORACLES=1).
"""
import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
from test_script_support import FASHION_MNIST, require_fashion_mnist, skip  # noqa: E402

SHOAL = sys.argv[1]
require_fashion_mnist()
try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError:
    skip("tensorboard is not installed (scripts/setup.sh installs it: pip install tensorboard)")

SMALL = ["--data-dir", FASHION_MNIST, "--model", "mlp", "--train-samples", "1024",
         "--test-samples", "128", "--batch-size", "32", "--threads", "1", "--no-progress",
         "--strategy", "ddp", "--nproc-per-node", "2", "--epochs", "2", "--log-interval", "2",
         "--histogram-interval", "4"]
STEPS_PER_EPOCH = 1024 // 2 // 32
# Keys of the metrics lines that are coordinates, not scalars.
COORDINATES = {"event", "epoch", "step", "samples", "total_samples", "seconds", "time"}


def shoal(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([SHOAL, *args], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode != 0:
        sys.exit(f"shoal {' '.join(args)} failed ({run.returncode}):\n{run.stderr}")
    return run


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def check_records(path):
    """The number of TFRecords in `path`, each one's length and data CRC checked."""
    with open(path, "rb") as f:
        data = f.read()
    at = count = 0
    while at < len(data):
        assert at + 12 <= len(data), f"{path}: truncated header at byte {at}"
        length, length_crc = struct.unpack("<QI", data[at:at + 12])
        assert masked(crc32c(data[at:at + 8])) == length_crc, f"{path}: bad length CRC at {at}"
        body = data[at + 12:at + 12 + length]
        assert len(body) == length, f"{path}: truncated record at {at}"
        data_crc, = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert masked(crc32c(body)) == data_crc, f"{path}: bad data CRC at {at}"
        at += 16 + length
        count += 1
    # The TFRecord check of the checker itself: CRC-32C of "123456789" is 0xe3069283.
    assert crc32c(b"123456789") == 0xE3069283
    return count


def float32(value):
    return struct.unpack("<f", struct.pack("<f", value))[0]


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load(folder):
    files = glob.glob(f"{folder}/events.out.tfevents.*")
    assert len(files) == 1, f"{folder}: {files}"
    records = check_records(files[0])
    acc = event_accumulator.EventAccumulator(
        folder, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0,
                               event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc, records


def expected_scalars(lines):
    """{tag: {step: float32 value}} of the metrics lines, as TensorBoard must hold them."""
    expected = {}
    for line in lines:
        prefix = {"step": "train", "epoch": "epoch"}.get(line["event"])
        if prefix is None:
            continue
        for key, value in line.items():
            if key in COORDINATES or not isinstance(value, (int, float)) or value is None:
                continue
            expected.setdefault(f"{prefix}/{key}", {})[line["step"]] = float32(value)
    return expected


def check_scalars(acc, lines, who):
    expected = expected_scalars(lines)
    assert sorted(acc.Tags()["scalars"]) == sorted(expected), (who, acc.Tags()["scalars"])
    for tag, values in expected.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got == values, f"{who} {tag}: TensorBoard {got} != metrics {values}"
    return sum(len(v) for v in expected.values())


with tempfile.TemporaryDirectory() as tmp:
    # ---- 1. rank 0's run folder ----------------------------------------------------------
    board = f"{tmp}/runs/ddp2"
    shoal("train", *SMALL, "--metrics", f"{tmp}/m.jsonl", "--tensorboard", board)
    lines = read_metrics(f"{tmp}/m.jsonl")
    assert lines[0]["event"] == "run" and lines[0]["strategy"] == "ddp" and \
        lines[0]["world_size"] == 2, lines[0]
    steps = [line["step"] for line in lines if line["event"] == "step"]
    assert steps == list(range(2, 2 * STEPS_PER_EPOCH + 1, 2)), steps
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "comm_bytes", "comm_wait_s"):
        assert all(key in line for line in lines if line["event"] == "step"), key
    assert os.listdir(f"{tmp}/runs") == ["ddp2"], os.listdir(f"{tmp}/runs")
    assert [p for p in os.listdir(board) if not p.startswith("events.out.tfevents.")] == []
    acc, records = load(board)
    compared = check_scalars(acc, lines, "rank 0")
    # Histograms: every 4 steps, each parameter's whole tensor (the sizes add up to the bytes
    # DDP reduces per step, 4 per float32 parameter).
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    histograms = sorted(acc.Tags()["histograms"])
    assert histograms == sorted(f"parameters/{n}" for n in names), histograms
    sizes = {}
    for name in names:
        events = acc.Histograms(f"parameters/{name}")
        assert [e.step for e in events] == list(range(4, 2 * STEPS_PER_EPOCH + 1, 4)), name
        for e in events:
            h = e.histogram_value
            assert sum(h.bucket) == h.num and sizes.setdefault(name, h.num) == h.num, name
            assert h.min <= h.bucket_limit[0] and h.bucket_limit[-1] == h.max, name
            assert h.min < h.max, name
    text = acc.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("strategy ddp, 2 processes, model mlp, batch 32 per rank"), text
    comm = [line["comm_bytes"] for line in lines if line["event"] == "step"]
    assert set(comm) == {4 * sum(sizes.values())}, (comm, sizes)
    print(f"rank 0: {records} records with valid CRCs, {compared} scalars equal to the metrics, "
          f"{len(histograms)} parameter histograms every 4 steps")

    # ---- 2. every rank ------------------------------------------------------------------
    every = f"{tmp}/runs/ddp2-all"
    shoal("train", *SMALL, "--metrics", f"{tmp}/all.jsonl", "--tensorboard", every,
          "--tensorboard-all-ranks")
    assert sorted(os.listdir(every)) == ["rank0", "rank1"], os.listdir(every)
    acc0, _ = load(f"{every}/rank0")
    acc1, _ = load(f"{every}/rank1")
    check_scalars(acc0, read_metrics(f"{tmp}/all.jsonl"), "all ranks, rank 0")
    loss0 = [e.value for e in acc0.Scalars("train/loss")]
    loss1 = [e.value for e in acc1.Scalars("train/loss")]
    assert len(loss1) == len(loss0) and loss0 != loss1, "each rank logs its own shard's loss"
    norm0 = [e.value for e in acc0.Scalars("train/grad_norm")]
    norm1 = [e.value for e in acc1.Scalars("train/grad_norm")]
    assert norm0 == norm1, (norm0, norm1)
    print("every rank: rank0/ and rank1/, own losses, equal averaged gradient norms")

    # ---- 3. TensorBoard serves the runs ---------------------------------------------------
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", f"{tmp}/runs",
                               "--host", "127.0.0.1", "--port", "0", "--load_fast", "false"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        port, output = None, []
        os.set_blocking(server.stdout.fileno(), False)
        while port is None:
            assert time.monotonic() < deadline, "tensorboard did not say its port:\n" + "".join(output)
            assert server.poll() is None, "tensorboard exited:\n" + "".join(output)
            chunk = server.stdout.readline()
            if not chunk:
                time.sleep(0.2)
                continue
            output.append(chunk)
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", chunk)
            port = int(found.group(1)) if found else None
        want = expected_scalars(lines)["train/loss"]
        query = urllib.parse.urlencode({"run": "ddp2", "tag": "train/loss"})
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
        served = None
        while True:
            try:
                with urllib.request.urlopen(url, timeout=10) as reply:
                    served = json.load(reply)
                if {step: value for _, step, value in served} == want:
                    break
            except OSError:  # not listening yet, or the run is not loaded yet (400)
                pass
            assert time.monotonic() < deadline, f"{url} answered {served}, not {want}"
            time.sleep(0.5)
        print(f"tensorboard on 127.0.0.1:{port} serves ddp2's train/loss: {len(served)} points")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
print("ORACLE OK tensorboard_ddp: all checks passed", flush=True)
