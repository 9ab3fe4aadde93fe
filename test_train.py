"""
train.py and configurator.py, run as a user runs them: as subprocesses on data the tests make themselves.
Covers learning, exact kill-and-resume, DDP == one process, signals, and the one-line errors for bad input.
"""
import glob
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from prepare import prepare

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

REPO = os.path.dirname(os.path.abspath(__file__))
# a tiny model and short sequences keep every run to a few seconds on 2 cores
# by steps, not the demo's clock: a resume's losses are then the uninterrupted run's
TINY = ["config/t5_tiny.py", "--compile=False", "--dtype=float32", "--device=cpu", "--input_length=64",
        "--batch_size=8", "--eval_steps=2", "--warmup_steps=5", "--log_interval=1", "--time_budget_hours=0"]


def run(args, env_extra=None, **kwargs):
    """`python args` in the repo, each rank with one thread: forked (below) unless the environment it starts with
    or how it is run differs"""
    if not env_extra and not kwargs:
        r = forked(args)
        if r.returncode == "timeout":
            raise subprocess.TimeoutExpired(args, 300, r.stdout, r.stderr)
        return r
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          **kwargs)


# A Python that has imported torch and what every script imports before its first line runs (3.5 s of each run
# here), and forks a child for each command: the child runs it as `python args` would, in a process and session of
# its own, with its own stdin, stdout, stderr, argv, sys.path[0], environment and exit. What differs in env_extra
# must be read after start-up (not PYTHONPATH, MALLOC_* or OMP_*). The parent runs nothing but imports: no thread
# of its holds a lock when it forks.
FORKS = r"""
import json, os, runpy, sys
import numpy, sentencepiece, tiktoken, tqdm
import torch, torch._dynamo, torch.distributed.checkpoint.state_dict, torch.distributed.fsdp, torch.nn.parallel
assert len(os.listdir("/proc/self/task")) == 1
for line in sys.stdin:
    args, env_extra, out, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
else:
    sys.exit()
os.setsid()
os.environ.update(env_extra)
written = os.O_WRONLY | os.O_CREAT
for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, out, written), (2, err, written)):
    os.dup2(os.open(path, mode), fd)
if args[0] == "-m":  # as python -m: argv[0] the module's file, sys.path[0] the folder it runs in
    sys.argv, sys.path[0] = args[1:], os.getcwd()
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
elif args[0] == "-c":
    sys.argv, sys.path[0] = ["-c", *args[2:]], ""
    exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
else:  # in a namespace of its own: nothing of this one's
    sys.argv, sys.path[0] = args, os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")
"""
forks = None  # this worker's FORKS, started by its first command


def forked(args, env_extra=None, timeout=300):
    """`python args` in the repo, forked from FORKS: a CompletedProcess, its returncode "timeout" if it was still
    running after timeout seconds (then its session is killed)"""
    global forks
    if forks is None:
        forks = subprocess.Popen([sys.executable, "-c", FORKS], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # select sees each line
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")  # the child writes them
        forks.stdin.write(json.dumps([args, env_extra or {}, out, err]).encode() + b"\n")
        pid = int(forks.stdout.readline())
        returncode = "timeout"
        if select.select([forks.stdout], [], [], timeout)[0]:
            returncode = int(forks.stdout.readline())
        else:
            os.killpg(pid, signal.SIGKILL)
            forks.stdout.readline()
        stdout, stderr = open(out).read(), open(err).read()
    if returncode == "timeout":
        stderr += f"hung: no exit within {timeout} s\n"
    return subprocess.CompletedProcess(args, returncode, stdout, stderr)


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        # a run still writing may have half a line at the end: it is read once it is complete
        records = [json.loads(line) for line in f if line.endswith("\n")]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def saved_state(out_dir):
    """what out_dir's newest checkpoint holds but its tensors"""
    from checkpoint import find_checkpoint, load_checkpoint
    return load_checkpoint(find_checkpoint(out_dir), weights=False)


def saved_step(out_dir):
    """the step of out_dir's newest checkpoint"""
    return saved_state(out_dir)["step"]


def checkpoint_bytes(out_dir):
    """the files of out_dir's checkpoints, by path"""
    folder = os.path.join(out_dir, "ckpt")
    return {os.path.join(root, name): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


def wandb_runs(out_dir):
    """out_dir's offline wandb runs, oldest first, read back from wandb's own transaction logs: for each, its run
    record (id, name, project) and {step: the numbers logged at it}. A log is LevelDB's log format after wandb's 7-byte
    header: 32 KiB blocks of entries (crc32c, length, type: 1 whole, 2-4 a record's first, middle, last part), each
    record a protobuf wandb_internal_pb2.Record"""
    from wandb.proto.wandb_internal_pb2 import Record
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "wandb", "offline-run-*", "run-*.wandb"))):  # by start time
        with open(path, "rb") as f:
            data = f.read()
        assert data[:4] == b":W&B", path
        run_record, history, pos, parts = None, {}, 7, b""
        while len(data) - pos >= 7:
            if 32768 - pos % 32768 < 7:  # a block's last bytes, too few for an entry: zeros
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            parts += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = Record.FromString(parts)
                parts = b""
                if record.HasField("run"):
                    run_record = record.run
                if record.HasField("history"):  # less wandb's own _step, _runtime, _timestamp
                    items = {item.key or "/".join(item.nested_key): item for item in record.history.item}
                    history[record.history.step.num] = {key: json.loads(item.value_json)
                                                        for key, item in items.items() if key[0] != "_"}
        runs.append((run_record, history))
    return runs


def start_until_step(args, out_dir, step):
    """a run started in the background (python args...), returned once out_dir's log reaches step, or it exited"""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = os.path.join(out_dir, "log.jsonl")
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and not (
            os.path.exists(log) and max(read_log(out_dir), default=0) >= step):
        time.sleep(0.02)
    return proc


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """C4-shaped JSONL whose documents are drawn from a pool of 40 made-up sentences, so that a masked span can be
    learned, prepared with a small sentencepiece model trained on it"""
    root = tmp_path_factory.mktemp("c4")
    rng = random.Random(0)
    words = ("the of and to in is was for on that with as by at from his her which an were are this be had not "
             "river city music history government science church army school village species family film league "
             "season album station county island war king game team water north south first two new").split()
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "." for _ in range(40)]
    with open(root / "c4-sample.jsonl", "w") as f:
        for i in range(2000):
            text = " ".join(rng.choice(sentences) for _ in range(rng.randint(2, 12)))
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://x.org/{i}"}) + "\n")
    out = root / "prepared"
    prepare(dataset=str(root / "c4-sample.jsonl"), tokenizer="train", out_dir=str(out), vocab_size=100)
    return str(out)


@pytest.fixture(scope="module")
def learned(data_dir, tmp_path_factory):
    """the tiny config trained for 60 steps, with its checkpoint at the end: (out_dir, the finished process)"""
    out = str(tmp_path_factory.mktemp("learned") / "out")
    return out, run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=60",
                     "--eval_interval=60", "--checkpoint_interval=60"])


def test_tiny_config_learns(learned):
    out, r = learned
    assert r.returncode == 0, r.stderr
    losses = read_log(out)
    first, last = losses[1], sum(losses[s] for s in range(56, 61)) / 5
    # random init starts near ln(model vocab 256) = 5.5; 60 steps must take off at least 2 nats
    assert first > 5.0 and first - last > 2.0, (first, last)
    assert saved_step(out) == 60


def test_evaluations_show_the_models_fill_next_to_the_truth(data_dir, tmp_path):
    import numpy as np
    import torch
    import data as D
    import prepare as P
    from checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
    from test_data import rebuild
    out = str(tmp_path / "out")
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=6", "--eval_interval=3",
             "--checkpoint_interval=6"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "log.jsonl")) as f:
        shown = [record for record in map(json.loads, f) if "examples" in record]
    assert [record["step"] for record in shown] == [3, 6] and len(shown[-1]["examples"]) == 2
    for example in shown[-1]["examples"]:  # printed as logged
        assert f"    model: {example['model']}\n    truth: {example['truth']}\n" in r.stdout

    # the examples are the first two windows of val.bin, and their truth is exactly the spans span corruption removed
    val = D.SpanCorruptionBatches(data_dir, "val", 8, 64, 0.15, 3.0, 1337)
    inputs, labels = (t[:2] for t in val.get(0))
    windows = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)[:2 * val.raw_length]
    meta, tok = val.meta, P.load_tokenizer(val.meta)
    assert [rebuild(i, t, meta["first_sentinel_id"]) for i, t in zip(inputs.numpy(), labels.numpy())] == \
        windows.reshape(2, -1).tolist()
    # span accuracy is logged and printed next to its baseline, and is what the final weights score on val
    t5 = model_from_checkpoint(load_checkpoint(find_checkpoint(out))).eval()
    assert f"span acc {shown[-1]['span_acc']:.4f} (baseline {shown[-1]['span_baseline']:.4f})" in r.stdout
    totals = torch.zeros(2)
    for step in range(2):  # --eval_steps=2
        x, y = val.get(step)
        with torch.no_grad():
            totals += torch.stack(D.span_accuracy(t5(x, labels=y)[0], y, meta["first_sentinel_id"]))
    assert shown[-1]["span_acc"] == pytest.approx((totals[0] / totals[1]).item())
    # the fill is what generate() writes for that input with the final weights, cut at EOS
    fills = t5.generate(inputs, max_new_tokens=labels.size(1)).tolist()
    for example, ids, fill, truth in zip(shown[-1]["examples"], inputs.tolist(), fills, labels.tolist()):
        def text(ids):
            return tok.decode(ids[:ids.index(meta["eos_id"])] if meta["eos_id"] in ids else ids)
        assert text(fill).startswith(example["model"]) and text(truth).startswith(example["truth"])
        assert example["truth"].startswith("<extra_id_0>") and example["input"].count("<extra_id_") == 3
        assert all(part in text(ids) for part in example["input"].strip(". ").split(" ... "))


def test_kill_and_resume_is_exact(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=30", "--checkpoint_interval=10", "--eval_interval=1000"]
    straight = str(tmp_path / "straight")
    assert run(["train.py", *args, f"--out_dir={straight}"]).returncode == 0

    killed = str(tmp_path / "killed")
    proc = start_until_step(["train.py", *args, f"--out_dir={killed}"], killed, 23)
    proc.send_signal(signal.SIGKILL)  # no chance to save: only the step-20 checkpoint survives
    proc.wait()
    assert 23 <= max(read_log(killed)) < 30

    r = run(["train.py", *args, f"--out_dir={killed}", "--init_from=resume"])
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "at step 20" in r.stdout
    assert read_log(killed) == read_log(straight)  # bit-identical on CPU, every step


def test_sigterm_saves_a_checkpoint_and_exits_143(data_dir, tmp_path):
    # evaluating at every step, but not after the signal's save
    out = str(tmp_path / "out")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}",
                             "--max_steps=100000", "--checkpoint_interval=100000", "--eval_interval=1",
                             "--eval_steps=1"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    log = os.path.join(out, "log.jsonl")
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and not (
            os.path.exists(log) and max(read_log(out), default=0) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr  # after its save, as the signal would end it
    step = saved_step(out)
    assert step >= 3 and f"stopped by signal at step {step}" in stdout
    assert f"step {step - 1:6d} | val loss" in stdout and f"step {step:6d} | val loss" not in stdout, stdout


def test_time_budget_stops_the_run_and_drives_the_schedule(data_dir, tmp_path):
    out = str(tmp_path / "out")
    # 4 seconds of training, against a max_steps no CPU could reach in that time
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=1000000",
             "--time_budget_hours=0.0011", "--eval_interval=1000000", "--checkpoint_interval=1000000",
             "--min_lr=1e-5"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    last = [record for record in records if "loss" in record][-1]
    assert 1 < last["step"] < 1000 and 3.96 <= last["elapsed"] < 10
    # the budget's last step is evaluated, though no eval_interval falls on it
    assert "val_loss" in records[-1] and records[-1]["step"] == last["step"]
    # the cosine schedule follows the fraction of the budget spent (over half by the last step), not the fraction of
    # max_steps (under 0.1%, which would still be the peak lr of 1e-2)
    assert last["lr"] < 5e-3


def test_two_ddp_ranks_match_one_process(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=8", "--eval_interval=1000", "--checkpoint_interval=1000"]
    one = str(tmp_path / "one")
    assert run(["train.py", *args, f"--out_dir={one}", "--grad_accum_steps=2"]).returncode == 0
    two = str(tmp_path / "two")
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *args,
             f"--out_dir={two}"])
    assert r.returncode == 0, r.stderr
    a, b = read_log(one), read_log(two)
    assert a.keys() == b.keys() == set(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-4), step


def test_bad_input_under_torchrun_reaches_the_user(data_dir):
    # the rank that finds it first says the one line (torchrun then stops the others), before torchrun's report
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
             "--data_dir=/nonexistent/c4"])
    assert r.returncode != 0 and "ChildFailedError" in r.stderr
    line = ("error: /nonexistent/c4 holds no prepared data (no meta.json): prepare it with `python prepare.py "
            "--dataset=c4 --tokenizer=t5 --out_dir=/nonexistent/c4`\n")
    assert line in r.stderr and r.stderr.index(line) < r.stderr.index("ChildFailedError"), r.stderr


def test_nan_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "out")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=1000", "--checkpoint_interval=4",
            "--warmup_steps=1"]
    assert run(["train.py", *args, "--max_steps=4"]).returncode == 0
    good = checkpoint_bytes(out)
    r = run(["train.py", *args, "--max_steps=40", "--init_from=resume", "--lr=1e30", "--min_lr=1e30",
             "--grad_clip=0.0"])
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "diverged; resume with a lower lr" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and checkpoint_bytes(out) == good


# train.py run by exec under a few patches, for what only timing or a fault shows: rank 0's checkpoint writes
# made slow, NaN losses injected where the ranks watch for them, and on every rank the lr of each step and the
# collectives called written to out_dir/rank<r>.json with the step the rank stopped at and its exit code
PATCHED_TRAIN = """
import datetime, json, math, os, sys, time
sys.path.insert(0, {repo!r})
import checkpoint, distributed, optim, torch
distributed.TRAIN_TIMEOUT = {train_timeout}
rank = int(os.environ.get("RANK", 0))
lrs, collectives, watched = [], [0], [0]
make_optimizer, save_checkpoint = optim.make_optimizer, checkpoint.save_checkpoint
clip_grad_norm = torch.nn.utils.clip_grad_norm_

def recording_make_optimizer(*args, **kwargs):
    optimizer = make_optimizer(*args, **kwargs)
    step = optimizer.step
    def recorded_step(closure=None):  # a resume's first, which makes the state to load into, too
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        step(closure)
    optimizer.step = recorded_step
    return optimizer

def nan_clip_grad_norm(parameters, max_norm):  # the grad norm NaN at these calls, the weights untouched
    watched[0] += 1
    return clip_grad_norm(parameters, max_norm) * (math.nan if watched[0] in {nan_calls} else 1)

def slow_save_checkpoint(*args):
    if rank == 0:
        time.sleep({save_s})
    save_checkpoint(*args)

def counting(collective):
    def counted(*args, **kwargs):
        collectives[0] += 1
        return collective(*args, **kwargs)
    return counted

optim.make_optimizer, torch.nn.utils.clip_grad_norm_, checkpoint.save_checkpoint = (
    recording_make_optimizer, nan_clip_grad_norm, slow_save_checkpoint)
torch.distributed.all_reduce = counting(torch.distributed.all_reduce)
torch.distributed.broadcast = counting(torch.distributed.broadcast)
sys.argv = [os.path.join({repo!r}, "train.py"), *sys.argv[1:]]
script, code = dict(__name__="__main__", __file__=sys.argv[0]), 0
try:  # train.py's globals are script's, whether it ends or exits with a code
    exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"), script)
except SystemExit as e:
    code = e.code
    raise
finally:
    with open(os.path.join(script["out_dir"], f"rank{{rank}}.json"), "w") as f:
        json.dump(dict(step=script.get("step"), lrs=lrs, collectives=collectives[0], code=code), f)
"""


def run_patched(tmp_path, args, nproc=1, save_s=0.0, nan_calls=(), train_timeout_s=None):
    """train.py with PATCHED_TRAIN's patches, in its own process group, killed whole if it outlives 180 s (a rank
    left waiting on a collective would otherwise hang until gloo's 30-minute timeout)"""
    script = tmp_path / "patched_train.py"
    train_timeout = f"datetime.timedelta(seconds={train_timeout_s})" if train_timeout_s else "distributed.TRAIN_TIMEOUT"
    script.write_text(PATCHED_TRAIN.format(repo=REPO, save_s=save_s, nan_calls=set(nan_calls) or "set()",
                                           train_timeout=train_timeout))
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, *launcher, str(script), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"train.py still running after 180 s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def rank_records(out_dir, nproc):
    records = []
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            records.append(json.load(f))
    return records


def test_ddp_time_budget_with_slow_saves_ends_together(data_dir, tmp_path):
    # rank 0's part of a checkpoint, written every step, is slow; the other rank waits for it in the save's
    # collectives. On one agreed clock both stop at the same step, with the same lr at every step, and exit cleanly.
    out = str(tmp_path / "out")
    r = run_patched(tmp_path, [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=1000000",
                               "--time_budget_hours=0.0012", "--checkpoint_interval=1", "--eval_interval=1000000",
                               "--model=t5-tiny"], nproc=2, save_s=0.3)
    assert r.returncode == 0, r.stderr
    zero, one = rank_records(out, 2)
    assert zero["step"] == one["step"] > 2
    assert zero["lrs"] == one["lrs"] and len(zero["lrs"]) == zero["step"]
    assert saved_step(out) == zero["step"]
    with open(os.path.join(out, "log.jsonl")) as f:
        last = [record for record in map(json.loads, f) if "loss" in record][-1]
    assert last["step"] == zero["step"] and 4.32 <= last["elapsed"]


def test_two_runs_started_together_in_one_out_dir_one_goes_on(data_dir, tmp_path):
    # both may find out_dir free; the log each creates before writing anything, exclusively, lets one through, and
    # the other stops with one line naming out_dir (before, both trained, into one checkpoint)
    out = str(tmp_path / "out")
    args = [sys.executable, "train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=3",
            "--eval_interval=1000", "--warmup_steps=1"]
    procs = [subprocess.Popen(args, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(proc.communicate(timeout=120)[1], proc.returncode) for proc in procs]
    assert sorted(code for _, code in results) == [0, 1], results
    stopped = next(stderr for stderr, code in results if code == 1)
    assert stopped.startswith("error: ") and stopped.count("\n") == 1 and out in stopped, stopped
    assert sorted(read_log(out)) == [1, 2, 3] and saved_step(out) == 3


def test_ddp_ranks_agree_only_at_log_steps_and_wait_out_a_slow_save(data_dir, tmp_path):
    # no host sync between log steps: 16 steps logged every 8 agree at steps 1, 8 and 16 only; each step but the
    # last sums the ranks' signal flags, which the host reads two steps on. And rank 0's part of the last step's save
    # takes 4 s, past a training timeout of 2 s: the ranks wait for it under the start-up timeout, and the run ends
    # well (before, DDP's rank 0 wrote the whole checkpoint while the others waited in the next collective, which
    # timed out: on slow storage, a run died at its first save)
    out = str(tmp_path / "out")
    r = run_patched(tmp_path, [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=16",
                               "--log_interval=8", "--checkpoint_interval=1000", "--eval_interval=1000"], nproc=2,
                    save_s=4.0, train_timeout_s=2)
    assert r.returncode == 0, r.stderr
    assert saved_step(out) == 16
    zero, one = rank_records(out, 2)
    assert zero["step"] == one["step"] == 16
    # steps 1, 8 and 16, the evaluation at the last step, and the flags of steps 1 to 15
    assert zero["collectives"] == one["collectives"] == 4 + 15
    assert zero["lrs"] == one["lrs"]


def test_nan_between_log_steps_stops_before_the_next_checkpoint(data_dir, tmp_path):
    # a NaN grad norm at step 6 only, with the weights still finite after it: the check at step 8, the next log and
    # checkpoint step, still sees it, and the good checkpoint of step 4 stays
    out = str(tmp_path / "out")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=1000", "--checkpoint_interval=4",
            "--log_interval=4", "--warmup_steps=1"]
    assert run(["train.py", *args, "--max_steps=4"]).returncode == 0
    good = checkpoint_bytes(out)
    r = run_patched(tmp_path, [*args, "--max_steps=12", "--init_from=resume"], nan_calls=[2])  # step 4 + 2
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "diverged" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert checkpoint_bytes(out) == good


CONFIG_SCRIPT = """
import os
batch_size = 8
lr = 1e-3
compile = True
out_dir = "out"
exec(open(os.path.join({repo!r}, "configurator.py")).read())
print(config)
"""


@pytest.fixture
def config_script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(CONFIG_SCRIPT.format(repo=REPO))
    (tmp_path / "small.py").write_text("batch_size = 4\nlr = 1  # an int where a float is expected\n")
    return path


def test_configurator_applies_files_then_overrides(config_script, tmp_path):
    r = run([str(config_script), str(tmp_path / "small.py"), "--compile=False", "--out_dir=2024"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "{'batch_size': 4, 'lr': 1.0, 'compile': False, 'out_dir': '2024'}"


BAD_CONFIG_FILES = {"config.yaml": b"lr: 0.01\nbatch_size: 8\n", "config.json": b'{"lr": 0.01, "batch_size": 8}\n',
                    "empty.py": b"# a config file that sets nothing\n",
                    "latin1.txt": "caf\xe9 au lait\n".encode("latin-1"), "folder": None}


@pytest.mark.parametrize("args, message", [
    (["--batch_sise=3"], "unknown config key 'batch_sise' in --batch_sise (did you mean 'batch_size'?)"),
    (["--lr=fast"], "config key 'lr' in --lr must be float, got 'fast'"),
    (["--compile=1"], "config key 'compile' in --compile must be bool, got 1"),
    (["--lr"], "'--lr' needs a value: write --lr=value"),
    (["--lr", "0.1"], "'--lr' needs a value: write --lr=value"),  # not "config file '0.1' not found"
    (["--Lr=0.1"], "unknown config key 'Lr' in --Lr (did you mean 'lr'?)"),
    (["missing.py"], "config file 'missing.py' not found"),
    (["config.yaml"], "config file 'config.yaml' sets no config key"),  # YAML's key: value is a Python annotation
    (["config.json"], "config file 'config.json' sets no config key"),
    (["empty.py"], "config file 'empty.py' sets no config key"),
    (["latin1.txt"], "config file 'latin1.txt' is not Python: UnicodeDecodeError"),
    (["folder"], "config file 'folder' is not Python: IsADirectoryError"),
    (["--lr=1e999"], "config key 'lr' is inf; it must be a finite number"),
    (["--batch_size=12345678901234567890"], "config key 'batch_size' is 12345678901234567890; it must be below 2**63"),
    ([f"--lr={' '.join(['word'] * 5000)}"], "config key 'lr' in --lr must be float, got 'word word"),  # no MemoryError
    (["--batch_size=" + "[" * 200], "config key 'batch_size' in --batch_size must be int, got '[[["),
])
def test_configurator_errors_are_one_line(config_script, tmp_path, args, message):
    for name, content in BAD_CONFIG_FILES.items():
        if content is None:
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(content)
    r = subprocess.run([sys.executable, str(config_script), *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith(f"error: {message}") and r.stderr.count("\n") == 1, r.stderr


def test_configurator_takes_a_string_as_typed(config_script):
    # not through literal_eval, which reads 2024_06_01 as the number 20240601
    r = run([str(config_script), "--out_dir=2024_06_01"])
    assert r.returncode == 0 and "'out_dir': '2024_06_01'" in r.stdout, r.stderr


def test_configurator_rejects_unknown_key_in_file(config_script, tmp_path):
    (tmp_path / "bad.py").write_text("batch_size = 4\nlearning_rate = 0.1\n")
    r = run([str(config_script), str(tmp_path / "bad.py")])
    assert r.returncode == 1 and "unknown config key 'learning_rate'" in r.stderr


def test_resume_says_what_changed(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=2", "--eval_interval=1000",
            "--warmup_steps=1"]
    assert run(["train.py", *args, "--lr=0.01"]).returncode == 0
    r = run(["train.py", *args, "--init_from=resume", "--lr=0.02", "--log_interval=5", "--max_steps=3"])
    assert r.returncode == 0, r.stderr
    assert (f"resuming from {tmp_path}/ckpt/step-2 at step 2; changed on resume: max_steps 2 -> 3, lr 0.01 -> 0.02, "
            f"log_interval 1 -> 5") in r.stdout


def test_init_from_a_run_starts_a_new_run_from_its_weights(data_dir, learned, tmp_path):
    first = learned[0]
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'second'}", f"--init_from={first}",
             "--max_steps=2", "--eval_interval=1000", "--warmup_steps=1"])
    assert r.returncode == 0 and "a new run from the weights of" in r.stdout, r.stderr
    # it starts where the first run ended, far below a fresh model's loss
    assert read_log(str(tmp_path / "second"))[1] < read_log(first)[1] - 1.0


@pytest.mark.parametrize("nproc, signum", [(1, signal.SIGINT), (2, signal.SIGTERM)])
def test_a_signal_while_the_first_step_compiles_ends_the_run_at_once(data_dir, tmp_path, nproc, signum):
    # nothing to save yet: the run ends within seconds, where the compile, which swallows a KeyboardInterrupt, would
    # go on for a minute and the run after it
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if nproc == 2 else []
    proc = subprocess.Popen([sys.executable, *launch, "train.py", *TINY, "--compile=True", f"--data_dir={data_dir}",
                             f"--out_dir={tmp_path}", "--max_steps=1000"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    stdout = ""
    while "span accuracy baseline" not in stdout and proc.poll() is None:
        stdout += proc.stdout.readline()
    time.sleep(2)  # into the first step's compile
    proc.send_signal(signum)
    start = time.time()
    stdout, stderr = proc.communicate(timeout=120)
    assert time.time() - start < 15 and proc.returncode != 0, stderr
    assert f"{signal.Signals(signum).name} before the first step: nothing to save" in stderr, stderr
    assert not os.path.exists(tmp_path / "ckpt") and "step      1 " not in stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_between_log_steps_stops_within_steps_and_resumes_exactly(data_dir, tmp_path, nproc):
    # SIGTERM far from any log step: one process, which needs no other's word, stops after the step it came in;
    # torchrun's 2 ranks, at the same step within 3 of it. Either saves a checkpoint, from which the same command
    # again, --init_from=auto as a requeued job runs it (here with a nearer max_steps), logs what a run never stopped
    # logs; in an empty out_dir, that command started the run
    args = [*TINY, f"--data_dir={data_dir}", "--min_lr=0.03", "--eval_interval=1000000",
            "--checkpoint_interval=1000000", "--init_from=auto"]
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if nproc == 2 else []
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    proc = subprocess.Popen([sys.executable, *launch, "train.py", *args, f"--out_dir={stopped}",
                             "--max_steps=1000000", "--log_interval=1000000"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                                         OMP_NUM_THREADS="1"))
    stdout = ""
    while "step      1 " not in stdout and proc.poll() is None:
        stdout += proc.stdout.readline()
    time.sleep(1.5)  # some steps on
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = (stdout + more for more in proc.communicate(timeout=120))
    step = saved_step(str(stopped))
    assert nproc == 2 or proc.returncode == 128 + signal.SIGTERM  # torchrun's exit code is its own
    signalled_after = int(stderr.split("SIGTERM after step ")[1].split(":")[0])
    assert 1 < signalled_after + 1 <= step <= signalled_after + (1 if nproc == 1 else 3), stderr
    assert f"stopped by signal at step {step}" in stdout + stderr, stderr
    assert "--init_from=auto: scratch\n" in stdout, stdout
    r = run([*launch, "train.py", *args, f"--out_dir={stopped}", f"--max_steps={step + 3}"])
    assert r.returncode == 0 and "--init_from=auto: resume\n" in r.stdout, r.stdout + r.stderr
    assert run([*launch, "train.py", *args, f"--out_dir={straight}", f"--max_steps={step + 3}"]).returncode == 0
    resumed, never_stopped = read_log(str(stopped)), read_log(str(straight))
    assert [resumed[k] for k in range(step + 1, step + 4)] == [never_stopped[k] for k in range(step + 1, step + 4)]


def test_wandb_logs_what_log_jsonl_logs_and_a_resume_continues_its_run(data_dir, tmp_path):
    """Offline, read back from wandb's own files: each run holds log.jsonl's numbers at their steps (the train and
    evaluation records of a step together); a resume goes on with the wandb run its checkpoint saved, rewound to its
    step; a new run from that run's weights is a wandb run of its own"""
    out, new = str(tmp_path / "run"), str(tmp_path / "new")
    args = [*TINY, f"--data_dir={data_dir}", "--wandb_log=True", "--warmup_steps=1"]
    offline = {"WANDB_MODE": "offline"}
    r = run(["train.py", *args, f"--out_dir={out}", "--max_steps=3"], offline)
    assert r.returncode == 0, r.stderr
    first_id = saved_state(out)["wandb_id"]
    r = run(["train.py", *args, f"--out_dir={out}", "--max_steps=5", "--init_from=resume"], offline)
    assert r.returncode == 0, r.stderr
    logged = {}
    with open(os.path.join(out, "log.jsonl")) as f:
        for record in map(json.loads, f):  # its numbers: not the examples' texts, nor the MFU a CPU has none of
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            logged.setdefault(record["step"], {}).update(numbers)
    assert "val_loss" in logged[3] and "val_loss" in logged[5]
    (first, first_history), (resumed, resumed_history) = wandb_runs(out)
    assert first.run_id == resumed.run_id == first_id == saved_state(out)["wandb_id"]
    # rewound to the checkpoint's step, from which the resume logs again: wandb drops a step below its run's last
    assert (resumed.branch_point.run, resumed.branch_point.value) == (first_id, 3)
    assert (first.display_name, first.project) == ("run", "nanoT5")  # out_dir's folder, the default project
    assert first_history == {step: logged[step] for step in (1, 2, 3)}
    assert resumed_history == {step: logged[step] for step in (4, 5)}

    r = run(["train.py", *args, f"--out_dir={new}", f"--init_from={out}", "--max_steps=1",
             "--wandb_run_name=from-run", "--wandb_project=other"], offline)
    assert r.returncode == 0, r.stderr
    [(started, history)] = wandb_runs(new)
    assert started.run_id == saved_state(new)["wandb_id"] != first_id
    assert (started.display_name, started.project) == ("from-run", "other") and sorted(history) == [1]


@pytest.mark.parametrize("script", ["train.py", "finetune.py"])
def test_wandb_log_without_wandb_or_a_login_is_one_line(script, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    out = tmp_path / "out"
    r = run([script, "--wandb_log=True", f"--out_dir={out}"], {"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 1 and r.stderr == ("error: config key 'wandb_log' is True; it must be False without wandb: "
                                              "pip install wandb\n"), r.stderr
    assert not out.exists()
    # installed, online, with no API key in the environment or ~/.netrc: before any work, not after the model is built
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    r = subprocess.run([sys.executable, script, "--wandb_log=True", f"--out_dir={out}"], cwd=REPO, text=True,
                       capture_output=True, env=dict(env, HOME=str(tmp_path)), stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 1 and r.stderr == ("error: config key 'wandb_log' is True; it must be False without a "
                                              "wandb login: run `wandb login`, or set WANDB_MODE=offline\n"), r.stderr
    assert not out.exists()


def test_a_finished_run_stays_finished(data_dir, tmp_path):
    # a time-budgeted run, then the same --init_from=auto command twice, as a scheduler reruns a finished job: each
    # says the run is finished and exits 0, and every file stays as it was (before, each trained one step more and
    # pruned the run's final checkpoint); --init_from=resume is one line that names the key to raise
    out = str(tmp_path / "out")
    args = ["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=1000000",
            "--time_budget_hours=0.0003", "--eval_interval=1000000", "--checkpoint_interval=1000000",
            "--init_from=auto"]
    assert run(args).returncode == 0
    step, files, log = saved_step(out), checkpoint_bytes(out), open(os.path.join(out, "log.jsonl")).read()
    for _ in range(2):
        r = run(args)
        assert r.returncode == 0 and f"{out} is at step {step} of time_budget_hours=0.0003: the run is finished\n" \
            in r.stdout, r.stdout + r.stderr
        assert checkpoint_bytes(out) == files and open(os.path.join(out, "log.jsonl")).read() == log
    r = run([*args, "--init_from=resume"])
    assert r.returncode == 1 and r.stderr == (f"error: {out} is at step {step} of time_budget_hours=0.0003: raise "
                                              f"time_budget_hours to train it further\n"), r.stderr
    assert checkpoint_bytes(out) == files


def test_auto_starts_again_a_run_stopped_before_its_first_checkpoint(data_dir, tmp_path):
    # killed before its first checkpoint, a run leaves its log, and a first save killed after its state.pt a step
    # folder without .metadata: the same --init_from=auto command (here with a nearer max_steps) starts the run again,
    # drops that log with a note, logs an uninterrupted run's losses, and its first save takes the cut folder away
    # (before, every requeue was refused). Another run's folder is still refused.
    args = [*TINY, f"--data_dir={data_dir}", "--checkpoint_interval=1000", "--eval_interval=1000", "--init_from=auto"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run(["train.py", *args, "--max_steps=6", f"--out_dir={straight}"]).returncode == 0
    proc = start_until_step(["train.py", *args, "--max_steps=1000", f"--out_dir={killed}"], str(killed), 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (killed / "ckpt" / "step-1000").mkdir(parents=True)
    shutil.copy(straight / "ckpt" / "step-6" / "state.pt", killed / "ckpt" / "step-1000")
    r = run(["train.py", *args, "--max_steps=6", "--model=t5-tiny", f"--out_dir={killed}"])
    assert r.returncode == 1 and r.stderr == f"error: {killed}/ckpt exists and this run would replace it: pass " \
                                             f"another --out_dir\n", r.stderr
    r = run(["train.py", *args, "--max_steps=6", f"--out_dir={killed}"])
    assert r.returncode == 0 and "--init_from=auto: scratch\n" in r.stdout, r.stderr
    assert f"{killed}/log.jsonl: dropped the" in r.stdout and "lines of a start stopped before its first" in r.stdout
    assert read_log(str(killed)) == read_log(str(straight))
    assert os.listdir(killed / "ckpt") == ["step-6"]


def test_one_live_run_per_out_dir(data_dir, tmp_path):
    # two resumes of one run, the second started once the first has logged a step: the second stops at once, before
    # it reads anything, with one line naming out_dir (before, both trained, into the same step folders). SIGKILLed,
    # the first holds no lock any more, and the same command resumes at once.
    out = str(tmp_path / "out")
    args = ["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=1000",
            "--checkpoint_interval=2"]
    assert run([*args, "--max_steps=2", "--warmup_steps=1"]).returncode == 0
    resume = [*args, "--max_steps=100000", "--init_from=resume"]
    first = start_until_step(resume, out, 3)
    r = run(resume)
    assert r.returncode == 1 and r.stdout == "" and r.stderr == (
        f"error: {out} is in use by a run still going: let it end, or pass another --out_dir\n"), r.stderr
    assert first.poll() is None
    first.send_signal(signal.SIGKILL)
    first.wait()
    r = run([*resume, f"--max_steps={saved_step(out) + 1}"])
    assert r.returncode == 0 and "resuming from" in r.stdout, r.stderr


def test_time_budget_moves_the_lr_every_step_and_stops_within_steps_of_its_end(data_dir, tmp_path):
    # a budget of 2.9 s, logged every 100 steps: from the second step on, each step of the warmup (half the schedule)
    # takes a higher lr than the one before (before, the lr moved at sync steps only: here, at none of them), and the
    # run stops within a few steps of the budget's end, where no interval falls (before: at the next log step)
    out = str(tmp_path / "out")
    r = run_patched(tmp_path, [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=100000",
                               "--warmup_steps=50000", "--time_budget_hours=0.0008", "--log_interval=100",
                               "--checkpoint_interval=100000", "--eval_interval=100000"])
    assert r.returncode == 0, r.stderr
    [record] = rank_records(out, 1)
    lrs = record["lrs"]
    peak = lrs.index(max(lrs))
    assert len(lrs) == record["step"] and peak >= 3
    assert all(a < b for a, b in zip(lrs[1:peak], lrs[2:peak + 1])), lrs
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and lrs[-1] < max(lrs) / 4, lrs
    with open(os.path.join(out, "log.jsonl")) as f:
        last = [record for record in map(json.loads, f) if "loss" in record][-1]
    assert last["step"] == record["step"] and 2.88 <= last["elapsed"] < 2.88 + 1.0, last


STAND_INS = {  # srun, scancel and scontrol as this machine runs them: the step, its signal, the requeue
    "srun": """#!/bin/bash
# the step, here: torchrun as python -m torch.distributed.run, on 2 CPU ranks, train.py as $TRAIN, with $EXTRA's
echo $$ > "$STAND_INS/step.pid"
args=()
for arg in "$@"; do
    case "$arg" in
        torchrun) args+=("$PYTHON" -m torch.distributed.run) ;;
        --nproc_per_node=*) args+=(--nproc_per_node=2) ;;
        train.py) args+=("$TRAIN") ;;
        *) args+=("$arg") ;;
    esac
done
exec "${args[@]}" $EXTRA
""",
    "scancel": """#!/bin/bash
[ "$1 $2" = "--signal=TERM $SLURM_JOB_ID" ] && kill -TERM "$(cat "$STAND_INS/step.pid")"
""",
    "scontrol": """#!/bin/bash
echo "$@" >> "$STAND_INS/scontrol.log"
""",
}


def test_the_slurm_script_saves_longer_than_torchruns_default_wait_and_requeues(data_dir, tmp_path):
    # docs/cluster.md's script, checked by bash -n and then run by bash with stand-ins for srun, scancel and
    # scontrol, on 2 CPU ranks of a tiny run whose rank 0 takes 35 s to save, past torchrun's default 30 s before it
    # kills its ranks. USR1 to the shell, as at the time limit: the trap signals the step, each rank saves and exits
    # 143, the checkpoint is whole, and the job is requeued.
    with open(os.path.join(REPO, "docs", "cluster.md")) as f:
        script = f.read().split("```bash\n")[1].split("```")[0]
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "patched_train.py").write_text(PATCHED_TRAIN.format(
        repo=REPO, save_s=35.0, nan_calls="set()", train_timeout="distributed.TRAIN_TIMEOUT"))
    out = str(tmp_path / "out")
    extra = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=100000", "--log_interval=1000000",
             "--checkpoint_interval=1000000", "--eval_interval=1000000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42",
               STAND_INS=str(bin_dir), PYTHON=sys.executable, TRAIN=str(tmp_path / "patched_train.py"),
               EXTRA=" ".join(extra))
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], cwd=REPO, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout = ""
    while "step      1 " not in stdout and job.poll() is None:
        stdout += job.stdout.readline()
    time.sleep(1)
    job.send_signal(signal.SIGUSR1)
    more, stderr = job.communicate(timeout=180)
    stdout += more
    step = saved_step(out)
    assert os.path.isfile(os.path.join(out, "ckpt", f"step-{step}", ".metadata"))
    saved_s = float(stdout.split(f"stopped by signal at step {step}, saved in ")[1].split(" s")[0])
    assert saved_s > 35.0, stdout
    assert [record["code"] for record in rank_records(out, 2)] == [143, 143], stderr
    assert open(bin_dir / "scontrol.log").read() == "requeue 42\n"
