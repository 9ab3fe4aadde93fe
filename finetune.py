"""
Fine-tunes a T5 on Super-Natural-Instructions and reports Rouge-L on its
held-out test tasks, as the nanoT5 paper does, with Tk-Instruct's recipe.
    git clone https://github.com/allenai/natural-instructions
    python finetune.py --init_from=out/t5_base  # a train.py run, or HF weights
"""
import json
import math
import os
import random
import string
import time
from functools import lru_cache
from statistics import mean

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import checkpoint
import distributed
import runtime
from data import micro_batch_size
from model import T5, T5Config
from optim import OPTIMIZERS, make_optimizer, param_groups
from runtime import all_gathered, atomic_write, print0
from tokenizer import tokenizer_of

# -----------------------------------------------------------------------------
# default config: nanoT5's fine-tuning (task/ft.yaml) on Tk-Instruct's data
# I/O
data_dir = "natural-instructions"  # a clone of allenai/natural-instructions
init_from = "out"  # a run of train.py or finetune.py, HF weights, or 'resume'
out_dir = "out/finetune"
eval_only = False  # only evaluate init_from on the test tasks
# data
max_num_instances_per_task = 100
num_pos_examples = 2
max_input_length = 1024  # tokens, EOS included
max_target_length = 128
# optimizer: AdamW at a constant lr, no warmup
optimizer = "adamw"
lr = 5e-5
weight_decay = 0.0
grad_clip = 0.0
batch_size = 8  # examples per optimizer step, over micro-steps and ranks
grad_accum_steps = 1
epochs = 2
max_steps = 0  # 0: `epochs` passes over the train examples
dropout = 0.1  # T5's fine-tuning value; pre-training runs without
# intervals, in optimizer steps as in train.py, and evaluation
eval_interval = 0  # Rouge-L on the test tasks; 0: only at the end
log_interval = 10
checkpoint_interval = 1000
eval_batch_size = 32
max_new_tokens = 128
# system
device = "auto"  # cuda > mps > cpu
dtype = "float32"  # as the paper's fine-tuning numbers
compile = False  # each new padded prompt length would compile again
fsdp = False  # under torchrun: FSDP2 sharding instead of DDP
seed = 1337
# logging: log.jsonl always; wandb too, if asked for
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = ""  # '' -> out_dir's folder name
# -----------------------------------------------------------------------------

def sni_split(data_dir, split):
    path = os.path.join(data_dir, "splits", "default", f"{split}_tasks.txt")
    if not os.path.isfile(path):
        url = "https://github.com/allenai/natural-instructions"
        raise SystemExit(f"error: no SNI split file {path}: get the data "
                         f"with `git clone {url} {data_dir}`")
    return path

def load_split(data_dir, split, max_num_instances_per_task, seed):
    """SNI's default train or test split, a dict per example, read as
    Tk-Instruct reads it"""
    with open(sni_split(data_dir, split), encoding="utf-8") as f:
        task_names = f.read().split()
    examples = []
    for name in task_names:
        with open(os.path.join(data_dir, "tasks", name + ".json"),
                  encoding="utf-8") as f:
            task = json.load(f)
        definition = task["Definition"]  # today a list: Tk-Instruct's first
        if isinstance(definition, list):
            definition = definition[0]
        positives = [(ex["input"], ex["output"])
                     for ex in task["Positive Examples"]]
        instances = task["Instances"]
        if split == "test":  # SNI's label-balanced test instances come first
            instances = instances[:100]
        rng = random.Random(f"{seed}-{name}")  # whatever others drew
        count = min(max_num_instances_per_task, len(instances))
        for i in sorted(rng.sample(range(len(instances)), count)):
            ex = instances[i]
            examples.append(dict(
                task=name, id=ex.get("id") or f"{name}-{i}",
                definition=definition, positives=positives,
                input=ex["input"], references=ex["output"],
                target=rng.choice(ex["output"])))
    return examples

def build_prompt(definition, positives, instance_input, num_pos_examples=2):
    """Tk-Instruct's "definition + positive examples" prompt, spacing and
    periods included"""
    def dot(text):  # as Tk-Instruct ends each part
        return text if text[-1] in string.punctuation else text + "."
    prompt = dot("Definition: " + definition.strip()) + "\n\n"
    for i, (x, y) in enumerate(positives[:num_pos_examples]):
        prompt += f" Positive Example {i + 1} -\n"
        prompt += dot(f"Input: {x.strip()}") + "\n"
        prompt += dot(f" Output: {y.strip()}") + "\n\n"
    prompt += "Now complete the following example -\n"
    prompt += dot(f"Input: {instance_input.strip()}") + "\n"
    return prompt + "Output: "

def tokenize_example(example, tokenizer, eos_id, max_input_length,
                     max_target_length, num_pos_examples):
    """the example with prompt, input_ids and labels (each ending in EOS),
    within the limits: as many positive examples as fit, as Tk-Instruct"""
    positives = example["positives"]
    for k in range(min(num_pos_examples, len(positives)), -1, -1):
        prompt = build_prompt(example["definition"], positives,
                              example["input"], k)
        input_ids = tokenizer.encode(prompt) + [eos_id]
        if len(input_ids) <= max_input_length:
            break
    else:  # too long even without examples: cut
        input_ids = input_ids[:max_input_length - 1] + [eos_id]
        prompt = tokenizer.decode(input_ids[:-1])  # what the model sees
    target = tokenizer.encode(example["target"].strip())
    labels = target[:max_target_length - 1] + [eos_id]
    return dict(example, prompt=prompt, input_ids=input_ids, labels=labels)

def collate(examples, pad_id):
    """the model's arguments, right-padded to a multiple of 8 (labels with
    -100, which the loss ignores)"""
    def pad(sequences, value):
        padded = pad_sequence([torch.tensor(s) for s in sequences],
                              batch_first=True, padding_value=value)
        return F.pad(padded, (0, -padded.size(1) % 8), value=value)
    inputs = [ex["input_ids"] for ex in examples]
    return dict(input_ids=pad(inputs, pad_id),
                labels=pad([ex["labels"] for ex in examples], -100),
                attention_mask=pad([[1] * len(x) for x in inputs], 0))

@lru_cache(maxsize=1)
def rougeL_scorer():  # built once, imported late: the import takes seconds
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

def rouge_l(prediction, references):
    """Tk-Instruct's: rouge-score's F-measure, Porter stemmer, the best
    reference, x 100"""
    scores = rougeL_scorer().score_multi(references, prediction)
    return 100.0 * scores["rougeL"].fmeasure

def compute_metrics(records):  # over the examples, not the tasks' means
    scores = [rouge_l(r["prediction"], r["references"]) for r in records]
    return dict(rougeL=mean(scores), num_examples=len(scores))

def generate_predictions(model, examples, tokenizer, batch_size,
                         max_new_tokens, device, autocast, rank=0,
                         world_size=1):
    """greedy predictions of this rank's share of the examples, (index,
    text) pairs; every rank runs as many batches, for FSDP's collectives"""
    # by length, a batch's prompts need little padding
    shard = sorted(range(rank, len(examples), world_size),
                   key=lambda i: len(examples[i]["input_ids"]))
    shard = shard or [0]  # fewer examples than ranks: decode one anyway
    shard += shard[-1:] * (-(-len(examples) // world_size) - len(shard))
    eos_id = model.config.eos_token_id
    predictions = []
    for start in tqdm(range(0, len(shard), batch_size), desc="generating",
                      unit="batch", disable=rank != 0):
        indices = shard[start:start + batch_size]
        batch = collate([examples[i] for i in indices],
                        model.config.pad_token_id)
        with autocast():
            generated = model.generate(batch["input_ids"].to(device),
                                       batch["attention_mask"].to(device),
                                       max_new_tokens)
        for i, ids in zip(indices, generated.tolist()):
            ids = ids[:ids.index(eos_id)] if eos_id in ids else ids
            text = tokenizer.decode(ids, skip_special_tokens=True)
            predictions.append((i, text))  # decoded as Tk-Instruct does
    return predictions

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configurator.py")).read())
    check_config(config, [
        ("optimizer", optimizer in OPTIMIZERS,
         f"one of {', '.join(OPTIMIZERS)}"),
        ("dropout", 0 <= dropout < 1, "in [0, 1)"),
        ("seed", 0 <= seed < 2**32, "in [0, 2**32), as numpy takes it"),
        ("init_from", init_from not in ("scratch", "auto"),
         "the weights to fine-tune (a run's, HF's), or resume"),
        runtime.wandb_rule(wandb_log),
        *[(key, config[key] >= 0, ">= 0") for key in (
            "grad_clip", "max_steps", "eval_interval", "weight_decay",
            "num_pos_examples")],
        *[(key, config[key] > 0, "> 0") for key in (
            "lr", "batch_size", "grad_accum_steps", "epochs", "log_interval",
            "checkpoint_interval", "max_input_length", "max_target_length",
            "eval_batch_size", "max_new_tokens",
            "max_num_instances_per_task")],
    ])
    sni_split(data_dir, "test")
    rt = runtime.setup_runtime(device, dtype, seed, fsdp)
    if rt.torchrun:
        distributed.join(rt)
    micro_batch = micro_batch_size(batch_size, grad_accum_steps,
                                   rt.world_size)
    lock = runtime.lock_folder(out_dir)  # one live run per out_dir
    # the weights (this run's newest checkpoint, or init_from's), with the
    # tokenizer they were trained with, which checkpoints carry
    resuming, ckpt = checkpoint.start_from(
        init_from, out_dir, "finetune.py", config,
        ("optimizer", "weight_decay"), fsdp=fsdp)
    tokenizer = tokenizer_of(ckpt, init_from)
    t5_config = T5Config(**{**ckpt["model_config"], "dropout": dropout})
    if fsdp:  # dynamic: prompts of many lengths
        model = distributed.sharded_t5(t5_config, rt, compile, dynamic=True)
    else:
        with torch.device(rt.device):
            model = T5(t5_config)
    checkpoint.load_weights(model, ckpt)
    print0(f"{model.num_params() / 1e6:.1f}M parameters from {init_from}")
    train_model = model  # what the loop calls, as in train.py
    if compile and not fsdp:
        train_model = torch.compile(model, dynamic=True)
    if rt.torchrun and not fsdp:
        train_model = distributed.ddp(train_model, rt)

    def tokenized_split(split):
        args = (tokenizer, t5_config.eos_token_id, max_input_length,
                max_target_length, num_pos_examples)
        return [tokenize_example(ex, *args) for ex in load_split(
            data_dir, split, max_num_instances_per_task, seed)]
    test_examples = tokenized_split("test")
    train_examples = [] if eval_only else tokenized_split("train")
    print0(f"{len(train_examples):,} train and {len(test_examples):,} test "
           f"examples")
    steps_per_epoch = len(train_examples) // batch_size
    if not eval_only and not steps_per_epoch:
        raise SystemExit(f"error: {len(train_examples)} train examples make "
                         f"no full batch of {batch_size}: lower batch_size or "
                         f"raise max_num_instances_per_task")
    max_steps = 0 if eval_only else max_steps or epochs * steps_per_epoch

    opt = make_optimizer(optimizer, param_groups(model, weight_decay), lr)
    if fsdp:
        opt = distributed.shard_optimizer(opt)
    step, elapsed = (checkpoint.restore_state(ckpt, model, opt) if resuming
                     else (0, 0.0))
    for group in opt.param_groups:
        group["lr"] = lr  # a resume's --lr, not its checkpoint's
    # what checkpoints hold besides the state; weights: those the run
    # fine-tunes (a step folder, HF's), which metrics.json names
    wandb_id = ckpt.get("wandb_id") if resuming else None
    weights = ckpt["weights"] if resuming else ckpt["source"]
    identity = dict(program="finetune.py", config=config)
    run_record = dict(identity, meta=ckpt["meta"], tokenizer=tokenizer.data,
                      wandb_id=wandb_id, weights=weights)
    ckpt = None  # free the checkpoint's copy of the weights
    logger = runtime.Logger(out_dir, rt.master, step if resuming else None,
                            identity)
    if wandb_log:
        run_record["wandb_id"] = logger.start_wandb(
            wandb_project, wandb_run_name, config, wandb_id)

    @lru_cache(maxsize=1)
    def epoch_order(epoch):  # of (seed, epoch) alone: a resume's too
        generator = torch.Generator().manual_seed(seed + epoch)
        return torch.randperm(len(train_examples), generator=generator)

    def micro_batches(step):
        """this rank's micro-batches of step, collated: micro-step m takes
        chunk m * world_size + rank of the step's rows"""
        epoch, i = divmod(step, steps_per_epoch)
        rows = epoch_order(epoch)[i * batch_size:(i + 1) * batch_size]
        chunks = rows.split(micro_batch)[rt.rank::rt.world_size]
        batches = [collate([train_examples[j] for j in chunk.tolist()],
                           model.config.pad_token_id) for chunk in chunks]
        return [{k: t.to(rt.device) for k, t in b.items()} for b in batches]

    def evaluate():
        """greedy predictions of every test example, spread over the
        ranks; rank 0 scores them"""
        model.eval()
        predictions = generate_predictions(
            model, test_examples, tokenizer, eval_batch_size, max_new_tokens,
            rt.device, rt.autocast, rt.rank, rt.world_size)
        model.train()
        texts = dict(p for shard in all_gathered(predictions) for p in shard)
        if not rt.master:
            return
        records = [dict(task=ex["task"], id=ex["id"], prompt=ex["prompt"],
                        prediction=texts[i], references=ex["references"])
                   for i, ex in enumerate(test_examples)]
        metrics = dict(compute_metrics(records), step=step,
                       init_from=weights, tokenizer_sha256=tokenizer.sha256)
        path = os.path.join(out_dir, "predictions.jsonl")
        with atomic_write(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        with atomic_write(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        logger.log({"step": step, "rougeL": metrics["rougeL"]})
        print(f"step {step}: Rouge-L {metrics['rougeL']:.2f} on "
              f"{len(records):,} test examples; predictions in {path}")

    # the loop, as train.py's
    signals = runtime.Signals(rt)
    if rt.torchrun:
        signal_flags = distributed.SignalFlags(rt)
    max_norm = grad_clip or math.inf
    nonfinite = 0
    start_step, synced_step, synced_elapsed = step, step, elapsed
    clock = time.time()
    last_step = step >= max_steps
    while not last_step:
        # the loss: the mean over the step's label tokens on all ranks, a
        # micro-batch weighing its tokens (DDP, FSDP average the ranks')
        batches = micro_batches(step)
        tokens = [(batch["labels"] != -100).sum() for batch in batches]
        step_tokens = sum(tokens)
        if rt.torchrun:
            torch.distributed.all_reduce(step_tokens)
        train_loss = 0.0
        for micro_step, (batch, n) in enumerate(zip(batches, tokens)):
            if rt.torchrun:
                distributed.sync_gradients(train_model,
                                           micro_step == grad_accum_steps - 1)
            with rt.autocast():
                _, loss = train_model(**batch)
            weight = n * rt.world_size / step_tokens
            (loss * weight).backward()
            train_loss += loss.detach() * weight
        if fsdp:
            grad_norm = distributed.clip_grad_norm(model, max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        nonfinite = nonfinite + ~torch.isfinite(train_loss + grad_norm)
        signals.step = step
        stop = signals.caught > 0
        if rt.torchrun:
            stop = step < max_steps and signal_flags.any(signals.caught)
        last_step = step == max_steps or stop
        if step == start_step + 1:  # the optimizer state exists
            runtime.print_memory(model, opt, rt)
            if rt.torchrun:
                distributed.set_timeout(distributed.TRAIN_TIMEOUT)
        saving = last_step or step % checkpoint_interval == 0
        if saving or step % log_interval == 0:
            synced = time.time()
            loss, elapsed, nonfinite, signalled = rt.summed([
                train_loss / rt.world_size,
                (elapsed + synced - clock) * rt.master, nonfinite,
                signals.caught])
            if nonfinite:
                raise checkpoint.diverged(out_dir, step)
            last_step = last_step or signalled
            saving = saving or last_step
            step_s = (elapsed - synced_elapsed) / (step - synced_step)
            synced_step, synced_elapsed = step, elapsed
            epoch = step / steps_per_epoch
            logger.log({"step": step, "epoch": epoch, "loss": loss,
                        "lr": lr, "grad_norm": grad_norm.item(),
                        "ms_per_step": 1000 * step_s, "elapsed": elapsed})
            eta = (max_steps - step) * step_s / 3600
            print0(f"step {step:6d}/{max_steps} | epoch {epoch:.2f} | loss "
                   f"{loss:.4f} | grad norm {grad_norm:.3f} | "
                   f"{1000 * step_s:.0f} ms/step | eta {eta:.2f} h")
            if saving:
                checkpoint.save_checkpoint(out_dir, model, opt, step,
                                           elapsed, run_record)
            if signalled:
                print0(f"stopped by signal at step {step}, saved in "
                       f"{time.time() - synced:.1f} s: continue with "
                       f"--init_from=resume")
            clock = time.time()
        # no evaluation after a signal's save; the last one follows the loop
        if eval_interval and step % eval_interval == 0 and not last_step:
            evaluate()
    signals.release()
    if step == max_steps:
        evaluate()
    if rt.torchrun:
        torch.distributed.barrier()  # rank 0 may still write: leave together
        torch.distributed.destroy_process_group()
    if signals.caught:  # as a process the signal ended
        raise SystemExit(128 + signals.caught)
