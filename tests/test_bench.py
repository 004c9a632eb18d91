"""Smoke test of bench/ (`python -m bench NAME`): every mode runs end to end at a trivial size and prints its
JSON line. No timing is checked here (benchmarks measure, tests don't); the figures are in the README.

    python -m pytest tests/test_bench.py
"""
import dataclasses
import importlib.util
import json
import os
import random
import sys

import pytest

from conftest import run


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tests may run beside each other on 2 cores
    p = run([sys.executable, "-m", "bench", *args], cwd=ROOT, timeout=timeout, env=env)
    return p


def last_json(p) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
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
    assert gpu["segments"] == [1, 2] and gpu["replay_of_this_run"][0] == 1.0 and set(gpu["table1"]["by_replicas"]) == \
        {"1", "2", "4", "8", "16", "32", "64", "128"}
    assert all(0 < u <= 1 for u in r["utilisation"]), r
    assert all(0 <= x <= 1 for x in r["reward"]), r
    assert "speedup" in p.stdout and "paper" in p.stdout  # the table


def test_the_controlled_task_draws_the_long_share_asked_for(tmp_path):
    from bench.segments import controlled_data
    for frac in (0.0, 0.3, 1.0):
        with open(controlled_data(str(tmp_path / "c.jsonl"), 2000, seed=0, long_frac=frac)) as f:
            terms = [len(json.loads(line)["prompt"][:-1].split("+")) for line in f]
        assert set(terms) <= {2, 12} and abs(terms.count(12) / len(terms) - frac) < 0.04, frac
    p = run_bench("segments", "--long-frac", "0.3")  # the tiny task has no share to set: refused before any run
    assert p.returncode != 0 and "--task controlled" in p.stderr
    p = run_bench("segments", "--task", "controlled", "--long-frac", "1.5")
    assert p.returncode == 2 and "from 0 to 1" in p.stderr


def test_gpu_cost_model_by_hand():
    """Bytes over bandwidth, summed over decode steps: weights read once a step, each active row's KV cache
    (context so far) read once a step; a row that finishes leaves the batch."""
    from bench.gpu_cost import GPUCost
    c = GPUCost(layers=1, shared_bytes=100, expert_bytes=0, experts=1, top_k=1, kv_bytes_per_token=1,
                memory=1e9, hbm_bytes_per_s=1, flops=1e30, prefill_mfu=1, step_floor=0)
    assert abs(c.call_seconds([2], [3]) - (3 * 100 + (2 + 3 + 4))) < 1e-6
    assert abs(c.call_seconds([0, 0], [1, 3]) - (100 + 0 + 2 * 100 + (1 + 2))) < 1e-6
    small = GPUCost(layers=1, shared_bytes=0, expert_bytes=0, experts=1, top_k=1, kv_bytes_per_token=1,
                    memory=10 / 0.9, hbm_bytes_per_s=1, flops=1e30, step_floor=0)  # room for 10 tokens of KV
    # rows of 6 tokens each (context 1 + 5 generated): one at a time, so the second starts when the first ends
    assert abs(small.call_seconds([1, 1], [5, 5]) - 2 * (1 + 2 + 3 + 4 + 5)) < 1e-6
    assert abs(c.call_seconds([0, 0], [1, 3]) - c.call_seconds([0, 0], [3, 1])) < 1e-6


def test_simulated_rollout_trains_every_sample_once():
    """The real scheduler around LengthEngine: with S segments every sample needs ceil(length / (cap / S))
    rounds, every step trains --train-groups whole groups, and nothing is lost or duplicated."""
    from bench.simulate import long_tail, simulate_segments
    for segments in (1, 4):
        steps = simulate_segments(segments, long_tail(0, 64, 20, 0.8), 64, 4, 2, 4, 5, 2)
        assert len(steps) == 5 and all(len(lengths) == 4 * 2 for _, lengths in steps)
        assert all(4 < n <= 4 + 64 for _, lengths in steps for n in lengths)  # prompt of 4 + response
        assert all(max(gen) <= 64 // segments for calls, _ in steps for _, gen in calls)
        assert all(len(ctx) <= 4 * 2 for calls, _ in steps for ctx, _ in calls)


def test_gpu_cost_model_floor_replicas_update():
    """The revised model: a decode step pays the calibrated floor whatever its rows (the floor dominates a
    1-row step, not a full one); R replicas split a call by count and it lasts as long as the slowest; the
    update's FLOPs by hand; an overlapped step is the slower of rollout and update, else their sum."""
    from bench.gpu_cost import QWEN_BATCH1, GPUCost, floor_from_batch1, rl_step_seconds
    c = GPUCost()
    floor = floor_from_batch1(c, **QWEN_BATCH1)  # Qwen's batch-1 figure minus the model's own bytes
    assert 0.005 < floor < 0.0065 and abs(c.step_floor / floor - 1) < 0.01
    assert c.step_floor / c.step_seconds(1, 1000) > 0.75  # ~6.1 GB read in 1.3 ms, then the floor
    assert c.step_floor / c.step_seconds(1024, 500_000) < 0.25  # 60 GB of weights + 49 GB of KV cache
    # by hand: 3 decode steps of 10 (floor) + 100 (weights) + the KV cache read (2 + 3 + 4), no prefill cost
    hand = GPUCost(layers=1, shared_bytes=100, expert_bytes=0, experts=1, top_k=1, kv_bytes_per_token=1,
                   attention_width=0, memory=1e9, hbm_bytes_per_s=1, flops=1e30, step_floor=10)
    assert abs(hand.call_seconds([2], [3]) - (3 * 10 + 3 * 100 + (2 + 3 + 4))) < 1e-6
    # two replicas: the rows dealt round-robin, each engine alone, the call as long as the slower
    two = dataclasses.replace(hand, replicas=2)
    assert abs(two.call_seconds([2, 0, 0], [3, 1, 5]) - max(hand.call_seconds([2, 0], [3, 5]), hand.call_seconds([0], [1]))) < 1e-6
    # prefill: 2 x active params x tokens + causal attention 2 x layers x width x tokens^2, at prefill_mfu
    pre = GPUCost(layers=2, shared_bytes=10, expert_bytes=0, top_k=1, attention_width=3, flops=1.0, prefill_mfu=0.5)
    assert pre.forward_flops(4) == 2 * 5 * 4 + 2 * 2 * 3 * 16
    assert abs(pre.engine_seconds([4], [0]) - pre.forward_flops(4) / 0.5) < 1e-9
    # the update: (3 for forward + backward, 1 for pi_old, 1 for the reference with KL) x forward FLOPs
    upd = GPUCost(layers=1, shared_bytes=20, expert_bytes=0, top_k=1, attention_width=0, flops=100,
                  train_gpus=2, train_mfu=0.5)  # 10 active parameters
    assert abs(upd.update_seconds([5, 5]) - 4 * 2 * (2 * 10 * 5) / (2 * 100 * 0.5)) < 1e-9
    assert abs(dataclasses.replace(upd, kl=True).update_seconds([5, 5]) / upd.update_seconds([5, 5]) - 5 / 4) < 1e-9
    assert rl_step_seconds(3.0, 5.0, overlap=True) == 5.0 and rl_step_seconds(3.0, 5.0, overlap=False) == 8.0
    # more replicas, never slower; a call lasts at least its longest row's decode steps x the floor
    rng = random.Random(0)
    ctx, gen = [rng.randint(100, 2000) for _ in range(256)], [rng.randint(1, 65536) for _ in range(256)]
    times = [dataclasses.replace(c, replicas=r).call_seconds(ctx, gen) for r in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(times, times[1:])) and times[-1] >= max(gen) * c.step_floor
    # rows that all fit the KV budget decode together: the floor adds exactly (longest row) x floor
    ctx8, gen8 = ctx[:8], gen[:8]
    assert abs(c.call_seconds(ctx8, gen8) - dataclasses.replace(c, step_floor=0).call_seconds(ctx8, gen8)
               - max(gen8) * c.step_floor) < 1e-6


def test_gpu_table_reproduces_its_parts(monkeypatch):
    """gpu_table over a reduced scan: overlap never slower than rollout + update, the step at least the
    slower of the two on average, and more engines with a higher floor give segments the larger speedup."""
    from bench import gpu
    monkeypatch.setattr(gpu, "FLOORS", (0.0, 0.012))
    monkeypatch.setattr(gpu, "REPLICAS", (1, 64))
    monkeypatch.setattr(gpu, "MFUS", (0.4,))
    monkeypatch.setattr(gpu, "TAILS", ((40, 0.9),))
    rows = gpu.gpu_table([1, 4], 0, steps=2)
    assert len(rows) == 2 * 2 * 2
    key = {(x["floor_ms"], x["replicas"], x["overlap"]): x for x in rows}
    for x in rows:
        assert x["speedup"][0] == 1.0
        assert all(s >= max(r, u) - 1e-6 for s, r, u in zip(x["step_s"], x["rollout_s"], x["update_s"]))
        if not x["overlap"]:
            assert all(abs(s - r - u) < 1e-6 for s, r, u in zip(x["step_s"], x["rollout_s"], x["update_s"]))
            assert all(o <= s for o, s in zip(key[x["floor_ms"], x["replicas"], True]["step_s"], x["step_s"]))
    assert key[12.0, 64, True]["speedup"][1] > key[0.0, 1, True]["speedup"][1]


@pytest.mark.slow
def test_gpu():
    r = last_json(run_bench("gpu", "--segments", "1,2", "--steps", "1"))
    assert r["bench"] == "gpu" and r["segments"] == [1, 2] and len(r["by_replicas"]) == 8
    assert r["speedup_2"][0] <= r["speedup_2"][1] and r["step_s_first"][0] > 0, r


@pytest.mark.slow
def test_memory():
    p = run_bench("memory", "--sizes", "256", "--vocab", "1000", "--hidden", "16", "--chunk", "32,64")
    r = last_json(p)
    assert r["bench"] == "memory" and r["tokens"] == [256] and set(r["ratio"]) == {"chunked:32", "chunked:64"}
    assert all(isinstance(x[0], (int, float)) for x in r["peak_mb"].values()), r


@pytest.mark.slow
def test_sp():
    r = last_json(run_bench("sp", "--lengths", "64,128", "--rounds", "1"))
    assert r["bench"] == "sp" and [row["tokens"] for row in r["rows"]] == [64, 128]
    assert all(row["sp1_s"] > 0 and row["sp2_s"] > 0 for row in r["rows"]), r


@pytest.mark.slow
def test_decode(tmp_path):
    """Both engines on one tiny shape, each in its own process: a step's cost for every row count, and the figure
    written."""
    figure = tmp_path / "decode.png"
    r = last_json(run_bench("decode", "--models", "64x2", "--rows", "1,4", "--tokens", "4", "--rounds", "1",
                            "--figure", str(figure), "--dir", str(tmp_path), timeout=300))
    engines = ["hf", "vllm"] if __import__("importlib").util.find_spec("vllm") else ["hf"]
    assert r["bench"] == "decode" and sorted(r["results"]) == [f"{e} 64x2" for e in engines]
    assert all(len(x["step_ms"]) == 2 and x["params_m"] > 0 for x in r["results"].values()), r  # timings: not asserted
    assert figure.stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_seeds(tmp_path):
    """vLLM with and without a seed on each request, at a trivial size: figures for every row count."""
    r = last_json(run_bench("seeds", "--model", "64x2", "--rows", "2,4", "--tokens", "3", "--rounds", "2",
                            "--dir", str(tmp_path), timeout=300))
    assert r["bench"] == "seeds" and sorted(r["results"]) == ["2", "4"]
    assert all(x["seeded_tok_s"] > 0 and x["plain_tok_s"] > 0 for x in r["results"].values()), r  # timings only


def test_enforced_lengths_through_a_real_engine(tok, lm):
    """Enforced around the transformers engine (no stop id) under the real scheduler: a sample ends exactly where
    the long tail drew its length, whatever the segments, and a segment's call never decodes past cap / S."""
    from bench.scale import Enforced
    from bench.simulate import long_tail, segment_steps
    from systems.engine import HFEngine, Sampling
    eng = HFEngine(lm, [], tok.pad_token_id, seed=0)
    length = long_tail(1, 24, 8, 0.9)
    for segments in (1, 3):
        totals = {}

        def generate(prompts, budgets, keys):
            gens = eng.generate(prompts, budgets, Sampling(1.0), keys)
            for k, g in zip(keys, gens):
                totals[k] = totals.get(k, 0) + len(g.tokens)
            return gens

        enforced = Enforced(generate, length)
        run = segment_steps(enforced, segments, 24, 3, 2, 3)
        trained = []
        for _ in range(4):
            calls, lengths = next(run)
            assert len(lengths) == 6 and all(max(gen) <= 24 // segments for _, gen in calls)
            trained += lengths
        assert enforced.seconds > 0 and all(n <= length(k) for k, n in totals.items())
        ended = {length(k) for k, n in totals.items() if n == length(k)}
        assert all(n - 4 in ended for n in trained)  # prompts of 4 tokens
        assert segments == 1 or any(n - 4 > 24 // segments for n in trained)  # some took several segments


@pytest.mark.slow
def test_scale():
    """The scale mode at a trivial size, the transformers engine alone: every variant measured for every step,
    its samples all trained, its decode steps no more than the variant's segment length allows."""
    r = last_json(run_bench("scale", "--shape", "64x2", "--cap", "16", "--median", "6", "--prompts", "2", "--group",
                            "2", "--steps", "2", "--warmup", "0", "--segments", "1,4", "--engines", "hf", timeout=300))
    x = r["results"]["hf"]
    assert r["bench"] == "scale" and r["segments"] == [1, 4] and len(x["speedup"]) == 2 and x["speedup"][0] == 1
    assert all(0 < rows <= 4 for rows in x["rows_per_step"]) and all(n > 0 for n in x["decode_steps"]), r


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_reward():
    """The pool and the loop score the same pairs alike (the mode asserts it) and both take time."""
    r = last_json(run_bench("reward", "--n", "20", "--workers", "1"))
    assert r["bench"] == "reward" and r["n"] == 20 and r["workers"] == 1, r
    assert r["loop_s"] > 0 and r["pool_warm_s"] > 0 and 0 < r["accuracy_of_pairs"] < 1, r


@pytest.mark.slow
def test_offload():
    """Both thread counts step the same optimizer and take time."""
    r = last_json(run_bench("offload", "--millions", "2", "--tensors", "4", "--rounds", "2"))
    assert r["bench"] == "offload" and r["threads"] == 2 and r["step_s_1"] > 0 and r["step_s_2"] > 0, r


@pytest.mark.slow
def test_rg():
    """Two datasets' probes, one refused (coin_flip: '0' is within its absolute tolerance of most answers)."""
    r = last_json(run_bench("rg", "--datasets", "coin_flip,spell_backward"))
    assert r["bench"] == "rg" and r["datasets"] == 2 and r["refused"] == ["coin_flip"], r
    assert r["as is"] + r["full marks only"] == 1 and r["seconds"] > 0, r


@pytest.mark.slow
def test_plan_load():
    """The memory plan's loading measurement under torchrun, as docs/memory.md runs it: one JSON line a rank."""
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bench",
             "plan", "load", "--model", "tiny_ckpt"], cwd=ROOT, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = sorted((json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")), key=lambda x: x["rank"])
    assert [(x["rank"], x["ranks"], x["path"]) for x in rows] == [(0, 2, "sharded"), (1, 2, "sharded")], rows
    assert rows[0]["params"] > 0 and rows[0]["load_peak_mib"] >= 0, rows
