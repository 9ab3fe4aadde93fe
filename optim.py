"""
nanoT5's optimizer, AdamWScale, and its learning-rate schedule.
"""
import math

import torch
from torch.optim.adamw import adamw

class AdamWScale(torch.optim.Optimizer):
    """
    nanoT5's AdamW: each tensor's Adam step is scaled by the tensor's
    RMS, like Adafactor's parameter scaling, so that one lr (2e-2) moves
    every weight by a similar fraction of its own size. Per tensor p with
    gradient g, after t steps:
        (1) m = b1*m + (1-b1)*g
        (2) v = b2*v + (1-b2)*g^2
        (3) step_size = lr * sqrt(1-b2^t)/(1-b1^t) * max(1e-3, RMS(p))
        (4) p -= step_size * m / (sqrt(v) + eps)
        (5) p -= lr * wd * p              # decoupled; if wd > 0
    RMS(p) is taken before this update. (1)-(4) run as torch's fused
    AdamW kernel, one call a tensor, which computes
        p -= lr' / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps')
    that is (3)-(4) with lr' = lr * max(1e-3, RMS(p)) and
    eps' = eps / sqrt(1-b2^t). Two hooks say what a tensor is: `local`,
    the tensor this process updates, and `rms`; distributed.py's
    ShardedAdamWScale overrides them for a rank's slices of tensors.
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.0):
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        # a checkpoint's state loads to the CPU
        self.register_load_state_dict_post_hook(AdamWScale.place)

    def local(self, t):
        return t

    def rms(self, tensors):  # each tensor's root mean square, 0-d
        return [t.norm() / math.sqrt(t.numel()) for t in tensors]

    def place(self):
        """the step counts on the parameters' device, which the fused
        kernel reads; the host's count t, for eps', from them"""
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    state = self.state[p]
                    group["t"] = int(state["step"])
                    device = self.local(p).device
                    state["step"] = state["step"].to(device)

    @torch.no_grad()
    def step(self, closure=None):  # closure: torch.optim's signature
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            # a group's tensors step together, as T5's do
            group["t"] = t = group.get("t", 0) + 1
            eps = group["eps"] / math.sqrt(1 - beta2 ** t)  # eps'
            for p, p_rms in zip(params, self.rms(params)):
                state = self.state[p]
                if not state:  # float32: what the fused kernel reads
                    device = self.local(p).device
                    state.update(step=torch.zeros((), device=device),
                                 exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p, g, m, v = map(self.local, (p, p.grad, m, v))
                p_lr = (lr * p_rms.clamp(min=1e-3)).float()  # lr'
                adamw([p], [g], [m], [v], [], [state["step"]],
                      fused=True, amsgrad=False, beta1=beta1,
                      beta2=beta2, lr=p_lr, weight_decay=0.0, eps=eps,
                      maximize=False)
                if decay > 0:
                    p.mul_(1 - lr * decay)  # (5)

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

class Pace:
    """Where the schedule is, in steps, and how far each optimizer step
    moves it: one step, or under a time budget (budget_s > 0), as far as
    ends the schedule with the budget, at the pace last measured. At each
    sync step, where the ranks agree on the clock (synced), the pace is
    measured again: first at the second step (the first's time holds the
    compile), then at check_step, halfway to the budget's end at that
    pace. The position never goes back."""

    def __init__(self, max_steps, budget_s, step, elapsed):
        self.max_steps, self.budget_s = max_steps, budget_s
        self.step, self.elapsed, self.start = step, elapsed, step
        self.position = elapsed / budget_s * max_steps if budget_s else step
        self.rate = 0.0 if budget_s else 1.0
        self.check_step = step + 2 if budget_s else 0

    def advance(self):  # the next step's position
        self.position = min(self.position + self.rate, self.max_steps)
        return self.position

    def synced(self, step, elapsed):
        """at a sync step: the mean seconds of a step since the last one"""
        step_s = (elapsed - self.elapsed) / (step - self.step)
        first = self.step == self.start
        self.step, self.elapsed = step, elapsed
        if self.budget_s and not first:
            left = max(1, math.ceil((self.budget_s - elapsed) / step_s))
            self.check_step = step + math.ceil(left / 2)
            self.rate = (self.max_steps - self.position) / left
        return step_s

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
