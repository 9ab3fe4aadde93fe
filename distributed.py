"""
The multi-GPU layer, which a one-GPU run can skip: how torchrun's ranks
train as one. One process makes the same calls, with nothing to share.
- join: the ranks' process group; how long a collective waits;
- wrap_model: DDP, or FSDP2 (HSDP over nodes) applied from outside, per
  block, as torchtitan does; activation checkpointing; generate;
- draw_weights, clip_grad_norm, ShardedAdamWScale: on each rank's slices;
- Sync: what the ranks agree on, and the signals that stop them.
"""
import contextlib
import datetime
import functools
import math
import os
import signal
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy,
                                    fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from optim import AdamWScale
from runtime import memory_report, print0

# how long a collective waits for every rank: long while the run starts
# or saves, where ranks read and write at their own paces; else NCCL's
START_TIMEOUT = datetime.timedelta(hours=1)
TRAIN_TIMEOUT = datetime.timedelta(minutes=10)

def join(rt):
    """under torchrun, this rank joins the ranks' process group"""
    if rt.ddp:
        backend = "nccl" if rt.device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=START_TIMEOUT)
        rt.groups.append(dist.group.WORLD)

def set_timeout(rt, timeout):  # on every process group
    for group in rt.groups:
        group.set_timeout(timeout)

@contextlib.contextmanager
def patiently(rt):
    """inside, every rank waits for the slowest write: START_TIMEOUT"""
    set_timeout(rt, START_TIMEOUT)
    yield
    set_timeout(rt, TRAIN_TIMEOUT)

def all_gathered(value):  # every rank's value (picklable), in rank order
    values = [value]
    if dist.is_initialized():
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values

def summed(rt, values):
    """values' sums over the ranks (numbers, or 0-d tensors on the
    device), as floats, in one all-reduce: the host's one wait for the
    device"""
    device = rt.device if rt.ddp else "cpu"  # and MPS has no float64
    values = [torch.as_tensor(v).to(device, torch.float64) for v in values]
    return sum_over_ranks(rt, torch.stack(values)).tolist()

def sum_over_ranks(rt, t):  # a tensor, summed over the ranks in place
    if rt.ddp:
        dist.all_reduce(t)
    return t

# the model as it trains: one process, DDP, or FSDP

def blocks(model):  # the encoder's, then the decoder's
    return [*model.encoder.blocks, *model.decoder.blocks]

def wrap_model(model, rt, fsdp=False, compile=False,
               activation_checkpointing=False, shard_across_nodes=False,
               dynamic=None):
    """The T5 built on the meta device, placed for training, its weights
    still to be made. FSDP shards it in place, each rank materialising
    only its own slices, and compiles each block, as torchtitan does;
    else it is whole on the device, compiled, in DDP under torchrun.
    Returns what the loop calls: the T5, or its compiled or DDP wrapper."""
    if activation_checkpointing:  # then compile, then shard: torchtitan's
        apply_activation_checkpointing(model)
    if fsdp:
        if compile:
            for block in blocks(model):
                block.compile(dynamic=dynamic)
        shard_model(model, rt, shard_across_nodes)
        return model.to_empty(device=rt.device)
    model.to_empty(device=rt.device)
    model.tie_weights()  # to_empty made lm_head a tensor of its own
    if compile:
        model = torch.compile(model, dynamic=dynamic)
    if rt.ddp:  # no broadcast: every rank draws or loads the same weights
        ids = [rt.local_rank] if rt.device_type == "cuda" else None
        model = DDP(model, device_ids=ids, init_sync=False)
    return model

def apply_activation_checkpointing(model):
    """each block keeps only its input for backward, which runs it again;
    before compiling: the compiler sees that run too"""
    for block in blocks(model):
        block.forward = functools.partial(checkpoint, block.forward,
                                          use_reentrant=False)

def shard_model(model, rt, shard_across_nodes=False):
    """FSDP2 on the T5 in place, a group for each part that runs as one,
    gathered just before it runs: each relative_attention_bias table;
    each block, twice a step (forward, backward), in bf16 under bf16; the
    embedding, in fp32 (it starts the residual stream); the root: lm_head
    and the final norms. Gradients reduce in fp32. Over several nodes,
    HSDP: each node shards the model over its ranks, the nodes are
    replicas, and only the gradients' all-reduce crosses the network;
    or, shard_across_nodes, one sharding over all ranks."""
    if rt.nodes > 1 and not shard_across_nodes:  # torchtitan's dp_replicate, dp_shard
        shape, names = (rt.nodes, rt.world_size // rt.nodes), ("replicate", "shard")
        mesh = init_device_mesh(rt.device_type, shape, mesh_dim_names=names)
    else:
        mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    rt.groups += mesh.get_all_groups()
    set_timeout(rt, START_TIMEOUT)  # a new group has the backend's default
    param_dtype = torch.bfloat16 if rt.dtype == "bfloat16" else None  # None: fp32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    # under bf16 a block's norms scale the fp32 residual stream by bf16
    # weights: torch does it in fp32, unfused, and would say so every step
    warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            fully_shard(module, mesh=mesh)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    for block in model.decoder.blocks:  # generate() calls it outside forward()
        register_fsdp_forward_method(block, "encoder_kv")
    if not model.config.tie_word_embeddings:  # tied: the root's lm_head
        # gathered once a step: forward looks up encoder and decoder tokens
        fully_shard(model.shared, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "generate")
    generate = model.generate

    def generate_gathered(*args, **kwargs):
        """generate() with each decoder block gathered once for the call,
        resharded after it. The decoding steps then hold no collective, and
        each rank stops when its own rows are finished."""
        for block in model.decoder.blocks:
            block.set_reshard_after_forward(False)
        try:
            return generate(*args, **kwargs)
        finally:
            for block in model.decoder.blocks:
                block.set_reshard_after_forward(True)
                block.reshard()
    model.generate = generate_gathered

def sync_gradients(model, now):
    """whether backward all-reduces the gradients over the replicas (DDP's
    ranks, HSDP's nodes): after a step's last micro-step only. FSDP
    reduce-scatters them at each, and keeps them sharded."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = now
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(now)

# on each rank's slices: the weights drawn, the gradients clipped, AdamWScale

@torch.no_grad()
def draw_weights(model):
    """The weights T5(config) draws, into a placed model, each tensor drawn
    whole on the device in the same order: the same on any number of ranks
    as in one process. Under FSDP each rank keeps its own slice, and holds
    one tensor whole at a time."""
    for name, p in model.named_parameters():
        whole = torch.empty(p.shape, device=p.device)  # none from the host
        model.init_parameter(name, whole)
        set_values(p, whole)

@torch.no_grad()
def set_values(p, whole):
    """p, a placed parameter, gets the values of whole, of its shape, on
    any device: under FSDP, only this rank's slice, which it cuts itself
    (src_data_rank=None: no rank sends)"""
    if isinstance(p, DTensor):
        whole = distribute_tensor(whole, p.device_mesh, p.placements,
                                  src_data_rank=None).to_local()
        p = p.to_local()
    p.copy_(whole)

def clip_grad_norm(model, max_norm):
    """the gradients' total norm, clipped to max_norm (0: not clipped);
    under FSDP of every rank's slices, reduced once, as torchtitan does"""
    grads = [p.grad for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # the one all-reduce
    max_norm = max_norm or float("inf")
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm

class ShardedAdamWScale(AdamWScale):
    """AdamWScale on FSDP's slices: each rank updates its own; RMS(p) is
    the whole tensor's, the squares of its slices summed over the ranks
    that shard it (under HSDP, a node's), one all-reduce for all tensors"""

    def local(self, t):
        return t.to_local()

    def rms(self, tensors):
        if not tensors:
            return []
        norms = [t.to_local().norm() for t in tensors]
        squares = torch.stack([norm.square() for norm in norms])
        mesh = tensors[0].device_mesh
        shards = mesh.get_group(mesh.ndim - 1)  # the mesh's last dim
        dist.all_reduce(squares, group=shards)
        return [norm / math.sqrt(t.numel())
                for norm, t in zip(squares.sqrt().unbind(), tensors)]

def shard_optimizer(optimizer):
    """an AdamWScale as ShardedAdamWScale; torch's AdamW takes slices"""
    if type(optimizer) is AdamWScale:
        optimizer = ShardedAdamWScale(optimizer.param_groups,
                                      **optimizer.defaults)
    return optimizer

def print_memory(model, optimizer, rt):
    """after the first step: what rank 0 holds of the weights and the
    optimizer state; a GPU's peak"""
    state = [v for s in optimizer.state.values() for v in s.values()]
    tensors = [*model.parameters(), *filter(torch.is_tensor, state)]
    held = sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes
               for t in tensors)
    print0(f"parameters + optimizer state: {held / 2**20:.2f} MiB on rank 0")
    if rt.device_type == "cuda":
        print0(memory_report(rt.device))

# where the ranks agree

class Sync:
    """What the ranks agree on, so that each takes every decision at the
    same step. After each step (step_done), on the device, not waited
    for: whether the loss or grad norm is NaN or inf; and the ranks'
    signal flags, summed, read two steps on. At a sync step (agree), in
    one all-reduce: the mean loss, rank 0's clock, and those two.
    SIGINT (Ctrl-C) and SIGTERM (a preemption): every rank saves and
    stops at the same step, within 3; before the first step is done (it
    compiles) there is nothing to save, and the run ends at once, where
    torch.compile's first call would swallow a KeyboardInterrupt. Either
    way the process exits 128 + the signal's number, as one the signal
    killed: `train.py && export.py` stops there."""

    def __init__(self, rt):
        self.rt = rt
        self.caught = 0  # the signal's number, once one came
        self.step = None  # the last step done; None until the first is
        self.nonfinite = 0  # steps with a NaN or inf since the last sync
        self.sums = []  # each step's sum of the flags, on the host, its event
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.catch)

    def catch(self, signum, frame):
        name = signal.Signals(signum).name
        if self.step is None:
            os.write(2, f"{name} before the first step: nothing to save\n".encode())
            os._exit(128 + signum)
        if not self.caught and self.rt.master:
            when = ("within 3 steps, on every rank" if self.rt.ddp
                    else "after this step")
            os.write(2, f"{name} after step {self.step}: the run saves and "
                        f"stops {when}\n".encode())
        self.caught = signum

    def step_done(self, step, loss, grad_norm, last):
        """after each step: whether to save and stop here, the same on
        every rank: at the last step, or for a signal"""
        self.step = step
        self.nonfinite = self.nonfinite + ~torch.isfinite(loss + grad_norm)
        if last or not self.rt.ddp:
            return last or self.caught > 0
        flag = torch.full((1,), float(self.caught), device=self.rt.device)
        dist.all_reduce(flag)  # NCCL: the GPU's stream waits, not the host
        on_host = flag.to("cpu", non_blocking=True)  # when the GPU gets there
        copied = torch.cuda.Event() if flag.is_cuda else None
        if copied:
            copied.record()
        self.sums.append((on_host, copied))
        if len(self.sums) < 3:
            return False
        on_host, copied = self.sums.pop(0)
        if copied:
            copied.synchronize()  # long done: two steps ago
        return on_host.item() > 0

    def agree(self, loss, elapsed, errors=()):
        """at a sync step: the mean loss over the ranks, rank 0's elapsed
        seconds, and whether any rank saw a NaN or inf since the last sync
        step (diverged), a signal (signalled), or errors (damaged)"""
        mine = elapsed if self.rt.master else 0.0  # the others add 0
        values = (loss / self.rt.world_size, self.nonfinite, self.caught, mine,
                  len(errors))
        loss, nonfinite, signalled, elapsed, damaged = summed(self.rt, values)
        self.nonfinite = 0
        return SimpleNamespace(loss=loss, elapsed=elapsed, damaged=damaged,
                               diverged=nonfinite > 0, signalled=signalled > 0)

    def release(self):  # after the loop: a signal stops the program at once
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
