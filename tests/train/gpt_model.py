#!/usr/bin/python3
"""`shoal train --model gpt` against nanoGPT's model and loop written here in PyTorch:

  names       the state dict Shoal saves has nanoGPT's keys (transformer.wte.weight, ...,
              lm_head.weight, tied to wte) and loads into the Python GPT (strict)
  single      the same initial weights (--init-from, saved from Python), the same token blocks
              (--data): 12 AdamW steps equal PyTorch's to 1e-5 relative, and the test loss (the
              model's own cross-entropy) equals PyTorch's. No --clip-grad-norm here: the gradient
              of c_attn's key bias is zero up to rounding (softmax ignores a shift shared by all
              keys), and Adam's normalisation turns a clip factor's last-bit difference there
              into a 1e-4 one
  generate    shoal generate --top-k 1 from the run's checkpoint equals Python's greedy decoding
              of the same weights (past the block size); sampling is seeded
  ddp, fsdp   2 ranks of 4 blocks: 12 steps equal PyTorch's DDP (DistributedSampler shards,
              gradients averaged); fsdp (ZeRO-3, the tied head too) with Adam
  bad input   sizes that cannot work (--n-embd not a multiple of --n-head), a token id beyond
              --vocab-size, no --data: one line each

    gpt_model.py SHOAL_BINARY
"""
import math
import os
import subprocess
import sys
import tempfile

from test_script_support import Checks, run_shoal, skip

SHOAL = sys.argv[1]
try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    skip("python3-torch is not installed")

torch.set_num_threads(1)
checks = Checks("gpt_model")
check = checks.check

N_LAYER, N_HEAD, N_EMBD, BLOCK, VOCAB = 2, 2, 32, 16, 64


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        att = F.softmax(att.masked_fill(mask == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT (model.py), without dropout and with the mask made per forward."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD),
            wpe=nn.Embedding(BLOCK, N_EMBD),
            h=nn.ModuleList([Block() for _ in range(N_LAYER)]),
            ln_f=nn.LayerNorm(N_EMBD),
        ))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" not in name:
                std = 0.02 / math.sqrt(2 * N_LAYER) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            # LayerNorm weights stay 1; a little noise makes a wrong name or order show.
            if "ln_" in name and name.endswith("weight"):
                with torch.no_grad():
                    p.add_(0.1 * torch.randn_like(p))

    def logits(self, idx):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, idx, targets):
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


SEED, LR = 7, 3e-3
g = torch.Generator().manual_seed(5)
# A stream with structure to learn: each token mostly follows from the one before.
stream = [int(torch.randint(0, VOCAB, (1,), generator=g))]
for _ in range(120 * BLOCK):
    step = int(torch.randint(1, 4, (1,), generator=g))
    stream.append((stream[-1] * 5 + step) % VOCAB)
tokens = torch.tensor(stream)
blocks = tokens[: 120 * BLOCK + 1]
x = torch.stack([blocks[i * BLOCK:(i + 1) * BLOCK] for i in range(120)])
y = torch.stack([blocks[i * BLOCK + 1:(i + 1) * BLOCK + 1] for i in range(120)])
x, xt, y, yt = x[:96], x[96:], y[:96], y[96:]
y[0, :3] = -1  # ignored positions, as nanoGPT's ignore_index

torch.manual_seed(1)
initial = GPT()


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.1)


def copy_of(model):
    fresh = GPT()
    fresh.load_state_dict(model.state_dict())
    return fresh


def compare(run, reference, dump, what):
    check(run.returncode == 0, f"{what}: shoal train exits 0", run)
    if run.returncode != 0:
        return
    state = torch.load(dump + ".rank0.pt")
    expected = reference.state_dict()
    check(list(state.keys()) == list(expected.keys()),
          f"{what}: nanoGPT's keys in its order ({list(state.keys())[:4]}...)")
    check(state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr() or
          torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]),
          f"{what}: lm_head.weight is transformer.wte.weight")
    worst = max(relative(state[k], v) for k, v in expected.items() if k in state)
    check(worst <= 1e-5, f"{what}: weights equal PyTorch's to 1e-5 relative (worst {worst:.3g})")
    print(f"{what}: worst relative difference {worst:.3g}", flush=True)
    GPT().load_state_dict(state)


with tempfile.TemporaryDirectory() as tmp:
    data = os.path.join(tmp, "tokens.pt")
    torch.save({"train_x": x, "train_y": y, "test_x": xt, "test_y": yt}, data)
    init = os.path.join(tmp, "init.pt")
    torch.save(initial.state_dict(), init)
    common = ["--model", "gpt", "--n-layer", str(N_LAYER), "--n-head", str(N_HEAD), "--n-embd",
              str(N_EMBD), "--block-size", str(BLOCK), "--vocab-size", str(VOCAB), "--data", data,
              "--init-from", init, "--optimizer", "adamw", "--weight-decay", "0.1", "--lr", str(LR),
              "--seed", str(SEED), "--threads", "1", "--no-progress"]

    # --- single: 12 steps of 8 blocks, one epoch, then the test loss
    model = copy_of(initial)
    opt = adamw(model)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    for step in range(12):
        idx = order[step * 8:(step + 1) * 8]
        opt.zero_grad()
        model(x[idx], y[idx]).backward()
        opt.step()
    with torch.no_grad():
        test_loss = model(xt, yt).item()
    dump = os.path.join(tmp, "single")
    checkpoints = os.path.join(tmp, "checkpoints")
    run = run_shoal(SHOAL, "train", *common, "--batch-size", "8", "--dump-parameters", dump,
                    "--checkpoint-dir", checkpoints)
    compare(run, model, dump, "single")
    line = [l for l in run.stdout.splitlines() if l.startswith("final test loss")]
    check(len(line) == 1 and abs(float(line[0].split()[-1]) - test_loss) <= 1e-5 * test_loss,
          f"single: the test loss {line} is PyTorch's {test_loss:.6g}", run)

    # --- shoal generate: greedy (--top-k 1) equals Python's greedy decoding of the same weights,
    # past the block size (the context is cropped to its last 16 tokens, as nanoGPT does)
    def generate(*args):
        return subprocess.run([SHOAL, "generate", "--checkpoint", checkpoints, *args],
                              capture_output=True, timeout=120)

    if os.path.exists(dump + ".rank0.pt"):
        trained = GPT()
        trained.load_state_dict(torch.load(dump + ".rank0.pt"))
        trained.eval()
        ids = torch.tensor([list(b"0123")])
        with torch.no_grad():
            for _ in range(24):
                ids = torch.cat([ids, trained.logits(ids[:, -BLOCK:])[:, -1].argmax(-1, keepdim=True)], 1)
        expected = bytes(ids[0].tolist()) + b"\n"
        run = generate("--prompt", "0123", "--max-new-tokens", "24", "--top-k", "1")
        check(run.returncode == 0 and run.stdout == expected,
              f"generate, greedy: {run.stdout!r} == Python's {expected!r} ({run.stderr[-300:]!r})")
        sampled = [generate("--prompt", "0123", "--max-new-tokens", "24", "--temperature", "0.8",
                            "--seed", seed).stdout for seed in ("1", "1", "2")]
        check(sampled[0] == sampled[1] and len(sampled[0]) == 29 and sampled[0] != sampled[2],
              f"generate, sampled: the same --seed gives the same text, another seed another ({sampled})")
        run = generate("--prompt", "0123\x7f")
        check(run.returncode != 0 and b"byte 127 at position 4 is beyond the model's vocabulary of 64"
              in run.stderr, f"generate: a prompt byte beyond the vocabulary is refused ({run.stderr!r})")

    # --- ddp and fsdp, 2 ranks of 4: PyTorch's DDP simulated step by step (FSDP shards Adam's
    # state, not AdamW's: it trains with Adam and L2 weight decay)
    shards = []
    for r in range(2):
        sampler = torch.utils.data.DistributedSampler(range(len(x)), num_replicas=2, rank=r,
                                                      shuffle=True, seed=SEED)
        sampler.set_epoch(0)
        shards.append(torch.tensor(list(sampler)))
    for strategy, optimizer, make in (("ddp", "adamw", adamw), ("fsdp", "adam", adam)):
        ranks = [copy_of(initial) for _ in range(2)]
        opts = [make(m) for m in ranks]
        for step in range(12):
            for r in range(2):
                idx = shards[r][step * 4:(step + 1) * 4]
                opts[r].zero_grad()
                ranks[r](x[idx], y[idx]).backward()
            for p0, p1 in zip(ranks[0].parameters(), ranks[1].parameters()):
                mean = (p0.grad + p1.grad) / 2
                p0.grad.copy_(mean)
                p1.grad.copy_(mean)
            for o in opts:
                o.step()
        dump = os.path.join(tmp, strategy)
        args = [a if a != "adamw" else optimizer for a in common]
        run = run_shoal(SHOAL, "train", *args, "--strategy", strategy, "--nproc-per-node", "2",
                        "--batch-size", "4", "--dump-parameters", dump)
        compare(run, ranks[0], dump, f"{strategy}, 2 ranks, {optimizer}")

    # --- bad input: one line each
    def refused(args, expect, what):
        run = run_shoal(SHOAL, "train", *args)
        lines = [l for l in run.stderr.splitlines() if l.strip()]
        check(0 < run.returncode < 126 and len(lines) == 1 and expect in lines[0],
              f"{what}: one line saying '{expect}'", run)

    refused(common + ["--n-head", "3"], "--n-embd must be a positive multiple of --n-head",
            "n_embd not a multiple of n_head")
    big = os.path.join(tmp, "big.pt")
    torch.save({"train_x": x.clone().fill_(VOCAB), "train_y": y, "test_x": xt, "test_y": yt}, big)
    refused(common + ["--data", big], f"holds the token id {VOCAB}, but the vocabulary has {VOCAB}",
            "a token id beyond the vocabulary")
    refused(["--model", "gpt", "--no-progress"], "--model gpt trains on blocks of token ids",
            "gpt without --data")

checks.finish()
