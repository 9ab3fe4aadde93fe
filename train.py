"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop, read top to bottom.
    python train.py config/t5_base.py                                    # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py  # 8 GPUs, the same batch
    python train.py config/t5_tiny.py                                    # the CPU demo
"""
import dataclasses
import math
import os
import time

import torch

import checkpoint
import runtime
from data import Prefetcher, SpanCorruptionBatches, micro_batch_size, span_accuracy, unigram_baseline
from model import PRESETS, T5, T5Config
from optim import OPTIMIZERS, get_lr, make_optimizer, param_groups
from prepare import RECIPES, load_meta, load_tokenizer, prepare
from runtime import print0

# -------------------------------------------------------------------------------------------------
# default config: nanoT5's T5-v1.1-base recipe on C4; config/*.py and --key=value override it
out_dir = "out"
data_dir = "data/c4"  # a folder prepare.py made (data/pydoc, the demo's, is made on first use)
init_from = "scratch"  # 'scratch', 'resume' (out_dir's run), 'auto' (either), a run, HF weights
model = "t5-v1_1-base"
dropout = 0.0  # nanoT5 pre-trains without dropout
# data and objective
input_length = 512
noise_density = 0.15
mean_noise_span_length = 3.0
batch_size = 128  # global examples per optimizer step, over all micro-steps and ranks
grad_accum_steps = 1
max_steps = 65536
time_budget_hours = 0.0  # > 0: the schedule and the stop follow training time (Cramming)
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
activation_checkpointing = False  # keep only each block's input for backward, which runs it again
fsdp = False  # under torchrun: shard weights, gradients and optimizer state (FSDP2) instead of DDP
shard_across_nodes = False  # fsdp over nodes: False shards within each, replicates across (HSDP)
seed = 1337
peak_flops = 0.0  # dense peak FLOP/s of one GPU, for MFU; 0 -> runtime.PEAK_FLOPS
# logging: log.jsonl always; wandb too, if asked for
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = ""  # '' -> out_dir's folder name
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# the values that would never end, fail obscurely or train silently wrong: refused, a line each
runtime.check_config(config, [
    *[(key, globals()[key] in choices, f"one of {', '.join(choices)}") for key, choices in
      (("model", PRESETS), ("optimizer", OPTIMIZERS))],
    ("out_dir", out_dir and not os.path.isfile(out_dir), "a folder's path"),
    ("noise_density", 0 < noise_density < 1, "in (0, 1)"),
    ("mean_noise_span_length", mean_noise_span_length >= 1, ">= 1"),
    ("input_length", input_length >= 3, ">= 3"),
    ("dropout", 0 <= dropout < 1, "in [0, 1)"),
    ("warmup_start_factor", 0 <= warmup_start_factor <= 1, "in [0, 1]"),
    ("seed", 0 <= seed < 2**32, "in [0, 2**32), as numpy takes it"),
    ("shard_across_nodes", fsdp or not shard_across_nodes, "False without fsdp=True"),
    ("min_lr", min_lr <= lr, f"<= lr ({lr}): the cosine decays to it"),
    ("warmup_steps", warmup_steps <= max_steps, f"<= max_steps ({max_steps}), the schedule's length"),
    runtime.wandb_rule(wandb_log),
    *[(key, globals()[key] >= 0, ">= 0") for key in ("grad_clip", "time_budget_hours", "min_lr",
                                                     "warmup_steps", "weight_decay", "peak_flops")],
    *[(key, globals()[key] > 0, "> 0") for key in ("lr", "batch_size", "grad_accum_steps",
      "max_steps", "eval_interval", "eval_steps", "log_interval", "checkpoint_interval")],
])
# -------------------------------------------------------------------------------------------------

# start-up, before any work: the device and the ranks; out_dir, locked; what the run starts from,
# found before the data, so that a resume whose data folder is gone names its own; the data
rt = runtime.setup_runtime(device, dtype, seed, fsdp)
micro_batch_size(batch_size, grad_accum_steps, rt.world_size)  # refused if it won't split
lock = runtime.claim(out_dir)  # one live run per out_dir: held by rank 0 until it ends
# its own newest checkpoint (resume), a run's or Hugging Face's weights (of the data's tokenizer),
# or nothing (scratch); auto: resume if there is a checkpoint, else scratch
how, ckpt = checkpoint.start_from(init_from, out_dir, "train.py", config,
                                  ("model", "dropout", "optimizer", "weight_decay"), model, fsdp)
budget_s = time_budget_hours * 3600
if how == "resume" and (ckpt["step"] >= max_steps or 0 < budget_s <= ckpt["elapsed"]):
    key = "max_steps" if ckpt["step"] >= max_steps else "time_budget_hours"
    done = f"{out_dir} is at step {ckpt['step']} of {key}={config[key]}"
    if init_from == "auto":  # finished: a requeue ends here, and changes no file
        print0(f"{done}: the run is finished")
        raise SystemExit(0)
    raise SystemExit(f"error: {done}: raise {key} to train it further")
demo_data = os.path.basename(os.path.normpath(data_dir)) == "pydoc"  # offline: made on first use
if demo_data and rt.master and not os.path.exists(os.path.join(data_dir, "meta.json")):
    prepare(**RECIPES["pydoc"], out_dir=data_dir)
if rt.ddp:
    torch.distributed.barrier()
meta = load_meta(data_dir, ckpt and ckpt["meta"])
tok = load_tokenizer(meta)
checkpoint.check_data(ckpt, meta, how)
# span-corrupted batches: step k's global batch is a function of (seed, k); a rank builds its slice
span_corruption = (batch_size, input_length, noise_density, mean_noise_span_length, seed)
train_data = SpanCorruptionBatches(data_dir, "train", *span_corruption)
val_data = SpanCorruptionBatches(data_dir, "val", *span_corruption)
most = max(1, val_data.num_windows // batch_size)  # an evaluation reads each val window once
runtime.check_config(config, [("eval_steps", eval_steps <= most, f"<= {most}: {data_dir}/val.bin "
                               f"holds {val_data.num_windows:,} windows of this run")])

# the model: T5(config) on the meta device, its shapes with no memory yet; placed on the device
# (sharded, compiled, in DDP), it gets its weights: read from the checkpoint, or drawn fresh
ids = dict(eos_token_id=meta["eos_id"], pad_token_id=meta["pad_id"],
           decoder_start_token_id=meta["pad_id"])  # the data's; T5's decoder starts with pad
t5_config = (T5Config(**ckpt["model_config"]) if ckpt else
             T5Config.from_preset(model, vocab_size=meta["model_vocab_size"], **ids))
with torch.device("meta"):
    t5 = T5(dataclasses.replace(t5_config, dropout=dropout))  # dropout ours: HF's configs say 0.1
# what the loop calls: the T5 itself (sharded in place), or its compiled or DDP wrapper
train_t5 = runtime.wrap_model(t5, rt, fsdp, compile, activation_checkpointing, shard_across_nodes)
if ckpt:
    checkpoint.load_weights(t5, ckpt)  # under FSDP, each rank its own slices
else:
    runtime.draw_weights(t5)  # as one process on that device draws them, on any number of ranks
print0(f"{t5.num_params() / 1e6:.1f}M parameters")
opt = make_optimizer(optimizer, param_groups(t5, weight_decay), lr, compile)
step, elapsed = checkpoint.restore_state(ckpt, t5, opt) if how == "resume" else (0, 0.0)
wandb_id = ckpt.get("wandb_id") if how == "resume" else None  # its wandb run goes on
ckpt = None  # free the checkpoint's copy of the weights

train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank, rt.world_size, rt.device)
tokens_per_step = batch_size * (input_length + train_data.targets_length)
step_flops = runtime.flops_per_step(t5, batch_size, input_length, train_data.targets_length)
common_fill, span_baseline = unigram_baseline(val_data, eval_steps)
print0(f"span accuracy baseline {span_baseline:.4f}: always writing the commonest fill, "
       f"{tok.decode(common_fill)!r}")
# two held-out examples every evaluation shows filled in: the first two windows of val.bin
demo_inputs, demo_labels = (t[:2] for t in val_data.get(0, device=rt.device))
demo_tokens = max(tok.shown_length(labels) for labels in demo_labels.tolist())  # what they need
logger = runtime.Logger(out_dir, rt.master, step if how == "resume" else None,
                        dict(program="train.py", config=config))
if wandb_log:
    wandb_id = logger.start_wandb(wandb_project, wandb_run_name, config, wandb_id)
run = dict(program="train.py", config=config, meta=meta, tokenizer=tok.data,  # for checkpoints
           wandb_id=wandb_id)
peak = rt.peak_flops(peak_flops)

@torch.no_grad()
def evaluate():
    """On the fixed val batches: val_loss, val_acc (next token), span_acc; the examples filled in"""
    train_t5.eval()
    sums = torch.zeros(4, device=rt.device)  # loss, next-token accuracy, spans right, spans
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps, rt.rank,
                                             rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = train_t5(input_ids, labels=labels)
            accuracy = (logits.argmax(-1) == labels).float().mean()
            spans_right, spans = span_accuracy(logits, labels, meta["first_sentinel_id"])
            sums += torch.stack([loss.float(), accuracy, spans_right.float(), spans.float()])
    loss, accuracy, spans_right, spans = runtime.agree(rt, *sums)  # the sums over the ranks
    with rt.autocast():  # every rank decodes (under FSDP each block is gathered on all)
        fills = t5.generate(demo_inputs, max_new_tokens=demo_tokens)
    train_t5.train()
    batches = eval_steps * grad_accum_steps * rt.world_size
    return dict(val_loss=loss / batches, val_acc=accuracy / batches, span_acc=spans_right / spans,
                examples=list(map(tok.show_fill, demo_inputs.cpu(), fills.cpu(), demo_labels.cpu())))

# the loop, one optimizer step at a time. Every rank takes each decision at the same step: at sync
# steps (the first, every log, checkpoint and evaluation step, the last) the ranks agree, in one
# all-reduce, on the mean loss, any NaN or inf since the last, any signal, and rank 0's clock. In
# between nothing waits for the GPU, but for a signal's flag: summed at every step, read two on
signals = runtime.Signals(rt)  # Ctrl-C or SIGTERM: every rank saves and stops at the same step
start_step = last_sync_step = step
last_elapsed = elapsed
step_s = 0.0  # the seconds of a step: the mean since the sync step before, agreed
# the schedule's position, in steps, and how far a step moves it: 1 without a time budget; under
# one, so far that the schedule ends with the budget at the pace the ranks last agreed on. Each
# budget_step, a sync step, checks the pace: the second step (the first's time holds the compile),
# then halfway to where the budget runs out, down to the last step
position = elapsed / budget_s * max_steps if budget_s else step
rate = 0.0 if budget_s else 1.0
budget_step = start_step + 2 if budget_s else 0
nonfinite = 0  # the steps since the last sync step whose loss or grad norm was NaN or inf
clock = time.time()  # rank 0's, from which training seconds are counted
last_step = False
while not last_step:
    position = min(position + rate, max_steps)
    lr_now = get_lr(position, max_steps, lr, warmup_steps, warmup_start_factor, min_lr)
    for group in opt.param_groups:
        group["lr"].fill_(lr_now)  # in place: a compiled optimizer step does not compile again
    # forward and backward over this rank's micro-batches, the gradients summed; clip; update
    train_loss = 0.0  # this rank's: the mean over its micro-batches
    for micro_step, batch in enumerate(train_batches.get(step)):
        runtime.sync_gradients(train_t5, micro_step == grad_accum_steps - 1)  # after the last only
        with rt.autocast():
            _, loss = train_t5(**batch)
        (loss / grad_accum_steps).backward()  # FSDP reduce-scatters at each: gradients stay sharded
        train_loss += loss.detach() / grad_accum_steps
    grad_norm = runtime.clip_grad_norm(t5, grad_clip)  # under FSDP, of all ranks' slices
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    nonfinite = nonfinite + ~torch.isfinite(train_loss + grad_norm)  # not waited for: on the device
    if step == start_step + 1:  # the optimizer state exists from the first step on
        runtime.print_memory(t5, opt, rt)
    # at a sync step, the ranks agree; then log, save, evaluate
    last_step = step == max_steps or signals.stop_now(step)
    intervals = (log_interval, checkpoint_interval, eval_interval)
    if (step in (start_step + 1, budget_step) or last_step
            or any(step % interval == 0 for interval in intervals)):
        elapsed, clock = elapsed + time.time() - clock, time.time()  # rank 0's is agreed on
        mean_loss, nonfinite, signalled, elapsed = runtime.agree(
            rt, train_loss / rt.world_size, nonfinite, signals.caught, elapsed * rt.master)
        if nonfinite:  # before a save: the last checkpoint is good
            raise checkpoint.diverged(out_dir, step)
        last_step = last_step or signalled > 0 or 0 < budget_s <= elapsed
        step_s = (elapsed - last_elapsed) / (step - last_sync_step)
        last_sync_step, last_elapsed = step, elapsed
        if budget_s and step > start_step + 1:
            steps_left = max(1, math.ceil((budget_s - elapsed) / step_s))
            budget_step, rate = step + math.ceil(steps_left / 2), (max_steps - position) / steps_left
        mfu_now = runtime.mfu(step_flops, step_s, rt.world_size, peak)
        logger.log({"step": step, "loss": mean_loss, "lr": lr_now, "grad_norm": grad_norm.item(),
                    "ms_per_step": 1000 * step_s, "tokens_per_s": tokens_per_step / step_s,
                    "mfu": mfu_now, "elapsed": elapsed})
        eta_s = budget_s - elapsed if budget_s else (max_steps - step) * step_s
        mfu_text = f" | mfu {100 * mfu_now:.1f}%" if mfu_now else ""
        print0(f"step {step:6d} | loss {mean_loss:.4f} | lr {lr_now:.2e} | grad norm "
               f"{grad_norm:.3f} | {1000 * step_s:.0f} ms/step | {tokens_per_step / step_s:,.0f} "
               f"tok/s{mfu_text} | eta {eta_s / 3600:.2f} h")
        paused = time.time()  # a save and an evaluation are not training time
        if step % checkpoint_interval == 0 or last_step:
            runtime.set_timeout(rt, runtime.START_TIMEOUT)  # the ranks wait for the slowest write
            checkpoint.save_checkpoint(out_dir, t5, opt, step, elapsed, run)
        if (step % eval_interval == 0 or last_step) and not signalled:
            metrics = evaluate()
            logger.log({"step": step, **metrics, "span_baseline": span_baseline})
            print0(f"step {step:6d} | val loss {metrics['val_loss']:.4f} | val acc "
                   f"{metrics['val_acc']:.4f} | span acc {metrics['span_acc']:.4f} (baseline "
                   f"{span_baseline:.4f})")
            for ex in metrics["examples"]:
                print0("\n".join(f"    {key}: {ex[key]}" for key in ("input", "model", "truth")))
        if signalled:  # the save's time: what the launcher must wait for (docs/cluster.md)
            print0(f"stopped by signal at step {step}, saved in {time.time() - paused:.1f} s: "
                   f"continue with --init_from=resume")
        clock += time.time() - paused
signals.release()
train_batches.close()
print0(f"{step} steps in {elapsed / 3600:.2f} h; checkpoint in {out_dir}")
if rt.ddp:
    torch.distributed.destroy_process_group()
if signals.caught:  # as a process the signal ended: `train.py && export.py` stops here
    raise SystemExit(128 + signals.caught)
