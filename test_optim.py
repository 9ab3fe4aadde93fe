import io
import math

import pytest
import torch
from torch import nn

from optim import AdamWScale, get_lr, make_optimizer, param_groups

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once


def adamwscale_by_hand(p, grads, lr, weight_decay, b1=0.9, b2=0.999, eps=1e-6):
    """nanoT5's rule on a list of floats, one element at a time"""
    p, m, v = list(p), [0.0] * len(p), [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        rms = math.sqrt(sum(x * x for x in p) / len(p))
        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * max(1e-3, rms)
        for i in range(len(p)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
            p[i] -= step_size * m[i] / (math.sqrt(v[i]) + eps)
            p[i] -= lr * weight_decay * p[i]
    return p


def test_adamwscale_matches_hand_computed_steps():
    lr = 0.1
    big = nn.Parameter(torch.tensor([3.0, -4.0]))  # RMS = 5 / sqrt(2)
    zero = nn.Parameter(torch.zeros(2))  # RMS = 0: the step size is floored at lr * 1e-3
    opt = AdamWScale([{"params": [big], "weight_decay": 0.1}, {"params": [zero], "weight_decay": 0.0}], lr=lr)
    big_grads, zero_grads = [[0.5, -1.0], [-2.0, 0.25]], [[2.0, -0.25], [1.0, 1.0]]

    big.grad, zero.grad = torch.tensor(big_grads[0]), torch.tensor(zero_grads[0])
    opt.step()
    # on the first step the bias corrections cancel and m / sqrt(v) = g / |g|: each element moves by lr * RMS against
    # its gradient, shortened by eps to |g| / (|g| + eps / sqrt(1 - b2)); decay then shrinks the big tensor by 0.99
    moved = lambda g, rms: -lr * rms * g / (abs(g) + 1e-6 / math.sqrt(1e-3))
    rms = 5 / math.sqrt(2)
    assert big.tolist() == pytest.approx([(3.0 + moved(0.5, rms)) * 0.99, (-4.0 + moved(-1.0, rms)) * 0.99], rel=1e-6)
    assert zero.tolist() == pytest.approx([moved(2.0, 1e-3), moved(-0.25, 1e-3)], rel=1e-6)

    big.grad, zero.grad = torch.tensor(big_grads[1]), torch.tensor(zero_grads[1])
    opt.step()
    assert big.tolist() == pytest.approx(adamwscale_by_hand([3.0, -4.0], big_grads, lr, 0.1), rel=1e-5)
    assert zero.tolist() == pytest.approx(adamwscale_by_hand([0.0, 0.0], zero_grads, lr, 0.0), rel=1e-5)


def test_adamwscale_skips_params_without_grad():
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = AdamWScale([used, unused], lr=0.1)
    used.grad = torch.ones(3)
    opt.step()
    assert unused.tolist() == [1.0, 1.0, 1.0] and unused not in opt.state
    assert used[0].item() < 1.0


def test_adamwscale_keeps_step_counts_on_the_parameters_device():
    """the bias corrections are computed on the parameters' device from their step counts, so that the host never
    waits for it; a checkpoint loads them onto the CPU. The meta device stands in for the GPU here."""
    p = nn.Parameter(torch.ones(3))
    opt = AdamWScale([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()  # on the CPU, as a checkpoint loads it
    with torch.device("meta"):
        q = nn.Parameter(torch.ones(3))
    other = AdamWScale([q], lr=0.1)
    other.load_state_dict(saved)
    assert other.state[q]["step"].device.type == "meta"


@pytest.mark.parametrize("name", ["adamwscale", "adamw"])
def test_state_dict_round_trip(name):
    torch.manual_seed(0)
    shapes = [(4, 3), (3,)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    opt = make_optimizer(name, [{"params": params, "weight_decay": 0.01}], lr=1e-2)
    for step_grads in grads[:2]:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for c, p in zip(copies, params):
            c.copy_(p)
    resumed = make_optimizer(name, [{"params": copies, "weight_decay": 0.01}], lr=1e-2)
    resumed.load_state_dict(torch.load(buffer))
    for p, c, g in zip(params, copies, grads[2]):
        p.grad, c.grad = g, g.clone()
    opt.step()
    resumed.step()
    for p, c in zip(params, copies):
        assert torch.equal(p, c)


def test_cosine_schedule_matches_nanot5():
    lr_at = lambda step: get_lr(step, 65536, 2e-2, 10000, 0.5, 1e-5)
    assert lr_at(0) == pytest.approx(1e-2, rel=1e-12)
    assert lr_at(1) == pytest.approx(1e-2, rel=1e-4)
    assert lr_at(5000) == pytest.approx(1.5e-2, rel=1e-12)
    assert lr_at(10000) == pytest.approx(2e-2, rel=1e-12)
    assert lr_at(10000 + 55536 / 2) == pytest.approx((2e-2 + 1e-5) / 2, rel=1e-12)
    assert lr_at(65536) == pytest.approx(1e-5, rel=1e-12)
    assert lr_at(70000) == pytest.approx(1e-5, rel=1e-12)
    assert lr_at(5000) < lr_at(5000.5) < lr_at(5001)  # a time budget passes fractional steps


def test_min_lr_at_lr_is_a_constant_lr():
    assert get_lr(123.5, 1000, 3e-4, 0, 0.5, 3e-4) == get_lr(2000, 1000, 3e-4, 0, 0.5, 3e-4) == 3e-4


def test_param_groups_spare_norm_weights():
    from model import T5, T5Config
    t5 = T5(T5Config.from_preset("t5-tiny"))
    norm_weights = {id(m.weight) for m in t5.modules() if isinstance(m, nn.RMSNorm)}
    decayed, not_decayed = param_groups(t5, 0.1)
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0
    assert {id(p) for p in not_decayed["params"]} == norm_weights
    assert len(decayed["params"]) + len(not_decayed["params"]) == len(list(t5.parameters()))

    names = {id(p): n for n, p in t5.named_parameters()}
    _, not_decayed = param_groups(t5, 0.1, no_decay=("ln_", "shared"))
    assert {names[id(p)] for p in not_decayed["params"]} == {names[i] for i in norm_weights} | {"shared.weight"}


def test_make_optimizer():
    groups = param_groups(nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4)), 0.0)
    assert isinstance(make_optimizer("adamwscale", groups, 1e-2), AdamWScale)
    assert isinstance(make_optimizer("adamw", groups, 1e-3), torch.optim.AdamW)


class ByLines(AdamWScale):
    """AdamWScale's lines (1)-(5) run one by one on each tensor, nanoT5's per-tensor form"""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t, m, v, g = state["step"], state["exp_avg"], state["exp_avg_sq"], p.grad
                p_rms = p.norm() / math.sqrt(p.numel())  # before this update
                m.lerp_(g, 1 - beta1)  # (1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # (2)
                step_size = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) * p_rms.clamp(min=1e-3)  # (3)
                p.sub_(step_size * m / (v.sqrt() + group["eps"]))  # (4)
                if group["weight_decay"] > 0:
                    p.mul_(1 - lr * group["weight_decay"])  # (5)


def test_the_step_over_all_tensors_is_the_per_tensor_form():
    """AdamWScale's step, each formula line over all of a group's tensors at once, equals its lines run one by one
    on each tensor (ByLines), over 20 steps of a new lr each, on T5-shaped tensors with weight decay"""
    torch.manual_seed(0)
    shapes = [(256, 64), (64,), (32, 6), (64, 256)]  # a projection, a norm, a bias table, wo
    fused = [nn.Parameter(torch.randn(s) * 0.05) for s in shapes]
    by_lines = [nn.Parameter(p.detach().clone()) for p in fused]
    optimizers = [cls([{"params": ps, "weight_decay": 0.01}], lr=1e-2) for ps, cls in ((fused, AdamWScale),
                                                                                     (by_lines, ByLines))]
    for step in range(20):
        grads = [torch.randn(s) * 1e-3 for s in shapes]
        for optimizer, params in zip(optimizers, (fused, by_lines)):
            optimizer.param_groups[0]["lr"] = 2e-2 * (step + 1) / 20  # as train.py sets it
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
    for p, q in zip(fused, by_lines):  # each step moves a weight by ~1e-3: 1e-7 is 1e-4 of a step
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
