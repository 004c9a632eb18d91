"""Nothing lost: a run killed with SIGKILL and resumed with --resume auto ends exactly where an uninterrupted
run ends; unfinished samples survive the crash; damaged checkpoints are skipped; a NaN loss is skipped;
SIGTERM leaves a loadable checkpoint. CPU, fp32, transformers engine.

    python -m pytest tests/test_resume.py
"""
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

from conftest import kill_group, run, start, together
import outdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # 8-step runs, killed and resumed: -m "not slow" skips them
ARGS = ["--steps", "8", "--save-every", "1", "--keep-last", "0", "--eval-n", "16", "--eval-every", "3",
        "--train-groups", "4", "--prompts-per-step", "4", "--max-response-len", "32", "--segments", "4"]
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


def test_resume_after_sigkill_is_exact(uninterrupted, killed_and_resumed):
    killed, saved = killed_and_resumed
    a = load_file(os.path.join(uninterrupted, "step_000008", "model.safetensors"))
    b = load_file(os.path.join(killed, "step_000008", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(uninterrupted / "metrics.jsonl"), records(killed / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(9))  # no step lost or repeated
    assert without_timing(ra) == without_timing(rb)
    assert records(uninterrupted / "samples.jsonl") == records(killed / "samples.jsonl")


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
