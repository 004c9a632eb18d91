"""Runs a script's command line several times in one process, as `python SCRIPT ARGS...` would each time, and prints
one JSON line per run: {"returncode", "stdout", "stderr"}. For commands that stop before any model loads (--plan, a
flag error), where starting Python and importing torch and transformers is most of a launch's cost.

    python tests/entries.py train.py '[["--plan"], ["--plan", "--sp", "2"]]'
"""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def entry(script: str, args: list[str]) -> dict:
    """The script run as __main__ with sys.argv = [script, *args]; its exit as the interpreter would report it."""
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [script, *args]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:  # sys.exit("message") prints the message and exits 1, as the interpreter does
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except Exception:
            traceback.print_exc()
            code = 1
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    script, runs = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts its folder first
    results = [entry(script, args) for args in runs]
    sys.stdout = sys.__stdout__
    for result in results:
        print(json.dumps(result))
