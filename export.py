"""
Exports a run in Hugging Face's format, with the tokenizer its checkpoint
carries: T5ForConditionalGeneration, AutoTokenizer and sample.py read it.
    python export.py --init_from=out/t5_tiny --out_dir=out/t5_tiny_hf
"""
import os

from checkpoint import find_checkpoint, load, model_from_checkpoint
from hf import save_pretrained
from runtime import lock_folder
from tokenizer import tokenizer_of

# -----------------------------------------------------------------------------
# a run: its out_dir, ckpt/ or a step folder
init_from = "out/t5_tiny"
out_dir = "out/t5_tiny_hf"  # a new folder, or an empty one
# -----------------------------------------------------------------------------

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configurator.py")).read())
    if not find_checkpoint(init_from):  # HF weights: exported already
        raise SystemExit(f"error: {init_from} is not a run of train.py or "
                         f"finetune.py (its out_dir, ckpt/ or a step folder): "
                         f"export.py writes a run in Hugging Face's format")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir)
                                    or os.listdir(out_dir)):
        raise SystemExit(f"error: {out_dir} is not an empty folder, and "
                         f"export.py replaces no file: pass a new --out_dir")
    lock_folder(out_dir, lock=False)  # writable, before any work
    ckpt = load(init_from)
    model = model_from_checkpoint(ckpt)
    tokenizer_of(ckpt, init_from)  # the model's, checked before any write
    save_pretrained(model, out_dir, ckpt["tokenizer"])
    spiece = ", with its tokenizer" if ckpt["tokenizer"] else ""
    print(f"{out_dir}: {init_from} ({model.num_params() / 1e6:.1f}M "
          f"parameters) as Hugging Face's T5ForConditionalGeneration{spiece}")
