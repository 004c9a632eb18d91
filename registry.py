"""The kinds of things a run names by a string, one table each: the verifiers a row's `verifier` field names, the
policy losses --policy-loss names, and the data sources a --data / --eval-data spec names. A new verifier is a
function in verifiers.py and one entry here; a new policy loss, a function in loss.py and one entry here; a new
kind of source, a loader in data.py and one entry here.

Functions are named as "module:function" strings, not imported: this module loads the standard library only, so
config.py (`--help`, the flag checks) reads it without loading math-verify, torch or reasoning_gym, and the reward
workers import a verifier by the same string.
"""
import functools
import importlib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Verifier:
    reward: str  # "module:function", (response, answer) -> a score in [0, 1]: run in a reward worker
    final: str | None = None  # "module:function", response -> its final answer (maj@k, clean.py); None: none short
    answer_check: str | None = None  # "module:function" that raises ValueError on a bad answer: the answer is JSON
    answer_given_prompt: str | None = None  # "module:function", (prompt text, answer) -> the answer a row keeps
    from_file: bool = True  # whether a row read from a file may name it (--default-verifier's choices)
    judged: bool = False  # its reward is answer equivalence, where a generative verifier can help (reward.Judge)
    as_response: str | None = None  # a final answer written as a response its reward reads ("{}"), for clean.py
    help: str = ""  # --default-verifier's help for it; without from_file, why a file row may not name it


VERIFIERS = {
    "math": Verifier("verifiers:math_reward", "verifiers:math_answer", judged=True, as_response="\\boxed{{{}}}",
                     help="last \\boxed{}, else the last number"),
    "math_boxed": Verifier("verifiers:math_boxed_reward", "verifiers:math_boxed_answer", judged=True,
                           as_response="\\boxed{{{}}}", help="\\boxed{} only"),
    "code": Verifier("systems.sandbox:code_reward", answer_check="systems.sandbox:parse_tests",
                     answer_given_prompt="systems.sandbox:answer_given_prompt",
                     help="the answer: JSON stdin/stdout tests"),
    "ifeval": Verifier("verifiers:ifeval_reward", answer_check="verifiers:check_ifeval_answer",
                       help="the answer: a JSON list of constraints"),
    "tiny": Verifier("verifiers:tiny_reward", "verifiers:tiny_answer", as_response=":{}", help="the built-in task"),
    "rg": Verifier("verifiers:rg_reward", "verifiers:rg_answer", from_file=False,
                   help="Reasoning Gym rows are generated here (--data rg:NAME), never read from a file, whose "
                        "answer a scorer would run"),
}
FILE_VERIFIERS = sorted(name for name, v in VERIFIERS.items() if v.from_file)


def default_verifier_help() -> str:
    return ("verifier of file rows without a 'verifier' field: " +
            ", ".join(f"{name} ({v.help})" for name, v in VERIFIERS.items() if v.from_file) +
            "".join(f"; not {name}: {v.help}" for name, v in VERIFIERS.items() if not v.from_file))


@functools.cache
def function(ref: str):
    """The function a "module:function" string names (imported on first use), or ValueError saying why not."""
    module, _, name = ref.partition(":")
    try:
        fn = functools.reduce(getattr, name.split("."), importlib.import_module(module)) if module and name else None
    except ModuleNotFoundError as e:
        if e.name != module:  # the module is there and fails to import: its own error says why
            raise
        fn = None
    except AttributeError:
        fn = None
    if not callable(fn):
        raise ValueError(f"{ref!r} must name a module-level function of an importable module ('module:function'), "
                         f"the form a reward worker imports a verifier by")
    return fn


# --policy-loss: each takes loss.policy_loss's arguments, all by keyword (ulorl.micro_batch_loss), and returns
# (loss, metrics)
POLICY_LOSSES = {"clipped": "loss:policy_loss"}


@dataclass(frozen=True)
class Source:
    pattern: str  # the sources of this kind (re.fullmatch); the last entry's matches every other one
    rows: str  # "module:function", (source, seed, held_out, n, prompt_key, answer_key, default_verifier, split) -> rows
    check: str | None  # "module:function", source -> None or ValueError / OSError: the flag checks, before any loading
    held_out: bool  # whether it has a held-out draw of its own (problems or a seed training never draws)
    help: str


# A spec is SOURCE, or a mixture "SOURCE@WEIGHT,SOURCE@WEIGHT" (parse_mixture); each SOURCE is the first kind here
# whose pattern it matches.
SOURCES = {
    "tiny": Source(r"tiny(:.*)?", "data:tiny_source", "data:tiny_terms", True,
                   "'tiny' (the built-in task; 'tiny:K': every problem K terms)"),
    "rg": Source(r"rg:.*", "data:rg_source", None, True, "rg:NAME[:SIZE] (Reasoning Gym)"),
    "file": Source(r".*", "data:file_source", "data:check_path", False,
                   "a .jsonl/.json/.parquet file, a saved dataset, a hub name"),
}
DATA_HELP = (", ".join(s.help for s in SOURCES.values()) +
             ", or a mixture 'a.jsonl@0.7,rg:chain_sum@0.3'")


def source_kind(source: str) -> str:
    """The SOURCES key of one source of a spec."""
    return next(kind for kind, s in SOURCES.items() if re.fullmatch(s.pattern, source, re.DOTALL))


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """--data "a.jsonl@0.7,rg:chain_sum@0.3" -> [("a.jsonl", 0.7), ("rg:chain_sum", 0.3)]; no @ = weight 1.
    ('@' and not ':' separates the weight: ':' already belongs to rg:NAME:SIZE.)"""
    parts = []
    for part in spec.split(","):
        source, at, weight = part.strip().rpartition("@") if "@" in part else ("", "", "1")
        source = source.strip() if at else part.strip()
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not source or not w > 0:
            raise ValueError(f"--data {spec!r}: part {part!r} must be SOURCE or SOURCE@WEIGHT with WEIGHT > 0")
        parts.append((source, w))
    return parts
