"""Running untrusted programs written by the model: the code domain's sandbox (ProRL's code rewards).

Own file rather than part of reward.py because it is the one place that deals with process isolation
(rlimits, namespaces, user ids, killing process groups): security code that should be read and reviewed on
its own. reward.py only calls `code_reward`, from its worker processes, so a model's program is never run
by (or forked from) the trainer itself.

One test case = one fresh `python -I` process (isolated mode: no user site, no PYTHON* variables) with:
- limits (setrlimit, before exec): CPU seconds, address space, file size (its stdout goes to a file, so
  this also caps the output), open files, no core dumps, and RLIMIT_NPROC = 0: it cannot fork or start
  threads at all. RLIMIT_NPROC counts every process of the user, so a positive cap would depend on how many
  processes the trainer's user already has; 0 refuses every fork of the sandboxed process only, and
  processes of the trainer (which have no such limit) fork as before.
- a wall-clock timeout: its whole process group is killed (SIGKILL), and the kernel kills it as well
  if the reward worker that started it dies (PR_SET_PDEATHSIG);
- no network: a new network namespace with only a loopback interface that is down (unshare(2) via libc;
  as root it needs no user namespace, otherwise an unprivileged user namespace);
- one writable place, private and size-limited: a new mount namespace in which /tmp is a fresh tmpfs of
  TMP_MB and every other world-writable directory of the machine (/var/tmp, /dev/shm, /run/lock,
  /dev/mqueue) an empty read-only one; the program runs in /tmp (its code copied there), and whatever it
  writes is gone when its last process dies. stdin and stdout are files in a directory of the runner's that the program cannot write;
- a minimal environment (PATH, LANG, HOME=TMPDIR=/tmp): no secrets of the trainer's environment;
- as root, it runs as user `nobody` (65534): it cannot write root's files, nor read them or other processes'
  environments. RLIMIT_NPROC does not bind root, which is another reason to drop to `nobody`.

Fallbacks, reported once as a warning: where the kernel refuses new namespaces (some containers), the
program runs without network isolation, and in a directory of its own on the machine's /tmp (deleted
afterwards) with the machine's /tmp and /dev/shm writable. When the trainer does not run as root, the
program runs as the trainer's user and can write files that user owns (only RLIMIT_FSIZE bounds them), and
read /proc/<pid>/environ of that user's processes; run the trainer as root in a container or as a dedicated
user.
"""
import ctypes
import glob
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 1, 2, 4, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")  # each gets a private tmpfs
TMP_MB = 64  # the program's /tmp: memory, so it is small
_CODE_BLOCK = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_libc = ctypes.CDLL(None, use_errno=True)
_SETUP: tuple[bool, str] | None = None  # (namespaces work, interpreter), probed on first use


@dataclass
class Result:
    status: str  # "ok" (exit code 0), "error" (any other exit), "timeout" (wall clock)
    stdout: str
    returncode: int | None


def _mount_tmpfs(path: str, writable: bool) -> None:
    flags = MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, f"size={TMP_MB if writable else 1}m,mode=1777".encode()):
        raise OSError(ctypes.get_errno(), f"mounting a tmpfs on {path} failed")


def _limits(cpu_s: int, memory_mb: int, file_mb: int, isolate: bool) -> None:
    """preexec_fn: runs in the child between fork and exec, in the runner's directory (the cwd that
    subprocess set). (Python code there is safe only when the parent has no other threads: reward workers
    have none; the trainer never runs this.)"""
    os.setsid()  # its own process group, so a timeout kills everything it started
    if isolate:
        root = os.geteuid() == 0
        if _libc.unshare(CLONE_NEWNET | CLONE_NEWNS | (0 if root else CLONE_NEWUSER)) != 0:
            raise OSError(ctypes.get_errno(), "unshare failed")
        if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None):  # nothing mounted here leaks out
            raise OSError(ctypes.get_errno(), "making / private failed")
        for path in WORLD_WRITABLE:
            if os.path.isdir(path):
                _mount_tmpfs(path, writable=path == "/tmp")
        shutil.copy("main.py", "/tmp/main.py")  # "." is still the runner's directory, under the old /tmp
        os.chdir("/tmp")
    if os.geteuid() == 0:  # before the limits: RLIMIT_NPROC binds only non-root users
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    for res, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_mb << 20),
                       (resource.RLIMIT_FSIZE, file_mb << 20), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
        resource.setrlimit(res, (value, value))
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it


def _setup() -> tuple[bool, str]:
    """(namespaces work, interpreter) for this machine, probed once. As `nobody` the trainer's interpreter
    may be unreachable (pyenv under /root, mode 700): then the system's python3 runs programs."""
    global _SETUP
    if _SETUP is None:
        probe = tempfile.mkdtemp(prefix=f"ulorl_sandbox_{os.getpid()}_")
        try:
            with open(os.path.join(probe, "main.py"), "w") as f:
                f.write("pass\n")
            os.chmod(os.path.join(probe, "main.py"), 0o644)
            for isolate in (True, False):
                for python in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
                    try:
                        subprocess.run([python, "-I", "main.py"], preexec_fn=lambda: _limits(2, 512, 1, isolate),
                                       check=True, timeout=30, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env={"PATH": "/usr/bin:/bin"}, cwd=probe)
                    except (subprocess.SubprocessError, OSError):
                        continue
                    _SETUP = (isolate, python)
                    if not isolate:
                        warnings.warn("sandbox: this kernel refuses new namespaces; model programs run WITH network "
                                      "access and can write to the machine's /tmp and /dev/shm (see sandbox.py)")
                    return _SETUP
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        raise RuntimeError(f"sandbox: no Python interpreter runs under the sandbox's limits (tried {sys.executable}"
                           f" and /usr/bin/python3 as uid {NOBODY if os.geteuid() == 0 else os.geteuid()})")
    return _SETUP


def network_isolated() -> bool:
    """Whether sandboxed programs get their own (empty) network namespace and private, size-limited
    temporary directories on this machine."""
    return _setup()[0]


def _sweep() -> None:
    """Remove directories left by runners that were killed mid-run (a reward worker past its timeout): each
    directory name holds the pid of the process that made it."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "ulorl_sandbox_*_*")):
        pid = os.path.basename(path).split("_")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)


def run_program(code: str, stdin: str = "", timeout: float = 2.0, memory_mb: int = 1024,
                file_mb: int = 16) -> Result:
    """Run `code` as a Python program in the sandbox with `stdin`; never raises for anything the program does."""
    isolate, python = _setup()
    _sweep()
    work = tempfile.mkdtemp(prefix=f"ulorl_sandbox_{os.getpid()}_")  # mode 700: the runner's own
    try:
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        os.chmod(os.path.join(work, "main.py"), 0o644)  # readable by `nobody` under the trainer's umask 077
        with open(os.path.join(work, "stdin"), "w") as f:
            f.write(stdin)
        if os.geteuid() == 0 and not isolate:  # the fallback: the program works in this directory
            os.chown(work, NOBODY, NOBODY)
        home = "/tmp" if isolate else work
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}
        with open(os.path.join(work, "stdin"), "rb") as fin, open(os.path.join(work, "stdout"), "wb") as fout:
            proc = subprocess.Popen([python, "-I", "main.py"], cwd=work, env=env, stdin=fin, stdout=fout,
                                    stderr=subprocess.DEVNULL, close_fds=True,
                                    preexec_fn=lambda: _limits(math.ceil(timeout) + 1, memory_mb, file_mb, isolate))
            try:
                returncode = proc.wait(timeout=timeout)
                status = "ok" if returncode == 0 else "error"
            except subprocess.TimeoutExpired:
                status, returncode = "timeout", None
            finally:  # also when the program exited but left something behind in its group
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
