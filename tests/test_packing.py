"""The update's scaling flags on the tiny model: token-budget packing of micro-batches
(model.micro_batches / collate with pack=True) gives the same log-probs, entropy, loss and gradients as
padded micro-batches and as one unpadded forward per sample; gradient checkpointing gives the same
gradients as without it. CPU, a few seconds.

    python -m pytest tests/test_packing.py
"""
import random

import pytest
import torch

import config
import model as model_lib
import tiny
from loss import policy_loss
from segment_rollout import Sample

TOL = 1e-5
TEMPERATURE = 0.85


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def loaded():
    return model_lib.load(tiny.CKPT)


def make_samples(pad_id: int, seed: int = 0) -> list[Sample]:
    """Lengths from 3 to 220 tokens (prompt + response): one of them longer than the budget used below."""
    rng = random.Random(seed)
    shapes = [(2, 1), (20, 200), (5, 3), (12, 60), (3, 120), (8, 8), (15, 30), (4, 1), (9, 90), (6, 15)]
    out = []
    for uid, (p, n) in enumerate(shapes):
        tokens = [rng.randrange(3, 17) for _ in range(n)]  # never the pad id: padding must not matter anyway
        out.append(Sample(uid, uid // 2, [rng.randrange(3, 17) for _ in range(p)], {}, tokens=tokens,
                          logprobs=[-rng.random() for _ in range(n)], versions=[0] * n, seg_starts=[0],
                          finish="eos" if uid % 3 else "truncated", reward=float(uid % 2)))
    assert all(t != pad_id for s in out for t in s.prompt_ids + s.tokens)
    return out


def naive(model, s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of each response token from one forward over prompt + response alone."""
    logits = model(input_ids=torch.tensor([s.prompt_ids + s.tokens]), use_cache=False).logits[0]
    logp = torch.log_softmax(logits[len(s.prompt_ids) - 1:-1].float() / TEMPERATURE, -1)
    return logp.gather(1, torch.tensor(s.tokens)[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def test_micro_batches_pack_within_the_budget():
    samples = make_samples(0)
    lengths = [len(s.prompt_ids) + len(s.tokens) for s in samples]
    for pack in (True, False):
        mbs = model_lib.micro_batches(samples, 200, pack=pack)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(samples)))
        for mb in mbs:
            size = sum(lengths[i] for i in mb) if pack else len(mb) * max(lengths[i] for i in mb)
            assert size <= 200 or len(mb) == 1, (pack, mb)
        assert [1] in mbs  # 220 tokens: alone in its micro-batch
    packed, padded = model_lib.micro_batches(samples, 200), model_lib.micro_batches(samples, 200, pack=False)
    assert len(packed) == 3 < len(padded)  # 220 alone; 310 other tokens fill two rows of 200


def test_packed_row_equals_separate_sequences(loaded):
    """transformers (masking_utils.find_packed_sequence_indices) turns position_ids that restart at 0 into a
    block-diagonal causal mask when attention_mask is None and there is no KV cache."""
    model = loaded[0].eval()
    decoder = model.get_decoder()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 17, (n,), generator=g) for n in (5, 40, 1, 17, 90)]
    with torch.no_grad():
        alone = torch.cat([decoder(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in seqs])
        row = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        packed = decoder(input_ids=row, position_ids=pos, use_cache=False).last_hidden_state[0]
        cached = decoder(input_ids=row, position_ids=pos, use_cache=True).last_hidden_state[0]
    torch.testing.assert_close(packed, alone)  # fp32 defaults: rtol 1.3e-6, atol 1e-5
    assert (cached - alone).abs().max() > 1e-2  # with a cache the packing is not detected: attention leaks


def run_update(model, samples: list[Sample], adv: torch.Tensor, pack: bool, pad_id: int, budget: int = 200):
    """Log-probs, entropy (per sample), summed loss and gradients of one optimizer step's micro-batches,
    as ulorl.update computes them: one global token count, backward per micro-batch."""
    model.zero_grad(set_to_none=True)
    mbs = [(idx, model_lib.collate([samples[i] for i in idx], pad_id, pack=pack))
           for idx in model_lib.micro_batches(samples, budget, pack=pack)]
    denom = sum(mb.resp_mask.sum() for _, mb in mbs)  # every response token trains
    total, lps, ents = 0.0, {}, {}
    for idx, mb in mbs:
        lp, ent = model_lib.response_logprobs(model, mb, TEMPERATURE)
        loss, _ = policy_loss(lp, mb.behaviour, adv[idx], mb.resp_mask, eps_low=0.2, eps_high=0.28, denom=denom)
        loss.backward()
        total += loss.item()
        for row, i in enumerate(idx):
            n = len(samples[i].tokens)
            lps[i], ents[i] = lp[row, :n].detach(), ent[row, :n]
    return total, lps, ents, {n: p.grad.clone() for n, p in model.named_parameters()}, len(mbs)


def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(loaded):
    model, tok = loaded
    model.train()
    samples = make_samples(tok.pad_token_id)
    adv = torch.linspace(-1.5, 1.5, len(samples))
    packed = run_update(model, samples, adv, True, tok.pad_token_id)
    padded = run_update(model, samples, adv, False, tok.pad_token_id)
    assert packed[4] < padded[4]  # fewer forward/backward calls
    assert packed[0] == pytest.approx(padded[0], rel=1.3e-6, abs=TOL) and abs(packed[0]) > 1e-3
    with torch.no_grad():
        for i, s in enumerate(samples):
            lp, ent = naive(model, s)
            for layout in (packed, padded):
                # another computation order than the packed/padded layouts: tolerances that scale with the values
                torch.testing.assert_close(layout[1][i], lp, msg=f"log-probs of sample {i}")
                torch.testing.assert_close(layout[2][i], ent, msg=f"entropy of sample {i}")
    for name, grad in packed[3].items():
        torch.testing.assert_close(grad, padded[3][name], msg=name)
    assert max(g.abs().max() for g in packed[3].values()) > 1e-3  # the gradients are not trivially 0


def test_gradient_checkpointing_gives_the_same_gradients(loaded):
    tok = loaded[1]
    samples = make_samples(tok.pad_token_id)
    adv = torch.linspace(-1.5, 1.5, len(samples))
    grads, calls = [], []
    for on in (False, True):
        model = model_lib.load(tiny.CKPT, gradient_checkpointing=on)[0].train()
        mlp, n = model.get_decoder().layers[0].mlp, [0]
        forward = mlp.forward  # (module hooks do not fire in the recompute, so count calls of forward itself)
        mlp.forward = lambda *args: (n.__setitem__(0, n[0] + 1), forward(*args))[1]
        grads.append(run_update(model, samples, adv, True, tok.pad_token_id)[3])
        calls.append(n[0])
    assert calls[1] == 2 * calls[0]  # with checkpointing each layer runs again in the backward
    for name, grad in grads[0].items():
        assert (grad - grads[1][name]).abs().max() < 1e-6, name


def test_flags_and_presets():
    # padding by default: with sdpa a packed row gets a dense [L, L] mask (README, "Real models")
    assert not config.parse_config([]).pack and not config.parse_config([]).gradient_checkpointing
    assert config.parse_config(["--pack", "true"]).pack and config.parse_config([]).attn_implementation == "sdpa"
    for preset in ("ulorl", "prorl"):  # (on this CPU machine, with the data the presets leave to the user)
        assert config.parse_config(["--preset", preset, "--device", "cpu", "--data", "tiny"]).gradient_checkpointing
