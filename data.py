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

UloRL's data cleaning (section 3.4) is the CLI at the bottom of this file:

    python data.py clean IN.jsonl OUT.jsonl [--model M --k 8 ...]      # writes OUT.jsonl and OUT.report.json
"""
import functools
import json
import math
import os
import random
import re

import reward
import sandbox
import tiny

SUFFIXES = (".jsonl", ".json", ".parquet")
MISSING = object()  # a dotted key that isn't there (a stored None is a value, and an error of its own)


def read_jsonl(path: str) -> list[tuple[str, dict]]:
    """(where, object) per non-blank line. Bytes are decoded line by line so a bad byte names its line."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    out = []
    for n, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: line {n} is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r});"
                             f" re-encode the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: line {n} is not valid JSON ({e.msg} at column {e.colno});"
                             f" each line must hold one JSON object") from None
        except RecursionError:
            raise ValueError(f"{path}:{n}: line {n} is JSON nested too deeply to read") from None
        out.append((f"{path}:{n}", obj))
    return out


def read_json(path: str) -> list[tuple[str, dict]]:
    with open(path, "rb") as f:
        try:
            data = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a valid UTF-8 JSON file ({e}); a .json source must hold one list"
                             f" of row objects (use .jsonl for one object per line)") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply to read") from None
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
    if isinstance(answer, (dict, list)) and verifier in JSON_ANSWERS:
        answer = json.dumps(answer)  # test cases or constraints stored as a nested column
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field '{answer_key}' (the answer) is a {type(answer).__name__}, expected a"
                         f" string or number: {str(answer)[:200]!r}")
    if verifier in JSON_ANSWERS:
        try:
            JSON_ANSWERS[verifier](answer)
        except ValueError as e:
            raise ValueError(f"{where}: field '{answer_key}' (the answer of a {verifier!r} row): {e}") from None
    return {"prompt": prompt, "answer": answer, "verifier": verifier, "where": where}


def _check_ifeval_answer(answer: str) -> None:
    reward.ifeval_reward("", answer)  # raises ValueError on a malformed list or an unknown constraint type


# Verifiers whose answer is JSON: checked when the row is loaded, so a bad one names its row before training.
JSON_ANSWERS = {"code": sandbox.parse_tests, "ifeval": _check_ifeval_answer}


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
    """The rows of a --data / --eval-data spec: "tiny" (the built-in task), "rg:NAME[:SIZE]" (Reasoning Gym,
    generated here), a file or dataset (load_rows), or a weighted mixture of those ("a.jsonl@0.7,rg:x@0.3").
    Every row keeps its own verifier. held_out: the evaluation draw (the tiny task's and Reasoning Gym's from
    seeds training never uses, a dataset's `split` or its "test" split), cut to the first `n` rows."""
    sources = []
    for source, weight in parse_mixture(spec):
        if source == "tiny":  # a fixed training draw and a separate held-out draw
            rows = tiny.held_out_rows(n or 512, seed) if held_out else tiny.make_rows(100_000, seed)
        elif source.startswith("rg:"):
            rows = rg_rows(source, seed + 1_000_003 if held_out else seed, size=(n or 1000) if held_out else 1000)
        else:
            rows = load_rows(source, prompt_key, answer_key, default_verifier=default_verifier,
                             split=split or ("test" if held_out else "train"))
        sources.append((rows, weight))
    rows = sources[0][0] if len(sources) == 1 else mix(sources, seed)
    return rows[:n] if held_out else rows


def read_objects(source: str, split: str = "train", limit: int | None = None) -> list[tuple[str, dict]]:
    """(where, raw object) per row of a source, before any field is looked at."""
    path = os.path.expanduser(source)
    if path.endswith(SUFFIXES) or path.startswith(("/", ".")):
        if not os.path.exists(path):  # a typo'd path would otherwise reach the hub as a dataset name
            raise FileNotFoundError(f"no such file or directory: {path}")
    if path.endswith(SUFFIXES) and not os.path.isdir(path):
        read = {".jsonl": read_jsonl, ".json": read_json, ".parquet": read_parquet}[os.path.splitext(path)[1]]
        objs = read(path)
    else:
        objs = read_dataset(source, split, limit)
    return objs[:limit] if limit is not None else objs


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of the prompt as the model sees it, ending where the response begins."""
    if not tokenizer.chat_template:
        if not isinstance(prompt, str):
            raise ValueError("the tokenizer has no chat template, so chat-message prompts can't be rendered;"
                             " use a chat model's tokenizer, set tokenizer.chat_template, or use string prompts")
        return tokenizer(prompt).input_ids  # a base model: its tokenizer adds BOS if it wants one
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    check_messages(messages, "encode_prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the template already wrote any BOS; letting the tokenizer add its own would double it
    return tokenizer(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------------------- Reasoning Gym and mixtures

RG_INSTRUCTION = "\n\nPut your final answer within <answer></answer> tags."  # reward.rg_extract reads them


def rg_rows(spec: str, seed: int, size: int = 1000) -> list[dict]:
    """Rows of a Reasoning Gym dataset generated locally: spec "rg:NAME" or "rg:NAME:SIZE". The answer holds
    what the library's scorer needs, as JSON ({"dataset", "answer", "metadata"}); the verifier is "rg"."""
    import reasoning_gym
    _, name, *rest = spec.split(":")
    if len(rest) > 1 or (rest and not rest[0].isdigit()) or not name:
        raise ValueError(f"--data {spec}: expected rg:NAME or rg:NAME:SIZE (SIZE a number of rows)")
    size = int(rest[0]) if rest else size
    if name not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"--data {spec}: Reasoning Gym has no dataset {name!r}; some: "
                         f"{', '.join(sorted(reasoning_gym.factory.DATASETS)[:20])}, ...")
    rows = []
    for i, entry in enumerate(reasoning_gym.create_dataset(name, size=size, seed=seed)):
        try:
            answer = json.dumps({"dataset": name, "answer": entry["answer"], "metadata": entry["metadata"]})
        except TypeError as e:
            raise ValueError(f"rg:{name}:{i}: the entry can't be stored as JSON for the scorer ({e})") from None
        rows.append({"prompt": entry["question"] + RG_INSTRUCTION, "answer": answer, "verifier": "rg",
                     "where": f"rg:{name}:{i}"})
    # the scorer gets the entry back from JSON (tuples become lists) and runs in the sandbox under a guard that
    # keeps the answer a literal or an expression: make sure that still scores the gold answer
    if json.loads(rows[0]["answer"])["answer"] is not None and (why := reward.rg_unsupported(rows[0]["answer"])):
        raise ValueError(f"rg:{name}: this dataset is not supported: the library's scorer, run as training runs "
                         f"it (in the sandbox, the answer kept to a literal or an expression), does not give its "
                         f"own answer 1.0 ({why})")
    return rows


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
    """Row indices for draw positions cursor .. cursor+count-1 of an endless stream, reshuffled every epoch
    (epoch = position // n_rows). Stateless, so a checkpoint only stores the cursor to resume the same order."""
    assert n_rows > 0 and cursor >= 0 and count >= 0, f"draw_order({n_rows=}, {cursor=}, {count=})"
    return [epoch_order(n_rows, seed, pos // n_rows)[pos % n_rows] for pos in range(cursor, cursor + count)]


def draw_prompts(rows: list[dict], seed: int, cursor: int, n: int, tokenizer, max_prompt_len: int,
                 source: str = "", too_long: set | None = None) -> tuple[list[tuple[list[int], dict]], int, int]:
    """The next n prompts of the endless shuffled stream (draw_order) from position `cursor` on, as (token
    ids, row); prompts over `max_prompt_len` tokens are skipped. `too_long` remembers the rows found too long
    (pass the same set every time), so each is tokenized once, not at every draw: a 1 MB prompt would
    otherwise cost a tokenization per epoch. Returns (prompts, new cursor, skipped)."""
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


# ---------------------------------------------------------------------------- data cleaning (UloRL 3.4)

# Sub-question markers, in order: "(a) ... (b)", "(1) ... (2)", "(i) ... (ii)", "(I) ... (II)", "Part 1 ... Part 2".
# A marker must not follow a word or ')', so that f(a) + f(b) is not a pair of sub-questions.
_SUBPARTS = [re.compile(rf"(?<![\w)])(\({a}\)).*?(?<![\w)])(\({b}\))")
             for a, b in (("a", "b"), ("1", "2"), ("i", "ii"), ("I", "II"))]
_SUBPARTS.append(re.compile(r"(?i)\b(part\s*\(?(?:1|a|i)\)?)\W.*?\b(part\s*\(?(?:2|b|ii)\)?)\W"))
_MATRIX = re.compile(r"\\begin\{[pbvBV]?matrix\}|\\begin\{array\}")


def prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def multi_question(prompt) -> str | None:
    """Why a problem looks like several sub-questions (the marker pair found), or None. A heuristic: it
    misses sub-questions without markers ("Find x. Then find y.")."""
    text = prompt_text(prompt).replace("\n", " ")
    for pattern in _SUBPARTS:
        m = pattern.search(text)
        if m:
            return f"sub-question markers {m.group(1)!r} ... {m.group(2)!r}"
    return None


def long_answer(answer: str, max_chars: int) -> str | None:
    """Why a reference answer is too long to check reliably (UloRL drops matrices), or None."""
    if _MATRIX.search(answer):
        return "matrix or array answer"
    if len(answer) > max_chars:
        return f"answer of {len(answer)} characters > {max_chars}"
    return None


def generate(model_name: str, rows: list[dict], n: int, args) -> list[list[str]]:
    """n responses per row from `model_name` through the rollout engine (greedy when args.temperature == 0)."""
    import model as model_lib
    from engine import Sampling, make_engine
    policy, tokenizer = model_lib.load(model_name, args.dtype, args.device)
    engine = make_engine(args.engine, policy.eval(), tokenizer, args.seed, path=model_name,
                         max_model_len=args.max_prompt_len + args.max_tokens, device=args.device, dtype=args.dtype)
    sampling = Sampling(temperature=1.0, top_k=1) if args.temperature == 0 else Sampling(temperature=args.temperature)
    prompts = [encode_prompt(tokenizer, r["prompt"])[-args.max_prompt_len:] for r in rows]
    texts = []
    for lo in range(0, len(rows), args.batch):
        chunk = [p for p in prompts[lo:lo + args.batch] for _ in range(n)]
        gens = engine.generate(chunk, [args.max_tokens] * len(chunk), sampling)
        texts += tokenizer.batch_decode([g.tokens for g in gens], skip_special_tokens=True)
    return [texts[i * n:(i + 1) * n] for i in range(len(rows))]


def clean(args) -> dict:
    """UloRL's data cleaning (section 3.4): write the kept rows (as they were read) to args.out and a report
    of every dropped row and why to args.report. Filters, cheap ones first:
    multi_question (several sub-questions), long_answer (over --max-answer-chars, or a matrix),
    solved_k_of_k (--model solves it in all --k samples: no learning signal), majority_disagrees
    (--majority-models: at least --majority-min of them give the same final answer, and it is wrong)."""
    objs = read_objects(args.input)
    rows = [make_row(obj, where, args.prompt_key, args.answer_key, args.verifier_key, args.default_verifier)
            for where, obj in objs]
    dropped: dict[int, dict] = {}

    def drop(i: int, reason: str, detail: str) -> None:
        dropped[i] = {"where": rows[i]["where"], "reason": reason, "detail": detail}

    for i, row in enumerate(rows):
        why = multi_question(row["prompt"])
        if why:
            drop(i, "multi_question", why)
        elif why := long_answer(row["answer"], args.max_answer_chars):
            drop(i, "long_answer", why)
    if args.model:
        todo = [i for i in range(len(rows)) if i not in dropped]
        samples = generate(args.model, [rows[i] for i in todo], args.k, args)
        items = [(rows[i]["verifier"], text, rows[i]["answer"]) for i, texts in zip(todo, samples) for text in texts]
        scores, _ = reward.score_batch(items, timeout=args.reward_timeout)
        for j, i in enumerate(todo):
            if all(s == 1.0 for s in scores[j * args.k:(j + 1) * args.k]):
                drop(i, "solved_k_of_k", f"{args.model} solved it in {args.k} of {args.k} samples")
    if args.majority_models:
        models = [m for m in args.majority_models.split(",") if m]
        todo = [i for i in range(len(rows))
                if i not in dropped and rows[i]["verifier"] in ("tiny", "math", "math_boxed")]
        answers = []  # [model][row]: each model's final answer, one sample each
        for m in models:
            texts = generate(m, [rows[i] for i in todo], 1, args)
            answers.append([reward.final_answer(rows[i]["verifier"], t[0]) for i, t in zip(todo, texts)])
        for j, i in enumerate(todo):
            votes = [a[j] for a in answers if a[j]]
            top = max(set(votes), key=votes.count) if votes else None
            if top is None or votes.count(top) < args.majority_min:
                continue
            items = [(rows[i]["verifier"], r"\boxed{" + top + "}" if rows[i]["verifier"] != "tiny" else ":" + top,
                      rows[i]["answer"])]
            if reward.score_batch(items, timeout=args.reward_timeout)[0][0] == 0.0:
                drop(i, "majority_disagrees", f"{votes.count(top)} of {len(models)} models answer {top!r}, "
                                              f"the reference is {rows[i]['answer']!r}")
    with open(args.out, "w") as f:
        for i, (where, obj) in enumerate(objs):
            if i not in dropped:
                f.write(json.dumps(obj, default=str) + "\n")
    counts = {}
    for d in dropped.values():
        counts[d["reason"]] = counts.get(d["reason"], 0) + 1
    report = {"input": args.input, "output": args.out, "rows": len(rows), "kept": len(rows) - len(dropped),
              "dropped": counts, "dropped_rows": [dropped[i] for i in sorted(dropped)], "args": vars(args)}
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"{args.input}: {len(rows)} rows, kept {report['kept']}, dropped {len(dropped)}: "
          + (", ".join(f"{k} {v}" for k, v in counts.items()) or "none") + f"; report: {args.report}")
    return report


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("clean", help="UloRL 3.4 data cleaning: filter a dataset, write the kept rows and a report")
    c.add_argument("input", help="dataset to clean (any source load_rows takes)")
    c.add_argument("out", help="where the kept rows go (.jsonl, the rows as they were read)")
    c.add_argument("--report", default="", help="JSON report of dropped rows (default: OUT with .report.json)")
    c.add_argument("--prompt-key", default="prompt", help="column holding the prompt")
    c.add_argument("--answer-key", default="answer", help="column holding the reference answer")
    c.add_argument("--verifier-key", default="verifier", help="column holding the verifier name")
    c.add_argument("--default-verifier", default="math", help="verifier of rows without one")
    c.add_argument("--max-answer-chars", type=int, default=64, help="drop longer reference answers (UloRL: short "
                                                                      "answers only; matrices are always dropped)")
    c.add_argument("--model", default="", help="drop problems this model solves in all --k samples ('' = skip)")
    c.add_argument("--k", type=int, default=8, help="samples per problem for --model (UloRL 8)")
    c.add_argument("--majority-models", default="", help="comma-separated models; drop rows whose reference "
                                                         "disagrees with their majority answer ('' = skip)")
    c.add_argument("--majority-min", type=int, default=2, help="models that must agree on one wrong answer")
    c.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    c.add_argument("--max-tokens", type=int, default=4096, help="response tokens per sample")
    c.add_argument("--max-prompt-len", type=int, default=2048, help="prompt tokens kept (the end of longer ones)")
    c.add_argument("--batch", type=int, default=64, help="prompts per engine call")
    c.add_argument("--engine", default="auto", help="rollout engine: hf, vllm or auto")
    c.add_argument("--device", default="cpu", help="torch device for the models")
    c.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    c.add_argument("--reward-timeout", type=float, default=5.0, help="seconds per reward check")
    c.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = p.parse_args(argv)
    args.report = args.report or os.path.splitext(args.out)[0] + ".report.json"
    clean(args)


if __name__ == "__main__":
    main()
