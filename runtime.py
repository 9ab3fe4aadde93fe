"""
The runtime that train.py, finetune.py, bench.py and prepare.py share, one copy of each piece: files written
atomically, print0, the device/dtype/DDP set-up and the GPUs' peak FLOP/s, the model's DDP or FSDP wrapping, the log,
stop signals, the claim on a run's out_dir and the resume check, and the checkpoint files (one file, or a directory of
shards) with the one save-and-stop pattern of the training loops. The optimizers are in optim.py, the model in
model.py.
"""
import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

# the one error class for bad input (configurator.py prints it as one `error:` line). model.py owns it, so that
# model.py can be copied alone; the other scripts import it from here.
from model import UserError  # noqa: F401


# -----------------------------------------------------------------------------------------------------------------
# writing files atomically

# errors that only writing can meet: disk or quota full, file too large, read-only file system
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def write_error(path, e):
    """The one-line error for an OSError met while writing path; atomic writes leave any previous path as it was."""
    kept = f"; the previous {os.path.basename(path)} is unchanged" if os.path.exists(path) else ""
    return UserError(f"could not write {path}: {e.strerror}{kept}")


def discard(f):
    """Close and delete an unfinished temporary file. Closing flushes, which may fail again as the write did."""
    with contextlib.suppress(OSError):
        f.close()
    with contextlib.suppress(FileNotFoundError):
        os.remove(f.name)


def commit(f, path):
    """Finish a file written under a temporary name: flush it to disk, then rename it to path in one step."""
    try:
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(f.name, path)
    except OSError as e:
        discard(f)
        raise write_error(path, e) from None


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write to path.tmp and rename it to path once complete: a crash or Ctrl-C mid-write leaves the previous file
    intact, never a truncated one under the final name. Failing to write (no such folder, no permission, disk full)
    is one UserError naming path."""
    try:
        f = open(path + ".tmp", mode)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        yield f
    except BaseException as e:
        discard(f)
        # another OSError is the caller's own, e.g. from reading an input inside the block, and keeps its message
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            raise write_error(path, e) from None
        raise
    commit(f, path)


# -----------------------------------------------------------------------------------------------------------------
# device, dtype and DDP

def print0(*args, **kwargs):
    """print on rank 0 only, so that 8 GPUs don't print 8 copies of every line"""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs)


DTYPES = ("float32", "tfloat32", "bfloat16")

# Dense peak FLOP/s (no 2:4 sparsity) for (float32, tfloat32, bfloat16), keyed by the exact name that
# torch.cuda.get_device_name prints: MFU divides by these. From NVIDIA's data sheets, whose tensor-core figures for
# the data-center parts carry the footnote "with sparsity", so those are halved here: A100 (40/80 GB, SXM and PCIe
# alike), H100 (SXM, PCIe and NVL columns), H200 (SXM and NVL), L4, L40, L40S, HGX B200 (per GPU). The GeForce cards
# come from NVIDIA's Ampere GA102 and Ada AD102 architecture whitepapers (bf16 with fp32 accumulation, which is what
# autocast runs). No entry for the A10G: NVIDIA publishes no data sheet for it, and third parties disagree by ~2x.
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


def gpu_peak_flops(name, dtype):
    """the dense peak FLOP/s at dtype of the GPU torch.cuda.get_device_name calls `name`, or None for a GPU not in
    PEAK_FLOPS: a near miss (an L40S is not an L4) would make MFU wrong by a factor, so only exact names match"""
    peaks = PEAK_FLOPS.get(name.strip())
    return peaks[DTYPES.index(dtype)] if peaks else None


def flops_per_step(model, batch_size, input_length, target_length):
    """Training FLOPs (forward + backward) of one step over batch_size examples, for MFU. A matmul costs 6 FLOPs per
    weight per token it sees (2 forward, 4 backward):
      6 * N_encoder * S                   encoder weights (not the embedding, a lookup) over S input tokens
    + 6 * (N_decoder - N_cross_kv) * T    decoder weights over T target tokens ...
    + 6 * N_cross_kv * S                  ... except cross-attention k/v, which project the S encoder outputs
    + 6 * d_model * vocab * T             lm_head (counted even when tied: a matmul, not a lookup)
    + 12 * nh * d_kv * (L_enc * S*S + L_dec * (T*T + T*S))   attention scores and weighted sums: 2 matmuls of
                                          2*Tq*Tk*nh*d_kv FLOPs, x3 for the backward (causal masks not discounted)"""
    c, S, T = model.config, input_length, target_length
    n_enc = sum(p.numel() for p in model.encoder.parameters())
    n_cross_kv = sum(2 * b.cross_attn.k.weight.numel() for b in model.decoder.blocks)
    n_dec = sum(p.numel() for p in model.decoder.parameters()) - n_cross_kv
    flops = 6 * (n_enc * S + n_dec * T + n_cross_kv * S + c.d_model * c.vocab_size * T)
    flops += 12 * c.num_heads * c.d_kv * (c.num_layers * S * S + c.num_decoder_layers * (T * T + T * S))
    return batch_size * flops


def mfu(flops_per_step, seconds_per_step, world_size, peak_flops):
    """model FLOP utilisation of each GPU: flops_per_step counts the whole global batch, which world_size GPUs share,
    against one GPU's peak; None when the peak is unknown"""
    if not peak_flops:
        return None
    return flops_per_step / world_size / seconds_per_step / peak_flops


def memory_report(device):
    """one line, after the first training step on a GPU: the step's peak memory and how much more a step could take,
    so that a user sees at once whether batch_size / grad_accum_steps leave room or are near the edge"""
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # memory PyTorch has reserved but not in use at the peak is headroom too: its allocator hands it out first
    headroom = free + torch.cuda.memory_reserved(device) - peak
    return (f"first step: peak memory {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB, {headroom / 2**30:.1f} GiB "
            f"headroom ({100 * headroom / total:.0f}%)")


def micro_batch_size(batch_size, grad_accum_steps, world_size):
    """examples per forward pass on one rank: the global batch splits over micro-steps and ranks"""
    size, leftover = divmod(batch_size, grad_accum_steps * world_size)
    if leftover or not size:
        raise UserError(f"batch_size={batch_size} must split evenly into grad_accum_steps={grad_accum_steps} x "
                        f"{world_size} ranks; change batch_size or grad_accum_steps")
    return size


def cpu_has_native_bf16():
    """Whether this CPU multiplies bf16 matrices natively (x86 AVX512-BF16 or AMX, Arm's BF16 extension), read from
    the flags Linux lists in /proc/cpuinfo; False where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


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
        return micro_batch_size(batch_size, grad_accum_steps, self.world_size)

    def peak_flops(self, given=0.0):
        """given if > 0 (a --peak_flops config key), else the GPU's dense peak FLOP/s at this dtype from PEAK_FLOPS;
        None on CPU and MPS, and on a GPU not in the table, which gets a hint to pass the figure"""
        if given > 0:
            return given
        if self.device_type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        peak = gpu_peak_flops(name, self.dtype)
        if peak is None:
            print0(f"'{name}' is not in runtime.PEAK_FLOPS, so no MFU is shown: pass --peak_flops=<its dense "
                   f"{self.dtype} FLOP/s from the data sheet> to see it")
        return peak


def check_device(name):
    """'auto', or a device of a kind this code runs on, spelled as torch spells it: cpu, cuda, cuda:1, mps"""
    try:
        known = name == "auto" or torch.device(name).type in ("cpu", "cuda", "mps")
    except RuntimeError:  # "Invalid device string", "Expected one of cpu, cuda, ..."
        known = False
    if not known:
        raise UserError(f"device '{name}' is not one this code runs on: use auto, cpu, cuda, cuda:N or mps")


def setup_runtime(device="auto", dtype="bfloat16", seed=1337):
    """Pick the device, join the torchrun process group if there is one, seed, and set the float modes."""
    if dtype not in DTYPES:
        raise UserError(f"dtype '{dtype}' is not supported; use bfloat16, tfloat32 or float32")
    check_device(device)
    ddp = "RANK" in os.environ  # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device_type = device.split(":")[0]
    if device_type == "cpu" and dtype == "bfloat16" and not cpu_has_native_bf16():
        # without native bf16 matmuls (AVX512-BF16, AMX) autocast would only add casts; with them it is ~1.7x faster
        print0("this CPU has no native bf16 matmuls: running in float32 instead")
        dtype = "float32"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device '{device}' asked for, but torch sees no CUDA GPU; use --device=cpu")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device '{device}' asked for, but torch sees no Apple GPU; use --device=cpu")
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


# -----------------------------------------------------------------------------------------------------------------
# the model as it trains: one process, DDP, or FSDP

def shard_model(model, rt):
    """
    FSDP2 on the T5 in place: each rank keeps a 1/world_size slice (along dim 0) of every weight, its gradient and
    its optimizer state, and a group of weights is all-gathered just before the module that uses it runs and freed
    after, so that only one block is ever whole. Each encoder block is one group, each decoder block one group, and
    the whole model is the group of what is left (embedding, lm_head, final norms), whole from the forward pass to
    the end of the backward. The groups follow model.py's data flow, which reads weights outside the module that owns
    them in two places, where FSDP could not gather them in time:
      - a stack turns its first layer's relative-attention table into the position bias of every layer before that
        layer runs: the two tables are groups of their own, gathered when the stack calls them;
      - T5.forward projects the encoder output into every layer's cross-attention keys and values at once
        (Decoder.encoder_kv, one matmul over all layers' k and v weights) before the first decoder block runs: those
        k and v weights stay in the whole model's group (for xxl 0.8B parameters, 3.2 GB in fp32 on every rank
        during the step; projecting inside each block would let them be sharded like the rest).
    Under bf16 the blocks are gathered in bf16, the dtype autocast casts their weights to for the matmuls anyway
    (half the all-gather traffic and memory); weights, gradient reductions and optimizer state stay fp32. Autocast
    still runs the forward: model.py's RMSNorm returns fp32, which a bf16 matmul would refuse without it. The
    embedding and the rest of the whole model's group stay fp32, so the residual stream is fp32 as under DDP.
    """
    mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    blocks_policy = MixedPrecisionPolicy()
    if rt.dtype == "bfloat16":
        # cast_forward_inputs=False: a block's input is the fp32 residual stream, which must stay fp32
        blocks_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                             cast_forward_inputs=False)
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            fully_shard(module, mesh=mesh)
    for block in model.encoder.blocks:
        fully_shard(block, mesh=mesh, mp_policy=blocks_policy)
    for block in model.decoder.blocks:
        # one group of the block's modules, without the cross-attention k and v (see above)
        modules = [m for name, m in block.named_children() if name != "cross_attn"]
        fully_shard(modules + [block.cross_attn.q, block.cross_attn.o], mesh=mesh, mp_policy=blocks_policy)
    fully_shard(model, mesh=mesh)


def check_fsdp(fsdp):
    """configurator.py's rule for the fsdp key: sharding needs the ranks torchrun starts"""
    if fsdp and "RANK" not in os.environ:
        raise UserError("fsdp=True shards the model over the ranks torchrun starts: launch with "
                        "torchrun --nproc_per_node=N, or leave fsdp off for one process")


def wrap_model(model, rt, fsdp=False, compile=False, dynamic=None):
    """
    The model as the training loop calls it: moved to the device, FSDP-sharded (fsdp=True, under torchrun),
    compiled (dynamic is torch.compile's), and wrapped in DDP when torchrun started several ranks without fsdp.
    Parameters are not the same objects after sharding: make the optimizer from raw_model(the result).
    """
    if fsdp:
        shard_model(model, rt)  # built on the host, each rank moves only its own slices to the device
    else:
        model.to(rt.device)
    if compile:
        model = torch.compile(model, dynamic=dynamic)
    if rt.ddp and not fsdp:
        model = DDP(model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None)
    return model


def set_gradient_sync(model, sync):
    """Whether the next backward pass all-reduces (DDP) or reduce-scatters (FSDP) the gradients: off on all but the
    last micro-step of gradient accumulation, so that a step communicates once (nanoGPT's trick)"""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = sync
    elif isinstance(raw_model(model), FSDPModule):
        raw_model(model).set_requires_gradient_sync(sync)


def local_bytes(tensors):
    """the bytes of these tensors held by this rank: of a DTensor (an FSDP-sharded tensor), only this rank's slice"""
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


def state_bytes(model, optimizer):
    """bytes of parameters and optimizer state on this rank, the memory that FSDP divides by the number of ranks"""
    optimizer_state = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return local_bytes(raw_model(model).parameters()) + local_bytes(optimizer_state)


def unsharded_copy(model):
    """A plain copy of the whole FSDP-sharded T5 on every rank, for generate(), which reads weights outside the
    forward calls where FSDP gathers them. Inference holds 2-4 bytes per parameter, not training's 16, so the whole
    model fits where its training did not."""
    from model import T5
    t5 = raw_model(model)
    state = {name: t.full_tensor() for name, t in t5.state_dict().items()}
    with torch.device("meta"):  # no weights made only to be overwritten
        copy = T5(t5.config)
    copy.load_state_dict(state, assign=True)
    return copy.train(t5.training)


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
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise write_error(self.path, e) from None
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


# -----------------------------------------------------------------------------------------------------------------
# the run's folder: one run at a time, never over another run's checkpoint, and a resume continues its own run

def claim_out_dir(out_dir, rt, fresh):
    """
    Called before a run does any work: it stops with one line rather than lose or mix anyone's files.
    - fresh=True (a run that starts a new checkpoint): refuses an out_dir holding one, which the run would replace;
      forgetting --init_from=resume must not cost the run it meant to continue.
    - out_dir must be writable, and no other run may be writing it: the run holds an exclusive flock on out_dir/lock
      (the file keeps the holder's pid) until its process ends. The OS releases a flock however the process dies, so
      a crashed run never blocks the next, and no stale lock needs deleting.
    Rank 0 decides and every rank raises the same error. fresh=False with no out_dir yet (a resume that will not
    find its checkpoint, an evaluation) creates nothing. Returns the open lock file, or None: keep it while the run
    lasts.
    """
    problem = lock = None
    if rt.master:
        problem, lock = _claim(out_dir, fresh)
    if rt.ddp:
        problem = [problem]
        torch.distributed.broadcast_object_list(problem, src=0)
        problem = problem[0]
    if problem:
        raise UserError(problem)
    return lock


def _claim(out_dir, fresh):
    # a checkpoint of either form: one file, or (FSDP) a directory of shards, or what a kill mid-commit_dir left of it
    found = [p for p in ("ckpt.pt", "ckpt", "ckpt.old") if os.path.exists(os.path.join(out_dir, p))]
    if fresh and found:
        return (f"{os.path.join(out_dir, found[0])} exists and this run would replace it: pass --init_from=resume to "
                f"continue that run, or another --out_dir to start a new one"), None
    if not fresh and not os.path.isdir(out_dir):
        return None, None
    path = os.path.join(out_dir, "lock")
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(path, "a+")
    except OSError as e:
        return f"can't write to out_dir {out_dir}: {e.strerror}", None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        return (f"another run (pid {lock.read().strip() or '?'}) is writing {out_dir}: wait for it to finish, or "
                f"use another --out_dir"), None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return None, lock


def check_resume(ckpt, path, config, meta, fixed):
    """
    A resumed run continues the run in its checkpoint (read from path): the config keys in `fixed` (what its weights
    and optimizer state were made with) and the settings its data was prepared with must keep their saved values, or
    the run stops with one line listing each difference. Other keys (lr, max_steps, intervals...) may change; the line
    that announces the resume says which did.
    """
    def settings(config, meta):
        # the data as prepare.py made it, wherever its folder is now
        return {**config, **{f"data.{k}": v for k, v in ((meta or {}).get("settings") or {}).items()}}
    saved, current = settings(ckpt["config"], ckpt["meta"]), settings(config, meta)
    fixed = (*fixed, *(key for key in current if key.startswith("data.")))

    def differences(keys):
        return [f"{key} {saved[key]!r} -> {current[key]!r}" for key in keys
                if key in saved and key in current and saved[key] != current[key]]
    wrong = differences(fixed)
    if wrong:
        raise UserError(f"--init_from=resume continues the run in {path}, which had other settings "
                        f"({', '.join(wrong)}): set them back, or start a new run in another --out_dir")
    changed = differences(key for key in current if key not in fixed and key != "init_from")
    print0(f"resuming from {path} at step {ckpt['step']}" + (f"; changed on resume: {', '.join(changed)}"
                                                             if changed else ""))


# -----------------------------------------------------------------------------------------------------------------
# checkpoint files, one (ckpt.pt, from rank 0) or, under FSDP, a directory of shards that every rank writes, and the
# save-and-stop pattern

def is_sharded(path):
    """a checkpoint path not ending in .pt names a directory of shards"""
    return not path.endswith(".pt")


def rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def commit_dir(tmp, path):
    """Put the finished directory tmp in the place of path. A directory cannot be swapped in one rename, so the old
    one steps aside to path.old first: at every moment path, or else path.old, holds a complete checkpoint."""
    old = path + ".old"
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def finished_dir(path):
    """where the last complete sharded checkpoint of path is: path, or path.old when a run died between the two
    renames of commit_dir"""
    return path if os.path.isdir(path) or not os.path.isdir(path + ".old") else path + ".old"


def save_checkpoint(path, state):
    """
    A .pt path: torch.save into one file, atomically (rank 0 calls this). A directory (every rank calls this): the
    model and optimizer tensors go through torch.distributed.checkpoint, each rank writing its own shards, and
    everything else into state.pt. The directory is written as path.tmp and renamed once every rank is done, so a
    run killed mid-save leaves the previous checkpoint, never half a new one.
    """
    if not is_sharded(path):
        with atomic_write(path) as f:
            torch.save(state, f)
        return
    tmp = path + ".tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
    barrier()
    try:
        dcp.save({"model": state["model"], "optimizer": state["optimizer"]}, checkpoint_id=tmp)
    except CheckpointException as e:  # every rank gets every rank's failures; a full disk is one line, as above
        failure = next(exc for exc, _ in e.failures.values())
        if isinstance(failure, OSError) and failure.errno in WRITE_ERRNOS:
            raise write_error(path, failure) from None
        raise
    if rank() == 0:  # dcp.save returns once every rank has written its shards and rank 0 the index (.metadata)
        with atomic_write(os.path.join(tmp, "state.pt")) as f:
            torch.save({k: v for k, v in state.items() if k not in ("model", "optimizer")}, f)
        commit_dir(tmp, path)
    barrier()


def load_checkpoint(path, map_location="cpu"):
    """
    The checkpoint at path as one dict, in one process. From a directory of shards: the whole model (every rank's
    shards read back into plain tensors, as T5.from_checkpoint and save_pretrained take them) and the rest, without
    the optimizer state, which restore_state reads shard by shard; "shards" names the directory.
    """
    if is_sharded(path):
        path = finished_dir(path)
        if not os.path.isfile(os.path.join(path, "state.pt")):
            if os.path.isfile(path + ".pt"):
                raise UserError(f"no sharded checkpoint in {path}, but {path}.pt is one written without FSDP: leave "
                                f"fsdp off to read it")
            raise UserError(f"no sharded checkpoint in {path}; check the path, or train one first with train.py "
                            f"--fsdp=True")
        try:
            state = torch.load(os.path.join(path, "state.pt"), map_location=map_location, weights_only=False)
            tensors = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            model = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
                     for key, md in tensors.items() if key.startswith("model.") and
                     isinstance(md, TensorStorageMetadata)}
            # no_dist: each caller reads the whole model on its own, under torchrun too (as dcp warns it assumes)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
        except (Exception, CheckpointException) as e:  # the latter is no Exception
            raise UserError(f"sharded checkpoint {path} is corrupt or unreadable ({type(e).__name__}); delete it or "
                            f"use another")
        return dict(state, model=model, shards=path)
    if not os.path.isfile(path):
        if os.path.isdir(finished_dir(path.removesuffix(".pt"))):
            raise UserError(f"no checkpoint at {path}, but {path.removesuffix('.pt')} holds the shards of an FSDP run:"
                            f" pass --fsdp=True (under torchrun) to read it")
        raise UserError(f"no checkpoint at {path}; check the path, or train one first with train.py")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); delete it or use another")


def checkpoint_state(model, optimizer, step, elapsed, config, meta=None):
    """everything a run needs to continue exactly where it stopped. Under FSDP every rank calls this: the model and
    optimizer tensors are this rank's shards (DTensors, keyed by parameter name), the RNG is every rank's."""
    t5 = raw_model(model)
    sharded = isinstance(t5, FSDPModule)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if sharded:
        rngs = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rngs, rng)
        rng = rngs
    return {"model": t5.state_dict(), "model_config": asdict(t5.config),
            "optimizer": get_optimizer_state_dict(t5, optimizer) if sharded else optimizer.state_dict(),
            "step": step, "elapsed": elapsed, "config": config, "meta": meta, "rng": rng}


def restore_rng(state):
    # a sharded checkpoint holds one RNG state per rank; with more ranks than it was written by, they repeat
    rng = state["rng"][rank() % len(state["rng"])] if isinstance(state["rng"], list) else state["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def restore_state(ckpt, model, optimizer):
    """A resumed run's optimizer state and RNG. From a directory of shards, every rank reads the slices of the
    optimizer state it now holds, for any number of ranks (torch.distributed.checkpoint reshards)."""
    if "shards" in ckpt:
        t5 = raw_model(model)
        state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}  # the layout, to be filled from the files
        dcp.load(state, checkpoint_id=ckpt["shards"])
        set_optimizer_state_dict(t5, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    restore_rng(ckpt)


class Checkpointer:
    """
    The save-and-stop pattern of train.py and finetune.py, and the one place where DDP ranks agree on what to do.

    Ranks agree only at sync points: every sync_interval steps (the log interval), every checkpoint step, step 1 and
    the last step. There a single all-reduce of four numbers tells every rank whether any rank got SIGINT or SIGTERM,
    whether any loss or grad norm since the last sync point was NaN or inf, rank 0's clock, and the mean loss. Between
    sync points nothing waits on the device or on another rank: the NaN check accumulates on the device, and the clock
    is extrapolated from agreed values only. So every rank stops, saves, and (under a time budget) sets the lr at the
    same step from the same numbers, and a checkpoint is written only right after its step passed the NaN check.

        checkpoints = Checkpointer(path, interval, log_interval, max_steps, rt, make_state, step, elapsed, budget_s)
        while step < max_steps and not checkpoints.stop:
            ... lr from checkpoints.clock(step) under a time budget; loss, grad_norm = train_step(...)
            step += 1
            if checkpoints.agree(step, loss, grad_norm):
                ... log checkpoints.loss and checkpoints.elapsed
            with checkpoints.paused():
                ... evaluate
            checkpoints.after_step(step)  # writes the checkpoint every interval steps and when stopping
        checkpoints.finish(step)  # writes the last step's checkpoint unless just written, gives the signals back

    The clock counts training seconds on rank 0, summed over resumes; evaluation and checkpoint writes, timed with
    paused(), don't count. make_state(elapsed) returns what to save; it runs on rank 0 only, or on every rank for a
    directory of shards (FSDP), which every rank writes.
    """

    def __init__(self, path, interval, sync_interval, max_steps, rt, make_state, step, elapsed=0.0, budget_s=0.0):
        self.path, self.interval, self.sync_interval, self.max_steps = path, interval, sync_interval, max_steps
        self.rt, self.make_state, self.budget_s = rt, make_state, budget_s
        self.saved_step = step  # a resumed run's checkpoint holds its first step already
        self.signal = StopSignal()
        self.stop = 0 < budget_s <= elapsed  # a resumed run may have spent its budget already
        self.loss = None  # the mean loss over ranks at the last sync point
        # agreed by all ranks: training seconds at the last sync point, and the seconds per step before it
        self.elapsed, self.synced_step, self.seconds_per_step = elapsed, step, 0.0
        # this rank's: wall time at the last sync point, and the paused seconds since
        self.mark, self.paused_s = time.time(), 0.0
        self.nonfinite = None  # on the device: whether a loss or grad norm since the last sync point was NaN or inf

    def clock(self, step):
        """training seconds after `step` steps, the same on every rank: the last agreed reading, plus the agreed
        seconds per step times the steps since"""
        return self.elapsed + (step - self.synced_step) * self.seconds_per_step

    @contextlib.contextmanager
    def paused(self):
        """time spent inside is not training time: the time budget and the logged elapsed leave it out"""
        t0 = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - t0

    def agree(self, step, loss, grad_norm):
        """Call after every optimizer step. Notes on the device whether loss or grad norm is NaN or inf; at a sync
        point, agrees with the other ranks (above) and returns True. Raises UserError when the run diverged."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
        if not (step % self.sync_interval == 0 or step % self.interval == 0 or step in (1, self.max_steps)):
            return False
        now = time.time()
        reading = self.elapsed + now - self.mark - self.paused_s  # this rank's clock; rank 0's is the one used
        self.mark, self.paused_s = now, 0.0
        shared = torch.stack([self.nonfinite.float(), loss.detach().float() / self.rt.world_size])
        if self.rt.ddp:
            # summed over ranks: the flags are > 0 when any rank raised one, the clock is rank 0's, the loss the mean
            host = torch.tensor([float(self.signal.requested), reading if self.rt.master else 0.0],
                                dtype=torch.float64, device=shared.device)
            shared = torch.cat([shared.double(), host])
            torch.distributed.all_reduce(shared)
            nonfinite, self.loss, signalled, reading = shared.tolist()  # the one host sync since the last sync point
        else:
            (nonfinite, self.loss), signalled = shared.tolist(), self.signal.requested
        if nonfinite:
            raise UserError(f"the loss or grad norm became NaN or inf between steps {self.synced_step + 1} and {step}:"
                            f" training diverged; {self.path} (the last good checkpoint) is untouched; resume from it "
                            f"with a lower lr or grad_clip")
        self.nonfinite = None
        self.seconds_per_step = (reading - self.elapsed) / (step - self.synced_step)
        self.elapsed, self.synced_step = reading, step
        self.stop = bool(signalled) or 0 < self.budget_s <= reading
        if signalled:
            print0(f"stopped by signal at step {step}")
        return True

    def save(self, step):
        if self.synced_step != step:
            raise RuntimeError(f"checkpoint of step {step} written without the sync point that checks it for NaN")
        if self.rt.master or is_sharded(self.path):
            with self.paused():
                save_checkpoint(self.path, self.make_state(self.elapsed))
        self.saved_step = step

    def after_step(self, step):
        """writes the checkpoint every `interval` steps and when stopping (signal or time budget)"""
        if self.stop or step % self.interval == 0:
            self.save(step)

    def finish(self, step):
        if self.saved_step != step:
            self.save(step)
        self.signal.release()
