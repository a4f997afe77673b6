#!/usr/bin/python3
"""`shoal train` on a user's own data, against PyTorch training the same model on the same data:

  --data FILE.pt   a dict of tensors written here by torch.save (train_x, train_y, test_x, test_y);
                   class targets, and float targets under --loss mse, smooth_l1, bce_with_logits
  --data-dir DIR   CIFAR-10's binary files (data_batch_1.bin, data_batch_2.bin, test_batch.bin),
                   written here in the dataset's record layout and read by the test as
                   PyTorch's CIFAR-10 users read them (label byte, then 3x32x32 planes)

Each run (with worker threads loading ahead) must end with PyTorch's weights (1e-5 relative) and
PyTorch's test accuracy. Then malformed files: each must end the run with one clear line on
stderr and a non-zero exit status, never a crash.

    data_files.py SHOAL_BINARY
"""
import os
import sys
import tempfile

from test_script_support import run_shoal, start_oracle, state_matches

SHOAL, torch, checks = start_oracle("data_files")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# The Python twins of Shoal's built-in models (tests/models, beside this folder).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from pytorch_models import Cnn  # noqa: E402

check = checks.check


def shoal(*args):
    return run_shoal(SHOAL, "train", *args)


def train_in_pytorch(x, y, xt, yt, seed, batch, lr, momentum, epochs=1):
    """What shoal train does: model after manual_seed(seed), SGD, cross-entropy, DistributedSampler's
    order (randperm seeded seed + epoch); evaluation on the test set."""
    torch.manual_seed(seed)
    model = Cnn(*x.shape[1:])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for begin in range(0, len(x), batch):
            idx = order[begin:begin + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(xt).argmax(1) == yt).double().mean().item()
    return model, accuracy


def compare(run, model, accuracy, dump, what):
    state = state_matches(check, run, model.state_dict(), dump, what)
    if state is None:
        return
    line = [l for l in run.stdout.splitlines() if l.startswith("final test accuracy")]
    check(len(line) == 1 and abs(float(line[0].split()[-1]) - accuracy) < 1e-4,
          f"{what}: test accuracy {line} equals PyTorch's {accuracy:.4f}", run)
    # The saved state dict loads into the Python module.
    fresh = Cnn(*model_shape(model))
    fresh.load_state_dict(state)


def model_shape(model):
    return model.conv1.in_channels, *model_shape.hw


def teacher_data(generator, n, shape):
    x = torch.randn(n, *shape, generator=generator)
    teacher = torch.randn(x[0].numel(), 10, generator=generator)
    return x, (x.reshape(n, -1).double() @ teacher.double()).argmax(1)


with tempfile.TemporaryDirectory() as tmp:
    g = torch.Generator().manual_seed(11)
    # --- --data FILE.pt
    shape = (2, 12, 12)
    x, y = teacher_data(g, 384, shape)
    xt = torch.randn(128, *shape, generator=g)
    yt = torch.randint(0, 10, (128,), generator=g)
    data_pt = os.path.join(tmp, "data.pt")
    torch.save({"train_x": x, "train_y": y, "test_x": xt, "test_y": yt}, data_pt)
    model_shape.hw = shape[1:]
    model, accuracy = train_in_pytorch(x, y, xt, yt, seed=3, batch=32, lr=0.05, momentum=0.9)
    for workers in ("0", "2"):
        dump = os.path.join(tmp, "pt" + workers)
        run = shoal("--data", data_pt, "--model", "cnn", "--seed", "3", "--batch-size", "32",
                    "--lr", "0.05", "--momentum", "0.9", "--threads", "1", "--no-progress",
                    "--num-workers", workers, "--dump-parameters", dump)
        compare(run, model, accuracy, dump, f"--data FILE.pt, --num-workers {workers}")

    # --- CIFAR-10 binary files
    cifar = os.path.join(tmp, "cifar")
    os.makedirs(cifar)
    counts = {"data_batch_1.bin": 96, "data_batch_2.bin": 64, "test_batch.bin": 48}
    images, labels = {}, {}
    for name, n in counts.items():
        labels[name] = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        images[name] = torch.randint(0, 256, (n, 3072), generator=g, dtype=torch.uint8)
        with open(os.path.join(cifar, name), "wb") as f:
            f.write(torch.cat([labels[name].unsqueeze(1), images[name]], 1).numpy().tobytes())

    def cifar_split(names):
        raw = torch.cat([images[n] for n in names]).reshape(-1, 3, 32, 32)
        mean = torch.tensor([0.4914, 0.4822, 0.4465], dtype=torch.float64).float().view(1, 3, 1, 1)
        std = torch.tensor([0.2470, 0.2435, 0.2616], dtype=torch.float64).float().view(1, 3, 1, 1)
        return raw.float().div_(255.0).sub_(mean).div_(std), torch.cat([labels[n] for n in names]).long()

    cx, cy = cifar_split(["data_batch_1.bin", "data_batch_2.bin"])
    cxt, cyt = cifar_split(["test_batch.bin"])
    model_shape.hw = (32, 32)
    model, accuracy = train_in_pytorch(cx, cy, cxt, cyt, seed=5, batch=16, lr=0.01, momentum=0.9)
    dump = os.path.join(tmp, "cifar_dump")
    run = shoal("--data-dir", cifar, "--model", "cnn", "--seed", "5", "--batch-size", "16",
                "--lr", "0.01", "--momentum", "0.9", "--threads", "1", "--no-progress",
                "--num-workers", "2", "--prefetch-factor", "3", "--dump-parameters", dump)
    compare(run, model, accuracy, dump, "CIFAR-10 --data-dir, --num-workers 2")

    # --- --loss mse on regression targets: the built-in mlp with one output per target value
    class Mlp(nn.Module):
        """shoal's built-in mlp for F features and K outputs (models::Mlp(InputShape))."""

        def __init__(self, features, outputs):
            super().__init__()
            self.fc1 = nn.Linear(features, 1024)
            self.fc2 = nn.Linear(1024, 1024)
            self.fc3 = nn.Linear(1024, outputs)

        def forward(self, x):
            x = F.relu(self.fc1(torch.flatten(x, 1)))
            return self.fc3(F.relu(self.fc2(x)))

    def regression(loss_name, loss_fn, rx, ry, rxt, ryt, seed=6, batch=32, lr=0.01):
        torch.manual_seed(seed)
        net = Mlp(rx[0].numel(), ry[0].numel())
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        order = torch.randperm(len(rx), generator=torch.Generator().manual_seed(seed))
        for begin in range(0, len(rx), batch):
            idx = order[begin:begin + batch]
            opt.zero_grad()
            loss_fn(net(rx[idx]).view_as(ry[idx]), ry[idx]).backward()
            opt.step()
        with torch.no_grad():
            test_loss = loss_fn(net(rxt).view_as(ryt), ryt).item()
        path = os.path.join(tmp, f"regression_{loss_name}.pt")
        torch.save({"train_x": rx, "train_y": ry, "test_x": rxt, "test_y": ryt}, path)
        dump = os.path.join(tmp, f"regression_{loss_name}")
        run = shoal("--data", path, "--model", "mlp", "--loss", loss_name, "--seed", str(seed),
                    "--batch-size", str(batch), "--lr", str(lr), "--momentum", "0.9",
                    "--threads", "1", "--no-progress", "--dump-parameters", dump)
        what = f"--loss {loss_name}, targets {list(ry.shape)}"
        if state_matches(check, run, net.state_dict(), dump, what) is None:
            return
        line = [l for l in run.stdout.splitlines() if l.startswith("final test loss")]
        check(len(line) == 1 and abs(float(line[0].split()[-1]) - test_loss) <= 1e-5 * abs(test_loss),
              f"{what}: the last line {line} is PyTorch's test loss {test_loss:.6g}", run)
        check("accuracy" not in run.stdout, f"{what}: no accuracy reported for a regression", run)
        print(f"{what}: test loss {test_loss:.6g}", flush=True)

    rx = torch.randn(384, 8, generator=g)
    rw = torch.randn(8, 2, generator=g)
    rxt = torch.randn(64, 8, generator=g)
    regression("mse", F.mse_loss, rx, (rx @ rw)[:, 0].contiguous(), rxt, (rxt @ rw)[:, 0].contiguous())
    regression("smooth_l1", F.smooth_l1_loss, rx, rx @ rw, rxt, rxt @ rw)
    regression("bce_with_logits", F.binary_cross_entropy_with_logits, rx,
               torch.sigmoid(rx @ rw), rxt, torch.sigmoid(rxt @ rw))
    good_regression = {"train_x": rx, "train_y": (rx @ rw)[:, 0].contiguous(), "test_x": rxt,
                       "test_y": (rxt @ rw)[:, 0].contiguous()}

    # --- malformed files: one clear line, a non-zero exit, no crash
    def refused(args, expect, what):
        run = shoal(*args, "--model", "cnn", "--no-progress", "--threads", "1")
        lines = [l for l in run.stderr.splitlines() if l.strip()]
        check(0 < run.returncode < 126, f"{what}: exits non-zero without a crash", run)
        print(f"{what}: {lines[0] if lines else '(nothing)'}", flush=True)
        check(len(lines) == 1 and expect in lines[0],
              f"{what}: one line on stderr saying '{expect}'", run)

    def bad_cifar(name, edit, expect, what):
        folder = os.path.join(tmp, name)
        os.makedirs(folder)
        for file in counts:
            with open(os.path.join(cifar, file), "rb") as f:
                data = bytearray(f.read())
            with open(os.path.join(folder, file), "wb") as f:
                f.write(edit(file, data))
        refused(["--data-dir", folder], expect, what)

    bad_cifar("cut", lambda f, d: d[:-100] if f == "data_batch_2.bin" else d,
              "not a whole number of 3073-byte records", "CIFAR-10 record cut short")
    bad_cifar("label", lambda f, d: d[:3073] + bytes([10]) + d[3074:] if f == "data_batch_1.bin" else d,
              "record 1 has label 10", "CIFAR-10 label out of range")

    def bad_pt(name, content, expect, what):
        path = os.path.join(tmp, name + ".pt")
        torch.save(content, path)
        refused(["--data", path], expect, what)

    good = {"train_x": x[:64], "train_y": y[:64], "test_x": xt[:32], "test_y": yt[:32]}
    bad_pt("nokey", {k: v for k, v in good.items() if k != "test_y"}, "no key 'test_y'",
           ".pt missing a key")
    bad_pt("intx", dict(good, train_x=(x[:64] * 10).long()), "'train_x' has dtype Long, not floating point",
           ".pt with integer inputs")
    bad_pt("floaty", dict(good, train_y=y[:64].float()), "'train_y' has dtype Float, not an integer type",
           ".pt with float targets")
    bad_pt("shapey", dict(good, train_y=y[:64].reshape(32, 2)), "'train_y' has shape [32, 2]",
           ".pt with 2-D targets")
    bad_pt("count", dict(good, train_y=y[:63]), "train_x holds 64 samples but train_y 63",
           ".pt with counts that disagree")
    bad_pt("sample", dict(good, test_x=torch.randn(32, 2, 10, 12)), "both splits must have one sample shape",
           ".pt with train and test samples of different shapes")
    bad_pt("range", dict(good, train_y=y[:64].clone().fill_(12)), "holds the label 12",
           ".pt with a label out of range")
    bad_pt("notdict", x[:4], "not a dict", ".pt holding a tensor, not a dict")
    bad_pt("notensor", dict(good, test_x=[1, 2, 3]), "'test_x' is a GenericList, not a tensor",
           ".pt with a list where a tensor belongs")
    int_targets = os.path.join(tmp, "int_targets.pt")
    torch.save(dict(good_regression, train_y=good_regression["train_y"].long()), int_targets)
    run = shoal("--data", int_targets, "--model", "mlp", "--loss", "mse", "--no-progress")
    lines = [l for l in run.stderr.splitlines() if l.strip()]
    check(0 < run.returncode < 126 and len(lines) == 1 and "'train_y' has dtype Long, not floating "
          "point; a regression loss takes float targets" in lines[0],
          "--loss mse with integer targets: one line", run)
    run = shoal("--model", "mlp", "--loss", "mse", "--no-progress")
    lines = [l for l in run.stderr.splitlines() if l.strip()]
    check(0 < run.returncode < 126 and len(lines) == 1 and "--loss mse takes float targets" in lines[0],
          "--loss mse on Fashion-MNIST's class labels: one line", run)
    cut = os.path.join(tmp, "cut.pt")
    with open(data_pt, "rb") as f:
        whole = f.read()
    with open(cut, "wb") as f:
        f.write(whole[: len(whole) // 2])
    refused(["--data", cut], cut, ".pt cut in half")

checks.finish()
