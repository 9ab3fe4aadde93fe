"""sample.py run as a user runs it, on a short train.py run: a text with sentinels filled in by generate(), Hugging
Face weights with the tokenizer beside them, a byte-level BPE's run exported for transformers' AutoTokenizer, bad
input as one line; and plot.py's pictures of such a run."""
import json
import math
import os
import shutil

import pytest
import torch

import prepare as P
from checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
from hf import read_hf, save_pretrained
from model import T5, T5Config
from sample import check_text, encode, fill_in
from tokenizer import tokenizer_of
from test_prepare import write_bpe_ranks, write_c4_jsonl
from test_train import TINY, data_dir, run  # noqa: F401 (data_dir is a fixture)

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

TEXT = "The river <extra_id_0> the city <extra_id_1> north."


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):  # noqa: F811
    out = str(tmp_path_factory.mktemp("sample") / "run")
    r = run(["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=30",
             "--eval_interval=1000", "--checkpoint_interval=1000"])
    assert r.returncode == 0, r.stderr
    return out


def model_and_tokenizer(out):
    ckpt = load_checkpoint(find_checkpoint(out))
    return model_from_checkpoint(ckpt).eval(), tokenizer_of(ckpt, out)


def test_a_text_is_filled_in_by_generate(trained):
    r = run(["sample.py", f"--init_from={trained}", f"--text={TEXT}", "--device=cpu", "--max_new_tokens=12"])
    assert r.returncode == 0, r.stderr
    t5, tok = model_and_tokenizer(trained)
    ids = encode(tok, TEXT)
    assert ids[-1] == tok.eos_id and ids.count(tok.first_sentinel_id) == ids.count(tok.first_sentinel_id - 1) == 1
    fill = t5.generate(torch.tensor([ids]), max_new_tokens=12)[0].tolist()
    corrupted = tok.decode(ids)
    assert f"input: {corrupted}\nmodel: {fill_in(tok, corrupted, fill)}\n" in r.stdout
    assert fill_in(tok, "a <extra_id_1> b <extra_id_0>", [tok.first_sentinel_id, 7, tok.first_sentinel_id - 1, 8,
                                                          tok.eos_id]) == f"a [{tok.decode([8])}] b [{tok.decode([7])}]"


def test_hugging_face_weights_use_the_tokenizer_beside_them(trained, tmp_path):
    t5, tok = model_and_tokenizer(trained)
    save_pretrained(t5, str(tmp_path))
    data = load_checkpoint(find_checkpoint(trained))["meta"]["data_dir"]
    shutil.copy(os.path.join(data, "tokenizer.model"), tmp_path / "spiece.model")
    ours = run(["sample.py", f"--init_from={trained}", f"--text={TEXT}", "--device=cpu"])
    theirs = run(["sample.py", f"--init_from={tmp_path}", f"--text={TEXT}", "--device=cpu"])
    assert ours.returncode == theirs.returncode == 0 and ours.stdout == theirs.stdout, theirs.stderr


def test_export_is_a_self_contained_hugging_face_folder(trained, tmp_path):
    """export.py writes the run with its own tokenizer: transformers gives the same logits, sample.py the same fills"""
    import transformers
    folder = str(tmp_path / "hf")
    r = run(["export.py", f"--init_from={trained}", f"--out_dir={folder}"])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "spiece.model", "tokenizer.json",
                                          "tokenizer_config.json"]
    t5, tok = model_and_tokenizer(trained)
    # transformers' AutoTokenizer reads the run's ids from it on a plain install: without protobuf, which a
    # sentencepiece model needs, it reads tokenizer.json
    no_protobuf = (
        "import importlib.abc, sys\n"
        "class NoProtobuf(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[:2] == ['google', 'protobuf']:\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, NoProtobuf())\n"
        "from transformers import AutoTokenizer\n"
        "print(AutoTokenizer.from_pretrained(sys.argv[1])(sys.argv[2]).input_ids)\n")
    r = run(["-c", no_protobuf, folder, TEXT + " <extra_id_99>, naïve  café"])
    assert r.returncode == 0 and r.stdout == f"{encode(tok, TEXT + ' <extra_id_99>, naïve  café')}\n", r.stderr
    hf = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    input_ids, labels = torch.tensor([encode(tok, TEXT)]), torch.tensor([[tok.first_sentinel_id, 7, 8, tok.eos_id]])
    with torch.no_grad():
        torch.testing.assert_close(t5(input_ids, labels=labels)[0], hf(input_ids=input_ids, labels=labels).logits,
                                   rtol=0, atol=1e-4)
    ours = run(["sample.py", f"--init_from={trained}", f"--text={TEXT}", "--device=cpu"])
    theirs = run(["sample.py", f"--init_from={folder}", f"--text={TEXT}", "--device=cpu"])
    assert ours.returncode == theirs.returncode == 0 and ours.stdout == theirs.stdout, theirs.stderr


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """2 steps of train.py on data prepared with a byte-level BPE's tiktoken ranks file (as --tokenizer=gpt2 writes
    GPT-2's)"""
    root = tmp_path_factory.mktemp("bpe")
    corpus = str(write_c4_jsonl(root / "corpus.jsonl"))
    ranks = write_bpe_ranks(root / "bpe.tiktoken", P.documents(corpus, "train"))
    P.prepare(corpus, tokenizer=ranks, out_dir=str(root / "data"), val_fraction=0.05)
    out = str(root / "run")
    r = run(["train.py", *TINY, f"--data_dir={root / 'data'}", f"--out_dir={out}", "--max_steps=2", "--warmup_steps=1",
             "--eval_interval=1000", "--checkpoint_interval=1000"])
    assert r.returncode == 0, r.stderr
    return out


def test_a_bpe_run_exports_a_tokenizer_transformers_reads_as_ours(bpe_run, tmp_path):
    """A run on a BPE's data is a T5 of its ids (EOS = pad = decoder start, after the ranks); export.py writes its
    ranks and transformers' tokenizer.json: AutoTokenizer encodes and decodes a text with sentinels as we do,
    T5ForConditionalGeneration generates our tokens, and sample.py reads the export as the run"""
    import transformers
    folder = str(tmp_path / "hf")
    r = run(["export.py", f"--init_from={bpe_run}", f"--out_dir={folder}"])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer.tiktoken",
                                          "tokenizer_config.json"]
    t5, tok = model_and_tokenizer(bpe_run)
    c = t5.config
    assert tok.tiktoken and c.eos_token_id == c.pad_token_id == c.decoder_start_token_id == tok.eos_id == 400
    config, _, tokenizer = read_hf(folder)
    assert tokenizer == tok.data and (config.eos_token_id, config.pad_token_id, config.decoder_start_token_id) == \
        (c.eos_token_id, c.pad_token_id, c.decoder_start_token_id)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "The river <extra_id_0> the  city\n\n<extra_id_1> north, naïve café 日本 <extra_id_99>."
    ids = encode(tok, text)
    assert hf_tok(text).input_ids == ids and tok.first_sentinel_id - 99 in ids and ids[-1] == tok.eos_id
    assert hf_tok.decode(ids[:-1]) == tok.decode(ids[:-1]) == text
    assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    ours = t5.generate(torch.tensor([ids]), max_new_tokens=8)
    theirs = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, num_beams=1)
    assert torch.equal(ours, theirs[:, 1:]) and theirs[0, 0] == tok.pad_id  # theirs start with the decoder start
    ours = run(["sample.py", f"--init_from={bpe_run}", f"--text={text}", "--device=cpu", "--max_new_tokens=8"])
    theirs = run(["sample.py", f"--init_from={folder}", f"--text={text}", "--device=cpu", "--max_new_tokens=8"])
    assert ours.returncode == theirs.returncode == 0 and ours.stdout == theirs.stdout, theirs.stderr


def test_a_run_carries_its_tokenizer_when_its_data_moves(trained, data_dir, tmp_path):  # noqa: F811
    """sample.py and export.py read a run whose data folder is gone with the tokenizer its checkpoint carries (before,
    a traceback)"""
    moved = tmp_path / "run"
    shutil.copytree(trained, moved)
    state_file = os.path.join(find_checkpoint(str(moved)), "state.pt")
    state = torch.load(state_file, weights_only=False)
    torch.save(dict(state, meta=dict(state["meta"], data_dir=str(tmp_path / "gone"))), state_file)
    r = run(["sample.py", f"--init_from={moved}", f"--text={TEXT}", "--device=cpu", "--max_new_tokens=12"])
    assert r.returncode == 0, r.stderr
    t5, tok = model_and_tokenizer(trained)
    ids = encode(tok, TEXT)
    fill = t5.generate(torch.tensor([ids]), max_new_tokens=12)[0].tolist()
    assert f"model: {fill_in(tok, tok.decode(ids), fill)}\n" in r.stdout
    r = run(["export.py", f"--init_from={moved}", f"--out_dir={tmp_path / 'hf'}"])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(data_dir, "tokenizer.model"), "rb") as f:
        assert (tmp_path / "hf" / "spiece.model").read_bytes() == f.read()


@pytest.mark.parametrize("text, message", [
    ("no gap here", "--text has no sentinel to fill in"),
    ("a <extra_id_100> b", "knows only <extra_id_0> to <extra_id_99>"),
    ("a <extra_id_5000> b", "knows only <extra_id_0> to <extra_id_99>"),
    ("a <extra_id_0> b <extra_id_0>", "--text has a sentinel twice"),
])
def test_a_text_is_checked_where_it_enters(text, message):
    with pytest.raises(SystemExit, match=message):
        check_text(text)
    check_text("a <extra_id_0> b <extra_id_1>")


# relative_position_bucket's worked example (model.py's docstring), num_buckets 32 and max_distance 128; the
# decoder's keys on the right are its future, masked: not drawn
DISTANCES = [-128, -64, -32, -16, -8, -7, -1, 0, 1, 7, 8, 16, 32, 64, 128]
ENCODER_BUCKETS = [15, 14, 12, 10, 8, 7, 1, 0, 17, 23, 24, 26, 28, 30, 31]
DECODER_BUCKETS = [31, 26, 21, 16, 8, 7, 1, 0, None, None, None, None, None, None, None]


def test_plot_draws_each_heads_learned_bias_by_distance():
    """the bias drawn at key - query d for head h is the stack's relative_attention_bias[bucket(d), h]"""
    from plot import plot_biases, position_biases
    t5 = T5(T5Config.from_preset("t5-mini", vocab_size=256))
    with torch.no_grad():  # bias[bucket, head] = 100 * head + bucket (+ 1000 in the decoder)
        for offset, attn in ((0, t5.encoder.blocks[0].attn), (1000, t5.decoder.blocks[0].self_attn)):
            attn.relative_attention_bias.weight.copy_(torch.arange(32)[:, None] + 100 * torch.arange(4) + offset)
    encoder, decoder = plot_biases(position_biases(t5), dpi=50).axes
    for ax, offset, buckets in ((encoder, 0, ENCODER_BUCKETS), (decoder, 1000, DECODER_BUCKETS)):
        assert len(ax.lines) == 4 + 1  # the heads, and 0 marked
        for head, line in enumerate(ax.lines[:4]):
            drawn = dict(zip(line.get_xdata(), line.get_ydata()))
            assert list(drawn) == list(range(-128, 129))
            assert [None if math.isnan(drawn[d]) else drawn[d] for d in DISTANCES] == \
                [None if b is None else 100 * head + b + offset for b in buckets]


def test_plot_draws_the_values_the_log_kept(tmp_path):
    """a step logged twice is drawn with its later value, as the run kept it; another record of the same step (an
    evaluation's) replaces none of its values"""
    from plot import plot_curves, read_log
    records = [{"step": 0, "program": "train.py"},
               {"step": 10, "loss": 5.0, "lr": 0.1, "elapsed": 60.0},
               {"step": 20, "loss": 4.0, "lr": 0.2, "elapsed": 120.0},
               {"step": 20, "val_loss": 4.5, "span_acc": 0.01, "span_baseline": 0.02, "examples": []},
               {"step": 20, "loss": 3.5, "lr": 0.2, "elapsed": 130.0},  # resumed from step 10
               {"step": 30, "loss": 3.0, "lr": 0.3, "elapsed": 190.0},
               {"step": 30, "rougeL": 40.0}]  # a fine-tuning's evaluation, after its step's record
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = read_log(tmp_path / "log.jsonl")
    assert curves["loss"] == ([10, 20, 30], [5.0, 3.5, 3.0]) and curves["val_loss"] == ([20], [4.5])
    loss, span, lr = plot_curves(curves, dpi=50).axes[:3]
    drawn = {line.get_label(): line.get_xydata().tolist() for ax in (loss, span, lr) for line in ax.lines}
    assert drawn == {"loss": [[10, 5.0], [20, 3.5], [30, 3.0]], "val_loss": [[20, 4.5]], "span_acc": [[20, 0.01]],
                     "span_baseline": [[20, 0.02]], "lr": [[10, 0.1], [20, 0.2], [30, 0.3]]}


def test_plot_writes_a_runs_pictures_and_refuses_what_is_not_a_run(trained, tmp_path):
    """plot.py as a user runs it: whole PNGs of the size asked for, with the curves of log.jsonl's values; a folder
    of no run, and a run without its log, are one line"""
    from matplotlib.image import imread
    from plot import read_log
    with open(os.path.join(trained, "log.jsonl")) as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    assert read_log(os.path.join(trained, "log.jsonl"))["loss"] == (list(losses), list(losses.values()))
    r = run(["plot.py", trained, f"--out={tmp_path}", "--dpi=40"])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "position_bias.png"]
    assert r.stdout.split() == [str(tmp_path / "position_bias.png"), str(tmp_path / "curves.png")]
    assert imread(tmp_path / "position_bias.png").shape[:2] == (5 * 40, 7 * 40)
    assert imread(tmp_path / "curves.png").shape[:2] == (3 * 96, 7 * 40)  # 3 panels of 2.4 inches
    step_folder = find_checkpoint(trained)
    r = run(["plot.py", step_folder, f"--out={tmp_path / 'bias'}"])  # weights alone: the bias
    assert r.returncode == 0 and os.listdir(tmp_path / "bias") == ["position_bias.png"], r.stderr
    no_log = tmp_path / "no_log"
    shutil.copytree(trained, no_log, ignore=shutil.ignore_patterns("log.jsonl"))
    for folder, line in ((tmp_path / "bias", "holds no run or weights"), (no_log, "is a run without a log.jsonl")):
        r = run(["plot.py", str(folder)])
        assert r.returncode == 1 and r.stderr.startswith("error: ") and line in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1
