"""
Fine-tunes a T5 on Super-Natural-Instructions (SNI) and reports Rouge-L on its held-out test tasks,
as the nanoT5 paper does, with Tk-Instruct's recipe (definition + 2 positive examples, at most 100
instances per task).
    git clone https://github.com/allenai/natural-instructions
    python finetune.py --init_from=out/t5_base         # a train.py run, or Hugging Face weights
    python finetune.py --init_from=out/finetune --eval_only=True --out_dir=out/eval   # evaluate only
    torchrun --standalone --nproc_per_node=4 finetune.py --init_from=out/xl --fsdp=True
"""
import errors  # first: from here on an error, or Ctrl-C, is one line, not a traceback
import dataclasses
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

from checkpoint import (check_init_from, check_resume, claim_out_dir, load_checkpoint, load_weights,
                        read_weights, restore_state, run_state, save_checkpoint)
from data import micro_batch_size
from files import UserError, atomic_write, reading, reason
from model import T5
from optim import check_optimizer, make_optimizer, param_groups
from prepare import load_tokenizer
from runtime import (DTYPES, Logger, Sync, check_device, check_wandb, print0,
                     setup_runtime, wrap_model)

def sni_split(data_dir, split="test"):
    """the file that lists the tasks of SNI's default split, in data_dir; the rule for data_dir"""
    path = os.path.join(data_dir, "splits", "default", f"{split}_tasks.txt")
    if not os.path.isfile(path):
        raise UserError(f"no SNI split file {path}: get the data with "
                        f"`git clone https://github.com/allenai/natural-instructions {data_dir}`")
    return path

# -------------------------------------------------------------------------------------------------
# default config: nanoT5's fine-tuning run (task/ft.yaml) on Tk-Instruct's data
valid = {}
# I/O
data_dir = "natural-instructions"  # a clone of allenai/natural-instructions
init_from = "out/ckpt.pt"  # a run of train.py or finetune.py, Hugging Face weights, or 'resume'
out_dir = "out/finetune"
eval_only = False  # only evaluate init_from on the test tasks
wandb_log = False
wandb_project = "nanoT5"
wandb_run_name = "finetune"
valid.update(data_dir=sni_split, init_from=check_init_from, out_dir="folder", eval_only="any",
             wandb_log=check_wandb, wandb_project="non-empty", wandb_run_name="any")
# data
max_num_instances_per_task = 100
num_pos_examples = 2
max_input_length = 1024  # tokens, EOS included
max_target_length = 128
valid.update(max_num_instances_per_task="> 0", num_pos_examples=">= 0", max_input_length="> 0",
             max_target_length="> 0")
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
valid.update(optimizer=check_optimizer, lr="> 0", weight_decay=">= 0", grad_clip=">= 0",
             batch_size="> 0", grad_accum_steps="> 0", epochs="> 0", max_steps=">= 0", dropout="in [0, 1)")
# intervals, in optimizer steps as in train.py, and evaluation
eval_interval = 0  # Rouge-L on the test tasks; 0: only at the end
log_interval = 10
checkpoint_interval = 1000
eval_batch_size = 32
max_new_tokens = 128
valid.update(eval_interval=">= 0", log_interval="> 0", checkpoint_interval="> 0",
             eval_batch_size="> 0", max_new_tokens="> 0")
# system
device = "auto"  # cuda > mps > cpu
dtype = "float32"  # as the paper's fine-tuning numbers
compile = False  # every new padded prompt length would compile again
fsdp = False  # under torchrun: FSDP2 sharding instead of DDP
seed = 1337
valid.update(device=check_device, dtype=DTYPES, compile="any", fsdp="any", seed=">= 0")
# -------------------------------------------------------------------------------------------------

def read_task(path):
    """One SNI task file as a dict; an exception says what is wrong with it."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    definition = raw["Definition"]  # a list in current task files: Tk-Instruct takes the first
    definition = definition[0] if isinstance(definition, list) else definition
    positives = [(example["input"], example["output"]) for example in raw["Positive Examples"]]
    if not all(isinstance(text, str) for text in [definition, *(t for pair in positives for t in pair)]):
        raise ValueError("its definition or a positive example is not text")
    if not raw["Instances"]:
        raise ValueError("it has no instances")
    instances = []
    for i, instance in enumerate(raw["Instances"]):
        references = instance.get("output")
        if not (isinstance(references, list) and references and isinstance(instance.get("input"), str)
                and all(isinstance(text, str) for text in references)):
            raise ValueError(f"instance {i} is not an 'input' text with a list of 'output' texts")
        instances.append((instance.get("id"), instance["input"], references))
    return dict(definition=definition, positives=positives, instances=instances)

def load_split(data_dir, split, max_num_instances_per_task, seed):
    """SNI's default train or test split, a dict per example; one warning names the tasks skipped."""
    split_file = sni_split(data_dir, split)
    not_text = f"{{path}} is not UTF-8 text ({{reason}}): is {data_dir} a clone of allenai/natural-instructions?"
    with reading(split_file, not_text), open(split_file, encoding="utf-8") as f:
        task_names = [line.strip() for line in f if line.strip()]
    examples, skipped = [], []
    for name in task_names:
        try:
            task = read_task(os.path.join(data_dir, "tasks", name + ".json"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            skipped.append(f"{name} ({reason(e)})")
            continue
        instances = task["instances"]
        if split == "test":
            instances = instances[:100]  # SNI's label-balanced evaluation instances come first
        rng = random.Random(f"{seed}-{name}")  # per task: its draw doesn't depend on the tasks before
        chosen = sorted(rng.sample(range(len(instances)), min(max_num_instances_per_task, len(instances))))
        for i in chosen:
            instance_id, instance_input, references = instances[i]
            examples.append(dict(task=name, id=instance_id or f"{name}-{i}", definition=task["definition"],
                                 positives=task["positives"], input=instance_input,
                                 references=references, target=rng.choice(references)))
    if skipped:
        print0(f"warning: skipped {len(skipped)} of {len(task_names)} {split} task files: "
               f"{'; '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
    if not examples:
        raise UserError(f"no usable task in {split_file}: {'; '.join(skipped[:3])}")
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

def tokenize_example(example, tokenizer, eos_id, max_input_length, max_target_length, num_pos_examples):
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
    """Tk-Instruct's Rouge-L: rouge-score's F-measure with the Porter stemmer, best reference, x 100"""
    scores = [rougeL_scorer().score(target=ref, prediction=prediction)["rougeL"] for ref in references]
    return 100.0 * max(score.fmeasure for score in scores)

def exact_match(prediction, references):
    """Tk-Instruct's: SQuAD's normalization, lowercase, no punctuation, one space (articles stay)"""
    def normalize(text):
        return " ".join(text.lower().translate(str.maketrans("", "", string.punctuation)).split())
    return 100.0 * any(normalize(prediction) == normalize(ref) for ref in references)

def compute_metrics(records):
    """Rouge-L and exact match averaged over all examples, as Tk-Instruct reports them, and per task"""
    scores = [dict(task=r["task"], rougeL=rouge_l(r["prediction"], r["references"]),
                   exact_match=exact_match(r["prediction"], r["references"])) for r in records]

    def summary(rows):
        return dict(rougeL=mean(row["rougeL"] for row in rows),
                    exact_match=mean(row["exact_match"] for row in rows), num_examples=len(rows))
    tasks = sorted({row["task"] for row in scores})
    return dict(summary(scores), per_task={task: summary([row for row in scores if row["task"] == task])
                                           for task in tasks})

def generate_predictions(model, examples, tokenizer, batch_size, max_new_tokens, device, autocast,
                         rank=0, world_size=1):
    """greedy predictions for this rank's share of the examples, as (index in examples, text) pairs.
    Every rank runs as many batches (under FSDP, the same model calls)."""
    # sorted by length, a batch's prompts need little padding
    shard = sorted(range(rank, len(examples), world_size), key=lambda i: len(examples[i]["input_ids"]))
    shard = shard or [0]  # fewer examples than ranks: a rank with none decodes one again, as the others do
    shard += shard[-1:] * (-(-len(examples) // world_size) - len(shard))  # a repeat evens the shares
    eos_id = model.config.eos_token_id
    predictions = []
    for start in tqdm(range(0, len(shard), batch_size), desc="generating", unit="batch", disable=rank != 0):
        indices = shard[start:start + batch_size]
        batch = collate([examples[i] for i in indices], model.config.pad_token_id)
        with autocast():
            generated = model.generate(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                       max_new_tokens)
        for i, ids in zip(indices, generated.tolist()):
            ids = ids[:ids.index(eos_id)] if eos_id in ids else ids
            predictions.append((i, tokenizer.decode(ids, skip_special_tokens=True)))  # as Tk-Instruct
    return predictions

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    rt = setup_runtime(device, dtype, seed, fsdp)
    micro_batch = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)
    # before any work: no run writes over another run's files, or shares its out_dir
    resuming = init_from == "resume"
    claim_out_dir(out_dir, rt, fresh=not resuming, program="finetune.py")  # held till exit

    # the model, and the tokenizer it was pre-trained with: this run's checkpoint, or init_from's
    ckpt_path = os.path.join(out_dir, "ckpt" if fsdp else "ckpt.pt")  # FSDP: a folder of shards
    resumed = None
    if resuming:
        resumed = load_checkpoint(ckpt_path, program="finetune.py", weights=not fsdp)
        check_resume(resumed, ckpt_path, config, resumed["meta"], fixed=("optimizer",))
    t5_config, weights, meta = read_weights(resumed or init_from, fsdp)
    with torch.device("meta"):
        model = T5(dataclasses.replace(t5_config, dropout=dropout))
    train_model = wrap_model(model, rt, fsdp, compile, dynamic=True)  # batches of many lengths
    load_weights(model, weights)
    tokenizer = load_tokenizer(meta, init_from, model.config.vocab_size)
    print0(f"{model.num_params() / 1e6:.1f}M parameters from {init_from}")

    def tokenized_split(split):
        examples = load_split(data_dir, split, max_num_instances_per_task, seed)
        limits = (max_input_length, max_target_length, num_pos_examples)
        return [tokenize_example(ex, tokenizer, model.config.eos_token_id, *limits) for ex in examples]
    test_examples = tokenized_split("test")
    train_examples = [] if eval_only else tokenized_split("train")
    print0(f"{len(train_examples):,} train and {len(test_examples):,} test examples")
    steps_per_epoch = len(train_examples) // batch_size
    if not eval_only and not steps_per_epoch:
        raise UserError(f"{len(train_examples)} train examples make no full batch of {batch_size}: "
                        f"lower batch_size or raise max_num_instances_per_task")
    max_steps = 0 if eval_only else max_steps or epochs * steps_per_epoch

    opt = make_optimizer(optimizer, param_groups(model, weight_decay), lr)
    step, elapsed = restore_state(resumed, model, opt)  # optimizer steps done, seconds
    for group in opt.param_groups:
        group["lr"].fill_(lr)  # a resume's --lr, not its checkpoint's
    weights = resumed = None  # free the checkpoint's copy of the weights
    logger = Logger(out_dir, rt.master, resume_step=step if resuming else None, config=config)

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
        """greedy predictions of all test examples, spread over the ranks; rank 0 scores, writes them"""
        model.eval()
        predictions = generate_predictions(model, test_examples, tokenizer, eval_batch_size, max_new_tokens,
                                           rt.device, rt.autocast, rt.rank, rt.world_size)
        model.train()
        if rt.ddp:
            shards = [None] * rt.world_size
            torch.distributed.all_gather_object(shards, predictions)
            predictions = [p for shard in shards for p in shard]
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
        logger.log({"step": step, "rougeL": metrics["rougeL"], "exact_match": metrics["exact_match"]})
        print0(f"step {step}: Rouge-L {metrics['rougeL']:.2f} | exact match {metrics['exact_match']:.2f} on "
               f"{metrics['num_examples']:,} test examples of {len(metrics['per_task'])} tasks; "
               f"predictions in {out_dir}/predictions.jsonl")

    sync = Sync(rt, ckpt_path, step, elapsed)  # the ranks agree at log and checkpoint steps
    model.train()
    t_log = time.time()
    steps_since_log = 0
    last_step = step >= max_steps
    while not last_step:
        # forward and backward over this rank's micro-batches, the gradients summed; clip; update.
        # The loss is the mean over the step's label tokens, on every rank: a micro-batch's mean
        # weighs as many tokens as it holds (DDP and FSDP average the ranks' gradients)
        batches = micro_batches(step)
        tokens = [(batch["labels"] != -100).sum() for batch in batches]
        step_tokens = torch.stack(tokens).sum()
        if rt.ddp:
            torch.distributed.all_reduce(step_tokens)
        train_loss = 0.0
        for micro_step, (batch, batch_tokens) in enumerate(zip(batches, tokens)):
            last_micro_step = micro_step == grad_accum_steps - 1
            if rt.ddp and not fsdp:  # DDP all-reduces the gradients once, after the last micro-step
                train_model.require_backward_grad_sync = last_micro_step
            if fsdp:  # HSDP's all-reduce across nodes, likewise
                model.set_requires_all_reduce(last_micro_step)
            with rt.autocast():
                _, loss = train_model(**batch)
            weight = batch_tokens * rt.world_size / step_tokens
            (loss * weight).backward()
            train_loss += loss.detach() * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
        if fsdp:
            grad_norm = grad_norm.full_tensor()  # the norm of all ranks' slices together
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        steps_since_log += 1
        sync.watch(train_loss, grad_norm)
        last_step = step == max_steps or sync.stop_now(step)  # Ctrl-C or SIGTERM: saved, stopped
        if step % log_interval == 0 or step % checkpoint_interval == 0 or last_step:
            mean_loss, elapsed, signalled = sync.agree(step, train_loss)  # a NaN ends the run unsaved
            last_step = last_step or signalled
            dt = (time.time() - t_log) / steps_since_log
            t_log = time.time()
            steps_since_log = 0
            logger.log({"step": step, "epoch": step / steps_per_epoch, "loss": mean_loss, "lr": lr,
                        "grad_norm": grad_norm.item(), "ms_per_step": 1000 * dt, "elapsed": elapsed})
            print0(f"step {step:6d}/{max_steps} | epoch {step / steps_per_epoch:.2f} | "
                   f"loss {mean_loss:.4f} | grad norm {grad_norm.item():.3f} | "
                   f"{1000 * dt:.0f} ms/step | eta {(max_steps - step) * dt / 3600:.2f} h")
            if last_step or step % checkpoint_interval == 0:
                state = run_state(model, opt, step, elapsed, config, meta, "finetune.py")
                with sync.paused():
                    save_checkpoint(ckpt_path, state)
        if eval_interval and step % eval_interval == 0 and step < max_steps:
            with sync.paused():
                evaluate()
    sync.release()
    if step == max_steps:
        evaluate()
    if rt.ddp:
        torch.distributed.barrier()  # rank 0 may still be writing: the ranks leave together
        torch.distributed.destroy_process_group()
