"""
Times the training step that train.py runs (optim.train_step itself: forward, backward, clip, optimizer step) and,
in the same process and on the same weights, the alternatives one would otherwise use.
    python bench.py                                  # ms/step, tokens/s, MFU, peak memory
    python bench.py --table=True                     # dtype x compile, laid out like the nanoT5 paper's Table 1
    python bench.py --compare=hf                     # the same step in transformers' T5ForConditionalGeneration
    python bench.py --compare=null                   # ours against ours: the noise floor of every ratio here
    python bench.py --part=data                      # span corruption of a batch vs one example at a time
    python bench.py --part=optim                     # AdamWScale vs torch.optim.AdamW(foreach=True)
    python bench.py --part=generate                  # greedy decoding vs transformers' generate
    python bench.py --part=prepare --data_dir=data/pydoc --dataset=big.jsonl   # prepare.py vs one sp.encode call
    python bench.py --profile=True                   # torch.profiler trace of every timed side, into out_dir
The CPU measurements of the README:
    python bench.py --device=cpu --threads=2 --dtype=float32 --compile=False --compare=hf
"""
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from model import PRESETS, T5, T5Config
from optim import make_optimizer, param_groups, train_step
from prepare import Prefetcher, SpanCorruptionBatches, compute_input_and_target_lengths, load_meta, span_corrupt
from runtime import DTYPES, UserError, check_device, flops_per_step, mfu, print0, setup_runtime

# -----------------------------------------------------------------------------------------------------------------
# default config; --key=value overrides any of these, and `valid` below each group says what values they may take
valid = {}
part = "train"  # 'train', 'data' (span corruption), 'optim' (optimizer step), 'generate' (greedy decoding) or
# 'prepare' (prepare.py's tokenising of `dataset` with data_dir's tokenizer vs one single-process sentencepiece call)
compare = ""  # '': ours alone (train) or against the part's reference; 'hf': against transformers; 'null': ours twice
table = False  # part=train: every dtype x compile row in one run, each at the largest micro-batch that fits
profile = False
out_dir = "out/bench"  # profiler traces go here
data_dir = ""  # a prepare.py folder to time real span-corrupted batches; '' -> random ids, no loading in the step
dataset = "pydoc"  # part=prepare: the text to tokenise, any dataset prepare.py accepts (a big local file is fairest)
num_proc = os.cpu_count()  # part=prepare: prepare.py's tokenising threads
valid.update(part=("train", "data", "optim", "generate", "prepare"), compare=("", "hf", "null"), table="any",
             profile="any", out_dir="non-empty", data_dir="any", dataset="non-empty", num_proc="> 0")
# model and shapes
model = ""  # a preset; '' -> t5-v1_1-base on CUDA (the paper's), t5-v1_1-small elsewhere
batch_size = 0  # examples per optimizer step; 0 -> 128 on CUDA (the paper's), 4 elsewhere (128 for part=data)
grad_accum_steps = 1
input_length = 512
noise_density = 0.15
mean_noise_span_length = 3.0
generate_batch_size = 8
max_new_tokens = 128
valid.update(model=("", *PRESETS), batch_size=">= 0", grad_accum_steps="> 0", input_length=">= 3",
             noise_density="in (0, 1)", mean_noise_span_length=">= 1", generate_batch_size="> 0", max_new_tokens="> 0")
# the step, as train.py's defaults
lr = 2e-2
grad_clip = 1.0
valid.update(lr="> 0", grad_clip=">= 0")
# timing
burn_in = 3  # untimed calls first: compilation, allocator and thread-pool warm-up, optimizer state creation; the
# first one is timed apart and printed as "first call (compile)"
steps = 10  # timed calls (per side when two are compared)
peak_flops = 0.0  # dense peak FLOP/s for MFU; 0 -> runtime.PEAK_FLOPS for known GPUs
valid.update(burn_in=">= 0", steps="> 0", peak_flops=">= 0")
# system
device = "auto"
dtype = "bfloat16"
compile = True
threads = 0  # CPU threads for torch; 0 -> all cores
seed = 1337
valid.update(device=check_device, dtype=DTYPES, compile="any", threads=">= 0", seed=">= 0")
# -----------------------------------------------------------------------------------------------------------------

# the nanoT5 paper's Table 1: seconds per step of its default T5-v1.1-base pre-training step on one A100
PAPER_A100_S_PER_STEP = {("float32", False): 4.10, ("tfloat32", False): 1.39, ("bfloat16", False): 1.30,
                         ("tfloat32", True): 0.95, ("bfloat16", True): 0.56}
TABLE_ROWS = [(row_dtype, row_compile) for row_compile in (False, True)
              for row_dtype in ("float32", "tfloat32", "bfloat16")]


@dataclass
class Shape:
    """what one training step processes: batch_size examples of input_length tokens over grad_accum_steps micro-steps,
    the targets as long as span corruption makes them"""
    model_name: str
    batch_size: int
    grad_accum_steps: int = 1
    input_length: int = 512
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0

    @property
    def raw_length(self):
        return compute_input_and_target_lengths(self.input_length, self.noise_density, self.mean_noise_span_length)[0]

    @property
    def targets_length(self):
        return compute_input_and_target_lengths(self.input_length, self.noise_density, self.mean_noise_span_length)[1]

    @property
    def tokens_per_step(self):
        return self.batch_size * (self.input_length + self.targets_length)


@dataclass
class Timing:
    """how calls are timed: burn_in untimed calls (the first timed apart), then `steps` timed ones; sync waits for
    the device; trace_prefix, when set, is where torch.profiler traces go ('out/bench/trace_train_')"""
    burn_in: int = 3
    steps: int = 10
    sync: object = lambda: None
    trace_prefix: str = ""


def timed(fn, sync):
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def burn(fn, timing):
    """the untimed calls before timing; returns the seconds of the first, which compiles (None when burn_in is 0)"""
    first = timed(fn, timing.sync) if timing.burn_in else None
    for _ in range(timing.burn_in - 1):
        fn()
    return first


def side_by_side(a, b, work, unit, timing, compiled=False):
    """
    Median seconds per call of two (name, fn) sides, timed in the order A B B A A B ... after burn_in calls of each,
    so that drift (other processes on the machine, clocks, caches) lands on both alike. Prints both as throughput
    (work units per call) and the ratio, and with compiled=True each side's first, compiling call; every comparison
    in this file goes through here.
    """
    sides = (a, b)
    firsts = [burn(fn, timing) for _, fn in sides]
    times = ([], [])
    for i in range(timing.steps):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[side].append(timed(sides[side][1], timing.sync))
    medians = [statistics.median(t) for t in times]
    for (name, _), t, first in zip(sides, medians, firsts):
        first_text = f" | first call (compile): {first:.2f} s" if compiled and first is not None else ""
        print0(f"{name:>34s}: {1000 * t:10.1f} ms {work / t:12,.0f} {unit}/s{first_text}")
    print0(f"{a[0]} / {b[0]}: {medians[1] / medians[0]:.2f}x the throughput (medians of {timing.steps} alternating "
           f"calls)")
    if timing.trace_prefix:
        for name, fn in sides:
            trace(name, fn, timing)
    return medians


def trace(name, fn, timing):
    """a chrome trace (open in chrome://tracing or ui.perfetto.dev) and the ops that took the most time"""
    from torch.profiler import ProfilerActivity
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            fn()
            timing.sync()
    path = f"{timing.trace_prefix}{name.replace(' ', '_')}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)
    print0(f"\nprofile of {name}, 3 calls (trace in {path}):")
    print0(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=20))


def peak_memory():
    """bytes: the CUDA allocator's high-water mark, or on CPU the whole process's max resident set so far"""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def build_model(rt, model_name, vocab_size, seed=1337):
    torch.manual_seed(seed)
    t5 = T5(T5Config.from_preset(model_name, vocab_size=vocab_size))
    return t5.to(rt.device)


def transformers_twin(t5, rt):
    """transformers' T5ForConditionalGeneration holding exactly our weights, through our own save_pretrained"""
    import transformers
    # its loading progress bar and its note that our untied lm_head stays untied would drown the timings
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        t5.save_pretrained(folder)
        return transformers.T5ForConditionalGeneration.from_pretrained(folder).to(rt.device)


def our_twin(t5, rt):
    """a second copy of ours with the same weights, for the null comparison"""
    with tempfile.TemporaryDirectory() as folder:
        t5.save_pretrained(folder)
        return T5.from_pretrained(folder).to(rt.device)


class TransformersAdapter(torch.nn.Module):
    """transformers' T5 behind our forward's signature, so that optim.train_step runs it unchanged"""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, labels=None, attention_mask=None):
        out = self.hf(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        return out.logits, out.loss


def batches(rt, shape, vocab_size, data_dir="", seed=1337):
    """get_batch for train_step: real batches from data_dir, a new one each step as train.py loads them (built ahead
    in a thread, as train.py's Prefetcher does), or one fixed random batch (then the step has no data loading)"""
    micro_batch_size = rt.micro_batch_size(shape.batch_size, shape.grad_accum_steps)
    if not data_dir:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab_size, (micro_batch_size, shape.input_length), generator=generator)
        labels = torch.randint(0, vocab_size, (micro_batch_size, shape.targets_length), generator=generator)
        input_ids, labels = input_ids.to(rt.device), labels.to(rt.device)
        return lambda micro_step: (input_ids, labels, None)
    data = SpanCorruptionBatches(data_dir, "train", shape.batch_size, shape.input_length, shape.noise_density,
                                 shape.mean_noise_span_length, seed, vocab_size)
    prefetcher = Prefetcher(data, shape.grad_accum_steps, 0, 1, rt.device)
    step, step_batches = -1, None

    def get_batch(micro_step):
        nonlocal step, step_batches
        if micro_step == 0:
            step += 1
            step_batches = prefetcher(step)
        return step_batches(micro_step)
    return get_batch


def training_step(net, rt, get_batch, grad_accum_steps, compile_model, lr=2e-2, grad_clip=1.0):
    """one call = one optimizer step of optim.train_step, with train.py's optimizer and clipping"""
    optimizer = make_optimizer("adamwscale", param_groups(net, 0.0), lr)
    net = torch.compile(net) if compile_model else net
    return lambda: train_step(net, optimizer, get_batch, grad_accum_steps, lr, grad_clip, autocast=rt.autocast)


def bench_train(rt, shape, vocab_size, compile_model, timing, peak_flops=0.0, data_dir="", seed=1337):
    """our training step alone: (s/step, tokens/s, MFU or None, peak memory in bytes, first call's seconds)"""
    t5 = build_model(rt, shape.model_name, vocab_size, seed)
    step_fn = training_step(t5, rt, batches(rt, shape, vocab_size, data_dir, seed), shape.grad_accum_steps,
                            compile_model)
    if rt.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first = burn(step_fn, timing)
    dt = statistics.median(timed(step_fn, timing.sync) for _ in range(timing.steps))
    flops = flops_per_step(t5, shape.batch_size, shape.input_length, shape.targets_length)
    mfu_now = mfu(flops, dt, rt.world_size, rt.peak_flops(peak_flops))
    if timing.trace_prefix:
        trace("ours", step_fn, timing)
    return dt, shape.tokens_per_step / dt, mfu_now, peak_memory(), first


def bench_train_fitting(rt, shape, vocab_size, compile_model, timing, peak_flops=0.0, data_dir="", seed=1337):
    """
    bench_train at the largest power-of-two micro-batch that fits in memory: from shape's own micro-batch down,
    halving after each torch.OutOfMemoryError, with grad_accum_steps raised to keep the global batch. Returns (the
    micro-batch used, bench_train's results); raises the last OutOfMemoryError when not even one example fits.
    """
    asked = shape.batch_size // shape.grad_accum_steps
    micro = 1
    while micro * 2 <= asked and shape.batch_size % (micro * 2) == 0:
        micro *= 2
    while True:
        try:
            return micro, bench_train(rt, replace(shape, grad_accum_steps=shape.batch_size // micro), vocab_size,
                                      compile_model, timing, peak_flops, data_dir, seed)
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
        # out of the except block, so that the failed attempt's tensors, held by the traceback, can be freed
        micro //= 2
        gc.collect()
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()


def print_table(device, shape, vocab_size, timing, peak_flops=0.0, data_dir="", seed=1337, rows=TABLE_ROWS):
    """one line per (dtype, compile) row, each at the micro-batch that fits; a row that fails says why, and the
    table goes on"""
    print0(f"{'precision':>10s} {'compile':>8s} {'micro':>6s} {'s/step':>8s} {'tokens/s':>10s} {'MFU':>6s} "
           f"{'peak mem':>9s} {'1st call':>8s} {'paper, A100':>12s}")
    for row_dtype, row_compile in rows:
        paper = PAPER_A100_S_PER_STEP.get((row_dtype, row_compile))
        paper_text = f"{paper:12.2f}" if paper else f"{'-':>12s}"
        head = f"{row_dtype:>10s} {'yes' if row_compile else 'no':>8s}"
        row_rt = setup_runtime(device, row_dtype, seed)
        if row_dtype == "tfloat32" and row_rt.device_type != "cuda":
            print0(f"{head}  skipped: TF32 is an NVIDIA tensor-core mode, here it is float32   {paper_text}")
            continue
        try:
            micro, (dt, tokens_per_s, mfu_now, memory, first) = bench_train_fitting(
                row_rt, shape, vocab_size, row_compile, timing, peak_flops, data_dir, seed)
        except Exception as e:  # one row's failure (out of memory at micro-batch 1, a compiler error) is reported
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print0(f"{head}  failed: {type(e).__name__}: {message[:80]}")
            continue
        mfu_text = f"{100 * mfu_now:5.1f}%" if mfu_now else f"{'-':>6s}"
        first_text = f"{first:7.1f}s" if first is not None else f"{'-':>8s}"
        print0(f"{head} {micro:6d} {dt:8.2f} {tokens_per_s:10,.0f} {mfu_text} {memory / 2**30:7.2f}GB {first_text} "
               f"{paper_text}")


def bench_train_side_by_side(rt, shape, vocab_size, compare, compile_model, timing, data_dir="", seed=1337):
    t5 = build_model(rt, shape.model_name, vocab_size, seed)
    other = our_twin(t5, rt) if compare == "null" else TransformersAdapter(transformers_twin(t5, rt))
    get_batch = batches(rt, shape, vocab_size, data_dir, seed)
    # both sides compiled or neither
    accum = shape.grad_accum_steps
    side_by_side(("ours", training_step(t5, rt, get_batch, accum, compile_model)),
                 ("ours again" if compare == "null" else "transformers",
                  training_step(other, rt, get_batch, accum, compile_model)),
                 shape.tokens_per_step, "tok", timing, compiled=compile_model)


def bench_data(shape, compare, timing, seed=1337):
    """building one global batch of span-corrupted examples, as the data loader does every step"""
    rows, raw_length = shape.batch_size, shape.raw_length
    first_sentinel_id, eos_id = 32099, 1  # the T5 tokenizer's <extra_id_0> and </s>
    # uint16, as the loader reads windows out of the .bin shards
    tokens = np.random.default_rng(seed).integers(2, first_sentinel_id - 99, (rows, raw_length), dtype=np.uint16)
    print0(f"span corruption of {rows} x {raw_length} tokens -> inputs {shape.input_length}, targets "
           f"{shape.targets_length}")

    def corrupt(implementation):
        # a fresh rng every call: every call does the same work
        return lambda: implementation(tokens, shape.noise_density, shape.mean_noise_span_length, first_sentinel_id,
                                      eos_id, np.random.default_rng(seed))
    from test_prepare import span_corrupt_per_example  # the reference implementation lives with its test
    reference = ("batched again", corrupt(span_corrupt)) if compare == "null" else \
        ("per example", corrupt(span_corrupt_per_example))
    side_by_side(("batched", corrupt(span_corrupt)), reference, rows * raw_length, "tok", timing)


def bench_prepare(data_dir, dataset, num_proc, compare, timing):
    """prepare.py end to end (reading, tokenising in num_proc threads, writing shards) against one single-threaded
    sentencepiece call on the same documents, already in memory: the speed-up parallel tokenisation buys"""
    import sentencepiece as spm
    from prepare import documents, prepare
    if not data_dir:
        raise UserError("part=prepare tokenises with a prepared folder's tokenizer: pass --data_dir=data/pydoc")
    tokenizer_file = load_meta(data_dir)["tokenizer_file"]
    if not tokenizer_file:
        raise UserError(f"{data_dir} was prepared with the gpt2 tokenizer; part=prepare needs a sentencepiece one")
    model_file = os.path.join(data_dir, tokenizer_file)
    texts = list(documents(dataset, "train")) + list(documents(dataset, "val"))
    sp = spm.SentencePieceProcessor(model_file=model_file)
    tokens = sum(len(ids) + 1 for ids in sp.encode(texts))  # + EOS, as prepare.py writes it
    print0(f"{len(texts):,} documents of {dataset}, {tokens:,} tokens")

    def run_prepare():
        with tempfile.TemporaryDirectory() as folder:
            prepare(dataset, model_file, folder, num_proc=num_proc)
    reference = ("prepare.py again", run_prepare) if compare == "null" else \
        ("one sp.encode call", lambda: sp.encode(texts, num_threads=1))
    side_by_side((f"prepare.py, num_proc={num_proc}", run_prepare), reference, tokens, "tok", timing)


def bench_optim(rt, model_name, vocab_size, compare, timing, lr=2e-2, seed=1337):
    t5 = build_model(rt, model_name, vocab_size, seed)
    twin = our_twin(t5, rt)
    for p, q in zip(t5.parameters(), twin.parameters()):
        p.grad = torch.randn_like(p) * 1e-3
        q.grad = p.grad.clone()
    ours = make_optimizer("adamwscale", param_groups(t5, 0.0), lr)
    if compare == "null":
        reference = ("AdamWScale again", make_optimizer("adamwscale", param_groups(twin, 0.0), lr).step)
    else:
        reference = ("AdamW(foreach=True)", torch.optim.AdamW(param_groups(twin, 0.0), lr, foreach=True).step)
    print0(f"one optimizer step over {t5.num_params():,} parameters")
    side_by_side(("AdamWScale", ours.step), reference, t5.num_params(), "param", timing)


def bench_generate(rt, model_name, vocab_size, compare, timing, batch_size=8, input_length=512, max_new_tokens=128,
                   seed=1337, compile_step=False):
    """
    Greedy decoding of batch_size x max_new_tokens; compile_step: ours compiles its one-token decode step (gpt-fast's
    way), transformers' generate runs as it is. Random weights often pick EOS early, and a batch that stops
    early measures less work; both models get an EOS id no token can have (ours -1, transformers' None), so both
    always run all max_new_tokens steps, and the shapes are checked below.
    """
    t5 = build_model(rt, model_name, vocab_size, seed).eval()
    other = our_twin(t5, rt) if compare == "null" else transformers_twin(t5, rt)
    other.eval()
    t5.config.eos_token_id = -1
    if compare == "null":
        other.config.eos_token_id = -1
    else:
        other.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (batch_size, input_length), generator=generator).to(rt.device)

    def ours(net):
        def run():
            with rt.autocast():
                return net.generate(input_ids, max_new_tokens=max_new_tokens, compile=compile_step)
        return run

    def theirs():
        with rt.autocast():
            out = other.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 num_beams=1, max_new_tokens=max_new_tokens)
        return out[:, 1:]  # transformers returns the decoder start token too
    reference = ("ours again", ours(other)) if compare == "null" else ("transformers", theirs)
    tokens_a, tokens_b = ours(t5)(), reference[1]()
    expected = (batch_size, max_new_tokens)
    if tokens_a.shape != expected or tokens_b.shape != expected:
        raise RuntimeError(f"generated {tuple(tokens_a.shape)} and {tuple(tokens_b.shape)} tokens, not {expected}")
    print0(f"greedy decoding of {expected[0]} x {expected[1]} new tokens after {input_length} input tokens; "
           f"{100 * (tokens_a == tokens_b).float().mean():.1f}% of the tokens agree")
    side_by_side(("ours", ours(t5)), reference, batch_size * max_new_tokens, "tok", timing)


if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    if compare == "hf" and part in ("data", "optim", "prepare"):
        raise UserError(f"compare '{compare}' is not valid here; use '' (the part's reference), 'null', or 'hf' "
                        f"with part=train or part=generate")
    if table and (part != "train" or compare):
        raise UserError("--table=True times our training step alone; drop --part and --compare")
    torch.set_num_threads(threads or os.cpu_count())
    rt = setup_runtime(device, dtype, seed)
    on_cuda = rt.device_type == "cuda"
    shape = Shape(model or ("t5-v1_1-base" if on_cuda else "t5-v1_1-small"),
                  batch_size or (128 if on_cuda or part == "data" else 4), grad_accum_steps, input_length,
                  noise_density, mean_noise_span_length)
    rt.micro_batch_size(shape.batch_size, shape.grad_accum_steps)  # a one-line error if the batch does not split
    timing = Timing(burn_in, steps, torch.cuda.synchronize if on_cuda else lambda: None,
                    os.path.join(out_dir, f"trace_{part}_") if profile else "")
    vocab_size = T5Config.from_preset(shape.model_name).vocab_size
    if data_dir:
        vocab_size = load_meta(data_dir)["model_vocab_size"]
    name = torch.cuda.get_device_name() if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    shape_text = f"batch {shape.batch_size} x ({input_length} input + {shape.targets_length} target) | " \
        if part == "train" else ""
    print0(f"{name} | {shape.model_name} | {part} | {shape_text}{dtype} | compile={compile} | "
           f"{'data from ' + data_dir if data_dir else 'random ids'}")

    if part == "data":
        bench_data(shape, compare, timing, seed)
    elif part == "prepare":
        bench_prepare(data_dir, dataset, num_proc, compare, timing)
    elif part == "optim":
        bench_optim(rt, shape.model_name, vocab_size, compare, timing, lr, seed)
    elif part == "generate":
        bench_generate(rt, shape.model_name, vocab_size, compare, timing, generate_batch_size, input_length,
                       max_new_tokens, seed, compile)
    elif table:
        print_table(device, shape, vocab_size, timing, peak_flops, data_dir, seed)
    elif compare:
        bench_train_side_by_side(rt, shape, vocab_size, compare, compile, timing, data_dir, seed)
    else:
        dt, tokens_per_s, mfu_now, memory, first = bench_train(rt, shape, vocab_size, compile, timing, peak_flops,
                                                               data_dir, seed)
        mfu_text = f" | MFU {100 * mfu_now:.1f}%" if mfu_now else ""
        first_text = f" | first call (compile): {first:.2f} s" if compile and first is not None else ""
        print0(f"{1000 * dt:.1f} ms/step | {tokens_per_s:,.0f} tokens/s{mfu_text} | peak memory "
               f"{memory / 2**30:.2f} GB{first_text}")
