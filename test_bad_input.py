"""
Bad input to the four scripts, as one table: every case runs the script as a user would, and must end with one line
`error: ...` on stderr (exit code non-zero, no traceback, no hang) that says what the table expects, and leave the
checkpoints, shards and meta.json it finds byte-identical.
One table rather than a table per test file: the promise is the same for every script, and so is the check.
The cases start together, one per CPU core at a time; each test waits for its own.
"""
import fcntl
import glob
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from model import T5, T5Config
from optim import make_optimizer, param_groups
from prepare import prepare
from runtime import checkpoint_state, save_checkpoint

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

# (name, command, words the error line must contain). In commands, {tmp} is the case's own empty folder, and each
# case gets its own copy of {run} (a train.py run with a checkpoint), {ftrun} (a finetune.py run with one),
# {sharded} (a train.py --fsdp=True run, its checkpoint a directory) and {prepared} (a prepared folder); the others
# are shared: {data} the prepared folder, {short}, {noval} and {other}
# damaged copies of it, {locked} a run another process holds, {ckpt} a checkpoint to fine-tune, {sni} an SNI clone,
# {corpus} the text it was prepared from, {bad} bad files.
CASES = [
    # 1. every key is checked against its declared range, before any work; values that used to hang
    ("train lr", [*TRAIN, "--lr=-1.0"], "config key 'lr' is -1.0; it must be > 0"),
    ("train noise_density 1 (hung)", [*TRAIN, "--noise_density=1.0"], "'noise_density' is 1.0; it must be in (0, 1)"),
    ("train mean span", [*TRAIN, "--mean_noise_span_length=0.5"], "'mean_noise_span_length' is 0.5; it must be >= 1"),
    ("train input_length", [*TRAIN, "--input_length=0"], "'input_length' is 0; it must be >= 3"),
    ("train grad_accum_steps", [*TRAIN, "--grad_accum_steps=0"], "'grad_accum_steps' is 0; it must be > 0"),
    ("train log_interval", [*TRAIN, "--log_interval=0"], "'log_interval' is 0"),
    ("train checkpoint_interval", [*TRAIN, "--checkpoint_interval=-5"], "'checkpoint_interval' is -5"),
    ("train eval_steps (NaN)", [*TRAIN, "--eval_steps=0"], "'eval_steps' is 0; it must be > 0"),
    ("train max_steps 0", [*TRAIN, "--max_steps=0"], "'max_steps' is 0; it must be > 0"),
    ("train seed", [*TRAIN, "--seed=-1"], "'seed' is -1; it must be >= 0"),
    ("train out_dir empty", [*TRAIN, "--out_dir="], "'out_dir' is ''; it must be non-empty"),
    ("train dtype", [*TRAIN, "--dtype=float16"], "'dtype' is 'float16'; it must be one of 'float32', 'tfloat32'"),
    ("train lr_schedule", [*TRAIN, "--lr_schedule=cosin"], "did you mean 'cosine'?"),
    ("train device", [*TRAIN, "--device=tpu"], "device 'tpu' is not one this code runs on"),
    ("train batch split", [*TRAIN, "--batch_size=12", "--grad_accum_steps=8"], "must split evenly"),
    ("finetune eval_batch_size", [*FINETUNE, "--eval_batch_size=0"], "'eval_batch_size' is 0; it must be > 0"),
    ("finetune max_new_tokens", [*FINETUNE, "--max_new_tokens=-1"], "'max_new_tokens' is -1"),
    ("finetune epochs", [*FINETUNE, "--epochs=0"], "'epochs' is 0; it must be > 0"),
    ("finetune lr", [*FINETUNE, "--lr=0.0"], "'lr' is 0.0; it must be > 0"),
    ("finetune max_input_length", [*FINETUNE, "--max_input_length=0"], "'max_input_length' is 0"),
    ("finetune batch split", [*FINETUNE, "--batch_size=3", "--grad_accum_steps=2"], "must split evenly"),
    ("train fsdp without torchrun", [*TRAIN, "--fsdp=True"], "fsdp=True shards the model over the ranks torchrun"),
    ("finetune fsdp without torchrun", [*FINETUNE, "--fsdp=True"], "launch with torchrun --nproc_per_node=N"),
    ("prepare shard_tokens 0 (hung)", [*PREPARE, "--shard_tokens=0"], "'shard_tokens' is 0; it must be > 0"),
    ("prepare num_proc", [*PREPARE, "--num_proc=0"], "'num_proc' is 0; it must be > 0"),
    ("prepare max_train_tokens", [*PREPARE, "--max_train_tokens=-5"], "'max_train_tokens' is -5; it must be >= 0"),
    ("prepare val_fraction 0", [*PREPARE, "--val_fraction=0.0"], "'val_fraction' is 0.0; it must be in (0, 1)"),
    ("prepare vocab_size", [*PREPARE, "--vocab_size=0"], "'vocab_size' is 0; it must be in [1, 65436]"),
    ("bench steps", [*BENCH, "--steps=0"], "'steps' is 0; it must be > 0"),
    ("bench burn_in", [*BENCH, "--burn_in=-1"], "'burn_in' is -1; it must be >= 0"),
    ("bench part", [*BENCH, "--part=dat"], "did you mean 'data'?"),
    ("bench noise_density (hung)", [*BENCH, "--noise_density=1.0"], "'noise_density' is 1.0"),
    ("bench model", [*BENCH, "--model=t5-tiy"], "did you mean 't5-tiny'?"),
    ("bench compare", [*BENCH, "--part=optim", "--compare=hf"], "compare 'hf' is not valid here"),
    ("bench batch split", [*BENCH, "--batch_size=6", "--grad_accum_steps=4"], "must split evenly"),
    # 2. an out_dir is never clobbered, and two runs never write one
    ("train scratch over a checkpoint", [*TRAIN, "--init_from=scratch"], "pass --init_from=resume"),
    ("finetune over a checkpoint", [*FINETUNE, "--init_from={ckpt}"], "pass --init_from=resume"),
    ("train scratch over a sharded checkpoint", [*TRAIN, "--out_dir={sharded}", "--init_from=scratch"],
     "sharded/ckpt exists and this run would replace it"),
    ("train out_dir in use", [*TRAIN, "--out_dir={locked}"], "is writing"),
    ("finetune out_dir in use", [*FINETUNE, "--out_dir={locked}", "--optimizer=adamwscale"], "is writing"),
    ("train out_dir not writable", [*TRAIN, "--init_from=scratch", "--out_dir={bad}/latin1.txt/out"],
     "can't write to out_dir"),
    # 3. data is verified before it is trusted
    ("train shard cut short", [*TRAIN, "--data_dir={short}"], "train_001.bin holds 500 tokens, not the 1,000"),
    ("train val.bin lost", [*TRAIN, "--data_dir={noval}"], "val.bin is missing: rebuild it with `python prepare.py"),
    ("bench shard cut short", [*BENCH, "--data_dir={short}"], "train_001.bin holds 500 tokens"),
    ("prepare unreadable tokenizer", [*PREPARE, "--out_dir={tmp}/data", "--tokenizer={bad}/garbage.model"],
     "as a sentencepiece model"),
    ("finetune corrupt checkpoint", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={bad}/garbage.pt"],
     "corrupt or unreadable"),
    # 4. a resume is the run it resumes
    ("train resume, other model", [*TRAIN, "--model=t5-v1_1-small"], "model 't5-tiny' -> 't5-v1_1-small'"),
    ("train resume, other optimizer", [*TRAIN, "--optimizer=adafactor"], "optimizer 'adamwscale' -> 'adafactor'"),
    ("train resume, other data", [*TRAIN, "--data_dir={other}"], "data.max_val_tokens 10000000 -> 5000"),
    ("finetune resume, other optimizer", [*FINETUNE, "--optimizer=adafactor"], "optimizer 'adamw' -> 'adafactor'"),
    ("train resume of an FSDP run without fsdp", [*TRAIN, "--out_dir={sharded}"], "holds the shards of an FSDP run"),
    # 5. every file error is a message
    ("prepare not UTF-8", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/latin1.txt"],
     "latin1.txt: 'utf-8' codec can't decode"),
    ("prepare truncated jsonl.gz", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/cut.jsonl.gz"],
     "could not read"),
    ("prepare truncated txt.gz", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/cut.txt.gz"],
     "cut.txt.gz: Compressed file ended"),
    ("prepare not gzip", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/plain.jsonl.gz"], "could not read"),
    ("prepare out_dir not writable", [*PREPARE, "--out_dir={bad}/latin1.txt/data"], "Not a directory"),
    ("train config file not UTF-8", ["train.py", "{bad}/latin1.txt"], "is not UTF-8 text"),
    ("train config file a folder", ["train.py", "{bad}"], "can't be read: Is a directory"),
    ("finetune split file not UTF-8", [*FINETUNE, "--data_dir={bad}/sni"], "test_tasks.txt is not UTF-8 text"),
    ("finetune HF folder without config.json", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={bad}/hf"],
     "config.json: No such file"),
    ("train HF folder without config.json", [*TRAIN, "--out_dir={tmp}/out", "--init_from={bad}/hf"],
     "config.json: No such file"),
    # 6. a run continues only a run of its own kind, and never replaces results it did not make
    ("finetune resume of a train.py run", [*FINETUNE, "--out_dir={run}"], "was written by train.py"),
    ("finetune eval over finished results", [*FINETUNE, "--init_from={ckpt}", "--eval_only=True",
                                             "--out_dir={results}"], "metrics.json exists and this run would replace"),
    ("train resume of a plain state dict", [*TRAIN, "--out_dir={bad}/statedict"], "was written by another program"),
    # 7. data is what its meta.json says, and the values given with it agree
    ("train tokenizer of another folder", [*TRAIN, "--data_dir={othertok}"], "is not the tokenizer"),
    ("train vocab_size against the folder", [*TRAIN, "--vocab_size=1000"], "with vocab_size 64, not 1000"),
    ("train meta.json without a key", [*TRAIN, "--data_dir={nometa}"], "it has no 'eos_id'"),
    ("train shard one byte long", [*TRAIN, "--data_dir={longshard}"], "holds 1,000 tokens and a byte, not the 1,000"),
    ("train data_dir a file", [*TRAIN, "--data_dir={corpus}"], "it must be a folder, not a file"),
    ("train log.jsonl damaged", [*TRAIN, "--out_dir={badlog}"], "line 2 of"),
    # 8. config files are Python assignments; numbers are finite and usable
    ("train YAML config", ["train.py", "{bad}/config.yaml"], "config files are Python assignments (key = value)"),
    ("train JSON config", ["train.py", "{bad}/config.json"], "config files are Python assignments (key = value)"),
    ("train config that sets nothing", ["train.py", "{bad}/empty.py"], "sets no config key"),
    ("train lr inf", [*TRAIN, "--lr=1e999"], "'lr' is inf; it must be a finite number"),
    ("train seed of 20 digits", [*TRAIN, "--seed=12345678901234567890"], "it must be below 2**63"),
    # 9. a message names the real cause
    ("prepare dataset a folder", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/sni"], "is a folder"),
    ("prepare csv", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/data.csv"], "data.csv is not a .txt/"),
    ("prepare bad line late", [*PREPARE, "--out_dir={tmp}/data", "--dataset={bad}/late.jsonl",
                               "--tokenizer={data}/tokenizer.model"], "on line 30001"),
    ("finetune init_from a missing folder", [*FINETUNE, "--out_dir={tmp}/out", "--init_from={tmp}/run"],
     "run does not exist: pass a run of train.py or finetune.py"),
]
OWN_COPIES = ("run", "ftrun", "prepared", "sharded")

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


def tiny_checkpoint(path, meta, config, optimizer, program="train.py"):
    """a checkpoint in train.py's format of a very small T5 (at a path not ending in .pt, a directory of shards, as
    --fsdp=True writes): cases stop before its weights matter"""
    t5 = T5(T5Config(vocab_size=meta["model_vocab_size"], d_model=32, d_kv=8, d_ff=64, num_layers=1,
                     num_decoder_layers=1, num_heads=2))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    opt = make_optimizer(optimizer, param_groups(t5, 0.0), 1e-3)
    save_checkpoint(path, checkpoint_state(t5, opt, 1, 0.0, dict(config, optimizer=optimizer), meta, program))


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
    shutil.copytree(root / "run", root / "locked")
    shutil.copytree(root / "run", root / "badlog")
    (root / "badlog" / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 1, "lo\n')
    write_sni(root / "sni")
    (root / "results").mkdir()
    (root / "results" / "metrics.json").write_text('{"rougeL": 40.7}')
    (root / "results" / "predictions.jsonl").write_text('{"prediction": "a finished run"}\n')

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
                longshard=copy_data(data, root / "longshard", one_byte_more))


def snapshot(folders):
    """the bytes of every checkpoint, shard, tokenizer and meta.json in the folders"""
    patterns = ("ckpt.pt", "ckpt/*", "ckpt/.metadata", "*.bin", "tokenizer.model", "meta.json", "metrics.json",
                "predictions.jsonl", "log.jsonl")
    files = [p for folder in folders for pattern in patterns for p in glob.glob(os.path.join(folder, pattern))]
    return {p: open(p, "rb").read() for p in files}


@pytest.fixture(scope="module")
def results(places):
    """{case name: (completed process, files before, files after)}, all cases started at once"""
    # another run holds the lock of this out_dir for as long as the cases run
    holder = open(os.path.join(places["locked"], "lock"), "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run_case(name, command):
        tmp = os.path.join(places["root"], "cases", name.replace(" ", "_"))
        os.makedirs(tmp)
        own = {key: shutil.copytree(places[key], os.path.join(tmp, key)) for key in OWN_COPIES
               if any("{" + key + "}" in arg for arg in command)}
        args = [arg.format(**dict(places, tmp=tmp, **own)) for arg in command]
        # the folders the case can reach, whose checkpoints and shards must come out as they went in
        reached = [dict(places, **own)[key] for key in (*OWN_COPIES, "data", "short", "noval", "other", "locked",
                                                        "results", "othertok", "badlog", "nometa", "longshard")
                   if any("{" + key + "}" in arg for arg in command)]
        before = snapshot(reached)
        try:
            r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=120)
        except subprocess.TimeoutExpired:
            r = subprocess.CompletedProcess(args, "timeout", "", "hung: no exit within 120 s\n")
        return r, before, snapshot(reached)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        futures = {name: pool.submit(run_case, name, command) for name, command, _ in CASES}
        yield futures
        for future in futures.values():
            future.result()
    holder.close()


def test_the_table_covers_every_script():
    scripts = [command[0] for _, command, _ in CASES]
    assert len(CASES) >= 40 and all(scripts.count(s) >= 5 for s in ("train.py", "finetune.py", "prepare.py",
                                                                      "bench.py"))


@pytest.mark.parametrize("name, command, message", CASES, ids=[name for name, _, _ in CASES])
def test_bad_input(results, name, command, message):
    r, before, after = results[name].result()
    lines = r.stderr.strip().splitlines()
    assert r.returncode not in (0, "timeout"), f"{r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert lines and lines[-1].startswith("error: ") and message in lines[-1], r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert after == before  # every checkpoint, shard and meta.json the case could reach, byte for byte
