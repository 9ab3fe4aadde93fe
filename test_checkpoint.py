"""Tests for checkpoint.py and files.py: checkpoint files, atomic writes on a full disk, the out_dir's claim, and the
resume check."""
import errno
import os
import subprocess
import sys

import pytest
import torch

from checkpoint import (check_resume, claim_out_dir, load_checkpoint, load_weights, restore_state, run_state,
                        save_checkpoint)
from files import UserError, atomic_write
from model import T5, T5Config
from optim import AdamWScale
from runtime import Logger, Runtime

REPO = os.path.dirname(os.path.abspath(__file__))


def test_weights_that_do_not_fit_the_model_are_one_line_naming_the_tensor():
    model = T5(T5Config.from_preset("t5-mini", vocab_size=256))
    weights = {name: torch.zeros(t.shape) for name, t in model.state_dict().items()}
    assert load_weights(model, weights) is model and all(t.abs().sum() == 0 for t in model.state_dict().values())
    wider = dict(weights, **{"encoder.ln_f.weight": torch.zeros(129)})
    with pytest.raises(UserError, match=r"encoder.ln_f.weight is \(129,\) in the weights and \(128,\) in the model$"):
        load_weights(model, wider)
    missing = {name: t for name, t in weights.items() if name != "lm_head.weight"}
    with pytest.raises(UserError, match=r"lm_head.weight is absent in the weights and \(256, 128\) in the model$"):
        load_weights(model, missing)


def test_a_run_keeps_its_own_gpus_rng_state_so_a_resume_may_see_other_gpus(monkeypatch):
    # 8 GPUs visible when saving: the state of this rank's GPU alone is kept, and restored on a machine with fewer
    # (every visible GPU's states, restored one per GPU, would fail there)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.arange(16, dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    t5 = T5(T5Config.from_preset("t5-mini", vocab_size=256))
    opt = AdamWScale(t5.parameters(), lr=1e-2)
    state = run_state(t5, opt, step=3, elapsed=1.0, config={})
    assert torch.equal(state["rng"]["cuda"], torch.arange(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert restore_state(state, t5, opt) == (3, 1.0)
    assert len(restored) == 1 and torch.equal(restored[0], torch.arange(16, dtype=torch.uint8))


def test_checkpoint_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"step": 3, "w": torch.arange(4)})
    assert not os.path.exists(path + ".tmp")
    state = load_checkpoint(path)
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(4))
    with open(path, "r+b") as f:
        f.truncate(50)
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(path)
    with pytest.raises(UserError, match="no checkpoint"):
        load_checkpoint(str(tmp_path / "missing.pt"))


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_line_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"step": 1})
    good = open(path, "rb").read()
    for where in ("os.fsync", "os.replace", "torch.save"):  # at the flush, the rename, and while writing
        with monkeypatch.context() as m:
            m.setattr(where, full_disk)
            with pytest.raises(UserError, match=f"could not write {path}: No space left on device; the previous "
                                                f"ckpt.pt is unchanged"):
                save_checkpoint(path, {"step": 2})
        assert open(path, "rb").read() == good and os.listdir(tmp_path) == ["ckpt.pt"]


def test_write_errors_name_the_file_and_others_pass_through(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(UserError, match="could not write .*file/out.json: Not a directory"):
        with atomic_write(str(tmp_path / "file" / "out.json"), "w") as f:
            f.write("{}")
    # an error of reading an input inside the block is the caller's, with its own message
    with pytest.raises(FileNotFoundError):
        with atomic_write(str(tmp_path / "out.json"), "w") as f:
            f.write(open(tmp_path / "missing.txt").read())
    assert os.listdir(tmp_path) == ["file"]  # no .tmp files left
    logger = Logger(str(tmp_path / "run"))
    logger.path = str(tmp_path / "file" / "log.jsonl")  # where no file can be made, even by root
    with pytest.raises(UserError, match="could not write .*log.jsonl: Not a directory"):
        logger.log({"step": 1})


RT = Runtime("cpu", "cpu", "float32", ddp=False, rank=0, local_rank=0, world_size=1)


def test_a_new_run_never_replaces_a_checkpoint(tmp_path):
    save_checkpoint(str(tmp_path / "ckpt.pt"), {"step": 100, "program": "train.py"})  # as train.py writes it
    with pytest.raises(UserError, match="ckpt.pt exists and this run would replace it: pass --init_from=resume"):
        claim_out_dir(str(tmp_path), RT, fresh=True)
    claim_out_dir(str(tmp_path), RT, fresh=False).close()
    # a resume that will find no checkpoint creates no folder (load_checkpoint then names the missing file)
    assert claim_out_dir(str(tmp_path / "nothing"), RT, fresh=False) is None and not (tmp_path / "nothing").exists()
    with pytest.raises(UserError, match="can't write to out_dir .*ckpt.pt/out: Not a directory"):
        claim_out_dir(str(tmp_path / "ckpt.pt" / "out"), RT, fresh=True)


def test_one_run_per_out_dir_and_no_stale_lock(tmp_path):
    out = str(tmp_path / "out")
    lock = claim_out_dir(out, RT, fresh=True)
    with pytest.raises(UserError, match=f"another run \\(pid {os.getpid()}\\) is writing {out}"):
        claim_out_dir(out, RT, fresh=True)
    lock.close()  # as when the process ends
    claim_out_dir(out, RT, fresh=True).close()
    # a run killed with SIGKILL leaves the lock file, but the OS has dropped its lock
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from checkpoint import claim_out_dir; "
                               "from runtime import Runtime; rt = Runtime('cpu', 'cpu', 'float32', False, 0, 0, 1); "
                               f"lock = claim_out_dir({out!r}, rt, fresh=True); print('locked', flush=True); "
                               "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(UserError, match=f"pid {holder.pid}"):
        claim_out_dir(out, RT, fresh=True)
    holder.kill()
    holder.wait()
    claim_out_dir(out, RT, fresh=True).close()


def test_resume_refuses_other_settings_and_reports_changes(capsys):
    meta = {"settings": {"tokenizer": "t5", "vocab_size": None}}
    ckpt = {"step": 7, "config": {"model": "t5-tiny", "optimizer": "adamwscale", "lr": 0.02, "max_steps": 10,
                                  "init_from": "scratch"}, "meta": meta}
    config = dict(ckpt["config"], lr=0.01, max_steps=20, init_from="resume")
    check_resume(ckpt, "out/ckpt.pt", config, meta, fixed=("model", "optimizer"))
    assert capsys.readouterr().out == ("resuming from out/ckpt.pt at step 7; changed on resume: lr 0.02 -> 0.01, "
                                       "max_steps 10 -> 20\n")
    with pytest.raises(UserError, match="other settings \\(model 't5-tiny' -> 't5-v1_1-small', optimizer "
                                        "'adamwscale' -> 'adafactor'\\)"):
        check_resume(ckpt, "out/ckpt.pt", dict(config, model="t5-v1_1-small", optimizer="adafactor"), meta,
                     fixed=("model", "optimizer"))
    other_data = {"settings": {"tokenizer": "train", "vocab_size": 4000}}
    with pytest.raises(UserError, match="data.tokenizer 't5' -> 'train', data.vocab_size None -> 4000"):
        check_resume(ckpt, "out/ckpt.pt", config, other_data, fixed=("model", "optimizer"))


def test_a_full_disk_inside_torch_save_is_one_line(tmp_path, monkeypatch):
    # torch's zip writer turns the file's OSError into a RuntimeError: still one line, and the old file stays
    import io
    import files
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"step": 1})
    good = open(path, "rb").read()

    class FullDisk(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
    # open() gives a buffered file, which is where torch's writer meets the error, as on a real full disk
    monkeypatch.setattr(files, "open", lambda name, mode: io.BufferedWriter(FullDisk(name, "w")), raising=False)
    with pytest.raises(UserError, match=f"could not write {path}: No space left on device; the previous ckpt.pt"):
        save_checkpoint(path, {"step": 2, "w": torch.zeros(100_000)})  # more than the buffer holds
    assert open(path, "rb").read() == good and os.listdir(tmp_path) == ["ckpt.pt"]
