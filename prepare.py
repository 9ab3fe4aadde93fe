"""
Tokenises a corpus into uint16 shards, the tokenizer and meta.json (what
each file holds), and reads a prepared folder back; killed, the same
command resumes after the last shard.
    python prepare.py --dataset=c4 --tokenizer=t5 --out_dir=data/c4  # streamed
"""
import glob
import hashlib
import itertools
import json
import math
import os
import shlex
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, suppress

import numpy as np
from tqdm import tqdm

from runtime import atomic_write, lock_folder
from tokenizer import (MAX_VOCAB_SIZE, Tokenizer, gpt2_ranks, hub_check,
                       read_tokenizer, t5_spiece, train_spiece)

# -----------------------------------------------------------------------------
# default config; --key=value overrides it
# 'c4', 'pydoc' (offline), a Hub dataset or a .txt/.json/.jsonl/.parquet(.gz)
dataset = "c4"
text_field = "text"
# 't5', 'gpt2', 'train', or a .model or .tiktoken file
tokenizer = "t5"
vocab_size = 32000  # for tokenizer='train'
out_dir = "data/c4"
max_train_tokens = 0  # 0: the whole dataset
num_proc = os.cpu_count()  # tokenising threads
shard_tokens = 100_000_000  # 200 MB per shard
val_fraction = 0.005  # held out if a dataset has no validation split
max_val_tokens = 10_000_000
# -----------------------------------------------------------------------------

# how to make the data folders the configs name
RECIPES = {"c4": dict(dataset="c4", tokenizer="t5"),
           "pydoc": dict(dataset="pydoc", tokenizer="train", vocab_size=1000)}
# datasets' loader of a local file, by extension (then maybe .gz)
LOADERS = {".txt": "text", ".json": "json", ".jsonl": "json",
           ".parquet": "parquet"}

def prepare(dataset="c4", tokenizer="t5", out_dir="data/c4", vocab_size=32000,
            max_train_tokens=0, num_proc=1, text_field="text",
            shard_tokens=100_000_000, val_fraction=0.005,
            max_val_tokens=10_000_000):
    """Tokenise dataset into out_dir and return its meta; a rerun resumes."""
    settings = dict(dataset=dataset, text_field=text_field,
                    tokenizer=tokenizer,
                    vocab_size=vocab_size if tokenizer == "train" else None,
                    max_train_tokens=max_train_tokens or None,
                    shard_tokens=shard_tokens, val_fraction=val_fraction,
                    max_val_tokens=max_val_tokens)
    path = os.path.join(out_dir, "meta.json")
    meta = None
    if os.path.isfile(path):
        with open(path) as f:
            meta = json.load(f)
        if meta["settings"] != settings:
            was = meta["settings"]
            changed = ", ".join(f"{k} {was.get(k)!r} -> {v!r}"
                                for k, v in settings.items()
                                if was.get(k) != v)
            raise SystemExit(
                f"error: {out_dir} was prepared with other settings "
                f"({changed}): use another --out_dir, or delete it to "
                f"start over")
        if os.path.isfile(tokenizer) and (read_tokenizer(tokenizer).sha256
                                          != meta["tokenizer_sha256"]):
            raise SystemExit(
                f"error: {tokenizer} is not the tokenizer {out_dir} was "
                f"prepared with: use another --out_dir, or delete it to "
                f"start over")
        if meta["complete"]:
            return load_meta(out_dir)
        # what a writer killed before its rename left (the folder is ours)
        for tmp in glob.glob(os.path.join(glob.escape(out_dir), "*.tmp")):
            os.remove(tmp)

    def docs(split):
        return documents(dataset, split, text_field, val_fraction)

    def save():
        with atomic_write(path, "w") as f:
            json.dump(meta, f, indent=2)
    if meta is None:  # a new folder: write nothing before a first document
        if next(docs("train"), None) is None:
            raise SystemExit(
                f"error: {dataset} has no training documents (its non-empty "
                f"'{text_field}' values; a local file holds out one in "
                f"{round(1 / val_fraction)})")
        os.makedirs(out_dir, exist_ok=True)
        meta = dict(settings=settings, val=[], shards=[], complete=False,
                    **write_tokenizer(tokenizer, vocab_size, out_dir, docs))
        save()
    tok = load_tokenizer(dict(meta, data_dir=out_dir))
    write_shards(docs("val"), tok, num_proc, meta["val"], max_val_tokens,
                 max_val_tokens, save, out_dir, "val")
    write_shards(docs("train"), tok, num_proc, meta["shards"], shard_tokens,
                 max_train_tokens or math.inf, save, out_dir, "train")
    meta["complete"] = True
    save()
    meta = load_meta(out_dir)
    print(f"{out_dir}: {meta['train_tokens']:,} train tokens in "
          f"{len(meta['shards'])} shards, {meta['val_tokens']:,} val tokens, "
          f"vocab {meta['vocab_size']} (model {meta['model_vocab_size']})")
    return meta

def write_tokenizer(tokenizer, vocab_size, out_dir, docs):
    if tokenizer == "train":
        print(f"training a {vocab_size}-piece sentencepiece model")
        tok = Tokenizer(train_spiece(docs("train"), vocab_size))
    elif tokenizer == "gpt2":
        tok = Tokenizer(gpt2_ranks())
    else:
        source = t5_spiece() if tokenizer == "t5" else tokenizer
        if not os.path.isfile(source):
            raise SystemExit(
                f"error: tokenizer '{tokenizer}' is not t5, gpt2, train or a "
                f".model or .tiktoken file")
        tok = read_tokenizer(source)  # checked before it is copied
    if tok.vocab_size > 1 << 16:
        raise SystemExit(
            f"error: the tokenizer's {tok.vocab_size} ids don't fit uint16: "
            f"use at most {MAX_VOCAB_SIZE}")
    if tok.pad_id < 0 or tok.eos_id < 0:  # a model is built with the data's ids
        raise SystemExit(
            f"error: tokenizer '{tokenizer}' has no pad or no EOS id, which "
            f"T5 needs: train it with pad_id=0 and eos_id=1, as "
            f"--tokenizer=train does")
    name = "tokenizer.tiktoken" if tok.tiktoken else "tokenizer.model"
    with atomic_write(os.path.join(out_dir, name)) as f:
        f.write(tok.data)
    return {"tokenizer_file": name, **tok.identity()}

def shard_name(split, i):
    return f"train_{i:03d}.bin" if split == "train" else "val.bin"

def write_shards(docs, tok, num_threads, shards, shard_tokens, max_tokens,
                 save, out_dir, split):
    """docs into split's files of shard_tokens; shards: those done"""
    doc, offset = ((shards[-1]["next_doc"], shards[-1]["next_offset"])
                   if shards else (0, 0))
    done = sum(s["tokens"] for s in shards)
    if done >= max_tokens or (shards and shards[-1]["tokens"] < shard_tokens):
        return  # finished before: only the last file is short
    pieces, filled = [], 0  # of the file being filled

    def write(next_doc, next_offset):
        path = os.path.join(out_dir, shard_name(split, len(shards)))
        sha256 = hashlib.sha256()  # what a run checks the shard against
        with atomic_write(path) as f:
            for piece in pieces:
                sha256.update(piece)
                f.write(piece)
        shards.append({"tokens": filled, "next_doc": next_doc,
                       "next_offset": next_offset,
                       "sha256": sha256.hexdigest()})
        save()
    chunks = encoded_chunks(itertools.islice(docs, doc, None), tok, num_threads)
    bar = tqdm(desc=split, total=max_tokens, initial=done, unit="tok",
               unit_scale=True)  # an inf total: tqdm's unknown
    with closing(chunks), bar:
        for ids, lengths in chunks:
            ends = np.cumsum(lengths)
            # the first document's first `offset` tokens are in the last file
            pos, offset = offset, 0
            while pos < len(ids) and done < max_tokens:
                n = int(min(len(ids) - pos, shard_tokens - filled,
                            max_tokens - done))
                pieces.append(ids[pos: pos + n])
                pos, filled, done = pos + n, filled + n, done + n
                if filled == shard_tokens or done == max_tokens:
                    # the next file starts in the chunk's document j
                    j = int(np.searchsorted(ends, pos, side="right"))
                    write(doc + j, int(pos - (ends[j - 1] if j else 0)))
                    pieces, filled = [], 0
            bar.update(len(ids))
            doc += len(lengths)
            if done >= max_tokens:
                return
        if filled or not shards:  # the data ran out: the last file is short
            write(doc, 0)

def encoded_chunks(docs, tok, num_threads, chunk_docs=1000):
    """(ids, document lengths) per chunk of docs, in order; the threads
    (tokenizers release the GIL) run at most 2 chunks each ahead"""
    with ThreadPoolExecutor(num_threads) as pool:
        pending = deque()
        while chunk := list(itertools.islice(docs, chunk_docs)):
            pending.append(pool.submit(tok.encode_documents, chunk))
            if len(pending) >= 2 * num_threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

# sources: the same documents, in order, on every run

def documents(dataset, split, text_field="text", val_fraction=0.005):
    """split 'train' or 'val'; a held-out val starts at the first document:
    even a small file has one"""
    if dataset == "pydoc":  # 0.5% of 2 MB would be 4 documents
        texts, val_fraction = pydoc_documents(), max(val_fraction, 0.05)
    else:
        splits = open_dataset(dataset)
        own = "validation" in splits  # then train keeps every document
        name = "validation" if own and split == "val" else "train"
        texts = column(splits[name], text_field)
        val_fraction = 1.0 if own else val_fraction
    docs = (text.strip() for text in texts if text and text.strip())
    if val_fraction == 1:
        return docs
    every = max(2, round(1 / val_fraction))
    return (doc for i, doc in enumerate(docs)
            if (i % every == 0) == (split == "val"))

def open_dataset(dataset):  # its splits, streamed
    import datasets
    loader = LOADERS.get(
        os.path.splitext(dataset.lower().removesuffix(".gz"))[1])
    if loader:
        if not os.path.isfile(dataset):
            raise SystemExit(f"error: input file {dataset} not found")
        options = dict(sample_by="paragraph") if loader == "text" else {}
        return datasets.load_dataset(loader, data_files=dataset,
                                     streaming=True, **options)
    if os.path.exists(dataset):
        raise SystemExit(
            f"error: {dataset} is not a {'/'.join(LOADERS)} file (or .gz): "
            f"its extension says how to read it")
    repo_id, config_name = (("allenai/c4", "en") if dataset == "c4"
                            else (dataset, None))
    hub_check(repo_id, "dataset",
              "use --dataset=pydoc (offline) or a local file")
    return datasets.load_dataset(repo_id, config_name, streaming=True)

def column(split, text_field):
    for batch in split.iter(batch_size=1000):  # not a slow dict per row
        if text_field not in batch:
            raise SystemExit(
                f"error: the dataset has no '{text_field}' field (it has "
                f"{', '.join(batch)}): set --text_field")
        yield from batch[text_field]

def pydoc_documents():
    """~2 MB of English, offline"""
    import ast
    import sysconfig
    import pydoc_data.topics
    for name in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[name]
    for folder, subfolders, files in os.walk(sysconfig.get_paths()["stdlib"]):
        # test suites' docstrings are mostly "Test that ..." one-liners
        skipped = ("site-packages", "test", "tests", "__pycache__")
        subfolders[:] = sorted(d for d in subfolders if d not in skipped)
        for file in sorted(f for f in files if f.endswith(".py")):
            # lib2to3's test data holds broken files
            with suppress(SyntaxError, UnicodeDecodeError, ValueError):
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                docstrings = [ast.get_docstring(node)
                              for node in ast.walk(tree)
                              if isinstance(node, (
                                  ast.Module, ast.ClassDef,
                                  ast.FunctionDef, ast.AsyncFunctionDef))]
                yield "\n\n".join(filter(None, docstrings))

def prepare_command(settings, data_dir):
    flags = [f"--{key}={shlex.quote(str(value))}"
             for key, value in settings.items() if value is not None]
    return (f"python prepare.py {' '.join(flags)} "
            f"--out_dir={shlex.quote(data_dir)}")

def prepare_again(settings, data_dir):  # the fix for a damaged folder
    return (f"delete {data_dir} and prepare it again with "
            f"`{prepare_command(settings, data_dir)}`")

def load_meta(data_dir, run_meta=None):
    """a complete prepared folder's meta.json, with data_dir, source and
    counts; run_meta: a run's data's, which a missing folder's line names"""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        recipe = run_meta and run_meta["settings"] or RECIPES.get(
            os.path.basename(os.path.normpath(data_dir)))  # or its name's
        recipes = [recipe] if recipe else RECIPES.values()
        commands = " or ".join(f"`{prepare_command(r, data_dir)}`"
                               for r in recipes)
        raise SystemExit(
            f"error: {data_dir} holds no prepared data (no meta.json): "
            f"prepare it with {commands}")
    with open(path) as f:
        meta = json.load(f)
    if not meta["complete"]:
        raise SystemExit(
            f"error: {data_dir} is not completely prepared: finish it with "
            f"`{prepare_command(meta['settings'], data_dir)}`")
    if any("sha256" not in file for file in meta["shards"] + meta["val"]):
        raise SystemExit(f"error: {data_dir} was prepared before meta.json "
                         f"recorded each shard's sha256: "
                         f"{prepare_again(meta['settings'], data_dir)}")
    meta.update(data_dir=os.path.abspath(data_dir),
                source=meta["settings"]["dataset"])
    load_tokenizer(meta)  # the file meta.json records, or refused
    for split, files in (("train", meta["shards"]), ("val", meta["val"])):
        meta[f"{split}_tokens"] = sum(file["tokens"] for file in files)
        cut = files[-1]["next_offset"] > 0  # the last file ends mid-document
        meta[f"{split}_documents"] = files[-1]["next_doc"] + cut
    return meta

def load_tokenizer(meta):
    """a folder's tokenizer, as meta.json records it: another's ids mean
    other pieces; a wrong EOS would end every row with another token"""
    path = os.path.join(meta["data_dir"], meta["tokenizer_file"])
    tok = read_tokenizer(path)
    wrong = [f"{key} {meta[key]} in meta.json, {value} in the tokenizer"
             for key, value in tok.identity().items() if meta[key] != value]
    if wrong:
        raise SystemExit(
            f"error: {path} is not the tokenizer {meta['data_dir']}/meta.json "
            f"records ({wrong[0]}): "
            f"{prepare_again(meta['settings'], meta['data_dir'])}")
    return tok

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configurator.py")).read())
    check_config(config, [
        ("vocab_size", 0 < vocab_size <= MAX_VOCAB_SIZE,
         f"in [1, {MAX_VOCAB_SIZE}]"),
        ("val_fraction", 0 < val_fraction < 1, "in (0, 1)"),
        ("max_train_tokens", max_train_tokens >= 0, ">= 0 (0: all)"),
        # meta.json lists every shard, rewritten after each: 2 MB at least
        ("shard_tokens", shard_tokens >= 1_000_000, ">= 1,000,000"),
        *[(key, globals()[key] > 0, "> 0")
          for key in ("num_proc", "max_val_tokens")]])
    lock = lock_folder(out_dir)  # one prepare.py at a time in a folder
    prepare(**config)
