"""The PyTorch side of test_train_features_pytorch.cpp: Adam, AdamW, warm-up + cosine, StepLR,
MultiStepLR, clip_grad_norm_, gradient accumulation and bf16 autocast, each trained 20 steps in
Python PyTorch on the data and initial weights Shoal's trainer uses.

usage: train_features_oracle.py CASES_FILE OUT_DIR
CASES_FILE holds one case a line: "NAME key=value ...", keys: strategy (single, ddp, dp,
pipeline), ranks (data-parallel ranks: 2 for ddp), size, batch (per rank and micro-batch), seed,
data_seed, optimizer, lr, momentum, betas (b1,b2), eps, weight_decay, lr_schedule, warmup_steps,
warmup_start_factor, step_size, gamma, milestones (a,b,...), t_max, clip, accumulate, precision
(fp32, bf16, fp16), and for the loss scaler (torch.amp.GradScaler("cpu"), PyTorch >= 2.3):
scaler (1: scale a float32 model too; fp16 always scales), init_scale, growth_interval,
inf_samples (a,b,...: those samples get an inf pixel, so that their steps overflow), and device
(cpu, cuda: the model, data, autocast and scaler on the GPU).
Data as shoal::data::SyntheticDataset and the model as shoal::models::create("mlp", seed) make
them (see pytorch_train.py). Each optimizer step takes, on each rank, `accumulate` micro-batches
of `batch` from the rank's DistributedSampler(shuffle=True, seed) shard; with several ranks the
step's gradient is the ranks' gradients averaged, as DistributedDataParallel's allreduce leaves
it on every rank (clipping follows the averaging). dp and pipeline train as one process.
Writes OUT_DIR/NAME.params (every parameter, little-endian float32, registration order) and
OUT_DIR/NAME.txt (a line per step: the step's mean loss over rank 0's samples, and the total
gradient norm before clipping, or nan); with a scaler, OUT_DIR/NAME.scale (a line per step: the
scale after update() and 1 when the step was skipped, else 0).
"""
import os
import sys

try:
    import torch
    import torch.nn.functional as F
    from torch.utils.data.distributed import DistributedSampler
except ImportError:
    print("python3-torch is not installed", file=sys.stderr)
    sys.exit(77)  # the caller reports the test as skipped

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from pytorch_models import Mlp  # noqa: E402


def parse(line):
    words = line.split()
    case = {"name": words[0]}
    for word in words[1:]:
        key, value = word.split("=", 1)
        case[key] = value
    return case


def optimizer_of(case, params):
    lr = float(case["lr"])
    kind = case.get("optimizer", "sgd")
    if kind in ("adam", "adamw"):
        betas = tuple(float(b) for b in case.get("betas", "0.9,0.999").split(","))
        kwargs = {"lr": lr, "betas": betas, "eps": float(case.get("eps", "1e-8"))}
        if "weight_decay" in case:
            kwargs["weight_decay"] = float(case["weight_decay"])
        return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(params, **kwargs)
    return torch.optim.SGD(params, lr=lr, momentum=float(case.get("momentum", "0.9")),
                           weight_decay=float(case.get("weight_decay", "0")))


def scheduler_of(case, opt, total_steps):
    sched = torch.optim.lr_scheduler
    warmup = int(case.get("warmup_steps", "0"))
    kind = case.get("lr_schedule", "constant")
    main = None
    if kind == "cosine":
        t_max = int(case.get("t_max", "0")) or total_steps - warmup
        main = sched.CosineAnnealingLR(opt, T_max=t_max)
    elif kind == "step":
        main = sched.StepLR(opt, step_size=int(case["step_size"]), gamma=float(case["gamma"]))
    elif kind == "multistep":
        milestones = [int(m) for m in case["milestones"].split(",")]
        main = sched.MultiStepLR(opt, milestones=milestones, gamma=float(case["gamma"]))
    if warmup == 0:
        return main
    # Built as a user would: the warm-up, the schedule, SequentialLR over both.
    linear = sched.LinearLR(opt, start_factor=float(case.get("warmup_start_factor", "0.3333333333333333")),
                            total_iters=warmup)
    if main is None:
        return linear
    return sched.SequentialLR(opt, schedulers=[linear, main], milestones=[warmup])


def run(case, x, y, out_dir=None):
    """Trains `case`; writes its files to out_dir when given; returns (parameters, step lines)."""
    seed, ranks = int(case["seed"]), int(case.get("ranks", "1"))
    batch, accumulate = int(case["batch"]), int(case.get("accumulate", "1"))
    size = x.shape[0]
    torch.manual_seed(seed)
    model = Mlp()
    # device=cuda: made on the CPU as Shoal makes it, then moved, with the data.
    device = case.get("device", "cpu")
    model.to(device)
    x, y = x.to(device), y.to(device)
    params = list(model.parameters())
    opt = optimizer_of(case, params)
    step_samples = batch * accumulate
    shards = []
    for r in range(ranks):
        sampler = DistributedSampler(range(size), num_replicas=ranks, rank=r, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        shards.append(torch.tensor(list(sampler)))
    steps = (len(shards[0]) + step_samples - 1) // step_samples
    scheduler = scheduler_of(case, opt, steps)
    clip = float(case.get("clip", "0"))
    precision = case.get("precision", "fp32")
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = None
    if case.get("scaler") == "1" or precision == "fp16":
        scaler = torch.amp.GradScaler(device, init_scale=float(case.get("init_scale", "65536")),
                                      growth_interval=int(case.get("growth_interval", "2000")))
    if "inf_samples" in case:
        x = x.clone()
        for k in case["inf_samples"].split(","):
            x[int(k), 0, 0, 0] = float("inf")
    lines, scales = [], []
    for s in range(steps):
        opt.zero_grad()
        summed = [torch.zeros_like(p) for p in params]
        rank0_loss = 0.0
        for r in range(ranks):
            idx = shards[r][s * step_samples:(s + 1) * step_samples]
            micro = idx.split(batch)
            for chunk in micro:
                if autocast is not None:
                    with torch.autocast(device, dtype=autocast):
                        loss = F.cross_entropy(model(x[chunk]), y[chunk])
                else:
                    loss = F.cross_entropy(model(x[chunk]), y[chunk])
                # Each micro-batch weighs its share of the step's samples (the step equals one
                # on all of them; on a short last step the shares are not 1 / len(micro)).
                share = len(chunk) / len(idx)
                part = loss * share if len(micro) > 1 else loss
                (scaler.scale(part) if scaler is not None else part).backward()
                if r == 0:
                    rank0_loss += loss.item() * share
            # This rank's gradient, then the next rank's from zero (DDP: each rank its own).
            for total, p in zip(summed, params):
                total += p.grad
                p.grad.zero_()
        for total, p in zip(summed, params):
            p.grad.copy_(total / ranks)  # DDP's average
        norm = float("nan")
        if scaler is not None:
            scaler.unscale_(opt)  # the true gradients before clipping, as PyTorch's recipe does
        if clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if scaler is not None:
            found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
            scaler.step(opt)
            scaler.update()
            scales.append("%r %d" % (scaler.get_scale(), 1 if found else 0))
        else:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        lines.append("%r %r" % (rank0_loss, norm))
    if out_dir is not None:
        with open(os.path.join(out_dir, case["name"] + ".params"), "wb") as f:
            for p in params:
                f.write(p.detach().cpu().contiguous().numpy().astype("<f4").tobytes())
        with open(os.path.join(out_dir, case["name"] + ".txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        if scaler is not None:
            with open(os.path.join(out_dir, case["name"] + ".scale"), "w") as f:
                f.write("\n".join(scales) + "\n")
    return dict(model.named_parameters()), lines


def main():
    cases_file, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    cases = [parse(line) for line in open(cases_file) if line.strip()]
    data = {}
    for case in cases:
        key = (int(case["data_seed"]), int(case["size"]))
        if key not in data:
            g = torch.Generator().manual_seed(key[0])
            x = torch.randn(key[1], 1, 28, 28, generator=g)
            teacher = torch.randn(784, 10, generator=g)
            data[key] = (x, (x.reshape(key[1], -1).double() @ teacher.double()).argmax(1))
        run(case, *data[key], out_dir)
    print("ORACLE OK train_features %d cases" % len(cases), flush=True)


if __name__ == "__main__":
    main()
