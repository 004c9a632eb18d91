"""bfloat16 runs keep fp32 master weights in every mode: at the papers' learning rate (1e-6) an update is far
below bf16's spacing, so AdamW steps fp32 masters and the model computes in bf16 (one process: a bf16 module
beside fp32 masters; FSDP2: its MixedPrecisionPolicy). On one batch the masters move as fp32 weights do; 2
FSDP2 ranks move them as one process does; the checkpoint keeps them (the HF export stays bf16), and a run
killed with SIGKILL resumes bit for bit. CPU (this CPU runs bf16), transformers engine.

    python -m pytest tests/test_bf16.py        # ~1 minute on 2 cores
"""
import copy
import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_group, run, start, together

import tiny
import ulorl
from config import parse_config
from naive import PROMPTS, ids, make_row
from segment_rollout import Pools, rollout_step
from systems import distributed
from systems import placement
from systems.engine import HFEngine, Sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
ARGS = ["--steps", str(STEPS), "--lr", "1e-6", "--lr-final", "1", "--eval-data", "", "--train-groups", "4",
        "--prompts-per-step", "4", "--max-response-len", "32", "--segments", "4", "--dump-samples", "0",
        "--save-every", "1", "--keep-last", "0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def command(out, ranks, *extra):
    launcher = TORCHRUN if ranks > 1 else [sys.executable]
    return [*launcher, "train.py", *ARGS, "--out", str(out), *extra]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1")  # one thread: bit-identical floating point run to run


def train(out, ranks, *extra):
    proc = run(command(out, ranks, *extra), timeout=600, env=env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def kill_and_resume(out, ranks, *extra):
    """The run SIGKILLed (every process of it) somewhere after step 2's record, then --resume auto."""
    proc = start(command(out, ranks, *extra), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            path = os.path.join(out, "metrics.jsonl")
            if os.path.exists(path) and sum(line.endswith("\n") for line in open(path)) >= 2:
                break
            time.sleep(0.05)
        time.sleep(random.Random().uniform(0, 1.0))  # mid-rollout, mid-update or mid-save
    finally:
        kill_group(proc)  # every process of it, torchrun's workers too
    return train(out, ranks, *extra, "--resume", "auto")


def masters(out, step=STEPS, sharded=True):
    """The fp32 master weights of checkpoint `step`, flattened in parameter order (each rank's shards
    joined along the first dimension, as FSDP2 splits them; DDP's ranks hold the same whole copy)."""
    states = sorted(f for f in os.listdir(os.path.join(out, f"step_{step:06d}")) if f.startswith("trainer_state"))
    if not sharded:
        states = states[:1]
    shards = [torch.load(os.path.join(out, f"step_{step:06d}", f), weights_only=True)["masters"] for f in states]
    return torch.cat([torch.cat(parts).flatten() for parts in zip(*shards)])


def flat(path):
    """A model's weights in fp32, flattened in parameter order."""
    from transformers import AutoModelForCausalLM
    return torch.cat([p.detach().flatten() for p in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).parameters()])


def updates(lm, groups, tok, kind, n=5):
    """n updates at lr 1e-6 on the same batch; kind: fp32, masters (bf16 compute over fp32 masters) or bf16
    (AdamW on the bf16 weights themselves). Returns the weights AdamW stepped, flattened."""
    lm = copy.deepcopy(lm)
    masters = distributed.MasterWeights(lm, torch.bfloat16) if kind == "masters" else None
    if kind == "bf16":
        lm.to(torch.bfloat16)
    cfg = parse_config(["--lr", "1e-6", "--lr-final", "1", "--steps", str(n), "--max-engine-kl", "0"])
    params = masters.parameters() if masters else list(lm.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    policy = placement.wrap(lm, "none")
    for _ in range(n):
        ulorl.update(policy, None, opt, sched, groups, 0, tok.pad_token_id, cfg, distributed.Ranks(masters=masters))
    return torch.cat([p.detach().float().flatten() for p in params])


@pytest.mark.slow  # in process, but 15 forward-backward passes: over a second
def test_masters_keep_updates_that_bf16_weights_round_away(tok):
    """The same batch, five updates at lr 1e-6: fp32 masters under bf16 compute move as fp32 weights do; AdamW
    on bf16 weights loses most of the change."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(tiny.CKPT, dtype=torch.float32)
    torch.set_num_threads(1)
    eng = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=0)
    pools = Pools()
    new = [pools.new_group(ids(tok, p), make_row(p), 4) for p in PROMPTS]
    rollout_step(eng, pools, new, 32, 32, Sampling(1.0), 0)
    groups = pools.ready_groups(4)
    for g in groups:  # informative: two right, two wrong in every group
        for i, s in enumerate(g):
            s.reward = float(i % 2)
    start_ = torch.cat([p.detach().flatten() for p in lm.parameters()])
    want = updates(lm, groups, tok, "fp32") - start_
    cos = {kind: torch.nn.functional.cosine_similarity(updates(lm, groups, tok, kind) - start_, want, dim=0).item()
           for kind in ("masters", "bf16")}
    assert cos["masters"] > 0.9, cos
    assert cos["bf16"] < 0.5, cos  # what the masters are for


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    bf16, fsdp = ["--dtype", "bfloat16"], ["--dtype", "bfloat16", "--parallel", "fsdp"]
    # independent runs side by side (the kills wait for step 2's record, whatever the load)
    runs = together(lambda: kill_and_resume(d / "fsdp_resumed", 2, *fsdp),
                    lambda: kill_and_resume(d / "one_resumed", 1, *bf16),
                    lambda: train(d / "fsdp", 2, *fsdp), lambda: train(d / "one", 1, *bf16),
                    lambda: train(d / "ddp", 2, "--dtype", "bfloat16", "--parallel", "ddp"))
    return dict(zip(["fsdp_resumed", "one_resumed", "fsdp", "one", "ddp"], runs))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_ranks_move_the_masters_like_one_process(runs, parallel):
    """2 ranks in bf16 (FSDP2: MixedPrecisionPolicy on gloo; DDP: MasterWeights, gradients all-reduced in fp32)
    against one process in bf16 (MasterWeights): the same rollouts (rank 0 samples with a bf16 copy), so their
    masters' change over 4 steps points the same way; the checkpoints' HF export is bf16."""
    start_ = flat(tiny.CKPT)
    two = masters(runs[parallel], sharded=parallel == "fsdp")
    cosine = torch.nn.functional.cosine_similarity(two - start_, masters(runs["one"]) - start_, dim=0).item()
    assert cosine > 0.99, cosine
    for mode in ("one", parallel):
        export = load_file(os.path.join(runs[mode], f"step_{STEPS:06d}", "model.safetensors"))
        assert {t.dtype for t in export.values()} == {torch.bfloat16}
        with open(os.path.join(runs[mode], f"step_{STEPS:06d}", "config.json")) as f:
            assert json.load(f)["dtype"] == "bfloat16"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one", "fsdp"])
def test_killed_bf16_run_resumes_bit_for_bit(runs, mode):
    assert torch.equal(masters(runs[mode]), masters(runs[f"{mode}_resumed"]))
    a = load_file(os.path.join(runs[mode], f"step_{STEPS:06d}", "model.safetensors"))
    b = load_file(os.path.join(runs[f"{mode}_resumed"], f"step_{STEPS:06d}", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
