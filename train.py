"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop, read top to bottom.
    python train.py config/t5_base.py                                    # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py  # 8 GPUs, the same batch
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py --model=t5-v1_1-xl --fsdp=True
    python train.py config/t5_tiny.py                                    # the CPU demo
"""
import errors  # first: from here on an error, or Ctrl-C, is one line, not a traceback
import dataclasses
import math
import os
import time

import torch

import checkpoint
import runtime
from data import Prefetcher, SpanCorruptionBatches, micro_batch_size, span_accuracy, unigram_baseline
from model import T5, T5Config
from optim import LR_SCHEDULES, check_optimizer, get_lr, make_optimizer, param_groups
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
shard_across_nodes = False  # fsdp over nodes: False shards within each, replicates across (HSDP)
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
    fsdp="any", shard_across_nodes="any", seed=">= 0", peak_flops=">= 0",
    wandb_log=runtime.check_wandb, wandb_project="non-empty", wandb_run_name="any",
)
# the command line: config files, then --key=value, each checked against valid; then `config` holds
# every key's value and `given_at` where on the command line each given key was
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -------------------------------------------------------------------------------------------------

# start-up: every check before any work
rt = runtime.setup_runtime(device, dtype, seed, fsdp)
micro_batch = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)
meta = checkpoint.open_data_dir(config, given_at, rt)  # the data, prepared, as the keys describe it
tok = load_tokenizer(meta)
ckpt_path = os.path.join(out_dir, "ckpt" if fsdp else "ckpt.pt")  # FSDP: a folder of shards
resumed = checkpoint.open_out_dir(ckpt_path, config, meta, rt)  # out_dir ours; resume: its checkpoint

# the model: T5(config) on the meta device, its shapes with no memory yet; placed on the device
# (sharded, compiled, in DDP), it gets its weights: drawn fresh, or read from what it starts from
if init_from == "scratch":
    t5_config, weights = T5Config.from_preset(model, vocab_size=meta["model_vocab_size"]), None
else:  # this run's checkpoint, or the weights init_from names (a run's, Hugging Face's)
    t5_config, weights, _ = checkpoint.read_weights(resumed or init_from, fsdp, model)
with torch.device("meta"):
    t5 = T5(dataclasses.replace(t5_config, dropout=dropout))  # dropout ours: HF's configs say 0.1
# what the loop calls: the T5 itself (sharded in place), or its compiled or DDP wrapper
train_t5 = runtime.wrap_model(t5, rt, fsdp, compile, activation_checkpointing, shard_across_nodes)
if weights is None:
    runtime.draw_weights(t5)  # as one process on that device draws them, on any number of ranks
else:
    checkpoint.load_weights(t5, weights)  # under FSDP, each rank its own slices
print0(f"{t5.num_params() / 1e6:.1f}M parameters")
opt = make_optimizer(optimizer, param_groups(t5, weight_decay), lr, compile)
# resuming, the optimizer state and the RNG; the steps done, and the training seconds (for a budget)
step, elapsed = checkpoint.restore_state(resumed, t5, opt)
weights = resumed = None  # free the checkpoint's copy of the weights

# span-corrupted batches: step k's global batch is a function of (seed, k); a rank builds its slice
span_corruption = dict(batch_size=batch_size, input_length=input_length, noise_density=noise_density,
                       mean_noise_span_length=mean_noise_span_length, seed=seed,
                       vocab_size=t5.config.vocab_size)
train_data = SpanCorruptionBatches(data_dir, "train", **span_corruption)
val_data = SpanCorruptionBatches(data_dir, "val", **span_corruption)
train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank, rt.world_size, rt.device)
tokens_per_step = batch_size * (input_length + train_data.targets_length)
step_flops = runtime.flops_per_step(t5, batch_size, input_length, train_data.targets_length)
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
    train_t5.eval()
    sums = {name: torch.zeros((), device=rt.device) for name in ("loss", "accuracy", "spans_right", "spans")}
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps, rt.rank, rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = train_t5(input_ids, labels=labels)
            spans_right, spans = span_accuracy(logits, labels, meta["first_sentinel_id"])
            sums["loss"] += loss.float()
            sums["accuracy"] += (logits.argmax(-1) == labels).float().mean()
            sums["spans_right"] += spans_right
            sums["spans"] += spans
    if rt.ddp:  # the sums over the ranks, in one all-reduce
        summed = torch.stack(list(sums.values()))
        torch.distributed.all_reduce(summed)
        sums = dict(zip(sums, summed))
    with rt.autocast():  # every rank decodes (under FSDP each block is gathered on all), rank 0 shows
        fills = t5.generate(demo_inputs, max_new_tokens=demo_tokens)
    train_t5.train()
    batches = eval_steps * grad_accum_steps * rt.world_size
    return dict(val_loss=sums["loss"].item() / batches, val_acc=sums["accuracy"].item() / batches,
                span_acc=(sums["spans_right"] / sums["spans"]).item(),
                examples=[tok.show_fill(*ids) for ids in zip(demo_inputs.cpu(), fills.cpu(), demo_labels.cpu())])

# the loop, one optimizer step at a time. The ranks agree at sync steps (the log and checkpoint
# steps, the first and the last); in between, nothing waits for the GPU or another rank, and a
# signal's flag, summed over the ranks at every step, is read two steps on (sync.stop_now)
sync = runtime.Sync(rt, ckpt_path, step, elapsed)  # where they agree: signals, the clock, NaNs
budget_s = time_budget_hours * 3600
train_t5.train()
start_step = step
t_log = time.time()
steps_since_log = 0
last_step = False
while not last_step:
    # where the schedule is, in steps: this step's number; under a time budget, the share of the
    # budget spent by the last sync step, times max_steps (the same on every rank)
    schedule_step = sync.elapsed / budget_s * max_steps if budget_s else step + 1
    lr_now = get_lr(schedule_step, max_steps, lr_schedule, lr, warmup_steps, warmup_start_factor,
                    min_lr)
    for group in opt.param_groups:
        group["lr"].fill_(lr_now)  # in place: a compiled optimizer step does not compile again
    # forward and backward over this rank's micro-batches, the gradients summed; clip; update
    train_loss = 0.0  # this rank's: the mean over its micro-batches
    for micro_step, batch in enumerate(train_batches.get(step)):
        last_micro_step = micro_step == grad_accum_steps - 1
        if rt.ddp and not fsdp:  # DDP all-reduces the gradients once, after the last micro-step
            train_t5.require_backward_grad_sync = last_micro_step
        if fsdp:  # HSDP's all-reduce across nodes, likewise
            t5.set_requires_all_reduce(last_micro_step)
        with rt.autocast():
            _, loss = train_t5(**batch)
        (loss / grad_accum_steps).backward()  # FSDP reduce-scatters at each: gradients stay sharded
        train_loss += loss.detach() / grad_accum_steps
    grad_norm = torch.nn.utils.clip_grad_norm_(t5.parameters(), grad_clip or math.inf)
    if fsdp:
        grad_norm = grad_norm.full_tensor()  # the norm of all ranks' slices together
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    steps_since_log += 1
    sync.watch(train_loss, grad_norm)  # a NaN or inf, noted on the device without waiting for it
    if step == start_step + 1:  # the optimizer state exists from the first step on
        runtime.print_memory(t5, opt, rt)

    last_step = step == max_steps or sync.stop_now(step)  # Ctrl-C or SIGTERM: saved, then stopped
    sync_step = step % log_interval == 0 or step % checkpoint_interval == 0 or step == start_step + 1
    if sync_step or last_step:
        mean_loss, elapsed, signalled = sync.agree(step, train_loss)  # the same on every rank
        last_step = last_step or signalled or 0 < budget_s <= elapsed
        dt = (time.time() - t_log) / steps_since_log
        t_log = time.time()
        steps_since_log = 0
        mfu_now = runtime.mfu(step_flops, dt, rt.world_size, peak)
        eta_s = budget_s - elapsed if budget_s else (max_steps - step) * dt
        logger.log({"step": step, "loss": mean_loss, "lr": lr_now, "grad_norm": grad_norm.item(),
                    "ms_per_step": 1000 * dt, "tokens_per_s": tokens_per_step / dt, "mfu": mfu_now,
                    "elapsed": elapsed})
        mfu_text = f" | mfu {100 * mfu_now:.1f}%" if mfu_now else ""
        print0(f"step {step:6d} | loss {mean_loss:.4f} | lr {lr_now:.2e} | "
               f"grad norm {grad_norm.item():.3f} | {1000 * dt:.0f} ms/step | "
               f"{tokens_per_step / dt:,.0f} tok/s{mfu_text} | eta {eta_s / 3600:.2f} h")
    if step % checkpoint_interval == 0 or last_step:
        with sync.paused():
            state = checkpoint.run_state(t5, opt, step, sync.elapsed, config, meta)
            checkpoint.save_checkpoint(ckpt_path, state)
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
