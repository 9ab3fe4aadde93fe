"""
nanoT5's optimizers, AdamWScale and Adafactor (the paper's baseline), the learning-rate schedules,
and the training step that train.py, finetune.py and bench.py run.
"""
import math
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from files import UserError

class AdamWScale(torch.optim.Optimizer):
    """
    nanoT5's AdamW: each tensor's Adam step is scaled by the tensor's RMS, like Adafactor's parameter
    scaling, so that one lr (2e-2) moves every weight by a similar fraction of its own size. Per
    tensor p with gradient g at step t:
        (1) step_size = lr * sqrt(1-b2^t)/(1-b1^t) * max(1e-3, RMS(p))  # RMS(p) before this update
        (2) m = b1*m + (1-b1)*g
        (3) v = b2*v + (1-b2)*g^2
        (4) p -= step_size * m / (sqrt(v) + eps)
        (5) p -= lr * wd * p                                             # decoupled; if wd > 0
    Each line runs over all tensors of a group at once (torch._foreach_*). Under FSDP each rank holds
    a slice of p: RMS(p) is the whole tensor's (one all-reduce per group), the rest runs on slices.
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim's signature: set_optimizer_state_dict passes None
        assert closure is None, "one gradient per step: no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            eps = group["eps"]
            weight_decay = group["weight_decay"]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
            grads = [p.grad for p in params]
            exp_avgs = [state["exp_avg"] for state in states]
            exp_avg_sqs = [state["exp_avg_sq"] for state in states]

            # one step size per tensor, as 0-d tensors on p's device; the step counts live on the
            # host, so the bias corrections are plain floats
            step_sizes = norms(params)  # (1) |p|
            torch._foreach_mul_(step_sizes, [1 / math.sqrt(p.numel()) for p in params])  # (1) RMS(p)
            torch._foreach_clamp_min_(step_sizes, 1e-3)  # (1) max(1e-3, RMS(p))
            corrections = [lr * math.sqrt(1 - beta2 ** s["step"]) / (1 - beta1 ** s["step"])
                           for s in states]
            torch._foreach_mul_(step_sizes, corrections)  # (1) lr * sqrt(1-b2^t)/(1-b1^t) * ...

            # the elementwise lines run on this rank's slices (the whole tensors outside FSDP)
            slices = local(params)
            grads = local(grads)
            exp_avgs = local(exp_avgs)
            exp_avg_sqs = local(exp_avg_sqs)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # (2) m = b1*m + (1-b1)*g
            torch._foreach_mul_(exp_avg_sqs, beta2)  # (3) v = b2*v ...
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)  # (3) ... + (1-b2)*g^2
            denoms = torch._foreach_sqrt(exp_avg_sqs)  # (4) sqrt(v)
            torch._foreach_add_(denoms, eps)  # (4) sqrt(v) + eps
            # one more pass divides by the step sizes: on the host, they would wait for the GPU
            torch._foreach_div_(denoms, step_sizes)  # (4) (sqrt(v) + eps) / step_size
            torch._foreach_addcdiv_(slices, exp_avgs, denoms, value=-1.0)  # (4) p -= m / that
            if weight_decay > 0:
                torch._foreach_mul_(slices, 1 - lr * weight_decay)  # (5) p -= lr * wd * p

class Adafactor(torch.optim.Optimizer):
    """
    Adafactor as nanoT5 compared it: HF's transformers.optimization.Adafactor with
    relative_step=False, scale_parameter=True, warmup_init=False, beta1=None. No first moment; a
    matrix's second moments are stored as their row and column means; the step is scaled by the
    tensor's RMS and the update clipped to RMS 1. Per tensor p with gradient g at step t, with
    b2 = 1 - t^decay_rate:
        V = b2*V + (1-b2)*(g^2 + eps1)   # >= 2 dims: row, column means R, C; V ~ R C / mean(R)
        u = g / sqrt(V)
        u = u / max(1, RMS(u) / clip_threshold)
        p -= lr * max(eps2, RMS(p)) * (u + weight_decay * p)      # RMS(p) before this update
    (torch.optim.Adafactor differs: it caps the step at 1/sqrt(t), clamps V, scales decay by lr.)
    Under FSDP the lines run as DTensor ops, which sum over the ranks where a whole tensor is needed.
    """

    def __init__(self, params, lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim's signature: set_optimizer_state_dict passes None
        assert closure is None, "one gradient per step: no closure"
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                factored = g.dim() >= 2
                if not state:
                    state["step"] = 0
                    if factored:
                        state["exp_avg_sq_row"] = zeros_like_mean(g, -1)  # (..., rows)
                        state["exp_avg_sq_col"] = zeros_like_mean(g, -2)  # (..., cols)
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
                    row_share = row / row.mean(dim=-1, keepdim=True)
                    v = row_share.unsqueeze(-1) * col.unsqueeze(-2)  # (..., rows, cols)
                else:
                    v = state["exp_avg_sq"]
                    v.lerp_(g2, 1 - beta2)
                update = g * v.rsqrt()
                update.div_((rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["weight_decay"] * step_size)
                p.sub_(update.mul_(step_size))

# what the optimizers need for FSDP's DTensors

def rms(t):  # of a DTensor (an FSDP shard), the whole tensor's
    return t.norm() / math.sqrt(t.numel())

def local(tensors):
    """this rank's slices of DTensors, as plain tensors sharing their memory; others as they are"""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

def norms(tensors):
    """each tensor's 2-norm, as 0-d tensors; a DTensor's is the whole tensor's (one all-reduce)"""
    if not isinstance(tensors[0], DTensor):
        return torch._foreach_norm(tensors)
    squares = torch.stack(torch._foreach_norm(local(tensors))).square_()
    torch.distributed.all_reduce(squares, group=tensors[0].device_mesh.get_group())
    return list(squares.sqrt_().unbind())

def zeros_like_mean(t, dim):
    """zeros shaped like t.mean(dim); of a DTensor, laid out as that mean summed over the ranks (row means stay
    sliced, column means are whole on every rank)"""
    mean = t.mean(dim=dim)
    if isinstance(mean, DTensor):
        mean = mean.redistribute(placements=[Replicate() if p.is_partial() else p for p in mean.placements])
    return torch.zeros_like(mean)

def get_lr(step, max_steps, schedule, lr, warmup_steps, warmup_start_factor, min_lr):
    """
    The learning rate after `step` optimizer steps (fractional under a time budget) of max_steps.
    cosine: linear warmup from warmup_start_factor*lr to lr, then half a cosine to min_lr at max_steps.
    inverse_sqrt: nanoT5's "legacy" T5 schedule, min(lr, 1/sqrt(step)), then linear from 90% of the run
        down to 0 (with T5's lr of 1e-2, flat for 10,000 steps: its warmup).
    constant: lr throughout.
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
    # inverse_sqrt
    if step >= max_steps:
        return 0.0
    decay_start = 0.9 * max_steps
    if step < decay_start:
        return min(lr, 1 / math.sqrt(step)) if step > 0 else lr
    return min(lr, 1 / math.sqrt(decay_start)) * (max_steps - step) / (max_steps - decay_start)

LR_SCHEDULES = ("cosine", "inverse_sqrt", "constant")

def param_groups(model, weight_decay, no_decay=("ln_",)):
    """Two param groups: weight decay, and none for names holding one of no_decay (the RMSNorm scales, which
    decay would pull towards 0 rather than regularise)."""
    decayed, not_decayed = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (not_decayed if any(s in name for s in no_decay) else decayed).append(p)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": not_decayed, "weight_decay": 0.0}]

OPTIMIZERS = ("adamwscale", "adafactor", "adamw")

def check_optimizer(name):
    """configurator.py's rule for `optimizer`"""
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer '{name}': use one of {', '.join(OPTIMIZERS)}")

def make_optimizer(name, groups, lr):
    """One of OPTIMIZERS by name; each group's weight_decay from param_groups."""
    if name == "adamwscale":
        return AdamWScale(groups, lr=lr)
    if name == "adafactor":
        return Adafactor(groups, lr=lr)
    # adamw: eps 1e-6 is HF AdamW's, which nanoT5 ran
    device_type = next(p for g in groups for p in g["params"]).device.type
    return torch.optim.AdamW(groups, lr=lr, eps=1e-6, fused=device_type in ("cuda", "cpu"))

def train_step(model, optimizer, micro_batches, lr=None, grad_clip=0.0, autocast=nullcontext):
    """One optimizer step over a step's micro-batches, each a dict of the model's arguments
    (input_ids, labels, perhaps attention_mask). Returns the mean loss and the gradient norm before
    clipping, as tensors on the device: the caller decides when to wait for them. autocast: the
    run's float mode, a context manager (bf16 autocast, or none)."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    total_loss = 0.0
    for micro_step, batch in enumerate(micro_batches):
        if isinstance(model, DDP):
            # all-reduce the gradients once, after the last micro-batch (nanoGPT's trick). FSDP
            # reduce-scatters them after each, so that no rank ever holds whole gradients
            model.require_backward_grad_sync = micro_step == len(micro_batches) - 1
        with autocast():
            _, loss = model(**batch)
        (loss / len(micro_batches)).backward()
        total_loss = total_loss + loss.detach()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()  # FSDP: the norm over all ranks' slices, already summed
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total_loss / len(micro_batches), grad_norm
