"""
The optimizers and learning-rate schedules of the nanoT5 recipe: AdamW with steps scaled by each tensor's RMS
(AdamWScale), T5's Adafactor (the nanoT5 paper's baseline), and the schedules as pure functions of the step.
Then the training machinery that train.py, finetune.py and bench.py share: runtime set-up (device, dtype, DDP), the
training step, the log, stop signals and the checkpoint format.
"""
import json
import math
import os
import signal
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from model import UserError, atomic_write


def rms(t):
    return t.norm() / math.sqrt(t.numel())


class AdamWScale(torch.optim.Optimizer):
    """
    nanoT5's AdamW: each tensor's Adam step is scaled by the tensor's RMS, like Adafactor's parameter scaling, so that
    one lr (2e-2) moves every weight by a similar fraction of its own size. Per tensor p with gradient g at step t:
        m = b1*m + (1-b1)*g
        v = b2*v + (1-b2)*g^2
        p -= lr * sqrt(1-b2^t)/(1-b1^t) * max(1e-3, RMS(p)) * m / (sqrt(v) + eps)   # RMS(p) before this update
        p -= lr * wd * p                                                              # decoupled, only if wd > 0
    Each line runs over all tensors of a param group at once (torch._foreach_*), as torch.optim.AdamW(foreach=True)
    does. Compared with that AdamW it adds a pass that reads p for its RMS, and saves the pass that divides sqrt(v)
    by sqrt(1-b2^t) (here eps is added to sqrt(v) as it is, and the bias correction rides in the step size).
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.scratch = {}  # param -> buffer for sqrt(v); not optimizer state, so not in checkpoints

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
            grads = [p.grad for p in params]
            exp_avgs = [state["exp_avg"] for state in states]
            exp_avg_sqs = [state["exp_avg_sq"] for state in states]

            # one step size per tensor, as 0-d tensors on p's device
            step_sizes = torch._foreach_norm(params)
            torch._foreach_mul_(step_sizes, [1 / math.sqrt(p.numel()) for p in params])
            torch._foreach_clamp_min_(step_sizes, 1e-3)
            # the step counts live on the host, so the bias corrections are plain floats
            torch._foreach_mul_(step_sizes, [lr * math.sqrt(1 - beta2 ** s["step"]) / (1 - beta1 ** s["step"])
                                             for s in states])

            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            if params[0].device.type == "cpu":
                # on the host a fresh param-sized tensor every step costs more in page faults than the sqrt itself
                # (2x the whole step for t5-v1_1-small), so sqrt(v) goes into buffers kept across steps
                for p in params:
                    if p not in self.scratch:
                        self.scratch[p] = torch.empty_like(p)
                denoms = [self.scratch[p] for p in params]
                torch._foreach_copy_(denoms, exp_avg_sqs)
                torch._foreach_sqrt_(denoms)
                torch._foreach_add_(denoms, eps)
                # and reading the step sizes costs nothing, so they go in as per-tensor scalars
                torch._foreach_addcdiv_(params, exp_avgs, denoms, torch.stack(step_sizes).neg_())
            else:
                denoms = torch._foreach_sqrt(exp_avg_sqs)  # the caching allocator makes this buffer free on a GPU
                torch._foreach_add_(denoms, eps)
                # reading the step sizes from a GPU would make the host wait for it; one more pass divides them in
                torch._foreach_div_(denoms, step_sizes)
                torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-1.0)
            if weight_decay > 0:
                torch._foreach_mul_(params, 1 - lr * weight_decay)
        return loss


class Adafactor(torch.optim.Optimizer):
    """
    Adafactor as nanoT5 compared it: HF's transformers.optimization.Adafactor with relative_step=False,
    scale_parameter=True, warmup_init=False, beta1=None. No first moment; a matrix's second moments are stored as
    their row and column means only; the step is scaled by the tensor's RMS and the update clipped to RMS 1.
    Per tensor p with gradient g at step t, with b2 = 1 - t^decay_rate:
        V = b2*V + (1-b2)*(g^2 + eps1)        # p with >= 2 dims: R, C = row, column means of V; V ~ R C / mean(R)
        u = g / sqrt(V)
        u = u / max(1, RMS(u) / clip_threshold)
        p -= lr * max(eps2, RMS(p)) * (u + weight_decay * p)      # RMS(p) before this update
    torch.optim.Adafactor (torch 2.13) also scales by RMS(p) and clips, but is not this optimizer: it always takes
    the relative step min(lr, 1/sqrt(t)), so lr caps the step instead of setting it (a cosine schedule's 2e-2 would
    be cut to 1/sqrt(t) after step 2,500); it clamps V at eps1^2 instead of adding eps1 to g^2; and it scales weight
    decay by lr instead of by the RMS-scaled step.
    """

    def __init__(self, params, lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                factored = g.dim() >= 2
                if not state:
                    state["step"] = 0
                    if factored:
                        state["exp_avg_sq_row"] = g.new_zeros(g.shape[:-1])
                        state["exp_avg_sq_col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(g)
                state["step"] += 1
                beta2 = 1 - state["step"] ** group["decay_rate"]
                step_size = rms(p).clamp_(min=eps2) * group["lr"]
                g2 = g * g + eps1
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.lerp_(g2.mean(dim=-1), 1 - beta2)
                    col.lerp_(g2.mean(dim=-2), 1 - beta2)
                    v = (row / row.mean(dim=-1, keepdim=True)).unsqueeze(-1) * col.unsqueeze(-2)  # (..., rows, cols)
                else:
                    v = state["exp_avg_sq"]
                    v.lerp_(g2, 1 - beta2)
                update = g * v.rsqrt()
                update.div_((rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["weight_decay"] * step_size)
                p.sub_(update.mul_(step_size))
        return loss


def get_lr(step, max_steps, schedule, lr, warmup_steps, warmup_start_factor, min_lr):
    """
    The learning rate at `step` optimizer steps into a run of max_steps. Step may be fractional, so that a time budget
    can drive the schedule with progress * max_steps.
    cosine: linear warmup from warmup_start_factor*lr to lr over warmup_steps, then half a cosine down to min_lr at
        max_steps. nanoT5: 1e-2 at the start, 2e-2 at 10,000, 1e-5 at 65,536.
    inverse_sqrt: nanoT5's "legacy" T5 schedule, min(lr, 1/sqrt(step)), then linear from its value at 90% of the run
        down to 0 at max_steps. With T5's lr of 1e-2 it is flat for 10,000 steps, which stands in for a warmup.
    constant: lr throughout, no warmup.
    """
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        if step < warmup_steps:
            return lr * (warmup_start_factor + (1 - warmup_start_factor) * step / warmup_steps)
        if step >= max_steps:
            return min_lr
        progress = (step - warmup_steps) / (max_steps - warmup_steps)
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "inverse_sqrt":
        if step >= max_steps:
            return 0.0
        decay_start = 0.9 * max_steps
        if step < decay_start:
            return min(lr, 1 / math.sqrt(step)) if step > 0 else lr
        return min(lr, 1 / math.sqrt(decay_start)) * (max_steps - step) / (max_steps - decay_start)
    raise UserError(f"unknown lr_schedule '{schedule}': use one of cosine, inverse_sqrt, constant")


def param_groups(model, weight_decay, no_decay=("ln_",)):
    """
    Two param groups: weight decay for most weights, none for parameters whose name contains one of the no_decay
    substrings. The default catches model.py's RMSNorm scales (ln_1, ln_2, ln_3, ln_f): decaying them would pull each
    layer's output towards 0 rather than regularise it. Add 'shared' or 'relative_attention_bias' to spare those too.
    """
    decayed, not_decayed = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (not_decayed if any(s in name for s in no_decay) else decayed).append(p)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": not_decayed, "weight_decay": 0.0}]


def make_optimizer(name, groups, lr):
    """The optimizer named by train.py's `optimizer` config key; each group's weight_decay comes from param_groups."""
    if name == "adamwscale":
        return AdamWScale(groups, lr=lr)
    if name == "adafactor":
        return Adafactor(groups, lr=lr)
    if name == "adamw":
        # eps 1e-6 is HF AdamW's, the one nanoT5 ran; fused does the whole step in one kernel per chunk of tensors
        device_type = next(p for g in groups for p in g["params"]).device.type
        return torch.optim.AdamW(groups, lr=lr, eps=1e-6, fused=device_type in ("cuda", "cpu"))
    raise UserError(f"unknown optimizer '{name}': use one of adamwscale, adafactor, adamw")

# -----------------------------------------------------------------------------------------------------------------
# Training machinery shared by train.py, finetune.py and bench.py. One copy of the runtime set-up, the step, the log
# and the checkpoint format, so that what bench.py times is exactly what train.py runs.

def print0(*args, **kwargs):
    """print on rank 0 only, so that 8 GPUs don't print 8 copies of every line"""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs)


# dense peak FLOP/s per GPU for (float32, tfloat32, bfloat16), from the vendors' data sheets; MFU divides by these
PEAK_FLOPS = {
    "H200": (67e12, 495e12, 989e12),
    "H100": (67e12, 495e12, 989e12),
    "A100": (19.5e12, 156e12, 312e12),
    "A10G": (31.2e12, 62.5e12, 125e12),
    "L4": (30.3e12, 60e12, 121e12),
    "RTX 4090": (82.6e12, 82.6e12, 165e12),
    "RTX 3090": (35.6e12, 35.6e12, 71e12),
}


@dataclass
class Runtime:
    device: str  # 'cuda:0', 'mps', 'cpu'
    device_type: str  # 'cuda', 'mps', 'cpu'
    dtype: str  # 'float32', 'tfloat32' or 'bfloat16'
    ddp: bool
    rank: int
    local_rank: int
    world_size: int

    @property
    def master(self):
        return self.rank == 0

    def autocast(self):
        # bf16 autocast keeps weights, gradients and optimizer state in fp32 and runs the matmuls in bf16: unlike fp16
        # it has fp32's range, so T5 needs no loss scaling (and T5 is famous for overflowing fp16)
        if self.dtype == "bfloat16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    def micro_batch_size(self, batch_size, grad_accum_steps):
        """examples per forward pass on this rank: the global batch splits over micro-steps and ranks"""
        micro_batch_size, leftover = divmod(batch_size, grad_accum_steps * self.world_size)
        if leftover or not micro_batch_size:
            raise UserError(f"batch_size={batch_size} must split evenly into grad_accum_steps={grad_accum_steps} x "
                            f"{self.world_size} ranks; change batch_size or grad_accum_steps")
        return micro_batch_size

    def peak_flops(self):
        """the GPU's dense peak FLOP/s at this dtype, or None where unknown (CPU, MPS, an unlisted GPU)"""
        if self.device_type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        column = ("float32", "tfloat32", "bfloat16").index(self.dtype)
        return next((peaks[column] for gpu, peaks in PEAK_FLOPS.items() if gpu in name), None)


def setup_runtime(device="auto", dtype="bfloat16", seed=1337):
    """Pick the device, join the torchrun process group if there is one, seed, and set the float modes."""
    if dtype not in ("float32", "tfloat32", "bfloat16"):
        raise UserError(f"dtype '{dtype}' is not supported; use bfloat16, tfloat32 or float32")
    ddp = "RANK" in os.environ  # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device_type = device.split(":")[0]
    if device_type == "cpu" and dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # without native bf16 matmuls (AVX512-BF16, AMX) autocast would only add casts; with them it is ~1.7x faster
        print0("this CPU has no native bf16 matmuls: running in float32 instead")
        dtype = "float32"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device '{device}' asked for, but torch sees no CUDA GPU; use --device=cpu")
    if ddp and device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        torch.distributed.init_process_group("nccl" if device_type == "cuda" else "gloo")
    # the same seed on every rank: all replicas must start from the same weights
    torch.manual_seed(seed)
    # TF32 runs fp32 matmuls on the tensor cores with a 10-bit mantissa; under bf16 autocast it only touches the few
    # matmuls autocast leaves in fp32. 'float32' is kept exact for the paper's fp32 row.
    torch.backends.cuda.matmul.allow_tf32 = dtype != "float32"
    torch.backends.cudnn.allow_tf32 = dtype != "float32"
    if device_type == "cpu":
        # late in training many weights and gradients become denormal floats, which x86 CPUs process ~100x slower
        torch.set_flush_denormal(True)
    return Runtime(device, device_type, dtype, ddp, rank, local_rank, world_size)


def raw_model(model):
    """the T5 inside any DDP and torch.compile wrappers: its state_dict has no 'module.' or '_orig_mod.' prefixes"""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def train_step(model, optimizer, get_batch, grad_accum_steps=1, lr=None, grad_clip=0.0, z_loss=0.0,
               autocast=nullcontext, ddp=False):
    """
    One optimizer step over grad_accum_steps micro-batches; get_batch(micro_step) -> (input_ids, labels,
    attention_mask or None). Returns the mean cross-entropy and the gradient norm before clipping, as tensors left on
    the device so that the caller decides when to pay for a sync.
    """
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    total_loss = 0.0
    for micro_step in range(grad_accum_steps):
        input_ids, labels, attention_mask = get_batch(micro_step)
        if ddp:
            # all-reduce the gradients once, after the last micro-batch has added its share (nanoGPT's trick)
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        with autocast():
            logits, loss = model(input_ids, labels=labels, attention_mask=attention_mask)
            objective = loss
            if z_loss > 0:
                # t5x's auxiliary z-loss pulls log(sum(exp(logits))) towards 0, which keeps the softmax from drifting
                # into regions where bf16 loses precision
                valid = labels != -100
                log_z = torch.logsumexp(logits.float(), dim=-1)
                objective = loss + z_loss * (log_z.square() * valid).sum() / valid.sum()
        (objective / grad_accum_steps).backward()
        total_loss = total_loss + loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total_loss / grad_accum_steps, grad_norm


class Logger:
    """
    Appends one JSON object per event to out_dir/log.jsonl (rank 0 only), mirrored to wandb when enabled. A resumed
    run first drops the lines a killed run wrote after its last checkpoint, so the log reads as one run.
    """

    def __init__(self, out_dir, master=True, resume_step=None, wandb_log=False, wandb_project="nanoT5",
                 wandb_run_name=None, config=None):
        self.path = os.path.join(out_dir, "log.jsonl") if master else None
        self.wandb = None
        if self.path is None:
            return
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                # a run killed mid-write leaves half a line at the end: it goes with the steps after the checkpoint
                kept = [line for line in f if line.endswith("\n") and json.loads(line).get("step", 0) <= resume_step]
            with atomic_write(self.path, "w") as f:
                f.writelines(kept)
        if wandb_log:
            import wandb
            self.wandb = wandb.init(project=wandb_project, name=wandb_run_name, config=config)

    def log(self, record):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=record.get("step"))


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag, so that the loop finishes its step, saves a checkpoint and exits cleanly."""

    def __init__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        self.requested = True

    def release(self):
        """give the signals back: after the training loop, Ctrl-C should stop the program at once"""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def agreed(self, runtime):
        """True when any rank was signalled; under DDP every rank must stop at the same step or the others hang"""
        if not runtime.ddp:
            return self.requested
        flag = torch.tensor(float(self.requested), device=runtime.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def save_checkpoint(path, state):
    with atomic_write(path) as f:
        torch.save(state, f)


def load_checkpoint(path, map_location="cpu"):
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; check the path, or train one first with train.py")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); delete it or use another")


def checkpoint_state(model, optimizer, step, elapsed, config, meta=None):
    """everything a run needs to continue exactly where it stopped"""
    t5 = raw_model(model)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"model": t5.state_dict(), "model_config": asdict(t5.config), "optimizer": optimizer.state_dict(),
            "step": step, "elapsed": elapsed, "config": config, "meta": meta, "rng": rng}


def restore_rng(state):
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
