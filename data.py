"""Prompts in, token ids out: loading rows from jsonl / json / parquet files or a Hugging Face dataset (a hub
name, a local `save_to_disk` directory, or a local directory of data files), Reasoning Gym datasets
generated locally (`rg:NAME[:SIZE]`), weighted mixtures of sources, the one loader train.py and eval.py
both use (`load_prompts`), chat templating (`encode_prompt`), and the order in which training draws rows
(`draw_order`, `draw_prompts`).

A row is {"prompt": str | [{"role", "content"}, ...], "answer": str, "verifier": str, "where": "src:row"}.
`where` points back at the source so a bad reward or a crash can be traced to its line: for .jsonl it is the
line number (from 1, as editors show it), for everything else the 0-based index (as `rows[i]`, `ds[i]` and
`pandas.read_parquet(...).iloc[i]` take it). Column names may be dotted paths into nested columns, e.g. the
verl/DAPO parquet layout: `prompt` a list of chat messages, `--answer-key reward_model.ground_truth`.

Bad rows are never skipped silently: a dataset that quietly loses half its rows trains on something other
than the run says. Every error names the source, the row and the field.
UloRL's data cleaning (section 3.4) is clean.py.
"""
import ctypes
import functools
import json
import math
import os
import random
import sys
import threading
import time

import registry
import verifiers
from registry import parse_mixture  # noqa: F401 (data.parse_mixture: a spec's sources, parsed where they are named)
import tiny

SUFFIXES = (".jsonl", ".json", ".parquet")
MISSING = object()  # a dotted key that isn't there (a stored None is a value, and an error of its own)


# What a row of a data file may hold. A line is read at most MAX_LINE_BYTES at a time, so a longer one is refused
# without being read whole; a JSON number of more than MAX_NUMBER_CHARS characters (Python refuses to convert an
# integer of over 4,300 digits, and a float that long is inf) is refused before it is converted.
MAX_LINE_BYTES = 64 << 20
MAX_NUMBER_CHARS = 400


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:  # json.loads would keep the last silently: which one the writer meant is unknown
            raise ValueError(f"holds the key {key[:60]!r} twice in one object")
        seen.add(key)
    return dict(pairs)


def _number(text: str, kind):
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"holds a number of {len(text):,} characters ({text[:20]}...; at most {MAX_NUMBER_CHARS}: store "
                         f"a longer one as a string)")
    return kind(text)


def parse_json(text: str):
    """json.loads, refusing what it would take silently or choke on: a key twice in one object, a number of
    over MAX_NUMBER_CHARS characters, a raw NUL byte, nesting deeper than Python can read. ValueError
    says which, as a phrase that follows "the line"."""
    if "\x00" in text:
        raise ValueError(f"holds a NUL byte at character {text.index(chr(0))}")
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys, parse_int=lambda t: _number(t, int),
                         parse_float=lambda t: _number(t, float))
    except json.JSONDecodeError as e:
        raise ValueError(f"is not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError("is JSON nested too deeply to read") from None
    return obj


def read_jsonl(path: str) -> list[tuple[str, dict]]:
    """(where, object) per non-blank line, read a line at a time (at most MAX_LINE_BYTES each). Bytes are decoded
    line by line so a bad byte names its line."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{n}: line {n} is longer than {MAX_LINE_BYTES >> 20} MiB, the most a row "
                                 f"may hold; shorten it or drop it at the source")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: line {n} is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r});"
                                 f" re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = parse_json(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: line {n} {e}; each line must hold one JSON object") from None
            out.append((f"{path}:{n}", obj))
    return out


def read_json(path: str) -> list[tuple[str, dict]]:
    with open(path, "rb") as f:
        try:
            data = parse_json(f.read().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid UTF-8 ({e}); re-encode the file as UTF-8") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}; a .json source must hold one list of row objects (use .jsonl "
                             f"for one object per line)") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, expected a list of row objects")
    return [(f"{path}:{i}", obj) for i, obj in enumerate(data)]


def read_parquet(path: str) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq  # struct columns come back as dicts, list<struct> as lists of dicts
    return [(f"{path}:{i}", obj) for i, obj in enumerate(pq.read_table(path).to_pylist())]


def read_dataset(source: str, split: str, limit: int | None) -> list[tuple[str, dict]]:
    import datasets
    path = os.path.expanduser(source)
    if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
        ds = datasets.load_from_disk(path)  # a directory written by save_to_disk
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{source}: has splits {list(ds)}, not '{split}'; pick one with --split")
            ds, label = ds[split], f"{source}[{split}]"
        else:
            label = source
    else:  # a hub name, or a local directory of jsonl/json/parquet/csv files (the split is then 'train')
        ds, label = datasets.load_dataset(source, split=split), f"{source}[{split}]"
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))  # before iterating: a big dataset isn't decoded in full
    return [(f"{label}:{i}", obj) for i, obj in enumerate(ds)]


def lookup(obj: dict, key: str):
    """(obj["a"]["b"], None) for key "a.b"; if absent, (MISSING, what is there instead)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(obj, dict) or part not in obj:
            at = "the row" if i == 0 else repr(".".join(parts[:i]))
            there = f"has keys {sorted(obj)}" if isinstance(obj, dict) else f"is a {type(obj).__name__}"
            return MISSING, f"{at} {there}"
        obj = obj[part]
    return obj, None


ROLES = ("system", "user", "assistant", "tool", "developer")  # what chat templates render


def check_messages(prompt, where: str, field: str = "prompt") -> None:
    ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt)
    if not ok:
        raise ValueError(f"{where}: field '{field}' must be a non-empty string or a non-empty list of"
                         f" {{'role': str, 'content': str}} messages, got {str(prompt)[:200]!r}")
    for i, m in enumerate(prompt):
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: field '{field}', message {i}: unknown role {m['role']!r}; roles are "
                             f"{', '.join(ROLES)}")
    if not any(m["content"].strip() for m in prompt):
        raise ValueError(f"{where}: field '{field}': every message is empty or whitespace")


def make_row(obj, where: str, prompt_key: str, answer_key: str, verifier_key: str, default_verifier: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: row is a {type(obj).__name__}, expected an object with '{prompt_key}'"
                         f" and '{answer_key}' fields")
    fields = {}
    for name, key in (("prompt", prompt_key), ("answer", answer_key)):
        value, instead = lookup(obj, key)
        if value is MISSING:
            raise ValueError(f"{where}: no field '{key}' (the {name}); {instead}; name the right"
                             f" column with --{name}-key (dotted paths reach into nested columns)")
        if value in (None, "", []) or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{where}: field '{key}' (the {name}) is empty; fix or drop this row at the source")
        fields[name] = value
    prompt, answer = fields["prompt"], fields["answer"]
    if not isinstance(prompt, str):
        check_messages(prompt, where, prompt_key)
    verifier, _ = lookup(obj, verifier_key)  # optional: most datasets are one domain
    if verifier is MISSING or verifier is None:
        verifier = default_verifier
    if not isinstance(verifier, str) or not verifier:
        raise ValueError(f"{where}: field '{verifier_key}' (the verifier) must be a non-empty string,"
                         f" got {verifier!r}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f"{where}: field '{answer_key}' (the answer) is {answer}, not a number an answer can be "
                         f"(JSON's NaN / Infinity, or a missing value in a parquet column)")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)  # JSON and parquet hand back integer answers as numbers
    kind = registry.VERIFIERS.get(verifier)
    if isinstance(answer, (dict, list)) and kind and kind.answer_check:
        answer = json.dumps(answer)  # test cases or constraints stored as a nested column
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field '{answer_key}' (the answer) is a {type(answer).__name__}, expected a"
                         f" string or number: {str(answer)[:200]!r}")
    if kind is None:
        raise ValueError(f"{where}: field '{verifier_key}' (the verifier) is {verifier[:100]!r}; known: "
                         f"{', '.join(sorted(registry.VERIFIERS))}")
    if not kind.from_file:  # rg: its answer is the entry the library's scorer reads, and some scorers run answers
        raise ValueError(f"{where}: field '{verifier_key}' (the verifier) is {verifier!r}: {kind.help}")
    for field, text in [(prompt_key, prompt)] if isinstance(prompt, str) else \
            [(f"{prompt_key}[{i}].content", m["content"]) for i, m in enumerate(prompt)]:
        _check_text(text, where, field)
    _check_text(answer, where, answer_key)
    if kind.answer_check:  # a JSON answer (tests, constraints) is checked here, so a bad one names its row
        try:
            registry.function(kind.answer_check)(answer)
        except ValueError as e:
            raise ValueError(f"{where}: field '{answer_key}' (the answer of a {verifier!r} row): {e}") from None
    if kind.answer_given_prompt:  # e.g. code: a test the prompt shows is no test alone
        answer = registry.function(kind.answer_given_prompt)(
            "\n".join(m["content"] for m in prompt) if isinstance(prompt, list) else prompt, answer)
    return {"prompt": prompt, "answer": answer, "verifier": verifier, "where": where}


def _check_text(text: str, where: str, field: str) -> None:
    """A text no tokenizer can encode: a lone surrogate (JSON's "\\ud800" without its pair), or one that tokenizers,
    verifiers and C libraries read differently: a NUL character (JSON's "\\u0000")."""
    if "\x00" in text:
        raise ValueError(f"{where}: field '{field}' holds a NUL character (at character {text.index(chr(0))}), which "
                         f"tokenizers, verifiers and C libraries read differently; fix the row at its source")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: field '{field}' holds a lone surrogate ({text[e.start:e.end]!r} at character "
                         f"{e.start}), which is not text a tokenizer can encode; fix the row at its source") from None


def load_rows(source: str, prompt_key: str = "prompt", answer_key: str = "answer", verifier_key: str = "verifier",
              default_verifier: str = "math", split: str = "train", limit: int | None = None) -> list[dict]:
    """Rows from a .jsonl / .json / .parquet file, a save_to_disk directory, or anything
    datasets.load_dataset takes (a hub name, a local directory of data files). `limit` keeps the first rows."""
    objs = read_objects(source, split, limit)
    if not objs:
        raise ValueError(f"{source}: has no rows; expected {prompt_key!r} and {answer_key!r} per row")
    return [make_row(obj, where, prompt_key, answer_key, verifier_key, default_verifier) for where, obj in objs]


def load_prompts(spec: str, seed: int = 0, held_out: bool = False, n: int | None = None, prompt_key: str = "prompt",
                 answer_key: str = "answer", default_verifier: str = "math", split: str = "") -> list[dict]:
    """The rows of a --data / --eval-data spec: one source or a weighted mixture of them, each of a kind in
    registry.SOURCES (the built-in task, Reasoning Gym, a file or dataset).
    Every row keeps its own verifier. held_out: the evaluation draw (the tiny task's and Reasoning Gym's from
    seeds training never uses, a dataset's `split` or its "test" split), cut to the first `n` rows."""
    keys = dict(prompt_key=prompt_key, answer_key=answer_key, default_verifier=default_verifier, split=split)
    sources = []
    for source, weight in parse_mixture(spec):
        load = registry.function(registry.SOURCES[registry.source_kind(source)].rows)
        sources.append((load(source, seed, held_out, n, **keys), weight))
    rows = sources[0][0] if len(sources) == 1 else mix(sources, seed)
    return rows[:n] if held_out else rows


def tiny_source(source: str, seed: int, held_out: bool, n: int | None, **_) -> list[dict]:
    """"tiny" / "tiny:K": a fixed training draw and a separate held-out draw."""
    terms = tiny_terms(source)
    return tiny.held_out_rows(n or 512, seed, terms) if held_out else tiny.make_rows(100_000, seed, terms)


def rg_source(source: str, seed: int, held_out: bool, n: int | None, **_) -> list[dict]:
    """"rg:NAME[:SIZE]": generated here; the held-out draw from a seed training never uses."""
    return rg_rows(source, seed + 1_000_003 if held_out else seed, size=(n or 1000) if held_out else 1000)


def file_source(source: str, seed: int, held_out: bool, n: int | None, prompt_key: str, answer_key: str,
                default_verifier: str, split: str) -> list[dict]:
    return load_rows(source, prompt_key, answer_key, default_verifier=default_verifier,
                     split=split or ("test" if held_out else "train"))


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as the text two rows are compared by: a string stripped, chat messages as their roles and contents."""
    if isinstance(prompt, str):
        return prompt.strip()
    return json.dumps([[m["role"], m["content"].strip()] for m in prompt])


def without_held_out(rows: list[dict], held_out: list[dict], spec: str, eval_spec: str) -> list[dict]:
    """The training rows whose prompt is none of the held-out rows' (prompt_text): accuracy on prompts training
    saw measures recall, not skill. How many were left out is said; none left is an error."""
    if not held_out:
        return rows
    seen = {prompt_text(r["prompt"]) for r in held_out}
    kept = [r for r in rows if prompt_text(r["prompt"]) not in seen]
    if not kept:
        raise ValueError(f"--data {spec}: every prompt is also in the held-out set (--eval-data {eval_spec}); give "
                         f"held-out prompts training does not use, or --eval-data '' for none")
    if len(kept) < len(rows):
        print(f"--data {spec}: {len(rows) - len(kept)} of {len(rows)} rows have a prompt of the held-out set "
              f"(--eval-data {eval_spec}) and are left out of training", file=sys.stderr, flush=True)
    return kept


def tiny_terms(source: str) -> int | None:
    """K of "tiny:K" (None for "tiny"), checked."""
    if source == "tiny":
        return None
    k = source.split(":", 1)[1]
    if not k.isdigit():
        raise ValueError(f"{source}: expected tiny:K, K the number of terms of every problem (e.g. tiny:12)")
    tiny.check_terms(int(k))
    return int(k)


def check_path(source: str) -> None:
    """FileNotFoundError for a source meant as a local path that is not there: a typo'd path would otherwise reach
    the hub as a dataset name."""
    path = os.path.expanduser(source)
    if (path.endswith(SUFFIXES) or path.startswith(("/", "."))) and not os.path.exists(path):
        raise FileNotFoundError(f"{source}: no such file or directory: {path}")


def read_objects(source: str, split: str = "train", limit: int | None = None) -> list[tuple[str, dict]]:
    """(where, raw object) per row of a source, before any field is looked at."""
    check_path(source)
    path = os.path.expanduser(source)
    if path.endswith(SUFFIXES) and not os.path.isdir(path):
        read = {".jsonl": read_jsonl, ".json": read_json, ".parquet": read_parquet}[os.path.splitext(path)[1]]
        objs = read(path)
    else:
        objs = read_dataset(source, split, limit)
    return objs[:limit] if limit is not None else objs


# A chat template is code from the model's folder (a checkpoint's, which whoever can write --out could plant),
# run by jinja's sandbox, which keeps it from files and attributes but not from looping: nested range() loops
# run for hours. Its rendering is bounded in time (`bounded`: a watchdog thread's asynchronous exception, in any
# thread). Cost: 0.7 us a prompt, 0.07 s over 100k rows (measured; rendering the tiny template and
# tokenizing it take ~35 us), and the watchdog's 10 wake-ups a second.
TEMPLATE_SECONDS = 10.0


def template_file(tokenizer) -> str:
    """Where the tokenizer's chat template came from: the file in its folder, else its name."""
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    found = [os.path.join(where, n) for n in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
             if os.path.isfile(os.path.join(where, n))]
    return found[0] if found else f"the chat template of {where}"


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of the prompt as the model sees it, ending where the response begins. A chat template that
    fails, or runs past TEMPLATE_SECONDS, is an error naming its file."""
    if not tokenizer.chat_template:
        if not isinstance(prompt, str):
            raise ValueError("the tokenizer has no chat template, so chat-message prompts can't be rendered;"
                             " use a chat model's tokenizer, set tokenizer.chat_template, or use string prompts")
        return tokenizer(prompt).input_ids  # a base model: its tokenizer adds BOS if it wants one
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    check_messages(messages, "encode_prompt")
    try:
        text = bounded(lambda: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       TEMPLATE_SECONDS)
    except TimeLimit:
        raise ValueError(f"{template_file(tokenizer)}: its chat template ran over {TEMPLATE_SECONDS:g} s on one "
                         f"prompt (a template that loops); refused") from None
    except Exception as e:  # the template's own error (jinja's, raise_exception's): the file that holds it
        raise ValueError(f"{template_file(tokenizer)}: its chat template failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    # the template already wrote any BOS; letting the tokenizer add its own would double it
    return tokenizer(text, add_special_tokens=False).input_ids


class TimeLimit(Exception):
    pass


_deadlines: dict[int, float] = {}  # thread id -> when its rendering must end
_watch_lock = threading.Lock()
_watchdog: list[threading.Thread] = []


def _watch() -> None:
    while True:
        time.sleep(0.1)
        with _watch_lock:
            for thread, deadline in [*_deadlines.items()]:
                if time.monotonic() > deadline:
                    del _deadlines[thread]
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(TimeLimit))


def bounded(run, seconds: float):
    """run(), stopped with TimeLimit after `seconds` in whatever thread calls it (its Python code, not a C call in
    it): a watchdog thread raises an asynchronous exception there, delivered between bytecodes, so a loop of any
    depth stops (SIGALRM would serve the main thread only, and --overlap draws prompts in the rollout thread)."""
    thread = threading.get_ident()
    with _watch_lock:
        if not _watchdog:
            _watchdog.append(threading.Thread(target=_watch, name="time-limit watchdog", daemon=True))
            _watchdog[0].start()
        _deadlines[thread] = time.monotonic() + seconds
    try:
        return run()
    finally:
        with _watch_lock:
            fired = _deadlines.pop(thread, None) is None
        if fired:  # raised, or still on its way: never to arrive after this call
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)


# ---------------------------------------------------------------------------- Reasoning Gym and mixtures

RG_INSTRUCTION = "\n\nPut your final answer within <answer></answer> tags."  # verifiers.rg_extract reads them


def rg_rows(spec: str, seed: int, size: int = 1000) -> list[dict]:
    """Rows of a Reasoning Gym dataset generated locally: spec "rg:NAME" or "rg:NAME:SIZE". The answer holds
    what the library's scorer needs, as JSON ({"dataset", "answer", "metadata"}) and how its scores count
    ("full_marks", from the dataset's probe: rg_verdict); the verifier is "rg"."""
    _, name, *rest = spec.split(":")
    if len(rest) > 1 or (rest and not rest[0].isdigit()) or not name:
        raise ValueError(f"--data {spec}: expected rg:NAME or rg:NAME:SIZE (SIZE a number of rows)")
    size = int(rest[0]) if rest else size
    full_marks = rg_verdict(name)
    return [{"prompt": question + RG_INSTRUCTION, "answer": json.dumps({**json.loads(answer), "full_marks": full_marks}),
             "verifier": "rg", "where": f"rg:{name}:{i}"} for i, (question, answer) in enumerate(rg_entries(name, seed, size))]


def rg_entries(name: str, seed: int, size: int) -> list[tuple[str, str]]:
    """(question, answer JSON) of `size` rows of Reasoning Gym's dataset `name`, drawn with `seed`."""
    import reasoning_gym
    if name not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"--data rg:{name}: Reasoning Gym has no dataset {name!r}; some: "
                         f"{', '.join(sorted(reasoning_gym.factory.DATASETS)[:20])}, ...")
    out = []
    for i, entry in enumerate(reasoning_gym.create_dataset(name, size=size, seed=seed)):
        try:
            out.append((entry["question"], json.dumps({"dataset": name, "answer": entry["answer"],
                                                       "metadata": entry["metadata"]})))
        except TypeError as e:
            raise ValueError(f"rg:{name}:{i}: the entry can't be stored as JSON for the scorer ({e})") from None
    return out


RG_PROBE_SEED = 20_250_725  # the rows a dataset's probe scores: one draw, whatever a run's seed or split


@functools.cache
def rg_verdict(name: str) -> bool:
    """Whether training rewards dataset `name` with full marks only, from its probe (verifiers.rg_probe): its
    scorer, run as training runs it (the sandbox, the answer kept to a literal or an expression), gives its own
    answers 1.0 and no wrong answer a policy could learn full marks; a dataset that fails either is refused."""
    full_marks, found = verifiers.rg_probe(name, rg_entries(name, RG_PROBE_SEED, verifiers.RG_PROBE_ROWS))
    print(f"rg:{name}: {found}", file=sys.stderr, flush=True)
    return full_marks


def mix(sources: list[tuple[list[dict], float]], seed: int) -> list[dict]:
    """One row list holding the sources in proportion to their weights, as long as all sources together:
    source i gets round(total * w_i / sum(w)) rows, its own rows in a fixed shuffled order, cycled when it is
    upsampled (a downsampled source shows the same subset every epoch). Then the whole list is drawn by
    draw_order like any dataset, so the draw stays stateless given (seed, cursor) and resume stays exact."""
    total, weight_sum = sum(len(rows) for rows, _ in sources), sum(w for _, w in sources)
    mixed = []
    for i, (rows, w) in enumerate(sources):
        order = list(range(len(rows)))
        random.Random(f"{seed}/mix/{i}").shuffle(order)
        n = max(1, round(total * w / weight_sum))
        mixed += [rows[order[k % len(rows)]] for k in range(n)]
    random.Random(f"{seed}/mix").shuffle(mixed)  # interleaved, so that a prefix (an eval set) is a mixture too
    return mixed


@functools.lru_cache(maxsize=2)  # a draw usually spans one or two epochs: shuffle a big dataset once, not per step
def epoch_order(n_rows: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n_rows))
    random.Random(f"{seed}/{epoch}").shuffle(order)  # a str seed: stable across runs, no (seed, epoch) clashes
    return tuple(order)


def draw_order(n_rows: int, seed: int, cursor: int, count: int) -> list[int]:
    """Rows at positions cursor .. cursor+count-1 of an endless stream reshuffled every epoch: a cursor resumes it."""
    assert n_rows > 0 and cursor >= 0 and count >= 0, f"draw_order({n_rows=}, {cursor=}, {count=})"
    return [epoch_order(n_rows, seed, pos // n_rows)[pos % n_rows] for pos in range(cursor, cursor + count)]


def draw_prompts(rows: list[dict], seed: int, cursor: int, n: int, tokenizer, max_prompt_len: int,
                 source: str = "", too_long: set | None = None) -> tuple[list[tuple[list[int], dict]], int, int]:
    """The next n (token ids, row) of the stream from `cursor` on, skipping prompts over `max_prompt_len` tokens;
    `too_long` keeps those rows across calls (a 1 MB prompt is tokenized once). (prompts, new cursor, skipped)"""
    too_long = set() if too_long is None else too_long
    out, skipped = [], 0
    while len(out) < n:
        i = draw_order(len(rows), seed, cursor, 1)[0]
        cursor += 1
        ids = None if i in too_long else encode_prompt(tokenizer, rows[i]["prompt"])
        if ids is None or len(ids) > max_prompt_len:
            too_long.add(i)
            skipped += 1
            if len(too_long) >= len(rows):  # no usable prompt at all: it would loop forever
                raise ValueError(f"--data {source}: every prompt is longer than --max-prompt-len {max_prompt_len} "
                                 f"tokens (e.g. {rows[i].get('where', '')}); raise --max-prompt-len")
            continue
        out.append((ids, rows[i]))
    return out, cursor, skipped
