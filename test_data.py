"""Tests for data.py: span corruption against T5's algorithm one example at a time, the batch of every step, the
prefetcher, and span accuracy. CPU only, no network: the folder is test_prepare.py's, prepared from synthetic C4."""
import json
import os
import threading

import numpy as np
import pytest
import torch

import data as D
import prepare as P
from tokenizer import NUM_SENTINELS
from test_prepare import SHARD_TOKENS, batches, copy_of, corpus, data_dir, folder_bytes  # noqa: F401 (fixtures)

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once


def span_corrupt_per_example(tokens, noise_density, mean_noise_span_length, first_sentinel_id, eos_id, rng):
    """The reference for span_corrupt: one example at a time, step by step as T5's random_spans_noise_mask describes
    it. span_corrupt must match it in distribution (tested below)."""
    L = tokens.shape[1]
    num_noise = min(max(round(L * noise_density), 1), L - 1)
    num_spans = max(1, round(min(num_noise, L - num_noise) / mean_noise_span_length))

    def random_segmentation(num_items):
        # shuffle num_spans - 1 segment starts among items 1..num_items-1; item 0 always starts a segment
        is_start = [1] + list(rng.permutation([1] * (num_spans - 1) + [0] * (num_items - num_spans)))
        lengths = []
        for start in is_start:
            if start:
                lengths.append(0)
            lengths[-1] += 1
        return lengths

    all_inputs, all_targets = [], []
    for row in tokens:
        is_noise = []
        for kept, noise in zip(random_segmentation(L - num_noise), random_segmentation(num_noise)):
            is_noise += [False] * kept + [True] * noise
        inputs, targets, sentinel = [], [], first_sentinel_id + 1
        for i, token in enumerate(row):
            if is_noise[i] and not is_noise[i - 1]:  # a noise span starts (position 0 is never noise)
                sentinel -= 1
                inputs.append(sentinel)
                targets.append(sentinel)
            (targets if is_noise[i] else inputs).append(int(token))
        all_inputs.append(inputs + [eos_id])
        all_targets.append(targets + [eos_id])
    return np.array(all_inputs, dtype=np.int64), np.array(all_targets, dtype=np.int64)


def uncorrupt(inputs, targets, first_sentinel_id):
    """(the original row, which of its tokens were noise): each sentinel in the inputs replaced by the tokens after
    it in the targets."""
    assert inputs[-1] == targets[-1]  # both end with EOS
    spans, current = {}, None
    for t in targets[:-1]:
        if first_sentinel_id - NUM_SENTINELS < t <= first_sentinel_id:
            current = spans.setdefault(int(t), [])
        else:
            current.append(int(t))
    row, is_noise = [], []
    for t in inputs[:-1]:
        span = spans.pop(int(t)) if first_sentinel_id - NUM_SENTINELS < t <= first_sentinel_id else None
        row.extend([int(t)] if span is None else span)
        is_noise.extend([False] if span is None else [True] * len(span))
    assert not spans  # every target span was used
    return row, np.array(is_noise)


def rebuild(inputs, targets, first_sentinel_id):
    return uncorrupt(inputs, targets, first_sentinel_id)[0]


def span_lengths(row_is_noise):
    """Lengths of the runs of kept and of noise tokens in a boolean row."""
    change = np.flatnonzero(np.diff(row_is_noise.astype(int))) + 1
    bounds = np.concatenate([[0], change, [len(row_is_noise)]])
    runs, first = np.diff(bounds), row_is_noise[0]
    return runs[int(first)::2], runs[int(not first)::2]  # kept, noise


# -----------------------------------------------------------------------------------------------------------------
# span corruption


@pytest.mark.parametrize("inputs_length,expected", [(512, (568, 114)), (128, (141, 29)), (1024, (1137, 229))])
def test_input_and_target_lengths(inputs_length, expected):
    assert D.compute_input_and_target_lengths(inputs_length, 0.15, 3.0) == expected


@pytest.mark.parametrize("inputs_length,density,mean", [(512, 0.15, 3.0), (128, 0.15, 3.0), (64, 0.3, 2.0),
                                                        (32, 0.5, 1.5), (16, 0.15, 3.0)])
def test_span_corrupt_shapes_rebuild_and_counts(inputs_length, density, mean):
    raw_length, targets_length = D.compute_input_and_target_lengths(inputs_length, density, mean)
    tokens = np.random.default_rng(0).integers(3, 1000, (64, raw_length)).astype(np.uint16)
    inputs, targets = D.span_corrupt(tokens, density, mean, 32099, 1, np.random.default_rng(1))
    assert inputs.shape == (64, inputs_length) and targets.shape == (64, targets_length)
    assert inputs.dtype == np.int64 and targets.dtype == np.int64
    num_noise = min(max(round(raw_length * density), 1), raw_length - 1)
    num_spans = max(1, round(min(num_noise, raw_length - num_noise) / mean))
    for row, x, y in zip(tokens, inputs, targets):
        assert rebuild(x, y, 32099) == row.tolist()
        assert x[-1] == y[-1] == 1
        sentinels = x[x > 1000]
        assert sentinels.tolist() == list(range(32099, 32099 - num_spans, -1))  # counting down, in span order
        assert y[y > 1000].tolist() == sentinels.tolist()
        assert len(y) - 1 - num_spans == num_noise
        kept, noise = span_lengths(uncorrupt(x, y, 32099)[1])
        assert len(kept) == len(noise) == num_spans and noise.sum() == num_noise
        assert x[0] < 1000  # rows start with kept tokens


def test_span_corrupt_matches_reference_distribution():
    # not the same random draws, so compare the distributions over many rows
    rows, length = 3000, 141
    tokens = np.random.default_rng(0).integers(3, 1000, (rows, length))
    inputs, targets = D.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    reference = list(zip(*span_corrupt_per_example(tokens, 0.15, 3.0, 32099, 1, rng)))
    assert rebuild(*reference[0], 32099) == tokens[0].tolist()

    def stats(pairs):
        masks = np.stack([uncorrupt(np.array(x), np.array(y), 32099)[1] for x, y in pairs])
        kept, noise = zip(*(span_lengths(m) for m in masks))
        kept, noise = np.concatenate(kept), np.concatenate(noise)
        return (np.bincount(noise, minlength=length) / len(noise), np.bincount(kept, minlength=length) / len(kept),
                masks.mean(axis=0))

    (noise, kept, position), (ref_noise, ref_kept, ref_position) = stats(zip(inputs, targets)), stats(reference)
    assert np.abs(noise - ref_noise).sum() / 2 < 0.03  # total variation distance of the span length histograms
    assert np.abs(kept - ref_kept).sum() / 2 < 0.03
    assert np.abs(position - ref_position).max() < 0.05  # where the noise falls
    assert abs(np.dot(np.arange(length), noise) - 21 / 7) < 1e-9  # 21 noise tokens in 7 spans, in every row


def test_span_corrupt_same_seed_same_output():
    tokens = np.random.default_rng(0).integers(3, 1000, (8, 568))
    a = D.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(5))
    b = D.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(5))
    c = D.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


# -----------------------------------------------------------------------------------------------------------------
# the batch stream


def test_stream_shapes_and_resume(data_dir):
    stream = batches(data_dir)
    x, y = stream.get(0)
    assert x.shape == (8, 64) and y.shape == (8, stream.targets_length) and x.dtype == y.dtype == torch.int64
    assert (stream.raw_length, stream.targets_length) == D.compute_input_and_target_lengths(64, 0.15, 3.0)
    uninterrupted = [stream.get(step) for step in range(6)]
    resumed = batches(data_dir)  # a fresh process resuming at step 4
    for step in (4, 5):
        assert all(torch.equal(a, b) for a, b in zip(resumed.get(step), uninterrupted[step]))
    assert not torch.equal(uninterrupted[4][0], uninterrupted[5][0])
    assert not torch.equal(batches(data_dir, seed=1).get(4)[0], uninterrupted[4][0])


def test_stream_ranks_and_grad_accum_slice_the_same_global_batch(data_dir):
    stream = batches(data_dir)
    x, y = stream.get(3)
    for accum, world in ((1, 2), (2, 1), (2, 2), (4, 2)):
        parts = [batches(data_dir).get(3, m, accum, r, world) for m in range(accum) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(SystemExit, match="split evenly"):
        stream.get(3, 0, 3, 0, 1)


def test_each_rank_corrupts_only_its_own_rows(data_dir, monkeypatch):
    corrupted = []

    def recording_span_corrupt(tokens, *args):
        corrupted.append(len(tokens))
        return span_corrupt(tokens, *args)
    span_corrupt = D.span_corrupt
    monkeypatch.setattr(D, "span_corrupt", recording_span_corrupt)
    batches(data_dir).get(3, 1, 2, 1, 2)  # global batch 8: micro-step 1 of 2 on rank 1 of 2 is rows 6 and 7
    assert corrupted == [2]


def test_prefetcher_gives_each_step_its_batches(data_dir):
    stream = batches(data_dir)
    threads = set(threading.enumerate())
    prefetcher = D.Prefetcher(batches(data_dir), 2, 1, 2, "cpu")
    for step in (5, 6, 7, 3, 4, 9):  # a resumed start, steps in order, a jump back, a jump forward
        micro_batches = prefetcher.get(step)
        assert prefetcher.next[0] == step + 1  # being built meanwhile
        for micro_step in range(2):
            batch = micro_batches[micro_step]
            expected = stream.get(step, micro_step, 2, 1, 2)
            assert torch.equal(batch["input_ids"], expected[0]) and torch.equal(batch["labels"], expected[1])
            assert "attention_mask" not in batch  # pre-training windows are never padded
    prefetcher.close()
    assert set(threading.enumerate()) == threads  # its thread is gone


def test_prefetcher_thread_pins_on_the_runs_gpu(data_dir, monkeypatch):
    # no GPU here: the thread's choice of device is recorded instead; torch.cuda.set_device needs an index, and
    # device 'cuda' (one GPU, no DDP) has none
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for device in ("cuda", "cuda:1"):
        prefetcher = D.Prefetcher(batches(data_dir), 1, 0, 1, device)
        prefetcher.pool.submit(int).result()  # the thread has started
        prefetcher.close()
    assert chosen == [3, 1]


def test_stream_epoch_visits_every_window_once(data_dir):
    stream = batches(data_dir, batch_size=5)
    meta, raw = stream.meta, stream.raw_length
    windows = {tuple(s[i: i + raw].tolist()) for s in stream.shards for i in range(0, len(s) - raw + 1, raw)}
    assert len(windows) == stream.num_windows > 20

    def rows(steps):
        for step in steps:
            x, y = stream.get(step)
            for a, b in zip(x.numpy(), y.numpy()):
                yield tuple(rebuild(a, b, meta["first_sentinel_id"]))

    epoch = list(rows(range(stream.num_windows // 5)))
    assert len(set(epoch)) == len(epoch) and set(epoch) <= windows  # no repeats within an epoch
    two_epochs = list(rows(range(2 * stream.num_windows // 5 + 1)))
    first, second = two_epochs[: stream.num_windows], two_epochs[stream.num_windows: 2 * stream.num_windows]
    assert set(first) == set(second) == windows and first != second  # each epoch its own order


def test_val_stream_is_fixed(data_dir):
    a, b = batches(data_dir, "val", seed=0), batches(data_dir, "val", seed=123)
    for step in (0, 1):
        assert all(torch.equal(u, v) for u, v in zip(a.get(step), b.get(step)))
    x, y = a.get(0)
    first = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)[: a.raw_length]
    assert rebuild(x[0].numpy(), y[0].numpy(), a.meta["first_sentinel_id"]) == first.tolist()


def test_stream_bad_input(data_dir, tmp_path):
    with pytest.raises(SystemExit, match="no prepared data.*python prepare.py"):
        batches(str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="fewer than"):
        batches(data_dir, "val", input_length=100_000)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name, content in folder_bytes(data_dir).items():
        (bad / name).write_bytes(content)
    np.full(SHARD_TOKENS, 600, dtype=np.uint16).tofile(bad / "train_000.bin")
    np.full(SHARD_TOKENS, 600, dtype=np.uint16).tofile(bad / "train_001.bin")
    with pytest.raises(SystemExit, match="train_00[01].bin holds token id 600"):
        for step in range(20):
            batches(str(bad)).get(step)


def test_start_up_and_a_first_read_hold_no_shard_whole(data_dir, tmp_path):
    big = copy_of(data_dir, tmp_path / "big")
    with open(os.path.join(big, "train_000.bin"), "r+b") as f:
        f.truncate(1 << 30)  # a sparse 1 GB shard: its holes read as token id 0
    with open(os.path.join(big, "meta.json")) as f:
        meta = json.load(f)
    meta["shards"][0]["tokens"] = (1 << 30) // 2
    with open(os.path.join(big, "meta.json"), "w") as f:
        json.dump(meta, f)

    def resident_kb():  # mapped pages of a shard count too
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
    before = resident_kb()
    streams = [batches(data_dir)]  # kept: their shards stay mapped
    small = resident_kb() - before
    streams.append(batches(big))
    large = resident_kb() - before - small
    assert large <= small + 1024, (small, large)  # KB: reading the shard whole would add its 1 GB
    # the first step that reads the shard checks its ids, in chunks: a memmap's max() kept the 1 GB resident
    before = resident_kb()
    assert streams[-1].get(0)[0].shape == (8, 64)
    assert resident_kb() - before < 300 * 1024, resident_kb() - before


# -----------------------------------------------------------------------------------------------------------------
# span accuracy and its baseline


def test_span_accuracy_counts_spans_right_to_their_end():
    # <extra_id_0> = 299, <extra_id_1> = 298, EOS = 1; a span is its tokens and the token that ends it
    labels = torch.tensor([[299, 5, 6, 298, 7, 1], [299, 7, 298, 9, 9, 1]])
    predicted = torch.tensor([[4, 5, 6, 298, 8, 1],  # span 0 right (the first sentinel is not scored), span 1 wrong
                              [299, 7, 298, 9, 9, 3]])  # span 0 right, span 1 not ended by EOS: wrong
    right, spans = D.span_accuracy(torch.nn.functional.one_hot(predicted, 300).float(), labels, 299)
    assert (right.item(), spans.item()) == (2, 4)
    assert D.span_fills(labels, 299) == [(5, 6), (7,), (7,), (9, 9)]


def test_unigram_baseline_always_writes_the_commonest_fill():
    class Batches:
        meta = {"first_sentinel_id": 299}

        def get(self, step):  # step 0's fills: (5,), (7, 7), (5,), (6,), (5,), (5, 5)
            return None, torch.tensor([[[299, 5, 298, 7, 7, 297, 5, 1], [299, 6, 298, 5, 297, 5, 5, 1]],
                                       [[299, 6, 298, 6, 297, 9, 9, 1], [299, 6, 298, 9, 297, 9, 9, 1]]][step])
    assert D.unigram_baseline(Batches(), val_steps=1) == ((5,), 0.5)  # 3 of 6: (5, 5) is another fill
    assert D.unigram_baseline(Batches(), val_steps=2) == ((6,), 4 / 12)  # step 1 adds (6,) 3 times


def test_window_of_works_its_docstring_example():
    stream = object.__new__(D.SpanCorruptionBatches)  # only the window arithmetic: no folder
    stream.split, stream.seed, stream.num_windows, stream.raw_length = "train", 1337, 5, 10
    stream.first_window = np.array([0, 3, 5])  # shards of 3 and 2 windows
    assert D.train_order(1337, 5, 1).tolist() == [2, 4, 0, 1, 3]
    shard, start = stream.window_of(np.array([5, 6]))
    assert shard.tolist() == [0, 1] and start.tolist() == [20, 10]
    stream.split = "val"  # in order, epoch after epoch
    shard, start = stream.window_of(np.array([5, 6, 8]))
    assert shard.tolist() == [0, 0, 1] and start.tolist() == [0, 10, 0]
