"""
Times train.py's step (forward, backward, clip, optimizer) and, in the
same process on the same weights, what one would otherwise use.
    python bench.py                 # ms/step, tokens/s, MFU, a GPU's memory
    python bench.py --compare=hf    # the same step in transformers' T5
    python bench.py --compare=null  # ours against ours: a ratio's noise
"""
import copy
import os
import statistics
import tempfile
import time

import torch

from data import compute_input_and_target_lengths, micro_batch_size
from hf import save_pretrained
from model import PRESETS, T5, T5Config
from optim import make_optimizer, param_groups
from runtime import flops_per_step, mfu, print0, setup_runtime

# -----------------------------------------------------------------------------
# default config
compare = ""  # 'hf': against transformers; 'null': ours twice; '': ours
# model and shapes
model = ""  # a preset; '' -> t5-v1_1-base on CUDA (the paper's), else small
batch_size = 0  # examples per step; 0 -> 128 on CUDA (the paper's), else 4
grad_accum_steps = 1
input_length = 512  # and T5's 15% noise in spans of 3: 114 targets
# timing
burn_in = 3  # untimed calls first; the first (it compiles) timed apart
steps = 10  # timed calls (per side when two are compared)
peak_flops = 0.0  # dense peak FLOP/s for MFU; 0 -> runtime.PEAK_FLOPS
# system
device = "auto"
dtype = "bfloat16"
compile = True
threads = 0  # CPU threads for torch; 0 -> all cores
seed = 1337
# -----------------------------------------------------------------------------

def timed(fn):
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the device's work, not just its launch
    return time.perf_counter() - t0

def warm_up(fn, burn_in):
    """the untimed calls; returns the seconds of the first, or None"""
    first = timed(fn) if burn_in else None
    for _ in range(burn_in - 1):
        fn()
    return first

def first_call(first, compiled):  # first: seconds, None if not timed
    return (f" | first call (compile): {first:.2f} s"
            if compiled and first else "")

def side_by_side(a, b, work, unit, steps, burn_in, compiled=False):
    """median seconds a call of two (name, fn) sides, timed A B B A ...
    (drift lands on both alike), printed with the ratio"""
    firsts = [warm_up(fn, burn_in) for _, fn in (a, b)]
    times = ([], [])
    for i in range(steps):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[side].append(timed((a, b)[side][1]))
    medians = [statistics.median(t) for t in times]
    for (name, _), t, first in zip((a, b), medians, firsts):
        print0(f"{name:>34s}: {1000 * t:10.1f} ms {work / t:12,.0f} "
               f"{unit}/s{first_call(first, compiled)}")
    print0(f"{a[0]} / {b[0]}: {medians[1] / medians[0]:.2f}x the throughput "
           f"(medians of {steps} alternating calls)")
    return medians

def build_model(rt, model_name, vocab_size, seed=1337):
    torch.manual_seed(seed)
    config = T5Config.from_preset(model_name, vocab_size=vocab_size)
    return T5(config).to(rt.device)

def other_side(t5, rt, compare):
    """(name, model): ours again, or transformers' T5 with our weights"""
    if compare == "null":
        return "ours again", copy.deepcopy(t5)
    import transformers
    # its loading bar and notes would drown the timings
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(t5, folder)
        hf = transformers.T5ForConditionalGeneration.from_pretrained(folder)
    return "transformers", TransformersAdapter(hf.to(rt.device))

class TransformersAdapter(torch.nn.Module):
    """transformers' T5 returning our forward's (logits, loss)"""
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, **batch):
        out = self.hf(**batch)
        return out.logits, out.loss

def targets_length(input_length):
    return compute_input_and_target_lengths(input_length, 0.15, 3.0)[1]

def batches(rt, batch_size, grad_accum_steps, input_length, vocab_size,
            seed=1337):
    """next_batch() -> a step's micro-batches: one fixed random batch, so
    that the step loads no data (train.py builds the next in a thread)"""
    micro = micro_batch_size(batch_size, grad_accum_steps, rt.world_size)
    generator = torch.Generator().manual_seed(seed)
    lengths = dict(input_ids=input_length,
                   labels=targets_length(input_length))
    micro_batch = {key: torch.randint(0, vocab_size, (micro, n),
                                      generator=generator).to(rt.device)
                   for key, n in lengths.items()}
    return lambda: [micro_batch] * grad_accum_steps

def training_step(net, rt, next_batch, compile_model, lr=2e-2,
                  grad_clip=1.0):
    """one call = one optimizer step as train.py's loop takes it: forward
    and backward over the micro-batches, clip, AdamWScale's update"""
    optimizer = make_optimizer("adamwscale", param_groups(net, 0.0), lr)
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
    """the compiler's start-up, untimed: each side's first call is then
    its model's compile alone"""
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    x = torch.ones(2, 8, device=rt.device)
    torch.compile(layers.to(rt.device))(x).sum().backward()

def bench_train(rt, model_name, vocab_size, batch_size, grad_accum_steps,
                input_length, compile_model, steps=10, burn_in=3,
                peak_flops=0.0, seed=1337):
    """our training step alone: (s/step, tokens/s, MFU or None, a GPU's
    peak memory or None, first call's s)"""
    t5 = build_model(rt, model_name, vocab_size, seed)
    next_batch = batches(rt, batch_size, grad_accum_steps, input_length,
                         vocab_size, seed)
    step_fn = training_step(t5, rt, next_batch, compile_model)
    first = warm_up(step_fn, burn_in)
    dt = statistics.median(timed(step_fn) for _ in range(steps))
    targets = targets_length(input_length)
    flops = flops_per_step(t5, batch_size, input_length, targets)
    tokens = batch_size * (input_length + targets)
    mfu_now = mfu(flops, dt, rt.world_size, rt.peak_flops(peak_flops))
    memory = rt.device_type == "cuda" and torch.cuda.max_memory_allocated()
    return dt, tokens / dt, mfu_now, memory, first

if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "configurator.py")).read())
    check_config(config, [
        ("compare", compare in ("", "hf", "null"), "'', hf or null"),
        ("model", model in ("", *PRESETS),
         f"'' or one of {', '.join(PRESETS)}"),
        ("input_length", input_length >= 3, ">= 3"),
        *[(key, config[key] >= 0, ">= 0")
          for key in ("burn_in", "batch_size", "threads", "peak_flops")],
        *[(key, config[key] > 0, "> 0")
          for key in ("steps", "grad_accum_steps")],
    ])
    torch.set_num_threads(threads or os.cpu_count())
    rt = setup_runtime(device, dtype, seed)
    on_cuda = rt.device_type == "cuda"
    model = model or ("t5-v1_1-base" if on_cuda else "t5-v1_1-small")
    batch_size = batch_size or (128 if on_cuda else 4)
    micro_batch_size(batch_size, grad_accum_steps, rt.world_size)  # splits?
    vocab_size = T5Config.from_preset(model).vocab_size
    name = (torch.cuda.get_device_name() if on_cuda
            else f"CPU, {torch.get_num_threads()} threads")
    print0(f"{name} | {model} | batch {batch_size} x {input_length} | "
           f"{rt.dtype} | compile={compile} | random ids")

    if not compare:  # ours alone
        dt, tokens_per_s, mfu_now, memory, first = bench_train(
            rt, model, vocab_size, batch_size, grad_accum_steps,
            input_length, compile, steps, burn_in, peak_flops, seed)
        mfu_text = f" | MFU {100 * mfu_now:.1f}%" if mfu_now else ""
        memory = f" | peak memory {memory / 2**30:.2f} GB" if memory else ""
        print0(f"{1000 * dt:.1f} ms/step | {tokens_per_s:,.0f} tokens/s"
               f"{mfu_text}{memory}{first_call(first, compile)}")
    else:
        t5 = build_model(rt, model, vocab_size, seed)
        other, theirs = other_side(t5, rt, compare)
        next_batch = batches(rt, batch_size, grad_accum_steps, input_length,
                             vocab_size, seed)
        tokens = batch_size * (input_length + targets_length(input_length))
        if compile:
            warm_up_compiler(rt)
        side_by_side(("ours", training_step(t5, rt, next_batch, compile)),
                     (other, training_step(theirs, rt, next_batch, compile)),
                     tokens, "tok", steps, burn_in, compiled=compile)
