"""The wheels the one-GPU check (tests/gpu/h200.py) carries to a machine that cannot download anything: what
train.py imports at start-up that such a machine's Python lacks. Of the rewards only math-verify is imported
at start-up, and of its needs only two are missing there (sympy and mpmath come with torch). Every other
package the check runs (torch, transformers, safetensors, tokenizers, huggingface-hub, tqdm) is preinstalled
on it.

    python tests/gpu/wheels.py          # download them here, into .whl/ (git ignores it)
    python tests/gpu/wheels.py --check  # only say which are there and their size; exit 1 if one is missing

The GPU machine runs Python 3.12, so pip is asked for wheels of that Python; all three are pure Python.
h200.py installs them from .whl/ into its work folder when math_verify does not import.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(ROOT, ".whl")
REQUIREMENTS = os.path.join(ROOT, "requirements.txt")
PYTHON = "3.12"  # the GPU machine's
# (distribution, version, wheel file, its bytes as downloaded): the dry run's size budget counts the bytes
# before anything is downloaded. math-verify's version is requirements.txt's pin (a test holds them equal);
# latex2sympy2_extended is the exact version math-verify 0.9.0 requires, antlr4 the newest it allows.
WHEELS = [
    ("math-verify", "0.9.0", "math_verify-0.9.0-py3-none-any.whl", 29967),
    ("latex2sympy2_extended", "1.11.0", "latex2sympy2_extended-1.11.0-py3-none-any.whl", 209050),
    ("antlr4-python3-runtime", "4.13.2", "antlr4_python3_runtime-4.13.2-py3-none-any.whl", 144462),
]


def pinned(name: str, path: str = REQUIREMENTS) -> str | None:
    """The version requirements.txt pins `name` to (`name==X`), or None."""
    with open(path) as f:
        for line in f:
            m = re.match(rf"\s*{re.escape(name)}\s*==\s*([^\s#;]+)", line, re.IGNORECASE)
            if m:
                return m.group(1)
    return None


def status(folder: str = FOLDER) -> list[dict]:
    """Each wheel: name, version, file, whether it is in `folder`, and its bytes (the file's when there, else
    the recorded size)."""
    out = []
    for name, version, file, size in WHEELS:
        path = os.path.join(folder, file)
        there = os.path.isfile(path)
        out.append({"wheel": name, "version": version, "file": file, "present": there,
                    "bytes": os.path.getsize(path) if there else size})
    return out


def download(folder: str = FOLDER) -> int:
    """pip download, without dependencies (each one needed is listed), of wheels for the GPU machine's Python."""
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "-d", folder]
    cmd += [f"{name}=={version}" for name, version, _, _ in WHEELS]
    return subprocess.run(cmd).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="download nothing: list the wheels, exit 1 if one is missing")
    p.add_argument("--dir", default=FOLDER, help="the folder (default: .whl/ in the project)")
    args = p.parse_args()
    if not args.check and download(args.dir):
        return 1
    missing = 0
    for w in status(args.dir):
        print(f"{w['file']:<52} {w['bytes'] / 1e3:8.1f} kB  {'' if w['present'] else 'MISSING'}")
        missing += not w["present"]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
