"""
Hugging Face's format: transformers' T5ForConditionalGeneration read and
written (config.json, model.safetensors, the tokenizer), our names mapped
to theirs, and weights fetched from the Hub.
"""
import dataclasses
import glob
import hashlib
import json
import os
import zipfile
from types import SimpleNamespace

import torch

from model import T5, T5Config
from runtime import atomic_write
from tokenizer import BPE_PATTERN, NUM_SENTINELS, Tokenizer, read_ranks

NOTHING_THERE = ("error: {} holds no run or weights{}: pass a run's out_dir "
                 "(or a step folder of its ckpt/), a folder of Hugging Face "
                 "weights, or a Hub name like google/t5-v1_1-base")

# T5Config fields that HF's config.json names otherwise; the rest, alike
HF_CONFIG_NAMES = {'dropout': 'dropout_rate',
                   'layer_norm_eps': 'layer_norm_epsilon'}
# our block's sub-modules -> HF's; the parameters in them have our names
HF_SUBLAYERS = dict(ln_1='layer.0.layer_norm', attn='layer.0.SelfAttention',
                    self_attn='layer.0.SelfAttention',
                    ln_2='layer.1.layer_norm',
                    cross_attn='layer.1.EncDecAttention',
                    ln_3='layer.2.layer_norm')
# copies of shared.weight, and a cross-attention bias table that old
# checkpoints carry and T5 never uses
HF_REDUNDANT = {'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight',
                'decoder.block.0.layer.1.EncDecAttention'
                '.relative_attention_bias.weight'}

def hf_names(model):
    """(our name, HF's) of each tensor: decoder.blocks.3.cross_attn.k.weight
    is decoder.block.3.layer.1.EncDecAttention.k.weight"""
    for name in model.state_dict():
        stack, kind, *rest = name.split('.')
        if kind == 'blocks':  # feed-forward: the encoder's layer 1, decoder's 2
            layer = 1 if stack == 'encoder' else 2
            sub = HF_SUBLAYERS.get(rest[1], f"layer.{layer}.DenseReluDense")
            yield name, '.'.join([stack, 'block', rest[0], sub, *rest[2:]])
        else:  # ln_f, shared, lm_head
            yield name, name.replace('ln_f', 'final_layer_norm')

def read_hf(name_or_dir):
    """(T5Config, state dict in our names, the tokenizer beside them or None:
    T5's) of a gated-GELU T5: a Hub id, or a folder of config.json and
    model.safetensors or .bin"""
    folder = (name_or_dir if os.path.isdir(name_or_dir)
              else download(name_or_dir))
    if not os.path.isfile(os.path.join(folder, 'config.json')):
        raise SystemExit(NOTHING_THERE.format(name_or_dir, ""))
    with open(os.path.join(folder, 'config.json')) as f:
        hf = json.load(f)
    tokenizer, name = None, 'spiece.model'
    for file in ('spiece.model', 'tokenizer.tiktoken'):  # or a BPE's ranks
        if os.path.isfile(os.path.join(folder, file)):
            with open(os.path.join(folder, file), 'rb') as f:
                tokenizer, name = f.read(), file
    recorded = hf.get('tokenizer_sha256')  # export.py's: the model's own
    found = tokenizer and hashlib.sha256(tokenizer).hexdigest()
    if recorded and recorded != found:
        raise SystemExit(f"error: {folder}/{name} is not the tokenizer its "
                         f"config.json records (tokenizer_sha256 "
                         f"{recorded[:12]}): copy the model's own tokenizer "
                         f"there")
    if hf.get('feed_forward_proj', 'relu') != 'gated-gelu':
        raise SystemExit(f"error: {name_or_dir} is not a gated-GELU T5, "
                         f"which model.py implements (t5-v1_1, flan-t5, "
                         f"t5-lm-adapt, nanoT5)")
    state_dict = read_weights_file(folder)
    fields = {f.name: hf.get(HF_CONFIG_NAMES.get(f.name, f.name))
              for f in dataclasses.fields(T5Config)}
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault('num_decoder_layers', fields['num_layers'])
    # transformers 5 says tie_word_embeddings=true even when untied: the
    # weights decide
    shared = state_dict['shared.weight']
    lm_head = state_dict.get('lm_head.weight', shared)
    fields['tie_word_embeddings'] = (lm_head is shared
                                     or torch.equal(lm_head, shared))
    fields.setdefault('scale_decoder_outputs',
                      hf.get('tie_word_embeddings', True))
    config = T5Config(**fields)
    with torch.device("meta"):
        ours = {theirs: name for name, theirs in hf_names(T5(config))}
    state_dict = {ours.get(k, k): v for k, v in state_dict.items()
                  if k not in HF_REDUNDANT}
    state_dict['lm_head.weight'] = lm_head
    return config, state_dict, tokenizer

def save_pretrained(model, folder, tokenizer=None):
    """config.json, model.safetensors and the tokenizer (None: T5's), its
    sha256 in config.json, each written whole, config.json last: a folder
    without it is no weights"""
    from safetensors.torch import save
    c = model.config
    state_dict = model.state_dict()
    tensors = {theirs: state_dict[name].contiguous()
               for name, theirs in hf_names(model)
               # tied, lm_head is shared.weight
               if not (c.tie_word_embeddings and name == 'lm_head.weight')}
    hf = {HF_CONFIG_NAMES.get(k, k): v
          for k, v in dataclasses.asdict(c).items()}
    hf.update(architectures=['T5ForConditionalGeneration'], model_type='t5',
              feed_forward_proj='gated-gelu', is_encoder_decoder=True,
              initializer_factor=1.0,
              scale_decoder_outputs=c.output_scaling != 1.0)
    os.makedirs(folder, exist_ok=True)
    if tokenizer:
        tok = Tokenizer(tokenizer)
        hf['tokenizer_sha256'] = tok.sha256
        name = 'tokenizer.tiktoken' if tok.tiktoken else 'spiece.model'
        with atomic_write(os.path.join(folder, name)) as f:
            f.write(tokenizer)
        save_hf_tokenizer(tok, folder)
    with atomic_write(os.path.join(folder, 'model.safetensors')) as f:
        f.write(save(tensors, metadata={'format': 'pt'}))
    with atomic_write(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(hf, f, indent=2)

def save_hf_tokenizer(tok, folder):
    """tokenizer.json (transformers' converter) and tokenizer_config.json,
    which AutoTokenizer reads without protobuf or tiktoken; EOS appended,
    the sentinels special at their ids"""
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing
    from transformers.convert_slow_tokenizer import (SpmConverter,
                                                     TikTokenConverter)

    class RanksConverter(TikTokenConverter):  # tiktoken caches files by path
        def load_tiktoken_bpe(self, data):
            return read_ranks(data)  # from memory

    class SpiecesConverter(SpmConverter):  # protobuf reads the model
        special_tokens = ()
    sentinels = [f"<extra_id_{i}>" for i in reversed(range(NUM_SENTINELS))]
    if tok.tiktoken:  # EOS is a token of its own, after the ranks
        converted = RanksConverter(tok.data, BPE_PATTERN).converted()
        eos = pad = "<|endoftext|>"
        sentinels.insert(0, eos)
    else:
        spiece = SimpleNamespace(vocab_file=f"{folder}/spiece.model")
        converted = SpiecesConverter(spiece).converted()
        eos, pad = map(tok.sp.id_to_piece, (tok.eos_id, tok.pad_id))
    converted.add_special_tokens([AddedToken(s, normalized=False)
                                  for s in sentinels])
    converted.post_processor = TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, tok.eos_id)])
    with atomic_write(os.path.join(folder, 'tokenizer.json'), 'w') as f:
        f.write(converted.to_str())
    config = dict(tokenizer_class='PreTrainedTokenizerFast', eos_token=eos,
                  pad_token=pad)
    with atomic_write(f"{folder}/tokenizer_config.json", 'w') as f:
        json.dump(config, f, indent=2)

def download(repo_id):
    """a Hub model's folder in the HF cache: config.json and the weights,
    in seconds, not minutes of retries, when offline or unknown"""
    if (os.path.exists(repo_id) or repo_id.startswith(('.', '/', '~'))
            or repo_id.count('/') != 1):
        raise SystemExit(NOTHING_THERE.format(repo_id, ""))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        for weights in ('*.safetensors', 'pytorch_model*.bin'):  # or older
            folder = snapshot_download(
                repo_id, etag_timeout=5, allow_patterns=[
                    'config.json', 'spiece.model', 'tokenizer.tiktoken',
                    weights])
            if glob.glob(os.path.join(folder, weights)):
                break
    except LocalEntryNotFoundError:  # offline, or the Hub out of reach
        raise SystemExit(f"error: {repo_id} holds no run or weights, here or "
                         f"on the Hugging Face Hub, which can't be reached: "
                         f"connect, or pass a folder of its config.json and "
                         f"model.safetensors as --init_from=<folder>") from None
    except Exception as e:
        hub = f", here or on the Hugging Face Hub ({type(e).__name__})"
        raise SystemExit(NOTHING_THERE.format(repo_id, hub)) from None
    return folder

def read_weights_file(folder):
    """every tensor in folder's weights (sharded or not), mapped from its
    file, safetensors preferred: memory holds what is used, when it is"""
    files = (sorted(glob.glob(f'{folder}/*.safetensors'))
             or glob.glob(f'{folder}/pytorch_model*.bin'))
    if not files:
        raise SystemExit(f"error: no model.safetensors or pytorch_model.bin "
                         f"in {folder}")
    if files[0].endswith('.safetensors'):
        from safetensors.torch import load_file  # which maps them
        shards = map(load_file, files)
    else:  # an old file, not a zip, is read whole
        shards = [torch.load(f, map_location='cpu', weights_only=True,
                             mmap=zipfile.is_zipfile(f)) for f in files]
    return {k: v for shard in shards for k, v in shard.items()}
