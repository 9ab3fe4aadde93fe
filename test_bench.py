"""bench.py's functions called directly, as a test or a notebook would: a tiny training step, the table's fallback to
a micro-batch that fits after running out of memory, and the first (compiling) call reported apart."""
import re

import pytest
import torch

import bench
from data import compute_input_and_target_lengths
from runtime import flops_per_step, setup_runtime

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

# t5-tiny, 4 examples of 32 input tokens; a small vocab keeps the embedding and lm_head, and so each step, small
TINY = ("t5-tiny", 256, 4, 1, 32)  # model, vocab, batch, grad_accum_steps, input_length
TARGETS = compute_input_and_target_lengths(32, 0.15, 3.0)[1]
ONE_STEP = dict(burn_in=1, steps=1)


@pytest.fixture(autouse=True)
def one_thread():
    # steps this small gain nothing from a second thread, and on a busy machine two spinning threads are ~10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bench_train_tiny():
    rt = setup_runtime("cpu", "float32")
    dt, tokens_per_s, mfu, memory, first = bench.bench_train(rt, *TINY, False, **ONE_STEP)
    assert dt > 0 and tokens_per_s == pytest.approx(4 * (32 + TARGETS) / dt)
    assert mfu is None and memory > 0 and first > 0  # no known peak on a CPU
    # with a peak given, MFU is the model's FLOPs per second over it
    dt, _, mfu, _, _ = bench.bench_train(rt, *TINY, False, peak_flops=1e12, **ONE_STEP)
    flops = flops_per_step(bench.build_model(rt, "t5-tiny", 256), 4, 32, TARGETS)
    assert mfu == pytest.approx(flops / dt / 1e12)


def run_out_of_memory(monkeypatch, fails):
    """make the training step raise torch.OutOfMemoryError when fails(micro-batch) is true; returns the micro-batch
    of every step tried"""
    tried, training_step = [], bench.training_step

    def patched(net, rt, next_batch, *args, **kwargs):
        step = training_step(net, rt, next_batch, *args, **kwargs)

        def checked():
            micro_batch = len(next_batch()[0]["input_ids"])
            tried.append(micro_batch)
            if fails(micro_batch):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
            return step()
        return checked
    monkeypatch.setattr(bench, "training_step", patched)
    return tried


def test_out_of_memory_falls_back_to_the_largest_micro_batch_that_fits(monkeypatch):
    tried = run_out_of_memory(monkeypatch, lambda micro_batch: micro_batch > 1)
    rt = setup_runtime("cpu", "float32")
    micro_batch, (dt, tokens_per_s, _, _, _) = bench.bench_train_fitting(rt, *TINY, False, **ONE_STEP)
    assert micro_batch == 1 and tried == [4, 2, 1, 1]  # the first call of each size, then the timed call
    assert tokens_per_s == pytest.approx(4 * (32 + TARGETS) / dt)  # still the whole global batch per step
    tried.clear()
    with pytest.raises(torch.OutOfMemoryError):
        run_out_of_memory(monkeypatch, lambda micro_batch: True)
        bench.bench_train_fitting(rt, *TINY, False, **ONE_STEP)


def test_table_finishes_every_row(monkeypatch, capsys):
    calls = iter(range(100))
    # the first row runs out of memory at every micro-batch (4, 2, 1); the second fits at 2
    tried = run_out_of_memory(monkeypatch, lambda micro_batch: next(calls) < 3 or micro_batch > 2)
    bench.print_table("cpu", "t5-tiny", 256, 4, 32, rows=[("float32", False), ("tfloat32", False),
                                                        ("float32", False)], **ONE_STEP)
    lines = capsys.readouterr().out.splitlines()
    assert tried == [4, 2, 1, 4, 2, 2]
    failed, skipped, fitted = [line for line in lines if line.lstrip().startswith(("float32", "tfloat32"))]
    assert "failed: OutOfMemoryError: CUDA out of memory" in failed
    assert "skipped" in skipped
    assert fitted.split()[2] == "2"  # the micro-batch column


def run_bench(*args, eager=False):
    """bench.py as a command, on one CPU thread, t5-tiny; eager: with torch.compile's stance force_eager, so that
    --compile=True runs without compiling"""
    import os
    import subprocess
    import sys
    script = ["-c", "import runpy, sys, torch; torch.compiler.set_stance('force_eager'); sys.argv = sys.argv[1:]; "
              "runpy.run_path('bench.py', run_name='__main__')"] if eager else []
    return subprocess.run([sys.executable, *script, "bench.py", "--device=cpu", "--threads=1", "--model=t5-tiny",
                           "--input_length=32", "--steps=1", *args],
                          cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_the_table_runs_the_rows_of_the_dtype_and_compile_given():
    r = run_bench("--table=True", "--compile=False", "--dtype=float32", "--batch_size=2", "--burn_in=0")
    rows = [line.split()[:2] for line in r.stdout.splitlines() if line.lstrip().startswith(("float32", "tfloat32",
                                                                                           "bfloat16"))]
    assert r.returncode == 0 and rows == [["float32", "no"]], r.stdout + r.stderr


PEAK_SCRIPT = """
import bench, torch
torch.set_num_threads(1)
training_step, extra = bench.training_step, iter([2**27, 0])  # the first row's step holds 512 MiB more

def patched(*args, **kwargs):
    step, numel = training_step(*args, **kwargs), next(extra)

    def step_and_more():
        torch.ones(numel).add_(1)  # written, so resident
        step()
    return step_and_more
bench.training_step = patched
bench.print_table("cpu", "t5-tiny", 256, 4, 32, rows=[("float32", False)] * 2, burn_in=1, steps=1)
"""


def test_each_table_row_gets_its_own_peak_memory():
    # in a process of its own, started while this one holds 2 GiB: an earlier test's memory stays in this one, and
    # Linux's getrusage gives a process started by fork and exec the peak of its parent as well
    import os
    import subprocess
    import sys
    held = torch.ones(2**29)  # 2 GiB, resident
    r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], cwd=os.path.dirname(os.path.abspath(__file__)),
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    del held
    rows = [line.split() for line in r.stdout.splitlines() if line.lstrip().startswith("float32")]
    first, second = (float(row[6].removesuffix("GB")) for row in rows)  # the peak memory column
    assert second < first - 0.25 and first < 2, rows


def test_no_burn_in_still_prints_the_result():
    r = run_bench("--compile=True", "--dtype=float32", "--burn_in=0", eager=True)
    assert r.returncode == 0 and "ms/step" in r.stdout and "first call" not in r.stdout, r.stdout + r.stderr


def test_tfloat32_off_a_cuda_gpu_says_it_times_float32():
    r = run_bench("--dtype=tfloat32", "--compile=False", "--burn_in=0")
    assert r.returncode == 0 and "ms/step" in r.stdout, r.stdout + r.stderr
    assert r.stdout.startswith("no TF32 off an NVIDIA GPU: running in float32 instead\n"), r.stdout
    assert "| float32 | compile=False" in r.stdout.splitlines()[1], r.stdout  # the header: what runs


def test_side_by_side_reports_the_first_call_apart(capsys):
    calls = []
    bench.side_by_side(("a", lambda: calls.append("a")), ("b", lambda: calls.append("b")), 1, "op", steps=2,
                       burn_in=2, compiled=True)
    out = capsys.readouterr().out
    assert out.count("first call (compile):") == 2 and calls.count("a") == calls.count("b") == 4


def test_profile_prints_the_steps_kernels_and_the_attention_kernel(capsys):
    rt = setup_runtime("cpu", "float32")
    bench.bench_train(rt, *TINY, False, profile=True, **ONE_STEP)
    out = capsys.readouterr().out
    phases = next(line for line in out.splitlines() if line.startswith("one step by phase: "))
    assert re.fullmatch(r"one step by phase: forward [\d.]+ ms \| backward [\d.]+ ms \| clip [\d.]+ ms"
                        r" \| optimizer [\d.]+ ms", phases)
    assert "Self CPU time total" in out and "aten::mm" in out  # torch.profiler's table
    attention = next(line for line in out.splitlines() if line.startswith("attention: "))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in attention


def test_the_warm_up_compiles_the_optimizer_update_both_sides_share():
    """after warm_up_compiler, neither side's first call compiles AdamWScale's update again: each first call is its
    model's compile"""
    import torch._dynamo
    from optim import make_optimizer, param_groups
    torch._dynamo.reset()
    rt = setup_runtime("cpu", "float32")
    bench.warm_up_compiler(rt)
    t5 = bench.build_model(rt, "t5-tiny", 256)
    for p in t5.parameters():
        p.grad = torch.ones_like(p)
    optimizer = make_optimizer("adamwscale", param_groups(t5, 0.0), 1e-3, compile=True)
    with torch.compiler.set_stance("fail_on_recompile"):  # for this step alone
        optimizer.step()


@pytest.mark.parametrize("args, sides", [(["--compare=hf"], ["ours", "transformers"]),
                                         (["--part=optim"], ["AdamWScale", "AdamW(foreach=True)"])])
def test_compare_times_each_side_then_the_ratio(args, sides):
    r = run_bench(*args, "--compile=False", "--dtype=float32", "--batch_size=2", "--burn_in=0")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and [line.split(":")[0].strip() for line in lines[-3:-1]] == sides, r.stdout + r.stderr
    assert lines[-1].startswith(f"{sides[0]} / {sides[1]}: ") and "x the throughput" in lines[-1]
