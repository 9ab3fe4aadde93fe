"""Tests for prepare.py: prepare (end to end, resume, bad input) and reading a prepared folder back. CPU only, no
network: the data is a synthetic C4-style JSONL file and a sentencepiece model (or a byte-level BPE) trained on it."""
import base64
import functools
import glob
import gzip
import hashlib
import json
import os
import re
import shutil

import numpy as np
import pytest

import data as D
import prepare as P
import tokenizer as T

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

HERE = os.path.dirname(os.path.abspath(__file__))
SHARD_TOKENS = 3000
PIECES = 150


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


def train_shards(meta):  # the train files meta.json lists, by the one rule that names them
    return [P.shard_name("train", i) for i in range(len(meta["shards"]))]


def test_prepare_end_to_end(corpus, data_dir):
    meta = P.load_meta(data_dir)
    files = sorted(os.listdir(data_dir))
    shards = [f for f in files if f.startswith("train_")]
    assert files == sorted(shards + ["val.bin", "tokenizer.model", "meta.json"])
    assert shards == train_shards(meta) and len(shards) >= 3
    sizes = [os.path.getsize(os.path.join(data_dir, f)) // 2 for f in shards]
    assert sizes[:-1] == [SHARD_TOKENS] * (len(shards) - 1) and 0 < sizes[-1] <= SHARD_TOKENS
    assert meta["train_tokens"] == sum(sizes) and meta["val_tokens"] == os.path.getsize(f"{data_dir}/val.bin") // 2
    assert meta["vocab_size"] == PIECES + 100 and meta["model_vocab_size"] == 256
    assert (meta["pad_id"], meta["eos_id"], meta["first_sentinel_id"]) == (0, 1, PIECES + 99)
    assert meta["train_documents"] == 380 and meta["val_documents"] == 20 and meta["source"] == corpus

    # the shards are exactly every train document's ids followed by EOS, in order; val holds every 20th document
    tok = P.load_tokenizer(P.load_meta(data_dir))
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
    assert meta["train_tokens"] == 4000 and train_shards(meta) == ["train_000.bin", "train_001.bin"]
    assert os.path.getsize(tmp_path / "train_001.bin") == 2 * 1000


def test_prepare_resumes_after_interrupt(corpus, data_dir, tmp_path, monkeypatch):
    # small chunks so that the run is interrupted between chunks, with a shard half written
    encoded_chunks, calls = P.encoded_chunks, []

    def interrupted_chunks(docs, tok, num_threads):
        for chunk in encoded_chunks(docs, tok, num_threads, chunk_docs=10):
            calls.append(1)
            if len(calls) == 12:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(P, "encoded_chunks", interrupted_chunks)
    with pytest.raises(KeyboardInterrupt):
        P.prepare(corpus, **prepare_args(tmp_path))
    files = os.listdir(tmp_path)
    progress = json.load(open(tmp_path / "meta.json"))  # the folder's one state file: not complete, and not taken
    assert not progress["complete"] and not [f for f in files if f.endswith(".tmp")]
    with pytest.raises(SystemExit, match="not completely prepared"):
        P.load_meta(str(tmp_path))
    assert 1 <= len(progress["shards"]) < len(train_shards(P.load_meta(data_dir)))
    assert any(s["next_offset"] > 0 for s in progress["shards"])  # a document straddles a shard boundary
    for f in files:
        if f.startswith("train_"):
            assert os.path.getsize(tmp_path / f) == 2 * SHARD_TOKENS

    # what a SIGKILL leaves of a shard it cut in the middle of its writing; the resume takes it away
    (tmp_path / f"{P.shard_name('train', len(progress['shards']))}.0123abcd.tmp").write_bytes(b"\0" * 100)
    monkeypatch.setattr(P, "encoded_chunks", functools.partial(encoded_chunks, chunk_docs=10))
    P.prepare(corpus, **prepare_args(tmp_path))
    assert folder_bytes(tmp_path) == folder_bytes(data_dir)


def test_prepare_bad_input(tmp_path, corpus):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="not found"):
        P.prepare(str(tmp_path / "missing.jsonl"), **prepare_args(out))
    (tmp_path / "empty.jsonl").write_text('{"text": " "}\n' * 3)  # records, but no text
    with pytest.raises(SystemExit, match="no training documents"):
        P.prepare(str(tmp_path / "empty.jsonl"), **prepare_args(out))
    (tmp_path / "other.jsonl").write_text('{"content": "hello"}\n')
    with pytest.raises(SystemExit, match="no 'text' field.*content"):
        P.prepare(str(tmp_path / "other.jsonl"), **prepare_args(out))
    assert not out.exists()
    with pytest.raises(SystemExit, match="Vocabulary size too high.*--vocab_size"):
        P.prepare(corpus, **prepare_args(out, vocab_size=20000))
    assert not [f for f in os.listdir(out) if f != "progress.json"]
    P.prepare(corpus, **prepare_args(tmp_path / "done", max_train_tokens=1000))
    with pytest.raises(SystemExit, match="other settings.*max_train_tokens 1000 -> 2000"):
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
        with pytest.raises(SystemExit, match="--dataset=pydoc"):
            P.prepare(name, **prepare_args(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_pydoc_corpus_is_english():
    docs = list(zip(range(120), P.documents("pydoc", "train")))  # the pydoc topics and the first modules
    assert len(docs) == 120
    text = " ".join(d for _, d in docs)
    assert len(text) > 300_000 and text.count(" the ") > 2000


def batches(data_dir, split="train", batch_size=8, seed=0, input_length=64):
    """data.py's batches of a prepared folder, as train.py makes them"""
    return D.SpanCorruptionBatches(data_dir, split, batch_size, input_length, 0.15, 3.0, seed)


# -----------------------------------------------------------------------------------------------------------------
# damaged folders, stale and bad tokenizers, full disks


def copy_of(folder, to):
    os.makedirs(to)
    for name, content in folder_bytes(folder).items():
        with open(os.path.join(to, name), "wb") as f:
            f.write(content)
    return str(to)


def test_a_lost_or_cut_shard_is_named_when_a_run_opens_the_folder(data_dir, tmp_path):
    damaged = copy_of(data_dir, tmp_path / "c4")
    os.remove(os.path.join(damaged, "train_001.bin"))
    with pytest.raises(SystemExit, match="train_001.bin is not the 3,000 tokens meta.json says .*python prepare.py"):
        batches(damaged)
    with open(os.path.join(damaged, "val.bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(SystemExit, match="val.bin is not the .* tokens meta.json says"):
        batches(damaged, "val")


def test_a_shard_whose_contents_are_not_its_sha256s_is_named(data_dir, corpus, tmp_path):
    meta = P.load_meta(data_dir)
    for name, file in zip([*train_shards(meta), "val.bin"], meta["shards"] + meta["val"]):
        assert file["sha256"] == hashlib.sha256((open(os.path.join(data_dir, name), "rb").read())).hexdigest()
    # overwritten in place with ids of its own tokenizer, the same size: newer than meta.json, checked at start-up
    overwritten = copy_of(data_dir, tmp_path / "overwritten")
    path = os.path.join(overwritten, "train_001.bin")
    np.random.default_rng(0).permutation(np.fromfile(path, dtype=np.uint16)).tofile(path)
    with pytest.raises(SystemExit, match="train_001.bin is not the shard meta.json records .its sha256 differs.: put "
                                         "the file back, or delete .* and prepare it again with `python prepare.py"):
        batches(overwritten)
    # copied in, with its times, from a folder prepared later with the same tokenizer and shard size: start-up takes
    # it (its time is before meta.json's), and the check in the background names it
    other = tmp_path / "other"
    P.prepare(str(write_c4_jsonl(tmp_path / "other.jsonl", seed=1)),
              **prepare_args(other, tokenizer=os.path.join(data_dir, "tokenizer.model")))
    copied = copy_of(data_dir, tmp_path / "copied")
    shutil.copy2(other / "train_000.bin", os.path.join(copied, "train_000.bin"))
    os.utime(os.path.join(copied, "train_000.bin"), (1e9, 1e9))
    streams = batches(copied), batches(copied, "val")
    check = D.ShardCheck(*streams)
    check.join(timeout=60)
    assert len(check.errors) == 1 and "train_000.bin is not the shard meta.json records" in str(check.errors[0])
    check = D.ShardCheck(batches(data_dir), batches(data_dir, "val"))
    check.join(timeout=60)
    assert not check.is_alive() and check.errors == []
    # a folder prepared before meta.json recorded the shards' sha256s: one line to prepare it again
    old = copy_of(data_dir, tmp_path / "old")
    with open(os.path.join(old, "meta.json")) as f:
        meta = json.load(f)
    for file in meta["shards"] + meta["val"]:
        del file["sha256"]
    with open(os.path.join(old, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(SystemExit, match="old was prepared before meta.json recorded each shard's sha256: delete .*old "
                                         "and prepare it again with `python prepare.py"):
        batches(old)


def test_a_stale_tokenizer_never_survives_into_a_new_run(data_dir, corpus, tmp_path):
    out = tmp_path / "c4"
    out.mkdir()
    # another run's tokenizer, of another vocab size, left in out_dir (the run was killed before any progress)
    P.prepare(corpus, **prepare_args(tmp_path / "small", vocab_size=PIECES // 2, max_train_tokens=1000))
    (out / "tokenizer.model").write_bytes((tmp_path / "small" / "tokenizer.model").read_bytes())
    assert P.prepare(corpus, **prepare_args(out))["vocab_size"] == PIECES + 100
    assert folder_bytes(out) == folder_bytes(data_dir)


def test_every_reader_of_a_folder_refuses_a_tokenizer_it_does_not_record(data_dir, corpus, tmp_path):
    # data.py's batches read meta.json alone: an EOS edited there would end every row with another token, and
    # another tokenizer's file would give its ids other pieces; each is named however the folder is read
    edited = copy_of(data_dir, tmp_path / "edited")
    with open(os.path.join(edited, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(edited, "meta.json"), "w") as f:
        json.dump(dict(meta, eos_id=5), f)
    with pytest.raises(SystemExit, match="tokenizer.model is not the tokenizer .*meta.json records .eos_id 5"):
        batches(edited)
    replaced = copy_of(data_dir, tmp_path / "replaced")
    P.prepare(corpus, **prepare_args(tmp_path / "other", vocab_size=PIECES // 2, max_train_tokens=1000))
    (tmp_path / "replaced" / "tokenizer.model").write_bytes((tmp_path / "other" / "tokenizer.model").read_bytes())
    with pytest.raises(SystemExit, match="tokenizer.model is not the tokenizer .*meta.json records .tokenizer_sha256"):
        batches(replaced)


def test_a_tokenizer_without_a_pad_id_is_refused_before_it_is_copied(corpus, tmp_path):
    # sentencepiece's defaults have no pad id (-1): a model built with the data's ids would pad and start decoding
    # with id -1
    import sentencepiece as spm
    texts = [json.loads(line)["text"] for line in open(corpus)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / "defaults"),
                                   vocab_size=PIECES, minloglevel=2)
    with pytest.raises(SystemExit, match="defaults.model' has no pad or no EOS id, which T5 needs: train it with "
                                         "pad_id=0 and eos_id=1"):
        P.prepare(corpus, **prepare_args(tmp_path / "out", tokenizer=str(tmp_path / "defaults.model")))
    assert not (tmp_path / "out" / "tokenizer.model").exists()


def test_an_unreadable_tokenizer_is_refused_before_it_is_copied(corpus, tmp_path):
    (tmp_path / "bad.model").write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(SystemExit, match="bad.model is not a sentencepiece model"):
        P.prepare(corpus, **prepare_args(tmp_path / "out", tokenizer=str(tmp_path / "bad.model")))
    assert not (tmp_path / "out" / "tokenizer.model").exists()


def test_a_full_disk_keeps_every_finished_shard_and_the_rerun_continues(data_dir, corpus, tmp_path, monkeypatch):
    fsync = os.fsync

    def disk_full_at_the_second_shard(fd):
        if re.search(r"train_001\.bin\.\w+\.tmp$", os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(28, "No space left on device")
        fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", disk_full_at_the_second_shard)
        with pytest.raises(OSError, match="No space left on device"):
            P.prepare(corpus, **prepare_args(tmp_path))
    assert not os.path.exists(tmp_path / "train_001.bin")  # never half a shard under its name
    P.prepare(corpus, **prepare_args(tmp_path))
    assert folder_bytes(tmp_path) == folder_bytes(data_dir)


def test_decode_skips_special_tokens_as_hugging_face_does(data_dir):
    from transformers import T5Tokenizer
    tok = P.load_tokenizer(P.load_meta(data_dir))
    # Hugging Face's T5 tokenizer over the same pieces (transformers 5 builds it from the (piece, score) list)
    hf = T5Tokenizer(vocab=[(tok.sp.id_to_piece(i), tok.sp.get_score(i)) for i in range(PIECES)], extra_ids=100)
    rng = np.random.default_rng(0)
    special = [tok.pad_id, tok.eos_id, tok.unk_id, tok.first_sentinel_id, tok.first_sentinel_id - 7]
    for _ in range(50):
        ids = [int(i) if rng.random() < 0.7 else int(rng.choice(special)) for i in rng.integers(3, PIECES, 12)]
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), ids
    ids = tok.encode("the model") + [tok.first_sentinel_id, tok.eos_id]
    assert tok.decode(ids) == "the model <extra_id_0>" and tok.decode(ids, skip_special_tokens=True) == "the model"


def test_tokenizer_training_reports_a_failure_to_read_as_itself():
    def texts():
        yield "some text to learn a vocabulary from " * 50
        raise KeyboardInterrupt  # Ctrl-C while the corpus is read
    with pytest.raises(KeyboardInterrupt):
        T.train_spiece(texts(), 100)


# -----------------------------------------------------------------------------------------------------------------
# a byte-level BPE's tiktoken ranks file (--tokenizer=<file>.tiktoken; GPT-2's for --tokenizer=gpt2)


def write_bpe_ranks(path, texts, vocab_size=400):
    """A byte-level BPE learned on texts by the tokenizers package, as a tiktoken ranks file (lines "base64(piece)
    rank"): its ids are the ranks, the 256 bytes first, then its merges in order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}  # ByteLevel shows each byte as a character
    pieces = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    with open(path, "wb") as f:
        f.writelines(base64.b64encode(bytes(byte_of[c] for c in piece)) + b" %d\n" % i for piece, i in pieces)
    return str(path)


@pytest.fixture(scope="module")
def bpe_file(corpus, tmp_path_factory):
    return write_bpe_ranks(tmp_path_factory.mktemp("bpe") / "bpe.tiktoken", P.documents(corpus, "train"))


def reference_encoding(ranks, **special_tokens):
    """tiktoken's own encoding of ranks, split as GPT-2's"""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    return tiktoken.Encoding("reference", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)


def test_a_tiktoken_ranks_file_prepares_to_its_encodings_ids(corpus, bpe_file, tmp_path):
    """--tokenizer=<file>.tiktoken: each train document in the shards is tiktoken's encoding of it (the ranks read by
    tiktoken) then EOS; after the ranks come EOS (also pad) and the 100 sentinels, <extra_id_0> last"""
    from tiktoken.load import load_tiktoken_bpe
    meta = P.prepare(corpus, **prepare_args(tmp_path, tokenizer=bpe_file))
    ranks = load_tiktoken_bpe(bpe_file)
    n, reference = len(ranks), reference_encoding(ranks)
    with open(bpe_file, "rb") as f:
        assert (tmp_path / "tokenizer.tiktoken").read_bytes() == f.read()
        assert meta["tokenizer_file"] == "tokenizer.tiktoken"
    assert meta["tokenizer_sha256"] == hashlib.sha256((tmp_path / "tokenizer.tiktoken").read_bytes()).hexdigest()
    assert {key: meta[key] for key in ("vocab_size", "model_vocab_size", "eos_id", "pad_id", "first_sentinel_id")} == \
        dict(vocab_size=n + 101, model_vocab_size=512, eos_id=n, pad_id=n, first_sentinel_id=n + 100)
    shards = np.concatenate([np.fromfile(tmp_path / name, dtype=np.uint16) for name in train_shards(meta)])
    expected = [i for doc in P.documents(corpus, "train", val_fraction=0.05) for i in reference.encode(doc) + [n]]
    assert shards.tolist() == expected and len(train_shards(meta)) >= 2
    tok = P.load_tokenizer(meta)
    text = "Naïve café: 日本 <|endoftext|> stays text\n\n  twice."
    assert tok.encode(text) == reference.encode_ordinary(text) and tok.decode(tok.encode(text)) == text
    ids = tok.encode("The model") + [tok.first_sentinel_id - 1] + tok.encode(" reads.") + [tok.eos_id]
    assert tok.decode(ids) == "The model<extra_id_1> reads." and tok.decode(ids, skip_special_tokens=True) == \
        "The model reads."


def test_gpt2_is_tiktokens_encoding_written_as_a_ranks_file(monkeypatch):
    """--tokenizer=gpt2 writes tiktoken.get_encoding("gpt2")'s ranks (here an encoding of GPT-2's shape, 50,256 ranks
    and <|endoftext|> after them: the real one needs the network) as a ranks file, which encodes as it does"""
    import tiktoken
    pairs = (bytes([a, b]) for a in range(32, 256) for b in range(256))
    ranks = {bytes([b]): b for b in range(256)} | {pair: 256 + i for i, pair in zip(range(50_000), pairs)}
    gpt2 = reference_encoding(ranks, **{"<|endoftext|>": 50256})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: {"gpt2": gpt2}[name])
    tok = T.Tokenizer(T.gpt2_ranks())
    assert T.read_ranks(tok.data) == ranks and tok.eos_id == tok.pad_id == gpt2.eot_token == 50256
    assert (tok.vocab_size, tok.first_sentinel_id, tok.model_vocab_size) == (50357, 50356, 50432)  # in uint16
    text = "GPT-2's ranks, then <|endoftext|>: ids to 50,356."
    assert tok.encode(text) == gpt2.encode_ordinary(text)
    assert tok.encode_documents([text])[0].tolist() == gpt2.encode_ordinary(text) + [50256]


def test_gpt2_offline_and_a_bad_ranks_file_are_one_line(corpus, bpe_file, tmp_path):
    from test_train import run
    # offline (a proxy no one answers), with an empty cache: tiktoken can't download GPT-2's files
    r = run(["prepare.py", f"--dataset={corpus}", "--tokenizer=gpt2", f"--out_dir={tmp_path / 'gpt2'}"],
            dict(TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"), https_proxy="http://127.0.0.1:9", no_proxy="",
                 HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY=""))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(r"error: tiktoken can't get GPT-2's tokenizer \(\w+\): connect once, or pass its ranks as "
                        r"--tokenizer=<file>\.tiktoken\n", r.stderr), r.stderr
    with open(bpe_file, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    for name, bad in (("cut", lines[200:]), ("garbled", lines + [b"bm90IGEgcmFuaw== 400x\n"]),
                      ("twice", lines + [lines[-1].split()[0] + b" %d\n" % len(lines)])):  # rank 399 lost
        (tmp_path / f"{name}.tiktoken").write_bytes(b"".join(bad))
        with pytest.raises(SystemExit,
                           match="is not a sentencepiece model or a tiktoken ranks file of a byte-level BPE"):
            P.prepare(corpus, **prepare_args(tmp_path / name, tokenizer=str(tmp_path / f"{name}.tiktoken")))
