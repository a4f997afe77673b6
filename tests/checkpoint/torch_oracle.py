"""PyTorch's side of Shoal's checkpoint tests: reads the files Shoal wrote and writes files for
Shoal to read. Run by tests/checkpoint/*.cpp with Debian's /usr/bin/python3 (python3-torch). Each command
prints "ORACLE OK <command>" last, once its checks passed: the C++ side requires that line."""
import collections
import os
import sys

import torch
from torch import nn


def net():
    # The same layers as the C++ tests' model: the keys must match one to one.
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


MARKER = "/nonexistent"


class Evil:
    # Loading this file with Python's pickle would run `touch MARKER`; Shoal must refuse it.
    def __reduce__(self):
        return (os.system, ("touch " + MARKER,))


def check_and_resave(d, epoch, step):
    sd = torch.load(os.path.join(d, "shoal_sd.pt"))
    assert isinstance(sd, collections.OrderedDict), type(sd)
    m = net()
    m.load_state_dict(sd)  # strict: every key and shape matches
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]) and v.dtype == sd[k].dtype, k

    full = torch.load(os.path.join(d, "shoal_full.pt"))
    assert full["epoch"] == epoch and full["step"] == step, (full["epoch"], full["step"])
    config = full["config"]
    assert config["model"] == "mlp", config
    # Numbers as numbers, not strings.
    assert type(config["lr"]) is float and config["lr"] == 0.05, config
    assert type(config["momentum"]) is float and config["momentum"] == 0.9, config
    assert type(config["batch_size"]) is int and config["batch_size"] == 32, config
    assert type(config["seed"]) is int and config["seed"] == 7, config
    assert full["rng_state"].dtype == torch.uint8
    assert full["shoal_version"] == "0.1.0"
    m.load_state_dict(full["model"])
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.0)
    opt.load_state_dict(full["optimizer"])
    g = opt.param_groups[0]
    assert g["lr"] == 0.05 and g["momentum"] == 0.9, g
    for i, p in enumerate(m.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], full["optimizer"]["state"][i]["momentum_buffer"])
    # The loaded optimizer steps (the state is in the form Python's SGD expects).
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch.set_rng_state(full["rng_state"])

    m.load_state_dict(full["model"])
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.0)
    opt.load_state_dict(full["optimizer"])
    torch.save(m.state_dict(), os.path.join(d, "py_sd.pt"))
    # The config as Shoal 0.1 wrote it before numbers were numbers: every value a string.
    old_config = {"model": "mlp", "lr": "0.05", "momentum": "0.9", "batch_size": "32",
                  "seed": "18446744073709551615"}
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                "config": old_config}, os.path.join(d, "py_full.pt"))
    torch.save(nn.DataParallel(m).state_dict(), os.path.join(d, "py_dp.pt"))
    # A model with a child named "module" beside another: PyTorch keeps every name as it is.
    child = nn.Module()
    child.module = nn.Linear(3, 2)
    child.head = nn.Linear(2, 2)
    torch.save(child.state_dict(), os.path.join(d, "py_module_child.pt"))
    # Newer pickle protocols (FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE) as torch.save can be asked for.
    torch.save(m.state_dict(), os.path.join(d, "py_sd_p4.pt"), pickle_protocol=4)
    # Views sharing one storage, torch.Size, bytes and wide integers.
    base = torch.arange(10, dtype=torch.float64)
    values = {"a": base, "b": base[2:5], "c": base.view(2, 5).t(), "size": base.view(2, 5).shape,
              "bytes": b"\x00\xffab", "betas": (0.9, 0.999), "neg": -3, "big": 2 ** 40, "negbig": -(2 ** 40)}
    torch.save(values, os.path.join(d, "py_values.pt"))
    torch.save(values, os.path.join(d, "py_values_p5.pt"), pickle_protocol=5)

    # Adam state written by Python, two steps taken.
    torch.manual_seed(3)
    adam = torch.optim.Adam(m.parameters(), lr=0.01)
    m.train()
    for _ in range(2):
        adam.zero_grad()
        m(torch.randn(6, 4)).pow(2).mean().backward()
        adam.step()
    torch.save({"model_state_dict": m.state_dict(), "optimizer_state_dict": adam.state_dict(),
                "epoch": 7}, os.path.join(d, "py_adam.pt"))

    global MARKER
    MARKER = os.path.join(d, "pwned")
    torch.save({"x": Evil()}, os.path.join(d, "py_evil.pt"))
    print("ORACLE OK check_and_resave", flush=True)


def load_converted(path, prefix):
    sd = torch.load(path)
    assert all(k.startswith(prefix) for k in sd), list(sd)
    m = net()
    m.load_state_dict({k[len(prefix):]: v for k, v in sd.items()})
    print("ORACLE OK load_converted", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "check_and_resave":
        check_and_resave(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "load_converted":
        load_converted(sys.argv[2], sys.argv[3])
    else:
        sys.exit("unknown command " + sys.argv[1])
