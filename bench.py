"""
Times the training step train.py runs (forward, backward, clip, optimizer step) and, in the same
process on the same weights, what one would otherwise use.
    python bench.py                               # ms/step, tokens/s, MFU, peak memory
    python bench.py --table=True                  # dtype x compile, as the nanoT5 paper's Table 1
    python bench.py --profile=True                # the step's kernels by time, and the attention's
    python bench.py --compare=hf                  # the same step in transformers' T5
    python bench.py --compare=null                # ours against ours: the noise floor of a ratio
    python bench.py --part=generate --compare=hf  # greedy decoding against transformers' generate
    python bench.py --part=optim                  # AdamWScale against torch.optim.AdamW(foreach=True)
    python bench.py --part=data --data_dir=data/pydoc  # one span-corrupted batch, as the loader does
"""
import errors  # first: from here on an error, or Ctrl-C, is one line, not a traceback
import copy
import gc
import itertools
import os
import resource
import statistics
import tempfile
import time

import torch

from data import Prefetcher, SpanCorruptionBatches, compute_input_and_target_lengths, micro_batch_size
from checkpoint import save_pretrained
from files import UserError
from model import PRESETS, T5, T5Config
from optim import make_optimizer, param_groups
from prepare import load_meta
from runtime import DTYPES, check_device, flops_per_step, mfu, print0, require, setup_runtime

# -------------------------------------------------------------------------------------------------
# default config; `valid` below each group says what values its keys may take
valid = {}
part = "train"  # 'train', 'generate' (greedy decoding), 'optim' (an optimizer step), 'data' (a batch)
compare = ""  # 'hf': against transformers; 'null': ours twice; '': train alone, others their reference
table = False  # part=train: each dtype x compile row (those given only), at the largest batch that fits
profile = False  # part=train: after the timing, torch.profiler's table of one step's kernels
data_dir = ""  # a prepare.py folder for real batches; '' -> random ids, no loading in the step
valid.update(part=("train", "generate", "optim", "data"), compare=("", "hf", "null"), table="any",
             profile="any", data_dir="any")
# model and shapes
model = ""  # a preset; '' -> t5-v1_1-base on CUDA (the paper's), t5-v1_1-small elsewhere
batch_size = 0  # examples per optimizer step; 0 -> 128 on CUDA (the paper's) and for data, else 4
grad_accum_steps = 1
input_length = 512
noise_density = 0.15
mean_noise_span_length = 3.0
generate_batch_size = 8
max_new_tokens = 128
valid.update(model=("", *PRESETS), batch_size=">= 0", grad_accum_steps="> 0", input_length=">= 3",
             noise_density="in (0, 1)", mean_noise_span_length=">= 1", generate_batch_size="> 0",
             max_new_tokens="> 0")
# timing
burn_in = 3  # untimed calls first (compilation, warm-up); the first is timed apart, as "1st call"
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
# -------------------------------------------------------------------------------------------------

# the nanoT5 paper's Table 1: seconds per step of its T5-v1.1-base pre-training step on one A100
PAPER_A100_S_PER_STEP = {("float32", False): 4.10, ("tfloat32", False): 1.39, ("bfloat16", False): 1.30,
                         ("tfloat32", True): 0.95, ("bfloat16", True): 0.56}
TABLE_ROWS = [(row_dtype, row_compile) for row_compile in (False, True)
              for row_dtype in ("float32", "tfloat32", "bfloat16")]

def timed(fn):
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the device's work, not just its launch
    return time.perf_counter() - t0

def burn(fn, burn_in):
    """the untimed calls; returns the seconds of the first (it compiles), or None"""
    first = timed(fn) if burn_in else None
    for _ in range(burn_in - 1):
        fn()
    return first

def side_by_side(a, b, work, unit, steps, burn_in, compiled=False):
    """Median seconds per call of two (name, fn) sides, timed A B B A A B ..., so that drift lands
    on both alike; prints each as work per second, the ratio, and with compiled=True the first calls."""
    firsts = [burn(fn, burn_in) for _, fn in (a, b)]
    times = ([], [])
    for i in range(steps):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[side].append(timed((a, b)[side][1]))
    medians = [statistics.median(t) for t in times]
    for (name, fn), t, first in zip((a, b), medians, firsts):
        first_text = f" | first call (compile): {first:.2f} s" if compiled and first is not None else ""
        print0(f"{name:>34s}: {1000 * t:10.1f} ms {work / t:12,.0f} {unit}/s{first_text}")
    ratio = medians[1] / medians[0]
    print0(f"{a[0]} / {b[0]}: {ratio:.2f}x the throughput (medians of {steps} alternating calls)")
    return medians

def build_model(rt, model_name, vocab_size, seed=1337):
    torch.manual_seed(seed)
    return T5(T5Config.from_preset(model_name, vocab_size=vocab_size)).to(rt.device)

def twin(t5, rt, compare):
    """the other side, with exactly our weights: ours again (null), or transformers' T5"""
    if compare == "null":
        return copy.deepcopy(t5)
    import transformers
    transformers.logging.set_verbosity_error()  # its loading bar and notes would drown the timings
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(t5, folder)
        return transformers.T5ForConditionalGeneration.from_pretrained(folder).to(rt.device)

class TransformersAdapter(torch.nn.Module):
    """transformers' T5 behind our forward's signature, so that training_step runs it unchanged"""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, labels=None, attention_mask=None):
        out = self.hf(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        return out.logits, out.loss

def targets_length(input_length):
    return compute_input_and_target_lengths(input_length, noise_density, mean_noise_span_length)[1]

def batches(rt, batch_size, grad_accum_steps, input_length, vocab_size, data_dir="", seed=1337):
    """next_batch() -> a step's micro-batches: from data_dir a new batch each step, prefetched as
    train.py does; else one fixed random batch, and the step loads no data"""
    if data_dir:
        data = SpanCorruptionBatches(data_dir, "train", batch_size, input_length, noise_density,
                                     mean_noise_span_length, seed, vocab_size)
        prefetcher = Prefetcher(data, grad_accum_steps, 0, 1, rt.device)
        steps = itertools.count()
        return lambda: prefetcher.get(next(steps))
    micro = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (micro, input_length), generator=generator)
    labels = torch.randint(0, vocab_size, (micro, targets_length(input_length)), generator=generator)
    micro_batch = dict(input_ids=input_ids.to(rt.device), labels=labels.to(rt.device))
    return lambda: [micro_batch] * grad_accum_steps

def training_step(net, rt, next_batch, compile_model, lr=2e-2, grad_clip=1.0):
    """one call = one optimizer step as train.py's loop takes it: forward and backward over the
    micro-batches, clip, update with AdamWScale (compiled with the model)"""
    optimizer = make_optimizer("adamwscale", param_groups(net, 0.0), lr, compile_model)
    model = torch.compile(net) if compile_model else net

    def step():
        micro_batches = next_batch()
        for batch in micro_batches:
            with rt.autocast():
                _, loss = model(**batch)
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step

def warm_up_compiler(rt):
    """Compiles what both sides share before either first call is timed: the compiler's start-up
    (its workers, its toolchain) and the optimizer's update, so that each first call is its model's"""
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)).to(rt.device)
    optimizer = make_optimizer("adamwscale", param_groups(layers, 0.0), 1e-3, compile=True)
    torch.compile(layers)(torch.ones(2, 8, device=rt.device)).sum().backward()
    optimizer.step()

def bench_train(rt, model_name, vocab_size, batch_size, grad_accum_steps, input_length, compile_model,
                steps=10, burn_in=3, peak_flops=0.0, data_dir="", seed=1337, profile=False):
    """our training step alone: (s/step, tokens/s, MFU or None, peak memory bytes, first call's s);
    profile: then prints one more step's kernels (print_profile)"""
    t5 = build_model(rt, model_name, vocab_size, seed)
    next_batch = batches(rt, batch_size, grad_accum_steps, input_length, vocab_size, data_dir, seed)
    step_fn = training_step(t5, rt, next_batch, compile_model)
    if rt.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):  # Linux: "5" resets the max resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    first = burn(step_fn, burn_in)
    dt = statistics.median(timed(step_fn) for _ in range(steps))
    flops = flops_per_step(t5, batch_size, input_length, targets_length(input_length))
    tokens = batch_size * (input_length + targets_length(input_length))
    mfu_now = mfu(flops, dt, rt.world_size, rt.peak_flops(peak_flops))
    if rt.device_type == "cuda":  # the allocator's high-water mark
        memory = torch.cuda.max_memory_allocated()
    elif os.path.exists("/proc/self/status"):  # Linux: the max resident set since clear_refs, in KiB
        with open("/proc/self/status") as f:  # (getrusage's also holds the parent's, from before exec)
            memory = 1024 * int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
    else:  # macOS: the process's max resident set, in bytes
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if profile:
        print_profile(step_fn, rt)
    return dt, tokens / dt, mfu_now, memory, first

def print_profile(fn, rt, rows=30):
    """torch.profiler's table of one call of fn: its kernels (the GPU's, or the CPU's ops) by their
    own time, how many ran, and which attention kernel SDPA chose"""
    from torch.profiler import profile
    with profile() as prof:  # the CPU's ops, and the GPU's kernels where there is one
        timed(fn)
    events = prof.key_averages()
    on = "cuda" if rt.device_type == "cuda" else "cpu"
    print0(events.table(sort_by=f"self_{on}_time_total", row_limit=rows))
    attention = sorted({e.key for e in events if e.key.startswith("aten::_scaled_dot_product")})
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA" or on == "cpu" and not e.cpu_parent)
    print0(f"attention: {', '.join(attention) or 'none found'}; {kernels:,} " +
           ("CUDA kernels in one step" if on == "cuda" else "CPU ops at the top level in one step"))

def bench_train_fitting(rt, model_name, vocab_size, batch_size, grad_accum_steps, input_length,
                        compile_model, **kwargs):
    """(micro-batch, bench_train's results) at the largest power-of-two micro-batch that fits,
    halving it (raising grad_accum_steps) after each torch.OutOfMemoryError; raises the last one if
    not one example fits"""
    micro = 1
    while micro * 2 <= batch_size // grad_accum_steps and batch_size % (micro * 2) == 0:
        micro *= 2
    while True:
        try:
            return micro, bench_train(rt, model_name, vocab_size, batch_size, batch_size // micro,
                                      input_length, compile_model, **kwargs)
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
        # out of the except block: the failed attempt's tensors, held by the traceback, can be freed
        micro //= 2
        gc.collect()
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()

def print_table(device, model_name, vocab_size, batch_size, input_length, rows=TABLE_ROWS, **kwargs):
    """one line per (dtype, compile) row, at the micro-batch that fits; a row that fails says why"""
    print0(f"{'precision':>10s} {'compile':>8s} {'micro':>6s} {'s/step':>8s} {'tokens/s':>10s} "
           f"{'MFU':>6s} {'peak mem':>9s} {'1st call':>8s} {'paper, A100':>12s}")
    for row_dtype, row_compile in rows:
        paper = PAPER_A100_S_PER_STEP.get((row_dtype, row_compile))
        paper_text = f"{paper:12.2f}" if paper else f"{'-':>12s}"
        head = f"{row_dtype:>10s} {'yes' if row_compile else 'no':>8s}"
        row_rt = setup_runtime(device, row_dtype)
        if row_dtype == "tfloat32" and row_rt.device_type != "cuda":
            print0(f"{head}  skipped: TF32 is an NVIDIA tensor-core mode, here float32   {paper_text}")
            continue
        try:
            micro, (dt, tokens_per_s, mfu_now, memory, first) = bench_train_fitting(
                row_rt, model_name, vocab_size, batch_size, 1, input_length, row_compile, **kwargs)
        except Exception as e:  # out of memory at micro-batch 1, a compiler error
            reason = (str(e).strip().splitlines() or [""])[0][:80]
            print0(f"{head}  failed: {type(e).__name__}: {reason}")
            continue
        mfu_text = f"{100 * mfu_now:5.1f}%" if mfu_now else f"{'-':>6s}"
        first_text = f"{first:7.1f}s" if first is not None else f"{'-':>8s}"
        print0(f"{head} {micro:6d} {dt:8.2f} {tokens_per_s:10,.0f} {mfu_text} {memory / 2**30:7.2f}GB "
               f"{first_text} {paper_text}")

def bench_generate(rt, t5, other, other_name, batch_size, input_length, max_new_tokens, compile_step,
                   steps, burn_in, seed=1337):
    """Greedy decoding of batch_size x max_new_tokens; compile_step: ours compiles its decode step
    (gpt-fast's way). Random weights pick EOS early: both get an EOS id no token has."""
    t5.eval().config.eos_token_id = -1
    other.eval()
    if isinstance(other, T5):
        other.config.eos_token_id = -1
    else:
        other.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, t5.config.vocab_size, (batch_size, input_length), generator=generator)
    input_ids = input_ids.to(rt.device)

    def run(net):
        with rt.autocast():
            if isinstance(net, T5):
                return net.generate(input_ids, max_new_tokens=max_new_tokens, compile=compile_step)
            generated = net.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                     do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
            return generated[:, 1:]  # transformers' starts with the start token
    ours, theirs = run(t5), run(other)
    if ours.shape != theirs.shape or ours.shape != (batch_size, max_new_tokens):
        raise RuntimeError(f"generated {tuple(ours.shape)} and {tuple(theirs.shape)} tokens, not "
                           f"{(batch_size, max_new_tokens)}")
    print0(f"greedy decoding of {batch_size} x {max_new_tokens} new tokens after {input_length} input "
           f"tokens; {100 * (ours == theirs).float().mean():.1f}% of the tokens agree")
    side_by_side(("ours", lambda: run(t5)), (other_name, lambda: run(other)), batch_size * max_new_tokens,
                 "tok", steps, burn_in)

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    if compare == "hf" and part in ("data", "optim"):
        raise UserError(f"compare '{compare}' is not valid here; use '' (the part's reference), 'null', "
                        f"or 'hf' with part=train or part=generate")
    if (table or profile) and (part != "train" or compare):
        raise UserError(f"--{'table' if table else 'profile'}=True times our training step alone; drop --part "
                        f"and --compare")
    if not table and (compare == "hf" or (part == "generate" and not compare)):
        require("transformers", f"bench.py --part={part} against transformers")
    torch.set_num_threads(threads or os.cpu_count())
    rt = setup_runtime(device, dtype, seed)
    on_cuda = rt.device_type == "cuda"
    model = model or ("t5-v1_1-base" if on_cuda else "t5-v1_1-small")
    batch_size = batch_size or (128 if on_cuda or part == "data" else 4)
    micro_batch_size(batch_size, grad_accum_steps, rt.world_size)  # one line if the batch won't split
    vocab_size = T5Config.from_preset(model).vocab_size
    if data_dir:
        vocab_size = load_meta(data_dir)["model_vocab_size"]
    name = torch.cuda.get_device_name() if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    print0(f"{name} | {model} | {part} | batch {batch_size} x {input_length} | {dtype} | "
           f"compile={compile} | {'data from ' + data_dir if data_dir else 'random ids'}")

    if table:  # every row, or those of the dtype and compile given
        rows = [(row_dtype, row_compile) for row_dtype, row_compile in TABLE_ROWS
                if ("dtype" not in given_at or row_dtype == dtype)
                and ("compile" not in given_at or row_compile == compile)]
        print_table(device, model, vocab_size, batch_size, input_length, rows, steps=steps,
                    burn_in=burn_in, peak_flops=peak_flops, data_dir=data_dir, seed=seed)
    elif part == "train" and not compare:
        dt, tokens_per_s, mfu_now, memory, first = bench_train(
            rt, model, vocab_size, batch_size, grad_accum_steps, input_length, compile, steps, burn_in,
            peak_flops, data_dir, seed, profile)
        mfu_text = f" | MFU {100 * mfu_now:.1f}%" if mfu_now else ""
        first_text = f" | first call (compile): {first:.2f} s" if compile and burn_in else ""
        print0(f"{1000 * dt:.1f} ms/step | {tokens_per_s:,.0f} tokens/s{mfu_text} | peak memory "
               f"{memory / 2**30:.2f} GB{first_text}")
    elif part == "data":  # the loader's work for one global batch: windows read, span-corrupted
        if not data_dir:
            raise UserError("part=data builds batches of a prepared folder: pass --data_dir=data/pydoc")
        data = SpanCorruptionBatches(data_dir, "train", batch_size, input_length, noise_density,
                                     mean_noise_span_length, seed, vocab_size)
        side_by_side(("a batch", lambda: data.get(0)), ("a batch again", lambda: data.get(0)),
                     batch_size * data.raw_length, "tok", steps, burn_in)
    elif part == "optim":
        t5 = build_model(rt, model, vocab_size, seed)
        other = copy.deepcopy(t5)
        for p, q in zip(t5.parameters(), other.parameters()):
            p.grad = torch.randn_like(p) * 1e-3
            q.grad = p.grad.clone()
        ours = make_optimizer("adamwscale", param_groups(t5, 0.0), 2e-2, compile)
        if compare == "null":
            reference = ("AdamWScale again", make_optimizer("adamwscale", param_groups(other, 0.0), 2e-2, compile).step)
        else:
            reference = ("AdamW(foreach=True)", torch.optim.AdamW(other.parameters(), foreach=True).step)
        print0(f"one optimizer step over {t5.num_params():,} parameters")
        side_by_side(("AdamWScale", ours.step), reference, t5.num_params(), "param", steps, burn_in)
    else:  # train or generate, against transformers or ours again
        t5 = build_model(rt, model, vocab_size, seed)
        other = twin(t5, rt, compare or "hf")
        other_name = "ours again" if compare == "null" else "transformers"
        if part == "generate":
            bench_generate(rt, t5, other, other_name, generate_batch_size, input_length, max_new_tokens,
                           compile, steps, burn_in, seed)
        else:
            next_batch = batches(rt, batch_size, grad_accum_steps, input_length, vocab_size, data_dir, seed)
            theirs = other if compare == "null" else TransformersAdapter(other)
            tokens = batch_size * (input_length + targets_length(input_length))
            if compile:
                warm_up_compiler(rt)
            side_by_side(("ours", training_step(t5, rt, next_batch, compile)),
                         (other_name, training_step(theirs, rt, next_batch, compile)), tokens, "tok",
                         steps, burn_in, compiled=compile)
