"""
The data path of training: a prepared folder's windows of tokens, span-
corrupted into T5's (inputs, targets); each step's batch, built ahead in a
thread; what an evaluation measures.
    data = SpanCorruptionBatches("data/pydoc", "train", batch_size=16,
                                 input_length=128, noise_density=0.15,
                                 mean_noise_span_length=3.0, seed=1337)
    input_ids, labels = data.get(step)  # (16, 128) and (16, 29), any step
"""
import functools
import hashlib
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from prepare import load_meta, prepare_again, shard_name
from tokenizer import NUM_SENTINELS

# span corruption, as T5 does it (t5.data.preprocessors)

def noise_counts(length, noise_density, mean_noise_span_length):
    """(noise tokens, noise spans) of a window: >= 1 noise and 1 kept token,
    and no more noise spans than kept ones, as they alternate"""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(1, round(min(num_noise, length - num_noise)
                             / mean_noise_span_length))
    return num_noise, num_spans

def compute_input_and_target_lengths(inputs_length, noise_density,
                                     mean_noise_span_length):
    """T5's random_spans_helper: (the longest raw window whose inputs, kept
    tokens, a sentinel per span and EOS, fit inputs_length; its targets'
    length)"""
    def corrupted_lengths(raw_length):
        num_noise, num_spans = noise_counts(raw_length, noise_density,
                                            mean_noise_span_length)
        return (raw_length - num_noise + num_spans + 1,
                num_noise + num_spans + 1)
    raw_length = inputs_length - 1
    while corrupted_lengths(raw_length + 1)[0] <= inputs_length:
        raw_length += 1
    return raw_length, corrupted_lengths(raw_length)[1]

def random_segmentation(num_items, num_segments, keys):
    """T5's: lengths of num_segments non-empty runs that split num_items at
    random, a row per row of keys (B, num_items - 1)"""
    # item 0, with no key, starts the first run
    starts = np.argsort(keys, axis=1)[:, :num_segments - 1] + 1
    starts = np.sort(starts, axis=1)  # (B, num_segments - 1)
    return np.diff(starts, axis=1, prepend=0, append=num_items)

def random_spans_noise_mask(length, noise_density, mean_noise_span_length,
                            rngs):
    """T5's: which tokens of each window are noise (True), in num_spans spans
    of random lengths, kept tokens first, noise last; row i's keys: rngs[i]"""
    num_noise, num_spans = noise_counts(length, noise_density,
                                        mean_noise_span_length)
    num_kept = length - num_noise
    keys = np.stack([rng.random(length - 2 if num_spans > 1 else 0)
                     for rng in rngs])
    kept_lengths = random_segmentation(num_kept, num_spans,
                                       keys[:, :num_kept - 1])
    noise_lengths = random_segmentation(num_noise, num_spans,
                                        keys[:, num_kept - 1:])
    # interleaved: kept, noise, kept, noise, ...
    span_lengths = np.stack([kept_lengths, noise_lengths], axis=2)
    is_noise = np.tile([False, True], span_lengths.size // 2)
    mask = np.repeat(is_noise, span_lengths.ravel())
    return mask.reshape(len(keys), length)

def noise_span_to_unique_sentinel(tokens, noise_mask, first_sentinel_id):
    """T5's: each noise span (B, L) becomes one sentinel, counting down from
    first_sentinel_id (<extra_id_0>) in each row"""
    previous_is_noise = np.pad(noise_mask[:, :-1], ((0, 0), (1, 0)))
    first_noise = noise_mask & ~previous_is_noise
    subsequent_noise = noise_mask & previous_is_noise
    sentinels = first_sentinel_id + 1 - np.cumsum(first_noise, axis=1)
    kept = np.where(first_noise, sentinels, tokens)[~subsequent_noise]
    # each row drops as many: all but each span's first
    return kept.reshape(len(tokens), -1)

def span_corrupt(tokens, noise_density, mean_noise_span_length,
                 first_sentinel_id, eos_id, rngs):
    """T5's span corruption of windows (B, L) into int64 (inputs, targets).
    rngs: a numpy Generator per row (a row is the same alone as in a batch),
    or one for all. With words for tokens, a window of 10, noise_density 0.3
    and mean_noise_span_length 1.5 make 3 noise tokens in 2 spans; random
    segmentation splits the 7 kept tokens into 2 runs, here 2 and 5, and the
    3 noise tokens into 2 and 1; interleaved, they make the noise mask:
        window:   Thank  you  for  inviting  me  to  your  party  last  week
        mask:     .      .    x    x         .   .   .     .      .     x
        inputs:   Thank you <extra_id_0> me to your party last <extra_id_1> </s>
        targets:  <extra_id_0> for inviting <extra_id_1> week </s>
    The model learns to fill in the blanks."""
    if isinstance(rngs, np.random.Generator):
        rngs = [rngs] * len(tokens)
    tokens = tokens.astype(np.int64)
    noise_mask = random_spans_noise_mask(
        tokens.shape[1], noise_density, mean_noise_span_length, rngs)
    inputs = noise_span_to_unique_sentinel(tokens, noise_mask,
                                           first_sentinel_id)
    targets = noise_span_to_unique_sentinel(tokens, ~noise_mask,
                                            first_sentinel_id)
    eos = np.full((len(tokens), 1), eos_id)
    return np.hstack([inputs, eos]), np.hstack([targets, eos])

# the batch of every step

def micro_batch_size(batch_size, grad_accum_steps, world_size):
    """the rows of one micro-step on one rank"""
    size, leftover = divmod(batch_size, grad_accum_steps * world_size)
    if leftover or not size:
        raise SystemExit(
            f"error: batch_size={batch_size} must split evenly into "
            f"grad_accum_steps={grad_accum_steps} x {world_size} ranks; "
            f"change batch_size or grad_accum_steps")
    return size

# the batches' random streams, by numpy seed
# [seed, TRAIN_ORDER, epoch]: train's order of windows
TRAIN_ORDER = 0
# [seed, TRAIN_SPANS, step, row]: a train row's noise spans
TRAIN_SPANS = 1
# [VAL_SPANS, step, row]: no seed, so runs' eval losses compare
VAL_SPANS = 2

@functools.lru_cache(maxsize=1)
def train_order(seed, num_windows, epoch):
    rng = np.random.default_rng([seed, TRAIN_ORDER, epoch])
    return rng.permutation(num_windows)

class SpanCorruptionBatches:
    """A prepared folder's windows, span-corrupted. Row r of step k's batch
    depends on (seed, k, r) alone: resuming, more GPUs or micro-steps
    change nothing."""
    def __init__(self, data_dir, split, batch_size, input_length,
                 noise_density, mean_noise_span_length, seed):
        self.meta = load_meta(data_dir)
        self.split = split
        self.batch_size = batch_size
        self.seed = seed
        self.noise = (noise_density, mean_noise_span_length)
        self.raw_length, self.targets_length = (
            compute_input_and_target_lengths(input_length, *self.noise))
        files = self.meta["shards" if split == "train" else "val"]
        paths = [os.path.join(data_dir, shard_name(split, i))
                 for i in range(len(files))]
        self.again = prepare_again(self.meta["settings"], data_dir)
        # a shard newer than meta.json is checked now, the others in
        # ShardCheck's thread (bit rot, a copy that kept its times): a stat
        # each keeps start-up short
        written = os.path.getmtime(os.path.join(data_dir, "meta.json"))
        self.unchecked = []
        for path, file in zip(paths, files):
            if (not os.path.isfile(path)
                    or os.path.getsize(path) != 2 * file["tokens"]):
                raise SystemExit(
                    f"error: {path} is not the {file['tokens']:,} tokens "
                    f"meta.json says (lost or cut): {self.again}")
            if os.path.getmtime(path) > written:
                self.check(path, file["sha256"])
            else:
                self.unchecked.append((path, file["sha256"]))
        self.shards = [np.memmap(path, dtype=np.uint16, mode="r")
                       for path in paths]
        # disjoint windows per shard
        windows = [len(s) // self.raw_length for s in self.shards]
        self.num_windows = sum(windows)
        if self.num_windows == 0:
            raise SystemExit(
                f"error: the {split} data in {data_dir} has fewer than "
                f"{self.raw_length} tokens, not one window: prepare more "
                f"data, or lower input_length")
        self.first_window = np.cumsum([0] + windows)  # of each shard

    def window_of(self, samples):
        """(shard, first token) of each sample's window, a sample being step *
        batch_size + row. Windows of raw_length L are numbered across shards;
        train reads them in a new order each epoch, val in order. With shards
        of 3 and 2 windows, batch_size 4 and seed 1337, epoch 1 reads
        train_order(1337, 5, 1) = [2, 4, 0, 1, 3]: sample 5 (step 1, row 1) is
        its first, window 2, shard 0's third (tokens 2L to 3L); sample 6 reads
        window 4, shard 1's second (tokens L to 2L)."""
        epochs, nth = np.divmod(samples, self.num_windows)
        windows = nth.copy()
        if self.split == "train":
            for epoch in np.unique(epochs):
                order = train_order(self.seed, self.num_windows, epoch)
                windows[epochs == epoch] = order[nth[epochs == epoch]]
        shard = np.searchsorted(self.first_window, windows, side="right") - 1
        return shard, (windows - self.first_window[shard]) * self.raw_length

    def get(self, step, micro_step=0, grad_accum_steps=1, rank=0,
            world_size=1, device="cpu"):
        """int64 (input_ids (b, input_length), labels (b, targets_length)) on
        device: micro_step's b rows of step's batch on this rank"""
        b = micro_batch_size(self.batch_size, grad_accum_steps, world_size)
        rows = (micro_step * world_size + rank) * b + np.arange(b)
        shards, starts = self.window_of(step * self.batch_size + rows)
        raw = np.stack([self.shards[s][i: i + self.raw_length]
                        for s, i in zip(shards, starts)])
        stream = ([self.seed, TRAIN_SPANS] if self.split == "train"
                  else [VAL_SPANS])
        rngs = [np.random.default_rng([*stream, step, r])
                for r in rows]
        corrupted = span_corrupt(raw, *self.noise,
                                 self.meta["first_sentinel_id"],
                                 self.meta["eos_id"], rngs)
        return tuple(torch.from_numpy(x).to(device) for x in corrupted)

    def check(self, path, sha256, chunk_bytes=1 << 20):
        """the shard holds what prepare.py wrote; read in chunks (a memmap's
        max() would keep it resident)"""
        largest, digest = 0, hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
                largest = max(largest,
                              int(np.frombuffer(chunk, np.uint16).max()))
        if largest >= self.meta["vocab_size"]:
            raise SystemExit(
                f"error: {path} holds token id {largest}, beyond its "
                f"tokenizer's {self.meta['vocab_size']} ids: it is another "
                f"tokenizer's")
        if digest.hexdigest() != sha256:
            raise SystemExit(
                f"error: {path} is not the shard meta.json records (its "
                f"sha256 differs): put the file back, or {self.again}")

class ShardCheck(threading.Thread):
    """the streams' shards start-up did not check, once, in a thread the
    run's end does not wait for; sync steps read its errors"""
    def __init__(self, *streams):
        super().__init__(daemon=True)
        self.streams, self.errors = streams, []
        self.start()

    def run(self):
        try:
            for stream in self.streams:
                for path, sha256 in stream.unchecked:
                    stream.check(path, sha256)
        except SystemExit as e:
            self.errors.append(e)

    def error(self):  # what a sync step raises when any rank found one
        data_dir = self.streams[0].meta["data_dir"]
        return (self.errors or [SystemExit(
            f"error: another rank found a shard of {data_dir} that is not "
            f"what its meta.json records")])[0]

class Prefetcher:
    """get(step): this rank's micro-batches of step, dicts of input_ids and
    labels; a thread builds step + 1's meanwhile (the order is known: no
    DataLoader workers), pinned on CUDA, so that the copy is async"""
    def __init__(self, data, grad_accum_steps, rank, world_size, device):
        micro_batch_size(data.batch_size, grad_accum_steps, world_size)
        self.data, self.device = data, torch.device(device)
        self.slice = (grad_accum_steps, rank, world_size)
        pin_on = {}
        if self.device.type == "cuda":  # this rank's GPU: no context on GPU 0
            gpu = (torch.cuda.current_device() if self.device.index is None
                   else self.device.index)
            pin_on = dict(initializer=torch.cuda.set_device,
                          initargs=(gpu,))
        self.pool = ThreadPoolExecutor(1, **pin_on)
        self.next = (None, None)  # (step, its future)

    def on_host(self, step):
        batches = [self.data.get(step, micro_step, *self.slice)
                   for micro_step in range(self.slice[0])]
        if self.device.type == "cuda":
            batches = [[t.pin_memory() for t in b] for b in batches]
        return [dict(input_ids=x, labels=y) for x, y in batches]

    def get(self, step):
        next_step, future = self.next
        micro_batches = (future.result() if next_step == step
                         else self.on_host(step))
        self.next = (step + 1, self.pool.submit(self.on_host, step + 1))
        return [{key: t.to(self.device, non_blocking=True)
                 for key, t in batch.items()}
                for batch in micro_batches]

    def close(self):
        self.pool.shutdown(cancel_futures=True)

# what an evaluation measures

def span_accuracy(logits, labels, first_sentinel_id):
    """(spans right, spans) under teacher forcing: a span is right if the
    argmax is each of its tokens and the one ending it (sentinel or EOS)"""
    sentinel = ((labels <= first_sentinel_id)
                & (labels > first_sentinel_id - NUM_SENTINELS))
    # (B, T): the span each label is in or ends; span 0, the first
    # sentinel, is not scored
    span = sentinel.long().cumsum(1) - sentinel.long()
    wrong = (logits.argmax(-1) != labels).float()
    wrong_per_span = torch.zeros_like(wrong).scatter_add_(1, span, wrong)
    spans = sentinel.sum()
    return spans - (wrong_per_span[:, 1:] > 0).sum(), spans

def span_fills(labels, first_sentinel_id):
    """every noise span's fill, a tuple of ids, in labels (B, T)"""
    fills = []
    for row in labels.tolist():
        for token in row[:-1]:  # the last is EOS
            if first_sentinel_id - NUM_SENTINELS < token <= first_sentinel_id:
                fills.append(())
            else:
                fills[-1] += (token,)
    return fills

def unigram_baseline(val, val_steps):
    """(the commonest fill of val's spans, the share it fills): the best span
    accuracy of a model that ignores its input"""
    first = val.meta["first_sentinel_id"]
    fills = [fill for step in range(val_steps)
             for fill in span_fills(val.get(step)[1], first)]
    common, count = Counter(fills).most_common(1)[0]
    return common, count / len(fills)
