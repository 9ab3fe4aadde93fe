"""A run's checkpoints: saved (one file, or FSDP's shards in a folder per step), found, read back
and restored; what a run starts from (load); a new run writes over no other run's files, and a
resume keeps its run's settings; Hugging Face's format, read and written."""
import dataclasses
import glob
import json
import os
import re
import shutil
import warnings
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule

from model import PRESETS, T5, T5Config
from runtime import atomic_write, print0, rank, set_values

# what a run writes into its out_dir: a new run refuses a folder that holds one of them
RUN_FILES = ("ckpt.pt", "ckpt", "log.jsonl", "metrics.json", "predictions.jsonl")
NOTHING_THERE = ("error: {} holds no run or weights{}: pass a run's out_dir (or its ckpt.pt or "
                 "ckpt/), a folder of Hugging Face weights, or a Hub name like google/t5-v1_1-base")

def check_new_run(out_dir):
    """a new run writes into a folder that holds no other run's files"""
    found = [path for path in (os.path.join(out_dir, name) for name in RUN_FILES) if os.path.exists(path)]
    if found:
        raise SystemExit(f"error: {found[0]} exists and this run would replace it: pass another "
                         f"--out_dir, or --init_from=resume to continue that run")

# checkpoints: saved, found, read back

def save_checkpoint(out_dir, t5, optimizer, step, elapsed, config, meta, program="train.py"):
    """All a run needs to go on where it stopped. One process (or DDP's rank 0) writes
    out_dir/ckpt.pt, renamed over the last one once complete. Under FSDP every rank writes its
    shards into out_dir/ckpt/step-N, once rank 0 has written state.pt there (all but the tensors):
    torch.distributed.checkpoint writes .metadata last, marking it complete. The newest two stay."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's GPU's only: a resume may see another number of GPUs
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"program": program, "model_config": dataclasses.asdict(t5.config), "step": step,
             "elapsed": elapsed, "config": config, "meta": meta, "rng": rng}
    if not isinstance(t5, FSDPModule):
        if rank() == 0:
            with atomic_write(os.path.join(out_dir, "ckpt.pt")) as f:
                torch.save(dict(state, model=t5.state_dict(), optimizer=optimizer.state_dict()), f)
        return
    state["rng"] = [None] * torch.distributed.get_world_size()  # every rank's
    torch.distributed.all_gather_object(state["rng"], rng)
    folder = os.path.join(out_dir, "ckpt", f"step-{step}")
    if rank() == 0:
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, "state.pt"))
    tensors = {"model": t5.state_dict(), "optimizer": get_optimizer_state_dict(t5, optimizer)}
    dcp.save(tensors, checkpoint_id=folder)
    if rank() == 0:
        kept = complete_steps(os.path.join(out_dir, "ckpt"))[-2:]
        for old in set(glob.glob(os.path.join(out_dir, "ckpt", "step-*"))) - set(kept):
            shutil.rmtree(old)

def complete_steps(folder):
    """the complete step folders of a sharded checkpoint, oldest first"""
    steps = [os.path.dirname(mark) for mark in glob.glob(os.path.join(folder, "step-*", ".metadata"))]
    return sorted(steps, key=lambda path: int(re.search(r"step-(\d+)$", path)[1]))

def find_checkpoint(path):
    """The checkpoint that path names, or None: a file (ckpt.pt), a complete step folder, or a run's
    out_dir or ckpt/ folder: its ckpt.pt, or else its newest complete step folder."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, ".metadata")):
        return path
    if os.path.isfile(os.path.join(path, "ckpt.pt")):
        return os.path.join(path, "ckpt.pt")
    steps = complete_steps(path) or complete_steps(os.path.join(path, "ckpt"))
    return steps[-1] if steps else None

def load_checkpoint(path, weights=True):
    """A checkpoint as one dict: a .pt file; or a step folder's state.pt, with 'shards' naming the
    folder and, if weights, the whole model read from the shards into this process."""
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
    state["shards"] = path
    if weights:
        tensors = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # their shapes
        state["model"] = {key[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                          for key, md in tensors.items() if key.startswith("model.")}
        with warnings.catch_warnings():  # that it reads the whole model in one process: so it does
            warnings.simplefilter("ignore")
            dcp.load({"model": state["model"]}, checkpoint_id=path, no_dist=True)
    return state

def load_resume(out_dir, program, fsdp, config, meta, fixed):
    """The newest checkpoint of out_dir's run, which --init_from=resume continues: one its program
    wrote, of the format this run writes, with the keys in `fixed` (what its weights and optimizer
    state were made with) and its data's settings unchanged. Under FSDP its shards stay on disk."""
    wanted = os.path.join(out_dir, "ckpt" if fsdp else "ckpt.pt")
    path = find_checkpoint(wanted)
    if path is None:
        other = find_checkpoint(out_dir)  # of the other format
        fix = "leave fsdp off" if fsdp else "pass --fsdp=True under torchrun"
        raise SystemExit(f"error: no checkpoint to resume at {wanted}" +
                         (f"; {other} is another format's: {fix}" if other else ": train one first"))
    ckpt = load_checkpoint(path, weights=not fsdp)
    if ckpt.get("program") != program:
        writer = ckpt.get("program") or "another program"
        raise SystemExit(f"error: {path} was written by {writer}, and {program} resumes only its "
                         f"own runs: start from its weights with --init_from={path} in another "
                         f"--out_dir")

    def settings(config, meta):  # the keys, and the data's settings as data.key
        data = (meta or {}).get("settings") or {}
        return {**config, **{f"data.{key}": value for key, value in data.items()}}
    saved, current = settings(ckpt["config"], ckpt["meta"]), settings(config, meta or ckpt["meta"])
    changed = {key: f"{key} {saved[key]!r} -> {current[key]!r}" for key in current
               if key in saved and saved[key] != current[key] and key != "init_from"}
    wrong = [text for key, text in changed.items() if key in fixed or key.startswith("data.")]
    if wrong:
        raise SystemExit(f"error: --init_from=resume continues the run in {path}, which had other "
                         f"settings ({', '.join(wrong)}): set them back, or start a new run in "
                         f"another --out_dir")
    changed = f"; changed on resume: {', '.join(changed.values())}" if changed else ""
    print0(f"resuming from {path} at step {ckpt['step']}{changed}")
    return ckpt

def restore_state(ckpt, t5, optimizer):
    """A resumed run's optimizer state and RNG; returns (its steps done, its training seconds). From
    shards each rank reads its own, on any number of ranks (the RNG states then repeat)."""
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
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"], ckpt["elapsed"]

# what a run starts from: its own checkpoint, a run's, Hugging Face weights, or nothing

def start_from(init_from, out_dir, program, fsdp, config, meta, fixed, preset=None):
    """What a run starts from: for 'resume' its out_dir's newest checkpoint (load_resume); for a
    new run, in an out_dir free of other runs' files, what init_from names (load); None: scratch"""
    if init_from == "resume":
        return load_resume(out_dir, program, fsdp, config, meta, fixed)
    check_new_run(out_dir)
    if init_from != "scratch":
        print0(f"a new run from the weights of {init_from}")
        return load(init_from, fsdp, preset)

def load(init_from, fsdp=False, preset=None):
    """What a new run (or sample.py, export.py) starts from, as a checkpoint: model_config, meta (a
    run's data, or None) and the weights. init_from is a run of train.py or finetune.py (its
    out_dir, ckpt.pt, ckpt/ or a step folder) or Hugging Face weights (a folder, a Hub name), of
    the shape of the model preset if one is given. No rank holds the whole model: under FSDP a
    run's shards stay on disk, for each rank to read its own; other weights are mapped from their
    files, not read, until load_weights copies out what the rank keeps."""
    path = find_checkpoint(init_from)
    if path:
        ckpt = load_checkpoint(path, weights=not fsdp)
    else:
        config, weights = read_hf(init_from)
        ckpt = {"model_config": dataclasses.asdict(config), "model": weights, "meta": None}
    theirs = [name for name, shape in PRESETS.items() if shape.items() <= ckpt["model_config"].items()]
    if preset and preset not in theirs:
        fix = f"pass --model={theirs[0]}" if theirs else "add their shape to model.py's PRESETS"
        raise SystemExit(f"error: --model={preset} is not the shape of the weights in {init_from}: "
                         f"{fix}")
    return ckpt

def load_weights(model, ckpt):
    """model, placed, with a checkpoint's weights: from FSDP's shards each rank reads its own
    slices; from a whole state dict, its tensors mapped from their files, each rank copies out its
    own, tensor by tensor (runtime.set_values), and so reads only those"""
    if "model" in ckpt:
        for name, p in model.state_dict().items():
            set_values(p, ckpt["model"][name])
        return model
    state = {"model": get_model_state_dict(model)}  # the layout to fill
    dcp.load(state, checkpoint_id=ckpt["shards"])
    set_model_state_dict(model, state["model"])
    return model

def model_from_checkpoint(ckpt, **overrides):
    """the T5 of a checkpoint (from load or load_checkpoint); overrides are T5Config fields"""
    return load_weights(T5(T5Config(**{**ckpt["model_config"], **overrides})), ckpt)

def load_model(init_from, **overrides):
    """(T5, its checkpoint) of what load() reads; overrides are T5Config fields"""
    ckpt = load(init_from)
    return model_from_checkpoint(ckpt, **overrides), ckpt

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
    nanoT5) from a Hub id, or a folder of config.json and model.safetensors or pytorch_model.bin"""
    folder = name_or_dir if os.path.isdir(name_or_dir) else download(name_or_dir)
    if not os.path.isfile(os.path.join(folder, 'config.json')):
        raise SystemExit(NOTHING_THERE.format(name_or_dir, ""))
    with open(os.path.join(folder, 'config.json')) as f:
        hf = json.load(f)
    if hf.get('feed_forward_proj', 'relu') != 'gated-gelu':
        raise SystemExit(f"error: {name_or_dir} is not a gated-GELU T5, which model.py implements "
                         f"(t5-v1_1, flan-t5, t5-lm-adapt, nanoT5)")
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
        raise SystemExit(NOTHING_THERE.format(repo_id, ""))
    from huggingface_hub import snapshot_download
    try:  # offline, an unknown or a gated repo: in seconds, not after minutes of retries
        for weights in ('*.safetensors', 'pytorch_model*.bin'):  # the older format if no other
            folder = snapshot_download(repo_id, allow_patterns=['config.json', weights], etag_timeout=5)
            if glob.glob(os.path.join(folder, weights)):
                break
    except Exception as e:
        hub = f", here or on the Hugging Face Hub ({type(e).__name__})"
        raise SystemExit(NOTHING_THERE.format(repo_id, hub)) from None
    return folder

def read_weights_file(folder):
    """every tensor of the checkpoint in folder (sharded or not), safetensors preferred, each mapped
    from its file (safetensors' load_file maps them too): memory holds what is used, when it is"""
    files = sorted(glob.glob(f'{folder}/*.safetensors')) or glob.glob(f'{folder}/pytorch_model*.bin')
    if not files:
        raise SystemExit(f"error: no model.safetensors or pytorch_model.bin in {folder}")
    if files[0].endswith('.safetensors'):
        from safetensors.torch import load_file
        return {k: v for f in files for k, v in load_file(f).items()}
    mapped = [torch.load(f, map_location='cpu', weights_only=True, mmap=zipfile.is_zipfile(f))
              for f in files]  # an old file, not a zip, is read whole
    return {k: v for state_dict in mapped for k, v in state_dict.items()}
