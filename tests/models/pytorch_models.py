"""The PyTorch twins of Shoal's built-in models, for the oracle test.

Usage: pytorch_models.py MODEL SEED OUT
Builds MODEL right after torch.manual_seed(SEED) and writes to OUT, as little-endian float32:
every parameter in registration order (flattened), then the logits for the fixed input
linspace(-1, 1, 2*784) shaped [2,1,28,28]. A line per parameter, "name numel", goes to stdout.
"""
import sys

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("python3-torch is not installed", file=sys.stderr)
    sys.exit(77)  # the caller reports the test as skipped


class Cnn(nn.Module):
    """Shoal's cnn for samples [C, H, W] (models::Cnn(InputShape)); Fashion-MNIST's by default."""

    def __init__(self, c=1, h=28, w=28, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(64 * ((h - 4) // 2) * ((w - 4) // 2), 128)
        self.fc2 = nn.Linear(128, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        w = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, -1)
        x = x + self.proj((w @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """Shoal's "transformer" (include/shoal/models/transformer.h): rows of the image as tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(28, 64)
        self.pos = nn.Embedding(28, 64)
        self.blocks = nn.ModuleList([TransformerBlock(64, 4, 256) for _ in range(4)])
        self.ln_f = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.embed(x.reshape(x.shape[0], 28, 28)) + self.pos.weight
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x).mean(1))


MODELS = {"cnn": Cnn, "mlp": Mlp, "transformer": Transformer}


def main():
    name, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = MODELS[name]()
    x = torch.linspace(-1, 1, 2 * 784).reshape(2, 1, 28, 28)
    with torch.no_grad():
        logits = model(x)
    with open(out, "wb") as f:
        for pname, p in model.named_parameters():
            print(pname, p.numel())
            f.write(p.detach().contiguous().numpy().astype("<f4").tobytes())
        f.write(logits.numpy().astype("<f4").tobytes())
    print("ORACLE OK pytorch_models %s" % name, flush=True)  # the C++ side requires this line


if __name__ == "__main__":
    main()
