"""Verifiers: turn a response text and a reference answer into a scalar reward.

Owns answer extraction (`extract_answer`), math answer equivalence (`math_equal`, math-verify run in
worker processes with a hard timeout), the tiny built-in task (`tiny_reward`), the `VERIFIERS` table
that maps a dataset's verifier name to a function `(response, answer) -> float`, the batch scorer the
trainer calls once per step (`score_batch`), and overlong handling (`overlong_reward`, SPEC section 5).

Checks run in a persistent pool of processes because sympy can hang inside C code, where neither
signals nor threads can interrupt it: a worker that overruns its deadline is killed and replaced.
Workers come from the multiprocessing "forkserver", never from a fork of the trainer (which holds torch
threads). As with any spawn/forkserver child, each worker imports the main script as `__mp_main__`,
so `train.py` keeps its work under `if __name__ == "__main__":`.
"""

import atexit
import functools
import importlib
import logging
import multiprocessing as mp
import re
import signal
import time
import warnings
from collections import deque
from multiprocessing.connection import wait as mp_wait

from math_verify import parse, verify

# ---------------------------------------------------------------------------- answer extraction

_BOX = re.compile(r"\\(?:boxed|fbox)")
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)  # escaped chars first, so "\{" and "\}" never count
_SPACE = re.compile(r"\s*")
_TOKEN = re.compile(r"[^\s$]+")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?")


def _box_argument(text: str, i: int) -> str | None:
    """The argument of a box command whose name ends at text[i]: `{...}` or, after a space, one token."""
    j = _SPACE.match(text, i).end()
    if text.startswith("{", j):
        depth = 0
        for m in _BRACE.finditer(text, j):  # visits only braces and escapes: linear, no recursion
            if m.group() == "{":
                depth += 1
            elif m.group() == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1:m.start()].strip()
        return None  # unbalanced
    token = _TOKEN.match(text, j) if j > i else None  # "\boxedx" is some other macro, not a box
    return token.group().rstrip(".,;") if token else None


def extract_answer(text: str, fallback: str = "last_number") -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed 5`; without a usable box, the
    fallback: "last_number" (last integer, decimal or a/b fraction in the text) or "none" (None)."""
    if fallback not in ("last_number", "none"):
        raise ValueError(f"unknown fallback {fallback!r}; use 'last_number' or 'none'")
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start >= 0:
        answer = _box_argument(text, _BOX.match(text, start).end())
        if answer is not None:
            return answer
    if fallback == "none":
        return None
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group() if last else None


# ---------------------------------------------------------------------------- verifiers

_IN_WORKER = False  # set in pool workers, where the parent process enforces the timeout


def _parse(answer: str) -> list:
    # math-verify only reads LaTeX inside delimiters ("\frac12", "[1,2)", "\{1,2\}"); the raw text is
    # the fallback for answers that bring their own "$...$" or break the box with stray braces.
    # Its signal-based timeouts are off: the pool's kill is the timeout.
    return parse("\\boxed{" + answer + "}", parsing_timeout=None) or parse(answer, parsing_timeout=None)


def _math_check(prediction: str, reference: str) -> float:
    gold, pred = _parse(reference), _parse(prediction)
    return float(bool(gold and pred and verify(gold, pred, timeout_seconds=None)))


def math_equal(prediction: str, reference: str, timeout: float = 5.0) -> bool:
    """Whether two final answers are mathematically equal (math-verify); never raises, and gives up
    (False) after `timeout` seconds. An empty prediction is never equal."""
    if prediction is None or not prediction.strip():
        return False
    if prediction.strip() == reference.strip():
        return True
    if _IN_WORKER:
        return _math_check(prediction, reference) == 1.0
    scores, _, _ = _run_checks([(_ref(_math_check), prediction, reference)], timeout, workers=1)
    return scores[0] == 1.0


def math_reward(response: str, answer: str) -> float:
    prediction = extract_answer(response)
    return float(prediction is not None and math_equal(prediction, answer))


def tiny_reward(response: str, answer: str) -> float:
    """The tiny task writes running sums then the total ("7,12:12"): the text after the last ':'."""
    _, colon, final = response.rpartition(":")
    return float(bool(colon) and final.strip() == answer)


# Verifier functions must live at module level: workers import them by "module:name".
VERIFIERS = {"tiny": tiny_reward, "math": math_reward}


# ---------------------------------------------------------------------------- worker pool

def _load(ref: str):
    module, _, name = ref.partition(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


@functools.cache
def _ref(fn) -> str:
    ref = f"{fn.__module__}:{fn.__qualname__}"
    try:
        found = _load(ref)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise ValueError(f"verifier {ref} must be a module-level function so that workers can import it")
    return ref


def _serve(conn) -> None:
    """Worker loop: receive chunks of (index, ref, response, answer), send one (index, score, error) each."""
    global _IN_WORKER
    _IN_WORKER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer; it kills us at exit
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" and parse noise
    conn.send("ready")
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        for i, ref, response, answer in chunk:
            try:
                conn.send((i, float(_load(ref)(response, answer)), None))
            except Exception as e:  # any model output or verifier bug scores 0; the parent counts it
                conn.send((i, 0.0, f"{ref}: {type(e).__name__}: {e}"))


class _Worker:
    """One checker process; `pending` holds the indices it was sent and has not answered yet, in order."""

    def __init__(self):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # the server imports sympy once; forking from it is cheap
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.ready, self.pending, self.deadline = False, [], 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()  # reap it: no zombies
        self.conn.close()


_POOL: list[_Worker] = []


@atexit.register
def _close_pool() -> None:
    for w in _POOL:
        w.kill()
    _POOL.clear()


def _replace(w: _Worker, todo: deque) -> None:
    """Kill a stuck or dead worker; its unanswered checks after the current one go back first in line."""
    todo.extendleft(reversed(w.pending[1:]))
    w.kill()
    _POOL[_POOL.index(w)] = _Worker()


def _run_checks(tasks: list[tuple[str, str, str]], timeout: float, workers: int):
    """Run (ref, response, answer) checks on the pool (grown to `workers` processes, never shrunk).
    Returns (scores, number of timeouts, error texts); a timed-out or failed check scores 0.0."""
    while len(_POOL) < workers:
        _POOL.append(_Worker())
    scores, n_timeouts, errors = [0.0] * len(tasks), 0, []
    todo = deque(range(len(tasks)))
    # a few chunks per worker: one message per chunk instead of per item, yet the tail stays balanced
    chunk = max(1, min(64, len(tasks) // (4 * len(_POOL))))
    while todo or any(w.pending for w in _POOL):
        for w in _POOL:
            if w.ready and not w.pending and todo:
                w.pending = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                w.conn.send([(i, *tasks[i]) for i in w.pending])
                w.deadline = time.monotonic() + timeout
        deadlines = [w.deadline for w in _POOL if w.pending]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for conn in mp_wait([w.conn for w in _POOL], timeout=wait_s):
            w = next(w for w in _POOL if w.conn is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the process died (segfault, OOM killer)
                if not w.ready:
                    raise RuntimeError("a reward worker died while starting; `python -c 'import reward'` "
                                       "and the main script's imports must succeed") from None
                if w.pending:
                    errors.append(f"reward worker died (exit code {w.proc.exitcode}) during a check")
                _replace(w, todo)
                continue
            if msg == "ready":
                w.ready = True
                continue
            i, score, error = msg
            scores[i] = score
            if error:
                errors.append(error)
            w.pending.remove(i)
            w.deadline = time.monotonic() + timeout  # the clock runs per check, not per chunk
        now = time.monotonic()
        for w in list(_POOL):
            if w.pending and now > w.deadline and not w.conn.poll():  # unread results: not stuck
                n_timeouts += 1
                _replace(w, todo)
    return scores, n_timeouts, errors


def score_batch(items: list[tuple[str, str, str]], timeout: float = 5.0,
                workers: int = 2) -> tuple[list[float], dict]:
    """Score (verifier_name, response_text, answer) items in parallel worker processes. Returns one
    reward per item, in order, and {"reward/timeouts", "reward/errors"}; a check that raises or
    runs past `timeout` seconds scores 0.0. An unknown verifier name raises ValueError."""
    for name, _, _ in items:
        if name not in VERIFIERS:
            raise ValueError(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
    scores, n_timeouts, errors = [], 0, []
    if items:
        tasks = [(_ref(VERIFIERS[name]), response, answer) for name, response, answer in items]
        scores, n_timeouts, errors = _run_checks(tasks, timeout, workers)
    if errors:
        warnings.warn(f"{len(errors)} of {len(items)} reward checks raised and scored 0; first: {errors[0]}")
    return scores, {"reward/timeouts": n_timeouts, "reward/errors": len(errors)}


# ---------------------------------------------------------------------------- overlong handling

def overlong_reward(reward: float, n_tokens: int, truncated: bool, max_len: int,
                    mode: str = "zero", buffer: int = 0) -> float:
    """Reward of a sample after overlong handling (SPEC section 5).
    "zero" (UloRL): truncated samples get 0. "soft" (DAPO's soft overlong punishment): a penalty
    growing linearly from 0 at max_len - buffer tokens to -1 at max_len is added; truncated samples
    get 0 - 1. "none", and "filter" (the trainer drops truncated samples from the loss): unchanged."""
    if mode == "zero":
        return 0.0 if truncated else reward
    if mode == "soft":
        if truncated:
            return -1.0
        start = max_len - buffer
        return reward if n_tokens <= start else reward - min(1.0, (n_tokens - start) / max(buffer, 1))
    if mode in ("none", "filter"):
        return reward
    raise ValueError(f"unknown overlong mode {mode!r}; use 'zero', 'soft', 'none' or 'filter'")
