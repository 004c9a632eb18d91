"""The --out folder: one run per folder, and which of its checkpoints a run may trust.

A run holds `--out/.lock` (an exclusive flock, rank 0, for its whole life): a second run on the same --out is
refused instead of mixing its records and checkpoints with the first's. flock is local to one machine: it
does not keep out a run on another machine writing to the same network file system. A folder holding a run is
never written over unless --resume continues it or --overwrite deletes it; --resume auto takes the newest
checkpoint whose files all match the sizes and sha256 digests in its manifest.json. The run's files are opened
without following links, and a refused write (full disk, read-only --out) is reported with what is safe.
"""
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def lock_out(out: str):
    """Take --out for this run: an exclusive, non-blocking flock on out/.lock, held while the returned file is
    open (the process's life; the kernel drops it when the process dies, even by SIGKILL). A folder that
    another live run holds is refused, naming that run's pid and host."""
    try:
        os.makedirs(out, exist_ok=True)
        f = open_run_file(os.path.join(out, ".lock"), "a+")
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that did not say which"
        f.close()
        raise ValueError(f"--out {out} is in use by another run ({holder}); two runs in one folder would mix "
                         f"their records and checkpoints: wait for it to end, or choose another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def write_error(e: OSError, what: str, out: str) -> ValueError | None:
    """A user's error, not a traceback, for a write that the machine refused (full disk, quota, read-only or
    forbidden --out): what failed, and what is safe. None for any other error."""
    if e.errno not in WRITE_ERRORS:
        return None
    published = list_checkpoints(out)  # complete by construction: publish() renames only finished ones
    safe = (f"the checkpoints before it are intact (the newest, {published[-1]}, resumes with --resume auto "
            f"once --out can be written)" if published else "no checkpoint of this run was complete yet")
    return ValueError(f"{what}: {e.strerror} ({e.filename or out}); {safe}")


def prune(out: str, keep_last: int, run_id: str) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints (0: keep all) of run `run_id` in `out`, never one
    another run wrote. Returns the names deleted."""
    mine = [name for name in list_checkpoints(out) if read_manifest(os.path.join(out, name)).get("run") == run_id]
    gone = mine[:-keep_last] if keep_last > 0 else []
    for name in gone:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    return gone


def list_checkpoints(out: str) -> list[str]:
    """step_NNNNNN directories in `out`, oldest first (unfinished `.tmp` writes excluded)."""
    if not os.path.isdir(out):
        return []
    return sorted(d for d in os.listdir(out) if d.startswith("step_") and not d.endswith(".tmp"))


def read_manifest(path: str) -> dict:
    """A checkpoint's manifest, {} when it has none that parses."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def problem(path: str) -> str | None:
    """Why a checkpoint cannot be trusted, or None. Trusted: a manifest that lists every file of the checkpoint
    (ulorl_state.json among them) with its size and sha256, and every file matching them; a file the manifest
    does not list (a routing.pt put there) is a reason too, since resume would load it."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            listing = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest.json with a file listing ({type(e).__name__}: {e})"
    if not isinstance(listing, dict) or "ulorl_state.json" not in listing:
        return "the manifest does not list ulorl_state.json"
    on_disk = {os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names} - \
        {"manifest.json"}
    if unlisted := sorted(on_disk - set(listing)):
        return f"{unlisted[0]} is not in the manifest"
    for name, want in listing.items():
        if not isinstance(want, dict) or not isinstance(want.get("size"), int) or \
                not isinstance(want.get("sha256"), str):
            return f"the manifest lists {name} without its size and sha256"
        if name not in on_disk:
            return f"{name} is missing"
        p = os.path.join(path, name)
        if os.path.islink(p):
            return f"{name} is a symbolic link"
        if os.path.getsize(p) != want["size"]:
            return f"{name} has {os.path.getsize(p)} bytes, the manifest says {want['size']}"
        if file_digest(p) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def run_files(out: str) -> list[str]:
    """What of a run the folder `out` holds: metrics.jsonl / samples.jsonl with records, step_* checkpoints
    (finished or interrupted), --report-to's tb/ and wandb/ folders."""
    if not os.path.isdir(out):
        return []
    found = [n for n in ("metrics.jsonl", "samples.jsonl")
             if os.path.exists(os.path.join(out, n)) and os.path.getsize(os.path.join(out, n)) > 0]
    return found + sorted(d for d in os.listdir(out) if d.startswith("step_") or d in TRACKERS)


TRACKERS = ("tb", "wandb")  # --report-to's folders: their libraries' own (W&B links its latest run and logs)


def refuse_links(out: str) -> None:
    """--out may itself be a link, never hold one outside TRACKERS: a run writes its records, checkpoints and
    lock inside it, and a planted link would make it write (the data's answers, or over another file)
    somewhere else."""
    for d, dirs, names in os.walk(out):
        if d == out:
            dirs[:] = [x for x in dirs if x not in TRACKERS or os.path.islink(os.path.join(d, x))]
        for name in dirs + names:
            if os.path.islink(os.path.join(d, name)):
                raise ValueError(f"--out {out}: {os.path.join(d, name)} is a symbolic link; a run writes only "
                                 f"into --out itself: remove the link, or choose another --out")


def open_run_file(path: str, mode: str):
    """A file of the run in --out, opened without following a link at its name ("r", "w", "a" or "a+")."""
    flags = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
             "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}[mode]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; a run writes only into --out itself") from None
        raise
    return os.fdopen(fd, mode)


def find_resume(resume: str, out: str, overwrite: bool = False) -> str | None:
    """The checkpoint a run starts from (None: from the model), given --resume, --out and --overwrite. An --out
    that holds a run is never written over unless --resume continues it or --overwrite says so; --resume auto
    takes the newest checkpoint that passes its manifest check (those skipped are named), starts fresh in a
    folder holding no run, and stops, listing what it found and why each was rejected, when nothing of a run
    there can be resumed. Read-only: --overwrite's deletion is clear_run()'s."""
    refuse_links(out)
    held = run_files(out)
    if overwrite:
        return None
    if not resume:
        if held:
            raise ValueError(f"--out {out} holds a run ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): "
                             f"continue it with --resume auto, start it again with --overwrite (deletes those), or "
                             f"choose another --out")
        return None
    if resume != "auto":
        if why := problem(resume):
            raise ValueError(f"--resume {resume}: {why}")
        same = os.path.realpath(os.path.dirname(os.path.abspath(resume))) == os.path.realpath(out)
        if held and not same:
            raise ValueError(f"--resume {resume} writes into --out {out}, which holds another run ({', '.join(held[:5])}"
                             f"): choose an empty --out, or --out {os.path.dirname(os.path.abspath(resume))}")
        return resume
    rejected = []
    for name in reversed(list_checkpoints(out)):
        why = problem(os.path.join(out, name))
        if why is None:
            for skipped, reason in rejected:
                print(f"warning: skipping checkpoint {os.path.join(out, skipped)}: {reason}", file=sys.stderr, flush=True)
            return os.path.join(out, name)
        rejected.append((name, why))
    if not held:
        return None  # nothing to lose: a fresh start
    rejected += [(name, "an interrupted save") for name in held if name.endswith(".tmp")]
    lines = [f"  {name}: {why}" for name, why in rejected] or [f"  no checkpoint; {', '.join(held)} only"]
    raise ValueError(f"--resume auto: nothing in {out} can be resumed:\n" + "\n".join(lines) +
                     "\nstart the run again with --overwrite (deletes them), or choose another --out")


def clear_run(out: str) -> list[str]:
    """--overwrite: delete the run held in `out` (run_files); returns what was deleted."""
    held = run_files(out)
    for name in held:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return held
