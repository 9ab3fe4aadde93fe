"""
The runtime that train.py, finetune.py, bench.py and prepare.py share, one copy of each piece: files written
atomically, print0, the device/dtype/DDP set-up and the GPUs' peak FLOP/s, the log, stop signals, and the checkpoint
files with the one save-and-stop pattern of the training loops. The optimizers are in optim.py, the model in model.py.
"""
import contextlib
import json
import os
import signal
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

# the one error class for bad input (configurator.py prints it as one `error:` line). model.py owns it, so that
# model.py can be copied alone; the other scripts import it from here.
from model import UserError  # noqa: F401


# -----------------------------------------------------------------------------------------------------------------
# writing files atomically

def commit(f, path):
    """Finish a file written under a temporary name: flush it to disk, then rename it to path in one step."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(f.name, path)


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write to path.tmp and rename it to path once complete: a crash or Ctrl-C mid-write leaves the previous file
    intact, never a truncated one under the final name."""
    f = open(path + ".tmp", mode)
    try:
        yield f
        commit(f, path)
    finally:
        if not f.closed:
            f.close()
            os.remove(f.name)


# -----------------------------------------------------------------------------------------------------------------
# device, dtype and DDP

def print0(*args, **kwargs):
    """print on rank 0 only, so that 8 GPUs don't print 8 copies of every line"""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs)


# dense peak FLOP/s per GPU for (float32, tfloat32, bfloat16), from the vendors' data sheets; MFU divides by these
PEAK_FLOPS = {
    "H200": (67e12, 495e12, 989e12),
    "H100": (67e12, 495e12, 989e12),
    "A100": (19.5e12, 156e12, 312e12),
    "A10G": (31.2e12, 62.5e12, 125e12),
    "L4": (30.3e12, 60e12, 121e12),
    "RTX 4090": (82.6e12, 82.6e12, 165e12),
    "RTX 3090": (35.6e12, 35.6e12, 71e12),
}


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

    def peak_flops(self):
        """the GPU's dense peak FLOP/s at this dtype, or None where unknown (CPU, MPS, an unlisted GPU)"""
        if self.device_type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        column = ("float32", "tfloat32", "bfloat16").index(self.dtype)
        return next((peaks[column] for gpu, peaks in PEAK_FLOPS.items() if gpu in name), None)


def setup_runtime(device="auto", dtype="bfloat16", seed=1337):
    """Pick the device, join the torchrun process group if there is one, seed, and set the float modes."""
    if dtype not in ("float32", "tfloat32", "bfloat16"):
        raise UserError(f"dtype '{dtype}' is not supported; use bfloat16, tfloat32 or float32")
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
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
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

    def agreed(self, runtime):
        """True when any rank was signalled; under DDP every rank must stop at the same step or the others hang"""
        if not runtime.ddp:
            return self.requested
        flag = torch.tensor(float(self.requested), device=runtime.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def save_checkpoint(path, state):
    with atomic_write(path) as f:
        torch.save(state, f)


def load_checkpoint(path, map_location="cpu"):
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; check the path, or train one first with train.py")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise UserError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); delete it or use another")


def checkpoint_state(model, optimizer, step, elapsed, config, meta=None):
    """everything a run needs to continue exactly where it stopped"""
    t5 = raw_model(model)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"model": t5.state_dict(), "model_config": asdict(t5.config), "optimizer": optimizer.state_dict(),
            "step": step, "elapsed": elapsed, "config": config, "meta": meta, "rng": rng}


def restore_rng(state):
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


class Checkpointer:
    """
    The save-and-stop pattern of train.py and finetune.py. After every optimizer step the loop calls after_step(step),
    which writes the checkpoint every `interval` steps and at once when any rank got SIGINT or SIGTERM, and returns
    True when the loop must stop. After the loop, finish(step) writes the last step's checkpoint unless that step was
    just saved, and gives the signals back: from then on Ctrl-C stops the program at once. make_state() returns what
    to save; it runs on rank 0 only.
    """

    def __init__(self, path, interval, rt, make_state, step):
        self.path, self.interval, self.rt, self.make_state = path, interval, rt, make_state
        self.saved_step = step  # a resumed run's checkpoint holds its first step already
        self.signal = StopSignal()

    def save(self, step):
        if self.rt.master:
            save_checkpoint(self.path, self.make_state())
        self.saved_step = step

    def after_step(self, step):
        stop = self.signal.agreed(self.rt)
        if stop or step % self.interval == 0:
            self.save(step)
        if stop:
            print0(f"stopped by signal at step {step}")
        return stop

    def finish(self, step):
        if self.saved_step != step:
            self.save(step)
        self.signal.release()
