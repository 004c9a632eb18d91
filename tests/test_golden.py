"""A change that should not alter numbers reproduces the first steps of a fixed-seed run: the tiny default
(one process) and a 2-rank FSDP run with a KL reference reset every 2 steps, 5 steps each, one thread,
against the records in tests/golden/: every key they hold but timing, memory, git hash and config must be
there with the same value. A key the records do not hold (a new metric) is allowed: adding one needs no edit
here, and the next regeneration takes it in.

A change that alters training numbers on purpose regenerates them, and says so in its commit:

    OMP_NUM_THREADS=1 python train.py --steps 5 --eval-n 128 --out /tmp/g1
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 train.py --steps 5 --parallel fsdp --eval-n 64 \\
        --kl-coef 0.01 --ref-reset-every 2 --out /tmp/g2
    python tests/test_golden.py /tmp/g1 /tmp/g2              # writes tests/golden/{one,fsdp}.jsonl

    python -m pytest tests/test_golden.py                 # ~40 seconds on 2 cores
"""
import json
import math
import os
import sys

import pytest

from conftest import run


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
SKIP = {"time/step_s", "time/rollout_s", "time/sync_s", "tokens/per_s", "git", "config"}  # and memory/*: measured
RUNS = {"one": ([sys.executable], ["--steps", "5", "--eval-n", "128"]),
        "fsdp": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                 ["--steps", "5", "--parallel", "fsdp", "--eval-n", "64", "--kl-coef", "0.01", "--ref-reset-every", "2"])}


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in SKIP and not k.startswith("memory/")}
                for line in f if line.strip()]


def same(a, b, key: str = "") -> bool:
    """Equal, floats within 1e-4 relative: summation order inside BLAS kernels may differ on another CPU. The
    engine-vs-trainer log-prob gap is itself rounding (1e-6..1e-5): any change of batch shapes moves it, so 1e-4 absolute."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4 if key.startswith("rollout/logprob_diff") else 1e-7)
    return a == b and type(a) is type(b)


def mismatches(got: list[dict], want: list[dict]) -> list[str]:
    """What differs between a run's records and the golden ones: steps, keys the golden records hold that the
    run lacks, and values. Keys only the run has (new metrics) are fine."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} != {[r['step'] for r in want]}"]
    out = []
    for g, w in zip(got, want):
        if w.keys() - g.keys():
            out.append(f"step {w['step']}: keys gone: {sorted(w.keys() - g.keys())}")
        diff = {k: (g[k], w[k]) for k in w.keys() & g.keys() if not same(g[k], w[k], k)}
        if diff:
            out.append(f"step {w['step']}: {diff}")
    return out


def test_the_guard_allows_new_keys_and_catches_changes():
    want = records(os.path.join(GOLDEN, "one.jsonl"))
    assert mismatches([dict(r) for r in want], want) == []
    assert mismatches([{**r, "new/metric": 1.0} for r in want], want) == []
    moved = [dict(r) for r in want]
    moved[1]["entropy/mean"] *= 1.001
    assert mismatches(moved, want) == [f"step 1: {{'entropy/mean': ({moved[1]['entropy/mean']}, "
                                       f"{want[1]['entropy/mean']})}}"]
    gone = [{k: v for k, v in r.items() if k != "reward/mean"} for r in want]
    assert len(mismatches(gone, want)) == len(want) and "keys gone: ['reward/mean']" in mismatches(gone, want)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_first_steps_match_the_golden_record(name, tmp_path):
    launcher, flags = RUNS[name]
    proc = run([*launcher, "train.py", *flags, "--out", str(tmp_path)], timeout=900,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    problems = mismatches(records(tmp_path / "metrics.jsonl"), records(os.path.join(GOLDEN, f"{name}.jsonl")))
    assert not problems, "\n".join(problems)


if __name__ == "__main__":  # regenerate: python tests/test_golden.py RUN_ONE RUN_FSDP
    for name, run_dir in zip(("one", "fsdp"), sys.argv[1:3]):
        with open(os.path.join(GOLDEN, f"{name}.jsonl"), "w") as f:
            for r in records(os.path.join(run_dir, "metrics.jsonl")):
                f.write(json.dumps(r, sort_keys=True) + "\n")
