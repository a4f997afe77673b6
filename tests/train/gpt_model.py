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
  pipeline    --stages 2 (the tied wte on both stages, gradients summed): 50 AdamW steps equal
              one process's loop, also stopped mid-epoch and resumed; --micro-batches 2 weighted
              by their counted targets (SGD, --clip-grad-norm) equal whole batches, alone and
              with 2 replicas (4 processes) against PyTorch's DDP on 2 ranks
  token files --data train.bin --val-data val.bin (uint16, nanoGPT's files): 2 epochs of blocks
              dealt as ExactlyOnceSampler does (each block once, ranks' shares cut to equal
              counts) equal PyTorch's loop on the same blocks in the same order, single and ddp
              2 ranks; the validation loss and its perplexity are reported; a run stopped
              mid-epoch (--checkpoint-every) and resumed continues with the next unseen block:
              its weights equal the uninterrupted run's, and resumed by 3 ranks instead, the
              rest of the epoch dealt over 3, a loop that does so; a file of an odd size or with an id
              beyond --vocab-size is refused in one line
  bad input   sizes that cannot work (--n-embd not a multiple of --n-head), a token id beyond
              --vocab-size, no --data: one line each

    gpt_model.py SHOAL_BINARY
"""
import array
import glob
import math
import os
import shutil
import subprocess
import sys
import tempfile

from test_script_support import average_gradients, relative, run_shoal, start_oracle, state_matches

SHOAL, torch, checks = start_oracle("gpt_model")
check = checks.check

N_LAYER, N_HEAD, N_EMBD, BLOCK, VOCAB = 2, 2, 32, 16, 64


# nanoGPT's GPT, the one `shoal bench ddp --model gpt` races; LayerNorm weights start at 1 plus a
# little noise, so that a wrong name or order shows.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gpt_torch  # noqa: E402


def GPT():
    return gpt_torch.GPT(N_LAYER, N_HEAD, N_EMBD, BLOCK, VOCAB, layer_norm_noise=0.1)


# Weights to 1e-5 relative. Adam's eps is 1e-3, not its default 1e-8: the attention's key biases
# get gradients that are zero up to rounding (a query's softmax ignores what it adds to every
# score), which eps 1e-8 turns into steps of +-lr following the rounding's sign, so that another
# BLAS or thread count moves the weights 4e-4 apart though both updates are right.
WEIGHT_TOLERANCE = 1e-5


SEED, LR, EPS = 7, 3e-3, 1e-3
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
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)


def copy_of(model):
    fresh = GPT()
    fresh.load_state_dict(model.state_dict())
    return fresh


def compare(run, reference, dump, what):
    state = state_matches(check, run, reference.state_dict(), dump, what, tolerance=WEIGHT_TOLERANCE)
    if state is None:
        return
    check(state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr() or
          torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]),
          f"{what}: lm_head.weight is transformer.wte.weight")
    GPT().load_state_dict(state)


with tempfile.TemporaryDirectory() as tmp:
    data = os.path.join(tmp, "tokens.pt")
    torch.save({"train_x": x, "train_y": y, "test_x": xt, "test_y": yt}, data)
    init = os.path.join(tmp, "init.pt")
    torch.save(initial.state_dict(), init)
    common = ["--model", "gpt", "--n-layer", str(N_LAYER), "--n-head", str(N_HEAD), "--n-embd",
              str(N_EMBD), "--block-size", str(BLOCK), "--vocab-size", str(VOCAB), "--data", data,
              "--init-from", init, "--optimizer", "adamw", "--weight-decay", "0.1", "--lr", str(LR), "--eps", str(EPS),
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

    def simulate_ddp(make):
        """Rank 0's model and optimizer after 12 steps of PyTorch's DDP on 2 ranks of 4."""
        ranks = [copy_of(initial) for _ in range(2)]
        opts = [make(m) for m in ranks]
        for step in range(12):
            for r in range(2):
                idx = shards[r][step * 4:(step + 1) * 4]
                opts[r].zero_grad()
                ranks[r](x[idx], y[idx]).backward()
            average_gradients(ranks)
            for o in opts:
                o.step()
        return ranks[0], opts[0]

    for strategy, optimizer, make in (("ddp", "adamw", adamw), ("fsdp", "adam", adam)):
        model, _ = simulate_ddp(make)
        dump = os.path.join(tmp, strategy)
        args = [a if a != "adamw" else optimizer for a in common]
        run = run_shoal(SHOAL, "train", *args, "--strategy", strategy, "--nproc-per-node", "2",
                        "--batch-size", "4", "--dump-parameters", dump)
        compare(run, model, dump, f"{strategy}, 2 ranks, {optimizer}")

    # --- pipeline, 2 stages: the embeddings and block 0 | block 1, ln_f and the head. The tied
    # wte is one copy per stage, their gradients summed after each backward (Megatron's way).
    # 50 AdamW steps (5 epochs of 10 batches of 8 of --train-samples 80) equal one process's
    # loop; a run stopped mid-epoch resumes to the same weights. In 2 micro-batches, weighted by
    # their counted targets (y[0] ignores 3 positions), the loss is the whole batch's mean: with
    # SGD (Adam turns the micro-batches' float32 rounding in the key biases' gradient, zero but
    # for rounding, into steps of random sign) and --clip-grad-norm (the global norm counts the
    # tied gradient once), alone and with 2 replicas of the pipeline (4 processes, DDP per stage)
    # against PyTorch's DDP on 2 ranks.
    LIMIT, EPOCHS = 80, 5
    sgd_common = [a if a != "adamw" else "sgd" for a in common]
    sgd_common[sgd_common.index("--lr") + 1] = "0.5"
    sgd_common += ["--clip-grad-norm", "0.1"]

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)

    def pipeline_reference(replicas, make, clip=None):
        ranks = [copy_of(initial) for _ in range(replicas)]
        opts = [make(m) for m in ranks]
        batch = 8 // replicas
        for epoch in range(EPOCHS):
            shares = []
            for r in range(replicas):
                sampler = torch.utils.data.DistributedSampler(
                    range(LIMIT), num_replicas=replicas, rank=r, shuffle=True, seed=SEED)
                sampler.set_epoch(epoch)
                shares.append(torch.tensor(list(sampler)))
            for begin in range(0, len(shares[0]), batch):
                for r in range(replicas):
                    idx = shares[r][begin:begin + batch]
                    opts[r].zero_grad()
                    ranks[r](x[idx], y[idx]).backward()
                for ps in zip(*(m.parameters() for m in ranks)):
                    mean = sum(p.grad for p in ps) / replicas
                    for p in ps:
                        p.grad.copy_(mean)
                if clip:
                    for m in ranks:
                        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                for o in opts:
                    o.step()
        return ranks[0]

    def pipeline_args(args, replicas, micro_batches):
        return args + ["--strategy", "pipeline", "--stages", "2", "--replicas", str(replicas),
                       "--micro-batches", str(micro_batches), "--train-samples", str(LIMIT),
                       "--epochs", str(EPOCHS), "--batch-size", str(8 // replicas)]

    for replicas, micro_batches, optimizer in ((1, 1, "adamw"), (1, 2, "sgd"), (2, 2, "sgd")):
        what = (f"pipeline, 2 stages x {replicas} replica{'s' if replicas > 1 else ''}, "
                f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''}, {optimizer}")
        reference = (pipeline_reference(replicas, adamw) if optimizer == "adamw" else
                     pipeline_reference(replicas, sgd, clip=0.1))
        args = pipeline_args(common if optimizer == "adamw" else sgd_common, replicas,
                             micro_batches)
        dump = os.path.join(tmp, f"pipeline{replicas}{micro_batches}")
        run = run_shoal(SHOAL, "train", *args, "--dump-parameters", dump)
        compare(run, reference, dump, what)
        if optimizer != "adamw":
            continue
        checkpoints = os.path.join(tmp, "pipeline_resume")
        first = run_shoal(SHOAL, "train", *args, "--checkpoint-dir", checkpoints,
                          "--checkpoint-every", "5", "--stop-after-steps", "25")
        check(first.returncode == 0, f"{what}: the run stopped after 25 steps exits 0", first)
        saved = sorted(glob.glob(os.path.join(checkpoints, "*.pt")))
        check(len(saved) >= 1, f"{what}: a checkpoint in {checkpoints}", first)
        if saved:
            model_state = torch.load(saved[-1])["model"]
            check(torch.equal(model_state["lm_head.weight"], model_state["transformer.wte.weight"]),
                  f"{what}: the checkpoint's lm_head.weight is its transformer.wte.weight")
            GPT().load_state_dict(model_state)
        resumed_args = [a for i, a in enumerate(args)
                        if a != "--init-from" and (i == 0 or args[i - 1] != "--init-from")]
        dump = os.path.join(tmp, "pipeline_resumed")
        run = run_shoal(SHOAL, "train", *resumed_args, "--checkpoint-dir", checkpoints, "--resume",
                        "--dump-parameters", dump)
        compare(run, reference, dump, f"{what}, stopped after 25 steps and resumed")

    # --- tensor parallelism: --mesh dp=2,tp=2, 4 ranks (heads, MLP and vocabulary split over
    # tp, DDP over dp) trains as ddp on 2 ranks does; its checkpoint is the whole model and the
    # whole momentum, as ddp's. With SGD: Adam's division by the gradient's size turns float32
    # rounding in the key biases' gradient (zero but for rounding) into steps of random sign.
    model, optimizer = simulate_ddp(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1))
    args = [a if a != "adamw" else "sgd" for a in common]
    args[args.index("--lr") + 1] = "0.5"
    dump = os.path.join(tmp, "mesh")
    mesh_checkpoints = os.path.join(tmp, "mesh_checkpoints")
    run = run_shoal(SHOAL, "train", *args, "--mesh", "dp=2,tp=2", "--batch-size", "4",
                    "--dump-parameters", dump, "--checkpoint-dir", mesh_checkpoints)
    compare(run, model, dump, "mesh dp=2,tp=2, sgd")
    saved = sorted(glob.glob(os.path.join(mesh_checkpoints, "*.pt")))
    check(len(saved) >= 1, f"mesh: a checkpoint in {mesh_checkpoints}", run)
    if saved:
        checkpoint = torch.load(saved[-1])
        GPT().load_state_dict(checkpoint["model"])
        worst = relative(checkpoint["model"]["transformer.h.0.attn.c_attn.weight"],
                         model.state_dict()["transformer.h.0.attn.c_attn.weight"])
        buffers = [s["momentum_buffer"] for _, s in sorted(checkpoint["optimizer"]["state"].items())]
        expected = [s["momentum_buffer"] for _, s in sorted(optimizer.state_dict()["state"].items())]
        check(worst <= WEIGHT_TOLERANCE and len(buffers) == len(expected) and
              all(a.shape == b.shape and relative(a, b) <= 1e-4 for a, b in zip(buffers, expected)),
              f"mesh: the checkpoint holds the whole model and momentum, DDP's ({worst:.3g})")
    # Stopped after 5 of the 12 steps and resumed under the same mesh: the whole momentum of the
    # checkpoint is cut back to each rank's pieces, so the run ends with DDP's weights.
    stopped = os.path.join(tmp, "mesh_stopped")
    first = run_shoal(SHOAL, "train", *args, "--mesh", "dp=2,tp=2", "--batch-size", "4",
                      "--checkpoint-dir", stopped, "--checkpoint-every", "5", "--stop-after-steps", "5")
    check(first.returncode == 0, "mesh: the run stopped after 5 steps exits 0", first)
    dump = os.path.join(tmp, "mesh_resumed")
    resumed = [a for i, a in enumerate(args) if "--init-from" not in (a, args[i - 1])]
    run = run_shoal(SHOAL, "train", *resumed, "--mesh", "dp=2,tp=2", "--batch-size", "4",
                    "--checkpoint-dir", stopped, "--resume", "--dump-parameters", dump)
    compare(run, model, dump, "mesh dp=2,tp=2, stopped after 5 steps and resumed")
    # --dropout with --mesh tp=2 trains (the masks drawn as Megatron's rule says, seeded from
    # --seed: test_tensor_parallel checks the rule and that a seed repeats), and drops: its
    # weights are not those of the same run without dropout.
    dumps = {}
    for dropout in ("0.1", "0"):
        dump = os.path.join(tmp, f"mesh_dropout{dropout}")
        run = run_shoal(SHOAL, "train", *args, "--mesh", "tp=2", "--batch-size", "4",
                        "--dropout", dropout, "--dump-parameters", dump)
        check(run.returncode == 0, f"mesh tp=2 --dropout {dropout}: shoal train exits 0", run)
        dumps[dropout] = torch.load(dump + ".rank0.pt") if run.returncode == 0 else None
    if all(d is not None for d in dumps.values()):
        key = "transformer.h.0.attn.c_attn.weight"
        check(all(torch.isfinite(v).all() for v in dumps["0.1"].values()) and
              relative(dumps["0.1"][key], dumps["0"][key]) > 1e-3,
              "mesh tp=2 --dropout 0.1: finite weights, not those of the run without dropout")

    # --- token files: blocks of BLOCK + 1 tokens at multiples of BLOCK, dealt each epoch as
    # ExactlyOnceSampler with drop_last: randperm(n) seeded with seed + epoch, rank r of W taking
    # order[consumed + r::W], the last (n - consumed) % W left out
    def write_tokens(path, ids, typecode="H"):
        with open(path, "wb") as f:
            array.array(typecode, ids).tofile(f)

    N_BLOCKS = 97  # odd: 2 ranks leave one block out per epoch
    train_tokens = tokens[: N_BLOCKS * BLOCK + 1 + 5]  # 5 tokens past the last block, unused
    val_tokens = tokens[-(20 * BLOCK + 1):]
    train_bin, val_bin = os.path.join(tmp, "train.bin"), os.path.join(tmp, "val.bin")
    write_tokens(train_bin, train_tokens.tolist())
    write_tokens(val_bin, val_tokens.tolist())

    def block_batch(stream, ids):
        xs = torch.stack([stream[i * BLOCK:i * BLOCK + BLOCK] for i in ids.tolist()])
        ys = torch.stack([stream[i * BLOCK + 1:i * BLOCK + BLOCK + 1] for i in ids.tolist()])
        return xs, ys

    def deal(epoch, r, world):
        order = torch.randperm(N_BLOCKS, generator=torch.Generator().manual_seed(SEED + epoch))
        return order[: N_BLOCKS - N_BLOCKS % world][r::world]

    def token_reference(world, batch, epochs=2):
        ranks = [copy_of(initial) for _ in range(world)]
        opts = [adamw(m) for m in ranks]
        for epoch in range(epochs):
            shares = [deal(epoch, r, world) for r in range(world)]
            for begin in range(0, len(shares[0]), batch):
                for r in range(world):
                    opts[r].zero_grad()
                    ranks[r](*block_batch(train_tokens, shares[r][begin:begin + batch])).backward()
                for ps in zip(*(m.parameters() for m in ranks)):
                    mean = sum(p.grad for p in ps) / world
                    for p in ps:
                        p.grad.copy_(mean)
                for o in opts:
                    o.step()
        return ranks[0]

    def token_reference_resumed(before, steps, after, batch, epochs=2):
        """`before` ranks train `steps` steps of the first epoch, then `after` ranks deal the rest
        of its order (the last (n - consumed) % after left out) and the later epochs."""
        model = copy_of(initial)
        opt = adamw(model)

        def ddp_step(batches):  # each rank's mean loss, gradients averaged over the ranks
            opt.zero_grad()
            (sum(model(*block_batch(train_tokens, ids)) for ids in batches) / len(batches)).backward()
            opt.step()

        shares = [deal(0, r, before) for r in range(before)]
        for begin in range(0, steps * batch, batch):
            ddp_step([share[begin:begin + batch] for share in shares])
        order = torch.randperm(N_BLOCKS, generator=torch.Generator().manual_seed(SEED))
        rest = order[steps * batch * before:]
        rest = rest[:len(rest) - len(rest) % after]
        for epoch in range(epochs):
            shares = [rest[r::after] for r in range(after)] if epoch == 0 else \
                [deal(epoch, r, after) for r in range(after)]
            for begin in range(0, len(shares[0]), batch):
                ddp_step([share[begin:begin + batch] for share in shares])
        return model

    token_common = [train_bin if a == data else a for a in common] + [
        "--val-data", val_bin, "--epochs", "2"]
    for world, batch in ((1, 8), (2, 4)):
        what = f"token files, {world} rank{'s' if world > 1 else ''}"
        reference = token_reference(world, batch)
        with torch.no_grad():
            val_loss = reference(*block_batch(val_tokens, torch.arange(20))).item()
        launch = ["--strategy", "ddp", "--nproc-per-node", "2"] if world > 1 else []
        dump = os.path.join(tmp, f"tokens{world}")
        metrics = dump + ".jsonl"
        run = run_shoal(SHOAL, "train", *token_common, *launch, "--batch-size", str(batch),
                        "--dump-parameters", dump, "--metrics", metrics)
        compare(run, reference, dump, what)
        line = [l for l in run.stdout.splitlines() if "final test loss" in l]
        check(len(line) == 1 and abs(float(line[0].split()[-1]) - val_loss) <= 1e-5 * val_loss,
              f"{what}: the validation loss {line} is PyTorch's {val_loss:.6g}", run)
        check(f"test perplexity {math.exp(val_loss):.4g}" in run.stdout,
              f"{what}: the epoch line reports the perplexity exp({val_loss:.4g})", run)
        if world == 1:
            continue
        # Stopped after 5 steps of epoch 1 (a checkpoint every 5 steps), then resumed: the same
        # weights as the uninterrupted run, so the resumed run took the next unseen blocks. The
        # same tokens as uint32 files here; the resumed run is given neither the GPT's sizes nor
        # the token width: it continues with the checkpoint's.
        train32, val32 = os.path.join(tmp, "train32.bin"), os.path.join(tmp, "val32.bin")
        check(array.array("I").itemsize == 4, "array's 'I' is 4 bytes here")
        write_tokens(train32, train_tokens.tolist(), "I")
        write_tokens(val32, val_tokens.tolist(), "I")
        common32 = [{train_bin: train32, val_bin: val32}.get(a, a) for a in token_common]
        checkpoints = os.path.join(tmp, f"resume{world}")
        first = run_shoal(SHOAL, "train", *common32, "--token-dtype", "uint32", *launch,
                          "--batch-size", str(batch), "--checkpoint-dir", checkpoints,
                          "--checkpoint-every", "5", "--stop-after-steps", "5")
        check(first.returncode == 0, f"{what}: the run stopped after 5 steps exits 0", first)
        checkpoints_copy = checkpoints + "_copy"
        shutil.copytree(checkpoints, checkpoints_copy)
        inherited = {"--init-from", "--n-layer", "--n-head", "--n-embd", "--block-size",
                     "--vocab-size"}
        resumed_args = [a for i, a in enumerate(common32)
                        if a not in inherited and (i == 0 or common32[i - 1] not in inherited)]
        dump = os.path.join(tmp, f"resumed{world}")
        run = run_shoal(SHOAL, "train", *resumed_args, *launch, "--batch-size", str(batch),
                        "--checkpoint-dir", checkpoints, "--resume", "--dump-parameters", dump)
        compare(run, reference, dump, f"{what}, stopped mid-epoch and resumed with the "
                "checkpoint's sizes and token width")
        # The same stopped run resumed by 3 ranks: the rest of epoch 1's order dealt over 3 (rank
        # r the r-th of each 3), then epoch 2 over 3; the weights equal that loop's.
        dump = os.path.join(tmp, f"resumed{world}to3")
        run = run_shoal(SHOAL, "train", *resumed_args, "--strategy", "ddp", "--nproc-per-node", "3",
                        "--batch-size", str(batch), "--checkpoint-dir", checkpoints_copy, "--resume",
                        "--dump-parameters", dump)
        compare(run, token_reference_resumed(world, 5, 3, batch), dump,
                f"{what}, stopped mid-epoch and resumed by 3 ranks")

    # --- bad input: one line each
    def refused(args, expect, what):
        run = run_shoal(SHOAL, "train", *args)
        lines = [l for l in run.stderr.splitlines() if l.strip()]
        check(0 < run.returncode < 126 and len(lines) == 1 and expect in lines[0],
              f"{what}: one line saying '{expect}'", run)

    refused(common + ["--n-head", "3"], "--n-embd must be a positive multiple of --n-head",
            "n_embd not a multiple of n_head")
    refused(common + ["--mesh", "dp=1,tp=4"], "tp=4 does not divide --n-head (2)",
            "a tensor-parallel degree that does not divide the heads")
    refused(common + ["--mesh", "dp=2,pp=2"], "dimension 'pp' is not supported",
            "a mesh dimension not supported yet")
    refused(common + ["--mesh", "tp=2", "--strategy", "fsdp"], "--mesh applies to --strategy ddp",
            "a mesh with fsdp")
    refused(common + ["--mesh", "dp=2,tp=2", "--strategy", "ddp", "--nproc-per-node", "3"],
            "--mesh dp=2,tp=2 runs 4 processes, but --nproc-per-node is 3",
            "a mesh whose ranks are not --nproc-per-node")
    run = run_shoal(SHOAL, "run", "--nproc-per-node", "2", SHOAL, "train", *common, "--mesh",
                    "dp=2,tp=2")
    check(run.returncode != 0 and "--mesh dp=2,tp=2 holds 4 ranks but the job has 2" in run.stderr,
          "a mesh whose ranks are not the job's is refused", run)
    big = os.path.join(tmp, "big.pt")
    torch.save({"train_x": x.clone().fill_(VOCAB), "train_y": y, "test_x": xt, "test_y": yt}, big)
    refused(common + ["--data", big], f"holds the token id {VOCAB}, but the vocabulary has {VOCAB}",
            "a token id beyond the vocabulary")
    refused(["--model", "gpt", "--no-progress"], "--model gpt trains on blocks of token ids",
            "gpt without --data")
    odd = os.path.join(tmp, "odd.bin")
    with open(odd, "wb") as f:
        f.write(bytes(2 * BLOCK + 3))
    refused(token_common + ["--data", odd], f"token file {odd} has {2 * BLOCK + 3} bytes, not a "
            "multiple of 2", "a token file of an odd size")
    beyond = os.path.join(tmp, "beyond.bin")
    write_tokens(beyond, [VOCAB + 1] * (4 * BLOCK + 1))
    refused(token_common + ["--data", beyond], f"is not below the vocabulary size {VOCAB}",
            "a token file with an id beyond --vocab-size")
    refused(token_common + ["--data", beyond], beyond, "a token file with an id beyond --vocab-size")
    refused(["--model", "mlp", "--data", train_bin, "--no-progress"],
            f"--data {train_bin} is a token file (.bin): it trains --model gpt, not --model mlp",
            "a token file for another model")
    refused(token_common + ["--data", data], f"--val-data {val_bin} needs --data TRAIN.bin",
            "--val-data beside a .pt --data")

checks.finish()
