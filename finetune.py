"""
Fine-tunes a T5 on Super-Natural-Instructions (SNI) and reports Rouge-L on its held-out test tasks,
as the nanoT5 paper does, with Tk-Instruct's recipe (definition + 2 positive examples, at most 100
instances per task).
    git clone https://github.com/allenai/natural-instructions
    python finetune.py --init_from=out/t5_base         # a train.py run, or Hugging Face weights
    python finetune.py --init_from=out/finetune --eval_only=True --out_dir=out/eval  # evaluation
    torchrun --standalone --nproc_per_node=4 finetune.py --init_from=out/xl --fsdp=True
"""
import dataclasses
import json
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
import runtime
from data import micro_batch_size
from model import T5, T5Config
from optim import OPTIMIZERS, make_optimizer, param_groups
from runtime import atomic_write, print0

# -------------------------------------------------------------------------------------------------
# default config: nanoT5's fine-tuning run (task/ft.yaml) on Tk-Instruct's data
# I/O
data_dir = "natural-instructions"  # a clone of allenai/natural-instructions
init_from = "out"  # a run of train.py or finetune.py, Hugging Face weights, or 'resume'
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
batch_size = 8  # examples per optimizer step, over all micro steps and DDP ranks
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
compile = False  # every new padded prompt length would compile again
fsdp = False  # under torchrun: FSDP2 sharding instead of DDP
seed = 1337
# logging: log.jsonl always; wandb too, if asked for
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = ""  # '' -> out_dir's folder name
# -------------------------------------------------------------------------------------------------

def sni_split(data_dir, split):
    """the file that lists the tasks of SNI's default train or test split"""
    path = os.path.join(data_dir, "splits", "default", f"{split}_tasks.txt")
    if not os.path.isfile(path):
        raise SystemExit(f"error: no SNI split file {path}: get the data with "
                         f"`git clone https://github.com/allenai/natural-instructions {data_dir}`")
    return path

def load_split(data_dir, split, max_num_instances_per_task, seed):
    """SNI's default train or test split, a dict per example, read as Tk-Instruct reads it"""
    with open(sni_split(data_dir, split), encoding="utf-8") as f:
        task_names = [line.strip() for line in f if line.strip()]
    examples = []
    for name in task_names:
        with open(os.path.join(data_dir, "tasks", name + ".json"), encoding="utf-8") as f:
            task = json.load(f)
        definition = task["Definition"]  # a list in current task files: Tk-Instruct takes the first
        definition = definition[0] if isinstance(definition, list) else definition
        positives = [(example["input"], example["output"]) for example in task["Positive Examples"]]
        instances = task["Instances"]
        if split == "test":
            instances = instances[:100]  # SNI's label-balanced evaluation instances come first
        rng = random.Random(f"{seed}-{name}")  # per task: its draw is not the tasks' before it's
        count = min(max_num_instances_per_task, len(instances))
        for i in sorted(rng.sample(range(len(instances)), count)):
            instance = instances[i]
            examples.append(dict(task=name, id=instance.get("id") or f"{name}-{i}",
                                 definition=definition, positives=positives, input=instance["input"],
                                 references=instance["output"], target=rng.choice(instance["output"])))
    return examples

def end_with_punctuation(text):
    # as Tk-Instruct ends the definition and every input/output line
    return text if text[-1] in string.punctuation else text + "."

def build_prompt(definition, positives, instance_input, num_pos_examples=2):
    """Tk-Instruct's "definition + positive examples" prompt, spacing and periods included."""
    prompt = end_with_punctuation("Definition: " + definition.strip()) + "\n\n"
    for i, (example_input, example_output) in enumerate(positives[:num_pos_examples]):
        prompt += f" Positive Example {i + 1} -\n"
        prompt += end_with_punctuation(f"Input: {example_input.strip()}") + "\n"
        prompt += end_with_punctuation(f" Output: {example_output.strip()}") + "\n\n"
    prompt += "Now complete the following example -\n"
    prompt += end_with_punctuation(f"Input: {instance_input.strip()}") + "\n"
    return prompt + "Output: "

def tokenize_example(example, tokenizer, eos_id, max_input_length, max_target_length,
                     num_pos_examples):
    """adds prompt, input_ids and labels (both ending in EOS) to an example, within the limits"""
    # the most examples that fit: what Tk-Instruct's adding them while they fit comes to
    for k in range(min(num_pos_examples, len(example["positives"])), -1, -1):
        prompt = build_prompt(example["definition"], example["positives"], example["input"], k)
        input_ids = tokenizer.encode(prompt) + [eos_id]
        if len(input_ids) <= max_input_length:
            break
    if len(input_ids) > max_input_length:
        input_ids = input_ids[:max_input_length - 1] + [eos_id]
        prompt = tokenizer.decode(input_ids[:-1])  # what the model sees, for predictions.jsonl
    labels = tokenizer.encode(example["target"].strip())[:max_target_length - 1] + [eos_id]
    return dict(example, prompt=prompt, input_ids=input_ids, labels=labels)

def collate(examples, pad_id):
    """A batch, the model's arguments: input_ids, labels and attention_mask, right-padded to a
    multiple of 8; labels with -100 (ignored)"""
    def pad(sequences, value):
        tensors = [torch.tensor(s) for s in sequences]
        padded = pad_sequence(tensors, batch_first=True, padding_value=value)
        return F.pad(padded, (0, -padded.size(1) % 8), value=value)
    return dict(input_ids=pad([ex["input_ids"] for ex in examples], pad_id),
                labels=pad([ex["labels"] for ex in examples], -100),
                attention_mask=pad([[1] * len(ex["input_ids"]) for ex in examples], 0))

@lru_cache(maxsize=1)
def rougeL_scorer():  # built once for all predictions; imported here, as its import takes seconds
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

def rouge_l(prediction, references):
    """Tk-Instruct's Rouge-L: rouge-score's F-measure, Porter stemmer, the best reference, x 100"""
    return 100.0 * rougeL_scorer().score_multi(references, prediction)["rougeL"].fmeasure

def compute_metrics(records):
    """Rouge-L averaged over all examples (not over the tasks' means), as Tk-Instruct reports it"""
    scores = [rouge_l(r["prediction"], r["references"]) for r in records]
    return dict(rougeL=mean(scores), num_examples=len(scores))

def generate_predictions(model, examples, tokenizer, batch_size, max_new_tokens, device, autocast,
                         rank=0, world_size=1):
    """greedy predictions for this rank's share of the examples, as (index in examples, text) pairs.
    Every rank runs as many batches (under FSDP, the same model calls)."""
    # sorted by length, a batch's prompts need little padding
    shard = sorted(range(rank, len(examples), world_size),
                   key=lambda i: len(examples[i]["input_ids"]))
    shard = shard or [0]  # fewer examples than ranks: a rank with none decodes one, as the others
    shard += shard[-1:] * (-(-len(examples) // world_size) - len(shard))  # repeats even the shares
    eos_id = model.config.eos_token_id
    predictions = []
    starts = range(0, len(shard), batch_size)
    for start in tqdm(starts, desc="generating", unit="batch", disable=rank != 0):
        indices = shard[start:start + batch_size]
        batch = collate([examples[i] for i in indices], model.config.pad_token_id)
        with autocast():
            generated = model.generate(batch["input_ids"].to(device),
                                       batch["attention_mask"].to(device), max_new_tokens)
        for i, ids in zip(indices, generated.tolist()):
            ids = ids[:ids.index(eos_id)] if eos_id in ids else ids
            predictions.append((i, tokenizer.decode(ids, skip_special_tokens=True)))  # Tk-Instruct's
    return predictions

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    runtime.check_config(config, [
        ("optimizer", optimizer in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
        ("out_dir", out_dir and not os.path.isfile(out_dir), "a folder's path"),
        ("dropout", 0 <= dropout < 1, "in [0, 1)"),
        ("grad_clip", grad_clip >= 0, ">= 0 (0: no clipping)"),
        ("max_steps", max_steps >= 0, ">= 0 (0: epochs)"),
        ("eval_interval", eval_interval >= 0, ">= 0 (0: at the end)"),
        ("seed", 0 <= seed < 2**32, "in [0, 2**32), as numpy takes it"),
        ("init_from", init_from not in ("scratch", "auto"), "the weights to fine-tune (a run, "
         "Hugging Face's), or resume: its run's newest checkpoint"),
        runtime.wandb_rule(wandb_log),
        *[(key, globals()[key] >= 0, ">= 0") for key in ("weight_decay", "num_pos_examples")],
        *[(key, globals()[key] > 0, "> 0") for key in (
            "lr", "batch_size", "grad_accum_steps", "epochs", "log_interval", "checkpoint_interval",
            "max_input_length", "max_target_length", "eval_batch_size", "max_new_tokens",
            "max_num_instances_per_task")],
    ])
    sni_split(data_dir, "test")
    rt = runtime.setup_runtime(device, dtype, seed, fsdp)
    micro_batch = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)
    lock = runtime.claim(out_dir)  # one live run per out_dir, as train.py's
    # the model, and the tokenizer it was pre-trained with, which its checkpoint carries: this
    # run's newest checkpoint, or what init_from names; a new run writes over no other run's files
    how, ckpt = checkpoint.start_from(init_from, out_dir, "finetune.py", config,
                                      ("optimizer", "weight_decay"), fsdp=fsdp)
    resuming = how == "resume"
    tokenizer = checkpoint.tokenizer_of(ckpt, init_from)
    with torch.device("meta"):
        model = T5(dataclasses.replace(T5Config(**ckpt["model_config"]), dropout=dropout))
    train_model = runtime.wrap_model(model, rt, fsdp, compile, dynamic=True)  # of many lengths
    checkpoint.load_weights(model, ckpt)
    print0(f"{model.num_params() / 1e6:.1f}M parameters from {init_from}")

    def tokenized_split(split):
        examples = load_split(data_dir, split, max_num_instances_per_task, seed)
        limits = (max_input_length, max_target_length, num_pos_examples)
        eos_id = model.config.eos_token_id
        return [tokenize_example(ex, tokenizer, eos_id, *limits) for ex in examples]
    test_examples = tokenized_split("test")
    train_examples = [] if eval_only else tokenized_split("train")
    print0(f"{len(train_examples):,} train and {len(test_examples):,} test examples")
    steps_per_epoch = len(train_examples) // batch_size
    if not eval_only and not steps_per_epoch:
        raise SystemExit(f"error: {len(train_examples)} train examples make no full batch of "
                         f"{batch_size}: lower batch_size or raise max_num_instances_per_task")
    max_steps = 0 if eval_only else max_steps or epochs * steps_per_epoch

    opt = make_optimizer(optimizer, param_groups(model, weight_decay), lr)
    step, elapsed = checkpoint.restore_state(ckpt, model, opt) if resuming else (0, 0.0)
    for group in opt.param_groups:
        group["lr"].fill_(lr)  # a resume's --lr, not its checkpoint's
    # what its checkpoints record besides the state: the pre-training data's meta, the tokenizer,
    # the wandb run (a resume continues it)
    run = dict(program="finetune.py", config=config, meta=ckpt["meta"], tokenizer=tokenizer.data,
               wandb_id=ckpt.get("wandb_id") if resuming else None)
    ckpt = None  # free the checkpoint's copy of the weights
    logger = runtime.Logger(out_dir, rt.master, step if resuming else None,
                            dict(program="finetune.py", config=config))
    if wandb_log:
        run["wandb_id"] = logger.start_wandb(wandb_project, wandb_run_name, config, run["wandb_id"])

    @lru_cache(maxsize=1)
    def epoch_order(epoch):
        # a pure function of (seed, epoch): a resumed run sees the batches it would have
        generator = torch.Generator().manual_seed(seed + epoch)
        return torch.randperm(len(train_examples), generator=generator).tolist()

    def micro_batches(step):
        """this rank's micro-batches of step: dicts of input_ids, labels and attention_mask"""
        epoch, i = divmod(step, steps_per_epoch)
        batches = []
        for micro_step in range(grad_accum_steps):
            first = i * batch_size + (micro_step * rt.world_size + rt.rank) * micro_batch
            examples = [train_examples[j] for j in epoch_order(epoch)[first:first + micro_batch]]
            batch = collate(examples, model.config.pad_token_id)
            batches.append({key: t.to(rt.device) for key, t in batch.items()})
        return batches

    def evaluate():
        """greedy predictions of all test examples, spread over the ranks; rank 0 scores them"""
        model.eval()
        predictions = generate_predictions(model, test_examples, tokenizer, eval_batch_size,
                                           max_new_tokens, rt.device, rt.autocast, rt.rank,
                                           rt.world_size)
        model.train()
        predictions = [p for shard in runtime.all_gathered(predictions) for p in shard]
        if not rt.master:
            return
        texts = dict(predictions)
        records = [dict(task=ex["task"], id=ex["id"], prompt=ex["prompt"], prediction=texts[i],
                        references=ex["references"]) for i, ex in enumerate(test_examples)]
        metrics = dict(compute_metrics(records), step=step, init_from=init_from)
        with atomic_write(os.path.join(out_dir, "predictions.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        with atomic_write(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        logger.log({"step": step, "rougeL": metrics["rougeL"]})
        print0(f"step {step}: Rouge-L {metrics['rougeL']:.2f} on {metrics['num_examples']:,} test "
               f"examples; predictions in {out_dir}/predictions.jsonl")

    # the loop, as train.py's: the ranks agree at log and checkpoint steps (runtime.agree, Signals)
    signals = runtime.Signals(rt)
    model.train()
    last_log = step
    nonfinite = 0  # the steps since the last log whose loss or grad norm was NaN or inf
    t_log = time.time()
    last_step = step >= max_steps
    while not last_step:
        # the loss is the mean over the step's label tokens, on every rank: a micro-batch's mean
        # weighs as many tokens as it holds (DDP and FSDP average the ranks' gradients)
        batches = micro_batches(step)
        tokens = [(batch["labels"] != -100).sum() for batch in batches]
        step_tokens = torch.stack(tokens).sum()
        if rt.ddp:
            torch.distributed.all_reduce(step_tokens)
        train_loss = 0.0
        for micro_step, (batch, batch_tokens) in enumerate(zip(batches, tokens)):
            runtime.sync_gradients(train_model, micro_step == grad_accum_steps - 1)
            with rt.autocast():
                _, loss = train_model(**batch)
            weight = batch_tokens * rt.world_size / step_tokens
            (loss * weight).backward()
            train_loss += loss.detach() * weight
        grad_norm = runtime.clip_grad_norm(model, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        nonfinite = nonfinite + ~torch.isfinite(train_loss + grad_norm)
        last_step = step == max_steps or signals.stop_now(step)
        if step % log_interval == 0 or step % checkpoint_interval == 0 or last_step:
            mean_loss, nonfinite, signalled = runtime.agree(rt, train_loss / rt.world_size,
                                                            nonfinite, signals.caught)
            if nonfinite:
                raise checkpoint.diverged(out_dir, step)
            last_step = last_step or signalled > 0
            dt = (time.time() - t_log) / (step - last_log)
            elapsed += time.time() - t_log
            t_log, last_log = time.time(), step
            logger.log({"step": step, "epoch": step / steps_per_epoch, "loss": mean_loss, "lr": lr,
                        "grad_norm": grad_norm.item(), "ms_per_step": 1000 * dt, "elapsed": elapsed})
            print0(f"step {step:6d}/{max_steps} | epoch {step / steps_per_epoch:.2f} | "
                   f"loss {mean_loss:.4f} | grad norm {grad_norm.item():.3f} | "
                   f"{1000 * dt:.0f} ms/step | eta {(max_steps - step) * dt / 3600:.2f} h")
            saving = time.time()
            if last_step or step % checkpoint_interval == 0:
                runtime.set_timeout(rt, runtime.START_TIMEOUT)  # the ranks wait for the slowest
                checkpoint.save_checkpoint(out_dir, model, opt, step, elapsed, run)
            if signalled:
                print0(f"stopped by signal at step {step}, saved in {time.time() - saving:.1f} "
                       f"s: continue with --init_from=resume")
        if eval_interval and step % eval_interval == 0 and not last_step:  # no evaluation after a
            evaluate()  # signal's save, and the last step's comes after the loop
    signals.release()
    if step == max_steps:
        evaluate()
    if rt.ddp:
        torch.distributed.barrier()  # rank 0 may still be writing: the ranks leave together
        torch.distributed.destroy_process_group()
    if signals.caught:  # as a process the signal ended
        raise SystemExit(128 + signals.caught)
