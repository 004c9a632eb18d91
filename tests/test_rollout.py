"""Segment rollout (UloRL Algorithm 1): bookkeeping over several steps (pools, segments, versions,
behaviour log-probs of continued samples), an uneven last segment, and the overlong reward of truncated
samples. The engine is the transformers one over a small random model (tests/conftest.py).

    python -m pytest tests/test_rollout.py
"""
import pytest
import torch

import reward
from naive import PROMPTS, TOL, ids, make_row, naive_logprobs
from segment_rollout import Pools, Sample, rollout_step
from systems import workers
from systems.engine import Engine, HFEngine, Sampling

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
        reward.score_samples(workers.run, samples, texts, max_len=7, overlong=overlong)
        return [s.reward for s in samples]

    assert run("zero") == [0.0, 1.0, 0.0]  # UloRL: truncated scores 0 (the default)
    assert run("none") == [1.0, 1.0, 0.0]
    assert run("filter") == [1.0, 1.0, 0.0]  # the update drops truncated samples instead


def test_the_overlong_penalty_counts_response_tokens_on_each_side_of_its_buffer(tok):
    """DAPO's soft penalty over the last 4 tokens before a cap of 12, for samples whose prompt (30 tokens) is longer
    than the cap: 8 response tokens are free, 9 lose 1/4, 11 lose 3/4, a truncated one (12) scores -1; under
    "zero" a sample of exactly 12 tokens that ended by EOS keeps its reward, a truncated one scores 0."""
    row = make_row("1+2+3+4+5+6+7+8+9+1+2+3+4+5+6=")
    prompt = ids(tok, row["prompt"])
    assert len(prompt) == 30

    def rewards(overlong, lengths, finish="eos"):
        samples = [Sample(i, i, prompt, row, tokens=[tok.eos_token_id] * n,
                          finish="truncated" if finish == "truncated" and n == 12 else "eos") for i, n in enumerate(lengths)]
        # every text right: 1 before the rule
        reward.score_samples(workers.run, samples, [":66"] * len(samples), 12, overlong, 4)
        return [s.reward for s in samples]

    assert rewards("soft", [7, 8, 9, 11]) == [1.0, 1.0, 0.75, 0.25]
    assert rewards("soft", [12], "truncated") == [-1.0]
    assert rewards("zero", [11, 12]) == [1.0, 1.0] and rewards("zero", [12], "truncated") == [0.0]


class Recording(Engine):
    """An engine that records what every generate call asks for, with the pools it was asked from and how many
    groups were ready for the update then."""

    def __init__(self, engine, pools, state=None):
        self.engine, self.pools, self.state, self.calls = engine, pools, state, []

    def generate(self, prompts, max_tokens, sampling, keys=None):
        batch = list(self.pools.unfinished)  # rollout_step puts the whole batch there before it asks
        self.calls.append({"prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens),
                           "expected": [(s.prompt_ids + s.tokens, len(s.tokens)) for s in batch],
                           "ready": len(self.state.ready) if self.state else 0})
        return self.engine.generate(prompts, max_tokens, sampling, keys)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def rounds(tok, lm):
    """Six steps of the trainer's rollout (rollouts.Rollouts) on 12-term problems (prompts of 24 tokens) with 3
    prompts x 2 samples a round, 4 segments of 4 tokens (cap 16), 1 group trained a step: unfinished samples
    continue at every round beside new ones, and groups left over from a step wait for the next. Returns (the recording engine, the samples of the trained groups, the
    config, each step's (groups ready before it, its record))."""
    import config
    import rollouts
    import tiny
    import ulorl
    cfg = config.parse_config(["--prompts-per-step", "3", "--group-size", "2", "--segments", "4",
                               "--max-response-len", "16", "--train-groups", "1", "--dynamic-sampling", "false",
                               "--data", "tiny:12"])
    pools, state = Pools(), ulorl.RunState()
    engine = Recording(HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=0), pools, state)
    roll = rollouts.Rollouts(engine, pools, tiny.make_rows(200, 0, 12), state, tok, Sampling(1.0), cfg, None,
                             workers.run)
    trained, steps = [], []
    for _ in range(6):
        before = len(state.ready)
        batch = roll.next()
        trained += [s for g in batch.groups for s in g]
        steps.append((before, batch.record))
        state.version += 1
    return engine, trained, cfg, steps


def test_no_round_holds_more_than_prompts_times_group_and_a_refill_fills_it(rounds):
    """A round decodes the unfinished samples and as many new groups as fit beside them in prompts x G rows: never
    more rows, never room for one more group left unused while fewer groups are ready than a step trains, and no
    new group once that many are ready (the unfinished samples still advance: every step runs a round)."""
    engine, _, cfg, steps = rounds
    slots = cfg.prompts_per_step * cfg.group_size
    sizes = []
    for call in engine.calls:
        continued = sum(n > 0 for _, n in call["expected"])
        new = len(call["prompts"]) - continued
        assert len(call["prompts"]) <= slots and new % cfg.group_size == 0
        if call["ready"] < cfg.train_groups:
            assert slots - len(call["prompts"]) < cfg.group_size
        else:
            assert new == 0
        sizes.append((continued, new, call["ready"] >= cfg.train_groups))
    assert any(c and n for c, n, _ in sizes) and any(c and not n for c, n, _ in sizes)  # refills, and rounds without
    assert any(full for _, _, full in sizes)  # rounds that began with enough groups ready
    assert all(record["rollout/rounds"] >= 1 for _, record in steps)
    assert any(before >= cfg.train_groups for before, _ in steps)


def test_a_continued_sample_asks_for_its_prompt_and_every_token_it_has_within_the_response_cap(rounds):
    """Each request is the sample's prompt followed by its whole response so far, and its budget is the segment
    or what the response cap (16 response tokens, the 24-token prompt not counted) leaves; a truncated sample
    ends with exactly 16 response tokens."""
    engine, trained, cfg, _ = rounds
    segment = cfg.max_response_len // cfg.segments
    for call in engine.calls:
        assert call["prompts"] == [p for p, _ in call["expected"]]
        assert call["max_tokens"] == [min(segment, cfg.max_response_len - n) for _, n in call["expected"]]
    assert any(n == 3 * segment for call in engine.calls for _, n in call["expected"])  # a 4th segment asked for
    assert any(s.finish == "truncated" for s in trained)
    assert all(len(s.tokens) == cfg.max_response_len for s in trained if s.finish == "truncated")



def test_a_round_the_engine_fails_is_retried_with_every_sample_it_held(tok, lm):
    """The engine raises once, in a round that holds continued and new samples: the retry decodes exactly those
    (the new ones already wait in the unfinished pool), and every drawn sample ends in exactly one place."""
    import config
    import rollouts
    import tiny
    import ulorl

    class FailsOnce(Recording):  # in the first round that continues some samples and starts others
        def generate(self, prompts, max_tokens, sampling, keys=None):
            seen = {k for call in self.calls for k in call["keys"]}
            self.calls.append({"keys": list(keys)})
            if not self.failed and seen & set(keys) and set(keys) - seen:
                self.failed = len(self.calls)
                raise RuntimeError("the engine fell over")
            return self.engine.generate(prompts, max_tokens, sampling, keys)

    cfg = config.parse_config(["--prompts-per-step", "3", "--group-size", "2", "--segments", "4",
                               "--max-response-len", "16", "--train-groups", "2", "--dynamic-sampling", "false"])
    pools, state = Pools(), ulorl.RunState()
    engine = FailsOnce(HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=0), pools)
    engine.failed = 0
    roll = rollouts.Rollouts(engine, pools, tiny.make_rows(50, 0, 12), state, tok, Sampling(1.0), cfg, None,
                             workers.run)
    trained = [s for _ in range(3) for g in roll.next().groups for s in g]
    assert engine.failed
    failed, retry = (engine.calls[engine.failed + i]["keys"] for i in (-1, 0))
    assert retry == failed
    where = [s.uid for s in trained + pools.unfinished + [s for g in pools.experience.values() for s in g]
             + [s for g in state.ready for s in g]]
    assert sorted(where) == list(range(pools.next_uid))


@pytest.mark.parametrize("trained_version, probing", [(0, True), (1, False)])
def test_an_overlapped_batch_probes_when_no_trained_token_is_of_the_current_weights(trained_version, probing):
    """--overlap: the step's rollout ran during the last update (on version 0's weights); the trainer is at version
    1. The batch probes the engine exactly when none of its tokens were sampled by the current weights, and
    records how many versions behind the decoding weights were."""
    import rollouts
    from config import parse_config
    from ulorl import RunState
    sample = Sample(0, 0, [1, 2], {}, tokens=[3, 4], versions=[0, trained_version], seg_starts=[0, 1])
    ahead = rollouts.Prefetched({**rollouts.new_record(Pools()), "rollout/rounds": 1}, [], 0)
    state = RunState(version=1, ready=[[sample]], prefetched=ahead)
    cfg = parse_config(["--train-groups", "1", "--overlap", "1", "--engine", "hf"])
    batch = rollouts.Overlapped(None, Pools(), [], state, None, Sampling(1.0), cfg, None, workers.run).next()
    assert batch.groups == [[sample]] and batch.probing is probing and batch.record["staleness/engine_lag"] == 1
