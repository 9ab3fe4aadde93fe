"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop, read top to bottom.
    python train.py config/t5_base.py                                    # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py  # 8 GPUs, the same batch
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py --model=t5-v1_1-xl --fsdp=True
    python train.py config/t5_tiny.py                                    # the CPU demo
"""
import configurator  # first: from here on an error, or Ctrl-C, is one line, not a traceback
import os
import time

import torch

from checkpoint import (check_init_from, check_resume, checkpoint_state, claim_out_dir, load_checkpoint,
                        restore_state, save_checkpoint, start_model)
from data import (Prefetcher, SpanCorruptionBatches, micro_batch_size, show_fill, shown_length,
                  span_accuracy, unigram_baseline)
from files import UserError
from model import T5Config
from optim import LR_SCHEDULES, check_optimizer, get_lr, make_optimizer, param_groups, train_step
from prepare import MAX_VOCAB_SIZE, load_meta, load_tokenizer, prepare
from runtime import (DTYPES, Logger, Sync, check_device, check_fsdp, check_wandb, flops_per_step,
                     memory_report, mfu, print0, raw_model, setup_runtime, state_bytes)

# -------------------------------------------------------------------------------------------------
# default config: nanoT5's T5-v1.1-base recipe on C4; config/*.py and --key=value override it,
# `valid` says what values each key may take
valid = {}
# paths and run
out_dir = "out"
data_dir = "data/c4"
init_from = "scratch"  # 'scratch', 'resume' (out_dir's run), or a run or HF weights to start from
valid.update(out_dir="folder", data_dir="folder", init_from=check_init_from)
# how data_dir was made, checked against its meta.json (pydoc, offline, is prepared on first use)
dataset = "c4"
tokenizer = "t5"
vocab_size = 32000  # only for tokenizer='train'
valid.update(dataset="non-empty", tokenizer="non-empty", vocab_size=f"in [1, {MAX_VOCAB_SIZE}]")
# model
model = "t5-v1_1-base"
dropout = 0.0  # nanoT5 pre-trains without dropout
valid.update(model=T5Config.from_preset, dropout="in [0, 1)")
# data and objective
input_length = 512
noise_density = 0.15
mean_noise_span_length = 3.0
valid.update(input_length=">= 3", noise_density="in (0, 1)", mean_noise_span_length=">= 1")
# batch
batch_size = 128  # global examples per optimizer step, over all micro-steps and ranks
grad_accum_steps = 1
valid.update(batch_size="> 0", grad_accum_steps="> 0")
# steps
max_steps = 65536
time_budget_hours = 0.0  # > 0: the schedule and the stop follow training time (Cramming)
valid.update(max_steps="> 0", time_budget_hours=">= 0")
# optimizer and schedule
optimizer = "adamwscale"
lr = 2e-2
lr_schedule = "cosine"
warmup_steps = 10000
warmup_start_factor = 0.5
min_lr = 1e-5
weight_decay = 0.0
grad_clip = 1.0
z_loss = 0.0
valid.update(optimizer=check_optimizer, lr="> 0", lr_schedule=LR_SCHEDULES, warmup_steps=">= 0",
             warmup_start_factor="in [0, 1]", min_lr=">= 0", weight_decay=">= 0", grad_clip=">= 0",
             z_loss=">= 0")
# intervals
eval_interval = 1000
eval_steps = 20
log_interval = 10
checkpoint_interval = 1000
valid.update(eval_interval="> 0", eval_steps="> 0", log_interval="> 0", checkpoint_interval="> 0")
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
valid.update(device=check_device, dtype=DTYPES, compile="any", activation_checkpointing="any",
             fsdp=check_fsdp, seed=">= 0", peak_flops=">= 0", wandb_log=check_wandb,
             wandb_project="non-empty", wandb_run_name="any")
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -------------------------------------------------------------------------------------------------

rt = setup_runtime(device, dtype, seed)
micro_batch = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)

def describes_data_dir(key):
    """Whether `key` was given with data_dir (in one config file) or after it: then it describes
    that folder, and must be what its meta.json says. A key given before a later --data_dir
    described the folder that one replaced (config/t5_tiny.py's dataset under --data_dir=mine)."""
    return given_at.get(key, -1) >= given_at.get("data_dir", 0)

# the data: the offline corpus is prepared on first use
if dataset == "pydoc" and not os.path.exists(os.path.join(data_dir, "meta.json")):
    if rt.master:
        print0(f"{data_dir} has no data yet: preparing the '{dataset}' corpus there (runs once)")
        prepare(dataset=dataset, tokenizer=tokenizer, out_dir=data_dir, vocab_size=vocab_size)
    if rt.ddp:
        torch.distributed.barrier()
meta = load_meta(data_dir)
made_with = meta["settings"]
contradicted = [f"{key} {made_with[key]!r}, not {config[key]!r}" for key in ("dataset", "tokenizer", "vocab_size")
                if describes_data_dir(key) and made_with[key] not in (None, config[key])]
if contradicted:
    raise UserError(f"{data_dir} was prepared with {', '.join(contradicted)}: set those to the folder's "
                    f"values, or give another --data_dir")
tok = load_tokenizer(meta)
# a new run never replaces a checkpoint, and two runs never write one out_dir
out_dir_lock = claim_out_dir(out_dir, rt, fresh=init_from != "resume")  # held till the end

# the model: from scratch, from this run's checkpoint, or from other weights (a run's, or HF's)
ckpt_path = os.path.join(out_dir, "ckpt" if fsdp else "ckpt.pt")  # FSDP: a folder of shards
ckpt = load_checkpoint(ckpt_path, program="train.py", weights=not fsdp) if init_from == "resume" else None
if ckpt is not None:
    check_resume(ckpt, ckpt_path, config, meta, fixed=("model", "dropout", "optimizer"))
    if ckpt["step"] >= max_steps:
        raise UserError(f"{ckpt_path} is at step {ckpt['step']} of max_steps={max_steps}: nothing is left "
                        f"to train; raise --max_steps to train on")
    if 0 < time_budget_hours * 3600 <= ckpt["elapsed"]:
        raise UserError(f"{ckpt_path} has spent its time budget, {ckpt['elapsed'] / 3600:.2f} h of "
                        f"time_budget_hours={time_budget_hours}: raise --time_budget_hours to train on")
    weights = ckpt
elif init_from == "scratch":
    weights = T5Config.from_preset(model, vocab_size=meta["model_vocab_size"], dropout=dropout)
else:
    weights = init_from
    print0(f"a new run from the weights of {init_from} (--init_from=resume continues a run)")
# on the device: sharded, compiled, in DDP as configured; dropout ours (Hugging Face's configs say 0.1)
t5, _ = start_model(weights, rt, fsdp, compile, activation_checkpointing=activation_checkpointing,
                    dropout=dropout)
print0(f"{raw_model(t5).num_params() / 1e6:.1f}M parameters")
opt = make_optimizer(optimizer, param_groups(raw_model(t5), weight_decay), lr)
step = ckpt["step"] if ckpt is not None else 0  # optimizer steps done
elapsed = ckpt["elapsed"] if ckpt is not None else 0.0  # training seconds over resumes, for the budget
if ckpt is not None:
    restore_state(ckpt, t5, opt)  # the optimizer state and the RNG
ckpt = None  # free the checkpoint's copy of the weights

# span-corrupted batches: step k's global batch is a function of (seed, k); a rank builds its slice
vocab = raw_model(t5).config.vocab_size
data_args = (batch_size, input_length, noise_density, mean_noise_span_length, seed, vocab)
train_data = SpanCorruptionBatches(data_dir, "train", *data_args)
val_data = SpanCorruptionBatches(data_dir, "val", *data_args)
train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank, rt.world_size, rt.device)
targets_length = train_data.targets_length
tokens_per_step = batch_size * (input_length + targets_length)
step_flops = flops_per_step(raw_model(t5), batch_size, input_length, targets_length)
print0(f"{batch_size} examples x ({input_length} input + {targets_length} target) tokens = {tokens_per_step:,} "
       f"tokens/step, {micro_batch} per micro-step on each of {rt.world_size} rank(s)")
# the span accuracy of a model that ignores its input
common_fill, span_baseline = unigram_baseline(train_data, val_data, eval_steps)
print0(f"span accuracy baseline {span_baseline:.4f}: always writing the commonest fill, "
       f"{tok.decode(common_fill)!r} (ids {list(common_fill)})")
# two held-out examples every evaluation shows filled in: the first two windows of val.bin
demo_inputs, demo_labels = (t[:2] for t in val_data.get(0, device=rt.device))
demo_tokens = max(shown_length(tok, labels) for labels in demo_labels.tolist())  # what they need
logger = Logger(out_dir, rt.master, resume_step=step if init_from == "resume" else None,
                wandb_log=wandb_log, wandb_project=wandb_project, wandb_run_name=wandb_run_name, config=config)
peak = rt.peak_flops(peak_flops)

@torch.no_grad()
def evaluate():
    """loss, next-token accuracy and span accuracy on the fixed validation batches, and the two
    examples filled in"""
    t5.eval()
    totals = torch.zeros(4, device=rt.device)
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps, rt.rank, rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = t5(input_ids, labels=labels)
            accuracy = (logits.argmax(-1) == labels).float().mean()
            spans_right, spans = span_accuracy(logits, labels, meta["first_sentinel_id"])
            totals += torch.stack([loss.float(), accuracy, spans_right, spans])
    if rt.ddp:
        torch.distributed.all_reduce(totals)  # gloo has no AVG: sum, then divide by the ranks too
    with rt.autocast():  # every rank decodes all steps (FSDP gathers each block on all ranks), rank 0 shows
        fills = raw_model(t5).generate(demo_inputs, max_new_tokens=demo_tokens, all_steps=fsdp)
    t5.train()
    examples = [show_fill(tok, *ids) for ids in zip(demo_inputs.cpu(), fills.cpu(), demo_labels.cpu())]
    val_loss, val_acc = (totals[:2] / (eval_steps * grad_accum_steps * rt.world_size)).tolist()
    return val_loss, val_acc, (totals[2] / totals[3]).item(), examples

# the loop. The ranks agree at sync points only (the log and checkpoint steps, the first and the
# last): there a signal or a spent time budget stops them together, and a NaN ends the run unsaved
sync = Sync(rt, ckpt_path, step, elapsed, time_budget_hours * 3600)
t5.train()
start_step = step
t_log = time.time()
steps_since_log = 0
last_step = False
while not last_step:
    # under a time budget, the schedule follows the share of the budget spent
    progress = sync.clock(step) / sync.budget_s * max_steps if sync.budget_s else step + 1
    lr_now = get_lr(progress, max_steps, lr_schedule, lr, warmup_steps, warmup_start_factor, min_lr)
    micro_batches = train_batches.get(step)  # this rank's share of the step's batch
    loss, grad_norm = train_step(t5, opt, micro_batches, lr_now, grad_clip, z_loss, rt.autocast, rt.ddp)
    step += 1
    steps_since_log += 1
    sync.watch(loss, grad_norm)  # NaN or inf noted on the device, without waiting for it
    if step == start_step + 1:  # the optimizer state exists from the first step on
        print0(f"parameters + optimizer state: {state_bytes(t5, opt) / 2**20:.2f} MiB on rank 0")
        if rt.device_type == "cuda":
            print0(memory_report(rt.device))

    stop = False
    sync_step = step % log_interval == 0 or step % checkpoint_interval == 0 or step in (start_step + 1, max_steps)
    if sync_step:
        loss, stop = sync.agree(step, loss)  # one all-reduce: the mean loss, and whether to stop
        dt = (time.time() - t_log) / steps_since_log
        t_log = time.time()
        steps_since_log = 0
        mfu_now = mfu(step_flops, dt, rt.world_size, peak)
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
            save_checkpoint(ckpt_path, checkpoint_state(t5, opt, step, sync.elapsed, config, meta))
    if step % eval_interval == 0 or step == max_steps:
        with sync.paused():
            val_loss, val_acc, span_acc, examples = evaluate()
        logger.log({"step": step, "val_loss": val_loss, "val_acc": val_acc, "span_acc": span_acc,
                    "span_baseline": span_baseline, "examples": examples})
        print0(f"step {step:6d} | val loss {val_loss:.4f} | val acc {val_acc:.4f} | span acc {span_acc:.4f} "
               f"(baseline {span_baseline:.4f})")
        for ex in examples:
            print0(f"    input: {ex['input']}\n    model: {ex['model']}\n    truth: {ex['truth']}")
sync.release()
train_batches.close()
print0(f"{step} steps in {sync.elapsed / 3600:.2f} h; checkpoint in {ckpt_path}")
if rt.ddp:
    torch.distributed.destroy_process_group()
