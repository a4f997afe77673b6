"""The PyTorch twin of Shoal's single-process trainer, for the oracle test.

Usage: pytorch_train.py MODEL SEED DATA_SEED SIZE EPOCHS BATCH LR MOMENTUM OUT [SCHEDULE]
Data as shoal::data::SyntheticDataset makes it (randn inputs [SIZE,1,28,28] and a randn teacher
[784,10] from one generator seeded DATA_SEED; labels = argmax in float64), the model built after
torch.manual_seed(SEED), SGD with momentum, cross-entropy, and each epoch's order the permutation
DistributedSampler(shuffle=True, seed=SEED) gives after set_epoch(epoch). SCHEDULE "cosine":
CosineAnnealingLR(T_max = every step of the run), stepped after each optimizer step.
Prints one line per epoch: the mean training loss. Writes the final parameters to OUT as
little-endian float32, in registration order.
"""
import os
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("python3-torch is not installed", file=sys.stderr)
    sys.exit(77)  # the caller reports the test as skipped

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from pytorch_models import Cnn, Mlp  # noqa: E402


def main():
    name, seed, data_seed, size, epochs, batch = sys.argv[1], *map(int, sys.argv[2:7])
    lr, momentum, out = float(sys.argv[7]), float(sys.argv[8]), sys.argv[9]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(size, 1, 28, 28, generator=g)
    teacher = torch.randn(784, 10, generator=g)
    y = (x.reshape(size, -1).double() @ teacher.double()).argmax(1)
    torch.manual_seed(seed)
    model = {"cnn": Cnn, "mlp": Mlp}[name]()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scheduler = None
    if len(sys.argv) > 10 and sys.argv[10] == "cosine":
        steps = epochs * ((size + batch - 1) // batch)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        total = 0.0
        for begin in range(0, size, batch):
            idx = order[begin:begin + batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            total += loss.item() * len(idx)
        print(repr(total / size))
    with open(out, "wb") as f:
        for p in model.parameters():
            f.write(p.detach().contiguous().numpy().astype("<f4").tobytes())
    print("ORACLE OK pytorch_train %s" % name, flush=True)  # the C++ side requires this line


if __name__ == "__main__":
    main()
