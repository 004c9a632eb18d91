"""The README's guide to changing the algorithm, followed on a copy of the project: a new default-off flag
(a Config field), a metric of the update with a figure of its own, and in ulorl.micro_batch_loss an entropy
bonus behind the flag and a metric averaged over loss_mask. The golden and plot tests, unedited, still pass;
the flag reaches the run, the metrics reach metrics.jsonl with their values, and the bonus its gradient.

    python -m pytest tests/test_guide.py          # ~1 minute on 2 cores
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run

# (file, text it holds, text put after it): the README guide's edits: a flag, a metric of the update, a loss term
# and a metric over loss_mask in ulorl.micro_batch_loss, and a figure
ENTROPY_BONUS = 0.01
EDITS = [
    ("config.py", '    dump_samples: int = flag(',
     '    my_flag: bool = flag(False, "a researcher\'s new idea; off by default")\n'),
    ("ulorl.py", '    out = tally.reduce(ranks)\n',
     '    out["my/metric"] = 1.0 if cfg.my_flag else 0.5\n'),
    ("ulorl.py", 'from loss import ', 'aggregate, '),
    ("ulorl.py", 'behaviour_logprobs=mb.behaviour)\n',
     '    entropy = torch.where(mb.loss_mask, entropy, 0)\n'
     f'    if cfg.my_flag:\n        loss = loss - {ENTROPY_BONUS} * aggregate(entropy, mb.loss_mask, cfg.agg, denom)\n'
     '    metrics["my/entropy"] = Mean(entropy.sum().item(), mb.loss_mask.sum().item())\n'),
    ("plot.py", 'FIGURES = {\n',
     '    "my_metric.png": [("my new metric", [("my/metric", "-")])],\n'),
]


def project_files() -> list[str]:
    """The files of this checkout (tracked, and new ones git does not ignore), as git lists them."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the project's files cannot be listed")
    return [f for f in listed.stdout.splitlines() if os.path.isfile(os.path.join(ROOT, f))]


@pytest.mark.slow
def test_a_new_flag_and_metric_need_no_test_edits(tmp_path):
    copy = tmp_path / "ulorl"
    for f in project_files():
        os.makedirs(copy / os.path.dirname(f), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), copy / f)
    for name, anchor, added in EDITS:
        text = (copy / name).read_text()
        at = text.index(anchor)
        where = at if name == "config.py" else at + len(anchor)  # the flag goes before dump_samples
        (copy / name).write_text(text[:where] + added + text[where:])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tests = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "tests/test_golden.py",
                 "tests/test_plot.py", "-k", "not fsdp"], timeout=600, cwd=copy, env=env)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert re.search(r"^\d+ passed, 1 deselected in ", tests.stdout, re.M), tests.stdout[-2000:]
    records = {}
    for on in ("true", "false"):
        out = tmp_path / f"run_{on}"
        trained = run([sys.executable, "train.py", "--steps", "1", "--my-flag", on, "--eval-data", "",
                       "--dump-samples", "0", "--out", str(out)], timeout=300, cwd=copy, env=env)
        assert trained.returncode == 0, trained.stderr[-3000:]
        records[on] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    on, off = records["true"], records["false"]
    assert on["my/metric"] == 1.0 and off["my/metric"] == 0.5 and on["config"]["my_flag"] is True
    # the metric over loss_mask is the entropy step 5 measured (the same weights, every response token trains)
    for r in (on, off):
        assert r["my/entropy"] == pytest.approx(r["entropy/mean"], rel=1e-5)
    # the bonus moves the loss by exactly its term (one update, the same rollout) and has a gradient
    assert on["loss/policy"] == pytest.approx(off["loss/policy"] - ENTROPY_BONUS * on["my/entropy"], rel=1e-5)
    assert abs(on["train/grad_norm"] - off["train/grad_norm"]) > 1e-6 * off["train/grad_norm"]
    out = tmp_path / "run_true"
    drawn = run([sys.executable, "plot.py", str(out)], timeout=120, cwd=copy, env=env)
    assert drawn.returncode == 0 and (out / "my_metric.png").exists(), drawn.stderr[-2000:]
