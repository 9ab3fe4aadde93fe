"""What the scripts share at run time: files, devices, DDP, FSDP, MFU, the out_dir, checkpoints, log and Sync."""
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
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from model import T5, UserError  # model.py owns UserError so that it can be copied alone

# files

# errors only writing meets: disk or quota full, file too large, read-only file system
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
    """where a named file is read: whatever fails inside becomes one UserError, `message` filled in"""
    try:
        yield
    except UserError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # torch.distributed.checkpoint's exception is no Exception
        raise UserError(message.format(path=path, reason=reason(e))) from None

def write_failure(e):
    """the OSError behind e that only writing meets (torch's zip writer wraps it in a RuntimeError), or None"""
    while e is not None and not (isinstance(e, OSError) and e.errno in WRITE_ERRNOS):
        e = e.__context__
    return e

def write_error(path, e):
    kept = f"; the previous {os.path.basename(path)} is unchanged" if os.path.exists(path) else ""
    return UserError(f"could not write {path}: {reason(e)}{kept}")

@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Where every file is written: via path.tmp, renamed over path, so a crash leaves the old file. A failure to
    write is one UserError naming path; other errors (reading an input) stay the caller's."""
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
        failure = write_failure(e)
        if failure is None:
            raise
        raise write_error(path, failure) from None

# device, dtype, DDP and MFU

def rank():
    return int(os.environ.get("RANK", 0))  # set by torchrun

def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs)

DTYPES = ("float32", "tfloat32", "bfloat16")

# dense peak FLOP/s (float32, tfloat32, bfloat16) from NVIDIA's data sheets, by torch.cuda.get_device_name
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
    """Training FLOPs of one step, for MFU: 6 per weight per token it sees (2 forward, 4 backward): S input tokens
    for the encoder and cross-attention's k/v, T targets for the rest and the lm_head; plus attention's matmuls."""
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
    headroom = free + torch.cuda.memory_reserved(device) - peak  # memory PyTorch reserved is headroom too
    return (f"first step: peak memory {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB, {headroom / 2**30:.1f} GiB "
            f"headroom ({100 * headroom / total:.0f}%)")

def micro_batch_size(batch_size, grad_accum_steps, world_size):
    size, leftover = divmod(batch_size, grad_accum_steps * world_size)
    if leftover or not size:
        raise UserError(f"batch_size={batch_size} must split evenly into grad_accum_steps={grad_accum_steps} x "
                        f"{world_size} ranks; change batch_size or grad_accum_steps")
    return size

@dataclass
class Runtime:
    device: str  # 'cuda:0', 'mps', 'cpu'
    device_type: str
    dtype: str
    ddp: bool
    rank: int
    local_rank: int
    world_size: int

    @property
    def master(self):
        return self.rank == 0

    def autocast(self):
        # bf16 has fp32's range: T5, which overflows fp16, needs no loss scaling
        if self.dtype == "bfloat16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def peak_flops(self, given=0.0):
        """given if > 0, else the GPU's dense peak from PEAK_FLOPS; None on CPU and MPS, and on an unknown GPU"""
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
    except RuntimeError:
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
    """picks the device, joins torchrun's process group if there is one, seeds, and sets the float modes"""
    ddp = "RANK" in os.environ
    local_rank, world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device_type = device.split(":")[0]
    if device_type == "cpu" and dtype == "bfloat16":  # without native bf16 matmuls, autocast only adds casts
        cpuinfo = ""
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
        if not {"avx512_bf16", "amx_bf16", "bf16"} & set(cpuinfo.split()):
            print0("this CPU has no native bf16 matmuls: running in float32 instead")
            dtype = "float32"
    if ddp and device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        torch.distributed.init_process_group("nccl" if device_type == "cuda" else "gloo")
    torch.manual_seed(seed)  # the same on every rank, so all replicas start equal
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dtype != "float32"
    if device_type == "cpu":
        torch.set_flush_denormal(True)  # denormals, which appear late in training, are slow on x86
    return Runtime(device, device_type, dtype, ddp, rank(), local_rank, world_size)

# the model as it trains: one process, DDP, or FSDP

def raw_model(model):
    """the T5 inside any DDP and torch.compile wrappers: its state_dict has no 'module.' or '_orig_mod.' prefixes"""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)

def shard_model(model, rt):
    """FSDP2 on the T5 in place: each block is a group, gathered just before it runs, and the rest another.
    Weights read outside their module (relative_attention_bias; cross-attention's k and v, which
    Decoder.encoder_kv projects first) stay out of the blocks' groups. Under bf16 the blocks gather in bf16;
    gradient reductions and the residual stream stay fp32."""
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
    """the model on the device, sharded, compiled or DDP-wrapped as asked; make the optimizer from its raw_model"""
    if fsdp:
        shard_model(model, rt)  # each rank moves only its own slices to the device
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
    tensors = [*raw_model(model).parameters(),
               *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)

def unsharded_copy(model):
    """a whole copy of an FSDP-sharded T5, for generate(), which reads weights outside forward()"""
    t5 = raw_model(model)
    state = {name: t.full_tensor() for name, t in t5.state_dict().items()}
    with torch.device("meta"):  # no weights made to be overwritten
        copy = T5(t5.config)
    copy.load_state_dict(state, assign=True)
    return copy.train(t5.training)

# the run's folder: one run at a time, never over another run's results

CHECKPOINTS = ("ckpt.pt", "ckpt", "ckpt.old")  # one file, or (FSDP) a directory of shards, or what a kill left of one

def claim_out_dir(out_dir, rt, fresh, results=CHECKPOINTS):
    """Before a run does any work: a fresh run refuses an out_dir holding any of the `results` it would write;
    then an flock on out_dir/lock, which the OS drops however the run dies. Rank 0 decides, every rank raises.
    Returns the lock file to keep while the run lasts, or None (a resume with no out_dir, left uncreated)."""
    problem = lock = None
    if rt.master:
        found = [os.path.join(out_dir, p) for p in results if os.path.exists(os.path.join(out_dir, p))]
        if fresh and found:
            resumable = set(CHECKPOINTS) & set(results)
            hint = "pass --init_from=resume to continue that run, or" if resumable else "pass"
            problem = (f"{found[0]} exists and this run would replace it: {hint} another --out_dir to start a "
                       f"new one")
        elif fresh or os.path.isdir(out_dir):
            try:
                os.makedirs(out_dir, exist_ok=True)
                lock = open(os.path.join(out_dir, "lock"), "a+")
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                problem = (f"another run (pid {lock.read().strip() or '?'}) is writing {out_dir}: wait for it to "
                           f"finish, or use another --out_dir")
            except OSError as e:
                problem = f"can't write to out_dir {out_dir}: {e.strerror}"
            else:
                lock.truncate(0)
                lock.write(f"{os.getpid()}\n")
                lock.flush()
    problem = [problem]
    if rt.ddp:
        torch.distributed.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise UserError(problem[0])
    return lock

def check_resume(ckpt, path, config, meta, fixed):
    """A resume continues its checkpoint's run: the keys in `fixed` (what its weights and optimizer state were made
    with) and its data's settings must keep their values; the resume line names other keys that changed."""
    def settings(config, meta):  # the data as prepare.py made it, wherever its folder is now
        data = (meta or {}).get("settings") or {}
        return {**config, **{f"data.{key}": value for key, value in data.items()}}
    saved, current = settings(ckpt["config"], ckpt["meta"]), settings(config, meta)
    differences = {key: f"{key} {saved[key]!r} -> {current[key]!r}" for key in current
                   if key in saved and saved[key] != current[key] and key != "init_from"}
    wrong = [text for key, text in differences.items() if key in fixed or key.startswith("data.")]
    if wrong:
        raise UserError(f"--init_from=resume continues the run in {path}, which had other settings "
                        f"({', '.join(wrong)}): set them back, or start a new run in another --out_dir")
    changed = ", ".join(differences.values())
    print0(f"resuming from {path} at step {ckpt['step']}" + (f"; changed on resume: {changed}" if changed else ""))

# checkpoints

def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()

def finished_dir(path):
    """where path's last complete sharded checkpoint is: path, or path.old if a run died while swapping them"""
    return path if os.path.isdir(path) or not os.path.isdir(path + ".old") else path + ".old"

def save_checkpoint(path, state):
    """A .pt path: rank 0 writes one file atomically. A directory (FSDP, every rank calls this): the ranks write
    their shards and rank 0 the rest (state.pt) into path.tmp, which replaces path, kept as path.old meanwhile."""
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
    except dcp.CheckpointException as e:  # every rank gets every rank's failures
        failure = write_failure(next(exc for exc, _ in e.failures.values()))
        if failure is None:
            raise
        raise write_error(path, failure) from None
    if rank() == 0:  # every rank's shards are written once dcp.save returns
        with atomic_write(os.path.join(tmp, "state.pt")) as f:
            torch.save({k: v for k, v in state.items() if k not in ("model", "optimizer")}, f)
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()

def load_checkpoint(path, program=None):
    """The checkpoint at path (a .pt file or a directory of FSDP shards) as one dict; with `program`, only one that
    program wrote. From shards: the whole model, the rest but the optimizer, and 'shards' naming the directory."""
    sharded = not path.endswith(".pt")
    found = finished_dir(path) if sharded else path
    state_file = os.path.join(found, "state.pt") if sharded else found
    if not os.path.isfile(state_file):
        if sharded:
            other, kind = path + ".pt", "one written without FSDP: leave fsdp off"
        else:
            other, kind = path.removesuffix(".pt"), "the shards of an FSDP run: pass --fsdp=True (under torchrun)"
        hint = f"but {other} holds {kind} to read it" if os.path.exists(finished_dir(other)) else \
            "check the path, or train one first with train.py"
        raise UserError(f"no {'sharded ' if sharded else ''}checkpoint at {path}; {hint}")
    with reading(found, "{path} is corrupt or unreadable ({reason}): delete it or use another"):
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        if sharded:
            tensors = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
            model = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype) for key, md in
                     tensors.items() if key.startswith("model.") and isinstance(md, dcp.TensorStorageMetadata)}
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
    """All a run needs to continue where it stopped, and which program wrote it. Under FSDP every rank calls this:
    the tensors are this rank's shards, the RNG states every rank's."""
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
    """A resumed run's optimizer state and RNG. From shards each rank reads its slices, for any number of ranks;
    with more ranks than wrote them, the RNG states repeat."""
    if "shards" in ckpt:
        t5 = raw_model(model)
        state = {"optimizer": get_optimizer_state_dict(t5, optimizer)}  # the layout to fill
        dcp.load(state, checkpoint_id=ckpt["shards"])
        set_optimizer_state_dict(t5, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt["rng"][rank() % len(ckpt["rng"])] if isinstance(ckpt["rng"], list) else ckpt["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])

def load_model(init_from, **overrides):
    """(T5, its checkpoint or None) from a run of train.py or finetune.py (its out_dir, ckpt.pt or ckpt/) or from
    Hugging Face weights (a Hub name or folder); overrides are T5Config fields."""
    for path in (init_from, os.path.join(init_from, "ckpt.pt"), os.path.join(init_from, "ckpt")):
        if os.path.isfile(path if path.endswith(".pt") else os.path.join(finished_dir(path), "state.pt")):
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

# the loop's log and its agreement

class Logger:
    """One JSON object per event in out_dir/log.jsonl (rank 0), and to wandb if enabled. A resume first drops what
    was logged after its checkpoint; a damaged line stops it, but for the last, which a kill may cut."""

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
    """Where the ranks agree, at the loop's log and checkpoint steps, in one all-reduce: a stop signal, whether a
    loss or grad norm was NaN or inf, rank 0's clock (training seconds over resumes, less time in paused()) and the
    mean loss. In between nothing waits for the device or another rank, yet every rank stops at the same step."""

    def __init__(self, rt, ckpt_path, step, elapsed=0.0, budget_s=0.0):
        self.rt, self.ckpt_path, self.budget_s = rt, ckpt_path, budget_s
        self.step, self.elapsed, self.per_step = step, elapsed, 0.0  # agreed at the last sync point
        self.mark, self.paused_s, self.nonfinite, self.signalled = time.time(), 0.0, 0, False  # this rank's own
        self.stop = 0 < budget_s <= elapsed  # a resumed run may have spent its budget
        self.handlers = {s: signal.signal(s, lambda *_: setattr(self, "signalled", True))
                         for s in (signal.SIGINT, signal.SIGTERM)}

    def clock(self, step):
        """training seconds after `step` steps, extrapolated the same on every rank"""
        return self.elapsed + (step - self.step) * self.per_step

    @contextlib.contextmanager
    def paused(self):
        t0 = time.time()
        yield
        self.paused_s += time.time() - t0

    def watch(self, loss, grad_norm):
        """after every step: counts, without waiting for the device, a loss or grad norm that is NaN or inf"""
        self.nonfinite = self.nonfinite + ~(torch.isfinite(loss) & torch.isfinite(grad_norm))

    def agree(self, step, loss):
        """the all-reduce of a sync point: sets stop, returns the mean loss, raises UserError if training diverged"""
        now = time.time()
        clock_s = self.elapsed + now - self.mark - self.paused_s  # rank 0's is the one used
        self.mark, self.paused_s = now, 0.0
        device = loss.device if self.rt.ddp else "cpu"  # the backend's device; and MPS has no float64
        shared = torch.stack([self.nonfinite.float(), loss.detach().float() / self.rt.world_size]).to(device).double()
        host = torch.tensor([self.signalled, clock_s * self.rt.master], dtype=torch.float64, device=device)
        shared = torch.cat([shared, host])
        if self.rt.ddp:
            torch.distributed.all_reduce(shared)  # a sum: a flag raised anywhere, rank 0's clock, the mean loss
        nonfinite, loss, signalled, clock_s = shared.tolist()  # the one wait for the device
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
        """gives SIGINT and SIGTERM back: after the loop, Ctrl-C stops the program at once"""
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
