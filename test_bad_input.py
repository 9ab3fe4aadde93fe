"""
Typed mistakes, as one table (CASES): a command a user might type with one mistake in it (a key, a value, a path, a
file the command needs, settings that contradict), words its error line must say, and its fix. Each row runs as
`python script.py args` in a process of its own, as a user runs it (forked from one that has imported torch:
test_train.forked), and is checked three ways: the script ends with one line `error: ...` on stderr (a non-zero
exit code, no traceback, no hang); every checkpoint, shard, meta.json and result the row can reach is
byte-identical afterwards; and the fix the line names, once done, gets past that error.
One table rather than a table per test file: the promise is the same for every script, and so is the check.
"""
import glob
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

from checkpoint import save_checkpoint
from hf import save_pretrained
from model import T5, T5Config
from optim import make_optimizer, param_groups
from prepare import prepare
from test_train import forked

REPO = os.path.dirname(os.path.abspath(__file__))
SYSTEM = ["--device=cpu", "--dtype=float32", "--compile=False"]
# each script's base command; a case adds its bad arguments, which win over these
TRAIN = ["train.py", "config/t5_tiny.py", *SYSTEM, "--model=t5-tiny", "--data_dir={data}", "--out_dir={run}",
         "--init_from=resume", "--input_length=64", "--batch_size=8", "--max_steps=2", "--eval_steps=1",
         "--time_budget_hours=0", "--warmup_steps=1"]
FINETUNE = ["finetune.py", *SYSTEM, "--data_dir={sni}", "--out_dir={ftrun}", "--init_from=resume",
            "--max_num_instances_per_task=4", "--batch_size=4", "--max_steps=1", "--max_new_tokens=4"]
PREPARE = ["prepare.py", "--dataset={corpus}", "--tokenizer=train", "--vocab_size=64", "--out_dir={prepared}",
           "--num_proc=1"]
BENCH = ["bench.py", *SYSTEM, "--model=t5-tiny", "--input_length=32", "--batch_size=1", "--steps=1", "--burn_in=0"]
SAMPLE = ["sample.py", "--device=cpu", "--init_from={run}", "--max_new_tokens=4"]
EXPORT = ["export.py", "--init_from={run}", "--out_dir={tmp}/hf"]
BASES = (TRAIN, FINETUNE, PREPARE, BENCH, SAMPLE, EXPORT)

# (name, command, words the error line must contain (or a list: a line each), its fix). In commands, {tmp} is the
# case's own empty folder, and each case gets its own copy of the places in OWN_COPIES it names: {run} (a train.py
# run with a checkpoint), {ftrun} (a finetune.py run with one), {prepared} (a prepared folder), copies with a shard
# cut short ({short}), with another folder's tokenizer.model ({swapped}), with meta.json's EOS id edited
# ({edited}), with a shard's ids shuffled ({overwritten}; {rotten}: its time kept), and tiny Hugging Face weights
# without their tokenizer ({nospiece}). The others are shared: {data} the
# prepared folder, {otherdata} a folder of another corpus prepared with a tokenizer of the same vocab, {ckpt} a run to
# fine-tune, {hfweights} Hugging Face weights, {miniweights} t5-mini's, {bigvocab} weights of a vocab {data}'s
# tokenizer beside them does not make, {bigvocabrun} a run of such a model, {sni} an SNI clone, {corpus} the text
# {data} was prepared from, {bad} a file no loader reads, {results} a finished finetune.py evaluation, {byfile} a
# folder prepared with the tokenizer file {tokfile}, which changed since.
# A fix is what the error line says to do: "undo", the script's base command without the mistakes (one run serves
# every row that undoes to it); args that replace or join the case's; "follow": the --key=value it names; "prepare
# again": the folder deleted (if the line says to) and the command it quotes run; or a function, done to the case's
# places, then the case
# again. The configurator's own mistakes, the same in every script, are test_train.py's, on a script of its own.
CASES = [
    # 1. every key is checked where it enters, before any work; each bad value is a line of its own. Values that used
    # to hang: a noise density of 1, shard_tokens=0. (test_train.py: the configurator's own mistakes; test_data.py: a
    # batch that won't split over micro-steps and ranks)
    ("train values", [*TRAIN, "--lr=-1.0", "--noise_density=1.0", "--mean_noise_span_length=0.5", "--input_length=0",
                      "--grad_accum_steps=0", "--log_interval=0", "--checkpoint_interval=-5", "--eval_steps=0",
                      "--max_steps=0", "--dropout=1.0", "--grad_clip=-1.0", "--optimizer=adam",
                      "--model=t5-tiy", "--batch_size=0", "--eval_interval=0", "--time_budget_hours=-1.0"],
     ["config key 'lr' is -1.0; it must be > 0", "'noise_density' is 1.0; it must be in (0, 1)",
      "'mean_noise_span_length' is 0.5; it must be >= 1", "'input_length' is 0; it must be >= 3",
      "'grad_accum_steps' is 0; it must be > 0", "'log_interval' is 0", "'checkpoint_interval' is -5",
      "'eval_steps' is 0; it must be > 0", "'max_steps' is 0; it must be > 0", "'dropout' is 1.0; it must be in [0, 1)",
      "'grad_clip' is -1.0; it must be >= 0", "one of adamwscale, adamw",
      "'model' is 't5-tiy'; it must be one of t5-mini, t5-tiny",
      "'batch_size' is 0", "'eval_interval' is 0", "'time_budget_hours' is -1.0"], "undo"),
    # values that trained silently wrong (a negative lr, weights that grow, a flag that meant nothing) or failed
    # obscurely (a seed numpy refuses, an out_dir or data_dir that is a file or empty), or never ended (an evaluation
    # that reads val.bin 100,000 batches long, shards of one token each)
    ("train values that trained wrong", [*TRAIN, "--min_lr=-1e-05", "--warmup_steps=-1",
                                         "--warmup_start_factor=-1.0", "--weight_decay=-0.1", "--seed=-1",
                                         "--peak_flops=-1.0", "--out_dir=", "--shard_across_nodes=True",
                                         "--data_dir={corpus}"],
     ["'min_lr' is -1e-05; it must be >= 0", "'warmup_steps' is -1; it must be >= 0",
      "'warmup_start_factor' is -1.0; it must be in [0, 1]", "'weight_decay' is -0.1; it must be >= 0",
      "'seed' is -1; it must be in [0, 2**32)", "'peak_flops' is -1.0; it must be >= 0",
      "'out_dir' is ''; it must be a folder's path", "'shard_across_nodes' is True; it must be False without fsdp",
      "corpus.jsonl'; it must be a folder's path"],
     "undo"),
    # a schedule that cannot be what was meant: a "decay" that rises; a run that is all warmup, as t5_base.py's
    # 10,000 warmup steps would be for a shorter run
    ("train schedule", [*TRAIN, "--lr=0.01", "--min_lr=0.1", "--warmup_steps=5"],
     ["'min_lr' is 0.1; it must be <= lr (0.01)", "'warmup_steps' is 5; it must be <= max_steps (2)"], "undo"),
    ("train evaluation longer than val.bin", [*TRAIN, "--eval_steps=100000"],
     "'eval_steps' is 100000; it must be <= ", "undo"),
    ("finetune values", [*FINETUNE, "--eval_batch_size=0", "--max_new_tokens=-1", "--epochs=0", "--lr=0.0",
                         "--max_input_length=0", "--optimizer=sgd", "--dropout=-0.5", "--max_steps=-1",
                         "--num_pos_examples=-1", "--max_num_instances_per_task=0", "--weight_decay=-1.0",
                         "--seed=4294967296", "--out_dir={corpus}", "--data_dir={bad}/data.csv"],
     ["'eval_batch_size' is 0; it must be > 0", "'max_new_tokens' is -1", "'epochs' is 0; it must be > 0",
      "'lr' is 0.0; it must be > 0", "'max_input_length' is 0", "one of adamwscale, adamw",
      "'dropout' is -0.5", "'max_steps' is -1", "'num_pos_examples' is -1; it must be >= 0",
      "'max_num_instances_per_task' is 0; it must be > 0", "'weight_decay' is -1.0; it must be >= 0",
      "'seed' is 4294967296; it must be in [0, 2**32)", "corpus.jsonl'; it must be a folder's path",
      "data.csv'; it must be a folder's path"], "undo"),
    # fine-tuning starts from trained weights: auto and scratch name none
    ("finetune auto", [*FINETUNE, "--init_from=auto"], "'init_from' is 'auto'; it must be the weights to fine-tune",
     "undo"),
    ("finetune scratch", [*FINETUNE, "--init_from=scratch"], "'init_from' is 'scratch'; it must be the weights",
     "undo"),
    ("prepare values", [*PREPARE, "--shard_tokens=1", "--num_proc=0", "--max_train_tokens=-5", "--val_fraction=0.0",
                        "--vocab_size=0", "--max_val_tokens=0", "--out_dir={corpus}"],
     ["'shard_tokens' is 1; it must be >= 1,000,000", "'num_proc' is 0; it must be > 0",
      "'max_train_tokens' is -5; it must be >= 0", "'val_fraction' is 0.0; it must be in (0, 1)",
      "'vocab_size' is 0; it must be in [1, 65436]", "'max_val_tokens' is 0", "it must be a folder's path"], "undo"),
    ("bench values", [*BENCH, "--steps=0", "--burn_in=-1", "--model=t5-tiy", "--compare=HF",
                      "--input_length=2", "--grad_accum_steps=0", "--batch_size=-4", "--threads=-1"],
     ["'steps' is 0; it must be > 0", "'burn_in' is -1; it must be >= 0", "'model' is 't5-tiy'", "'compare' is 'HF'",
      "'input_length' is 2", "'grad_accum_steps' is 0", "'batch_size' is -4; it must be >= 0",
      "'threads' is -1; it must be >= 0"], "undo"),
    ("bench batch that won't split", [*BENCH, "--batch_size=3", "--grad_accum_steps=2"],
     "batch_size=3 must split evenly into grad_accum_steps=2", "undo"),
    ("sample values", [*SAMPLE, "--max_new_tokens=100000"], "'max_new_tokens' is 100000; it must be in [1, 1024]",
     "undo"),
    ("train dtype", [*TRAIN, "--dtype=float16"], "dtype 'float16' is not one of float32, tfloat32, bfloat16", "undo"),
    ("train device", [*TRAIN, "--device=tpu"], "device 'tpu' is not one this code runs on", "undo"),
    ("train fsdp without torchrun", [*TRAIN, "--fsdp=True"], "fsdp=True shards the model over the ranks torchrun",
     "undo"),
    # 2. a new run never writes over another run's files (test_checkpoint.py: each kind of file)
    ("train scratch over a checkpoint", [*TRAIN, "--init_from=scratch"], "would replace it", "undo"),
    ("finetune into a train.py run", [*FINETUNE, "--init_from={ckpt}", "--out_dir={run}"],
     "ckpt exists and this run would replace it: pass another --out_dir", ["--out_dir={tmp}/out"]),
    # 3. a shard is checked when a run opens it
    ("train shard cut short", [*TRAIN, "--data_dir={short}"], "tokens meta.json says (lost or cut)",
     "prepare again"),
    # a shard is what meta.json's sha256 says: overwritten after meta.json, checked at start-up; its bytes rotten with
    # its time kept, in the background, which stops the run at its next sync step, before it saves
    ("train shard overwritten", [*TRAIN, "--data_dir={overwritten}"], "is not the shard meta.json records",
     "prepare again"),
    ("train shard rotten", [*TRAIN, "--data_dir={rotten}"], "train_000.bin is not the shard meta.json records",
     "prepare again"),
    # a resume whose data folder is gone names its own data, which its checkpoint records
    ("train resume whose data is gone", [*TRAIN, "--data_dir={tmp}/gone"],
     "gone holds no prepared data (no meta.json): prepare it with `python prepare.py --dataset=", "prepare again"),
    # a folder is prepared with one tokenizer: a tokenizer file changed since is refused, not silently ignored
    ("prepare a changed tokenizer file", [*PREPARE, "--tokenizer={tokfile}", "--out_dir={byfile}"],
     "tok.model is not the tokenizer", ["--out_dir={tmp}/new"]),
    # 4. a resume is the run it resumes, of its own program (test_checkpoint.py: each setting, format and data)
    ("train resume, other model, optimizer and weight decay", [*TRAIN, "--model=t5-v1_1-small",
                                                               "--optimizer=adamw", "--weight_decay=0.1"],
     "model 't5-tiny' -> 't5-v1_1-small', optimizer 'adamwscale' -> 'adamw', weight_decay 0.0 -> 0.1", "undo"),
    ("finetune resume of a train.py run", [*FINETUNE, "--out_dir={run}"], "was written by train.py",
     ["--init_from={run}", "--out_dir={tmp}/out"]),
    ("train resume at max_steps", [*TRAIN, "--max_steps=1"], "is at step 1 of max_steps=1", "undo"),
    # 5. a path names what the command needs (test_prepare.py: a corpus not found, without the text field, prepared
    # with other settings; test_train.py: data_dir without data; test_finetune.py: data_dir without SNI)
    ("train init_from Resume", [*TRAIN, "--out_dir={tmp}/out", "--init_from=Resume"],
     "did you mean --init_from=resume?", "undo"),
    ("train init_from a file that is no checkpoint", [*TRAIN, "--out_dir={tmp}/out", "--init_from={corpus}"],
     "corpus.jsonl holds no run or weights", "undo"),
    ("prepare csv", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/data.csv"], "data.csv is not a .txt/", "undo"),
    ("prepare tokenizer not a file", [*PREPARE, "--out_dir={tmp}/data", "--tokenizer={tmp}/t5.model"],
     "is not t5, gpt2, train or a .model or .tiktoken file", "undo"),
    ("prepare tokenizer not sentencepiece's", [*PREPARE, "--out_dir={tmp}/data", "--tokenizer={corpus}"],
     "corpus.jsonl is not a sentencepiece model", "undo"),
    ("prepare vocab_size below the corpus's characters", [*PREPARE, "--out_dir={tmp}/data", "--vocab_size=3"],
     "is smaller than required_chars: use --vocab_size=", "follow"),
    # 6. sample.py and export.py take only what they can use (test_sample.py: each sentinel mistake)
    ("export into a non-empty folder", [*EXPORT, "--out_dir={results}"], "is not an empty folder, and export.py",
     "undo"),
    ("export Hugging Face weights", [*EXPORT, "--init_from={hfweights}"], "is not a run of train.py or finetune.py",
     "undo"),
    # 7. a new run is the shape of the weights it starts from
    ("train --model against its weights", [*TRAIN, "--out_dir={tmp}/out", "--init_from={miniweights}"],
     "--model=t5-tiny is not the shape of the weights", "follow"),
    # 8. a model reads only a tokenizer of its vocab (test_finetune.py: finetune.py's)
    ("sample an export without spiece.model", [*SAMPLE, "--init_from={nospiece}", "--text=a <extra_id_0> b"],
     "holds no spiece.model", lambda places, line: shutil.copy(os.path.join(places["data"], "tokenizer.model"),
                                                               os.path.join(places["nospiece"], "spiece.model"))),
    # a Hub name offline, or with the Hub out of reach: the line says so, and how to pass weights that are here
    ("sample a Hub name offline", [*SAMPLE, "--init_from=google/t5-v1_1-base", "--text=a <extra_id_0> b"],
     "which can't be reached: connect, or pass a folder of its config.json", ["--init_from={hfweights}"]),
    ("sample a tokenizer of fewer ids than the model", [*SAMPLE, "--init_from={bigvocab}", "--text=a <extra_id_0>"],
     "is not the model's: its 164 ids", "undo"),
    ("export a run whose tokenizer is not its model's", [*EXPORT, "--init_from={bigvocabrun}"], "is not the model's",
     "undo"),
    # 9. the tokenizer is part of a model's identity: its sha256, recorded in meta.json and carried by checkpoints
    ("train weights of another tokenizer of the same vocab", [*TRAIN, "--out_dir={tmp}/out", "--model=t5-mini",
                                                              "--init_from={miniweights}", "--data_dir={otherdata}"],
     "was trained with another tokenizer", "undo"),
    ("train data whose tokenizer was replaced", [*TRAIN, "--data_dir={swapped}"],
     "tokenizer.model is not the tokenizer", "undo"),  # the line's "prepare again": the cut shard's above
    ("train data whose meta.json EOS was edited", [*TRAIN, "--data_dir={edited}"],
     "(eos_id 5 in meta.json, 1 in the tokenizer)", "undo"),
]
OWN_COPIES = ("run", "ftrun", "prepared", "short", "swapped", "edited", "nospiece", "overwritten", "rotten")
SHARED = ("data", "otherdata", "results", "hfweights", "miniweights", "bigvocab", "bigvocabrun", "byfile")

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


def tiny_checkpoint(out_dir, meta, config, optimizer, program="train.py", vocab_size=None):
    """a checkpoint in the format of program (train.py's or finetune.py's, which names the weights it fine-tunes)
    of a very small T5, at step 1"""
    t5 = tiny_t5(meta, vocab_size)
    opt = make_optimizer(optimizer, param_groups(t5, 0.0), 1e-3)
    with open(os.path.join(meta["data_dir"], "tokenizer.model"), "rb") as f:
        run = dict(program=program, config=dict(config, optimizer=optimizer), meta=meta, tokenizer=f.read(),
                   weights="out/pretrained/ckpt/step-1")
    save_checkpoint(str(out_dir), t5, opt, 1, 0.0, run)


def copy_data(data, to, damage):
    shutil.copytree(data, to)
    damage(to)
    return str(to)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    corpus = write_corpus(root / "corpus.jsonl", 400)
    data = str(root / "data")
    meta = prepare(dataset=corpus, tokenizer="train", out_dir=data, vocab_size=64)

    def cut_shard(folder):
        with open(folder / "val.bin", "r+b") as f:
            f.truncate(1000)
    otherdata = str(root / "otherdata")
    prepare(dataset=write_corpus(root / "other.jsonl", 400, seed=1), tokenizer="train", out_dir=otherdata,
            vocab_size=64)

    def overwrite_shard(folder, keep_time=False):  # with ids of its own tokenizer: the same size
        path = folder / "train_000.bin"
        stat = os.stat(path)
        np.random.default_rng(0).permutation(np.fromfile(path, dtype=np.uint16)).tofile(path)
        if keep_time:  # as bit rot, or a copy that kept the file's time, leaves it
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    def swap_tokenizer(folder):
        shutil.copy(os.path.join(otherdata, "tokenizer.model"), folder / "tokenizer.model")

    def edit_eos(folder):
        edited = dict(json.loads((folder / "meta.json").read_text()), eos_id=5)
        (folder / "meta.json").write_text(json.dumps(edited))

    run_config = {"model": "t5-tiny", "dropout": 0.0, "lr": 1e-2, "weight_decay": 0.0}
    tiny_checkpoint(root / "run", meta, run_config, "adamwscale")
    tiny_checkpoint(root / "ftrun", meta, {}, "adamw", "finetune.py")
    tiny_checkpoint(root / "pretrained", meta, {}, "adamwscale")
    tiny_checkpoint(root / "bigvocabrun", meta, run_config, "adamwscale", vocab_size=384)
    # Hugging Face weights with the tokenizer of {data} beside them, as export.py writes them: tiny ones, t5-mini's
    # shape, and vocabs its tokenizer did not make; and tiny ones without their tokenizer
    for name, t5 in (("hfweights", tiny_t5(meta)), ("bigvocab", tiny_t5(meta, 384)),
                     ("miniweights", T5(T5Config.from_preset("t5-mini", vocab_size=meta["model_vocab_size"]))),
                     ("nospiece", tiny_t5(meta))):
        save_pretrained(t5, str(root / name))
        if name != "nospiece":
            shutil.copy(os.path.join(data, "tokenizer.model"), root / name / "spiece.model")
    # a folder prepared with a tokenizer file, which then changed
    tokfile = str(root / "tok.model")
    shutil.copy(os.path.join(data, "tokenizer.model"), tokfile)
    prepare(dataset=corpus, tokenizer=tokfile, out_dir=str(root / "byfile"))
    shutil.copy(os.path.join(otherdata, "tokenizer.model"), tokfile)
    write_sni(root / "sni")
    (root / "results").mkdir()
    (root / "results" / "metrics.json").write_text('{"rougeL": 40.7}')
    (root / "results" / "predictions.jsonl").write_text('{"prediction": "a finished run"}\n')
    bad = root / "bad"
    bad.mkdir()
    (bad / "data.csv").write_text("text,label\nhello world,1\n")
    return dict(corpus=corpus, data=data, prepared=data, sni=str(root / "sni"), ckpt=str(root / "pretrained"),
                tokfile=tokfile, byfile=str(root / "byfile"),
                bad=str(bad), short=copy_data(data, root / "short", cut_shard), otherdata=otherdata,
                swapped=copy_data(data, root / "swapped", swap_tokenizer),
                edited=copy_data(data, root / "edited", edit_eos), root=str(root),
                overwritten=copy_data(data, root / "overwritten", overwrite_shard),
                rotten=copy_data(data, root / "rotten", lambda folder: overwrite_shard(folder, keep_time=True)),
                **{name: str(root / name) for name in ("run", "ftrun", "results", "hfweights", "miniweights",
                                                       "bigvocab", "nospiece", "bigvocabrun")})


def snapshot(folders):
    """the bytes of every checkpoint, shard, tokenizer and meta.json in the folders"""
    patterns = ("ckpt/*/*", "ckpt/*/.metadata", "*.bin", "tokenizer.model", "meta.json", "metrics.json",
                "predictions.jsonl", "log.jsonl")
    files = [p for folder in folders for pattern in patterns for p in glob.glob(os.path.join(folder, pattern))]
    return {p: open(p, "rb").read() for p in files}


def base_of(command):
    return next(base for base in BASES if command[:len(base)] == base)


def with_args(args, extra):
    """args with extra's --key=value in place of the same key's, as a user edits a command line"""
    keys = {arg.split("=")[0] for arg in extra if arg.startswith("--")}
    return [arg for arg in args if arg.split("=")[0] not in keys] + extra


TIMEOUT = 120  # seconds: a run still going after them has hung


def python(args):
    """`python args` in the repo, as a user runs it, offline: a process of its own"""
    return forked(args, dict(HF_HUB_OFFLINE="1"), TIMEOUT)


def set_up(name, command, places):
    """the case's folder, {tmp}, with its own copies of the places in OWN_COPIES it names: (its arguments, its
    places, the folders it can reach)"""
    tmp = os.path.join(places["root"], "cases", re.sub(r"\W", "_", name))
    os.makedirs(tmp, exist_ok=True)
    named = [key for key in places if any("{" + key + "}" in arg for arg in command)]
    own = {key: shutil.copytree(places[key], os.path.join(tmp, key)) for key in OWN_COPIES if key in named}
    case_places = dict(places, tmp=tmp, **own)
    # the folders the case can reach, whose checkpoints and shards must come out as they went in
    reached = [case_places[key] for key in (*OWN_COPIES, *SHARED) if key in named]
    return [arg.format(**case_places) for arg in command], case_places, reached


def run_fix(fix, args, case_places, line):
    """the case's command after the fix its error line names, done; None for "undo": its base command answers"""
    if fix == "undo":
        return None
    if fix == "prepare again":  # the folder deleted (if the line says so), and prepared by the command it quotes
        if re.search(r"delete (\S+) and", line):
            shutil.rmtree(re.search(r"delete (\S+) and", line)[1])
        command = shlex.split(line.split("`")[1])
        assert command[0] == "python" and python(command[1:]).returncode == 0
    elif fix == "follow":
        named = [word.rstrip("?.,;)") for word in line.split() if word.startswith("--") and "=" in word]
        args = with_args(args, named[-1:])
    elif callable(fix):
        fix(case_places, line)
    else:
        args = with_args(args, [arg.format(**case_places) for arg in fix])
    return python(args)


@pytest.fixture(scope="module")
def base_run(places):
    """base_run(i): the run of BASES[i], the script's base command that the "undo" rows come back to, made the first
    time a row on this worker asks for it"""
    runs = {}

    def base_run(i):
        if i not in runs:
            runs[i] = python(set_up(f"base {i}", BASES[i], places)[0])
        return runs[i]
    return base_run


def test_the_table_covers_every_script():
    scripts = [command[0] for _, command, _, _ in CASES]
    assert scripts.count("train.py") >= 10 and all(scripts.count(s) >= 3 for s in ("finetune.py", "prepare.py",
                                                                                     "sample.py", "export.py"))
    assert scripts.count("bench.py") >= 2


# each row a test, a process of its own, which xdist runs on whichever worker is free (no xdist_group)
@pytest.mark.parametrize("name, command, message, fix", CASES, ids=[name for name, _, _, _ in CASES])
def test_bad_input_is_a_line_each_and_the_fix_gets_past_it(places, base_run, name, command, message, fix):
    args, case_places, reached = set_up(name, command, places)
    before = snapshot(reached)
    r = python(args)
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert r.returncode not in (0, "timeout"), f"{r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert errors and errors == lines[-len(errors):], r.stderr[-3000:]  # the error lines come last
    for words in [message] if isinstance(message, str) else message:  # each mistake, a line of its own
        assert len([line for line in errors if words in line]) == 1, (words, r.stderr[-3000:])
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert snapshot(reached) == before  # every checkpoint, shard and meta.json the case could reach, byte for byte
    # the fix the line names, done, gets past the error
    fixed = run_fix(fix, args, case_places, lines[-1]) or base_run(BASES.index(base_of(command)))
    fixed_lines = fixed.stderr.strip().splitlines()
    assert fixed.returncode != "timeout", fixed.stderr[-3000:]
    assert "Traceback" not in fixed.stderr + fixed.stdout, fixed.stderr[-3000:]
    first = [message] if isinstance(message, str) else message
    assert fixed.returncode == 0 or (fixed_lines and first[0] not in fixed_lines[-1]), fixed.stderr[-3000:]


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


# a read-only mount, as sitecustomize makes one of the folder $READ_ONLY for every write that Python's open, os.open
# and os.mkdir make (tests run as root here, which a chmod does not stop)
READ_ONLY = """
import builtins, errno, os
def refusing(call, writes):
    def refused(path, *args, **kwargs):
        name = os.path.abspath(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else ""
        if name.startswith(os.environ["READ_ONLY"]) and writes(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return call(path, *args, **kwargs)
    return refused
builtins.open = refusing(builtins.open, lambda mode="r", *args, **kwargs: set(mode) & set("wax+"))
os.open = refusing(os.open, lambda flags, *args, **kwargs: flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
os.mkdir = refusing(os.mkdir, lambda *args, **kwargs: True)
"""


@pytest.mark.parametrize("command, read_only", [
    ([*TRAIN, "--init_from=scratch", "--out_dir={tmp}/ro/out"], "{tmp}/ro"),  # a new run
    ([*TRAIN], "{run}"),  # a resume
    ([*EXPORT, "--out_dir={tmp}/ro/hf"], "{tmp}/ro"),
    ([*PREPARE, "--out_dir={tmp}/ro/data"], "{tmp}/ro"),
], ids=["train", "resume", "export", "prepare"])
def test_a_read_only_out_dir_is_one_line_before_any_work(places, tmp_path, command, read_only):
    args, case_places, reached = set_up(f"read-only {command[0]} {read_only}", command, places)
    read_only = read_only.format(**case_places)
    (tmp_path / "sitecustomize.py").write_text(READ_ONLY)
    before = snapshot(reached)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(tmp_path), READ_ONLY=read_only)
    r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    out_dir = next(arg.split("=", 1)[1] for arg in reversed(args) if arg.startswith("--out_dir="))
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (f"error: can't write in {out_dir} (Read-only file system): pass an --out_dir you can write "
                        f"to\n"), r.stderr
    assert snapshot(reached) == before
