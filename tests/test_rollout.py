"""Rollout tier: the HF engine's behaviour log-probs against a naive recomputation, segment-rollout
bookkeeping over several steps, the overlong reward of truncated samples, TOIS/SAIS/POIS old log-probs,
and ProRL's reference reset. A small *random* tiny model (fp32, CPU): its next-token distribution is close
to uniform over 17 tokens, so EOS (p ~ 1/17 per token) ends some responses and the caps end others.

    python -m pytest tests/test_rollout.py -q
"""
import copy
import math

import pytest
import torch

import model as model_lib
import tiny
import train
import ulorl
import engine as engine_lib
from engine import HFEngine, Sampling
from segment_rollout import Pools, Sample, rollout_step

TOL = 1e-5  # fp32 engine (KV cache, left padding) vs one unpadded forward


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    return tiny.make_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    """The shared random model; tests that change weights work on a deepcopy."""
    return tiny.make_model(tok, seed=0).eval()


def ids(tok, text):
    return tok(text).input_ids


PROMPTS = ["3+4=", "1+2+3+4+5+6=", "9=", "5+5+5="]  # 4, 12, 2 and 6 tokens: left padding differs per row


# ------------------------------------------------------------------------------ naive reference

def naive_dists(model, prompt: list[int], tokens: list[int], sampling: Sampling) -> list[dict[int, float]]:
    """For each response token: {token id: log-prob} of the sampling distribution at that position, over
    the tokens it keeps, from one forward over prompt + response without padding or cache. Written
    independently of engine.process_logits: plain Python over the sorted vocabulary."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()  # [L, V]
    dists = []
    for t in range(len(tokens)):
        row = (logits[len(prompt) - 1 + t] / sampling.temperature).tolist()
        order = sorted(range(len(row)), key=lambda j: -row[j])
        if 0 < sampling.top_k < len(row):
            order = order[:sampling.top_k]
        z = math.log(sum(math.exp(row[j]) for j in order))
        logp = {j: row[j] - z for j in order}
        if sampling.top_p < 1.0:  # the smallest prefix of the ranking whose mass reaches top_p
            kept, mass = [], 0.0
            for j in order:
                kept.append(j)
                mass += math.exp(logp[j])
                if mass >= sampling.top_p:
                    break
            z = math.log(sum(math.exp(logp[j]) for j in kept))
            logp = {j: logp[j] - z for j in kept}
        dists.append(logp)
    return dists


def naive_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    dists = naive_dists(model, prompt, tokens, Sampling(temperature))
    return torch.tensor([d[x] for d, x in zip(dists, tokens)], dtype=torch.float64)


# ------------------------------------------------------------------------------ 1. engine

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


# ------------------------------------------------------------------------------ 2. segment rollout

def make_row(prompt: str) -> dict:
    return {"prompt": prompt, "answer": str(eval(prompt[:-1])), "verifier": "tiny"}


def test_segment_bookkeeping(tok, lm):
    G, segment_len, max_len, eos = 3, 4, 12, tok.eos_token_id
    sampling = Sampling(0.9)
    eng = HFEngine(lm, [eos], tok.pad_token_id, seed=0)
    pools = Pools()
    new_per_step = [3, 2, 1, 0, 0, 0]
    versions = [10, 13, 17, 21, 30, 31]  # a different version at every step
    created: dict[int, Sample] = {}
    produced: dict[int, list[tuple[int, int, int]]] = {}  # uid -> (version, start, end) per step it was in
    prompt_cycle = iter(PROMPTS * 10)
    for step, (n_new, version) in enumerate(zip(new_per_step, versions)):
        if not pools.unfinished and not n_new:
            break
        new = [pools.new_group(ids(tok, p), make_row(p), G) for p in [next(prompt_cycle) for _ in range(n_new)]]
        for g in new:
            assert len({s.group for s in g}) == 1 and len(g) == G
            for s in g:
                assert s.uid not in created
                created[s.uid] = s
        before = {s.uid: len(s.tokens) for s in pools.unfinished}
        in_batch = list(before) + [s.uid for g in new for s in g]
        r = rollout_step(eng, pools, new, segment_len, max_len, sampling, version)
        assert r["rollout/batch"] == len(in_batch) and r["rollout/new_samples"] == G * n_new
        for uid in in_batch:
            s = created[uid]
            start = before.get(uid, 0)
            assert s.seg_starts[-1] == start
            produced.setdefault(uid, []).append((version, start, len(s.tokens)))
        assert r["tokens/generated"] == sum(e - b for uid in in_batch for _, b, e in produced[uid][-1:])

        # every sample is in exactly one pool; none lost, none duplicated
        unf = [s.uid for s in pools.unfinished]
        fin = [s.uid for grp, members in pools.finished.items() for s in members]
        assert len(unf) == len(set(unf)) and len(fin) == len(set(fin))
        assert not set(unf) & set(fin)
        assert set(unf) | set(fin) == set(created)
        assert r["rollout/unfinished"] == len(unf)
        assert all(s.group == grp for grp, members in pools.finished.items() for s in members)
        assert r["rollout/eos"] == sum(created[u].finish == "eos" for u in in_batch)
        assert r["rollout/truncated"] == sum(created[u].finish == "truncated" for u in in_batch)

        for s in created.values():
            n = len(s.tokens)
            assert len(s.logprobs) == len(s.versions) == n
            # segments: one per step the sample took part in, each the tokens that step produced
            assert s.seg_starts == [b for _, b, _ in produced[s.uid]]
            bounds = s.seg_starts + [n]
            segs = [s.tokens[a:b] for a, b in zip(bounds, bounds[1:])]
            assert sum(segs, []) == s.tokens
            assert all(1 <= len(seg) <= segment_len for seg in segs)
            for (v, a, b) in produced[s.uid]:
                assert s.versions[a:b] == [v] * (b - a)
            assert s.segment_versions() == [v for v, _, _ in produced[s.uid]]
            assert eos not in s.tokens[:-1]
            if s.finish is None:
                assert s.uid in unf and n < max_len and n == segment_len * len(segs)
                assert s.tokens[-1] != eos
            elif s.finish == "eos":
                assert s.uid in fin and s.tokens[-1] == eos and n <= max_len
            else:
                assert s.finish == "truncated" and s.uid in fin
                assert n == max_len and s.tokens[-1] != eos
            # every segment but the last stopped at the segment cap
            assert all(len(seg) == segment_len for seg in segs[:-1])

        # ready groups: exactly those with all G members finished, oldest first
        ready = pools.ready_groups(G)
        expected = sorted({s.group for s in created.values()}
                          - {s.group for s in created.values() if s.finish is None})
        assert [g[0].group for g in ready] == expected
        for g in ready:
            assert len(g) == G and len({s.uid for s in g}) == G and all(s.finish for s in g)
            assert {s.group for s in g} == {g[0].group}

    assert not pools.unfinished, "max_len is 3 segments: everything ends within 3 steps of its start"
    finishes = [s.finish for s in created.values()]
    assert "eos" in finishes and "truncated" in finishes
    assert any(len(s.seg_starts) == 3 for s in created.values())
    assert pools.in_flight_groups() == sum(new_per_step)
    group = pools.pop_group(0)
    assert len(group) == G and 0 not in pools.finished

    # continuation correctness: same weights all along, so every token's behaviour log-prob is the full
    # sequence's, however many segments (and left-padded continuations) produced it
    multi = [s for s in created.values() if len(s.seg_starts) == 3]
    assert multi
    for s in created.values():
        expected = naive_logprobs(lm, s.prompt_ids, s.tokens, sampling.temperature)
        assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), expected, atol=TOL, rtol=0), s.uid


def test_rollout_uneven_last_segment(tok, lm):
    """max_len not a multiple of segment_len: the last segment is shorter and ends truncated at max_len."""
    eng = HFEngine(lm, [], tok.pad_token_id, seed=0)  # no stop id: every sample runs to the cap
    pools = Pools()
    new = [pools.new_group(ids(tok, "2+2="), make_row("2+2="), 2)]
    lens = []
    for v in range(3):
        rollout_step(eng, pools, new if v == 0 else [], 4, 10, Sampling(1.0), v)
        lens.append(sorted(len(s.tokens) for s in pools.unfinished))
    assert lens == [[4, 4], [8, 8], []]
    (g,) = pools.ready_groups(2)
    for s in g:
        assert s.finish == "truncated" and len(s.tokens) == 10 and s.seg_starts == [0, 4, 8]
        assert s.segment_versions() == [0, 1, 2]


# ------------------------------------------------------------------------------ 3. overlong reward

def test_truncated_sample_scores_zero(tok):
    body = ids(tok, "7,12:12")  # a correct answer to 3+4+5=
    row = make_row("3+4+5=")
    prompt = ids(tok, row["prompt"])
    eos = tok.eos_token_id

    def make(tokens, finish, uid):
        return Sample(uid, uid, prompt, row, tokens=list(tokens), finish=finish)

    def run(argv):
        cfg = train.parse_config(argv)
        samples = [make(body, "truncated", 0), make(body + [eos], "eos", 1), make(ids(tok, "7,13:13") + [eos], "eos", 2)]
        train.score(samples, tok, cfg)
        return [s.reward for s in samples]

    assert run(["--max-response-len", "7", "--segments", "1"]) == [0.0, 1.0, 0.0]  # default --overlong zero
    assert run(["--max-response-len", "7", "--segments", "1", "--overlong", "none"]) == [1.0, 1.0, 0.0]


# ------------------------------------------------------------------------------ 4. importance sampling

@pytest.fixture(scope="module")
def multi_version(tok, lm):
    """Groups rolled out over 3 steps (versions 0, 1, 2) with the weights perturbed after each step; the
    engine shares the module, as in training. Returns (model at version 2, groups, state dict per version)."""
    policy = copy.deepcopy(lm)
    eng = HFEngine(policy, [tok.eos_token_id], tok.pad_token_id, seed=5)
    pools, states = Pools(), {}
    gen = torch.Generator().manual_seed(0)
    new = [pools.new_group(ids(tok, p), make_row(p), 4) for p in PROMPTS]
    for version in range(3):
        states[version] = copy.deepcopy(policy.state_dict())
        rollout_step(eng, pools, new if version == 0 else [], 4, 12, Sampling(1.0), version)
        if version < 2:
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
    assert not pools.unfinished
    groups = pools.ready_groups(4)
    assert len(groups) == len(PROMPTS)
    for g in groups:  # informative: two right, two wrong in every group
        for i, s in enumerate(g):
            s.reward = float(i % 2)
    return policy, groups, states


def test_pois_ratio_is_exactly_one(tok, multi_version):
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    assert len({len(s.tokens) for s in samples}) > 1  # right padding in the batch
    assert any(len(s.seg_starts) > 1 for s in samples)
    mb = ulorl.collate(samples, tok.pad_token_id)
    policy.eval()
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy, mb, 1.0)
    old = ulorl.old_logprobs("pois", current, mb["behaviour"])
    policy.train()
    try:
        logprobs, _ = model_lib.response_logprobs(policy, mb, 1.0)
    finally:
        policy.eval()
    assert logprobs.requires_grad
    ratio = torch.exp(logprobs - old)
    assert torch.equal(ratio, torch.ones_like(ratio)), (ratio - 1).abs().max()
    # the stored behaviour log-probs of earlier segments are not pi_old under POIS
    assert not torch.equal(old, mb["behaviour"])


@pytest.mark.parametrize("is_mode", ["pois", "sais"])
def test_train_on_ratio_metrics(tok, multi_version, is_mode):
    policy, groups, _ = multi_version
    policy = copy.deepcopy(policy)
    cfg = train.parse_config(["--is-mode", is_mode, "--mini-batch", "0", "--lr", "1e-3"])
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = copy.deepcopy(policy.state_dict())
    out = train.train_on(model_lib.wrap(policy, "none"), None, opt, sched, groups, 2, tok.pad_token_id, cfg)
    assert out["train/optimizer_steps"] == 1
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items()), "no update happened"
    if is_mode == "pois":
        assert out["ratio/max"] == 1.0 and out["ratio/mean"] == 1.0
        assert out["clip/low_frac"] == 0 and out["clip/high_frac"] == 0
    else:  # earlier segments came from other weights: the ratio is not 1 there
        assert out["ratio/max"] > 1.0 + 1e-4


def test_train_on_ratio_max_is_a_max_over_micro_batches(tok, multi_version):
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    mb = ulorl.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy.eval(), mb, 1.0)
    true_max = torch.exp(current - mb["behaviour"])[mb["resp_mask"]].max().item()
    cfg = train.parse_config(["--is-mode", "sais", "--mpt", "off", "--max-tokens-per-micro-batch", "40"])
    assert len(ulorl.micro_batches(samples, cfg.max_tokens_per_micro_batch)) > 1
    policy = copy.deepcopy(policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = train.train_on(model_lib.wrap(policy, "none"), None, opt, sched, groups, 2, tok.pad_token_id, cfg)
    assert out["ratio/max"] == pytest.approx(true_max, rel=1e-5)


def test_sais_uses_each_segments_own_policy(tok, lm, multi_version):
    policy, groups, states = multi_version
    samples = [s for g in groups for s in g]
    three = [s for s in samples if len(s.seg_starts) == 3]
    assert three, "need samples continued over 3 segments"
    scratch = copy.deepcopy(lm)
    naive = {}  # version -> uid -> log-probs of the whole response under that version's weights
    for v, sd in states.items():
        scratch.load_state_dict(sd)
        naive[v] = {s.uid: naive_logprobs(scratch.eval(), s.prompt_ids, s.tokens, 1.0) for s in samples}
    for s in samples:
        stored = torch.tensor(s.logprobs, dtype=torch.float64)
        bounds = s.seg_starts + [len(s.tokens)]
        for v, (a, b) in zip(s.segment_versions(), zip(bounds, bounds[1:])):
            assert s.versions[a:b] == [v] * (b - a)
            assert torch.allclose(stored[a:b], naive[v][s.uid][a:b], atol=TOL, rtol=0), (s.uid, v)
            if v < 2:  # the weights changed since: the latest policy disagrees on these tokens
                assert (stored[a:b] - naive[2][s.uid][a:b]).abs().max() > 1e-3
    assert [s.segment_versions() for s in three] == [[0, 1, 2]] * len(three)

    mb = ulorl.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy.eval(), mb, 1.0)
    old = ulorl.old_logprobs("sais", current, mb["behaviour"])
    assert torch.equal(ulorl.old_logprobs("tois", current, mb["behaviour"]), old)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        assert torch.equal(old[i, :n], torch.tensor(s.logprobs))
        assert mb["versions"][i, :n].tolist() == s.versions
        # the trainer's current log-probs are the latest version's
        assert torch.allclose(current[i, :n].double(), naive[2][s.uid], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="is-mode"):
        ulorl.old_logprobs("ppo", current, mb["behaviour"])


# ------------------------------------------------------------------------------ 5. reference reset

def test_reset_reference(tok, lm):
    policy = copy.deepcopy(lm).train()
    ref = copy.deepcopy(lm).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    x = torch.tensor([ids(tok, "3+4=7") + [tok.eos_token_id], ids(tok, "1+2+3=3,6:6")[:6]])

    def step():
        opt.zero_grad(set_to_none=True)
        policy(input_ids=x, labels=x).loss.backward()
        opt.step()

    for _ in range(3):
        step()
    assert any(not torch.equal(p, r) for p, r in zip(policy.parameters(), ref.parameters()))
    assert len(opt.state) > 0

    train.reset_reference(policy, ref, opt)
    pol_sd, ref_sd = policy.state_dict(), ref.state_dict()
    assert pol_sd.keys() == ref_sd.keys()
    for k in pol_sd:
        assert torch.equal(pol_sd[k], ref_sd[k]), k
    pol_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not pol_ptrs & {p.data_ptr() for p in ref.parameters()}, "ref must own its tensors"
    assert ref.get_output_embeddings().weight is ref.get_input_embeddings().weight  # still tied
    assert len(opt.state) == 0

    frozen = copy.deepcopy(ref_sd)
    step()  # the optimizer still works, from fresh moments
    assert all(opt.state[p]["step"] == 1 for p in policy.parameters() if p.grad is not None)
    assert any(not torch.equal(policy.state_dict()[k], frozen[k]) for k in frozen)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, frozen[k]), f"changing the policy changed the reference's {k}"
