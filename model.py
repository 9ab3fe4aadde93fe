"""A T5 v1.1 encoder-decoder, numerically Hugging Face's
T5ForConditionalGeneration: after the T5 paper (arxiv.org/abs/1910.10683),
t5x, transformers' modeling_t5.py and gpt-fast (the static KV cache)."""

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclasses.dataclass
class T5Config:
    vocab_size: int = 32128  # 32100 pieces, padded to a multiple of 128
    d_model: int = 512
    d_kv: int = 64  # head size; num_heads * d_kv need not be d_model
    d_ff: int = 1024
    num_layers: int = 8
    num_decoder_layers: int = 8
    num_heads: int = 6
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False  # lm_head is shared: T5, not v1.1
    scale_decoder_outputs: bool | None = None  # by d_model**-0.5; None: tied
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    @property
    def output_scaling(self):
        scaled = self.scale_decoder_outputs
        if scaled is None:
            scaled = self.tie_word_embeddings
        return self.d_model ** -0.5 if scaled else 1.0

    @classmethod
    def from_preset(cls, name, **overrides):
        return cls(**(PRESETS[name] | overrides))

# t5x's shapes; t5-mini and t5-tiny train on a laptop CPU
PRESETS = {
    't5-mini': dict(d_model=128, d_ff=384, num_heads=4, d_kv=32, num_layers=3),
    't5-tiny': dict(d_model=256, d_ff=768, num_heads=4, d_kv=64, num_layers=4),
    't5-v1_1-small': dict(d_model=512, d_ff=1024, num_heads=6, d_kv=64, num_layers=8),
    't5-v1_1-base': dict(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_layers=12),
    't5-v1_1-large': dict(d_model=1024, d_ff=2816, num_heads=16, d_kv=64, num_layers=24),
    't5-v1_1-xl': dict(d_model=2048, d_ff=5120, num_heads=32, d_kv=64, num_layers=24),
    't5-v1_1-xxl': dict(d_model=4096, d_ff=10240, num_heads=64, d_kv=64, num_layers=24),
}
for _shape in PRESETS.values():  # v1.1's decoder is as deep as its encoder
    _shape['num_decoder_layers'] = _shape['num_layers']

def relative_position_bucket(relative_position, bidirectional,
                             num_buckets, max_distance):
    """T5's positions: key - query -> a bucket, whose learned bias per head
    is added to the score. Half the buckets are exact distances, half
    log-wider ranges up to max_distance; farther keys share the last. The
    encoder gives keys on the right half the buckets; the decoder sees only
    the left. With num_buckets 32 and max_distance 128:
        key - query  -200 -128 -64 -32 -16  -8  -7  -1   0   1   7   8  16  32  64 128
        encoder        15   15  14  12  10   8   7   1   0  17  23  24  26  28  30  31
        decoder        31   31  26  21  16   8   7   1   0   0   0   0   0   0   0   0"""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # clamp keeps log() finite where torch.where drops it
    log_distance = torch.log(distance.clamp(min=1).float() / max_exact)
    log_ratio = log_distance / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)

class KVCache(nn.Module):
    """self-attention's k, v so far, in buffers of a fixed shape"""
    def __init__(self, shape, dtype, device):  # (B, nh, max_len, hs)
        super().__init__()
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        self.register_buffer('k_cache', k, persistent=False)
        self.register_buffer('v_cache', v, persistent=False)

    def update(self, pos, k, v):  # k, v (B, nh, T, hs) go to pos (T,)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return self.k_cache, self.v_cache

class Attention(nn.Module):
    """Unlike GPT, no 1/sqrt(d_kv) scaling: T5 folds it into q's init.
    q, k, v stay separate: the optimizers scale each one's update by its
    RMS, and q starts 8x smaller."""
    def __init__(self, config, has_relative_attention_bias=False,
                 bidirectional=True):
        super().__init__()
        self.d_kv = config.d_kv
        self.bidirectional = bidirectional
        self.dropout = config.dropout
        inner = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.kv_cache = None  # a KVCache in generate()
        if has_relative_attention_bias:
            self.num_buckets = config.relative_attention_num_buckets
            self.max_distance = config.relative_attention_max_distance
            self.relative_attention_bias = nn.Embedding(
                self.num_buckets, config.num_heads)

    def position_bias(self, query_positions, key_positions):
        relative_position = key_positions[None, :] - query_positions[:, None]
        buckets = relative_position_bucket(
            relative_position, self.bidirectional, self.num_buckets, self.max_distance)
        bias = self.relative_attention_bias(buckets)  # (Tq, Tk, nh)
        return bias.permute(2, 0, 1)[None].contiguous()  # (1, nh, Tq, Tk)

    def split_heads(self, t):  # (B, T, nh * hs) -> (B, nh, T, hs)
        return t.unflatten(2, (-1, self.d_kv)).transpose(1, 2)

    def kv(self, x):  # (B, T, d_model) -> k, v (B, nh, T, hs)
        return self.split_heads(self.k(x)), self.split_heads(self.v(x))

    def forward(self, x, mask, kv=None, pos=None):
        """x (B, T, d_model); mask: the position bias, -large where masked.
        Self-attention over x; cross-attention over kv, the encoder output's
        k, v; or, decoding, self-attention at pos over kv_cache."""
        q = self.split_heads(self.q(x))
        k, v = self.kv(x) if kv is None else kv
        if pos is not None:  # decoding: this step's k, v join the cache
            k, v = self.kv_cache.update(pos, k, v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0,
            dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).flatten(2)  # (B, nh, T, hs) -> (B, T, nh * hs)
        return self.o(y)

class GatedGELU(nn.Module):
    """v1.1's gated feed-forward: gelu(x @ wi_0) * (x @ wi_1) @ wo, tanh GELU"""
    def __init__(self, config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = F.gelu(self.wi_0(x), approximate='tanh') * self.wi_1(x)
        return self.wo(self.dropout(h))

def rms_norm(config):  # T5's layer norm: no mean, no bias, on the fp32 stream
    return nn.RMSNorm(config.d_model, config.layer_norm_eps)

class EncoderBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias):
        super().__init__()
        self.ln_1 = rms_norm(config)
        self.attn = Attention(config, has_relative_attention_bias)
        self.ln_2 = rms_norm(config)
        self.ff = GatedGELU(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, mask):
        x = x + self.dropout(self.attn(self.ln_1(x), mask))
        return x + self.dropout(self.ff(self.ln_2(x)))

class DecoderBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias):
        super().__init__()
        self.ln_1 = rms_norm(config)
        self.self_attn = Attention(
            config, has_relative_attention_bias, bidirectional=False)
        self.ln_2 = rms_norm(config)
        self.cross_attn = Attention(config)
        self.ln_3 = rms_norm(config)
        self.ff = GatedGELU(config)
        self.dropout = nn.Dropout(config.dropout)

    def encoder_kv(self, encoder_out):
        """cross-attention's k, v (B, nh, S, hs): once per generate()"""
        k, v = self.cross_attn.kv(encoder_out)
        if encoder_out.device.type == "cpu":  # reads strided k, v slower
            k, v = k.contiguous(), v.contiguous()
        return k, v

    def forward(self, x, self_mask, cross_mask, encoder_out, pos=None):
        """encoder_out: the encoder's output, or (decoding) its encoder_kv()"""
        x = x + self.dropout(self.self_attn(self.ln_1(x), self_mask, pos=pos))
        kv = self.cross_attn.kv(encoder_out) if pos is None else encoder_out
        x = x + self.dropout(self.cross_attn(self.ln_2(x), cross_mask, kv=kv))
        return x + self.dropout(self.ff(self.ln_3(x)))

def padding_mask(attention_mask, dtype):
    """(B, S), 0 at padding -> additive (B, 1, 1, S), dtype's min there
    (-inf gives NaN)"""
    if attention_mask is not None:
        padded = attention_mask[:, None, None, :] == 0
        return padded.to(dtype) * torch.finfo(dtype).min

class Stack(nn.Module):
    """all blocks share the first's position bias"""
    def __init__(self, config, block, num_layers):
        super().__init__()
        self.blocks = nn.ModuleList(
            [block(config, i == 0) for i in range(num_layers)])
        self.ln_f = rms_norm(config)
        self.dropout = nn.Dropout(config.dropout)

class Encoder(Stack):
    def forward(self, x, attention_mask, dtype):  # x (B, S, d_model)
        positions = torch.arange(x.size(1), device=x.device)
        mask = self.blocks[0].attn.position_bias(positions, positions)
        mask = mask.to(dtype)  # (1, nh, S, S)
        if attention_mask is not None:
            mask = mask + padding_mask(attention_mask, dtype)  # (B, nh, S, S)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, mask)
        return self.dropout(self.ln_f(x))

class Decoder(Stack):
    def encoder_kv(self, encoder_out):  # every layer's, for generate()
        return [block.encoder_kv(encoder_out) for block in self.blocks]

    def forward(self, x, encoder_out, cross_mask, dtype, pos=None):
        """x (B, T, d_model). Decoding: pos, x's positions (T,) in kv_cache;
        encoder_out, each layer's encoder_kv."""
        attn = self.blocks[0].self_attn
        if pos is None:  # each position sees itself and earlier ones
            T = x.size(1)
            query_positions = key_positions = torch.arange(T, device=x.device)
        else:  # decoding: unwritten cache slots are future too
            query_positions = pos
            cached = attn.kv_cache.k_cache.size(2)
            key_positions = torch.arange(cached, device=x.device)
        bias = attn.position_bias(query_positions, key_positions).to(dtype)
        future = key_positions[None, :] > query_positions[:, None]
        mask = bias.masked_fill(future, torch.finfo(dtype).min)  # (1, nh, T, Tk)
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            enc = encoder_out if pos is None else encoder_out[i]
            x = block(x, mask, cross_mask, enc, pos)
        return self.dropout(self.ln_f(x))

class T5(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # the weights' own seed, drawn first from torch's: FSDP draws them
        # again from it (distributed.py), on any device
        self.init_seed = int(torch.randint(2**62, (), device="cpu"))
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Encoder(config, EncoderBlock, config.num_layers)
        self.decoder = Decoder(config, DecoderBlock, config.num_decoder_layers)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight
        if not self.shared.weight.is_meta:  # meta: shapes, for FSDP to shard
            self.init_weights()

    def blocks(self):
        return [*self.encoder.blocks, *self.decoder.blocks]

    def init_weights(self):
        """each tensor in turn from one generator of init_seed (a tied
        lm_head gets shared's N(0, 1))"""
        device = self.shared.weight.device
        generator = torch.Generator(device).manual_seed(self.init_seed)
        for name, p in self.named_parameters():
            self.init_parameter(name, p, generator)

    @torch.no_grad()
    def init_parameter(self, name, p, generator):
        """Mesh-TensorFlow's init: matrices N(0, 1/fan_in), q's
        N(0, 1/(fan_in * d_kv)) as attention skips 1/sqrt(d_kv); shared
        N(0, 1); an untied lm_head t5x's d_model**-0.5, not HF's 1.0
        (loss > 100 at start)."""
        c = self.config
        if p.dim() == 1:  # RMSNorm
            return nn.init.ones_(p)
        if name == 'shared.weight':
            std = 1.0
        elif name.endswith('relative_attention_bias.weight'):
            std = c.d_model ** -0.5
        else:  # a matrix (out, in), lm_head included
            std = (p.size(1) * (c.d_kv if name.endswith('.q.weight') else 1)) ** -0.5
        nn.init.normal_(p, std=std, generator=generator)

    def num_params(self):  # a tied lm_head counts once
        return sum(p.numel() for p in self.parameters())

    def compute_dtype(self, device):
        # the masks are built once in it, as SDPA's fused kernels want q's
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.shared.weight.dtype

    def forward(self, input_ids, decoder_input_ids=None, labels=None,
                attention_mask=None):
        """-> (logits (B, T, vocab), mean cross-entropy or None). The decoder
        reads the labels shifted right (teacher forcing): position t sees
        the labels before t and predicts label t:
            labels             <extra_id_0>  for           inviting  </s>
            decoder_input_ids  <pad>         <extra_id_0>  for       inviting"""
        if decoder_input_ids is None:
            decoder_input_ids = self.shift_right(labels)
        dtype = self.compute_dtype(input_ids.device)
        x = self.shared(input_ids)
        encoder_out = self.encoder(x, attention_mask, dtype)
        cross_mask = padding_mask(attention_mask, dtype)
        x = self.shared(decoder_input_ids)
        x = self.decoder(x, encoder_out, cross_mask, dtype)
        logits = self.lm_head(x * self.config.output_scaling)
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               ignore_index=-100)
        return logits, loss

    def shift_right(self, labels):
        """start token, then all labels but the last; -100 -> pad"""
        start = self.config.decoder_start_token_id
        shifted = F.pad(labels[..., :-1], (1, 0), value=start)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def decode_step(self, token, pos, encoder_kv, cross_mask):
        """logits (B, vocab) after token (B, 1) at pos (1,)"""
        dtype = self.compute_dtype(token.device)
        x = self.decoder(self.shared(token), encoder_kv, cross_mask, dtype, pos)
        return self.lm_head(x[:, -1] * self.config.output_scaling).float()

    # not inference_mode, where autocast re-casts weights every step
    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=128):
        """Greedy: up to max_new_tokens ids per row, no start token, pad
        after EOS; it stops when every row has its EOS"""
        c = self.config
        B = input_ids.size(0)
        device = input_ids.device
        dtype = self.compute_dtype(device)
        ids = dict(dtype=torch.long, device=device)
        out = torch.full((B, max_new_tokens), c.pad_token_id, **ids)
        x = self.shared(input_ids)
        encoder_out = self.encoder(x, attention_mask, dtype)
        encoder_kv = self.decoder.encoder_kv(encoder_out)
        cross_mask = padding_mask(attention_mask, dtype)
        cache_shape = (B, c.num_heads, max_new_tokens, c.d_kv)
        for block in self.decoder.blocks:
            block.self_attn.kv_cache = KVCache(cache_shape, dtype, device)
        token = torch.full((B, 1), c.decoder_start_token_id, **ids)
        finished = torch.zeros_like(token, dtype=torch.bool)
        pos = torch.zeros(1, **ids)  # where the cache writes this step's k, v
        for i in range(max_new_tokens):
            logits = self.decode_step(token, pos, encoder_kv, cross_mask)
            token = logits.argmax(-1, keepdim=True)
            token.masked_fill_(finished, c.pad_token_id)
            out[:, i] = token[:, 0]
            finished |= token == c.eos_token_id
            if finished.all():
                break
            pos += 1
        for block in self.decoder.blocks:  # free the caches
            block.self_attn.kv_cache = None
        return out[:, :pos.item() + 1]  # to the step where all rows finished
