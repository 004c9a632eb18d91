"""Smoke test of bench.py: every mode runs end to end at a trivial size and prints its JSON line. No timing is
checked here (benchmarks measure, tests don't); the figures are in the README.

    python -m pytest tests/test_bench.py -q
"""
import importlib.util
import json
import os
import sys

from conftest import run


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tests may run beside each other on 2 cores
    p = run([sys.executable, "bench.py", *args], cwd=ROOT, timeout=timeout, env=env)
    return p


def last_json(p) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_segments(tmp_path):
    # 2 variants, 1 warm-up step and 1 measured round of 1 step each; extra flags go to train.py
    p = run_bench("segments", "--segments", "1,2,2u", "--warmup", "1", "--rounds", "1", "--chunk", "1",
                  "--dir", str(tmp_path), "--prompts-per-step", "1", "--train-groups", "1", "--max-response-len", "16",
                  "--dynamic-sampling", "false", timeout=240)
    r = last_json(p)
    assert r["bench"] == "segments" and r["segments"] == ["1", "2", "2u"]
    assert r["speedup"][0] == 1.0 and r["speedup"][1] > 0
    assert r["prefill_tokens_bucketed"][1] <= r["prefill_tokens"][1]
    gpu = r["gpu_model"]
    assert gpu["segments"] == [1, 2] and gpu["replay_of_this_run"][0] == 1.0 and len(gpu["long_tail_1024_rows"]) == 2
    assert all(0 < u <= 1 for u in r["utilisation"]), r
    assert all(0 <= x <= 1 for x in r["reward"]), r
    assert "speedup" in p.stdout and "paper" in p.stdout  # the table


def test_gpu_cost_model_by_hand():
    """Bytes over bandwidth, summed over decode steps: weights read once a step, each active row's KV cache
    (context so far) read once a step; a row that finishes leaves the batch."""
    import bench
    c = bench.GPUCost(layers=1, shared_bytes=100, expert_bytes=0, experts=1, top_k=1, kv_bytes_per_token=1,
                      memory=1e9, hbm_bytes_per_s=1, flops=1e30, prefill_mfu=1)
    assert abs(c.call_seconds([2], [3]) - (3 * 100 + (2 + 3 + 4))) < 1e-6
    assert abs(c.call_seconds([0, 0], [1, 3]) - (100 + 0 + 2 * 100 + (1 + 2))) < 1e-6
    small = bench.GPUCost(layers=1, shared_bytes=0, expert_bytes=0, experts=1, top_k=1, kv_bytes_per_token=1,
                          memory=10 / 0.9, hbm_bytes_per_s=1, flops=1e30)  # room for 10 tokens of KV cache
    # rows of 6 tokens each (context 1 + 5 generated): one at a time, so the second starts when the first ends
    assert abs(small.call_seconds([1, 1], [5, 5]) - 2 * (1 + 2 + 3 + 4 + 5)) < 1e-6
    assert abs(c.call_seconds([0, 0], [1, 3]) - c.call_seconds([0, 0], [3, 1])) < 1e-6


def test_simulated_rollout_trains_every_sample_once():
    """The real scheduler around LengthEngine: with S segments every sample needs ceil(length / (cap / S))
    rounds, every step trains --train-groups whole groups, and nothing is lost or duplicated."""
    import bench
    for segments in (1, 4):
        calls, trained = bench.simulate_segments(segments, bench.long_tail(0, 64, 20, 0.8), 64, 4, 2, 4, 5, 2)
        assert trained == 5 * 4 * 2
        assert all(max(gen) <= 64 // segments for _, gen in calls)
        assert all(len(ctx) <= 4 * 2 for ctx, _ in calls)


def test_memory():
    p = run_bench("memory", "--sizes", "256", "--vocab", "1000", "--hidden", "16", "--chunk", "32,64")
    r = last_json(p)
    assert r["bench"] == "memory" and r["tokens"] == [256] and set(r["ratio"]) == {"chunked:32", "chunked:64"}
    assert all(isinstance(x[0], (int, float)) for x in r["peak_mb"].values()), r


def test_sp():
    r = last_json(run_bench("sp", "--lengths", "64,128", "--rounds", "1"))
    assert r["bench"] == "sp" and [row["tokens"] for row in r["rows"]] == [64, 128]
    assert all(row["sp1_s"] > 0 and row["sp2_s"] > 0 for row in r["rows"]), r


def test_routing():
    """Replay takes every decision from the engine, also where the trainer's own router picks others (the deeper
    model in bf16 has such decisions at this size, so the check is not empty); fp32, the control, routes as the
    engine did and its gap is rounding; the figures are fractions, in range."""
    r = last_json(run_bench("routing", "--configs", "16x4:2x64,64x8:8x64", "--prompts", "4", "--tokens", "24"))
    assert r["bench"] == "routing" and [(x["experts"], x["dtype"]) for x in r["rows"]] == \
        [(16, "float32"), (16, "bfloat16"), (64, "float32"), (64, "bfloat16")]
    for x in r["rows"]:
        assert x["replay_differ"] == 0 and x["response_tokens"] == 4 * 24, x
        assert x["decisions"] == x["positions"] * x["layers"] and len(x["mismatch_by_layer"]) == x["layers"], x
        assert 0 <= x["mismatch"] <= x["positions_mismatch"] <= 1 and 0 <= x["metric_mismatch"] <= 1, x
        assert 0 <= x["engine_kl"] and x["gap_mean"] <= x["gap_max"] < 0.1 and x["replay_gap_max"] < 0.1, x
        if x["dtype"] == "float32":
            assert x["mismatch"] == 0 and x["metric_mismatch"] == 0 and x["gap_max"] < 1e-4, x
    assert r["rows"][3]["mismatch"] > 0, r["rows"][3]


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
