"""
Turns a text corpus into uint16 token shards for T5 pre-training, and reads them back as span-corrupted batches.
    python prepare.py                                               # C4 en, streamed, T5's tokenizer
    python prepare.py --dataset=c4 --max_train_tokens=4_800_000_000 # just what nanoT5's recipe consumes
    python prepare.py --dataset=my_corpus.jsonl.gz --tokenizer=train --vocab_size=16000 --out_dir=data/mine
    python prepare.py --dataset=pydoc --tokenizer=train --vocab_size=4000 --out_dir=data/pydoc  # offline
out_dir gets train_000.bin, train_001.bin, ... (shard_tokens uint16 ids each, the last one shorter), val.bin, the
tokenizer model and meta.json. Every document ends with EOS. Killed runs continue where they stopped when the same
command is run again: finished shards are kept, everything else is only ever written under a .tmp name.
The file reads in that order: span corruption, then the batch stream train.py reads (SpanCorruptionBatches, whose
global batch at step k is a pure function of (seed, k)), then prepare() writing the shards; after them the plumbing:
tokenising in threads, the sources (C4, Hub datasets, local files, pydoc) and the tokenizers.
"""
import itertools
import json
import math
import os
import shlex
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from runtime import WRITE_ERRNOS, UserError, atomic_write, commit, discard, micro_batch_size, write_error

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
             out_dir="non-empty")
max_train_tokens = 0  # stop after this many train tokens; 0 = the whole dataset
num_proc = os.cpu_count()  # tokenising threads
shard_tokens = 100_000_000  # 200 MB per shard
val_fraction = 0.005  # documents held out of a dataset that has no validation split
max_val_tokens = 10_000_000
valid.update(max_train_tokens=">= 0", num_proc="> 0", shard_tokens="> 0", val_fraction="in (0, 1)",
             max_val_tokens="> 0")
# -----------------------------------------------------------------------------------------------------------------

LOCAL_EXTENSIONS = (".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt.gz", ".parquet")
OFFLINE_OPTIONS = "use --dataset=pydoc (offline corpus) or a local .txt/.jsonl/.json(.gz)/.parquet file"

# -----------------------------------------------------------------------------------------------------------------
# span corruption, exactly as T5's random_spans_noise_mask + noise_span_to_unique_sentinel


def _noise_counts(length, noise_density, mean_noise_span_length):
    # at least one noise and one kept token; as many noise spans as kept spans so that they can alternate
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(1, round(min(num_noise, length - num_noise) / mean_noise_span_length))
    return num_noise, num_spans


def compute_input_and_target_lengths(inputs_length, noise_density, mean_noise_span_length):
    """The longest raw window whose corrupted inputs fit in inputs_length, and its targets length (T5's
    random_spans_helper): 512 -> (568, 114) at density 0.15, mean span 3."""
    # outside these the search below never ends (density 1 keeps the inputs at 3 tokens however long the window)
    if not (inputs_length >= 3 and 0 < noise_density < 1 and mean_noise_span_length >= 1):
        raise UserError(f"span corruption needs input_length >= 3 (got {inputs_length}), 0 < noise_density < 1 (got "
                        f"{noise_density}) and mean_noise_span_length >= 1 (got {mean_noise_span_length})")

    def corrupted_lengths(raw_length):
        num_noise, num_spans = _noise_counts(raw_length, noise_density, mean_noise_span_length)
        # inputs: kept tokens + one sentinel per span + EOS; targets: one sentinel per span + noise + EOS
        return raw_length - num_noise + num_spans + 1, num_noise + num_spans + 1

    raw_length = inputs_length - 1
    while corrupted_lengths(raw_length + 1)[0] <= inputs_length:
        raw_length += 1
    return raw_length, corrupted_lengths(raw_length)[1]


def span_corrupt(tokens, noise_density, mean_noise_span_length, first_sentinel_id, eos_id, rng):
    """tokens (B, L) ints -> (inputs, targets) int64 arrays. Each row gets its own random noise mask; the noise spans
    become sentinels first_sentinel_id, first_sentinel_id - 1, ... in the inputs, and the targets are each sentinel
    followed by the tokens it replaced. Both end with EOS."""
    B, L = tokens.shape
    num_noise, num_spans = _noise_counts(L, noise_density, mean_noise_span_length)

    def segment_lengths(num_items):
        # split num_items into num_spans non-empty segments uniformly at random, like T5's shuffle: segment 0 starts
        # at item 0, the other starts are a random (num_spans - 1)-subset of items 1..num_items-1, here the items
        # with the smallest of iid uniform keys
        starts = np.zeros((B, 1), dtype=np.int64)
        if num_spans > 1:
            keys = rng.random((B, num_items - 1))
            subset = np.argpartition(keys, num_spans - 2, axis=1)[:, : num_spans - 1] + 1
            starts = np.concatenate([starts, np.sort(subset, axis=1)], axis=1)
        return np.diff(starts, axis=1, append=num_items)  # (B, num_spans)

    # kept, noise, kept, noise, ...: every row starts with kept tokens and ends with noise
    lengths = np.stack([segment_lengths(L - num_noise), segment_lengths(num_noise)], axis=2).reshape(B, 2 * num_spans)
    span_start = np.zeros((B, L), dtype=np.int32)
    np.put_along_axis(span_start, np.cumsum(lengths, axis=1)[:, :-1], 1, axis=1)
    # (int32: numpy's int64 cumsum along rows is ~10x slower)
    span_num = np.cumsum(span_start, axis=1, dtype=np.int32)  # (B, L): 2k in kept span k, 2k + 1 in noise span k
    is_noise = span_num % 2 == 1
    span_start[:, 0] = 1

    # kept span k is followed by noise span k, so both are named by the same sentinel
    sentinel = first_sentinel_id - span_num // 2
    tokens = tokens.astype(np.int64)
    eos = np.full((B, 1), eos_id, dtype=np.int64)
    # inputs: kept tokens, and one sentinel in place of each noise span; targets: the reverse
    inputs = np.where(is_noise, sentinel, tokens)[~is_noise | (span_start == 1)].reshape(B, L - num_noise + num_spans)
    targets = np.where(is_noise, tokens, sentinel)[is_noise | (span_start == 1)].reshape(B, num_noise + num_spans)
    return np.concatenate([inputs, eos], axis=1), np.concatenate([targets, eos], axis=1)


# -----------------------------------------------------------------------------------------------------------------
# the batch stream


class RowGenerators:
    """One random generator per row, in place of span_corrupt's single rng: random((B, n)) draws row i from generator
    i, so that any subset of a batch's rows can be span-corrupted alone, identical to those rows of the whole batch."""

    def __init__(self, seeds):
        self.generators = [np.random.default_rng(seed) for seed in seeds]

    def random(self, shape):
        return np.stack([g.random(shape[1]) for g in self.generators])  # shape: (len(seeds), n)


class SpanCorruptionBatches:
    """Span-corrupted batches of raw_length windows of a prepared folder. Row r of the global batch of optimizer step
    k is a pure function of (seed, k, r): its window comes from a seeded permutation of all windows per epoch, its
    noise from an rng seeded with (seed, k, r). Each micro-step and DDP rank builds only its own rows, so resuming at
    step k, running on more GPUs or changing grad_accum_steps changes nothing about the data. Validation uses the
    windows of val.bin in order and noise that ignores the seed, so eval losses compare across runs."""

    def __init__(self, data_dir, split, batch_size, input_length, noise_density, mean_noise_span_length, seed,
                 vocab_size):
        self.meta = load_meta(data_dir)
        if vocab_size != self.meta["model_vocab_size"]:
            raise UserError(f"{data_dir} was tokenised with '{self.meta['tokenizer']}' for a model vocab of "
                            f"{self.meta['model_vocab_size']}, but the model's vocab_size is {vocab_size}: use "
                            f"data prepared with the model's tokenizer")
        self.split, self.batch_size, self.seed, self.vocab_size = split, batch_size, seed, vocab_size
        self.input_length, self.noise_density, self.mean_noise_span_length = (
            input_length, noise_density, mean_noise_span_length)
        self.raw_length, self.targets_length = compute_input_and_target_lengths(
            input_length, noise_density, mean_noise_span_length)
        names = self.meta["train_shards"] if split == "train" else ["val.bin"]
        for problem in damaged_files(data_dir, self.meta, names).values():
            raise UserError(f"{problem}: rebuild it with `{prepare_command(self.meta)}`")
        self.files = [os.path.join(data_dir, name) for name in names]
        self.shards = [np.memmap(path, dtype=np.uint16, mode="r") for path in self.files]
        # non-overlapping windows within each shard; the < raw_length tokens at each shard's end are dropped
        windows = [len(s) // self.raw_length for s in self.shards]
        self.num_windows = sum(windows)
        if self.num_windows == 0:
            raise UserError(f"the {split} data in {data_dir} has fewer than {self.raw_length} tokens, not one "
                            f"window: prepare more data or lower input_length")
        self.first_window = np.cumsum([0] + windows)  # of each shard
        self._permutation = (None, None)  # (epoch, permutation of all windows)

    def _windows(self, sample):
        if self.split != "train":
            return sample % self.num_windows
        windows = np.empty_like(sample)
        epoch = sample // self.num_windows
        for e in np.unique(epoch):  # a batch spans at most two epochs unless the data is tiny
            permutation = self._permutation  # one read: Prefetcher's thread may replace it meanwhile
            if permutation[0] != e:
                permutation = (e, np.random.default_rng([self.seed, 0, e]).permutation(self.num_windows))
                self._permutation = permutation
            windows[epoch == e] = permutation[1][sample[epoch == e] % self.num_windows]
        return windows

    def rows(self, step, first, count):
        """rows first .. first + count - 1 of the global batch of `step`: (count, input_length + targets_length)"""
        windows = self._windows(np.arange(step * self.batch_size + first, step * self.batch_size + first + count))
        shard = np.searchsorted(self.first_window, windows, side="right") - 1
        start = (windows - self.first_window[shard]) * self.raw_length
        raw = np.stack([self.shards[s][i: i + self.raw_length] for s, i in zip(shard, start)])  # (count, raw_length)
        top = int(raw.max())
        if top >= self.vocab_size:
            bad = self.files[shard[np.nonzero(raw.max(axis=1) == top)[0][0]]]
            raise UserError(f"{bad} holds token id {top}, beyond the model's vocab_size {self.vocab_size}: the data "
                            f"is corrupt or from another tokenizer; delete {self.meta['data_dir']} and make it again "
                            f"with `{prepare_command(self.meta)}`")
        rng = RowGenerators([[self.seed, 1, step, row] if self.split == "train" else [2, step, row]
                             for row in range(first, first + count)])
        inputs, targets = span_corrupt(raw, self.noise_density, self.mean_noise_span_length,
                                       self.meta["first_sentinel_id"], self.meta["eos_id"], rng)
        return np.concatenate([inputs, targets], axis=1)

    def micro_batch(self, step, micro_step=0, grad_accum_steps=1, rank=0, world_size=1):
        """slice micro_step * world_size + rank of the global batch of `step`, b = batch_size / (grad_accum_steps *
        world_size) rows, as one flat int64 CPU tensor: the b input rows, then the b label rows, so that one copy
        moves both"""
        b = micro_batch_size(self.batch_size, grad_accum_steps, world_size)
        rows = self.rows(step, (micro_step * world_size + rank) * b, b)
        return torch.from_numpy(np.concatenate([rows[:, : self.input_length].ravel(),
                                                rows[:, self.input_length:].ravel()]))

    def split_micro_batch(self, flat):
        """(input_ids (b, input_length), labels (b, targets_length)): views of a micro_batch, on its device"""
        b = len(flat) // (self.input_length + self.targets_length)
        n = b * self.input_length
        return flat[:n].view(b, self.input_length), flat[n:].view(b, self.targets_length)

    def get(self, step, micro_step=0, grad_accum_steps=1, rank=0, world_size=1, device="cpu"):
        """(input_ids (b, input_length), labels (b, targets_length)) int64 on device: micro_batch, built now"""
        flat = self.micro_batch(step, micro_step, grad_accum_steps, rank, world_size)
        return self.split_micro_batch(flat.to(device))


class Prefetcher:
    """
    prefetcher(step) -> get_batch(micro_step) for optim.train_step: this rank's micro-batches of `step`, the batches
    of SpanCorruptionBatches.get. While the caller runs step k, one background thread builds step k + 1, so the
    device never waits for span corruption; a step other than the one prepared (the first, or after a jump) is built
    at once, so any sequence of steps gets exactly its batches.
    A thread rather than DataLoader worker processes: numpy releases the GIL during the array work of span
    corruption, the steps come in a fixed order, and a thread needs no pickling, shared memory or extra copies of the
    shards. On CUDA the thread also pins each batch; torch's pinned-memory cache hands out a buffer only once its
    last copy to the GPU is done, so the asynchronous copy here can never read a buffer the thread is refilling.
    """

    def __init__(self, data, grad_accum_steps, rank, world_size, device):
        self.data, self.grad_accum_steps, self.rank, self.world_size = data, grad_accum_steps, rank, world_size
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        if self.pin:
            gpu = torch.cuda.current_device() if self.device.index is None else self.device.index
            # the thread pins on this rank's GPU, not on GPU 0 (which would cost every rank a CUDA context there)
            self.pool = ThreadPoolExecutor(1, initializer=torch.cuda.set_device, initargs=(gpu,))
        else:
            self.pool = ThreadPoolExecutor(1)
        self.next = (None, None)  # (step, future of its host micro-batches)

    def _host(self, step):
        flats = [self.data.micro_batch(step, m, self.grad_accum_steps, self.rank, self.world_size)
                 for m in range(self.grad_accum_steps)]
        return [flat.pin_memory() for flat in flats] if self.pin else flats

    def __call__(self, step):
        next_step, future = self.next
        flats = future.result() if next_step == step else self._host(step)
        self.next = (step + 1, self.pool.submit(self._host, step + 1))
        batches = [self.data.split_micro_batch(flat.to(self.device, non_blocking=True)) for flat in flats]
        return lambda micro_step: (*batches[micro_step], None)  # pre-training windows are never padded

    def close(self):
        """stop the thread, dropping a batch built ahead that no step will use"""
        self.pool.shutdown(cancel_futures=True)


def shown_length(tok, ids, num_spans=3):
    """How many of ids (a fill or a true fill) hold their first num_spans spans: up to the next sentinel or EOS."""
    ends = [i for i, token in enumerate(ids) if token in (tok.eos_id, tok.first_sentinel_id - num_spans)]
    return ends[0] if ends else len(ids)


def show_fill(tok, inputs, fill, truth, num_spans=3, context=6):
    """What an evaluation prints of one span-corrupted example: the corrupted input around its first num_spans
    sentinels (context tokens on each side, gaps shown as ...), and the model's fill and the true fill of those
    sentinels. inputs, fill, truth: 1-D ids; fill and truth end at EOS, as the model's output does."""
    inputs, fill, truth = (np.asarray(ids).tolist() for ids in (inputs, fill, truth))
    shown = [i for i, token in enumerate(inputs) if tok.is_sentinel(token)][:num_spans]
    keep = sorted({j for i in shown for j in range(max(i - context, 0), min(i + context + 1, len(inputs)))})
    runs = np.split(np.array(keep), np.nonzero(np.diff(keep) > 1)[0] + 1) if keep else []  # runs of positions
    text = " ... ".join(tok.decode([inputs[j] for j in run]).strip() for run in runs)
    model, true = (tok.decode(ids[:shown_length(tok, ids, num_spans)]).strip() for ids in (fill, truth))
    return {"input": ("... " if keep and keep[0] > 0 else "") + text + " ...", "model": model, "truth": true}


def load_meta(data_dir):
    """meta.json of a prepared folder, plus 'data_dir' (where the tokenizer model sits)."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise UserError(f"{data_dir} holds no prepared data (no meta.json): run e.g. `python prepare.py "
                        f"--dataset=c4 --out_dir={data_dir}` or `python prepare.py --dataset=pydoc --tokenizer=train "
                        f"--vocab_size=4000 --out_dir={data_dir}`")
    meta = _read_json(path)
    meta["data_dir"] = os.path.abspath(data_dir)
    return meta


def _read_json(path):
    """meta.json or progress.json of a prepared folder; they are written atomically, so only a hand edit breaks them"""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except ValueError:  # not JSON, not UTF-8
        obj = None
    if not isinstance(obj, dict) or "settings" not in obj:
        raise UserError(f"{path} is not the JSON prepare.py writes: delete its folder and prepare it again")
    return obj


def damaged_files(data_dir, meta, names):
    """{name: '<path> is missing' or '<path> holds n tokens, not the m of meta.json'} for each of the named files of a
    prepared folder (shards, val.bin, the tokenizer model) that is not as prepare.py wrote it. Sizes only: nothing is
    read."""
    n, full = len(meta["train_shards"]), meta["settings"]["shard_tokens"]
    # every shard is full but the last
    tokens = dict(zip(meta["train_shards"], [full] * (n - 1) + [meta["train_tokens"] - full * (n - 1)]))
    tokens["val.bin"] = meta["val_tokens"]
    damaged = {}
    for name in names:
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            damaged[name] = f"{path} is missing"
        elif name in tokens and os.path.getsize(path) != 2 * tokens[name]:
            damaged[name] = f"{path} holds {os.path.getsize(path) / 2:,g} tokens, not the {tokens[name]:,} of meta.json"
    return damaged


def prepare_command(meta):
    """The command line that made a prepared folder; run again, it rebuilds the folder's damaged files."""
    flags = " ".join(f"--{key}={shlex.quote(str(value))}" for key, value in meta["settings"].items()
                     if value is not None)
    return f"python prepare.py {flags} --out_dir={shlex.quote(meta['data_dir'])}"


def load_tokenizer(meta_or_data_dir):
    """The tokenizer of a prepared folder, from its path or its meta dict (as train.py stores it in checkpoints)."""
    meta = load_meta(meta_or_data_dir) if isinstance(meta_or_data_dir, str) else meta_or_data_dir
    model_file = meta["tokenizer_file"] and os.path.join(meta["data_dir"], meta["tokenizer_file"])
    if model_file and not os.path.isfile(model_file):
        raise UserError(f"tokenizer model {model_file} is missing: rebuild it with `{prepare_command(meta)}`")
    return _make_tokenizer(model_file)


# -----------------------------------------------------------------------------------------------------------------
# prepare


def _write_json(path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2)


class _Progress:
    """A tqdm bar in tokens/s with docs/s beside it."""

    def __init__(self, desc, total, initial=0):
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True)
        self.docs, self.t0 = 0, time.time()

    def update(self, tokens, docs):
        self.docs += docs
        self.bar.set_postfix_str(f"{self.docs / max(time.time() - self.t0, 1e-9):,.0f} docs/s", refresh=False)
        self.bar.update(tokens)

    def close(self):
        self.bar.close()


def _write_val(docs, tok, num_threads, path, max_tokens):
    tokens = num_docs = 0
    bar = _Progress("val", None)
    with atomic_write(path) as f:
        for ids, lengths in encoded_chunks(docs, tok, num_threads):
            ids = ids[: max_tokens - tokens]
            f.write(ids.tobytes())
            tokens += len(ids)
            num_docs += int(np.sum(np.cumsum(lengths) - lengths < len(ids)))  # those with a token in val.bin
            bar.update(len(ids), len(lengths))
            if tokens >= max_tokens:
                break
    bar.close()
    return {"tokens": tokens, "documents": num_docs}


def _write_train(docs, tok, num_threads, out_dir, state, shard_tokens, max_tokens, save_state):
    """Fill train_NNN.bin shards from the document stream. state['shards'] lists the finished ones, each with the
    position its successor starts at (a document index and a token offset into that document), so that a rerun
    re-tokenises from exactly there."""
    shards = state["shards"]
    next_doc, offset = (shards[-1]["next_doc"], shards[-1]["next_offset"]) if shards else (0, 0)
    done = sum(s["tokens"] for s in shards)
    if done >= max_tokens or (shards and shards[-1]["tokens"] < shard_tokens):
        return  # finished before: the last shard is short only at the end of the data
    bar = _Progress("train", max_tokens if max_tokens < float("inf") else None, initial=done)
    shard = filled = None  # the open .tmp file of the shard being written, and its tokens so far
    chunks = encoded_chunks(itertools.islice(docs, next_doc, None), tok, num_threads)
    chunk_doc = next_doc  # index of the current chunk's first document

    def finish_shard(next_doc, next_offset):
        commit(shard, os.path.join(out_dir, f"train_{len(shards):03d}.bin"))
        shards.append({"tokens": filled, "next_doc": next_doc, "next_offset": next_offset})
        save_state()

    try:
        for ids, lengths in chunks:
            ends = np.cumsum(lengths)
            pos = offset  # the first document's first `offset` tokens are already in the previous shard
            offset = 0
            while pos < len(ids) and done < max_tokens:
                if shard is None:
                    shard, filled = open(os.path.join(out_dir, f"train_{len(shards):03d}.bin.tmp"), "wb"), 0
                n = int(min(len(ids) - pos, shard_tokens - filled, max_tokens - done))
                shard.write(ids[pos: pos + n].tobytes())
                pos, filled, done = pos + n, filled + n, done + n
                if filled == shard_tokens or done == max_tokens:
                    j = int(np.searchsorted(ends, pos, side="right"))  # the document the next shard starts in
                    finish_shard(chunk_doc + j, int(pos - (ends[j - 1] if j else 0)))
                    shard = None
            bar.update(len(ids), len(lengths))
            chunk_doc += len(lengths)
            if done >= max_tokens:
                break
        if shard is not None:  # the data ran out: the last shard is short
            finish_shard(chunk_doc, 0)
    except OSError as e:
        if e.errno in WRITE_ERRNOS:  # a full disk; other OSErrors come from reading the input
            raise write_error(os.path.join(out_dir, f"train_{len(shards):03d}.bin"), e) from None
        raise
    finally:
        if shard is not None and not shard.closed:  # interrupted: drop the unfinished shard
            discard(shard)
        chunks.close()
        bar.close()


def _plan_rebuild(out_dir, meta, damaged):
    """Turn a finished folder with damaged files back into an interrupted run that rebuilds them: val.bin if it is
    damaged, the shards from the first damaged one on (where a shard starts in the documents is known from the end
    of the one before), and everything if the tokenizer model is lost (the shards may not be its ids)."""
    first_problem = next(iter(damaged.values()))
    if "shards" not in meta:
        raise UserError(f"{first_problem}, and {out_dir} was prepared by an older prepare.py that can't rebuild it: "
                        f"delete {out_dir} and run this command again")
    print(f"{first_problem}: rebuilding it")
    first_damaged = next((i for i, name in enumerate(meta["train_shards"]) if name in damaged), None)
    state = {"settings": meta["settings"], "val": {"tokens": meta["val_tokens"], "documents": meta["val_documents"]},
             "shards": meta["shards"][:first_damaged]}
    if "val.bin" in damaged:
        state["val"] = None
    if meta["tokenizer_file"] in damaged:
        state["val"], state["shards"] = None, []
    _write_json(os.path.join(out_dir, "progress.json"), state)
    os.remove(os.path.join(out_dir, "meta.json"))


def prepare(dataset="c4", tokenizer="t5", out_dir="data/c4", vocab_size=32000, max_train_tokens=None, num_proc=1,
            text_field="text", shard_tokens=100_000_000, val_fraction=0.005, max_val_tokens=10_000_000):
    """Tokenise dataset into out_dir (see the module docstring) and return its meta dict. A rerun with the same
    arguments continues an interrupted run, or returns at once if out_dir is complete."""
    settings = {"dataset": dataset, "text_field": text_field, "tokenizer": tokenizer,
                "vocab_size": vocab_size if tokenizer == "train" else None,
                "max_train_tokens": max_train_tokens or None, "shard_tokens": shard_tokens,
                "val_fraction": val_fraction, "max_val_tokens": max_val_tokens}
    meta_path, state_path = os.path.join(out_dir, "meta.json"), os.path.join(out_dir, "progress.json")
    for path in (meta_path, state_path):
        if os.path.isfile(path):
            before = _read_json(path)["settings"]
            if before != settings:
                changed = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items()
                                    if before.get(k) != v)
                raise UserError(f"{out_dir} was prepared with other settings ({changed}): use another --out_dir, "
                                f"or delete it to start over")
            if path == meta_path:
                meta = load_meta(out_dir)
                damaged = damaged_files(out_dir, meta, [name for name in (meta["tokenizer_file"], "val.bin",
                                                                         *meta["train_shards"]) if name])
                if not damaged:
                    return meta
                _plan_rebuild(out_dir, meta, damaged)
    if tokenizer == "train" and not 0 < vocab_size <= MAX_VOCAB_SIZE:
        raise UserError(f"vocab_size={vocab_size} must be in 1..{MAX_VOCAB_SIZE} so that ids fit uint16")
    max_train_tokens = max_train_tokens or float("inf")

    # fail on an empty or unreadable input before writing anything
    try:
        next(documents(dataset, "train", text_field, val_fraction))
    except StopIteration:
        raise UserError(f"{dataset} has no training documents (is it empty? documents are its non-empty "
                        f"'{text_field}' values; local files also hold out one in {round(1 / val_fraction)} for val)")
    os.makedirs(out_dir, exist_ok=True)
    state = {"settings": settings, "val": None, "shards": []}
    continuing = os.path.isfile(state_path)
    if continuing:
        state = _read_json(state_path)
        print(f"continuing in {out_dir}: {len(state['shards'])} train shards already done")

    def save_state():
        _write_json(state_path, state)

    model_file = os.path.join(out_dir, "tokenizer.model")
    if tokenizer == "gpt2":
        model_file = None
    elif not (continuing and os.path.isfile(model_file)):
        # a new run makes its own: a tokenizer.model that another run left in out_dir may be another tokenizer
        if tokenizer == "train":
            print(f"training a {vocab_size}-piece sentencepiece model on {dataset}")
            spiece = _train_spiece(documents(dataset, "train", text_field, val_fraction), vocab_size)
        else:
            source = tokenizer if tokenizer != "t5" else t5_spiece()
            if not os.path.isfile(source):
                raise UserError(f"tokenizer '{tokenizer}' is not 't5', 'gpt2', 'train' or a sentencepiece "
                                f".model file")
            SentencePieceTokenizer(source)  # a file that is no sentencepiece model stops here, before it is copied
            with open(source, "rb") as f:
                spiece = f.read()
        with atomic_write(model_file) as f:
            f.write(spiece)
    tok = _make_tokenizer(model_file)
    if tok.vocab_size > 1 << 16:
        raise UserError(f"the tokenizer's {tok.vocab_size} ids don't fit uint16: use one with at most "
                        f"{MAX_VOCAB_SIZE} pieces")

    if state["val"] is None:
        state["val"] = _write_val(documents(dataset, "val", text_field, val_fraction), tok, num_proc,
                                  os.path.join(out_dir, "val.bin"), max_val_tokens)
        save_state()
    _write_train(documents(dataset, "train", text_field, val_fraction), tok, num_proc, out_dir, state,
                 shard_tokens, max_train_tokens, save_state)

    shards = state["shards"]
    meta = {"settings": settings, "source": dataset, "tokenizer": tokenizer,
            "tokenizer_file": model_file and os.path.basename(model_file),
            "vocab_size": tok.vocab_size, "model_vocab_size": math.ceil(tok.vocab_size / 128) * 128,
            "eos_id": tok.eos_id, "pad_id": tok.pad_id, "first_sentinel_id": tok.first_sentinel_id,
            "num_sentinels": NUM_SENTINELS, "train_shards": [f"train_{i:03d}.bin" for i in range(len(shards))],
            "shards": shards,  # each one's tokens and where the next starts, so that a lost one can be rebuilt
            "train_tokens": sum(s["tokens"] for s in shards), "val_tokens": state["val"]["tokens"],
            "train_documents": shards[-1]["next_doc"] + (shards[-1]["next_offset"] > 0),
            "val_documents": state["val"]["documents"]}
    _write_json(meta_path, meta)  # last: its presence means the folder is complete
    os.remove(state_path)
    print(f"{out_dir}: {meta['train_tokens']:,} train tokens in {len(shards)} shards, {meta['val_tokens']:,} val "
          f"tokens, vocab {meta['vocab_size']} (model {meta['model_vocab_size']})")
    return load_meta(out_dir)


# -----------------------------------------------------------------------------------------------------------------
# tokenising in parallel, in order


def _chunks(docs, chunk_chars=1 << 20):
    # big enough to amortise handing a chunk to a thread, small enough that all threads stay busy until the end
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
    """(ids, document lengths) for chunks of docs, in order. num_threads threads tokenise a chunk each while this one
    reads the next. Threads, not processes: the tokenizers release the GIL, and no text or ids are copied between
    processes. At most 2 chunks per thread are in flight, so that a streamed dataset is never read far ahead."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(num_threads) as pool:
        pending = deque()
        for chunk in _chunks(docs):
            pending.append(pool.submit(tok.encode_documents, chunk))
            if len(pending) >= 2 * num_threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# -----------------------------------------------------------------------------------------------------------------
# sources: every one is an iterator of document strings, the same ones in the same order on every run


def pydoc_documents():
    """Python's own documentation, ~2 MB of English that needs no download: the pydoc topics (the language
    reference), then for each standard-library module its docstring and those of its classes and functions."""
    import ast
    import sysconfig
    import pydoc_data.topics
    for name in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[name]
    root = sysconfig.get_paths()["stdlib"]
    for folder, subfolders, files in os.walk(root):
        # the test suites' docstrings are mostly one-line "Test that ..." notes
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "test", "tests", "__pycache__"))
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            try:
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):  # lib2to3's deliberately broken test data
                continue
            docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            yield "\n\n".join(d for d in docstrings if d)


def _json_lines(path, text_field):
    # pyarrow, told the one field we need, parses in its own threads and skips every other field: a third of the
    # CPU time of datasets' json builder, which parses every field in one thread, and tokenising needs the cores
    import pyarrow as pa
    import pyarrow.json as paj
    options = paj.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]),
                               unexpected_field_behavior="ignore")
    try:
        for i, batch in enumerate(paj.open_json(pa.input_stream(path), parse_options=options)):  # .gz decompressed
            texts = batch.column(0)
            if i == 0 and texts.null_count == len(texts):
                fields = paj.open_json(pa.input_stream(path)).schema.names
                raise UserError(f"{path} has no '{text_field}' field (it has {', '.join(fields)}): set --text_field")
            yield texts.to_pylist()
    except pa.ArrowInvalid as e:  # e.g. "JSON parse error: Column(/text) changed from string to number in row 0"
        raise UserError(f"{path} is not JSON Lines with a string '{text_field}' field: {e}") from None


def _local_batches(path, text_field):
    """Lists of the text_field values of a local file (None for a record without one)."""
    name = os.path.basename(path).lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        import pyarrow as pa
        with pa.input_stream(path) as f:
            head = f.read(1 << 12).lstrip(b"\xef\xbb\xbf \t\r\n")  # after a byte order mark and blank lines
        if not head:
            return []
        if not head.startswith(b"["):  # JSON Lines (C4's .json files are); datasets reads a JSON array below
            return _json_lines(path, text_field)
    import datasets
    if name.endswith((".txt", ".txt.gz")):
        # documents are paragraphs, separated by blank lines
        split = datasets.load_dataset("text", data_files=path, split="train", streaming=True, sample_by="paragraph")
    else:
        split = datasets.load_dataset("parquet" if name.endswith(".parquet") else "json", data_files=path,
                                      split="train", streaming=True)
    return _columns(split, text_field, path)


def _read_errors_named(path, text_field):
    """_local_batches, with a file that can't be read to its end (truncated or corrupt gzip, not UTF-8, unreadable)
    as one line naming it"""
    import pyarrow as pa
    try:
        yield from _local_batches(path, text_field)
    except (OSError, EOFError, UnicodeDecodeError, pa.ArrowException) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(f"could not read {path}: {reason}") from None


def _columns(split, text_field, source):
    # batches of rows are ~6x faster to read than one dict per row
    for batch in split.iter(batch_size=1000):
        if text_field not in batch:
            raise UserError(f"{source} has no '{text_field}' field (it has {', '.join(batch)}): set --text_field")
        yield batch[text_field]


def _texts(batches):
    for batch in batches:
        for text in batch:
            text = text and text.strip()
            if text:
                yield text


def documents(dataset, split, text_field="text", val_fraction=0.005):
    """The documents of split 'train' or 'val'. Sources without a validation split hold out every
    round(1 / val_fraction)-th document, starting with the first, so that even a small file has a val set."""
    name = dataset.lower()
    if name == "pydoc":
        docs = (d for d in pydoc_documents() if d.strip())
        val_fraction = max(val_fraction, 0.05)  # a small corpus: 0.5% would be a val set of 4 documents
    elif name.endswith(LOCAL_EXTENSIONS) or os.path.isfile(dataset):
        if not os.path.isfile(dataset):
            raise UserError(f"input file {dataset} not found (datasets are 'c4', a Hub name, 'pydoc' or a local "
                            f"{'/'.join(LOCAL_EXTENSIONS)} file)")
        docs = _texts(_read_errors_named(dataset, text_field))
    else:
        import datasets
        repo_id, config_name = ("allenai/c4", "en") if name == "c4" else (dataset, None)
        _hub_check(repo_id, "dataset")
        splits = datasets.load_dataset(repo_id, config_name, streaming=True)
        if "validation" in splits:
            return _texts(_columns(splits["train" if split == "train" else "validation"], text_field, dataset))
        docs = _texts(_columns(splits["train"], text_field, dataset))
    every = max(2, round(1 / val_fraction))
    return (d for i, d in enumerate(docs) if (i % every == 0) == (split == "val"))


# -----------------------------------------------------------------------------------------------------------------
# tokenizers: sentencepiece (T5's or a new one) or GPT-2's BPE, each with 100 sentinels appended to its vocab


class _Tokenizer:
    """encode(str) -> list of ids, encode_documents(list of str) -> (uint16 ids of all of them, each followed by EOS;
    each one's length), decode(ids) -> str with <extra_id_i> sentinels. sentencepiece and tiktoken encode without the
    GIL, so that threads tokenise in parallel."""

    def encode_documents(self, texts):
        ids = self._encode_batch(texts)
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        flat = np.concatenate(ids)
        if flat.min() < 0 or flat.max() >= min(self.vocab_size, 1 << 16):
            raise UserError(f"the tokenizer produced id {flat.max()}, outside its vocab of {self.vocab_size} or "
                            f"uint16")
        return flat.astype(np.uint16), lengths

    def is_sentinel(self, i):
        return self.first_sentinel_id - NUM_SENTINELS < i <= self.first_sentinel_id

    def decode(self, ids, skip_special_tokens=False):
        """skip_special_tokens drops sentinels, EOS and UNK too, as Hugging Face's decode(skip_special_tokens=True)
        does: how Tk-Instruct decodes the predictions it scores."""
        skipped = {self.pad_id, *((self.eos_id, self.unk_id) if skip_special_tokens else ())}
        # sentinels are not in the underlying vocab, so decode the runs between them and spell them out, with a
        # space on each side as T5's own tokenizer shows them
        parts, run = [], []
        for i in ids:
            i = int(i)
            if self.is_sentinel(i):
                if not skip_special_tokens:
                    parts += [self._decode_pieces(run), f"<extra_id_{self.first_sentinel_id - i}>"]
                    run = []
            elif i not in skipped and i < self.vocab_size:  # the model's vocab is padded past the tokenizer's
                run.append(i)
        return " ".join(part for part in parts + [self._decode_pieces(run)] if part)


class SentencePieceTokenizer(_Tokenizer):
    """T5's convention: pad 0, eos 1, unk 2, and <extra_id_i> = pieces + 99 - i (32099 - i for T5's 32000 pieces)."""

    def __init__(self, model_file):
        import sentencepiece as spm
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:  # e.g. "INTERNAL: could not parse ModelProto from x.model"
            reason = str(e).split(": ", 1)[-1]
            raise UserError(f"{model_file} can't be read as a sentencepiece model ({reason})") from None
        self.vocab_size = self.sp.get_piece_size() + NUM_SENTINELS
        self.eos_id, self.pad_id, self.unk_id = self.sp.eos_id(), self.sp.pad_id(), self.sp.unk_id()
        self.first_sentinel_id = self.vocab_size - 1

    def encode(self, text):
        return self.sp.encode(text)

    def _encode_batch(self, texts):
        # int arrays, not lists: building a Python int per token is the one part of encoding that holds the GIL.
        # One thread: the parallelism is prepare's threads, each with its own chunk
        return self.sp.encode(texts, add_eos=True, num_threads=1, out_type="numpy")

    def _decode_pieces(self, ids):
        return self.sp.decode(ids)


class Gpt2Tokenizer(_Tokenizer):
    """tiktoken's GPT-2 BPE: eos is <|endoftext|> 50256, <extra_id_i> = 50356 - i, and pad is one more id, 50357."""

    def __init__(self):
        import tiktoken
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except OSError as e:
            raise UserError(f"tiktoken could not download GPT-2's BPE files ({type(e).__name__}); offline, use "
                            f"--tokenizer=train or a local sentencepiece .model file") from None
        self.eos_id = self.enc.eot_token
        self.unk_id = None  # byte-level BPE has no unknown token
        self.first_sentinel_id = self.enc.n_vocab + NUM_SENTINELS - 1
        self.pad_id = self.first_sentinel_id + 1
        self.vocab_size = self.pad_id + 1

    # ordinary: text that happens to contain "<|endoftext|>" is just text
    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def _encode_batch(self, texts):
        return [self.enc.encode_ordinary(text) + [self.eos_id] for text in texts]

    def _decode_pieces(self, ids):
        return self.enc.decode(ids)


def _make_tokenizer(model_file):
    return SentencePieceTokenizer(model_file) if model_file else Gpt2Tokenizer()


def _hub_check(repo_id, repo_type, hint=OFFLINE_OPTIONS):
    """Fail in seconds, not after minutes of retries, when the Hub can't be reached or has no such repo."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"HF_HUB_OFFLINE is set, so {repo_id} can't be downloaded: {hint}")
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=3)
    except RepositoryNotFoundError:
        raise UserError(f"no {repo_type} named '{repo_id}' on the Hugging Face Hub (or it is private): check the "
                        f"name, or {hint}") from None
    except Exception as e:  # the http client's own connection and timeout errors
        raise UserError(f"can't reach the Hugging Face Hub for {repo_id} ({type(e).__name__}), are you offline? "
                        f"{hint}") from None


def t5_spiece():
    """T5 v1.1's sentencepiece model (shared by t5-v1_1, flan-t5 and nanoT5), from the Hub cache or the Hub."""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download("google/t5-v1_1-base", "spiece.model", local_files_only=True)
    except FileNotFoundError:  # not cached yet
        _hub_check("google/t5-v1_1-base", "model", "pass a local copy of T5's spiece.model instead")
        return hf_hub_download("google/t5-v1_1-base", "spiece.model")


def _train_spiece(texts, vocab_size, max_chars=20_000_000):
    """A unigram sentencepiece model with T5's special ids, trained on the first max_chars characters of texts."""
    import io
    import sentencepiece as spm

    def lines():
        chars = 0
        for text in texts:
            for line in text.splitlines():
                if line.strip():
                    yield line
                    chars += len(line)
            if chars >= max_chars:
                return

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=lines(), model_writer=model, vocab_size=vocab_size,
                                       model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                       num_threads=8, minloglevel=2)  # fixed: the model depends on it
    except RuntimeError as e:  # e.g. "Vocabulary size too high (8000). Please set it to a value <= 3012."
        reason = str(e).split("] ")[-1].rstrip(".")
        raise UserError(f"sentencepiece training failed: {reason}; adjust --vocab_size") from None
    return model.getvalue()


# -----------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    try:
        prepare(dataset, tokenizer, out_dir, vocab_size, max_train_tokens, num_proc, text_field, shard_tokens,
                val_fraction, max_val_tokens)
    except KeyboardInterrupt:
        raise SystemExit("interrupted: finished shards are kept, run the same command again to continue")
