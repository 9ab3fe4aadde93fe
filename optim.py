"""
nanoT5's optimizer, AdamWScale, and its learning-rate schedule.
"""
import math

import torch
from torch.optim.adamw import adamw

from runtime import local, rms  # FSDP's slices: this rank's, and the whole tensor's RMS

class AdamWScale(torch.optim.Optimizer):
    """
    nanoT5's AdamW: each tensor's Adam step is scaled by the tensor's RMS, like Adafactor's
    parameter scaling, so that one lr (2e-2) moves every weight by a similar fraction of its own
    size. Per tensor p with gradient g, after t steps:
        (1) m = b1*m + (1-b1)*g
        (2) v = b2*v + (1-b2)*g^2
        (3) step_size = lr * sqrt(1-b2^t)/(1-b1^t) * max(1e-3, RMS(p))  # RMS(p) before this update
        (4) p -= step_size * m / (sqrt(v) + eps)
        (5) p -= lr * wd * p                                             # decoupled; if wd > 0
    (1)-(4) run as torch's fused AdamW kernel, one call a tensor. It computes
        p -= lr' / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps')
    which is (3)-(4) with lr' = lr * max(1e-3, RMS(p)) and eps' = eps / sqrt(1-b2^t).
    make_optimizer(compile=True) runs `update`, the lines compiled once for every size and step:
    lr and the step counts are tensors on the parameters' device, with no CPU code beside the GPU's.
    Under FSDP each rank holds a slice of p: RMS(p) is the whole tensor's (rms), the rest on slices.
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        lr = torch.tensor(lr, dtype=torch.float64)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.compiled_update = None  # make_optimizer(compile=True) sets it
        self.place()
        self.register_load_state_dict_post_hook(AdamWScale.place)  # a checkpoint loads to the CPU

    def place(self):
        """lr and the step counts on the parameters' device; the host's count t (eps') from them"""
        for group in self.param_groups:
            for p in group["params"]:
                group["lr"] = group["lr"].to(local(p).device)
                if p in self.state:
                    group["t"] = int(self.state[p]["step"])
                    self.state[p]["step"] = self.state[p]["step"].to(local(p).device)

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim's signature: set_optimizer_state_dict passes None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            (beta1, beta2), lr, decay = group["betas"], group["lr"], group["weight_decay"]
            group["t"] = t = group.get("t", 0) + 1  # its tensors step together, as T5's do
            eps = group["eps"] / math.sqrt(1 - beta2 ** t)  # eps'
            for p, p_rms in zip(params, rms(params)):
                state = self.state[p]
                if not state:  # the step count in float32, as the fused kernel reads it
                    state.update(step=torch.zeros((), device=local(p).device),
                                 exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                p, g, m, v = (local(x) for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
                if self.compiled_update:
                    self.compiled_update(p.view(-1), g.view(-1), m.view(-1), v.view(-1),
                                         state["step"], p_rms, lr, beta1, beta2, group["eps"])
                else:
                    p_lr = (lr * p_rms.clamp(min=1e-3)).float()  # lr'
                    adamw([p], [g], [m], [v], [], [state["step"]], fused=True, amsgrad=False,
                          beta1=beta1, beta2=beta2, lr=p_lr, weight_decay=0.0, eps=eps,
                          maximize=False)
                if decay > 0:
                    p.mul_(1 - lr * decay)  # (5)

    @staticmethod
    @torch.no_grad()
    def update(p, g, m, v, t, p_rms, lr, beta1, beta2, eps):
        """(1)-(4) for one tensor, flattened, as make_optimizer(compile=True) compiles it"""
        t += 1
        m.lerp_(g, 1 - beta1)  # (1): m + (1-b1)*(g - m)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # (2)
        t = t.double()  # the bias corrections as exact as Python's floats
        step_size = lr * (1 - beta2 ** t).sqrt() / (1 - beta1 ** t)  # (3)
        step_size = step_size * p_rms.clamp(min=1e-3)  # (3)
        update = m / v.sqrt().add_(eps)  # (4) m / (sqrt(v) + eps)
        p.sub_(update.mul_(step_size))  # (4) p -= step_size * that

def get_lr(step, max_steps, lr, warmup_steps, warmup_start_factor, min_lr):
    """
    The learning rate of optimizer step number `step` of max_steps (1 is the first; under a time
    budget, fractional: the share of the budget spent, in steps): nanoT5's cosine, a linear warmup
    from warmup_start_factor*lr to lr, then half a cosine down to min_lr (min_lr = lr: constant).
    """
    if step < warmup_steps:
        return lr * (warmup_start_factor + (1 - warmup_start_factor) * step / warmup_steps)
    if step >= max_steps:
        return min_lr
    decayed = (step - warmup_steps) / (max_steps - warmup_steps)  # the share of the decay done
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * decayed))

def param_groups(model, weight_decay, no_decay=("ln_",)):
    """Two param groups: weight decay, and none for names holding one of no_decay (the RMSNorm
    scales, which decay would pull towards 0 rather than regularise)."""
    decayed, not_decayed = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (not_decayed if any(s in name for s in no_decay) else decayed).append(p)
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": not_decayed, "weight_decay": 0.0}]

OPTIMIZERS = ("adamwscale", "adamw")

def make_optimizer(name, groups, lr, compile=False):
    """One of OPTIMIZERS by name, each group's weight_decay from param_groups; lr a tensor, which
    train.py sets in place. compile: AdamWScale's `update` compiled, not torch's fused kernel."""
    if name == "adamw":  # eps 1e-6 is HF AdamW's, which nanoT5 ran
        fused = next(p for g in groups for p in g["params"]).device.type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=torch.tensor(lr), eps=1e-6, fused=fused)
    optimizer = AdamWScale(groups, lr=lr)
    if compile:  # one graph for every tensor, of whatever size
        optimizer.compiled_update = torch.compile(optimizer.update, dynamic=True)
    return optimizer
