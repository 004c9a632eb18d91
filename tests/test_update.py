"""The update (ulorl.update, steps 5-6): pi_old under TOIS/SAIS/POIS on samples whose segments came from
three policy versions, the ratio metrics, a NaN loss skipped, and ProRL's reference reset.

    python -m pytest tests/test_update.py
"""
import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

import config
import loss
import model as model_lib
import ulorl
from naive import PROMPTS, TOL, ids, make_row, naive_logprobs
from segment_rollout import Pools, Sample, rollout_step
from systems import placement
from systems.distributed import Ranks
from systems.engine import HFEngine, Sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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


@pytest.mark.parametrize("is_mode", ["pois", "sais"])
def test_first_ratio_is_exactly_one_where_pi_old_is_the_current_weights(tok, multi_version, is_mode):
    """The update's first forward reproduces the no-grad pass exactly: the ratio is exactly 1 on every token
    under POIS, and under SAIS on the tokens the current weights (version 2) sampled; on older segments SAIS
    keeps their own policy's behaviour log-probs, so the ratio is not 1 there."""
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    assert len({len(s.tokens) for s in samples}) > 1  # right padding in the batch
    assert any(len(s.seg_starts) > 1 for s in samples)
    mb = model_lib.collate(samples, tok.pad_token_id)
    policy.eval()
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy, mb, 1.0)
    old = loss.old_logprobs(is_mode, current, mb.behaviour, mb.versions, 2)
    policy.train()
    try:
        logprobs, _ = model_lib.response_logprobs(policy, mb, 1.0)
    finally:
        policy.eval()
    assert logprobs.requires_grad
    ratio = torch.exp(logprobs - old)[mb.resp_mask]
    fresh = (mb.versions == 2)[mb.resp_mask]
    assert fresh.any() and (~fresh).any()
    assert torch.equal(ratio[fresh], torch.ones_like(ratio[fresh]))
    if is_mode == "pois":
        assert torch.equal(ratio, torch.ones_like(ratio)), (ratio - 1).abs().max()
        assert not torch.equal(old, mb.behaviour)  # older segments' behaviour log-probs are not pi_old
    else:
        assert (ratio[~fresh] - 1).abs().min() > 0 and (ratio[~fresh] - 1).abs().max() > 1e-3


@pytest.mark.parametrize("is_mode", ["pois", "sais"])
def test_update_ratio_metrics(tok, multi_version, is_mode):
    policy, groups, _ = multi_version
    policy = copy.deepcopy(policy)
    cfg = config.parse_config(["--is-mode", is_mode, "--mini-batch", "0", "--lr", "1e-3"])
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = copy.deepcopy(policy.state_dict())
    out = ulorl.update(placement.wrap(policy, "none"), None, opt, sched, groups, 2, tok.pad_token_id, cfg, Ranks())
    assert out["train/optimizer_steps"] == 1
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items()), "no update happened"
    if is_mode == "pois":
        assert out["ratio/max"] == 1.0 and out["ratio/mean"] == 1.0
        assert out["clip/low_frac"] == 0 and out["clip/high_frac"] == 0
    else:  # earlier segments came from other weights: the ratio is not 1 there
        assert out["ratio/max"] > 1.0 + 1e-4


@pytest.mark.parametrize("stale", [False, True])
def test_the_gap_watch_stops_a_stale_engine_before_any_weight_moves(tok, multi_version, stale):
    """The gap watch, applied where the model is wrapped and armed for version 2, sees the pass before the optimizer
    and checks it at the optimizer's first forward: an engine whose log-probs of version 2's tokens are 1 nat off
    (k3 e^1 - 2 = 0.72 a token, past --max-engine-kl 0.1) stops the update with every weight and the optimizer as
    they were; the engine that sampled them (the same weights) passes, its KL ~0 on every version-2 token."""
    from systems.engine_gap import Watch
    policy, groups, _ = multi_version
    policy, groups = copy.deepcopy(policy), copy.deepcopy(groups)
    if stale:
        for s in (s for g in groups for s in g):
            s.logprobs = [lp - 1.0 if v == 2 else lp for lp, v in zip(s.logprobs, s.versions)]
    cfg = config.parse_config(["--mini-batch", "0", "--lr", "1e-3"])
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    watch, before = Watch(cfg), copy.deepcopy(policy.state_dict())
    watch.start(2, [])
    fresh = sum(v == 2 for g in groups for s in g for v in s.versions)
    wrapped = placement.wrap(policy, "none", watch=watch)
    if stale:
        with pytest.raises(RuntimeError, match="past --max-engine-kl 0.1"):
            ulorl.update(wrapped, None, opt, sched, groups, 2, tok.pad_token_id, cfg, Ranks())
        assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items()) and not opt.state
        assert watch.gap.kl() == pytest.approx(math.e - 2, rel=1e-3)
    else:
        out = ulorl.update(wrapped, None, opt, sched, groups, 2, tok.pad_token_id, cfg, Ranks()) | watch.metrics()
        assert out["train/optimizer_steps"] == 1 and out["rollout/engine_kl"] < 1e-6
    assert watch.gap.n == fresh > 0


def test_update_ratio_max_is_a_max_over_micro_batches(tok, multi_version):
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    mb = model_lib.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy.eval(), mb, 1.0)
    old = torch.where(mb.versions == 2, current, mb.behaviour)  # SAIS: fresh tokens' pi_old is the trainer's
    true_max = torch.exp(current - old)[mb.resp_mask].max().item()
    assert true_max > 1.0 + 1e-4
    cfg = config.parse_config(["--is-mode", "sais", "--mpt", "off", "--max-tokens-per-micro-batch", "40"])
    assert len(model_lib.micro_batches(samples, cfg.max_tokens_per_micro_batch)) > 1
    policy = copy.deepcopy(policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = ulorl.update(placement.wrap(policy, "none"), None, opt, sched, groups, 2, tok.pad_token_id, cfg, Ranks())
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

    mb = model_lib.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy.eval(), mb, 1.0)
    old = loss.old_logprobs("sais", current, mb.behaviour, mb.versions, 2)
    assert torch.equal(loss.old_logprobs("tois", current, mb.behaviour, mb.versions, 2), old)
    assert torch.equal(loss.old_logprobs("pois", current, mb.behaviour, mb.versions, 2), current)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        assert mb.versions[i, :n].tolist() == s.versions
        for t in range(n):  # segments of older versions: their behaviour log-prob; the current one's: recomputed
            want = current[i, t] if s.versions[t] == 2 else torch.tensor(s.logprobs[t])
            assert old[i, t] == want, (s.uid, t)
        # the trainer's current log-probs are the latest version's
        assert torch.allclose(current[i, :n].double(), naive[2][s.uid], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="is-mode"):
        loss.old_logprobs("ppo", current, mb.behaviour, mb.versions, 2)



def test_nan_loss_skips_the_update():
    """A verifier that returns NaN makes the advantages and the loss NaN: the update is skipped and reported,
    and the weights are untouched."""
    cfg = config.parse_config(["--mpt", "off"])
    policy, tok = model_lib.load(cfg.model)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    prompt, response = tok("3+4=").input_ids, tok("4=7:7").input_ids + [tok.eos_token_id]
    n = len(response)
    groups = []
    for g, rewards in enumerate([[1.0, 0.0], [math.nan, 1.0]]):
        groups.append([Sample(2 * g + i, g, prompt, {}, tokens=response, logprobs=[-0.1] * n, versions=[0] * n,
                              seg_starts=[0], finish="eos", reward=r) for i, r in enumerate(rewards)])
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = placement.wrap(policy, "none")
    m = ulorl.update(trainer, None, opt, sched, groups, 0, tok.pad_token_id, cfg, Ranks())
    assert m["train/skipped_updates"] == 1 and m["train/optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert not opt.state  # nothing of the NaN step reached the optimizer
    json.dumps(m, allow_nan=False)  # and the record stays valid JSON
    state = ulorl.RunState(version=3)
    ulorl.after_update(m, state, cfg, warn=False)  # no weights changed: no new policy version to stamp tokens with
    assert (state.version, state.bad_steps) == (3, 1)
    m = ulorl.update(trainer, None, opt, sched, groups[:1], 0, tok.pad_token_id, cfg, Ranks())  # good data trains again
    assert m["train/optimizer_steps"] == 1
    assert not all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    ulorl.after_update(m, state, cfg, warn=False)
    assert (state.version, state.bad_steps) == (4, 0)


def test_the_loss_divides_by_the_tokens_of_every_micro_batch_of_the_step(tok, multi_version):
    """The token-level loss: every micro-batch's loss is divided by the token count of the whole optimizer step
    (all its micro-batches), not by its own, so that splitting a batch into micro-batches of unequal sizes
    changes nothing. The weights after one plain gradient step (SGD: the change is the gradient itself) are
    those of the same batch in one micro-batch, and so is the loss."""
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    lengths = sorted(len(s.prompt_ids) + len(s.tokens) for s in samples)
    results = []
    for micro_tokens in (10**6, lengths[-1] + lengths[0]):  # one micro-batch; then several, of unequal sizes
        cfg = config.parse_config(["--max-tokens-per-micro-batch", str(micro_tokens), "--grad-clip", "1e9",
                                   "--mpt", "off", "--pack", "true"])
        split = model_lib.micro_batches(samples, micro_tokens, True)
        sizes = {sum(len(samples[i].tokens) for i in mb) for mb in split}
        assert len(split) == 1 if micro_tokens == 10**6 else len(split) > 4 and len(sizes) > 2
        trainer = copy.deepcopy(policy)
        opt = torch.optim.SGD(trainer.parameters(), lr=1.0)
        out = ulorl.update(placement.wrap(trainer, "none"), None, opt, torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 1.0), groups, 2, tok.pad_token_id, cfg, Ranks())
        results.append((out["loss/policy"], {k: v - policy.state_dict()[k] for k, v in trainer.state_dict().items()}))
    (one_loss, one), (many_loss, many) = results
    assert many_loss == pytest.approx(one_loss, rel=1e-5, abs=1e-7)
    assert max((one[k] - many[k]).abs().max() for k in one) < 1e-6 * max(one[k].abs().max() for k in one)
    assert max(one[k].abs().max() for k in one) > 1e-4  # the step moved the weights


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

    trained = copy.deepcopy(policy.state_dict())
    ulorl.reset_reference(policy, ref, opt)
    pol_sd, ref_sd = policy.state_dict(), ref.state_dict()
    assert pol_sd.keys() == ref_sd.keys() == trained.keys()
    for k in pol_sd:  # the policy is copied into the reference, never the other way
        assert torch.equal(pol_sd[k], trained[k]) and torch.equal(ref_sd[k], trained[k]), k
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


def test_update_divides_by_every_response_token_under_dmmpts(tok, multi_version):
    """The update's first loss under POIS (ratio 1, so each kept token's loss is -A): the sum of -A over the
    tokens DMMPTs keep, divided by *every* response token (UloRL Eq. 10), not by the kept ones."""
    policy, groups, _ = multi_version
    policy = copy.deepcopy(policy)
    samples = [s for g in groups for s in g]
    cfg = config.parse_config(["--mpt", "static", "--mpt-tau", "0.05", "--segments", "1", "--max-response-len", "64"])
    mb = model_lib.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, entropy = model_lib.response_logprobs(policy.eval(), mb, cfg.temperature)
    keep = mb.resp_mask & loss.mpt_mask(current, entropy, mb.rewards, mb.resp_mask, 0.05, math.inf)
    assert 0 < (mb.resp_mask & ~keep).sum() < mb.resp_mask.sum() // 2, "the case needs some masked tokens"
    adv = ulorl.sample_advantages(groups)
    expected = -(adv[:, None] * keep).sum().item() / mb.resp_mask.sum().item()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    out = ulorl.update(placement.wrap(policy, "none"), None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       groups, 2, tok.pad_token_id, cfg, Ranks())
    assert out["loss/policy"] == pytest.approx(expected, rel=1e-5)
    assert out["mpt/masked_frac"] == pytest.approx(1 - keep.sum().item() / mb.resp_mask.sum().item())


def test_update_averages_each_sample_first_under_agg_sample(tok, multi_version):
    """--agg sample (GRPO): the update's first loss under POIS (each kept token's loss is -A) is the mean over
    samples of each one's sum of -A over the tokens DMMPTs keep divided by its own response length, over micro-batches
    of a few samples each."""
    policy, groups, _ = multi_version
    policy = copy.deepcopy(policy)
    samples = [s for g in groups for s in g]
    cfg = config.parse_config(["--mpt", "static", "--mpt-tau", "0.05", "--segments", "1", "--max-response-len", "64",
                               "--agg", "sample", "--max-tokens-per-micro-batch", "64"])
    mb = model_lib.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, entropy = model_lib.response_logprobs(policy.eval(), mb, cfg.temperature)
    keep = mb.resp_mask & loss.mpt_mask(current, entropy, mb.rewards, mb.resp_mask, 0.05, math.inf)
    adv = ulorl.sample_advantages(groups)
    expected = sum(-adv[i].item() * keep[i].sum().item() / len(s.tokens) for i, s in enumerate(samples)) / len(samples)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    assert len(ulorl.plan_micro_batches(samples, adv, tok.pad_token_id, cfg, Ranks())[0]) > 2
    out = ulorl.update(placement.wrap(policy, "none"), None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       groups, 2, tok.pad_token_id, cfg, Ranks())
    assert out["loss/policy"] == pytest.approx(expected, rel=1e-5) and abs(expected) > 1e-3


def test_update_logs_the_covariance_of_log_prob_and_advantage_and_the_part_dmmpts_mask(tok, multi_version):
    """entropy/cov over every response token of the step, against a naive loop over the tokens (the same
    log-probs, pi at the update's weights), and its parts on the tokens DMMPTs mask and on the rest, over
    micro-batches of a few samples each."""
    policy, groups, _ = multi_version
    policy = copy.deepcopy(policy)
    samples = [s for g in groups for s in g]
    cfg = config.parse_config(["--mpt", "static", "--mpt-tau", "0.05", "--segments", "1", "--max-response-len", "64",
                               "--max-tokens-per-micro-batch", "64"])
    mb = model_lib.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, entropy = model_lib.response_logprobs(policy.eval(), mb, cfg.temperature)
    keep = loss.mpt_mask(current, entropy, mb.rewards, mb.resp_mask, 0.05, math.inf)
    adv = ulorl.sample_advantages(groups)
    tokens = [(current[i, t].item(), adv[i].item(), bool(keep[i, t]))
              for i in range(len(samples)) for t in range(len(samples[i].tokens))]
    mean_lp, mean_adv = (sum(v[j] for v in tokens) / len(tokens) for j in (0, 1))
    part = lambda pick: sum((lp - mean_lp) * (a - mean_adv) for lp, a, k in tokens if pick(k)) / len(tokens)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    assert len(ulorl.plan_micro_batches(samples, adv, tok.pad_token_id, cfg, Ranks())[0]) > 2
    out = ulorl.update(placement.wrap(policy, "none"), None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       groups, 2, tok.pad_token_id, cfg, Ranks())
    assert out["entropy/cov"] == pytest.approx(part(lambda k: True), rel=1e-5, abs=1e-9)
    assert out["entropy/cov_masked"] == pytest.approx(part(lambda k: not k), rel=1e-5, abs=1e-9)
    assert out["entropy/cov_trained"] == pytest.approx(part(lambda k: k), rel=1e-5, abs=1e-9)
    assert out["entropy/cov_masked"] != 0 and out["entropy/cov_trained"] != 0


def _sample(uid, seg_versions, seg_lens):
    versions = [v for v, n in zip(seg_versions, seg_lens) for _ in range(n)]
    starts = [sum(seg_lens[:i]) for i in range(len(seg_lens))]
    return Sample(uid, uid, [1], {}, tokens=[5] * len(versions), logprobs=[-0.1] * len(versions),
                  versions=versions, seg_starts=starts, finish="eos", reward=1.0)


def test_staleness_on_a_scripted_pool():
    # weights being updated: version 7. Sample a: segments by versions 4, 6, 7 of 10, 10, 5 tokens;
    # b: one segment of 8 tokens by version 5 (finished early, waited for its group); c: 2 tokens by 7.
    # tokens: lags 3 x10, 1 x10, 0 x5, 2 x8, 0 x2 -> mean (30 + 10 + 16) / 35 = 1.6, max 3
    # last segments: a 0, b 2, c 0 -> mean 2/3, max 2
    samples = [_sample(0, [4, 6, 7], [10, 10, 5]), _sample(1, [5], [8]), _sample(2, [7], [2])]
    got = ulorl.staleness(samples, 7)
    assert got == pytest.approx({"staleness/token_mean": 56 / 35, "staleness/token_max": 3,
                                 "staleness/last_segment_mean": 2 / 3, "staleness/last_segment_max": 2})
    assert ulorl.staleness([_sample(0, [7], [3])], 7) == {"staleness/token_mean": 0.0, "staleness/token_max": 0,
                                                          "staleness/last_segment_mean": 0.0,
                                                          "staleness/last_segment_max": 0}


def test_stall_trigger_on_a_scripted_eval_history():
    # patience 2: the baseline 0.5, then 0.6 (better), 0.6, 0.55 (two without improvement: reset), 0.58, 0.61
    # (better), 0.6, 0.6 (reset again)
    state = ulorl.RunState()
    history = [0.5, 0.6, 0.6, 0.55, 0.58, 0.61, 0.6, 0.6]
    assert [ulorl.stalled(state, a, 2) for a in history] == [False, False, False, True, False, False, False, True]
    assert state.best_eval == 0.61
    never = ulorl.RunState()
    assert not any(ulorl.stalled(never, a, 0) for a in history)  # patience 0: never


@pytest.mark.parametrize("renew", ["both", "reference", "optimizer"])
def test_reset_renews_what_reset_names(tok, lm, renew):
    """--reset: the reference takes the policy's weights under both and reference, and only then; AdamW forgets its
    moments under both and optimizer, and only then; the policy keeps its weights every time."""
    policy = copy.deepcopy(lm).train()
    ref = copy.deepcopy(lm).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    x = torch.tensor([ids(tok, "3+4=7") + [tok.eos_token_id]])
    policy(input_ids=x, labels=x).loss.backward()
    opt.step()
    trained, reference = copy.deepcopy(policy.state_dict()), copy.deepcopy(ref.state_dict())
    assert any(not torch.equal(trained[k], reference[k]) for k in trained) and opt.state
    ulorl.reset_reference(policy, ref, opt, renew=renew)
    assert all(torch.equal(trained[k], v) for k, v in policy.state_dict().items())
    took = all(torch.equal(trained[k], v) for k, v in ref.state_dict().items())
    kept = all(torch.equal(reference[k], v) for k, v in ref.state_dict().items())
    assert (took, kept) == ((True, False) if renew != "optimizer" else (False, True))
    assert (len(opt.state) == 0) == (renew != "reference")


def test_reset_without_a_reference_clears_only_the_optimizer(tok, lm):
    policy = copy.deepcopy(lm).train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    x = torch.tensor([ids(tok, "3+4=7") + [tok.eos_token_id]])
    policy(input_ids=x, labels=x).loss.backward()
    opt.step()
    before = copy.deepcopy(policy.state_dict())
    assert len(opt.state) > 0
    ulorl.reset_reference(policy, None, opt)
    assert len(opt.state) == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_lr_factor_warms_up_then_follows_the_cosine_to_lr_final():
    """The schedule by hand: 10 steps of 4 mini-batches (16 groups x 8 / 32) = 40 updates, 4 of warm-up, the
    cosine over all the others; then 10 steps of one update whose last 4 anneal."""
    cfg = config.parse_config(["--steps", "10", "--mini-batch", "32", "--warmup-steps", "4", "--lr-final", "0.1",
                               "--lr-decay-steps", "0"])
    f = [ulorl.lr_factor(u, cfg) for u in range(40)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, then the cosine starts at 1
    assert f[39] == pytest.approx(0.1)  # the last update runs at --lr-final
    middle = 4 + (39 - 4) / 2  # halfway through the cosine: (1 + 0.1) / 2
    assert ulorl.lr_factor(middle, cfg) == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(f[3:], f[4:]))  # never rises after warm-up
    wsd = config.parse_config(["--steps", "10", "--lr-decay-steps", "4", "--lr-final", "0.2"])  # 1 update a step
    f = [ulorl.lr_factor(u, wsd) for u in range(10)]
    assert f[:7] == [1.0] * 7 and f[9] == pytest.approx(0.2)  # stable, then the last 4 steps anneal
    assert f[7] == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 3)))
    constant = config.parse_config(["--steps", "10", "--lr-final", "1"])
    assert {ulorl.lr_factor(u, constant) for u in range(12)} == {1.0}
    for preset in ("ulorl", "prorl"):  # both papers train at a constant learning rate
        assert config.PRESETS[preset]["lr_final"] == 1.0


def test_dynamic_sampling_drops_exactly_the_groups_whose_rewards_are_all_equal():
    groups = [[SimpleNamespace(reward=r) for r in rs] for rs in ([1, 1], [0, 1], [0, 0], [0.5, 0.5, 1])]
    kept, dropped = ulorl.dynamic_sampling(groups, enabled=True)
    assert kept == [groups[1], groups[3]] and dropped == 2
    assert ulorl.dynamic_sampling(groups, enabled=False) == (groups, 0)


@pytest.mark.parametrize("is_mode, surplus, left, dropped", [
    ("pois", "wait", 2, None), ("sais", "wait", 2, None), ("tois", "wait", 0, 2),
    ("pois", "drop", 0, 2), ("sais", "drop", 0, 2), ("tois", "drop", 0, 2)])
def test_take_groups_keeps_the_surplus_except_under_tois_or_drop(is_mode, surplus, left, dropped):
    """The first --train-groups ready groups train; the rest wait for the next step, except under TOIS, whose
    tokens must all come from the weights being updated, and --surplus drop: the surplus is dropped."""
    state = ulorl.RunState(ready=["g0", "g1", "g2", "g3"])
    groups, n = ulorl.take_groups(state, SimpleNamespace(train_groups=2, is_mode=is_mode, surplus=surplus))
    assert groups == ["g0", "g1"] and n == dropped and state.ready == ["g2", "g3"][:left]


def test_token_masks_filter_truncated_samples_whole_and_keep_dmmpt_tokens_in_the_denominator():
    """--overlong filter takes a truncated sample out of the loss (both masks); a DMMPT-masked token leaves only
    the policy-gradient mask (UloRL Eq. 10: it stays in the denominator)."""
    resp = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    mb = SimpleNamespace(resp_mask=resp, empty=False, truncated=torch.tensor([False, True, False]),
                         rewards=torch.tensor([1.0, 1.0, 0.0]))
    mastered = torch.full((3, 3), math.log(0.999))
    entropy = torch.zeros(3, 3)
    cfg = SimpleNamespace(overlong="filter", mpt="dynamic", mpt_tau=0.99, mpt_sigma=0.2)
    loss_mask, pg_mask = ulorl.token_masks(mb, mastered, entropy, cfg)
    assert torch.equal(loss_mask, torch.tensor([[True, True, False], [False, False, False], [True, True, True]]))
    assert torch.equal(pg_mask, torch.tensor([[False, False, False], [False, False, False], [True, True, True]]))
    loss_mask, pg_mask = ulorl.token_masks(mb, mastered, entropy, SimpleNamespace(**{**vars(cfg), "overlong": "zero",
                                                                                      "mpt": "off"}))
    assert torch.equal(loss_mask, resp) and torch.equal(pg_mask, resp)
