"""The update (ulorl.update, steps 5-6): pi_old under TOIS/SAIS/POIS on samples whose segments came from
three policy versions, the ratio metrics, a NaN loss skipped, and ProRL's reference reset.

    python -m pytest tests/test_update.py -q
"""
import copy
import json
import math

import pytest
import torch

import loss
import model as model_lib
import train
import ulorl
from engine import HFEngine, Sampling
from naive import PROMPTS, TOL, ids, make_row, naive_logprobs
from segment_rollout import Pools, Sample, rollout_step

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


def test_pois_ratio_is_exactly_one(tok, multi_version):
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    assert len({len(s.tokens) for s in samples}) > 1  # right padding in the batch
    assert any(len(s.seg_starts) > 1 for s in samples)
    mb = model_lib.collate(samples, tok.pad_token_id)
    policy.eval()
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy, mb, 1.0)
    old = loss.old_logprobs("pois", current, mb.behaviour)
    policy.train()
    try:
        logprobs, _ = model_lib.response_logprobs(policy, mb, 1.0)
    finally:
        policy.eval()
    assert logprobs.requires_grad
    ratio = torch.exp(logprobs - old)
    assert torch.equal(ratio, torch.ones_like(ratio)), (ratio - 1).abs().max()
    # the stored behaviour log-probs of earlier segments are not pi_old under POIS
    assert not torch.equal(old, mb.behaviour)


@pytest.mark.parametrize("is_mode", ["pois", "sais"])
def test_update_ratio_metrics(tok, multi_version, is_mode):
    policy, groups, _ = multi_version
    policy = copy.deepcopy(policy)
    cfg = train.parse_config(["--is-mode", is_mode, "--mini-batch", "0", "--lr", "1e-3"])
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = copy.deepcopy(policy.state_dict())
    out = ulorl.update(model_lib.wrap(policy, "none"), None, opt, sched, groups, 2, tok.pad_token_id, cfg)
    assert out["train/optimizer_steps"] == 1
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items()), "no update happened"
    if is_mode == "pois":
        assert out["ratio/max"] == 1.0 and out["ratio/mean"] == 1.0
        assert out["clip/low_frac"] == 0 and out["clip/high_frac"] == 0
    else:  # earlier segments came from other weights: the ratio is not 1 there
        assert out["ratio/max"] > 1.0 + 1e-4


def test_update_ratio_max_is_a_max_over_micro_batches(tok, multi_version):
    policy, groups, _ = multi_version
    samples = [s for g in groups for s in g]
    mb = model_lib.collate(samples, tok.pad_token_id)
    with torch.no_grad():
        current, _ = model_lib.response_logprobs(policy.eval(), mb, 1.0)
    true_max = torch.exp(current - mb.behaviour)[mb.resp_mask].max().item()
    cfg = train.parse_config(["--is-mode", "sais", "--mpt", "off", "--max-tokens-per-micro-batch", "40"])
    assert len(model_lib.micro_batches(samples, cfg.max_tokens_per_micro_batch)) > 1
    policy = copy.deepcopy(policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = ulorl.update(model_lib.wrap(policy, "none"), None, opt, sched, groups, 2, tok.pad_token_id, cfg)
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
    old = loss.old_logprobs("sais", current, mb.behaviour)
    assert torch.equal(loss.old_logprobs("tois", current, mb.behaviour), old)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        assert torch.equal(old[i, :n], torch.tensor(s.logprobs))
        assert mb.versions[i, :n].tolist() == s.versions
        # the trainer's current log-probs are the latest version's
        assert torch.allclose(current[i, :n].double(), naive[2][s.uid], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="is-mode"):
        loss.old_logprobs("ppo", current, mb.behaviour)



def test_nan_loss_skips_the_update():
    """A verifier that returns NaN makes the advantages and the loss NaN: the update is skipped and reported,
    and the weights are untouched."""
    cfg = train.parse_config(["--mpt", "off"])
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
    trainer = model_lib.wrap(policy, "none")
    m = ulorl.update(trainer, None, opt, sched, groups, 0, tok.pad_token_id, cfg)
    assert m["train/skipped_updates"] == 1 and m["train/optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert not opt.state  # nothing of the NaN step reached the optimizer
    json.dumps(m, allow_nan=False)  # and the record stays valid JSON
    m = ulorl.update(trainer, None, opt, sched, groups[:1], 0, tok.pad_token_id, cfg)  # good data trains again
    assert m["train/optimizer_steps"] == 1
    assert not all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


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

    ulorl.reset_reference(policy, ref, opt)
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
