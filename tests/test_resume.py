"""Nothing lost: a run resumed from any of its checkpoints ends exactly where an uninterrupted run ends (in this
process, every part of the state a checkpoint keeps in play: the unfinished pool, surplus ready groups, the data
cursor, AdamW and the schedule, the reference and its reset, the best held-out accuracy); a run killed with
SIGKILL and resumed with --resume auto does too; unfinished samples survive the crash; damaged checkpoints are
skipped; SIGTERM leaves a loadable checkpoint. CPU, fp32, transformers engine.

    python -m pytest tests/test_resume.py
"""
import copy
import json
import os
import random
import signal
import shutil
import subprocess
import sys
import time

import pytest

import torch
from safetensors.torch import load_file

import harness
from conftest import kill_group, run, start, together
from systems import outdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every group trains (no dynamic sampling): the samples a checkpoint holds unfinished are trained after the crash,
# whichever of checkpoints 3-5 the kill leaves (with it, those of 4 and 5 were all in all-equal groups, dropped)
ARGS = ["--steps", "8", "--save-every", "1", "--keep-last", "0", "--eval-n", "16", "--eval-every", "3",
        "--train-groups", "4", "--prompts-per-step", "4", "--max-response-len", "32", "--segments", "4",
        "--dynamic-sampling", "false"]
TIMING = {"time/step_s", "time/rollout_s", "time/sync_s", "tokens/per_s", "config"}  # may differ (config: --out), as memory/* do


def command(out, *extra):
    return [sys.executable, "train.py", *ARGS, "--out", str(out), *extra]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1")  # one thread: bit-identical floating point run to run


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def without_timing(recs):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("memory/")} for r in recs]


def wait_for_step(out, step, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        path = os.path.join(out, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                steps = [json.loads(line)["step"] for line in f if line.endswith("\n")]
            if steps and steps[-1] >= step:
                return
        time.sleep(0.05)
    raise TimeoutError(f"no record of step {step} in {timeout} s")


def run_whole(out):
    p = run(command(out), cwd=ROOT, env=env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def kill_and_resume(out):
    proc = start(command(out), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(out, 3, proc)
        time.sleep(random.Random().uniform(0, 1.0))  # somewhere in step 4 or 5: mid-rollout, mid-update, mid-save
        proc.send_signal(signal.SIGKILL)  # the trainer alone, as kill -9 PID does
        proc.wait()
    finally:
        kill_group(proc)  # and whatever it left behind
    resume_from = outdir.find_resume("auto", str(out))
    with open(os.path.join(resume_from, "ulorl_state.json")) as f:
        saved = json.load(f)
    p = run(command(out, "--resume", "auto"), cwd=ROOT, env=env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {resume_from} at step {saved['step']}" in p.stdout
    return out, saved


def terminate(out):
    """A long run sent SIGTERM after its first step: (out, returncode, stdout, stderr)."""
    proc = start(command(out) + ["--steps", "100", "--save-every", "0"], env=env(), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out, 1, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    return out, proc.returncode, stdout, stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The file's three runs at once (each a one-thread process): the uninterrupted run, the one killed and
    resumed, and the one sent SIGTERM."""
    made = [tmp_path_factory.mktemp(name) for name in ("whole", "killed", "term")]
    return together(lambda: run_whole(made[0]), lambda: kill_and_resume(made[1]), lambda: terminate(made[2]))


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return runs[0]


@pytest.fixture(scope="module")
def killed_and_resumed(runs):
    return runs[1]


# 4 segments, surplus groups (1 trains a step, 4 are decoded), 2 updates a step, a KL reference reset every 2 steps,
# an evaluation every 2 steps with the stall trigger armed: every part of the state a checkpoint keeps matters
IN_PROCESS = ["--steps", "3", "--save-every", "1", "--keep-last", "0", "--eval-n", "8", "--eval-every", "2",
              "--train-groups", "1", "--prompts-per-step", "4", "--group-size", "4", "--max-response-len", "32",
              "--segments", "4", "--mini-batch", "2", "--kl-coef", "0.05", "--ref-reset-every", "2",
              "--ref-reset-on-stall", "1", "--lr-decay-steps", "2", "--dump-samples", "16"]


@pytest.fixture(scope="module")
def whole_in_process(tmp_path_factory):
    out = harness.train_run(IN_PROCESS, tmp_path_factory.mktemp("whole"))
    seen = harness.observe(out)
    assert [r["rollout/unfinished"] > 0 for r in seen["records"][1:3]] == [True, True]  # checkpoints 1, 2 hold some
    assert any(len(set(s["versions"])) > 1 for s in seen["samples"])  # samples decoded across steps train
    assert seen["resets"] == [2, 3] and len(seen["evals"]) == 3  # every 2 steps; at 3, the held-out accuracy stalled
    return out


def state_of(checkpoint: str) -> dict:
    """What a checkpoint holds but its run id: the run state, the pools, the weights and the reference."""
    with open(os.path.join(checkpoint, "ulorl_state.json")) as f:
        saved = {k: v for k, v in json.load(f).items() if k not in ("run_id", "config", "git")}
    for name in ("model.safetensors", os.path.join("reference", "model.safetensors")):
        saved[name] = {k: v.tolist() for k, v in load_file(os.path.join(checkpoint, name)).items()}
    trainer = torch.load(os.path.join(checkpoint, "trainer_state_rank0.pt"), weights_only=True)
    saved["optimizer"] = {i: {k: v.tolist() if torch.is_tensor(v) else v for k, v in st.items()}
                          for i, st in trainer["optimizer"]["state"].items()}
    saved["scheduler"], saved["engine_rng"] = trainer["scheduler"], trainer["engine_rng"].tolist()
    return saved


@pytest.mark.parametrize("step", [1, 2])
def test_a_run_resumed_from_any_checkpoint_ends_where_the_whole_run_ends(whole_in_process, tmp_path, step):
    """In this process: a copy of the whole run's --out resumed from its step-N checkpoint writes again the
    records, the samples and the checkpoints of steps N+1.. the whole run wrote (its files cut back to step N
    first), every value equal."""
    whole, resumed = whole_in_process, str(tmp_path / "run")
    shutil.copytree(whole, resumed)
    harness.train_run([*IN_PROCESS, "--resume", os.path.join(resumed, f"step_{step:06d}")], resumed)
    a, b = harness.observe(whole), harness.observe(resumed)
    assert b["records"] == a["records"] and b["samples"] == a["samples"]
    for later in range(step + 1, 4):
        name = f"step_{later:06d}"
        assert state_of(os.path.join(resumed, name)) == state_of(os.path.join(whole, name)), name


def test_a_checkpoint_gives_back_every_part_of_the_state_it_saved(tmp_path):
    """checkpoint.load after checkpoint.save, into fresh objects of a process whose random streams moved on: the
    unfinished samples, the experience pool and the ready groups (every field of every sample), the run state,
    AdamW's moments, the schedule, the engine's, torch's and Python's random streams are what was saved (a run
    decodes only a few of these in a short test: each is compared here as saved)."""
    import config
    import random
    import model as model_lib
    import tiny
    import ulorl
    from segment_rollout import Pools, Sample
    from systems import checkpoint
    from systems.engine import HFEngine, Sampling

    def sample(uid, group, n, finish, version):
        return Sample(uid, group, [3, 4, 5], {"prompt": "1+2=", "answer": "3", "verifier": "tiny"},
                      tokens=list(range(5, 5 + n)), logprobs=[-0.5 - i / 10 for i in range(n)],
                      versions=[version - 1] * (n // 2) + [version] * (n - n // 2), seg_starts=[0, n // 2],
                      finish=finish, reward=None if finish is None else 1.0)

    def fresh(lm):
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1 / (u + 1))

    lm, tok = model_lib.load(tiny.CKPT)
    engine = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=3)
    engine.generate([[3, 4, 5]], [2], Sampling(1.0))  # a request without keys moves the engine's own stream
    opt, sched = fresh(lm)
    lm(input_ids=torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss.backward()
    opt.step()
    sched.step()
    sched.step()
    pools = Pools(unfinished=[sample(0, 0, 6, None, 2)], experience={0: [sample(1, 0, 4, "eos", 2)]}, next_uid=9,
                  next_group=3)
    state = ulorl.RunState(step=3, version=2, cursor=17, ready=[[sample(4, 1, 5, "eos", 2), sample(5, 1, 8,
                           "truncated", 2)]], bad_steps=1, run_id="run", best_eval=0.5, evals_since_best=1,
                           engine_kl=[1e-5, 2e-5])
    torch.manual_seed(11)
    random.seed(12)
    saved = {"pools": copy.deepcopy(pools), "state": copy.deepcopy(state), "opt": copy.deepcopy(opt.state_dict()),
             "sched": sched.state_dict(), "engine": engine.rng_state(), "torch": torch.get_rng_state(),
             "python": random.getstate()}
    cfg = config.parse_config(["--out", str(tmp_path), "--eval-data", ""])
    with outdir.Folder.at(str(tmp_path)) as out:
        checkpoint.save(out, "step_000003", lm, None, tok, opt, sched, engine, pools, state, cfg)

    torch.manual_seed(99)
    random.seed(99)
    engine.generate([[3, 4]], [3], Sampling(1.0))
    opt, sched = fresh(lm)
    pools, state = Pools(), ulorl.RunState()
    checkpoint.load(str(tmp_path / "step_000003"), opt, sched, engine, pools, state)
    assert (pools, state) == (saved["pools"], saved["state"])
    now = opt.state_dict()
    assert now["param_groups"] == saved["opt"]["param_groups"] and now["state"].keys() == saved["opt"]["state"].keys()
    assert all(torch.equal(v, saved["opt"]["state"][i][k]) for i, st in now["state"].items() for k, v in st.items())
    assert sched.state_dict() == saved["sched"]
    assert torch.equal(engine.rng_state(), saved["engine"]) and torch.equal(torch.get_rng_state(), saved["torch"])
    assert random.getstate() == saved["python"]


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(uninterrupted, killed_and_resumed):
    killed, saved = killed_and_resumed
    a = load_file(os.path.join(uninterrupted, "step_000008", "model.safetensors"))
    b = load_file(os.path.join(killed, "step_000008", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(uninterrupted / "metrics.jsonl"), records(killed / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(9))  # no step lost or repeated
    assert without_timing(ra) == without_timing(rb)
    assert records(uninterrupted / "samples.jsonl") == records(killed / "samples.jsonl")


@pytest.mark.slow
def test_unfinished_samples_survive_the_crash(killed_and_resumed):
    out, saved = killed_and_resumed
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "step_000008"))
    unfinished = {d["uid"]: d for d in saved["pools"]["unfinished"]}
    assert unfinished, "the checkpoint held no unfinished sample; the test proves nothing"
    trained = records(out / "samples.jsonl")
    uids = [s["uid"] for s in trained]
    assert len(uids) == len(set(uids)), "a sample was trained twice"
    after = [s for s in trained if s["uid"] in unfinished]
    assert after, "no sample cut before the crash finished after it"
    for s in after:
        d = unfinished[s["uid"]]
        assert s["step"] > saved["step"]
        assert s["response"].startswith(tok.decode(d["tokens"], skip_special_tokens=True))
        assert s["versions"][:len(d["seg_starts"])] == [d["versions"][i] for i in d["seg_starts"]]
        assert s["n_tokens"] > len(d["tokens"])


@pytest.mark.slow
def test_resume_auto_skips_damaged_checkpoints(uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    os.makedirs(out / "step_000009.tmp")  # a save that was interrupted
    assert outdir.find_resume("auto", str(out)) == str(out / "step_000008")
    with open(out / "step_000008" / "model.safetensors", "r+b") as f:  # truncated newest
        f.truncate(1000)
    with open(out / "step_000007" / "ulorl_state.json", "r+b") as f:  # one flipped byte in the next
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    assert outdir.find_resume("auto", str(out)) == str(out / "step_000006")
    err = capsys.readouterr().err
    assert "step_000008: model.safetensors has 1000 bytes" in err and "step_000007: ulorl_state.json" in err


@pytest.mark.slow
def test_sigterm_saves_a_loadable_checkpoint(runs):
    out, returncode, stdout, stderr = runs[2]
    assert returncode == 0, stderr[-3000:]
    last = records(out / "metrics.jsonl")[-1]["step"]
    assert f"stopped by SIGTERM after step {last}" in stdout
    ckpt = out / f"step_{last:06d}"
    assert outdir.problem(str(ckpt)) is None
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.model_type == "qwen3"
    assert not [d for d in os.listdir(out) if d.endswith(".tmp")]
