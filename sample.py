"""
Fills in a text's sentinels with a trained T5 (a run, or Hugging Face
weights), nanoGPT's sample.py for span corruption; fills show [bracketed].
    python sample.py --init_from=out/t5_tiny --text="The <extra_id_0> is a small <extra_id_1> ."
"""
import os
import re

import torch

from checkpoint import load, model_from_checkpoint
from runtime import print0, setup_runtime
from tokenizer import NUM_SENTINELS, tokenizer_of

SENTINEL = re.compile(r"<extra_id_(\d+)>")  # where the model fills in

def check_text(text):
    """the gaps of --text: marked <extra_id_0> to <extra_id_99>, each once"""
    numbers = [int(n) for n in SENTINEL.findall(text)]
    if not numbers:
        raise SystemExit("error: --text has no sentinel to fill in: mark gaps "
                         "with <extra_id_0>, <extra_id_1>, ...")
    if max(numbers) >= NUM_SENTINELS:
        raise SystemExit(f"error: --text has <extra_id_{max(numbers)}>, but a "
                         f"T5 knows only <extra_id_0> to "
                         f"<extra_id_{NUM_SENTINELS - 1}>")
    if len(set(numbers)) < len(numbers):
        raise SystemExit("error: --text has a sentinel twice: give each gap "
                         "its own")

# -----------------------------------------------------------------------------
init_from = "out/t5_tiny"
text = "The <extra_id_0> of a function is its <extra_id_1> ."  # gaps, once each
max_new_tokens = 64  # 100 sentinels of mean span 3 need ~400: the cache's size
device = "auto"
# -----------------------------------------------------------------------------

def encode(tok, text):
    """the ids of text, each <extra_id_i> its sentinel, ending with EOS"""
    ids = []
    for i, part in enumerate(SENTINEL.split(text)):
        if i % 2:  # a sentinel's number
            ids.append(tok.first_sentinel_id - int(part))
        else:
            ids += tok.encode(part)
    return ids + [tok.eos_id]

def fill_in(tok, text, fill):
    """text, each <extra_id_i> replaced by [what fill holds after it]"""
    spans, span = {}, None
    for i in fill:
        if tok.is_sentinel(i):
            span = spans.setdefault(tok.first_sentinel_id - i, [])
        elif i == tok.eos_id:
            break
        elif span is not None:
            span.append(i)

    def filled(match):
        return f"[{tok.decode(spans.get(int(match[1]), [])).strip()}]"
    return SENTINEL.sub(filled, text)

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configurator.py")).read())
    check_text(text)
    check_config(config, [("max_new_tokens", 0 < max_new_tokens <= 1024,
                           "in [1, 1024]")])
    rt = setup_runtime(device, "float32")
    ckpt = load(init_from)
    model = model_from_checkpoint(ckpt).to(rt.device).eval()
    tok = tokenizer_of(ckpt, init_from)  # the one it was trained with
    ids = encode(tok, text)
    fill = model.generate(torch.tensor([ids], device=rt.device),
                          max_new_tokens=max_new_tokens)[0].tolist()
    corrupted = tok.decode(ids)
    print0(f"input: {corrupted}\nmodel: {fill_in(tok, corrupted, fill)}")
