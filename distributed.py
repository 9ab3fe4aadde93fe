"""
Many GPUs training as one, under torchrun; a one-GPU run calls none of it
(train.py calls it under `if rt.torchrun:` or `if fsdp:`): the process
group and its timeouts, DDP, FSDP2 (HSDP over nodes) per block as
torchtitan applies it, each rank drawing or loading only its slices,
clipping and AdamWScale on slices, any rank's signal for all.
"""
import contextlib
import datetime
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy,
                                    fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from model import T5
from optim import AdamWScale
from runtime import checkpoint_activations

# long while a run starts or saves, where ranks read and write at their
# own paces; else NCCL's default, so that a hung rank is found
START_TIMEOUT = datetime.timedelta(hours=1)
TRAIN_TIMEOUT = datetime.timedelta(minutes=10)
GROUPS = []  # every process group: the ranks', and FSDP's mesh's

def join(rt):
    backend = "nccl" if rt.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=START_TIMEOUT)
    GROUPS.append(dist.group.WORLD)

def set_timeout(timeout):
    for group in GROUPS:
        group.set_timeout(timeout)

@contextlib.contextmanager
def save_timeout():  # while saving, ranks wait for the slowest
    set_timeout(START_TIMEOUT)
    yield
    set_timeout(TRAIN_TIMEOUT)

def ddp(model, rt):  # no broadcast: every rank has drawn the same weights
    ids = [rt.local_rank] if rt.device_type == "cuda" else None
    return DDP(model, device_ids=ids, init_sync=False)

def sharded_t5(config, rt, compile=False, activation_checkpointing=False,
               shard_across_nodes=False, dynamic=None):
    """T5(config) under FSDP2, built on the meta device (no memory); each
    rank draws its slices of the weights one process draws (docs/scale.md)"""
    with torch.device("meta"):
        model = T5(config)
    if activation_checkpointing:  # then compile, then shard: torchtitan's
        checkpoint_activations(model)
    if compile:
        for block in model.blocks():
            block.compile(dynamic=dynamic)
    shard_model(model, rt, shard_across_nodes)
    model.to_empty(device=rt.device)
    generator = torch.Generator(rt.device).manual_seed(model.init_seed)
    for name, p in model.named_parameters():
        whole = torch.empty(p.shape, device=rt.device)
        model.init_parameter(name, whole, generator)
        set_values(p, whole)
    return model

def shard_model(model, rt, shard_across_nodes=False):
    """FSDP2 on the T5 in place, a group for each part that runs as one:
    each bias table, each block (gathered in bf16 under bf16), the
    embedding (fp32), the root; over nodes HSDP, unless shard_across_nodes
    (docs/scale.md)"""
    if rt.nodes > 1 and not shard_across_nodes:
        shape = (rt.nodes, rt.world_size // rt.nodes)
        mesh = init_device_mesh(rt.device_type, shape,
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    GROUPS.extend(mesh.get_all_groups())
    set_timeout(START_TIMEOUT)  # a new group has the backend's default
    policy = MixedPrecisionPolicy(  # param_dtype None: fp32
        param_dtype=torch.bfloat16 if rt.dtype == "bfloat16" else None,
        reduce_dtype=torch.float32, cast_forward_inputs=False)
    # under bf16 a block's norms scale the fp32 residual stream by bf16
    # weights: torch does it in fp32, unfused, and would say so every step
    warnings.filterwarnings("ignore",
                            "Mismatch dtype between input and weight")
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            fully_shard(module, mesh=mesh)
    for block in model.blocks():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    for block in model.decoder.blocks:  # generate() calls it, not forward()
        register_fsdp_forward_method(block, "encoder_kv")
    if not model.config.tie_word_embeddings:  # tied: the root's lm_head
        # gathered once a step: forward looks up encoder and decoder tokens
        fully_shard(model.shared, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "generate")
    generate = model.generate

    def generate_gathered(*args, **kwargs):
        """each decoder block gathered once a call: decoding holds no
        collective, and each rank stops when its own rows are done"""
        for block in model.decoder.blocks:
            block.set_reshard_after_forward(False)
        try:
            return generate(*args, **kwargs)
        finally:
            for block in model.decoder.blocks:
                block.set_reshard_after_forward(True)
                block.reshard()
    model.generate = generate_gathered

@torch.no_grad()
def set_values(p, whole):
    """a sharded p gets whole's values: this rank cuts its own slice
    (src_data_rank=None: no rank sends)"""
    whole = distribute_tensor(whole, p.device_mesh, p.placements,
                              src_data_rank=None)
    p.to_local().copy_(whole.to_local())

def sync_gradients(model, now):
    """whether backward all-reduces the gradients over the replicas (DDP's
    ranks, HSDP's nodes): after a step's last micro-step only"""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = now
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(now)

def clip_grad_norm(model, max_norm):
    """the norm of all ranks' gradient slices, reduced once, as torchtitan
    does; clipped to max_norm"""
    grads = [p.grad for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(grads).full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm

class ShardedAdamWScale(AdamWScale):
    """AdamWScale on FSDP's slices; RMS(p) the whole tensor's, from its
    slices' squares, one all-reduce for all tensors"""

    def shards(self, tensors):
        return [t.to_local() for t in tensors]

    def sum_over_shards(self, squares):
        mesh = self.param_groups[0]["params"][0].device_mesh
        dist.all_reduce(squares, group=mesh.get_group(mesh.ndim - 1))
        return squares

def shard_optimizer(optimizer):  # torch's AdamW takes slices as they are
    if type(optimizer) is AdamWScale:
        optimizer = ShardedAdamWScale(optimizer.param_groups,
                                      lr=optimizer.defaults["lr"])
    return optimizer

class SignalFlags:
    """whether any rank caught a signal: each step sums the flags on the
    device, the host reads the sum two steps on (never waiting), and all
    ranks stop at one step, within 3 of the signal"""

    def __init__(self, rt):
        self.device, self.sums = rt.device, []

    def any(self, caught):
        flag = torch.full((1,), float(caught), device=self.device)
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
            copied.synchronize()
        return on_host.item() > 0
