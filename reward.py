"""Verifiers: turn a response text and a reference answer into a scalar reward.

Owns answer extraction (`extract_answer`, and `final_answer`: the one table of each verifier's final
answer), math answer equivalence (`math_equal`, math-verify run in worker processes with a hard timeout),
the tiny built-in task (`tiny_reward`), Reasoning Gym's scorers (`rg_reward`), instruction-following
constraints (`ifeval_reward`, `CONSTRAINTS`), the `VERIFIERS` table that maps a dataset's verifier name to a
function `(response, answer) -> float` (code rewards come from sandbox.py), the batch scorer
(`score_batch`) and the one function that rewards samples for training and evaluation alike
(`score_samples`), the generative verifier (UloRL 3.3: `Judge`, `JUDGE_PROMPT`, `judge_rewards`), and
overlong handling (`overlong_reward`: UloRL gives a truncated sample 0, DAPO a soft penalty).

    python reward.py bench       # the pool's throughput on 1000 math answers against a single-process loop

Checks run in a persistent pool of processes because sympy can hang inside C code, where neither
signals nor threads can interrupt it: a worker that overruns its deadline is killed and replaced.
Workers come from the multiprocessing "forkserver", never from a fork of the trainer (which holds torch
threads), and start without importing the main script (a spawn/forkserver child normally re-runs it:
every public function here is safe to call from a plain script without an `if __name__ == "__main__":`
guard, and a worker does not load torch because the trainer did). Verifiers therefore live in importable
modules, never in the main script.
"""
import atexit
import functools
import importlib
import json
import logging
import math
import multiprocessing as mp
import re
import resource
import signal
import string
import sys
import time
import types
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable
from multiprocessing.connection import wait as mp_wait

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

import sandbox

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
# Each worker's address space (RLIMIT_AS): a parse of model output such as \boxed{2^{2^{2^{2^{2^{2}}}}}} grows
# without bound (~40-90 MB/s) until the timeout; capped, it raises MemoryError (an error, scored 0). A worker
# needs ~70 MB; a code check's program sets its own limit (1 GB) inside its sandbox.
WORKER_MEMORY_MB = 1024


def _parse(answer: str) -> list:
    # math-verify only reads LaTeX inside delimiters ("\frac12", "[1,2)", "\{1,2\}"); the raw text is
    # the fallback for answers that bring their own "$...$" or break the box with stray braces.
    # Its signal-based timeouts are off: the pool's kill is the timeout.
    return parse("\\boxed{" + answer + "}", parsing_timeout=None) or parse(answer, parsing_timeout=None)


def _parse_reference(answer: str) -> list:
    """A dataset's reference answer, usually bare ("3/4", "\\frac{3}{4}", "(1, 2)"), boxed by _parse; one that
    brings its own delimiters ("$(3,2)$", "\\boxed{2}, \\boxed{3}") is read as it is first."""
    if any(d in answer for d in ("$", "\\boxed", "\\(", "\\[")):
        return parse(answer, parsing_timeout=None) or _parse(answer)
    return _parse(answer)


def _math_check(prediction: str, reference: str) -> float:
    gold, pred = _parse(reference), _parse(prediction)
    return float(bool(gold and pred and verify(gold, pred, timeout_seconds=None)))


# math-verify's own extraction of a response's answer: \boxed{} first (several boxes form one set or tuple
# list), then LaTeX anywhere ($...$, \[...\], "the answer is ..."), then plain expressions (the last number).
_RESPONSE_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _math_response_check(text: str, reference: str) -> float:
    gold, pred = _parse_reference(reference), parse(text, _RESPONSE_EXTRACTION, parsing_timeout=None)
    return float(bool(gold and pred and verify(gold, pred, timeout_seconds=None)))


MAX_ANSWER_CHARS = 1000  # a longer final answer is garbage (or an attack on the parser): 0 without parsing
MAX_PARSE_CHARS = 10_000  # math-verify reads the end of a response's final text: where its answer is


def math_equal(prediction: str, reference: str, timeout: float = 5.0) -> bool:
    """Whether two final answers are mathematically equal (math-verify); never raises, and gives up
    (False) after `timeout` seconds. An empty prediction, or one over MAX_ANSWER_CHARS, is never equal."""
    if prediction is None or not prediction.strip() or len(prediction) > MAX_ANSWER_CHARS:
        return False
    if prediction.strip() == reference.strip():
        return True
    if _IN_WORKER:
        return _math_check(prediction, reference) == 1.0
    scores, _, _ = _run_checks([(_ref(_math_check), prediction, reference)], timeout, workers=1)
    return scores[0] == 1.0


def math_reward(response: str, answer: str, timeout: float = 5.0) -> float:
    """1 if the response's answer equals the reference, as math-verify reads it (_RESPONSE_EXTRACTION) from
    the response's final text (after </think>, its last MAX_PARSE_CHARS characters); else 0. Cheap guards
    first: an empty text, or a last \\boxed{} over MAX_ANSWER_CHARS, is 0 unparsed. Never raises; outside the
    reward workers it runs in one of them, so it gives up (0) after `timeout` seconds."""
    text = final_text(response)
    boxed = extract_answer(text, fallback="none")
    if not text.strip() or (boxed is not None and len(boxed) > MAX_ANSWER_CHARS):
        return 0.0
    text = text[-MAX_PARSE_CHARS:]
    if _IN_WORKER:
        return _math_response_check(text, answer)
    scores, _, _ = _run_checks([(_ref(_math_response_check), text, answer)], timeout, workers=1)
    return scores[0]


def math_boxed_reward(response: str, answer: str) -> float:
    """As math_reward, for responses with a \\boxed{} answer only: without one the response scores 0."""
    text = final_text(response)
    return math_reward(text, answer) if ("\\boxed" in text or "\\fbox" in text) else 0.0


def tiny_answer(response: str) -> str | None:
    """The tiny task writes running sums then the total ("7,12:12"): the text after the last ':'."""
    _, colon, final = response.rpartition(":")
    return final.strip() if colon else None


def tiny_reward(response: str, answer: str) -> float:
    return float(tiny_answer(response) == answer)


def final_text(response: str) -> str:
    """The response after its reasoning: the text after the last `</think>` (all of it without one)."""
    return response.rpartition("</think>")[2]


# ---------------------------------------------------------------------------- logic puzzles (Reasoning Gym)

def _last_tagged(text: str, open_tag: str = "<answer>", close_tag: str = "</answer>") -> str | None:
    """The content of the last <answer>...</answer>, pairs read left to right; one pass (a regex's lazy match
    from every unclosed <answer> made this quadratic: 20 s for 15,000 of them)."""
    pos, last = 0, None
    while (start := text.find(open_tag, pos)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            break
        pos, last = end + len(close_tag), text[start + len(open_tag):end]
    return last


def rg_extract(response: str) -> str:
    """The answer Reasoning Gym's scorers expect: the last <answer>...</answer> (their prompt convention),
    else the last \\boxed{...}, else the last non-empty line."""
    text = final_text(response)
    tagged = _last_tagged(text)
    if tagged is not None:
        return tagged.strip()
    boxed = extract_answer(text, fallback="none")
    if boxed is not None:
        return boxed
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# Reasoning Gym's scorers run in the sandbox, a fresh child process per check (sandbox.Server): some read the
# answer as code. Those that parse it as a sympy expression may name sympy's numbers, arithmetic and functions
# and one-letter symbols; every other scorer gets literals only (its eval of "[1, 2]" works; of
# "oracle_answer.split()", the scorer's own variable, it does not).
RG_EXPRESSIONS = {"countdown", "puzzle24", "polynomial_multiplication", "simple_integration",
                  "intermediate_integration"}
SYMPY_NAMES = frozenset(string.ascii_letters) | {
    "Integer", "Float", "Rational", "Symbol", "Function", "factorial", "sqrt", "exp", "log", "ln", "sin", "cos",
    "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "pi", "oo", "Abs"}
_RG_SERVER = sandbox.Server("reasoning_gym:get_score_answer_fn", memory_mb=1024)


def rg_score(prediction: str, answer: str) -> float:
    """Reasoning Gym's own scorer for the row's dataset on an extracted answer (continuous scores allowed), in
    the sandbox. `answer` is the JSON data.rg_rows wrote: {"dataset", "answer", "metadata"}, the entry the
    scorer needs."""
    if not _IN_WORKER:  # the sandboxed scorer is started from a reward worker, never from the trainer
        scores, timeouts, errors = _run_checks([(_ref(rg_score), prediction, answer)], 60.0, workers=1)
        if errors or timeouts:
            raise ValueError(errors[0] if errors else "the Reasoning Gym check timed out")
        return scores[0]
    try:
        entry = json.loads(answer)
    except (ValueError, RecursionError):
        raise ValueError(f"rg answer is not the JSON entry data.py writes: {answer[:200]!r}") from None
    if not _RG_SERVER.warm(entry["dataset"]):
        _slow_start()  # starting the sandbox and importing the library: seconds, not the check's own time
    names = SYMPY_NAMES if entry["dataset"] in RG_EXPRESSIONS else frozenset()
    return _RG_SERVER.call(entry["dataset"], [prediction, entry], [entry["answer"], entry], names)


def rg_reward(response: str, answer: str) -> float:
    """rg_score on the response's answer (rg_extract)."""
    return rg_score(rg_extract(response), answer)


def rg_gold(answer: str, _: str = "") -> float:
    """The score of a row's own reference answer."""
    return rg_score(json.loads(answer)["answer"], answer)


def rg_unsupported(answer: str, timeout: float = 60.0) -> str | None:
    """Why a Reasoning Gym dataset cannot be trained on, judged by one of its rows (`answer`: its JSON entry):
    None when the library's scorer, run as every check runs (in the sandbox, under the guard), gives the row's
    own answer 1.0; a scorer that needs more of Python than the guard allows is refused here."""
    scores, timeouts, errors = _run_checks([(_ref(rg_gold), answer, "")], timeout, workers=1)
    if errors or timeouts:
        return errors[0] if errors else f"its scorer ran past {timeout} s"
    return None if scores[0] == 1.0 else f"its scorer gives the dataset's own answer {scores[0]}, not 1.0"


# ---------------------------------------------------------------------------- instruction following

_WORD = re.compile(r"\b[\w'-]+\b")
_SENTENCE = re.compile(r"[^.!?]*[A-Za-z0-9][^.!?]*(?:[.!?]+|$)")
_BULLET = re.compile(r"^\s*[-*\u2022]\s+\S", re.MULTILINE)


def _has_word(text: str, word: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(word.lower()) + r"(?!\w)", text.lower()) is not None


def _is_json(text: str) -> bool:
    text = text.strip()
    if text.startswith("```"):  # a fenced block: ```json ... ```
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rstrip().removesuffix("```")
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# Each constraint: {"type": one of these names, plus its parameters}; a function (text, constraint) -> bool.
CONSTRAINTS = {
    "max_words": lambda t, c: len(_WORD.findall(t)) <= c["n"],
    "min_words": lambda t, c: len(_WORD.findall(t)) >= c["n"],
    "max_sentences": lambda t, c: len(_SENTENCE.findall(t.strip())) <= c["n"],
    "min_sentences": lambda t, c: len(_SENTENCE.findall(t.strip())) >= c["n"],
    "include_keywords": lambda t, c: all(_has_word(t, w) for w in c["words"]),
    "forbid_keywords": lambda t, c: not any(_has_word(t, w) for w in c["words"]),
    "json_format": lambda t, c: _is_json(t),
    "bullet_points": lambda t, c: len(_BULLET.findall(t)) == c["n"],
    "ends_with": lambda t, c: t.strip().endswith(c["phrase"]),
    "starts_with": lambda t, c: t.strip().startswith(c["phrase"]),
    "lowercase": lambda t, c: t == t.lower(),
    "no_commas": lambda t, c: "," not in t,
}


def ifeval_reward(response: str, answer: str) -> float:
    """Instruction following (ProRL): the fraction of the constraints in `answer` (a JSON list of
    {"type": ..., parameters}) that the response (after any </think>) meets."""
    try:
        constraints = json.loads(answer)
    except json.JSONDecodeError as e:
        raise ValueError(f"ifeval answer is not JSON ({e}): {answer[:200]!r}") from None
    except RecursionError:
        raise ValueError("ifeval answer is JSON nested too deeply to read") from None
    if not isinstance(constraints, list) or not constraints:
        raise ValueError(f"ifeval answer must be a non-empty JSON list of constraints, got {answer[:200]!r}")
    text = final_text(response)
    met = 0
    for c in constraints:
        if not isinstance(c, dict) or c.get("type") not in CONSTRAINTS:
            raise ValueError(f"ifeval constraint {c!r}: 'type' must be one of {sorted(CONSTRAINTS)}")
        try:
            met += bool(CONSTRAINTS[c["type"]](text, c))
        except (KeyError, TypeError) as e:
            raise ValueError(f"ifeval constraint {c!r}: missing or bad parameter ({type(e).__name__}: {e})") from None
    return met / len(constraints)


def _rg_answer(response: str) -> str | None:
    return rg_extract(response) or None


def math_answer(response: str, fallback: str = "last_number") -> str | None:
    """The answer the math rewards read: from the text after the reasoning (final_text: after the last
    </think>, or the whole response without one)."""
    return extract_answer(final_text(response), fallback)


# The final answer of a response, per verifier, read from what its reward reads: what maj@k votes with and the
# data cleaning's majority filter compares. Verifiers without one short answer (code, ifeval) have none.
ANSWERS = {"tiny": tiny_answer, "math": math_answer, "math_boxed": functools.partial(math_answer, fallback="none"),
           "rg": _rg_answer}


def final_answer(verifier: str, response: str) -> str | None:
    return ANSWERS[verifier](response) if verifier in ANSWERS else None


# Verifier functions must live at module level: workers import them by "module:name".
VERIFIERS = {"tiny": tiny_reward, "math": math_reward, "math_boxed": math_boxed_reward, "code": sandbox.code_reward,
             "rg": rg_reward, "ifeval": ifeval_reward}


# ---------------------------------------------------------------------------- generative verifier (UloRL 3.3)

# The judge sees the problem, the reference and the extracted prediction (never the whole response: a long
# response could argue with the judge). It runs in the trainer process: it is a model forward, not model code.
JUDGE_PROMPT = """You are grading a student's final answer to a problem against the reference answer.

Problem: {question}

Reference answer: {reference}

Student's answer: {prediction}

Are the two answers equivalent: the same number, expression, set, interval or choice, even if written \
differently (1/2 and 0.5, 27 cm and 0.27 m, "one half" and 1/2)? Reply with one word: yes or no."""
JUDGE_DOMAINS = ("math", "math_boxed")  # verifiers whose reward is answer equivalence, where a judge can help
_VERDICT_PUNCT = ".!"


def parse_verdict(text: str) -> bool:
    """Strict: True only if the reply (after any </think>) is the single word "yes" (any case, surrounding
    spaces and one final '.' or '!' allowed); "yes, but ...", "Yes/No" or anything else is a no."""
    return final_text(text).strip().rstrip(_VERDICT_PUNCT).strip().lower() == "yes"


def _question_text(prompt) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn holds the problem
        prompt = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), prompt[-1]["content"])
    return prompt if len(prompt) <= 4000 else prompt[:2000] + " ... " + prompt[-2000:]


@dataclass
class Judge:
    """The generative verifier: a model behind the rollout engine's interface, and how to talk to it."""
    engine: object  # engine.generate(prompts, max_tokens, sampling) -> [Generation]
    encode: Callable[[str], list[int]]  # a prompt text -> token ids (the judge's chat template applied)
    decode: Callable[[list[list[int]]], list[str]]  # token ids -> texts
    sampling: object  # engine.Sampling; greedy: Sampling(temperature=1.0, top_k=1)
    mode: str = "second_opinion"  # "second_opinion": ask only about rule-based 0s; "alone": ask about all
    max_tokens: int = 64  # what it may write before its yes/no (thinking models need more)


def judge(j: Judge, items: list[tuple]) -> list[bool]:
    """Ask the judge whether each (question, prediction, reference) pair is equivalent; verdicts parsed by
    parse_verdict. A missing, empty or over-long prediction is a no without asking."""
    verdicts, ask = [False] * len(items), []
    for i, (question, prediction, reference) in enumerate(items):
        if prediction is not None and prediction.strip() and len(prediction) <= MAX_ANSWER_CHARS:
            ask.append(i)
    if not ask:
        return verdicts
    prompts = [j.encode(JUDGE_PROMPT.format(question=_question_text(items[i][0]), reference=items[i][2],
                                            prediction=items[i][1])) for i in ask]
    gens = j.engine.generate(prompts, [j.max_tokens] * len(ask), j.sampling)
    for i, text in zip(ask, j.decode([g.tokens for g in gens])):
        verdicts[i] = parse_verdict(text)
    return verdicts


def judge_rewards(j: Judge, rows: list[dict], responses: list[str], rewards: list[float]) -> tuple[list[float], int]:
    """Rewards after the generative verifier, for rows whose verifier is in JUDGE_DOMAINS; others unchanged.
    "alone": the judge's verdict is the reward. "second_opinion": only rule-based 0s are asked, and a yes
    makes them 1 (UloRL's answer to pairs like 27cm / 0.27m). Returns (rewards, number of judge calls)."""
    if j.mode not in ("alone", "second_opinion"):
        raise ValueError(f"unknown verifier mode {j.mode!r}; use 'off', 'alone' or 'second_opinion'")
    ask = [i for i, row in enumerate(rows) if row["verifier"] in JUDGE_DOMAINS and
           (j.mode == "alone" or rewards[i] == 0.0)]
    verdicts = judge(j, [(rows[i]["prompt"], extract_answer(final_text(responses[i])), rows[i]["answer"])
                         for i in ask])
    out = list(rewards)
    for i, yes in zip(ask, verdicts):
        out[i] = float(yes)
    return out, len(ask)


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
    if found is not fn or fn.__module__ == "__main__":
        raise ValueError(f"verifier {ref} must be a module-level function of an importable module (not the main "
                         f"script) so that workers can import it")
    return ref


_CONN = None  # a worker's pipe to the trainer
SETUP_S = 120.0  # what a check may take on top of its timeout when it starts a sandboxed scorer first


def _slow_start() -> None:
    """In a worker: tell the trainer that this check starts a sandboxed scorer first (SETUP_S more)."""
    if _CONN is not None:
        _CONN.send("setup")


def _serve(conn, memory_mb: int) -> None:
    """Worker loop: receive chunks of (index, ref, response, answer), send one (index, score, error) each."""
    global _IN_WORKER, _CONN
    _IN_WORKER, _CONN = True, conn
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
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
        self.proc = ctx.Process(target=_serve, args=(child, WORKER_MEMORY_MB), daemon=True)
        # A forkserver child re-imports the main script unless there is none to import: it needs nothing from
        # it, and a script without a main guard would start workers again from inside the worker (an error).
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:
            self.proc.start()
        finally:
            sys.modules["__main__"] = main
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


def _run_checks(tasks: list[tuple[str, str, str]], timeout: float, workers: int, batch_timeout: float = 0.0):
    """Run (ref, response, answer) checks on the pool (grown to `workers` processes, never shrunk).
    Returns (scores, number of timeouts, error texts); a timed-out or failed check scores 0.0. With
    `batch_timeout` > 0 the whole call returns after at most that many seconds: checks left then score 0 and
    count as timeouts (hanging checks otherwise queue behind each other, `timeout` each)."""
    while len(_POOL) < workers:
        _POOL.append(_Worker())
    scores, n_timeouts, errors = [0.0] * len(tasks), 0, []
    todo = deque(range(len(tasks)))
    stop_at = time.monotonic() + batch_timeout if batch_timeout > 0 else math.inf
    # a few chunks per worker: one message per chunk instead of per item, yet the tail stays balanced
    chunk = max(1, min(64, len(tasks) // (4 * len(_POOL))))
    while todo or any(w.pending for w in _POOL):
        if time.monotonic() >= stop_at:  # the batch's bound: what is left scores 0
            n_timeouts += len(todo) + sum(len(w.pending) for w in _POOL)
            todo.clear()
            for w in list(_POOL):
                if w.pending:
                    w.pending = []
                    _replace(w, todo)
            break
        for w in _POOL:
            if w.ready and not w.pending and todo:
                w.pending = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                w.conn.send([(i, *tasks[i]) for i in w.pending])
                w.deadline = time.monotonic() + timeout
        deadlines = [w.deadline for w in _POOL if w.pending] + ([stop_at] if stop_at < math.inf else [])
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
            if msg == "setup":  # the check starts a sandboxed scorer first
                w.deadline = time.monotonic() + timeout + SETUP_S
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


def score_batch(items: list[tuple[str, str, str]], timeout: float = 5.0, workers: int = 2,
                batch_timeout: float = 0.0) -> tuple[list[float], dict]:
    """Score (verifier_name, response_text, answer) items in parallel worker processes. Returns one
    reward per item, in order, and {"reward/timeouts", "reward/errors"}; a check that raises or
    runs past `timeout` seconds scores 0.0, and so does every check left when the call has run
    `batch_timeout` seconds (> 0: the bound of the whole batch). An unknown verifier name raises ValueError."""
    for name, _, _ in items:
        if name not in VERIFIERS:
            raise ValueError(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
    scores, n_timeouts, errors = [], 0, []
    if items:
        tasks = [(_ref(VERIFIERS[name]), response, answer) for name, response, answer in items]
        scores, n_timeouts, errors = _run_checks(tasks, timeout, workers, batch_timeout)
    if errors:
        warnings.warn(f"{len(errors)} of {len(items)} reward checks raised and scored 0; first: {errors[0]}")
    return scores, {"reward/timeouts": n_timeouts, "reward/errors": len(errors)}


def score_samples(samples: list, texts: list[str], max_len: int, overlong: str = "zero", overlong_buffer: int = 0,
                  timeout: float = 5.0, judge: Judge | None = None, batch_timeout: float = 0.0) -> dict:
    """Set the reward of every sample (segment_rollout.Sample; `texts` are their decoded responses): its
    verifier's score, the judge's verdict where it is asked, then the overlong rule for truncated samples
    ("filter" leaves rewards alone: the update drops those samples). Training and evaluation both score here.
    Returns {"reward/timeouts", "reward/errors"} (and "reward/judge_calls" with a judge)."""
    items = [(s.row["verifier"], t, s.row["answer"]) for s, t in zip(samples, texts)]
    rewards, metrics = score_batch(items, timeout=timeout, batch_timeout=batch_timeout)
    if judge is not None and samples:
        rewards, metrics["reward/judge_calls"] = judge_rewards(judge, [s.row for s in samples], texts, rewards)
    for s, r in zip(samples, rewards):
        s.reward = overlong_reward(r, len(s.tokens), s.finish == "truncated", max_len,
                                   "none" if overlong == "filter" else overlong, overlong_buffer)
    return metrics


# ---------------------------------------------------------------------------- overlong handling

def overlong_reward(reward: float, n_tokens: int, truncated: bool, max_len: int,
                    mode: str = "zero", buffer: int = 0) -> float:
    """Reward of a sample after overlong handling.
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


# ---------------------------------------------------------------------------- benchmark

def bench(n: int = 1000, workers: int = 2, timeout: float = 5.0) -> dict:
    """Seconds to score n math answers: the pool (score_batch) against the fastest single-process loop over
    the same pairs (math_reward called directly: no processes, no messages, no timeout protection)."""
    import random
    rng = random.Random(0)
    forms = [lambda a, b: (rf"\frac{{{a}}}{{{b}}}", f"{a}/{b}"), lambda a, b: (f"{a / b:.4f}", rf"\frac{{{a}}}{{{b}}}"),
             lambda a, b: (rf"\sqrt{{{a * a}}}", str(a)), lambda a, b: (f"x = {a + b}", str(a + b)),
             lambda a, b: (rf"\{{{a}, {b}\}}", rf"\{{{b}, {a}\}}"), lambda a, b: (f"[{a}, {a + b})", f"[{a},{a + b})"),
             lambda a, b: (f"{a}^{{2}} + {b}", str(a * a + b + rng.randint(0, 1)))]
    items = []
    for _ in range(n):
        prediction, reference = rng.choice(forms)(rng.randint(1, 99), rng.randint(1, 99))
        items.append(("math", f"so the answer is \\boxed{{{prediction}}}.", reference))
    global _IN_WORKER
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # as in the workers: no "timeout disabled" noise
    _IN_WORKER = True  # the loop checks in this process, as a single-process scorer would
    start = time.perf_counter()
    loop = [math_reward(response, answer) for _, response, answer in items]
    loop_s = time.perf_counter() - start
    _IN_WORKER = False
    start = time.perf_counter()
    pool, _ = score_batch(items, timeout=timeout, workers=workers)
    cold_s = time.perf_counter() - start  # includes starting the worker processes
    start = time.perf_counter()
    pool, metrics = score_batch(items, timeout=timeout, workers=workers)
    warm_s = time.perf_counter() - start
    assert pool == loop, "the pool and the loop disagree"
    return {"n": n, "workers": workers, "loop_s": loop_s, "pool_cold_s": cold_s, "pool_warm_s": warm_s,
            "ratio_cold": cold_s / loop_s, "ratio_warm": warm_s / loop_s, "accuracy_of_pairs": sum(loop) / n, **metrics}


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="python reward.py bench: the reward pool's throughput against a "
                                            "single-process loop")
    p.add_argument("command", choices=["bench"])
    p.add_argument("--n", type=int, default=1000, help="math answers to score")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    args = p.parse_args()
    print(json.dumps(bench(args.n, args.workers), indent=1))
