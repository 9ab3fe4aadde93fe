"""
Exports a run of train.py or finetune.py (sharded or not) in Hugging Face's format: config.json,
model.safetensors and the run's tokenizer as spiece.model, which transformers'
T5ForConditionalGeneration and sample.py read back as the run.
    python export.py --init_from=out/t5_tiny --out_dir=out/t5_tiny_hf
"""
import os
import shutil

from checkpoint import find_checkpoint, load_model, save_pretrained
from prepare import load_tokenizer

# -------------------------------------------------------------------------------------------------
init_from = "out/t5_tiny"  # a run: its out_dir, ckpt.pt or ckpt/
out_dir = "out/t5_tiny_hf"  # a new folder, or an empty one
# -------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    if not find_checkpoint(init_from):  # a run to export, not weights in this format already
        raise SystemExit(f"error: {init_from} is not a run of train.py or finetune.py (its "
                         f"out_dir, ckpt.pt or ckpt/): export.py writes a run in Hugging Face's format")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise SystemExit(f"error: {out_dir} is not an empty folder, and export.py replaces no "
                         f"file: pass a new --out_dir")
    model, ckpt = load_model(init_from)
    meta = ckpt["meta"]  # None: the run started from Hugging Face weights, with T5's tokenizer
    if meta:
        load_tokenizer(meta, vocab_size=model.config.vocab_size)  # checked before any write
    save_pretrained(model, out_dir)
    if meta:
        spiece = os.path.join(meta["data_dir"], meta["tokenizer_file"])
        shutil.copy(spiece, os.path.join(out_dir, "spiece.model"))
    print(f"{out_dir}: {init_from} ({model.num_params() / 1e6:.1f}M parameters) as Hugging Face's "
          f"T5ForConditionalGeneration{', with its tokenizer as spiece.model' if meta else ''}")
