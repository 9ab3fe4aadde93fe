"""
What the scripts share at run time: the two boundaries where files are read and written, print0, the device and DDP
set-up, MFU, the model wrapped for DDP or FSDP, the claim on an out_dir, checkpoints, the log, and Sync, where the
ranks of a run agree.
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

from model import T5, UserError  # UserError: model.py owns it so that it can be copied alone; scripts take it here


# -----------------------------------------------------------------------------------------------------------------
# files

# errors that only writing can meet: disk or quota full, file too large, read-only file system
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def reason(e):
    """what went wrong, in a few words"""
    if isinstance(e, KeyError):
        return f"it has no {e.args[0]!r}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


@contextlib.contextmanager
def reading(path, message="could not read {path}: {reason}"):
    """Where a named file is read: whatever fails inside (missing, not UTF-8, not the format, a key missing) becomes
    one UserError, `message` with the file's path and the reason filled in."""
    try:
        yield
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # torch.distributed.checkpoint's exception is no Exception
        raise UserError(message.format(path=path, reason=reason(e))) from None


def write_failure(e):
    """the OSError behind e that only writing meets (torch's zip writer raises a RuntimeError in its place), or None"""
    while e is not None and not (isinstance(e, OSError) and e.errno in WRITE_ERRNOS):
        e = e.__context__
    return e


def write_error(path, e):
    kept = f"; the previous {os.path.basename(path)} is unchanged" if os.path.exists(path) else ""
    return UserError(f"could not write {path}: {reason(e)}{kept}")


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Where every file is written: to path.tmp, flushed to disk, then renamed to path in one step, so that a crash
    mid-write leaves the previous file intact. A failure to write is one UserError naming path; other errors inside
    the block (reading an input) stay the caller's."""
    try:
        f = open(path + ".tmp", mode)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(f.name, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            f.close()  # flushes, which may fail again as the write did
        with contextlib.suppress(OSError):
            os.remove(f.name)
        if write_failure(e) is None:
            raise
        raise write_error(path, write_failure(e)) from None


# -----------------------------------------------------------------------------------------------------------------
# device, dtype, DDP and MFU

def rank():
    return int(os.environ.get("RANK", 0))  # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE


def print0(*args, **kwargs):
    """print on rank 0 only, so that 8 GPUs don't print 8 copies of every line"""
    if rank() == 0:
        print(*args, **kwargs)


DTYPES = ("float32", "tfloat32", "bfloat16")

# dense peak FLOP/s (float32, tfloat32, bfloat16) by the exact name torch.cuda.get_device_name prints: NVIDIA's data
# sheets (figures "with sparsity" halved) and the GA102/AD102 whitepapers; no A10G, which has no NVIDIA data sheet
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
    """model FLOP utilisation of each GPU, which does 1/world_size of the step's FLOPs; None without a peak"""
    return flops_per_step / world_size / seconds_per_step / peak_flops if peak_flops else None


def memory_report(device):
    """after the first step on a GPU: its peak memory and the headroom left, to judge batch_size by"""
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
        return contextlib.nullcontext()

    def peak_flops(self, given=0.0):
        """given if > 0, else the GPU's dense peak from PEAK_FLOPS (exact names only: an L40S is not an L4); None on
        CPU and MPS, and on an unknown GPU, with a hint to pass --peak_flops"""
        if given > 0 or self.device_type != "cuda":
            return given or None
        name = torch.cuda.get_device_name(self.device).strip()
        if name not in PEAK_FLOPS:
            print0(f"'{name}' is not in runtime.PEAK_FLOPS, so no MFU is shown: pass --peak_flops=<its dense "
                   f"{self.dtype} FLOP/s from the data sheet> to see it")
            return None
        return PEAK_FLOPS[name][DTYPES.index(self.dtype)]


def check_device(name):
    """configurator.py's rule for `device`"""
    try:
        kind = "auto" if name == "auto" else torch.device(name).type
    except RuntimeError:  # "Invalid device string", "Expected one of cpu, cuda, ..."
        kind = None
    if kind not in ("auto", "cpu", "cuda", "mps"):
        raise UserError(f"device '{name}' is not one this code runs on: use auto, cpu, cuda, cuda:N or mps")
    if (kind == "cuda" and not torch.cuda.is_available()) or (kind == "mps" and not torch.backends.mps.is_available()):
        raise UserError(f"device '{name}' asked for, but torch sees no such GPU here; use --device=cpu")


def check_fsdp(fsdp):
    """configurator.py's rule for `fsdp`"""
    if fsdp and "RANK" not in os.environ:
        raise UserError("fsdp=True shards the model over the ranks torchrun starts: launch with "
                        "torchrun --nproc_per_node=N, or leave fsdp off for one process")


def setup_runtime(device="auto", dtype="bfloat16", seed=1337):
    """Pick the device, join the torchrun process group if there is one, seed, and set the float modes."""
    ddp = "RANK" in os.environ
    local_rank, world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device_type = device.split(":")[0]
    if device_type == "cpu" and dtype == "bfloat16":  # native bf16 matmuls: AVX512-BF16, AMX or Arm's BF16
        flags = set()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
        if not {"avx512_bf16", "amx_bf16", "bf16"} & flags:
            print0("this CPU has no native bf16 matmuls: running in float32 instead")  # autocast would add casts
            dtype = "float32"
    if ddp and device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        torch.distributed.init_process_group("nccl" if device_type == "cuda" else "gloo")
    torch.manual_seed(seed)  # the same on every rank: all replicas start from the same weights
    # TF32 runs fp32 matmuls on the tensor cores with a 10-bit mantissa; 'float32' stays exact for the paper's fp32 row
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dtype != "float32"
    if device_type == "cpu":
        torch.set_flush_denormal(True)  # late in training denormal floats appear, which x86 handles ~100x slower
    return Runtime(device, device_type, dtype, ddp, rank(), local_rank, world_size)


# -----------------------------------------------------------------------------------------------------------------
# the model as it trains: one process, DDP, or FSDP

def raw_model(model):
    """the T5 inside any DDP and torch.compile wrappers: its state_dict has no 'module.' or '_orig_mod.' prefixes"""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def shard_model(model, rt):
    """
    FSDP2 on the T5 in place: each rank keeps a 1/world_size slice of every weight, its gradient and its optimizer
    state, and a group of weights is gathered just before the module that uses it runs. Each encoder and decoder
    block is one group; the whole model is the group of the rest (embedding, lm_head, final norms). Two reads of
    weights outside their module shape the groups: each stack's relative_attention_bias table is a group of its own,
    gathered when the stack calls it, and the decoder's cross-attention k and v stay in the whole model's group,
    because Decoder.encoder_kv projects them for every layer at once before the first block runs.
    Under bf16 the blocks are gathered in bf16, as autocast would cast them (half the traffic); weights, gradient
    reductions and optimizer state stay fp32, and so does the residual stream (cast_forward_inputs=False).
    """
    mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    policy = MixedPrecisionPolicy()
    if rt.dtype == "bfloat16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            fully_shard(module, mesh=mesh)
    for block in model.encoder.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    for block in model.decoder.blocks:
        modules = [m for name, m in block.named_children() if name != "cross_attn"]
        fully_shard(modules + [block.cross_attn.q, block.cross_attn.o], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh)


def wrap_model(model, rt, fsdp=False, compile=False, dynamic=None):
    """The model as the loop calls it: on the device, FSDP-sharded, compiled, and DDP-wrapped under torchrun without
    fsdp. Make the optimizer from raw_model(the result)."""
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
    """whether the next backward all-reduces (DDP) or reduce-scatters (FSDP) the gradients"""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = sync
    elif isinstance(raw_model(model), FSDPModule):
        raw_model(model).set_requires_gradient_sync(sync)


def state_bytes(model, optimizer):
    """bytes of parameters and optimizer state on this rank (of an FSDP-sharded tensor, only this rank's slice)"""
    tensors = [*raw_model(model).parameters(),
               *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


def unsharded_copy(model):
    """A whole copy of an FSDP-sharded T5, for generate(), which reads weights outside the forward calls where FSDP
    gathers them (inference holds 2-4 bytes per parameter, not training's 16)"""
    t5 = raw_model(model)
    state = {name: t.full_tensor() for name, t in t5.state_dict().items()}
    with torch.device("meta"):  # no weights made only to be overwritten
        copy = T5(t5.config)
    copy.load_state_dict(state, assign=True)
    return copy.train(t5.training)


# -----------------------------------------------------------------------------------------------------------------
# the run's folder: one run at a time, never over another run's results

CHECKPOINTS = ("ckpt.pt", "ckpt", "ckpt.old")  # one file, or (FSDP) a directory of shards, or what a kill left of one


def claim_out_dir(out_dir, rt, fresh, results=CHECKPOINTS):
    """
    Called before a run does any work, to stop with one line rather than lose or mix anyone's files. A fresh run
    (one that does not continue the run in out_dir) refuses an out_dir holding any of the `results` it would write.
    Then it takes an exclusive flock on out_dir/lock (holding its pid) until its process ends; the OS releases a flock
    however the process dies, so a crashed run never blocks the next. Rank 0 decides and every rank raises the same
    error. A resume with no out_dir creates nothing. Returns the open lock file (keep it while the run lasts) or None.
    """
    problem = lock = None
    if rt.master:
        problem, lock = _claim(out_dir, fresh, results)
    if rt.ddp:
        problem = [problem]
        torch.distributed.broadcast_object_list(problem, src=0)
        problem = problem[0]
    if problem:
        raise UserError(problem)
    return lock


def _claim(out_dir, fresh, results):
    found = [os.path.join(out_dir, p) for p in results if os.path.exists(os.path.join(out_dir, p))]
    if fresh and found:
        hint = "pass --init_from=resume to continue that run, or" if set(CHECKPOINTS) & set(results) else "pass"
        return f"{found[0]} exists and this run would replace it: {hint} another --out_dir to start a new one", None
    if not fresh and not os.path.isdir(out_dir):
        return None, None
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, "lock"), "a+")
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
    """A resume continues the run in its checkpoint: the config keys in `fixed` (what its weights and optimizer state
    were made with) and the settings its data was prepared with must keep their values, or the run stops with one
    line listing each difference. Other keys may change; the line announcing the resume says which did."""
    def settings(config, meta):  # the data as prepare.py made it, wherever its folder is now
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
# checkpoints: one file (ckpt.pt, from rank 0) or, under FSDP, a directory of shards that every rank writes

def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def finished_dir(path):
    """where the last complete sharded checkpoint of path is: path, or path.old when a run died while swapping"""
    return path if os.path.isdir(path) or not os.path.isdir(path + ".old") else path + ".old"


def save_checkpoint(path, state):
    """
    A .pt path: rank 0 writes one file atomically. A directory (FSDP, every rank calls this): each rank writes its
    model and optimizer shards through torch.distributed.checkpoint, rank 0 the rest as state.pt, into path.tmp, which
    then takes path's place; the old one steps aside to path.old first, so that at every moment path, or else
    path.old, holds a complete checkpoint.
    """
    if path.endswith(".pt"):
        if rank() == 0:
            with atomic_write(path) as f:
                torch.save(state, f)
        return
    tmp, old = path + ".tmp", path + ".old"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
    barrier()
    try:
        dcp.save({"model": state["model"], "optimizer": state["optimizer"]}, checkpoint_id=tmp)
    except CheckpointException as e:  # every rank gets every rank's failures
        failure = write_failure(next(exc for exc, _ in e.failures.values()))
        if failure is None:
            raise
        raise write_error(path, failure) from None
    if rank() == 0:  # dcp.save returns once every rank has written its shards and rank 0 the index
        with atomic_write(os.path.join(tmp, "state.pt")) as f:
            torch.save({k: v for k, v in state.items() if k not in ("model", "optimizer")}, f)
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_checkpoint(path, program=None):
    """
    The checkpoint at path (a .pt file, or a directory of FSDP shards) as one dict, in one process; with `program`,
    only one that program wrote: a resume continues only a run of its own kind. From shards: the whole model as plain
    tensors and the rest without the optimizer state, which restore_state reads shard by shard; 'shards' names the
    directory.
    """
    sharded = not path.endswith(".pt")
    found = finished_dir(path) if sharded else path
    if not os.path.isfile(os.path.join(found, "state.pt") if sharded else found):
        other, kind = (path + ".pt", "one written without FSDP: leave fsdp off") if sharded else \
            (path.removesuffix(".pt"), "the shards of an FSDP run: pass --fsdp=True (under torchrun)")
        hint = f"but {other} holds {kind} to read it" if os.path.exists(finished_dir(other)) else \
            "check the path, or train one first with train.py"
        raise UserError(f"no {'sharded ' if sharded else ''}checkpoint at {path}; {hint}")
    with reading(found, "{path} is corrupt or unreadable ({reason}): delete it or use another"):
        if not sharded:
            state = torch.load(found, map_location="cpu", weights_only=False)
        else:
            state = torch.load(os.path.join(found, "state.pt"), map_location="cpu", weights_only=False)
            tensors = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
            model = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype) for key, md in
                     tensors.items() if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
            with warnings.catch_warnings():  # no_dist: each caller reads the whole model on its own
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"model": model}, checkpoint_id=found, no_dist=True)
            state = dict(state, model=model, shards=found)
    if program and (not isinstance(state, dict) or state.get("program") != program):
        writer = state.get("program") if isinstance(state, dict) else None
        raise UserError(f"{path} was written by {writer or 'another program'}, and {program} --init_from=resume "
                        f"continues only its own runs: start from it with --init_from={path} in another --out_dir")
    return state


def checkpoint_state(model, optimizer, step, elapsed, config, meta=None, program="train.py"):
    """everything a run needs to continue exactly where it stopped, and which program wrote it. Under FSDP every rank
    calls this: the model and optimizer tensors are this rank's shards, the RNG states are every rank's."""
    t5 = raw_model(model)
    sharded = isinstance(t5, FSDPModule)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if sharded:
        rngs = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rngs, rng)
        rng = rngs
    return {"program": program, "model": t5.state_dict(), "model_config": asdict(t5.config),
            "optimizer": get_optimizer_state_dict(t5, optimizer) if sharded else optimizer.state_dict(),
            "step": step, "elapsed": elapsed, "config": config, "meta": meta, "rng": rng}


def restore_state(ckpt, model, optimizer):
    """A resumed run's optimizer state and RNG. From shards, every rank reads the slices it now holds, for any number
    of ranks (torch.distributed.checkpoint reshards); with more ranks than wrote them, the RNG states repeat."""
    if "shards" in ckpt:
        t5 = raw_model(model)
        state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}  # the layout, filled from the files
        dcp.load(state, checkpoint_id=ckpt["shards"])
        set_optimizer_state_dict(t5, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt["rng"][rank() % len(ckpt["rng"])] if isinstance(ckpt["rng"], list) else ckpt["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_model(init_from, **overrides):
    """(T5, its checkpoint or None) from a checkpoint of train.py or finetune.py (a run's out_dir, its ckpt.pt or its
    directory of FSDP shards) or from Hugging Face weights (a Hub name or folder); overrides are T5Config fields."""
    for path in (init_from, os.path.join(init_from, "ckpt.pt"), os.path.join(init_from, "ckpt")):
        sharded = os.path.isfile(os.path.join(finished_dir(path), "state.pt"))
        if path.endswith(".pt") and os.path.isfile(path) or sharded:
            break
    else:
        if init_from.endswith(".pt"):
            path = init_from  # a missing one: load_checkpoint names it
        elif not os.path.exists(init_from) and os.path.isdir(os.path.dirname(init_from)):  # a path, not a Hub id
            raise UserError(f"{init_from} does not exist: pass a run of train.py or finetune.py (its out_dir, ckpt.pt "
                            f"or ckpt/), a folder with Hugging Face weights, or a Hub name")
        else:
            return T5.from_pretrained(init_from, **overrides), None
    ckpt = load_checkpoint(path)
    with reading(path, "{path} is not a checkpoint of train.py or finetune.py ({reason}): pass one of theirs"):
        return T5.from_checkpoint(ckpt, **overrides), ckpt


# -----------------------------------------------------------------------------------------------------------------
# the loop's log and its agreement

class Logger:
    """Appends one JSON object per event to out_dir/log.jsonl (rank 0 only), and to wandb when enabled. A resume first
    drops what a killed run logged after its checkpoint; a damaged line (a kill damages only the last) stops it."""

    def __init__(self, out_dir, master=True, resume_step=None, wandb_log=False, wandb_project="nanoT5",
                 wandb_run_name=None, config=None):
        self.path, self.wandb = os.path.join(out_dir, "log.jsonl") if master else None, None
        if master and resume_step is not None and os.path.exists(self.path):
            kept = []
            with reading(self.path), open(self.path) as f:
                for number, line in enumerate(f, 1):
                    with reading(self.path, f"line {number} of {{path}} is damaged ({{reason}}): delete that line"):
                        if line.endswith("\n") and json.loads(line).get("step", 0) <= resume_step:
                            kept.append(line)
            with atomic_write(self.path, "w") as f:
                f.writelines(kept)
        if master and wandb_log:
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


class Sync:
    """
    Where the ranks of a run agree, at the sync points the loop chooses (log and checkpoint steps): one all-reduce of
    a stop signal (SIGINT or SIGTERM on any rank), whether any loss or grad norm since the last was NaN or inf (the run
    then stops before it can save), rank 0's clock and the mean loss. In between nothing waits for the device or
    another rank, so every rank stops, saves and sets a time budget's lr at the same step, from the same numbers.
    The clock counts training seconds, summed over resumes; time inside paused() (evaluation, saving) is left out.
    """

    def __init__(self, rt, ckpt_path, step, elapsed=0.0, budget_s=0.0):
        self.rt, self.ckpt_path, self.budget_s = rt, ckpt_path, budget_s
        self.step, self.elapsed, self.per_step = step, elapsed, 0.0  # agreed at the last sync point
        self.mark, self.paused_s, self.nonfinite, self.signalled = time.time(), 0.0, 0, False  # this rank's own
        self.stop = 0 < budget_s <= elapsed  # a resumed run may have spent its budget
        self.handlers = {s: signal.signal(s, lambda *_: setattr(self, "signalled", True))
                         for s in (signal.SIGINT, signal.SIGTERM)}

    def clock(self, step):
        """training seconds after `step` steps, the same on every rank: the agreed reading, extrapolated"""
        return self.elapsed + (step - self.step) * self.per_step

    @contextlib.contextmanager
    def paused(self):
        t0 = time.time()
        yield
        self.paused_s += time.time() - t0

    def watch(self, loss, grad_norm):
        """after every step: counts on the device, without waiting for it, a loss or grad norm that is NaN or inf"""
        self.nonfinite = self.nonfinite + ~(torch.isfinite(loss) & torch.isfinite(grad_norm))

    def agree(self, step, loss):
        """the all-reduce of a sync point: sets stop, returns the mean loss, raises UserError if training diverged"""
        now = time.time()
        clock_s = self.elapsed + now - self.mark - self.paused_s  # this rank's clock; rank 0's is the one used
        self.mark, self.paused_s = now, 0.0
        device = loss.device if self.rt.ddp else "cpu"  # the backend's device; and MPS has no float64
        shared = torch.stack([self.nonfinite.float(), loss.detach().float() / self.rt.world_size]).to(device).double()
        host = torch.tensor([self.signalled, clock_s * self.rt.master], dtype=torch.float64, device=device)
        shared = torch.cat([shared, host])
        if self.rt.ddp:
            torch.distributed.all_reduce(shared)  # a sum: a flag raised anywhere, rank 0's clock, the mean loss
        nonfinite, loss, signalled, clock_s = shared.tolist()  # the one wait for the device since the last sync point
        if nonfinite:
            kept = f"{self.ckpt_path} (the last good checkpoint) is untouched; resume from it" if os.path.exists(
                self.ckpt_path) else "no checkpoint was written yet; start again"
            raise UserError(f"the loss or grad norm became NaN or inf between steps {self.step + 1} and {step}: "
                            f"training diverged; {kept} with a lower lr or grad_clip")
        self.nonfinite, self.per_step = 0, (clock_s - self.elapsed) / (step - self.step)
        self.step, self.elapsed, self.stop = step, clock_s, bool(signalled) or 0 < self.budget_s <= clock_s
        if signalled:
            print0(f"stopped by signal at step {step}")
        return loss

    def release(self):
        """give SIGINT and SIGTERM back: after the loop, Ctrl-C stops the program at once"""
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
