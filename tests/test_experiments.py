"""Smoke test of experiments/findings.py at a trivial size: a finding's variants train (2 steps, one seed),
its figure and summary are written, and a second call reuses the finished runs instead of training again.
The findings themselves are in docs/findings.md; experiments are not tests.

    python -m pytest tests/test_experiments.py -q        # ~2 minutes on 2 cores
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_finding_runs_end_to_end_and_reuses_its_runs(tmp_path):
    cmd = [sys.executable, "experiments/findings.py", "dmmpt", "--seeds", "0", "--root", str(tmp_path / "runs"),
           "--figure", str(tmp_path / "dmmpt.png"), "--steps", "2", "--eval-n", "16", "--eval-every", "1",
           "--prompts-per-step", "2", "--train-groups", "2", "--dynamic-sampling", "false"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["finding"] == "dmmpt" and summary["steps"] == 2 and set(summary["numbers"]) == {"off", "static", "dynamic"}
    assert summary["numbers"]["off"]["masked_frac"]["mean"] == 0 < summary["numbers"]["static"]["masked_frac"]["mean"]
    assert open(tmp_path / "dmmpt.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for variant in ("off", "static", "dynamic"):
        with open(tmp_path / "runs" / "dmmpt" / f"{variant}_s0" / "metrics.jsonl") as f:
            assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "_s0:" not in again.stdout  # no run trained again
    passk = subprocess.run([sys.executable, "experiments/findings.py", "passk", "--models", "dmmpt/off,dmmpt/static",
                            "--root", str(tmp_path / "runs"), "--figure", str(tmp_path / "passk.png"),
                            "--passk-samples", "4", "--passk-problems", "8"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert passk.returncode == 0, passk.stdout[-2000:] + passk.stderr[-3000:]
    table = json.loads(passk.stdout.strip().splitlines()[-1])["pass@k"]
    assert set(table) == {"warm start", "dmmpt/off", "dmmpt/static"} and set(table["warm start"]) == {"1", "2", "4"}
    assert all(0 <= v["mean"] <= 1 for row in table.values() for v in row.values())
    assert all(row["1"]["mean"] <= row["4"]["mean"] for row in table.values())  # pass@k never falls with k
