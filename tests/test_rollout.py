"""Segment rollout (UloRL Algorithm 1): bookkeeping over several steps (pools, segments, versions,
behaviour log-probs of continued samples), an uneven last segment, and the overlong reward of truncated
samples. The engine is the transformers one over a small random model (tests/conftest.py).

    python -m pytest tests/test_rollout.py
"""
import pytest
import torch

import reward
from engine import HFEngine, Sampling
from naive import PROMPTS, TOL, ids, make_row, naive_logprobs
from segment_rollout import Pools, Sample, rollout_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
        for uid in in_batch:
            s = created[uid]
            start = before.get(uid, 0)
            assert s.seg_starts[-1] == start
            produced.setdefault(uid, []).append((version, start, len(s.tokens)))
        assert r["tokens/generated"] == sum(e - b for uid in in_batch for _, b, e in produced[uid][-1:])

        # every sample is in exactly one pool; none lost, none duplicated
        unf = [s.uid for s in pools.unfinished]
        fin = [s.uid for grp, members in pools.experience.items() for s in members]
        assert len(unf) == len(set(unf)) and len(fin) == len(set(fin))
        assert not set(unf) & set(fin)
        assert set(unf) | set(fin) == set(created)
        assert r["rollout/unfinished"] == len(unf)
        assert all(s.group == grp for grp, members in pools.experience.items() for s in members)

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
    assert len({s.group for s in created.values()}) == sum(new_per_step)
    group = pools.pop_group(0)
    assert len(group) == G and 0 not in pools.experience

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



def test_truncated_sample_scores_zero(tok):
    body = ids(tok, "7,12:12")  # a correct answer to 3+4+5=
    row = make_row("3+4+5=")
    prompt = ids(tok, row["prompt"])
    eos = tok.eos_token_id

    def make(tokens, finish, uid):
        return Sample(uid, uid, prompt, row, tokens=list(tokens), finish=finish)

    def run(overlong):
        samples = [make(body, "truncated", 0), make(body + [eos], "eos", 1), make(ids(tok, "7,13:13") + [eos], "eos", 2)]
        texts = tok.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
        reward.score_samples(samples, texts, max_len=7, overlong=overlong)
        return [s.reward for s in samples]

    assert run("zero") == [0.0, 1.0, 0.0]  # UloRL: truncated scores 0 (the default)
    assert run("none") == [1.0, 1.0, 0.0]
    assert run("filter") == [1.0, 1.0, 0.0]  # the update drops truncated samples instead
