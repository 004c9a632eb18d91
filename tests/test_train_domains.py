"""The real trainer on a mixed math + Reasoning Gym dataset with the tiny model: rows of
both sources are drawn, each scored by its own verifier, and the reward curve is logged. The tiny model only
knows its addition task, so puzzle rewards are ~0 (its character tokenizer reads the letters of a puzzle as
<unk>); the math rows hold tiny-style sums, which it does solve.

    OMP_NUM_THREADS=1 python -m pytest tests/test_train_domains.py
"""
import json
import os
import sys

import pytest

from conftest import run
import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_mixed_math_and_reasoning_gym_run(tmp_path):
    math_file = tmp_path / "math.jsonl"  # no verifier column: --default-verifier (math) applies
    math_file.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                                 for r in tiny.make_rows(40, seed=1)))
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--data", f"{math_file}@0.5,rg:chain_sum:40@0.5", "--steps", "2",
           "--eval-data", "", "--dynamic-sampling", "false", "--out", str(out), "--max-prompt-len", "192",
           "--max-response-len", "24", "--segments", "1", "--prompts-per-step", "4", "--group-size", "2",
           "--train-groups", "4", "--engine", "hf"]
    p = run(cmd, cwd=ROOT, timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]  # the reward curve: one point per step
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["reward/errors"] == 0 for r in records)
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    puzzles = [s for s in samples if "<unk>" in s["prompt"]]
    sums = [s for s in samples if "<unk>" not in s["prompt"]]
    assert puzzles and sums  # both sources were drawn
    assert {s["verifier"] for s in puzzles} == {"rg"} and {s["verifier"] for s in sums} == {"math"}
    for r in records:  # one reward curve per domain, consistent with the overall mean when both were scored
        per = {k.split("/")[-1]: v for k, v in r.items() if k.startswith("reward/by_verifier/")}
        assert set(per) <= {"math", "rg"} and per and all(0.0 <= v <= 1.0 for v in per.values())
    for s in sums:  # each math row scored by the math verifier: the last number of the response
        prompt = s["prompt"].removesuffix("=")
        right = str(sum(int(x) for x in prompt.split("+")))
        last = s["response"].replace(":", ",").replace("=", ",").rstrip(",").split(",")[-1]
        assert s["reward"] == float(last == right and s["finish"] == "eos"), s


@pytest.mark.slow
def test_prompts_all_too_long_stop_with_a_message(tmp_path):
    """Reasoning Gym prompts are longer than the tiny default's --max-prompt-len 64: the run must say so,
    not skip prompts forever."""
    p = run([sys.executable, "train.py", "--data", "rg:chain_sum:20", "--steps", "1", "--eval-data", "",
            "--out", str(tmp_path)], cwd=ROOT, timeout=120,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode != 0 and "every prompt is longer than --max-prompt-len 64" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow  # the dataset's probe runs its scorer in the sandbox
def test_reasoning_gym_s_held_out_draw_is_left_out_of_training(capsys):
    """rg:prime_factorization's problem space is small: 16 of 50 prompts of its held-out draw (another seed) were
    also in a training draw of 300. --eval-data auto takes that held-out draw, and training leaves them out."""
    import config
    import train
    cfg = config.parse_config(["--data", "rg:prime_factorization:300", "--eval-n", "50", "--max-prompt-len", "512"])
    assert cfg.eval_data == "rg:prime_factorization:300"
    rows, held = train.load_data(cfg, lead=True)
    assert len(held) == 50 and not {r["prompt"] for r in rows} & {r["prompt"] for r in held}
    left_out = 300 - len(rows)
    assert left_out > 0 and f"{left_out} of 300 rows have a prompt of the held-out set" in capsys.readouterr().err
