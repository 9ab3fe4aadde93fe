"""
FSDP (train.py --fsdp=True) on 2 CPU ranks over gloo, run as a user runs it: the same losses as one process, with
accumulation, activation checkpointing and torch.compile; half the state per rank, and never a whole model on a rank
(peak memory of a 201M-parameter T5); each block gathered twice a step; generation through FSDP's hooks; exact
kill-and-resume from sharded checkpoints, and a sharded checkpoint read back in one process and exported to Hugging
Face's format.
"""
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
from hf import save_pretrained
from prepare import prepare
from test_finetune import sni_dir  # noqa: F401 (a fixture)
from test_train import REPO, TINY, data_dir, read_log, run, start_until_step  # noqa: F401 (data_dir is a fixture)

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: the file's module fixtures built once

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# 8 steps, a checkpoint at step 4 and at the end
ARGS = [*TINY, "--max_steps=8", "--checkpoint_interval=4", "--eval_interval=1000"]


def kill_run(pid):
    """SIGKILL to torchrun and to the ranks it started, all at once, as a crashed node would end them (the ranks run in
    sessions of their own, which a signal to torchrun's process group would miss)"""
    ranks = []
    for children in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(children) as f:
            ranks += [int(child) for child in f.read().split()]
    for p in [pid, *ranks]:
        os.kill(p, signal.SIGKILL)


def state_mib(stdout):
    return float(re.search(r"parameters \+ optimizer state: ([\d.]+) MiB", stdout).group(1))


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):  # noqa: F811
    """one process (2 micro-steps) and 2 FSDP ranks (1 micro-step each) on the same global batches"""
    root = tmp_path_factory.mktemp("fsdp")
    out = {}
    for name, launch, extra in (("one", [], ["--grad_accum_steps=2"]), ("fsdp", TORCHRUN, ["--fsdp=True"])):
        out_dir = str(root / name)
        r = run([*launch, "train.py", *ARGS, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *extra])
        assert r.returncode == 0, r.stderr
        out[name] = out_dir, r.stdout
    return out


def test_two_fsdp_ranks_match_one_process(runs):
    # AdamWScale's RMS(p) needs the whole tensor, not a rank's slice: computed on the slices alone, the losses part
    # from step 2 on
    one, fsdp = read_log(runs["one"][0]), read_log(runs["fsdp"][0])
    assert one.keys() == fsdp.keys() == set(range(1, 9))
    for step in one:
        assert fsdp[step] == pytest.approx(one[step], rel=1e-4), step


def test_each_rank_holds_half_the_state(runs):
    one, fsdp = state_mib(runs["one"][1]), state_mib(runs["fsdp"][1])
    # weights + AdamWScale's two moments in fp32: 12 bytes per parameter, split over 2 ranks (+ padding of odd rows)
    t5 = model_from_checkpoint(load_checkpoint(find_checkpoint(runs["one"][0])))
    assert one == pytest.approx(12 * t5.num_params() / 2**20, rel=1e-3)
    assert fsdp == pytest.approx(one / 2, rel=0.01)


def two_nodes(args, nproc=2, cwds=(REPO, REPO), script=os.path.join(REPO, "train.py")):
    """train.py args (or script's) as 2 nodes of nproc gloo ranks each on this machine, each node in its folder of
    cwds: two torchrun launches, which meet at a free port; each node's (exit code, stdout, stderr)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = ["-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
              f"--master_port={port}"]
    nodes = [subprocess.Popen([sys.executable, *launch, f"--node_rank={node}", str(script), *args],
                              cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node, cwd in enumerate(cwds)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs)]


COUNTED = """
import atexit, collections, os, runpy, sys
import torch.distributed as dist
all_reduce, counts = dist.all_reduce, collections.Counter()
def counted(*args, group=None, **kwargs):  # all-reduces by the ranks of their group
    counts[str(dist.get_process_group_ranks(group) if group else "all")] += 1
    return all_reduce(*args, group=group, **kwargs)
dist.all_reduce = counted
atexit.register(lambda: print(f"rank {{os.environ['RANK']}} all-reduces: {{dict(counts)}}", flush=True))
sys.argv = [os.path.join({repo!r}, "train.py"), *sys.argv[1:]]
sys.path.insert(0, {repo!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("shard_across_nodes, share", [(False, 1 / 2), (True, 1 / 4)])
def test_two_nodes_shard_within_each_and_replicate_across(runs, data_dir, tmp_path, shard_across_nodes, share):
    # HSDP: each node holds the model sharded over its 2 ranks, so a rank holds half the state, and the nodes are
    # replicas; with shard_across_nodes one sharding over all 4 ranks, a quarter. Either logs one process's losses,
    # with 2 micro-steps a step, as the one process has.
    out = str(tmp_path / "out")
    script = tmp_path / "counted.py"
    script.write_text(COUNTED.format(repo=REPO))
    nodes = two_nodes([*ARGS, f"--data_dir={data_dir}", f"--out_dir={out}", "--fsdp=True", "--grad_accum_steps=2",
                       f"--shard_across_nodes={shard_across_nodes}"], script=script)
    assert [code for code, _, _ in nodes] == [0, 0], nodes
    stdout = nodes[0][1]
    one_dir, one_stdout = runs["one"]
    assert read_log(out) == pytest.approx(read_log(one_dir), rel=2e-3)
    assert state_mib(stdout) == pytest.approx(state_mib(one_stdout) * share, rel=0.01)
    # rank 0 and rank 2, on the other node, all-reduce each FSDP group's gradients once a step, after the last
    # micro-step: 10 groups (6 blocks, 2 relative_attention_bias tables, the embedding, the root) x 8 steps
    across = eval(re.search(r"rank 0 all-reduces: (.*)", stdout).group(1)).get("[0, 2]", 0)
    assert across == (0 if shard_across_nodes else 10 * 8)


def test_sharded_checkpoint_loads_into_one_process_and_exports(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    shards = os.path.join(runs["fsdp"][0], "ckpt")
    ckpt = load_checkpoint(find_checkpoint(shards))
    assert ckpt["step"] == 8 and sorted(os.listdir(shards)) == ["step-4", "step-8"]  # the newest two are kept
    ours = model_from_checkpoint(ckpt).eval()
    # the trained weights, not fresh ones: within float rounding of the one-process run's after the same 8 steps
    reference = load_checkpoint(find_checkpoint(runs["one"][0]))["model"]
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=2e-3 * reference[name].abs().max().item())
    # the README's export command, which reads the shards in one process
    r = run(["export.py", f"--init_from={runs['fsdp'][0]}", f"--out_dir={tmp_path / 'hf'}"])
    assert r.returncode == 0, r.stderr
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    torch.manual_seed(0)
    input_ids, labels = torch.randint(2, 200, (2, 12)), torch.randint(2, 200, (2, 7))
    with torch.no_grad():
        logits, _ = ours(input_ids, labels=labels)
        expected = theirs(input_ids=input_ids, labels=labels).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_fsdp_ranks_start_from_whole_weights_as_one_process(runs, data_dir, tmp_path):  # noqa: F811
    # --init_from a run's export to Hugging Face's safetensors, one file of the whole model: every rank maps the file
    # and copies out its own slices. 2 ranks log one process's losses from the same weights.
    ckpt = load_checkpoint(find_checkpoint(runs["one"][0]))
    hf = str(tmp_path / "hf")
    save_pretrained(model_from_checkpoint(ckpt), hf, ckpt["tokenizer"])  # as export.py writes it
    logs = {}
    for name, launch, start in (("one", [], hf), ("hf", TORCHRUN, hf)):
        out_dir = str(tmp_path / name)
        extra = ["--fsdp=True"] if launch else ["--grad_accum_steps=2"]
        r = run([*launch, "train.py", *ARGS, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--max_steps=3",
                 "--warmup_steps=1", f"--init_from={start}", *extra])
        assert r.returncode == 0, r.stderr
        logs[name] = read_log(out_dir)
    assert logs["one"].keys() == {1, 2, 3}
    assert logs["hf"] == pytest.approx(logs["one"], rel=1e-4)


def test_kill_and_resume_is_exact(runs, data_dir, tmp_path):  # noqa: F811
    straight = runs["fsdp"][0]
    killed = str(tmp_path / "killed")
    args = [*TORCHRUN, "train.py", *ARGS, f"--data_dir={data_dir}", f"--out_dir={killed}", "--fsdp=True"]
    proc = start_until_step(args, killed, 5)
    kill_run(proc.pid)  # no chance to save: only the step-4 checkpoint survives
    proc.wait()
    time.sleep(1)  # a rank still alive would go on logging
    assert 5 <= max(read_log(killed)) < 8
    assert find_checkpoint(killed) == os.path.join(killed, "ckpt", "step-4")

    r = run([*args, "--init_from=resume"])
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "at step 4" in r.stdout, r.stdout
    assert read_log(killed) == read_log(straight)  # bit-identical on CPU, every step


def test_a_run_resumes_in_any_mode_on_any_number_of_ranks(runs, data_dir, tmp_path):  # noqa: F811
    """One format for every run: one process's step-4 checkpoint resumes as 2 FSDP ranks, and FSDP's as one process,
    each logging the uninterrupted run's losses for steps 5 and 6 (DDP resumes as one process does: test_train.py)"""
    one, fsdp = runs["one"][0], runs["fsdp"][0]
    for name, source, launch, extra in (("fsdp", one, TORCHRUN, ["--fsdp=True"]),
                                        ("one", fsdp, [], ["--grad_accum_steps=2"])):
        out = tmp_path / name
        shutil.copytree(os.path.join(source, "ckpt", "step-4"), out / "ckpt" / "step-4")
        r = run([*launch, "train.py", *ARGS, f"--data_dir={data_dir}", f"--out_dir={out}", "--init_from=resume",
                 "--max_steps=6", *extra])
        assert r.returncode == 0, r.stderr
        resumed, straight = read_log(str(out)), read_log(one)
        assert resumed.keys() == {5, 6}
        for step in resumed:
            assert resumed[step] == pytest.approx(straight[step], rel=1e-4), (name, step)


def test_ranks_that_find_other_checkpoints_stop_together(runs, data_dir, tmp_path):  # noqa: F811
    # a relative out_dir, which the two nodes resolve in folders of their own: node 0's holds the run, node 1's
    # nothing. Every rank agrees on what it found, in one collective, and ends with the line (before, node 1's ranks
    # stopped with "no checkpoint", and node 0's waited for them up to an hour)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(os.path.join(runs["one"][0], "ckpt"), nodes[0] / "out" / "ckpt")
    nodes[1].mkdir()
    args = [os.path.join(REPO, ARGS[0]), *ARGS[1:], f"--data_dir={data_dir}", "--out_dir=out", "--init_from=resume"]
    results = two_nodes(args, nproc=1, cwds=nodes)
    line = ("error: the ranks found different checkpoints in out (None, out/ckpt/step-8): out_dir must be a folder "
            "every node sees\n")
    for code, _, stderr in results:
        assert code != 0 and line in stderr, stderr


@pytest.mark.parametrize("script", ["train.py", "finetune.py"])
def test_ranks_that_find_another_run_to_start_from_stop_together(runs, data_dir, sni_dir, tmp_path,  # noqa: F811
                                                                  script):
    # --init_from=run, a relative path each node resolves in a folder of its own: node 0 finds the run's newest
    # checkpoint, node 1 an older one (a save or a prune it has not seen yet). Every rank agrees on the path before
    # any rank reads it, and ends with the line (before, each loaded its own, and the ranks trained from different
    # weights)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(os.path.join(runs["one"][0], "ckpt"), nodes[0] / "run" / "ckpt")
    shutil.copytree(os.path.join(runs["one"][0], "ckpt", "step-4"), nodes[1] / "run" / "ckpt" / "step-4")
    common = [f"--data_dir={sni_dir}", "--device=cpu"] if script == "finetune.py" else [
        os.path.join(REPO, ARGS[0]), *ARGS[1:], f"--data_dir={data_dir}"]
    results = two_nodes([*common, "--out_dir=out", "--init_from=run"], nproc=1, cwds=nodes,
                        script=os.path.join(REPO, script))
    line = ("error: the ranks found different checkpoints in run (run/ckpt/step-4, run/ckpt/step-8): init_from must "
            "be a folder every node sees\n")
    for code, _, stderr in results:
        assert code != 0 and line in stderr, stderr


def test_half_written_checkpoint_is_never_taken(runs, tmp_path):
    """a run killed mid-save leaves a step folder without the .metadata that dcp.save writes last"""
    out = tmp_path / "out"
    shutil.copytree(os.path.join(runs["fsdp"][0], "ckpt"), out / "ckpt")
    (out / "ckpt" / "step-12").mkdir()
    shutil.copy(out / "ckpt" / "step-8" / "state.pt", out / "ckpt" / "step-12" / "state.pt")  # written first
    (out / "ckpt" / "step-12" / "__0_0.distcp").write_bytes(b"half")
    assert find_checkpoint(str(out)) == str(out / "ckpt" / "step-8")
    assert load_checkpoint(find_checkpoint(str(out)))["step"] == 8


# a sharded save on 2 ranks over gloo, with one rank's disk full from the second save on (writes past 2 KB fail)
FULL_DISK_SAVE = """
import os, resource, signal, sys
sys.path.insert(0, {repo!r})
import torch
from checkpoint import save_checkpoint
from distributed import join, shard_optimizer, sharded_t5
from model import T5Config
from optim import make_optimizer, param_groups
from runtime import setup_runtime
rt = setup_runtime("cpu", "float32", 0, fsdp=True)
join(rt)
t5 = sharded_t5(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                         num_heads=2), rt)
opt = shard_optimizer(make_optimizer("adamwscale", param_groups(t5, 0.0), 1e-3))
RUN = dict(program="train.py", config={{}}, meta=None, tokenizer=None)
save_checkpoint(sys.argv[1], t5, opt, 1, 0.0, RUN)
if rt.rank == {full_rank}:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
save_checkpoint(sys.argv[1], t5, opt, 2, 0.0, RUN)
"""


@pytest.mark.parametrize("full_rank", [0, 1])
def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path, full_rank):
    # every rank stops, none waits for the others, and the last complete checkpoint is the one a resume takes
    script = tmp_path / "save.py"
    script.write_text(FULL_DISK_SAVE.format(repo=REPO, full_rank=full_rank))
    out = tmp_path / "out"
    r = run([*TORCHRUN, str(script), str(out)])
    assert r.returncode != 0 and "Traceback" in r.stderr, r.stderr
    assert not os.path.exists(out / "ckpt" / "step-2" / ".metadata")
    assert find_checkpoint(str(out)) == str(out / "ckpt" / "step-1")
    assert load_checkpoint(find_checkpoint(str(out)))["step"] == 1


def test_finetune_from_a_sharded_checkpoint_matches_one_process(runs, sni_dir, tmp_path):  # noqa: F811
    """finetune.py --fsdp=True on 2 ranks from train.py's sharded checkpoint, against one process reading the same
    directory whole: the same weights after 3 steps, and the same predictions from generate() on the gathered ones.
    The loss is a mean over the step's label tokens: one micro-batch of all 4 examples logs the same."""
    common = ["finetune.py", f"--init_from={os.path.join(runs['fsdp'][0], 'ckpt')}",
              f"--data_dir={sni_dir}", "--device=cpu", "--max_num_instances_per_task=10", "--max_new_tokens=8",
              "--eval_batch_size=4", "--batch_size=4", "--max_steps=3", "--lr=1e-3", "--log_interval=1",
              "--dropout=0.0"]
    one, fsdp = str(tmp_path / "one"), str(tmp_path / "fsdp")
    r = run([*common, f"--out_dir={one}", "--grad_accum_steps=2"])
    assert r.returncode == 0, r.stderr
    r = run([*TORCHRUN, *common, f"--out_dir={fsdp}", "--fsdp=True"])
    assert r.returncode == 0, r.stderr
    ours_log, reference_log = read_log(fsdp), read_log(one)
    assert ours_log.keys() == reference_log.keys() == {1, 2, 3}
    for step in reference_log:
        assert ours_log[step] == pytest.approx(reference_log[step], rel=1e-4), step
    whole = str(tmp_path / "whole")
    assert run([*common, f"--out_dir={whole}"]).returncode == 0
    assert read_log(whole) == pytest.approx(reference_log, rel=1e-4)
    ours, reference = load_checkpoint(find_checkpoint(fsdp)), load_checkpoint(find_checkpoint(one))
    assert ours["step"] == reference["step"] == 3
    for name, tensor in reference["model"].items():
        torch.testing.assert_close(ours["model"][name], tensor, rtol=0, atol=1e-3 * tensor.abs().max().item())
    with open(os.path.join(one, "predictions.jsonl")) as f, open(os.path.join(fsdp, "predictions.jsonl")) as g:
        assert f.read() == g.read()


def test_finetune_evaluates_fewer_test_examples_than_ranks(runs, sni_dir, tmp_path):  # noqa: F811
    r = run([*TORCHRUN, "finetune.py", f"--init_from={os.path.join(runs['fsdp'][0], 'ckpt')}",
             f"--data_dir={sni_dir}", "--device=cpu", "--max_num_instances_per_task=1", "--max_new_tokens=4",
             "--eval_only=True", "--fsdp=True", f"--out_dir={tmp_path / 'eval'}"])
    assert r.returncode == 0, r.stderr
    assert json.load(open(tmp_path / "eval" / "metrics.json"))["num_examples"] == 1


def test_sample_reads_a_sharded_checkpoint(runs):
    from sample import encode, fill_in
    from tokenizer import tokenizer_of
    out = runs["fsdp"][0]
    text = "The river <extra_id_0> the city."
    r = run(["sample.py", f"--init_from={out}", f"--text={text}", "--device=cpu", "--max_new_tokens=8"])
    assert r.returncode == 0, r.stderr
    ckpt = load_checkpoint(find_checkpoint(out))
    tok, t5 = tokenizer_of(ckpt, out), model_from_checkpoint(ckpt).eval()
    ids = encode(tok, text)
    fill = t5.generate(torch.tensor([ids]), max_new_tokens=8)[0].tolist()
    assert f"model: {fill_in(tok, tok.decode(ids), fill)}\n" in r.stdout


# -----------------------------------------------------------------------------------------------------------------
# FSDP's groups, precision and activation checkpointing, in-process on 2 gloo ranks

GROUPS_SCRIPT = """
import collections, json, os, sys
sys.path.insert(0, {repo!r})
import torch
from model import T5, T5Config
from distributed import ShardedAdamWScale, clip_grad_norm, join, sharded_t5
from optim import AdamWScale, param_groups
from runtime import Runtime, checkpoint_activations, setup_runtime

join(setup_runtime("cpu", "float32", seed=0))  # joins the process group
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
config = T5Config(vocab_size=256, d_model=64, d_ff=128, num_heads=2, d_kv=32, num_layers=3, num_decoder_layers=3)
gathers = collections.Counter()  # all-gathers by the size of this rank's input: one size per group
all_gather_single = torch.distributed.all_gather_single
def counted(output, input, *args, **kwargs):
    gathers[input.numel()] += 1
    return all_gather_single(output, input, *args, **kwargs)
torch.distributed.all_gather_single = counted
generator = torch.Generator().manual_seed(1)
batch = dict(input_ids=torch.randint(2, 256, (4, 16), generator=generator),
             labels=torch.randint(2, 256, (4, 6), generator=generator))
mine = {{key: t.chunk(world)[rank] for key, t in batch.items()}}

def losses(dtype, fsdp, activation_checkpointing, steps=3):
    rt = Runtime("cpu", "cpu", dtype, fsdp, rank, rank, world)  # dtype as given: bf16 on any CPU
    torch.manual_seed(0)
    if fsdp:
        t5 = sharded_t5(config, rt, activation_checkpointing=activation_checkpointing)
    else:
        t5 = T5(config)
        if activation_checkpointing:
            checkpoint_activations(t5)
    model = t5
    opt = (ShardedAdamWScale if fsdp else AdamWScale)(model.parameters(), lr=1e-2)
    gathers.clear()
    out = []
    for _ in range(steps):  # train.py's step, of one micro-step
        with rt.autocast():
            _, loss = model(**(mine if fsdp else batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(t5.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if fsdp:  # the mean over the ranks' halves of the batch
            torch.distributed.all_reduce(loss)
            loss /= world
        out.append(loss.item())
    counts = dict(gathers)
    block = lambda b: sum(p.to_local().numel() for n, p in b.named_parameters() if "relative" not in n)
    sizes = dict(encoder_block=block(t5.encoder.blocks[1]), decoder_block=block(t5.decoder.blocks[1]),
                 shared=t5.shared.weight.to_local().numel()) if fsdp else {{}}
    generate_gathers = []  # of one generate() call, for 8 new tokens, 8 again and 4
    for max_new_tokens in (8, 8, 4):
        gathers.clear()
        with torch.no_grad(), rt.autocast():
            fills = t5.generate(mine["input_ids"], max_new_tokens=max_new_tokens).tolist()
        generate_gathers.append(dict(gathers))
    # each rank decoding as many tokens as it needs, here 3 and 8: none waits for another's rows
    with torch.no_grad(), rt.autocast(), torch.profiler.profile() as profile:
        uneven = t5.generate(mine["input_ids"], max_new_tokens=3 + 5 * rank).tolist()
    reduces = sum(event.name == "gloo:all_reduce" for event in profile.events())
    return dict(losses=out, gathers=counts, sizes=sizes, fills=fills, generate_gathers=generate_gathers,
                uneven=uneven, decoding_all_reduces=reduces)

def adamwscale_all_reduces():  # of an AdamWScale step under FSDP: its second (the first also makes its state)
    t5 = sharded_t5(config, Runtime("cpu", "cpu", "float32", True, rank, rank, world))
    opt = ShardedAdamWScale(param_groups(t5, weight_decay=0.0), lr=1e-2)  # 2 groups
    for _ in range(2):
        t5(**mine)[1].backward()
        with torch.profiler.profile() as profile:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return sum(event.name == "gloo:all_reduce" for event in profile.events())

results = {{f"{{dtype}} {{fsdp}} {{ac}}": losses(dtype, fsdp, ac) for dtype in ("float32", "bfloat16")
           for fsdp in (False, True) for ac in (False, True)}}
results["adamwscale_all_reduces"] = adamwscale_all_reduces()

def clip_all_reduces():  # of clipping the gradients under FSDP: the total norm, reduced once
    t5 = sharded_t5(config, Runtime("cpu", "cpu", "float32", True, rank, rank, world))
    t5(**mine)[1].backward()
    with torch.profiler.profile() as profile:
        clip_grad_norm(t5, 1.0)
    return sum(event.name == "gloo:all_reduce" for event in profile.events())

results["clip_all_reduces"] = clip_all_reduces()
if rank == 0:
    print(json.dumps(results), flush=True)
torch.distributed.destroy_process_group()
os._exit(0)  # no interpreter finalization: gloo's threads may still hold tensors of FSDP's async collectives, whose
# release then aborts the process (about 1 run in 14 here, under load)
"""


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    script = tmp_path_factory.mktemp("groups") / "groups.py"
    script.write_text(GROUPS_SCRIPT.format(repo=os.path.dirname(os.path.abspath(__file__))))
    r = run([*TORCHRUN, str(script)])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_and_activation_checkpointing_keep_one_process_losses(groups, dtype):
    one = groups[f"{dtype} False False"]["losses"]
    tolerance = 1e-5 if dtype == "float32" else 5e-3  # bf16: FSDP gathers the blocks' weights in bf16
    for fsdp, ac in ((False, True), (True, False), (True, True)):
        assert groups[f"{dtype} {fsdp} {ac}"]["losses"] == pytest.approx(one, rel=tolerance), (fsdp, ac)


@pytest.mark.parametrize("ac", [False, True])
def test_each_block_is_gathered_once_in_forward_and_once_in_backward(groups, ac):
    run = groups[f"float32 True {ac}"]
    sizes, gathers = run["sizes"], run["gathers"]
    steps, layers = 3, 3
    assert sizes["encoder_block"] != sizes["decoder_block"]
    assert gathers[str(sizes["encoder_block"])] == 2 * layers * steps
    assert gathers[str(sizes["decoder_block"])] == 2 * layers * steps
    assert gathers[str(sizes["shared"])] == steps  # the embedding stays gathered from forward to backward


def test_generate_gathers_each_block_once_for_any_number_of_tokens(groups):
    run = groups["float32 True False"]
    sizes, (first, eight, four) = run["sizes"], run["generate_gathers"]
    assert four == eight  # as often for 8 new tokens as for 4: not at every decoding step
    for gathers in (first, eight):  # the first gathers the embedding and the root too, which stay gathered
        assert gathers[str(sizes["encoder_block"])] == gathers[str(sizes["decoder_block"])] == 3  # once a layer


def test_each_rank_stops_decoding_when_its_own_rows_are_done(groups):
    # under FSDP every block is gathered for the whole generate() call, so that its decoding steps hold no collective:
    # a rank decoding fewer tokens than another neither waits for it nor leaves it waiting (before, the ranks agreed at
    # every step, and a rank that stopped left the others waiting), and gives one process's tokens
    for dtype in ("float32", "bfloat16"):
        one, fsdp = groups[f"{dtype} False False"], groups[f"{dtype} True False"]
        assert fsdp["uneven"] == one["uneven"] and fsdp["decoding_all_reduces"] == 0


def test_adamwscale_under_fsdp_reduces_all_tensors_at_once(groups):
    # 75 tensors in 2 groups; each group's step sums the squares of its tensors' slices over the ranks, for RMS(p), in
    # one all-reduce, not one a tensor
    assert groups["adamwscale_all_reduces"] == 2


def test_the_gradient_norm_is_reduced_once(groups):
    # torchtitan's order: the total norm of each rank's slices, one all-reduce, then clipping with that norm
    assert groups["clip_all_reduces"] == 1


def test_fsdp_generates_through_its_hooks(groups):
    # generate() on the sharded model, every rank running all its steps, gives one process's tokens for this rank's
    # rows, in fp32 and bf16
    for dtype in ("float32", "bfloat16"):
        one, fsdp = groups[f"{dtype} False False"]["fills"], groups[f"{dtype} True False"]["fills"]
        assert fsdp == one[:len(fsdp)]


def test_compiled_fsdp_with_accumulation_and_checkpointing_matches_one_process(data_dir, tmp_path):  # noqa: F811
    """torch.compile per block under FSDP, 2 micro-steps a step and activation checkpointing: the losses of one
    process (2 micro-steps, eager, no checkpointing)"""
    args = [*ARGS, f"--data_dir={data_dir}", "--max_steps=3", "--warmup_steps=3", "--grad_accum_steps=2"]
    one, out_dir = str(tmp_path / "one"), str(tmp_path / "compiled")
    assert run(["train.py", *args, f"--out_dir={one}"]).returncode == 0
    r = run([*TORCHRUN, "train.py", *args, f"--out_dir={out_dir}", "--fsdp=True", "--activation_checkpointing=True",
             "--compile=True"])
    assert r.returncode == 0, r.stderr
    one, compiled = read_log(one), read_log(out_dir)
    assert compiled.keys() == {1, 2, 3}
    for step in compiled:
        assert compiled[step] == pytest.approx(one[step], rel=1e-4), step


# -----------------------------------------------------------------------------------------------------------------
# peak memory per rank of a 201M-parameter T5 (t5-v1_1-base's shapes, a vocab of 2,048): never the whole model

PEAK = """
import atexit, os, runpy, sys
peak_file = f"{{sys.argv[0]}}.{{os.environ.get('RANK', '0')}}.peak"
def report():  # this process's peak resident memory, KiB
    with open("/proc/self/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM")).split()[1]
    with open(peak_file, "w") as f:
        f.write(peak)
atexit.register(report)
sys.argv = [os.path.join({repo!r}, "train.py"), *sys.argv[1:]]
sys.path.insert(0, {repo!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """Peak resident memory (MiB) per rank: one process for a step of 2 micro-steps followed by a save and an
    evaluation; 2 FSDP ranks starting from its weights (its checkpoint), which is everything a new run does (each rank
    draws its slices, takes the step, saves, evaluates) and a whole checkpoint read, then resuming from their own
    sharded checkpoint. And each command's with t5-mini, which the test subtracts, so that imports, data and gloo
    cancel out (as its checkpoints are small, t5-mini's new run serves for a start and a resume)"""
    root = tmp_path_factory.mktemp("peaks")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(3000):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))}) + "\n")
    data = str(root / "data")
    prepare(dataset=str(root / "corpus.jsonl"), tokenizer="train", out_dir=data, vocab_size=1900)
    common = ["config/t5_tiny.py", "--device=cpu", "--dtype=float32", "--compile=False", "--input_length=16",
              "--batch_size=4", "--grad_accum_steps=2", "--eval_steps=1", "--warmup_steps=1",
              "--log_interval=1", "--time_budget_hours=0",
              f"--data_dir={data}", "--checkpoint_interval=1", "--eval_interval=1"]
    env = dict(MALLOC_MMAP_THRESHOLD_="65536")  # glibc gives freed blocks back: the peak is of live memory
    out = {}
    for model, name, case, extra in (
            ("t5-v1_1-base", "one", "step", ["--max_steps=1"]),
            ("t5-v1_1-base", "fsdp", "start", ["--max_steps=1", f"--init_from={root / 't5-v1_1-base-one'}"]),
            ("t5-v1_1-base", "fsdp", "resume", ["--max_steps=2", "--init_from=resume"]),
            ("t5-mini", "one", "step", ["--max_steps=1"]),
            ("t5-mini", "fsdp", "step", ["--max_steps=1"])):
        launch, fsdp = (TORCHRUN, ["--fsdp=True"]) if name == "fsdp" else ([], [])
        script = root / f"{model}-{name}-{case}.py"
        script.write_text(PEAK.format(repo=os.path.dirname(os.path.abspath(__file__))))
        r = run([*launch, str(script), *common, f"--model={model}", f"--out_dir={root / f'{model}-{name}'}", *fsdp,
                 *extra], env_extra=env)
        assert r.returncode == 0, r.stderr
        out[model, name, case] = [int((root / f"{script.name}.{rank}.peak").read_text()) / 1024
                                  for rank in range(2 if launch else 1)]
    print("peak MiB per rank:", out)  # pytest -s shows them
    return out


@pytest.mark.xdist_group("test_fsdp peaks")  # its own fixture, 3 minutes: beside the file's other tests
@pytest.mark.parametrize("case", ["start", "resume"])
def test_no_fsdp_rank_holds_the_whole_model(peaks, case):
    """One process holds the weights, their gradients and AdamWScale's two moments, 16 bytes per parameter; each of
    2 FSDP ranks half of that, plus gathered blocks and activations, whatever it does: a new run's draw, a step of 2
    micro-steps, a save and an evaluation, a start from another run's whole weights, a resume. Whole weights on a
    rank (an unsharded copy to generate with, whole gradients while accumulating, a whole checkpoint read to resume
    or start from) would each add 768 MiB."""
    parameters = 201.4e6 - 2.0e6  # t5-v1_1-base's less t5-mini's, each with a vocab of 2,048
    one = peaks["t5-v1_1-base", "one", "step"][0] - peaks["t5-mini", "one", "step"][0]
    assert 16 * parameters / 2**20 < one < 17 * parameters / 2**20
    for base, mini in zip(peaks["t5-v1_1-base", "fsdp", case], peaks["t5-mini", "fsdp", "step"]):
        assert base - mini < one / 2 + 250  # MiB: 2 gathered blocks and their gradients, 144 MiB in fp32
