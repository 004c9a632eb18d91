"""Tests for reward.py: answer extraction, math equivalence, the tiny task, overlong handling, and the
worker pool's ordering, error and timeout accounting. Values are computed by hand.

    python -m pytest tests/test_reward.py -q
"""

import os
import time

import pytest

import reward
from reward import extract_answer, math_equal, overlong_reward, score_batch, tiny_reward


# Test verifiers live at module level so that pool workers can import them by name.
def _hang(response, answer):
    time.sleep(1e6)


def _boom(response, answer):
    raise RuntimeError(f"boom on {response!r}")


def _die(response, answer):
    os._exit(3)  # like a segfault or the OOM killer


# ---------------------------------------------------------------------------- extract_answer

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"first \boxed{1}, then \boxed{ 2 } wins", "2"),
    (r"\fbox{7}", "7"),
    (r"answer: $\boxed 5$", "5"),
    (r"\boxed 12.", "12"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{a^{b^{c}}} and 9", "a^{b^{c}}"),
    (r"\boxed{\boxed{3}}", "3"),
    ("no box: 3 apples and -4.5 pears", "-4.5"),
    ("the ratio is 3/4", "3/4"),
    (r"broken \boxed{\frac{1}{2", "2"),  # unbalanced box -> last number
    ("no answer at all", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_fallback_none():
    assert extract_answer("the answer is 42", fallback="none") is None
    assert extract_answer(r"\boxed{\frac{1}{2}", fallback="none") is None
    assert extract_answer(r"\boxed{} ", fallback="none") == ""
    assert extract_answer(r"\boxedx 4", fallback="none") is None
    with pytest.raises(ValueError, match="fallback"):
        extract_answer("1", fallback="first_number")


def test_extract_answer_is_linear():
    start = time.perf_counter()
    assert extract_answer("x" * 1_000_000 + r"\boxed{7}") == "7"
    assert extract_answer(r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_001) == "{" * 10_000 + "1" + "}" * 10_000
    assert extract_answer(r"\boxed{" + "{" * 10_000 + "1", fallback="none") is None
    assert extract_answer(r"\boxed " + " " * 1_000_000, fallback="none") is None
    assert extract_answer("1 " * 500_000) == "1"
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------------------- math_equal

@pytest.mark.parametrize("prediction, reference, expected", [
    ("1/2", r"\frac{1}{2}", True),
    ("0.5", r"\frac12", True),
    ("3", "4", False),
    ("12", " 12 ", True),
    ("3", "x=3", True),
    (r"\frac{\sqrt2}{2}", r"\sqrt{2}/2", True),
    (r"\{3,2,1\}", r"\{1,2,3\}", True),
    (r"\{1,2\}", r"\{1,3\}", False),
    ("[1,2)", "[1, 2)", True),
    ("(1,2]", "[1,2)", False),
    (r"(0,\infty)", "x>0", True),
    ("", "1", False),
    ("   ", "", False),
    ("}{", "1", False),
    (r"\frac{", "1", False),
    ("\x00\\\\", r"\frac{1}{2}", False),
])
def test_math_equal(prediction, reference, expected):
    assert math_equal(prediction, reference) is expected


def test_math_equal_exact_match_needs_no_worker():
    assert math_equal(r" \frac{1}{2}", r"\frac{1}{2} ", timeout=0.0)  # a worker could never answer in 0 s


def test_math_equal_on_long_garbage_returns_in_time():
    start = time.perf_counter()
    assert math_equal("(" * 5_000 + "1", "1", timeout=2.0) is False
    assert time.perf_counter() - start < 6.0


# ---------------------------------------------------------------------------- tiny task and VERIFIERS

def test_tiny_reward():
    assert tiny_reward("7,12:12", "12") == 1.0
    assert tiny_reward("7,12:12 ", "12") == 1.0
    assert tiny_reward("7:7,12:12", "12") == 1.0
    assert tiny_reward("7,12:13", "12") == 0.0
    assert tiny_reward("7,12:", "12") == 0.0
    assert tiny_reward("12", "12") == 0.0  # no ':'
    assert tiny_reward("12:12:", "12") == 0.0  # last ':' decides


def test_verifiers_table():
    assert reward.VERIFIERS["tiny"]("3+4=7:7", "7") == 1.0
    assert reward.VERIFIERS["math"](r"so x is \boxed{\frac{2}{4}}", "0.5") == 1.0
    assert reward.VERIFIERS["math"](r"so x is \boxed{3}", "0.5") == 0.0
    assert reward.VERIFIERS["math"]("no number here", "0.5") == 0.0


# ---------------------------------------------------------------------------- overlong_reward

def test_overlong_reward():
    # max_len 100, buffer 20: the soft penalty starts after 80 tokens and reaches -1 at 100
    assert overlong_reward(1.0, 100, True, 100, "zero") == 0.0
    assert overlong_reward(1.0, 90, False, 100, "zero") == 1.0
    assert overlong_reward(0.0, 90, False, 100, "zero") == 0.0
    assert overlong_reward(1.0, 80, False, 100, "soft", buffer=20) == 1.0
    assert overlong_reward(1.0, 90, False, 100, "soft", buffer=20) == pytest.approx(0.5)
    assert overlong_reward(1.0, 95, False, 100, "soft", buffer=20) == pytest.approx(0.25)
    assert overlong_reward(0.0, 85, False, 100, "soft", buffer=20) == pytest.approx(-0.25)
    assert overlong_reward(1.0, 100, False, 100, "soft", buffer=20) == pytest.approx(0.0)
    assert overlong_reward(1.0, 100, True, 100, "soft", buffer=20) == -1.0
    assert overlong_reward(1.0, 99, False, 100, "soft", buffer=0) == 1.0
    assert overlong_reward(1.0, 100, True, 100, "none") == 1.0
    assert overlong_reward(1.0, 100, True, 100, "filter") == 1.0
    with pytest.raises(ValueError, match="soft_cap"):
        overlong_reward(1.0, 10, False, 100, "soft_cap")


# ---------------------------------------------------------------------------- score_batch

def test_score_batch_order_and_metrics():
    items = [("tiny", f"1,{i}:{i}", str(i if i % 3 else i + 1)) for i in range(200)]
    items += [("math", r"\boxed{\frac{1}{2}}", "0.5"), ("math", "it is 7", "8"), ("tiny", "no colon", "1")]
    scores, metrics = score_batch(items, timeout=10.0)
    assert scores == [0.0 if i % 3 == 0 else 1.0 for i in range(200)] + [1.0, 0.0, 0.0]
    assert metrics == {"reward/timeouts": 0, "reward/errors": 0}
    assert score_batch([]) == ([], {"reward/timeouts": 0, "reward/errors": 0})


def test_score_batch_unknown_verifier():
    with pytest.raises(ValueError, match="'kode'"):
        score_batch([("tiny", "1:1", "1"), ("kode", "print(1)", "1")])


def test_score_batch_lambda_verifier_is_a_config_error(monkeypatch):
    monkeypatch.setitem(reward.VERIFIERS, "lambda", lambda response, answer: 1.0)
    with pytest.raises(ValueError, match="module-level"):
        score_batch([("lambda", "x", "y")])


def test_score_batch_counts_errors(monkeypatch):
    monkeypatch.setitem(reward.VERIFIERS, "boom", _boom)
    items = [("tiny", "1:1", "1"), ("boom", "x", "y"), ("tiny", "1:2", "2"), ("boom", "z", "y")]
    with pytest.warns(UserWarning, match="2 of 4 reward checks raised.*boom on"):
        scores, metrics = score_batch(items)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert metrics == {"reward/timeouts": 0, "reward/errors": 2}


def test_score_batch_survives_a_dying_worker(monkeypatch):
    monkeypatch.setitem(reward.VERIFIERS, "die", _die)
    items = [("tiny", "1:1", "1"), ("die", "x", "y"), ("tiny", "1:2", "2"), ("tiny", "1:2", "3")]
    with pytest.warns(UserWarning, match="worker died"):
        scores, metrics = score_batch(items)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert metrics == {"reward/timeouts": 0, "reward/errors": 1}


def test_score_batch_kills_hanging_check_and_recovers(monkeypatch):
    monkeypatch.setitem(reward.VERIFIERS, "hang", _hang)
    score_batch([("tiny", "1:1", "1")] * 2, workers=2)  # start the pool outside the timed part
    items = [("tiny", "3:3", "3"), ("hang", "x", "y"), ("math", r"\boxed{0.25}", "1/4"),
             ("tiny", "3:4", "3"), ("math", r"\boxed{2}", "3"), ("tiny", "5:5", "5")]
    items += [("tiny", f"{i}:{i}", str(i)) for i in range(34)]  # chunks of 5: the hang strands 3 items
    start = time.perf_counter()
    scores, metrics = score_batch(items, timeout=2.0, workers=2)
    assert time.perf_counter() - start < 2.0 + 3.0
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0] + [1.0] * 34
    assert metrics == {"reward/timeouts": 1, "reward/errors": 0}
    # the killed worker was replaced, and the pool serves the next call
    scores, metrics = score_batch([("tiny", "1:1", "1"), ("math", r"\boxed{x=3}", "3")], timeout=10.0)
    assert scores == [1.0, 1.0]
    assert metrics == {"reward/timeouts": 0, "reward/errors": 0}
    assert len(reward._POOL) == 2 and all(w.proc.is_alive() for w in reward._POOL)
