"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop,
read top to bottom.
    python train.py config/t5_base.py           # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py
    python train.py config/t5_tiny.py           # the CPU demo
A one-GPU reader passes over the lines under `if rt.torchrun:` and `if
fsdp:`: they call distributed.py, where many GPUs train as one.
"""
import math
import os
import time

import torch

import checkpoint
import distributed
import runtime
from data import (Prefetcher, ShardCheck, SpanCorruptionBatches,
                  span_accuracy, unigram_baseline)
from model import PRESETS, T5, T5Config
from optim import OPTIMIZERS, TimeBudget, get_lr, make_optimizer, param_groups
from prepare import RECIPES, load_meta, load_tokenizer, prepare
from runtime import print0

# -----------------------------------------------------------------------------
# default config: nanoT5's T5-v1.1-base recipe on C4; config/*.py and
# --key=value override it
out_dir = "out"
data_dir = "data/c4"  # prepare.py's folder
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

# 1. start-up, before any work: the device; out_dir, locked; what the run
# starts from, found before the data, so that a resume whose data is gone
# names it
rt = runtime.setup_runtime(device, dtype, seed, fsdp)
if rt.torchrun:  # the ranks' process group
    distributed.join(rt)
lock = runtime.lock_folder(out_dir)  # one live run per out_dir
# a resume keeps these: its weights and optimizer state were made so
kept_on_resume = ("model", "dropout", "optimizer", "weight_decay")
resuming, ckpt = checkpoint.start_from(init_from, out_dir, "train.py",
                                       config, kept_on_resume, model, fsdp)
budget_s = time_budget_hours * 3600
if resuming and (ckpt["step"] >= max_steps
                 or 0 < budget_s <= ckpt["elapsed"]):
    key = "max_steps" if ckpt["step"] >= max_steps else "time_budget_hours"
    done = f"{out_dir} is at step {ckpt['step']} of {key}={config[key]}"
    if init_from == "auto":  # finished: a requeue ends here, changing nothing
        print0(f"{done}: the run is finished")
        raise SystemExit(0)
    raise SystemExit(f"error: {done}: raise {key} to train it further")

# 2. the data; a folder named pydoc is the CPU demo's, Python's own
# documentation, prepared here on first use (offline, in seconds)
if os.path.basename(os.path.normpath(data_dir)) == "pydoc":
    if rt.master and not os.path.exists(f"{data_dir}/meta.json"):
        prepare(**RECIPES["pydoc"], out_dir=data_dir)
    if rt.torchrun:  # the others wait for it
        torch.distributed.barrier()
meta = load_meta(data_dir, ckpt and ckpt["meta"])
tok = load_tokenizer(meta)
checkpoint.check_data(ckpt, meta, resuming)
# step k's batch is a function of (seed, k): each rank builds its rows
corruption = (batch_size, input_length, noise_density,
              mean_noise_span_length, seed)
train_data = SpanCorruptionBatches(data_dir, "train", *corruption)
val_data = SpanCorruptionBatches(data_dir, "val", *corruption)
most = max(1, val_data.num_windows // batch_size)  # each val window once
check_config(config, [("eval_steps", eval_steps <= most,
                       f"<= {most}: {data_dir}/val.bin holds "
                       f"{val_data.num_windows:,} windows of this run")])
shard_check = ShardCheck(train_data, val_data)  # what start-up did not hash
train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank,
                           rt.world_size, rt.device)  # or the batch won't split

# 3. the model: T5(config) on the device draws its weights, which a
# checkpoint's replace; under FSDP each rank keeps only its own slices
if ckpt:  # with our dropout: HF's configs say 0.1
    t5_config = T5Config(**{**ckpt["model_config"], "dropout": dropout})
else:  # T5 starts decoding with pad
    t5_config = T5Config.from_preset(
        model, vocab_size=meta["model_vocab_size"], dropout=dropout,
        eos_token_id=meta["eos_id"], pad_token_id=meta["pad_id"],
        decoder_start_token_id=meta["pad_id"])
if fsdp:
    t5 = distributed.sharded_t5(t5_config, rt, compile,
                                activation_checkpointing, shard_across_nodes)
else:
    with torch.device(rt.device):
        t5 = T5(t5_config)
    if activation_checkpointing:
        runtime.checkpoint_activations(t5)
if ckpt:
    checkpoint.load_weights(t5, ckpt)
print0(f"{t5.num_params() / 1e6:.1f}M parameters")
train_t5 = t5  # what the loop calls: compiled, and under DDP wrapped
if compile and not fsdp:  # FSDP compiled each block
    train_t5 = torch.compile(t5)
if rt.torchrun and not fsdp:  # DDP all-reduces the gradients
    train_t5 = distributed.ddp(train_t5, rt)
opt = make_optimizer(optimizer, param_groups(t5, weight_decay), lr)
if fsdp:  # AdamWScale on each rank's slices
    opt = distributed.shard_optimizer(opt)
step, elapsed = (checkpoint.restore_state(ckpt, t5, opt) if resuming
                 else (0, 0.0))
wandb_id = ckpt.get("wandb_id") if resuming else None  # its wandb run goes on
ckpt = None  # free the checkpoint's copy of the weights

# 4. what the loop reads and writes around the step
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
# what checkpoints hold besides the weights and optimizer state
run_record = dict(identity, meta=meta, tokenizer=tok.data, wandb_id=wandb_id)

@torch.no_grad()
def evaluate():
    """val_loss, val_acc (next token) and span_acc on the fixed val
    batches, and the examples filled in"""
    train_t5.eval()
    sums = torch.zeros(4, device=rt.device)
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps,
                                             rt.rank, rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = train_t5(input_ids, labels=labels)
            accuracy = (logits.argmax(-1) == labels).float().mean()
            spans = span_accuracy(logits, labels, meta["first_sentinel_id"])
            sums += torch.stack([loss.float(), accuracy, *spans])
    loss, accuracy, spans_right, spans = rt.summed(sums)
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
        print0("\n".join(f"    {key}: {ex[key]}" for key in ex))

def log_step(loss, grad_norm, step_s):
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

# 5. the loop, one optimizer step at a time. Between sync steps (the
# first, each log, checkpoint and evaluation step, the last) the host
# never waits for the device; at one, all ranks decide alike
signals = runtime.Signals(rt)  # Ctrl-C, SIGTERM: save, then stop
if rt.torchrun:  # any rank's signal, for all at one step
    signal_flags = distributed.SignalFlags(rt)
# with a time budget, the schedule's position follows the clock
budget = TimeBudget(max_steps, budget_s, step, elapsed) if budget_s else None
max_norm = grad_clip or math.inf  # 0: measured, not clipped
nonfinite = 0  # steps with a NaN or inf loss or grad norm, on the device
start_step, synced_step, synced_elapsed = step, step, elapsed
intervals = (log_interval, checkpoint_interval, eval_interval)
clock = time.time()  # rank 0's counts the training seconds
last_step = False
while not last_step:
    lr_now = get_lr(budget.advance() if budget else step + 1, max_steps, lr,
                    warmup_steps, warmup_start_factor, min_lr)
    for group in opt.param_groups:
        group["lr"] = lr_now
    # forward and backward over this rank's micro-batches; clip; update
    train_loss = 0.0  # this rank's mean over its micro-batches
    for micro_step, batch in enumerate(train_batches.get(step)):
        if rt.torchrun:  # DDP: all-reduce after the last micro-step only
            distributed.sync_gradients(train_t5,
                                       micro_step == grad_accum_steps - 1)
        with rt.autocast():
            _, loss = train_t5(**batch)
        (loss / grad_accum_steps).backward()
        train_loss += loss.detach() / grad_accum_steps
    if fsdp:  # the norm of all ranks' slices
        grad_norm = distributed.clip_grad_norm(t5, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(t5.parameters(), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    nonfinite = nonfinite + ~torch.isfinite(train_loss + grad_norm)
    signals.step = step
    stop = signals.caught > 0
    if rt.torchrun:  # a signal on any rank, read two steps on
        stop = step < max_steps and signal_flags.any(signals.caught)
    last_step = step == max_steps or stop
    if step == start_step + 1:  # it compiled; the optimizer state exists
        runtime.print_memory(t5, opt, rt)
        if rt.torchrun:  # from here a hung rank times out sooner
            distributed.set_timeout(distributed.TRAIN_TIMEOUT)
    if not (last_step or step in (start_step + 1, budget and budget.next_check)
            or any(step % interval == 0 for interval in intervals)):
        continue
    # a sync step: in one all-reduce (one process: one read of the device),
    # the mean loss, rank 0's clock, and whether any rank saw a NaN or inf,
    # a signal, a damaged shard
    synced = time.time()
    loss, elapsed, nonfinite, signalled, damaged = rt.summed([
        train_loss / rt.world_size, (elapsed + synced - clock) * rt.master,
        nonfinite, signals.caught, len(shard_check.errors)])
    if nonfinite:  # before a save: the last checkpoint is good
        raise checkpoint.diverged(out_dir, step)
    if damaged:
        raise shard_check.error()
    last_step = last_step or signalled or 0 < budget_s <= elapsed
    step_s = (elapsed - synced_elapsed) / (step - synced_step)
    if budget and synced_step > start_step:  # not the compile's step
        budget.measure(step, elapsed, step_s)
    synced_step, synced_elapsed = step, elapsed
    log_step(loss, grad_norm, step_s)
    if step % checkpoint_interval == 0 or last_step:
        checkpoint.save_checkpoint(out_dir, t5, opt, step, elapsed,
                                   run_record)
    if (step % eval_interval == 0 or last_step) and not signalled:
        evaluate()
    clock = time.time()  # a save and an evaluation are not training time
signals.release()
train_batches.close()
if signalled:  # the save's time: what a launcher must wait for
    print0(f"stopped by signal at step {step}, saved in "
           f"{clock - synced:.1f} s: continue with --init_from=resume")
print0(f"{step} steps in {elapsed / 3600:.2f} h; checkpoint in {out_dir}")
if rt.torchrun:
    torch.distributed.destroy_process_group()
if signals.caught:  # exits as a process the signal ended: `&&` stops there
    raise SystemExit(128 + signals.caught)
