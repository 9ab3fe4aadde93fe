"""Speed on a GPU, from the repo's root: `python docs/gpu_trials.py` (at most 8 minutes on one H100).
t5-v1_1-base at batch 128 x (512 + 114), bf16, the model compiled as train.py compiles it, AdamWScale as optim.py
writes it, its formula in torch._foreach_* lines. Each change against today's step, in this process, on the same
weights and batch, A B B A after warm-up, the null comparison first:
  null        today's step against itself
  flex        the encoder's self-attention in flex_attention, its bias an fp32 (H, S, S) table in a score_mod
  per-block   each block compiled, as the FSDP path does, against the whole model compiled
Then each side's first call (Inductor's caches off), AdamWScale's step alone in both forms (its formula, and
FusedPerTensor: torch's fused AdamW kernel a tensor at a time, as it ran before), and flex against SDPA for one
encoder layer, forward and backward.
Then train.py as a user runs it (train_run): config/t5_base.py on data/pydoc, compiled, bf16, 120 steps with a
checkpoint at 100, those last 20 steps again resumed from it, and sample.py from the run; in one process, then under
`torchrun --standalone --nproc_per_node=1` (DDP's path).
Prints one table and writes the same figures to $OUT/gpu_trials.json (else ./gpu_trials.json).
`python docs/gpu_trials.py train` runs the two train_runs alone.
Off a GPU it runs t5-tiny at batch 2 without flex, and train_run with t5-mini, to check the script itself."""
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__":  # each first call compiles from nothing, sharing no cached kernel with another's
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from optim import AdamWScale, make_optimizer, param_groups  # noqa: E402
from prepare import RECIPES, prepare  # noqa: E402
from runtime import setup_runtime  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flex_self_attention(attn, x, bias):
    """model.Attention's self-attention with flex_attention: bias (H, S, S), fp32, added to each score, so that its
    gradient is (H, S, S), not SDPA's (B, H, S, S)"""
    q, (k, v) = attn.split_heads(attn.q(x)), attn.kv(x)  # (B, nh, S, hs)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]
    y = flex_attention(q, k, v, score_mod=score_mod, scale=1.0)
    return attn.o(y.transpose(1, 2).flatten(2))  # (B, nh, S, hs) -> (B, S, nh * hs)


def flex_encoder_forward(encoder, x, attention_mask, dtype):
    """model.Encoder.forward with flex_self_attention, for unpadded pre-training batches without dropout"""
    assert attention_mask is None, "pre-training batches have no padding"
    positions = torch.arange(x.size(1), device=x.device)
    bias = encoder.blocks[0].attn.position_bias(positions, positions)[0]  # (nh, S, S), fp32
    for block in encoder.blocks:
        x = x + flex_self_attention(block.attn, block.ln_1(x), bias)
        x = x + block.ff(block.ln_2(x))
    return encoder.ln_f(x)


def use_flex_in_encoder(t5):
    t5.encoder.forward = lambda *args: flex_encoder_forward(t5.encoder, *args)
    return t5


class FusedPerTensor(AdamWScale):
    """AdamWScale as it ran before its step became its formula: torch's fused AdamW kernel, one call a tensor, with
    lr' = lr * max(1e-3, RMS(p)) and eps' = eps / sqrt(1 - b2^t), the step counts on the device"""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim.adamw import adamw
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            (beta1, beta2), lr = group["betas"], group["lr"]
            group["t"] = t = group.get("t", 0) + 1
            eps = group["eps"] / (1 - beta2 ** t) ** 0.5
            for p, p_rms in zip(params, self.rms(params).unbind()):
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                adamw([p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], fused=True,
                      amsgrad=False, beta1=beta1, beta2=beta2, lr=(lr * p_rms.clamp(min=1e-3)).float(),
                      weight_decay=0.0, eps=eps, maximize=False)


def compile_blocks(t5):
    for block in [*t5.encoder.blocks, *t5.decoder.blocks]:
        block.compile()
    return t5


def layer_attention(rt, B, H, S, steps):
    """one encoder layer's biased self-attention, forward and backward with the bias's gradient: SDPA with a bf16
    (1, H, S, S) mask, as model.py runs it, against compiled flex_attention with the fp32 (H, S, S) table"""
    q, k, v = (torch.randn(B, H, S, 64, device=rt.device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    table = (torch.randn(H, S, S, device=rt.device) * 0.5).requires_grad_()
    grad_out = torch.randn(B, H, S, 64, device=rt.device, dtype=torch.bfloat16)
    flex = torch.compile(flex_attention)

    def sdpa():
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=table.to(torch.bfloat16)[None], scale=1.0)
        return [y, *torch.autograd.grad(y, (q, k, v, table), grad_out)]

    def with_flex():
        y = flex(q, k, v, score_mod=lambda score, b, h, i, j: score + table[h, i, j], scale=1.0)
        return [y, *torch.autograd.grad(y, (q, k, v, table), grad_out)]
    errors = {what: ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
              for what, a, b in zip(("out", "dq", "dk", "dv", "dbias"), sdpa(), with_flex())}
    sdpa_ms, flex_ms = bench.side_by_side(("SDPA", sdpa), ("flex", with_flex), B * S, "tok", steps, 3)
    return dict(sdpa_ms=1e3 * sdpa_ms, flex_ms=1e3 * flex_ms, max_rel_error=errors)


def train_run(on_cuda, folder, launch=()):
    """train.py as a user runs it, launched with launch (TORCHRUN, or nothing for one process): config/t5_base.py
    on data/pydoc (prepared here in seconds; its vocab of 1,152 makes the model 200M parameters), compiled, bf16, 120
    steps logged each, a checkpoint at step 100 and at the end; then a copy of the run without its last checkpoint
    resumes from step 100, and its 20 steps must log the same losses; then sample.py fills a text from the run. The
    lr is constant after 10 warmup steps, so that no step's lr depends on max_steps. Off a GPU: t5-mini at batch
    8 x 64, eager, fp32 (gloo under torchrun, where a GPU has NCCL)."""
    data = os.path.join(folder, "pydoc")
    prepare(**RECIPES["pydoc"], out_dir=data)
    size = [] if on_cuda else ["--model=t5-mini", "--batch_size=8", "--input_length=64", "--compile=False",
                               "--dtype=float32", "--device=cpu"]
    common = ["config/t5_base.py", f"--data_dir={data}", "--max_steps=120", "--warmup_steps=10", "--min_lr=2e-2",
              "--log_interval=1", "--checkpoint_interval=100", "--eval_interval=100", "--eval_steps=1", *size]
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)  # the resume may reuse the first run's kernels

    def train(out_dir, *extra):
        t0 = time.time()
        r = subprocess.run([sys.executable, *launch, "train.py", *common, f"--out_dir={out_dir}", *extra], cwd=REPO,
                           env=env, capture_output=True, text=True)
        print(r.stdout[-2500:] + r.stderr[-2500:])
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            losses = {rec["step"]: rec for rec in map(json.loads, f) if "loss" in rec}
        return dict(returncode=r.returncode, seconds=time.time() - t0, stdout=r.stdout), losses

    straight = os.path.join(folder, "straight")
    first, losses = train(straight)
    resumed = os.path.join(folder, "resumed")
    shutil.copytree(straight, resumed)
    shutil.rmtree(os.path.join(resumed, "ckpt", "step-120"))
    second, resumed_losses = train(resumed, "--init_from=resume")
    sample = subprocess.run([sys.executable, "sample.py", f"--init_from={straight}"], cwd=REPO, capture_output=True,
                            text=True)
    print(sample.stdout + sample.stderr[-2000:])
    ms = sorted(rec["ms_per_step"] for step, rec in losses.items() if 20 < step <= 100)
    peak = [line for line in first["stdout"].splitlines() if "peak memory" in line or "optimizer state" in line]
    differences = [abs(resumed_losses[step]["loss"] - losses[step]["loss"]) for step in range(101, 121)]
    return dict(returncode=[first["returncode"], second["returncode"], sample.returncode],
                seconds=[first["seconds"], second["seconds"]],
                losses={step: rec["loss"] for step, rec in losses.items()},
                resumed_losses={step: resumed_losses[step]["loss"] for step in range(101, 121)},
                resume_max_abs_difference=max(differences), resume_exact=max(differences) == 0.0,
                median_ms_per_step_20_to_100=ms[len(ms) // 2], memory=peak, sample=sample.stdout)


def print_train_run(run, label):
    losses = run["losses"]
    print(f"train.py {label}: exit codes {run['returncode']}, {run['seconds'][0]:.0f} s and "
          f"{run['seconds'][1]:.0f} s (resume);"
          f" loss {losses[1]:.3f} at step 1, {losses[100]:.3f} at 100, {losses[120]:.3f} at 120; "
          f"{run['median_ms_per_step_20_to_100']:.1f} ms/step (median, steps 21-100); resumed steps 101-120 "
          f"{'equal' if run['resume_exact'] else 'differ'} (max |difference| {run['resume_max_abs_difference']:.2e})")
    print("\n".join(run["memory"]) + "\n" + run["sample"])


# torchrun with one rank: DDP's path (NCCL on a GPU), the process group, the ranks' agreement at sync steps
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1")


def train_runs(on_cuda):
    """train_run in one process, then under torchrun, each printed: {train_run, train_run_torchrun}"""
    runs = {}
    for key, launch in (("train_run", ()), ("train_run_torchrun", TORCHRUN)):
        with tempfile.TemporaryDirectory() as folder:
            runs[key] = train_run(on_cuda, folder, launch)
        print_train_run(runs[key], "under torchrun" if launch else "in one process")
    return runs


def main():
    on_cuda = torch.cuda.is_available()
    out = os.environ.get("OUT", ".")
    if sys.argv[1:] == ["train"]:
        runs = train_runs(on_cuda)
        with open(os.path.join(out, "gpu_train_run.json"), "w") as f:
            json.dump(runs, f, indent=2)
        return
    rt = setup_runtime("auto", "bfloat16" if on_cuda else "float32")
    name, batch_size, input_length, steps = ("t5-v1_1-base", 128, 512, 10) if on_cuda else ("t5-tiny", 2, 64, 4)
    vocab_size = 32128 if on_cuda else 256
    tokens = batch_size * (input_length + bench.targets_length(input_length))
    next_batch = bench.batches(rt, batch_size, 1, input_length, vocab_size)
    device = torch.cuda.get_device_name() if on_cuda else "CPU"
    print(f"{device} | torch {torch.__version__} | {name} | batch {batch_size} x {input_length} | {rt.dtype}")

    t5 = bench.build_model(rt, name, vocab_size)
    sides = {"today": bench.training_step(t5, rt, next_batch, True),
             "null": bench.training_step(t5, rt, next_batch, True),
             "per-block": bench.training_step(compile_blocks(copy.deepcopy(t5)), rt, next_batch, False)}
    # (side, the side it is timed against)
    pairs = [("null", "today"), ("per-block", "today")]
    if on_cuda:  # flex_attention has no backward on a CPU
        sides["flex"] = bench.training_step(use_flex_in_encoder(copy.deepcopy(t5)), rt, next_batch, True)
        pairs.append(("flex", "today"))

    results = dict(device=device, torch=torch.__version__, model=name, batch_size=batch_size,
                   input_length=input_length, steps=steps, first_call_s={}, ms_per_step={},
                   against={})
    for label, fn in sides.items():
        results["first_call_s"][label] = bench.warm_up(fn, 3)
    for label, reference in pairs:  # A B B A, medians; the null first
        print(f"{reference} against {label}:")
        a, b = bench.side_by_side((reference, sides[reference]), (label, sides[label]), tokens, "tok", steps, 0)
        results["ms_per_step"].setdefault(reference, 1e3 * a)
        results["ms_per_step"][label] = 1e3 * b
        results["against"][label] = dict(side=reference, ms=1e3 * a, speedup=a / b)

    for p in t5.parameters():  # AdamWScale alone, over the model's tensors
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = [("fused per tensor", FusedPerTensor(param_groups(t5, 0.0), lr=2e-2)),
                  ("formula", make_optimizer("adamwscale", param_groups(t5, 0.0), 2e-2))]
    medians = bench.side_by_side(*[(f"AdamWScale {k}", o.step) for k, o in optimizers], t5.num_params(), "param",
                                 steps, 3, compiled=True)
    results["adamwscale_ms"] = {k: 1e3 * m for (k, _), m in zip(optimizers, medians)}
    if on_cuda:
        results["encoder_layer_attention"] = layer_attention(rt, batch_size, 12, input_length, steps)

    print(f"\n{'side':>10s} {'ms/step':>9s} {'speed-up':>9s} {'against':>8s} {'1st call':>9s}")
    for label in sides:
        against = results["against"].get(label, dict(side="", speedup=1.0))
        print(f"{label:>10s} {results['ms_per_step'][label]:9.1f} {against['speedup']:9.2f} {against['side']:>8s} "
              f"{results['first_call_s'][label]:8.1f}s")
    print("AdamWScale alone: " + ", ".join(f"{k} {v:.2f} ms" for k, v in results["adamwscale_ms"].items()))
    if on_cuda:
        print(f"encoder layer attention: {results['encoder_layer_attention']}")
    results.update(train_runs(on_cuda))
    path = os.path.join(out, "gpu_trials.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
