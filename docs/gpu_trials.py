"""Two trials run on a GPU for docs/performance.md, from the repo's root: `python docs/gpu_trials.py`.
1. The relative-bias attention of t5-v1_1-base, forward and backward with the bias's gradient: SDPA, as model.py runs
   it (the bias as a float mask), against flex_attention with a score_mod that adds the bias, compiled.
2. AdamWScale's step over t5-v1_1-base's tensors, eager and compiled (make_optimizer(compile=True)), and the gradient
   clipping: ms per step and CUDA kernels per step."""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import T5, T5Config  # noqa: E402
from optim import make_optimizer, param_groups  # noqa: E402


def ms(fn, n=20):
    """the median of n calls, by CUDA events"""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def attention(name, B, H, Sq, Sk, causal, flex=torch.compile(flex_attention)):
    """SDPA against flex_attention at one shape: the gradients' agreement, and the ms saved by flex"""
    q = torch.randn(B, H, Sq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H, Sk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    bias = (torch.randn(1, H, Sq, Sk, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    future = torch.ones(Sq, Sk, device="cuda", dtype=torch.bool).triu(1)
    grad_out = torch.randn(B, H, Sq, 64, device="cuda", dtype=torch.bfloat16)

    def sdpa():
        mask = bias.masked_fill(future, torch.finfo(torch.bfloat16).min) if causal else bias
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)

    def score_mod(score, b, h, q_idx, kv_idx):
        score = score + bias[0, h, q_idx, kv_idx]
        return torch.where(kv_idx > q_idx, -float("inf"), score) if causal else score

    def with_flex():
        return flex(q, k, v, score_mod=score_mod, scale=1.0)

    def forward_backward(fn):
        out = fn()
        return [out, *torch.autograd.grad(out, (q, k, v, bias), grad_out)]

    for what, a, b in zip(("out", "dq", "dk", "dv", "dbias"), forward_backward(sdpa), forward_backward(with_flex)):
        error = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
        print(f"  {name} {what}: max |flex - sdpa| / max |sdpa| = {error:.2e}")
    for fn in (sdpa, with_flex) * 3:  # warm-up
        forward_backward(fn)
    times = {sdpa: [], with_flex: []}
    for i in range(20):  # alternating
        for fn in (sdpa, with_flex) if i % 2 == 0 else (with_flex, sdpa):
            times[fn].append(ms(lambda: forward_backward(fn), n=1))
    a, b = statistics.median(times[sdpa]), statistics.median(times[with_flex])
    print(f"{name}: sdpa {a:.2f} ms, flex {b:.2f} ms (forward + backward, medians of 20 alternating)")
    return a - b


print(torch.__version__, torch.cuda.get_device_name())
saved = [attention("encoder self-attention B=128 H=12 512x512", 128, 12, 512, 512, False),
         attention("decoder self-attention B=128 H=12 114x114 causal", 128, 12, 114, 114, True)]
print(f"per step (12 encoder + 12 decoder layers): flex saves {12 * sum(saved):.1f} ms")

torch.manual_seed(0)
with torch.device("cuda"):
    t5 = T5(T5Config.from_preset("t5-v1_1-base"))
params = list(t5.parameters())
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
clip = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)  # noqa: E731
print(f"clip_grad_norm_: {ms(clip):.2f} ms, {kernels(clip)} kernels")
for compiled in (False, True):
    optimizer = make_optimizer("adamwscale", param_groups(t5, 0.0), 2e-2, compile=compiled)
    t0 = time.time()
    optimizer.step()
    torch.cuda.synchronize()
    first = time.time() - t0
    print(f"AdamWScale, compile={compiled}: {ms(optimizer.step):.2f} ms/step, {kernels(optimizer.step)} kernels, "
          f"first call {first:.1f} s")
