"""Nothing silently wrong: every flag is checked before anything loads, an output folder holding a run is never
written over or mixed, and bad data rows, sampling edge values and NaN statistics get clear handling.

    python -m pytest tests/test_errors.py
"""
import hashlib
import json
import math
import os
import shutil
import sys
import time

import pytest

import torch

from conftest import run
import config
import data
import tiny
from systems import outdir
from systems import logs
from systems.engine import Sampling, process_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--steps", "2", "--eval-n", "8", "--train-groups", "2", "--prompts-per-step", "2", "--max-response-len", "16",
       "--segments", "2"]


def run_train(*args, timeout=300):
    return run([sys.executable, "train.py", *args], timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


# ------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, message", [
    (["--segments", "0"], "--segments 0: must be >= 1"),
    (["--group-size", "0"], "--group-size 0: must be >= 2"),
    (["--group-size", "1"], "--group-size 1: must be >= 2: GRPO's advantage compares"),
    (["--prompts-per-step", "0"], "--prompts-per-step 0: must be >= 1"),
    (["--temperature", "0"], "--temperature 0.0: must be > 0"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--mpt", "bogus"], "argument --mpt: invalid choice: 'bogus'"),
    (["--mpt-tau", "2"], "--mpt-tau 2.0: must be in (0, 1]"),
    (["--is-mode", "bogus"], "argument --is-mode: invalid choice: 'bogus'"),
    (["--default-verifier", "bogus"], "argument --default-verifier: invalid choice: 'bogus'"),
    (["--lr", "-1"], "--lr -1.0: must be > 0"),
    (["--pack", "flase"], "argument --pack: expected true or false (or 1/0, yes/no), got 'flase'"),
    (["--dynamic-sampling", "maybe"], "argument --dynamic-sampling: expected true or false"),
    (["--eps-low", "nan"], "--eps-low nan: must be a finite number"),
    (["--clip-ratio-c", "0.5"], "--clip-ratio-c 0.5: must be 0 (off) or > 1"),
    (["--preset", "bogus"], "argument --preset: invalid choice: 'bogus'"),
    (["--data", "nope.jsonl"], "--data nope.jsonl: no such file or directory: nope.jsonl"),
    (["--data", "tiny@-1"], "must be SOURCE or SOURCE@WEIGHT with WEIGHT > 0"),
    (["--data", "tiny:13"], "--data tiny:13: the number of terms must be 2-12, the range the warm start"),
    (["--eval-data", "tiny:twelve"], "--eval-data tiny:twelve: expected tiny:K"),
    (["--resume", "auto", "--overwrite", "true"], "say opposite things"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "gpu"], "--device"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_wrong_flag_is_refused_with_its_name_and_value(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_booleans_take_the_usual_spellings():
    for text, value in (("true", True), ("Yes", True), ("1", True), ("false", False), ("NO", False), ("0", False)):
        assert config.parse_config(["--pack", text]).pack is value


@pytest.mark.slow
def test_a_wrong_flag_stops_before_anything_loads():
    """The real entry point: an exit within seconds (the imports), no traceback, no model or data loaded."""
    start = time.time()
    p = run_train("--group-size", "1", "--out", "/nonexistent/never/written", timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--group-size 1" in p.stderr
    assert "Loading weights" not in p.stderr + p.stdout and time.time() - start < 60
    assert not os.path.exists("/nonexistent/never/written")


SYNC_FAILS = """import sys, train
from systems import workers
from systems.engine import SyncError
workers.close_pool = lambda: print("workers killed", flush=True)
def main(cfg):
    raise SyncError("the weight sync failed: no tensor moved for 5 s")
train.main = main
try:
    train.cli()
finally:  # train.cli ends the process with os._exit: reached only when it did not
    print("cli returned", file=sys.stderr)
"""


def test_a_failed_weight_sync_ends_the_process_in_one_line_with_its_workers_killed():
    """train.cli's way out of a sync whose threads may wait for good: the cause in one line, the reward workers
    killed (atexit handlers do not run after os._exit), exit status 1, no traceback."""
    p = run([sys.executable, "-c", SYNC_FAILS], timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "cli returned" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.count("error: the weight sync failed: no tensor moved for 5 s") == 1, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["workers killed"], p.stdout


# ----------------------------------------------------------------------------------- output folders

def digest(folder) -> dict:
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("first")
    p = run_train(*RUN, "--save-every", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_used_folder_is_refused_and_left_as_it_was(first_run, tmp_path):
    out = tmp_path / "used"
    shutil.copytree(first_run, out)
    before = digest(out)
    p = run_train(*RUN, "--steps", "1", "--out", str(out), timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert f"--out {out} holds a run (metrics.jsonl, samples.jsonl, step_000001, step_000002)" in p.stderr
    assert "--resume auto" in p.stderr and "--overwrite" in p.stderr
    assert digest(out) == before  # nothing of the first run changed


@pytest.mark.slow
def test_overwrite_starts_again_and_says_what_it_deleted(first_run, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(first_run, out)
    p = run_train(*RUN, "--steps", "1", "--out", str(out), "--overwrite", "true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--overwrite: deleted metrics.jsonl, samples.jsonl, step_000001, step_000002" in p.stdout
    assert sorted(os.listdir(out)) == [".lock", "metrics.jsonl", "runs.json", "samples.jsonl", "step_000001"]
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1]


@pytest.mark.slow
def test_resume_auto_with_every_checkpoint_damaged_stops_with_the_reasons(first_run, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(first_run, out)
    with open(out / "step_000002" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    os.remove(out / "step_000001" / "manifest.json")
    before = digest(out)
    with pytest.raises(ValueError) as e:
        outdir.find_resume("auto", str(out))
    assert "step_000002: model.safetensors has 100 bytes" in str(e.value)
    assert "step_000001: no readable manifest.json" in str(e.value) and "--overwrite" in str(e.value)
    p = run_train(*RUN, "--out", str(out), "--resume", "auto", timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "nothing in" in p.stderr
    assert digest(out) == before


def test_resume_auto_in_an_empty_folder_starts_fresh_and_metrics_without_checkpoints_stop(tmp_path):
    assert outdir.find_resume("auto", str(tmp_path / "new")) is None
    (tmp_path / "died").mkdir()
    (tmp_path / "died" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="no checkpoint; metrics.jsonl only"):
        outdir.find_resume("auto", str(tmp_path / "died"))


@pytest.mark.slow
def test_resume_from_another_folder_into_a_used_one_is_refused(first_run, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(first_run, out)
    with pytest.raises(ValueError, match="which holds another run"):
        outdir.find_resume(str(first_run / "step_000002"), str(out))
    assert outdir.find_resume(str(first_run / "step_000002"), str(tmp_path / "empty")) == \
        str(first_run / "step_000002")


def test_keep_last_prunes_only_this_runs_checkpoints(tmp_path):
    for step, owner in ((1, "old"), (2, "old"), (3, "me"), (4, "me"), (5, "me")):
        os.makedirs(tmp_path / f"step_{step:06d}")
        (tmp_path / f"step_{step:06d}" / "manifest.json").write_text(json.dumps({"run": owner, "step": step, "files": {}}))
    os.makedirs(tmp_path / "step_000006")  # no manifest: nobody's
    with outdir.Folder.at(str(tmp_path)) as out:
        assert outdir.prune(out, 2, "me") == ["step_000003"]
        assert sorted(os.listdir(tmp_path)) == ["step_000001", "step_000002", "step_000004", "step_000005",
                                                "step_000006"]
        assert outdir.prune(out, 0, "me") == []


# ----------------------------------------------------------------------------- sampling and records

def test_top_p_and_top_k_edge_values_keep_the_top_token():
    logits = torch.tensor([[0.5, 3.0, 1.0, 3.0 - 1e-6], [2.0, 2.0, -1.0, 0.0]])
    for s in (Sampling(1.0, top_p=1e-9), Sampling(1.0, top_p=0.0), Sampling(1.0, top_k=1)):
        logp = process_logits(logits, s)
        assert torch.isfinite(logp).any(1).all() and not torch.isnan(logp).any(), s
        assert logp.exp().sum(1).allclose(torch.ones(2))
        assert (logp[0].argmax().item(), torch.isfinite(logp[0]).sum().item()) == (1, 1)


def test_nan_and_inf_statistics_are_written_as_null(tmp_path):
    path = tmp_path / "m.jsonl"
    with open(path, "w") as f:
        logs.write_record(f, {"step": 1, "entropy/mean": math.nan, "loss/kl": math.inf, "reward/mean": 0.5})
    assert json.loads(path.read_text()) == {"step": 1, "entropy/mean": None, "loss/kl": None, "reward/mean": 0.5}


# ------------------------------------------------------------------------------------------- data rows

@pytest.mark.parametrize("row, message", [
    ({"prompt": [{"role": "narrator", "content": "3+4="}], "answer": "7"}, "message 0: unknown role 'narrator'"),
    ({"prompt": "   \n", "answer": "7"}, "field 'prompt' (the prompt) is empty"),
    ({"prompt": "3+4=", "answer": "  "}, "field 'answer' (the answer) is empty"),
    ({"prompt": [{"role": "user", "content": " "}], "answer": "7"}, "every message is empty or whitespace"),
])
def test_bad_rows_name_their_row(tmp_path, row, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        data.load_rows(str(path))
    assert f"{path}:2" in str(e.value) and message in str(e.value)


class CountingTokenizer:
    """The tiny tokenizer, counting how often it is asked to tokenize each prompt."""

    def __init__(self):
        self.inner, self.calls = tiny.make_tokenizer(), {}
        self.chat_template = self.inner.chat_template

    def apply_chat_template(self, messages, **kw):
        self.calls[messages[0]["content"]] = self.calls.get(messages[0]["content"], 0) + 1
        return self.inner.apply_chat_template(messages, **kw)

    def __call__(self, *a, **kw):
        return self.inner(*a, **kw)


def test_a_long_prompt_is_tokenized_once_not_at_every_draw():
    long = "+".join(["1"] * 300) + "="
    rows = [{"prompt": long, "answer": "300", "verifier": "tiny"}] + tiny.make_rows(9, seed=3)
    tok, too_long, cursor, skipped = CountingTokenizer(), set(), 0, 0
    for _ in range(30):  # 30 draws of 5 usable prompts: over 16 passes over the 10 rows
        prompts, cursor, n = data.draw_prompts(rows, 0, cursor, 5, tok, 64, "test", too_long)
        skipped += n
        assert all(len(ids) <= 64 for ids, _ in prompts)
    drawn = data.draw_order(10, 0, 0, cursor)  # row indices of every draw
    assert cursor == 150 + skipped and skipped == drawn.count(0) >= 15 and too_long == {0}
    assert tok.calls[long] == 1  # skipped `skipped` times, tokenized once
    assert tok.calls[rows[1]["prompt"]] == drawn.count(1)  # a usable prompt: at every draw
    with pytest.raises(ValueError, match="every prompt is longer than --max-prompt-len 2"):
        data.draw_prompts(rows, 0, 0, 1, tok, 2, "test", set())
