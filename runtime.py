"""What a run needs around the model: the device and its float modes, DDP and FSDP, MFU, the log,
and Sync, where the ranks agree."""
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import re
import signal
import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from files import UserError, atomic_write, reading, write_error

# device, dtype, DDP and MFU

def rank():
    return int(os.environ.get("RANK", 0))  # set by torchrun

def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs)

DTYPES = ("float32", "tfloat32", "bfloat16")

# dense peak FLOP/s (float32, tfloat32, bfloat16) from NVIDIA's data sheets, by get_device_name
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100-SXM4-80GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100-PCIE-40GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100 80GB PCIe": (19.5e12, 156e12, 312e12),
    "NVIDIA H100 80GB HBM3": (67e12, 494.5e12, 989.5e12),  # SXM
    "NVIDIA H100 PCIe": (51e12, 378e12, 756.5e12),
    "NVIDIA H100 NVL": (60e12, 417.5e12, 835.5e12),
    "NVIDIA H200": (67e12, 494.5e12, 989.5e12),  # SXM
    "NVIDIA H200 NVL": (60e12, 417.5e12, 835.5e12),
    "NVIDIA B200": (75e12, 1.1e15, 2.25e15),
    "NVIDIA L4": (30.3e12, 60e12, 121e12),
    "NVIDIA L40": (90.5e12, 90.5e12, 181e12),
    "NVIDIA L40S": (91.6e12, 183e12, 362e12),
    "NVIDIA GeForce RTX 3090": (35.6e12, 35.6e12, 71e12),
    "NVIDIA GeForce RTX 4090": (82.6e12, 82.6e12, 165.2e12),
}

def flops_per_step(model, batch_size, input_length, target_length):
    """Training FLOPs of one step, for MFU: 6 per weight per token it sees (2 forward, 4 backward):
    S input tokens for the encoder and cross-attention's k, v, T targets for the rest and the lm_head;
    plus attention's matmuls."""
    c, S, T = model.config, input_length, target_length
    n_enc = sum(p.numel() for p in model.encoder.parameters())
    n_cross_kv = sum(2 * b.cross_attn.k.weight.numel() for b in model.decoder.blocks)
    n_dec = sum(p.numel() for p in model.decoder.parameters()) - n_cross_kv
    flops = 6 * (n_enc * S + n_dec * T + n_cross_kv * S + c.d_model * c.vocab_size * T)
    flops += 12 * c.num_heads * c.d_kv * (c.num_layers * S * S + c.num_decoder_layers * (T * T + T * S))
    return batch_size * flops

def mfu(flops_per_step, seconds_per_step, world_size, peak_flops):
    return flops_per_step / world_size / seconds_per_step / peak_flops if peak_flops else None

def memory_report(device):
    """after the first step on a GPU: its peak memory and headroom, to judge batch_size by"""
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    headroom = free + torch.cuda.memory_reserved(device) - peak  # what PyTorch reserved is headroom too
    return (f"first step: peak memory {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB, "
            f"{headroom / 2**30:.1f} GiB headroom ({100 * headroom / total:.0f}%)")

@dataclass
class Runtime:
    device: str  # 'cuda:0', 'mps', 'cpu'
    device_type: str
    dtype: str
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    nodes: int = 1  # the machines the ranks run on, as torchrun says (its --nnodes)

    @property
    def master(self):
        return self.rank == 0

    def autocast(self):
        # bf16 has fp32's range: T5, which overflows fp16, needs no loss scaling
        if self.dtype == "bfloat16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def peak_flops(self, given=0.0):
        """given if > 0, else the GPU's dense peak from PEAK_FLOPS; None on CPU, MPS, an unknown GPU"""
        if given > 0 or self.device_type != "cuda":
            return given or None
        name = torch.cuda.get_device_name(self.device).strip()
        if name not in PEAK_FLOPS:
            print0(f"'{name}' is not in runtime.PEAK_FLOPS, so no MFU is shown: pass --peak_flops=<its dense "
                   f"{self.dtype} FLOP/s from the data sheet> to see it")
            return None
        return PEAK_FLOPS[name][DTYPES.index(self.dtype)]

def require(package, purpose):
    """an optional package that purpose needs: there, or one line saying how to install it"""
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{purpose} needs the {package} package, which is not installed: pip install {package}")

def check_device(name):
    """configurator.py's rule for `device`"""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        raise UserError(f"device '{name}' is not one this code runs on: use auto, cpu, cuda, cuda:N or mps")
    there = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not there.get(name.split(":")[0], True):
        raise UserError(f"device '{name}' asked for, but torch sees no such GPU here; use --device=cpu")

# how long a collective waits for every rank: long while the run starts, where ranks may read weights or
# prepare data at different paces; then NCCL's default (which HSDP's mesh groups get), so that a hung
# rank stops the run sooner
START_TIMEOUT = datetime.timedelta(hours=1)
TRAIN_TIMEOUT = datetime.timedelta(minutes=10)

def setup_runtime(device="auto", dtype="bfloat16", seed=1337, fsdp=False):
    """picks the device, joins torchrun's process group if there is one, seeds, sets the float modes"""
    ddp = "RANK" in os.environ
    if fsdp and not ddp:
        raise UserError("fsdp=True shards the model over the ranks torchrun starts: launch with "
                        "torchrun --nproc_per_node=N, or leave fsdp off for one process")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device_type = device.split(":")[0]
    if device_type == "cpu" and dtype == "bfloat16":  # no native bf16 matmuls: autocast only adds casts
        cpuinfo = ""
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
        if not {"avx512_bf16", "amx_bf16", "bf16"} & set(cpuinfo.split()):
            print0("this CPU has no native bf16 matmuls: running in float32 instead")
            dtype = "float32"
    if device_type != "cuda" and dtype == "tfloat32":
        print0("no TF32 off an NVIDIA GPU: running in float32 instead")
        dtype = "float32"
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
    return Runtime(device, device_type, dtype, ddp, rank(), local_rank, world_size, nodes)

# the model as it trains: one process, DDP, or FSDP

def shard_model(model, rt, shard_across_nodes=False):
    """FSDP2 on the T5 in place, one group for each part that runs as one, gathered just before it runs:
    each relative_attention_bias table (read before the blocks run); each block, cross-attention's k, v
    included, 2 all-gathers a step (forward, backward); the embedding, in fp32 as its output starts the
    residual stream; and the root: lm_head and the final norms. Under bf16 all but the first and the
    embedding gather in bf16; gradient reductions stay fp32. generate() runs through FSDP's hooks too.
    Over several nodes, HSDP: each node holds the model sharded over its ranks, and the nodes are
    replicas, so that only the gradients' all-reduce crosses the network; or, shard_across_nodes,
    one sharding over all ranks."""
    if rt.nodes > 1 and not shard_across_nodes:  # torchtitan's dp_replicate and dp_shard
        mesh = init_device_mesh(rt.device_type, (rt.nodes, rt.world_size // rt.nodes),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    policy = MixedPrecisionPolicy()
    if rt.dtype == "bfloat16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
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

def all_ranks(done):
    """whether done, a 0-d bool tensor, is true on every rank"""
    done = done.to(torch.int32)
    torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
    return bool(done)

def apply_activation_checkpointing(model):
    """activation checkpointing, on each block: in training it keeps only its inputs for backward,
    which runs the block again to get the rest. Applied before compiling, so the compiler sees the
    block run again too."""
    for block in [*model.encoder.blocks, *model.decoder.blocks]:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

def wrap_model(model, rt, fsdp=False, compile=False, activation_checkpointing=False,
               shard_across_nodes=False, dynamic=None):
    """The T5 built on the meta device, placed for training, its weights still to be made
    (draw_weights, checkpoint.load_weights). With FSDP each rank materialises only its own shards,
    and each block is compiled, as torchtitan does, FSDP's hooks between the graphs; without, the
    model is whole on the device, compiled, in DDP under torchrun. Returns what the loop calls: the
    T5 itself (FSDP shards it in place), or its compiled or DDP wrapper."""
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

@torch.no_grad()
def draw_weights(model):
    """The weights T5(config) draws, into a placed model: each tensor drawn whole on the device, from
    the same seed and in the same order: the same weights on any number of ranks as in one process on
    that kind of device (a GPU's generator draws other numbers than a CPU's). Under FSDP each rank
    keeps its own slice, and holds one tensor whole at a time."""
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

def print_memory(model, optimizer, rt):
    """after the first step: what rank 0 holds of the weights and optimizer state; a GPU's peak"""
    tensors = [*model.parameters(),
               *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    state_bytes = sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)
    print0(f"parameters + optimizer state: {state_bytes / 2**20:.2f} MiB on rank 0")
    if rt.device_type == "cuda":
        print0(memory_report(rt.device))

# the loop's log and its agreement

def check_wandb(wandb_log):
    """configurator.py's rule for wandb_log"""
    if wandb_log:
        require("wandb", "--wandb_log=True")

class Logger:
    """One JSON object per event in out_dir/log.jsonl (rank 0), and to wandb if the run's config
    says wandb_log. A resume first drops what was logged after its checkpoint; a damaged line stops
    it, but for the last, which a kill may cut."""

    def __init__(self, out_dir, master=True, resume_step=None, config=None):
        self.path = os.path.join(out_dir, "log.jsonl") if master else None
        self.wandb = None
        if master and resume_step is not None and os.path.exists(self.path):
            kept = []
            with reading(self.path), open(self.path) as f:
                for number, line in enumerate(f, 1):
                    damaged = f"line {number} of {{path}} is damaged ({{reason}}): delete that line"
                    with reading(self.path, damaged):
                        if line.endswith("\n") and json.loads(line).get("step", 0) <= resume_step:
                            kept.append(line)
            with atomic_write(self.path, "w") as f:
                f.writelines(kept)
        if master and config and config["wandb_log"]:
            import wandb
            self.wandb = wandb.init(project=config["wandb_project"], name=config["wandb_run_name"],
                                    config=config)

    def log(self, record):
        if self.path is None:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise write_error(self.path, e) from None
        if self.wandb is not None:
            self.wandb.log(record, step=record.get("step"))

class Sync:
    """Where the ranks agree, at the loop's sync steps, in one all-reduce: the loss averaged over
    the ranks, whether a loss or grad norm since the last sync was NaN or inf (watch), whether
    SIGINT or SIGTERM came to any rank, and rank 0's clock (training seconds over resumes, less time
    in paused()). In between, the host waits for neither the device nor another rank; a signal's
    flag alone is summed at every step, and read two steps later (stop_now). From the first
    agreement on, the run has started: a collective waits TRAIN_TIMEOUT, not START_TIMEOUT."""

    def __init__(self, rt, ckpt_path, step, elapsed=0.0):
        self.rt = rt
        self.ckpt_path = ckpt_path
        self.step = step  # the last sync step, and what was agreed there
        self.elapsed = elapsed
        self.mark = time.time()  # this rank's own since then
        self.paused_s = 0.0
        self.nonfinite = 0
        self.signalled = False
        self.stopped_by_signal = False
        self.done = step  # the steps done
        self.flags = []  # each step's sum of the ranks' signal flags, on the host, with its event
        self.handlers = {s: signal.signal(s, self.stop_soon) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop_soon(self, signum, frame):
        """SIGINT or SIGTERM: noted, and said at once, even mid-step (while it compiles, say)"""
        if not self.signalled and self.rt.master:
            when = "within 3 steps, at the same step on every rank" if self.rt.ddp else "after this step"
            os.write(2, f"{signal.Signals(signum).name} after step {self.done}: the run saves a checkpoint "
                        f"and stops {when}\n".encode())
        self.signalled = True

    def stop_now(self, step):
        """After every step: whether to stop here for a signal, the same on every rank. One process
        stops at once. Ranks sum their flags at every step, and act on step N's sum at step N + 2:
        by then a GPU has long copied it to the host, which so never waits for the device, and every
        rank stops at the same step, within 3 of the signal."""
        self.done = step
        if not self.rt.ddp:
            return self.signalled
        flag = torch.full((1,), float(self.signalled), device=self.rt.device)
        torch.distributed.all_reduce(flag)  # under NCCL the GPU's stream waits for it, not the host
        on_host = flag.to("cpu", non_blocking=True)  # a GPU copies it when it gets there
        copied = torch.cuda.Event() if flag.is_cuda else None
        if copied:
            copied.record()
        self.flags.append((on_host, copied))
        if len(self.flags) < 3:
            return False
        on_host, copied = self.flags.pop(0)
        if copied:
            copied.synchronize()  # long done: two steps ago
        return on_host.item() > 0

    @contextlib.contextmanager
    def paused(self):
        t0 = time.time()
        yield
        self.paused_s += time.time() - t0

    def watch(self, loss, grad_norm):
        """after every step: counts, without waiting for the device, a NaN or inf loss or grad norm"""
        self.nonfinite = self.nonfinite + ~(torch.isfinite(loss) & torch.isfinite(grad_norm))

    def agree(self, step, loss):
        """At a sync step: (the mean loss, the training seconds, whether a signal came), the same on
        every rank. A NaN or inf since the last sync ends the run before it could save."""
        now = time.time()
        elapsed = self.elapsed + now - self.mark - self.paused_s  # rank 0's is the one used
        self.mark, self.paused_s = now, 0.0
        device = loss.device if self.rt.ddp else "cpu"  # the backend's device; and MPS has no float64
        from_device = torch.stack([self.nonfinite.float(), loss.float() / self.rt.world_size])
        from_host = torch.tensor([self.signalled, elapsed * self.rt.master], dtype=torch.float64)
        shared = torch.cat([from_device.to(device).double(), from_host.to(device)])
        if self.rt.ddp:
            torch.distributed.all_reduce(shared)  # a sum: any rank's flags, rank 0's clock, the mean
            torch.distributed.group.WORLD.set_timeout(TRAIN_TIMEOUT)  # the run has started
        nonfinite, mean_loss, signalled, elapsed = shared.tolist()  # the one wait for the device
        if nonfinite:
            kept = "no checkpoint was written yet; start again"
            if os.path.exists(self.ckpt_path):
                kept = f"{self.ckpt_path} (the last good checkpoint) is untouched; resume from it"
            raise UserError(f"the loss or grad norm became NaN or inf between steps {self.step + 1} and {step}: "
                            f"training diverged; {kept} with a lower lr or grad_clip")
        self.nonfinite = 0
        self.step, self.elapsed = step, elapsed
        self.stopped_by_signal = bool(signalled)
        if signalled:
            print0(self.stop_line())
        return mean_loss, elapsed, self.stopped_by_signal

    def stop_line(self):
        return f"stopped by signal at step {self.step}: continue with --init_from=resume"

    def release(self):
        """After the loop: SIGINT and SIGTERM stop the program at once again; a run a signal stopped,
        its checkpoint saved, says so last (under torchrun, after torchrun's report)"""
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        if self.stopped_by_signal:
            import errors  # here, not at the top: importing it sets the scripts' hooks
            errors.say_last(self.stop_line())
