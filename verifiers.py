"""Verifiers: a response text and a row's reference answer to a reward, one function `(response, answer) -> float`
per data domain, named by a row's `verifier` field through registry.VERIFIERS: math answer equivalence
(`math_reward`, math-verify), the tiny built-in task, Reasoning Gym's scorers (in the sandbox), sandboxed code
tests (systems/sandbox.py) and instruction-following constraints (`CONSTRAINTS`). `final_answer` is each verifier's
final answer (what maj@k votes with). They run in reward workers (systems/workers.py): module-level functions only.
"""
import ast
import itertools
import json
import math
import operator
import re
import string
from fractions import Fraction

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

import registry
from systems import sandbox
from systems import workers

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
    return float(bool(gold and pred and not _costlier(pred, gold) and verify(gold, pred, timeout_seconds=None)))


# What verify may be asked to compare. Parsing leaves big numbers unevaluated (9^{9^{9}}, (10^{100})!), and
# comparing them, or expanding a power of a sum, runs to the check's timeout: measured, (1+x)^{1000} 4 s,
# (x+y+z)^{200} and 9^{9^9} past 5 s, binom(10^9, 10^5) 15 s; (1+x)^{200} 0.2 s, 10^{1000000} and 100000! 0.1 s.
MAX_EXPONENT = 10**6  # of a number
MAX_EXPANDED_TERMS = 300  # of a power of a sum with symbols: (a+b+c)^n has binom(n+2, 2)
MAX_ARGUMENT = 10**5  # of a factorial or binomial; a product's or sum's count of terms too


def _log10(e) -> float:
    """An upper bound of log10|e| for a number expression `e` left unevaluated (inf where none is cheap)."""
    import sympy
    if e.is_Number:
        return math.log10(max(abs(float(e)), 1.0)) if e.is_finite else math.inf
    parts = [_log10(a) for a in e.args if a.is_number]
    if e.is_Pow:
        base, exponent = parts if len(parts) == 2 else (math.inf, math.inf)
        return math.inf if exponent > 15 else 10 ** exponent * max(base, 0.0)
    if isinstance(e, (sympy.factorial, sympy.binomial, sympy.gamma, sympy.factorial2)):
        n = max(parts, default=math.inf)
        return math.inf if n > 15 else 10 ** n * max(n, 1.0)
    if e.is_Mul:
        return sum(parts)
    return max(parts, default=0.0) + math.log10(max(len(parts), 1))  # a sum; a function's value, about its arguments


def _costly(expr) -> bool:
    """Whether comparing sympy expression `expr` could take seconds: a number raised past MAX_EXPONENT, a power of a
    sum with symbols of more than MAX_EXPANDED_TERMS terms expanded, a factorial or binomial of more than
    MAX_ARGUMENT, a product or sum of more terms."""
    import sympy
    big = lambda e, limit: e.is_number and _log10(e) > math.log10(limit)
    for node in sympy.preorder_traversal(expr):
        if node.is_Pow and ((node.base.is_number and big(node.exp, MAX_EXPONENT)) or
                            (node.base.is_Add and node.base.free_symbols and node.exp.is_number and
             _log10(node.exp) * (len(node.base.args) - 1) > math.log10(MAX_EXPANDED_TERMS))):
            return True
        if isinstance(node, (sympy.factorial, sympy.binomial, sympy.gamma, sympy.factorial2)) and \
                any(big(a, MAX_ARGUMENT) for a in node.args):
            return True
        if isinstance(node, (sympy.Product, sympy.Sum)) and \
                any(big(b, MAX_ARGUMENT) for _, *bounds in node.limits for b in bounds):
            return True
    return False


def _costlier(pred: list, gold: list) -> bool:
    """The parsed prediction would take verify seconds and the gold would not (a gold this big is compared)."""
    import sympy
    costly = lambda parsed: any(isinstance(e, sympy.Basic) and _costly(e) for e in parsed)
    return costly(pred) and not costly(gold)


# math-verify's own extraction of a response's answer: \boxed{} first (several boxes form one set or tuple
# list), then LaTeX anywhere ($...$, \[...\], "the answer is ..."), then plain expressions (the last number).
_RESPONSE_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _math_response_check(text: str, reference: str) -> float:
    gold, pred = _parse_reference(reference), parse(text, _RESPONSE_EXTRACTION, parsing_timeout=None)
    return float(bool(gold and pred and not _costlier(pred, gold) and verify(gold, pred, timeout_seconds=None)))


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
    # and it compares within 1e-6: the value must be the target's exactly
    "countdown": lambda answer, entry: _value(answer) == entry["metadata"]["target"],
    # puzzle24 checks that an answer uses four numbers in range, not the puzzle's: `8+8+4+4` solved every row; and
    # it reads the value through int(): 24.9 was 24
    "puzzle24": lambda answer, entry: _value(answer) == 24 and
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
# dataset, rg_probe scores them on RG_PROBE_ROWS rows of it. Of the 104 datasets it can generate, a fixed canary
# scored 1.0 on 6 before RG_CHECKS and above 0 on 59; with those built from the prompt, 70 (docs/rewards.md).
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


def rg_canaries(question: str, gold, metadata: dict, answers: list) -> list[tuple[str, str | None]]:
    """Wrong answers to one row, each with its kind where it may be right by chance (None where it may not; see
    canary_verdict): RG_CANARIES; two other rows' answers, and all of theirs in one line; what the prompt gives away (prompt_canaries; the rows' answers as the
    task's labels when they are few and short); the puzzle's numbers (metadata["numbers"], else the question's
    first six) added, multiplied, multiplied by 0_0 plus one of the numbers the row names, written with an
    underscore (`94*4*61*6*0_0+3_15`), and arranged to a value next to the row's (`near_expressions`). None of them
    the row's own answer (`gold`)."""
    others = [a for a in dict.fromkeys(a for a in answers if isinstance(a, str)) if not _same_answer(a, gold)]
    in_question = [int(n) for n in re.findall(r"\d+", question)][:6]
    numbers = metadata.get("numbers")
    if not (isinstance(numbers, list) and numbers and all(type(n) is int and n >= 0 for n in numbers)):
        numbers = in_question
    named = [v for v in metadata.values() if type(v) is int and v >= 10] + in_question
    labels = list(dict.fromkeys(a for a in answers if isinstance(a, str)))
    out = [*RG_CANARIES, " ".join(others)]
    chance = prompt_canaries(question, labels if len(labels) <= 6 and all(len(a) <= 20 for a in labels) else [])
    if numbers:
        out += ["+".join(map(str, numbers)), "*".join(map(str, numbers))]
        out += ["*".join(map(str, numbers)) + f"*0_0+{str(n)[0]}_{str(n)[1:]}" for n in dict.fromkeys(named)
                if n >= 10]
        if isinstance(gold, str) and (target := _value(gold)) is not None:
            out += near_expressions(numbers, target)
    out += near_values(gold, question)
    borrowed = {a: f"another row's answer {a[:60]!r}" for a in others[:2]}
    return [(c, kind) for c, kind in {**chance, **borrowed, **dict.fromkeys(out)}.items() if not _same_answer(c, gold)]


_NAME = re.compile(r"\b[A-Z][a-z]+\b")
_QUOTED = re.compile(r"\"([^\"\n]{1,200})\"|'([^'\n]{1,200})'")
_ALTERNATIVES = re.compile(r"\b(\w+)/(\w+)\b")
_CIPHER = re.compile(r"\b[A-Z]+(?:[ ,'!?-]+[A-Z]+){2,}\b")  # words of capitals, as cipher tasks show their text
PROMPT_ITEMS = 8  # the names, numbers and quoted options of a prompt tried alone: its first few; all of them together


def prompt_canaries(question: str, labels: list[str] = ()) -> dict[str, str | None]:
    """What a policy can write from the prompt alone, without solving, each with its kind where it may be right
    by chance (else None): the prompt echoed (whole, its last line, its questions); its names, numbers and quoted
    options, each alone (the first PROMPT_ITEMS: one of them may be the answer) and all together; the task's
    labels (`labels`, "hero/villain" alternatives, True/False, Yes/No) joined in both orders ("TrueFalse",
    "Yes No"); every shift of a run of capitals (a Caesar cipher's text) in one answer. Includes the row's answer
    where the prompt holds it: callers drop it (_same_answer)."""
    lines = [line.strip() for line in question.strip().splitlines() if line.strip()]
    out = [question.strip(), lines[-1] if lines else "", *re.findall(r"[^.!?\n]*\?", question)]
    alone = {}
    for kind, items in (("a name", _NAME.findall(question)), ("a number", re.findall(r"-?\d+(?:\.\d+)?", question)),
                        ("a quoted option", [a or b for a, b in _QUOTED.findall(question)])):
        items = list(dict.fromkeys(items))
        alone.update(dict.fromkeys(items[:PROMPT_ITEMS], f"{kind} of the prompt"))
        together = [" ".join(items), ", ".join(items)] if len(items) > 1 else []
        if kind == "a quoted option":  # statements quoted in a puzzle: all of them may hold the answer's claims
            alone.update(dict.fromkeys(together, "the quoted options of the prompt"))
        else:
            out += together
    for pair in [*_ALTERNATIVES.findall(question), ("True", "False"), ("Yes", "No"), tuple(labels)]:
        for order in (pair, pair[::-1]) if len(pair) > 1 else ():
            out += [sep.join(order) for sep in ("", " ", ", ", "/", "\n")]
    for text in _CIPHER.findall(question):
        out += ["\n".join("".join(chr((ord(ch) - 65 + k) % 26 + 65) if "A" <= ch <= "Z" else ch for ch in text)
                          for k in range(26))]
    return {**{c: None for c in out if c.strip() and c not in alone}, **alone}


def near_values(gold, question: str = "") -> list[str]:
    """For a numeric answer, the values next to it: one off (a whole number), 1% off (else), 0.5 and 0.9 above
    (int() reads 24.9 as 24); none that is the answer at a precision the question asks for ("to 3 significant
    figures", "to 2 decimal places")."""
    try:
        g = float(gold)
    except (TypeError, ValueError):
        return []
    if not abs(g) < 1e15:  # nan, inf, or past exact whole floats
        return []
    near = [g + 0.5, g + 0.9] + ([g - 1, g + 1] if g == int(g) else [g * 1.01])
    if m := re.search(r"(\d+) significant (?:figure|digit)", question):
        same = lambda v: f"{v:.{max(int(m.group(1)) - 1, 0)}e}" == f"{g:.{max(int(m.group(1)) - 1, 0)}e}"
        near = [v for v in near if not same(v)] + [g * 1.1]
    elif m := re.search(r"(\d+) decimal places?", question):
        near = [v for v in near if round(v, int(m.group(1))) != round(g, int(m.group(1)))]
    return [str(int(v)) if v == int(v) else repr(v) for v in near]


def near_expressions(numbers: list[int], target: Fraction, limit: int = 4) -> list[str]:
    """Arithmetic over all of `numbers` (at most 4; each once, + - * / and brackets) whose value is within 1 of
    `target` but not it: up to one below and one above, e.g. 24.9 from 8, 5, 10, 6 where 24 is asked."""
    if len(numbers) > limit:
        return []
    def combine(terms):  # (text, value) of every expression over `terms`, each term once
        if len(terms) == 1:
            yield terms[0]
            return
        for i in range(1, len(terms)):
            for mask in itertools.combinations(range(len(terms)), i):
                left = [terms[j] for j in mask]
                right = [terms[j] for j in range(len(terms)) if j not in mask]
                for (a, x), (b, y) in itertools.product(combine(left), combine(right)):
                    yield f"({a}+{b})", x + y
                    yield f"({a}-{b})", x - y
                    yield f"({a}*{b})", x * y
                    if y:
                        yield f"({a}/{b})", x / y
    found = {}
    for text, value in combine([(str(n), Fraction(n)) for n in numbers]):
        if value != target and abs(value - target) < 1:
            found.setdefault(value > target, text)
            if len(found) == 2:
                break
    return [text[1:-1] if text.startswith("(") else text for text in found.values()]


def rg_probe(name: str, entries: list[tuple[str, str]], timeout: float = 60.0) -> tuple[bool, str]:
    """How training may reward dataset `name`, judged on `entries` ((question, answer JSON) per row, drawn for
    the probe) as every check runs (reward workers, the sandbox, the guard, RG_CHECKS): (full_marks, what was
    found). Raises ValueError, naming the dataset and what scored, when a row's own answer does not score 1.0 or
    a canary (rg_canaries) scores 1.0 (see canary_verdict). full_marks when a canary earns partial credit: the
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
    tried = [(canary, kind, row, a) for row, ((q, e), (_, a)) in enumerate(zip(loaded, entries))
             for canary, kind in rg_canaries(q, e["answer"], e["metadata"], answers)]
    scores, _, _ = workers.run([(workers.ref(rg_score), canary, a) for canary, _, _, a in tried], timeout, workers=2)
    found = {}  # (canary, kind) -> [(score, row)], a canary that errs or hangs scores 0, as in training
    for (canary, kind, row, _), score in zip(tried, scores):
        found.setdefault((canary, kind), []).append((score, row))
    return canary_verdict(name, found, answers)


def canary_verdict(name: str, found: dict, answers: list) -> tuple[bool, str]:
    """rg_probe's verdict from each canary's scores (`found`: (canary, kind) -> [(score, row)]; `answers`: the
    rows' own): refused (ValueError) when a canary scores full marks; one of a kind that may be right by chance
    (a name or quoted option of the prompt, another row's answer: one jugs solution solves another puzzle too)
    only when its kind does on at least half the rows it is tried on. (True, why) when one earns partial
    credit, of any kind; else (False, why)."""
    rows, solved = {}, {}  # kind -> the rows its canaries are tried on, and those they solve (row -> canary)
    for (canary, kind), results in found.items():
        rows.setdefault(kind, set()).update(row for _, row in results)
        solved.setdefault(kind, {}).update({row: canary for score, row in results if score >= 1.0})
    for kind, full in solved.items():
        if full and (kind is None or len(full) >= max(2, len(rows[kind]) / 2)):
            canary = full[min(full)]
            hits = sorted(row for row, c in full.items() if c == canary or kind is not None)
            raise ValueError(f"rg:{name}: this dataset is not supported: the wrong answer {canary[:80]!r} "
                             f"{f'({kind}) ' if kind else ''}scores 1.0 on probe row{'s' if len(hits) > 1 else ''} "
                             f"{', '.join(map(str, hits))} (answer {str(answers[hits[0]])[:60]!r}), so a policy could "
                             f"learn it instead of solving")
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


def check_ifeval_answer(answer: str) -> None:
    """ValueError on a malformed constraint list or an unknown constraint type: a row's answer, checked as it loads."""
    ifeval_reward("", answer)


def rg_answer(response: str) -> str | None:
    return rg_extract(response) or None


def math_answer(response: str, fallback: str = "last_number") -> str | None:
    """The answer the math rewards read: from the text after the reasoning (final_text: after the last
    </think>, or the whole response without one)."""
    return extract_answer(final_text(response), fallback)


def math_boxed_answer(response: str) -> str | None:
    return math_answer(response, fallback="none")


def final_answer(verifier: str, response: str) -> str | None:
    """The final answer of a response, read as its verifier's reward reads it (registry.Verifier.final): what maj@k
    votes with and the data cleaning's majority filter compares. None for a verifier without one short answer
    (code, ifeval)."""
    kind = registry.VERIFIERS.get(verifier)
    return registry.function(kind.final)(response) if kind and kind.final else None
