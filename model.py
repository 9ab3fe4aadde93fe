"""
A T5 v1.1 encoder-decoder in one file, numerically the same model as Hugging Face's T5ForConditionalGeneration.
References:
1) the T5 paper: https://arxiv.org/abs/1910.10683
2) t5x / mesh-tensorflow, which define the v1.1 shapes, the relative position buckets and the initialisation
3) huggingface/transformers modeling_t5.py, whose checkpoints this file loads and writes
4) gpt-fast, whose static KV cache and compiled one-token decoding step generate() follows
"""

import dataclasses
import difflib
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
            close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.0)
            raise UserError(f"unknown model preset {name!r}; did you mean {close[0]!r}? "
                            f"(choices: {', '.join(PRESETS)})")
        return cls(**{**PRESETS[name], **overrides})


# shapes from the t5x gin files; 't5-tiny' is small enough to train on a laptop CPU
PRESETS = {
    't5-tiny': dict(d_model=256, d_ff=768, num_heads=4, d_kv=64, num_layers=4, num_decoder_layers=4),
    't5-v1_1-small': dict(d_model=512, d_ff=1024, num_heads=6, d_kv=64, num_layers=8, num_decoder_layers=8),
    't5-v1_1-base': dict(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_layers=12, num_decoder_layers=12),
    't5-v1_1-large': dict(d_model=1024, d_ff=2816, num_heads=16, d_kv=64, num_layers=24, num_decoder_layers=24),
    't5-v1_1-xl': dict(d_model=2048, d_ff=5120, num_heads=32, d_kv=64, num_layers=24, num_decoder_layers=24),
    't5-v1_1-xxl': dict(d_model=4096, d_ff=10240, num_heads=64, d_kv=64, num_layers=24, num_decoder_layers=24),
}


def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Map key_position - query_position to a bucket id: half the buckets are exact offsets, the other half are
    logarithmically wider up to max_distance, beyond which everything shares the last bucket. Bidirectional
    (encoder) attention spends half the buckets on keys to the right; causal (decoder) attention only looks left."""
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
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class KVCache(nn.Module):
    """Self-attention keys and values of the tokens decoded so far, in buffers sized for the whole generation up
    front, so that every decoding step has the same shapes (and a compiled step never recompiles)."""

    def __init__(self, batch_size, num_heads, max_len, d_kv, dtype, device):
        super().__init__()
        shape = (batch_size, num_heads, max_len, d_kv)
        self.register_buffer('k_cache', torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer('v_cache', torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos, k, v):
        """Write k, v (B, nh, T, hs) at positions pos (T,); return the whole buffers (B, nh, max_len, hs)."""
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    """Multi-head attention without the 1/sqrt(d_kv) scaling: T5 folds it into the init of q instead.
    q, k, v stay separate parameters, as in T5 and Hugging Face's checkpoints, because AdamWScale and Adafactor
    scale each update by the RMS of its own tensor (and Adafactor factors and clips per tensor): q starts 8x smaller
    than k and v, and inside one fused tensor its updates would be scaled by theirs. Self-attention still projects
    q, k, v in one matmul over the concatenated weights: one larger GEMM is faster than three small ones."""

    def __init__(self, config, has_relative_attention_bias=False, bidirectional=True):
        super().__init__()
        self.d_kv, self.bidirectional, self.dropout = config.d_kv, bidirectional, config.dropout
        inner = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.kv_cache = None  # a KVCache while generate() decodes
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
            self.num_buckets = config.relative_attention_num_buckets
            self.max_distance = config.relative_attention_max_distance

    def position_bias(self, query_positions, key_positions):
        """The learned bias for every (query, key) pair, (1, nh, Tq, Tk), in fp32. Only the first layer of a
        stack owns the table; the stack computes this once per forward and every layer adds the same bias.
        Contiguous, because the attention kernel would otherwise copy the strided mask at every layer."""
        buckets = relative_position_bucket(key_positions[None, :] - query_positions[:, None], self.bidirectional,
                                           self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0).contiguous()

    def split_heads(self, x):
        B, T, _ = x.shape
        return x.view(B, T, -1, self.d_kv).transpose(1, 2)  # (B, nh, T, hs)

    def forward(self, x, mask, kv=None, pos=None):
        """mask: float, position bias plus -large where attention is not allowed, broadcastable to (B, nh, T, Tk).
        kv: the encoder's (k, v), for cross-attention. pos: the positions (T,) of x's tokens while decoding with
        the kv_cache; their k, v are written there and x attends over the whole cache (masked beyond pos)."""
        B, T, _ = x.shape
        if kv is not None:
            q, (k, v) = self.split_heads(self.q(x)), kv
        else:
            qkv = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]))  # (B, T, 3*nh*hs)
            q, k, v = [self.split_heads(t) for t in qkv.chunk(3, dim=-1)]
            if pos is not None:
                k, v = self.kv_cache.update(pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, nh*hs) -> (B, T, d_model)


class GatedGELU(nn.Module):
    """v1.1's feed-forward: gelu(x @ wi_0) * (x @ wi_1) @ wo, with the tanh approximation of GELU."""

    def __init__(self, config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = F.gelu(self.wi_0(x), approximate='tanh') * self.wi_1(x)
        return self.wo(self.dropout(h))


class EncoderBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias):
        super().__init__()
        self.ln_1 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.attn = Attention(config, has_relative_attention_bias=has_relative_attention_bias)
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
        self.self_attn = Attention(config, has_relative_attention_bias=has_relative_attention_bias,
                                   bidirectional=False)
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
    """(B, S) with 1 for real tokens -> additive (B, 1, 1, S): 0 where allowed, the dtype's minimum where padded.
    The minimum rather than -inf keeps a row with nothing to attend to finite, as in Hugging Face's T5."""
    if attention_mask is None:
        return None
    padded = attention_mask[:, None, None, :] == 0
    return torch.zeros(padded.shape, dtype=dtype, device=padded.device).masked_fill(padded, torch.finfo(dtype).min)


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList([EncoderBlock(config, i == 0) for i in range(config.num_layers)])
        self.ln_f = RMSNorm(config.d_model, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, attention_mask, dtype):
        """x: the token embeddings (B, S, d_model); attention_mask: (B, S) with 0 at padding, or None."""
        positions = torch.arange(x.size(1), device=x.device)
        mask = self.blocks[0].attn.position_bias(positions, positions).to(dtype)  # (1, nh, S, S)
        if attention_mask is not None:
            mask = mask + padding_mask(attention_mask, dtype)  # (B, nh, S, S)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, mask)
        return self.dropout(self.ln_f(x))


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList([DecoderBlock(config, i == 0) for i in range(config.num_decoder_layers)])
        self.ln_f = RMSNorm(config.d_model, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.d_kv = config.d_kv

    def encoder_kv(self, encoder_out):
        """Every layer's cross-attention (k, v) from the encoder output (B, S, d_model), each (B, nh, S, hs),
        projected in one matmul over all layers' concatenated k and v weights."""
        B, S, _ = encoder_out.shape
        weight = torch.cat([w for b in self.blocks for w in (b.cross_attn.k.weight, b.cross_attn.v.weight)])
        kv = F.linear(encoder_out, weight).view(B, S, 2 * len(self.blocks), -1, self.d_kv)  # (B, S, 2L, nh, hs)
        kv = kv.permute(2, 0, 3, 1, 4)  # (2L, B, nh, S, hs)
        return list(zip(kv[0::2], kv[1::2]))

    def forward(self, x, encoder_kv, cross_mask, decoder_attention_mask, dtype, pos=None):
        """x: the token embeddings (B, T, d_model); encoder_kv: encoder_kv()'s list. pos: None for a whole target
        sequence, or while generate() decodes, the positions (T,) of x's tokens in the layers' kv_cache."""
        if pos is None:
            query_positions = key_positions = torch.arange(x.size(1), device=x.device)
        else:  # the keys are the whole cache, its unwritten tail masked as future
            query_positions = pos
            key_positions = torch.arange(self.blocks[0].self_attn.kv_cache.k_cache.size(2), device=x.device)
        bias = self.blocks[0].self_attn.position_bias(query_positions, key_positions).to(dtype)  # (1, nh, T, Tk)
        mask = bias.masked_fill(key_positions[None, :] > query_positions[:, None], torch.finfo(dtype).min)
        if decoder_attention_mask is not None:
            mask = mask.masked_fill(decoder_attention_mask[:, None, None, :] == 0, torch.finfo(dtype).min)
        x = self.dropout(x)
        for block, kv in zip(self.blocks, encoder_kv):
            x = block(x, mask, cross_mask, kv, pos)
        return self.dropout(self.ln_f(x))


def check_ids(name, ids, like=None):
    """Shape and dtype only, no values: checking id < vocab would cost a GPU sync every step."""
    if not torch.is_tensor(ids) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2:
        what = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if torch.is_tensor(ids) else type(ids).__name__
        raise UserError(f"{name} must be a 2-D int64 tensor (batch, length), got a {what}")
    if like is not None and ids.shape != like.shape:
        raise UserError(f"{name} has shape {tuple(ids.shape)} but its ids have shape {tuple(like.shape)}")


class T5(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Mesh-TensorFlow's initialisation, which the v1.1 checkpoints were trained from: every matrix is normal
        with std 1/sqrt(fan_in), except embeddings (std 1) and q, whose std also absorbs the 1/sqrt(d_kv) that the
        attention leaves out. The untied lm_head gets d_model**-0.5 as in t5x, not Hugging Face's 1.0: with 1.0 the
        first loss is above 100 instead of about ln(vocab) (nanoT5 issue #25), and the huge logits underflow into
        denormal floats in the backward pass, which makes CPU training 3-6x slower."""
        c = self.config
        d, inner = c.d_model, c.num_heads * c.d_kv
        nn.init.normal_(self.shared.weight, std=1.0)
        if not c.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=d ** -0.5)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Attention):
                nn.init.normal_(module.q.weight, std=(d * c.d_kv) ** -0.5)
                for linear, fan_in in ((module.k, d), (module.v, d), (module.o, inner)):
                    nn.init.normal_(linear.weight, std=fan_in ** -0.5)
                if hasattr(module, 'relative_attention_bias'):
                    nn.init.normal_(module.relative_attention_bias.weight, std=d ** -0.5)
            elif isinstance(module, GatedGELU):
                for linear, fan_in in ((module.wi_0, d), (module.wi_1, d), (module.wo, c.d_ff)):
                    nn.init.normal_(linear.weight, std=fan_in ** -0.5)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied lm_head only once

    def flops_per_step(self, batch_size, input_length, target_length):
        """Training FLOPs (forward + backward) of one step over batch_size examples, for MFU: 6 per weight per
        token (2 forward, 4 backward), each weight over the tokens it sees (the encoder's and the cross-attention
        k/v over S input tokens, the rest of the decoder and lm_head over T targets; the embedding is a lookup),
        plus 12 * nh * d_kv * Tq * Tk per attention layer for the scores and weighted sums, forward and backward
        (causal masking is not discounted)."""
        c = self.config
        S, T, inner = input_length, target_length, c.num_heads * c.d_kv
        n_enc = sum(p.numel() for p in self.encoder.parameters())
        n_cross_kv = sum(2 * b.cross_attn.k.weight.numel() for b in self.decoder.blocks)
        n_dec = sum(p.numel() for p in self.decoder.parameters()) - n_cross_kv
        flops = 6 * (n_enc * S + n_dec * T + n_cross_kv * S + c.d_model * c.vocab_size * T)
        flops += 12 * inner * (c.num_layers * S * S + c.num_decoder_layers * (T * T + T * S))
        return batch_size * flops

    def compute_dtype(self, device):
        """The dtype activations will have: the autocast dtype inside autocast, else the weights' dtype."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.shared.weight.dtype

    def shift_right(self, labels):
        """Decoder input for teacher forcing: the start token, then the labels without their last token."""
        start = labels.new_full((labels.size(0), 1), self.config.decoder_start_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def forward(self, input_ids, decoder_input_ids=None, labels=None, attention_mask=None,
                decoder_attention_mask=None):
        check_ids('input_ids', input_ids)
        if attention_mask is not None:
            check_ids('attention_mask', attention_mask, like=input_ids)
        if decoder_input_ids is None:
            if labels is None:
                raise UserError("T5.forward needs decoder_input_ids or labels (to shift right into decoder inputs)")
            check_ids('labels', labels)
            decoder_input_ids = self.shift_right(labels)
        check_ids('decoder_input_ids', decoder_input_ids)
        if decoder_attention_mask is not None:
            check_ids('decoder_attention_mask', decoder_attention_mask, like=decoder_input_ids)
        if decoder_input_ids.size(0) != input_ids.size(0):
            raise UserError(f"input_ids hold {input_ids.size(0)} rows, the decoder's ids {decoder_input_ids.size(0)}")
        dtype = self.compute_dtype(input_ids.device)
        # one lookup for both stacks: the backward then builds one dense (vocab, d_model) gradient, not two to add
        S, T = input_ids.size(1), decoder_input_ids.size(1)
        encoder_in, decoder_in = self.shared(torch.cat([input_ids, decoder_input_ids], dim=1)).split([S, T], dim=1)
        encoder_kv = self.decoder.encoder_kv(self.encoder(encoder_in, attention_mask, dtype))
        x = self.decoder(decoder_in, encoder_kv, padding_mask(attention_mask, dtype), decoder_attention_mask, dtype)
        logits = self.lm_head(x * self.config.output_scaling)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss

    def decode_step(self, token, pos, encoder_kv, cross_mask):
        """One step of generate(): the logits (B, vocab) that follow token (B, 1) at position pos (1,), with the
        decoder's kv_caches holding the tokens before it."""
        x = self.decoder(self.shared(token), encoder_kv, cross_mask, None, self.compute_dtype(token.device), pos)
        return self.lm_head(x[:, -1] * self.config.output_scaling).float()

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=128, temperature=0.0, top_k=None,
                 compile=False):
        """Decode up to max_new_tokens per row: greedy at temperature 0, else sampling (from the top_k most likely
        tokens when top_k is set). Returns (B, <= max_new_tokens) ids without the start token, pad after EOS.
        The encoder runs once, every layer's cross-attention k/v are projected once, and self-attention k/v go
        into a KVCache per layer, so every step has the same shapes. compile=True runs decode_step through
        torch.compile (compiled once per model and batch shape; the first call pays the compilation)."""
        check_ids('input_ids', input_ids)
        if attention_mask is not None:
            check_ids('attention_mask', attention_mask, like=input_ids)
        c, B, device = self.config, input_ids.size(0), input_ids.device
        dtype = self.compute_dtype(device)
        # made outside inference_mode, so that autograd accepts the ids afterwards (as labels to train on, say)
        out = torch.full((B, max_new_tokens), c.pad_token_id, dtype=torch.long, device=device)
        step = torch.compile(self.decode_step, fullgraph=True) if compile else self.decode_step
        # inference_mode: no_grad without the version counters and view tracking, less bookkeeping per step
        with torch.inference_mode():
            encoder_out = self.encoder(self.shared(input_ids), attention_mask, dtype)
            # contiguous: the attention kernel reads strided k, v 1.3x (fp32) to 2.3x (bf16) slower
            encoder_kv = [(k.contiguous(), v.contiguous()) for k, v in self.decoder.encoder_kv(encoder_out)]
            cross_mask = padding_mask(attention_mask, dtype)
            for block in self.decoder.blocks:
                block.self_attn.kv_cache = KVCache(B, c.num_heads, max_new_tokens, c.d_kv, dtype, device)
            token = torch.full((B, 1), c.decoder_start_token_id, dtype=torch.long, device=device)
            pos = torch.zeros(1, dtype=torch.long, device=device)
            finished = torch.zeros(B, dtype=torch.bool, device=device)
            try:
                for i in range(max_new_tokens):
                    logits = step(token, pos, encoder_kv, cross_mask)
                    if temperature == 0.0:
                        token = logits.argmax(dim=-1, keepdim=True)
                    else:
                        logits = logits / temperature
                        if top_k is not None:
                            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                            logits = logits.masked_fill(logits < kth, -float('inf'))
                        token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
                    token = token.masked_fill(finished[:, None], c.pad_token_id)
                    out[:, i] = token[:, 0]
                    finished |= token[:, 0] == c.eos_token_id
                    if finished.all():
                        return out[:, :i + 1]
                    pos += 1
            finally:  # the caches are only valid for this call: free them
                for block in self.decoder.blocks:
                    block.self_attn.kv_cache = None
        return out

    # ---- Hugging Face checkpoints ----

    @classmethod
    def from_pretrained(cls, name_or_dir, **overrides):
        """Load a gated-GELU T5 (t5-v1_1-*, flan-t5-*, t5-*-lm-adapt, nanoT5) from a local folder holding
        config.json and model.safetensors (or pytorch_model.bin), or from a Hugging Face Hub id.
        overrides are T5Config fields applied on top of config.json, e.g. dropout=0.1 for fine-tuning."""
        folder = name_or_dir if os.path.isdir(name_or_dir) else _download(name_or_dir)
        with open(os.path.join(folder, 'config.json')) as f:
            hf = json.load(f)
        activation = hf.get('feed_forward_proj', 'relu')
        if activation != 'gated-gelu':
            raise UserError(f"unsupported model {name_or_dir}: feed_forward_proj is {activation!r}, model.py "
                            f"implements gated-gelu T5s (t5-v1_1, flan-t5, t5-lm-adapt, nanoT5)")
        state_dict = _read_weights(folder)
        shared = state_dict['shared.weight']
        fields = {f.name: hf[_HF_CONFIG_NAMES.get(f.name, f.name)] for f in dataclasses.fields(T5Config)
                  if hf.get(_HF_CONFIG_NAMES.get(f.name, f.name)) is not None}
        fields.setdefault('num_decoder_layers', fields['num_layers'])
        # transformers 5.x writes tie_word_embeddings=true even for untied models, so the weights decide tying,
        # and the output scaling comes from scale_decoder_outputs, or from the config's tie_word_embeddings without it
        lm_head = state_dict.get('lm_head.weight', shared)
        fields['tie_word_embeddings'] = lm_head is shared or torch.equal(lm_head, shared)
        fields.setdefault('scale_decoder_outputs', hf.get('tie_word_embeddings', True))
        model = cls(T5Config(**{**fields, **overrides}))
        ours = {hf_name: name for name, hf_name in _hf_names(model)}
        state_dict = {ours.get(k, k): v for k, v in state_dict.items() if k not in _HF_REDUNDANT}
        state_dict['lm_head.weight'] = lm_head
        return model.load_weights(state_dict, f"weights in {folder} do not match its config.json")

    @classmethod
    def from_checkpoint(cls, ckpt, **overrides):
        """The model in a train.py or finetune.py checkpoint (a dict from load_checkpoint), e.g. dropout=0.1."""
        model = cls(T5Config(**{**ckpt['model_config'], **overrides}))
        return model.load_weights(ckpt['model'], "the checkpoint's weights do not match its model config")

    def load_weights(self, state_dict, problem):
        try:
            self.load_state_dict(state_dict)
        except RuntimeError as e:  # name the first mismatch in one line, not torch's page of them
            raise UserError(f"{problem}: {str(e).splitlines()[1].strip()}") from None
        return self

    def save_pretrained(self, folder):
        """Write config.json and model.safetensors in Hugging Face's layout, so that
        transformers.T5ForConditionalGeneration.from_pretrained(folder) gives the same model."""
        from safetensors.torch import save
        c = self.config
        os.makedirs(folder, exist_ok=True)
        state_dict = self.state_dict()
        tensors = {hf_name: state_dict[name].contiguous() for name, hf_name in _hf_names(self)
                   if not (c.tie_word_embeddings and name == 'lm_head.weight')}  # tied: the same tensor as shared
        hf = {_HF_CONFIG_NAMES.get(k, k): v for k, v in dataclasses.asdict(c).items()}
        hf.update(architectures=['T5ForConditionalGeneration'], model_type='t5', feed_forward_proj='gated-gelu',
                  dense_act_fn='gelu_new', is_gated_act=True, is_encoder_decoder=True, initializer_factor=1.0,
                  use_cache=True, scale_decoder_outputs=c.output_scaling != 1.0)
        # each file goes to a temporary name first and is renamed once on disk: a crash mid-write leaves the
        # previous file intact, never a truncated one under the final name
        for name, data in (('model.safetensors', save(tensors, metadata={'format': 'pt'})),
                           ('config.json', json.dumps(hf, indent=2).encode())):
            path = os.path.join(folder, name)
            with open(path + '.tmp', 'wb') as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + '.tmp', path)


# T5Config fields that Hugging Face's config.json names differently; all others have the same name
_HF_CONFIG_NAMES = {'dropout': 'dropout_rate', 'layer_norm_eps': 'layer_norm_epsilon'}
# our block sub-modules -> Hugging Face's, per stack; parameters inside them (q, k, v, o, wi_0...) have the same names
_HF_SUBLAYERS = {
    'encoder': dict(ln_1='layer.0.layer_norm', attn='layer.0.SelfAttention', ln_2='layer.1.layer_norm',
                    ff='layer.1.DenseReluDense'),
    'decoder': dict(ln_1='layer.0.layer_norm', self_attn='layer.0.SelfAttention', ln_2='layer.1.layer_norm',
                    cross_attn='layer.1.EncDecAttention', ln_3='layer.2.layer_norm', ff='layer.2.DenseReluDense'),
}
# copies of shared.weight, and a cross-attention bias table that old checkpoints carry but T5 never uses
_HF_REDUNDANT = {'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight',
                 'decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight'}


def _hf_names(model):
    """(our name, Hugging Face's name) for every tensor in the state dict, e.g.
    decoder.blocks.3.cross_attn.k.weight -> decoder.block.3.layer.1.EncDecAttention.k.weight."""
    for name in model.state_dict():
        stack, kind, *rest = name.split('.')
        if kind == 'ln_f':
            yield name, f'{stack}.final_layer_norm.weight'
        elif kind == 'blocks':
            i, sub, param = rest[0], rest[1], '.'.join(rest[2:])
            yield name, f'{stack}.block.{i}.{_HF_SUBLAYERS[stack][sub]}.{param}'
        else:
            yield name, name  # shared.weight, lm_head.weight


def _download(repo_id):
    """Fetch config.json and the weights of a Hub model into the local cache; one-line error when that fails."""
    if os.path.exists(repo_id) or repo_id.startswith(('.', '/', '~')) or repo_id.count('/') != 1:
        raise UserError(f"{repo_id} is not a folder with a Hugging Face checkpoint, nor a Hub id like "
                        f"google/t5-v1_1-small")
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(repo_id, allow_patterns=['config.json', '*.safetensors'], etag_timeout=5)
        if not glob.glob(os.path.join(folder, '*.safetensors')):
            folder = snapshot_download(repo_id, allow_patterns=['config.json', 'pytorch_model*.bin'], etag_timeout=5)
    except Exception as e:  # offline, unknown repo, gated repo, no huggingface_hub: all end the same way
        raise UserError(f"could not get {repo_id} from the Hugging Face Hub ({type(e).__name__}); pass a local "
                        f"folder with config.json and model.safetensors (or pytorch_model.bin) instead")
    return folder


def _read_weights(folder):
    """All tensors of the checkpoint in folder (sharded or not), safetensors preferred."""
    files = sorted(glob.glob(os.path.join(folder, '*.safetensors')))
    try:
        if files:
            from safetensors.torch import load_file
            return {k: v for f in files for k, v in load_file(f).items()}
        files = sorted(glob.glob(os.path.join(folder, 'pytorch_model*.bin')))
        if not files:
            raise UserError(f"no model.safetensors or pytorch_model.bin in {folder}; save one with save_pretrained")
        return {k: v for f in files for k, v in torch.load(f, map_location='cpu', weights_only=True).items()}
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"could not read the weights in {folder} ({type(e).__name__}: {str(e).splitlines()[0][:100]}); "
                        f"the file is corrupt or truncated, download or save it again")
