"""
FSDP (train.py --fsdp=True) on 2 CPU ranks over gloo, run as a user runs it: the same losses as one process for
both optimizers, half the state per rank, exact kill-and-resume from sharded checkpoints, and a sharded checkpoint
read back in one process and exported to Hugging Face's format.
"""
import glob
import os
import re
import shutil
import signal
import time

import pytest
import torch

from model import T5
from checkpoint import load_checkpoint
from test_finetune import sni_dir  # noqa: F401 (a fixture)
from test_train import TINY, data_dir, read_log, run, start_until_step  # noqa: F401 (data_dir is a fixture)

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# 8 steps, a checkpoint at step 4 and at the end
ARGS = [*TINY, "--max_steps=8", "--checkpoint_interval=4", "--eval_interval=1000"]


def kill_run(pid):
    """SIGKILL to torchrun and to the ranks it started, all at once, as a crashed node would end them (the ranks run in
    sessions of their own, which a signal to torchrun's process group would miss)"""
    ranks = []
    for children in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(children) as f:
            ranks += [int(child) for child in f.read().split()]
    for p in [pid, *ranks]:
        os.kill(p, signal.SIGKILL)


def state_mib(stdout):
    return float(re.search(r"parameters \+ optimizer state: ([\d.]+) MiB", stdout).group(1))


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):  # noqa: F811
    """one process (2 micro-steps) and 2 FSDP ranks (1 micro-step each) on the same global batches, per optimizer"""
    root = tmp_path_factory.mktemp("fsdp")
    out = {}
    for optimizer in ("adamwscale", "adafactor"):
        for name, launch, extra in (("one", [], ["--grad_accum_steps=2"]), ("fsdp", TORCHRUN, ["--fsdp=True"])):
            out_dir = str(root / f"{optimizer}-{name}")
            r = run([*launch, "train.py", *ARGS, f"--data_dir={data_dir}", f"--out_dir={out_dir}",
                     f"--optimizer={optimizer}", *extra])
            assert r.returncode == 0, r.stderr
            out[optimizer, name] = out_dir, r.stdout
    return out


@pytest.mark.parametrize("optimizer", ["adamwscale", "adafactor"])
def test_two_fsdp_ranks_match_one_process(runs, optimizer):
    # AdamWScale's RMS(p) and Adafactor's column means and RMS clipping need the whole tensor, not a rank's slice:
    # computed on the slices alone, the losses part from step 2 on
    one, fsdp = read_log(runs[optimizer, "one"][0]), read_log(runs[optimizer, "fsdp"][0])
    assert one.keys() == fsdp.keys() == set(range(1, 9))
    for step in one:
        assert fsdp[step] == pytest.approx(one[step], rel=1e-4), step


def test_each_rank_holds_half_the_state(runs):
    one, fsdp = state_mib(runs["adamwscale", "one"][1]), state_mib(runs["adamwscale", "fsdp"][1])
    # weights + AdamWScale's two moments in fp32: 12 bytes per parameter, split over 2 ranks (+ padding of odd rows)
    t5 = T5.from_checkpoint(load_checkpoint(os.path.join(runs["adamwscale", "one"][0], "ckpt.pt")))
    assert one == pytest.approx(12 * t5.num_params() / 2**20, rel=1e-3)
    assert fsdp == pytest.approx(one / 2, rel=0.01)


def test_sharded_checkpoint_loads_into_one_process_and_exports(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = load_checkpoint(os.path.join(runs["adamwscale", "fsdp"][0], "ckpt"))
    assert ckpt["step"] == 8 and not os.path.exists(os.path.join(runs["adamwscale", "fsdp"][0], "ckpt.tmp"))
    ours = T5.from_checkpoint(ckpt).eval()
    # the trained weights, not fresh ones: within float rounding of the one-process run's after the same 8 steps
    reference = load_checkpoint(os.path.join(runs["adamwscale", "one"][0], "ckpt.pt"))["model"]
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=2e-3 * reference[name].abs().max().item())
    # the README's export command, which reads the shards in one process
    r = run(["export.py", f"--init_from={runs['adamwscale', 'fsdp'][0]}", f"--out_dir={tmp_path / 'hf'}"])
    assert r.returncode == 0, r.stderr
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    torch.manual_seed(0)
    input_ids, labels = torch.randint(2, 200, (2, 12)), torch.randint(2, 200, (2, 7))
    with torch.no_grad():
        logits, _ = ours(input_ids, labels=labels)
        expected = theirs(input_ids=input_ids, labels=labels).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_kill_and_resume_is_exact(runs, data_dir, tmp_path):  # noqa: F811
    straight = runs["adamwscale", "fsdp"][0]
    killed = str(tmp_path / "killed")
    args = [*TORCHRUN, "train.py", *ARGS, f"--data_dir={data_dir}", f"--out_dir={killed}", "--fsdp=True"]
    proc = start_until_step(args, killed, 5)
    kill_run(proc.pid)  # no chance to save: only the step-4 checkpoint survives
    proc.wait()
    time.sleep(1)  # a rank still alive would go on logging
    assert 5 <= max(read_log(killed)) < 8
    assert torch.load(os.path.join(killed, "ckpt", "state.pt"), weights_only=False)["step"] == 4

    r = run([*args, "--init_from=resume"])
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "at step 4" in r.stdout, r.stdout
    assert read_log(killed) == read_log(straight)  # bit-identical on CPU, every step


def test_half_written_checkpoint_is_never_taken(runs, tmp_path):
    """a run killed mid-save leaves ckpt.tmp; killed between commit_dir's two renames, only ckpt.old"""
    out = tmp_path / "out"
    shutil.copytree(os.path.join(runs["adamwscale", "fsdp"][0], "ckpt"), out / "ckpt.old")
    (out / "ckpt.tmp").mkdir()
    (out / "ckpt.tmp" / "__0_0.distcp").write_bytes(b"half")
    assert load_checkpoint(str(out / "ckpt"))["step"] == 8


def test_finetune_from_a_sharded_checkpoint_matches_one_process(runs, sni_dir, tmp_path):  # noqa: F811
    """finetune.py --fsdp=True on 2 ranks from train.py's sharded checkpoint, against one process reading the same
    directory whole: the same weights after 3 steps, and the same predictions from generate() on the gathered ones"""
    common = ["finetune.py", f"--init_from={os.path.join(runs['adamwscale', 'fsdp'][0], 'ckpt')}",
              f"--data_dir={sni_dir}", "--device=cpu", "--max_num_instances_per_task=10", "--max_new_tokens=8",
              "--eval_batch_size=4", "--batch_size=4", "--max_steps=3", "--lr=1e-3", "--log_interval=1",
              "--dropout=0.0"]
    one, fsdp = str(tmp_path / "one"), str(tmp_path / "fsdp")
    r = run([*common, f"--out_dir={one}", "--grad_accum_steps=2"])
    assert r.returncode == 0, r.stderr
    r = run([*TORCHRUN, *common, f"--out_dir={fsdp}", "--fsdp=True"])
    assert r.returncode == 0, r.stderr
    ours_log, reference_log = read_log(fsdp), read_log(one)
    assert ours_log.keys() == reference_log.keys() == {1, 2, 3}
    for step in reference_log:
        assert ours_log[step] == pytest.approx(reference_log[step], rel=1e-4), step
    ours, reference = load_checkpoint(os.path.join(fsdp, "ckpt")), load_checkpoint(os.path.join(one, "ckpt.pt"))
    assert ours["step"] == reference["step"] == 3
    for name, tensor in reference["model"].items():
        torch.testing.assert_close(ours["model"][name], tensor, rtol=0, atol=1e-3 * tensor.abs().max().item())
    with open(os.path.join(one, "predictions.jsonl")) as f, open(os.path.join(fsdp, "predictions.jsonl")) as g:
        assert f.read() == g.read()


def test_sample_reads_a_sharded_checkpoint(runs):
    from sample import encode, fill_in
    from prepare import load_tokenizer
    out = runs["adamwscale", "fsdp"][0]
    text = "The river <extra_id_0> the city."
    r = run(["sample.py", f"--init_from={out}", f"--text={text}", "--device=cpu", "--max_new_tokens=8"])
    assert r.returncode == 0, r.stderr
    ckpt = load_checkpoint(os.path.join(out, "ckpt"))
    tok, t5 = load_tokenizer(ckpt["meta"]), T5.from_checkpoint(ckpt).eval()
    ids = encode(tok, text)
    fill = t5.generate(torch.tensor([ids]), max_new_tokens=8)[0].tolist()
    assert f"model: {fill_in(tok, tok.decode(ids), fill)}\n" in r.stdout
