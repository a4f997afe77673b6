#!/usr/bin/env python3
"""`shoal train --device cuda` as a user runs it on a GPU machine: the fp16 recipe (CUDA
autocast to float16 with the loss scaler) under single and 2-process DDP on a `--data FILE.pt` of
learnable tensors; the CUDA run equals the CPU run in float32 (to 1e-4 relative); an fp16 run
stopped mid-epoch and resumed ends with the weights of the uninterrupted one; a checkpoint written
on the GPU loads with torch.load on the CPU. Without a GPU, --device cuda is refused in one line.

    cli_train_cuda.py SHOAL_BINARY
Run with a python whose torch sees the GPU (scripts/gpu_check.sh: the GPU machine's python3).
Exit 77 (skipped) when this python has no torch.
"""
import os
import sys
import tempfile

from test_script_support import Checks, run_shoal, skip

SHOAL = sys.argv[1]
try:
    import torch
except ImportError:
    skip("this python has no torch")

checks = Checks("cli_train_cuda")
check = checks.check
COMMON = ["--model", "mlp", "--seed", "3", "--epochs", "2", "--batch-size", "32", "--threads", "1",
          "--no-progress", "--lr", "0.05"]


def shoal(*args):
    return run_shoal(SHOAL, "train", *args, timeout=600)


def accuracy(run):
    for line in run.stdout.splitlines():
        if "final test accuracy:" in line:  # "[rank 0] final test accuracy: A" under ddp
            return float(line.split(":", 1)[1])
    return None


def max_relative(a, b):
    worst = 0.0
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-12)
        worst = max(worst, float((a[k].float() - b[k].float()).abs().max()) / scale)
    return worst


with tempfile.TemporaryDirectory() as tmp:
    # Learnable data: labels from a fixed random linear teacher of the top-left 4x4 pixels (the
    # rest is faint noise); the MLP reaches ~0.78 in 2 epochs on the CPU.
    g = torch.Generator().manual_seed(5)
    x = 0.1 * torch.randn(2560, 1, 28, 28, generator=g)
    x[:, :, :4, :4] = torch.randn(2560, 1, 4, 4, generator=g)
    teacher = torch.randn(16, 10, generator=g)
    y = (x[:, 0, :4, :4].reshape(len(x), -1) @ teacher).argmax(1)
    data = f"{tmp}/data.pt"
    torch.save({"train_x": x[:2048], "train_y": y[:2048], "test_x": x[2048:], "test_y": y[2048:]},
               data)
    common = [*COMMON, "--data", data]

    # Strategies that train on the CPU only: one line, before any data is read, on any machine.
    for strategy in (["--strategy", "ps"], ["--strategy", "pipeline", "--stages", "2"]):
        run = shoal(*common, *strategy, "--device", "cuda")
        lines = run.stderr.strip().splitlines()
        check(run.returncode == 2 and len(lines) == 1 and "--strategy single or plain ddp" in run.stderr,
              f"--device cuda with --strategy {strategy[1]} is refused in one line", run)

    if not torch.cuda.is_available():
        run = shoal(*common, "--device", "cuda")
        lines = run.stderr.strip().splitlines()
        check(run.returncode == 2 and len(lines) == 1 and "--device cuda" in run.stderr
              and "--device cpu" in run.stderr,
              "without a GPU, --device cuda is refused in one line naming --device cpu", run)
        checks.finish()
        sys.exit(0)

    # float32 on the GPU equals float32 on the CPU (cuBLAS and the CPU's BLAS sum in other orders).
    cpu = shoal(*common, "--dump-parameters", f"{tmp}/cpu")
    gpu = shoal(*common, "--device", "cuda", "--dump-parameters", f"{tmp}/gpu")
    check(cpu.returncode == 0 and gpu.returncode == 0, "fp32 trains on the CPU and on the GPU", gpu)
    if cpu.returncode == 0 and gpu.returncode == 0:
        diff = max_relative(torch.load(f"{tmp}/cpu.rank0.pt"), torch.load(f"{tmp}/gpu.rank0.pt"))
        print(f"fp32 after 2 epochs: GPU vs CPU parameters within {diff:.2e} relative")
        check(diff <= 1e-4, f"fp32 on the GPU equals the CPU's to 1e-4 relative ({diff:.2e})")

    # The fp16 recipe, one process and DDP over 2 processes on this GPU (gloo through host memory).
    for strategy in (["--strategy", "single"], ["--strategy", "ddp", "--nproc-per-node", "2"]):
        run = shoal(*common, *strategy, "--device", "cuda", "--precision", "fp16",
                    "--dump-parameters", f"{tmp}/fp16_{strategy[1]}")
        acc = accuracy(run)
        print(f"fp16 {strategy[1]} on the GPU: test accuracy {acc}")
        check(run.returncode == 0 and acc is not None and acc > 0.5,
              f"fp16 {strategy[1]}: trains on the GPU to a test accuracy above 0.5 ({acc})", run)

    # Stopped after step 40 (mid-epoch), resumed: the uninterrupted run's weights.
    fp16 = [*common, "--strategy", "ddp", "--nproc-per-node", "2", "--device", "cuda",
            "--precision", "fp16"]
    cut = shoal(*fp16, "--checkpoint-dir", f"{tmp}/ckpt", "--checkpoint-every", "20",
                "--stop-after-steps", "40")
    check(cut.returncode == 0, "fp16 ddp: stopped after step 40", cut)
    resumed = shoal(*fp16, "--checkpoint-dir", f"{tmp}/ckpt", "--resume",
                    "--dump-parameters", f"{tmp}/resumed")
    check(resumed.returncode == 0, "fp16 ddp: --resume on the GPU", resumed)
    if resumed.returncode == 0 and os.path.exists(f"{tmp}/fp16_ddp.rank0.pt"):
        diff = max_relative(torch.load(f"{tmp}/fp16_ddp.rank0.pt"), torch.load(f"{tmp}/resumed.rank0.pt"))
        print(f"fp16 ddp resumed vs uninterrupted: {diff:.2e} relative")
        check(diff <= 1e-6, f"fp16 ddp resumed: the uninterrupted run's weights ({diff:.2e})")
    saved = sorted(os.path.join(d, f) for d, _, fs in os.walk(f"{tmp}/ckpt") for f in fs
                   if f.endswith(".pt"))
    check(bool(saved), "fp16 ddp: checkpoints were written")
    if saved:
        state = torch.load(saved[-1])  # no map_location: a CUDA tensor would load as one
        tensors = [v for v in state.get("model", state.get("state_dict", {})).values()
                   if isinstance(v, torch.Tensor)]
        check(bool(tensors) and all(t.device.type == "cpu" for t in tensors),
              "a checkpoint written on the GPU holds CPU tensors")
        check("grad_scaler.scale" in state.get("config", {}),
              "the checkpoint holds the loss scaler's state")
checks.finish()
