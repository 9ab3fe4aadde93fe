"""Tests for runtime.py: peak FLOP/s by GPU name, MFU, the memory report and the FLOPs of a step; the
collectives' timeouts."""
import pytest
import torch

from model import T5, T5Config
from runtime import DTYPES, Runtime, flops_per_step, memory_report, mfu
from test_train import REPO, run

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

# the exact names torch.cuda.get_device_name prints, and each one's dense bf16 peak; near misses of a listed name
# (an H200 NVL is not an H200, an H100 PCIe is not an SXM) must not borrow its figure
REAL_GPU_NAMES = {
    "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA H100 80GB HBM3": 989.5e12, "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H200": 989.5e12, "NVIDIA B200": 2.25e15, "NVIDIA H100 NVL": None, "NVIDIA H200 NVL": None,
    "NVIDIA L40S": None, "NVIDIA GeForce RTX 4090": None, "NVIDIA A10G": None, "Tesla V100-SXM2-16GB": None,
}


@pytest.mark.parametrize("name, bf16_peak", REAL_GPU_NAMES.items())
def test_peak_flops_matches_whole_gpu_names(monkeypatch, capsys, name, bf16_peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    rt = Runtime("cuda:0", "cuda", "bfloat16", False, 0, 0, 1)
    assert rt.peak_flops() == bf16_peak
    assert ("--peak_flops" in capsys.readouterr().out) == (bf16_peak is None)  # the hint, for unknown GPUs only
    assert rt.peak_flops(given=1e15) == 1e15
    fp32, tf32, bf16 = (Runtime("cuda:0", "cuda", dtype, False, 0, 0, 1).peak_flops() for dtype in DTYPES)
    assert bf16_peak is None or fp32 <= tf32 <= bf16


def test_mfu_is_per_gpu():
    # 8 GPUs at 1e15 FLOP/s each, a step of 4e15 FLOPs in 1 s: each GPU did 5e14, half its peak
    assert mfu(4e15, 1.0, 8, 1e15) == pytest.approx(0.5)
    assert mfu(4e15, 1.0, 1, 8e15) == pytest.approx(0.5)
    assert mfu(4e15, 1.0, 8, None) is None


def test_memory_report(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 62 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (16 * gib, 80 * gib))
    # 16 GiB free on the device plus 2 GiB reserved by PyTorch beyond the peak
    assert memory_report("cuda:0") == "first step: peak memory 60.0 GiB of 80.0 GiB, 18.0 GiB headroom (22%)"


def test_flops_per_step_counts_every_matmul():
    with torch.device("meta"):
        model = T5(T5Config.from_preset("t5-v1_1-small"))
    c, S, T = model.config, 512, 114
    n = model.num_params() - c.vocab_size * c.d_model  # all weights but the embedding lookup
    flops = flops_per_step(model, 4, S, T)
    # weights alone, each over the tokens of its own stack, bound it from below; attention adds the rest
    assert flops > 4 * 6 * (sum(p.numel() for p in model.encoder.parameters()) * S)
    assert 4 * 6 * n * T < flops < 4 * 6 * n * S + 4 * 12 * 384 * 16 * S * S


TIMEOUT_SCRIPT = """
import datetime, os, sys, time
sys.path.insert(0, {repo!r})
import torch
import distributed, runtime
from model import T5, T5Config
distributed.TRAIN_TIMEOUT = datetime.timedelta(seconds=1)
rt = runtime.setup_runtime("cpu", "float32")
distributed.join(rt)
rt.nodes = 2  # 4 ranks as if on 2 nodes: FSDP's mesh is HSDP's, (replicate, shard), of groups of their own
with torch.device("meta"):
    t5 = T5(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2))
distributed.shard_model(t5, rt)
shard = distributed.GROUPS[2]  # the mesh's group of ranks 0 and 1 (or 2 and 3)

def late_all_reduce(group):  # ranks 1 and 3 come 3 s late: whether rank 0 waits for them
    if rt.rank % 2 == 1:
        time.sleep(3)
    try:
        torch.distributed.all_reduce(torch.ones(1), group=group)
        return "waited"
    except RuntimeError:
        return "timed-out"

assert torch.distributed.get_process_group_ranks(shard) == [rt.rank // 2 * 2, rt.rank // 2 * 2 + 1]
starting = [late_all_reduce(group) for group in (None, shard)]
distributed.set_timeout(distributed.TRAIN_TIMEOUT)  # the loop's first step is done: the run has started
training = [late_all_reduce(group) for group in (shard, None)]
if rt.rank == 0:
    print(*starting, *training, flush=True)
os._exit(0)  # the late ranks' collectives failed with rank 0's: no teardown
"""


def test_a_collective_waits_long_while_starting_and_times_out_sooner_once_training(tmp_path):
    # START_TIMEOUT (an hour) while the ranks start; from the loop's first agreement on, TRAIN_TIMEOUT, here 1 s: on
    # the default group and on the groups of FSDP's mesh alike
    script = tmp_path / "timeouts.py"
    script.write_text(TIMEOUT_SCRIPT.format(repo=REPO))
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)])
    assert r.stdout.split() == ["waited", "waited", "timed-out", "timed-out"], r.stderr
