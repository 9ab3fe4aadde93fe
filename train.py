"""
Pre-trains T5 v1.1 with span corruption: nanoT5's recipe as one flat loop, read top to bottom.
    python train.py config/t5_base.py                                     # one GPU
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py   # 8 GPUs: the same batch, ~8x faster
    torchrun --standalone --nproc_per_node=8 train.py config/t5_base.py --model=t5-v1_1-xl --fsdp=True  # sharded
    python train.py config/t5_tiny.py                                     # the CPU demo, which prepares its data
"""
import os
import time

import torch

from model import T5, T5Config
from optim import LR_SCHEDULES, check_optimizer, get_lr, make_optimizer, param_groups, train_step
from prepare import (MAX_VOCAB_SIZE, Prefetcher, SpanCorruptionBatches, load_meta, load_tokenizer, prepare, show_fill,
                     shown_length, span_accuracy, unigram_baseline)
from runtime import (DTYPES, Logger, Sync, UserError, check_device, check_fsdp, check_resume, checkpoint_state,
                     claim_out_dir, flops_per_step, load_checkpoint, load_model, memory_report, mfu, micro_batch_size,
                     print0, raw_model, restore_state, save_checkpoint, setup_runtime, state_bytes, unsharded_copy,
                     wrap_model)

# -----------------------------------------------------------------------------------------------------------------
# default config: nanoT5's T5-v1.1-base recipe on C4; config/*.py and --key=value override it, `valid` says what
# values each key may take
valid = {}
# paths and run
out_dir = "out"
data_dir = "data/c4"
init_from = "scratch"  # 'scratch', 'resume' (out_dir's checkpoint), or other weights: a checkpoint, an HF name/folder
valid.update(out_dir="folder", data_dir="folder", init_from="non-empty")
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
time_budget_hours = 0.0  # > 0: schedule and stop follow training time instead of max_steps (Cramming)
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
             warmup_start_factor="in [0, 1]", min_lr=">= 0", weight_decay=">= 0", grad_clip=">= 0", z_loss=">= 0")
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
fsdp = False  # under torchrun: shard weights, gradients and optimizer state (FSDP2) instead of DDP
seed = 1337
peak_flops = 0.0  # dense peak FLOP/s of one GPU, for MFU; 0 -> runtime.PEAK_FLOPS
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = "t5"
valid.update(device=check_device, dtype=DTYPES, compile="any", fsdp=check_fsdp, seed=">= 0", peak_flops=">= 0",
             wandb_log="any", wandb_project="non-empty", wandb_run_name="any")
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------------------------------------------

rt = setup_runtime(device, dtype, seed)
micro_batch = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)

# the data: the offline corpus is prepared on first use
if dataset == "pydoc" and not os.path.exists(os.path.join(data_dir, "meta.json")):
    if rt.master:
        print0(f"{data_dir} has no data yet: preparing the '{dataset}' corpus there first (runs once)")
        prepare(dataset=dataset, tokenizer=tokenizer, out_dir=data_dir, vocab_size=vocab_size)
    if rt.ddp:
        torch.distributed.barrier()
meta = load_meta(data_dir)
# dataset, tokenizer and vocab_size given with data_dir or after it must be what it holds
described = [key for key in ("dataset", "tokenizer", "vocab_size")
             if given_at.get(key, -1) >= given_at.get("data_dir", 0)]
contradicted = [f"{key} {meta['settings'][key]!r}, not {config[key]!r}" for key in described
                if meta["settings"][key] not in (None, config[key])]
if contradicted:
    raise UserError(f"{data_dir} was prepared with {', '.join(contradicted)}: set those to the folder's values, or "
                    f"give another --data_dir")
# a new run never replaces a checkpoint, and two runs never write one out_dir
out_dir_lock = claim_out_dir(out_dir, rt, fresh=init_from != "resume")  # held while the process lives

# the model: from scratch, from this run's checkpoint, or from other weights (ours or Hugging Face's)
ckpt_path = os.path.join(out_dir, "ckpt" if fsdp else "ckpt.pt")  # FSDP: a directory of every rank's shards
ckpt = load_checkpoint(ckpt_path, program="train.py") if init_from == "resume" else None
if ckpt is not None:
    check_resume(ckpt, ckpt_path, config, meta, fixed=("model", "dropout", "optimizer"))
    t5 = T5.from_checkpoint(ckpt)
elif init_from == "scratch":
    t5 = T5(T5Config.from_preset(model, vocab_size=meta["model_vocab_size"], dropout=dropout))
else:
    t5, weights = load_model(init_from, dropout=dropout)  # HF configs say dropout 0.1, the fine-tuning value
    if weights is not None:
        print0(f"a new run from the weights of {init_from} (--init_from=resume continues a run, optimizer and all)")
print0(f"{t5.num_params() / 1e6:.1f}M parameters")
t5 = wrap_model(t5, rt, fsdp, compile)  # on the device; sharded, compiled, DDP-wrapped as configured
opt = make_optimizer(optimizer, param_groups(raw_model(t5), weight_decay), lr)
if ckpt is not None:
    restore_state(ckpt, t5, opt)  # the optimizer state and the RNG
step = ckpt["step"] if ckpt is not None else 0  # optimizer steps done
elapsed = ckpt["elapsed"] if ckpt is not None else 0.0  # training seconds, summed over resumes for the time budget
ckpt = None  # free the checkpoint's copy of the weights

# span-corrupted batches: the global batch of step k is a function of (seed, k); this rank builds its slice
data_args = (batch_size, input_length, noise_density, mean_noise_span_length, seed, raw_model(t5).config.vocab_size)
train_data = SpanCorruptionBatches(data_dir, "train", *data_args)
val_data = SpanCorruptionBatches(data_dir, "val", *data_args)
train_batches = Prefetcher(train_data, grad_accum_steps, rt.rank, rt.world_size, rt.device)  # builds k+1 meanwhile
tokens_per_step = batch_size * (input_length + train_data.targets_length)
step_flops = flops_per_step(raw_model(t5), batch_size, input_length, train_data.targets_length)
print0(f"{batch_size} examples x ({input_length} input + {train_data.targets_length} target) tokens = "
       f"{tokens_per_step:,} tokens/step, {micro_batch} per micro-step on each of {rt.world_size} rank(s)")
# the span accuracy of a model that ignores its input
common_fill, span_baseline = unigram_baseline(train_data, val_data, eval_steps)
tok = load_tokenizer(meta)
print0(f"span accuracy baseline {span_baseline:.4f}: always writing the commonest fill, {tok.decode(common_fill)!r} "
       f"(ids {list(common_fill)})")
# two held-out examples every evaluation shows filled in: the first two windows of val.bin
demo_inputs, demo_labels = (t[:2] for t in val_data.get(0, device=rt.device))
demo_tokens = max(shown_length(tok, labels) for labels in demo_labels.tolist())  # what the shown spans need
logger = Logger(out_dir, rt.master, resume_step=step if init_from == "resume" else None, wandb_log=wandb_log,
                wandb_project=wandb_project, wandb_run_name=wandb_run_name, config=config)
peak = rt.peak_flops(peak_flops)

@torch.no_grad()
def evaluate():
    """loss, next-token accuracy and span accuracy on the fixed validation batches, and the demo examples filled in"""
    t5.eval()
    totals = torch.zeros(4, device=rt.device)
    for i in range(eval_steps):
        for micro_step in range(grad_accum_steps):
            input_ids, labels = val_data.get(i, micro_step, grad_accum_steps, rt.rank, rt.world_size, rt.device)
            with rt.autocast():
                logits, loss = t5(input_ids, labels=labels)
            totals += torch.stack([loss.float(), (logits.argmax(-1) == labels).float().mean(),
                                   *span_accuracy(logits, labels, meta["first_sentinel_id"])])
    if rt.ddp:
        torch.distributed.all_reduce(totals)  # gloo has no AVG: sum, then divide by the ranks too
    with rt.autocast():  # every rank decodes (FSDP needs all ranks), rank 0 shows
        generator = unsharded_copy(t5) if fsdp else raw_model(t5)
        fills = generator.generate(demo_inputs, max_new_tokens=demo_tokens)
    t5.train()
    examples = [show_fill(tok, *ids) for ids in zip(demo_inputs.cpu(), fills.cpu(), demo_labels.cpu())]
    val_loss, val_acc = (totals[:2] / (eval_steps * grad_accum_steps * rt.world_size)).tolist()
    return val_loss, val_acc, (totals[2] / totals[3]).item(), examples

# the ranks agree at sync points only (log and checkpoint steps): there they stop, save and read the clock together
sync = Sync(rt, ckpt_path, step, elapsed, time_budget_hours * 3600)
t5.train()
start_step, t_log, steps_since_log = step, time.time(), 0
while step < max_steps and not sync.stop:
    # under a time budget, the schedule follows the share of the budget spent
    progress = sync.clock(step) / sync.budget_s * max_steps if sync.budget_s else step + 1
    lr_now = get_lr(progress, max_steps, lr_schedule, lr, warmup_steps, warmup_start_factor, min_lr)
    loss, grad_norm = train_step(t5, opt, train_batches(step), grad_accum_steps, lr_now, grad_clip, z_loss,
                                 rt.autocast, rt.ddp)
    step += 1
    steps_since_log += 1
    sync.watch(loss, grad_norm)  # NaN or inf noted on the device, without waiting for it
    if step == start_step + 1:  # the optimizer state exists from the first step on
        print0(f"parameters + optimizer state: {state_bytes(t5, opt) / 2**20:.2f} MiB on rank 0")
        if rt.device_type == "cuda":
            print0(memory_report(rt.device))

    if step % log_interval == 0 or step % checkpoint_interval == 0 or step in (start_step + 1, max_steps):
        loss = sync.agree(step, loss)  # one all-reduce; NaN or inf since the last one ends the run before it saves
        dt = (time.time() - t_log) / steps_since_log
        t_log, steps_since_log = time.time(), 0
        mfu_now = mfu(step_flops, dt, rt.world_size, peak)
        eta_s = sync.budget_s - sync.elapsed if sync.budget_s else (max_steps - step) * dt
        logger.log({"step": step, "loss": loss, "lr": lr_now, "grad_norm": grad_norm.item(), "ms_per_step": 1000 * dt,
                    "tokens_per_s": tokens_per_step / dt, "mfu": mfu_now, "elapsed": sync.elapsed})
        print0(f"step {step:6d} | loss {loss:.4f} | lr {lr_now:.2e} | grad norm {grad_norm.item():.3f} | "
               f"{1000 * dt:.0f} ms/step | {tokens_per_step / dt:,.0f} tok/s"
               f"{f' | mfu {100 * mfu_now:.1f}%' if mfu_now else ''} | eta {eta_s / 3600:.2f} h")
        if sync.stop or step % checkpoint_interval == 0 or step == max_steps:  # a signal, the budget spent, the end
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
print0(f"{step} steps in {sync.elapsed / 3600:.2f} h; checkpoint in {ckpt_path} (continue with --init_from=resume)")
if rt.ddp:
    torch.distributed.destroy_process_group()
