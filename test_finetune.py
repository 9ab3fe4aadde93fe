"""
finetune.py on a made-up Super-Natural-Instructions clone: the task-file parser, Tk-Instruct's prompt to the byte,
Rouge-L against the rouge-score package, and fine-tuning plus evaluation run end to end as a user runs them.
"""
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from finetune import (build_prompt, collate, compute_metrics, generate_predictions, load_split, rouge_l,
                      tokenize_example)
from model import T5, T5Config
from checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint, save_checkpoint
from hf import save_pretrained
from tokenizer import tokenizer_of
from prepare import prepare
from test_train import TINY, data_dir, forked, saved_step, wandb_runs  # noqa: F401 (data_dir is a fixture)

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

REPO = os.path.dirname(os.path.abspath(__file__))
WORDS = "red green blue cat dog bird tree river stone house road light water fire wind rain".split()


def run(args):
    r = forked(["finetune.py", *args], dict(HF_HUB_OFFLINE="1", WANDB_MODE="offline"))  # wandb's files only
    assert r.returncode != "timeout", r.stderr
    return r


def make_task(definition, transform, num_instances, rng, extra_reference=False):
    """A task in SNI's layout; its answers are `transform` of the input words."""
    def pair():
        words = rng.sample(WORDS, 4)
        return " ".join(words), transform(words)
    positives = [dict(zip(("input", "output"), pair()), explanation="because") for _ in range(3)]
    instances = []
    for i in range(num_instances):
        text, answer = pair()
        references = [answer, answer.upper()] if extra_reference else [answer]
        instances.append({"id": f"inst-{i}", "input": text, "output": references})
    return {"Contributors": ["test"], "Source": ["made up"], "Categories": ["Text Modification"],
            "Definition": definition, "Positive Examples": positives, "Negative Examples": [], "Instances": instances}


@pytest.fixture(scope="module")
def sni_dir(tmp_path_factory):
    """Two train tasks (list and plain-string Definition), one test task."""
    root = tmp_path_factory.mktemp("natural-instructions")
    (root / "tasks").mkdir()
    (root / "splits" / "default").mkdir(parents=True)
    rng = random.Random(0)
    tasks = {
        "task001_copy": make_task(["Copy the input words."], " ".join, 12, rng, extra_reference=True),
        "task002_reverse": make_task("Write the input words in reverse order", lambda w: " ".join(w[::-1]), 12, rng),
        "task101_first_word": make_task(["Answer with the first word"], lambda w: w[0], 12, rng),
    }
    for instance in tasks["task002_reverse"]["Instances"]:
        del instance["id"]  # older task files have no instance ids
    for name, task in tasks.items():
        (root / "tasks" / f"{name}.json").write_text(json.dumps(task, indent=4))
    (root / "splits" / "default" / "train_tasks.txt").write_text("task001_copy\ntask002_reverse\n")
    (root / "splits" / "default" / "test_tasks.txt").write_text("task101_first_word\n")
    return str(root)


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    """A tiny randomly initialised T5 checkpoint in train.py's format, with a small sentencepiece tokenizer."""
    root = tmp_path_factory.mktemp("pretrained")
    rng = random.Random(1)
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(1000):
            words = [rng.choice(WORDS) for _ in range(12)]
            text = build_prompt("Copy the words in reverse order", [(" ".join(words[:4]), " ".join(words[3::-1]))],
                                " ".join(words[4:8]), num_pos_examples=1) + " ".join(words[8:])
            f.write(json.dumps({"text": text}) + "\n")
    meta = prepare(dataset=str(root / "corpus.jsonl"), tokenizer="train", out_dir=str(root / "data"), vocab_size=64)
    config = T5Config(vocab_size=meta["model_vocab_size"], d_model=32, d_kv=8, d_ff=64, num_layers=1,
                      num_decoder_layers=1, num_heads=2)
    torch.manual_seed(0)
    model = T5(config)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters())
    tokenizer = (root / "data" / "tokenizer.model").read_bytes()
    save_checkpoint(str(root), model, optimizer, 0, 0.0, dict(program="train.py", config={}, meta=meta,
                                                              tokenizer=tokenizer))
    return str(root)


def test_prompt_is_tk_instructs_to_the_byte():
    positives = [("Bulgaria", "380"), ("What is it?", "  42!  "), ("never", "shown")]
    assert build_prompt(" Return the barcode prefix ", positives, "Canada") == (
        "Definition: Return the barcode prefix.\n\n"
        " Positive Example 1 -\nInput: Bulgaria.\n Output: 380.\n\n"
        " Positive Example 2 -\nInput: What is it?\n Output: 42!\n\n"
        "Now complete the following example -\nInput: Canada.\nOutput: ")
    assert build_prompt("Say it.", positives, "", num_pos_examples=0) == (
        "Definition: Say it.\n\nNow complete the following example -\nInput: .\nOutput: ")


def test_split_parsing(sni_dir):
    train = load_split(sni_dir, "train", 10, seed=0)
    by_task = {name: [ex for ex in train if ex["task"] == name] for name in ("task001_copy", "task002_reverse")}
    assert [len(exs) for exs in by_task.values()] == [10, 10] and len(train) == 20
    # Definition as a list (current task files) and as a plain string (older ones)
    assert by_task["task001_copy"][0]["definition"] == "Copy the input words."
    assert by_task["task002_reverse"][0]["definition"] == "Write the input words in reverse order"
    assert by_task["task001_copy"][0]["id"].startswith("inst-")
    assert by_task["task002_reverse"][0]["id"].startswith("task002_reverse-")  # made from the instance's index
    # several references: train on one of them, evaluate against all
    copy = by_task["task001_copy"][0]
    assert len(copy["references"]) == 2 and copy["target"] in copy["references"]
    assert {ex["target"].isupper() for ex in by_task["task001_copy"]} == {True, False}

    def ids(examples):
        return [(ex["id"], ex["target"]) for ex in examples]
    assert ids(load_split(sni_dir, "train", 10, seed=0)) == ids(train)  # the seed decides, nothing else
    assert ids(load_split(sni_dir, "train", 10, seed=1)) != ids(train)
    assert len(load_split(sni_dir, "test", 100, seed=0)) == 12


def test_missing_data_dir_names_the_clone_command(tmp_path):
    with pytest.raises(SystemExit, match="git clone https://github.com/allenai/natural-instructions"):
        load_split(str(tmp_path / "natural-instructions"), "train", 100, seed=0)


class CharTokenizer:
    """One id per character, so lengths are easy to reason about."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_long_prompts_drop_examples_then_truncate():
    example = dict(definition="Copy.", positives=[("a" * 40, "a" * 40), ("b" * 40, "b" * 40)], input="hello",
                   target="x" * 50)
    full = build_prompt("Copy.", example["positives"], "hello")
    one = build_prompt("Copy.", example["positives"], "hello", num_pos_examples=1)
    args = (CharTokenizer(), 1)  # EOS id 1
    for limit, prompt in ((len(full) + 1, full), (len(full), one), (len(one) + 1, one)):
        ex = tokenize_example(example, *args, max_input_length=limit, max_target_length=128, num_pos_examples=2)
        assert ex["prompt"] == prompt and ex["input_ids"] == [ord(c) for c in prompt] + [1]
    ex = tokenize_example(example, *args, max_input_length=20, max_target_length=8, num_pos_examples=2)
    assert ex["prompt"] == "Definition: Copy.\n\n" and len(ex["input_ids"]) == 20 and ex["input_ids"][-1] == 1
    assert ex["labels"] == [ord("x")] * 7 + [1]


def test_collate_pads_to_a_multiple_of_8():
    examples = [dict(input_ids=[5] * 9, labels=[6] * 3), dict(input_ids=[7] * 2, labels=[8] * 10)]
    batch = collate(examples, pad_id=0)
    input_ids, labels, attention_mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert input_ids.shape == attention_mask.shape == (2, 16) and labels.shape == (2, 16)
    assert attention_mask.sum(1).tolist() == [9, 2] and (input_ids == 0).sum().item() == 7 + 14
    assert labels[0, 3:].eq(-100).all() and labels[1, :10].eq(8).all() and labels[1, 10:].eq(-100).all()


def test_rouge_l_equals_rouge_score():
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    cases = [("the cats are running home", ["a cat runs home"]),
             ("police killed the gunman", ["the gunman police killed", "gunman was killed by police"]),
             ("", ["anything"]),
             ("Exactly this.", ["exactly this"])]
    for prediction, references in cases:
        expected = 100 * max(scorer.score(ref, prediction)["rougeL"].fmeasure for ref in references)
        assert rouge_l(prediction, references) == pytest.approx(expected)
    assert rouge_l("the cats are running", ["cat run"]) == pytest.approx(100 * 2 * 0.5 * 1 / 1.5)  # stemmer on


def test_metrics_average_examples_overall():
    records = [dict(task="a", prediction="the cat sat", references=["the cat sat"]),
               dict(task="a", prediction="a dog", references=["the cat sat", "dog"]),
               dict(task="b", prediction="no", references=["yes"])]
    metrics = compute_metrics(records)
    dog = rouge_l("a dog", ["dog"])  # 2/3: precision 1/2, recall 1
    assert dog == pytest.approx(100 * 2 / 3)
    # over all examples, as Tk-Instruct averages, not over the task means
    assert metrics["rougeL"] == pytest.approx((100 + dog) / 3)


def test_finetune_then_evaluate(sni_dir, ckpt_path, tmp_path):
    out = str(tmp_path / "ft")
    common = [f"--data_dir={sni_dir}", "--device=cpu", "--max_num_instances_per_task=10", "--max_new_tokens=8",
              "--eval_batch_size=4"]
    r = run([*common, f"--init_from={ckpt_path}", f"--out_dir={out}", "--batch_size=4", "--epochs=1", "--lr=1e-3",
             "--log_interval=1"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "log.jsonl")) as f:
        losses = [rec["loss"] for rec in map(json.loads, f) if "loss" in rec]
    assert len(losses) == 5  # 20 train examples / batch 4, one epoch
    assert load_checkpoint(find_checkpoint(out), weights=False)["step"] == 5
    # sample.py takes a fine-tuned run as it takes a pre-trained one, with the tokenizer its checkpoint names
    sampled = subprocess.run([sys.executable, "sample.py", f"--init_from={out}", "--text=red <extra_id_0> blue",
                              "--device=cpu", "--max_new_tokens=4"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert sampled.returncode == 0 and "model: red [" in sampled.stdout, sampled.stderr

    with open(os.path.join(out, "predictions.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 10 and {r["task"] for r in records} == {"task101_first_word"}
    assert all(r["prompt"].startswith("Definition: Answer with the first word.\n\n Positive Example 1 -\n")
               and r["prompt"].endswith("\nOutput: ") for r in records)

    # the metrics again, straight from predictions.jsonl with rouge-score
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rouge = [100 * max(scorer.score(ref, r["prediction"])["rougeL"].fmeasure for ref in r["references"])
             for r in records]
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["rougeL"] == pytest.approx(sum(rouge) / 10)
    assert metrics["num_examples"] == 10 and metrics["step"] == 5
    # it names the weights it fine-tuned, and their tokenizer
    tokenizer = load_checkpoint(find_checkpoint(ckpt_path), weights=False)["tokenizer"]
    assert metrics["init_from"] == find_checkpoint(ckpt_path)
    assert metrics["tokenizer_sha256"] == hashlib.sha256(tokenizer).hexdigest()
    # killed after a checkpoint and resumed, the same run writes the same metrics.json: --init_from=resume is the
    # weights the run started from
    cut = str(tmp_path / "cut")
    proc = subprocess.Popen([sys.executable, "finetune.py", *common, f"--init_from={ckpt_path}", f"--out_dir={cut}",
                             "--batch_size=4", "--epochs=1", "--lr=1e-3", "--checkpoint_interval=2",
                             "--eval_interval=1"], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not os.path.exists(os.path.join(cut, "ckpt", "step-2", ".metadata")):
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert saved_step(cut) in (2, 4)
    r = run([*common, "--init_from=resume", f"--out_dir={cut}", "--batch_size=4", "--epochs=1", "--lr=1e-3"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(cut, "metrics.json")) as f:
        assert json.load(f) == metrics

    # the same weights in Hugging Face's layout, with the tokenizer as spiece.model beside them, evaluate the same
    ckpt = load_checkpoint(find_checkpoint(out))
    model = model_from_checkpoint(ckpt)
    hf_dir = str(tmp_path / "hf")
    save_pretrained(model, hf_dir)
    shutil.copy(os.path.join(ckpt["meta"]["data_dir"], ckpt["meta"]["tokenizer_file"]), hf_dir + "/spiece.model")
    again = str(tmp_path / "eval")
    r = run([*common, f"--init_from={hf_dir}", f"--out_dir={again}", "--eval_only=True"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(again, "predictions.jsonl")) as f:
        assert [json.loads(line) for line in f] == records


def test_ids_past_the_model_vocab_are_caught_at_loading(sni_dir, ckpt_path, tmp_path):
    # a run of the pre-training's tokenizer whose model has a vocab of 8
    ckpt = load_checkpoint(find_checkpoint(ckpt_path), weights=False)
    small = T5(T5Config(**{**ckpt["model_config"], "vocab_size": 8}))
    path = str(tmp_path / "small")
    save_checkpoint(path, small, torch.optim.AdamW(small.parameters()), 0, 0.0,
                    {key: ckpt[key] for key in ("program", "config", "meta", "tokenizer")})
    r = run([f"--data_dir={sni_dir}", f"--init_from={path}", "--device=cpu", f"--out_dir={tmp_path / 'out'}"])
    assert r.returncode == 1 and "vocab_size 8" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_predictions_are_decoded_as_tk_instruct_decodes_them(ckpt_path):
    """Tk-Instruct scores batch_decode(..., skip_special_tokens=True): no sentinels, pad or unk in the text."""
    tokenizer = tokenizer_of(load_checkpoint(find_checkpoint(ckpt_path)), ckpt_path)
    words = tokenizer.encode("red cat")
    sentinel, unk, eos = tokenizer.first_sentinel_id, tokenizer.unk_id, tokenizer.eos_id

    class Generator:
        config = T5Config(eos_token_id=eos, pad_token_id=tokenizer.pad_id)

        def generate(self, input_ids, attention_mask, max_new_tokens, all_steps=False):
            return torch.tensor([[sentinel, *words, unk, sentinel - 1, eos, *words]] * len(input_ids))

    examples = [dict(input_ids=[5, 6, eos], labels=[eos]), dict(input_ids=[7, eos], labels=[eos])]
    predictions = generate_predictions(Generator(), examples, tokenizer, 2, 8, "cpu", contextlib.nullcontext)
    assert sorted(predictions) == [(0, "red cat"), (1, "red cat")]


SMALL_RUN = ["--max_num_instances_per_task=4", "--batch_size=4", "--max_new_tokens=2", "--eval_batch_size=4",
             "--device=cpu"]


def test_a_signal_saves_and_stops_and_the_resume_reads_the_tokenizer_of_the_start(sni_dir, ckpt_path, tmp_path):
    """Evaluating at every step, as train.py, but not after the signal's save. And from Hugging Face weights with a
    spiece.model of their own: the run's checkpoints carry it, so that its resume (and sample.py, export.py) read it,
    not T5's (before, a resume fell back to T5's tokenizer, here out of reach offline). Logged to wandb (offline), the
    resume continues the run's wandb run."""
    ckpt = load_checkpoint(find_checkpoint(ckpt_path))
    hf, out = str(tmp_path / "hf"), str(tmp_path / "ft")
    save_pretrained(model_from_checkpoint(ckpt), hf, ckpt["tokenizer"])
    common = [f"--data_dir={sni_dir}", *SMALL_RUN, f"--out_dir={out}", "--wandb_log=True"]
    proc = subprocess.Popen([sys.executable, "finetune.py", *common, f"--init_from={hf}", "--max_steps=100000",
                             "--eval_interval=1", "--log_interval=1", "--checkpoint_interval=100000"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                                     WANDB_MODE="offline"))
    stdout = ""
    while "step 2: Rouge-L" not in stdout and proc.poll() is None:
        stdout += proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    more, stderr = proc.communicate(timeout=120)
    stdout += more
    assert proc.returncode == 128 + signal.SIGTERM, stderr  # after its save, as the signal would end it
    step = load_checkpoint(find_checkpoint(out), weights=False)["step"]
    assert step >= 2 and f"stopped by signal at step {step}" in stdout, stdout
    assert f"step {step - 1}: Rouge-L" in stdout and f"step {step}: Rouge-L" not in stdout, stdout
    wandb_id = load_checkpoint(find_checkpoint(out), weights=False)["wandb_id"]
    r = run([*common, "--init_from=resume", f"--max_steps={step + 1}"])
    assert r.returncode == 0, r.stderr
    resumed = load_checkpoint(find_checkpoint(out), weights=False)
    assert resumed["tokenizer"] == ckpt["tokenizer"]
    (first, first_history), (again, again_history) = wandb_runs(out)
    assert first.run_id == again.run_id == wandb_id == resumed["wandb_id"]
    assert "loss" in first_history[step] and "rougeL" in first_history[step - 1]
    assert "loss" in again_history[step + 1] and "rougeL" in again_history[step + 1]


# scripts run one after another in one process (json: [[script, args], ...] in argv[2]) under sys.setprofile (and
# threading.setprofile, for the data's threads): the project functions each calls, by file, as JSON in argv[1].
# Importing a file is no call.
PROFILED = """
import json, os, runpy, sys, threading
repo, out, runs = {repo!r}, sys.argv[1], json.loads(sys.argv[2])
sys.path[0] = repo
import numpy, sentencepiece, tiktoken, torch, torch.distributed.fsdp, tqdm  # imported before: profiled, slow
called = set()

def profile(frame, event, arg):
    code = frame.f_code  # functions only (CO_OPTIMIZED): not a module's or a class's body
    if event == "call" and code.co_flags & 1 and os.path.dirname(os.path.abspath(code.co_filename)) == repo:
        called.add((os.path.basename(code.co_filename), code.co_qualname))
calls = {{}}
for script, args in runs:
    called.clear()
    sys.argv = [script, *args]
    sys.setprofile(profile)
    threading.setprofile(profile)
    runpy.run_path(script, run_name="__main__")
    sys.setprofile(None)
    threading.setprofile(None)
    calls[script] = sorted(called)
json.dump(calls, open(out, "w"))
"""


def test_a_one_process_run_calls_nothing_of_the_multi_gpu_file(sni_dir, ckpt_path, data_dir, tmp_path):  # noqa: F811
    """train.py, finetune.py and bench.py without torchrun: a one-GPU reader never needs distributed.py"""
    script = tmp_path / "profiled.py"
    script.write_text(PROFILED.format(repo=REPO))
    runs = {"train.py": [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'train'}", "--max_steps=1",
                         "--eval_interval=1", "--warmup_steps=1"],
            "finetune.py": [f"--data_dir={sni_dir}", *SMALL_RUN, f"--init_from={ckpt_path}",
                            f"--out_dir={tmp_path / 'finetune'}", "--max_steps=1"],
            "bench.py": ["--device=cpu", "--model=t5-mini", "--batch_size=2", "--input_length=32", "--steps=1",
                         "--burn_in=0", "--compile=False", "--dtype=float32"]}
    calls = tmp_path / "calls.json"
    r = subprocess.run([sys.executable, str(script), str(calls), json.dumps(list(runs.items()))], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    for name, called in json.load(open(calls)).items():
        files = {file for file, _ in called}
        assert {"model.py", "optim.py", "runtime.py", "checkpoint.py"} & files and name in files, (name, files)
        assert [function for file, function in called if file == "distributed.py"] == [], name
