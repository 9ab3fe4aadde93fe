"""Tests for checkpoint.py: step folders written whole and found, the newest two kept, a resume's optimizer state and
RNG, what a new run may write over, the resume check, and the tokenizer a checkpoint carries against data's."""
import errno
import fcntl
import glob
import os
import shutil

import pytest
import torch

import checkpoint as C
from hf import save_pretrained
import runtime
from model import T5, T5Config
from optim import AdamWScale
from tokenizer import T5_SPIECE_SHA256, check_tokenizer, tokenizer_sha256, train_spiece
from runtime import atomic_write

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

REPO = os.path.dirname(os.path.abspath(__file__))


def tiny_run(out_dir, step=1, config=None, meta=None, program="train.py", tokenizer=b"a tokenizer"):
    """a one-process run's checkpoint of t5-mini, as train.py writes it; (model, optimizer)"""
    t5 = T5(T5Config.from_preset("t5-mini", vocab_size=256))
    opt = AdamWScale(t5.parameters(), lr=1e-2)
    run = dict(program=program, config=config or {}, meta=meta, tokenizer=tokenizer)
    C.save_checkpoint(str(out_dir), t5, opt, step, 1.0, run)
    return t5, opt


def test_a_run_keeps_its_own_gpus_rng_state_so_a_resume_may_see_other_gpus(monkeypatch, tmp_path):
    # 8 GPUs visible when saving: the state of this rank's GPU alone is kept, and restored on a machine with fewer
    # (every visible GPU's states, restored one per GPU, would fail there)
    answers = iter([True])  # to the save's own question only: the checkpoint's writer asks too, and finds no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: next(answers, False))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.arange(16, dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    t5, opt = tiny_run(tmp_path, step=3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state = C.load_checkpoint(C.find_checkpoint(str(tmp_path)))
    assert torch.equal(state["rng"][0]["cuda"], torch.arange(16, dtype=torch.uint8))  # rank 0's, of 1 rank
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert C.restore_state(state, t5, opt) == (3, 1.0)
    assert len(restored) == 1 and torch.equal(restored[0], torch.arange(16, dtype=torch.uint8))


def test_one_process_writes_step_folders_whole_and_keeps_the_newest_two(tmp_path):
    # one format for every run: torch.distributed.checkpoint's step folders, as under FSDP
    for step in (1, 2, 3):
        t5, _ = tiny_run(tmp_path, step=step)
    steps = tmp_path / "ckpt"
    assert sorted(os.listdir(steps)) == ["step-2", "step-3"]
    assert sorted(os.listdir(steps / "step-3")) == [".metadata", "__0_0.distcp", "state.pt"]  # no .tmp left
    assert C.find_checkpoint(str(tmp_path)) == C.find_checkpoint(str(steps)) == str(steps / "step-3")
    state = C.load_checkpoint(str(steps / "step-3"))
    assert state["step"] == 3 and state["program"] == "train.py" and state["tokenizer"] == b"a tokenizer"
    assert all(torch.equal(t, state["model"][name]) for name, t in t5.state_dict().items())


def test_pruning_takes_only_step_folders_and_the_newest_complete_one_is_found(tmp_path):
    # a user's step-4000.bak and a step-abc stay, and neither is taken for a step; a folder a killed save left without
    # its .metadata is never taken, and the next save removes it; a step folder that holds a file no save writes is a
    # user's too, and stays (before, it was deleted)
    tiny_run(tmp_path, step=1)
    for name in ("step-4000.bak", "step-abc", "step-9", "step-5"):
        (tmp_path / "ckpt" / name).mkdir()
        shutil.copy(tmp_path / "ckpt" / "step-1" / "state.pt", tmp_path / "ckpt" / name)
    (tmp_path / "ckpt" / "step-4000.bak" / ".metadata").write_bytes(b"")
    (tmp_path / "ckpt" / "step-5" / "notes.txt").write_text("the run as it was on Monday")
    assert C.find_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt" / "step-1")
    for step in (2, 3):
        tiny_run(tmp_path, step=step)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-2", "step-3", "step-4000.bak", "step-5", "step-abc"]


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def half_written(obj, f):
    f.write(b"half a state")
    full_disk()


def test_a_full_disk_keeps_the_last_checkpoint_and_never_leaves_half_a_state(tmp_path, monkeypatch):
    tiny_run(tmp_path, step=1)
    good = open(tmp_path / "ckpt" / "step-1" / "state.pt", "rb").read()
    for where, patch in (("os.fsync", full_disk), ("os.replace", full_disk), ("torch.save", half_written)):
        with monkeypatch.context() as m:
            m.setattr(where, patch)
            with pytest.raises(OSError, match="No space left on device"):
                tiny_run(tmp_path, step=2)
        assert not os.path.exists(tmp_path / "ckpt" / "step-2" / "state.pt"), where  # whole, or not there
        assert not glob.glob(str(tmp_path / "ckpt" / "*" / "*.tmp")), where  # and no temporary file left
        assert C.find_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt" / "step-1")
        assert open(tmp_path / "ckpt" / "step-1" / "state.pt", "rb").read() == good


def test_two_writers_of_one_file_never_mix(tmp_path):
    # each writes a temporary file of its own: the file is one writer's whole bytes (with one shared name the second
    # open truncated the first's, and the first's rename failed on a file the second had moved)
    path = str(tmp_path / "state.pt")
    with atomic_write(path) as first:
        first.write(b"A" * 10)
        with atomic_write(path) as second:
            second.write(b"B" * 5)
    assert open(path, "rb").read() == b"A" * 10 and os.listdir(tmp_path) == ["state.pt"]


def test_a_new_run_never_replaces_another_runs_files(tmp_path):
    tiny_run(tmp_path)
    with pytest.raises(SystemExit, match="ckpt exists and this run would replace it: pass another --out_dir, "
                                         "or --init_from=resume"):
        C.check_new_run(str(tmp_path))
    for name in ("log.jsonl", "metrics.json", "predictions.jsonl"):  # a run killed before its first checkpoint,
        (tmp_path / f"has_{name}").mkdir()  # a fine-tuning's results
        (tmp_path / f"has_{name}" / name).write_text("{}")
        with pytest.raises(SystemExit, match=f"{name} exists and this run would replace it: pass another "
                                             f"--out_dir$"):  # no resume to suggest: it would find none
            C.check_new_run(str(tmp_path / f"has_{name}"))
    C.check_new_run(str(tmp_path / "nothing"))  # a folder still to make


def test_resume_refuses_other_settings_and_reports_changes(tmp_path, capsys):
    meta = {"settings": {"tokenizer": "t5", "vocab_size": None}}
    config = {"model": "t5-tiny", "optimizer": "adamwscale", "lr": 0.02, "max_steps": 10, "init_from": "scratch",
              "weight_decay": 0.0}
    tiny_run(tmp_path, step=7, config=config, meta=meta)
    path = tmp_path / "ckpt" / "step-7"
    changed = dict(config, lr=0.01, max_steps=20, init_from="resume")
    fixed = ("model", "optimizer", "weight_decay")
    resuming, ckpt = C.start_from("resume", str(tmp_path), "train.py", changed, fixed)
    assert resuming and ckpt["step"] == 7
    assert capsys.readouterr().out == (f"resuming from {path} at step 7; changed on resume: lr 0.02 -> 0.01, "
                                       "max_steps 10 -> 20\n")
    with pytest.raises(SystemExit, match="other settings \\(model 't5-tiny' -> 't5-v1_1-small', optimizer "
                                         "'adamwscale' -> 'adamw', weight_decay 0.0 -> 0.1\\)"):
        C.start_from("resume", str(tmp_path), "train.py", dict(changed, model="t5-v1_1-small", optimizer="adamw",
                                                                weight_decay=0.1), fixed)
    other_data = {"settings": {"tokenizer": "train", "vocab_size": 4000}}
    with pytest.raises(SystemExit, match="data.tokenizer 't5' -> 'train', data.vocab_size None -> 4000"):
        C.check_data(ckpt, other_data, resuming)
    with pytest.raises(SystemExit, match="was written by train.py, and finetune.py resumes only its own runs"):
        C.start_from("resume", str(tmp_path), "finetune.py", changed, kept_on_resume=())
    with pytest.raises(SystemExit, match="no checkpoint to resume in .*/nothing: train one first"):
        C.start_from("resume", str(tmp_path / "nothing"), "train.py", changed, kept_on_resume=())


def test_a_step_count_saved_as_float64_resumes_exactly(tmp_path):
    """AdamWScale's step counts were float64 before its fused kernel, which reads float32: a checkpoint of then,
    resumed, takes the step the uninterrupted run takes"""
    torch.manual_seed(0)
    t5 = T5(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2))
    opt = AdamWScale(t5.parameters(), lr=1e-2)
    for _ in range(3):
        for p in t5.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    steps = {p: state["step"] for p, state in opt.state.items()}
    for state in opt.state.values():
        state["step"] = state["step"].double()  # as written before
    C.save_checkpoint(str(tmp_path), t5, opt, 3, 0.0, dict(program="train.py", config={}, meta=None,
                                                            tokenizer=None))
    for p, state in opt.state.items():
        state["step"] = steps[p]
    resumed = T5(t5.config)
    resumed.load_state_dict(t5.state_dict())
    resumed_opt = AdamWScale(resumed.parameters(), lr=1e-2)
    C.restore_state(C.load_checkpoint(C.find_checkpoint(str(tmp_path)), weights=False), resumed, resumed_opt)
    assert all(state["step"].dtype == torch.float32 for state in resumed_opt.state.values())
    for p, q in zip(t5.parameters(), resumed.parameters()):
        p.grad = torch.randn_like(p) * 1e-3
        q.grad = p.grad.clone()
    opt.step()
    resumed_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(t5.parameters(), resumed.parameters()))


def test_a_file_that_is_no_checkpoint_is_one_line(tmp_path):
    for name, write in (("README.md", lambda path: open(path, "w").write("# a project\n")),
                        ("weights.pt", lambda path: torch.save({"shared.weight": torch.ones(2)}, path))):
        write(tmp_path / name)
        with pytest.raises(SystemExit, match=f"error: .*{name} holds no run or weights"):
            C.load(str(tmp_path / name))


def test_weights_meet_only_data_of_their_own_tokenizer(tmp_path):
    """A model reads ids as its tokenizer made them: Hugging Face's weights without a spiece.model carry T5's, and
    data tokenised by another tokenizer, even of the same vocab size, is refused, as is another vocab"""
    save_pretrained(T5(T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2)),
                      str(tmp_path / "hf"))
    hf = C.load(str(tmp_path / "hf"))
    assert hf["tokenizer"] is None and tokenizer_sha256(hf) == T5_SPIECE_SHA256
    meta = {"data_dir": "data/mine", "tokenizer_sha256": "0" * 64, "model_vocab_size": 32128}
    with pytest.raises(SystemExit, match="hf was trained with another tokenizer \\(sha256 d60acb128cf7, model "
                                         "vocab 32128\\) than data/mine's \\(sha256 000000000000, 32128\\)"):
        check_tokenizer(hf, meta, str(tmp_path / "hf"))
    check_tokenizer(hf, dict(meta, tokenizer_sha256=T5_SPIECE_SHA256), "hf")  # T5's data: its own
    with pytest.raises(SystemExit, match="model vocab 32128\\) than data/mine's \\(sha256 d60acb128cf7, 256\\)"):
        check_tokenizer(hf, dict(meta, tokenizer_sha256=T5_SPIECE_SHA256, model_vocab_size=256), "hf")


def test_an_export_names_its_tokenizer_and_reads_no_other(tmp_path):
    # config.json records the spiece.model's sha256: a replaced or lost spiece.model is refused, where T5's would
    # otherwise be read in its place, silently, for a vocab of T5's size
    t5 = T5(T5Config(vocab_size=256, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2))
    ours = train_spiece(["the quick brown fox jumps over the lazy dog " * 3] * 50, 30)  # a tokenizer of our own
    save_pretrained(t5, str(tmp_path / "hf"), tokenizer=ours)
    assert C.load(str(tmp_path / "hf"))["tokenizer"] == ours
    (tmp_path / "hf" / "spiece.model").write_bytes(b"another tokenizer")
    with pytest.raises(SystemExit, match="spiece.model is not the tokenizer its config.json records"):
        C.load(str(tmp_path / "hf"))
    os.remove(tmp_path / "hf" / "spiece.model")
    with pytest.raises(SystemExit, match="spiece.model is not the tokenizer its config.json records"):
        C.load(str(tmp_path / "hf"))


def test_the_divergence_line_names_a_fix_that_works(tmp_path):
    # before any checkpoint a resume would find none: the line says to start again
    assert str(C.diverged(str(tmp_path), 3)) == ("error: the loss or grad norm became NaN or inf by step 3: training "
                                                 "diverged; no checkpoint yet: start again in a new --out_dir with a "
                                                 "lower lr or grad_clip")
    tiny_run(tmp_path, step=2)
    assert str(C.diverged(str(tmp_path), 3)).endswith("diverged; resume with a lower lr or grad_clip")


def test_a_second_claim_of_an_out_dir_is_refused_and_a_filesystem_without_locks_warns(tmp_path, monkeypatch, capsys):
    # flock's lock belongs to the open file: a second claim fails as another process's would, and the first's
    # closing frees the folder at once
    first = runtime.lock_folder(str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=f"error: {tmp_path}/out is in use by a run still going"):
        runtime.lock_folder(str(tmp_path / "out"))
    first.close()
    runtime.lock_folder(str(tmp_path / "out")).close()

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    runtime.lock_folder(str(tmp_path / "out")).close()
    assert capsys.readouterr().out == f"warning: {tmp_path}/out can't be locked (No locks available): run nothing " \
                                      f"else in it\n"
