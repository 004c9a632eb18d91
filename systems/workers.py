"""Killable worker processes for reward checks: `run` scores (verifier, response, answer) tasks in a persistent
pool with a deadline per check, and a check that overruns it is killed with its process and scores 0.

Checks need processes because sympy can hang inside C code, where neither signals nor threads can interrupt it.
Workers come from the multiprocessing "forkserver", never from a fork of the trainer (which holds torch
threads), and start without importing the main script, so a verifier must be a module-level function of an
importable module, and a worker does not load torch because the trainer did.
"""
import atexit
import functools
import importlib
import logging
import math
import os
import multiprocessing as mp
import resource
import signal
import sys
import time
import types
from collections import deque
from multiprocessing.connection import wait as mp_wait

from systems import sandbox  # the standard library only: its leftovers are removed with a worker

IN_WORKER = False  # True in a worker, where the parent enforces the timeout: verifiers check in-process there
# Each worker's address space (RLIMIT_AS): a parse of model output such as \boxed{2^{2^{2^{2^{2^{2}}}}}} grows
# without bound (~40-90 MB/s) until the timeout; capped, it raises MemoryError (an error, scored 0). A worker
# needs ~70 MB; a code check's program sets its own limit (1 GB) inside its sandbox.
MEMORY_MB = 1024
RECYCLE_MB = MEMORY_MB // 2  # a worker holding more after a check ends and is replaced: what one response grew
# (a parse that hit the cap) stays with the process, and the next checks would start near its limit
PRELOAD = ["verifiers"]  # the forkserver imports math-verify and sympy once; forking from it is cheap
SETUP_S = 120.0  # what a check may take on top of its timeout when it starts a sandboxed scorer first

def _load(ref: str):
    module, _, name = ref.partition(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


@functools.cache
def ref(fn) -> str:
    """"module:name" of a verifier, the form a worker imports it by."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    try:
        found = _load(name)
    except (ImportError, AttributeError):
        found = None
    if found is not fn or fn.__module__ == "__main__":
        raise ValueError(f"verifier {name} must be a module-level function of an importable module (not the main "
                         f"script) so that workers can import it")
    return name


_CONN = None  # a worker's pipe to the trainer


def setup_started() -> None:
    """In a worker: tell the trainer that this check starts a sandboxed scorer first (SETUP_S more)."""
    if _CONN is not None:
        _CONN.send("setup")


def _serve(conn, memory_mb: int) -> None:
    """Worker loop: receive chunks of (index, ref, response, answer), send one (index, score, error) each."""
    global IN_WORKER, _CONN
    IN_WORKER, _CONN = True, conn
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer; it kills us at exit
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" and parse noise
    conn.send("ready")
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        for i, ref, response, answer in chunk:
            try:
                score, error = float(_load(ref)(response, answer)), None
                if not 0.0 <= score <= 1.0:  # NaN fails this too: a reward is a score in [0, 1], or an error
                    raise ValueError(f"the verifier returned {score!r}, not a score in [0, 1]")
            except Exception as e:  # any model output or verifier bug scores 0; the parent counts it
                score, error = 0.0, f"{ref}: {type(e).__name__}: {e}"
            last = rss_mb() > RECYCLE_MB  # with its answer, in one message: the rest goes to a fresh worker
            conn.send((i, score, error, last))
            if last:
                return


def rss_mb() -> float:
    """This process's resident memory now (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Worker:
    """One checker process; `pending` holds the indices it was sent and has not answered yet, in order."""

    def __init__(self):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, MEMORY_MB), daemon=True)
        # A forkserver child re-imports the main script unless there is none to import: it needs nothing from
        # it, and a script without a main guard would start workers again from inside the worker (an error).
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:
            self.proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()
        self.ready, self.pending, self.deadline = False, [], 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()  # reap it: no zombies
        self.conn.close()
        sandbox.remove_leftovers(self.proc.pid)  # what it kept in /tmp for the sandbox (its copy of bwrap)


POOL: list[_Worker] = []


@atexit.register
def close_pool() -> None:
    """Kill every worker (at exit; and before a process ends without its atexit handlers)."""
    for w in POOL:
        w.kill()
    POOL.clear()


def _replace(w: _Worker, todo: deque, started: int = 1) -> None:
    """Kill a stuck or dead worker; its unanswered checks after the `started` one go back first in line."""
    todo.extendleft(reversed(w.pending[started:]))
    w.kill()
    POOL[POOL.index(w)] = _Worker()


def run(tasks: list[tuple[str, str, str]], timeout: float, workers: int, batch_timeout: float = 0.0):
    """Run (ref, response, answer) checks on the pool (grown to `workers` processes, never shrunk).
    Returns (scores, number of timeouts, error texts); a timed-out or failed check scores 0.0. With
    `batch_timeout` > 0 the whole call returns after at most that many seconds: checks left then score 0 and
    count as timeouts (hanging checks otherwise queue behind each other, `timeout` each)."""
    while len(POOL) < workers:
        POOL.append(_Worker())
    scores, n_timeouts, errors = [0.0] * len(tasks), 0, []
    todo = deque(range(len(tasks)))
    stop_at = time.monotonic() + batch_timeout if batch_timeout > 0 else math.inf
    # a few chunks per worker: one message per chunk instead of per item, yet the tail stays balanced
    chunk = max(1, min(64, len(tasks) // (4 * len(POOL))))
    while todo or any(w.pending for w in POOL):
        if time.monotonic() >= stop_at:  # the batch's bound: what is left scores 0
            n_timeouts += len(todo) + sum(len(w.pending) for w in POOL)
            todo.clear()
            for w in list(POOL):
                if w.pending:
                    w.pending = []
                    _replace(w, todo)
            break
        for w in POOL:
            if w.ready and not w.pending and todo:
                w.pending = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                w.conn.send([(i, *tasks[i]) for i in w.pending])
                w.deadline = time.monotonic() + timeout
        deadlines = [w.deadline for w in POOL if w.pending] + ([stop_at] if stop_at < math.inf else [])
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for conn in mp_wait([w.conn for w in POOL], timeout=wait_s):
            w = next(w for w in POOL if w.conn is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the process died (segfault, OOM killer)
                if not w.ready:
                    raise RuntimeError("a reward worker died while starting; `python -c 'import verifiers'` "
                                       "must succeed") from None
                if w.pending:
                    errors.append(f"reward worker died (exit code {w.proc.exitcode}) during a check")
                _replace(w, todo)
                continue
            if msg == "ready":
                w.ready = True
                continue
            if msg == "setup":  # the check starts a sandboxed scorer first
                w.deadline = time.monotonic() + timeout + SETUP_S
                continue
            i, score, error, last = msg
            scores[i] = score
            if error:
                errors.append(error)
            w.pending.remove(i)
            w.deadline = time.monotonic() + timeout  # the clock runs per check, not per chunk
            if last:  # it answered, and holds too much memory for the next: its unstarted checks go first in line
                _replace(w, todo, started=0)
        now = time.monotonic()
        for w in list(POOL):
            if w.pending and now > w.deadline and not w.conn.poll():  # unread results: not stuck
                n_timeouts += 1
                _replace(w, todo)
    return scores, n_timeouts, errors


