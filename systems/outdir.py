"""The --out folder: one run per folder, and which of its checkpoints a run may trust.

A run holds `--out/.lock` (an exclusive flock, rank 0, for its whole life): a second run on the same --out is
refused instead of mixing its records and checkpoints with the first's. flock is local to one machine: it
does not keep out a run on another machine writing to the same network file system. A folder holding a run is
never written over unless --resume continues it or --overwrite deletes it; --resume auto takes the newest
checkpoint whose files all match the sizes and sha256 digests in its manifest.json. Everything inside --out is
reached through a `Folder` (a held directory descriptor, no link followed, regular files of one link only), and a
refused write (full disk, read-only --out) is reported with what is safe.
"""
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import time


AT_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_OPEN = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
         "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}


class Folder:
    """A folder of the run held by its descriptor. What is inside is named relative to it and reached without
    following a link, so a name swapped while the run writes (a link put in place of step_N.tmp by anyone who can
    write into --out) cannot send a write elsewhere: it lands in the folder this object holds, wherever that is
    now. Its files must be regular files with one link (a hard link would be cut or written through as well), and
    are checked before anything could wait on them (a FIFO)."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    @classmethod
    def at(cls, path: str) -> "Folder":
        """The folder `path` (--out itself may be a link: the run was pointed there)."""
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def sub(self, name: str, create: bool = False) -> "Folder":
        """The folder `name` inside this one (made first with `create`), never through a link."""
        if create:
            os.mkdir(name, 0o777, dir_fd=self.fd)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError(f"{os.path.join(self.path, name)} is not a folder but {self.kind(name)}; a run "
                                 f"writes only into --out itself: remove it") from None
            raise
        return Folder(fd, os.path.join(self.path, name))

    def kind(self, name: str) -> str:
        """What `name` is, in words, without following a link."""
        mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        return next((what for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                                             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                                             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                                             (stat.S_ISREG, "a file")) if test(mode)), "something else")

    def open(self, name: str, mode: str = "rb", new: bool = False):
        """The file `name` ("r", "w", "a", "a+", with or without "b"; "w" truncates once the file is checked;
        `new`: it must not exist yet). A link, a FIFO, a device or a file with another link is refused, naming it."""
        if "/" in name:  # a file in a folder below: each folder on the way is reached as this one is
            head, rest = name.split("/", 1)
            with self.sub(head) as below:
                return below.open(rest, mode, new)
        path = os.path.join(self.path, name)
        try:  # what is there already is looked at before it is opened: opening a device may do something
            there = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            there = stat.S_IFREG
        if not stat.S_ISREG(there):
            raise ValueError(f"{path} is {self.kind(name)}, not a file; a run's files are regular files inside "
                             f"--out: remove it")
        flags = _OPEN[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_EXCL if new else 0)
        try:
            fd = os.open(name, flags, 0o666, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO opened for writing with no reader
                raise ValueError(f"{path} is {'a symbolic link' if e.errno == errno.ELOOP else 'a FIFO'}; a run's "
                                 f"files are regular files inside --out: remove it") from None
            raise
        st = os.fstat(fd)
        why = None if stat.S_ISREG(st.st_mode) else f"is {self.kind(name)}, not a file"
        why = why or (f"has {st.st_nlink} links (a hard link: writing it would write another file too)"
                      if st.st_nlink != 1 else None)
        if why:
            os.close(fd)
            raise ValueError(f"{path} {why}; a run's files are its own: remove it")
        os.set_blocking(fd, True)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def files(self) -> list[str]:
        """Every name below this folder that is not a folder (links and FIFOs included, none followed), as paths
        relative to it, sorted."""
        out = []

        def walk(fd: int, prefix: str) -> None:
            for entry in os.scandir(fd):
                if entry.is_dir(follow_symlinks=False):
                    sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    try:
                        walk(sub, os.path.join(prefix, entry.name))
                    finally:
                        os.close(sub)
                else:
                    out.append(os.path.join(prefix, entry.name))
        walk(self.fd, "")
        return sorted(out)

    def fsync(self, name: str) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def holds(self, name: str, folder: "Folder") -> bool:
        """Whether `name` here is `folder` itself (the same inode, not a link to it or a stand-in)."""
        try:
            here = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(folder.fd)
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def replace(self, old: str, new: str) -> None:
        os.replace(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def exchange(self, a: str, b: str) -> None:
        """Swap the names `a` and `b` in one step (renameat2 RENAME_EXCHANGE)."""
        if _libc.renameat2(self.fd, os.fsencode(a), self.fd, os.fsencode(b), AT_RENAME_EXCHANGE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"swapping in a checkpoint with renameat2(RENAME_EXCHANGE) failed ({os.strerror(code)}"
                                f"; a file system without it, such as NFS, cannot hold --out)",
                          os.path.join(self.path, b))

    def remove(self, name: str) -> None:
        """Delete `name` (a folder with all it holds), never following a link out of this folder."""
        if self.kind(name) == "a folder":
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)


def file_digest(f) -> str:
    """sha256 of an open binary file, from its start."""
    h = hashlib.sha256()
    f.seek(0)
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def open_out(out: str) -> Folder:
    """--out (made if needed), held open: the folder claimed at start, which every write of the run goes
    through by its descriptor, so renaming or replacing --out or a folder above it mid-run cannot redirect a
    write (they land in the folder held, under whatever name it has now)."""
    try:
        os.makedirs(out, exist_ok=True)
        return Folder.at(out)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror})") from None


def lock_out(folder: Folder):
    """Take --out (`folder`) for this run: an exclusive, non-blocking flock on its .lock, held while the returned
    file is open (the process's life; the kernel drops it when the process dies, even by SIGKILL). A folder
    that another live run holds is refused, naming that run's pid and host."""
    try:
        f = folder.open(".lock", "a+")
    except OSError as e:
        raise ValueError(f"--out {folder.path}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that did not say which"
        f.close()
        raise ValueError(f"--out {folder.path} is in use by another run ({holder}); two runs in one folder would "
                         f"mix their records and checkpoints: wait for it to end, or choose another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class TmpdirError(OSError):
    """A write to TMPDIR (where a library writes what is then copied into --out) refused: its filename is TMPDIR."""


def folder_identity(out: Folder) -> tuple[str, int, int]:
    """What same_folder compares: this machine, and the held folder's device and inode."""
    st = os.fstat(out.fd)
    return socket.gethostname(), st.st_dev, st.st_ino


def same_folder(out: Folder, ranks: list[tuple[str, int, int]]) -> None:
    """Every rank's --out is rank 0's folder: on rank 0's machine the same device and inode, on another (a shared
    file system, another device number there) the same inode. `ranks`: folder_identity of each rank."""
    host, dev, ino = ranks[0]
    for r, (h, d, i) in enumerate(ranks):
        if i != ino or (h == host and d != dev):
            raise ValueError(f"--out {out.path} is not the same folder on rank {r} ({h}) as on rank 0 ({host}): "
                             f"every rank writes its optimizer state into rank 0's --out; give them one folder")


def write_error(e: OSError, what: str, out: Folder) -> ValueError | None:
    """A user's error, not a traceback, for a write that the machine refused (full disk, quota, read-only or
    forbidden --out, or TMPDIR): what failed, where, and what is safe. None for any other error."""
    if e.errno not in WRITE_ERRORS:
        return None
    where = "TMPDIR" if isinstance(e, TmpdirError) else "--out"
    published = list_checkpoints(out)  # complete by construction: publish() renames only finished ones
    safe = (f"the checkpoints before it are intact (the newest, {published[-1]}, resumes with --resume auto "
            f"once {where} can be written)" if published else "no checkpoint of this run was complete yet")
    return ValueError(f"{what}: {e.strerror} ({where + ' ' if where == 'TMPDIR' else ''}{e.filename or out.path}); "
                      f"{safe}")


def prune(out: Folder, keep_last: int, run_id: str) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints (0: keep all) of run `run_id` in `out`, never one
    another run wrote. Returns the names deleted."""
    mine = [name for name in list_checkpoints(out) if manifest_in(out, name).get("run") == run_id]
    gone = mine[:-keep_last] if keep_last > 0 else []
    for name in gone:
        out.remove(name)
    return gone


CHECKPOINT = re.compile(r"step_(\d+)")


def list_checkpoints(out: "Folder | str") -> list[str]:
    """step_N folders in `out` (a held Folder, or a path), oldest first by N (step_1000000 after step_999999),
    unfinished `.tmp` writes excluded."""
    if isinstance(out, str) and not os.path.isdir(out):
        return []
    names = out.names() if isinstance(out, Folder) else os.listdir(out)
    steps = [(int(m.group(1)), name) for name in names if (m := CHECKPOINT.fullmatch(name))]
    return [name for _, name in sorted(steps)]


def read_manifest(path: str) -> dict:
    """A checkpoint's manifest, {} when it has none that parses."""
    try:
        with Folder.at(os.path.dirname(path) or ".") as parent:
            return manifest_in(parent, os.path.basename(path))
    except OSError:
        return {}


def manifest_in(out: Folder, name: str) -> dict:
    """The manifest of checkpoint `name` in `out`, {} when it has none that parses."""
    try:
        with out.sub(name) as folder, folder.open("manifest.json", "rb") as f:
            found = json.loads(f.read(MANIFEST_BYTES))
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


MANIFEST_BYTES = 64 << 20  # a manifest lists a few dozen files: more than this is no manifest a run wrote


def problem(path: str) -> str | None:
    """Why a checkpoint cannot be trusted, or None. Trusted: a manifest that lists every file of the checkpoint
    (ulorl_state.json among them) with its size and sha256, and every file matching them: a regular file of one
    link, whole (no holes, and no larger than its file system: a run writes every byte), its size as listed,
    then its digest. Sizes are checked before any file is read, so a file listed at 16 TiB is refused at once,
    not hashed for hours. A file the manifest does not list (a routing.pt put there) is a reason too, since
    resume would load it."""
    try:
        with Folder.at(os.path.dirname(path) or ".") as parent, parent.sub(os.path.basename(path)) as folder:
            return _problem(folder)
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _problem(folder: Folder) -> str | None:
    try:
        with folder.open("manifest.json", "rb") as f:
            listing = json.loads(f.read(MANIFEST_BYTES))["files"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        return f"no readable manifest.json with a file listing ({type(e).__name__}: {e})"
    if not isinstance(listing, dict) or "ulorl_state.json" not in listing:
        return "the manifest does not list ulorl_state.json"
    on_disk = set(folder.files()) - {"manifest.json"}
    if unlisted := sorted(on_disk - set(listing)):
        return f"{unlisted[0]} is not in the manifest"
    for name, want in listing.items():
        if not isinstance(want, dict) or type(want.get("size")) is not int or not isinstance(want.get("sha256"), str):
            return f"the manifest lists {name} without its size and sha256"
        if name not in on_disk:
            return f"{name} is missing"
    opened = {}
    try:
        for name, want in listing.items():  # every size first: nothing is read until all are right
            f = opened[name] = folder.open(name, "rb")
            st = os.fstat(f.fileno())
            if st.st_size != want["size"]:
                return f"{name} has {st.st_size} bytes, the manifest says {want['size']}"
            disk = os.fstatvfs(f.fileno())
            if st.st_size > disk.f_blocks * disk.f_frsize or \
                    (st.st_size and os.lseek(f.fileno(), 0, os.SEEK_HOLE) < st.st_size):
                return f"{name} has holes (a sparse file): a run writes every byte of a checkpoint"
        for name, want in listing.items():
            if file_digest(opened[name]) != want["sha256"]:
                return f"{name} does not match its sha256 in the manifest"
    except ValueError as e:  # a link, a FIFO, a device or a hard link where a file is listed
        return str(e).removeprefix(folder.path + "/").split("; ")[0]
    finally:
        for f in opened.values():
            f.close()
    return None


def run_files(out: str) -> list[str]:
    """What of a run the folder `out` holds: metrics.jsonl / samples.jsonl with records, step_* checkpoints
    (finished or interrupted), --report-to's tb/ and wandb/ folders."""
    if not os.path.isdir(out):
        return []
    found = [n for n in ("metrics.jsonl", "samples.jsonl")
             if os.path.lexists(os.path.join(out, n)) and os.lstat(os.path.join(out, n)).st_size > 0]
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


def find_resume(resume: str, out: str, overwrite: bool = False) -> str | None:
    """The checkpoint a run starts from (None: from the model), given --resume, --out and --overwrite. An --out
    that holds a run is never written over unless --resume continues it or --overwrite says so; --resume auto
    takes the newest checkpoint that passes its manifest check (those skipped are named), starts fresh in a
    folder holding no run, and stops, listing what it found and why each was rejected, when nothing of a run
    there can be resumed; a checkpoint whose manifest names a run runs.json does not list (copied in from
    another --out) stops it too. Read-only: --overwrite's deletion is clear_run()'s."""
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
    rejected, runs = [], runs_of(out)
    for name in reversed(list_checkpoints(out)):
        if (manifest := read_manifest(os.path.join(out, name))) and (owner := manifest.get("run")) not in runs:
            raise ValueError(f"--resume auto: {os.path.join(out, name)} was written by run {owner!r}, not by a run of "
                             f"this --out ({os.path.join(out, RUNS)} lists {', '.join(runs) or 'none'}): a checkpoint "
                             f"copied in from another --out is not continued; remove it, or resume it by name")
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


RUNS = "runs.json"  # the run ids this --out has started, oldest first: the checkpoints --resume auto may take


def runs_of(out: "Folder | str") -> list[str]:
    """The run ids --out's runs.json lists ([] without one: a new folder)."""
    try:
        with (contextlib.nullcontext(out) if isinstance(out, Folder) else Folder.at(out)) as folder, \
                folder.open(RUNS, "rb") as f:
            runs = json.loads(f.read(MANIFEST_BYTES))["runs"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{os.path.join(out if isinstance(out, str) else out.path, RUNS)} is not the list of runs "
                         f"a run writes ({type(e).__name__}: {e}); remove it to start afresh") from None
    if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
        raise ValueError(f"{os.path.join(out if isinstance(out, str) else out.path, RUNS)}: 'runs' is not a list of "
                         f"run ids; remove it to start afresh")
    return runs


RECORDS = ("metrics.jsonl", "samples.jsonl")


def begin_run(out: Folder, resume_from: str | None, new_id: str) -> str:
    """The id this run writes its checkpoints under, added to runs.json (rank 0, holding the lock). Resuming the
    newest checkpoint of --out continues its run (its id); resuming an older one starts a new branch (`new_id`),
    and the checkpoints newer than it move aside, to `aside-<new_id>/` in --out with a copy of the records (kept, said where): left in
    place, their step names would be written over, and --resume auto would continue the abandoned branch. A
    fresh run, or one resumed from another folder, is new too."""
    run_id, here = new_id, None
    if resume_from:
        parent = os.stat(os.path.dirname(os.path.abspath(resume_from)))
        held = os.fstat(out.fd)
        here = os.path.basename(resume_from) if (parent.st_dev, parent.st_ino) == (held.st_dev, held.st_ino) else None
    if here:
        saved = manifest_in(out, here)
        newer = [n for n in list_checkpoints(out) if int(CHECKPOINT.fullmatch(n).group(1)) > saved.get("step", 0)]
        if not newer:
            run_id = saved.get("run") or new_id
        else:
            aside = f"aside-{new_id}"
            with out.sub(aside, create=True) as kept:
                for name in newer:
                    out.replace(name, os.path.join(aside, name))
                for name in RECORDS:  # the abandoned branch's records: this run cuts them from --out's own
                    if name in out.names():
                        with out.open(name, "rb") as src, kept.open(name, "wb", new=True) as dst:
                            shutil.copyfileobj(src, dst)
            print(f"--resume {resume_from} is not the newest checkpoint of --out: this run is a new branch, run id "
                  f"{new_id}; the newer checkpoints ({', '.join(newer)}) moved to {os.path.join(out.path, aside)}/, "
                  f"with a copy of the records", flush=True)
    runs = runs_of(out)
    if run_id not in runs:
        with out.open(RUNS + ".tmp", "w") as f:
            json.dump({"runs": runs + [run_id]}, f)
            f.flush()
            os.fsync(f.fileno())
        out.replace(RUNS + ".tmp", RUNS)
    return run_id


def clear_run(out: Folder) -> list[str]:
    """--overwrite: delete the run held in `out` (run_files); returns what was deleted."""
    held = run_files(out.path)
    for name in held:
        out.remove(name)
    return held
