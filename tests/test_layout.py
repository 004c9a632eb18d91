"""The layout holds: the step's files reach no systems module, the systems package imports from above only what
it names, and the README's reading order is what one step of the tiny default runs, traced.

    python -m pytest -n 0 tests/test_layout.py      # ~10 s
"""
import ast
import collections
import json
import os
import re
import sys

import pytest

from conftest import ROOT, run

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

def systems_names(path: str) -> set[str]:
    """The systems modules a file imports, and the functions of it that use one: read from the AST, so that
    neither a call nor an import can hide."""
    tree = ast.parse(open(path).read())
    bound, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                full = f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
                if full.split(".")[0] == "systems":
                    bound[alias.asname or alias.name.split(".")[0]] = "systems"
                    found.add(f"import {full}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found |= {f"{node.name}: {n.id}" for n in ast.walk(node)
                      if isinstance(n, ast.Name) and bound.get(n.id) == "systems"}
    return found


def spans(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every module-level function and method of a file, decorators included."""
    out = []
    for node in ast.parse(open(path).read()).body:
        for fn, prefix in ([(node, "")] if isinstance(node, ast.FunctionDef) else
                           [(sub, node.name + ".") for sub in node.body if isinstance(sub, ast.FunctionDef)]
                           if isinstance(node, ast.ClassDef) else []):
            out.append((fn.lineno - len(fn.decorator_list), fn.end_lineno, prefix + fn.name))
    return out


# Step 1 of the tiny default, from the loop in train.main to the step's end (step 2, the last, would evaluate and
# save), in a process of its own: every call's first event (None: no line events in it), its code's file and line
TRACE = """
import json, sys, threading
sys.path.insert(0, "tests")
import harness, train
entered = set()
def trace(frame, event, arg):
    entered.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))
real_next, real_finish = train.next_batch, train.finish_step
def next_batch(run):
    if run.state.step == 0:
        sys.settrace(trace)
        threading.settrace(trace)
    return real_next(run)
def finish_step(run, step, *rest):
    real_finish(run, step, *rest)
    if step == 1:
        sys.settrace(None)
        threading.settrace(None)
train.next_batch, train.finish_step = next_batch, finish_step
harness.train_run(["--steps", "2"], sys.argv[1])
entered.add((train.main.__code__.co_filename, train.main.__code__.co_firstlineno))
print(json.dumps(sorted(entered)))
"""


@pytest.fixture(scope="module")
def one_step(tmp_path_factory) -> dict[str, dict[str, int]]:
    """file -> {function: its lines} of every top-level function step 1 of the tiny default enters (TRACE).
    Nested functions count in the function that holds them; the systems package is not read here."""
    done = run([sys.executable, "-c", TRACE, str(tmp_path_factory.mktemp("run") / "out")], timeout=300,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    per = collections.defaultdict(dict)
    for path, line in json.loads(done.stdout.splitlines()[-1]):
        rel = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else ""
        if not rel.endswith(".py") or os.sep in rel:  # the top level only
            continue
        for first, last, name in spans(path):
            if first <= line <= last:
                per[rel][name] = last - first + 1
    return dict(per)


def test_the_readme_s_reading_order_is_one_step_as_it_runs(one_step):
    """The README's reading order names the files one step runs, the functions of each it enters, and their
    lines within 5%: counted from a trace, not chosen."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    claimed = re.search(r"about ([\d,]+) lines in (\d+) files", section)
    assert claimed, "the README's reading order gives no count"
    items = re.findall(r"^\d+\. `([\w/]+\.py)`(.*?)(?=^\d+\. |\Z)", section, re.M | re.S)
    assert [f for f, _ in items] and {f for f, _ in items} == set(one_step), (sorted(one_step), items)
    for name, text in items:  # a method is named as itself, by its name alone or by its class
        named = set(re.findall(r"`([\w.]+)`", text))
        for fn in one_step[name]:
            cls, _, method = fn.rpartition(".")
            assert fn in named or (cls and (cls in named or method in named)), (name, fn)
    total = sum(sum(f.values()) for f in one_step.values())
    assert abs(int(claimed[1].replace(",", "")) - total) <= 0.05 * total, (claimed[1], total)
    assert int(claimed[2]) == len(one_step)


def test_the_step_s_files_reach_no_systems_module_and_ask_no_feature(one_step):
    """Every file a step runs but the entry point imports nothing of the systems package and no function of it the
    step enters asks an object what it has (hasattr, getattr of a name): the systems features are applied where the
    run is set up (the reward workers are handed to the rollout, the sandbox's checks named in registry.py)."""
    for name, functions in one_step.items():
        if name == "train.py":
            continue
        path = os.path.join(ROOT, name)
        assert not systems_names(path), name
        asks = [c.lineno for c in ast.walk(ast.parse(open(path).read())) if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Name) and (c.func.id == "hasattr" or c.func.id == "getattr"
                                                      and isinstance(c.args[1], ast.Constant))]
        assert not [(fn, line) for first, last, fn in spans(path) if fn in functions
                    for line in asks if first <= line <= last], name


def test_the_algorithm_s_file_names_nothing_of_the_systems():
    """ulorl.py imports the loss, the model and the standard library or torch, nothing else; no function of it
    reaches the ranks, sequence parallelism, routing replay or the engine other than through what it is handed."""
    path = os.path.join(ROOT, "ulorl.py")
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(ast.parse(open(path).read())) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    assert imported - sys.stdlib_module_names - {"torch"} == {"loss", "model"}
    assert systems_names(path) == set()
    # the check itself sees an import and a call
    with open(path) as f:
        text = f.read()
    changed = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ulorl_{os.getpid()}.py")
    with open(changed, "w") as f:
        f.write(text.replace("import math\n", "import math\nfrom systems import seqpar as sp\n", 1)
                .replace("    policy.train()\n", "    policy.train()\n    sp.sp_size()\n", 1))
    try:
        assert systems_names(changed) == {"import systems.seqpar", "optimize: sp"}
    finally:
        os.remove(changed)


def test_the_systems_import_from_above_only_what_their_package_names():
    """The package under the algorithm imports the top level's files only where systems/__init__.py says so: a
    new import from above (a cycle in the making) fails here until it is named there."""
    top = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    found = set()
    for name in sorted(os.listdir(os.path.join(ROOT, "systems"))):
        if name.endswith(".py"):
            for n in ast.walk(ast.parse(open(os.path.join(ROOT, "systems", name)).read())):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    mods = [n.module] if isinstance(n, ast.ImportFrom) and n.module else [a.name for a in n.names]
                    found |= {(name[:-3], m.split(".")[0]) for m in mods if m.split(".")[0] in top}
    import systems
    named = {(m[1], above) for m in re.finditer(r"^  (\w+) +(.*(?:\n {14}.*)*)", systems.__doc__, re.M)
             for above in re.findall(r"(?:^|, |\n\s+)(\w+) \(", m[2])}
    assert found == named, (found - named, named - found)
