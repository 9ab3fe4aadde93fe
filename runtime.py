"""
What a run needs around the model: the device, its float modes, speed and
memory; files written whole; a folder held by one run; signals; sums over
the ranks; the log.
"""
import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import re
import signal
import uuid
from dataclasses import dataclass
from tempfile import TemporaryFile

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

def rank():
    return int(os.environ.get("RANK", 0))  # set by torchrun

def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs)

@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """a file written whole or not at all: into a temporary file of this
    writer's own, renamed over path once on disk"""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, mode.replace("w", "x")) as f:  # no other writer's
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)

def lock_folder(out_dir, lock=True):
    """out_dir, made, and locked by rank 0 while it lives: one live run per
    folder (docs/cluster.md); lock=False: made, and found writable"""
    if rank():
        return None
    try:
        os.makedirs(out_dir, exist_ok=True)
        file = (open(os.path.join(out_dir, ".lock"), "a") if lock
                else TemporaryFile(dir=out_dir))
    except OSError as e:
        raise SystemExit(f"error: can't write in {out_dir} ({e.strerror}): "
                         f"pass an --out_dir you can write to") from None
    try:
        if lock:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: {out_dir} is in use by a run still going: "
                         f"let it end, or pass another --out_dir") from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
        print(f"warning: {out_dir} can't be locked ({e.strerror}): run "
              f"nothing else in it")
    return file

DTYPES = ("float32", "tfloat32", "bfloat16")

# dense peak FLOP/s (float32, tfloat32, bfloat16): NVIDIA's data sheets
A100 = (19.5e12, 156e12, 312e12)
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": A100,
    "NVIDIA A100-SXM4-80GB": A100,
    "NVIDIA A100-PCIE-40GB": A100,
    "NVIDIA A100 80GB PCIe": A100,
    "NVIDIA H100 80GB HBM3": (67e12, 494.5e12, 989.5e12),  # SXM
    "NVIDIA H100 PCIe": (51e12, 378e12, 756.5e12),
    "NVIDIA H200": (67e12, 494.5e12, 989.5e12),  # SXM
    "NVIDIA B200": (75e12, 1.1e15, 2.25e15),
}

def flops_per_step(model, batch_size, input_length, target_length):
    """A step's training FLOPs, for MFU: 6 per weight per token it sees
    (2 forward, 4 backward), S input tokens for the encoder and the cross
    k, v, T targets for the rest; plus attention's matmuls"""
    c, S, T = model.config, input_length, target_length
    n_enc = sum(p.numel() for p in model.encoder.parameters())
    n_cross_kv = sum(2 * block.cross_attn.k.weight.numel()
                     for block in model.decoder.blocks)
    n_dec = sum(p.numel() for p in model.decoder.parameters()) - n_cross_kv
    n_head = c.d_model * c.vocab_size
    flops = 6 * ((n_enc + n_cross_kv) * S + (n_dec + n_head) * T)
    attention = (c.num_layers * S * S  # q k^T and a v
                 + c.num_decoder_layers * (T * T + T * S))
    flops += 12 * c.num_heads * c.d_kv * attention
    return batch_size * flops

def mfu(flops_per_step, seconds_per_step, world_size, peak_flops):
    if peak_flops:
        return flops_per_step / world_size / seconds_per_step / peak_flops

def memory_report(device):  # after a GPU's first step: to size batch_size
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    headroom = free + torch.cuda.memory_reserved(device) - peak  # torch's too
    return (f"first step: peak memory {peak / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB, {headroom / 2**30:.1f} GiB headroom "
            f"({100 * headroom / total:.0f}%)")

def print_memory(model, optimizer, rt):
    """what rank 0 holds of the weights and optimizer state (under FSDP,
    its slices); a GPU's peak"""
    state = [v for s in optimizer.state.values() for v in s.values()]
    tensors = [*model.parameters(), *filter(torch.is_tensor, state)]
    held = sum(getattr(t, "to_local", lambda: t)().nbytes for t in tensors)
    print0(f"parameters + optimizer state: {held / 2**20:.2f} MiB on rank 0")
    if rt.device_type == "cuda":
        print0(memory_report(rt.device))

def checkpoint_activations(model):
    """each block keeps only its input for backward, which runs it again
    (before compiling: the compiler sees that run too)"""
    for block in model.blocks():
        block.forward = functools.partial(checkpoint, block.forward,
                                          use_reentrant=False)

@dataclass
class Runtime:
    device: str  # 'cuda:0', 'mps', 'cpu'
    device_type: str
    dtype: str
    torchrun: bool  # launched by torchrun: ranks in a process group
    rank: int
    local_rank: int
    world_size: int
    nodes: int = 1  # torchrun's --nnodes

    @property
    def master(self):
        return self.rank == 0

    def autocast(self):  # bf16 has fp32's range: T5 overflows fp16
        return torch.autocast(self.device_type, torch.bfloat16,
                              enabled=self.dtype == "bfloat16")

    def summed(self, values):
        """values (numbers, 0-d tensors on the device) summed over the
        ranks, in one all-reduce, as floats: the host waits for the device"""
        device = self.device if self.torchrun else "cpu"  # MPS: no float64
        values = torch.stack([torch.as_tensor(v).to(device, torch.float64)
                              for v in values])
        if self.torchrun:
            dist.all_reduce(values)
        return values.tolist()

    def peak_flops(self, given=0.0):  # None: a CPU, MPS, an unknown GPU
        if given > 0 or self.device_type != "cuda":
            return given or None
        name = torch.cuda.get_device_name(self.device).strip()
        if name in PEAK_FLOPS:
            return PEAK_FLOPS[name][DTYPES.index(self.dtype)]
        print0(f"no MFU: '{name}' is not in runtime.PEAK_FLOPS; pass "
               f"--peak_flops=<its dense {self.dtype} FLOP/s>")

def all_gathered(value):  # every rank's value (picklable), in rank order
    values = [value]
    if dist.is_initialized():
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values

def setup_runtime(device="auto", dtype="bfloat16", seed=1337, fsdp=False):
    """picks the device, seeds, sets float modes; this rank's place among
    torchrun's"""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise SystemExit(f"error: device '{device}' is not one this code "
                         f"runs on: use auto, cpu, cuda, cuda:N or mps")
    if dtype not in DTYPES:
        raise SystemExit(f"error: dtype '{dtype}' is not one of "
                         f"{', '.join(DTYPES)}")
    torchrun = "RANK" in os.environ
    if fsdp and not torchrun:
        raise SystemExit("error: fsdp=True shards the model over the ranks "
                         "torchrun starts: launch with torchrun "
                         "--nproc_per_node=N, or leave fsdp off")
    there = dict(cuda=torch.cuda.is_available(),
                 mps=torch.backends.mps.is_available(), cpu=True)
    if device == "auto":
        device = next(name for name, found in there.items() if found)
    device_type = device.split(":")[0]
    if not there[device_type]:
        raise SystemExit(f"error: torch sees no {device} here: use "
                         f"--device=cpu")
    # a CPU without native bf16 matmuls would cast, for no speed
    if device_type == "cpu" and dtype == "bfloat16":
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            if not {"avx512_bf16", "amx_bf16", "bf16"} & set(f.read().split()):
                print0("this CPU has no native bf16 matmuls: running in "
                       "float32 instead")
                dtype = "float32"
    if device_type != "cuda" and dtype == "tfloat32":
        print0("no TF32 off an NVIDIA GPU: running in float32 instead")
        dtype = "float32"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torchrun and device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    torch.manual_seed(seed)  # the same on every rank
    tf32 = dtype != "float32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if device_type == "cpu":  # late in training denormals are slow on x86
        torch.set_flush_denormal(True)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return Runtime(device, device_type, dtype, torchrun, rank(), local_rank,
                   world_size, world_size // per_node)

class Signals:
    """SIGINT and SIGTERM ask the run to save and stop (caught: the
    number). Before the first step is done (step None) there is nothing to
    save: the run ends at once, where torch.compile would swallow a
    KeyboardInterrupt."""

    def __init__(self, rt):
        self.rt, self.caught, self.step = rt, 0, None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.catch)

    def catch(self, signum, frame):
        name = signal.Signals(signum).name
        if self.step is None:
            os.write(2, f"{name} before the first step: nothing to save\n".encode())
            os._exit(128 + signum)
        if not self.caught and self.rt.master:
            when = ("within 3 steps, on every rank" if self.rt.torchrun
                    else "after this step")
            os.write(2, f"{name} after step {self.step}: the run saves and "
                        f"stops {when}\n".encode())
        self.caught = signum

    def release(self):  # after the loop, a signal ends the program
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

class Logger:
    """A JSON line per event in out_dir/log.jsonl (rank 0), the first who
    the run is (program, config); a resume drops what came after its
    checkpoint."""

    def __init__(self, out_dir, master=True, resume_step=None,
                 identity=None):
        self.out_dir, self.resume_step = out_dir, resume_step
        self.path = os.path.join(out_dir, "log.jsonl") if master else None
        self.wandb_run = None
        if not master:
            return
        if resume_step is None:  # a new run: who it is
            lines = [json.dumps(dict(identity, step=0)) + "\n"]
        elif os.path.exists(self.path):  # a resume: to its checkpoint
            with open(self.path) as f:
                lines = [line for line in f if line.endswith("\n")
                         and json.loads(line)["step"] <= resume_step]
        else:
            return
        with atomic_write(self.path, "w") as f:
            f.writelines(lines)

    def start_wandb(self, project, name, config, run_id=None):
        """a new wandb run in out_dir/wandb, or run_id's rewound to the
        checkpoint's step (wandb drops a step below its last); its id"""
        if self.path is None:
            return run_id
        import wandb  # only when asked for
        name = name or os.path.basename(os.path.abspath(self.out_dir))
        rewind = f"{run_id}?_step={self.resume_step}" if run_id else None
        self.wandb_run = wandb.init(project=project, name=name,
                                    config=config, dir=self.out_dir,
                                    resume_from=rewind)
        return self.wandb_run.id

    def log(self, record):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run:  # numbers: no example texts, no missing MFU
            numbers = {k: v for k, v in record.items()
                       if isinstance(v, (int, float)) and k != "step"}
            self.wandb_run.log(numbers, step=record["step"])

def wandb_rule(wandb_log):  # installed, and logged in unless offline
    if not wandb_log:
        return "wandb_log", True, ""
    if not importlib.util.find_spec("wandb"):
        return "wandb_log", False, "False without wandb: pip install wandb"
    import wandb
    offline = os.environ.get("WANDB_MODE") in ("offline", "disabled")
    ready = offline or wandb.login(prompt=False, verify=False)
    return ("wandb_log", ready, "False without a wandb login: run `wandb "
            "login`, or set WANDB_MODE=offline")
