"""Tests for checkpoint.py: checkpoint files written whole, what a new run may write over, the resume check."""
import errno
import os

import pytest
import torch

from checkpoint import check_new_run, load_checkpoint, load_resume, restore_state, save_checkpoint
from model import T5, T5Config
from optim import AdamWScale

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

REPO = os.path.dirname(os.path.abspath(__file__))


def tiny_run(out_dir, step=1, config=None, meta=None, program="train.py"):
    """a one-process run's checkpoint of t5-mini, as train.py writes it; (model, optimizer)"""
    t5 = T5(T5Config.from_preset("t5-mini", vocab_size=256))
    opt = AdamWScale(t5.parameters(), lr=1e-2)
    os.makedirs(out_dir, exist_ok=True)
    save_checkpoint(str(out_dir), t5, opt, step, 1.0, config or {}, meta, program)
    return t5, opt


def test_a_run_keeps_its_own_gpus_rng_state_so_a_resume_may_see_other_gpus(monkeypatch, tmp_path):
    # 8 GPUs visible when saving: the state of this rank's GPU alone is kept, and restored on a machine with fewer
    # (every visible GPU's states, restored one per GPU, would fail there)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.arange(16, dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    t5, opt = tiny_run(tmp_path, step=3)
    state = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert torch.equal(state["rng"]["cuda"], torch.arange(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert restore_state(state, t5, opt) == (3, 1.0)
    assert len(restored) == 1 and torch.equal(restored[0], torch.arange(16, dtype=torch.uint8))


def test_checkpoint_round_trip(tmp_path):
    t5, opt = tiny_run(tmp_path, step=3)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # written whole, then renamed: no .tmp left
    state = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert state["step"] == 3 and state["program"] == "train.py"
    assert all(torch.equal(t, state["model"][name]) for name, t in t5.state_dict().items())


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    tiny_run(tmp_path, step=1)
    path = str(tmp_path / "ckpt.pt")
    good = open(path, "rb").read()
    for where in ("os.fsync", "os.replace", "torch.save"):  # at the flush, the rename, and while writing
        with monkeypatch.context() as m:
            m.setattr(where, full_disk)
            with pytest.raises(OSError, match="No space left on device"):
                tiny_run(tmp_path, step=2)
        assert open(path, "rb").read() == good


def test_a_new_run_never_replaces_another_runs_files(tmp_path):
    tiny_run(tmp_path)
    with pytest.raises(SystemExit, match="ckpt.pt exists and this run would replace it: pass another --out_dir, "
                                         "or --init_from=resume"):
        check_new_run(str(tmp_path))
    for name in ("log.jsonl", "metrics.json", "predictions.jsonl", "ckpt"):  # a run killed before its first
        (tmp_path / name.split(".")[0]).mkdir()  # checkpoint, a fine-tuning's results, an FSDP run's checkpoint
        (tmp_path / name.split(".")[0] / name).write_text("{}")
        with pytest.raises(SystemExit, match=f"{name} exists and this run would replace it"):
            check_new_run(str(tmp_path / name.split(".")[0]))
    check_new_run(str(tmp_path / "nothing"))  # a folder still to make


def test_resume_refuses_other_settings_and_reports_changes(tmp_path, capsys):
    meta = {"settings": {"tokenizer": "t5", "vocab_size": None}}
    config = {"model": "t5-tiny", "optimizer": "adamwscale", "lr": 0.02, "max_steps": 10, "init_from": "scratch"}
    tiny_run(tmp_path, step=7, config=config, meta=meta)
    path = tmp_path / "ckpt.pt"
    changed = dict(config, lr=0.01, max_steps=20, init_from="resume")
    assert load_resume(str(tmp_path), "train.py", False, changed, meta, fixed=("model", "optimizer"))["step"] == 7
    assert capsys.readouterr().out == (f"resuming from {path} at step 7; changed on resume: lr 0.02 -> 0.01, "
                                       "max_steps 10 -> 20\n")
    with pytest.raises(SystemExit, match="other settings \\(model 't5-tiny' -> 't5-v1_1-small', optimizer "
                                         "'adamwscale' -> 'adafactor'\\)"):
        load_resume(str(tmp_path), "train.py", False, dict(changed, model="t5-v1_1-small", optimizer="adafactor"),
                    meta, fixed=("model", "optimizer"))
    other_data = {"settings": {"tokenizer": "train", "vocab_size": 4000}}
    with pytest.raises(SystemExit, match="data.tokenizer 't5' -> 'train', data.vocab_size None -> 4000"):
        load_resume(str(tmp_path), "train.py", False, changed, other_data, fixed=("model", "optimizer"))
    with pytest.raises(SystemExit, match="was written by train.py, and finetune.py resumes only its own runs"):
        load_resume(str(tmp_path), "finetune.py", False, changed, meta, fixed=())
    with pytest.raises(SystemExit, match="no checkpoint to resume at .*/ckpt; .*/ckpt.pt is another format's: leave fsdp"):
        load_resume(str(tmp_path), "train.py", True, changed, meta, fixed=())
    with pytest.raises(SystemExit, match="no checkpoint to resume at .*/nothing/ckpt.pt: train one first"):
        load_resume(str(tmp_path / "nothing"), "train.py", False, changed, meta, fixed=())
