"""torchrun on CPU (gloo): two trainer ranks under FSDP2 or DDP train the same weights as one process on
the same global batch, and a sharded run resumes exactly. Each run is a real `torchrun --nproc-per-node 2
train.py` on the tiny model; rank 0 rolls out (so the batches are the same as in one process) and every
rank trains on its share.

    python -m pytest tests/test_distributed.py        # ~1 minute on 2 cores
"""
import json
import os
import subprocess
import sys

import pytest

import torch
from safetensors.torch import load_file

from conftest import free_port, kill_group, run, spawn, start, together

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # torchrun runs of several steps: -m "not slow" skips them
# with a KL reference reset every 2 steps, so that the sharded reference (forward, reset, checkpoint) is covered
ARGS = ["--eval-data", "", "--train-groups", "4", "--prompts-per-step", "4", "--max-response-len", "32",
        "--segments", "4", "--dump-samples", "0", "--save-every", "1", "--keep-last", "0",
        "--kl-coef", "0.01", "--ref-reset-every", "2",
        "--lr-final", "1"]  # a constant learning rate: runs of different --steps are compared step by step


def train_run(out, *extra, ranks=2):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]  # --standalone: a free port, not the fixed 29500
    proc = run([*launcher, "train.py", *ARGS, "--out", str(out), *extra], timeout=600,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def weights(out, step):
    """The safetensors of checkpoint `step` in `out` (or of the folder `step`, e.g. "reference")."""
    sub = step if isinstance(step, str) else f"step_{step:06d}"
    return load_file(os.path.join(out, sub, "model.safetensors"))


def rel_diff(a, b):
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a)


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def two_nodes(out, *extra):
    """train.py under torchrun --nnodes 2 --nproc-per-node 1: two agents on 127.0.0.1, one trainer rank each."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{free_port()}"]
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", *common, "--node-rank", str(node), "train.py",
                        *ARGS, "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    second = start(cmd(1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = run(cmd(0), env=env, timeout=600)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 0 and first.returncode == 0, first.stderr[-3000:] + err[-3000:]
    finally:
        kill_group(second)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, FSDP2 and DDP on 2 ranks, and FSDP2 on two nodes: independent runs, side by side."""
    d = tmp_path_factory.mktemp("dist")
    together(lambda: train_run(d / "fsdp", "--steps", "4", "--parallel", "fsdp"),
             lambda: train_run(d / "one", "--steps", "3", ranks=1),
             lambda: train_run(d / "ddp", "--steps", "3", "--parallel", "ddp"),
             lambda: two_nodes(d / "nodes", "--steps", "3", "--parallel", "fsdp"))
    return d


@pytest.fixture(scope="module")
def from_step_2(runs, tmp_path_factory):
    """The FSDP2 run's step-2 checkpoint resumed on 2 ranks (--offload-optimizer true) and in one process (which
    must refuse), side by side."""
    d = tmp_path_factory.mktemp("from_step_2")
    saved = runs / "fsdp" / "step_000002"
    resumed, refused = together(
        lambda: train_run(d / "resumed", "--steps", "4", "--parallel", "fsdp", "--offload-optimizer", "true",
                          "--resume", str(saved)),
        lambda: run([sys.executable, "train.py", *ARGS, "--out", str(d / "refused"), "--steps", "5", "--resume",
                     str(saved)], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")))
    return {"saved": saved, "out": d / "resumed", "resumed": resumed, "refused": refused}


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_ranks_train_the_weights_of_one_process(runs, parallel):
    # step 2: the reference reset after it clears AdamW's moments, and Adam's first step after a reset turns
    # rounding-level gradients into +-lr steps (2.4e-4 relative was seen at step 3), so compare before that
    one, two = weights(runs / "one", 2), weights(runs / parallel, 2)
    start = load_file(os.path.join(ROOT, "tiny_ckpt", "model.safetensors"))
    moved = rel_diff({k: one[k] for k in start}, start)
    assert moved > 1e-3, "two steps of training must move the weights"
    assert rel_diff(one, two) < 1e-4, f"{parallel}: {rel_diff(one, two):.2e} vs one process (training moved {moved:.2e})"
    # the same rollouts and rewards: rank 0 samples as the single process does, and the gap between the
    # engine's log-probs and the (sharded) trainer's stays at rounding level
    a, b = records(runs / "one")[:3], records(runs / parallel)[:3]
    assert [r["reward/trained_mean"] for r in a] == [r["reward/trained_mean"] for r in b]
    assert [r["tokens/generated"] for r in a] == [r["tokens/generated"] for r in b]
    for r, s in zip(a, b):
        assert abs(r["mpt/masked_frac"] - s["mpt/masked_frac"]) < 1e-9
        assert abs(r["entropy/mean"] - s["entropy/mean"]) < 1e-5
        assert s["rollout/logprob_diff_max"] < 1e-4
    # micro-batches far from full here: the memory plan (sized for full ones) is an upper bound on every rank
    for recs in (records(runs / "one"), records(runs / parallel)):
        assert recs[0]["memory/plan_trainer_mib"] > max(r["memory/host_peak_mib"] for r in recs) > 0


def test_resume_on_another_world_size_is_refused(from_step_2):
    proc = from_step_2["refused"]
    assert proc.returncode != 0 and "saved by 2 trainer process(es), resumed with 1" in proc.stderr


def test_two_nodes_train_like_two_local_ranks(runs):
    """torchrun --nnodes 2: two agents on 127.0.0.1, one trainer rank each (rank 0 on node 0 owns the engine):
    the same records and weights as the 2-rank run on one node (both launched by `runs`)."""
    skip = {"time/step_s", "time/rollout_s", "time/sync_s", "tokens/per_s", "config", "git"}
    clean = lambda recs: [{k: v for k, v in r.items() if k not in skip and not k.startswith("memory/")} for r in recs]
    assert clean(records(runs / "nodes")) == clean(records(runs / "fsdp")[:3])
    assert rel_diff(weights(runs / "nodes", 3), weights(runs / "fsdp", 3)) == 0


LONG_EVAL = ["--steps", "1", "--eval-data", "tiny", "--eval-n", "2048", "--eval-every", "1", "--max-response-len", "64",
             "--dist-timeout", "10"]  # evaluations of ~20 s


def worker_pids(agent: int) -> dict[int, int]:
    """torchrun's workers under the agent `agent`, by their RANK."""
    pids = {}
    for child in subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            pids[int(env[b"RANK"])] = int(child)
    return pids


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_that_dies_ends_the_run_and_is_named(tmp_path, victim):
    """A rank killed while rank 0 evaluates (the others wait with no timeout): the run still ends within 60 s,
    and torchrun's report names the rank that died as the first failure."""
    import time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           *ARGS, *LONG_EVAL, "--out", str(tmp_path / "killed")]
    proc = start(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True)
    try:
        deadline = time.time() + 120
        while len(pids := worker_pids(proc.pid)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(pids) == 2, "torchrun's workers did not start"
        time.sleep(8)  # loaded, and rank 0 in its ~20 s evaluation before training
        metrics = tmp_path / "killed" / "metrics.jsonl"
        assert not metrics.exists() or not metrics.read_text(), "the evaluation ended before the kill"
        os.kill(pids[victim], 9)
        killed = time.time()
        _, err = proc.communicate(timeout=90)
        ended = time.time() - killed
    finally:
        kill_group(proc)
    assert proc.returncode != 0
    assert ended < 60, ended
    root = err[err.index("Root Cause"):]
    assert f"rank      : {victim} (local_rank: {victim})" in root and "SIGKILL" in root, root


def _offload_worker(rank, world, port):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy
    from systems import placement
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        policy, lm, _ = placement.load_sharded(os.path.join(ROOT, "tiny_ckpt"), offload=True)
        for module in [*lm.get_decoder().layers, policy]:
            assert isinstance(module._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
        assert all(p.device.type == "cpu" for p in lm.parameters())
        assert all(not torch.equal(b, torch.zeros_like(b)) for b in lm.buffers())  # rotary frequencies put back
    finally:
        dist.destroy_process_group()


def test_sharded_checkpoint_resumes_exactly_with_the_optimizer_offloaded(runs, from_step_2):
    """The 4-step run resumed from its step-2 checkpoint into another --out, with --offload-optimizer true:
    FSDP2's CPUOffloadPolicy on every sharded module (checked on 2 ranks of a gloo group); on CPU it moves nothing
    (pin_memory off), so the resumed run ends bit for bit where the straight one without it ended (what it
    saves on a GPU, the GPU check measures). One launch for both: a difference in either fails it."""
    spawn(_offload_worker, 2, free_port())
    saved, out, proc = from_step_2["saved"], from_step_2["out"], from_step_2["resumed"]
    assert {"trainer_state_rank0.pt", "trainer_state_rank1.pt"} <= set(os.listdir(saved))
    assert "optimizer state in host memory" in proc.stdout and f"resumed from {saved} at step 2" in proc.stdout
    assert sorted(os.listdir(out / "step_000004")) == sorted(os.listdir(runs / "fsdp" / "step_000004"))
    straight, resumed = weights(runs / "fsdp", 4), weights(out, 4)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), rel_diff(straight, resumed)
    straight, resumed = weights(runs / "fsdp" / "step_000004", "reference"), weights(out / "step_000004", "reference")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), rel_diff(straight, resumed)
    drop = {"time/step_s", "time/rollout_s", "time/sync_s", "tokens/per_s",  # and memory/*: measured
            "config"}  # the first record's: its --out differs
    clean = lambda recs: [{k: v for k, v in r.items() if k not in drop and not k.startswith("memory/")} for r in recs]
    assert [r["step"] for r in records(out)] == [3, 4]
    assert clean(records(out)) == clean(records(runs / "fsdp")[2:])
    # the gathered checkpoint is a plain HF model
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "step_000004")


def _gradient_memory_worker(rank, world, port, out):
    """tests/gpu/h200.py's gradient_memory on CPU: FSDP2 over gloo on `world` ranks (one process: no wrapper).
    Writes this rank's figures and, from rank 0, the weights before (one process) and after the two updates."""
    import importlib.util
    import torch.distributed as dist
    from systems import distributed
    spec = importlib.util.spec_from_file_location("gpu_h200", os.path.join(ROOT, "tests", "gpu", "h200.py"))
    h200 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h200)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    weights = []
    got = h200.gradient_memory("cpu", world, "fsdp" if world > 1 else "none", keep=lambda lm: weights.append(
        {n: distributed.full_tensor(p.detach()).clone() for n, p in lm.named_parameters()}))
    with open(os.path.join(out, f"held_{world}_{rank}.json"), "w") as f:
        json.dump(got, f)
    if rank == 0:
        torch.save(weights[-1], os.path.join(out, f"weights_{world}.pt"))
        if world == 1:
            torch.save(weights[0], os.path.join(out, "weights_start.pt"))
    if world > 1:
        dist.destroy_process_group()


def test_fsdp_gradients_stay_sharded_between_micro_batches(tmp_path):
    """FSDP2 with its gradient sync off (every micro-batch of an optimizer step but the last) keeps each
    parameter's gradient unsharded until the last: between micro-batches a rank held the whole model's gradients
    in fp32, twice its shard here, ~114 GiB at 30B. Measured on two gloo ranks with four micro-batches each, what
    a rank holds between them stays at its shard of the gradients; the weights after two updates (one micro-batch,
    then four) are one process's."""
    spawn(_gradient_memory_worker, 2, free_port(), str(tmp_path))
    spawn(_gradient_memory_worker, 1, 0, str(tmp_path))
    for rank in (0, 1):
        found = json.load(open(tmp_path / f"held_2_{rank}.json"))
        held, shard = found["held"], found["shard"]
        assert held["1"] == [] and len(held["4"]) == 3, held  # one micro-batch, then four
        assert 0.8 * shard < max(held["4"]) < 1.2 * shard, (rank, [b >> 20 for b in held["4"]], shard >> 20)
    one, two, start = (torch.load(tmp_path / f"weights_{name}.pt") for name in (1, 2, "start"))
    assert rel_diff(one, start) > 1e-3, "two updates must move the weights"
    assert rel_diff(one, two) < 1e-4, rel_diff(one, two)
