"""What a run needs around the model: the device and its float modes; DDP or FSDP2 applied from
outside, per block, as torchtitan does; where the ranks agree; MFU; files written whole; the log."""
import contextlib
import datetime
import fcntl
import functools
import importlib.util
import json
import math
import os
import re
import signal
import uuid
import warnings
from dataclasses import dataclass, field
from tempfile import TemporaryFile

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

def rank():
    return int(os.environ.get("RANK", 0))  # set by torchrun

def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs)

def check_config(config, rules):
    """a script's rules, (key, whether its value is valid, what it must be): a line each it fails"""
    mistakes = [f"error: config key '{key}' is {config[key]!r}; it must be {rule}"
                for key, valid, rule in rules if not valid]
    if mistakes:
        raise SystemExit("\n".join(mistakes))

@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """a file written whole or not at all: into a temporary file of this writer's own, renamed over
    path once complete and on disk; a failed write leaves nothing behind"""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, mode.replace("w", "x")) as f:  # created here: no other writer's
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)

def claim(out_dir, lock=True):
    """out_dir, made, and locked for as long as this process lives (rank 0's): one live run per
    folder. The kernel releases the lock when the process ends, however: a requeue is never refused.
    lock=False: only made, and checked to be writable."""
    if rank():
        return None
    try:
        os.makedirs(out_dir, exist_ok=True)
        file = open(os.path.join(out_dir, ".lock"), "a") if lock else TemporaryFile(dir=out_dir)
    except OSError as e:
        raise SystemExit(f"error: can't write in {out_dir} ({e.strerror}): pass an --out_dir you "
                         f"can write to") from None
    try:
        if lock:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: {out_dir} is in use by a run still going: let it end, or pass "
                         f"another --out_dir") from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem without locks (docs/cluster.md)
        print(f"warning: {out_dir} can't be locked ({e.strerror}): run nothing else in it")
    return file

# the device, its float modes, and MFU

DTYPES = ("float32", "tfloat32", "bfloat16")

# dense peak FLOP/s (float32, tfloat32, bfloat16) from NVIDIA's data sheets, by get_device_name
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100-SXM4-80GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100-PCIE-40GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100 80GB PCIe": (19.5e12, 156e12, 312e12),
    "NVIDIA H100 80GB HBM3": (67e12, 494.5e12, 989.5e12),  # SXM
    "NVIDIA H100 PCIe": (51e12, 378e12, 756.5e12),
    "NVIDIA H200": (67e12, 494.5e12, 989.5e12),  # SXM
    "NVIDIA B200": (75e12, 1.1e15, 2.25e15),
}

def flops_per_step(model, batch_size, input_length, target_length):
    """Training FLOPs of one step, for MFU: 6 per weight per token it sees (2 forward, 4 backward):
    S input tokens for the encoder and cross-attention's k, v, T targets for the rest and the
    lm_head; plus attention's matmuls."""
    c, S, T = model.config, input_length, target_length
    n_enc = sum(p.numel() for p in model.encoder.parameters())
    n_cross_kv = sum(2 * b.cross_attn.k.weight.numel() for b in model.decoder.blocks)
    n_dec = sum(p.numel() for p in model.decoder.parameters()) - n_cross_kv
    flops = 6 * (n_enc * S + n_dec * T + n_cross_kv * S + c.d_model * c.vocab_size * T)
    attention = c.num_layers * S * S + c.num_decoder_layers * (T * T + T * S)  # q k^T and a v
    flops += 12 * c.num_heads * c.d_kv * attention
    return batch_size * flops

def mfu(flops_per_step, seconds_per_step, world_size, peak_flops):
    return flops_per_step / world_size / seconds_per_step / peak_flops if peak_flops else None

def memory_report(device):  # after the first step on a GPU, to judge batch_size by
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    headroom = free + torch.cuda.memory_reserved(device) - peak  # PyTorch's reserve is headroom too
    return (f"first step: peak memory {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB, "
            f"{headroom / 2**30:.1f} GiB headroom ({100 * headroom / total:.0f}%)")

@dataclass
class Runtime:
    device: str  # 'cuda:0', 'mps', 'cpu'
    device_type: str
    dtype: str
    ddp: bool  # under torchrun, in a process group
    rank: int
    local_rank: int
    world_size: int
    nodes: int = 1  # the machines the ranks run on, as torchrun says (its --nnodes)
    groups: list = field(default_factory=list)  # the process groups, once FSDP made its mesh's

    @property
    def master(self):
        return self.rank == 0

    def autocast(self):
        # bf16 has fp32's range: T5, which overflows fp16, needs no loss scaling
        return torch.autocast(self.device_type, torch.bfloat16, enabled=self.dtype == "bfloat16")

    def peak_flops(self, given=0.0):
        """given if > 0, else the GPU's dense peak (PEAK_FLOPS); None on CPU, MPS, an unknown GPU"""
        if given > 0 or self.device_type != "cuda":
            return given or None
        name = torch.cuda.get_device_name(self.device).strip()
        if name not in PEAK_FLOPS:
            print0(f"'{name}' is not in runtime.PEAK_FLOPS, so no MFU is shown: pass "
                   f"--peak_flops=<its dense {self.dtype} FLOP/s from the data sheet>")
            return None
        return PEAK_FLOPS[name][DTYPES.index(self.dtype)]

# how long a collective waits for every rank: long while the run starts, where ranks may read
# weights or prepare data at their own paces; from the loop's first agreement on, NCCL's default
START_TIMEOUT = datetime.timedelta(hours=1)
TRAIN_TIMEOUT = datetime.timedelta(minutes=10)

def setup_runtime(device="auto", dtype="bfloat16", seed=1337, fsdp=False):
    """picks the device, joins torchrun's process group if there is one, seeds, sets float modes"""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise SystemExit(f"error: device '{device}' is not one this code runs on: use auto, cpu, "
                         f"cuda, cuda:N or mps")
    if dtype not in DTYPES:
        raise SystemExit(f"error: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    ddp = "RANK" in os.environ
    if fsdp and not ddp:
        raise SystemExit("error: fsdp=True shards the model over the ranks torchrun starts: launch "
                         "with torchrun --nproc_per_node=N, or leave fsdp off for one process")
    there = dict(cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available(), cpu=True)
    if device == "auto":
        device = next(name for name, available in there.items() if available)
    device_type = device.split(":")[0]
    if not there[device_type]:
        raise SystemExit(f"error: device '{device}' asked for, but torch sees no such GPU here; "
                         f"use --device=cpu")
    if device_type == "cpu" and dtype == "bfloat16":  # no native bf16 matmuls: casts, no speed
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            if not {"avx512_bf16", "amx_bf16", "bf16"} & set(f.read().split()):
                print0("this CPU has no native bf16 matmuls: running in float32 instead")
                dtype = "float32"
    if device_type != "cuda" and dtype == "tfloat32":
        print0("no TF32 off an NVIDIA GPU: running in float32 instead")
        dtype = "float32"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if ddp and device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        backend = "nccl" if device_type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=START_TIMEOUT)
    torch.manual_seed(seed)  # the same on every rank, so all replicas start equal
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dtype != "float32"
    if device_type == "cpu":
        torch.set_flush_denormal(True)  # denormals, which appear late in training, are slow on x86
    nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # set by torchrun
    groups = [torch.distributed.group.WORLD] if ddp else []
    return Runtime(device, device_type, dtype, ddp, rank(), local_rank, world_size, nodes, groups)

# the model as it trains: one process, DDP, or FSDP

def shard_model(model, rt, shard_across_nodes=False):
    """FSDP2 on the T5 in place, a group for each part that runs as one, gathered just before it
    runs: each relative_attention_bias table; each block, 2 all-gathers a step (forward, backward),
    in bf16 under bf16; the embedding, in fp32 (it starts the residual stream); the root: lm_head
    and the final norms. Gradients reduce in fp32. Over several nodes, HSDP: each node holds the
    model sharded over its ranks and the nodes are replicas, so that only the gradients' all-reduce
    crosses the network; or, shard_across_nodes, one sharding over all ranks."""
    if rt.nodes > 1 and not shard_across_nodes:  # torchtitan's dp_replicate and dp_shard
        mesh = init_device_mesh(rt.device_type, (rt.nodes, rt.world_size // rt.nodes),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    rt.groups += mesh.get_all_groups()
    set_timeout(rt, START_TIMEOUT)  # a new group has the backend's default
    param_dtype = torch.bfloat16 if rt.dtype == "bfloat16" else None  # None: fp32, as stored
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    # under bf16 a block's norms scale the fp32 residual stream by bf16 weights: torch computes that
    # in fp32, unfused, and would say so on every rank
    warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            fully_shard(module, mesh=mesh)
    for block in [*model.encoder.blocks, *model.decoder.blocks]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    for block in model.decoder.blocks:  # generate() computes the encoder's k, v outside forward()
        register_fsdp_forward_method(block, "encoder_kv")
    if not model.config.tie_word_embeddings:  # tied, shared.weight is lm_head's, in the root group
        # gathered once a step: forward looks up both the encoder's and the decoder's tokens
        fully_shard(model.shared, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "generate")
    generate = model.generate

    def generate_gathered(*args, **kwargs):
        """generate() with each decoder block gathered once for the call, not at every decoding
        step, and resharded after it; every rank decodes until all ranks' rows are finished"""
        for block in model.decoder.blocks:
            block.set_reshard_after_forward(False)
        try:
            return generate(*args, all_done=all_ranks, **kwargs)
        finally:
            for block in model.decoder.blocks:
                block.set_reshard_after_forward(True)
                block.reshard()
    model.generate = generate_gathered

def all_ranks(done):  # whether done, a 0-d bool tensor, is true on every rank
    done = done.to(torch.int32)
    torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
    return bool(done)

def apply_activation_checkpointing(model):
    """activation checkpointing, on each block: in training it keeps only its inputs for backward,
    which runs the block again. Applied before compiling: the compiler sees that run too."""
    for block in [*model.encoder.blocks, *model.decoder.blocks]:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

def wrap_model(model, rt, fsdp=False, compile=False, activation_checkpointing=False,
               shard_across_nodes=False, dynamic=None):
    """The T5 built on the meta device, placed for training, its weights still to be made. With FSDP
    each rank materialises only its own shards, and each block is compiled, as torchtitan does;
    without, the model is whole on the device, compiled, in DDP under torchrun. Returns what the
    loop calls: the T5 itself (FSDP shards it in place), or its compiled or DDP wrapper."""
    if activation_checkpointing:  # then compile, then shard: torchtitan's order
        apply_activation_checkpointing(model)
    if fsdp:
        if compile:
            for block in [*model.encoder.blocks, *model.decoder.blocks]:
                block.compile(dynamic=dynamic)
        shard_model(model, rt, shard_across_nodes)
        return model.to_empty(device=rt.device)
    model.to_empty(device=rt.device)
    model.tie_weights()  # to_empty made lm_head a tensor of its own
    if compile:
        model = torch.compile(model, dynamic=dynamic)
    if rt.ddp:  # no broadcast of the empty weights: every rank draws or loads the same ones
        device_ids = [rt.local_rank] if rt.device_type == "cuda" else None
        model = DDP(model, device_ids=device_ids, init_sync=False)
    return model

def sync_gradients(model, now):
    """whether backward all-reduces the gradients over the replicas (DDP's ranks, HSDP's nodes):
    after a step's last micro-step only. FSDP reduce-scatters them at each, kept sharded."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = now
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(now)

@torch.no_grad()
def draw_weights(model):
    """The weights T5(config) draws, into a placed model, each tensor drawn whole on the device in
    the same order: the same on any number of ranks as in one process on that kind of device. Under
    FSDP each rank keeps its own slice, and holds one tensor whole at a time."""
    for name, p in model.named_parameters():
        whole = torch.empty(p.shape, device=p.device)  # no whole tensor crosses from the host
        model.init_parameter(name, whole)
        set_values(p, whole)

@torch.no_grad()
def set_values(p, whole):
    """p, a placed parameter, gets the values of whole, a tensor of its shape on any device: under
    FSDP, only this rank's slice, which it cuts itself (src_data_rank=None: no rank sends)"""
    if isinstance(p, DTensor):
        whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p = p.to_local()
    p.copy_(whole)

def clip_grad_norm(model, max_norm):
    """the gradients' total norm, clipped to max_norm (0: not clipped); under FSDP the norm of every
    rank's slices together, reduced once, as torchtitan does"""
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()  # the one all-reduce
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm or float("inf"), grad_norm)
    return grad_norm

def print_memory(model, optimizer, rt):
    """after the first step: what rank 0 holds of the weights and optimizer state; a GPU's peak"""
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    state_bytes = sum(local(t).nbytes for t in [*model.parameters(), *states])
    print0(f"parameters + optimizer state: {state_bytes / 2**20:.2f} MiB on rank 0")
    if rt.device_type == "cuda":
        print0(memory_report(rt.device))

# what AdamWScale needs of FSDP's slices

def local(t):
    """this rank's slice of a DTensor (an FSDP shard), a plain tensor sharing its memory; else t"""
    return t.to_local() if isinstance(t, DTensor) else t

def rms(tensors):
    """each tensor's root mean square, as 0-d tensors; of FSDP's DTensors, the whole tensor's: the
    squares of each rank's slices, summed over the ranks that shard them (under HSDP, a node's), in
    one all-reduce for all the tensors"""
    norms = [local(t).norm() for t in tensors]
    if tensors and isinstance(tensors[0], DTensor):
        squares = torch.stack([norm.square() for norm in norms])
        mesh = tensors[0].device_mesh
        torch.distributed.all_reduce(squares, group=mesh.get_group(mesh.ndim - 1))  # the last: shards
        norms = squares.sqrt().unbind()
    return [norm / math.sqrt(t.numel()) for norm, t in zip(norms, tensors)]

# where the ranks agree

def set_timeout(rt, timeout):  # on every process group
    for group in rt.groups:
        group.set_timeout(timeout)

def all_gathered(value):  # every rank's value (any picklable object), in rank order
    values = [value]
    if torch.distributed.is_initialized():
        values = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(values, value)
    return values

def agree(rt, *values):
    """The sums over the ranks of values (numbers, or 0-d tensors on the device), as floats, in one
    all-reduce: the host's one wait for the device. From then on, collectives wait TRAIN_TIMEOUT."""
    device = rt.device if rt.ddp else "cpu"  # the backend's; and MPS has no float64
    summed = torch.stack([torch.as_tensor(v).to(device, torch.float64) for v in values])
    if rt.ddp:
        torch.distributed.all_reduce(summed)
        set_timeout(rt, TRAIN_TIMEOUT)
    return summed.tolist()

class Signals:
    """SIGINT (Ctrl-C) and SIGTERM (a preemption) while the loop runs: the run saves and stops at
    the same step on every rank, within 3 steps. Each step sums the ranks' flags; stop_now reads
    step N's sum at step N + 2, long copied to the host, which so never waits for the GPU. Before the
    first step is done (it compiles), there is nothing to save: the run ends at once, where
    torch.compile's first call would swallow a KeyboardInterrupt. Either way the process exits
    128 + the signal's number, as one the signal killed: `train.py && export.py` stops there."""

    def __init__(self, rt):
        self.rt = rt
        self.caught = 0  # the signal's number, once one came
        self.step = None  # the last step done; None until the first is
        self.sums = []  # each step's sum of the ranks' flags, copied to the host, and its event
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.catch)

    def catch(self, signum, frame):
        name = signal.Signals(signum).name
        if self.step is None:
            os.write(2, f"{name} before the first step: nothing to save\n".encode())
            os._exit(128 + signum)
        if not self.caught and self.rt.master:
            when = "within 3 steps, on every rank" if self.rt.ddp else "after this step"
            os.write(2, f"{name} after step {self.step}: the run saves and stops {when}\n".encode())
        self.caught = signum

    def stop_now(self, step):
        """after every step: whether to save and stop here, the same on every rank"""
        self.step = step
        if not self.rt.ddp:
            return self.caught > 0
        flag = torch.full((1,), float(self.caught), device=self.rt.device)
        torch.distributed.all_reduce(flag)  # under NCCL the GPU's stream waits for it, not the host
        on_host = flag.to("cpu", non_blocking=True)  # a GPU copies it when it gets there
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

    def release(self):  # after the loop: a signal stops the program at once again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

# the log

class Logger:
    """One JSON object per event in out_dir/log.jsonl (rank 0). A new run's first says who it is
    (identity: its program and config), so that --init_from=auto knows a start that stopped before
    its first checkpoint as its own. A resume first drops what was logged after its checkpoint, and
    a last line a kill cut short. With start_wandb, each record's numbers go to wandb too."""

    def __init__(self, out_dir, master=True, resume_step=None, identity=None):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "log.jsonl") if master else None
        self.resume_step = resume_step
        self.wandb_run = None
        if master and resume_step is None:
            with atomic_write(self.path, "w") as f:
                f.write(json.dumps(dict(identity, step=0)) + "\n")
        if master and resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                lines = [line for line in f if line.endswith("\n")]
            kept = [line for line in lines if json.loads(line)["step"] <= resume_step]
            with atomic_write(self.path, "w") as f:
                f.writelines(kept)

    def start_wandb(self, project, name, config, run_id=None):
        """Rank 0's wandb run, its files in out_dir/wandb: a new one, named name or else out_dir's
        folder; or a resume's, run_id's, rewound to the checkpoint's step, from which it logs again
        (wandb ignores a step below its run's last). Returns its id, for the checkpoints to keep."""
        if self.path is None:
            return run_id
        import wandb  # only when asked for
        name = name or os.path.basename(os.path.abspath(self.out_dir))
        rewind = dict(resume_from=f"{run_id}?_step={self.resume_step}") if run_id else {}
        self.wandb_run = wandb.init(project=project, name=name, config=config, dir=self.out_dir,
                                    **rewind)
        return self.wandb_run.id

    def log(self, record):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run:  # the numbers: not an evaluation's example texts, nor a missing MFU
            numbers = {key: value for key, value in record.items()
                       if isinstance(value, (int, float)) and key != "step"}
            self.wandb_run.log(numbers, step=record["step"])

def wandb_rule(wandb_log):
    """wandb_log's config rule: wandb installed, and logged in unless offline"""
    if not wandb_log:
        return "wandb_log", True, ""
    if not importlib.util.find_spec("wandb"):
        return "wandb_log", False, "False without wandb: pip install wandb"
    import wandb
    offline = os.environ.get("WANDB_MODE") in ("offline", "disabled")
    return ("wandb_log", offline or wandb.login(prompt=False, verify=False),
            "False without a wandb login: run `wandb login`, or set WANDB_MODE=offline")
