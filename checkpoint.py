"""
A run's checkpoints: a folder per step, which torch.distributed.checkpoint
writes in one process as on many ranks; found, read back and restored on
any number of ranks; and what a run starts from.
"""
import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule

import distributed
from hf import read_hf
from model import PRESETS, T5, T5Config
from runtime import all_gathered, atomic_write, print0, rank
from tokenizer import check_tokenizer

# one process saves and loads without a process group, as it means to
warnings.filterwarnings("ignore", "torch.distributed is disabled, "
                        "unavailable or uninitialized")

# what a run writes into its out_dir: a new run refuses a folder of them
RUN_FILES = ("ckpt", "log.jsonl", "metrics.json", "predictions.jsonl")
# what a save writes into a step folder: pruning removes a folder only if
# it holds nothing else, so that no file of a user's goes with it
SAVED = re.compile(r"state\.pt|\.metadata|__\d+_\d+\.distcp|.*\.tmp")

def check_new_run(out_dir):
    found = [path for path in (os.path.join(out_dir, name)
                               for name in RUN_FILES) if os.path.exists(path)]
    if found:
        resume = (", or --init_from=resume to continue that run"
                  if find_checkpoint(out_dir) else "")
        raise SystemExit(f"error: {found[0]} exists and this run would "
                         f"replace it: pass another --out_dir{resume}")

# checkpoints: saved, found, read back

def save_checkpoint(out_dir, t5, optimizer, step, elapsed, run):
    """All a run needs to go on, in out_dir/ckpt/step-N: rank 0's state.pt
    (step, run record, RNG states), then each rank's part of the tensors;
    .metadata, written last, marks it complete. The newest two complete
    folders stay."""
    ranks = dist.is_initialized()  # then each waits for the slowest write
    with distributed.save_timeout() if ranks else contextlib.nullcontext():
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():  # this GPU's: a resume may have fewer
            rng["cuda"] = torch.cuda.get_rng_state()
        rngs = all_gathered(rng)
        folder = os.path.join(out_dir, "ckpt", f"step-{step}")
        if rank() == 0:
            os.makedirs(folder, exist_ok=True)
            state = dict(run, model_config=dataclasses.asdict(t5.config),
                         step=step, elapsed=elapsed, rng=rngs)
            with atomic_write(os.path.join(folder, "state.pt")) as f:
                torch.save(state, f)
        tensors = {"model": get_model_state_dict(t5),
                   "optimizer": get_optimizer_state_dict(t5, optimizer)}
        dcp.save(tensors, checkpoint_id=folder)
        if rank() == 0:
            steps = step_folders(os.path.join(out_dir, "ckpt"))
            # the older ones, and any a killed save left, if saves wrote them
            for old in set(steps) - set(complete(steps)[-2:]):
                if all(SAVED.fullmatch(name) for name in os.listdir(old)):
                    shutil.rmtree(old)

def step_folders(folder):
    """folder's step-<integer> folders, oldest first (not step-4000.bak)"""
    steps = [path for path in glob.glob(os.path.join(folder, "step-*"))
             if re.fullmatch(r"step-\d+", os.path.basename(path))]
    return sorted(steps, key=lambda path: int(path.rsplit("-", 1)[1]))

def complete(folders):  # those a save finished: .metadata is its last
    return [step for step in folders if os.path.isfile(f"{step}/.metadata")]

def find_checkpoint(path):
    """The complete step folder path names, or None: for a run's out_dir
    or its ckpt/, the newest; a step folder itself."""
    found = complete([path, *step_folders(path),
                      *step_folders(os.path.join(path, "ckpt"))])
    return found[-1] if found else None

def newest_checkpoint(path, key="out_dir"):
    """path's newest checkpoint, or None, the same on every rank: a node
    that saw another folder would load another state"""
    found = all_gathered(find_checkpoint(path))
    if len(set(found)) > 1:
        paths = ", ".join(sorted(map(str, set(found))))
        raise SystemExit(f"error: the ranks found different checkpoints in "
                         f"{path} ({paths}): {key} must be a folder every "
                         f"node sees")
    return found[0]

def load_checkpoint(path, weights=True):
    """a step folder's checkpoint, source its path; weights: the model's
    whole state dict, read into this process"""
    ckpt = torch.load(os.path.join(path, "state.pt"), map_location="cpu",
                      weights_only=False)
    ckpt["source"] = path
    if weights:
        shapes = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        ckpt["model"] = {key.removeprefix("model."): torch.empty(
            md.size, dtype=md.properties.dtype)
            for key, md in shapes.items() if key.startswith("model.")}
        dcp.load({"model": ckpt["model"]}, checkpoint_id=path, no_dist=True)
    return ckpt

def restore_state(ckpt, t5, optimizer):
    """a resume's optimizer state and RNG, each rank its own part on any
    number of ranks (the RNG states then repeat); (steps, seconds)"""
    state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}
    dcp.load(state, checkpoint_id=ckpt["source"])  # into that layout
    set_optimizer_state_dict(t5, optimizer, state["optimizer"])
    rng = ckpt["rng"][rank() % len(ckpt["rng"])]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"], ckpt["elapsed"]

@torch.no_grad()
def load_weights(model, ckpt):
    """model gets a checkpoint's weights: from a run's folder, each rank
    reads its own slices (DDP's, all); from a mapped state dict (load), it
    copies each tensor in (FSDP's, its slice)"""
    if "model" not in ckpt:
        state = {"model": get_model_state_dict(model)}  # the layout to fill
        dcp.load(state, checkpoint_id=ckpt["source"])
        set_model_state_dict(model, state["model"])
        return model
    copy = (distributed.set_values if isinstance(model, FSDPModule)
            else torch.Tensor.copy_)
    for name, p in model.state_dict().items():
        copy(p, ckpt["model"][name])
    return model

def model_from_checkpoint(ckpt, **overrides):  # T5Config fields
    config = T5Config(**{**ckpt["model_config"], **overrides})
    return load_weights(T5(config), ckpt)

def diverged(out_dir, step):
    fix = ("resume" if find_checkpoint(out_dir) else
           "no checkpoint yet: start again in a new --out_dir")
    return SystemExit(f"error: the loss or grad norm became NaN or inf by "
                      f"step {step}: training diverged; {fix} with a lower "
                      f"lr or grad_clip")

# what a run starts from: its checkpoint, a run's, HF weights, or nothing

def start_from(init_from, out_dir, program, config, kept_on_resume,
               preset=None, fsdp=False):
    """(resuming, checkpoint), the same on every rank: 'resume', out_dir's
    newest; 'scratch', None, in an out_dir free of other runs' files; a run
    or HF weights, those; 'auto', resume if there is a checkpoint, else
    scratch, also over this run's start stopped before its first one"""
    lower = init_from.lower()
    if lower in ("resume", "scratch", "auto") and lower != init_from:
        raise SystemExit(f"error: --init_from={init_from} names no run or "
                         f"weights here: did you mean --init_from={lower}?")
    if init_from in ("resume", "auto"):
        path = newest_checkpoint(out_dir)
        if init_from == "auto":
            print0(f"--init_from=auto: {'resume' if path else 'scratch'}")
        if path:
            return True, load_resume(path, program, config, kept_on_resume)
        if init_from == "resume":
            raise SystemExit(f"error: no checkpoint to resume in {out_dir}: "
                             f"train one first")
    if not (init_from == "auto" and
            started_early(out_dir, program, config, kept_on_resume)):
        check_new_run(out_dir)
    if init_from in ("scratch", "auto"):
        return False, None
    print0(f"a new run from the weights of {init_from}")
    return False, load(init_from, fsdp, preset)

def started_early(out_dir, program, config, kept_on_resume):
    """whether out_dir's log.jsonl is this run's (its first line: the same
    program, data_dir and kept_on_resume), stopped before a checkpoint:
    then the log is dropped, with a note"""
    try:
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            lines = f.readlines()
        first = json.loads(lines[0])
    except (OSError, IndexError, ValueError):
        return False
    saved = first.get("config", {})
    if first.get("program") != program or any(
            saved.get(key) != config[key]
            for key in (*kept_on_resume, "data_dir")):
        return False
    print0(f"{out_dir}/log.jsonl: dropped the {len(lines)} lines of a start "
           f"stopped before its first checkpoint")
    return True

def changes(saved, now, prefix=""):
    """what differs between two runs' settings: "key saved -> now", by key"""
    return {key: f"{prefix}{key} {saved[key]!r} -> {value!r}"
            for key, value in now.items()
            if key in saved and saved[key] != value and key != "init_from"}

def refuse(path, wrong):
    if wrong:
        raise SystemExit(f"error: --init_from=resume continues the run in "
                         f"{path}, which had other settings "
                         f"({', '.join(wrong)}): set them back, or start a "
                         f"new run in another --out_dir")

def load_resume(path, program, config, kept_on_resume):
    """the checkpoint at path, which a resume continues: one its program
    wrote, kept_on_resume unchanged"""
    ckpt = load_checkpoint(path, weights=False)
    writer = ckpt.get("program")
    if writer != program:
        raise SystemExit(f"error: {path} was written by "
                         f"{writer or 'another program'}, and {program} "
                         f"resumes only its own runs: start from its weights "
                         f"with --init_from={path} in another --out_dir")
    changed = changes(ckpt["config"], config)
    refuse(path, [text for key, text in changed.items()
                  if key in kept_on_resume])
    changed = ", ".join(changed.values())
    changed = f"; changed on resume: {changed}" if changed else ""
    print0(f"resuming from {path} at step {ckpt['step']}{changed}")
    return ckpt

def check_data(ckpt, meta, resuming):
    """a resume reads its run's data; any weights, data of their tokenizer"""
    if resuming:
        data = changes(ckpt["meta"]["settings"], meta["settings"], "data.")
        refuse(ckpt["source"], list(data.values()))
    if ckpt:
        check_tokenizer(ckpt, meta, ckpt["source"])

def load(init_from, fsdp=False, preset=None):
    """a run's or HF weights (a folder, a Hub name), of preset's shape if
    given, as a checkpoint; under FSDP a run's shards stay on disk for each
    rank to read its own, and other weights are mapped, not read"""
    path = newest_checkpoint(init_from, "init_from")
    if path:
        ckpt = load_checkpoint(path, weights=not fsdp)
    else:
        config, weights, tokenizer = read_hf(init_from)
        ckpt = {"model_config": dataclasses.asdict(config), "model": weights,
                "meta": None, "tokenizer": tokenizer, "source": init_from}
    shape = ckpt["model_config"].items()
    theirs = [name for name, preset_shape in PRESETS.items()
              if preset_shape.items() <= shape]
    if preset and preset not in theirs:
        fix = (f"pass --model={theirs[0]}" if theirs else
               "add their shape to model.py's PRESETS")
        raise SystemExit(f"error: --model={preset} is not the shape of the "
                         f"weights in {init_from}: {fix}")
    return ckpt
