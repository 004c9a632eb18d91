"""Does the fast tier catch one-line bugs at the joints? Each mutant of tests/mutants.tsv (FILE, OLD, NEW: OLD occurs
once in FILE; \\n stands for a newline) breaks one line on a copy of the project, and the fast tier runs there:
KILLED (a test failed: the line is guarded), SURVIVED (write the test that fails) or TIMEOUT. Your checkout is
never touched. A tool to run by hand after changing a joint, not part of CI: each mutant costs a fast-tier run
(~1-2 minutes on 2 cores, less once a test fails).

    python tests/mutants.py                      # every mutant of tests/mutants.tsv
    python tests/mutants.py --jobs 2             # two at a time, one thread each
    python tests/mutants.py --area splits        # one area's (the `# area:` lines of the file)
    python tests/mutants.py --file my.tsv -- -k test_update    # other mutants; after --, arguments for pytest

Exits 0 when every mutant was killed.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = shutil.ignore_patterns(".venv", "runs", "__pycache__", ".pytest_cache")  # .git: tests read its file list


def read(path: str) -> list[tuple[str, str, str, str]]:
    """(area, file, old, new) per mutant line; `# area: NAME` lines name the area of those below them."""
    area, out = "", []
    for line in open(path):
        if line.startswith("# area:"):
            area = line.split(":", 1)[1].strip()
        elif line.strip() and not line.startswith("#"):
            file, old, new = line.rstrip("\n").split("\t")
            out.append((area, file, old.replace("\\n", "\n"), new.replace("\\n", "\n")))
    return out


def mutate(file: str, old: str, new: str, pytest_args: list[str], timeout: float) -> tuple[str, float, str]:
    """(verdict, seconds, the first failing test) of one mutant on a fresh copy of the project."""
    copy = tempfile.mkdtemp(prefix="ulorl-mutant-")
    try:
        shutil.copytree(ROOT, copy, dirs_exist_ok=True, ignore=SKIP)
        path = os.path.join(copy, file)
        text = open(path).read()
        if text.count(old) != 1:
            return "NOT FOUND", 0.0, f"OLD occurs {text.count(old)} times in {file}, not once"
        with open(path, "w") as f:
            f.write(text.replace(old, new))
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", "-m", "not slow", "-x", "-q", "-n", "0",
                                "-p", "no:cacheprovider", *pytest_args], cwd=copy, env=env, capture_output=True,
                               text=True, timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            return "TIMEOUT", time.time() - t0, ""
        lines = (p.stdout + p.stderr).splitlines()
        verdict = {0: "SURVIVED", 1: "KILLED"}.get(p.returncode, f"EXIT {p.returncode}")
        return verdict, time.time() - t0, next((line for line in lines if line.startswith("FAILED")), "")
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main() -> None:
    argv = sys.argv[1:]
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", default=os.path.join(ROOT, "tests", "mutants.tsv"), help="the mutants (FILE OLD NEW)")
    p.add_argument("--area", default="", help="only the mutants of this area")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at a time, each on a copy of its own")
    p.add_argument("--timeout", type=float, default=1200, help="seconds one fast-tier run may take")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    mutants = [m for m in read(args.file) if args.area in m[0]]
    if not mutants:
        sys.exit(f"no mutant in {args.file}" + (f" of area {args.area!r}" if args.area else ""))
    print(f"{len(mutants)} mutants, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(mutate, file, old, new, pytest_args, args.timeout) for _, file, old, new in mutants]
        killed = 0
        for (area, file, old, new), run in zip(mutants, runs):
            verdict, seconds, why = run.result()
            killed += verdict == "KILLED"
            print(f"{verdict:9s} {seconds:5.0f}s  {area:8s} {file}: {old.strip()[:50]!r} -> {new.strip()[:50]!r}"
                  f"  {why[:120]}", flush=True)
    print(f"{killed} of {len(mutants)} killed")
    sys.exit(0 if killed == len(mutants) else 1)


if __name__ == "__main__":
    main()
