"""A run's folder and its weights on disk: one run at a time in an out_dir, never over another run's
results; a resume continues only its own run; checkpoints saved, loaded and restored, one file or FSDP's
shards; what a run starts from (read_weights, load_weights); Hugging Face's format read and written."""
import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import re
import shutil
import time
import warnings
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule

from files import UserError, atomic_write, reading, write_error, write_failure
from model import PRESETS, T5, T5Config
from prepare import load_meta, prepare
from runtime import print0, rank, require, set_values

# what a run writes in its out_dir: the checkpoint (one file, or FSDP's folder of shards, or what a run
# killed while replacing that left of it), the log and the results; a fresh run refuses to find one
RUN_FILES = ("ckpt.pt", "ckpt", "ckpt.old", "log.jsonl", "metrics.json", "predictions.jsonl")
NOT_A_RUN = "{path} is not a checkpoint of train.py or finetune.py ({reason}): pass one of theirs"
DAMAGED = ("{path} is corrupt or unreadable ({reason}): start from another checkpoint, or train a new "
           "run in another --out_dir")

# the run's folder

OUT_DIR_LOCKS = []  # the runs' out_dir locks, held while the process lives

def claim_out_dir(out_dir, rt, fresh, program="train.py"):
    """Before a run does any work: a fresh run refuses an out_dir holding a file another run wrote;
    then an flock on out_dir/lock, which the OS drops however the run dies. Rank 0 decides, every rank
    raises. The lock file is kept in OUT_DIR_LOCKS while the process lives, and returned (None for a
    resume with no out_dir)."""
    problem = None
    lock = None
    if rt.master:
        found = [os.path.join(out_dir, name) for name in RUN_FILES if os.path.exists(os.path.join(out_dir, name))]
        if fresh and found:
            resumable = found[0].endswith((".pt", "ckpt", ".old")) and written_by(found[0]) == program
            hint = "pass --init_from=resume to continue that run, or" if resumable else "pass"
            problem = (f"{found[0]} exists and this run would replace it: {hint} another --out_dir to start a "
                       f"new one")
        elif fresh or os.path.isdir(out_dir):
            try:
                os.makedirs(out_dir, exist_ok=True)
                lock = open(os.path.join(out_dir, "lock"), "a+")
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                problem = (f"another run (pid {lock.read().strip() or '?'}) is writing {out_dir}: wait for it to "
                           f"finish, or use another --out_dir")
            except OSError as e:
                problem = f"can't write to out_dir {out_dir}: {e.strerror}"
            else:
                lock.truncate(0)
                lock.write(f"{os.getpid()}\n")
                lock.flush()
    shared = [problem, lock and f"{os.getpid()}\n"]  # the problem, and what rank 0's lock says
    if rt.ddp:
        torch.distributed.broadcast_object_list(shared, src=0)
    problem, token = shared
    if rt.nodes > 1 and token and not problem:  # rank 0 alone writes out_dir: every node must see it
        seen = None
        with contextlib.suppress(OSError), open(os.path.join(out_dir, "lock")) as f:
            seen = f.read()
        unseen = (f"out_dir {out_dir} is not one folder every node sees: rank {rank()} does not find rank "
                  f"0's lock there; give an out_dir on a filesystem all nodes share")
        problem = first_problem(None if seen == token else unseen)
    if problem:
        raise UserError(problem)
    OUT_DIR_LOCKS.append(lock)
    return lock

def changes(ckpt, config, meta):
    """{key: 'key old -> new'} of the keys and the data's settings (data.key) that the run changed"""
    def settings(config, meta):
        data = (meta or {}).get("settings") or {}
        return {**config, **{f"data.{key}": value for key, value in data.items()}}
    saved, current = settings(ckpt["config"], ckpt["meta"]), settings(config, meta)
    return {key: f"{key} {saved[key]!r} -> {current[key]!r}" for key in current
            if key in saved and saved[key] != current[key] and key != "init_from"}

def check_resume(ckpt, path, config, meta, fixed):
    """A resume continues its checkpoint's run: the keys in `fixed` (what its weights and optimizer
    state were made with) and its data's settings keep their values; the resume line names other
    keys that changed."""
    changed = changes(ckpt, config, meta)
    wrong = [text for key, text in changed.items() if key in fixed or key.startswith("data.")]
    if wrong:
        raise UserError(f"--init_from=resume continues the run in {path}, which had other settings "
                        f"({', '.join(wrong)}): set them back, or start a new run in another --out_dir")
    changed = f"; changed on resume: {', '.join(changed.values())}" if changed else ""
    print0(f"resuming from {path} at step {ckpt['step']}{changed}")

# what train.py checks as it starts, before any work

def open_data_dir(config, given_at, rt):
    """train.py's prepared folder's meta.json; pydoc, offline, is prepared there on first use. Keys
    given with data_dir or after it (given_at: each key's place in argv) describe that folder, and
    must be what it was made with; keys given before a later --data_dir described the folder that it
    replaced (config/t5_tiny.py's dataset under --data_dir=mine)."""
    data_dir = config["data_dir"]
    if config["dataset"] == "pydoc" and not os.path.exists(os.path.join(data_dir, "meta.json")):
        if rt.master:
            print0(f"{data_dir} has no data yet: preparing the 'pydoc' corpus there (runs once)")
            prepare(dataset="pydoc", tokenizer=config["tokenizer"], out_dir=data_dir,
                    vocab_size=config["vocab_size"])
        barrier()
    vocab_size = config["vocab_size"] if config["tokenizer"] == "train" else None  # else the tokenizer's
    wanted = dict(dataset=config["dataset"], tokenizer=config["tokenizer"], vocab_size=vocab_size)
    meta = load_meta(data_dir, wanted)  # missing: the command that prepares what the keys describe
    made_with = meta["settings"]
    described = [key for key in ("dataset", "tokenizer", "vocab_size")
                 if given_at.get(key, -1) >= given_at.get("data_dir", 0)]
    contradicted = [f"{key} {made_with[key]!r}, not {config[key]!r}" for key in described
                    if made_with[key] not in (None, config[key])]
    if contradicted:
        raise UserError(f"{data_dir} was prepared with {', '.join(contradicted)}: set those to the folder's "
                        f"values, or give another --data_dir")
    return meta

def open_out_dir(ckpt_path, config, meta, rt):
    """train.py's out_dir, claimed (claim_out_dir); and the checkpoint --init_from=resume continues, of
    this run's model, optimizer and data (check_resume), with steps and time left; None for a new run"""
    resume = config["init_from"] == "resume"
    claim_out_dir(config["out_dir"], rt, fresh=not resume)
    if not resume:
        return None
    ckpt = load_checkpoint(ckpt_path, program="train.py", weights=not config["fsdp"])
    check_resume(ckpt, ckpt_path, config, meta, fixed=("model", "dropout", "optimizer"))
    if ckpt["step"] >= config["max_steps"]:
        raise UserError(f"{ckpt_path} is at step {ckpt['step']} of max_steps={config['max_steps']}: nothing "
                        f"is left to train; raise --max_steps to train on")
    if 0 < config["time_budget_hours"] * 3600 <= ckpt["elapsed"]:
        raise UserError(f"{ckpt_path} has spent its time budget, {ckpt['elapsed'] / 3600:.2f} h of "
                        f"time_budget_hours={config['time_budget_hours']}: raise --time_budget_hours to train on")
    return ckpt

# checkpoints

def first_problem(problem):
    """the first rank's problem of those the ranks found (each a message, or None): on every rank"""
    problems = [problem]
    if torch.distributed.is_initialized():
        problems = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(problems, problem)
    return next(filter(None, problems), None)

def barrier():
    """every rank waits for the others, in Python: a signal stops a waiting rank at once"""
    if torch.distributed.is_initialized():
        waiting = torch.distributed.barrier(async_op=True)
        while not waiting.is_completed():
            time.sleep(0.01)
        waiting.wait()  # raises what failed

def written_by(path):
    """the program that wrote the checkpoint at path, or None if it can't be read"""
    state_file = path if path.endswith(".pt") else os.path.join(path, "state.pt")
    with contextlib.suppress(Exception):  # mmap: the weights are not read
        return torch.load(state_file, map_location="cpu", weights_only=False, mmap=True).get("program")

def is_sharded(path):
    """a folder of FSDP shards, or what a run killed while replacing it kept: its state.pt or its
    .metadata marks it, either one left if the other is lost"""
    folder = finished_dir(path)
    return any(os.path.isfile(os.path.join(folder, mark)) for mark in ("state.pt", ".metadata"))

def finished_dir(path):
    """where path's last complete sharded checkpoint is: path, or path.old if a run died swapping"""
    return path if os.path.isdir(path) or not os.path.isdir(path + ".old") else path + ".old"

def save_checkpoint(path, state):
    """A .pt path: rank 0 writes one file atomically. A folder (FSDP; every rank calls this): the
    ranks write their shards and rank 0 the rest (state.pt) into path.tmp, which replaces path, kept
    as path.old meanwhile."""
    if path.endswith(".pt"):
        if rank() == 0:
            with atomic_write(path) as f:
                torch.save(state, f)
        return
    tmp = path + ".tmp"
    old = path + ".old"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
    barrier()
    problem = None
    try:
        dcp.save({"model": state["model"], "optimizer": state["optimizer"]}, checkpoint_id=tmp)
        if rank() == 0:  # every rank's shards are written once dcp.save returns
            rest = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            files = {name: os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp)}
            with atomic_write(os.path.join(tmp, "state.pt")) as f:
                torch.save(dict(rest, files=files), f)  # what a reader checks the folder against
    except (Exception, dcp.CheckpointException) as e:  # dcp's holds each rank's error; no Exception
        e = next(iter(e.failures.values()))[0] if isinstance(e, dcp.CheckpointException) else e
        problem = str(write_error(path, write_failure(e) or e))
    problem = first_problem(problem)  # a failure on any rank fails the save on every rank
    if problem:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the last good checkpoint stays
        barrier()  # then every rank says it at once: none is stopped by torchrun as another exits
        raise UserError(problem)
    if rank() == 0:
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()

def load_checkpoint(path, program=None, weights=True):
    """The checkpoint at path (a .pt file or a folder of FSDP shards) as one dict; with `program`,
    only one that program wrote. From shards: all but the optimizer, the whole model only if weights
    (a sharded run's ranks read their own slices), and 'shards' naming the folder. Every way a
    checkpoint is damaged is one line here, that names the file."""
    sharded = not path.endswith(".pt")
    found = finished_dir(path) if sharded else path
    state_file = os.path.join(found, "state.pt") if sharded else found
    if not os.path.exists(found):
        if sharded:
            other = path + ".pt"
            kind = "one written without FSDP: leave fsdp off"
        else:
            other = path.removesuffix(".pt")
            kind = "the shards of an FSDP run: pass --fsdp=True (under torchrun)"
        if os.path.exists(finished_dir(other)):
            hint = f"but {other} holds {kind} to read it"
        else:
            hint = "check the path, or train one first with train.py"
        raise UserError(f"no {'sharded ' if sharded else ''}checkpoint at {path}; {hint}")
    with reading(state_file, DAMAGED):
        state = torch.load(state_file, map_location="cpu", weights_only=False, mmap=True)  # read in use
        if sharded:
            state = dict(state, shards=found)
    if sharded:  # every file of the shards as long as when it was saved: none lost, none cut
        for name, size in state.get("files", {}).items():
            file = os.path.join(found, name)
            with reading(file, DAMAGED):
                if os.path.getsize(file) != size:  # a lost file: FileNotFoundError
                    raise EOFError(f"{size:,} bytes when saved, {os.path.getsize(file):,} now")
    if sharded and weights:
        tensors = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
        model = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
                 for key, md in tensors.items()
                 if key.startswith("model.") and isinstance(md, dcp.TensorStorageMetadata)}
        with warnings.catch_warnings():  # no_dist: each caller reads the whole model on its own
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model}, checkpoint_id=found, no_dist=True)
        state["model"] = model
    if program and (not isinstance(state, dict) or state.get("program") != program):
        writer = state.get("program") if isinstance(state, dict) else None
        raise UserError(f"{path} was written by {writer or 'another program'}, and {program} "
                        f"--init_from=resume continues only its own runs: start from it with "
                        f"--init_from={path} in another --out_dir")
    return state

def run_state(t5, optimizer, step, elapsed, config, meta=None, program="train.py"):
    """All a run needs to continue where it stopped, and which program wrote it. Under FSDP every
    rank calls this: the tensors are this rank's shards, the RNG states every rank's."""
    sharded = isinstance(t5, FSDPModule)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's GPU's only: a resume may see another number of GPUs
        rng["cuda"] = torch.cuda.get_rng_state()
    if sharded:
        rngs = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rngs, rng)
        rng = rngs
    optimizer_state = get_optimizer_state_dict(t5, optimizer) if sharded else optimizer.state_dict()
    return {"program": program, "model": t5.state_dict(), "model_config": dataclasses.asdict(t5.config),
            "optimizer": optimizer_state, "step": step, "elapsed": elapsed, "config": config,
            "meta": meta, "rng": rng}

def restore_state(ckpt, t5, optimizer):
    """A resumed run's optimizer state and RNG, and (its steps done, its training seconds); (0, 0.0)
    for a new run, ckpt None. From shards each rank reads its slices, for any number of ranks; with
    more ranks than wrote them, the RNG states repeat."""
    if ckpt is None:
        return 0, 0.0
    if "shards" in ckpt:
        state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}  # the layout to fill
        dcp.load(state, checkpoint_id=ckpt["shards"])
        set_optimizer_state_dict(t5, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt["rng"]
    if isinstance(rng, list):  # every rank's
        rng = rng[rank() % len(rng)]
    torch.set_rng_state(rng["torch"])
    if torch.is_tensor(rng.get("cuda")) and torch.cuda.is_available():  # not a list of every GPU's
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"], ckpt["elapsed"]

def model_from_checkpoint(ckpt, **overrides):
    """The T5 in a checkpoint of train.py or finetune.py (a dict from load_checkpoint)."""
    return load_weights(T5(T5Config(**{**ckpt["model_config"], **overrides})), ckpt["model"])

# Hugging Face's format: transformers' T5ForConditionalGeneration, read and written

# T5Config fields that Hugging Face's config.json names differently; all others have the same name
HF_CONFIG_NAMES = {'dropout': 'dropout_rate', 'layer_norm_eps': 'layer_norm_epsilon'}
# our block sub-modules -> Hugging Face's; the parameters inside them have the same names
HF_SUBLAYERS = dict(ln_1='layer.0.layer_norm', attn='layer.0.SelfAttention',
                    self_attn='layer.0.SelfAttention', ln_2='layer.1.layer_norm',
                    cross_attn='layer.1.EncDecAttention', ln_3='layer.2.layer_norm')
# copies of shared.weight, and a cross-attention bias table old checkpoints carry and T5 never uses
HF_REDUNDANT = {'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight',
                'decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight'}

def hf_names(model):
    """(our name, Hugging Face's) of each tensor: decoder.blocks.3.cross_attn.k.weight is
    decoder.block.3.layer.1.EncDecAttention.k.weight"""
    for name in model.state_dict():
        stack, kind, *rest = name.split('.')
        if kind == 'blocks':  # the feed-forward is the encoder's second layer, the decoder's third
            feed_forward = f"layer.{1 if stack == 'encoder' else 2}.DenseReluDense"
            sub = HF_SUBLAYERS.get(rest[1], feed_forward)
            yield name, '.'.join([stack, 'block', rest[0], sub, *rest[2:]])
        else:  # ln_f, shared, lm_head
            yield name, name.replace('ln_f', 'final_layer_norm')

def read_hf(name_or_dir):
    """(T5Config, state dict in our names) of a gated-GELU T5 (t5-v1_1, flan-t5, t5-lm-adapt,
    nanoT5) from a Hub id or a folder with config.json and model.safetensors (or pytorch_model.bin)"""
    folder = name_or_dir if os.path.isdir(name_or_dir) else download(name_or_dir)
    config_file = os.path.join(folder, 'config.json')
    with reading(config_file), open(config_file) as f:
        hf = json.load(f)
    activation = hf.get('feed_forward_proj', 'relu')
    if activation != 'gated-gelu':
        raise UserError(f"unsupported model {name_or_dir}: feed_forward_proj is {activation!r}, "
                        f"model.py implements gated-gelu T5s (t5-v1_1, flan-t5, t5-lm-adapt, nanoT5)")
    state_dict = read_weights_file(folder)
    names = [field.name for field in dataclasses.fields(T5Config)]
    values = {name: hf.get(HF_CONFIG_NAMES.get(name, name)) for name in names}
    fields = {name: value for name, value in values.items() if value is not None}
    fields.setdefault('num_decoder_layers', fields['num_layers'])
    # transformers 5.x says tie_word_embeddings=true even when untied: the weights decide tying
    shared = state_dict['shared.weight']
    lm_head = state_dict.get('lm_head.weight', shared)
    fields['tie_word_embeddings'] = lm_head is shared or torch.equal(lm_head, shared)
    fields.setdefault('scale_decoder_outputs', hf.get('tie_word_embeddings', True))
    config = T5Config(**fields)
    with torch.device("meta"):
        ours = {hf_name: name for name, hf_name in hf_names(T5(config))}
    state_dict = {ours.get(k, k): v for k, v in state_dict.items() if k not in HF_REDUNDANT}
    state_dict['lm_head.weight'] = lm_head
    return config, state_dict

def from_pretrained(name_or_dir, **overrides):
    """A T5 of Hugging Face's weights (read_hf); overrides are T5Config fields."""
    config, state_dict = read_hf(name_or_dir)
    return load_weights(T5(dataclasses.replace(config, **overrides)), state_dict)

def save_pretrained(model, folder):
    """config.json and model.safetensors, which transformers' T5ForConditionalGeneration reads"""
    from safetensors.torch import save
    c = model.config
    state_dict = model.state_dict()
    tensors = {hf_name: state_dict[name].contiguous() for name, hf_name in hf_names(model)
               if not (c.tie_word_embeddings and name == 'lm_head.weight')}  # tied: shared.weight
    hf = {HF_CONFIG_NAMES.get(k, k): v for k, v in dataclasses.asdict(c).items()}
    hf.update(architectures=['T5ForConditionalGeneration'], model_type='t5',
              feed_forward_proj='gated-gelu', dense_act_fn='gelu_new', is_gated_act=True,
              is_encoder_decoder=True, initializer_factor=1.0, use_cache=True,
              scale_decoder_outputs=c.output_scaling != 1.0)
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, 'model.safetensors')) as f:
        f.write(save(tensors, metadata={'format': 'pt'}))
    with atomic_write(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(hf, f, indent=2)

def download(repo_id):
    """a Hub model's folder in the Hugging Face cache: config.json and the weights (safetensors)"""
    if os.path.exists(repo_id) or repo_id.startswith(('.', '/', '~')) or repo_id.count('/') != 1:
        raise UserError(f"{repo_id} is not a folder with a Hugging Face checkpoint, nor a Hub id "
                        f"like google/t5-v1_1-base")
    # offline, an unknown or gated repo, no huggingface_hub
    with reading(repo_id, "could not get {path} from the Hugging Face Hub ({kind}); pass a local folder with "
                          "config.json and model.safetensors (or pytorch_model.bin)"):
        from huggingface_hub import snapshot_download
        folder = snapshot_download(repo_id, allow_patterns=['config.json', '*.safetensors'], etag_timeout=5)
        if not glob.glob(os.path.join(folder, '*.safetensors')):
            folder = snapshot_download(repo_id, allow_patterns=['config.json', 'pytorch_model*.bin'], etag_timeout=5)
    return folder

def read_weights_file(folder):
    """every tensor of the checkpoint in folder (sharded or not), safetensors preferred, each mapped
    from its file (safetensors' load_file maps them too): memory holds what is used, when it is"""
    files = sorted(glob.glob(f'{folder}/*.safetensors')) or sorted(glob.glob(f'{folder}/pytorch_model*.bin'))
    if not files:
        raise UserError(f"no model.safetensors or pytorch_model.bin in {folder}; write one with export.py")
    corrupt = "could not read the weights in {path} ({reason}); they are corrupt or cut: get them again"
    with reading(folder, corrupt):
        if files[0].endswith('.safetensors'):
            from safetensors.torch import load_file
            return {k: v for f in files for k, v in load_file(f).items()}
        mapped = [torch.load(f, map_location='cpu', weights_only=True, mmap=zipfile.is_zipfile(f))
                  for f in files]  # an old file, not a zip, is read whole
        return {k: v for state_dict in mapped for k, v in state_dict.items()}

# where a model comes from: a run's checkpoint, or Hugging Face weights

def find_weights(init_from):
    """The checkpoint of a run of train.py or finetune.py that init_from names (its out_dir, ckpt.pt or
    ckpt/), or None for Hugging Face weights (a folder, or a Hub name); what is neither is one line."""
    shards = os.path.dirname(init_from)
    if not os.path.isdir(init_from) and os.path.isfile(os.path.join(shards, ".metadata")):  # state.pt, say
        raise UserError(f"{init_from} is one file of the sharded checkpoint {shards}: pass "
                        f"--init_from={shards}")
    for path in (init_from, os.path.join(init_from, "ckpt.pt"), os.path.join(init_from, "ckpt")):
        if path.endswith(".pt") and os.path.isfile(path) or is_sharded(path):
            return path
    if init_from.endswith(".pt"):
        return init_from  # a missing one: load_checkpoint names it
    if os.path.isfile(os.path.join(init_from, "meta.json")):
        raise UserError(f"{init_from} is a prepared data folder, not a run: give it as --data_dir, and as "
                        f"--init_from a run's out_dir or Hugging Face weights")
    out_dir = re.compile(rf"^out_dir = [\"']{re.escape(init_from.rstrip('/'))}[\"']", re.M)
    made_by = [path for path in sorted(glob.glob("config/*.py")) if out_dir.search(open(path).read())]
    missing = not os.path.exists(init_from) and (made_by or os.path.isdir(os.path.dirname(init_from)))
    weights = (".json", ".safetensors", ".bin")  # Hugging Face's config.json and weights
    empty = os.path.isdir(init_from) and not any(f.endswith(weights) for f in os.listdir(init_from))
    if missing or empty:
        train = f" (`python train.py {made_by[0]}` trains it)" if made_by else ""
        raise UserError(f"{init_from} {'does not exist' if missing else 'holds no run or weights'}{train}: "
                        f"pass a run of train.py or finetune.py (its out_dir, ckpt.pt or ckpt/), a folder "
                        f"with Hugging Face weights, or a Hub name")
    require("safetensors", f"--init_from={init_from} (Hugging Face weights)")
    return None

def check_init_from(init_from):
    """configurator.py's rule for train.py's and finetune.py's init_from: all but a missing checkpoint
    file is checked before the run does any work"""
    word = init_from.strip("/").lower()
    if word in ("scratch", "resume") and init_from != word and not os.path.exists(init_from):
        raise UserError(f"--init_from={init_from} names no run or weights: did you mean --init_from={word}?")
    if init_from not in ("scratch", "resume"):
        find_weights(init_from)

def load_model(init_from, **overrides):
    """(T5, its checkpoint or None) from a run of train.py or finetune.py (its out_dir, ckpt.pt or
    ckpt/) or from Hugging Face weights (a Hub name or folder); overrides are T5Config fields."""
    path = find_weights(init_from)
    if path is None:
        return from_pretrained(init_from, **overrides), None
    ckpt = load_checkpoint(path)
    with reading(path, NOT_A_RUN):
        return model_from_checkpoint(ckpt, **overrides), ckpt

def read_weights(source, fsdp=False, preset=None):
    """(T5Config, weights for load_weights, the run's data meta or None) of what a run starts from:
    a resumed checkpoint (from load_checkpoint), or what init_from names, a run of train.py or
    finetune.py or Hugging Face weights, of the shape of the model preset if one is given. Every
    rank reads for itself: FSDP shards stay on disk, for each rank to read its own; other weights
    are mapped from their files (mmap), not read, until load_weights copies what the rank keeps."""
    def of(ckpt, path=""):
        with reading(path, NOT_A_RUN):
            return T5Config(**ckpt["model_config"]), ckpt.get("shards") or ckpt["model"], ckpt["meta"]
    if isinstance(source, dict):  # this run's own checkpoint
        return of(source)
    print0(f"a new run from the weights of {source} (--init_from=resume continues a run)")
    path = find_weights(source)
    if path is None:  # Hugging Face's
        config, weights, meta = *read_hf(source), None
    else:  # a run's: FSDP's shards, under FSDP, stay on disk
        sharded = fsdp and not path.endswith(".pt")
        config, weights, meta = of(load_checkpoint(path, weights=not sharded), path)
    if preset:  # a new run's --model: the shape of its weights
        theirs = [name for name, shape in PRESETS.items() if shape.items() <= dataclasses.asdict(config).items()]
        if preset not in theirs:
            fix = f"pass --model={theirs[0]}" if theirs else "add their shape to model.py's PRESETS"
            raise UserError(f"--model={preset} is not the shape of the weights in {source}: {fix}")
    return config, weights, meta

def load_weights(model, weights):
    """model with weights: from a folder of FSDP shards, each rank reading its own slices; or a whole
    state dict, its tensors mapped from their files: under FSDP each rank copies out its own slices,
    tensor by tensor (runtime.set_values), and so reads only those"""
    if isinstance(weights, str):
        state = {"model": get_model_state_dict(model)}  # the layout to fill
        dcp.load(state, checkpoint_id=weights)
        set_model_state_dict(model, state["model"])
        return model
    layout = model.state_dict()  # each tensor's name and whole shape
    wanted = {name: tuple(t.shape) for name, t in layout.items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if found != wanted:  # the first tensor that differs, in one line
        name = min(name for name in wanted.keys() | found.keys() if wanted.get(name) != found.get(name))
        raise UserError(f"the weights do not match their config: {name} is {found.get(name, 'absent')} in the "
                        f"weights and {wanted.get(name, 'absent')} in the model")
    for name, p in layout.items():
        set_values(p, weights[name])
    return model
