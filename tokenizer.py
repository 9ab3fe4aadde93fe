"""
The tokenizer: a sentencepiece model (T5's, or your own) or a byte-level
BPE's tiktoken ranks file, with T5's 100 sentinels after its ids. It is
named by the sha256 of its bytes, as two tokenizers of one vocab size give
an id two meanings; a model meets only ids of its own.
"""
import base64
import hashlib
import io
import math
import re

import numpy as np
import sentencepiece as spm
import tiktoken
import tiktoken_ext.openai_public

NUM_SENTINELS = 100
MAX_VOCAB_SIZE = (1 << 16) - NUM_SENTINELS  # ids are stored as uint16
# sha256 of T5 v1.1's (and flan-t5's) spiece.model
T5_SPIECE_SHA256 = "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86"
# a tiktoken ranks file's first line; a .model is a protobuf
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\n")
# GPT-2's split into words, within which BPE merges bytes
BPE_PATTERN = tiktoken_ext.openai_public.r50k_pat_str

class Tokenizer:
    """A tokenizer file's bytes (data); <extra_id_i> = vocab_size - 1 - i.
    A sentencepiece model as T5's (pad 0, eos 1, unk 2), or a byte-level
    BPE split as GPT-2 splits: ids are the ranks, then <|endoftext|> as
    EOS, pad and decoder start (GPT-2: EOS 50256, <extra_id_0> 50356)."""
    def __init__(self, data):
        self.data = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.tiktoken = TIKTOKEN_LINE.match(data) is not None
        if self.tiktoken:
            ranks = read_ranks(data)
            self.bpe = tiktoken.Encoding("bpe", pat_str=BPE_PATTERN,
                                         mergeable_ranks=ranks,
                                         special_tokens={})
            self.encode, self.decode_run = (self.bpe.encode_ordinary,
                                            self.bpe.decode)
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
        # a model's vocab: the ids, padded for fast matmuls
        self.model_vocab_size = math.ceil(self.vocab_size / 128) * 128

    def identity(self):  # what meta.json records, checked at every read
        keys = ("tokenizer_sha256", "vocab_size", "model_vocab_size",
                "eos_id", "pad_id", "first_sentinel_id")
        return {key: getattr(self, key.removeprefix("tokenizer_"))
                for key in keys}

    def encode_documents(self, texts):
        """(uint16 ids of all texts, each followed by EOS; their lengths)"""
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
        return 0 <= self.first_sentinel_id - i < NUM_SENTINELS

    def decode(self, ids, skip_special_tokens=False):
        """text as T5's tokenizer (a BPE's: its export's) shows it, or as
        HF's skip_special_tokens=True (Tk-Instruct's)"""
        skipped = {self.pad_id}
        if skip_special_tokens:
            skipped |= {self.eos_id, self.unk_id}
        parts, run = [], []
        for i in map(int, ids):
            if self.is_sentinel(i) and not skip_special_tokens:
                parts += [self.decode_run(run),
                          f"<extra_id_{self.first_sentinel_id - i}>"]
                run = []
            elif (not self.is_sentinel(i) and i not in skipped
                  and i < self.vocab_size):  # not the model's padding
                run.append(i)
        joint = "" if self.tiktoken else " "  # a BPE's pieces keep their spaces
        return joint.join(p for p in parts + [self.decode_run(run)] if p)

    def shown_length(self, ids, num_spans=3):
        """how many of ids, a fill, hold its first num_spans spans"""
        ends = (self.eos_id, self.first_sentinel_id - num_spans)
        return next((i for i, token in enumerate(ids) if token in ends),
                    len(ids))

    def show_fill(self, inputs, fill, truth, num_spans=3, context=6):
        """the input around its first num_spans sentinels, the model's fill
        and the true one, as an evaluation prints them"""
        inputs, fill, truth = (np.asarray(x).tolist()
                               for x in (inputs, fill, truth))
        sentinels = [i for i, token in enumerate(inputs)
                     if self.is_sentinel(token)][:num_spans]
        keep = sorted({j for i in sentinels
                       for j in range(i - context, i + context + 1)
                       if 0 <= j < len(inputs)})
        runs = np.split(keep, np.flatnonzero(np.diff(keep) > 1) + 1)
        text = " ... ".join(self.decode([inputs[j] for j in run]).strip()
                            for run in runs)
        start = "... " if keep and keep[0] > 0 else ""
        model, truth = (self.decode(ids[:self.shown_length(ids, num_spans)])
                        for ids in (fill, truth))
        return {"input": start + text + " ...", "model": model.strip(),
                "truth": truth.strip()}

def read_tokenizer(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        return Tokenizer(data)
    except (RuntimeError, ValueError):  # sentencepiece's, or read_ranks'
        raise SystemExit(f"error: {path} is not a sentencepiece model or a "
                         f"tiktoken ranks file of a byte-level BPE") from None

def read_ranks(data):
    """{piece: rank} of a tiktoken ranks file; the ranks are the ids 0, 1,
    ..., and every byte is a piece, or some text could not be encoded"""
    lines = (line.split(b" ") for line in data.splitlines() if line)
    ranks = {base64.b64decode(piece, validate=True): int(rank)
             for piece, rank in lines}
    bytes_missing = any(bytes([b]) not in ranks for b in range(256))
    if bytes_missing or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("not the ranks of a byte-level BPE")
    return ranks

# tokenizers to prepare data with: T5's, GPT-2's, or a new sentencepiece

def t5_spiece():
    """the path of T5's spiece.model, from the Hugging Face cache or Hub"""
    from huggingface_hub import hf_hub_download
    repo = "google/t5-v1_1-base"
    try:
        return hf_hub_download(repo, "spiece.model", local_files_only=True)
    except FileNotFoundError:  # not cached yet
        hub_check(repo, "model",
                  "pass a local copy of T5's spiece.model instead")
        return hf_hub_download(repo, "spiece.model")

def hub_check(repo_id, repo_type, hint):
    """in seconds, not minutes of retries: the Hub or repo out of reach"""
    from huggingface_hub import HfApi
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=3)
    except Exception as e:  # offline, no such or a private repo
        raise SystemExit(f"error: can't get the {repo_type} '{repo_id}' from "
                         f"the Hugging Face Hub ({type(e).__name__}): check "
                         f"the name, or {hint}") from None

def gpt2_ranks():
    """GPT-2's BPE as a tiktoken ranks file (tiktoken downloads it once)"""
    try:
        gpt2 = tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline
        raise SystemExit(f"error: tiktoken can't get GPT-2's tokenizer "
                         f"({type(e).__name__}): connect once, or pass its "
                         f"ranks as --tokenizer=<file>.tiktoken") from None
    pieces = sorted(gpt2.token_byte_values(), key=gpt2.encode_single_token)
    return b"".join(b"%s %d\n" % (base64.b64encode(p),
                                  gpt2.encode_single_token(p)) for p in pieces)

def train_spiece(texts, vocab_size, max_chars=20_000_000):
    """a unigram sentencepiece model with T5's ids, on texts' first lines"""
    lines, chars = [], 0
    for text in texts:
        lines += [line for line in text.splitlines() if line.strip()]
        chars += len(text)
        if chars >= max_chars:
            break
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model,
            vocab_size=vocab_size, model_type="unigram",
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2,
            num_threads=8)  # fixed: the model depends on it
    except RuntimeError as e:
        # "Vocabulary size too high (8000). Please set it to a value <= 3012."
        bound = re.search(r"(?:<=| vs) (\d+)", str(e))
        fix = f": use --vocab_size={bound[1]}" if bound else ""
        reason = str(e).split("] ")[-1].split(". ")[0]
        raise SystemExit(f"error: sentencepiece training failed: "
                         f"{reason}{fix}") from None
    return model.getvalue()

# where weights meet data: the tokenizer a checkpoint carries

def tokenizer_sha256(ckpt):  # None: HF weights without spiece.model, T5's
    data = ckpt["tokenizer"]
    return hashlib.sha256(data).hexdigest() if data else T5_SPIECE_SHA256

def check_tokenizer(ckpt, meta, source):
    """with another tokenizer's data, each id would mean another piece"""
    sha256 = tokenizer_sha256(ckpt)
    vocab_size = ckpt["model_config"]["vocab_size"]
    data = (meta["tokenizer_sha256"], meta["model_vocab_size"])
    if (sha256, vocab_size) != data:
        raise SystemExit(
            f"error: {source} was trained with another tokenizer (sha256 "
            f"{sha256[:12]}, model vocab {vocab_size}) than "
            f"{meta['data_dir']}'s (sha256 {data[0][:12]}, {data[1]}): "
            f"prepare the data with the model's own tokenizer (prepare.py "
            f"--tokenizer=t5 for Google's T5s, or an export's file)")

def tokenizer_of(ckpt, source):
    """the one a checkpoint carries; for HF weights the spiece.model beside
    them, or else T5's; it must make the model's vocab"""
    data, vocab_size = ckpt["tokenizer"], ckpt["model_config"]["vocab_size"]
    if data is None and vocab_size != 32128:  # T5's, padded
        raise SystemExit(f"error: {source} holds no spiece.model, and its "
                         f"vocab of {vocab_size} is not T5's tokenizer's: "
                         f"copy the model's tokenizer there as spiece.model")
    tok = Tokenizer(data) if data else read_tokenizer(t5_spiece())
    if tok.model_vocab_size != vocab_size:
        raise SystemExit(f"error: the tokenizer of {source} is not the "
                         f"model's: its {tok.vocab_size} ids (sentinels "
                         f"included) make a model vocab of "
                         f"{tok.model_vocab_size}, not its vocab_size "
                         f"{vocab_size}; use the tokenizer it was trained "
                         f"with")
    return tok
