"""A warm interpreter for the tests: one process that imports torch, transformers and the project once, then forks
a child for every `python SCRIPT ARGS`, `python -m MODULE ARGS` or `python -c CODE ARGS` a test asks it to run.

Importing train.py's modules costs ~9 s of CPU on a 2-core machine, most of a short run, and the suite starts over
a hundred such processes. A forked child is still a process of its own (its own pid, session, environment, working
directory, standard streams, exit status and signals; nothing it does reaches the next run), and it runs the script
as `python` would (`__main__`, sys.argv, sys.path[0], its threads joined and atexit handlers run at exit); only
what the imports computed is shared. What only a fresh interpreter shows (an import that works only after another)
stays covered by the processes that start fresh: vLLM's engine processes, the reward workers, and the runs
`ULORL_TESTS_COLD=1 python -m pytest` makes real. tests/conftest.py's run() and start() decide which commands
come here.

    python tests/warm.py SOCKET                   # serve (conftest starts it); ends when its parent does
    python tests/warm.py --client SCRIPT ARGS     # a stand-in for `python SCRIPT ARGS` (a torchrun worker), run
                                                  # by the interpreter behind $ULORL_WARM_SOCKET; exits as it did

A request is one connection: its stdin, stdout and stderr as file descriptors (SCM_RIGHTS), then one JSON line
{"argv": [...after the interpreter], "cwd", "env"}. The answer is two JSON lines: {"pid"} when the child started
and {"returncode"} when it ended (negative: the signal that killed it). A connection closed before the end (its
client was killed) kills the child and everything it started.
"""
import atexit
import glob
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exit_code(e: SystemExit) -> int:
    """The exit status the interpreter gives a SystemExit: None 0, an int itself, anything else printed and 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def child(request: dict, fds: list[int]) -> None:
    """Run the request as `python ARGV` would in a fresh process, then exit with its status (never returns)."""
    code = 1
    try:
        os.setsid()  # a session of its own: it and whatever it starts are killed as one group
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        try:
            if argv[0] == "-c":
                sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
                main = types.ModuleType("__main__")  # no __file__: spawned processes do not re-run it, as with -c
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            elif argv[0] == "-m":
                sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:
            traceback.print_exc()
        threading._shutdown()  # what the interpreter does at exit: join the threads that are not daemons
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    parent, running = os.getppid(), {}  # connection -> the pid of the child it asked for
    marks = {}  # child -> the file that names it as the child of the process that asked (kill() reads them)
    print("ready", flush=True)
    while os.getppid() == parent:  # the tests' process is gone: so is the reason to serve
        readable, _, _ = select.select([listener, *running], [], [], 0.05)
        for conn in readable:
            if conn is listener:
                conn = listener.accept()[0]
                _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                with conn.makefile("r") as f:
                    request = json.loads(f.readline())
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in [conn, *running]:
                        other.close()
                    child(request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
                running[conn] = pid
                asker = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                marks[pid] = os.path.join(os.path.dirname(path), f"child.{asker}.{pid}")
                open(marks[pid], "w").close()
            elif not conn.recv(1):  # its client is gone (killed): so goes the child
                kill(running.pop(conn))
                conn.close()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no child at all
                break
            if pid == 0:
                break
            if pid in marks:
                os.remove(marks.pop(pid))
            conn = next((c for c, p in running.items() if p == pid), None)
            if conn is None:  # its client went first: already killed
                continue
            del running[conn]
            try:
                conn.sendall((json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            except OSError:
                pass
            conn.close()


def kill(pid: int) -> list[int]:
    """SIGKILL `pid`, its process group (or session: the same number) and every process below it, also those in
    sessions of their own (torchrun starts each worker in one), and the children a warm interpreter runs for a
    --client among them (a warm torchrun's workers). Returns the processes it killed."""
    tree = [pid, *descendants(pid)]
    for each in list(tree):
        for mark in glob.glob(os.path.join(tempfile.gettempdir(), "ulorl-warm-*", f"child.{each}.*")):
            served = int(mark.rsplit(".", 1)[1])
            tree += [served, *descendants(served)]
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for each in tree:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has closed its files: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def request(path: str, argv: list[str], cwd: str, env: dict, fds: list[int], started=None) -> int:
    """Ask the warm interpreter at `path` to run `argv` with `fds` as its stdin, stdout and stderr; returns its
    exit status once it ends. `started(pid)` is called once it runs."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [b"r"], fds)
        conn.sendall((json.dumps({"argv": argv, "cwd": cwd, "env": env}) + "\n").encode())
        replies = conn.makefile("r")
        pid = json.loads(replies.readline())["pid"]
        if started:
            started(pid)
        line = replies.readline()
        if not line:
            raise RuntimeError("the warm interpreter ended before its child did")
        return json.loads(line)["returncode"]


def client(argv: list[str]) -> None:
    """`python ARGV`, run by the warm interpreter with this process's streams, environment and folder: the signals
    that stop a process (torchrun's SIGTERM to its workers) go on to the child, and this process exits as the child
    did. Killed outright, it closes its connection, and the warm interpreter kills the child."""
    pid = []

    def forward(sig, _frame):
        if pid:
            try:
                os.killpg(pid[0], sig)
            except ProcessLookupError:
                pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    env = {k: v for k, v in os.environ.items() if k != "ULORL_WARM_SOCKET"}
    code = request(os.environ["ULORL_WARM_SOCKET"], argv, os.getcwd(), env, [0, 1, 2], started=pid.append)
    if code < 0:  # killed by a signal: so is this process, and torchrun reports the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client(sys.argv[2:])
    sys.path[0] = ROOT  # the project's modules, as a script in ROOT sees them
    os.chdir(ROOT)
    import train  # noqa: F401  torch, transformers and every module of the project that the scripts import
    import eval  # noqa: F401
    serve(sys.argv[1])
