"""Tests for prepare.py: span corruption, prepare (end to end, resume, bad input) and the batch stream. CPU only, no
network: the data is a synthetic C4-style JSONL file and a sentencepiece model trained on it."""
import functools
import glob
import gzip
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import prepare as P
from model import UserError

HERE = os.path.dirname(os.path.abspath(__file__))
SHARD_TOKENS = 3000
PIECES = 150


def span_corrupt_per_example(tokens, noise_density, mean_noise_span_length, first_sentinel_id, eos_id, rng):
    """The reference for span_corrupt: one example at a time, step by step as T5's random_spans_noise_mask describes
    it. span_corrupt must match it in distribution (tested below), and bench.py --part=data times the two."""
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
        if first_sentinel_id - P.NUM_SENTINELS < t <= first_sentinel_id:
            current = spans.setdefault(int(t), [])
        else:
            current.append(int(t))
    row, is_noise = [], []
    for t in inputs[:-1]:
        span = spans.pop(int(t)) if first_sentinel_id - P.NUM_SENTINELS < t <= first_sentinel_id else None
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
    assert P.compute_input_and_target_lengths(inputs_length, 0.15, 3.0) == expected


@pytest.mark.parametrize("inputs_length,density,mean", [(512, 0.15, 3.0), (128, 0.15, 3.0), (64, 0.3, 2.0),
                                                        (32, 0.5, 1.5), (16, 0.15, 3.0)])
def test_span_corrupt_shapes_rebuild_and_counts(inputs_length, density, mean):
    raw_length, targets_length = P.compute_input_and_target_lengths(inputs_length, density, mean)
    tokens = np.random.default_rng(0).integers(3, 1000, (64, raw_length)).astype(np.uint16)
    inputs, targets = P.span_corrupt(tokens, density, mean, 32099, 1, np.random.default_rng(1))
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
    inputs, targets = P.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(1))
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
    a = P.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(5))
    b = P.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(5))
    c = P.span_corrupt(tokens, 0.15, 3.0, 32099, 1, np.random.default_rng(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


# -----------------------------------------------------------------------------------------------------------------
# prepare


def write_c4_jsonl(path, num_docs=400, seed=0):
    """Synthetic documents in C4's JSONL format, with English words so that sentencepiece has something to learn."""
    words = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
             "an had they you were their one all we can her has there been if more when will would who so no time "
             "language model text data training span noise sentinel encoder decoder transformer").split()
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(num_docs):
            sentences = [" ".join(rng.choice(words, rng.integers(4, 15))).capitalize() + "."
                         for _ in range(rng.integers(1, 8))]
            f.write(json.dumps({"text": " ".join(sentences), "timestamp": "2019-04-25T12:57:54Z",
                                "url": f"https://example.com/{i}"}) + "\n")
    return path


def prepare_args(out_dir, **overrides):
    return dict(dict(tokenizer="train", out_dir=str(out_dir), vocab_size=PIECES, num_proc=1,
                     shard_tokens=SHARD_TOKENS, val_fraction=0.05), **overrides)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(write_c4_jsonl(tmp_path_factory.mktemp("corpus") / "c4-train.00000-of-01024.json"))


@pytest.fixture(scope="module")
def data_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "c4"
    P.prepare(corpus, **prepare_args(out))
    return str(out)


def folder_bytes(folder):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(folder, "*")))}


def test_prepare_end_to_end(corpus, data_dir):
    meta = P.load_meta(data_dir)
    files = sorted(os.listdir(data_dir))
    shards = [f for f in files if f.startswith("train_")]
    assert files == sorted(shards + ["val.bin", "tokenizer.model", "meta.json"])
    assert shards == meta["train_shards"] and len(shards) >= 3
    sizes = [os.path.getsize(os.path.join(data_dir, f)) // 2 for f in shards]
    assert sizes[:-1] == [SHARD_TOKENS] * (len(shards) - 1) and 0 < sizes[-1] <= SHARD_TOKENS
    assert meta["train_tokens"] == sum(sizes) and meta["val_tokens"] == os.path.getsize(f"{data_dir}/val.bin") // 2
    assert meta["vocab_size"] == PIECES + 100 and meta["model_vocab_size"] == 256
    assert (meta["pad_id"], meta["eos_id"], meta["first_sentinel_id"]) == (0, 1, PIECES + 99)
    assert meta["train_documents"] == 380 and meta["val_documents"] == 20 and meta["source"] == corpus

    # the shards are exactly every train document's ids followed by EOS, in order; val holds every 20th document
    tok = P.load_tokenizer(data_dir)
    texts = [json.loads(line)["text"] for line in open(corpus)]
    expected = [i for t in texts for i in tok.encode(t) + [1] if texts.index(t) % 20]
    stream = np.concatenate([np.fromfile(os.path.join(data_dir, f), dtype=np.uint16) for f in shards])
    assert stream.tolist() == expected
    expected_val = [i for t in texts[::20] for i in tok.encode(t) + [1]]
    assert np.fromfile(f"{data_dir}/val.bin", dtype=np.uint16).tolist() == expected_val
    assert tok.decode(tok.encode(texts[3])) == texts[3]
    assert tok.decode(tok.encode("The data") + [PIECES + 99] + tok.encode("model")) == "The data <extra_id_0> model"

    # a rerun finds it complete, and 2 processes give the same bytes
    assert P.prepare(corpus, **prepare_args(data_dir)) == meta
    out2 = os.path.join(os.path.dirname(data_dir), "c4_2proc")
    P.prepare(corpus, **prepare_args(out2, num_proc=2))
    assert folder_bytes(out2) == folder_bytes(data_dir)


def test_prepare_max_train_tokens(corpus, tmp_path):
    meta = P.prepare(corpus, **prepare_args(tmp_path, max_train_tokens=4000))
    assert meta["train_tokens"] == 4000 and meta["train_shards"] == ["train_000.bin", "train_001.bin"]
    assert os.path.getsize(tmp_path / "train_001.bin") == 2 * 1000


def test_prepare_resumes_after_interrupt(corpus, data_dir, tmp_path, monkeypatch):
    # small chunks so that the run is interrupted between chunks, with a shard half written
    chunks, calls = P._chunks, []

    def interrupted_chunks(docs):
        for chunk in chunks(docs, chunk_chars=2000):
            calls.append(1)
            if len(calls) == 12:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(P, "_chunks", interrupted_chunks)
    with pytest.raises(KeyboardInterrupt):
        P.prepare(corpus, **prepare_args(tmp_path))
    files = os.listdir(tmp_path)
    progress = json.load(open(tmp_path / "meta.json"))  # the folder's one state file: not complete, and not taken
    assert not progress["complete"] and not [f for f in files if f.endswith(".tmp")]
    with pytest.raises(UserError, match="not completely prepared"):
        P.load_meta(str(tmp_path))
    assert 1 <= len(progress["shards"]) < len(P.load_meta(data_dir)["train_shards"])
    assert any(s["next_offset"] > 0 for s in progress["shards"])  # a document straddles a shard boundary
    for f in files:
        if f.startswith("train_"):
            assert os.path.getsize(tmp_path / f) == 2 * SHARD_TOKENS

    monkeypatch.setattr(P, "_chunks", functools.partial(chunks, chunk_chars=2000))
    P.prepare(corpus, **prepare_args(tmp_path))
    assert folder_bytes(tmp_path) == folder_bytes(data_dir)


def test_prepare_bad_input(tmp_path, corpus):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="not found"):
        P.prepare(str(tmp_path / "missing.jsonl"), **prepare_args(out))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="no training documents"):
        P.prepare(str(tmp_path / "empty.jsonl"), **prepare_args(out))
    (tmp_path / "other.jsonl").write_text('{"content": "hello"}\n')
    with pytest.raises(UserError, match="no 'text' field.*content"):
        P.prepare(str(tmp_path / "other.jsonl"), **prepare_args(out))
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(UserError, match="not JSON Lines with a string 'text' field.*changed from string to number"):
        P.prepare(str(tmp_path / "number.jsonl"), **prepare_args(out))
    assert not out.exists()
    with pytest.raises(UserError, match="Vocabulary size too high.*--vocab_size"):
        P.prepare(corpus, **prepare_args(out, vocab_size=20000))
    assert not [f for f in os.listdir(out) if f != "progress.json"]
    P.prepare(corpus, **prepare_args(tmp_path / "done", max_train_tokens=1000))
    with pytest.raises(UserError, match="other settings.*max_train_tokens 1000 -> 2000"):
        P.prepare(corpus, **prepare_args(tmp_path / "done", max_train_tokens=2000))


def test_local_formats_give_the_same_documents(corpus, tmp_path):
    # JSON Lines is read by pyarrow directly, a JSON array through datasets; gzip either way
    records = [json.loads(line) for line in open(corpus)]
    expected = list(P.documents(corpus, "train"))
    assert len(expected) == 398 and expected[0] == records[1]["text"]
    with gzip.open(tmp_path / "c4.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (tmp_path / "array.json").write_text(json.dumps(records, indent=1))
    for path in (tmp_path / "c4.jsonl.gz", tmp_path / "array.json"):
        assert list(P.documents(str(path), "train")) == expected
    # records without a text, or with only whitespace, are not documents
    (tmp_path / "gaps.jsonl").write_text('\n'.join(json.dumps(r) for r in [
        {"text": " a "}, {"url": "x"}, {"text": None}, {"text": " \n"}, {"text": "b"}, {"text": "c"}]) + "\n\n")
    assert list(P.documents(str(tmp_path / "gaps.jsonl"), "train", val_fraction=0.5)) == ["b"]
    assert list(P.documents(str(tmp_path / "gaps.jsonl"), "val", val_fraction=0.5)) == ["a", "c"]


def test_hub_datasets_fail_fast_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name in ("c4", "HuggingFaceFW/fineweb"):
        with pytest.raises(UserError, match="--dataset=pydoc"):
            P.prepare(name, **prepare_args(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_gpt2_fails_clearly_offline(monkeypatch):
    import requests
    import tiktoken

    def offline(name):
        raise requests.exceptions.ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(UserError, match="tiktoken could not download.*--tokenizer=train"):
        P.Tokenizer()  # GPT-2's, which tiktoken downloads


def test_cli_bad_input_is_one_line(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), f"--dataset={tmp_path}/missing.jsonl",
                          f"--out_dir={tmp_path}/out", "--tokenizer=train"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and run.stderr.startswith("error: input file") and run.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_pydoc_corpus_is_english():
    docs = list(zip(range(120), P.documents("pydoc", "train")))  # the pydoc topics and the first modules
    assert len(docs) == 120
    text = " ".join(d for _, d in docs)
    assert len(text) > 300_000 and text.count(" the ") > 2000


# -----------------------------------------------------------------------------------------------------------------
# the batch stream


def batches(data_dir, split="train", batch_size=8, seed=0, input_length=64):
    return P.SpanCorruptionBatches(data_dir, split, batch_size, input_length, 0.15, 3.0, seed, 256)


def test_stream_shapes_and_resume(data_dir):
    stream = batches(data_dir)
    x, y = stream.get(0)
    assert x.shape == (8, 64) and y.shape == (8, stream.targets_length) and x.dtype == y.dtype == torch.int64
    assert (stream.raw_length, stream.targets_length) == P.compute_input_and_target_lengths(64, 0.15, 3.0)
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
    with pytest.raises(UserError, match="split evenly"):
        stream.get(3, 0, 3, 0, 1)


def test_each_rank_corrupts_only_its_own_rows(data_dir, monkeypatch):
    corrupted = []

    def recording_span_corrupt(tokens, *args):
        corrupted.append(len(tokens))
        return span_corrupt(tokens, *args)
    span_corrupt = P.span_corrupt
    monkeypatch.setattr(P, "span_corrupt", recording_span_corrupt)
    batches(data_dir).get(3, 1, 2, 1, 2)  # global batch 8: micro-step 1 of 2 on rank 1 of 2 is rows 6 and 7
    assert corrupted == [2]


def test_prefetcher_gives_each_step_its_batches(data_dir):
    stream = batches(data_dir)
    threads = set(threading.enumerate())
    prefetcher = P.Prefetcher(batches(data_dir), 2, 1, 2, "cpu")
    for step in (5, 6, 7, 3, 4, 9):  # a resumed start, steps in order, a jump back, a jump forward
        get_batch = prefetcher(step)
        assert prefetcher.next[0] == step + 1  # being built meanwhile
        for micro_step in range(2):
            input_ids, labels, attention_mask = get_batch(micro_step)
            expected = stream.get(step, micro_step, 2, 1, 2)
            assert torch.equal(input_ids, expected[0]) and torch.equal(labels, expected[1]) and attention_mask is None
    prefetcher.close()
    assert set(threading.enumerate()) == threads  # its thread is gone


def test_prefetcher_thread_pins_on_the_runs_gpu(data_dir, monkeypatch):
    # no GPU here: the thread's choice of device is recorded instead; torch.cuda.set_device needs an index, and
    # device 'cuda' (one GPU, no DDP) has none
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for device in ("cuda", "cuda:1"):
        prefetcher = P.Prefetcher(batches(data_dir), 1, 0, 1, device)
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
    with pytest.raises(UserError, match="no prepared data.*python prepare.py"):
        batches(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="model vocab of 256.*vocab_size is 32128"):
        P.SpanCorruptionBatches(data_dir, "train", 8, 64, 0.15, 3.0, 0, 32128)
    with pytest.raises(UserError, match="fewer than"):
        batches(data_dir, "val", input_length=100_000)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name, content in folder_bytes(data_dir).items():
        (bad / name).write_bytes(content)
    np.full(SHARD_TOKENS, 600, dtype=np.uint16).tofile(bad / "train_000.bin")
    np.full(SHARD_TOKENS, 600, dtype=np.uint16).tofile(bad / "train_001.bin")
    with pytest.raises(UserError, match="train_00[01].bin holds token id 600"):
        for step in range(20):
            batches(str(bad)).get(step)


# -----------------------------------------------------------------------------------------------------------------
# damaged folders, stale and bad tokenizers, full disks


def copy_of(folder, to):
    os.makedirs(to)
    for name, content in folder_bytes(folder).items():
        with open(os.path.join(to, name), "wb") as f:
            f.write(content)
    return str(to)


def test_damaged_data_is_named_and_the_advised_command_rebuilds_it(data_dir, corpus, tmp_path):
    import shlex
    damaged = copy_of(data_dir, tmp_path / "c4")
    os.remove(os.path.join(damaged, "train_001.bin"))
    with open(os.path.join(damaged, "train_002.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match="train_001.bin is missing: rebuild it with `python prepare.py") as e:
        batches(damaged)
    command = shlex.split(str(e.value).split("`")[1])
    assert command[:2] == ["python", "prepare.py"]
    r = subprocess.run([sys.executable, *command[1:]], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "train_001.bin is missing: rebuilding it" in r.stdout
    assert folder_bytes(damaged) == folder_bytes(data_dir)
    # a short val.bin, and a lost tokenizer (then every file is rebuilt with the new one)
    with open(os.path.join(damaged, "val.bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match="val.bin holds .* tokens, not the"):
        batches(damaged, "val")
    P.prepare(corpus, **prepare_args(damaged))
    assert folder_bytes(damaged) == folder_bytes(data_dir)
    os.remove(os.path.join(damaged, "tokenizer.model"))
    P.prepare(corpus, **prepare_args(damaged))
    assert folder_bytes(damaged) == folder_bytes(data_dir)


def test_a_stale_tokenizer_never_survives_into_a_new_run(data_dir, corpus, tmp_path):
    out = tmp_path / "c4"
    out.mkdir()
    # another run's tokenizer, of another vocab size, left in out_dir (the run was killed before any progress)
    P.prepare(corpus, **prepare_args(tmp_path / "small", vocab_size=PIECES // 2, max_train_tokens=1000))
    (out / "tokenizer.model").write_bytes((tmp_path / "small" / "tokenizer.model").read_bytes())
    assert P.prepare(corpus, **prepare_args(out))["vocab_size"] == PIECES + 100
    assert folder_bytes(out) == folder_bytes(data_dir)


def test_an_unreadable_tokenizer_is_refused_before_it_is_copied(corpus, tmp_path):
    (tmp_path / "bad.model").write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(UserError, match="bad.model can't be read as a sentencepiece model"):
        P.prepare(corpus, **prepare_args(tmp_path / "out", tokenizer=str(tmp_path / "bad.model")))
    assert not (tmp_path / "out" / "tokenizer.model").exists()


def test_a_full_disk_names_the_shard_and_the_rerun_continues(data_dir, corpus, tmp_path, monkeypatch):
    fsync = os.fsync

    def disk_full_at_the_second_shard(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("train_001.bin.tmp"):
            raise OSError(28, "No space left on device")
        fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", disk_full_at_the_second_shard)
        with pytest.raises(UserError, match="could not write .*train_001.bin: No space left on device"):
            P.prepare(corpus, **prepare_args(tmp_path))
    assert not glob.glob(str(tmp_path / "*.tmp"))
    P.prepare(corpus, **prepare_args(tmp_path))
    assert folder_bytes(tmp_path) == folder_bytes(data_dir)


@pytest.mark.parametrize("inputs_length, density, mean", [(512, 1.0, 3.0), (512, 0.0, 3.0), (512, 0.15, 0.5),
                                                          (2, 0.15, 3.0)])
def test_input_and_target_lengths_refuse_what_never_ends(inputs_length, density, mean):
    # where these values enter, configurator.py refuses them, before compute_input_and_target_lengths could loop
    r = subprocess.run([sys.executable, "train.py", f"--input_length={inputs_length}", f"--noise_density={density}",
                        f"--mean_noise_span_length={mean}"], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: config key ") and r.stderr.count("\n") == 1, r.stderr


def test_decode_skips_special_tokens_as_hugging_face_does(data_dir):
    from transformers import T5Tokenizer
    tok = P.load_tokenizer(data_dir)
    # Hugging Face's T5 tokenizer over the same pieces (transformers 5 builds it from the (piece, score) list)
    hf = T5Tokenizer(vocab=[(tok.sp.id_to_piece(i), tok.sp.get_score(i)) for i in range(PIECES)], extra_ids=100)
    rng = np.random.default_rng(0)
    special = [tok.pad_id, tok.eos_id, tok.unk_id, tok.first_sentinel_id, tok.first_sentinel_id - 7]
    for _ in range(50):
        ids = [int(i) if rng.random() < 0.7 else int(rng.choice(special)) for i in rng.integers(3, PIECES, 12)]
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), ids
    ids = tok.encode("the model") + [tok.first_sentinel_id, tok.eos_id]
    assert tok.decode(ids) == "the model <extra_id_0>" and tok.decode(ids, skip_special_tokens=True) == "the model"


def test_a_tokenizer_of_another_folder_is_named_and_rebuilt(data_dir, corpus, tmp_path):
    other = P.prepare(corpus, **prepare_args(tmp_path / "small", vocab_size=PIECES // 2, max_train_tokens=1000))
    damaged = copy_of(data_dir, tmp_path / "c4")
    with open(os.path.join(other["data_dir"], "tokenizer.model"), "rb") as f:
        with open(os.path.join(damaged, "tokenizer.model"), "wb") as g:
            g.write(f.read())
    with pytest.raises(UserError, match="tokenizer.model is not the tokenizer .* was prepared with"):
        P.load_tokenizer(damaged)
    P.prepare(corpus, **prepare_args(damaged))  # the command the error names
    assert folder_bytes(damaged) == folder_bytes(data_dir)


def test_tokenizer_training_reports_a_failure_to_read_as_itself():
    def texts():
        yield "some text to learn a vocabulary from " * 50
        raise KeyboardInterrupt  # Ctrl-C while the corpus is read
    with pytest.raises(KeyboardInterrupt):
        P._train_spiece(texts(), 100)


def test_a_val_set_shorter_than_a_window_is_reported(corpus, tmp_path, capsys):
    P.prepare(corpus, **prepare_args(tmp_path, max_val_tokens=100))
    assert "warning: val.bin holds 100 tokens, fewer than one window" in capsys.readouterr().out


# -----------------------------------------------------------------------------------------------------------------
# span accuracy and its baseline


def test_span_accuracy_counts_spans_right_to_their_end():
    # <extra_id_0> = 299, <extra_id_1> = 298, EOS = 1; a span is its tokens and the token that ends it
    labels = torch.tensor([[299, 5, 6, 298, 7, 1], [299, 7, 298, 9, 9, 1]])
    predicted = torch.tensor([[4, 5, 6, 298, 8, 1],  # span 0 right (the first sentinel is not scored), span 1 wrong
                              [299, 7, 298, 9, 9, 3]])  # span 0 right, span 1 not ended by EOS: wrong
    right, spans = P.span_accuracy(torch.nn.functional.one_hot(predicted, 300).float(), labels, 299)
    assert (right.item(), spans.item()) == (2, 4)
    assert P.span_fills(labels, 299) == [(5, 6), (7,), (7,), (9, 9)]


def test_unigram_baseline_always_writes_the_commonest_training_fill():
    class Batches:
        meta = {"first_sentinel_id": 299}

        def __init__(self, labels):
            self.labels = torch.tensor(labels)

        def get(self, step):
            return None, self.labels
    train = Batches([[299, 5, 298, 5, 297, 6, 1]])  # fills (5,), (5,), (6,)
    val = Batches([[299, 5, 298, 7, 7, 1], [299, 6, 298, 5, 5, 1]])  # fills (5,), (7, 7), (6,), (5, 5)
    assert P.unigram_baseline(train, val, val_steps=1, train_spans=3) == ((5,), 0.25)
