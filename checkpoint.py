"""A run's checkpoints: a folder per step, which torch.distributed.checkpoint writes in one process
as on many ranks; found, read back and restored on any number of ranks; the tokenizer a model
reads; what a run starts from; Hugging Face's format, read and written."""
import dataclasses
import glob
import hashlib
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

from model import PRESETS, T5, T5Config
from prepare import (BPE_PATTERN, NUM_SENTINELS, T5_SPIECE_SHA256, TIKTOKEN_LINE, Tokenizer,
                     read_ranks, read_tokenizer, t5_spiece)
from runtime import all_gathered, atomic_write, print0, rank, set_values

# one process saves and loads without a process group, as it means to: no warning each time
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")

# what a run writes into its out_dir: a new run refuses a folder that holds one of them
RUN_FILES = ("ckpt", "log.jsonl", "metrics.json", "predictions.jsonl", "ckpt.pt")
# the files a save writes into a step folder: pruning takes no folder that holds another
SAVED = re.compile(r"state\.pt|\.metadata|__\d+_\d+\.distcp|.*\.tmp")
NOTHING_THERE = ("error: {} holds no run or weights{}: pass a run's out_dir (or a step folder of "
                 "its ckpt/), a folder of Hugging Face weights, or a Hub name like "
                 "google/t5-v1_1-base")

def check_new_run(out_dir):
    """a new run writes into a folder that holds no other run's files (the Logger then claims it)"""
    found = [path for path in (os.path.join(out_dir, name) for name in RUN_FILES)
             if os.path.exists(path)]
    if found:
        resumable = os.path.isdir(find_checkpoint(out_dir) or "")  # a step folder
        resume = ", or --init_from=resume to continue that run" if resumable else ""
        raise SystemExit(f"error: {found[0]} exists and this run would replace it: pass another "
                         f"--out_dir{resume}")

# checkpoints: saved, found, read back

def save_checkpoint(out_dir, t5, optimizer, step, elapsed, run):
    """All a run needs to go on where it stopped, in out_dir/ckpt/step-N, torchtitan's layout, in
    one process as on any number of ranks. Rank 0 writes state.pt (the step, the run's config, data
    and tokenizer, every rank's RNG state), whole; then every rank writes its part of the weights
    and optimizer state (under DDP the replicas share the writing), and torch.distributed.checkpoint
    writes .metadata last, which marks the folder complete. The newest two complete folders stay."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's GPU's only: a resume may see another number of GPUs
        rng["cuda"] = torch.cuda.get_rng_state()
    rngs = all_gathered(rng)
    folder = os.path.join(out_dir, "ckpt", f"step-{step}")
    if rank() == 0:
        os.makedirs(folder, exist_ok=True)
        state = dict(run, model_config=dataclasses.asdict(t5.config), step=step, elapsed=elapsed,
                     rng=rngs)
        with atomic_write(os.path.join(folder, "state.pt")) as f:
            torch.save(state, f)
    tensors = {"model": get_model_state_dict(t5),
               "optimizer": get_optimizer_state_dict(t5, optimizer)}
    dcp.save(tensors, checkpoint_id=folder)
    if rank() == 0:
        steps = step_folders(os.path.join(out_dir, "ckpt"))
        kept = [path for path in steps if os.path.isfile(os.path.join(path, ".metadata"))][-2:]
        for old in set(steps) - set(kept):  # and any a killed save left incomplete,
            if all(SAVED.fullmatch(name) for name in os.listdir(old)):  # if a save wrote it
                shutil.rmtree(old)

def step_folders(folder):
    """folder's step-<integer> folders, oldest first: a user's step-4000.bak is none of them"""
    steps = [path for path in glob.glob(os.path.join(folder, "step-*"))
             if re.fullmatch(r"step-\d+", os.path.basename(path))]
    return sorted(steps, key=lambda path: int(path.rsplit("-", 1)[1]))

def find_checkpoint(path):
    """The checkpoint that path names, or None: for a run's out_dir or its ckpt/ folder, the newest
    complete step folder (or ckpt/ itself, as runs before step folders wrote it); a step folder; a
    file (an older run's ckpt.pt, whose weights a new run can start from)."""
    for folder in (os.path.join(path, "ckpt"), path):
        complete = [candidate for candidate in [folder, *step_folders(folder)]
                    if os.path.isfile(os.path.join(candidate, ".metadata"))]
        if complete:
            return complete[-1]
    for file in (os.path.join(path, "ckpt.pt"), path):
        if os.path.isfile(file):
            return file

def load_checkpoint(path, weights=True):
    """A checkpoint as one dict, with 'shards' naming its folder and, if weights, the whole model
    read from them into this process; or an older run's ckpt.pt. A checkpoint written before they
    carried their tokenizer gets its data folder's."""
    if os.path.isfile(path):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as e:  # a README, a damaged file
            raise SystemExit(NOTHING_THERE.format(path, f" ({type(e).__name__})")) from None
        if not isinstance(ckpt, dict) or not {"model", "model_config", "meta"} <= ckpt.keys():
            raise SystemExit(NOTHING_THERE.format(path, " (a file, but no run's ckpt.pt)"))
    else:
        ckpt = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
        ckpt["shards"] = path
    if weights and "model" not in ckpt:
        shapes = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        ckpt["model"] = {key[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                         for key, md in shapes.items() if key.startswith("model.")}
        dcp.load({"model": ckpt["model"]}, checkpoint_id=path, no_dist=True)  # in this process
    if "tokenizer" not in ckpt:
        meta = ckpt["meta"]  # None: Hugging Face weights were the start, with T5's tokenizer
        file = meta and os.path.join(meta["data_dir"], meta["tokenizer_file"])
        if file and not os.path.isfile(file):
            raise SystemExit(f"error: {path} reads the tokenizer of its data folder, and {file} is "
                             f"gone: put the folder back there, or prepare it again")
        ckpt["tokenizer"] = read_tokenizer(file).data if file else None
    return ckpt

def newest_checkpoint(path, key="out_dir"):
    """path's newest checkpoint, or None, the same on every rank: each rank's finding, in one
    all-gather, for a node that sees another folder would load another state, or wait for the rest"""
    found = all_gathered(find_checkpoint(path))
    if len(set(found)) > 1:
        raise SystemExit(f"error: the ranks found different checkpoints in {path} "
                         f"({', '.join(sorted(map(str, set(found))))}): {key} must be a folder "
                         f"every node sees")
    return found[0]

def changes(saved, now, prefix=""):
    """what differs between two runs' settings: a "key saved -> now" each, by key"""
    return {key: f"{prefix}{key} {saved[key]!r} -> {value!r}" for key, value in now.items()
            if key in saved and saved[key] != value and key != "init_from"}

def refuse(path, wrong):
    if wrong:
        raise SystemExit(f"error: --init_from=resume continues the run in {path}, which had other "
                         f"settings ({', '.join(wrong)}): set them back, or start a new run in "
                         f"another --out_dir")

def load_resume(path, program, config, fixed):
    """The checkpoint at path, which --init_from=resume continues on any number of ranks: one its
    program wrote, with the keys in `fixed` (what its weights and optimizer state were made with)
    unchanged. Its shards stay on disk."""
    fix = f"start from its weights with --init_from={path} in another --out_dir"
    if os.path.isfile(path):
        raise SystemExit(f"error: {path} is an older run's checkpoint file, which a resume does "
                         f"not continue: {fix}")
    ckpt = load_checkpoint(path, weights=False)
    if ckpt.get("program") != program:
        writer = ckpt.get("program") or "another program"
        raise SystemExit(f"error: {path} was written by {writer}, and {program} resumes only its "
                         f"own runs: {fix}")
    changed = changes(ckpt["config"], config)
    refuse(path, [text for key, text in changed.items() if key in fixed])
    changed = f"; changed on resume: {', '.join(changed.values())}" if changed else ""
    print0(f"resuming from {path} at step {ckpt['step']}{changed}")
    return ckpt

def check_data(ckpt, meta, how):
    """a resume reads its own run's data; weights, data of their own tokenizer"""
    if how == "resume":
        settings = changes(ckpt["meta"]["settings"], meta["settings"], "data.")
        refuse(ckpt["shards"], list(settings.values()))
    if ckpt:
        check_tokenizer(ckpt, meta, ckpt.get("shards") or how)

def diverged(out_dir, step):
    """the line of a run whose loss or grad norm became NaN or inf, with a fix that works"""
    fix = ("resume" if find_checkpoint(out_dir) else
           "no checkpoint yet: start again in a new --out_dir")
    return SystemExit(f"error: the loss or grad norm became NaN or inf by step {step}: training "
                      f"diverged; {fix} with a lower lr or grad_clip")

def restore_state(ckpt, t5, optimizer):
    """A resumed run's optimizer state and RNG; returns (its steps done, its training seconds). Each
    rank reads its own part, on any number of ranks (the RNG states then repeat)."""
    state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}  # the layout to fill
    dcp.load(state, checkpoint_id=ckpt["shards"])
    set_optimizer_state_dict(t5, optimizer, state["optimizer"])  # a step count saved as float64 too
    rng = ckpt["rng"][rank() % len(ckpt["rng"])]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return ckpt["step"], ckpt["elapsed"]

# the tokenizer a model reads: the one its checkpoint carries; Hugging Face's weights' spiece.model

def tokenizer_sha256(ckpt):
    """what names a checkpoint's tokenizer: its bytes' sha256; None (Hugging Face weights without a
    spiece.model) is T5's"""
    return hashlib.sha256(ckpt["tokenizer"]).hexdigest() if ckpt["tokenizer"] else T5_SPIECE_SHA256

def check_tokenizer(ckpt, meta, source):
    """a model meets data: it must have been trained with the data's tokenizer, into whose vocab it
    reads, or each id would mean another piece to it"""
    sha256, vocab_size = tokenizer_sha256(ckpt), ckpt["model_config"]["vocab_size"]
    if (sha256, vocab_size) != (meta["tokenizer_sha256"], meta["model_vocab_size"]):
        raise SystemExit(f"error: {source} was trained with another tokenizer (sha256 "
                         f"{sha256[:12]}, model vocab {vocab_size}) than {meta['data_dir']}'s "
                         f"(sha256 {meta['tokenizer_sha256'][:12]}, {meta['model_vocab_size']}): "
                         f"prepare the data with the model's own tokenizer (prepare.py "
                         f"--tokenizer=t5 for Google's T5s, or an export's tokenizer file)")

def tokenizer_of(ckpt, source):
    """The tokenizer of a checkpoint's model: the one it carries; for Hugging Face weights the
    spiece.model beside them, or else T5's. It must make the model's vocab."""
    vocab_size = ckpt["model_config"]["vocab_size"]
    if ckpt["tokenizer"] is None and vocab_size != 32128:  # T5's tokenizer's, padded
        raise SystemExit(f"error: {source} holds no spiece.model, and its vocab of {vocab_size} "
                         f"is not T5's tokenizer's: copy the model's tokenizer there as "
                         f"spiece.model")
    tok = Tokenizer(ckpt["tokenizer"]) if ckpt["tokenizer"] else read_tokenizer(t5_spiece())
    if tok.model_vocab_size != vocab_size:
        raise SystemExit(f"error: the tokenizer of {source} is not the model's: its "
                         f"{tok.vocab_size} ids (sentinels included) make a model vocab of "
                         f"{tok.model_vocab_size}, not its vocab_size {vocab_size}; use the "
                         f"tokenizer the model was trained with")
    return tok

# what a run starts from: its own checkpoint, a run's, Hugging Face weights, or nothing

def start_from(init_from, out_dir, program, config, fixed, preset=None, fsdp=False):
    """What a run starts from, found the same on every rank before any is read: (how, checkpoint).
    'resume': out_dir's newest checkpoint, its weights still on disk (load_resume); 'scratch': None,
    in an out_dir free of other runs' files; a run or Hugging Face weights: those (load). 'auto' is
    resume if out_dir holds a checkpoint, else scratch, also over what this run logged before a
    first checkpoint it never wrote."""
    if init_from.lower() in ("resume", "scratch", "auto") and not init_from.islower():
        raise SystemExit(f"error: --init_from={init_from} names no run or weights here: did you "
                         f"mean --init_from={init_from.lower()}?")
    how = init_from
    if init_from in ("resume", "auto"):
        path = newest_checkpoint(out_dir)
        how = "resume" if path or init_from == "resume" else "scratch"
    if init_from == "auto":
        print0(f"--init_from=auto: {how}")
    if how == "resume":
        if path is None:
            raise SystemExit(f"error: no checkpoint to resume in {out_dir}: train one first")
        return how, load_resume(path, program, config, fixed)
    if not (init_from == "auto" and started_early(out_dir, program, config, fixed)):
        check_new_run(out_dir)
    if how == "scratch":
        return how, None
    print0(f"a new run from the weights of {init_from}")
    return how, load(init_from, fsdp, preset)

def started_early(out_dir, program, config, fixed):
    """whether out_dir's log.jsonl is this run's (its program, keys in `fixed`, data_dir), which
    stopped before its first checkpoint: the log is dropped, with a note, and the run begins again"""
    try:
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            lines = f.readlines()
        first = json.loads(lines[0])
    except (OSError, IndexError, ValueError):
        return False
    keys = (*fixed, "data_dir")
    if first.get("program") != program or any(first["config"].get(k) != config[k] for k in keys):
        return False
    print0(f"{out_dir}/log.jsonl: dropped the {len(lines)} lines of a start stopped before its "
           f"first checkpoint")
    return True

def load(init_from, fsdp=False, preset=None):
    """What a new run (or sample.py, export.py) starts from, as a checkpoint: model_config, meta (a
    run's data, or None), tokenizer and the weights. init_from is a run of train.py or finetune.py
    (its out_dir, ckpt/ or a step folder, or an older run's ckpt.pt) or Hugging Face weights (a
    folder, a Hub name), of the shape of the model preset if one is given. No rank holds the whole
    model: under FSDP a run's shards stay on disk, for each rank to read its own; other weights are
    mapped from their files, not read, until load_weights copies out what the rank keeps."""
    path = newest_checkpoint(init_from, "init_from")
    if path:
        ckpt = load_checkpoint(path, weights=not fsdp)
    else:
        config, weights, tokenizer = read_hf(init_from)
        ckpt = {"model_config": dataclasses.asdict(config), "model": weights, "meta": None,
                "tokenizer": tokenizer}
    theirs = [name for name, shape in PRESETS.items() if shape.items() <= ckpt["model_config"].items()]
    if preset and preset not in theirs:
        fix = f"pass --model={theirs[0]}" if theirs else "add their shape to model.py's PRESETS"
        raise SystemExit(f"error: --model={preset} is not the shape of the weights in {init_from}: "
                         f"{fix}")
    return ckpt

def load_weights(model, ckpt):
    """model, placed, with a checkpoint's weights: from its shards each rank reads its own slices
    (under DDP, all); from a whole state dict, mapped (load), its own, tensor by tensor"""
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
    """(T5Config, state dict in our names, the tokenizer beside them or None: T5's) of a
    gated-GELU T5 (t5-v1_1, flan-t5, t5-lm-adapt, nanoT5) from a Hub id, or a folder of config.json
    and model.safetensors or pytorch_model.bin"""
    folder = name_or_dir if os.path.isdir(name_or_dir) else download(name_or_dir)
    if not os.path.isfile(os.path.join(folder, 'config.json')):
        raise SystemExit(NOTHING_THERE.format(name_or_dir, ""))
    with open(os.path.join(folder, 'config.json')) as f:
        hf = json.load(f)
    tokenizer, name = None, 'spiece.model'
    for file in ('spiece.model', 'tokenizer.tiktoken'):  # a sentencepiece model, a BPE's ranks
        if os.path.isfile(os.path.join(folder, file)):
            with open(os.path.join(folder, file), 'rb') as f:
                tokenizer, name = f.read(), file
    recorded = hf.get('tokenizer_sha256')  # export.py's: the tokenizer the model was trained with
    if recorded and recorded != (tokenizer and hashlib.sha256(tokenizer).hexdigest()):
        raise SystemExit(f"error: {folder}/{name} is not the tokenizer its config.json "
                         f"records (tokenizer_sha256 {recorded[:12]}): copy the model's own "
                         f"tokenizer there")
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
    return config, state_dict, tokenizer

def save_pretrained(model, folder, tokenizer=None):
    """config.json and model.safetensors, which transformers' T5ForConditionalGeneration reads, and
    the tokenizer (its file's bytes; None: T5's), recorded in config.json: a sentencepiece model as
    spiece.model, a BPE's ranks as tokenizer.tiktoken and as transformers' tokenizer.json; each file
    written whole, config.json last: a folder without it is no weights"""
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
    if tokenizer:
        hf['tokenizer_sha256'] = hashlib.sha256(tokenizer).hexdigest()
        bpe = TIKTOKEN_LINE.match(tokenizer)
        name = 'tokenizer.tiktoken' if bpe else 'spiece.model'
        with atomic_write(os.path.join(folder, name)) as f:
            f.write(tokenizer)
        if bpe:
            save_hf_tokenizer(Tokenizer(tokenizer), folder)
    with atomic_write(os.path.join(folder, 'model.safetensors')) as f:
        f.write(save(tensors, metadata={'format': 'pt'}))
    with atomic_write(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(hf, f, indent=2)

def save_hf_tokenizer(tok, folder):
    """A BPE tokenizer as transformers' AutoTokenizer reads it: tokenizer.json, by transformers'
    converter, and tokenizer_config.json; <|endoftext|> and the sentinels special at their ids, EOS
    appended to a text's ids as T5's tokenizer does"""
    from tokenizers.processors import TemplateProcessing
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):  # the ranks from memory: tiktoken caches files by path
        def load_tiktoken_bpe(self, data):
            return read_ranks(data)
    eos = "<|endoftext|>"
    special = [eos] + [f"<extra_id_{i}>" for i in reversed(range(NUM_SENTINELS))]  # in id order
    converted = RanksConverter(tok.data, BPE_PATTERN, extra_special_tokens=special).converted()
    converted.post_processor = TemplateProcessing(single=f"$A {eos}",
                                                  special_tokens=[(eos, tok.eos_id)])
    with atomic_write(os.path.join(folder, 'tokenizer.json'), 'w') as f:
        f.write(converted.to_str())
    config = dict(tokenizer_class='PreTrainedTokenizerFast', eos_token=eos, pad_token=eos)
    with atomic_write(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
        json.dump(config, f, indent=2)

def download(repo_id):
    """a Hub model's folder in the Hugging Face cache: config.json and the weights (safetensors)"""
    if os.path.exists(repo_id) or repo_id.startswith(('.', '/', '~')) or repo_id.count('/') != 1:
        raise SystemExit(NOTHING_THERE.format(repo_id, ""))
    from huggingface_hub import snapshot_download
    try:  # offline, an unknown or a gated repo: in seconds, not after minutes of retries
        for weights in ('*.safetensors', 'pytorch_model*.bin'):  # the older format if no other
            files = ['config.json', 'spiece.model', 'tokenizer.tiktoken', weights]
            folder = snapshot_download(repo_id, allow_patterns=files, etag_timeout=5)
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
