"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop, read top to bottom.
    python train.py config/t5_base.py                                    # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py  # 8 GPUs, the same batch
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py --model=t5-v1_1-xl --fsdp=True
    python train.py config/t5_tiny.py                                    # the CPU demo
"""
import errors  # first: from here on an error, or Ctrl-C, is one line, not a traceback
import os
import time

import torch

import checkpoint
import runtime
from data import Prefetcher, SpanCorruptionBatches, micro_batch_size, span_accuracy, unigram_baseline
from model import T5Config
from optim import LR_SCHEDULES, check_optimizer, get_lr, make_optimizer, param_groups, train_step
from prepare import MAX_VOCAB_SIZE, load_tokenizer
from runtime import print0

# -------------------------------------------------------------------------------------------------
# default config: nanoT5's T5-v1.1-base recipe on C4; config/*.py and --key=value override it
# paths and run
out_dir = "out"
data_dir = "data/c4"
init_from = "scratch"  # 'scratch', 'resume' (out_dir's run), or a run or HF weights to start from
# how data_dir was made, checked against its meta.json (pydoc, offline, is prepared on first use)
dataset = "c4"
tokenizer = "t5"
vocab_size = 32000  # only for tokenizer='train'
# model
model = "t5-v1_1-base"
dropout = 0.0  # nanoT5 pre-trains without dropout
# data and objective
input_length = 512
noise_density = 0.15
mean_noise_span_length = 3.0
# batch
batch_size = 128  # global examples per optimizer step, over all micro-steps and ranks
grad_accum_steps = 1
# steps
max_steps = 65536
time_budget_hours = 0.0  # > 0: the schedule and the stop follow training time (Cramming)
# optimizer and schedule
optimizer = "adamwscale"
lr = 2e-2
lr_schedule = "cosine"
warmup_steps = 10000
warmup_start_factor = 0.5
min_lr = 1e-5
weight_decay = 0.0
grad_clip = 1.0
# intervals
eval_interval = 1000
eval_steps = 20
log_interval = 10
checkpoint_interval = 1000
# system
device = "auto"  # cuda > mps > cpu
dtype = "bfloat16"
compile = True
activation_checkpointing = False  # keep only each block's input for backward, which runs it again
fsdp = False  # under torchrun: shard weights, gradients and optimizer state (FSDP2) instead of DDP
seed = 1337
peak_flops = 0.0  # dense peak FLOP/s of one GPU, for MFU; 0 -> runtime.PEAK_FLOPS
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = "t5"
# the values each key may take, checked before anything runs: a bound, an interval, choices, a rule
valid = dict(
    out_dir="folder", data_dir="folder", init_from=checkpoint.check_init_from,
    dataset="non-empty", tokenizer="non-empty", vocab_size=f"in [1, {MAX_VOCAB_SIZE}]",
    model=T5Config.from_preset, dropout="in [0, 1)",
    input_length=">= 3", noise_density="in (0, 1)", mean_noise_span_length=">= 1",
    batch_size="> 0", grad_accum_steps="> 0",
    max_steps="> 0", time_budget_hours=">= 0",
    optimizer=check_optimizer, lr="> 0", lr_schedule=LR_SCHEDULES, warmup_steps=">= 0",
    warmup_start_factor="in [0, 1]", min_lr=">= 0", weight_decay=">= 0", grad_clip=">= 0",
    eval_interval="> 0", eval_steps="> 0", log_interval="> 0", checkpoint_interval="> 0",
    device=runtime.check_device, dtype=runtime.DTYPES, compile="any", activation_checkpointing="any",
    fsdp=runtime.check_fsdp, seed=">= 0", peak_flops=">= 0", wandb_log=runtime.check_wandb,
    wandb_project="non-empty", wandb_run_name="any",
)
# the command line: config files, then --key=value, each checked against valid; then `config` holds
# every key's value and `given_at` where on the command line each given key was
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -------------------------------------------------------------------------------------------------

# start-up: every check before any work
rt = runtime.setup_runtime(device, dtype, seed)
micro_batch = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)
meta = checkpoint.open_data_dir(config, given_at, rt)  # the data, prepared, as the keys describe it
tok = load_tokenizer(meta)
ckpt_path = os.path.join(out_dir, "ckpt" if fsdp else "ckpt.pt")  # FSDP: a folder of shards
ckpt = checkpoint.open_out_dir(ckpt_path, config, meta, rt)  # out_dir is ours; resume: its checkpoint

# the model: from scratch, or from weights: this run's checkpoint, or other weights (a run's, HF's)
if init_from == "scratch":
    weights = T5Config.from_preset(model, vocab_size=meta["model_vocab_size"], dropout=dropout)
else:
    weights = ckpt if ckpt is not None else init_from
# on the device: sharded, compiled, in DDP as configured; dropout ours (Hugging Face's configs say 0.1)
t5, _ = checkpoint.start_model(weights, rt, fsdp, compile, activation_checkpointing=activation_checkpointing,
                               dropout=dropout)
raw_t5 = runtime.raw_model(t5)  # the T5 inside DDP and torch.compile: its config, generate, weights
print0(f"{raw_t5.num_params() / 1e6:.1f}M parameters")
opt = make_optimizer(optimizer, param_groups(raw_t5, weight_decay), lr)
# resuming, the optimizer state and the RNG; the steps done, and the training seconds (for a budget)
step, elapsed = checkpoint.restore_state(ckpt, t5, opt)
ckpt = None  # free the checkpoint's copy of the weights

# span-corrupted batches: step k's global batch is a function of (seed, k); a rank builds its slice
span_corruption = dict(batch_size=batch_size, input_length=input_length, noise_density=noise_density,
                       mean_noise_span_length=mean_noise_span_length, seed=seed,
                       vocab_size=raw_t5.config.vocab_size)
train_data = SpanCorruptionBatches(data_dir, "train", **span_corruption)
val_data = SpanCorruptionBatches(data_dir, "val", **span_corruption)
train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank, rt.world_size, rt.device)
tokens_per_step = batch_size * (input_length + train_data.targets_length)
step_flops = runtime.flops_per_step(raw_t5, batch_size, input_length, train_data.targets_length)
print0(f"{batch_size} examples x ({input_length} input + {train_data.targets_length} target) tokens = "
       f"{tokens_per_step:,} tokens/step, {micro_batch} per micro-step on each of {rt.world_size} rank(s)")
# the span accuracy of a model that ignores its input
common_fill, span_baseline = unigram_baseline(train_data, val_data, eval_steps)
print0(f"span accuracy baseline {span_baseline:.4f}: always writing the commonest fill, "
       f"{tok.decode(common_fill)!r} (ids {list(common_fill)})")
# two held-out examples every evaluation shows filled in: the first two windows of val.bin
demo_inputs, demo_labels = (t[:2] for t in val_data.get(0, device=rt.device))
demo_tokens = max(tok.shown_length(labels) for labels in demo_labels.tolist())  # what they need
logger = runtime.Logger(out_dir, rt.master, resume_step=step if init_from == "resume" else None, config=config)
peak = rt.peak_flops(peak_flops)

@torch.no_grad()
def evaluate():
    """On the fixed val batches: val_loss, val_acc (next token), span_acc; the examples filled in"""
    t5.eval()
    sums = {name: torch.zeros((), device=rt.device) for name in ("loss", "accuracy", "spans_right", "spans")}
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps, rt.rank, rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = t5(input_ids, labels=labels)
            spans_right, spans = span_accuracy(logits, labels, meta["first_sentinel_id"])
            sums["loss"] += loss.float()
            sums["accuracy"] += (logits.argmax(-1) == labels).float().mean()
            sums["spans_right"] += spans_right
            sums["spans"] += spans
    if rt.ddp:  # the sums over the ranks, in one all-reduce
        summed = torch.stack(list(sums.values()))
        torch.distributed.all_reduce(summed)
        sums = dict(zip(sums, summed))
    with rt.autocast():  # every rank decodes all steps (FSDP gathers each block on all ranks), rank 0 shows
        fills = raw_t5.generate(demo_inputs, max_new_tokens=demo_tokens, all_steps=fsdp)
    t5.train()
    batches = eval_steps * grad_accum_steps * rt.world_size
    return dict(val_loss=sums["loss"].item() / batches, val_acc=sums["accuracy"].item() / batches,
                span_acc=(sums["spans_right"] / sums["spans"]).item(),
                examples=[tok.show_fill(*ids) for ids in zip(demo_inputs.cpu(), fills.cpu(), demo_labels.cpu())])

# the loop. The ranks agree at sync points only (the log and checkpoint steps, the first and the
# last): there a signal or a spent time budget stops them together, and a NaN ends the run unsaved
sync = runtime.Sync(rt, ckpt_path, step, elapsed, time_budget_hours * 3600)
t5.train()
start_step = step
t_log = time.time()
steps_since_log = 0
last_step = False
while not last_step:
    # the schedule's progress: the share of the run done, in steps of max_steps. Without a time
    # budget this step's number; under one, the training time spent, as a share of the budget
    progress = sync.clock(step) / sync.budget_s * max_steps if sync.budget_s else step + 1
    lr_now = get_lr(progress, max_steps, lr_schedule, lr, warmup_steps, warmup_start_factor, min_lr)
    micro_batches = train_batches.get(step)  # this rank's share of the step's batch
    loss, grad_norm = train_step(t5, opt, micro_batches, lr_now, grad_clip, rt.autocast)
    step += 1
    steps_since_log += 1
    sync.watch(loss, grad_norm)  # NaN or inf noted on the device, without waiting for it
    if step == start_step + 1:  # the optimizer state exists from the first step on
        runtime.print_memory(t5, opt, rt)

    stop = False
    sync_step = step % log_interval == 0 or step % checkpoint_interval == 0 or step in (start_step + 1, max_steps)
    if sync_step:
        loss, stop = sync.agree(step, loss)  # one all-reduce: the mean loss, and whether to stop
        dt = (time.time() - t_log) / steps_since_log
        t_log = time.time()
        steps_since_log = 0
        mfu_now = runtime.mfu(step_flops, dt, rt.world_size, peak)
        eta_s = sync.budget_s - sync.elapsed if sync.budget_s else (max_steps - step) * dt
        logger.log({"step": step, "loss": loss, "lr": lr_now, "grad_norm": grad_norm.item(),
                    "ms_per_step": 1000 * dt, "tokens_per_s": tokens_per_step / dt, "mfu": mfu_now,
                    "elapsed": sync.elapsed})
        mfu_text = f" | mfu {100 * mfu_now:.1f}%" if mfu_now else ""
        print0(f"step {step:6d} | loss {loss:.4f} | lr {lr_now:.2e} | grad norm {grad_norm.item():.3f} | "
               f"{1000 * dt:.0f} ms/step | {tokens_per_step / dt:,.0f} tok/s{mfu_text} | "
               f"eta {eta_s / 3600:.2f} h")
    last_step = step == max_steps or stop
    if step % checkpoint_interval == 0 or last_step:
        with sync.paused():
            checkpoint.save_checkpoint(ckpt_path, checkpoint.checkpoint_state(t5, opt, step, sync.elapsed,
                                                                             config, meta))
    if step % eval_interval == 0 or step == max_steps:
        with sync.paused():
            metrics = evaluate()
        logger.log({"step": step, **metrics, "span_baseline": span_baseline})
        print0(f"step {step:6d} | val loss {metrics['val_loss']:.4f} | val acc {metrics['val_acc']:.4f} | "
               f"span acc {metrics['span_acc']:.4f} (baseline {span_baseline:.4f})")
        for ex in metrics["examples"]:
            print0(f"    input: {ex['input']}\n    model: {ex['model']}\n    truth: {ex['truth']}")
sync.release()
train_batches.close()
print0(f"{step} steps in {sync.elapsed / 3600:.2f} h; checkpoint in {ckpt_path}")
if rt.ddp:
    torch.distributed.destroy_process_group()
