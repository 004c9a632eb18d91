"""eval.py: the metrics against brute force and hand-made results, segmented sampling, benchmarks from
jsonl / parquet / a saved Hugging Face dataset, and the real entry point as a subprocess with a tiny budget.

    python -m pytest tests/test_eval.py
"""
import itertools
import json
import os
import sys

import pytest

import torch

from conftest import run
import data
import eval as ev
import model as model_lib
import verifiers
import tiny
from systems import engine as engine_lib
from systems.engine import Sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)  # 2 threads on this tiny model are slower under load


# ------------------------------------------------------------------------------------------ metrics

@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_matches_enumeration_of_k_subsets(n):
    """The estimator equals the fraction of all k-subsets of the n samples that hold a correct one."""
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
            assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_mean_and_ks():
    assert ev.pass_at_k(32, 5, 1) == pytest.approx(5 / 32)
    assert ev.pass_at_k(32, 0, 32) == 0.0 and ev.pass_at_k(32, 1, 32) == 1.0
    assert ev.ks_up_to(1) == [1]
    assert ev.ks_up_to(4) == [1, 2, 4]
    assert ev.ks_up_to(6) == [1, 2, 4, 6]
    assert ev.ks_up_to(32) == [1, 2, 4, 8, 16, 32]


def test_majority_vote_ties_and_missing_answers():
    assert ev.majority_correct(["3", "4", "4"], [False, True, True])
    # a 2-2 tie: the answer seen first wins, and it is wrong
    assert not ev.majority_correct(["3", "4", "4", "3"], [False, True, True, False])
    assert ev.majority_correct(["4", "3", "3", "4"], [True, False, False, True])
    # samples without an answer (or truncated) do not vote
    assert ev.majority_correct([None, None, "5"], [False, False, True])
    assert not ev.majority_correct([None, None], [False, False])
    assert verifiers.final_answer("tiny", "4=7,5=12:12") == "12" and verifiers.final_answer("tiny", "4=7,5=12") is None
    assert verifiers.final_answer("math", r"so \boxed{12}") == "12" and verifiers.final_answer("code", "12") is None


def test_summarize_on_hand_made_results():
    per_problem = [
        {"correct": [True, False, False, False], "answers": ["7", "6", "6", "5"], "lengths": [10, 12, 14, 16],
         "truncated": [False, False, False, False]},  # maj "6": wrong
        {"correct": [True, True, False, False], "answers": ["9", "9", "8", None], "lengths": [4, 4, 4, 64],
         "truncated": [False, False, False, True]},  # maj "9": right
        {"correct": [False] * 4, "answers": ["1", "2", "3", "4"], "lengths": [1, 1, 1, 1],
         "truncated": [False] * 4},  # all tied: first ("1") wrong
    ]
    r = ev.summarize(per_problem)
    assert r["avg@k"] == pytest.approx(3 / 12)
    assert r["pass@k"]["1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert r["pass@k"]["2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6) + 0) / 3)
    assert r["pass@k"]["4"] == pytest.approx(2 / 3)
    assert r["maj@k"] == pytest.approx(1 / 3)
    assert r["mean_length"] == pytest.approx(sum([10, 12, 14, 16, 4, 4, 4, 64, 1, 1, 1, 1]) / 12)
    assert r["truncation_rate"] == pytest.approx(1 / 12)


def test_partial_credit_counts_toward_mean_reward_not_accuracy():
    """Fractional rewards (here instruction following: 3 constraints, two met = 2/3) are not solved: a
    sample is correct only with full marks. Problem 0's samples score 1, 2/3, 2/3, 1/3; problem 1's 2/3 x4."""
    from segment_rollout import Sample
    tok = tiny.make_tokenizer()
    answer = json.dumps([{"type": "max_words", "n": 2}, {"type": "no_commas"}, {"type": "starts_with", "phrase": "7"}])
    row = {"prompt": "1=", "answer": answer, "verifier": "ifeval"}
    texts = [["7", "7,7", "7+7+7", "7,7,7"], ["7,7"] * 4]  # 3 words break max_words; "," breaks no_commas
    groups = [[Sample(4 * g + i, g, [3], row, tokens=tok(t).input_ids + [tok.eos_token_id], finish="eos")
               for i, t in enumerate(ts)] for g, ts in enumerate(texts)]
    per_problem, _ = ev.score(groups, tok, max_len=64, timeout=10.0)
    assert [p["rewards"] for p in per_problem] == [[1.0, 2 / 3, 2 / 3, 1 / 3], [2 / 3] * 4]
    r = ev.summarize(per_problem)
    assert r["avg@k"] == pytest.approx(1 / 8)  # one solved sample of 8 (reward > 0 would say 7 / 8)
    assert r["mean_reward"] == pytest.approx(2 / 3)
    assert r["pass@k"]["4"] == pytest.approx(1 / 2)  # problem 1 is never solved
    assert r["pass@k"]["1"] == pytest.approx((1 / 4 + 0) / 2)
    # just below full marks: 99 of 100 constraints met is not solved
    nearly = {**row, "answer": json.dumps([{"type": "starts_with", "phrase": "7"}] * 99 + [{"type": "no_commas"}])}
    groups = [[Sample(i, 0, [3], nearly, tokens=tok(t).input_ids + [tok.eos_token_id], finish="eos")
               for i, t in enumerate(["7,7", "7"])]]
    per_problem, _ = ev.score(groups, tok, max_len=64, timeout=10.0)
    assert per_problem[0]["rewards"] == [0.99, 1.0] and per_problem[0]["correct"] == [False, True]


# ------------------------------------------------------------------------------------------ sampling

@pytest.fixture(scope="module")
def tiny_model():
    policy, tokenizer = model_lib.load(tiny.CKPT)
    rows = tiny.make_rows(12, seed=10_000)
    return policy, tokenizer, rows, [data.encode_prompt(tokenizer, r["prompt"]) for r in rows]


def sample_run(tiny_model, segments, batch, temperature, seed=0):
    policy, tokenizer, rows, ids = tiny_model
    engine = engine_lib.make_engine("hf", policy, tokenizer, seed)
    groups = ev.sample_all(engine, ids, rows, 3, 64, segments, batch, Sampling(temperature))
    assert [g[0].row for g in groups] == rows and all(len(g) == 3 for g in groups)
    return [[(s.tokens, s.finish) for s in g] for g in groups]


@pytest.mark.parametrize("temperature", [1.0, 1e-5], ids=["sampled", "greedy"])
def test_segmented_equals_unsegmented(tiny_model, temperature):
    """Segments (and a batch refilled as samples finish) change only the scheduling: every token's random
    number depends on (seed, sample, position) only, so sampled responses are identical too."""
    whole = sample_run(tiny_model, segments=1, batch=64, temperature=temperature)
    assert sample_run(tiny_model, segments=4, batch=64, temperature=temperature) == whole
    assert sample_run(tiny_model, segments=8, batch=7, temperature=temperature) == whole  # 7: fewer slots than one refill
    assert any(len(t) > 16 for g in whole for t, _ in g), "some response should span several segments"
    if temperature == 1.0:  # the draws really are random: the k samples of a problem differ
        assert any(len({tuple(t) for t, _ in g}) > 1 for g in whole)


def test_sampling_is_reproducible_under_a_fixed_seed(tiny_model):
    assert sample_run(tiny_model, segments=4, batch=16, temperature=1.0) == sample_run(tiny_model, 4, 16, 1.0)


# ------------------------------------------------------------------------------------------ benchmarks

ROWS = [{"prompt": "3+4=", "answer": "7", "verifier": "tiny"}, {"prompt": "1+2+3=", "answer": "6", "verifier": "tiny"},
        {"prompt": "9+9=", "answer": "18", "verifier": "tiny"}]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "saved_dataset"])
def test_benchmark_formats(tmp_path, fmt):
    if fmt == "jsonl":
        path = tmp_path / "bench.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        path = tmp_path / "bench.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets
        path = tmp_path / "bench_ds"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    rows = data.load_prompts(str(path), held_out=True, split="train")
    assert [{k: r[k] for k in ("prompt", "answer", "verifier")} for r in rows] == ROWS
    assert len(data.load_prompts(str(path), held_out=True, n=2, split="train")) == 2


def test_presets_and_overrides():
    a = ev.parse_args(["--preset", "ulorl"])
    assert (a.k, a.temperature, a.top_p, a.top_k) == (32, 0.85, 0.95, 20)
    a = ev.parse_args(["--preset", "prorl", "--top-p", "1.0", "--k", "4"])
    assert (a.k, a.temperature, a.top_p, a.top_k) == (4, 0.6, 1.0, -1)
    a = ev.parse_args([])
    assert (a.k, a.temperature, a.top_p, a.top_k, a.data) == (4, 1.0, 1.0, -1, "tiny")


# ------------------------------------------------------------------------------------------ entry point

@pytest.mark.slow
def test_eval_script_writes_the_report(tmp_path):
    report = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = run([sys.executable, "eval.py", "--n-problems", "16", "--k", "2", "--segments", "2", "--report", str(report)],
            timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "avg@2" in p.stdout and "pass@2" in p.stdout and "maj@2" in p.stdout
    r = json.loads(report.read_text())
    for key in ("avg@k", "pass@k", "maj@k", "mean_length", "truncation_rate", "per_problem"):
        assert key in r, key
    assert set(r["pass@k"]) == {"1", "2"} and r["pass@k"]["1"] == pytest.approx(r["avg@k"])
    assert len(r["per_problem"]) == 16
    for p in r["per_problem"]:
        assert {"prompt", "answer", "correct"} <= set(p) and len(p["correct"]) == 2
        assert all(isinstance(c, bool) for c in p["correct"])
    assert 0 < r["mean_length"] <= 64 and 0 <= r["avg@k"] <= 1 and r["pass@k"]["2"] >= r["avg@k"]


def test_maj_votes_on_the_text_the_reward_reads():
    """The math rewards read the text after </think>; a vote read from the whole response would count an answer
    the reasoning tried and the reward never saw."""
    assert verifiers.final_answer("math", r"<think>maybe \boxed{7}</think>so it is 5") == "5"
    assert verifiers.final_answer("math_boxed", r"<think>maybe \boxed{7}</think>so it is 5") is None
    assert verifiers.final_answer("math", r"<think>7?</think>\boxed{5}") == "5"
    assert verifiers.math_reward(r"<think>maybe \boxed{7}</think>so it is \boxed{5}", "5") == 1.0


def test_held_out_accuracy_counts_a_truncated_answer_unsolved_under_any_overlong():
    """train.py's held-out accuracy judges as eval.py does: a response cut at the cap is not solved, even where
    --overlong filter / none leave a truncated sample's training reward alone. The stand-in engine writes the
    right answer to the tiny task and is cut exactly at the cap."""
    import config
    import train
    tok = tiny.make_tokenizer()
    right = tok("1+2=3:3").input_ids

    class RightButCut(engine_lib.Engine):
        def generate(self, prompts, max_tokens, sampling, keys=None):
            return [engine_lib.Generation(right[:m], [0.0] * len(right[:m]), "length") for m in max_tokens]

    rows = [{"prompt": "1+2=", "answer": "3", "verifier": "tiny"}]
    assert verifiers.tiny_reward(tok.decode(right), "3") == 1.0
    for overlong in ("zero", "filter", "none"):
        cfg = config.parse_config(["--overlong", overlong, "--segments", "1", "--max-response-len", str(len(right))])
        got = train.held_out(RightButCut(), tok, rows, cfg, None)
        assert got["eval/accuracy"] == 0.0 and got["eval/truncation_rate"] == 1.0, (overlong, got)
