"""
Exports a run of train.py or finetune.py (sharded or not) in Hugging Face's format: config.json,
model.safetensors and the run's tokenizer as spiece.model, which transformers'
T5ForConditionalGeneration and sample.py read back as the run.
    python export.py --init_from=out/t5_tiny --out_dir=out/t5_tiny_hf
"""
import errors  # first: from here on an error, or Ctrl-C, is one line, not a traceback
import os

from checkpoint import find_weights, load_model, save_pretrained
from files import UserError, atomic_write
from prepare import load_tokenizer
from runtime import require

# -------------------------------------------------------------------------------------------------
valid = {}
init_from = "out/t5_tiny"  # a run: its out_dir, ckpt.pt or ckpt/
out_dir = "out/t5_tiny_hf"  # a new folder, or an empty one
valid.update(init_from=find_weights, out_dir="folder")
# -------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    if find_weights(init_from) is None:  # a run to export, not weights in this format already
        raise UserError(f"{init_from} is not a run of train.py or finetune.py (its out_dir, ckpt.pt "
                        f"or ckpt/): export.py writes a run in Hugging Face's format")
    require("safetensors", "export.py")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} is not empty, and export.py replaces no file: pass a new --out_dir")
    model, ckpt = load_model(init_from)
    meta = ckpt["meta"]  # None: the run started from Hugging Face weights, with T5's tokenizer
    if meta and not meta["tokenizer_file"]:
        raise UserError(f"{init_from} was trained with the {meta['settings']['tokenizer']} tokenizer, "
                        f"which a Hugging Face T5 folder cannot hold: export a sentencepiece run")
    if meta:
        load_tokenizer(meta, vocab_size=model.config.vocab_size)  # checked before any write
    save_pretrained(model, out_dir)
    if meta:
        with open(os.path.join(meta["data_dir"], meta["tokenizer_file"]), "rb") as f:
            spiece = f.read()
        with atomic_write(os.path.join(out_dir, "spiece.model")) as f:
            f.write(spiece)
    print(f"{out_dir}: {init_from} ({model.num_params() / 1e6:.1f}M parameters) as Hugging Face's "
          f"T5ForConditionalGeneration{', with its tokenizer as spiece.model' if meta else ''}")
