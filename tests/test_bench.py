"""Smoke test of bench.py: every mode runs end to end at a trivial size and prints its JSON line. No timing is
checked here (benchmarks measure, tests don't); the figures are in the README.

    python -m pytest tests/test_bench.py -q
"""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tests may run beside each other on 2 cores
    p = subprocess.run([sys.executable, "bench.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p


def last_json(p) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_segments(tmp_path):
    # 2 variants, 1 warm-up step and 1 measured round of 1 step each; extra flags go to train.py
    p = run_bench("segments", "--segments", "1,2", "--warmup", "1", "--rounds", "1", "--chunk", "1",
                  "--dir", str(tmp_path), "--prompts-per-step", "1", "--train-groups", "1", "--max-response-len", "16",
                  "--dynamic-sampling", "false")
    r = last_json(p)
    assert r["bench"] == "segments" and r["segments"] == [1, 2]
    assert r["speedup"][0] == 1.0 and r["speedup"][1] > 0
    assert all(0 < u <= 1 for u in r["utilisation"]), r
    assert all(0 <= x <= 1 for x in r["reward"]), r
    assert "speedup" in p.stdout and "paper" in p.stdout  # the table


def test_memory():
    p = run_bench("memory", "--sizes", "256", "--vocab", "1000", "--hidden", "16", "--chunk", "32,64")
    r = last_json(p)
    assert r["bench"] == "memory" and r["tokens"] == [256] and set(r["ratio"]) == {"chunked:32", "chunked:64"}
    assert all(isinstance(x[0], (int, float)) for x in r["peak_mb"].values()), r


def test_trl(tmp_path):
    if importlib.util.find_spec("trl") is None:  # an optional dependency: the mode says how to get it
        p = run_bench("trl", "--dir", str(tmp_path), timeout=60)
        assert p.returncode == 2 and "requirements-bench.txt" in p.stderr
        return
    p = run_bench("trl", "--rounds", "1", "--chunk", "2", "--dir", str(tmp_path), "--prompts-per-step", "2",
                  "--max-response-len", "16", timeout=180)
    r = last_json(p)
    assert r["variants"] == ["trl", "ulorl-1seg", "ulorl-4seg"] and r["speedup_vs_trl"][0] == 1.0
    assert all(n == 1 for n in r["steps_measured"]), r
