"""
train.py and configurator.py, run as a user runs them: as subprocesses on data the tests make themselves.
Covers learning, exact kill-and-resume, DDP == one process, and the one-line errors for bad input.
"""
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from prepare import prepare

REPO = os.path.dirname(os.path.abspath(__file__))
# a tiny model and short sequences keep every run to a few seconds on 2 cores
TINY = ["config/t5_tiny.py", "--compile=False", "--dtype=float32", "--device=cpu", "--input_length=64",
        "--batch_size=8", "--eval_steps=2", "--warmup_steps=5", "--log_interval=1"]


def run(args, env_extra=None, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          **kwargs)


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        # a run still writing may have half a line at the end: it is read once it is complete
        records = [json.loads(line) for line in f if line.endswith("\n")]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


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
    assert os.path.exists(os.path.join(out, "ckpt.pt"))


def test_evaluations_show_the_models_fill_next_to_the_truth(data_dir, tmp_path):
    import numpy as np
    import torch
    import data as D
    import prepare as P
    from checkpoint import model_from_checkpoint
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
    val = D.SpanCorruptionBatches(data_dir, "val", 8, 64, 0.15, 3.0, 1337, P.load_meta(data_dir)["model_vocab_size"])
    inputs, labels = (t[:2] for t in val.get(0))
    windows = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)[:2 * val.raw_length]
    meta, tok = val.meta, P.load_tokenizer(data_dir)
    assert [rebuild(i, t, meta["first_sentinel_id"]) for i, t in zip(inputs.numpy(), labels.numpy())] == \
        windows.reshape(2, -1).tolist()
    # span accuracy is logged and printed next to its baseline, and is what the final weights score on val
    t5 = model_from_checkpoint(torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)).eval()
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


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(data_dir, tmp_path):
    out = str(tmp_path / "out")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}",
                             "--max_steps=100000", "--checkpoint_interval=100000", "--eval_interval=100000"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = os.path.join(out, "log.jsonl")
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and not (
            os.path.exists(log) and max(read_log(out), default=0) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    import torch
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"]
    assert step >= 3 and f"stopped by signal at step {step}" in stdout


def test_time_budget_stops_the_run_and_drives_the_schedule(data_dir, tmp_path):
    out = str(tmp_path / "out")
    # 4 seconds of training, against a max_steps no CPU could reach in that time
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=1000000",
             "--time_budget_hours=0.0011", "--eval_interval=1000000", "--checkpoint_interval=1000000",
             "--min_lr=1e-5"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    last = records[-1]
    assert 1 < last["step"] < 1000 and 3.96 <= last["elapsed"] < 10
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
    # torch.distributed wraps the error hook once the process group is up; the one-line message must get through,
    # and after torchrun's own failure report it is said once more, so that it is the last line
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
             "--data_dir=/nonexistent/c4", "--dataset=c4"])
    assert r.returncode != 0
    assert "[rank0]: error: /nonexistent/c4 holds no prepared data" in r.stderr, r.stderr
    assert "ChildFailedError" in r.stderr  # torchrun's report comes first
    assert r.stderr.strip().splitlines()[-1] == ("error: /nonexistent/c4 holds no prepared data (no meta.json): "
                                                 "prepare it with `python prepare.py --dataset=c4 --tokenizer=train "
                                                 "--vocab_size=1000 --out_dir=/nonexistent/c4`")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "out")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=1000", "--checkpoint_interval=4"]
    assert run(["train.py", *args, "--max_steps=4"]).returncode == 0
    ckpt = os.path.join(out, "ckpt.pt")
    good = open(ckpt, "rb").read()
    r = run(["train.py", *args, "--max_steps=40", "--init_from=resume", "--lr=1e30", "--lr_schedule=constant",
             "--grad_clip=0.0"])
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "diverged" in r.stderr and "Traceback" not in r.stderr
    assert open(ckpt, "rb").read() == good


# train.py run through runpy under a few patches, for what only timing or a fault shows: rank 0's checkpoint writes
# made slow, NaN losses injected where the ranks watch for them, and on every rank the lr of each step and the
# collectives called written to out_dir/rank<r>.json with the step the rank stopped at
PATCHED_TRAIN = """
import json, math, os, runpy, sys, time
sys.path.insert(0, {repo!r})
import checkpoint, optim, runtime, torch
rank = int(os.environ.get("RANK", 0))
lrs, collectives, watched = [], [0], [0]
make_optimizer, watch, save_checkpoint = optim.make_optimizer, runtime.Sync.watch, checkpoint.save_checkpoint

def recording_make_optimizer(*args, **kwargs):
    optimizer = make_optimizer(*args, **kwargs)
    step = optimizer.step
    def recorded_step():
        lrs.append(optimizer.param_groups[0]["lr"].item())
        step()
    optimizer.step = recorded_step
    return optimizer

def nan_watch(self, loss, grad_norm):
    watched[0] += 1
    watch(self, loss * math.nan if watched[0] in {nan_calls} else loss, grad_norm)

def slow_save_checkpoint(path, state):
    if rank == 0:
        time.sleep({save_s})
    save_checkpoint(path, state)

def counting(collective):
    def counted(*args, **kwargs):
        collectives[0] += 1
        return collective(*args, **kwargs)
    return counted

optim.make_optimizer, runtime.Sync.watch, checkpoint.save_checkpoint = (recording_make_optimizer, nan_watch,
                                                                        slow_save_checkpoint)
torch.distributed.all_reduce = counting(torch.distributed.all_reduce)
torch.distributed.broadcast = counting(torch.distributed.broadcast)
sys.argv = ["train.py", *sys.argv[1:]]
script = runpy.run_path(os.path.join({repo!r}, "train.py"), run_name="__main__")
with open(os.path.join(script["out_dir"], f"rank{{rank}}.json"), "w") as f:
    json.dump(dict(step=script["step"], lrs=lrs, collectives=collectives[0]), f)
"""


def run_patched(tmp_path, args, nproc=1, save_s=0.0, nan_calls=()):
    """train.py with PATCHED_TRAIN's patches, in its own process group, killed whole if it outlives 180 s (a rank
    left waiting on a collective would otherwise hang until gloo's 30-minute timeout)"""
    script = tmp_path / "patched_train.py"
    script.write_text(PATCHED_TRAIN.format(repo=REPO, save_s=save_s, nan_calls=set(nan_calls) or "set()"))
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
    # rank 0 writes a checkpoint every step, slowly; the other rank waits for it in the next step's gradient
    # all-reduce. On one agreed clock both stop at the same step, with the same lr at every step, and exit cleanly.
    out = str(tmp_path / "out")
    r = run_patched(tmp_path, [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=1000000",
                               "--time_budget_hours=0.0012", "--checkpoint_interval=1", "--eval_interval=1000000",
                               "--model=t5-tiny"], nproc=2, save_s=0.3)
    assert r.returncode == 0, r.stderr
    zero, one = rank_records(out, 2)
    assert zero["step"] == one["step"] > 2
    assert zero["lrs"] == one["lrs"] and len(zero["lrs"]) == zero["step"]
    import torch
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"] == zero["step"]
    with open(os.path.join(out, "log.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    assert last["step"] == zero["step"] and 4.32 <= last["elapsed"]


def test_ddp_ranks_agree_only_at_log_steps(data_dir, tmp_path):
    # no host sync between log steps: 16 steps logged every 8 agree at steps 1, 8 and 16 only; each step but the
    # last sums the ranks' signal flags, which the host reads two steps on
    out = str(tmp_path / "out")
    r = run_patched(tmp_path, [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=16",
                               "--log_interval=8", "--checkpoint_interval=1000", "--eval_interval=1000"], nproc=2)
    assert r.returncode == 0, r.stderr
    zero, one = rank_records(out, 2)
    assert zero["step"] == one["step"] == 16
    # steps 1, 8 and 16, the evaluation at the last step, and the flags of steps 1 to 15
    assert zero["collectives"] == one["collectives"] == 4 + 15
    assert zero["lrs"] == one["lrs"]


def test_nan_between_log_steps_stops_before_the_next_checkpoint(data_dir, tmp_path):
    # a NaN loss at step 6 only, with the weights still finite after it: the check at step 8, the next log and
    # checkpoint step, still sees it, and the good checkpoint of step 4 stays
    out = str(tmp_path / "out")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=1000", "--checkpoint_interval=4",
            "--log_interval=4"]
    assert run(["train.py", *args, "--max_steps=4"]).returncode == 0
    ckpt = os.path.join(out, "ckpt.pt")
    good = open(ckpt, "rb").read()
    r = run_patched(tmp_path, [*args, "--max_steps=12", "--init_from=resume"], nan_calls=[2])  # step 4 + 2
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "diverged" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert open(ckpt, "rb").read() == good


@pytest.mark.parametrize("args, message", [
    (["--data_dir=/nonexistent/c4", "--dataset=c4"], "prepare.py"),
    (["--init_from=resume", "--out_dir=/nonexistent/out"], "ckpt.pt"),
    (["--optimizer=adamwscal"], "adamwscale"),
    (["--model=t5-v1_1-smal"], "t5-v1_1-small"),
])
def test_bad_input_is_one_line(data_dir, args, message):
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", *args])
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: ") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_corrupt_checkpoint_is_one_line(data_dir, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume"])
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


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


@pytest.mark.parametrize("args, message", [
    (["--batch_sise=3"], "unknown config key 'batch_sise' in --batch_sise (did you mean 'batch_size'?)"),
    (["--lr=fast"], "config key 'lr' in --lr must be float, got 'fast'"),
    (["--compile=1"], "config key 'compile' in --compile must be bool, got 1"),
    (["--lr"], "'--lr' needs a value: write --key=value"),
    (["missing.py"], "config file 'missing.py' not found"),
])
def test_configurator_errors_are_one_line(config_script, args, message):
    r = run([str(config_script), *args])
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: {message}") and r.stderr.count("\n") == 1, r.stderr


def test_configurator_takes_a_string_as_typed(config_script):
    # not through literal_eval, which reads 2024_06_01 as the number 20240601
    r = run([str(config_script), "--out_dir=2024_06_01"])
    assert r.returncode == 0 and "'out_dir': '2024_06_01'" in r.stdout, r.stderr


def test_the_error_hook_never_fails(tmp_path):
    # a MemoryError without a message is one line; an exception that can't be shown is the usual traceback
    for body, line in (("raise MemoryError()", "error: out of memory (MemoryError)"),
                       ("class Odd(Exception):\n    def __str__(self):\n        raise ValueError\nraise Odd()",
                        "Odd: <exception str() failed>")):
        script = tmp_path / "script.py"
        script.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\nimport errors\n{body}\n")
        r = run([str(script)])
        assert r.returncode == 1 and "Error in sys.excepthook" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(line), r.stderr


def interrupted(args, when):
    """a run of train.py given Ctrl-C as soon as when(stdout so far) is true: (its stdout, stderr, exit code)"""
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = ""
    while not when(out) and proc.poll() is None:
        out += proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return out + stdout, stderr, proc.returncode


def test_ctrl_c_while_starting_and_while_preparing_data_is_one_line(tmp_path):
    args = [*TINY, f"--data_dir={tmp_path}/pydoc", f"--out_dir={tmp_path}/out"]
    # while the imports run
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode in (130, -signal.SIGINT), stderr
    assert stderr.startswith("interrupted: ") and stderr.count("\n") == 1, stderr
    # while train.py prepares the pydoc corpus itself: what was finished stays finished
    stdout, stderr, code = interrupted(args, lambda out: "training a 1000-piece" in out)
    assert code in (130, -signal.SIGINT) and stderr.startswith("interrupted: ") and stderr.count("\n") == 1, stderr
    assert not os.path.exists(tmp_path / "out" / "log.jsonl") and not glob.glob(f"{tmp_path}/pydoc/*.tmp")


def test_configurator_rejects_unknown_key_in_file(config_script, tmp_path):
    (tmp_path / "bad.py").write_text("batch_size = 4\nlearning_rate = 0.1\n")
    r = run([str(config_script), str(tmp_path / "bad.py")])
    assert r.returncode == 2 and "unknown config key 'learning_rate'" in r.stderr


def test_resume_says_what_changed(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=2", "--eval_interval=1000"]
    assert run(["train.py", *args, "--lr=0.01"]).returncode == 0
    r = run(["train.py", *args, "--init_from=resume", "--lr=0.02", "--log_interval=5", "--max_steps=3"])
    assert r.returncode == 0, r.stderr
    assert (f"resuming from {tmp_path}/ckpt.pt at step 2; changed on resume: max_steps 2 -> 3, lr 0.01 -> 0.02, "
            f"log_interval 1 -> 5") in r.stdout


def test_every_rank_stops_when_another_run_holds_out_dir(data_dir, tmp_path):
    from checkpoint import claim_out_dir
    from runtime import Runtime
    lock = claim_out_dir(str(tmp_path), Runtime("cpu", "cpu", "float32", False, 0, 0, 1), fresh=True)
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
             f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=2"])
    lock.close()
    assert r.returncode != 0 and os.listdir(tmp_path) == ["lock"]  # no log, no checkpoint
    for rank in (0, 1):
        assert f"[rank{rank}]: error: another run (pid {os.getpid()}) is writing {tmp_path}" in r.stderr, r.stderr


def test_divergence_before_any_checkpoint_names_none(data_dir, tmp_path):
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=40", "--lr=1e30",
             "--lr_schedule=constant", "--grad_clip=0.0", "--checkpoint_interval=1000", "--eval_interval=1000"])
    assert r.returncode == 1 and "diverged; no checkpoint was written yet" in r.stderr, r.stderr
    assert "untouched" not in r.stderr and not os.path.exists(tmp_path / "ckpt.pt")


def test_init_from_a_run_starts_a_new_run_from_its_weights(data_dir, learned, tmp_path):
    first = learned[0]
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'second'}", f"--init_from={first}",
             "--max_steps=2", "--eval_interval=1000"])
    assert r.returncode == 0 and "a new run from the weights of" in r.stdout, r.stderr
    # it starts where the first run ended, far below a fresh model's loss
    assert read_log(str(tmp_path / "second"))[1] < read_log(first)[1] - 1.0


def test_out_of_memory_is_one_line(tmp_path):
    script = tmp_path / "big.py"
    script.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\nimport errors\nimport torch\n"
                      "torch.empty(2**50)\n")  # a petabyte: the CPU allocator refuses it with a RuntimeError
    r = run([str(script)])
    assert r.returncode == 1 and r.stderr.startswith("error: out of memory (") and "lower batch_size" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


# train.py with each checkpoint save slowed down and said on stdout, so that a signal can come in the middle of one
SLOW_SAVES = """
import os, runpy, sys, time
sys.path.insert(0, {repo!r})
import errors, checkpoint
save_checkpoint = checkpoint.save_checkpoint

def slow_save_checkpoint(path, state):
    print("saving", flush=True)
    time.sleep(2)
    save_checkpoint(path, state)

checkpoint.save_checkpoint = slow_save_checkpoint
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path(os.path.join({repo!r}, "train.py"), run_name="__main__")
"""
INTERRUPTED = "interrupted: what was finished is kept; run the same command again to go on"
STOPPED = "stopped by signal at step "
# (phase, the signal, what the run prints just before it comes, the line said last)
PHASES = [("imports", signal.SIGINT, None, INTERRUPTED), ("start-up", signal.SIGTERM, "training a 1000-piece", INTERRUPTED),
          ("loop", signal.SIGINT, "step      2 ", STOPPED), ("save", signal.SIGTERM, "saving", STOPPED)]


@pytest.mark.parametrize("phase, signum, after, last", PHASES, ids=[phase for phase, _, _, _ in PHASES])
def test_a_signal_to_torchrun_is_answered_at_once_and_said_last(data_dir, tmp_path, phase, signum, after, last):
    # Ctrl-C or SIGTERM reaches torchrun, which passes it to the ranks: each stops at once (where they have
    # nothing to save) or at the next log step, after a checkpoint, and none has to be killed; the project's line
    # comes after torchrun's own report
    script = tmp_path / "slow_saves.py"
    script.write_text(SLOW_SAVES.format(repo=REPO))
    data = tmp_path / "pydoc" if phase == "start-up" else data_dir  # pydoc, prepared on first use
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={data}", f"--out_dir={out}", "--max_steps=1000", "--eval_interval=1000",
            f"--checkpoint_interval={1 if phase == 'save' else 1000}"]
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen([sys.executable, *launch, str(script) if phase == "save" else "train.py", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if after is None:  # the ranks have started, and import
        while not any(open(path).read().strip() for path in glob.glob(f"/proc/{proc.pid}/task/*/children")):
            time.sleep(0.01)
        time.sleep(0.5)
    stdout = ""
    while after and after not in stdout and proc.poll() is None:
        stdout += proc.stdout.readline()
    proc.send_signal(signum)
    stdout, stderr = (stdout + more for more in proc.communicate(timeout=120))
    assert proc.returncode != 0 and stderr.count("Traceback") == 1, stderr  # torchrun's own, for the signal
    assert "forcefully exiting" not in stderr, stderr  # no rank left waiting until torchrun's SIGKILL
    assert stderr.strip().splitlines()[-1].startswith(last), stderr
    if last == STOPPED:
        assert "the run saves a checkpoint and stops within 3 steps, at the same step on every rank" in stderr, stderr
        step = int(stderr.strip().splitlines()[-1].removeprefix(STOPPED).split(":")[0])
        import torch
        assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == step


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_between_log_steps_stops_within_steps_and_resumes_exactly(data_dir, tmp_path, nproc):
    # SIGTERM far from any log step: one process, which needs no other's word, stops after the step it came in;
    # torchrun's 2 ranks, at the same step within 3 of it. Either saves a checkpoint, from which --init_from=resume
    # logs what a run never stopped logs
    args = [*TINY, f"--data_dir={data_dir}", "--lr_schedule=constant", "--eval_interval=1000000",
            "--checkpoint_interval=1000000"]
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
    import torch
    step = torch.load(stopped / "ckpt.pt", weights_only=False)["step"]
    signalled_after = int(stderr.split("SIGTERM after step ")[1].split(":")[0])
    assert 1 < signalled_after + 1 <= step <= signalled_after + (1 if nproc == 1 else 3), stderr
    assert f"stopped by signal at step {step}" in stdout + stderr, stderr
    assert run([*launch, "train.py", *args, f"--out_dir={stopped}", "--init_from=resume", f"--max_steps={step + 3}"]
               ).returncode == 0
    assert run([*launch, "train.py", *args, f"--out_dir={straight}", f"--max_steps={step + 3}"]).returncode == 0
    resumed, never_stopped = read_log(str(stopped)), read_log(str(straight))
    assert [resumed[k] for k in range(step + 1, step + 4)] == [never_stopped[k] for k in range(step + 1, step + 4)]
