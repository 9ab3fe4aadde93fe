"""
nanoT5's optimizer, AdamWScale, and its learning-rate schedule.
"""
import math

import torch

class AdamWScale(torch.optim.Optimizer):
    """
    nanoT5's AdamW: each tensor's Adam step is scaled by its RMS, like
    Adafactor's parameter scaling, so that one lr (2e-2) moves every weight
    by a like fraction of its size. step() is the formula, a line over all
    of a group's tensors at once. distributed.ShardedAdamWScale overrides
    shards (what this process updates) and sum_over_shards (for the RMS).
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.0):
        # capturable: torch's flag for step counts kept on the parameters'
        # device (no host sync); its load_state_dict puts them back there
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay, capturable=True)
        super().__init__(params, defaults)

    def shards(self, tensors):
        return tensors

    def sum_over_shards(self, squares):
        return squares

    def rms(self, params):  # each tensor's root mean square, (n,)
        norms = torch._foreach_norm(self.shards(params))
        squares = self.sum_over_shards(torch.stack(norms).square())
        sizes = squares.new_tensor([p.numel() for p in params])
        return (squares / sizes).sqrt()

    @torch.no_grad()
    def step(self, closure=None):  # closure: torch.optim's signature
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            (b1, b2), lr = group["betas"], group["lr"]
            states = [self.state[p] for p in params]
            for p, s in zip(params, states):
                if not s:
                    s.update(step=torch.zeros((), device=p.device),
                             exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))
            t = [s["step"] for s in states]
            torch._foreach_add_(t, 1)
            t = torch.stack(t)  # each tensor's steps, this one included
            rms = self.rms(params)  # of p before this step
            p, g, m, v = (self.shards(x) for x in (
                params, [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states]))
            # (1) m = b1*m + (1-b1)*g
            torch._foreach_lerp_(m, g, 1 - b1)
            # (2) v = b2*v + (1-b2)*g^2
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, g, g, 1 - b2)
            # (3) step_size = lr * sqrt(1-b2^t)/(1-b1^t) * max(1e-3, RMS(p)),
            # 1-b^t as -expm1(t log b), which float32 holds to its last digit
            c1, c2 = (-torch.expm1(t * math.log(b)) for b in (b1, b2))
            step_size = lr * c2.sqrt() / c1 * rms.clamp(min=1e-3)
            # (4) p -= step_size * m / (sqrt(v) + eps), the denominator in
            # g's memory (last read in (2)): a copy would add 4 bytes a
            # parameter to the step's peak
            denom = g
            torch._foreach_copy_(denom, v)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_div_(denom, list(step_size.unbind()))
            torch._foreach_addcdiv_(p, m, denom, value=-1)
            # (5) p -= lr * weight_decay * p, decoupled from the step
            if group["weight_decay"] > 0:
                torch._foreach_mul_(p, 1 - lr * group["weight_decay"])

def get_lr(step, max_steps, lr, warmup_steps, warmup_start_factor,
           min_lr):
    """
    The lr of optimizer step `step` of max_steps (1 is the first;
    fractional under a time budget): nanoT5's cosine, a linear warmup
    from warmup_start_factor*lr to lr, then half a cosine down to
    min_lr (min_lr = lr: a constant lr).
    """
    if step < warmup_steps:
        warm = step / warmup_steps
        return lr * (warmup_start_factor + (1 - warmup_start_factor) * warm)
    if step >= max_steps:
        return min_lr
    decayed = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * decayed))

class TimeBudget:
    """The schedule of a run that stops by the clock (Cramming's): each
    step moves it as far as ends it with budget_s at the pace measured at
    the second step (the first holds the compile), then at next_check,
    halfway to the end. It never goes back."""

    def __init__(self, max_steps, budget_s, step, elapsed):
        self.max_steps, self.budget_s = max_steps, budget_s
        self.position = elapsed / budget_s * max_steps
        self.rate = 0.0  # schedule steps per step, once measured
        self.next_check = step + 2

    def advance(self):  # the next step's position in the schedule
        self.position = min(self.position + self.rate, self.max_steps)
        return self.position

    def measure(self, step, elapsed, step_s):
        left = max(1, math.ceil((self.budget_s - elapsed) / step_s))
        self.next_check = step + math.ceil(left / 2)
        self.rate = (self.max_steps - self.position) / left

def param_groups(model, weight_decay, no_decay=("ln_",)):
    """Two param groups: weight decay, and none for names holding one
    of no_decay (the RMSNorm scales, which decay would pull towards 0
    rather than regularise)."""
    decayed, not_decayed = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            skip = any(s in name for s in no_decay)
            (not_decayed if skip else decayed).append(p)
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": not_decayed, "weight_decay": 0.0}]

OPTIMIZERS = ("adamwscale", "adamw")

def make_optimizer(name, groups, lr):
    """One of OPTIMIZERS by name, each group's weight_decay from
    param_groups"""
    if name == "adamw":  # eps 1e-6 is HF AdamW's, which nanoT5 ran
        p = next(p for group in groups for p in group["params"])
        fused = p.device.type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=lr, eps=1e-6, fused=fused)
    return AdamWScale(groups, lr=lr)
