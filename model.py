"""A T5 v1.1 encoder-decoder in one file, numerically the same model as Hugging Face's T5ForConditionalGeneration.
References: the T5 paper (arxiv.org/abs/1910.10683); t5x for v1.1's shapes, position buckets and init; transformers'
modeling_t5.py, whose checkpoints this reads and writes; gpt-fast's static KV cache and compiled decode step."""

import dataclasses
import glob
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

class UserError(Exception):
    """Bad input from the user: the message is one line saying what is wrong and how to fix it."""

@dataclasses.dataclass
class T5Config:
    vocab_size: int = 32128  # 32100 sentencepiece pieces, padded to a multiple of 128
    d_model: int = 512
    d_kv: int = 64  # size of one attention head; num_heads * d_kv need not equal d_model
    d_ff: int = 1024
    num_layers: int = 8  # encoder layers
    num_decoder_layers: int = 8
    num_heads: int = 6
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False  # v1.1 unties the output head; the original T5 tied it
    scale_decoder_outputs: bool | None = None  # multiply by d_model**-0.5 before lm_head; None: same as tied
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    @property
    def output_scaling(self):
        scale = self.tie_word_embeddings if self.scale_decoder_outputs is None else self.scale_decoder_outputs
        return self.d_model ** -0.5 if scale else 1.0

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise UserError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

# shapes from the t5x gin files; 't5-mini' and 't5-tiny' are small enough to train on a laptop CPU
PRESETS = {
    't5-mini': dict(d_model=128, d_ff=384, num_heads=4, d_kv=32, num_layers=3, num_decoder_layers=3),
    't5-tiny': dict(d_model=256, d_ff=768, num_heads=4, d_kv=64, num_layers=4, num_decoder_layers=4),
    't5-v1_1-small': dict(d_model=512, d_ff=1024, num_heads=6, d_kv=64, num_layers=8, num_decoder_layers=8),
    't5-v1_1-base': dict(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_layers=12, num_decoder_layers=12),
    't5-v1_1-large': dict(d_model=1024, d_ff=2816, num_heads=16, d_kv=64, num_layers=24, num_decoder_layers=24),
    't5-v1_1-xl': dict(d_model=2048, d_ff=5120, num_heads=32, d_kv=64, num_layers=24, num_decoder_layers=24),
    't5-v1_1-xxl': dict(d_model=4096, d_ff=10240, num_heads=64, d_kv=64, num_layers=24, num_decoder_layers=24),
}

def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """key_position - query_position -> bucket id: half the buckets are exact offsets, half logarithmically wider up
    to max_distance (farther keys share the last). The encoder spends half on keys to the right; the decoder's don't."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # clamp(min=1) only keeps log() finite for the small distances that torch.where discards anyway
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)

class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no mean subtraction, no bias, variance in fp32 even under autocast."""
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

class KVCache(nn.Module):
    """Self-attention k, v of the tokens decoded so far, in buffers sized up front: every step has the same shapes."""
    def __init__(self, shape, dtype, device):  # shape: (B, nh, max_len, hs)
        super().__init__()
        self.register_buffer('k_cache', torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer('v_cache', torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos, k, v):  # k, v (B, nh, T, hs) go to positions pos (T,); returns (B, nh, max_len, hs) each
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return self.k_cache, self.v_cache

class Attention(nn.Module):
    """Multi-head attention without the 1/sqrt(d_kv) scaling, which T5 folds into q's init. q, k, v stay separate
    parameters: the optimizers scale each tensor's update by its RMS, and q starts 8x smaller than k and v."""
    def __init__(self, config, has_relative_attention_bias=False, bidirectional=True):
        super().__init__()
        self.d_kv, self.bidirectional, self.dropout = config.d_kv, bidirectional, config.dropout
        d, inner = config.d_model, config.num_heads * config.d_kv
        self.q, self.k, self.v = [nn.Linear(d, inner, bias=False) for _ in range(3)]
        self.o = nn.Linear(inner, d, bias=False)
        self.kv_cache = None  # a KVCache while generate() decodes
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
            self.buckets = (config.relative_attention_num_buckets, config.relative_attention_max_distance)

    def position_bias(self, query_positions, key_positions):  # (1, nh, Tq, Tk), contiguous for the attention kernel
        buckets = relative_position_bucket(key_positions[None, :] - query_positions[:, None], self.bidirectional,
                                           *self.buckets)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0).contiguous()

    def forward(self, x, mask, kv=None, pos=None):
        """mask: position bias, -large where not allowed, (B, nh, T, Tk) or broadcastable. kv: the encoder's (k, v),
        for cross-attention. pos: decoding, x's positions (T,) in kv_cache."""
        B, T, _ = x.shape
        if kv is not None:
            q, (k, v) = self.q(x).view(B, T, -1, self.d_kv).transpose(1, 2), kv  # (B, nh, T, hs)
        else:
            if pos is None:  # one GEMM over the concatenated weights is faster than three
                q, k, v = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight])).chunk(3, dim=-1)
            else:  # a decoding step's few rows: concatenating the weights would cost more than it saves
                q, k, v = self.q(x), self.k(x), self.v(x)
            q, k, v = [t.view(B, T, -1, self.d_kv).transpose(1, 2) for t in (q, k, v)]  # (B, nh, T, hs)
            if pos is not None:
                k, v = self.kv_cache.update(pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, nh*hs) -> (B, T, d_model)

class GatedGELU(nn.Module):
    """v1.1's feed-forward: gelu(x @ wi_0) * (x @ wi_1) @ wo, with the tanh approximation of GELU."""
    def __init__(self, config):
        super().__init__()
        self.wi_0, self.wi_1 = [nn.Linear(config.d_model, config.d_ff, bias=False) for _ in range(2)]
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.wo(self.dropout(F.gelu(self.wi_0(x), approximate='tanh') * self.wi_1(x)))

class EncoderBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias):
        super().__init__()
        self.ln_1 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.attn = Attention(config, has_relative_attention_bias)
        self.ln_2 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.ff = GatedGELU(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, mask):
        x = x + self.dropout(self.attn(self.ln_1(x), mask))
        return x + self.dropout(self.ff(self.ln_2(x)))

class DecoderBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias):
        super().__init__()
        self.ln_1 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.self_attn = Attention(config, has_relative_attention_bias, bidirectional=False)
        self.ln_2 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.cross_attn = Attention(config)
        self.ln_3 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.ff = GatedGELU(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, self_mask, cross_mask, encoder_kv, pos=None):
        x = x + self.dropout(self.self_attn(self.ln_1(x), self_mask, pos=pos))
        x = x + self.dropout(self.cross_attn(self.ln_2(x), cross_mask, kv=encoder_kv))
        return x + self.dropout(self.ff(self.ln_3(x)))

def padding_mask(attention_mask, dtype):
    """(B, S), 0 at padding -> additive (B, 1, 1, S): the dtype's minimum there (not -inf: no NaN rows)."""
    if attention_mask is not None:
        padded = attention_mask[:, None, None, :] == 0
        return torch.zeros(padded.shape, dtype=dtype, device=padded.device).masked_fill(padded, torch.finfo(dtype).min)

class Stack(nn.Module):
    """The encoder or the decoder; only the first block owns a position bias table, which every block then uses."""
    def __init__(self, config, block, num_layers):
        super().__init__()
        self.blocks = nn.ModuleList([block(config, i == 0) for i in range(num_layers)])
        self.ln_f = RMSNorm(config.d_model, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

class Encoder(Stack):
    def forward(self, x, attention_mask, dtype):  # x: the token embeddings (B, S, d_model)
        positions = torch.arange(x.size(1), device=x.device)
        mask = self.blocks[0].attn.position_bias(positions, positions).to(dtype)  # (1, nh, S, S)
        if attention_mask is not None:
            mask = mask + padding_mask(attention_mask, dtype)  # (B, nh, S, S)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, mask)
        return self.dropout(self.ln_f(x))

class Decoder(Stack):
    def encoder_kv(self, encoder_out):
        """Every layer's cross-attention (k, v), (B, nh, S, hs) each, in one matmul over all layers' weights."""
        B, S, _ = encoder_out.shape
        weight = torch.cat([w for b in self.blocks for w in (b.cross_attn.k.weight, b.cross_attn.v.weight)])
        kv = F.linear(encoder_out, weight).view(B, S, 2 * len(self.blocks), -1, self.blocks[0].cross_attn.d_kv)
        kv = kv.permute(2, 0, 3, 1, 4)  # (B, S, 2L, nh, hs) -> (2L, B, nh, S, hs)
        kv = kv.contiguous() if kv.device.type == 'cpu' else kv  # the CPU kernel reads strided k, v slower
        return list(zip(kv[0::2], kv[1::2]))

    def forward(self, x, encoder_kv, cross_mask, decoder_attention_mask, dtype, pos=None):
        """x: token embeddings (B, T, d_model). pos: decoding, x's positions (T,), the keys all of kv_cache."""
        key_positions = torch.arange(x.size(1) if pos is None else self.blocks[0].self_attn.kv_cache.k_cache.size(2),
                                     device=x.device)
        query_positions = key_positions if pos is None else pos
        bias = self.blocks[0].self_attn.position_bias(query_positions, key_positions).to(dtype)  # (1, nh, T, Tk)
        mask = bias.masked_fill(key_positions[None, :] > query_positions[:, None], torch.finfo(dtype).min)  # future
        if decoder_attention_mask is not None:
            mask = mask.masked_fill(decoder_attention_mask[:, None, None, :] == 0, torch.finfo(dtype).min)
        x = self.dropout(x)
        for block, kv in zip(self.blocks, encoder_kv):
            x = block(x, mask, cross_mask, kv, pos)
        return self.dropout(self.ln_f(x))

def check_ids(name, ids, like=None):
    """Shape and dtype only: checking id < vocab would cost a GPU sync every step."""
    if ids is not None and (not torch.is_tensor(ids) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2):
        what = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if torch.is_tensor(ids) else type(ids).__name__
        raise UserError(f"{name} must be a 2-D int64 tensor (batch, length), got a {what}")
    if ids is not None and like is not None and ids.shape != like.shape:
        raise UserError(f"{name} has shape {tuple(ids.shape)} but its ids have shape {tuple(like.shape)}")

class T5(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Encoder(config, EncoderBlock, config.num_layers)
        self.decoder = Decoder(config, DecoderBlock, config.num_decoder_layers)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Mesh-TensorFlow's init: matrices N(0, 1/fan_in), q also taking the 1/sqrt(d_kv) attention leaves out;
        embeddings N(0, 1); an untied lm_head t5x's d_model**-0.5, not HF's 1.0 (which starts at a loss > 100)."""
        c = self.config
        for name, p in self.named_parameters():  # a tied lm_head is shared.weight, initialised once as that
            if p.dim() == 1:  # RMSNorm
                nn.init.ones_(p)
            elif name == 'shared.weight' or name.endswith('relative_attention_bias.weight'):  # embeddings
                nn.init.normal_(p, std=1.0 if name == 'shared.weight' else c.d_model ** -0.5)
            else:  # a matrix (out, in), lm_head included
                nn.init.normal_(p, std=(p.size(1) * (c.d_kv if name.endswith('.q.weight') else 1)) ** -0.5)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied lm_head only once

    def compute_dtype(self, device):  # the activations' dtype: autocast's inside autocast, else the weights'
        kind = device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.shared.weight.dtype

    def forward(self, input_ids, decoder_input_ids=None, labels=None, attention_mask=None, decoder_attention_mask=None):
        for name, ids, like in (('input_ids', input_ids, None), ('attention_mask', attention_mask, input_ids),
                                ('labels', labels, None), ('decoder_input_ids', decoder_input_ids, None)):
            check_ids(name, ids, like)
        c = self.config
        if decoder_input_ids is None:  # teacher forcing: the start token, then the labels without their last one
            if labels is None:
                raise UserError("T5.forward needs decoder_input_ids or labels (to shift right into decoder inputs)")
            shifted = torch.cat([labels.new_full((labels.size(0), 1), c.decoder_start_token_id), labels[:, :-1]], 1)
            decoder_input_ids = shifted.masked_fill(shifted == -100, c.pad_token_id)
        check_ids('decoder_attention_mask', decoder_attention_mask, like=decoder_input_ids)
        if decoder_input_ids.size(0) != input_ids.size(0):
            raise UserError(f"input_ids hold {input_ids.size(0)} rows, the decoder's ids {decoder_input_ids.size(0)}")
        dtype = self.compute_dtype(input_ids.device)
        # one lookup for both stacks: the backward builds one dense (vocab, d_model) gradient, not two
        S, T = input_ids.size(1), decoder_input_ids.size(1)
        encoder_in, decoder_in = self.shared(torch.cat([input_ids, decoder_input_ids], dim=1)).split([S, T], dim=1)
        encoder_kv = self.decoder.encoder_kv(self.encoder(encoder_in, attention_mask, dtype))
        x = self.decoder(decoder_in, encoder_kv, padding_mask(attention_mask, dtype), decoder_attention_mask, dtype)
        logits = self.lm_head(x * c.output_scaling)
        if labels is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)

    def decode_step(self, token, pos, encoder_kv, cross_mask):
        """The logits (B, vocab) after token (B, 1) at position pos (1,), the kv_caches holding the ones before."""
        x = self.decoder(self.shared(token), encoder_kv, cross_mask, None, self.compute_dtype(token.device), pos)
        return self.lm_head(x[:, -1] * self.config.output_scaling).float()

    @torch.no_grad()  # not inference_mode, under which autocast re-casts every weight at every step
    def generate(self, input_ids, attention_mask=None, max_new_tokens=128, temperature=0.0, top_k=None, compile=False):
        """Up to max_new_tokens ids per row, no start token, pad after EOS: greedy at temperature 0, else sampled from
        the top_k likeliest. The encoder and cross-attention k/v run once; compile=True compiles decode_step."""
        check_ids('input_ids', input_ids)
        check_ids('attention_mask', attention_mask, like=input_ids)
        c, B, device, dtype = self.config, input_ids.size(0), input_ids.device, self.compute_dtype(input_ids.device)
        out = torch.full((B, max_new_tokens), c.pad_token_id, dtype=torch.long, device=device)
        step = torch.compile(self.decode_step, fullgraph=True) if compile else self.decode_step
        encoder_kv = self.decoder.encoder_kv(self.encoder(self.shared(input_ids), attention_mask, dtype))
        cross_mask = padding_mask(attention_mask, dtype)
        for block in self.decoder.blocks:
            block.self_attn.kv_cache = KVCache((B, c.num_heads, max_new_tokens, c.d_kv), dtype, device)
        token = torch.full((B, 1), c.decoder_start_token_id, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)  # a tensor, not an int: one compiled graph for all
        for i in range(max_new_tokens):
            logits = step(token, pos, encoder_kv, cross_mask)
            if temperature == 0.0:
                token = logits.argmax(-1, keepdim=True)
            else:
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -float('inf'))
                token = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1)
            out[:, i] = token.masked_fill_(finished[:, None], c.pad_token_id)[:, 0]
            finished |= token[:, 0] == c.eos_token_id
            if finished.all():
                break
            pos += 1
        for block in self.decoder.blocks:  # the caches only hold this call's tokens: free them
            block.self_attn.kv_cache = None
        return out[:, :pos.item() + 1]  # all steps, or up to the one where every row was finished

    # ---- Hugging Face checkpoints ----
    @classmethod
    def from_pretrained(cls, name_or_dir, **overrides):
        """A gated-GELU T5 (t5-v1_1, flan-t5, t5-lm-adapt, nanoT5) from a Hub id or a folder with config.json and
        model.safetensors (or pytorch_model.bin); overrides are T5Config fields."""
        folder = name_or_dir if os.path.isdir(name_or_dir) else _download(name_or_dir)
        with open(os.path.join(folder, 'config.json')) as f:
            hf = json.load(f)
        if hf.get('feed_forward_proj', 'relu') != 'gated-gelu':
            raise UserError(f"unsupported model {name_or_dir}: feed_forward_proj is {hf.get('feed_forward_proj')!r}, "
                            f"model.py implements gated-gelu T5s (t5-v1_1, flan-t5, t5-lm-adapt, nanoT5)")
        state_dict = _read_weights(folder)
        fields = {f.name: hf[_HF_CONFIG_NAMES.get(f.name, f.name)] for f in dataclasses.fields(T5Config)
                  if hf.get(_HF_CONFIG_NAMES.get(f.name, f.name)) is not None}
        fields.setdefault('num_decoder_layers', fields['num_layers'])
        # transformers 5.x says tie_word_embeddings=true even when untied: the weights decide tying
        shared, lm_head = state_dict['shared.weight'], state_dict.get('lm_head.weight', state_dict['shared.weight'])
        fields['tie_word_embeddings'] = lm_head is shared or torch.equal(lm_head, shared)
        fields.setdefault('scale_decoder_outputs', hf.get('tie_word_embeddings', True))
        model = cls(T5Config(**{**fields, **overrides}))
        ours = {hf_name: name for name, hf_name in _hf_names(model)}
        state_dict = {ours.get(k, k): v for k, v in state_dict.items() if k not in _HF_REDUNDANT}
        state_dict['lm_head.weight'] = lm_head
        return model.load_weights(state_dict, f"weights in {folder} do not match its config.json")

    @classmethod
    def from_checkpoint(cls, ckpt, **overrides):
        """The model in a checkpoint of train.py or finetune.py (a dict from load_checkpoint)."""
        model = cls(T5Config(**{**ckpt['model_config'], **overrides}))
        return model.load_weights(ckpt['model'], "the checkpoint's weights do not match its model config")

    def load_weights(self, state_dict, problem):
        try:
            self.load_state_dict(state_dict)
        except RuntimeError as e:  # name the first mismatch in one line, not torch's page of them
            raise UserError(f"{problem}: {str(e).splitlines()[1].strip()}") from None
        return self

    def save_pretrained(self, folder):
        """config.json and model.safetensors that transformers' T5ForConditionalGeneration loads as this model."""
        from safetensors.torch import save
        c, state_dict = self.config, self.state_dict()
        tensors = {hf_name: state_dict[name].contiguous() for name, hf_name in _hf_names(self)
                   if not (c.tie_word_embeddings and name == 'lm_head.weight')}  # tied: the same tensor as shared
        hf = {_HF_CONFIG_NAMES.get(k, k): v for k, v in dataclasses.asdict(c).items()}
        hf.update(architectures=['T5ForConditionalGeneration'], model_type='t5', feed_forward_proj='gated-gelu',
                  dense_act_fn='gelu_new', is_gated_act=True, is_encoder_decoder=True, initializer_factor=1.0,
                  use_cache=True, scale_decoder_outputs=c.output_scaling != 1.0)
        os.makedirs(folder, exist_ok=True)
        for name, data in (('model.safetensors', save(tensors, metadata={'format': 'pt'})),
                           ('config.json', json.dumps(hf, indent=2).encode())):
            path = os.path.join(folder, name)
            with open(path + '.tmp', 'wb') as f:  # then renamed: a crash never leaves half a file
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + '.tmp', path)

# T5Config fields that Hugging Face's config.json names differently; all others have the same name
_HF_CONFIG_NAMES = {'dropout': 'dropout_rate', 'layer_norm_eps': 'layer_norm_epsilon'}
# our block sub-modules -> Hugging Face's; the parameters inside them have the same names
_HF_SUBLAYERS = dict(ln_1='layer.0.layer_norm', attn='layer.0.SelfAttention', self_attn='layer.0.SelfAttention',
                     ln_2='layer.1.layer_norm', cross_attn='layer.1.EncDecAttention', ln_3='layer.2.layer_norm')
# copies of shared.weight, and a cross-attention bias table that old checkpoints carry but T5 never uses
_HF_REDUNDANT = {'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight',
                 'decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight'}

def _hf_names(model):  # e.g. decoder.blocks.3.cross_attn.k.weight -> decoder.block.3.layer.1.EncDecAttention.k.weight
    for name in model.state_dict():
        stack, kind, *rest = name.split('.')
        if kind == 'blocks':  # the feed-forward is the encoder's second layer, the decoder's third
            sub = _HF_SUBLAYERS.get(rest[1]) or f"layer.{1 if stack == 'encoder' else 2}.DenseReluDense"
            yield name, '.'.join([stack, 'block', rest[0], sub, *rest[2:]])
        else:  # ln_f, shared, lm_head
            yield name, name.replace('ln_f', 'final_layer_norm')

def _download(repo_id):
    if os.path.exists(repo_id) or repo_id.startswith(('.', '/', '~')) or repo_id.count('/') != 1:
        raise UserError(f"{repo_id} is not a folder with a Hugging Face checkpoint, nor a Hub id like t5-v1_1-small")
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(repo_id, allow_patterns=['config.json', '*.safetensors'], etag_timeout=5)
        if not glob.glob(os.path.join(folder, '*.safetensors')):
            folder = snapshot_download(repo_id, allow_patterns=['config.json', 'pytorch_model*.bin'], etag_timeout=5)
    except Exception as e:  # offline, unknown or gated repo, no huggingface_hub
        raise UserError(f"could not get {repo_id} from the Hugging Face Hub ({type(e).__name__}); pass a local "
                        f"folder with config.json and model.safetensors (or pytorch_model.bin) instead")
    return folder

def _read_weights(folder):  # all tensors of the checkpoint in folder (sharded or not), safetensors preferred
    files = sorted(glob.glob(f'{folder}/*.safetensors')) or sorted(glob.glob(f'{folder}/pytorch_model*.bin'))
    if not files:
        raise UserError(f"no model.safetensors or pytorch_model.bin in {folder}; save one with save_pretrained")
    try:
        if files[0].endswith('.safetensors'):
            from safetensors.torch import load_file
            return {k: v for f in files for k, v in load_file(f).items()}
        return {k: v for f in files for k, v in torch.load(f, map_location='cpu', weights_only=True).items()}
    except Exception as e:
        raise UserError(f"could not read the weights in {folder} ({type(e).__name__}: {str(e).splitlines()[0][:100]}); "
                        f"the file is corrupt or truncated, download or save it again")
