"""Tests for model.py: parity with Hugging Face's T5 both ways, generation, buckets, presets, init.
Run: python -m pytest -q test_model.py (CPU, no network)."""

import json
import math
import os

import pytest
import torch
import torch.nn as nn
import transformers

from checkpoint import load, model_from_checkpoint
from model import PRESETS, T5, KVCache, T5Config, relative_position_bucket
from runtime import checkpoint_activations
from hf import hf_names, save_pretrained

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

def from_pretrained(name_or_dir, **overrides):  # transformers' from_pretrained, here
    return model_from_checkpoint(load(name_or_dir), **overrides)


# small, but with everything that can go wrong: encoder/decoder depths differ, heads * d_kv != d_model,
# and the tests use sequences longer than relative_attention_max_distance so the log buckets are exercised
SMALL = dict(vocab_size=300, d_model=48, d_kv=20, d_ff=80, num_layers=3, num_decoder_layers=2, num_heads=3)


def hf_config(tie_word_embeddings=False):
    return transformers.T5Config(
        vocab_size=300, d_model=48, d_kv=20, d_ff=80, num_layers=3, num_decoder_layers=2, num_heads=3,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=tie_word_embeddings,
        decoder_start_token_id=0)


def hf_model(tie_word_embeddings=False):
    torch.manual_seed(1)
    hf = transformers.T5ForConditionalGeneration(hf_config(tie_word_embeddings))
    if not tie_word_embeddings:
        # transformers 5.x ties lm_head to shared when building from a config: untie it by hand
        hf.lm_head.weight = nn.Parameter(torch.randn(300, 48) * 48 ** -0.5)
    with torch.no_grad():  # HF's init leaves some tables at zero; random values make the comparison stricter
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return hf.eval()


def padded_batch(seed=0, B=3, S=150, T=140):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, 300, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, 100:] = 0
    attention_mask[2, 7:] = 0
    input_ids[attention_mask == 0] = 0
    labels = torch.randint(2, 300, (B, T), generator=g)
    labels[1, 90:] = -100
    return input_ids, attention_mask, labels


def assert_same_outputs(ours, hf):
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        logits, loss = ours(input_ids, labels=labels, attention_mask=attention_mask)
        ref = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert logits.shape == ref.logits.shape
    assert (logits - ref.logits).abs().max().item() <= 1e-4
    assert abs(loss.item() - ref.loss.item()) <= 1e-5


# ---- relative position buckets ----

def test_bucket_spot_checks():
    rel = torch.arange(-200, 201, 50)
    assert relative_position_bucket(rel, True, 32, 128).tolist() == [15, 15, 15, 13, 0, 29, 31, 31, 31]
    rel = torch.tensor([5, 0, -1, -15, -16, -20, -127, -128, -1000])
    assert relative_position_bucket(rel, False, 32, 128).tolist() == [0, 0, 1, 15, 16, 17, 31, 31, 31]


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_match_hf(bidirectional):
    rel = torch.arange(-400, 400)
    ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(rel, bidirectional, 32, 128)
    assert torch.equal(relative_position_bucket(rel, bidirectional, 32, 128), ref)


# ---- parity with transformers ----

@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_ours(tmp_path, tied):
    hf = hf_model(tied)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(str(tmp_path)).eval()
    assert ours.config.tie_word_embeddings == tied
    assert (ours.lm_head.weight is ours.shared.weight) == tied
    assert_same_outputs(ours, hf)


def test_hf_4x_style_config_untied(tmp_path):
    # transformers 4.x configs say tie_word_embeddings=false and have no scale_decoder_outputs
    hf = hf_model(False)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("scale_decoder_outputs", None)
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = from_pretrained(str(tmp_path)).eval()
    assert ours.config.output_scaling == 1.0
    assert_same_outputs(ours, hf)


def test_gradients_match_hf(tmp_path):
    # the backward too: a training step must move every weight as transformers' T5 would
    hf = hf_model(False).train()
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(str(tmp_path)).train()
    input_ids, attention_mask, labels = padded_batch()
    ours(input_ids, labels=labels, attention_mask=attention_mask)[1].backward()
    hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    for name, hf_name in hf_names(ours):
        grad, ref = dict(ours.named_parameters())[name].grad, hf_grads[hf_name]
        assert (grad - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item()), name


@pytest.mark.parametrize("tied", [False, True])
def test_ours_to_hf(tmp_path, tied):
    torch.manual_seed(2)
    ours = T5(T5Config(**SMALL, tie_word_embeddings=tied)).eval()
    save_pretrained(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] == tied
    hf, info = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_outputs(ours, hf.eval())


def test_from_pretrained_dropout_and_overrides(tmp_path):
    save_pretrained(T5(T5Config(**SMALL)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dropout_rate"] = 0.1  # what the v1.1 checkpoints say
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert from_pretrained(str(tmp_path)).config.dropout == 0.1
    overridden = from_pretrained(str(tmp_path), dropout=0.0, eos_token_id=5).config
    assert (overridden.dropout, overridden.eos_token_id, overridden.d_kv) == (0.0, 5, 20)


def test_attention_projections_are_separate_parameters():
    # AdamWScale scales updates by the RMS of each tensor: fusing q with k and v would change training
    model = T5(T5Config(**SMALL))
    names = {name for name, _ in model.named_parameters()}
    for attn in ["encoder.blocks.0.attn", "decoder.blocks.1.self_attn", "decoder.blocks.1.cross_attn"]:
        assert {f"{attn}.{p}.weight" for p in "qkvo"} <= names
    assert not any("qkv" in name or ".kv." in name for name in names)
    inner = SMALL["num_heads"] * SMALL["d_kv"]
    assert all(p.shape[0] <= max(inner, SMALL["d_ff"], SMALL["vocab_size"]) for p in model.parameters())
    attn = model.encoder.blocks[1].attn  # T5's init: q absorbs the 1/sqrt(d_kv) that attention leaves out
    assert abs(attn.q.weight.std().item() - (48 * 20) ** -0.5) < 0.004
    assert abs(attn.k.weight.std().item() - 48 ** -0.5) < 0.02
    assert abs(attn.v.weight.std().item() - 48 ** -0.5) < 0.02


# ---- generation ----

def test_greedy_generate_matches_hf(tmp_path):
    torch.manual_seed(26)  # weights whose rows end at different steps
    ours = T5(T5Config(**SMALL)).eval()
    prompts, attention_mask, _ = padded_batch(seed=4, B=4, S=30)
    attention_mask[3, 12:] = 0
    prompts[attention_mask == 0] = 0
    # a random model rarely says EOS: make EOS a token that row 0 greedily emits early, so rows stop at
    # different steps and the padding after EOS is exercised
    ours.config.eos_token_id = ours.generate(prompts, attention_mask, max_new_tokens=8)[0, 4].item()
    save_pretrained(ours, tmp_path)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    for rows in ([0, 1, 2, 3], [1], [2, 3]):
        got = ours.generate(prompts[rows], attention_mask[rows], max_new_tokens=40)
        ref = hf.generate(input_ids=prompts[rows], attention_mask=attention_mask[rows], max_new_tokens=40,
                          do_sample=False, num_beams=1)
        assert torch.equal(got, ref[:, 1:]), rows  # HF's output starts with the decoder start token
    got = ours.generate(prompts[:1], attention_mask[:1], max_new_tokens=40)
    assert got[0, -1].item() == ours.config.eos_token_id and got.size(1) == 5  # stops when every row is done


def test_cached_generate_equals_recompute():
    torch.manual_seed(5)
    ours = T5(T5Config(**SMALL)).eval()
    prompts, attention_mask, _ = padded_batch(seed=6, B=3, S=25)
    got = ours.generate(prompts, attention_mask, max_new_tokens=20)
    assert not got.is_inference()  # autograd accepts the ids, e.g. as labels to train on
    assert all(block.self_attn.kv_cache is None for block in ours.decoder.blocks)  # the caches are freed
    decoder_input_ids = torch.zeros(3, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(20):
            logits, _ = ours(prompts, decoder_input_ids, attention_mask=attention_mask)
            decoder_input_ids = torch.cat([decoder_input_ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, decoder_input_ids[:, 1:])


# ---- presets, parameter count, init, training ----

def test_base_param_count():
    with torch.device("meta"):
        model = T5(T5Config.from_preset("t5-v1_1-base"))
    assert model.num_params() == 247_577_856


def test_presets():
    assert set(PRESETS) >= {"t5-v1_1-small", "t5-v1_1-base", "t5-v1_1-large", "t5-v1_1-xl", "t5-v1_1-xxl", "t5-tiny"}
    small = T5Config.from_preset("t5-v1_1-small", vocab_size=1000)
    assert (small.d_model, small.d_ff, small.num_heads * small.d_kv, small.vocab_size) == (512, 1024, 384, 1000)


def test_fresh_base_init_loss_near_ln_vocab():
    torch.manual_seed(8)
    model = T5(T5Config.from_preset("t5-v1_1-base"))
    input_ids, labels = torch.randint(2, 32128, (1, 16)), torch.randint(2, 32128, (1, 8))
    with torch.no_grad():
        _, loss = model(input_ids, labels=labels)
    assert abs(loss.item() - math.log(32128)) < 1.0


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(9)
    model = T5(T5Config.from_preset("t5-tiny", vocab_size=512))
    input_ids, labels = torch.randint(2, 512, (4, 32)), torch.randint(2, 512, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        _, loss = model(input_ids, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


def test_bf16_autocast_close_to_fp32():
    torch.manual_seed(10)
    model = T5(T5Config(**SMALL)).eval()
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        _, loss = model(input_ids, labels=labels, attention_mask=attention_mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss_bf16 = model(input_ids, labels=labels, attention_mask=attention_mask)
            generated = model.generate(input_ids[:, :20], attention_mask[:, :20], max_new_tokens=5)
    assert loss_bf16.dtype == torch.float32 and abs(loss_bf16.item() - loss.item()) < 0.05
    assert generated.shape == (3, 5)


# ---- Hugging Face folders that are not ours to read ----

def test_unsupported_activation(tmp_path):
    hf_config().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["feed_forward_proj"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="is not a gated-GELU T5"):
        from_pretrained(str(tmp_path))


def test_hub_id_fails_fast_offline(monkeypatch):
    import time
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.time()
    with pytest.raises(SystemExit, match="no-such-model holds no run or weights, here or on the Hugging Face Hub"):
        from_pretrained("nanot5-test/no-such-model")
    assert time.time() - start < 10
    with pytest.raises(SystemExit, match="holds no run or weights"):
        from_pretrained("./no/such/folder")


def test_a_folder_without_weights(tmp_path):
    save_pretrained(T5(T5Config(**SMALL)), tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(SystemExit, match="no model.safetensors"):
        from_pretrained(str(tmp_path))


def test_cross_attention_kv_are_copied_contiguous_on_cpu_only():
    # the CPU attention kernel reads strided k, v slower, so they are copied there; elsewhere ('meta' standing in for
    # a GPU, whose kernels take strided k, v) they stay views of the one projection, saving two copies a layer
    model = T5(T5Config(**SMALL))
    encoder_out = torch.randn(2, 7, 48)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in model.decoder.encoder_kv(encoder_out))
    kv = model.to("meta").decoder.encoder_kv(encoder_out.to("meta"))
    assert not any(k.is_contiguous() or v.is_contiguous() for k, v in kv)


def test_activation_checkpointing_keeps_only_each_blocks_input():
    """With activation checkpointing an encoder layer leaves backward only its input, the fp32 residual stream: 4
    bytes per value, 4 * B * S * d_model, where without it each layer keeps its q, k, v, norms and feed-forward"""
    def saved_bytes(num_layers, checkpointing):
        torch.manual_seed(0)
        model = T5(T5Config(**{**SMALL, "num_layers": num_layers}))
        if checkpointing:
            checkpoint_activations(model)
        storages = {}

        def pack(t):
            if not (t.requires_grad and t.is_leaf):  # an activation, not a weight
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        input_ids, labels = torch.randint(2, 100, (2, 12)), torch.randint(2, 100, (2, 5))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, loss = model(input_ids, labels=labels)
        loss.backward()  # and the gradients are still there: backward runs the blocks again
        return sum(storages.values()), model.shared.weight.grad
    layer_plain = saved_bytes(3, False)[0] - saved_bytes(2, False)[0]
    layer_checkpointed = saved_bytes(3, True)[0] - saved_bytes(2, True)[0]
    assert layer_checkpointed == 4 * 2 * 12 * SMALL["d_model"]
    assert layer_plain > 10 * layer_checkpointed
    torch.testing.assert_close(saved_bytes(3, True)[1], saved_bytes(3, False)[1])


def test_no_graph_breaks_in_the_training_step_and_the_decode_step():
    """torch.compile sees the model's forward (with the loss) and generate's decode step each as one graph: nothing
    falls back to Python between kernels"""
    import torch._dynamo
    torch.manual_seed(0)
    t5 = T5(T5Config(**SMALL))
    input_ids, labels = torch.randint(2, 100, (2, 10)), torch.randint(2, 100, (2, 5))
    assert torch._dynamo.explain(t5)(input_ids, labels=labels).graph_break_count == 0
    with torch.no_grad():
        encoder_kv = t5.decoder.encoder_kv(t5.encoder(t5.shared(input_ids), None, torch.float32))
        for block in t5.decoder.blocks:
            block.self_attn.kv_cache = KVCache((2, SMALL["num_heads"], 4, SMALL["d_kv"]), torch.float32, "cpu")
        token, pos = torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        assert torch._dynamo.explain(t5.decode_step)(token, pos, encoder_kv, None).graph_break_count == 0
    # activation checkpointing is applied before compiling: the recomputation is in the one graph too
    checkpoint_activations(t5)
    explained = torch._dynamo.explain(t5)(input_ids, labels=labels)
    assert explained.graph_break_count == 0 and "tag_activation_checkpoint" in explained.graphs[0].code


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: a CPU's
def test_the_flex_encoder_that_the_gpu_trials_time_computes_the_same_forward():
    """docs/gpu_trials.py's candidate, the encoder's self-attention in flex_attention with its bias as an fp32
    (H, S, S) table: the same logits and loss as model.py's SDPA (on a CPU flex_attention has a forward only)"""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_trials", os.path.join("docs", "gpu_trials.py"))
    gpu_trials = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_trials)
    torch.manual_seed(0)
    t5 = T5(T5Config.from_preset("t5-tiny", vocab_size=256))
    input_ids, labels = torch.randint(0, 256, (2, 40)), torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        logits, loss = t5(input_ids, labels=labels)
        flex_logits, flex_loss = gpu_trials.use_flex_in_encoder(t5)(input_ids, labels=labels)
    torch.testing.assert_close(flex_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_loss, loss, rtol=1e-6, atol=1e-6)
