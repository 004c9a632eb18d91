"""plot.py on two small synthetic runs (nulls in the step-0 record, as train.py writes them): every figure is
written as a valid, non-empty PNG, into --out or the first run directory.

    python -m pytest tests/test_plot.py -q
"""
import json
import os
import subprocess
import sys

import pytest

import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(path, seed, sigma=0.2, steps=6):
    os.makedirs(path)
    records = [{"step": 0, "time/step_s": 5.0, "reward/mean": None, "entropy/mean": None, "mpt/masked_frac": None,
                "rollout/unfinished": 0, "tokens/generated": 0, "eval/accuracy": 0.5, "eval/mean_length": 19.0,
                "eval/truncation_rate": 0.0, "config": {"mpt_sigma": sigma}}]
    for s in range(1, steps + 1):
        r = {"step": s, "time/step_s": 1.0 + 0.1 * s, "reward/mean": 0.5 + 0.05 * s + 0.01 * seed,
             "entropy/mean": 0.15 - 0.01 * s, "mpt/masked_frac": 0.3 + 0.02 * s, "rollout/unfinished": 40 + s + seed,
             "tokens/generated": 1000, "response/mean_len": 20.0 + s, "response/max_len": 50 + s}
        if s == 3:
            r["reward/mean"] = None  # a step with no completed group
        if s % 3 == 0:
            r.update({"eval/accuracy": 0.5 + 0.05 * s, "eval/mean_length": 19.0 + s, "eval/truncation_rate": 0.01})
        records.append(r)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def check_pngs(out_dir):
    for name in plot.FIGURES:
        path = os.path.join(out_dir, name)
        assert os.path.exists(path), f"{name} not written"
        with open(path, "rb") as f:
            blob = f.read()
        assert blob[:8] == PNG_SIGNATURE, f"{name} is not a PNG"
        assert len(blob) > 5000, f"{name} is suspiciously small ({len(blob)} bytes)"


def test_two_runs_into_out_dir(tmp_path):
    write_run(str(tmp_path / "run_a"), seed=0)
    write_run(str(tmp_path / "run_b"), seed=1)
    out = tmp_path / "plots"
    written = plot.main([str(tmp_path / "run_a"), str(tmp_path / "run_b"), "--out", str(out)])
    assert sorted(os.path.basename(p) for p in written) == sorted(plot.FIGURES)
    check_pngs(str(out))


def test_script_writes_into_first_run_dir(tmp_path):
    write_run(str(tmp_path / "run_a"), seed=0)
    write_run(str(tmp_path / "run_b"), seed=1)
    p = subprocess.run([sys.executable, "plot.py", str(tmp_path / "run_a"), str(tmp_path / "run_b")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    check_pngs(str(tmp_path / "run_a"))


def test_series_skips_nulls_and_step0_time(tmp_path):
    write_run(str(tmp_path / "run"), seed=0)
    records = plot.read_metrics(str(tmp_path / "run"))
    assert plot.series(records, "reward/mean")[0] == [1, 2, 4, 5, 6]
    assert plot.series(records, "time/step_s")[0] == [1, 2, 3, 4, 5, 6]
    assert plot.series(records, "eval/accuracy")[0] == [0, 3, 6]
    assert plot.series(records, "no/such_key") == ([], [])


def test_missing_metrics_file_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot.read_metrics(str(tmp_path))


def test_mixed_domains_get_a_reward_curve_each(tmp_path):
    write_run(str(tmp_path / "mixed"), seed=0)
    path = tmp_path / "mixed" / "metrics.jsonl"
    records = [json.loads(line) for line in open(path)]
    for r in records[1:]:
        r.update({"reward/by_verifier/math": 0.6, "reward/by_verifier/rg": 0.1})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot.main([str(tmp_path / "mixed")])
    assert os.path.basename(written[-1]) == "reward_by_verifier.png"
    with open(written[-1], "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    write_run(str(tmp_path / "single"), seed=0)  # one domain: no extra figure
    assert "reward_by_verifier.png" not in {os.path.basename(p) for p in plot.main([str(tmp_path / "single")])}


def test_seed_groups_average_each_variant_with_its_band(tmp_path):
    """Runs NAME_sSEED: one curve per NAME, the mean over its seeds with the lowest and highest seed as the band,
    at the steps every seed logged (a null step is skipped); other names stay their own group."""
    runs = {}
    for name, seed in (("off_s0", 0), ("off_s1", 1), ("dyn_s0", 2), ("single", 3)):
        write_run(str(tmp_path / name), seed=seed)
        runs[name] = plot.read_metrics(str(tmp_path / name))
    groups = plot.seed_groups(runs)
    assert list(groups) == ["off", "dyn", "single"] and len(groups["off"]) == 2
    steps, mean, low, high = plot.variant_curves(groups["off"], "reward/mean")
    assert steps == [1, 2, 4, 5, 6]  # step 3 is null in every run
    for s, m, lo, hi in zip(steps, mean, low, high):
        assert abs(m - (0.5 + 0.05 * s + 0.005)) < 1e-9 and abs(lo - (0.5 + 0.05 * s)) < 1e-9
        assert abs(hi - (0.5 + 0.05 * s + 0.01)) < 1e-9
    smoothed = plot.variant_curves(groups["dyn"], "entropy/mean", smooth=3)[1]  # trailing mean of 3 values
    assert abs(smoothed[2] - (0.14 + 0.13 + 0.12) / 3) < 1e-9 and abs(smoothed[0] - 0.14) < 1e-9
    written = plot.main([str(tmp_path / n) for n in runs] + ["--seeds", "--out", str(tmp_path / "fig")])
    assert written and all(open(p, "rb").read(8) == PNG_SIGNATURE for p in written)
