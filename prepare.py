"""
Tokenises a corpus into uint16 shards for T5 pre-training, and reads a prepared folder back: its
meta.json, its files checked, its tokenizer. data.py makes the batches.
    python prepare.py                                                # C4 en, streamed, T5's tokens
    python prepare.py --dataset=c4 --max_train_tokens=4_800_000_000  # what nanoT5's recipe reads
    python prepare.py --dataset=my.jsonl.gz --tokenizer=train --vocab_size=16000 --out_dir=data/my
    python prepare.py --dataset=pydoc --tokenizer=train --vocab_size=1000 --out_dir=data/pydoc
out_dir gets train_000.bin, ..., val.bin, the tokenizer and meta.json, its one state file: rerun,
the command continues where it was killed and rebuilds damaged files.
"""
import gzip
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
from tqdm import tqdm

from files import UserError, atomic_write, reading

# -------------------------------------------------------------------------------------------------
# default config for `python prepare.py`; --key=value overrides these, `valid` says what they may be
NUM_SENTINELS = 100
MAX_VOCAB_SIZE = (1 << 16) - NUM_SENTINELS  # ids are stored as uint16
valid = {}
dataset = "c4"  # 'c4', a Hub dataset, a .txt/.jsonl/.json(.gz)/.parquet file, 'pydoc' (offline)
text_field = "text"
tokenizer = "t5"  # 't5', a sentencepiece .model file, 'gpt2', 'train' (a new sentencepiece model)
vocab_size = 32000  # pieces of the trained model, for tokenizer='train'
out_dir = "data/c4"
valid.update(dataset="non-empty", text_field="non-empty", tokenizer="non-empty",
             vocab_size=f"in [1, {MAX_VOCAB_SIZE}]", out_dir="folder")
max_train_tokens = 0  # stop after this many train tokens; 0 = the whole dataset
num_proc = os.cpu_count()  # tokenising threads
shard_tokens = 100_000_000  # 200 MB per shard
val_fraction = 0.005  # documents held out of a dataset that has no validation split
max_val_tokens = 10_000_000
valid.update(max_train_tokens=">= 0", num_proc="> 0", shard_tokens="> 0", val_fraction="in (0, 1)",
             max_val_tokens="> 0")
# -------------------------------------------------------------------------------------------------

LOCAL_EXTENSIONS = (".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt.gz", ".parquet")
TOKENIZER_IDS = ("vocab_size", "eos_id", "pad_id", "first_sentinel_id")  # as the tokenizer says
META_KEYS = ("settings", "tokenizer_file", "tokenizer_sha256", "model_vocab_size", *TOKENIZER_IDS, "val",
             "shards", "complete")

# prepare: open the source, tokenise, write the shards, write meta.json
def prepare(dataset="c4", tokenizer="t5", out_dir="data/c4", vocab_size=32000, max_train_tokens=0,
            num_proc=1, text_field="text", shard_tokens=100_000_000, val_fraction=0.005,
            max_val_tokens=10_000_000):
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
                            f"'{text_field}' values; a local file holds out one in {round(1 / val_fraction)})")
        os.makedirs(out_dir, exist_ok=True)
        tokenizer_meta = _write_tokenizer(tokenizer, vocab_size, out_dir, docs)
        meta = {"settings": settings, **tokenizer_meta, "val": [], "shards": [], "complete": False}
        save()
    tok = Tokenizer(meta["tokenizer_file"] and os.path.join(out_dir, meta["tokenizer_file"]))
    _write_shards(docs("val"), tok, num_proc, meta["val"], max_val_tokens, max_val_tokens, save,
                  lambda i: os.path.join(out_dir, "val.bin"), "val")
    _write_shards(docs("train"), tok, num_proc, meta["shards"], shard_tokens, max_train_tokens or math.inf,
                  save, lambda i: os.path.join(out_dir, shard_name(i)), "train")
    meta["complete"] = True
    save()
    meta = load_meta(out_dir)
    print(f"{out_dir}: {meta['train_tokens']:,} train tokens in {len(meta['shards'])} shards, "
          f"{meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']} (model {meta['model_vocab_size']})")
    if meta["val_tokens"] < 568:
        print(f"warning: val.bin holds {meta['val_tokens']} tokens, fewer than one window of input_length "
              f"512 (568 tokens): raise --val_fraction or use a larger corpus")
    return meta

def _resume(out_dir, settings):
    """the meta an earlier run left in out_dir (None: a new folder), less the files damaged since"""
    if not os.path.isfile(os.path.join(out_dir, "meta.json")):
        return None
    meta = _read_meta(os.path.join(out_dir, "meta.json"))
    if meta["settings"] != settings:
        changed = ", ".join(f"{k} {meta['settings'].get(k)!r} -> {v!r}" for k, v in settings.items()
                            if meta["settings"].get(k) != v)
        raise UserError(f"{out_dir} was prepared with other settings ({changed}): use another --out_dir, or "
                        f"delete it to start over")
    damaged = damaged_files(out_dir, meta)
    if not damaged:
        return meta
    print(f"{next(iter(damaged.values()))}: rebuilding it")
    if meta["tokenizer_file"] in damaged:
        return None
    first = next((i for i in range(len(meta["shards"])) if shard_name(i) in damaged), None)
    val = [] if "val.bin" in damaged else meta["val"]
    return dict(meta, val=val, shards=meta["shards"][:first], complete=False)

def _write_tokenizer(tokenizer, vocab_size, out_dir, docs):
    """a new folder's tokenizer, as meta.json records it; never a tokenizer another run left"""
    spiece = None
    if tokenizer == "train":
        print(f"training a {vocab_size}-piece sentencepiece model on the corpus")
        spiece = _train_spiece(docs("train"), vocab_size)
    elif tokenizer != "gpt2":
        source = t5_spiece() if tokenizer == "t5" else tokenizer
        if not os.path.isfile(source):
            raise UserError(f"tokenizer '{tokenizer}' is not t5, gpt2, train or a .model file")
        Tokenizer(source)  # no sentencepiece model: stop before copying it
        with open(source, "rb") as f:
            spiece = f.read()
    file = spiece and "tokenizer.model"
    if file:
        with atomic_write(os.path.join(out_dir, file)) as f:
            f.write(spiece)
    tok = Tokenizer(file and os.path.join(out_dir, file))
    if tok.vocab_size > 1 << 16:
        raise UserError(f"the tokenizer's {tok.vocab_size} ids don't fit uint16: use at most {MAX_VOCAB_SIZE}")
    return {"tokenizer_file": file, "tokenizer_sha256": spiece and hashlib.sha256(spiece).hexdigest(),
            "model_vocab_size": tok.model_vocab_size,
            **{key: getattr(tok, key) for key in TOKENIZER_IDS}}

def shard_name(i):
    return f"train_{i:03d}.bin"

def _write_shards(docs, tok, num_threads, shards, shard_tokens, max_tokens, save, path, desc):
    """Tokenise docs into files path(i) of shard_tokens ids; shards: those done, and where the next begins"""
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
            pos, offset = offset, 0  # the first document's first `offset` tokens are in the last file
            while pos < len(ids) and done < max_tokens:
                n = int(min(len(ids) - pos, shard_tokens - filled, max_tokens - done))
                pieces.append(ids[pos: pos + n])
                pos, filled, done = pos + n, filled + n, done + n
                if filled == shard_tokens or done == max_tokens:
                    j = int(np.searchsorted(ends, pos, side="right"))  # where the next file starts
                    write(doc + j, int(pos - (ends[j - 1] if j else 0)))
                    pieces, filled = [], 0
            bar.update(len(ids))
            doc += len(lengths)
            if done >= max_tokens:
                return
        if filled or not shards:  # the data ran out: the last file is short
            write(doc, 0)

def _chunks(docs, chunk_chars=1 << 20):
    # big enough to amortise handing it to a thread, small enough to keep the threads busy to the end
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
    """(ids, document lengths) of docs' chunks in order, tokenised in threads (tokenizers release the
    GIL), at most 2 chunks per thread ahead: a stream is never read far ahead"""
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
        texts = pydoc_documents()
        val_fraction = max(val_fraction, 0.05)  # 0.5% of 2 MB would be 4 documents
    elif os.path.exists(dataset) or name.endswith(LOCAL_EXTENSIONS) or dataset.startswith((".", "/", "~")):
        texts = _local_texts(dataset, text_field)
    else:
        import datasets
        repo_id, config_name = ("allenai/c4", "en") if name == "c4" else (dataset, None)
        hub_check(repo_id, "dataset", "use --dataset=pydoc (offline) or a local file")
        splits = datasets.load_dataset(repo_id, config_name, streaming=True)
        if "validation" in splits:  # the dataset's own: nothing is held out of train
            texts = _column(splits["train" if split == "train" else "validation"], text_field)
            val_fraction = 1.0
        else:
            texts = _column(splits["train"], text_field)
    docs = (text.strip() for text in texts if text and text.strip())
    every = max(2, round(1 / val_fraction))  # val_fraction 1: the source's own validation split
    return docs if val_fraction == 1 else (d for i, d in enumerate(docs) if (i % every == 0) == (split == "val"))

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
            with suppress(SyntaxError, UnicodeDecodeError, ValueError):  # lib2to3's broken test data: skipped
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(
                    node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
                yield "\n\n".join(d for d in docstrings if d)

def _local_texts(path, text_field):
    """the text_field values of a local file, or a .txt's paragraphs; None for a record with none"""
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder: pass one file of it, or a Hub dataset name")
    kinds = "/".join(LOCAL_EXTENSIONS)
    if not os.path.isfile(path):
        raise UserError(f"input file {path} not found (datasets are 'c4', a Hub name, 'pydoc' or a local "
                        f"{kinds} file)")
    if not path.lower().endswith(LOCAL_EXTENSIONS):
        raise UserError(f"{path} is not a {kinds} file: its extension says how to read it")
    name = path.lower().removesuffix(".gz")
    opener = gzip.open if path.lower().endswith(".gz") else open
    with reading(path):
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq
            yield from (text for batch in pq.ParquetFile(path).iter_batches(columns=[text_field])
                        for text in batch.column(0).to_pylist())
        elif name.endswith(".txt"):
            with opener(path, "rt", encoding="utf-8") as f:  # blank lines separate paragraphs
                paragraphs = itertools.groupby(f, lambda line: not line.strip())
                yield from ("".join(lines) for blank, lines in paragraphs if not blank)
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
        for batch in paj.open_json(pa.input_stream(path), parse_options=options):  # .gz too
            if rows == 0 and batch.column(0).null_count == len(batch):
                fields = ", ".join(paj.open_json(pa.input_stream(path)).schema.names)
                raise UserError(f"{path} has no '{text_field}' field (it has {fields}): set --text_field")
            rows += len(batch)
            yield from batch.column(0).to_pylist()
    except pa.ArrowInvalid as e:  # pyarrow counts rows from the start of the block it was parsing
        reason = re.sub(r"in row (\d+)", lambda m: f"on line {rows + int(m[1]) + 1}", str(e))
        raise UserError(f"{path} is not JSON Lines with a string '{text_field}' field: {reason}") from None

def _column(split, text_field):
    for batch in split.iter(batch_size=1000):  # not a slow dict per row
        if text_field not in batch:
            fields = ", ".join(batch)
            raise UserError(f"the dataset has no '{text_field}' field (it has {fields}): set --text_field")
        yield from batch[text_field]

def hub_check(repo_id, repo_type, hint):
    """fail in seconds, not after minutes of retries, when the Hub is out of reach or lacks the repo"""
    from huggingface_hub import HfApi
    # offline, no such or a private repo, the http client's errors
    with reading(repo_id, f"can't get the {repo_type} '{{path}}' from the Hugging Face Hub ({{kind}}): check "
                          f"the name, or {hint}"):
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=3)

# tokenizers, each with 100 sentinels appended to its vocab
class Tokenizer:
    """A sentencepiece model_file as T5 has it (pad 0, eos 1, unk 2, <extra_id_i> = pieces + 99 - i),
    or else tiktoken's GPT-2 BPE (eos <|endoftext|>, <extra_id_i> = 50356 - i, pad 50357)."""
    def __init__(self, model_file=None):
        if model_file:
            with reading(model_file, "{path} can't be read as a sentencepiece model ({reason})"):
                self.sp = spm.SentencePieceProcessor(model_file=model_file)
            self.vocab_size = self.sp.get_piece_size() + NUM_SENTINELS
            self.eos_id, self.pad_id, self.unk_id = self.sp.eos_id(), self.sp.pad_id(), self.sp.unk_id()
            self.first_sentinel_id = self.vocab_size - 1
            self.encode, self._decode = self.sp.encode, self.sp.decode
            return
        import tiktoken
        with reading("GPT-2's BPE files", "tiktoken could not download {path} ({kind}); offline, use "
                                          "--tokenizer=train or a local sentencepiece .model file", OSError):
            self.enc = tiktoken.get_encoding("gpt2")
        self.eos_id = self.enc.eot_token
        self.unk_id = None  # byte-level BPE has no unknown token
        self.first_sentinel_id = self.enc.n_vocab + NUM_SENTINELS - 1
        self.pad_id = self.first_sentinel_id + 1
        self.vocab_size = self.pad_id + 1
        # ordinary: a text that holds "<|endoftext|>" is just text
        self.encode, self._decode = self.enc.encode_ordinary, self.enc.decode

    @property
    def model_vocab_size(self):
        """the vocab of a model trained with this tokenizer: its ids, padded for fast matmuls"""
        return math.ceil(self.vocab_size / 128) * 128

    def encode_documents(self, texts):
        """(uint16 ids of all texts, each followed by EOS; each one's length)"""
        if hasattr(self, "sp"):  # int arrays, not lists: a Python int per token holds the GIL
            ids = self.sp.encode(texts, add_eos=True, num_threads=1, out_type="numpy")
        else:
            ids = [self.encode(text) + [self.eos_id] for text in texts]
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        return np.concatenate(ids).astype(np.uint16), lengths

    def is_sentinel(self, i):
        return self.first_sentinel_id - NUM_SENTINELS < i <= self.first_sentinel_id

    def decode(self, ids, skip_special_tokens=False):
        """text as T5's tokenizer shows it, or as HF's skip_special_tokens=True (Tk-Instruct scores)"""
        skipped = {self.pad_id, *((self.eos_id, self.unk_id) if skip_special_tokens else ())}
        parts = []
        run = []
        for i in map(int, ids):
            if self.is_sentinel(i) and not skip_special_tokens:
                parts += [self._decode(run), f"<extra_id_{self.first_sentinel_id - i}>"]
                run = []
            elif not self.is_sentinel(i) and i not in skipped and i < self.vocab_size:  # no padding
                run.append(i)
        return " ".join(part for part in parts + [self._decode(run)] if part)

    def shown_length(self, ids, num_spans=3):
        """how many of ids (a fill or a true fill) hold their first num_spans spans"""
        ends = [i for i, token in enumerate(ids) if token in (self.eos_id, self.first_sentinel_id - num_spans)]
        return ends[0] if ends else len(ids)

    def show_fill(self, inputs, fill, truth, num_spans=3, context=6):
        """One span-corrupted example as an evaluation prints it: the input around its first num_spans
        sentinels, and the model's and the true fill of those."""
        inputs = np.asarray(inputs).tolist()
        shown = [i for i, token in enumerate(inputs) if self.is_sentinel(token)][:num_spans]
        keep = sorted({j for i in shown for j in range(max(i - context, 0), min(i + context + 1, len(inputs)))})
        runs = np.split(np.array(keep), np.nonzero(np.diff(keep) > 1)[0] + 1) if keep else []
        text = " ... ".join(self.decode([inputs[j] for j in run]).strip() for run in runs)
        start = "... " if keep and keep[0] > 0 else ""
        fill = np.asarray(fill).tolist()
        truth = np.asarray(truth).tolist()
        return {"input": start + text + " ...",
                "model": self.decode(fill[:self.shown_length(fill, num_spans)]).strip(),
                "truth": self.decode(truth[:self.shown_length(truth, num_spans)]).strip()}

def t5_spiece():
    """T5 v1.1's sentencepiece model (flan-t5 and nanoT5 share it), from the Hub or its cache"""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download("google/t5-v1_1-base", "spiece.model", local_files_only=True)
    except FileNotFoundError:  # not cached yet
        hub_check("google/t5-v1_1-base", "model", "pass a local copy of T5's spiece.model instead")
        return hf_hub_download("google/t5-v1_1-base", "spiece.model")

def _train_spiece(texts, vocab_size, max_chars=20_000_000):
    """a unigram sentencepiece model with T5's special ids, trained on texts' first max_chars"""
    lines, chars = [], 0
    for text in texts:  # read before training: a failure to read the corpus is reported as itself
        lines += [line for line in text.splitlines() if line.strip()]
        chars += len(text)
        if chars >= max_chars:
            break
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                       model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                       minloglevel=2, num_threads=8)  # fixed: the model depends on it
    except RuntimeError as e:  # "Vocabulary size too high (8000). Please set it to a value <= 3012."
        reason = str(e).split("] ")[-1]
        bound = re.search(r"<= (\d+)| vs (\d+)", reason)  # what this corpus allows; not its advice
        fix = f"; use --vocab_size={bound[1] or bound[2]}" if bound else ""  # (about flags we lack)
        raise UserError(f"sentencepiece training failed: {reason.split('. ')[0]}{fix}") from None
    return model.getvalue()

# reading a prepared folder back
def _read_meta(path):
    message = "{path} is not the meta.json prepare.py writes ({reason}): delete its folder, prepare it again"
    with reading(path, message), open(path, encoding="utf-8") as f:
        meta = json.load(f)
        missing = [key for key in META_KEYS if key not in meta]
        if missing:
            raise KeyError(missing[0])
    return meta

def load_meta(data_dir, settings=None):
    """meta.json of a complete prepared folder, with data_dir, source, train_shards and counts.
    settings: what the caller wants there (prepare()'s), for the command that prepares it."""
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        pydoc = dict(dataset="pydoc", tokenizer="train", vocab_size=1000)
        commands = [prepare_command(made_with, data_dir) for made_with in
                    ([settings] if settings else [dict(dataset="c4"), pydoc])]
        raise UserError(f"{data_dir} holds no prepared data (no meta.json): prepare it with "
                        + " or ".join(f"`{command}`" for command in commands))
    meta = _read_meta(os.path.join(data_dir, "meta.json"))
    if not meta["complete"]:
        raise UserError(f"{data_dir} is not completely prepared: finish it with "
                        f"`{prepare_command(meta['settings'], data_dir)}`")
    meta = dict(meta, data_dir=os.path.abspath(data_dir), source=meta["settings"]["dataset"],
                train_shards=list(map(shard_name, range(len(meta["shards"])))))
    for split, files in (("train", meta["shards"]), ("val", meta["val"])):
        meta[f"{split}_tokens"] = sum(file["tokens"] for file in files)
        cut = files[-1]["next_offset"] > 0  # the last file ends inside a document
        meta[f"{split}_documents"] = files[-1]["next_doc"] + cut
    return meta

def damaged_files(data_dir, meta, names=None):
    """{name: what is wrong} for the named files (by default all) that are not as meta.json says"""
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
                    damaged[name] = f"{path} is not the tokenizer {data_dir} was prepared with (sha256)"
        elif os.path.getsize(path) != 2 * tokens[name]:
            size = os.path.getsize(path)
            byte = " and a byte" if size % 2 else ""
            damaged[name] = f"{path} holds {size // 2:,} tokens{byte}, not the {tokens[name]:,} of meta.json"
    return damaged

def prepare_command(settings, data_dir):
    """the command that made a prepared folder, and rebuilds its damaged files"""
    flags = [f"--{key}={shlex.quote(str(value))}" for key, value in settings.items() if value is not None]
    return f"python prepare.py {' '.join(flags)} --out_dir={shlex.quote(os.path.abspath(data_dir))}"

def check_files(meta, names):
    for problem in damaged_files(meta["data_dir"], meta, names).values():
        raise rebuild(meta, problem)

def rebuild(meta, problem):
    """the UserError of a prepared file that is not what meta.json says: problem, and the command that
    rebuilds it"""
    return UserError(f"{problem}: rebuild it with `{prepare_command(meta['settings'], meta['data_dir'])}`")

def load_tokenizer(meta, hf_folder="", vocab_size=None):
    """A prepared folder's tokenizer (from its path, or its meta as checkpoints keep it), checked;
    without meta, T5's: hf_folder's spiece.model, or the Hub's. With vocab_size, a model's: the
    tokenizer must make that vocab, or the model would read garbage, its sentinels at other ids."""
    if not meta:
        spiece = os.path.join(hf_folder, "spiece.model")
        if not os.path.isfile(spiece) and vocab_size not in (None, 32128):  # not T5's tokenizer's
            raise UserError(f"{hf_folder} holds no spiece.model, and its vocab of {vocab_size} is not T5's "
                            f"tokenizer's: copy the tokenizer.model its data was prepared with there as "
                            f"spiece.model")
        source = spiece
        tok = Tokenizer(spiece if os.path.isfile(spiece) else t5_spiece())
    else:
        meta = load_meta(meta) if isinstance(meta, str) else meta
        source = meta["data_dir"]
        file = meta["tokenizer_file"]
        if file:
            check_files(meta, [file])
        tok = Tokenizer(file and os.path.join(meta["data_dir"], file))
        wrong = [f"{key} {meta[key]}, not {getattr(tok, key)}" for key in TOKENIZER_IDS
                 if meta[key] != getattr(tok, key)]
        if wrong:  # an edited meta.json: its sentinels would be ordinary pieces
            raise UserError(f"{meta['data_dir']}/meta.json records {', '.join(wrong)} as its tokenizer says: "
                            f"delete it and rebuild the folder with "
                            f"`{prepare_command(meta['settings'], meta['data_dir'])}`")
    if vocab_size not in (None, tok.model_vocab_size):
        raise UserError(f"the tokenizer of {source} is not the model's: its {tok.vocab_size} ids (sentinels "
                        f"included) make a model vocab of {tok.model_vocab_size}, not its vocab_size "
                        f"{vocab_size}; use the tokenizer the model was trained with")
    return tok

if __name__ == "__main__":
    import errors  # an error, or Ctrl-C, is one line; here, as importing prepare sets no hook
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    prepare(**config)
