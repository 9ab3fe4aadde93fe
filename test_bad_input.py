"""
Bad input to the six scripts, as one table (CASES): a command a user might type, words its error line must say, and
its fix. Every row is checked three ways: the script ends with one line `error: ...` on stderr (a non-zero exit code,
no traceback, no hang); every checkpoint, shard, meta.json and result the row can reach is byte-identical afterwards;
and the fix the line names, once done, gets past that error.
One table rather than a table per test file: the promise is the same for every script, and so is the check.

How the rows run. Most run in this process, one by one (in_process): runpy runs the script with its argv in the repo,
its output captured, and an exception that escapes it becomes what errors.py's hook would print (errors.one_line; a
traceback fails the row). torch is imported already, so such a row takes milliseconds, not the ~3 s of CPU a fresh
interpreter spends importing; what a process keeps to itself (cwd, signal handlers, out_dir locks) is put back after
each run. That checks every rule and its message. The rows in END_TO_END, a few per script and per kind of error, run
as `python script.py args` in a fresh interpreter (in_subprocess), meanwhile, on the other core: they show the real
hook at work, the line last on stderr, no traceback, a non-zero exit code. Every fix runs in this process.
"""
import contextlib
import fcntl
import glob
import gzip
import io
import json
import os
import random
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from model import T5, T5Config
from optim import make_optimizer, param_groups
from prepare import prepare
from checkpoint import OUT_DIR_LOCKS, run_state, save_checkpoint, save_pretrained

ctrl_c = signal.getsignal(signal.SIGINT)
from errors import one_line  # noqa: E402
signal.signal(signal.SIGINT, ctrl_c)  # importing errors makes Ctrl-C end the process at once: leave pytest its own

REPO = os.path.dirname(os.path.abspath(__file__))
SYSTEM = ["--device=cpu", "--dtype=float32", "--compile=False"]
# each script's base command; a case adds its bad arguments, which win over these
TRAIN = ["train.py", "config/t5_tiny.py", *SYSTEM, "--model=t5-tiny", "--data_dir={data}", "--out_dir={run}",
         "--init_from=resume", "--input_length=64", "--batch_size=8", "--max_steps=2", "--eval_steps=1"]
FINETUNE = ["finetune.py", *SYSTEM, "--data_dir={sni}", "--out_dir={ftrun}", "--init_from=resume",
            "--max_num_instances_per_task=4", "--batch_size=4", "--max_steps=1", "--max_new_tokens=4"]
PREPARE = ["prepare.py", "--dataset={corpus}", "--tokenizer=train", "--vocab_size=64", "--out_dir={prepared}",
           "--shard_tokens=1000", "--num_proc=1"]
BENCH = ["bench.py", *SYSTEM, "--model=t5-tiny", "--input_length=32", "--steps=1", "--burn_in=0"]
SAMPLE = ["sample.py", "--device=cpu", "--init_from={run}", "--max_new_tokens=4", "--num_samples=1"]
EXPORT = ["export.py", "--init_from={run}", "--out_dir={tmp}/hf"]
BASES = (TRAIN, FINETUNE, PREPARE, BENCH, SAMPLE, EXPORT)
# a new one-step run in the case's own folder: the fix of a command line that never got to run
FRESH_TRAIN = ["train.py", "config/t5_tiny.py", *SYSTEM, "--model=t5-tiny", "--data_dir={data}", "--out_dir={tmp}/out",
               "--input_length=64", "--batch_size=8", "--max_steps=1", "--eval_steps=1"]
WORDS_5000 = " ".join(["word"] * 5000)  # Python's parser runs out of memory on it

# (name, command, words the error line must contain, its fix). In commands, {tmp} is the case's own empty folder, and
# each case gets its own copy of the places in OWN_COPIES it names: {run} (a train.py run with a checkpoint), {ftrun}
# (a finetune.py run with one), {sharded} (a train.py --fsdp=True run, its checkpoint a folder), {prepared} (a
# prepared folder), damaged copies of it, a run's folder holding only a log ({logonly}), and tiny Hugging Face weights
# without their tokenizer ({nospiece}). The others are shared: {data} the prepared folder, {other} a copy with other
# settings, {locked} a run another process holds, {ckpt} a checkpoint to fine-tune, {hfweights} Hugging Face weights,
# {miniweights} t5-mini's, {smallvocab} and {bigvocab} weights of vocabs {data}'s tokenizer beside them does not make,
# {bigvocabrun} a run of such a model, {nostate}, {nometadata} and {cutshard} damaged copies of {sharded}, {sni} an
# SNI clone, {corpus} the text {data} was prepared from, {bad} bad files, {results} a finished finetune.py evaluation.
# "hide:package" runs the case as if that package were not installed.
# A fix is what the error line says to do: "undo", the script's base command without the mistake (one run serves every
# row that undoes to it); args that replace or join the case's, or a whole command (starting with a script);
# "suggested": run the command the line quotes, then the case's again; "follow": the --key=value it names; "installed":
# the case again, nothing hidden; or a function, done to the case's places, then the case again.
CASES = [
    # 1. every key is checked against its declared range, before any work; values that used to hang
    ("train lr", [*TRAIN, "--lr=-1.0"], "config key 'lr' is -1.0; it must be > 0", "undo"),
    ("train noise_density 1 (hung)", [*TRAIN, "--noise_density=1.0"], "'noise_density' is 1.0; it must be in (0, 1)",
     "undo"),
    ("train mean span", [*TRAIN, "--mean_noise_span_length=0.5"], "'mean_noise_span_length' is 0.5; it must be >= 1",
     "undo"),
    ("train input_length", [*TRAIN, "--input_length=0"], "'input_length' is 0; it must be >= 3", "undo"),
    ("train grad_accum_steps", [*TRAIN, "--grad_accum_steps=0"], "'grad_accum_steps' is 0; it must be > 0", "undo"),
    ("train log_interval", [*TRAIN, "--log_interval=0"], "'log_interval' is 0", "undo"),
    ("train checkpoint_interval", [*TRAIN, "--checkpoint_interval=-5"], "'checkpoint_interval' is -5", "undo"),
    ("train eval_steps (NaN)", [*TRAIN, "--eval_steps=0"], "'eval_steps' is 0; it must be > 0", "undo"),
    ("train max_steps 0", [*TRAIN, "--max_steps=0"], "'max_steps' is 0; it must be > 0", "undo"),
    ("train seed", [*TRAIN, "--seed=-1"], "'seed' is -1; it must be >= 0", "undo"),
    ("train out_dir empty", [*TRAIN, "--out_dir="], "'out_dir' is ''; it must be non-empty", "undo"),
    ("train dtype", [*TRAIN, "--dtype=float16"], "'dtype' is 'float16'; it must be one of 'float32', 'tfloat32'",
     "undo"),
    ("train lr_schedule", [*TRAIN, "--lr_schedule=cosin"], "did you mean 'cosine'?", "undo"),
    ("train device", [*TRAIN, "--device=tpu"], "device 'tpu' is not one this code runs on", "undo"),
    ("train batch split", [*TRAIN, "--batch_size=12", "--grad_accum_steps=8"], "must split evenly", "undo"),
    ("finetune eval_batch_size", [*FINETUNE, "--eval_batch_size=0"], "'eval_batch_size' is 0; it must be > 0", "undo"),
    ("finetune max_new_tokens", [*FINETUNE, "--max_new_tokens=-1"], "'max_new_tokens' is -1", "undo"),
    ("finetune epochs", [*FINETUNE, "--epochs=0"], "'epochs' is 0; it must be > 0", "undo"),
    ("finetune lr", [*FINETUNE, "--lr=0.0"], "'lr' is 0.0; it must be > 0", "undo"),
    ("finetune max_input_length", [*FINETUNE, "--max_input_length=0"], "'max_input_length' is 0", "undo"),
    ("finetune batch split", [*FINETUNE, "--batch_size=3", "--grad_accum_steps=2"], "must split evenly", "undo"),
    ("train fsdp without torchrun", [*TRAIN, "--fsdp=True"], "fsdp=True shards the model over the ranks torchrun",
     "undo"),
    ("finetune fsdp without torchrun", [*FINETUNE, "--fsdp=True"], "launch with torchrun --nproc_per_node=N", "undo"),
    ("prepare shard_tokens 0 (hung)", [*PREPARE, "--shard_tokens=0"], "'shard_tokens' is 0; it must be > 0", "undo"),
    ("prepare num_proc", [*PREPARE, "--num_proc=0"], "'num_proc' is 0; it must be > 0", "undo"),
    ("prepare max_train_tokens", [*PREPARE, "--max_train_tokens=-5"], "'max_train_tokens' is -5; it must be >= 0",
     "undo"),
    ("prepare val_fraction 0", [*PREPARE, "--val_fraction=0.0"], "'val_fraction' is 0.0; it must be in (0, 1)", "undo"),
    ("prepare vocab_size", [*PREPARE, "--vocab_size=0"], "'vocab_size' is 0; it must be in [1, 65436]", "undo"),
    ("bench steps", [*BENCH, "--steps=0"], "'steps' is 0; it must be > 0", "undo"),
    ("bench burn_in", [*BENCH, "--burn_in=-1"], "'burn_in' is -1; it must be >= 0", "undo"),
    ("bench part", [*BENCH, "--part=dat"], "did you mean 'data'?", "undo"),
    ("bench noise_density (hung)", [*BENCH, "--noise_density=1.0"], "'noise_density' is 1.0", "undo"),
    ("bench model", [*BENCH, "--model=t5-tiy"], "did you mean 't5-tiny'?", "undo"),
    ("bench compare", [*BENCH, "--part=optim", "--compare=hf"], "compare 'hf' is not valid here", "undo"),
    ("bench batch split", [*BENCH, "--batch_size=6", "--grad_accum_steps=4"], "must split evenly", "undo"),
    # 2. an out_dir is never clobbered, and two runs never write one
    ("train scratch over a checkpoint", [*TRAIN, "--init_from=scratch"], "pass --init_from=resume",
     ["--init_from=resume"]),
    ("finetune over a checkpoint", [*FINETUNE, "--init_from={ckpt}"], "pass --init_from=resume",
     ["--init_from=resume"]),
    ("train scratch over a sharded checkpoint", [*TRAIN, "--out_dir={sharded}", "--init_from=scratch"],
     "sharded/ckpt exists and this run would replace it", ["--init_from=resume"]),
    ("train out_dir in use", [*TRAIN, "--out_dir={locked}"], "is writing", ["--out_dir={tmp}/out"]),
    ("finetune out_dir in use", [*FINETUNE, "--out_dir={locked}", "--optimizer=adamwscale"], "is writing",
     ["--out_dir={tmp}/out"]),
    ("train out_dir not writable", [*TRAIN, "--init_from=scratch", "--out_dir={bad}/latin1.txt/out"],
     "can't write to out_dir", ["--out_dir={tmp}/out"]),
    # 3. data is verified before it is trusted
    ("train shard cut short", [*TRAIN, "--data_dir={short}"], "train_001.bin holds 500 tokens, not the 1,000",
     "suggested"),
    ("train val.bin lost", [*TRAIN, "--data_dir={noval}"], "val.bin is missing: rebuild it with `python prepare.py",
     "suggested"),
    ("bench shard cut short", [*BENCH, "--data_dir={short}"], "train_001.bin holds 500 tokens", "suggested"),
    ("prepare unreadable tokenizer", [*PREPARE, "--out_dir={tmp}/data", "--tokenizer={bad}/garbage.model"],
     "as a sentencepiece model", "undo"),
    ("finetune corrupt checkpoint", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={bad}/garbage.pt"],
     "corrupt or unreadable", "undo"),
    # 4. a resume is the run it resumes
    ("train resume, other model", [*TRAIN, "--model=t5-v1_1-small"], "model 't5-tiny' -> 't5-v1_1-small'", "undo"),
    ("train resume, other optimizer", [*TRAIN, "--optimizer=adafactor"], "optimizer 'adamwscale' -> 'adafactor'",
     "undo"),
    ("train resume, other data", [*TRAIN, "--data_dir={other}"], "data.max_val_tokens 10000000 -> 5000", "undo"),
    ("finetune resume, other optimizer", [*FINETUNE, "--optimizer=adafactor"], "optimizer 'adamw' -> 'adafactor'",
     "undo"),
    ("train resume of an FSDP run without fsdp", [*TRAIN, "--out_dir={sharded}"], "holds the shards of an FSDP run",
     ["--fsdp=True"]),
    # 5. every file error is a message
    ("prepare not UTF-8", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/latin1.txt"],
     "latin1.txt: 'utf-8' codec can't decode", "undo"),
    ("prepare truncated jsonl.gz", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/cut.jsonl.gz"],
     "could not read", "undo"),
    ("prepare truncated txt.gz", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/cut.txt.gz"],
     "cut.txt.gz: Compressed file ended", "undo"),
    ("prepare not gzip", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/plain.jsonl.gz"], "could not read",
     "undo"),
    ("prepare out_dir not writable", [*PREPARE, "--out_dir={bad}/latin1.txt/data"], "Not a directory", "undo"),
    ("train config file not UTF-8", ["train.py", "{bad}/latin1.txt"], "is not UTF-8 text", FRESH_TRAIN),
    ("train config file a folder", ["train.py", "{bad}"], "can't be read: Is a directory", FRESH_TRAIN),
    ("finetune split file not UTF-8", [*FINETUNE, "--data_dir={bad}/sni"], "test_tasks.txt is not UTF-8 text", "undo"),
    ("finetune HF folder without config.json", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={bad}/hf"],
     "config.json: No such file", "undo"),
    ("train HF folder without config.json", [*TRAIN, "--out_dir={tmp}/out", "--init_from={bad}/hf"],
     "config.json: No such file", "undo"),
    # 6. a run continues only a run of its own kind, and never replaces results it did not make
    ("finetune resume of a train.py run", [*FINETUNE, "--out_dir={run}"], "was written by train.py",
     ["--init_from={run}/ckpt.pt", "--out_dir={tmp}/out"]),
    ("finetune eval over finished results", [*FINETUNE, "--init_from={ckpt}", "--eval_only=True",
                                             "--out_dir={results}"], "metrics.json exists and this run would replace",
     ["--out_dir={tmp}/out"]),
    ("train resume of a plain state dict", [*TRAIN, "--out_dir={bad}/statedict"], "was written by another program",
     ["--init_from={bad}/statedict/ckpt.pt", "--out_dir={tmp}/out"]),
    # 7. data is what its meta.json says, and the values given with it agree
    ("train tokenizer of another folder", [*TRAIN, "--data_dir={othertok}"], "is not the tokenizer", "suggested"),
    ("train vocab_size against the folder", [*TRAIN, "--vocab_size=1000"], "with vocab_size 64, not 1000", "undo"),
    ("train meta.json without a key", [*TRAIN, "--data_dir={nometa}"], "it has no 'eos_id'", "undo"),
    ("train shard one byte long", [*TRAIN, "--data_dir={longshard}"], "holds 1,000 tokens and a byte, not the 1,000",
     "suggested"),
    ("train data_dir a file", [*TRAIN, "--data_dir={corpus}"], "it must be a folder, not a file", "undo"),
    ("train log.jsonl damaged", [*TRAIN, "--out_dir={badlog}"], "line 2 of",
     lambda places, line: delete_line(os.path.join(places["badlog"], "log.jsonl"), 2)),
    # 8. config files are Python assignments; numbers are finite and usable
    ("train YAML config", ["train.py", "{bad}/config.yaml"], "config files are Python assignments (key = value)",
     FRESH_TRAIN),
    ("train JSON config", ["train.py", "{bad}/config.json"], "config files are Python assignments (key = value)",
     FRESH_TRAIN),
    ("train config that sets nothing", ["train.py", "{bad}/empty.py"], "sets no config key", FRESH_TRAIN),
    ("train lr inf", [*TRAIN, "--lr=1e999"], "'lr' is inf; it must be a finite number", "undo"),
    ("train seed of 20 digits", [*TRAIN, "--seed=12345678901234567890"], "it must be below 2**63", "undo"),
    # 9. a message names the real cause
    ("prepare dataset a folder", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/sni"], "is a folder", "undo"),
    ("prepare csv", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/data.csv"], "data.csv is not a .txt/", "undo"),
    ("prepare bad line late", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/late.jsonl",
                               "--tokenizer={data}/tokenizer.model"], "on line 30001", "undo"),
    ("finetune init_from a missing folder", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={tmp}/run"],
     "run does not exist: pass a run of train.py or finetune.py", "undo"),
    # 10. a value is what the user typed, and nothing overrides it unseen
    ("train config file after a --key", ["train.py", *SYSTEM, "--lr=0.1", "config/t5_tiny.py"],
     "config file 'config/t5_tiny.py' comes after --device", [*FRESH_TRAIN, "--lr=0.1"]),
    ("train a value of 5,000 words", [*TRAIN, f"--lr={WORDS_5000}"], "config key 'lr' in --lr must be float, got 'word",
     "undo"),
    ("train max_steps of 200 brackets", [*TRAIN, "--max_steps=" + "[" * 200], "'max_steps' in --max_steps must be int",
     "undo"),
    # 11. sample.py takes only what the model was trained on
    ("sample sentinel 100", [*SAMPLE, "--text=a <extra_id_100> b"], "knows only <extra_id_0> to <extra_id_99>", "undo"),
    ("sample sentinel 5000", [*SAMPLE, "--text=a <extra_id_5000> b"], "knows only <extra_id_0> to <extra_id_99>",
     "undo"),
    ("sample sentinel twice", [*SAMPLE, "--text=a <extra_id_0> b <extra_id_0>"], "<extra_id_0> twice", "undo"),
    ("sample 100,000 new tokens", [*SAMPLE, "--max_new_tokens=100000"], "'max_new_tokens' is 100000; it must be in",
     "undo"),
    ("sample 100,000 samples", [*SAMPLE, "--num_samples=100000"], "windows for this run: ask for at most", "undo"),
    # 12. an out_dir belongs to the run that wrote anything into it
    ("train over a run killed before its checkpoint", [*TRAIN, "--init_from=scratch", "--out_dir={logonly}"],
     "log.jsonl exists and this run would replace it: pass another --out_dir", ["--out_dir={tmp}/out"]),
    ("finetune eval into a train.py run", [*FINETUNE, "--init_from={ckpt}", "--eval_only=True", "--out_dir={run}"],
     "ckpt.pt exists and this run would replace it: pass another --out_dir", ["--out_dir={tmp}/out"]),
    ("finetune into a train.py run", [*FINETUNE, "--init_from={ckpt}", "--out_dir={run}"],
     "would replace it: pass another --out_dir", ["--out_dir={tmp}/out"]),
    # 13. meta.json is what its tokenizer says
    ("train meta.json edited", [*TRAIN, "--data_dir={edited}"], "meta.json records first_sentinel_id 162, not 163",
     lambda places, line: os.remove(os.path.join(places["edited"], "meta.json")) or run_quoted(line)),
    # 14. export.py: a command, self-contained, that replaces nothing
    ("export a missing run", [*EXPORT, "--init_from={tmp}/nothing"], "nothing does not exist", "undo"),
    ("export over a file", [*EXPORT, "--out_dir={corpus}"], "it must be a folder, not a file", "undo"),
    ("export into a non-empty folder", [*EXPORT, "--out_dir={results}"], "is not empty, and export.py replaces no",
     "undo"),
    ("export Hugging Face weights", [*EXPORT, "--init_from={hfweights}"], "is not a run of train.py or finetune.py",
     "undo"),
    # 15. a run that does nothing says why
    ("train resume at max_steps", [*TRAIN, "--max_steps=1"], "is at step 1 of max_steps=1", "undo"),
    ("train resume with its time budget spent", [*TRAIN, "--out_dir={spent}", "--time_budget_hours=0.5"],
     "has spent its time budget, 1.00 h of time_budget_hours=0.5", ["--time_budget_hours=2.0"]),
    # 16. every hint works when followed
    ("train init_from a data folder", [*TRAIN, "--out_dir={tmp}/out", "--init_from={data}"],
     "is a prepared data folder, not a run", "undo"),
    ("finetune init_from a data folder", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={data}"],
     "is a prepared data folder, not a run", "undo"),
    ("train init_from Resume", [*TRAIN, "--init_from=Resume"], "did you mean --init_from=resume?", "follow"),
    ("train init_from resume/", [*TRAIN, "--init_from=resume/"], "did you mean --init_from=resume?", "follow"),
    ("prepare vocab_size below the corpus's characters", [*PREPARE, "--out_dir={tmp}/data", "--vocab_size=3"],
     "is smaller than required_chars; use --vocab_size=", "follow"),
    # 17. a missing optional package is one line that says what to install
    ("train without wandb", [*TRAIN, "--wandb_log=True", "hide:wandb"], "pip install wandb", "undo"),
    ("train Hugging Face weights without safetensors", [*TRAIN, "--out_dir={tmp}/out", "--init_from={hfweights}",
                                                        "hide:safetensors"], "pip install safetensors", "installed"),
    ("export without safetensors", [*EXPORT, "hide:safetensors"], "pip install safetensors", "installed"),
    ("bench against transformers without it", [*BENCH, "--compare=hf", "hide:transformers"],
     "pip install transformers", "installed"),
    # 18. a checkpoint, one file or shards, damaged or named by one of its files, is one line that names the file
    ("sample shards without state.pt", [*SAMPLE, "--init_from={nostate}"], "ckpt/state.pt is corrupt or unreadable",
     "undo"),
    ("export shards cut short", [*EXPORT, "--init_from={cutshard}"], "__0_0.distcp is corrupt or unreadable (",
     "undo"),
    ("finetune from shards without .metadata", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={nometadata}"],
     "ckpt/.metadata is corrupt or unreadable", "undo"),
    ("train from shards cut short", [*TRAIN, "--out_dir={tmp}/out", "--init_from={cutshard}"],
     "train a new run in another --out_dir", ["--init_from=scratch"]),
    ("sample a file of a sharded checkpoint", [*SAMPLE, "--init_from={sharded}/ckpt/state.pt"],
     "is one file of the sharded checkpoint", "follow"),
    ("finetune init_from a folder with no run", [*FINETUNE, "--out_dir={tmp}/out", "--init_from=config"],
     "config holds no run or weights", "undo"),
    # 19. a new run is the shape of the weights it starts from
    ("train --model against its weights", [*TRAIN, "--out_dir={tmp}/out", "--init_from={miniweights}"],
     "--model=t5-tiny is not the shape of the weights", "follow"),
    # 20. a model reads only a tokenizer of its vocab
    ("sample an export without spiece.model", [*SAMPLE, "--init_from={nospiece}", "--text=a <extra_id_0> b"],
     "holds no spiece.model", lambda places, line: shutil.copy(os.path.join(places["data"], "tokenizer.model"),
                                                               os.path.join(places["nospiece"], "spiece.model"))),
    ("sample a tokenizer of more ids than the model", [*SAMPLE, "--init_from={smallvocab}", "--text=a <extra_id_0>"],
     "is not the model's: its 164 ids", "undo"),
    ("sample a tokenizer of fewer ids than the model", [*SAMPLE, "--init_from={bigvocab}", "--text=a <extra_id_0>"],
     "is not the model's: its 164 ids", "undo"),
    ("finetune a tokenizer not the model's", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={bigvocab}"],
     "is not the model's", "undo"),
    ("export a run whose tokenizer is not its model's", [*EXPORT, "--init_from={bigvocabrun}"], "is not the model's",
     "undo"),
]
OWN_COPIES = ("run", "ftrun", "prepared", "sharded", "short", "noval", "othertok", "longshard", "badlog", "edited",
              "spent", "nospiece")
SHARED = ("data", "other", "locked", "results", "nometa", "logonly", "hfweights", "nostate", "cutshard", "nometadata",
          "miniweights", "smallvocab", "bigvocab", "bigvocabrun")
# a folder whose sitecustomize.py hides the packages HIDDEN_PACKAGES names: importlib finds none of them
HIDING = """import os, sys
for name in os.environ.get("HIDDEN_PACKAGES", "").split(","):
    sys.modules[name] = None
"""

WORDS = ("the of and to in is was for on that with as by at from his her which an were are this be had not river city "
         "music history government science church army school village species family film league season album "
         "station county island war king game team water north south first two new").split()


def write_corpus(path, num_docs, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))}) + "\n")
    return str(path)


def write_sni(root, seed=0):
    """a Super-Natural-Instructions clone of one train and one test task"""
    rng = random.Random(seed)
    os.makedirs(root / "tasks")
    os.makedirs(root / "splits" / "default")
    for name in ("task001_copy", "task002_copy"):
        def example():
            text = " ".join(rng.sample(WORDS, 4))
            return {"input": text, "output": [text]}
        task = {"Definition": ["Copy the input."], "Positive Examples": [{"input": "a b", "output": "a b"}],
                "Instances": [dict(example(), id=f"{name}-{i}") for i in range(8)]}
        (root / "tasks" / f"{name}.json").write_text(json.dumps(task))
    (root / "splits" / "default" / "train_tasks.txt").write_text("task001_copy\n")
    (root / "splits" / "default" / "test_tasks.txt").write_text("task002_copy\n")


def tiny_t5(meta, vocab_size=None):
    return T5(T5Config(vocab_size=vocab_size or meta["model_vocab_size"], d_model=32, d_kv=8, d_ff=64, num_layers=1,
                       num_decoder_layers=1, num_heads=2))


def tiny_checkpoint(path, meta, config, optimizer, program="train.py", elapsed=0.0, vocab_size=None):
    """a checkpoint in train.py's format of a very small T5 (at a path not ending in .pt, a directory of shards, as
    --fsdp=True writes), at step 1"""
    t5 = tiny_t5(meta, vocab_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    opt = make_optimizer(optimizer, param_groups(t5, 0.0), 1e-3)
    state = run_state(t5, opt, 1, elapsed, dict(config, optimizer=optimizer), meta, program)
    save_checkpoint(path, state)


def delete_line(path, number):
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:number - 1] + lines[number:])


def run_quoted(line):
    """run the command an error line quotes between backticks, as the user would"""
    command = shlex.split(line.split("`")[1])
    assert command[0] == "python"
    r = in_process(command[1:])
    assert r.returncode == 0, r.stderr[-3000:]


def copy_data(data, to, damage):
    shutil.copytree(data, to)
    damage(to)
    return str(to)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    corpus = write_corpus(root / "corpus.jsonl", 400)
    data = str(root / "data")
    meta = prepare(dataset=corpus, tokenizer="train", out_dir=data, vocab_size=64, shard_tokens=1000)
    assert len(meta["train_shards"]) >= 3

    def cut_shard(folder):
        with open(folder / "train_001.bin", "r+b") as f:
            f.truncate(1000)

    def other_settings(folder):
        other = json.loads((folder / "meta.json").read_text())
        other["settings"]["max_val_tokens"] = 5000
        (folder / "meta.json").write_text(json.dumps(other))

    run_config = {"model": "t5-tiny", "dropout": 0.0, "lr": 1e-2}
    tiny_checkpoint(str(root / "run" / "ckpt.pt"), meta, run_config, "adamwscale")
    tiny_checkpoint(str(root / "ftrun" / "ckpt.pt"), meta, {}, "adamw", "finetune.py")
    tiny_checkpoint(str(root / "sharded" / "ckpt"), meta, run_config, "adamwscale")
    tiny_checkpoint(str(root / "pretrained" / "ckpt.pt"), meta, {}, "adamwscale")
    tiny_checkpoint(str(root / "spent" / "ckpt.pt"), meta, dict(run_config, time_budget_hours=1.0), "adamwscale",
                    elapsed=3600.0)
    tiny_checkpoint(str(root / "bigvocabrun" / "ckpt.pt"), meta, run_config, "adamwscale", vocab_size=384)
    # Hugging Face weights with the tokenizer of {data} beside them, as export.py writes them: tiny ones, t5-mini's
    # shape, and vocabs its tokenizer did not make; and tiny ones without their tokenizer
    for name, t5 in (("hfweights", tiny_t5(meta)), ("smallvocab", tiny_t5(meta, 128)), ("bigvocab", tiny_t5(meta, 384)),
                     ("miniweights", T5(T5Config.from_preset("t5-mini", vocab_size=meta["model_vocab_size"]))),
                     ("nospiece", tiny_t5(meta))):
        save_pretrained(t5, str(root / name))
        if name != "nospiece":
            shutil.copy(os.path.join(data, "tokenizer.model"), root / name / "spiece.model")
    (root / "logonly").mkdir()  # a run killed before its first checkpoint
    (root / "logonly" / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (root / "hide").mkdir()
    (root / "hide" / "sitecustomize.py").write_text(HIDING)
    shutil.copytree(root / "run", root / "locked")
    shutil.copytree(root / "run", root / "badlog")
    (root / "badlog" / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 1, "lo\n')
    write_sni(root / "sni")
    (root / "results").mkdir()
    (root / "results" / "metrics.json").write_text('{"rougeL": 40.7}')
    (root / "results" / "predictions.jsonl").write_text('{"prediction": "a finished run"}\n')

    def cut_distcp(folder):
        with open(folder / "ckpt" / "__0_0.distcp", "r+b") as f:
            f.truncate(1000)

    def without(name):
        return lambda folder: os.remove(folder / "ckpt" / name)

    nostate = copy_data(root / "sharded", root / "nostate", without("state.pt"))
    nometadata = copy_data(root / "sharded", root / "nometadata", without(".metadata"))
    cutshard = copy_data(root / "sharded", root / "cutshard", cut_distcp)

    def other_tokenizer(folder):
        smaller = prepare(dataset=corpus, tokenizer="train", out_dir=str(root / "smaller"), vocab_size=48)
        shutil.copy(os.path.join(smaller["data_dir"], "tokenizer.model"), folder / "tokenizer.model")

    def without_eos_id(folder):
        meta = json.loads((folder / "meta.json").read_text())
        del meta["eos_id"]
        (folder / "meta.json").write_text(json.dumps(meta))

    def one_byte_more(folder):
        with open(folder / "train_001.bin", "ab") as f:
            f.write(b"\0")

    def sentinels_moved(folder):
        meta = json.loads((folder / "meta.json").read_text())
        meta["first_sentinel_id"] -= 1
        (folder / "meta.json").write_text(json.dumps(meta))

    bad = root / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("caf\xe9 au lait\n\nna\xefve\n".encode("latin-1") * 50)
    (bad / "garbage.model").write_bytes(b"not a sentencepiece model")
    (bad / "garbage.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    lines = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(3000)).encode()
    (bad / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:4000])
    (bad / "cut.txt.gz").write_bytes(gzip.compress(b"\n\n".join(b"paragraph %d " % i * 20 for i in range(3000)))[:4000])
    (bad / "plain.jsonl.gz").write_bytes(lines[:1000])
    write_sni(bad / "sni")
    (bad / "sni" / "splits" / "default" / "test_tasks.txt").write_bytes(b"task\xe9\n")
    (bad / "hf").mkdir()
    (bad / "hf" / "model.safetensors").write_bytes(b"")
    (bad / "statedict").mkdir()
    torch.save({"w": torch.zeros(3)}, bad / "statedict" / "ckpt.pt")
    (bad / "config.yaml").write_text("lr: 0.01\nbatch_size: 8\n")
    (bad / "config.json").write_text('{"lr": 0.01, "batch_size": 8}\n')
    (bad / "empty.py").write_text("# a config file that sets nothing\n")
    (bad / "data.csv").write_text("text,label\nhello world,1\n")
    (bad / "late.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(30000))
                                    + '{"text": 5}\n')
    return dict(corpus=corpus, data=data, run=str(root / "run"), ftrun=str(root / "ftrun"),
                sharded=str(root / "sharded"), prepared=data,
                sni=str(root / "sni"), ckpt=str(root / "pretrained" / "ckpt.pt"), locked=str(root / "locked"),
                bad=str(bad), short=copy_data(data, root / "short", cut_shard),
                noval=copy_data(data, root / "noval", lambda folder: os.remove(folder / "val.bin")),
                other=copy_data(data, root / "other", other_settings), root=str(root), results=str(root / "results"),
                othertok=copy_data(data, root / "othertok", other_tokenizer), badlog=str(root / "badlog"),
                nometa=copy_data(data, root / "nometa", without_eos_id),
                longshard=copy_data(data, root / "longshard", one_byte_more),
                edited=copy_data(data, root / "edited", sentinels_moved), spent=str(root / "spent"),
                logonly=str(root / "logonly"), hfweights=str(root / "hfweights"), hide=str(root / "hide"),
                nostate=nostate, nometadata=nometadata, cutshard=cutshard, bigvocabrun=str(root / "bigvocabrun"),
                **{name: str(root / name) for name in ("miniweights", "smallvocab", "bigvocab", "nospiece")})


def snapshot(folders):
    """the bytes of every checkpoint, shard, tokenizer and meta.json in the folders"""
    patterns = ("ckpt.pt", "ckpt/*", "ckpt/.metadata", "*.bin", "tokenizer.model", "meta.json", "metrics.json",
                "predictions.jsonl", "log.jsonl")
    files = [p for folder in folders for pattern in patterns for p in glob.glob(os.path.join(folder, pattern))]
    return {p: open(p, "rb").read() for p in files}


def base_of(command):
    return next(base for base in BASES if command[:len(base)] == base)


def with_args(args, extra):
    """args with extra's --key=value in place of the same key's, as a user edits a command line"""
    keys = {arg.split("=")[0] for arg in extra if arg.startswith("--")}
    return [arg for arg in args if arg.split("=")[0] not in keys] + extra


# The rows run in a fresh interpreter, `python script.py args`: every script; each kind of error (a config key, a
# config file, a file, a resume, an out_dir another process holds, a package not installed); every row that hides a
# package. The other rows run in this process.
END_TO_END = {
    "train lr", "train config file not UTF-8", "train resume, other model", "train out_dir in use",
    "train without wandb", "train Hugging Face weights without safetensors", "finetune epochs",
    "finetune corrupt checkpoint", "prepare not UTF-8", "prepare out_dir not writable", "bench compare",
    "bench against transformers without it", "sample sentinel 100", "export into a non-empty folder",
    "export without safetensors",
}
TIMEOUT = 120  # seconds: a run still going after them has hung


def in_subprocess(args, hidden, places):
    """`python args` in a fresh interpreter, where the hidden packages can't be imported"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if hidden:
        env.update(PYTHONPATH=places["hide"], HIDDEN_PACKAGES=",".join(hidden))
    try:
        return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, "timeout", "", f"hung: no exit within {TIMEOUT} s\n")


class Hung(BaseException):
    """a run still going after TIMEOUT s: a BaseException, which a script's `except Exception` lets by"""


def hung(signum, frame):
    raise Hung


def in_process(args):
    """`python args` run in this process, as a completed process: its output, its exit code, and on stderr what
    errors.py's hook prints for an exception that escapes the script (one line, or a traceback)"""
    cwd, argv, threads = os.getcwd(), sys.argv, torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    stdout, stderr = io.StringIO(), io.StringIO()
    os.chdir(REPO)
    sys.argv = list(args)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in_subprocess: the fresh interpreters have the other core
    signal.signal(signal.SIGALRM, hung)
    signal.alarm(TIMEOUT)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(os.path.join(REPO, args[0]), run_name="__main__")
        code = 0
    except SystemExit as e:  # configurator.py has printed its line
        code = e.code or 0
    except Hung:
        stderr.write(f"hung: no exit within {TIMEOUT} s\n")
        code = "timeout"
    except Exception as e:
        stderr.write(f"{one_line(type(e), e) or traceback.format_exc()}\n")
        code = 1
    finally:  # what the process would have kept to itself, and dropped as it exited
        signal.alarm(0)
        for lock in OUT_DIR_LOCKS:  # its out_dir's
            if lock is not None:
                lock.close()
        OUT_DIR_LOCKS.clear()
        for s, handler in handlers.items():  # runtime.Sync sets them
            signal.signal(s, handler)
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # runtime.setup_runtime sets it on CPUs
        os.chdir(cwd)
        sys.argv = argv
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def set_up(name, command, places):
    """the case's folder, {tmp}, with its own copies of the places in OWN_COPIES it names: (its arguments, its
    places, the folders it can reach, the packages it hides)"""
    tmp = os.path.join(places["root"], "cases", re.sub(r"\W", "_", name))
    os.makedirs(tmp, exist_ok=True)
    named = [key for key in places if any("{" + key + "}" in arg for arg in command)]
    own = {key: shutil.copytree(places[key], os.path.join(tmp, key)) for key in OWN_COPIES if key in named}
    case_places = dict(places, tmp=tmp, **own)
    args = [arg.format(**case_places) for arg in command if not arg.startswith("hide:")]
    hidden = [arg.removeprefix("hide:") for arg in command if arg.startswith("hide:")]
    # the folders the case can reach, whose checkpoints and shards must come out as they went in
    reached = [case_places[key] for key in (*OWN_COPIES, *SHARED) if key in named]
    return args, case_places, reached, hidden


def run_fix(fix, args, case_places, line):
    """the case's command after the fix its error line names, done; None for "undo": its base command answers"""
    if fix == "undo":
        return None
    if fix == "suggested":
        run_quoted(line)
    elif fix == "follow":
        named = [word.rstrip("?.,;)") for word in line.split() if word.startswith("--") and "=" in word]
        args = with_args(args, named[-1:])
    elif fix == "installed":
        pass  # the same command, in this process, which hides nothing
    elif callable(fix):
        fix(case_places, line)
    elif fix[0].endswith(".py"):
        args = [arg.format(**case_places) for arg in fix]
    else:
        args = with_args(args, [arg.format(**case_places) for arg in fix])
    return in_process(args)


@pytest.fixture(scope="module")
def results(places):
    """{case name: (its run, files before, files after, the fixed command's run)}, and {index in BASES: its run}"""
    # another process holds the lock of this out_dir for as long as the cases run
    holder = open(os.path.join(places["locked"], "lock"), "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    cases = {name: set_up(name, command, places) for name, command, _, _ in CASES}

    def run_case(name):
        args, _, reached, hidden = cases[name]
        before = snapshot(reached)
        r = in_subprocess(args, hidden, places) if name in END_TO_END else in_process(args)
        return r, before, snapshot(reached)

    # the fresh interpreters, one at a time on one core, while this process runs the rest on the other
    with ThreadPoolExecutor(1) as pool:
        started = {name: pool.submit(run_case, name) for name in cases if name in END_TO_END}
        # the base commands, which the "undo" rows come back to
        results = {i: in_process(set_up(f"base {i}", base, places)[0]) for i, base in enumerate(BASES)}
        for name, _, _, fix in sorted(CASES, key=lambda case: case[0] in END_TO_END):  # this process's first
            r, before, after = started[name].result() if name in started else run_case(name)
            args, case_places, _, _ = cases[name]
            line = (r.stderr.strip().splitlines() or [""])[-1]
            results[name] = r, before, after, run_fix(fix, args, case_places, line)
    holder.close()
    return results


def test_the_table_covers_every_script():
    scripts = [command[0] for _, command, _, _ in CASES]
    assert len(CASES) >= 40 and all(scripts.count(s) >= 5 for s in ("train.py", "finetune.py", "prepare.py",
                                                                      "bench.py", "sample.py"))
    assert scripts.count("export.py") >= 4


def test_every_script_runs_end_to_end():
    commands = {name: command for name, command, _, _ in CASES}
    assert END_TO_END <= commands.keys()
    assert {commands[name][0] for name in END_TO_END} == {base[0] for base in BASES}
    # HIDING hides a package from a fresh interpreter only
    assert all(name in END_TO_END for name, command in commands.items() if any(a.startswith("hide:") for a in command))


@pytest.mark.parametrize("name, command, message, fix", CASES, ids=[name for name, _, _, _ in CASES])
def test_bad_input(results, name, command, message, fix):
    r, before, after, _ = results[name]
    lines = r.stderr.strip().splitlines()
    assert r.returncode not in (0, "timeout"), f"{r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert lines and lines[-1].startswith("error: ") and message in lines[-1], r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert after == before  # every checkpoint, shard and meta.json the case could reach, byte for byte


@pytest.mark.parametrize("name, command, message, fix", CASES, ids=[name for name, _, _, _ in CASES])
def test_the_fix_gets_past_the_error(results, name, command, message, fix):
    fixed = results[name][3]
    if fix == "undo":
        fixed = results[BASES.index(base_of(command))]
    lines = fixed.stderr.strip().splitlines()
    assert fixed.returncode != "timeout", fixed.stderr[-3000:]
    assert "Traceback" not in fixed.stderr + fixed.stdout, fixed.stderr[-3000:]
    assert fixed.returncode == 0 or (lines and message not in lines[-1]), fixed.stderr[-3000:]


# The README's first commands on a fresh clone, with no data and no run, offline: each ends in one line that says
# what to do, and each python command that line gives, run as written, does its work (the first command then gets
# past its error, or both are still at work after 30 s), or fails only for the network. A `git clone` is not run.
FIRST_COMMANDS = [
    "python train.py config/t5_base.py",
    'python sample.py --init_from=out/t5_tiny --text="The <extra_id_0> of a function is its <extra_id_1> ."',
    "python finetune.py --init_from=out/t5_base --out_dir=out/ft_ours",
    "python export.py --init_from=out/xl --out_dir=out/xl_hf",
]


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory):
    """the repo's files as a clone has them, without the tests: no data, no runs"""
    clone = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if not name.startswith("test_"):
            os.makedirs(os.path.dirname(clone / name), exist_ok=True)
            shutil.copy(os.path.join(REPO, name), clone / name)
    return clone


def as_written(command, cwd, timeout):
    """a README command line run in cwd, offline (no Hub, no downloads); returncode "timeout" if still at work"""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    args = [sys.executable, *shlex.split(command)[1:]]
    try:
        return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, "timeout", "", "")


@pytest.mark.parametrize("command", FIRST_COMMANDS)
def test_first_commands_say_what_to_do_and_the_hints_work(fresh_clone, command):
    assert command in open(os.path.join(REPO, "README.md")).read()
    r = as_written(command, fresh_clone, 120)
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and line.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for suggestion in re.findall(r"`(python [^`]*)`", line):
        done = as_written(suggestion, fresh_clone, 30)
        assert "Traceback" not in done.stderr, done.stderr
        if done.returncode not in (0, "timeout"):  # offline: the Hub is out of reach, the honest end
            assert "from the Hugging Face Hub" in done.stderr.strip().splitlines()[-1], done.stderr
        elif done.returncode == 0:
            again = as_written(command, fresh_clone, 30)
            assert again.returncode == "timeout" or not again.stderr.strip(), again.stderr
