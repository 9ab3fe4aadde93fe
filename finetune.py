"""
Fine-tunes a T5 on Super-Natural-Instructions (SNI) and reports Rouge-L on
its held-out test tasks, as the nanoT5 paper does, with Tk-Instruct's
recipe (definition + 2 positive examples, at most 100 instances a task).
    git clone https://github.com/allenai/natural-instructions
    python finetune.py --init_from=out/t5_base  # a train.py run, or HF weights
    python finetune.py --init_from=out/finetune --eval_only=True --out_dir=out/eval
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
import distributed
import runtime
from data import micro_batch_size
from model import T5, T5Config
from optim import OPTIMIZERS, Pace, make_optimizer, param_groups
from runtime import atomic_write, print0

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
    """the file that lists the tasks of SNI's default train or test split"""
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
        task_names = [line.strip() for line in f if line.strip()]
    examples = []
    for name in task_names:
        path = os.path.join(data_dir, "tasks", name + ".json")
        with open(path, encoding="utf-8") as f:
            task = json.load(f)
        # a list in today's task files: Tk-Instruct takes the first
        definition = task["Definition"]
        if isinstance(definition, list):
            definition = definition[0]
        positives = [(example["input"], example["output"])
                     for example in task["Positive Examples"]]
        instances = task["Instances"]
        if split == "test":  # SNI's label-balanced test instances come first
            instances = instances[:100]
        # a task's draw, whatever the tasks before it drew
        rng = random.Random(f"{seed}-{name}")
        count = min(max_num_instances_per_task, len(instances))
        for i in sorted(rng.sample(range(len(instances)), count)):
            instance = instances[i]
            references = instance["output"]
            examples.append(dict(
                task=name, id=instance.get("id") or f"{name}-{i}",
                definition=definition, positives=positives,
                input=instance["input"], references=references,
                target=rng.choice(references)))
    return examples

def end_with_punctuation(text):
    # as Tk-Instruct ends the definition and each input and output line
    return text if text[-1] in string.punctuation else text + "."

def build_prompt(definition, positives, instance_input, num_pos_examples=2):
    """Tk-Instruct's "definition + positive examples" prompt, spacing and
    periods included"""
    dot = end_with_punctuation
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
    """adds prompt, input_ids and labels (both ending in EOS) to an
    example, within the limits"""
    # the most examples that fit: Tk-Instruct adds them while they fit
    most = min(num_pos_examples, len(example["positives"]))
    for k in range(most, -1, -1):
        prompt = build_prompt(example["definition"], example["positives"],
                              example["input"], k)
        input_ids = tokenizer.encode(prompt) + [eos_id]
        if len(input_ids) <= max_input_length:
            break
    if len(input_ids) > max_input_length:
        input_ids = input_ids[:max_input_length - 1] + [eos_id]
        # what the model sees, for predictions.jsonl
        prompt = tokenizer.decode(input_ids[:-1])
    target = tokenizer.encode(example["target"].strip())
    labels = target[:max_target_length - 1] + [eos_id]
    return dict(example, prompt=prompt, input_ids=input_ids, labels=labels)

def collate(examples, pad_id):
    """A batch, the model's arguments: input_ids, labels and
    attention_mask, right-padded to a multiple of 8; labels with -100
    (ignored)"""
    def pad(sequences, value):
        tensors = [torch.tensor(s) for s in sequences]
        padded = pad_sequence(tensors, batch_first=True,
                              padding_value=value)
        return F.pad(padded, (0, -padded.size(1) % 8), value=value)
    inputs = [ex["input_ids"] for ex in examples]
    return dict(input_ids=pad(inputs, pad_id),
                labels=pad([ex["labels"] for ex in examples], -100),
                attention_mask=pad([[1] * len(x) for x in inputs], 0))

@lru_cache(maxsize=1)
def rougeL_scorer():  # built once; imported here: the import takes seconds
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

def rouge_l(prediction, references):
    """Tk-Instruct's Rouge-L: rouge-score's F-measure, Porter stemmer, the
    best reference, x 100"""
    scores = rougeL_scorer().score_multi(references, prediction)
    return 100.0 * scores["rougeL"].fmeasure

def compute_metrics(records):
    """Rouge-L averaged over the examples (not over the tasks' means), as
    Tk-Instruct reports it"""
    scores = [rouge_l(r["prediction"], r["references"]) for r in records]
    return dict(rougeL=mean(scores), num_examples=len(scores))

def generate_predictions(model, examples, tokenizer, batch_size,
                         max_new_tokens, device, autocast, rank=0,
                         world_size=1):
    """greedy predictions of this rank's share of the examples, (index in
    examples, text) pairs. Every rank runs as many batches: under FSDP,
    the same model calls."""
    # sorted by length, a batch's prompts need little padding
    shard = sorted(range(rank, len(examples), world_size),
                   key=lambda i: len(examples[i]["input_ids"]))
    # fewer examples than ranks: a rank with none decodes one too; and the
    # shares are made even
    shard = shard or [0]
    shard += shard[-1:] * (-(-len(examples) // world_size) - len(shard))
    eos_id = model.config.eos_token_id
    predictions = []
    starts = range(0, len(shard), batch_size)
    for start in tqdm(starts, desc="generating", unit="batch",
                      disable=rank != 0):
        indices = shard[start:start + batch_size]
        batch = collate([examples[i] for i in indices],
                        model.config.pad_token_id)
        with autocast():
            generated = model.generate(batch["input_ids"].to(device),
                                       batch["attention_mask"].to(device),
                                       max_new_tokens)
        for i, ids in zip(indices, generated.tolist()):
            ids = ids[:ids.index(eos_id)] if eos_id in ids else ids
            # decoded as Tk-Instruct does
            text = tokenizer.decode(ids, skip_special_tokens=True)
            predictions.append((i, text))
    return predictions

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configurator.py")).read())
    check_config(config, [
        ("optimizer", optimizer in OPTIMIZERS,
         f"one of {', '.join(OPTIMIZERS)}"),
        ("out_dir", out_dir and not os.path.isfile(out_dir), "a folder's path"),
        ("data_dir", not os.path.isfile(data_dir), "a folder's path"),
        ("dropout", 0 <= dropout < 1, "in [0, 1)"),
        ("grad_clip", grad_clip >= 0, ">= 0 (0: no clipping)"),
        ("max_steps", max_steps >= 0, ">= 0 (0: epochs)"),
        ("eval_interval", eval_interval >= 0, ">= 0 (0: at the end)"),
        ("seed", 0 <= seed < 2**32, "in [0, 2**32), as numpy takes it"),
        ("init_from", init_from not in ("scratch", "auto"),
         "the weights to fine-tune (a run, Hugging Face's), or resume: its "
         "run's newest checkpoint"),
        runtime.wandb_rule(wandb_log),
        *[(key, config[key] >= 0, ">= 0")
          for key in ("weight_decay", "num_pos_examples")],
        *[(key, config[key] > 0, "> 0") for key in (
            "lr", "batch_size", "grad_accum_steps", "epochs", "log_interval",
            "checkpoint_interval", "max_input_length", "max_target_length",
            "eval_batch_size", "max_new_tokens",
            "max_num_instances_per_task")],
    ])
    sni_split(data_dir, "test")
    rt = runtime.setup_runtime(device, dtype, seed, fsdp)
    distributed.join(rt)
    micro_batch = micro_batch_size(batch_size, grad_accum_steps,
                                   rt.world_size)
    lock = runtime.claim(out_dir)  # one live run per out_dir, as train.py's
    # the model, and the tokenizer it was pre-trained with, which its
    # checkpoint carries: this run's newest checkpoint, or what init_from
    # names; a new run writes over no other run's files
    how, ckpt = checkpoint.start_from(init_from, out_dir, "finetune.py",
                                      config, ("optimizer", "weight_decay"),
                                      fsdp=fsdp)
    resuming = how == "resume"
    tokenizer = checkpoint.tokenizer_of(ckpt, init_from)
    t5_config = T5Config(**ckpt["model_config"])
    with torch.device("meta"):
        model = T5(dataclasses.replace(t5_config, dropout=dropout))
    # dynamic: prompts of many lengths
    train_model = distributed.wrap_model(model, rt, fsdp, compile,
                                         dynamic=True)
    checkpoint.load_weights(model, ckpt)
    print0(f"{model.num_params() / 1e6:.1f}M parameters from {init_from}")

    def tokenized_split(split):
        examples = load_split(data_dir, split, max_num_instances_per_task,
                              seed)
        limits = (max_input_length, max_target_length, num_pos_examples)
        eos_id = model.config.eos_token_id
        return [tokenize_example(ex, tokenizer, eos_id, *limits)
                for ex in examples]
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
    # what its checkpoints record besides the state: the pre-training
    # data's meta, the tokenizer, the wandb run (a resume continues it)
    wandb_id = ckpt.get("wandb_id") if resuming else None
    # the weights it fine-tunes, which metrics.json names: a step folder, HF's
    weights = ckpt["weights"] if resuming else ckpt.get("shards", init_from)
    identity = dict(program="finetune.py", config=config)
    run = dict(identity, meta=ckpt["meta"], tokenizer=tokenizer.data,
               wandb_id=wandb_id, weights=weights)
    ckpt = None  # free the checkpoint's copy of the weights
    logger = runtime.Logger(out_dir, rt.master, step if resuming else None,
                            identity)
    if wandb_log:
        run["wandb_id"] = logger.start_wandb(wandb_project, wandb_run_name,
                                             config, wandb_id)

    @lru_cache(maxsize=1)
    def epoch_order(epoch):
        # of (seed, epoch) alone: a resumed run sees the batches it would have
        generator = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(len(train_examples), generator=generator)
        return order.tolist()

    def micro_batches(step):
        """this rank's micro-batches of step: input_ids, labels and
        attention_mask each"""
        epoch, i = divmod(step, steps_per_epoch)
        order = epoch_order(epoch)
        batches = []
        for micro_step in range(grad_accum_steps):
            rows = (micro_step * rt.world_size + rt.rank) * micro_batch
            first = i * batch_size + rows
            examples = [train_examples[j]
                        for j in order[first:first + micro_batch]]
            batch = collate(examples, model.config.pad_token_id)
            batches.append({k: t.to(rt.device) for k, t in batch.items()})
        return batches

    def evaluate():
        """greedy predictions of every test example, spread over the
        ranks; rank 0 scores them"""
        model.eval()
        predictions = generate_predictions(
            model, test_examples, tokenizer, eval_batch_size, max_new_tokens,
            rt.device, rt.autocast, rt.rank, rt.world_size)
        model.train()
        predictions = [p for shard in distributed.all_gathered(predictions)
                       for p in shard]
        if not rt.master:
            return
        texts = dict(predictions)
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
        print0(f"step {step}: Rouge-L {metrics['rougeL']:.2f} on "
               f"{metrics['num_examples']:,} test examples; predictions in "
               f"{path}")

    # the loop, as train.py's, with the same calls
    sync = distributed.Sync(rt)
    pace = Pace(max_steps, 0.0, step, elapsed)  # a step's time
    model.train()
    start_step = step
    clock = time.time()
    last_step = step >= max_steps
    while not last_step:
        # the loss: the mean over the step's label tokens, on every rank: a
        # micro-batch's weighs as many tokens as it holds (DDP and FSDP
        # average the ranks' gradients)
        batches = micro_batches(step)
        tokens = [(batch["labels"] != -100).sum() for batch in batches]
        step_tokens = distributed.sum_over_ranks(rt, torch.stack(tokens).sum())
        train_loss = 0.0
        for micro_step, (batch, n) in enumerate(zip(batches, tokens)):
            last = micro_step == grad_accum_steps - 1
            distributed.sync_gradients(train_model, last)
            with rt.autocast():
                _, loss = train_model(**batch)
            weight = n * rt.world_size / step_tokens
            (loss * weight).backward()
            train_loss += loss.detach() * weight
        grad_norm = distributed.clip_grad_norm(model, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        last_step = sync.step_done(step, train_loss, grad_norm,
                                   step == max_steps)
        if step == start_step + 1:  # the optimizer state exists
            distributed.print_memory(model, opt, rt)
            distributed.set_timeout(rt, distributed.TRAIN_TIMEOUT)
        if (last_step or step % log_interval == 0
                or step % checkpoint_interval == 0):
            synced = time.time()
            agreed = sync.agree(train_loss, elapsed + synced - clock)
            if agreed.diverged:
                raise checkpoint.diverged(out_dir, step)
            elapsed = agreed.elapsed
            last_step = last_step or agreed.signalled
            step_s = pace.synced(step, elapsed)
            epoch = step / steps_per_epoch
            logger.log({"step": step, "epoch": epoch, "loss": agreed.loss,
                        "lr": lr, "grad_norm": grad_norm.item(),
                        "ms_per_step": 1000 * step_s, "elapsed": elapsed})
            eta = (max_steps - step) * step_s / 3600
            print0(f"step {step:6d}/{max_steps} | epoch {epoch:.2f} | loss "
                   f"{agreed.loss:.4f} | grad norm {grad_norm.item():.3f} | "
                   f"{1000 * step_s:.0f} ms/step | eta {eta:.2f} h")
            if last_step or step % checkpoint_interval == 0:
                with distributed.patiently(rt):
                    checkpoint.save_checkpoint(out_dir, model, opt, step,
                                               elapsed, run)
            if agreed.signalled:
                print0(f"stopped by signal at step {step}, saved in "
                       f"{time.time() - synced:.1f} s: continue with "
                       f"--init_from=resume")
            clock = time.time()
        # no evaluation after a signal's save; the last one follows the loop
        if eval_interval and step % eval_interval == 0 and not last_step:
            evaluate()
    sync.release()
    if step == max_steps:
        evaluate()
    if rt.ddp:
        torch.distributed.barrier()  # rank 0 may still write: leave together
        torch.distributed.destroy_process_group()
    if sync.caught:  # as a process the signal ended
        raise SystemExit(128 + sync.caught)
