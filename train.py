"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop,
read top to bottom.
    python train.py config/t5_base.py           # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py
    python train.py config/t5_tiny.py           # the CPU demo
The ranks' side of it (DDP, FSDP, agreeing, signals) is distributed.py's.
"""
import dataclasses
import os
import time

import torch

import checkpoint
import distributed
import runtime
from data import (Prefetcher, SpanCorruptionBatches, ShardCheck,
                  micro_batch_size, span_accuracy, unigram_baseline)
from model import PRESETS, T5, T5Config
from optim import OPTIMIZERS, Pace, get_lr, make_optimizer, param_groups
from prepare import RECIPES, load_meta, load_tokenizer, prepare
from runtime import print0

# -----------------------------------------------------------------------------
# default config: nanoT5's T5-v1.1-base recipe on C4; config/*.py and
# --key=value override it
out_dir = "out"
data_dir = "data/c4"  # prepare.py's folder (data/pydoc is made on first use)
# 'scratch', 'resume' (out_dir's run), 'auto' (either), a run, HF weights
init_from = "scratch"
model = "t5-v1_1-base"
dropout = 0.0  # nanoT5 pre-trains without dropout
# data and objective
input_length = 512
noise_density = 0.15
mean_noise_span_length = 3.0
batch_size = 128  # examples per optimizer step, over micro-steps and ranks
grad_accum_steps = 1
max_steps = 65536
time_budget_hours = 0.0  # > 0: schedule and stop follow the clock (Cramming)
# optimizer and schedule
optimizer = "adamwscale"
lr = 2e-2
warmup_steps = 10000
warmup_start_factor = 0.5
min_lr = 1e-5  # where the cosine ends; min_lr = lr: a constant lr
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
activation_checkpointing = False  # keep each block's input; backward reruns it
fsdp = False  # under torchrun: FSDP2 shards weights, grads, optimizer state
shard_across_nodes = False  # fsdp over nodes: shard in each, replicate across
seed = 1337
peak_flops = 0.0  # one GPU's dense peak FLOP/s, for MFU; 0: runtime.PEAK_FLOPS
# logging: log.jsonl always; wandb too, if asked for
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = ""  # '' -> out_dir's folder name
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "configurator.py")).read())
# values that would never end, fail obscurely or train silently wrong
check_config(config, [
    ("model", model in PRESETS, f"one of {', '.join(PRESETS)}"),
    ("optimizer", optimizer in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
    ("out_dir", out_dir and not os.path.isfile(out_dir), "a folder's path"),
    ("data_dir", not os.path.isfile(data_dir), "a folder's path"),
    ("noise_density", 0 < noise_density < 1, "in (0, 1)"),
    ("mean_noise_span_length", mean_noise_span_length >= 1, ">= 1"),
    ("input_length", input_length >= 3, ">= 3"),
    ("dropout", 0 <= dropout < 1, "in [0, 1)"),
    ("warmup_start_factor", 0 <= warmup_start_factor <= 1, "in [0, 1]"),
    ("seed", 0 <= seed < 2**32, "in [0, 2**32), as numpy takes it"),
    ("shard_across_nodes", fsdp or not shard_across_nodes,
     "False without fsdp=True"),
    ("min_lr", min_lr <= lr, f"<= lr ({lr}): the cosine decays to it"),
    ("warmup_steps", warmup_steps <= max_steps,
     f"<= max_steps ({max_steps}), the schedule's length"),
    runtime.wandb_rule(wandb_log),
    *[(key, config[key] >= 0, ">= 0") for key in (
        "grad_clip", "time_budget_hours", "min_lr", "warmup_steps",
        "weight_decay", "peak_flops")],
    *[(key, config[key] > 0, "> 0") for key in (
        "lr", "batch_size", "grad_accum_steps", "max_steps", "eval_interval",
        "eval_steps", "log_interval", "checkpoint_interval")],
])
# -----------------------------------------------------------------------------

# start-up, before any work: the device and the ranks; out_dir, held; what
# the run starts from, found before the data, so that a resume whose data
# folder is gone names its own; then the data
rt = runtime.setup_runtime(device, dtype, seed, fsdp)
distributed.join(rt)  # under torchrun: the ranks' process group
micro_batch_size(batch_size, grad_accum_steps, rt.world_size)  # or refused
lock = runtime.claim(out_dir)  # one live run per out_dir, until it ends
# its own newest checkpoint (resume), a run's or HF's weights, or nothing
# (scratch); auto: resume if there is a checkpoint, else scratch
fixed = ("model", "dropout", "optimizer", "weight_decay")
how, ckpt = checkpoint.start_from(init_from, out_dir, "train.py", config,
                                  fixed, model, fsdp)
budget_s = time_budget_hours * 3600
if how == "resume" and (ckpt["step"] >= max_steps
                        or 0 < budget_s <= ckpt["elapsed"]):
    key = "max_steps" if ckpt["step"] >= max_steps else "time_budget_hours"
    done = f"{out_dir} is at step {ckpt['step']} of {key}={config[key]}"
    if init_from == "auto":  # finished: a requeue ends here, changing nothing
        print0(f"{done}: the run is finished")
        raise SystemExit(0)
    raise SystemExit(f"error: {done}: raise {key} to train it further")
demo = os.path.basename(os.path.normpath(data_dir)) == "pydoc"  # offline
if demo and rt.master and not os.path.exists(f"{data_dir}/meta.json"):
    prepare(**RECIPES["pydoc"], out_dir=data_dir)
if rt.ddp:
    torch.distributed.barrier()
meta = load_meta(data_dir, ckpt and ckpt["meta"])
tok = load_tokenizer(meta)
checkpoint.check_data(ckpt, meta, how)
# span-corrupted batches: step k's global batch is a function of (seed, k);
# each rank builds its slice
corruption = (batch_size, input_length, noise_density,
              mean_noise_span_length, seed)
train_data = SpanCorruptionBatches(data_dir, "train", *corruption)
val_data = SpanCorruptionBatches(data_dir, "val", *corruption)
most = max(1, val_data.num_windows // batch_size)  # each val window once
check_config(config, [("eval_steps", eval_steps <= most,
                       f"<= {most}: {data_dir}/val.bin holds "
                       f"{val_data.num_windows:,} windows of this run")])
# the shards not checked at start-up: a sync step stops the run if one of
# them is not what meta.json records
shard_check = ShardCheck(train_data, val_data)

# the model: T5(config) on the meta device, shapes without memory; placed
# (sharded, compiled, in DDP), it gets its weights: a checkpoint's, or new
ids = dict(eos_token_id=meta["eos_id"], pad_token_id=meta["pad_id"],
           decoder_start_token_id=meta["pad_id"])  # T5 starts with pad
if ckpt:
    t5_config = T5Config(**ckpt["model_config"])
else:
    vocab_size = meta["model_vocab_size"]
    t5_config = T5Config.from_preset(model, vocab_size=vocab_size, **ids)
with torch.device("meta"):  # dropout ours: HF's configs say 0.1
    t5 = T5(dataclasses.replace(t5_config, dropout=dropout))
# what the loop calls: the T5 (FSDP shards it in place), or a wrapper
train_t5 = distributed.wrap_model(t5, rt, fsdp, compile,
                                  activation_checkpointing,
                                  shard_across_nodes)
if ckpt:
    checkpoint.load_weights(t5, ckpt)  # under FSDP, each rank its slices
else:
    distributed.draw_weights(t5)  # as one process draws them
print0(f"{t5.num_params() / 1e6:.1f}M parameters")
opt = make_optimizer(optimizer, param_groups(t5, weight_decay), lr)
if fsdp:  # AdamWScale on each rank's slices
    opt = distributed.shard_optimizer(opt)
resuming = how == "resume"
step, elapsed = (checkpoint.restore_state(ckpt, t5, opt) if resuming
                 else (0, 0.0))
wandb_id = ckpt.get("wandb_id") if resuming else None  # its wandb run goes on
ckpt = None  # free the checkpoint's copy of the weights

train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank,
                           rt.world_size, rt.device)
targets = train_data.targets_length
tokens_per_step = batch_size * (input_length + targets)
step_flops = runtime.flops_per_step(t5, batch_size, input_length, targets)
peak = rt.peak_flops(peak_flops)
fill, span_baseline = unigram_baseline(val_data, eval_steps)
print0(f"span accuracy baseline {span_baseline:.4f}: always writing the "
       f"commonest fill, {tok.decode(fill)!r}")
# two held-out examples each evaluation fills in: val.bin's first windows
examples, truths = (t[:2] for t in val_data.get(0, device=rt.device))
shown = max(tok.shown_length(labels) for labels in truths.tolist())
identity = dict(program="train.py", config=config)  # log.jsonl's first line
logger = runtime.Logger(out_dir, rt.master, step if resuming else None,
                        identity)
if wandb_log:
    wandb_id = logger.start_wandb(wandb_project, wandb_run_name, config,
                                  wandb_id)
# what checkpoints record besides the state
run = dict(identity, meta=meta, tokenizer=tok.data, wandb_id=wandb_id)

@torch.no_grad()
def evaluate():
    """val_loss, val_acc (next token) and span_acc on the fixed val
    batches, logged and printed with the examples filled in"""
    train_t5.eval()
    sums = torch.zeros(4, device=rt.device)  # loss, accuracy, spans right, spans
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps,
                                             rt.rank, rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = train_t5(input_ids, labels=labels)
            accuracy = (logits.argmax(-1) == labels).float().mean()
            spans = span_accuracy(logits, labels, meta["first_sentinel_id"])
            sums += torch.stack([loss.float(), accuracy,
                                 *(n.float() for n in spans)])
    loss, accuracy, spans_right, spans = distributed.summed(rt, sums)
    with rt.autocast():  # every rank decodes
        fills = t5.generate(examples, max_new_tokens=shown)
    train_t5.train()
    batches = eval_steps * grad_accum_steps * rt.world_size
    metrics = dict(val_loss=loss / batches, val_acc=accuracy / batches,
                   span_acc=spans_right / spans)
    filled = list(map(tok.show_fill, examples.cpu(), fills.cpu(),
                      truths.cpu()))
    logger.log({"step": step, **metrics, "examples": filled,
                "span_baseline": span_baseline})
    print0(f"step {step:6d} | val loss {metrics['val_loss']:.4f} | val acc "
           f"{metrics['val_acc']:.4f} | span acc {metrics['span_acc']:.4f} "
           f"(baseline {span_baseline:.4f})")
    for ex in filled:
        print0("\n".join(f"    {key}: {ex[key]}"
                         for key in ("input", "model", "truth")))

def log_step(loss, grad_norm, step_s):
    """a sync step's record and line: loss, lr, speed, MFU, time left"""
    mfu = runtime.mfu(step_flops, step_s, rt.world_size, peak)
    logger.log({"step": step, "loss": loss, "lr": lr_now,
                "grad_norm": grad_norm.item(), "ms_per_step": 1000 * step_s,
                "tokens_per_s": tokens_per_step / step_s, "mfu": mfu,
                "elapsed": elapsed})
    eta = budget_s - elapsed if budget_s else (max_steps - step) * step_s
    mfu = f" | mfu {100 * mfu:.1f}%" if mfu else ""
    print0(f"step {step:6d} | loss {loss:.4f} | lr {lr_now:.2e} | grad norm "
           f"{grad_norm:.3f} | {1000 * step_s:.0f} ms/step | "
           f"{tokens_per_step / step_s:,.0f} tok/s{mfu} | eta "
           f"{eta / 3600:.2f} h")

# the loop, one optimizer step at a time. The ranks take each decision at
# the same step: at sync steps (the first, each log, checkpoint and
# evaluation step, the last) they agree, in one all-reduce, on the mean
# loss, any NaN or inf since the last, any signal, and rank 0's clock; in
# between the host does not wait for the GPU
sync = distributed.Sync(rt)  # Ctrl-C, SIGTERM: all save and stop together
pace = Pace(max_steps, budget_s, step, elapsed)  # where the schedule is
start_step = step
intervals = (log_interval, checkpoint_interval, eval_interval)
clock = time.time()  # rank 0's counts the training seconds
last_step = False
while not last_step:
    lr_now = get_lr(pace.advance(), max_steps, lr, warmup_steps,
                    warmup_start_factor, min_lr)
    for group in opt.param_groups:
        group["lr"] = lr_now
    # forward and backward over this rank's micro-batches, the gradients
    # summed (DDP all-reduces them after the last one); clip; update
    train_loss = 0.0  # this rank's mean over its micro-batches
    for micro_step, batch in enumerate(train_batches.get(step)):
        last = micro_step == grad_accum_steps - 1
        distributed.sync_gradients(train_t5, last)
        with rt.autocast():
            _, loss = train_t5(**batch)
        (loss / grad_accum_steps).backward()
        train_loss += loss.detach() / grad_accum_steps
    grad_norm = distributed.clip_grad_norm(t5, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    # the last step, or a signal's: the same on every rank
    last_step = sync.step_done(step, train_loss, grad_norm, step == max_steps)
    if step == start_step + 1:  # it compiled; the optimizer state exists
        distributed.print_memory(t5, opt, rt)
        distributed.set_timeout(rt, distributed.TRAIN_TIMEOUT)
    # a sync step (also a time budget's, pace.check_step): the ranks agree;
    # then log, save, evaluate
    if not (last_step or step in (start_step + 1, pace.check_step) or
            any(step % interval == 0 for interval in intervals)):
        continue
    synced = time.time()
    agreed = sync.agree(train_loss, elapsed + synced - clock,
                        shard_check.errors)
    if agreed.diverged:  # before a save: the last checkpoint is good
        raise checkpoint.diverged(out_dir, step)
    if agreed.damaged:  # this rank's line, or that another found one
        raise (shard_check.errors or [SystemExit(
            f"error: another rank found a shard of {data_dir} that is not "
            f"what its meta.json records")])[0]
    elapsed = agreed.elapsed
    last_step = last_step or agreed.signalled or 0 < budget_s <= elapsed
    log_step(agreed.loss, grad_norm, pace.synced(step, elapsed))
    if step % checkpoint_interval == 0 or last_step:
        with distributed.patiently(rt):  # all wait for the slowest write
            checkpoint.save_checkpoint(out_dir, t5, opt, step, elapsed, run)
    if (step % eval_interval == 0 or last_step) and not agreed.signalled:
        evaluate()
    clock = time.time()  # a save and an evaluation are not training time
sync.release()
train_batches.close()
if agreed.signalled:  # the save's time: what a launcher must wait for
    print0(f"stopped by signal at step {step}, saved in "
           f"{clock - synced:.1f} s: continue with --init_from=resume")
print0(f"{step} steps in {elapsed / 3600:.2f} h; checkpoint in {out_dir}")
if rt.ddp:
    torch.distributed.destroy_process_group()
if sync.caught:  # as a process the signal ended: `train.py && export.py` stops
    raise SystemExit(128 + sync.caught)
