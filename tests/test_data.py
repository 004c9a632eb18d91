"""data.py: loading rows from every source it takes (all offline, from files written here), the errors bad
input raises (each naming the source, row and field), chat templating, and the training draw order.

    python -m pytest tests/test_data.py
"""
import json
import os
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import processors

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import clean  # noqa: E402
import data  # noqa: E402
import tiny  # noqa: E402

ROWS = tiny.make_rows(6, seed=0)  # {"prompt": "3+4=", "answer": "7", "verifier": "tiny"}
EXPECT = [{k: r[k] for k in ("prompt", "answer", "verifier")} for r in ROWS]


def strip_where(rows):
    return [{k: r[k] for k in ("prompt", "answer", "verifier")} for r in rows]


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def verl_table():
    """The verl/DAPO parquet layout: chat-message prompt, the answer nested under reward_model."""
    return pa.Table.from_pylist([
        {"data_source": "dapo", "prompt": [{"role": "user", "content": r["prompt"]}],
         "reward_model": {"style": "rule", "ground_truth": int(r["answer"])}} for r in ROWS])


# ---- round trips

def test_jsonl_round_trip_with_line_numbers(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    path.write_text("\n".join(lines[:2] + ["", "   "] + lines[2:]) + "\n")  # blank lines 3 and 4 are skipped
    rows = data.load_rows(str(path))
    assert strip_where(rows) == EXPECT
    assert [r["where"] for r in rows] == [f"{path}:{n}" for n in (1, 2, 5, 6, 7, 8)]


def test_json_round_trip(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    rows = data.load_rows(str(path))
    assert strip_where(rows) == EXPECT
    assert rows[3]["where"] == f"{path}:3"


def test_parquet_verl_layout_with_dotted_keys(tmp_path):
    path = str(tmp_path / "train.parquet")
    pq.write_table(verl_table(), path)
    rows = data.load_rows(path, answer_key="reward_model.ground_truth")
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": r["prompt"]}] for r in ROWS]
    assert [r["answer"] for r in rows] == [r["answer"] for r in ROWS]  # ints came back as strings
    assert {r["verifier"] for r in rows} == {"math"}
    with pytest.raises(ValueError, match=r"train\.parquet:0: field 'data_source' \(the verifier\) is 'dapo'; known"):
        data.load_rows(path, answer_key="reward_model.ground_truth", verifier_key="data_source")
    assert rows[-1]["where"] == f"{path}:5"


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": ds.select(range(2)), "test": ds}).save_to_disk(str(tmp_path / "dict"))
    assert strip_where(data.load_rows(str(tmp_path / "one"))) == EXPECT
    assert strip_where(data.load_rows(str(tmp_path / "dict"))) == EXPECT[:2]  # split defaults to train
    rows = data.load_rows(str(tmp_path / "dict"), split="test", limit=4)
    assert strip_where(rows) == EXPECT[:4]
    assert rows[1]["where"] == f"{tmp_path / 'dict'}[test]:1"
    with pytest.raises(ValueError, match=r"has splits \['train', 'test'\], not 'valid'"):
        data.load_rows(str(tmp_path / "dict"), split="valid")


def test_local_data_directory_via_load_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    pq.write_table(verl_table(), str(tmp_path / "d" / "train.parquet"))
    rows = data.load_rows(str(tmp_path / "d"), answer_key="reward_model.ground_truth")
    assert [r["answer"] for r in rows] == [r["answer"] for r in ROWS]
    assert rows[0]["prompt"] == [{"role": "user", "content": ROWS[0]["prompt"]}]
    assert rows[0]["verifier"] == "math" and rows[0]["where"] == f"{tmp_path / 'd'}[train]:0"


def test_verifier_column_default_and_limit(tmp_path):
    objs = [{"q": "1+1=", "a": 2, "v": "tiny"}, {"q": "2+2=", "a": 4.5}, {"q": "3+3=", "a": "6", "v": None}]
    path = write_jsonl(tmp_path / "v.jsonl", objs)
    rows = data.load_rows(path, prompt_key="q", answer_key="a", verifier_key="v", default_verifier="math_boxed")
    assert [(r["answer"], r["verifier"]) for r in rows] == [("2", "tiny"), ("4.5", "math_boxed"), ("6", "math_boxed")]
    assert len(data.load_rows(path, prompt_key="q", answer_key="a", limit=2)) == 2


# ---- errors: each names the source, the row and the field

def test_missing_field_names_row_field_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [ROWS[0], {"question": "1+1=", "answer": "2"}])
    with pytest.raises(ValueError) as e:
        data.load_rows(path)
    msg = str(e.value)
    assert f"{path}:2" in msg and "'prompt'" in msg and "['answer', 'question']" in msg and "--prompt-key" in msg
    pq.write_table(verl_table(), str(tmp_path / "v.parquet"))
    with pytest.raises(ValueError, match=r"v\.parquet:0: no field 'reward_model\.answer' .*'reward_model' has keys"
                                         r" \['ground_truth', 'style'\]"):
        data.load_rows(str(tmp_path / "v.parquet"), answer_key="reward_model.answer")


@pytest.mark.parametrize("bad, field", [
    ({"prompt": None, "answer": "1"}, "prompt"), ({"prompt": "", "answer": "1"}, "prompt"),
    ({"prompt": [], "answer": "1"}, "prompt"), ({"prompt": "1=", "answer": None}, "answer"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "prompt"), ({"prompt": ["1+1="], "answer": "1"}, "prompt"),
    ({"prompt": "1=", "answer": [1, 2]}, "answer"), ({"prompt": "1=", "answer": "1", "verifier": 3}, "verifier"),
    ({"prompt": "1=", "answer": float("nan")}, "answer"), ({"prompt": "1=", "answer": float("inf")}, "answer"),
    # a verifier that is not one stopped the run at its first score, naming no row
    ({"prompt": "1=", "answer": "1", "verifier": "__class__"}, "verifier"),
    # rg rows are generated here: a file's rg answer reached the scorer server's warm-up, which ran it unguarded
    ({"prompt": "1=", "answer": '{"dataset": "n_queens", "answer": "1", "metadata": {}}', "verifier": "rg"},
     "verifier"),
    # a lone surrogate loaded, then crashed the first draw's tokenizer with a traceback
    ({"prompt": "1+\ud800=", "answer": "1"}, "prompt"), ({"prompt": "1=", "answer": "\udfff"}, "answer"),
    ({"prompt": [{"role": "user", "content": "\ud800"}], "answer": "1"}, "prompt\\[0\\].content"),
])
def test_bad_values_name_row_and_field(tmp_path, bad, field):
    path = write_jsonl(tmp_path / "b.jsonl", ROWS[:2] + [bad])
    with pytest.raises(ValueError, match=rf"b\.jsonl:3: .*field '{field}'"):
        data.load_rows(path)


def test_invalid_json_and_utf8_lines_name_their_line(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "1+1=", "answer": \n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: line 3 is not valid JSON")):
        data.load_rows(str(path))
    path.write_text(json.dumps(ROWS[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")  # a RecursionError before
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: line 2 is JSON nested too deeply to read")):
        data.load_rows(str(path))
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"prompt": "1\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: line 2 is not valid UTF-8")):
        data.load_rows(str(path))


LINE = json.dumps(ROWS[0])


@pytest.mark.parametrize("line, refused", [
    ('{"prompt": "1+1=", "answer": "2", "answer": "3"}', "holds the key 'answer' twice in one object"),
    ('{"prompt": "1+1=", "answer": "2", "n": ' + "9" * 5000 + "}", "holds a number of 5,000 characters"),
    ('{"prompt": "1+1=", "answer": "2", "x": 1.' + "5" * 500 + "}", "holds a number of 502 characters"),
    ('{"prompt": "1+1=\x00", "answer": "2"}', "holds a NUL byte at character 16"),
    ('{"prompt": "1+1=", "answer": "2\\u0000"}', "field 'answer' holds a NUL character (at character 1)"),
    ('{"prompt": [{"role": "user", "content": "\\u00001+1="}], "answer": "2"}',
     "field 'prompt[0].content' holds a NUL character"),
    ('{"prompt": "1+1=", "answer": ' + "[" * 50_000 + "]" * 50_000 + "}", "is JSON nested too deeply to read"),
], ids=["key twice", "5000 digits", "long float", "NUL byte", "NUL answer", "NUL message", "deep"])
def test_rows_json_would_take_silently_or_choke_on_are_refused_by_line(tmp_path, line, refused):
    """A key twice (json.loads keeps the last), a number Python will not convert or turns into inf, a NUL byte or
    character, nesting past Python's limit: each is refused naming file and line, in .jsonl and .json alike; a
    number of MAX_NUMBER_CHARS characters still loads."""
    path = tmp_path / "r.jsonl"
    path.write_text(LINE + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(refused)):
        data.load_rows(str(path))
    whole = tmp_path / "r.json"
    whole.write_text("[" + LINE + ", " + line + "]")
    refused = refused.split(" at character")[0] if "NUL byte" in refused else refused  # another offset there
    with pytest.raises(ValueError, match=re.escape(f"{whole}") + ".*" + re.escape(refused)):
        data.load_rows(str(whole))
    path.write_text(LINE + "\n" + LINE[:-1] + ', "n": ' + "9" * data.MAX_NUMBER_CHARS + "}\n")
    assert len(data.load_rows(str(path))) == 2


def test_a_line_over_the_limit_is_refused_without_being_read_whole(tmp_path, monkeypatch):
    """A 1 MiB limit and a 40 MiB line: refused naming its line, with at most ~one limit's worth held at once
    (reading the file whole, as a loader might, holds all 40)."""
    import tracemalloc
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 1 << 20)
    path = tmp_path / "long.jsonl"
    with open(path, "w") as f:
        f.write(LINE + "\n" + '{"prompt": "' + "1+" * (20 << 20) + '1=", "answer": "2"}\n' + LINE + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=re.escape(f"{path}:2: line 2 is longer than 1 MiB")):
            data.load_rows(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, peak
    path.write_text(LINE + "\n" + LINE[:-1] + ', "pad": "' + "x" * ((1 << 20) - len(LINE) - 20) + '"}\n')
    assert os.path.getsize(path) - len(LINE) - 1 <= 1 << 20 and len(data.load_rows(str(path))) == 2


def test_empty_sources_and_missing_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    (tmp_path / "e.json").write_text("[]")
    for name in ("e.jsonl", "e.json"):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: has no rows")):
            data.load_rows(str(tmp_path / name))
    (tmp_path / "d.json").write_text('{"prompt": "1=", "answer": "1"}')
    with pytest.raises(ValueError, match="expected a list of row objects"):
        data.load_rows(str(tmp_path / "d.json"))
    for name in ("nope.jsonl", "nope.parquet", "nope_dir"):
        with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / name))):
            data.load_rows(str(tmp_path / name))


# ---- chat templating

@pytest.fixture
def role_tokenizer():
    """The tiny tokenizer plus role tokens, a template with roles, and a BOS its post-processor adds (the
    double-BOS pitfall: the template writes one, so tokenizing the rendered text must not add another)."""
    tok = tiny.make_tokenizer()
    tok.add_tokens(["<bos>", "<|user|>", "<|system|>", "<|assistant|>"], special_tokens=True)
    tok.bos_token = "<bos>"
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def test_tiny_k_gives_every_problem_k_terms_and_leaves_the_default_draw_alone():
    """tiny:K: the built-in task with every problem K terms long (the longest responses of the default's tail),
    its own training and held-out draws; plain "tiny" draws exactly the rows it always drew."""
    for k in (2, 7, 12):
        rows = data.load_prompts(f"tiny:{k}", seed=3)
        held_out = data.load_prompts(f"tiny:{k}", seed=3, held_out=True, n=50)
        for r in rows[:200] + held_out:
            terms = [int(t) for t in r["prompt"].rstrip("=").split("+")]
            assert len(terms) == k and all(1 <= t <= 9 for t in terms) and r["answer"] == str(sum(terms))
        assert len(held_out) == 50 and held_out != rows[:50]  # a draw of its own
    default = data.load_prompts("tiny", seed=3)
    assert default == tiny.make_rows(100_000, 3) and len({r["prompt"].count("+") for r in default[:500]}) > 5
    with pytest.raises(ValueError, match="tiny:1: the number of terms must be 2-12"):
        tiny.make_rows(10, seed=0, terms=1)


def test_encode_prompt_tiny_is_the_bare_prompt():
    tok = tiny.make_tokenizer()
    for r in ROWS:
        assert data.encode_prompt(tok, r["prompt"]) == tok(r["prompt"]).input_ids
    assert data.encode_prompt(tok, [{"role": "user", "content": "3+4="}]) == tok("3+4=").input_ids


def test_encode_prompt_role_template(role_tokenizer):
    tok = role_tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<bos>", "<|user|>", "<|system|>", "<|assistant|>")}
    chars = tok("3+4=", add_special_tokens=False).input_ids
    assert chars == [tok.convert_tokens_to_ids(c) for c in "3+4="]
    assert data.encode_prompt(tok, "3+4=") == [ids["<bos>"], ids["<|user|>"], *chars, ids["<|assistant|>"]]
    messages = [{"role": "system", "content": "9"}, {"role": "user", "content": "3+4="}]
    text = "<bos><|system|>9<|user|>3+4=<|assistant|>"  # rendered by hand
    assert data.encode_prompt(tok, messages) == tok(text, add_special_tokens=False).input_ids
    assert data.encode_prompt(tok, messages).count(ids["<bos>"]) == 1


def test_encode_prompt_without_template(role_tokenizer):
    tok = role_tokenizer
    tok.chat_template = None
    assert data.encode_prompt(tok, "3+4=") == [tok.bos_token_id] + tok("3+4=", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="no chat template"):
        data.encode_prompt(tok, [{"role": "user", "content": "3+4="}])


# ---- draw order

def test_draw_order_permutes_each_epoch_and_resumes():
    n, seed = 7, 3
    stream = data.draw_order(n, seed, 0, 5 * n + 3)
    for e in range(5):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    assert len({tuple(stream[e * n:(e + 1) * n]) for e in range(5)}) > 1  # reshuffled, not repeated
    assert data.draw_order(n, seed, 0, 10) + data.draw_order(n, seed, 10, 5) == stream[:15]
    assert data.draw_order(n, seed, 12, 20) == stream[12:32]  # a resume that starts mid-epoch
    assert data.draw_order(n, seed, 0, 0) == []
    data.epoch_order.cache_clear()  # deterministic from its arguments alone, not from the cache
    assert data.draw_order(n, seed, 0, 5 * n + 3) == stream


def test_draw_order_seeds_differ_and_edge_cases():
    assert data.draw_order(50, 0, 0, 50) != data.draw_order(50, 1, 0, 50)
    assert data.draw_order(1, 0, 5, 3) == [0, 0, 0]
    with pytest.raises(AssertionError):
        data.draw_order(0, 0, 0, 1)


# ---- Reasoning Gym rows and weighted mixtures

@pytest.mark.slow
def test_rg_rows_are_generated_locally_and_score_their_own_answers():
    import verifiers
    rows = data.rg_rows("rg:chain_sum:5", seed=0)
    assert len(rows) == 5 and data.rg_rows("rg:chain_sum:5", seed=0) == rows  # deterministic in the seed
    assert data.rg_rows("rg:chain_sum:5", seed=1) != rows
    assert [r["where"] for r in rows] == [f"rg:chain_sum:{i}" for i in range(5)]
    for r in rows:
        entry = json.loads(r["answer"])
        assert r["verifier"] == "rg" and entry["dataset"] == "chain_sum"
        assert r["prompt"].endswith(data.RG_INSTRUCTION)
        assert verifiers.rg_reward(f"<answer>{entry['answer']}</answer>", r["answer"]) == 1.0
        assert verifiers.rg_reward(f"<answer>{int(entry['answer']) + 1}</answer>", r["answer"]) == 0.0
    assert len(data.rg_rows("rg:chain_sum", seed=0, size=7)) == 7


@pytest.mark.slow
def test_a_dataset_whose_scorer_fails_its_own_answer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"rg:arc_agi: this dataset is not supported.*own answer 0\.05, not 1\.0"):
        data.rg_rows("rg:arc_agi:2", seed=0)


def test_rg_rows_bad_specs():
    with pytest.raises(ValueError, match="no dataset 'chain_summ'"):
        data.rg_rows("rg:chain_summ", seed=0)
    with pytest.raises(ValueError, match="rg:NAME:SIZE"):
        data.rg_rows("rg:chain_sum:many", seed=0)


def test_parse_mixture():
    assert data.parse_mixture("a.jsonl") == [("a.jsonl", 1.0)]
    assert data.parse_mixture("a.jsonl@0.7, rg:chain_sum:50@0.3") == [("a.jsonl", 0.7), ("rg:chain_sum:50", 0.3)]
    for bad in ("a.jsonl@0", "a.jsonl@-1", "a.jsonl@x", "@0.5", "a.jsonl,,b"):
        with pytest.raises(ValueError, match="SOURCE@WEIGHT"):
            data.parse_mixture(bad)


def test_mix_follows_the_weights_and_keeps_verifiers():
    math_rows = [{"prompt": f"m{i}", "answer": "1", "verifier": "math"} for i in range(30)]
    rg = [{"prompt": f"r{i}", "answer": "{}", "verifier": "rg"} for i in range(10)]
    mixed = data.mix([(math_rows, 0.25), (rg, 0.75)], seed=0)
    # 40 rows in all: 10 math (a subset, each once) and 30 puzzles (each of the 10 three times)
    assert len(mixed) == 40
    assert sum(r["verifier"] == "math" for r in mixed) == 10
    assert len({r["prompt"] for r in mixed if r["verifier"] == "math"}) == 10
    assert sorted(r["prompt"] for r in mixed if r["verifier"] == "rg") == sorted([f"r{i}" for i in range(10)] * 3)
    assert {r["verifier"] for r in mixed[:8]} == {"math", "rg"}  # interleaved: an eval prefix is a mixture
    assert data.mix([(math_rows, 0.25), (rg, 0.75)], seed=0) == mixed  # deterministic, so resume is exact
    assert data.mix([(math_rows, 0.25), (rg, 0.75)], seed=1) != mixed
    # the stream over the mixture: a resumed draw continues the same sequence
    stream = [mixed[i]["prompt"] for i in data.draw_order(len(mixed), 0, 0, 100)]
    assert [mixed[i]["prompt"] for i in data.draw_order(len(mixed), 0, 60, 40)] == stream[60:]


# ---- data cleaning (UloRL 3.4)

@pytest.mark.parametrize("prompt, flagged", [
    ("Find x. (a) x+1=2 (b) x-1=0", True),
    ("(1) compute a;\n(2) compute b", True),
    ("Part 1: do x. Part 2: do y", True),
    ([{"role": "user", "content": "(i) Show f is odd.\n(ii) Find f(0)."}], True),
    ("What is (1)?", False),
    ("Compute f(a)+f(b) for a=1, b=2.", False),
    ("g(1) and g(2)", False),
    ("3+4=", False),
])
def test_multi_question(prompt, flagged):
    assert (clean.multi_question(prompt) is not None) is flagged


def test_long_answer():
    assert clean.long_answer(r"\begin{pmatrix}1 & 0\end{pmatrix}", 64) == "matrix or array answer"
    assert clean.long_answer("x" * 65, 64) == "answer of 65 characters > 64"
    assert clean.long_answer("x" * 64, 64) is None


@pytest.mark.slow
def test_clean_cli_with_the_tiny_model(tmp_path, capsys):
    """The real CLI on the tiny model: problems it always solves go, wrong references that the models'
    majority contradicts go, and the report says why for every dropped row."""
    rows = tiny.make_rows(20, seed=5)
    wrong = [dict(r, answer=str(int(r["answer"]) + 10)) for r in tiny.make_rows(6, seed=6)]
    extra = [{"prompt": "(a) 3+4= (b) 5+6=", "answer": "7", "verifier": "tiny", "note": "multi"},
             {"prompt": "3+4=", "answer": r"\begin{pmatrix}7\end{pmatrix}", "verifier": "tiny", "note": "matrix"}]
    objs = [dict(r, id=i) for i, r in enumerate(rows + wrong + extra)]  # an extra column, kept in the output
    src = write_jsonl(tmp_path / "in.jsonl", objs)
    out = str(tmp_path / "out.jsonl")
    clean.main([src, out, "--model", tiny.CKPT, "--k", "4", "--majority-models", f"{tiny.CKPT},{tiny.CKPT}",
               "--max-tokens", "64", "--engine", "hf", "--temperature", "1.0"])
    report = json.load(open(str(tmp_path / "out.report.json")))
    reasons = {int(d["where"].rsplit(":", 1)[1]) - 1: d for d in report["dropped_rows"]}  # jsonl lines count from 1
    kept = [json.loads(line) for line in open(out)]
    assert [o["id"] for o in kept] == [o["id"] for o in objs if o["id"] not in reasons]  # as read, in order
    assert report["rows"] == len(objs) and report["kept"] == len(kept)
    assert sum(report["dropped"].values()) == len(reasons)
    assert reasons[26]["reason"] == "multi_question" and reasons[27]["reason"] == "long_answer"
    for i in range(20, 26):  # every wrong reference is caught by the majority (the model adds well)
        assert reasons[i]["reason"] == "majority_disagrees", reasons.get(i)
        assert f"the reference is '{objs[i]['answer']}'" in reasons[i]["detail"]
    easy = [i for i, d in reasons.items() if d["reason"] == "solved_k_of_k"]
    assert easy and all(i < 20 for i in easy)  # only true references can be solved 4 of 4 times
    assert kept, "at temperature 1 some problems are not solved every time"
    assert f"{len(objs)} rows, kept {len(kept)}" in capsys.readouterr().out


def test_code_and_ifeval_answers_are_checked_when_loaded(tmp_path):
    tests = {"inputs": ["1"], "outputs": ["2"]}
    good = [{"prompt": "add one", "answer": tests, "verifier": "code"},  # a nested column: stored as JSON
            {"prompt": "be brief", "answer": json.dumps([{"type": "max_words", "n": 5}, {"type": "min_words", "n": 1}]),
             "verifier": "ifeval"}]
    rows = data.load_rows(write_jsonl(tmp_path / "ok.jsonl", good))
    assert json.loads(rows[0]["answer"]) == tests and rows[1]["answer"] == good[1]["answer"]
    for i, (obj, match) in enumerate([
            ({"prompt": "p", "answer": {"inputs": ["1"]}, "verifier": "code"}, "equal, non-zero"),
            ({"prompt": "p", "answer": "{oops", "verifier": "code"}, "not JSON"),
            ({"prompt": "p", "answer": {**tests, "timeout": float("nan")}, "verifier": "code"}, "positive number"),
            ({"prompt": "p", "answer": {**tests, "timeout": -1}, "verifier": "code"}, "positive number"),
            ({"prompt": "p", "answer": [{"type": "max_words"}], "verifier": "ifeval"}, "missing or bad parameter"),
            ({"prompt": "p", "answer": [{"type": "rhymes"}], "verifier": "ifeval"}, "must be one of")]):
        path = write_jsonl(tmp_path / f"bad{i}.jsonl", [good[1], obj])
        with pytest.raises(ValueError, match=rf"bad{i}.jsonl:2: field 'answer' \(the answer of a '\w+' row\).*{match}"):
            data.load_rows(path)


def test_max_prompt_len_keeps_a_prompt_of_exactly_that_many_tokens():
    """--max-prompt-len counts the prompt's tokens: at the limit it is drawn, one over it is skipped."""
    tok = tiny.make_tokenizer()
    rows = [{"prompt": p, "answer": "0", "verifier": "tiny"} for p in ("1+2=", "1+2+=", "1+2+3=")]  # 4, 5, 6 tokens
    prompts, cursor, skipped = data.draw_prompts(rows, 0, 0, 20, tok, 5)
    assert {len(ids) for ids, _ in prompts} == {4, 5} and skipped == data.draw_order(3, 0, 0, cursor).count(2) > 0


@pytest.mark.parametrize("spec", ["tiny", "tiny:2"])
def test_the_tiny_task_s_held_out_problems_are_never_drawn_for_training(spec):
    """The built-in task is split by problem: every held-out problem (one in 8 of them, by a hash of its text) is
    outside every training draw, whatever the seeds, so held-out accuracy is measured on problems training never
    saw (the whole task's held-out draw once shared ~62% of its prompts with training's). Each part keeps the long
    tail of term counts."""
    train = data.load_prompts(spec, seed=3)  # the draw test_tiny_k... made (tiny.make_rows caches it)
    for seed in (0, 3):
        held = data.load_prompts(spec, seed=seed, held_out=True, n=512)
        assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
        assert all(tiny.held_out(r["prompt"]) for r in held) and not any(tiny.held_out(r["prompt"]) for r in train)
    if spec == "tiny":
        share = lambda rows, k: sum(r["prompt"].count("+") + 1 == k for r in rows) / len(rows)
        assert abs(share(held, 2) - share(train, 2)) < 0.05 and share(held, 12) > 0
    assert len({r["prompt"] for r in held}) > 8  # two-term problems: 11 of 81 are held out


def test_a_file_evaluated_on_itself_trains_on_the_rest(tmp_path, capsys):
    """--data F --eval-data F: the held-out set is F's first --eval-n rows, and training leaves out every row with
    one of their prompts (a repeated prompt too), and says so; a held-out set that holds every prompt is refused
    with what to pass instead."""
    import config
    import train
    rows = [dict(r, verifier="tiny") for r in tiny.make_rows(10, seed=4)]
    rows.append(dict(rows[1], answer="0"))  # row 1's prompt again, later in the file
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config.parse_config(["--data", str(path), "--eval-data", str(path), "--eval-n", "3"])
    train_rows, held = train.load_data(cfg, lead=True)
    assert [r["prompt"] for r in held] == [r["prompt"] for r in rows[:3]]
    assert [r["prompt"] for r in train_rows] == [r["prompt"] for r in rows[3:10]]
    assert f"4 of 11 rows have a prompt of the held-out set (--eval-data {path})" in capsys.readouterr().err
    cfg = config.parse_config(["--data", str(path), "--eval-data", str(path), "--eval-n", "11"])
    with pytest.raises(ValueError, match=r"every prompt is also in the held-out set .* or --eval-data '' for none"):
        train.load_data(cfg, lead=True)


def test_the_held_out_set_defaults_to_the_training_source_s_own(tmp_path, capsys):
    """--eval-data auto: the built-in task's and Reasoning Gym's held-out draws; none for a file (said), where the
    built-in task's problems would have been evaluated beside training on the file's."""
    import config
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    assert config.parse_config([]).eval_data == "tiny"
    assert config.parse_config(["--data", "tiny:4@1,rg:chain_sum@1", "--plan"]).eval_data == "tiny:4@1,rg:chain_sum@1"
    capsys.readouterr()
    assert config.parse_config(["--data", str(path)]).eval_data == ""
    assert f"--data {path} has no held-out draw of its own: no held-out evaluation" in capsys.readouterr().err
    assert config.parse_config(["--data", str(path), "--eval-data", "tiny"]).eval_data == "tiny"
