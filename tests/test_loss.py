"""Tests for loss.py, the pure tensor functions of the objective:
group advantages, the clipped token-/sample-level loss with decoupled clips, the global denominator across
micro-batches, the k3 KL, the DMMPT mask, chunked token log-probs/entropy, the loss metrics and truncated
importance sampling. Expected values are computed by hand (arithmetic in the comments) or by a naive
per-token Python loop over the papers' formula. CPU, a few seconds.

    python -m pytest tests/test_loss.py
"""

import math

import pytest
import torch

from loss import Covariance, group_advantages, kl_k3, mpt_mask, old_logprobs, policy_loss, tis_weights, token_logprobs

EPS_LOW, EPS_HIGH = 0.2, 0.4  # ProRL's decoupled clip


# ---------------------------------------------------------------------------------------------------------
# 1. group advantages

def test_group_advantages_hand_2x4_sample_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0],
                      [1.0, 1.0, 0.0, 0.0]])
    # row 0: mean .25; deviations .75, -.25, -.25, -.25; sum of squares .5625 + 3 * .0625 = .75
    #   sample var .75 / 3 = .25 -> std .5   -> A = .75 / .5 = 1.5, -.25 / .5 = -0.5
    #   (population std sqrt(.75 / 4) = .4330 would give 1.7321 / -0.5774)
    # row 1: mean .5; deviations +-.5; sum of squares 1; sample var 1/3 -> std .57735 -> A = +-.5 / .57735 = +-.86603
    #   (population std .5 would give +-1)
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5],
                             [0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)]])
    a = group_advantages(r)
    assert a.shape == (2, 4)
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=0)
    # explicitly not the population std
    assert abs(a[0, 0].item() - 0.75 / math.sqrt(0.75 / 4)) > 0.2
    assert abs(a[1, 0].item() - 1.0) > 0.1


def test_group_advantages_eps_in_denominator():
    # (r - mean) / (std + eps): with eps = 1 the row [1,0,0,0] gives .75 / (.5 + 1) = .5
    a = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=1.0)
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.25 / 1.5, -0.25 / 1.5, -0.25 / 1.5]]))


def test_group_advantages_all_equal_rows_are_zero():
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0],
                      [0.0, 0.0, 0.0, 0.0],
                      [0.3, 0.3, 0.3, 0.3],
                      [1.0, 0.0, 1.0, 0.0]])
    a = group_advantages(r)
    assert torch.equal(a[:3], torch.zeros(3, 4))
    assert torch.isfinite(a).all() and (a[3] != 0).all()
    # rows are independent: the mixed row is the same as on its own
    torch.testing.assert_close(a[3:], group_advantages(r[3:]))


def test_group_advantages_matches_naive_random():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(5, 8, generator=g, dtype=torch.float64)
    a = group_advantages(r)
    for i in range(5):
        row = r[i].tolist()
        mean = sum(row) / 8
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / 7)  # Bessel: n - 1
        for j in range(8):
            assert a[i, j].item() == pytest.approx((row[j] - mean) / (std + 1e-6), abs=1e-9)


# ---------------------------------------------------------------------------------------------------------
# 2. clipped surrogate, token level, asymmetric clips

# The hand case. Two samples, T = 4, token 3 of each is padding (mask 0, with a wild ratio that must not matter).
#   sample 0, A = +2: ratios 1.5 (> 1.4: clipped high), 0.5 (< 0.8 but A > 0: min picks the unclipped 0.5 * 2),
#                     1.2 (inside), pad 3.0
#   sample 1, A = -1: ratios 0.5 (< 0.8: clipped low), 1.5 (> 1.4 but A < 0: min picks the unclipped -1.5),
#                     0.9 (inside), pad 0.1
# per-token surrogate min(rho A, clip(rho) A):
#   s0: min(3.0, 1.4 * 2 = 2.8) = 2.8;  min(1.0, 0.8 * 2 = 1.6) = 1.0;   min(2.4, 2.4) = 2.4
#   s1: min(-0.5, -0.8) = -0.8;         min(-1.5, -1.4) = -1.5;          min(-0.9, -0.9) = -0.9
# J = (2.8 + 1.0 + 2.4 - 0.8 - 1.5 - 0.9) / 6 = 3.0 / 6 = 0.5  ->  loss = -0.5
# d loss / d logp_t = -A * rho / 6 where unclipped (d rho / d logp = rho), 0 where clipped:
#   s0: [0, -2 * .5 / 6 = -1/6, -2 * 1.2 / 6 = -0.4, 0];  s1: [0, 1.5 / 6 = 0.25, 0.9 / 6 = 0.15, 0]
HAND_RATIOS = [[1.5, 0.5, 1.2, 3.0], [0.5, 1.5, 0.9, 0.1]]
HAND_OLD = [[-1.0, -2.0, -0.5, -3.0], [-0.3, -1.7, -2.2, -0.8]]
HAND_ADV = [2.0, -1.0]
HAND_MASK = [[1, 1, 1, 0], [1, 1, 1, 0]]
HAND_LOSS = -0.5
HAND_GRAD = [[0.0, -1 / 6, -0.4, 0.0], [0.0, 0.25, 0.15, 0.0]]


def _hand_inputs():
    old = torch.tensor(HAND_OLD, dtype=torch.float64)
    logprobs = (old + torch.tensor(HAND_RATIOS, dtype=torch.float64).log()).requires_grad_()
    return logprobs, old, torch.tensor(HAND_ADV, dtype=torch.float64), torch.tensor(HAND_MASK, dtype=torch.float64)


def test_policy_loss_hand_value_and_gradient():
    logprobs, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    assert loss.item() == pytest.approx(HAND_LOSS, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor(HAND_GRAD, dtype=torch.float64), atol=1e-12, rtol=0)
    g = logprobs.grad
    assert g[0, 0] == 0 and g[1, 0] == 0  # clipped: no gradient
    assert (g[:, 1:3] != 0).all()  # unclipped (including both "min picks the unclipped term" tokens)
    assert (g[:, 3] == 0).all()  # padding


def test_policy_loss_hand_advantage_per_token_and_bool_mask():
    # advantages given as [B, T] (same value on every token) and a bool mask: same result
    logprobs, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logprobs, old, adv[:, None].expand(2, 4).clone(), mask.bool(),
                          eps_low=EPS_LOW, eps_high=EPS_HIGH)
    assert loss.item() == pytest.approx(HAND_LOSS, abs=1e-12)


def test_policy_loss_symmetric_default_clip_differs_on_hand_case():
    # with the default eps_high = 0.2, token (s0, t0) is clipped at 1.2: 2 * 1.2 = 2.4 instead of 2.8,
    # and (s0, t2) with rho = 1.2 sits on the boundary (2.4 either way): J = (3.0 - 0.4) / 6
    logprobs, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(-(3.0 - 0.4) / 6, abs=1e-12)


def _naive_per_token(lp, old, adv, eps_low, eps_high, ref=None, kl_coef=0.0):
    """[B][T] nested lists of the per-token loss -min(rho A, clip(rho) A) + kl_coef * k3, plain Python."""
    B, T = len(lp), len(lp[0])
    out = []
    for i in range(B):
        row = []
        for t in range(T):
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            rho = math.exp(lp[i][t] - old[i][t])
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            v = -min(rho * a, clipped * a)
            if ref is not None:
                d = ref[i][t] - lp[i][t]
                v += kl_coef * (math.exp(d) - d - 1)
            row.append(v)
        out.append(row)
    return out


def _random_batch(seed, B=5, T=7, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # ratios spread over both clips
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).to(torch.float64)
    mask[0, 0] = 1
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    return lp, old, adv, mask, ref


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_policy_loss_token_matches_naive_loop(per_token_adv):
    lp, old, adv, mask, _ = _random_batch(1, per_token_adv=per_token_adv)
    per = _naive_per_token(lp.tolist(), old.tolist(), adv.tolist(), EPS_LOW, EPS_HIGH)
    m = mask.tolist()
    kept = sum(sum(row) for row in m)
    expected = sum(per[i][t] for i in range(len(m)) for t in range(len(m[0])) if m[i][t]) / kept
    loss, _ = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # the batch really exercises both clips
    ratio = (lp - old).exp()
    assert ((ratio > 1 + EPS_HIGH) & (mask > 0)).any() and ((ratio < 1 - EPS_LOW) & (mask > 0)).any()


def test_policy_loss_gradient_matches_finite_differences():
    # the gradient of the whole loss w.r.t. each kept log-prob, against central differences of the naive loop
    lp, old, adv, mask, _ = _random_batch(2)
    lp = lp.clone().requires_grad_()
    policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)[0].backward()
    m = mask.tolist()
    kept = sum(sum(row) for row in m)

    def f(x):
        per = _naive_per_token(x, old.tolist(), adv.tolist(), EPS_LOW, EPS_HIGH)
        return sum(per[i][t] for i in range(len(m)) for t in range(len(m[0])) if m[i][t]) / kept

    h = 1e-6
    base = lp.detach().tolist()
    for i in range(len(m)):
        for t in range(len(m[0])):
            up = [row[:] for row in base]
            dn = [row[:] for row in base]
            up[i][t] += h
            dn[i][t] -= h
            assert lp.grad[i, t].item() == pytest.approx((f(up) - f(dn)) / (2 * h), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# 3. sample-level aggregation (GRPO)

def test_policy_loss_sample_agg_hand_differs_from_token():
    # ratio 1 everywhere (logprobs == old): per-token loss = -A.
    # sample 0: 3 kept tokens with A = 1 -> per-token -1, mean -1
    # sample 1: 1 kept token with A = -3 -> per-token 3, mean 3
    # sample 2: no kept token (A = 100 on its padding must not matter, nor its count)
    # token agg: (-1 - 1 - 1 + 3) / 4 = 0;  sample agg: (-1 + 3) / 2 = 1 (divided by 2 samples, not 3)
    lp = torch.zeros(3, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -3.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)
    tok, _ = policy_loss(lp, lp, adv, mask, agg="token")
    smp, _ = policy_loss(lp, lp, adv, mask, agg="sample")
    assert tok.item() == pytest.approx(0.0, abs=1e-12)
    assert smp.item() == pytest.approx(1.0, abs=1e-12)


def test_policy_loss_sample_agg_matches_naive_loop():
    lp, old, adv, mask, _ = _random_batch(3, B=6, T=9)
    mask[2] = 0  # a sample with no kept token: excluded from the mean over samples
    mask[4, :] = 0
    mask[4, 0] = 1  # a one-token sample
    per = _naive_per_token(lp.tolist(), old.tolist(), adv.tolist(), EPS_LOW, EPS_HIGH)
    m = mask.tolist()
    sample_means = []
    for i in range(len(m)):
        kept = [per[i][t] for t in range(len(m[0])) if m[i][t]]
        if kept:
            sample_means.append(sum(kept) / len(kept))
    assert len(sample_means) == 5
    expected = sum(sample_means) / len(sample_means)
    loss, _ = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, agg="sample")
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    tok, _ = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, agg="token")
    assert abs(tok.item() - loss.item()) > 1e-3  # samples of different lengths: the two really differ


# ---------------------------------------------------------------------------------------------------------
# 4. the global denominator across micro-batches

@pytest.mark.parametrize("agg", ["token", "sample"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_denom_split_batch_equals_whole_batch(agg, kl_coef):
    lp, old, adv, mask, ref = _random_batch(4, B=6, T=8)
    mask[1] = 0  # a sample with no kept token, in the first micro-batch
    lp = lp.clone().requires_grad_()
    whole, _ = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logprobs=ref, kl_coef=kl_coef, agg=agg)
    whole.backward()
    whole_grad = lp.grad.clone()
    lp.grad = None

    # the trainer's count over all micro-batches (an integer tensor, as train.py passes it)
    denom = mask.bool().sum() if agg == "token" else (mask.sum(1) > 0).sum()
    assert int(denom) == (int(mask.sum()) if agg == "token" else 5)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 6)):  # uneven micro-batches, each backward separately
        part, _ = policy_loss(lp[sl], old[sl], adv[sl], mask[sl], eps_low=EPS_LOW, eps_high=EPS_HIGH,
                              ref_logprobs=ref[sl], kl_coef=kl_coef, agg=agg, denom=denom)
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(lp.grad, whole_grad, atol=1e-12, rtol=0)

    # without denom each micro-batch divides by its own count, and the sum is not the whole batch's loss
    own = sum(policy_loss(lp[sl], old[sl], adv[sl], mask[sl], eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logprobs=ref[sl], kl_coef=kl_coef, agg=agg)[0].item()
              for sl in (slice(0, 2), slice(2, 6)))
    assert abs(own - whole.item()) > 1e-3


def test_denom_plain_number():
    # denom as a Python int: the hand case's total -3.0 (J sum 3.0) divided by 10 instead of 6
    logprobs, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, denom=10)
    assert loss.item() == pytest.approx(-0.3, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# 5. k3 KL

def test_kl_k3_hand_values():
    # logp = ln .5, ref = ln .25: d = ref - logp = ln .5 = -0.693147; k3 = e^d - d - 1 = .5 + .693147 - 1 = 0.193147
    # logp = ln .25, ref = ln .5: d = ln 2 = 0.693147;  k3 = 2 - .693147 - 1 = 0.306853
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1],
                                                              dtype=torch.float64))
    assert kl_k3(logp, ref)[0].item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_k3(logp, ref)[1].item() == pytest.approx(0.306853, abs=1e-6)


def test_kl_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(1000, generator=g) * 10
    ref = -torch.rand(1000, generator=g) * 10
    k = kl_k3(logp, ref)
    assert (k >= 0).all() and (k > 0).any()
    assert torch.equal(kl_k3(logp, logp), torch.zeros(1000))


def test_policy_loss_adds_kl_coef_times_mean_k3_over_kept_tokens():
    lp, old, adv, mask, ref = _random_batch(6)
    base, _ = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    with_kl, metrics = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logprobs=ref, kl_coef=0.1)
    m, l, r = mask.tolist(), lp.tolist(), ref.tolist()
    ks = [math.exp(r[i][t] - l[i][t]) - (r[i][t] - l[i][t]) - 1
          for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
    mean_k3 = sum(ks) / len(ks)
    assert mean_k3 > 1e-3
    assert (with_kl - base).item() == pytest.approx(0.1 * mean_k3, abs=1e-12)
    assert metrics["loss/kl"] == pytest.approx(mean_k3, abs=1e-12)
    # ref given but kl_coef 0: no change
    assert policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logprobs=ref)[0].item() == pytest.approx(base.item(), abs=1e-15)


def test_policy_loss_kl_gradient():
    # d k3 / d logp = 1 - exp(ref - logp); with A = 0 the only gradient is kl_coef * that / kept count.
    # logp = ln .5, ref = ln .25 -> 1 - .5 = .5;  logp = ln .25, ref = ln .5 -> 1 - 2 = -1;  third token masked
    lp = torch.tensor([[math.log(0.5), math.log(0.25), -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), mask, ref_logprobs=ref, kl_coef=2.0)
    # loss = 2 * (0.193147 + 0.306853) / 2 = 0.5
    assert loss.item() == pytest.approx(0.5, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[2 * 0.5 / 2, 2 * -1.0 / 2, 0.0]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------
# 6. DMMPT mask

LOG_HI, LOG_LO = math.log(0.995), math.log(0.5)  # a mastered (p >= .99) and a non-mastered token


def _mpt_case():
    # T = 4; token 3 is padding for every sample except sample 5 (which has 4 real tokens).
    logprobs = torch.tensor([
        [LOG_HI, LOG_LO, LOG_HI, 0.0],  # 0: reward 1, low entropy -> the two high-prob tokens masked
        [LOG_HI, LOG_LO, LOG_HI, 0.0],  # 1: reward 1, high entropy -> all train
        [LOG_HI, LOG_LO, LOG_HI, 0.0],  # 2: reward 0, low entropy -> all train
        [LOG_HI, LOG_LO, LOG_HI, 0.0],  # 3: reward exactly 1.0 given as 1.0, low entropy: positive
        [LOG_HI, LOG_LO, LOG_HI, 0.0],  # 4: reward .9 (partial credit), low entropy: not positive
        [LOG_LO, LOG_HI, LOG_LO, LOG_HI],  # 5: reward 1, no padding, low entropy
    ], dtype=torch.float64)
    entropy = torch.tensor([
        [0.1, 0.1, 0.1, 1e6],  # padding entropy huge: the mean over real tokens is .1
        [0.5, 0.3, 0.4, 0.0],  # mean .4 >= .2 (and padding 0 would pull a wrong mean over 4 down to .3)
        [0.1, 0.1, 0.1, 1e6],
        [0.0, 0.3, 0.0, 1e6],  # mean .1
        [0.1, 0.1, 0.1, 0.1],
        [0.1, 0.1, 0.1, 0.1],
    ], dtype=torch.float64)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.9, 1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]] * 5 + [[1, 1, 1, 1]])
    return logprobs, entropy, rewards, mask


def test_mpt_mask_cases():
    logprobs, entropy, rewards, mask = _mpt_case()
    keep = mpt_mask(logprobs, entropy, rewards, mask, tau=0.99, sigma=0.2)
    assert keep.dtype == torch.bool and keep.shape == (6, 4)
    expected = torch.tensor([
        [False, True, False, True],  # padding (even with logprob 0, p = 1) stays True
        [True, True, True, True],
        [True, True, True, True],
        [False, True, False, True],
        [True, True, True, True],
        [True, False, True, False],
    ])
    assert torch.equal(keep, expected)


def test_mpt_mask_padding_entropy_does_not_count():
    # a sample whose real tokens have mean entropy .4 but with many zero-entropy padding positions: a mean
    # over all T positions would be .4 * 2 / 8 = .1 < .2 and wrongly mask. Over the 2 real tokens: .4 -> no mask.
    logprobs = torch.full((1, 8), LOG_HI, dtype=torch.float64)
    entropy = torch.tensor([[0.4, 0.4, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0]])
    keep = mpt_mask(logprobs, entropy, torch.tensor([1.0]), mask)
    assert keep.all()
    # and the reverse: padding with huge entropy on a low-entropy sample
    entropy = torch.tensor([[0.1, 0.1, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9]], dtype=torch.float64)
    keep = mpt_mask(logprobs, entropy, torch.tensor([1.0]), mask)
    assert torch.equal(keep, torch.tensor([[False, False, True, True, True, True, True, True]]))


def test_mpt_mask_judges_entropy_per_sample_not_per_token():
    # a positive sample, every token mastered, mean entropy (0.05 + 0.05 + 0.35) / 3 = 0.15 < 0.2: all three are
    # masked, the one whose own entropy is 0.35 too; with mean 0.25 (>= 0.2) none is, the 0.05 ones neither
    logprobs = torch.full((2, 3), LOG_HI, dtype=torch.float64)
    entropy = torch.tensor([[0.05, 0.05, 0.35], [0.05, 0.05, 0.65]], dtype=torch.float64)
    keep = mpt_mask(logprobs, entropy, torch.tensor([1.0, 1.0]), torch.ones(2, 3), tau=0.99, sigma=0.2)
    assert torch.equal(keep, torch.tensor([[False, False, False], [True, True, True]]))


def test_mpt_mask_thresholds_inclusive_tau_strict_sigma():
    # probability exactly tau counts as mastered (>=): logprob 0 is probability exactly 1.0, tau = 1.0
    lp = torch.tensor([[0.0, math.log(0.999)]], dtype=torch.float64)
    ent = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    keep = mpt_mask(lp, ent, torch.tensor([1.0]), torch.tensor([[1, 1]]), tau=1.0, sigma=0.2)
    assert torch.equal(keep, torch.tensor([[False, True]]))
    # and with the default tau: a token whose exp(logprob) is exactly tau's float value
    lp = torch.tensor([[math.log(0.99), math.log(0.98)]], dtype=torch.float64)
    assert lp[0, 0].exp().item() == 0.99  # exact round trip in float64
    keep = mpt_mask(lp, ent, torch.tensor([1.0]), torch.tensor([[1, 1]]))
    assert torch.equal(keep, torch.tensor([[False, True]]))
    # mean entropy exactly sigma is not below it (< sigma): nothing masked. .25 is exact in binary.
    lp = torch.zeros(1, 2, dtype=torch.float64)
    ent = torch.tensor([[0.25, 0.25]], dtype=torch.float64)
    assert mpt_mask(lp, ent, torch.tensor([1.0]), torch.tensor([[1, 1]]), sigma=0.25).all()
    assert not mpt_mask(lp, ent, torch.tensor([1.0]), torch.tensor([[1, 1]]), sigma=0.2500001).any()
    # reward above 1 is positive too (reward >= 1)
    assert not mpt_mask(lp, ent * 0, torch.tensor([2.0]), torch.tensor([[1, 1]])).any()


def test_mpt_mask_static_variant_sigma_inf():
    logprobs, entropy, rewards, mask = _mpt_case()
    entropy = entropy * 1e3  # every sample now far above any finite sigma
    dynamic = mpt_mask(logprobs, entropy, rewards, mask, sigma=0.2)
    assert dynamic.all()
    static = mpt_mask(logprobs, entropy, rewards, mask, sigma=math.inf)
    expected = torch.tensor([
        [False, True, False, True],
        [False, True, False, True],  # the high-entropy positive sample is masked too
        [True, True, True, True],  # reward 0: never
        [False, True, False, True],
        [True, True, True, True],  # reward .9: never
        [True, False, True, False],
    ])
    assert torch.equal(static, expected)


def test_mpt_mask_all_padding_sample_stays_true():
    lp = torch.zeros(2, 3)
    ent = torch.zeros(2, 3)
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]])
    keep = mpt_mask(lp, ent, torch.tensor([1.0, 1.0]), mask)
    assert torch.equal(keep, torch.tensor([[True, True, True], [False, False, False]]))


# ---------------------------------------------------------------------------------------------------------
# 7. chunked token log-probs and entropy

def _naive_logprobs_entropy(hidden, weight, targets, temperature):
    logp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 64])  # 3 and 4 do not divide N = 11; 64 > N
def test_token_logprobs_matches_naive(chunk):
    g = torch.Generator().manual_seed(7)
    N, H, V, temp = 11, 8, 13, 0.7
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    coef = torch.randn(N, generator=g)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, targets, temperature=temp, chunk=chunk)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp_ref, ent_ref = _naive_logprobs_entropy(h2, w2, targets, temp)
    assert lp.shape == (N,) and ent.shape == (N,)
    torch.testing.assert_close(lp, lp_ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref.detach(), atol=1e-5, rtol=0)
    assert ent.requires_grad and lp.requires_grad  # an entropy term in the loss trains

    (lp * coef).sum().backward()
    (lp_ref * coef).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=0)
    h1.grad = w1.grad = h2.grad = w2.grad = None
    ent = token_logprobs(h1, w1, targets, temperature=temp, chunk=chunk)[1]
    (ent * coef).sum().backward()  # the entropy's gradient through the checkpointed chunks
    (_naive_logprobs_entropy(h2, w2, targets, temp)[1] * coef).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=0)

    with torch.no_grad():  # the no-grad (non-checkpointed) path gives the same numbers
        lp_ng, ent_ng = token_logprobs(hidden, weight, targets, temperature=temp, chunk=chunk)
    torch.testing.assert_close(lp_ng, lp_ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_ng, ent_ref.detach(), atol=1e-5, rtol=0)


def test_token_logprobs_hand_uniform():
    # hidden 0 -> all logits 0 -> uniform over V = 4: log-prob ln(1/4) = -1.386294, entropy ln 4 = 1.386294
    lp, ent = token_logprobs(torch.zeros(3, 2), torch.randn(4, 2), torch.tensor([0, 3, 1]), temperature=1.3, chunk=2)
    torch.testing.assert_close(lp, torch.full((3,), -math.log(4)))
    torch.testing.assert_close(ent, torch.full((3,), math.log(4)))


# ---------------------------------------------------------------------------------------------------------
# 8. metrics and argument checks

def test_policy_loss_metrics_hand():
    logprobs, old, adv, mask = _hand_inputs()
    _, m = policy_loss(logprobs, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    # of the 6 kept tokens: (s1, t0) is clipped low (A < 0, rho .5 < .8), (s0, t0) clipped high (A > 0, 1.5 > 1.4);
    # (s0, t1) rho .5 < .8 with A > 0 and (s1, t1) rho 1.5 > 1.4 with A < 0 are not clipped; padding ignored
    assert m["clip/low_frac"] == pytest.approx(1 / 6)
    assert m["clip/high_frac"] == pytest.approx(1 / 6)
    # ratio over kept tokens: (1.5 + .5 + 1.2 + .5 + 1.5 + .9) / 6 = 6.1 / 6; max 1.5 (padding's 3.0 ignored)
    assert m["ratio/mean"] == pytest.approx(6.1 / 6)
    assert m["ratio/max"] == pytest.approx(1.5)
    assert m["loss/kl"] == 0.0


def test_a_ratio_on_a_clip_bound_is_not_clipped():
    """The clip metrics count a token whose ratio is past its bound: just inside (1.2 - 1e-9 for A > 0, 0.8 + 1e-9
    for A < 0) and on it (1.2, 0.8: the clipped and unclipped terms are equal) are not clipped, just past is."""
    for ratio, adv, key, clipped in [(1.2 - 1e-9, 1.0, "clip/high_frac", 0), (1.2, 1.0, "clip/high_frac", 0),
                                      (1.2 + 1e-9, 1.0, "clip/high_frac", 1), (0.8 + 1e-9, -1.0, "clip/low_frac", 0),
                                      (0.8, -1.0, "clip/low_frac", 0), (0.8 - 1e-9, -1.0, "clip/low_frac", 1)]:
        lp = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
        _, m = policy_loss(lp, torch.zeros_like(lp), torch.tensor([adv], dtype=torch.float64),
                           torch.ones_like(lp, dtype=torch.bool), eps_low=0.2, eps_high=0.2)
        assert m[key] == clipped, (ratio, key)


def test_policy_loss_unknown_agg_raises():
    logprobs, old, adv, mask = _hand_inputs()
    with pytest.raises(ValueError, match="agg"):
        policy_loss(logprobs, old, adv, mask, agg="seq-mean-token-sum")


def test_policy_loss_all_masked_is_zero_not_nan():
    lp = torch.randn(2, 3, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach() + 0.1, torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and m["ratio/mean"] == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------------------
# 9. truncated importance sampling

def test_policy_loss_tis_cap_hand():
    # ratio 1 (logprobs == old), A = 1: plain per-token loss -1.
    # weights min(exp(old - behaviour), cap = 2): old - behaviour = ln 3 -> 3 capped to 2; ln .5 -> .5; 0 -> 1
    # loss = (-2 - .5 - 1) / 3 = -3.5 / 3; gradient -A * rho * w / 3 = [-2/3, -1/6, -1/3]
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    behaviour = old - torch.tensor([[math.log(3), math.log(0.5), 0.0]], dtype=torch.float64)
    lp = old.clone().requires_grad_()
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    loss, _ = policy_loss(lp, old, adv, mask, tis_cap=2.0, behaviour_logprobs=behaviour)
    assert loss.item() == pytest.approx(-3.5 / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, -1 / 6, -1 / 3]], dtype=torch.float64))
    # tis off: the same inputs give -1
    assert policy_loss(lp, old, adv, mask, behaviour_logprobs=behaviour)[0].item() == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------------------
# 10. UloRL Eq. 10: DMMPT-masked tokens leave the numerator, not the denominator (nor their KL)

def _naive_eq10(lp, old, adv, loss_mask, pg_mask, eps_low, eps_high, ref, kl_coef, agg):
    """Eq. 10 as a double loop: 1 / sum_i |o_i| * sum_i sum_t [[pg_mask]] * -min(r A, clip(r) A) (+ kl_coef * k3 on
    every loss_mask token); |o_i| counts every loss_mask token of sample i, kept or masked. agg="sample": each
    sample's sum over its own |o_i|, then the mean over samples with any loss_mask token."""
    per = _naive_per_token(lp, old, adv, eps_low, eps_high)
    sums, sizes = [], []
    for i in range(len(lp)):
        total, size = 0.0, 0
        for t in range(len(lp[0])):
            if loss_mask[i][t]:
                size += 1
                d = ref[i][t] - lp[i][t]
                total += (per[i][t] if pg_mask[i][t] else 0.0) + kl_coef * (math.exp(d) - d - 1)
        sums.append(total)
        sizes.append(size)
    if agg == "token":
        return sum(sums) / sum(sizes)
    means = [t / n for t, n in zip(sums, sizes) if n]
    return sum(means) / len(means)


@pytest.mark.parametrize("agg", ["token", "sample"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_eq10_masked_tokens_stay_in_the_denominator(agg, kl_coef):
    lp, old, adv, loss_mask, ref = _random_batch(11, B=6, T=9)
    g = torch.Generator().manual_seed(12)
    pg_mask = loss_mask.bool() & (torch.rand(loss_mask.shape, generator=g) < 0.6)  # DMMPTs drop ~40%
    assert (loss_mask.bool() & ~pg_mask).sum() >= 10
    lp = lp.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, loss_mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logprobs=ref,
                                kl_coef=kl_coef, agg=agg, pg_mask=pg_mask)
    args = (old.tolist(), adv.tolist(), loss_mask.tolist(), pg_mask.tolist(), EPS_LOW, EPS_HIGH, ref.tolist(), kl_coef, agg)
    expected = _naive_eq10(lp.tolist(), *args)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # the old rule (masked tokens out of the denominator too) is a different number: the test can tell
    wrong, _ = policy_loss(lp, old, adv, pg_mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logprobs=ref,
                           kl_coef=kl_coef, agg=agg)
    assert abs(wrong.item() - expected) > 1e-3
    # the gradient: central differences of the naive double loop
    loss.backward()
    h, base = 1e-6, lp.detach().tolist()
    for i, t in [(0, 0), (1, 2), (2, 5), (4, 1), (5, 8)]:
        up = [row[:] for row in base]
        down = [row[:] for row in base]
        up[i][t] += h
        down[i][t] -= h
        fd = (_naive_eq10(up, *args) - _naive_eq10(down, *args)) / (2 * h)
        assert lp.grad[i, t].item() == pytest.approx(fd, abs=1e-6), (i, t)
    if kl_coef:  # the KL is a mean over every loss_mask token, masked ones included
        assert metrics["loss/kl"] == pytest.approx(
            torch.where(loss_mask.bool(), kl_k3(lp.detach(), ref), 0).sum().item() / loss_mask.sum().item(), abs=1e-12)


def test_eq10_hand_value():
    # 2 samples x 3 tokens, ratio 1 (pi_old = pi), A = [1, -1]; sample 0's tokens 1 and 2 are masked (DMMPTs).
    # Eq. 10: (-1 [s0,t0] + 1 + 1 + 1 [s1]) / 6 loss_mask tokens = 2/6. Dividing by the 4 kept ones would give 2/4.
    lp = torch.full((2, 3), -0.5, dtype=torch.float64)
    loss_mask = torch.ones(2, 3, dtype=torch.bool)
    pg_mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, _ = policy_loss(lp, lp, torch.tensor([1.0, -1.0], dtype=torch.float64), loss_mask, pg_mask=pg_mask)
    assert loss.item() == pytest.approx(2 / 6, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# 11. pi_old per token (TOIS / SAIS / POIS)

def test_old_logprobs_per_token_by_mode():
    # two samples; versions of their tokens: [3, 3, 2] and [1, 2, 3]; the weights being updated are version 3
    current = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, -0.6]])
    behaviour = torch.tensor([[-1.1, -1.2, -1.3], [-1.4, -1.5, -1.6]])
    versions = torch.tensor([[3, 3, 2], [1, 2, 3]])
    # SAIS: the current weights' tokens take the trainer's recomputation, older ones their behaviour log-prob
    sais = torch.tensor([[-0.1, -0.2, -1.3], [-1.4, -1.5, -0.6]])
    assert torch.equal(old_logprobs("sais", current, behaviour, versions, 3), sais)
    assert torch.equal(old_logprobs("tois", current, behaviour, versions, 3), sais)
    # TOIS as defined (one segment: every token is the current weights'): exactly the trainer's log-probs
    assert torch.equal(old_logprobs("tois", current, behaviour, torch.full((2, 3), 3), 3), current)
    assert torch.equal(old_logprobs("pois", current, behaviour, versions, 3), current)
    with pytest.raises(ValueError, match="is-mode"):
        old_logprobs("ppo", current, behaviour, versions, 3)


def test_tis_weights_per_mode():
    # pi_old / pi_behaviour, capped at 2: under SAIS older tokens have pi_old = behaviour, so weight 1; the
    # current weights' tokens are weighted by the engine/trainer mismatch exp(current - behaviour)
    current = torch.tensor([[-0.1, -0.2], [-0.3, -2.0]])
    behaviour = torch.tensor([[-0.6, -0.2], [-0.3, -0.1]])
    versions = torch.tensor([[5, 4], [4, 5]])
    w = tis_weights(old_logprobs("sais", current, behaviour, versions, 5), behaviour, 2.0)
    torch.testing.assert_close(w, torch.tensor([[min(math.exp(0.5), 2.0), 1.0], [1.0, math.exp(-1.9)]]))
    w = tis_weights(old_logprobs("pois", current, behaviour, versions, 5), behaviour, 2.0)
    torch.testing.assert_close(w, torch.tensor([[min(math.exp(0.5), 2.0), 1.0], [1.0, math.exp(-1.9)]]))


# ---------------------------------------------------------------------------------------------------------
# 12. the guards: dual clip, log-ratio clamp, k3 clamp

def test_dual_clip_hand_values():
    # A = -1: ratio 5 -> the clipped surrogate gives max(5, 0.8) * 1 = 5; dual clip c = 3 caps it at 3.
    # ratio 2 -> 2 (under c, unchanged). A = +1, ratio 5 -> -min(5, 1.2) = -1.2 (dual clip never applies)
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64))
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    loss, m = policy_loss(lp, old, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-12)
    assert m["clip/dual_frac"] == pytest.approx(1 / 3)
    off, m = policy_loss(lp, old, adv, mask, clip_ratio_c=0.0)
    assert off.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3, abs=1e-12) and m["clip/dual_frac"] == 0
    # with the cap active the loss no longer depends on that token's log-prob: no gradient through it
    lp = lp.clone().requires_grad_()
    policy_loss(lp, old, adv, mask, clip_ratio_c=3.0)[0].backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] != 0


def test_log_ratio_and_kl_are_clamped():
    # a stale token: log-ratio 100 would overflow exp in fp32; clamped to 20 it stays finite
    lp = torch.tensor([[100.0, 0.0]])
    old = torch.zeros(1, 2)
    loss, m = policy_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 2), clip_ratio_c=0.0)
    assert math.isfinite(loss.item()) and m["ratio/max"] == pytest.approx(math.exp(20), rel=1e-6)
    # k3: d = ref - logp clamped to +-20, k3 clamped to 10: d = 50 -> 10; d = -50 -> e^-20 + 20 - 1 -> 10;
    # d = 1 -> e - 2 = 0.718 (unclamped)
    k = kl_k3(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([50.0, -50.0, 1.0]))
    torch.testing.assert_close(k, torch.tensor([10.0, 10.0, math.e - 2]))


# 13. the covariance of log-prob and advantage (the entropy mechanism), and the part a subset carries

def test_covariance_hand_values_and_its_parts():
    # log-probs x = [0, -1, -2, -1] (mean -1), advantages y = [1, 1, -1, -1] (mean 0): centred products
    # [1 * 1, 0 * 1, -1 * -1, 0 * -1] = [1, 0, 1, 0], so Cov = 2 / 4 = 0.5; the subset {0, 3} carries (1 + 0) / 4
    # and the rest {1, 2} (0 + 1) / 4
    x, y = torch.tensor([0.0, -1.0, -2.0, -1.0]), torch.tensor([1.0, 1.0, -1.0, -1.0])
    subset = torch.tensor([True, False, False, True])
    assert Covariance(x, y) == pytest.approx(0.5) and Covariance(x, y, subset) == pytest.approx(0.25)
    assert Covariance(x, y, ~subset) == pytest.approx(0.25)
    # a likely token with a positive advantage pushes it up: x = [0, -2], y = [1, -1] -> (1 * 1 + -1 * -1) / 2 = 1
    assert Covariance(torch.tensor([0.0, -2.0]), torch.tensor([1.0, -1.0])) == pytest.approx(1.0)
    # split into two micro-batches, the sums add up to the whole (not the mean of the parts' covariances)
    a, b = Covariance(x[:1], y[:1], subset[:1]), Covariance(x[1:], y[1:], subset[1:])
    assert Covariance.of([u + v for u, v in zip(a.sums, b.sums)]) == pytest.approx(0.25)
    a, b = Covariance(x[:1], y[:1]), Covariance(x[1:], y[1:])
    assert a == 0 and Covariance.of([u + v for u, v in zip(a.sums, b.sums)]) == pytest.approx(0.5)
    assert Covariance(x[:0], y[:0]) == 0  # nothing to average over
