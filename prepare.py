"""
Tokenises a corpus into uint16 shards for T5 pre-training, and reads a prepared folder back: its
meta.json and its tokenizer. data.py makes the batches.
    python prepare.py --dataset=c4 --tokenizer=t5 --out_dir=data/c4    # C4 en, streamed
    python prepare.py --dataset=c4 --max_train_tokens=4_800_000_000     # what nanoT5's recipe reads
    python prepare.py --dataset=my.jsonl.gz --tokenizer=train --vocab_size=16000 --out_dir=data/my
    python prepare.py --dataset=pydoc --tokenizer=train --vocab_size=1000 --out_dir=data/pydoc
    python prepare.py --dataset=c4 --tokenizer=gpt2 --out_dir=data/c4_gpt2   # GPT-2's, by tiktoken
out_dir gets train_000.bin, ..., val.bin, the tokenizer and meta.json (what
each file holds); killed, the same command resumes after the last full shard.
"""
import base64
import glob
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, suppress

import numpy as np
import sentencepiece as spm
import tiktoken
import tiktoken_ext.openai_public
from tqdm import tqdm

from runtime import atomic_write, claim

NUM_SENTINELS = 100
MAX_VOCAB_SIZE = (1 << 16) - NUM_SENTINELS  # ids are stored as uint16
# sha256 of T5 v1.1's (and flan-t5's) spiece.model
T5_SPIECE_SHA256 = "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86"
# a tiktoken ranks file's first line; a .model is a protobuf
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\n")
# GPT-2's split into words, within which BPE merges bytes
BPE_PATTERN = tiktoken_ext.openai_public.r50k_pat_str
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
    settings = {
        "dataset": dataset,
        "text_field": text_field,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size if tokenizer == "train" else None,
        "max_train_tokens": max_train_tokens or None,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "max_val_tokens": max_val_tokens,
    }
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
        copy = os.path.join(out_dir, meta["tokenizer_file"])
        if os.path.isfile(tokenizer) and (
                read_tokenizer(tokenizer).data != read_tokenizer(copy).data):
            raise SystemExit(
                f"error: {tokenizer} is not the tokenizer {out_dir} was "
                f"prepared with (it changed since): use another --out_dir, "
                f"or delete it to start over")
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
        meta = {
            "settings": settings,
            **write_tokenizer(tokenizer, vocab_size, out_dir, docs),
            "val": [],
            "shards": [],
            "complete": False,
        }
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
        print(f"training a {vocab_size}-piece sentencepiece model on the corpus")
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
    """Tokenise docs into split's files of shard_tokens; shards: those done"""
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
    total = max_tokens if max_tokens < math.inf else None
    bar = tqdm(desc=split, total=total, initial=done, unit="tok",
               unit_scale=True)
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
    """(ids, document lengths) per chunk of chunk_docs docs, in order; threads
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
    """split 'train' or 'val'. A held-out val starts at the first document:
    even a small file has one."""
    if dataset == "pydoc":
        texts = pydoc_documents()
        # 0.5% of 2 MB would be 4 documents
        val_fraction = max(val_fraction, 0.05)
    else:
        splits = open_dataset(dataset)
        if "validation" in splits:  # its own: train keeps every document
            texts = column(
                splits["train" if split == "train" else "validation"],
                text_field)
            val_fraction = 1.0
        else:
            texts = column(splits["train"], text_field)
    docs = (text.strip() for text in texts if text and text.strip())
    if val_fraction == 1:
        return docs
    every = max(2, round(1 / val_fraction))
    return (doc for i, doc in enumerate(docs)
            if (i % every == 0) == (split == "val"))

def open_dataset(dataset):
    """dataset's splits, streamed"""
    import datasets
    loader = LOADERS.get(
        os.path.splitext(dataset.lower().removesuffix(".gz"))[1])
    if loader and not os.path.isfile(dataset):
        raise SystemExit(f"error: input file {dataset} not found")
    if not loader and os.path.exists(dataset):
        raise SystemExit(
            f"error: {dataset} is not a {'/'.join(LOADERS)} file (or .gz): "
            f"its extension says how to read it")
    if loader:
        options = dict(sample_by="paragraph") if loader == "text" else {}
        return datasets.load_dataset(loader, data_files=dataset,
                                     streaming=True, **options)
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
                yield "\n\n".join(d for d in docstrings if d)

def hub_check(repo_id, repo_type, hint):
    """fail in seconds, not minutes of retries, if the Hub or repo is out of
    reach"""
    from huggingface_hub import HfApi
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=3)
    except Exception as e:  # offline, no such or a private repo
        raise SystemExit(
            f"error: can't get the {repo_type} '{repo_id}' from the Hugging "
            f"Face Hub ({type(e).__name__}): check the name, or {hint}"
        ) from None

# the tokenizer

class Tokenizer:
    """A tokenizer file's bytes (data), T5's sentinels after its ids:
    <extra_id_i> = vocab_size - 1 - i. A sentencepiece model as T5's (pad 0,
    eos 1, unk 2), or a byte-level BPE's tiktoken ranks file, split as GPT-2
    splits: ids are the ranks, then <|endoftext|> as EOS, pad and decoder start
    (GPT-2: EOS 50256, <extra_id_0> 50356). Its sha256 names it: two tokenizers
    of one vocab size may give an id two meanings."""
    def __init__(self, data):
        self.data = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.tiktoken = TIKTOKEN_LINE.match(data) is not None
        if self.tiktoken:
            ranks = read_ranks(data)
            self.bpe = tiktoken.Encoding("bpe", pat_str=BPE_PATTERN,
                                         mergeable_ranks=ranks,
                                         special_tokens={})
            self.encode = self.bpe.encode_ordinary
            self.decode_run = self.bpe.decode
            self.eos_id = self.pad_id = len(ranks)  # <|endoftext|>
            self.unk_id = None  # bytes: no text is unknown
            pieces = len(ranks) + 1
        else:
            self.sp = spm.SentencePieceProcessor(model_proto=data)
            self.encode, self.decode_run = self.sp.encode, self.sp.decode
            self.eos_id, self.pad_id = self.sp.eos_id(), self.sp.pad_id()
            self.unk_id = self.sp.unk_id()
            pieces = self.sp.get_piece_size()
        self.vocab_size = pieces + NUM_SENTINELS
        self.first_sentinel_id = self.vocab_size - 1

    @property
    def model_vocab_size(self):
        """a model's vocab: the ids, padded for fast matmuls"""
        return math.ceil(self.vocab_size / 128) * 128

    def identity(self):  # what meta.json records, checked at every read
        keys = ("tokenizer_sha256", "vocab_size", "model_vocab_size",
                "eos_id", "pad_id", "first_sentinel_id")
        return {key: getattr(self, key.removeprefix("tokenizer_"))
                for key in keys}

    def encode_documents(self, texts):
        """(uint16 ids of all texts, each followed by EOS; each one's length)"""
        # int arrays, not lists: a Python int per token would hold the GIL
        if self.tiktoken:
            ids = [np.append(self.bpe.encode_to_numpy(text), self.eos_id)
                   for text in texts]
        else:
            ids = self.sp.encode(texts, add_eos=True, num_threads=1,
                                 out_type="numpy")
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        return np.concatenate(ids).astype(np.uint16), lengths

    def is_sentinel(self, i):
        first = self.first_sentinel_id
        return first - NUM_SENTINELS < i <= first

    def decode(self, ids, skip_special_tokens=False):
        """text as T5's tokenizer (a BPE's: its export's) shows it, or as HF's
        skip_special_tokens=True (Tk-Instruct's)"""
        specials = (self.eos_id, self.unk_id) if skip_special_tokens else ()
        skipped = {self.pad_id, *specials}
        parts = []
        run = []
        for i in map(int, ids):
            if self.is_sentinel(i) and not skip_special_tokens:
                parts += [self.decode_run(run),
                          f"<extra_id_{self.first_sentinel_id - i}>"]
                run = []
            elif (not self.is_sentinel(i) and i not in skipped
                  and i < self.vocab_size):  # not the model's padding
                run.append(i)
        joint = "" if self.tiktoken else " "  # a BPE's pieces keep their spaces
        return joint.join(
            part for part in parts + [self.decode_run(run)] if part)

    def shown_length(self, ids, num_spans=3):
        """how many of ids, a fill, hold its first num_spans spans"""
        ends = (self.eos_id, self.first_sentinel_id - num_spans)
        return next((i for i, token in enumerate(ids) if token in ends),
                    len(ids))

    def show_fill(self, inputs, fill, truth, num_spans=3, context=6):
        """the input around its first num_spans sentinels, the model's fill and
        the true one, as an evaluation prints them"""
        inputs = np.asarray(inputs).tolist()
        shown = [i for i, token in enumerate(inputs)
                 if self.is_sentinel(token)][:num_spans]
        keep = sorted({j for i in shown
                       for j in range(i - context, i + context + 1)
                       if 0 <= j < len(inputs)})
        runs = (np.split(np.array(keep), np.nonzero(np.diff(keep) > 1)[0] + 1)
                if keep else [])
        text = " ... ".join(self.decode([inputs[j] for j in run]).strip()
                            for run in runs)
        start = "... " if keep and keep[0] > 0 else ""
        fill = np.asarray(fill).tolist()
        truth = np.asarray(truth).tolist()
        return {
            "input": start + text + " ...",
            "model": self.decode(
                fill[:self.shown_length(fill, num_spans)]).strip(),
            "truth": self.decode(
                truth[:self.shown_length(truth, num_spans)]).strip(),
        }

def read_tokenizer(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        return Tokenizer(data)
    except (RuntimeError, ValueError):  # sentencepiece's, or read_ranks'
        raise SystemExit(
            f"error: {path} is not a sentencepiece model or a tiktoken ranks "
            f"file of a byte-level BPE") from None

def read_ranks(data):
    """{piece: rank} of a tiktoken ranks file. The ranks are the ids 0, 1, ...;
    every byte is a piece, or some text could not be encoded."""
    lines = (line.split(b" ") for line in data.splitlines() if line)
    ranks = {base64.b64decode(piece, validate=True): int(rank)
             for piece, rank in lines}
    bytes_missing = any(bytes([b]) not in ranks for b in range(256))
    if bytes_missing or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("not the ranks of a byte-level BPE")
    return ranks

def gpt2_ranks():
    """GPT-2's BPE as a tiktoken ranks file (tiktoken downloads it once)"""
    try:
        gpt2 = tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline
        raise SystemExit(
            f"error: tiktoken can't get GPT-2's tokenizer "
            f"({type(e).__name__}): connect once, or pass its ranks as "
            f"--tokenizer=<file>.tiktoken") from None
    pieces = sorted(gpt2.token_byte_values(), key=gpt2.encode_single_token)
    return b"".join(
        b"%s %d\n" % (base64.b64encode(p), gpt2.encode_single_token(p))
        for p in pieces)

def t5_spiece():
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download("google/t5-v1_1-base", "spiece.model",
                               local_files_only=True)
    except FileNotFoundError:  # not cached yet
        hub_check("google/t5-v1_1-base", "model",
                  "pass a local copy of T5's spiece.model instead")
        return hf_hub_download("google/t5-v1_1-base", "spiece.model")

def train_spiece(texts, vocab_size, max_chars=20_000_000):
    lines, chars = [], 0
    for text in texts:
        lines += [line for line in text.splitlines() if line.strip()]
        chars += len(text)
        if chars >= max_chars:
            break
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
            minloglevel=2,
            num_threads=8)  # fixed: the model depends on it
    except RuntimeError as e:
        # "Vocabulary size too high (8000). Please set it to a value <= 3012."
        bound = re.search(r"<= (\d+)| vs (\d+)", str(e))
        fix = f": use --vocab_size={bound[1] or bound[2]}" if bound else ""
        reason = str(e).split("] ")[-1].split(". ")[0]
        raise SystemExit(
            f"error: sentencepiece training failed: {reason}{fix}") from None
    return model.getvalue()

# a prepared folder, read back

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
    counts. run_meta: that of a run's training data, which a missing folder's
    error names"""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        recipe = run_meta and run_meta["settings"] or RECIPES.get(
            os.path.basename(os.path.normpath(data_dir)))
        # the data its name says, or either
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
    """A prepared folder's tokenizer, the one meta.json records: another's ids
    mean other pieces; a wrong EOS would end every row with another token."""
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
        ("out_dir", out_dir and not os.path.isfile(out_dir), "a folder's path"),
        ("val_fraction", 0 < val_fraction < 1, "in (0, 1)"),
        ("max_train_tokens", max_train_tokens >= 0, ">= 0 (0: all)"),
        # meta.json lists every shard, rewritten after each: 2 MB at least
        ("shard_tokens", shard_tokens >= 1_000_000, ">= 1,000,000"),
        *[(key, globals()[key] > 0, "> 0")
          for key in ("num_proc", "max_val_tokens")]])
    lock = claim(out_dir)  # one prepare.py at a time in a folder
    prepare(**config)
