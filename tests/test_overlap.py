"""--overlap 1: vLLM (in a process of its own, on CPU too) decodes the next step's whole rollout with the current
weights while the trainer updates. Every step after the first trains tokens one version old (staleness/engine_lag
1), so a probe from the engine on the weights just synced measures the engine/trainer gap on every step (fp32
noise: the sync reached the engine); a run killed between steps resumes bit for bit (the rollout decoded during
the last update is in the checkpoint's pools and run state). --overlap 0 is the synchronous loop, pinned by
tests/test_golden.py.

    python -m pytest tests/test_overlap.py      # ~1.5 minutes on 2 cores (three vLLM engine processes)
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

from conftest import run
import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
ARGS = ["--engine", "vllm", "--overlap", "1", "--is-mode", "sais", "--eval-data", "", "--train-groups", "4",
        "--prompts-per-step", "8", "--max-response-len", "32", "--segments", "2", "--dump-samples", "0",
        "--save-every", "1", "--keep-last", "0", "--lr-final", "1"]  # a constant learning rate: a run resumed to 3 steps is compared with a 3-step one
TIMING = ("time/", "memory/", "tokens/per_s", "config")


def train(out, *extra):
    proc = run([sys.executable, "train.py", *ARGS, "--out", str(out), *extra], cwd=ROOT, timeout=600,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_overlapped_rounds_are_one_version_old_and_resume_exactly(tmp_path):
    saved = tmp_path / "straight" / "step_000002"
    with ThreadPoolExecutor(1) as pool:
        straight = pool.submit(train, tmp_path / "straight", "--steps", "3")
        # a checkpoint appears whole (written aside, then renamed): the resumed run starts beside step 3
        while not saved.exists() and not straight.done():
            time.sleep(0.2)
        resumed = train(tmp_path / "resumed", "--steps", "3", "--resume", str(saved)) if saved.exists() else None
        straight = straight.result()
    assert resumed is not None, "the straight run saved no step 2"
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
    import placement
    with pytest.raises(ValueError, match="overlap needs an engine in a process of its own: --engine vllm"):
        placement.check_overlap(config.parse_config(["--overlap", "1", "--engine", "hf"]))
    with pytest.raises(ValueError, match="use --overlap 0 with a generative verifier"):
        placement.check_overlap(config.parse_config(["--overlap", "1", "--engine", "vllm", "--verifier-model", "j"]))
    gpu = config.parse_config(["--overlap", "1", "--engine", "vllm"])
    gpu.device = "cuda"
    with pytest.raises(ValueError, match="give it GPUs of its own with --rollout-gpus"):
        placement.check_overlap(gpu)
