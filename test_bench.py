"""bench.py's functions called directly, as a test or a notebook would: a tiny training step, and the first
(compiling) call reported apart."""

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
    assert mfu is None and not memory and first > 0  # no known peak, no GPU's memory on a CPU
    # with a peak given, MFU is the model's FLOPs per second over it
    dt, _, mfu, _, _ = bench.bench_train(rt, *TINY, False, peak_flops=1e12, **ONE_STEP)
    flops = flops_per_step(bench.build_model(rt, "t5-tiny", 256), 4, 32, TARGETS)
    assert mfu == pytest.approx(flops / dt / 1e12)


def run_bench(*args, eager=False, prelude=""):
    """bench.py as a command, on one CPU thread, t5-tiny; eager: with torch.compile's stance force_eager, so that
    --compile=True runs without compiling; prelude: Python run first, in the same process"""
    from test_train import forked
    prelude += "torch.compiler.set_stance('force_eager')\n" if eager else ""
    script = ["-c", f"import runpy, sys, torch\n{prelude}sys.argv = sys.argv[1:]\n"
              "runpy.run_path('bench.py', run_name='__main__')"] if prelude else []
    return forked([*script, "bench.py", "--device=cpu", "--threads=1", "--model=t5-tiny", "--input_length=32",
                   "--steps=1", *args], timeout=120)


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


def test_compare_times_each_side_then_the_ratio():
    sides = ["ours", "transformers"]
    r = run_bench("--compare=hf", "--compile=False", "--dtype=float32", "--batch_size=2", "--burn_in=0")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and [line.split(":")[0].strip() for line in lines[-3:-1]] == sides, r.stdout + r.stderr
    assert lines[-1].startswith(f"{sides[0]} / {sides[1]}: ") and "x the throughput" in lines[-1]
