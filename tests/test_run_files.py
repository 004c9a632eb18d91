"""The run's files under attack: a flipped bit in a large file, two runs on one --out, a kill between deleting
and renaming a re-saved step, a full disk and a read-only --out. Each would have gone through silently, or
with a raw traceback, before.

    python -m pytest tests/test_run_files.py
"""
import ctypes
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import kill_group, run, run_many, start
from systems import checkpoint
from systems import outdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--eval-data", "", "--train-groups", "2", "--prompts-per-step", "2", "--max-response-len", "16",
       "--segments", "2", "--dump-samples", "0"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def fake_checkpoint(path, big_mib: int = 0, extra: str = ""):
    """A checkpoint as save() writes one: files hashed as written (a `big_mib` MiB stand-in for a weight shard
    among them), then the manifest."""
    os.makedirs(path)
    digests = {}
    with outdir.Folder.at(path) as folder:
        if big_mib:
            with checkpoint.HashingWriter(folder, "model-00001-of-00002.safetensors") as f:
                checkpoint.write_safetensors({"w": torch.arange(big_mib << 18, dtype=torch.float32)}, f)
            digests["model-00001-of-00002.safetensors"] = f.digest()
        with open(os.path.join(path, "config.json"), "w") as f:  # a file written without a digest: read back
            f.write("{" + extra + "}")
        with open(os.path.join(path, "ulorl_state.json"), "w") as f:
            f.write("{}")
        checkpoint.write_manifest(folder, "run-1", 1, digests)


@pytest.mark.slow
def test_a_flipped_bit_in_a_large_file_is_caught(tmp_path):
    path = str(tmp_path / "step_000001")
    fake_checkpoint(path, big_mib=65)  # more than the 64 MiB up to which files used to be hashed
    name = "model-00001-of-00002.safetensors"
    assert os.path.getsize(os.path.join(path, name)) > 64 << 20 and outdir.problem(path) is None
    assert set(outdir.read_manifest(path)["files"]) == {name, "config.json", "ulorl_state.json"}
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(40 << 20)
        byte = f.read(1)[0]
        f.seek(40 << 20)
        f.write(bytes([byte ^ 0x10]))
    assert outdir.problem(path) == f"{name} does not match its sha256 in the manifest"


def test_verification_needs_every_file_listed_with_its_digest(tmp_path):
    """A manifest with an empty listing, or sizes without digests, verified; a routing.pt it did not list was
    loaded. Now the manifest must list every file with both, and each file must match."""
    path = str(tmp_path / "step_000001")
    fake_checkpoint(path)
    assert outdir.problem(path) is None
    manifest = os.path.join(path, "manifest.json")
    good = json.load(open(manifest))

    def with_listing(files):
        json.dump({**good, "files": files}, open(manifest, "w"))
        return outdir.problem(path)

    assert with_listing({}) == "the manifest does not list ulorl_state.json"
    sizes_only = {name: {"size": want["size"]} for name, want in good["files"].items()}
    assert with_listing(sizes_only) == "the manifest lists config.json without its size and sha256"
    assert with_listing({"ulorl_state.json": good["files"]["ulorl_state.json"]}) == "config.json is not in the manifest"
    with_listing(good["files"])
    torch.save({0: torch.zeros(3, dtype=torch.uint8)}, os.path.join(path, "routing.pt"))
    assert outdir.problem(path) == "routing.pt is not in the manifest"
    os.remove(os.path.join(path, "routing.pt"))
    os.symlink("/etc/hostname", os.path.join(path, "config.json.tmp"))
    assert outdir.problem(path) == "config.json.tmp is not in the manifest"


@pytest.mark.slow
def test_links_inside_out_are_refused_and_nothing_is_written_through_them(tmp_path):
    """A `.lock` link made a root run overwrite its target; dangling metrics.jsonl / samples.jsonl links made
    the run create files (holding the data's answers) outside --out."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    links = {tmp_path / f"out-{name}" / name: target for name, target in ((".lock", victim),
                                                                          ("metrics.jsonl", tmp_path / "created"))}
    for link, target in links.items():
        link.parent.mkdir()
        os.symlink(target, link)
    refused = run_many("train.py", [[*RUN, "--steps", "1", "--out", str(link.parent), "--resume", "auto"]
                                    for link in links], timeout=120, env=ENV)
    for link, p in zip(links, refused):
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert f"{link} is a symbolic link" in p.stderr, p.stderr[-2000:]
    assert victim.read_text() == "precious" and not (tmp_path / "created").exists()
    with pytest.raises(ValueError, match="is a symbolic link"):  # a link that appears after the check
        outdir.Folder.at(str(tmp_path / "out-.lock")).open(".lock", "a+")


def test_a_resaved_step_is_complete_at_every_instant(tmp_path, monkeypatch):
    """publish() of a step that exists (the engine-failure path saves the current step again): before every
    file system call it makes, a complete checkpoint must be at `path`; deleting first, then renaming, left only
    the `.tmp` for a kill in between."""
    path, tmp = str(tmp_path / "step_000001"), str(tmp_path / "step_000001.tmp")
    fake_checkpoint(path)
    fake_checkpoint(tmp, extra='"saved": "again"')
    calls = []

    def checked(name, real):
        def call(*args, **kw):
            calls.append(name)
            assert outdir.problem(path) is None, f"no complete checkpoint at {path} before {name}"
            return real(*args, **kw)
        return call

    for name in ("remove", "replace", "exchange"):
        monkeypatch.setattr(outdir.Folder, name, checked(name, getattr(outdir.Folder, name)))
    with outdir.Folder.at(str(tmp_path)) as out, out.sub("step_000001.tmp") as written:
        checkpoint.publish(out, written, "step_000001")
    assert calls == ["exchange", "remove"] and not os.path.exists(tmp)  # the old copy, swapped out under tmp's name
    assert "again" in open(os.path.join(path, "config.json")).read() and outdir.problem(path) is None


@pytest.mark.slow
def test_a_second_run_on_the_same_out_is_refused(tmp_path):
    out = tmp_path / "out"
    first = start([sys.executable, "train.py", *RUN, "--steps", "200", "--save-every", "1", "--out", str(out)],
                  env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not outdir.list_checkpoints(str(out)):  # a checkpoint: --resume auto would take it
            assert first.poll() is None and time.time() < deadline, "the first run did not start"
            time.sleep(0.1)
        second = run([sys.executable, "train.py", *RUN, "--steps", "200", "--out", str(out), "--resume", "auto"],
                     timeout=120, env=ENV)
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert f"--out {out} is in use by another run (pid {first.pid} on " in second.stderr
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(set(steps))  # one run's records, in order
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        kill_group(first)
    with outdir.Folder.at(str(out)) as folder:
        outdir.lock_out(folder).close()  # the kernel released the dead run's lock


def in_a_small_mount(tmp_path, options: str, *args, keep=None):
    """train.py with --out on a tmpfs of its own (`options`: its size, or ro), unmounted after; with `keep`, also
    what keep(mount point) returns before it goes."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "mnt"
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "ulorl-test", str(mnt)], check=True)
    try:
        p = run([sys.executable, "train.py", *RUN, *args, "--out", str(mnt / "run")], timeout=300, env=ENV)
        return (p, keep(mnt)) if keep else p
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)


@pytest.mark.slow
def test_an_out_without_room_for_one_checkpoint_is_refused_before_the_run(tmp_path):
    # 2 MiB holds the logs but not a checkpoint of the tiny model (3 MB of weights, twice that of AdamW): the run
    # trained, then stopped at its save; now it is refused before anything loads, with the numbers
    p = in_a_small_mount(tmp_path, "size=2m", "--steps", "1")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert re.search(r"2\.0 MiB free, and one checkpoint of this run needs ~9\.\d MiB \(weights 3\.0, "
                     r"optimizer states 6\.\d", p.stderr), p.stderr
    assert "Loading weights" not in p.stderr


@pytest.mark.slow
def test_a_disk_that_fills_says_what_failed_and_what_is_safe(tmp_path):
    """16 MiB holds one checkpoint (9.6 MB) and a warning at the start (--keep-last 1 needs two), not the second
    beside it: that save fails in the optimizer state (torch.save's writer wrapped the refused write in a
    RuntimeError traceback), and the first resumes. The checkpoint's size as the plan counts it: at most 6% over."""
    p = in_a_small_mount(tmp_path, "size=16m", "--steps", "2", "--save-every", "1", "--keep-last", "1",
                         keep=lambda mnt: sum(f.stat().st_size for f in (mnt / "run" / "step_000001").iterdir()))
    p, written = p
    assert "warning: --out" in p.stderr and "--keep-last 1 needs" in p.stderr
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "error: could not write checkpoint" in p.stderr and "No space left on device" in p.stderr
    assert "trainer_state_rank0.pt" in p.stderr and "the newest, step_000001, resumes with --resume auto" in p.stderr
    import config
    from transformers import AutoConfig
    from systems import plan as plan_lib
    shape = plan_lib.Shape.of(AutoConfig.from_pretrained(os.path.join(ROOT, "tiny_ckpt")))
    sizes = plan_lib.checkpoint_bytes(shape, config.parse_config([*RUN, "--steps", "2"]), 1)
    assert written < sum(sizes.values()) < 1.06 * written, (written, sizes)


@pytest.mark.slow
def test_a_read_only_out_says_so(tmp_path):
    p = in_a_small_mount(tmp_path, "ro", "--steps", "1")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "cannot write there (Read-only file system)" in p.stderr


# ------------------------------------------------------------------------ someone else writing into --out
# On a shared file system anyone who can write into --out can put a link, a hard link or a FIFO there while a run
# goes. Each of these sent the run's files elsewhere, cut another file, or hung resume without a message.

def test_a_folder_swapped_for_a_link_while_a_checkpoint_is_written_sends_nothing_elsewhere(tmp_path):
    out_path, outside = tmp_path / "out", tmp_path / "outside"
    out_path.mkdir()
    outside.mkdir()
    with outdir.Folder.at(str(out_path)) as out, out.sub("step_000001.tmp", create=True) as tmp:
        os.rename(out_path / "step_000001.tmp", out_path / "moved")  # the swap, after the folder was made
        os.symlink(outside, out_path / "step_000001.tmp")
        with checkpoint.HashingWriter(tmp, "ulorl_state.json") as f:
            f.write(b"{}")
        checkpoint.write_manifest(tmp, "run-1", 1, {"ulorl_state.json": f.digest()})
        with pytest.raises(ValueError, match="step_000001.tmp was replaced while the checkpoint was written"):
            checkpoint.publish(out, tmp, "step_000001")
    assert os.listdir(outside) == [] and outdir.list_checkpoints(str(out_path)) == []
    assert sorted(os.listdir(out_path / "moved")) == ["manifest.json", "ulorl_state.json"]


def watch_and_swap(folder: str, name: str, target: str) -> threading.Thread:
    """A thread that, the moment `name` appears in `folder` (inotify), moves it away and puts a link to
    `target` in its place: the attack of a second user on a shared --out."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, folder.encode(), 0x100 | 0x80) >= 0  # IN_CREATE | IN_MOVED_TO

    def watch():
        try:
            while True:
                events = os.read(fd, 1 << 16)
                while events:
                    size = struct.unpack_from("iIII", events)[3]
                    created = events[16:16 + size].rstrip(b"\0").decode()
                    events = events[16 + size:]
                    if created == name:
                        os.rename(os.path.join(folder, name), os.path.join(folder, "moved"))
                        os.symlink(target, os.path.join(folder, name))
                        return
        finally:
            os.close(fd)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_save_whose_folder_is_swapped_fails_with_a_message(tmp_path):
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    watch_and_swap(str(out), "step_000001.tmp", str(outside))
    p = run([sys.executable, "train.py", *RUN, "--steps", "1", "--out", str(out)], timeout=300, env=ENV)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "step_000001.tmp" in p.stderr and ("was replaced" in p.stderr or "symbolic link" in p.stderr), p.stderr
    assert os.listdir(outside) == [] and outdir.list_checkpoints(str(out)) == []


@pytest.mark.slow
def test_resume_refuses_a_hard_link_and_a_fifo_at_once(tmp_path):
    """A metrics.jsonl / samples.jsonl hard-linked to another file: resume cut that file back and wrote the
    run's prompts and responses into it. A FIFO at metrics.jsonl: resume waited on it forever, silently."""
    done = tmp_path / "done"
    first = run([sys.executable, "train.py", *RUN, "--steps", "1", "--out", str(done)], timeout=300, env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    linked, piped, other = tmp_path / "linked", tmp_path / "piped", tmp_path / "other.jsonl"
    for copy in (linked, piped):
        shutil.copytree(done, copy)
    other.write_text('{"step": 9, "precious": true}\n' * 3)
    os.remove(linked / "samples.jsonl")
    os.link(other, linked / "samples.jsonl")
    os.remove(piped / "metrics.jsonl")
    os.mkfifo(piped / "metrics.jsonl")
    started = time.monotonic()
    refused = run_many("train.py", [[*RUN, "--steps", "2", "--out", str(d), "--resume", "auto"] for d in (linked, piped)],
                       timeout=120, env=ENV)
    assert time.monotonic() - started < 100
    for p, why in zip(refused, [f"{linked / 'samples.jsonl'} has 2 links", f"{piped / 'metrics.jsonl'} is a FIFO"]):
        assert p.returncode == 1 and "Traceback" not in p.stderr and why in p.stderr, p.stderr[-3000:]
    assert other.read_text() == '{"step": 9, "precious": true}\n' * 3


def test_a_listed_fifo_device_hard_link_or_sparse_file_is_refused_at_once(tmp_path):
    """A FIFO listed in the manifest hung resume; a listed 24 GiB sparse file (its size as listed) took 49 s to
    hash before it was rejected. Every listed file is now checked (a regular file of one link, without holes,
    its size) before any is read."""
    def on_alarm(*_):
        raise TimeoutError("the check waited")
    signal.signal(signal.SIGALRM, on_alarm)
    path = str(tmp_path / "step_000001")
    fake_checkpoint(path)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    state = os.path.join(path, "ulorl_state.json")

    def listed_as(make, size: int) -> str | None:
        os.remove(state)
        make()
        manifest["files"]["ulorl_state.json"]["size"] = size
        json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
        signal.alarm(5)
        try:
            start = time.monotonic()
            why = outdir.problem(path)
            assert time.monotonic() - start < 2.0
            return why
        finally:
            signal.alarm(0)

    assert listed_as(lambda: os.mkfifo(state), 0) == "ulorl_state.json is a FIFO, not a file"
    other = tmp_path / "other"
    other.write_text("{}")
    assert listed_as(lambda: os.link(other, state), 2) == \
        "ulorl_state.json has 2 links (a hard link: writing it would write another file too)"
    os.remove(other)

    def sparse():
        with open(state, "wb") as f:
            f.truncate(24 << 30)
    assert listed_as(sparse, 24 << 30) == "ulorl_state.json has holes (a sparse file): a run writes every byte of a checkpoint"
    if os.geteuid() == 0:  # a device node needs root to make
        assert listed_as(lambda: os.mknod(state, stat.S_IFCHR | 0o600, os.makedev(1, 3)), 0) == \
            "ulorl_state.json is a device, not a file"


def test_checkpoints_are_ordered_by_step_number(tmp_path):
    """step_1000000 sorted before step_999999 as text: --resume auto took the older, and --keep-last 1 deleted the
    newer."""
    out = str(tmp_path)
    for name in ("step_999999", "step_1000000"):
        fake_checkpoint(os.path.join(out, name))
    (tmp_path / outdir.RUNS).write_text('{"runs": ["run-1"]}')
    assert outdir.list_checkpoints(out) == ["step_999999", "step_1000000"]
    assert outdir.find_resume("auto", out) == os.path.join(out, "step_1000000")
    with outdir.Folder.at(out) as folder:
        assert outdir.prune(folder, 1, "run-1") == ["step_999999"]
    assert os.path.isdir(os.path.join(out, "step_1000000"))


# ------------------------------------------------------------------------ the run's folder, held from the start

TINY = ["--steps", "3", "--save-every", "1", "--keep-last", "0", "--eval-data", "", "--train-groups", "1",
        "--prompts-per-step", "2", "--group-size", "2", "--max-response-len", "8", "--segments", "1",
        "--dump-samples", "2"]


@pytest.mark.parametrize("renamed", ["out", "parent"])
def test_renaming_out_or_a_parent_mid_run_redirects_nothing(tmp_path, monkeypatch, renamed):
    """In this process: --out (or the folder above it) renamed after the first checkpoint, and a new folder made
    under the old name. Later checkpoints and records were written by name, into the new folder; now every one
    lands in the folder claimed at start, under its new name, and nothing appears under the old one."""
    import harness
    out = tmp_path / "parent" / "run"
    moved = {"out": tmp_path / "parent" / "moved", "parent": tmp_path / "moved" / "run"}[renamed]
    real_save = checkpoint.save

    def save_then_rename(**kw):
        real_save(**kw)
        if kw["name"] == "step_000001":
            os.rename(out, moved) if renamed == "out" else os.rename(out.parent, moved.parent)
            out.mkdir(parents=True)  # another folder takes the old name
    monkeypatch.setattr(checkpoint, "save", save_then_rename)
    harness.train_run(TINY, out)
    assert os.listdir(out) == []
    assert outdir.list_checkpoints(str(moved)) == ["step_000001", "step_000002", "step_000003"]
    assert all(outdir.problem(str(moved / f"step_00000{i}")) is None for i in (1, 2, 3))
    assert [r["step"] for r in harness.records(moved)] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(moved / "samples.jsonl")] == [1, 1, 2, 2, 3, 3]


def test_every_rank_must_hold_rank_0s_folder(tmp_path):
    """Each trainer rank opens --out itself and writes its optimizer state there: a rank whose --out is another
    folder (another working directory, a link changed between the ranks' starts) is refused, naming it."""
    import train
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with outdir.Folder.at(str(tmp_path / "a")) as a, outdir.Folder.at(str(tmp_path / "b")) as b:
        same = outdir.folder_identity(a)
        outdir.same_folder(a, [same, same])
        other_host = ("node-2", same[1] + 1, same[2])  # a shared file system: another device number there
        outdir.same_folder(a, [same, other_host])
        for wrong in (outdir.folder_identity(b), ("node-2", same[1], outdir.folder_identity(b)[2])):
            with pytest.raises(ValueError, match=f"--out {a.path} is not the same folder on rank 1"):
                outdir.same_folder(a, [same, wrong])


def manifest_run(path) -> str:
    return outdir.read_manifest(str(path))["run"]


def test_resuming_an_older_checkpoint_starts_a_branch_and_auto_continues_the_newest(tmp_path, capsys):
    """In this process: a run of 4 steps resumed from step 2 with --keep-last 1. That resume kept the run id,
    so its prune deleted the step-3 checkpoint it had just written (the first run's step 4 was newer), and
    --resume auto continued the abandoned branch. Now it is a new run id, said at start; the first run's steps
    3-4 move aside (kept, named), the prune keeps what it wrote, and --resume auto continues it, keeping its id."""
    import harness
    out = tmp_path / "run"
    harness.train_run([*TINY, "--steps", "4"], out)
    first = manifest_run(out / "step_000004")
    assert outdir.runs_of(str(out)) == [first]
    capsys.readouterr()
    harness.train_run([*TINY, "--keep-last", "1", "--resume", str(out / "step_000002")], out)
    said = capsys.readouterr().out
    branch = outdir.runs_of(str(out))[1]
    assert outdir.runs_of(str(out)) == [first, branch] and branch != first
    aside = out / f"aside-{branch}"
    assert f"this run is a new branch, run id {branch}; the newer checkpoints (step_000003, step_000004) moved to " \
           f"{aside}/, with a copy of the records" in said
    assert outdir.list_checkpoints(str(aside)) == ["step_000003", "step_000004"]
    assert all(manifest_run(aside / n) == first and outdir.problem(str(aside / n)) is None
               for n in outdir.list_checkpoints(str(aside)))
    assert outdir.list_checkpoints(str(out)) == ["step_000001", "step_000002", "step_000003"]
    assert [manifest_run(out / f"step_00000{i}") for i in (1, 2, 3)] == [first, first, branch]
    steps = lambda path: [json.loads(line)["step"] for line in open(path)]
    assert steps(aside / "metrics.jsonl") == [1, 2, 3, 4] and steps(out / "metrics.jsonl") == [1, 2, 3]
    assert outdir.find_resume("auto", str(out)) == str(out / "step_000003")
    harness.train_run([*TINY, "--steps", "4", "--keep-last", "1", "--resume", "auto"], out)
    assert f"resumed from {out / 'step_000003'} at step 3 (run id {branch})" in capsys.readouterr().out
    assert outdir.runs_of(str(out)) == [first, branch] and manifest_run(out / "step_000004") == branch
    assert outdir.list_checkpoints(str(out)) == ["step_000001", "step_000002", "step_000004"]


def test_resume_auto_refuses_a_checkpoint_copied_in_from_another_out(tmp_path):
    """A checkpoint copied into --out from another run's folder (its manifest intact) was taken by --resume auto
    as this run's newest. Now --resume auto takes only checkpoints of the runs this --out's runs.json lists, and
    stops with one line naming the stranger; resuming it by name, or into an empty --out, still works."""
    import harness
    mine, other = tmp_path / "mine", tmp_path / "other"
    harness.train_run([*TINY, "--steps", "1"], mine)
    harness.train_run([*TINY, "--steps", "2"], other)
    shutil.copytree(other / "step_000002", mine / "step_000002")
    with pytest.raises(ValueError) as e:
        outdir.find_resume("auto", str(mine))
    assert f"--resume auto: {mine / 'step_000002'} was written by run {manifest_run(other / 'step_000002')!r}, " \
           f"not by a run of this --out" in str(e.value) and "\n" not in str(e.value)
    assert outdir.find_resume(str(mine / "step_000002"), str(mine)) == str(mine / "step_000002")
    assert outdir.find_resume(str(other / "step_000002"), str(tmp_path / "empty")) == str(other / "step_000002")


# ------------------------------------------------------------- a planted checkpoint, its manifest made to match
# Whoever can write into --out can put files in a checkpoint and rewrite its manifest to match them: resume then
# trusts the digests. What the libraries would run, hang on or read out of bounds must still end in one line
# naming the file, and run nothing.

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    import harness
    return harness.train_run([*TINY, "--steps", "1"], tmp_path_factory.mktemp("saved") / "run")


def planted(saved_run, tmp_path, files: dict) -> str:
    """A copy of the saved run whose step_000001 holds `files` (name -> bytes or text), the manifest rewritten
    to match."""
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    ckpt = out / "step_000001"
    for name, content in files.items():
        (ckpt / name).write_bytes(content.encode() if isinstance(content, str) else content)
    run_id = outdir.read_manifest(str(ckpt))["run"]
    os.remove(ckpt / "manifest.json")
    with outdir.Folder.at(str(ckpt)) as folder:
        checkpoint.write_manifest(folder, run_id, 1, {})
    assert outdir.find_resume("auto", str(out)) == str(ckpt)  # the digests match: resume trusts it
    return str(out)


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def lying_header(saved_run, how: str) -> bytes:
    with open(os.path.join(saved_run, "step_000001", "model.safetensors"), "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    if how == "huge":
        return (1 << 62).to_bytes(8, "little") + blob[8:]
    header = json.loads(blob[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] += 1 << 30  # a tensor reaching a GiB past the file's end
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + n:]


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"


@pytest.mark.parametrize("attack, name, says", [
    ("pickle", "trainer_state_rank0.pt", "not a file of tensors that loads without running code"),
    ("offsets", "model.safetensors", "spans 1073750528 bytes, not 8704"),
    ("huge header", "model.safetensors", "its header size (4611686018427387904 bytes) does not fit the file"),
    ("auto_map", "config.json", "names code of its own to run (auto_map)"),
    ("loop", "chat_template.jinja", "its chat template ran over 1 s on one prompt"),
    ("include", "chat_template.jinja", "its chat template reads other templates"),
    ("state", "ulorl_state.json", "not the state a run saves")])
def test_a_planted_checkpoint_ends_in_one_line_naming_the_file(saved_run, tmp_path, monkeypatch, attack, name, says):
    """In this process, --resume auto of a checkpoint holding: an optimizer state that is a pickle running a
    command; a safetensors header whose tensor runs past the file's end, or whose header size is 2^62 (tracebacks
    from the library); a config.json naming code of its own beside it (auto_map); a chat template of nested loops
    (it hung resume) or one that includes another file. Each is a ValueError of one line naming the file, within
    seconds, and nothing of it runs."""
    import harness
    import data
    marker = tmp_path / "ran"
    monkeypatch.setattr(data, "TEMPLATE_SECONDS", 1.0)
    with open(os.path.join(saved_run, "step_000001", "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(saved_run, "step_000001", "ulorl_state.json")) as f:
        state = json.load(f)
    evil = tmp_path / "evil.pt"
    torch.save({"optimizer": Evil(marker)}, evil)
    files = {"pickle": {name: evil.read_bytes()},
             "offsets": {name: lying_header(saved_run, "offsets")},
             "huge header": {name: lying_header(saved_run, "huge")},
             "auto_map": {name: json.dumps({**config, "auto_map": {"AutoConfig": "evil.EvilConfig"}}),
                          "evil.py": f"open({str(marker)!r}, 'w')\n"},
             "loop": {name: LOOPS},
             "include": {name: "{% include '/etc/passwd' %}"},
             "state": {name: json.dumps({**state, "pools": {"unfinished": []}})}}[attack]
    out = planted(saved_run, tmp_path, files)

    def hung(*_):
        raise TimeoutError("resume hung")
    signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        with pytest.raises(ValueError) as e:
            harness.train_run([*TINY, "--steps", "2", "--resume", "auto"], out)
    finally:
        signal.alarm(0)
    message = str(e.value)
    assert message.startswith(os.path.join(out, "step_000001", name)) and says in message, message
    assert "\n" not in message and not marker.exists()


def test_a_template_that_loops_is_stopped_in_any_thread(monkeypatch):
    """--overlap draws prompts in the rollout thread, where no signal reaches: the bound holds there too, and a
    rendering that ends in time leaves nothing pending for the code after it."""
    import threading
    import data
    import tiny
    monkeypatch.setattr(data, "TEMPLATE_SECONDS", 0.5)
    tok = tiny.make_tokenizer()
    tok.chat_template = LOOPS
    errors = []

    def draw():
        try:
            data.encode_prompt(tok, "1+2=")
        except ValueError as e:
            errors.append(str(e))
    started = time.monotonic()
    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 3
    assert len(errors) == 1 and "its chat template ran over 0.5 s on one prompt" in errors[0], errors
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for _ in range(3):
        assert data.encode_prompt(tok, "1+2=") == tok("1+2=").input_ids
        time.sleep(0.6)  # past the deadline of the rendering that ended: nothing arrives


def test_a_full_tmpdir_is_named_as_tmpdir_not_out(tmp_path, monkeypatch):
    """In this process: the tokenizer's save_pretrained (which writes into a private folder in TMPDIR, copied
    into the checkpoint after) refused for a full disk at the second save. The message named --out, the folder
    with room, and said to resume once --out could be written; now it names TMPDIR."""
    import errno
    import tempfile
    import harness
    from transformers import PreTrainedTokenizerBase
    tmpdir, out = tmp_path / "tmpdir", tmp_path / "run"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    real, calls = PreTrainedTokenizerBase.save_pretrained, []

    def full(self, path, *args, **kw):
        calls.append(path)
        assert path.startswith(str(tmpdir))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, path, *args, **kw)
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    with pytest.raises(ValueError) as e:
        harness.train_run(TINY, out)
    assert str(e.value) == (f"could not write checkpoint {out / 'step_000002'}: No space left on device (TMPDIR "
                            f"{tmpdir}); the checkpoints before it are intact (the newest, step_000001, resumes "
                            f"with --resume auto once TMPDIR can be written)")
    assert outdir.list_checkpoints(str(out)) == ["step_000001"] and "step_000002.tmp" not in os.listdir(out)
    assert not [n for n in os.listdir(tmpdir) if n.startswith("ulorl_save_")]  # the private folder went too


def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(saved_run, tmp_path):
    """model.safetensors.index.json's weight_map was joined to the folder by FSDP's loader: '../' read a file
    outside it. Now the index may name only the folder's own .safetensors files."""
    import model as model_lib
    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(saved_run, "step_000001"), folder)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model.safetensors"}}))
    model_lib.check_files(str(folder))
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../other/model.safetensors"}}))
    with pytest.raises(ValueError, match=re.escape(f"{index} names ../other/model.safetensors, which is not a "
                                                   f".safetensors file of {folder}")):
        model_lib.check_files(str(folder))
