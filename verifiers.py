"""Verifiers: a response text and a row's reference answer to a reward, one function `(response, answer) -> float`
per data domain, named by a row's `verifier` field through `VERIFIERS`: math answer equivalence
(`math_reward`, math-verify), the tiny built-in task, Reasoning Gym's scorers (in the sandbox), sandboxed code
tests (sandbox.py) and instruction-following constraints (`CONSTRAINTS`). `final_answer` is each verifier's
final answer (what maj@k votes with). They run in reward workers (workers.py): module-level functions only.
"""
import ast
import functools
import json
import operator
import re
import string
from fractions import Fraction

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

import sandbox
import workers

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
    if workers.IN_WORKER:
        return _math_check(prediction, reference) == 1.0
    scores, _, _ = workers.run([(workers.ref(_math_check), prediction, reference)], timeout, workers=1)
    return scores[0] == 1.0


def math_reward(response: str, answer: str, timeout: float = 5.0) -> float:
    """1 if the response's answer equals the reference, as math-verify reads it (_RESPONSE_EXTRACTION) from
    the response's final text (after </think>, its last MAX_PARSE_CHARS characters); else 0. Cheap guards
    first: an empty text, or a last \\boxed{} over MAX_ANSWER_CHARS, closed or not, is 0 unparsed. Never raises; outside the
    reward workers it runs in one of them, so it gives up (0) after `timeout` seconds."""
    text = final_text(response)
    boxed = extract_answer(text, fallback="none")
    if not text.strip() or (boxed is not None and len(boxed) > MAX_ANSWER_CHARS) or \
            (boxed is None and _unclosed_box(text) > MAX_ANSWER_CHARS):
        return 0.0
    text = text[-MAX_PARSE_CHARS:]
    if workers.IN_WORKER:
        return _math_response_check(text, answer)
    scores, _, _ = workers.run([(workers.ref(_math_response_check), text, answer)], timeout, workers=1)
    return scores[0]


def _unclosed_box(text: str) -> int:
    """How long the last box's argument would be if its `{` is never closed: the characters after it (0 when the
    last box is closed or there is none)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return 0
    j = _SPACE.match(text, _BOX.match(text, start).end()).end()
    return len(text) - j - 1 if text.startswith("{", j) and _box_argument(text, _BOX.match(text, start).end()) is None else 0


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
    "Integer", "Float", "Rational", "Symbol", "factorial", "sqrt", "exp", "log", "ln", "sin", "cos",
    "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "pi", "oo", "Abs"}
_RG_SERVER = sandbox.Server("reasoning_gym:get_score_answer_fn", memory_mb=1024)


# The project's checks before the library's scorer, for scorers that gave a fixed answer full marks:
# (answer, entry) -> whether the library may score the answer at all (else it scores 0).
_ARITHMETIC = re.compile(r"[\d\s()+\-*/]+")
RG_CHECKS = {
    # countdown reads the answer's numbers as `\b\d+\b` and its value with sympy: "1_64" was no number to the
    # first and 164 to the second, so `n1*n2*n3*n4*0_0+1_64` solved a row whose target is 164
    "countdown": lambda answer, entry: bool(_ARITHMETIC.fullmatch(answer)),
    # puzzle24 checks that an answer uses four numbers in range, not the puzzle's: `8+8+4+4` solved every row
    "puzzle24": lambda answer, entry: bool(_ARITHMETIC.fullmatch(answer)) and
    sorted(map(int, re.findall(r"\d+", answer))) == sorted(entry["metadata"]["numbers"]),
    # complex_arithmetic scores min(1, exp(-distance)), which is 1 for a nan distance
    "complex_arithmetic": lambda answer, entry: "nan" not in answer.lower(),
}


def rg_score(prediction: str, answer: str) -> float:
    """Reasoning Gym's own scorer for the row's dataset on an extracted answer, in the sandbox, after the
    dataset's RG_CHECKS. `answer` is the JSON data.rg_rows wrote: {"dataset", "answer", "metadata"}, the entry the
    scorer needs, and "full_marks": true where the library's partial credit is not passed on (rg_probe): its score
    then counts only when it is 1.0."""
    if not workers.IN_WORKER:  # the sandboxed scorer is started from a reward worker, never from the trainer
        scores, timeouts, errors = workers.run([(workers.ref(rg_score), prediction, answer)], 60.0, workers=1)
        if errors or timeouts:
            raise ValueError(errors[0] if errors else "the Reasoning Gym check timed out")
        return scores[0]
    try:
        entry = json.loads(answer)
    except (ValueError, RecursionError):
        raise ValueError(f"rg answer is not the JSON entry data.py writes: {answer[:200]!r}") from None
    check = RG_CHECKS.get(entry["dataset"])
    if check is not None and not check(prediction, entry):
        return 0.0
    if not _RG_SERVER.warm(entry["dataset"]):
        workers.setup_started()  # starting the sandbox and importing the library: seconds, not the check's own time
    names = SYMPY_NAMES if entry["dataset"] in RG_EXPRESSIONS else frozenset()
    score = _RG_SERVER.call(entry["dataset"], [prediction, entry], [entry["answer"], entry], names)
    return 0.0 if entry.get("full_marks") and score != 1.0 else score


def rg_reward(response: str, answer: str) -> float:
    """rg_score on the response's answer (rg_extract)."""
    return rg_score(rg_extract(response), answer)


def rg_gold(answer: str, _: str = "") -> float:
    """The score of a row's own reference answer."""
    return rg_score(json.loads(answer)["answer"], answer)


# Canaries: wrong answers a policy could learn without solving anything. Before a run uses a Reasoning Gym
# dataset, rg_probe scores them on RG_PROBE_ROWS rows of it. Of the 104 datasets it can generate, a canary scored
# 1.0 on 6 before RG_CHECKS and above 0 on 59 (docs/rewards.md).
RG_PROBE_ROWS = 8
RG_CANARIES = ("", "0", "1", "-1", "0.5", "1_0", "nan", "inf", "-inf", "None", "True", "False", "yes", "no", "A",
               "[]", "{}")


def _value(text: str) -> Fraction | None:
    """The value of plain arithmetic over whole numbers (digits, + - * / and parentheses), else None."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(type(node).__name__)
    if not _ARITHMETIC.fullmatch(text) or len(text) > 200:
        return None
    try:
        return value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError):
        return None


def _same_answer(a: str, b) -> bool:
    """`a` is the answer `b` (the row's own): the same text up to case and spaces, the same number ("1" and
    "1.0"), or arithmetic of the same value (a puzzle solved another way); such a canary is no wrong answer."""
    if not isinstance(b, str):
        return False
    if a.strip().lower() == b.strip().lower():
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        pass
    return _value(a) is not None and _value(a) == _value(b)


def rg_canaries(question: str, gold, metadata: dict, answers: list) -> list[tuple[str, bool]]:
    """Wrong answers to one row, each with whether it is another row's answer: RG_CANARIES; two other rows'
    answers, and all of theirs in one line; the puzzle's numbers (metadata["numbers"], else the question's first
    six) added, multiplied, and multiplied by 0_0 plus one of the numbers the row names, written with an
    underscore (`94*4*61*6*0_0+3_15`). None of them the row's own answer (`gold`)."""
    others = [a for a in dict.fromkeys(a for a in answers if isinstance(a, str)) if not _same_answer(a, gold)]
    in_question = [int(n) for n in re.findall(r"\d+", question)][:6]
    numbers = metadata.get("numbers")
    if not (isinstance(numbers, list) and numbers and all(type(n) is int and n >= 0 for n in numbers)):
        numbers = in_question
    named = [v for v in metadata.values() if type(v) is int and v >= 10] + in_question
    out = [*RG_CANARIES, " ".join(others)]
    if numbers:
        out += ["+".join(map(str, numbers)), "*".join(map(str, numbers))]
        out += ["*".join(map(str, numbers)) + f"*0_0+{str(n)[0]}_{str(n)[1:]}" for n in dict.fromkeys(named)
                if n >= 10]
    return [(c, False) for c in dict.fromkeys(out) if not _same_answer(c, gold)] + [(a, True) for a in others[:2]]


def rg_probe(name: str, entries: list[tuple[str, str]], timeout: float = 60.0) -> tuple[bool, str]:
    """How training may reward dataset `name`, judged on `entries` ((question, answer JSON) per row, drawn for
    the probe) as every check runs (reward workers, the sandbox, the guard, RG_CHECKS): (full_marks, what was
    found). Raises ValueError, naming the dataset and what scored, when a row's own answer does not score 1.0,
    a canary (rg_canaries) scores 1.0, or another row's answer scores 1.0 on half the rows it is tried on (one
    row's solution may solve another puzzle too: jugs). full_marks when a canary earns partial credit: the
    library's scores then count only at 1.0 (rg_score); otherwise they pass as they are (continuous, as ProRL's
    puzzles)."""
    loaded = [(q, json.loads(a)) for q, a in entries]
    golds = [(a, "") for (q, e), (_, a) in zip(loaded, entries) if e["answer"] is not None]
    scores, timeouts, errors = workers.run([(workers.ref(rg_gold), a, b) for a, b in golds], timeout, workers=2)
    if errors or timeouts or any(s != 1.0 for s in scores):
        why = errors[0] if errors else f"its scorer ran past {timeout} s" if timeouts else \
            f"its scorer gives the dataset's own answer {min(scores)}, not 1.0"
        raise ValueError(f"rg:{name}: this dataset is not supported: the library's scorer, run as training runs it "
                         f"(in the sandbox, the answer kept to a literal or an expression), does not give its own "
                         f"answer 1.0 ({why})")
    answers = [e["answer"] for _, e in loaded]
    tried = [(canary, borrowed, row, a) for row, ((q, e), (_, a)) in enumerate(zip(loaded, entries))
             for canary, borrowed in rg_canaries(q, e["answer"], e["metadata"], answers)]
    scores, _, _ = workers.run([(workers.ref(rg_score), canary, a) for canary, _, _, a in tried], timeout, workers=2)
    found = {}  # canary -> [(score, row)], a canary that errs or hangs scores 0, as in training
    for (canary, borrowed, row, _), score in zip(tried, scores):
        found.setdefault((canary, borrowed), []).append((score, row))
    return canary_verdict(name, found, answers)


def canary_verdict(name: str, found: dict, answers: list) -> tuple[bool, str]:
    """rg_probe's verdict from each canary's scores (`found`: (canary, whether it is another row's answer) ->
    [(score, row)]; `answers`: the rows' own): refused (ValueError) when one scores full marks, another row's
    answer on half the rows it is tried on; (True, why) when one earns partial credit; else (False, why)."""
    for (canary, borrowed), results in found.items():
        full = [row for score, row in results if score >= 1.0]
        if full and (not borrowed or len(full) >= max(2, len(results) / 2)):
            raise ValueError(f"rg:{name}: this dataset is not supported: the wrong answer {canary[:80]!r} scores 1.0 "
                             f"on probe row{'s' if len(full) > 1 else ''} {', '.join(map(str, full))} (answer "
                             f"{str(answers[full[0]])[:60]!r}), so a policy could learn it instead of solving")
    partial = [(score, canary, row) for (canary, _), results in found.items() for score, row in results if 0 < score < 1]
    if not partial:
        return False, "no wrong answer earned credit: its scores count as they are"
    score, canary, row = max(partial)
    return True, (f"the wrong answer {canary[:60]!r} scores {score:.3g} on a row whose answer is "
                  f"{str(answers[row])[:60]!r}: its scores count only at full marks (1.0), else 0")


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


# The parameters each kind of constraint takes, and what makes a value one that every response meets or none can:
# a count is a whole number (a maximum at least 1, a minimum or a bullet count at least 0 but a minimum of 0 is met
# by any text), a phrase is non-blank text, a word list holds non-blank words.
_COUNTS = {"max_words": 1, "min_words": 1, "max_sentences": 1, "min_sentences": 1, "bullet_points": 0}
_TEXTS = {"ends_with": "phrase", "starts_with": "phrase"}
_WORD_LISTS = {"include_keywords": "words", "forbid_keywords": "words"}


def check_constraint(c) -> None:
    """ValueError unless `c` is a constraint of a known type whose parameters a response can meet and fail: no
    infinite, NaN, fractional or non-positive count, empty phrase or empty word list."""
    if not isinstance(c, dict) or c.get("type") not in CONSTRAINTS:
        raise ValueError(f"ifeval constraint {c!r}: 'type' must be one of {sorted(CONSTRAINTS)}")
    kind = c["type"]
    if kind in _COUNTS:
        n = c.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < _COUNTS[kind]:
            raise ValueError(f"ifeval constraint {c!r}: missing or bad parameter 'n': a whole number of at least {_COUNTS[kind]} "
                             f"(got {n!r}: every response would meet it, or none)")
    if kind in _TEXTS and (not isinstance(c.get(_TEXTS[kind]), str) or not c[_TEXTS[kind]].strip()):
        raise ValueError(f"ifeval constraint {c!r}: missing or bad parameter '{_TEXTS[kind]}': non-blank text (every response would "
                         f"meet an empty one)")
    if kind in _WORD_LISTS:
        words = c.get(_WORD_LISTS[kind])
        if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"ifeval constraint {c!r}: missing or bad parameter '{_WORD_LISTS[kind]}': a non-empty list of non-blank "
                             f"words (every response would meet an empty one)")


def silent(c: dict) -> bool:
    """Whether saying nothing meets constraint `c` (a maximum, forbidden words, lowercase, no commas, no bullets)."""
    return CONSTRAINTS[c["type"]]("", c)


def ifeval_reward(response: str, answer: str) -> float:
    """Instruction following (ProRL): the fraction of the constraints in `answer` (a JSON list of
    {"type": ..., parameters}) that the response (after any </think>) meets, or 0 when it meets none that
    silence fails: what an empty answer meets (every maximum, forbidden word, "no commas") rewards nothing
    alone, so a row must hold a constraint that asks for something."""
    try:
        constraints = json.loads(answer)
    except json.JSONDecodeError as e:
        raise ValueError(f"ifeval answer is not JSON ({e}): {answer[:200]!r}") from None
    except RecursionError:
        raise ValueError("ifeval answer is JSON nested too deeply to read") from None
    if not isinstance(constraints, list) or not constraints:
        raise ValueError(f"ifeval answer must be a non-empty JSON list of constraints, got {answer[:200]!r}")
    for c in constraints:
        check_constraint(c)
    if all(silent(c) for c in constraints):
        raise ValueError(f"ifeval answer {answer[:200]}: an empty response meets every one of these constraints; "
                         f"add one that asks for something (min_words, include_keywords, starts_with, ...)")
    text = final_text(response)
    met = [bool(CONSTRAINTS[c["type"]](text, c)) for c in constraints]
    if not any(m and not silent(c) for m, c in zip(met, constraints)):
        return 0.0
    return sum(met) / len(constraints)


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


