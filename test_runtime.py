"""Tests for runtime.py: atomic files, checkpoint files, the batch split, the save-and-stop pattern, the out_dir's
claim and the resume check."""
import errno
import os
import subprocess
import sys

import pytest
import torch

from model import T5, T5Config
from runtime import (DTYPES, Logger, Runtime, UserError, atomic_write, check_resume, claim_out_dir, flops_per_step,
                     load_checkpoint, memory_report, mfu, save_checkpoint)

REPO = os.path.dirname(os.path.abspath(__file__))


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


# the exact names torch.cuda.get_device_name prints, and each one's dense bf16 peak; near misses of a listed name
# (an L40S is not an L4, an H100 PCIe is not an SXM) must not borrow its figure
REAL_GPU_NAMES = {
    "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA H100 80GB HBM3": 989.5e12, "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12, "NVIDIA H200": 989.5e12, "NVIDIA L4": 121e12, "NVIDIA L40": 181e12,
    "NVIDIA L40S": 362e12, "NVIDIA GeForce RTX 3090": 71e12, "NVIDIA GeForce RTX 4090": 165.2e12,
    "NVIDIA A10G": None, "NVIDIA GeForce RTX 3090 Ti": None, "NVIDIA RTX A6000": None, "Tesla V100-SXM2-16GB": None,
}


@pytest.mark.parametrize("name, bf16_peak", REAL_GPU_NAMES.items())
def test_peak_flops_matches_whole_gpu_names(monkeypatch, capsys, name, bf16_peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    rt = Runtime("cuda:0", "cuda", "bfloat16", False, 0, 0, 1)
    assert rt.peak_flops() == bf16_peak
    assert ("--peak_flops" in capsys.readouterr().out) == (bf16_peak is None)  # the hint, for unknown GPUs only
    assert rt.peak_flops(given=1e15) == 1e15
    fp32, tf32, bf16 = (Runtime("cuda:0", "cuda", dtype, False, 0, 0, 1).peak_flops() for dtype in DTYPES)
    assert bf16_peak is None or fp32 <= tf32 <= bf16


def test_mfu_is_per_gpu():
    # 8 GPUs at 1e15 FLOP/s each, a step of 4e15 FLOPs in 1 s: each GPU did 5e14, half its peak
    assert mfu(4e15, 1.0, 8, 1e15) == pytest.approx(0.5)
    assert mfu(4e15, 1.0, 1, 8e15) == pytest.approx(0.5)
    assert mfu(4e15, 1.0, 8, None) is None


def test_memory_report(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 62 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (16 * gib, 80 * gib))
    # 16 GiB free on the device plus 2 GiB reserved by PyTorch beyond the peak
    assert memory_report("cuda:0") == "first step: peak memory 60.0 GiB of 80.0 GiB, 18.0 GiB headroom (22%)"


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
    save_checkpoint(str(tmp_path / "ckpt.pt"), {"step": 100})
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
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from runtime import Runtime, claim_out_dir; "
                               "rt = Runtime('cpu', 'cpu', 'float32', False, 0, 0, 1); "
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


def test_flops_per_step_counts_every_matmul():
    with torch.device("meta"):
        model = T5(T5Config.from_preset("t5-v1_1-small"))
    c, S, T = model.config, 512, 114
    n = model.num_params() - c.vocab_size * c.d_model  # all weights but the embedding lookup
    flops = flops_per_step(model, 4, S, T)
    # weights alone, each over the tokens of its own stack, bound it from below; attention adds the rest
    assert flops > 4 * 6 * (sum(p.numel() for p in model.encoder.parameters()) * S)
    assert 4 * 6 * n * T < flops < 4 * 6 * n * S + 4 * 12 * 384 * 16 * S * S


def test_a_full_disk_inside_torch_save_is_one_line(tmp_path, monkeypatch):
    # torch's zip writer turns the file's OSError into a RuntimeError: still one line, and the old file stays
    import io
    import runtime
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"step": 1})
    good = open(path, "rb").read()

    class FullDisk(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
    # open() gives a buffered file, which is where torch's writer meets the error, as on a real full disk
    monkeypatch.setattr(runtime, "open", lambda name, mode: io.BufferedWriter(FullDisk(name, "w")), raising=False)
    with pytest.raises(UserError, match=f"could not write {path}: No space left on device; the previous ckpt.pt"):
        save_checkpoint(path, {"step": 2, "w": torch.zeros(100_000)})  # more than the buffer holds
    assert open(path, "rb").read() == good and os.listdir(tmp_path) == ["ckpt.pt"]
