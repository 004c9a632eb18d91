"""--overlap 1: vLLM (in a process of its own, on CPU too) decodes the next step's whole rollout with the current
weights while the trainer updates. Every step after the first trains tokens one version old (staleness/engine_lag
1), so a probe from the engine on the weights just synced measures the engine/trainer gap on every step (fp32
noise: the sync reached the engine); a run stopped between steps resumes bit for bit (the rollout decoded during
the last update is in the checkpoint's pools and run state). Two FSDP2 ranks under torchrun, whose rank 0 is slower
than --dist-timeout where the others wait for it. --overlap 0 is the synchronous loop, pinned by tests/test_golden.py.

    python -m pytest tests/test_overlap.py      # ~2.5 minutes on 2 cores (two runs, an engine process each)
"""
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from conftest import run, undocumented_metrics
import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ARGS = ["--steps", "3", "--parallel", "fsdp", "--engine", "vllm", "--overlap", "1", "--is-mode", "sais",
        "--train-groups", "4", "--prompts-per-step", "8", "--max-response-len", "32", "--segments", "2",
        "--dump-samples", "0", "--save-every", "1", "--keep-last", "0", "--dist-timeout", "5",
        "--eval-data", "tiny", "--eval-n", "4", "--eval-every", "100",  # an evaluation before training only
        "--lr-final", "1"]  # a constant learning rate: a run resumed to 3 steps is compared with a 3-step one
TIMING = ("time/", "memory/", "tokens/per_s", "config")


# train.py whose rank 0 is slow where the other ranks wait for it: the rollout decoded during the update and the
# evaluation before training take longer than --dist-timeout (the test's numbers never depend on the sleeps)
SLOW_RANK_0 = """import sys, threading, time
sys.path.insert(0, sys.argv.pop(1))
import rollouts
import train
real_ready, real_eval, evals = rollouts.Rollouts.until_ready, train.held_out, []
def slow_ready(self, *args):  # the rollout decoded during the update outlasts --dist-timeout
    if threading.current_thread().name == "rollout":
        time.sleep(9)
    return real_ready(self, *args)
def slow_eval(*args):  # the evaluation before training (rank 0's first) takes over twice --dist-timeout
    if not evals:
        time.sleep(11)
    evals.append(1)
    return real_eval(*args)
rollouts.Rollouts.until_ready, train.held_out = slow_ready, slow_eval
if __name__ == "__main__":  # vLLM's engine process starts by spawn
    train.main(train.parse_config())
"""


def train(out, *extra, script="train.py"):
    proc = run([*TORCHRUN, script, *extra, *ARGS, "--out", str(out)], cwd=ROOT, timeout=600,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert undocumented_metrics(recs) == []  # docs/outputs.md lists every key a run writes
    return recs


@pytest.mark.slow
def test_overlapped_rounds_are_one_version_old_and_resume_exactly(tmp_path):
    """Two FSDP2 ranks (rank 0 owns the engine), 3 steps with --dist-timeout 5, and rank 0 slow where the others
    wait for it with no timeout (on GPUs the collective timeout is NCCL's watchdog, and rank 0 may roll out for
    twenty minutes): an evaluation before training of twice --dist-timeout, which they wait for in the step's
    broadcast, outside the trainers' collectives; and the rollout decoded beside each update, 9 s, which rank 0
    waits for before the sync, where the other ranks used to wait inside the sync's gathers until the collective
    timeout ended the run. The run from its step-2 checkpoint (no sleeps) ends as it did."""
    script, saved = tmp_path / "slow_rank_0.py", tmp_path / "straight" / "step_000002"
    script.write_text(SLOW_RANK_0)
    with ThreadPoolExecutor(1) as pool:
        straight = pool.submit(train, tmp_path / "straight", ROOT, script=str(script))
        # a checkpoint appears whole (written aside, then renamed): the resumed run starts beside step 3
        while not saved.exists() and not straight.done():
            time.sleep(0.2)
        resumed = train(tmp_path / "resumed", "--resume", str(saved)) if saved.exists() else None
        straight = straight.result()
    assert resumed is not None, "the straight run saved no step 2"
    assert [r["step"] for r in straight] == [0, 1, 2, 3]
    assert straight[0]["time/step_s"] > 10, straight[0]
    assert all(r["time/engine_wait_s"] > 5 for r in straight[1:]), straight[1:]
    straight = straight[1:]
    assert [r["staleness/engine_lag"] for r in straight] == [0, 1, 1]
    assert all(r["staleness/token_max"] <= r["staleness/engine_lag"] + 1 for r in straight)  # + older segments
    # after step 1 no trained token is of the current weights: the probe alone measures the gap, on every step
    assert [r["staleness/token_mean"] >= 1 for r in straight] == [False, True, True]
    assert all(r["rollout/engine_kl"] is not None and r["rollout/engine_kl"] < 1e-9 for r in straight)
    state = json.loads((saved / "ulorl_state.json").read_text())
    assert state["prefetched"]["version"] == 1  # step 3's rollout, decoded during step 2's update by step 1's weights
    assert state["prefetched"]["record"]["rollout/rounds"] >= 1
    clean = lambda recs: [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in recs]
    assert clean(resumed) == clean(straight[2:])
    a, b = (load_file(tmp_path / run / "step_000003" / "model.safetensors") for run in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_overlap_needs_an_engine_of_its_own(capsys):
    with pytest.raises(SystemExit):
        config.parse_config(["--overlap", "1", "--is-mode", "tois", "--segments", "1"])
    assert "--overlap 1 trains tokens of the previous weights; --is-mode tois" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config.parse_config(["--overlap", "2"])
    assert "--overlap 2: must be 0 (off) or 1" in capsys.readouterr().err
    from systems import placement
    with pytest.raises(ValueError, match="overlap needs an engine in a process of its own: --engine vllm"):
        placement.check_overlap(config.parse_config(["--overlap", "1", "--engine", "hf"]))
    with pytest.raises(ValueError, match="use --overlap 0 with a generative verifier"):
        placement.check_overlap(config.parse_config(["--overlap", "1", "--engine", "vllm", "--verifier-model", "j"]))
    gpu = config.parse_config(["--overlap", "1", "--engine", "vllm"])
    gpu.device = "cuda"
    with pytest.raises(ValueError, match="give it GPUs of its own with --rollout-gpus"):
        placement.check_overlap(gpu)
