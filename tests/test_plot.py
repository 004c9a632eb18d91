"""plot.py on two small synthetic runs (nulls in the step-0 record, as train.py writes them): every figure is
written as a valid, non-empty PNG, into --out or the first run directory.

    python -m pytest tests/test_plot.py
"""
import json
import os
import sys

import pytest

from conftest import run
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


def expected_figures(run_dirs) -> set[str]:
    """The figures of plot.FIGURES that have data: any of their keys logged (not null) in any run. A figure
    added to FIGURES is checked here without a test change."""
    logged = {k for d in run_dirs for r in plot.read_metrics(str(d)) for k, v in r.items() if v is not None}
    return {name for name, panels in plot.FIGURES.items() if any(k in logged for _, keys in panels for k, _ in keys)}


def check_pngs(paths):
    for path in paths:
        with open(path, "rb") as f:
            blob = f.read()
        assert blob[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
        assert len(blob) > 5000, f"{path} is suspiciously small ({len(blob)} bytes)"


def test_two_runs_into_out_dir(tmp_path):
    write_run(str(tmp_path / "run_a"), seed=0)
    write_run(str(tmp_path / "run_b"), seed=1)
    out = tmp_path / "plots"
    written = plot.main([str(tmp_path / "run_a"), str(tmp_path / "run_b"), "--out", str(out)])
    want = expected_figures([tmp_path / "run_a", tmp_path / "run_b"])
    assert {"reward.png", "entropy.png", "eval.png"} <= want  # the synthetic runs log these at least
    assert {os.path.basename(p) for p in written} == want and all(os.path.dirname(p) == str(out) for p in written)
    check_pngs(written)


@pytest.mark.slow
def test_script_writes_into_first_run_dir(tmp_path):
    write_run(str(tmp_path / "run_a"), seed=0)
    write_run(str(tmp_path / "run_b"), seed=1)
    p = run([sys.executable, "plot.py", str(tmp_path / "run_a"), str(tmp_path / "run_b")], cwd=ROOT,
            timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    want = expected_figures([tmp_path / "run_a", tmp_path / "run_b"])
    assert want and want <= set(os.listdir(tmp_path / "run_a"))
    check_pngs([tmp_path / "run_a" / name for name in want])


def test_keys_draw_any_metric_and_name_the_known_ones(tmp_path):
    write_run(str(tmp_path / "run"), seed=0)
    path = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in open(path)]
    for r in records[1:]:
        r["my/new_metric"] = 0.1 * r["step"]  # a key no figure knows
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot.main([str(tmp_path / "run"), "--keys", "my/new_metric,eval/accuracy"])
    assert [os.path.basename(p) for p in written] == ["my-new_metric+eval-accuracy.png"]
    check_pngs(written)
    with pytest.raises(SystemExit, match="no run logged any of them.*my/new_metric"):
        plot.main([str(tmp_path / "run"), "--keys", "my/typo"])


def test_seeds_mode_keeps_a_colour_per_variant_and_a_style_per_metric(tmp_path, monkeypatch):
    for name, seed in (("off_s0", 0), ("off_s1", 1), ("dyn_s0", 2), ("dyn_s1", 3)):
        write_run(str(tmp_path / name), seed=seed)
    figures = {}
    monkeypatch.setattr(plot.plt, "close", lambda fig: figures.setdefault(len(figures), fig))
    written = plot.main([str(tmp_path / n) for n in ("off_s0", "off_s1", "dyn_s0", "dyn_s1")] +
                        ["--seeds", "--out", str(tmp_path / "fig")])
    reward = figures[[os.path.basename(p) for p in written].index("reward.png")]
    lines = {line.get_label(): line for line in reward.axes[0].get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"off: reward/mean", "off: eval/accuracy", "dyn: reward/mean", "dyn: eval/accuracy"}
    colour = {label: line.get_color() for label, line in lines.items()}
    assert colour["off: reward/mean"] == colour["off: eval/accuracy"] != colour["dyn: reward/mean"]
    assert colour["dyn: reward/mean"] == colour["dyn: eval/accuracy"]
    style = {label: line.get_linestyle() for label, line in lines.items()}
    assert style["off: reward/mean"] == style["dyn: reward/mean"] != style["off: eval/accuracy"]


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


@pytest.mark.slow
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
