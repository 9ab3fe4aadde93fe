"""
Fills in the sentinels of a text with a trained T5: nanoGPT's sample.py, for span corruption.
    python sample.py --init_from=out/t5_tiny --text="The <extra_id_0> is a small <extra_id_1> ."
    python sample.py --init_from=out/t5_tiny                   # held-out windows of the run's own data, and the truth
    python sample.py --init_from=google/t5-v1_1-base --text="Thank you <extra_id_0> me to your party."
init_from: a train.py or finetune.py run (its out_dir, ckpt.pt or ckpt/), with its own tokenizer, or Hugging Face
weights (a Hub name or folder), with T5's. The model's fills are shown [in brackets] in place of the sentinels.
"""
import os
import re

import torch

from prepare import SpanCorruptionBatches, load_tokenizer
from runtime import UserError, check_device, load_model, print0, setup_runtime

SENTINEL = re.compile(r"<extra_id_(\d+)>")  # where the model fills in

# -----------------------------------------------------------------------------------------------------------------
valid = {}
init_from = "out/t5_tiny"
text = ""  # with gaps <extra_id_0>, <extra_id_1>, ...; '' -> held-out windows of the run
num_samples = 3  # held-out windows to show when there is no text
max_new_tokens = 64
temperature = 0.0  # 0: greedy (as evaluations show); above 0: sampled from the top_k likeliest tokens
top_k = 0  # 0: all
device = "auto"
seed = 1337
valid.update(init_from="non-empty", text="any", num_samples="> 0", max_new_tokens="> 0", temperature=">= 0",
             top_k=">= 0", device=check_device, seed=">= 0")
# -----------------------------------------------------------------------------------------------------------------

def encode(tok, text):
    """the ids of text, each <extra_id_i> as its sentinel, ending with EOS as the model's inputs do"""
    ids = []
    for i, part in enumerate(SENTINEL.split(text)):
        ids += tok.encode(part) if i % 2 == 0 else [tok.first_sentinel_id - int(part)]
    return ids + [tok.eos_id]

def fill_in(tok, text, fill):
    """text with each <extra_id_i> replaced by [what fill (model output or true targets) holds after it]"""
    spans, span = {}, None
    for i in fill:
        if tok.is_sentinel(i):
            span = spans.setdefault(tok.first_sentinel_id - i, [])
        elif i == tok.eos_id:
            break
        elif span is not None:
            span.append(i)
    return SENTINEL.sub(lambda m: f"[{tok.decode(spans.get(int(m[1]), [])).strip()}]", text)

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    rt = setup_runtime(device, "float32", seed)
    if text and not SENTINEL.search(text):
        raise UserError("--text has no sentinel to fill in: mark the gaps with <extra_id_0>, <extra_id_1>, ...")
    model, ckpt = load_model(init_from)
    model.to(rt.device).eval()
    meta = ckpt["meta"] if ckpt is not None else None
    if not text and meta is None:
        raise UserError(f"{init_from} brings no data of its own to fill in: pass --text=\"... <extra_id_0> ...\"")
    tok = load_tokenizer(meta, init_from)
    if text:
        inputs, truths = torch.tensor([encode(tok, text)]), [None]
    else:  # the first held-out windows of the run's data, noised as its evaluations are
        run = ckpt["config"]
        val = SpanCorruptionBatches(meta["data_dir"], "val", num_samples, run.get("input_length", 128),
                                    run.get("noise_density", 0.15), run.get("mean_noise_span_length", 3.0), seed,
                                    model.config.vocab_size)
        inputs, truths = val.get(0)
    fills = model.generate(inputs.to(rt.device), max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k or None).tolist()
    for ids, fill, truth in zip(inputs.tolist(), fills, truths):
        corrupted = tok.decode(ids)
        print0(f"input: {corrupted}\nmodel: {fill_in(tok, corrupted, fill)}")
        if truth is not None:
            print0(f"truth: {fill_in(tok, corrupted, truth.tolist())}")
        print0("-" * 80)
