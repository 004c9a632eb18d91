"""The built-in tasks (tiny.py): the any-order teacher writes every order of the terms and each is right, the
first task's teacher is unchanged, and on the shipped warm starts the entropy of the any-order model sits largely
on the choice of the next term, where the first task's model has next to none.

    python -m pytest tests/test_tiny.py        # ~15 s on 2 cores
"""
import itertools
import os
import random

import pytest

import tiny
from verifiers import tiny_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_first_task_s_teacher_adds_in_the_prompt_s_order():
    rng = random.Random(0)
    assert tiny.teacher_response([3, 4, 5], rng) == "4=7,5=12:12"
    assert tiny.teacher_response([9, 9], rng) == "9=18:18"


def test_the_any_order_teacher_writes_every_order_and_each_is_right():
    """Without slips, the responses to 1+2+3+4 over 2,000 draws are exactly its 24 orders, each term written with
    the running sum from 0, and the verifier gives every one full marks (only the answer after ':' counts)."""
    rng = random.Random(1)
    seen = {tiny.teacher_response([1, 2, 3, 4], rng, order="any") for _ in range(2000)}
    want = {",".join(f"{t}={sum(p[:i + 1])}" for i, t in enumerate(p)) + ":10" for p in itertools.permutations(range(1, 5))}
    assert seen == want and len(want) == 24
    assert all(tiny_reward(r, "10") == 1.0 for r in seen)


def test_the_any_order_teacher_slips_at_its_rate():
    """With slip 0.2 each of a 3-term problem's 3 sums is off by one (either way) with chance 0.2 and the teacher
    carries on from what it wrote, so the answer is right when the slips add up to 0 (none, or a +1 and a -1):
    0.8^3 + 6 x 0.8 x 0.1^2 = 0.56, within 3 standard errors over 20,000 draws."""
    rng = random.Random(2)
    n = 20_000
    right = sum(tiny_reward(tiny.teacher_response([2, 5, 7], rng, 0.2, "any"), "14") for _ in range(n)) / n
    # the final sum is the true one plus the sum of the slips: P(sum of 3 draws from {0 (0.8), +1, -1 (0.1 each)} = 0)
    p = sum(pa * pb * pc for (a, pa), (b, pb), (c, pc) in itertools.product([(0, 0.8), (1, 0.1), (-1, 0.1)], repeat=3)
            if a + b + c == 0)
    assert abs(right - p) < 3 * (p * (1 - p) / n) ** 0.5, (right, p)


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, tiny.ANY_CKPT)), reason="no tiny_any_ckpt/")
def test_the_any_order_model_s_entropy_sits_on_right_choices_and_the_first_task_s_does_not():
    """On 24 held-out problems of 3-5 terms, 8 samples each: of the any-order warm start's entropy, a large share sits
    on the positions that choose the next term, nearly all of their probability on terms not yet added (right
    choices); the first task's warm start, whose every position has one right token, puts little there."""
    from transformers import AutoModelForCausalLM
    tok = tiny.make_tokenizer()
    rows = [r for k in (3, 4, 5) for r in tiny.held_out_rows(8, seed=k, terms=k)]
    measured = {}
    for ckpt in (tiny.ANY_CKPT, tiny.CKPT):
        lm = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, ckpt))
        measured[ckpt] = tiny.choice_entropy(lm, tok, [r["prompt"] for r in rows])
    anyorder, first = measured[tiny.ANY_CKPT], measured[tiny.CKPT]
    assert anyorder["choice_share"] > 0.4 and anyorder["right_choice_mass"] > 0.98, anyorder  # measured 0.52, 0.996
    assert first["choice_share"] < 0.05, first  # measured 0.005
