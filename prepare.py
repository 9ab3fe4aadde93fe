"""
Tokenises a corpus into uint16 shards for T5 pre-training, and reads them back as span-corrupted batches.
    python prepare.py                                               # C4 en, streamed, T5's tokenizer
    python prepare.py --dataset=c4 --max_train_tokens=4_800_000_000 # just what nanoT5's recipe consumes
    python prepare.py --dataset=my_corpus.jsonl.gz --tokenizer=train --vocab_size=16000 --out_dir=data/mine
    python prepare.py --dataset=pydoc --tokenizer=train --vocab_size=1000 --out_dir=data/pydoc  # offline
out_dir gets train_000.bin, ..., val.bin, the tokenizer and meta.json, its one state file: rerun, the command
continues where it was killed and rebuilds damaged files.
"""
import functools
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np
import torch
from tqdm import tqdm

from runtime import UserError, atomic_write, micro_batch_size, reading

# -----------------------------------------------------------------------------------------------------------------
# default config for `python prepare.py`; --key=value overrides any of these, `valid` says what values they may take
NUM_SENTINELS = 100
MAX_VOCAB_SIZE = (1 << 16) - NUM_SENTINELS  # ids are stored as uint16
valid = {}
dataset = "c4"  # 'c4', a Hub dataset name, a local .txt/.jsonl/.json(.gz)/.parquet file, or 'pydoc' (offline)
text_field = "text"
tokenizer = "t5"  # 't5', a local sentencepiece .model file, 'gpt2', or 'train' (a new sentencepiece model)
vocab_size = 32000  # pieces of the trained model, for tokenizer='train'
out_dir = "data/c4"
valid.update(dataset="non-empty", text_field="non-empty", tokenizer="non-empty", vocab_size=f"in [1, {MAX_VOCAB_SIZE}]",
             out_dir="folder")
max_train_tokens = 0  # stop after this many train tokens; 0 = the whole dataset
num_proc = os.cpu_count()  # tokenising threads
shard_tokens = 100_000_000  # 200 MB per shard
val_fraction = 0.005  # documents held out of a dataset that has no validation split
max_val_tokens = 10_000_000
valid.update(max_train_tokens=">= 0", num_proc="> 0", shard_tokens="> 0", val_fraction="in (0, 1)",
             max_val_tokens="> 0")
# -----------------------------------------------------------------------------------------------------------------

LOCAL_EXTENSIONS = (".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt.gz", ".parquet")
META_KEYS = ("settings", "tokenizer_file", "tokenizer_sha256", "vocab_size", "model_vocab_size", "eos_id", "pad_id",
             "first_sentinel_id", "val", "shards", "complete")

# span corruption, exactly as T5's random_spans_noise_mask + noise_span_to_unique_sentinel
def _noise_counts(length, noise_density, mean_noise_span_length):
    # at least one noise and one kept token; as many noise spans as kept spans so that they can alternate
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(1, round(min(num_noise, length - num_noise) / mean_noise_span_length))
    return num_noise, num_spans

def compute_input_and_target_lengths(inputs_length, noise_density, mean_noise_span_length):
    """T5's random_spans_helper: the longest raw window whose corrupted inputs fit, and its targets length"""
    def corrupted_lengths(raw_length):
        num_noise, num_spans = _noise_counts(raw_length, noise_density, mean_noise_span_length)
        # inputs: kept tokens + one sentinel per span + EOS; targets: one sentinel per span + noise + EOS
        return raw_length - num_noise + num_spans + 1, num_noise + num_spans + 1
    raw_length = inputs_length - 1
    while corrupted_lengths(raw_length + 1)[0] <= inputs_length:
        raw_length += 1
    return raw_length, corrupted_lengths(raw_length)[1]

def span_corrupt(tokens, noise_density, mean_noise_span_length, first_sentinel_id, eos_id, rng):
    """tokens (B, L) -> (inputs, targets) int64, ending with EOS. rng: a numpy Generator, or one per row, so that
    rows corrupted alone are those rows of the whole batch."""
    B, L = tokens.shape
    num_noise, num_spans = _noise_counts(L, noise_density, mean_noise_span_length)

    def segment_lengths(num_items):
        # T5's shuffle: item 0 and the items with the smallest uniform keys start the num_spans segments
        starts = np.zeros((B, 1), dtype=np.int64)
        if num_spans > 1:
            keys = np.stack([g.random(num_items - 1) for g in rng]) if isinstance(rng, list) else \
                rng.random((B, num_items - 1))
            subset = np.argpartition(keys, num_spans - 2, axis=1)[:, : num_spans - 1] + 1
            starts = np.concatenate([starts, np.sort(subset, axis=1)], axis=1)
        return np.diff(starts, axis=1, append=num_items)  # (B, num_spans)
    # kept, noise, kept, noise, ...
    lengths = np.stack([segment_lengths(L - num_noise), segment_lengths(num_noise)], axis=2).reshape(B, 2 * num_spans)
    span_start = np.zeros((B, L), dtype=np.int32)  # int32: numpy's int64 cumsum along rows is slow
    np.put_along_axis(span_start, np.cumsum(lengths, axis=1)[:, :-1], 1, axis=1)
    span_num = np.cumsum(span_start, axis=1, dtype=np.int32)  # (B, L): 2k in kept span k, 2k + 1 in noise span k
    is_noise = span_num % 2 == 1
    span_start[:, 0] = 1
    sentinel = first_sentinel_id - span_num // 2  # of noise span k, and of the kept span before it
    tokens = tokens.astype(np.int64)
    eos = np.full((B, 1), eos_id, dtype=np.int64)
    inputs = np.where(is_noise, sentinel, tokens)[~is_noise | (span_start == 1)].reshape(B, L - num_noise + num_spans)
    targets = np.where(is_noise, tokens, sentinel)[is_noise | (span_start == 1)].reshape(B, num_noise + num_spans)
    return np.concatenate([inputs, eos], axis=1), np.concatenate([targets, eos], axis=1)

# prepare: open the source, tokenise, write the shards, write meta.json
def prepare(dataset="c4", tokenizer="t5", out_dir="data/c4", vocab_size=32000, max_train_tokens=0, num_proc=1,
            text_field="text", shard_tokens=100_000_000, val_fraction=0.005, max_val_tokens=10_000_000):
    """Tokenise dataset into out_dir and return its meta; a rerun continues where a run stopped."""
    settings = {"dataset": dataset, "text_field": text_field, "tokenizer": tokenizer,
                "vocab_size": vocab_size if tokenizer == "train" else None,
                "max_train_tokens": max_train_tokens or None, "shard_tokens": shard_tokens,
                "val_fraction": val_fraction, "max_val_tokens": max_val_tokens}
    meta = _resume(out_dir, settings)
    if meta is not None and meta["complete"]:
        return load_meta(out_dir)

    def docs(split):
        return documents(dataset, split, text_field, val_fraction)

    def save():
        with atomic_write(os.path.join(out_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    if meta is None:  # a new folder: nothing is written before the source gives a document
        if next(docs("train"), None) is None:
            raise UserError(f"{dataset} has no training documents (is it empty? documents are its non-empty "
                            f"'{text_field}' values; local files hold out one in {round(1 / val_fraction)} for val)")
        os.makedirs(out_dir, exist_ok=True)
        meta = {"settings": settings, **_write_tokenizer(tokenizer, vocab_size, out_dir, docs), "val": [],
                "shards": [], "complete": False}
        save()
    tok = Tokenizer(meta["tokenizer_file"] and os.path.join(out_dir, meta["tokenizer_file"]))
    _write_shards(docs("val"), tok, num_proc, meta["val"], max_val_tokens, max_val_tokens, save,
                  lambda i: os.path.join(out_dir, "val.bin"), "val")
    _write_shards(docs("train"), tok, num_proc, meta["shards"], shard_tokens, max_train_tokens or math.inf, save,
                  lambda i: os.path.join(out_dir, shard_name(i)), "train")
    meta["complete"] = True
    save()
    meta = load_meta(out_dir)
    print(f"{out_dir}: {meta['train_tokens']:,} train tokens in {len(meta['shards'])} shards, {meta['val_tokens']:,} "
          f"val tokens, vocab {meta['vocab_size']} (model {meta['model_vocab_size']})")
    if meta["val_tokens"] < 568:
        print(f"warning: val.bin holds {meta['val_tokens']} tokens, fewer than one window of input_length 512 (568 "
              f"tokens): raise --val_fraction or use a larger corpus")
    return meta

def _resume(out_dir, settings):
    """The meta an earlier run left in out_dir (None for a new folder), less the files damaged since."""
    if not os.path.isfile(os.path.join(out_dir, "meta.json")):
        return None
    meta = _read_meta(os.path.join(out_dir, "meta.json"))
    if meta["settings"] != settings:
        changed = ", ".join(f"{k} {meta['settings'].get(k)!r} -> {v!r}" for k, v in settings.items()
                            if meta["settings"].get(k) != v)
        raise UserError(f"{out_dir} was prepared with other settings ({changed}): use another --out_dir, or delete "
                        f"it to start over")
    damaged = damaged_files(out_dir, meta)
    if not damaged:
        return meta
    print(f"{next(iter(damaged.values()))}: rebuilding it")
    if meta["tokenizer_file"] in damaged:
        return None
    first = next((i for i in range(len(meta["shards"])) if shard_name(i) in damaged), None)
    return dict(meta, val=[] if "val.bin" in damaged else meta["val"], shards=meta["shards"][:first], complete=False)

def _write_tokenizer(tokenizer, vocab_size, out_dir, docs):
    """A new folder's tokenizer, as meta.json records it; never a tokenizer.model another run left."""
    spiece = None
    if tokenizer == "train":
        print(f"training a {vocab_size}-piece sentencepiece model on the corpus")
        spiece = _train_spiece(docs("train"), vocab_size)
    elif tokenizer != "gpt2":
        source = t5_spiece() if tokenizer == "t5" else tokenizer
        if not os.path.isfile(source):
            raise UserError(f"tokenizer '{tokenizer}' is not 't5', 'gpt2', 'train' or a sentencepiece .model file")
        Tokenizer(source)  # no sentencepiece model: stop before copying it
        with open(source, "rb") as f:
            spiece = f.read()
    file = spiece and "tokenizer.model"
    if file:
        with atomic_write(os.path.join(out_dir, file)) as f:
            f.write(spiece)
    tok = Tokenizer(file and os.path.join(out_dir, file))
    if tok.vocab_size > 1 << 16:
        raise UserError(f"the tokenizer's {tok.vocab_size} ids don't fit uint16: use one of at most {MAX_VOCAB_SIZE}")
    return {"tokenizer_file": file, "tokenizer_sha256": spiece and hashlib.sha256(spiece).hexdigest(),
            "vocab_size": tok.vocab_size, "model_vocab_size": math.ceil(tok.vocab_size / 128) * 128,
            "eos_id": tok.eos_id, "pad_id": tok.pad_id, "first_sentinel_id": tok.first_sentinel_id}

def shard_name(i):
    return f"train_{i:03d}.bin"

def _write_shards(docs, tok, num_threads, shards, shard_tokens, max_tokens, save, path, desc):
    """Tokenise docs into files path(i) of shard_tokens ids; `shards`: those done, and where each next begins"""
    doc, offset = (shards[-1]["next_doc"], shards[-1]["next_offset"]) if shards else (0, 0)
    done = sum(s["tokens"] for s in shards)
    if done >= max_tokens or (shards and shards[-1]["tokens"] < shard_tokens):
        return  # finished before: only the last file is short
    pieces, filled = [], 0  # of the file being filled

    def write(next_doc, next_offset):
        with atomic_write(path(len(shards))) as f:
            f.writelines(piece.tobytes() for piece in pieces)
        shards.append({"tokens": filled, "next_doc": next_doc, "next_offset": next_offset})
        save()
    chunks = encoded_chunks(itertools.islice(docs, doc, None), tok, num_threads)
    total = max_tokens if max_tokens < math.inf else None
    with closing(chunks), tqdm(desc=desc, total=total, initial=done, unit="tok", unit_scale=True) as bar:
        for ids, lengths in chunks:
            ends = np.cumsum(lengths)
            pos, offset = offset, 0  # the first document's first `offset` tokens are in the previous file
            while pos < len(ids) and done < max_tokens:
                n = int(min(len(ids) - pos, shard_tokens - filled, max_tokens - done))
                pieces.append(ids[pos: pos + n])
                pos, filled, done = pos + n, filled + n, done + n
                if filled == shard_tokens or done == max_tokens:
                    j = int(np.searchsorted(ends, pos, side="right"))  # the document the next file starts in
                    write(doc + j, int(pos - (ends[j - 1] if j else 0)))
                    pieces, filled = [], 0
            bar.update(len(ids))
            doc += len(lengths)
            if done >= max_tokens:
                return
        if filled or not shards:  # the data ran out: the last file is short
            write(doc, 0)

def _chunks(docs, chunk_chars=1 << 20):
    # big enough to amortise handing it to a thread, small enough to keep every thread busy to the end
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if chars >= chunk_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk

def encoded_chunks(docs, tok, num_threads):
    """(ids, document lengths) of docs' chunks in order, tokenised in threads (the tokenizers release the GIL), at
    most 2 chunks per thread ahead, so that a stream is never read far ahead"""
    with ThreadPoolExecutor(num_threads) as pool:
        pending = deque()
        for chunk in _chunks(docs):
            pending.append(pool.submit(tok.encode_documents, chunk))
            if len(pending) >= 2 * num_threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

# sources: every one gives the same documents in the same order on every run
def documents(dataset, split, text_field="text", val_fraction=0.005):
    """The documents of split 'train' or 'val'. Sources without a validation split hold out every
    round(1 / val_fraction)-th document, the first included, so that even a small file has a val set."""
    name = dataset.lower()
    if name == "pydoc":
        texts, val_fraction = pydoc_documents(), max(val_fraction, 0.05)  # 0.5% of 2 MB would be 4 documents
    elif os.path.exists(dataset) or name.endswith(LOCAL_EXTENSIONS) or dataset.startswith((".", "/", "~")):
        texts = _local_texts(dataset, text_field)
    else:
        import datasets
        repo_id, config_name = ("allenai/c4", "en") if name == "c4" else (dataset, None)
        hub_check(repo_id, "dataset", "use --dataset=pydoc (offline) or a local file")
        splits = datasets.load_dataset(repo_id, config_name, streaming=True)
        if "validation" in splits:  # the dataset's own: nothing is held out of train
            texts, val_fraction = _column(splits["train" if split == "train" else "validation"], text_field), 1.0
        else:
            texts = _column(splits["train"], text_field)
    docs = (text.strip() for text in texts if text and text.strip())
    every = max(2, round(1 / val_fraction)) if val_fraction < 1 else None
    return docs if every is None else (d for i, d in enumerate(docs) if (i % every == 0) == (split == "val"))

def pydoc_documents():
    """~2 MB of English with no download: the pydoc topics, then the standard library's docstrings"""
    import ast
    import sysconfig
    import pydoc_data.topics
    for name in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[name]
    for folder, subfolders, files in os.walk(sysconfig.get_paths()["stdlib"]):
        # test suites' docstrings are mostly one-line "Test that ..." notes
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "test", "tests", "__pycache__"))
        for file in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):  # lib2to3's deliberately broken test data
                continue
            docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            yield "\n\n".join(d for d in docstrings if d)

def _local_texts(path, text_field):
    """The text_field values of a local file, or a .txt's paragraphs; None where a record has none."""
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder: pass one file of it, or a Hub dataset name")
    if not os.path.isfile(path):
        raise UserError(f"input file {path} not found (datasets are 'c4', a Hub name, 'pydoc' or a local "
                        f"{'/'.join(LOCAL_EXTENSIONS)} file)")
    if not path.lower().endswith(LOCAL_EXTENSIONS):
        raise UserError(f"{path} is not a {'/'.join(LOCAL_EXTENSIONS)} file: its extension says how to read it")
    name, opener = path.lower().removesuffix(".gz"), gzip.open if path.lower().endswith(".gz") else open
    with reading(path):
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq
            yield from (text for batch in pq.ParquetFile(path).iter_batches(columns=[text_field])
                        for text in batch.column(0).to_pylist())
        elif name.endswith(".txt"):
            with opener(path, "rt", encoding="utf-8") as f:  # paragraphs are separated by blank lines
                yield from ("".join(lines) for blank, lines in itertools.groupby(f, lambda line: not line.strip())
                            if not blank)
        else:
            with opener(path, "rt", encoding="utf-8-sig") as f:
                head = f.read(1 << 12).lstrip()
                if head.startswith("["):  # one JSON array; C4's .json files are JSON Lines
                    f.seek(0)
                    yield from (record.get(text_field) for record in json.load(f))
                elif head:
                    yield from _json_lines(path, text_field)

def _json_lines(path, text_field):
    # pyarrow parses just this field, in its own threads: the cores are for tokenising
    import pyarrow as pa
    import pyarrow.json as paj
    options = paj.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]),
                               unexpected_field_behavior="ignore")
    rows = 0
    try:
        for batch in paj.open_json(pa.input_stream(path), parse_options=options):  # .gz decompressed
            if rows == 0 and batch.column(0).null_count == len(batch):
                fields = paj.open_json(pa.input_stream(path)).schema.names
                raise UserError(f"{path} has no '{text_field}' field (it has {', '.join(fields)}): set --text_field")
            rows += len(batch)
            yield from batch.column(0).to_pylist()
    except pa.ArrowInvalid as e:  # pyarrow counts rows from the start of the block it was parsing
        reason = re.sub(r"in row (\d+)", lambda m: f"on line {rows + int(m[1]) + 1}", str(e))
        raise UserError(f"{path} is not JSON Lines with a string '{text_field}' field: {reason}") from None

def _column(split, text_field):
    for batch in split.iter(batch_size=1000):  # not a slow dict per row
        if text_field not in batch:
            raise UserError(f"the dataset has no '{text_field}' field (it has {', '.join(batch)}): set --text_field")
        yield from batch[text_field]

def hub_check(repo_id, repo_type, hint):
    """Fail in seconds, not after minutes of retries, when the Hub can't be reached or has no such repo."""
    from huggingface_hub import HfApi
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=3)
    except Exception as e:  # offline, no such or a private repo, the http client's errors
        raise UserError(f"can't get the {repo_type} '{repo_id}' from the Hugging Face Hub ({type(e).__name__}): check "
                        f"the name, or {hint}") from None

# tokenizers, each with 100 sentinels appended to its vocab
class Tokenizer:
    """A sentencepiece model_file with T5's conventions (pad 0, eos 1, unk 2, <extra_id_i> = pieces + 99 - i), or
    without one tiktoken's GPT-2 BPE (eos <|endoftext|>, <extra_id_i> = 50356 - i, pad 50357)."""
    def __init__(self, model_file=None):
        if model_file:
            import sentencepiece as spm
            with reading(model_file, "{path} can't be read as a sentencepiece model ({reason})"):
                self.sp = spm.SentencePieceProcessor(model_file=model_file)
            self.vocab_size = self.sp.get_piece_size() + NUM_SENTINELS
            self.eos_id, self.pad_id, self.unk_id = self.sp.eos_id(), self.sp.pad_id(), self.sp.unk_id()
            self.first_sentinel_id = self.vocab_size - 1
            self.encode, self._decode = self.sp.encode, self.sp.decode
            return
        import tiktoken
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except OSError as e:
            raise UserError(f"tiktoken could not download GPT-2's BPE files ({type(e).__name__}); offline, use "
                            f"--tokenizer=train or a local sentencepiece .model file") from None
        self.eos_id, self.unk_id = self.enc.eot_token, None  # byte-level BPE has no unknown token
        self.first_sentinel_id = self.enc.n_vocab + NUM_SENTINELS - 1
        self.pad_id = self.first_sentinel_id + 1
        self.vocab_size = self.pad_id + 1
        # ordinary: a text that contains "<|endoftext|>" is just text
        self.encode, self._decode = self.enc.encode_ordinary, self.enc.decode

    def encode_documents(self, texts):
        """(uint16 ids of all texts, each followed by EOS; each one's length)"""
        if hasattr(self, "sp"):  # int arrays, not lists: a Python int per token is what holds the GIL
            ids = self.sp.encode(texts, add_eos=True, num_threads=1, out_type="numpy")
        else:
            ids = [self.encode(text) + [self.eos_id] for text in texts]
        return np.concatenate(ids).astype(np.uint16), np.array([len(x) for x in ids], dtype=np.int64)

    def is_sentinel(self, i):
        return self.first_sentinel_id - NUM_SENTINELS < i <= self.first_sentinel_id

    def decode(self, ids, skip_special_tokens=False):
        """text as T5's tokenizer shows it, or as HF's skip_special_tokens=True (which Tk-Instruct scores)"""
        skipped = {self.pad_id, *((self.eos_id, self.unk_id) if skip_special_tokens else ())}
        parts, run = [], []
        for i in map(int, ids):
            if self.is_sentinel(i) and not skip_special_tokens:
                parts += [self._decode(run), f"<extra_id_{self.first_sentinel_id - i}>"]
                run = []
            elif not self.is_sentinel(i) and i not in skipped and i < self.vocab_size:  # vocab padded past ours
                run.append(i)
        return " ".join(part for part in parts + [self._decode(run)] if part)

def t5_spiece():
    """T5 v1.1's sentencepiece model (t5-v1_1, flan-t5 and nanoT5 share it), from the Hub cache or the Hub."""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download("google/t5-v1_1-base", "spiece.model", local_files_only=True)
    except FileNotFoundError:  # not cached yet
        hub_check("google/t5-v1_1-base", "model", "pass a local copy of T5's spiece.model instead")
        return hf_hub_download("google/t5-v1_1-base", "spiece.model")

def _train_spiece(texts, vocab_size, max_chars=20_000_000):
    """A unigram sentencepiece model with T5's special ids, trained on the first max_chars characters of texts."""
    import sentencepiece as spm
    lines, chars = [], 0
    for text in texts:  # read before training, so that a failure to read the corpus is reported as itself
        lines += [line for line in text.splitlines() if line.strip()]
        chars += len(text)
        if chars >= max_chars:
            break
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                       model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                       num_threads=8, minloglevel=2)  # fixed: the model depends on it
    except RuntimeError as e:  # e.g. "Vocabulary size too high (8000). Please set it to a value <= 3012."
        reason = str(e).split("] ")[-1].rstrip(".")
        fix = "; adjust --vocab_size" if "ocabulary size" in reason else ""
        raise UserError(f"sentencepiece training failed: {reason}{fix}") from None
    return model.getvalue()

# reading a prepared folder back
def _read_meta(path):
    with reading(path, "{path} is not the meta.json prepare.py writes ({reason}): delete its folder and prepare it "
                       "again"), open(path, encoding="utf-8") as f:
        meta = json.load(f)
        missing = [key for key in META_KEYS if key not in meta]
        if missing:
            raise KeyError(missing[0])
    return meta

def load_meta(data_dir):
    """meta.json of a complete prepared folder, with data_dir, source, train_shards and each split's counts"""
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        raise UserError(f"{data_dir} holds no prepared data (no meta.json): run e.g. `python prepare.py "
                        f"--dataset=c4 --out_dir={data_dir}` or `python prepare.py --dataset=pydoc --tokenizer=train "
                        f"--vocab_size=1000 --out_dir={data_dir}`")
    meta = _read_meta(os.path.join(data_dir, "meta.json"))
    if not meta["complete"]:
        raise UserError(f"{data_dir} is not completely prepared: finish it with "
                        f"`{prepare_command(meta['settings'], data_dir)}`")
    meta = dict(meta, data_dir=os.path.abspath(data_dir), source=meta["settings"]["dataset"],
                train_shards=list(map(shard_name, range(len(meta["shards"])))))
    for split, files in (("train", meta["shards"]), ("val", meta["val"])):
        meta[f"{split}_tokens"] = sum(file["tokens"] for file in files)
        meta[f"{split}_documents"] = files[-1]["next_doc"] + (files[-1]["next_offset"] > 0)  # the last one, if cut
    return meta

def damaged_files(data_dir, meta, names=None):
    """{name: what is wrong} for the named files (by default all) that are not as meta.json describes them"""
    tokens = {shard_name(i): shard["tokens"] for i, shard in enumerate(meta["shards"])}
    if meta["val"]:
        tokens["val.bin"] = meta["val"][0]["tokens"]
    damaged = {}
    for name in names or [name for name in (meta["tokenizer_file"], *tokens) if name]:
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            damaged[name] = f"{path} is missing"
        elif name == meta["tokenizer_file"]:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != meta["tokenizer_sha256"]:
                    damaged[name] = f"{path} is not the tokenizer {data_dir} was prepared with (its sha256 differs)"
        elif os.path.getsize(path) != 2 * tokens[name]:
            size = os.path.getsize(path)
            damaged[name] = (f"{path} holds {size // 2:,} tokens{' and a byte' if size % 2 else ''}, not the "
                             f"{tokens[name]:,} of meta.json")
    return damaged

def prepare_command(settings, data_dir):
    """the command that made a prepared folder, and rebuilds its damaged files"""
    flags = " ".join(f"--{key}={shlex.quote(str(value))}" for key, value in settings.items() if value is not None)
    return f"python prepare.py {flags} --out_dir={shlex.quote(os.path.abspath(data_dir))}"

def check_files(meta, names):
    for problem in damaged_files(meta["data_dir"], meta, names).values():
        raise UserError(f"{problem}: rebuild it with `{prepare_command(meta['settings'], meta['data_dir'])}`")

def load_tokenizer(meta, hf_folder=""):
    """A prepared folder's tokenizer (from its path, or its meta as checkpoints keep it), checked; without meta,
    T5's: hf_folder's spiece.model, or the Hub's."""
    if not meta:
        spiece = os.path.join(hf_folder, "spiece.model")
        return Tokenizer(spiece if os.path.isfile(spiece) else t5_spiece())
    meta = load_meta(meta) if isinstance(meta, str) else meta
    if meta["tokenizer_file"]:
        check_files(meta, [meta["tokenizer_file"]])
    return Tokenizer(meta["tokenizer_file"] and os.path.join(meta["data_dir"], meta["tokenizer_file"]))

@functools.lru_cache(maxsize=1)
def _permutation(seed, num_windows, epoch):
    return np.random.default_rng([seed, 0, epoch]).permutation(num_windows)

class SpanCorruptionBatches:
    """Span-corrupted batches of a prepared folder. Row r of step k's global batch is a function of (seed, k, r),
    so that resuming, more GPUs or another grad_accum_steps change nothing; val's rows ignore the seed, so that
    eval losses compare across runs."""
    def __init__(self, data_dir, split, batch_size, input_length, noise_density, mean_noise_span_length, seed,
                 vocab_size):
        self.meta = load_meta(data_dir)
        if vocab_size != self.meta["model_vocab_size"]:
            raise UserError(f"{data_dir} was tokenised with '{self.meta['settings']['tokenizer']}' for a model vocab "
                            f"of {self.meta['model_vocab_size']}, but the model's vocab_size is {vocab_size}: use "
                            f"data prepared with the model's tokenizer")
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.noise = (noise_density, mean_noise_span_length, self.meta["first_sentinel_id"], self.meta["eos_id"])
        self.raw_length, self.targets_length = compute_input_and_target_lengths(
            input_length, noise_density, mean_noise_span_length)
        names = self.meta["train_shards"] if split == "train" else ["val.bin"]
        check_files(self.meta, names)
        self.shards = [np.memmap(os.path.join(data_dir, name), dtype=np.uint16, mode="r") for name in names]
        for name, shard in zip(names, self.shards):
            if len(shard) and shard.max() >= vocab_size:
                raise UserError(f"{os.path.join(data_dir, name)} holds token id {shard.max()}, beyond the model's "
                                f"vocab_size {vocab_size}: the data is corrupt or from another tokenizer; make it "
                                f"again with `{prepare_command(self.meta['settings'], data_dir)}`")
        windows = [len(s) // self.raw_length for s in self.shards]  # each shard's, not overlapping
        self.num_windows = sum(windows)
        if self.num_windows == 0:
            raise UserError(f"the {split} data in {data_dir} has fewer than {self.raw_length} tokens, not one "
                            f"window: prepare more data or lower input_length")
        self.first_window = np.cumsum([0] + windows)  # of each shard

    def _windows(self, sample):
        if self.split != "train":
            return sample % self.num_windows
        windows = np.empty_like(sample)
        epoch = sample // self.num_windows
        for e in np.unique(epoch):  # each epoch in its own order
            permutation = _permutation(self.seed, self.num_windows, e)
            windows[epoch == e] = permutation[sample[epoch == e] % self.num_windows]
        return windows

    def get(self, step, micro_step=0, grad_accum_steps=1, rank=0, world_size=1, device="cpu"):
        """(input_ids (b, input_length), labels (b, targets_length)) int64 on device: slice micro_step * world_size +
        rank of the global batch of `step`, b = batch_size / (grad_accum_steps * world_size) rows"""
        b = micro_batch_size(self.batch_size, grad_accum_steps, world_size)
        rows = range((micro_step * world_size + rank) * b, (micro_step * world_size + rank + 1) * b)
        windows = self._windows(step * self.batch_size + np.array(rows))
        shard = np.searchsorted(self.first_window, windows, side="right") - 1
        start = (windows - self.first_window[shard]) * self.raw_length
        raw = np.stack([self.shards[s][i: i + self.raw_length] for s, i in zip(shard, start)])  # (b, raw_length)
        rngs = [np.random.default_rng([self.seed, 1, step, r] if self.split == "train" else [2, step, r]) for r in rows]
        return tuple(torch.from_numpy(t).to(device) for t in span_corrupt(raw, *self.noise, rngs))

class Prefetcher:
    """prefetcher(step) -> get_batch(micro_step), this rank's micro-batches of `step` for optim.train_step. One
    thread builds them while the caller runs step - 1 (the order of steps is known: no DataLoader workers), and on
    CUDA pins them, so that the copy to the GPU is asynchronous."""
    def __init__(self, data, grad_accum_steps, rank, world_size, device):
        self.data, self.grad_accum_steps, self.rank, self.world_size = data, grad_accum_steps, rank, world_size
        self.device = torch.device(device)
        pin_on = {}
        if self.device.type == "cuda":  # the thread pins on this rank's GPU, not on GPU 0 (a context there per rank)
            gpu = torch.cuda.current_device() if self.device.index is None else self.device.index
            pin_on = dict(initializer=torch.cuda.set_device, initargs=(gpu,))
        self.pool = ThreadPoolExecutor(1, **pin_on)
        self.next = (None, None)  # (step, future of its host micro-batches)

    def _host(self, step):
        batches = [self.data.get(step, m, self.grad_accum_steps, self.rank, self.world_size)
                   for m in range(self.grad_accum_steps)]
        return [[t.pin_memory() for t in batch] for batch in batches] if self.device.type == "cuda" else batches

    def __call__(self, step):
        next_step, future = self.next
        batches = future.result() if next_step == step else self._host(step)
        self.next = (step + 1, self.pool.submit(self._host, step + 1))
        batches = [[t.to(self.device, non_blocking=True) for t in batch] for batch in batches]
        return lambda micro_step: (*batches[micro_step], None)  # pre-training windows are never padded

    def close(self):
        """stop the thread, dropping a batch built ahead that no step will use"""
        self.pool.shutdown(cancel_futures=True)

# what an evaluation shows: two examples filled in, and how many spans the model gets right
def shown_length(tok, ids, num_spans=3):
    """How many of ids (a fill or a true fill) hold their first num_spans spans: up to the next sentinel or EOS."""
    ends = [i for i, token in enumerate(ids) if token in (tok.eos_id, tok.first_sentinel_id - num_spans)]
    return ends[0] if ends else len(ids)

def show_fill(tok, inputs, fill, truth, num_spans=3, context=6):
    """One span-corrupted example as an evaluation prints it: the input around its first num_spans sentinels, and
    the model's and the true fill of those."""
    inputs, fill, truth = (np.asarray(ids).tolist() for ids in (inputs, fill, truth))
    shown = [i for i, token in enumerate(inputs) if tok.is_sentinel(token)][:num_spans]
    keep = sorted({j for i in shown for j in range(max(i - context, 0), min(i + context + 1, len(inputs)))})
    runs = np.split(np.array(keep), np.nonzero(np.diff(keep) > 1)[0] + 1) if keep else []  # runs of positions
    text = " ... ".join(tok.decode([inputs[j] for j in run]).strip() for run in runs)
    model, true = (tok.decode(ids[:shown_length(tok, ids, num_spans)]).strip() for ids in (fill, truth))
    return {"input": ("... " if keep and keep[0] > 0 else "") + text + " ...", "model": model, "truth": true}

def span_accuracy(logits, labels, first_sentinel_id):
    """(spans right, spans) of a batch under teacher forcing, as tensors: a noise span is right when the model's
    argmax is every one of its tokens and then the token that ends it (the next sentinel, or EOS)."""
    sentinel = (labels <= first_sentinel_id) & (labels > first_sentinel_id - NUM_SENTINELS)
    span = sentinel.long().cumsum(1) - sentinel.long()  # (B, T): the span a label is in or ends; 0: the first sentinel
    wrong = ((logits.argmax(-1) != labels) & (span > 0)).float()
    wrong_per_span = torch.zeros(labels.size(0), labels.size(1) + 1, device=labels.device).scatter_add_(1, span, wrong)
    return sentinel.sum() - (wrong_per_span[:, 1:] > 0).sum(), sentinel.sum()

def span_fills(labels, first_sentinel_id):
    """the fills, as tuples of ids, of every noise span in a (B, T) batch of labels, each row ending with EOS"""
    fills = []
    for token in (token for row in labels.tolist() for token in row[:-1]):
        if first_sentinel_id - NUM_SENTINELS < token <= first_sentinel_id:
            fills.append(())
        else:
            fills[-1] += (token,)
    return fills

def unigram_baseline(train, val, val_steps, train_spans=10_000):
    """(the commonest training fill, span accuracy on val always writing it): the score of ignoring the input"""
    first, fills, step = train.meta["first_sentinel_id"], [], 0
    while len(fills) < train_spans:
        fills, step = fills + span_fills(train.get(step)[1], first), step + 1
    common = Counter(fills).most_common(1)[0][0]
    val_fills = [fill for step in range(val_steps) for fill in span_fills(val.get(step)[1], first)]
    return common, val_fills.count(common) / len(val_fills)

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    try:
        prepare(**config)
    except KeyboardInterrupt:
        raise SystemExit("interrupted: finished shards are kept, run the same command again to continue")
