"""
A run's checkpoints: a folder per step, which torch.distributed.checkpoint
writes in one process as on many ranks; found, read back and restored on
any number of ranks, with the tokenizer a model reads; what a run starts
from.
"""
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from distributed import all_gathered, set_values
from hf import NOTHING_THERE, read_hf
from model import PRESETS, T5, T5Config
from prepare import T5_SPIECE_SHA256, Tokenizer, read_tokenizer, t5_spiece
from runtime import atomic_write, print0, rank

# one process saves and loads without a process group, as it means to
warnings.filterwarnings("ignore", "torch.distributed is disabled, "
                        "unavailable or uninitialized")

# what a run writes into its out_dir: a new run refuses a folder of them
RUN_FILES = ("ckpt", "log.jsonl", "metrics.json", "predictions.jsonl",
             "ckpt.pt")
# what a save writes into a step folder: pruning takes no folder of more
SAVED = re.compile(r"state\.pt|\.metadata|__\d+_\d+\.distcp|.*\.tmp")

def check_new_run(out_dir):
    """a new run writes into a folder of no other run's files"""
    found = [path for path in (os.path.join(out_dir, name)
                               for name in RUN_FILES) if os.path.exists(path)]
    if found:
        resumable = os.path.isdir(find_checkpoint(out_dir) or "")
        resume = (", or --init_from=resume to continue that run"
                  if resumable else "")
        raise SystemExit(f"error: {found[0]} exists and this run would "
                         f"replace it: pass another --out_dir{resume}")

# checkpoints: saved, found, read back

def save_checkpoint(out_dir, t5, optimizer, step, elapsed, run):
    """All a run needs to go on where it stopped, in out_dir/ckpt/step-N,
    torchtitan's layout, in one process as on any number of ranks. Rank 0
    writes state.pt (the step, the run's config, data and tokenizer, each
    rank's RNG state) whole; then every rank its part of the weights and
    optimizer state (DDP's replicas share the writing), and
    torch.distributed.checkpoint writes .metadata last, which marks the
    folder complete. The newest two complete folders stay."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's GPU's: a resume may have fewer
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
        kept = [path for path in steps
                if os.path.isfile(os.path.join(path, ".metadata"))][-2:]
        # the older ones, and any a killed save left, if a save wrote them
        for old in set(steps) - set(kept):
            if all(SAVED.fullmatch(name) for name in os.listdir(old)):
                shutil.rmtree(old)

def step_folders(folder):
    """folder's step-<integer> folders, oldest first (not step-4000.bak)"""
    steps = [path for path in glob.glob(os.path.join(folder, "step-*"))
             if re.fullmatch(r"step-\d+", os.path.basename(path))]
    return sorted(steps, key=lambda path: int(path.rsplit("-", 1)[1]))

def find_checkpoint(path):
    """The checkpoint path names, or None: for a run's out_dir or its
    ckpt/, the newest complete step folder (or ckpt/ itself, as runs
    before step folders wrote it); a step folder; a file (an older run's
    ckpt.pt, whose weights a new run can start from)."""
    for folder in (os.path.join(path, "ckpt"), path):
        complete = [candidate for candidate in [folder, *step_folders(folder)]
                    if os.path.isfile(os.path.join(candidate, ".metadata"))]
        if complete:
            return complete[-1]
    for file in (os.path.join(path, "ckpt.pt"), path):
        if os.path.isfile(file):
            return file

def newest_checkpoint(path, key="out_dir"):
    """path's newest checkpoint, or None, the same on every rank, which
    all-gather what they found: a node that sees another folder would
    load another state, or wait for the rest"""
    found = all_gathered(find_checkpoint(path))
    if len(set(found)) > 1:
        paths = ", ".join(sorted(map(str, set(found))))
        raise SystemExit(f"error: the ranks found different checkpoints in "
                         f"{path} ({paths}): {key} must be a folder every "
                         f"node sees")
    return found[0]

def load_checkpoint(path, weights=True):
    """A checkpoint as one dict, 'shards' naming its folder and, if
    weights, the whole model read into this process; or an older run's
    ckpt.pt. One written before checkpoints carried their tokenizer gets
    its data folder's."""
    if os.path.isfile(path):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False,
                              mmap=True)
        except Exception as e:  # a README, a damaged file
            why = f" ({type(e).__name__})"
            raise SystemExit(NOTHING_THERE.format(path, why)) from None
        keys = {"model", "model_config", "meta"}
        if not isinstance(ckpt, dict) or not keys <= ckpt.keys():
            why = " (a file, but no run's ckpt.pt)"
            raise SystemExit(NOTHING_THERE.format(path, why))
    else:
        state = os.path.join(path, "state.pt")
        ckpt = torch.load(state, map_location="cpu", weights_only=False)
        ckpt["shards"] = path
    if weights and "model" not in ckpt:
        reader = dcp.FileSystemReader(path)
        shapes = reader.read_metadata().state_dict_metadata
        ckpt["model"] = {key[len("model."):]: torch.empty(
            md.size, dtype=md.properties.dtype)
            for key, md in shapes.items() if key.startswith("model.")}
        dcp.load({"model": ckpt["model"]}, checkpoint_id=path, no_dist=True)
    if "tokenizer" not in ckpt:
        meta = ckpt["meta"]  # None: HF weights, with T5's tokenizer
        file = meta and os.path.join(meta["data_dir"], meta["tokenizer_file"])
        if file and not os.path.isfile(file):
            raise SystemExit(f"error: {path} reads the tokenizer of its "
                             f"data folder, and {file} is gone: put the "
                             f"folder back there, or prepare it again")
        ckpt["tokenizer"] = read_tokenizer(file).data if file else None
    return ckpt

def restore_state(ckpt, t5, optimizer):
    """A resumed run's optimizer state and RNG; returns (its steps, its
    training seconds). Each rank reads its own part, on any number of
    ranks (the RNG states then repeat)."""
    state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}
    dcp.load(state, checkpoint_id=ckpt["shards"])  # into that layout
    set_optimizer_state_dict(t5, optimizer, state["optimizer"])
    rng = ckpt["rng"][rank() % len(ckpt["rng"])]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"], ckpt["elapsed"]

def load_weights(model, ckpt):
    """model, placed, gets a checkpoint's weights: from its shards each
    rank reads its own slices (under DDP, all); from a whole state dict,
    mapped (load), it copies out its own, tensor by tensor"""
    if "model" in ckpt:
        for name, p in model.state_dict().items():
            set_values(p, ckpt["model"][name])
        return model
    state = {"model": get_model_state_dict(model)}  # the layout to fill
    dcp.load(state, checkpoint_id=ckpt["shards"])
    set_model_state_dict(model, state["model"])
    return model

def model_from_checkpoint(ckpt, **overrides):
    """the T5 of a checkpoint; overrides are T5Config fields"""
    config = T5Config(**{**ckpt["model_config"], **overrides})
    return load_weights(T5(config), ckpt)

def diverged(out_dir, step):
    """the line of a run whose loss or grad norm became NaN or inf"""
    fix = ("resume" if find_checkpoint(out_dir) else
           "no checkpoint yet: start again in a new --out_dir")
    return SystemExit(f"error: the loss or grad norm became NaN or inf by "
                      f"step {step}: training diverged; {fix} with a lower "
                      f"lr or grad_clip")

# the tokenizer a model reads: the one its checkpoint carries

def tokenizer_sha256(ckpt):
    """what names a checkpoint's tokenizer: the sha256 of its bytes; None
    (HF weights without a spiece.model) is T5's"""
    if ckpt["tokenizer"] is None:
        return T5_SPIECE_SHA256
    return hashlib.sha256(ckpt["tokenizer"]).hexdigest()

def check_tokenizer(ckpt, meta, source):
    """a model reads only data of its own tokenizer: with another's, each
    id would mean another piece to it"""
    sha256 = tokenizer_sha256(ckpt)
    vocab_size = ckpt["model_config"]["vocab_size"]
    data = (meta["tokenizer_sha256"], meta["model_vocab_size"])
    if (sha256, vocab_size) != data:
        raise SystemExit(
            f"error: {source} was trained with another tokenizer (sha256 "
            f"{sha256[:12]}, model vocab {vocab_size}) than "
            f"{meta['data_dir']}'s (sha256 {data[0][:12]}, {data[1]}): "
            f"prepare the data with the model's own tokenizer (prepare.py "
            f"--tokenizer=t5 for Google's T5s, or an export's tokenizer "
            f"file)")

def tokenizer_of(ckpt, source):
    """The tokenizer of a checkpoint's model: the one it carries; for HF
    weights the spiece.model beside them, or else T5's. It must make the
    model's vocab."""
    vocab_size = ckpt["model_config"]["vocab_size"]
    if ckpt["tokenizer"] is None and vocab_size != 32128:  # T5's, padded
        raise SystemExit(f"error: {source} holds no spiece.model, and its "
                         f"vocab of {vocab_size} is not T5's tokenizer's: "
                         f"copy the model's tokenizer there as spiece.model")
    data = ckpt["tokenizer"]
    tok = Tokenizer(data) if data else read_tokenizer(t5_spiece())
    if tok.model_vocab_size != vocab_size:
        raise SystemExit(f"error: the tokenizer of {source} is not the "
                         f"model's: its {tok.vocab_size} ids (sentinels "
                         f"included) make a model vocab of "
                         f"{tok.model_vocab_size}, not its vocab_size "
                         f"{vocab_size}; use the tokenizer the model was "
                         f"trained with")
    return tok

# what a run starts from: its checkpoint, a run's, HF weights, or nothing

def start_from(init_from, out_dir, program, config, fixed, preset=None,
               fsdp=False):
    """What a run starts from, (how, checkpoint), found the same on every
    rank before any reads it: 'resume', out_dir's newest checkpoint, its
    weights still on disk (load_resume); 'scratch', None, in an out_dir
    free of other runs' files; a run or HF weights, those (load). 'auto':
    resume if out_dir holds a checkpoint, else scratch, also over a start
    of this run that stopped before its first checkpoint."""
    lower = init_from.lower()
    if lower in ("resume", "scratch", "auto") and lower != init_from:
        raise SystemExit(f"error: --init_from={init_from} names no run or "
                         f"weights here: did you mean --init_from={lower}?")
    how = init_from
    if init_from in ("resume", "auto"):
        path = newest_checkpoint(out_dir)
        how = "resume" if path or init_from == "resume" else "scratch"
    if init_from == "auto":
        print0(f"--init_from=auto: {how}")
    if how == "resume":
        if path is None:
            raise SystemExit(f"error: no checkpoint to resume in {out_dir}: "
                             f"train one first")
        return how, load_resume(path, program, config, fixed)
    if not (init_from == "auto" and
            started_early(out_dir, program, config, fixed)):
        check_new_run(out_dir)
    if how == "scratch":
        return how, None
    print0(f"a new run from the weights of {init_from}")
    return how, load(init_from, fsdp, preset)

def started_early(out_dir, program, config, fixed):
    """whether out_dir's log.jsonl is this run's (its first line: the same
    program, keys in `fixed` and data_dir), stopped before its first
    checkpoint: then the log is dropped, with a note, and the run starts"""
    try:
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            lines = f.readlines()
        first = json.loads(lines[0])
    except (OSError, IndexError, ValueError):
        return False
    saved = first.get("config", {})
    keys = (*fixed, "data_dir")
    if first.get("program") != program or any(
            saved.get(key) != config[key] for key in keys):
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

def load_resume(path, program, config, fixed):
    """The checkpoint at path, which --init_from=resume continues on any
    number of ranks: one its program wrote, with the keys in `fixed` (what
    its weights and optimizer state were made with) unchanged."""
    fix = f"start from its weights with --init_from={path} in another --out_dir"
    if os.path.isfile(path):
        raise SystemExit(f"error: {path} is an older run's checkpoint file, "
                         f"which a resume does not continue: {fix}")
    ckpt = load_checkpoint(path, weights=False)
    writer = ckpt.get("program")
    if writer != program:
        raise SystemExit(f"error: {path} was written by "
                         f"{writer or 'another program'}, and {program} "
                         f"resumes only its own runs: {fix}")
    changed = changes(ckpt["config"], config)
    refuse(path, [text for key, text in changed.items() if key in fixed])
    changed = ", ".join(changed.values())
    changed = f"; changed on resume: {changed}" if changed else ""
    print0(f"resuming from {path} at step {ckpt['step']}{changed}")
    return ckpt

def check_data(ckpt, meta, how):
    """a resume reads its run's data; any weights, data of their tokenizer"""
    if how == "resume":
        data = changes(ckpt["meta"]["settings"], meta["settings"], "data.")
        refuse(ckpt["shards"], list(data.values()))
    if ckpt:
        check_tokenizer(ckpt, meta, ckpt.get("shards") or how)

def load(init_from, fsdp=False, preset=None):
    """What a new run (or sample.py, export.py) starts from, as a
    checkpoint: model_config, meta (a run's data, or None), tokenizer and
    weights. init_from: a run of train.py or finetune.py (its out_dir,
    ckpt/, a step folder, an older run's ckpt.pt), or HF weights (a
    folder, a Hub name), of preset's shape if one is given. No rank holds
    the whole model: under FSDP a run's shards stay on disk, for each rank
    to read its own; other weights are mapped from their files, not read,
    until load_weights copies out what a rank keeps."""
    path = newest_checkpoint(init_from, "init_from")
    if path:
        ckpt = load_checkpoint(path, weights=not fsdp)
    else:
        config, weights, tokenizer = read_hf(init_from)
        ckpt = {"model_config": dataclasses.asdict(config), "model": weights,
                "meta": None, "tokenizer": tokenizer}
    shape = ckpt["model_config"].items()
    theirs = [name for name, preset_shape in PRESETS.items()
              if preset_shape.items() <= shape]
    if preset and preset not in theirs:
        fix = (f"pass --model={theirs[0]}" if theirs else
               "add their shape to model.py's PRESETS")
        raise SystemExit(f"error: --model={preset} is not the shape of the "
                         f"weights in {init_from}: {fix}")
    return ckpt
