"""Prompts in, token ids out: loading rows from jsonl / json / parquet files or a Hugging Face dataset (a hub
name, a local `save_to_disk` directory, or a local directory of data files), chat templating, and the order
in which training draws rows.

A row is {"prompt": str | [{"role", "content"}, ...], "answer": str, "verifier": str, "where": "src:row"}.
`where` points back at the source so a bad reward or a crash can be traced to its line: for .jsonl it is the
line number (from 1, as editors show it), for everything else the 0-based index (as `rows[i]`, `ds[i]` and
`pandas.read_parquet(...).iloc[i]` take it). Column names may be dotted paths into nested columns, e.g. the
verl/DAPO parquet layout: `prompt` a list of chat messages, `--answer-key reward_model.ground_truth`.

Bad rows are never skipped silently: a dataset that quietly loses half its rows trains on something other
than the run says. Every error names the source, the row and the field.

(UloRL's data-cleaning CLI, `python data.py clean ...` (section 3.4), will live at the bottom of this file.)
"""
import functools
import json
import os
import random

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
        out.append((f"{path}:{n}", obj))
    return out


def read_json(path: str) -> list[tuple[str, dict]]:
    with open(path, "rb") as f:
        try:
            data = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a valid UTF-8 JSON file ({e}); a .json source must hold one list"
                             f" of row objects (use .jsonl for one object per line)") from None
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


def check_messages(prompt, where: str, field: str = "prompt") -> None:
    ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt)
    if not ok:
        raise ValueError(f"{where}: field '{field}' must be a non-empty string or a non-empty list of"
                         f" {{'role': str, 'content': str}} messages, got {str(prompt)[:200]!r}")


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
        if value in (None, "", []):
            raise ValueError(f"{where}: field '{key}' (the {name}) is empty; fix or drop this row at the source")
        fields[name] = value
    prompt, answer = fields["prompt"], fields["answer"]
    if not isinstance(prompt, str):
        check_messages(prompt, where, prompt_key)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)  # JSON and parquet hand back integer answers as numbers
    if not isinstance(answer, str):
        raise ValueError(f"{where}: field '{answer_key}' (the answer) is a {type(answer).__name__}, expected a"
                         f" string or number: {str(answer)[:200]!r}")
    verifier, _ = lookup(obj, verifier_key)  # optional: most datasets are one domain
    if verifier is MISSING or verifier is None:
        verifier = default_verifier
    if not isinstance(verifier, str) or not verifier:
        raise ValueError(f"{where}: field '{verifier_key}' (the verifier) must be a non-empty string,"
                         f" got {verifier!r}")
    return {"prompt": prompt, "answer": answer, "verifier": verifier, "where": where}


def load_rows(source: str, prompt_key: str = "prompt", answer_key: str = "answer", verifier_key: str = "verifier",
              default_verifier: str = "math", split: str = "train", limit: int | None = None) -> list[dict]:
    """Rows from a .jsonl / .json / .parquet file, a save_to_disk directory, or anything
    datasets.load_dataset takes (a hub name, a local directory of data files). `limit` keeps the first rows."""
    path = os.path.expanduser(source)
    if path.endswith(SUFFIXES) or path.startswith(("/", ".")):
        if not os.path.exists(path):  # a typo'd path would otherwise reach the hub as a dataset name
            raise FileNotFoundError(f"no such file or directory: {path}")
    if path.endswith(SUFFIXES) and not os.path.isdir(path):
        read = {".jsonl": read_jsonl, ".json": read_json, ".parquet": read_parquet}[os.path.splitext(path)[1]]
        objs = read(path)
    else:
        objs = read_dataset(source, split, limit)
    objs = objs[:limit] if limit is not None else objs
    if not objs:
        raise ValueError(f"{source}: has no rows; expected {prompt_key!r} and {answer_key!r} per row")
    return [make_row(obj, where, prompt_key, answer_key, verifier_key, default_verifier) for where, obj in objs]


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
