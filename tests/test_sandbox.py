"""Tests for systems/sandbox.py (the code domain's sandbox) and the "code" verifier: hostile programs score 0 and
leave the trainer and the machine as they were; correct programs score 1.

    OMP_NUM_THREADS=1 python -m pytest tests/test_sandbox.py
"""
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest


from conftest import run
import reward
import verifiers
from systems import sandbox
from systems import workers
from systems.sandbox import code_reward, extract_code, run_program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD_ONE = json.dumps({"inputs": ["1\n", "41\n", "-5\n"], "outputs": ["2\n", "42", "-4\n"]})
ONE_TEST = json.dumps({"inputs": [""], "outputs": ["ok"], "timeout": 1.0})


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


def test_extract_code_takes_the_last_block():
    assert extract_code("```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4) without a fence") is None


@pytest.mark.slow
def test_correct_code_scores_one_and_partial_code_a_fraction():
    assert code_reward(fenced("print(int(input()) + 1)"), ADD_ONE) == 1.0
    # right on positive inputs only: 2 of 3 tests
    assert code_reward(fenced("print(abs(int(input())) + 1)"), ADD_ONE) == pytest.approx(2 / 3)
    assert code_reward("print(int(input()) + 1)", ADD_ONE) == 0.0  # no code block
    assert code_reward(fenced("print(int(input()) + 1); raise SystemExit(1)"), ADD_ONE) == 0.0  # exit code counts


def test_bad_answer_is_a_clear_error():
    with pytest.raises(ValueError, match="not JSON"):
        code_reward(fenced("pass"), "{inputs: 1}")
    with pytest.raises(ValueError, match="equal, non-zero"):
        code_reward(fenced("pass"), json.dumps({"inputs": ["1"], "outputs": []}))


@pytest.mark.slow
def test_infinite_loop_is_killed_with_its_process():
    start = time.monotonic()
    r = run_program("while True: pass", timeout=1.0)
    assert r.status == "timeout" and time.monotonic() - start < 3.0
    assert sandboxed_pids() == []  # the program's whole PID namespace went with it
    assert code_reward(fenced("while True: pass\nprint('ok')"), ONE_TEST) == 0.0


@pytest.mark.slow
def test_sleeping_forever_is_killed_on_the_wall_clock():
    start = time.monotonic()  # sleeping uses no CPU time: only the wall-clock timeout catches it
    assert code_reward(fenced("import time\ntime.sleep(1000)\nprint('ok')"), ONE_TEST) == 0.0
    assert time.monotonic() - start < 3.0


@pytest.mark.slow
def test_allocating_10_gb_fails_inside_the_sandbox():
    assert code_reward(fenced("x = bytearray(10 * 2**30)\nprint('ok')"), ONE_TEST) == 0.0
    r = run_program("x = bytearray(10 * 2**30)")
    assert r.status == "error"


@pytest.mark.slow
def test_fork_bomb_cannot_fork_and_the_trainer_still_can():
    bomb = "import os\nwhile True:\n    os.fork()"
    assert code_reward(fenced(bomb + "\nprint('ok')"), ONE_TEST) == 0.0
    assert code_reward(fenced("import threading\nthreading.Thread(target=print).start()\nprint('ok')"),
                       ONE_TEST) == 0.0  # threads count as processes too
    assert code_reward(fenced("import subprocess\nprint(subprocess.check_output(['echo', 'ok']).decode())"),
                       ONE_TEST) == 0.0
    assert subprocess.run(["true"], timeout=10).returncode == 0  # RLIMIT_NPROC is per user: the trainer must not be hit
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_output_flood_is_capped_by_the_file_size_limit():
    start = time.monotonic()
    r = run_program("while True: print('x' * 10000)", timeout=5.0, file_mb=1)
    assert r.status == "error" and len(r.stdout) <= 1 << 20 and time.monotonic() - start < 5.0


def test_cannot_write_outside_its_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    code = (f"open({str(victim)!r}, 'w').write('pwned')\n"
            f"open({str(tmp_path / 'new.txt')!r}, 'w').write('pwned')\n"
            "open('here.txt', 'w').write('fine')\nprint('ok')")
    assert code_reward(fenced(code), ONE_TEST) == 0.0
    assert victim.read_text() == "precious" and not (tmp_path / "new.txt").exists()
    assert code_reward(fenced("open('here.txt', 'w').write('fine')\nprint(open('here.txt').read() and 'ok')"),
                       ONE_TEST) == 1.0  # its own directory is writable


def test_environment_secrets_are_not_inherited(monkeypatch):
    secret = "ulorl-test-secret-31337"
    monkeypatch.setenv("ULORL_TEST_SECRET", secret)
    code = ("import os\n"
            "found = [v for v in os.environ.values() if 'secret' in v]\n"
            f"for pid in (os.getppid(), {os.getpid()}):\n"
            "    try:\n"
            "        found.append(open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace'))\n"
            "    except OSError as e:\n"
            "        print('denied', pid)\n"
            "print(' '.join(found))")
    r = run_program(code)
    assert r.status == "ok" and secret not in r.stdout, r.stdout[:500]
    answer = json.dumps({"inputs": [""], "outputs": [secret]})
    assert code_reward(fenced("import os\nprint(os.environ.get('ULORL_TEST_SECRET', ''))"), answer) == 0.0


def test_no_network_connection_reaches_a_local_listener():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))  # the only address this test ever contacts: its own listener
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "s.sendall(b'hello')\nprint('ok')")
        assert code_reward(fenced(code), ONE_TEST) == 0.0
        with pytest.raises(socket.timeout):
            listener.accept()
    # the same program does reach it outside the sandbox: the listener itself works
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname(), timeout=1):
            conn, _ = listener.accept()
            conn.close()


@pytest.mark.slow
def test_code_verifier_runs_in_the_reward_workers():
    items = [("code", fenced("print(int(input()) + 1)"), ADD_ONE), ("code", fenced("while True: pass"), ONE_TEST),
             ("code", fenced("import os\nwhile True: os.fork()"), ONE_TEST), ("code", "no code", ADD_ONE),
             ("code", fenced("print('ok')"), "not json")]
    with pytest.warns(UserWarning, match="1 of 5 reward checks raised"):
        scores, metrics = reward.score_batch(workers.run, items, timeout=10.0)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert metrics == {"reward/timeouts": 0, "reward/errors": 1}


def sandboxed_pids() -> list[int]:
    """Sandboxed programs running right now: processes whose command line is the sandbox's launcher."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and sandbox.LAUNCHER.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                pids.append(int(entry))
        except OSError:  # gone
            pass
    return pids


@pytest.mark.slow
def test_program_dies_with_a_reward_worker_killed_for_its_timeout():
    # the test's own timeout (30 s) outlasts the check's (1 s): the pool kills the worker, and the kernel
    # must kill the program with it (PR_SET_PDEATHSIG), or it would sleep on after the step
    slow = json.dumps({"inputs": [""], "outputs": ["ok"], "timeout": 30})
    start = time.monotonic()
    items = [("code", fenced("import time\ntime.sleep(30)"), slow)]
    scores, metrics = reward.score_batch(workers.run, items, timeout=1.0)
    assert scores == [0.0] and metrics["reward/timeouts"] == 1 and time.monotonic() - start < 5.0
    time.sleep(0.5)
    assert sandboxed_pids() == []
    # the killed worker could not remove its folders (the program's, its copy of bwrap): the pool did
    left = [path for pattern in ("ulorl_sandbox_*_*", "ulorl_bwrap_*_*")
            for path in glob.glob(os.path.join(tempfile.gettempdir(), pattern))
            if not os.path.exists(f"/proc/{os.path.basename(path).split('_')[2]}")]
    assert left == []


def test_only_a_private_size_limited_tmp_is_writable_and_nothing_outlives_the_check():
    """The program may write only its own /tmp (a tmpfs of sandbox.TMP_MB, its working directory): the
    machine's world-writable directories stay untouched, and nothing it wrote is left after the check."""
    places = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "."]
    code = ("import os\n"
            f"for d in {places!r}:\n"
            "    try:\n"
            "        open(os.path.join(d, 'ulorl_probe_file'), 'w').write('x')\n"
            "        print(d, 'writable')\n"
            "    except OSError as e:\n"
            "        print(d, type(e).__name__)\n"
            "try:\n"
            f"    open('/tmp/ulorl_probe_big', 'wb').write(b'x' * ({sandbox.TMP_MB} + 8 << 20))\n"
            "    print('big written')\n"
            "except OSError as e:\n"
            "    print('big', e.errno)\n")
    r = run_program(code, timeout=10.0, file_mb=256, memory_mb=2048)
    assert r.status == "ok", r
    lines = r.stdout.splitlines()
    assert lines[0] == "/tmp writable" and lines[4] == ". writable"
    assert all(line.split()[1] in ("OSError", "FileNotFoundError", "PermissionError") for line in lines[1:4]), lines
    assert lines[5] == "big 28"  # ENOSPC: the private /tmp is full at TMP_MB
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        assert not os.path.exists(os.path.join(d, "ulorl_probe_file")), d
    assert not os.path.exists("/tmp/ulorl_probe_big")


# ------------------------------------------------------------------------ attacks a policy might write
# Each of these raised a sample's reward, or lowered another's, before the sandbox ran programs in bubblewrap.

def run_at_once(programs: list[str], timeout: float = 10.0) -> list:
    """Run the programs concurrently, as two reward workers do; the first is started 0.2 s before the rest."""
    with ThreadPoolExecutor(len(programs)) as pool:
        futures = []
        for i, code in enumerate(programs):
            futures.append(pool.submit(run_program, code, "", timeout))
            if i == 0:
                time.sleep(0.2)
        return [f.result() for f in futures]


@pytest.mark.slow
def test_concurrent_programs_can_neither_see_nor_kill_each_other():
    """The victim sleeps while the attacker reads every /proc entry it can find and then kills every process
    it may signal. Both print the wall clock (shared by all namespaces) at start and end: the test checks that
    they really overlapped, since isolated programs can share no barrier."""
    marker = f"victim-{uuid.uuid4().hex}"
    victim = f"# {marker}\nimport time\nstart = time.time()\ntime.sleep(2.5)\nprint(start, time.time())\nprint('alive')"
    attacker = ("import os, signal, time\n"
                "start = time.time()\n"
                "end, stolen = start + 1.5, set()\n"
                "while time.time() < end:\n"
                "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
                "        for path in (f'/proc/{pid}/cwd/main.py', f'/proc/{pid}/cmdline'):\n"
                "            try:\n"
                "                stolen.add(open(path).read())\n"
                "            except OSError:\n"
                "                pass\n"
                "try:\n"
                "    os.kill(-1, signal.SIGKILL)  # every process this user may signal\n"
                "except OSError:\n"
                "    pass\n"
                "print(start, time.time())\n"
                "print('\\n'.join(stolen))")
    kept, attacked = run_at_once([victim, attacker])
    assert kept.status == "ok" and kept.stdout.splitlines()[1] == "alive", kept
    assert attacked.status == "ok" and marker not in attacked.stdout
    (v_start, v_end), (a_start, a_end) = (map(float, r.stdout.splitlines()[0].split()) for r in (kept, attacked))
    assert v_start < a_start and a_end < v_end, "the attack did not run while the victim was alive"


def test_the_data_and_the_trainers_command_line_are_out_of_reach():
    """The reference answers live in files the trainer reads and name in its command line: a program that
    reads them can print the expected output."""
    marker = f"expected-output-{uuid.uuid4().hex}"
    secret = os.path.join(ROOT, f".test-sandbox-{marker}.jsonl")  # where a dataset would be: in the project
    with open(secret, "w") as f:
        f.write(marker)
    os.chmod(secret, 0o644)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", secret])  # '--data PATH'
    try:
        code = ("import os\n"
                f"found = [open({secret!r}).read()] if os.path.exists({secret!r}) else []\n"
                "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
                "    try:\n"
                "        found.append(open(f'/proc/{pid}/cmdline').read())\n"
                "    except OSError:\n"
                "        pass\n"
                f"print('found' if any({marker!r} in x for x in found) else 'nothing', os.path.exists({ROOT!r}))")
        r = run_program(code)
        assert (r.status, r.stdout) == ("ok", "nothing False\n"), r
    finally:
        holder.kill()
        holder.wait()
        os.remove(secret)


LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nerr = lambda: os.strerror(ctypes.get_errno())\n"


def syscall(name: str) -> int:
    import pyseccomp
    return pyseccomp.resolve_syscall(pyseccomp.system_arch(), name)


def test_memory_outside_the_limits_is_refused():
    """SysV shared memory and memfds held memory outside RLIMIT_AS (2.1 GB in one check), and bwrap's root
    tmpfs was writable without a bound (1.95 GB in 0.6 s): each is refused now."""
    code = LIBC + ("libc.shmat.restype = ctypes.c_void_p\n"
                   "print('shm', libc.shmget(0x51A7, 1 << 20, 0o1666), err())\n"  # IPC_CREAT | 0666
                   f"print('memfd', libc.syscall({syscall('memfd_create')}, b'x', 0), err())\n"
                   "for path in ('/pwn', '/usr/pwn', '/proc/pwn', '/dev/pwn'):\n"
                   "    try:\n"
                   "        open(path, 'w').write('x')\n"
                   "        print(path, 'written')\n"
                   "    except OSError as e:\n"
                   "        print(path, 'refused')\n")
    r = run_program(code)
    assert r.status == "ok", r
    assert r.stdout.splitlines()[:2] == ["shm -1 Operation not permitted", "memfd -1 Operation not permitted"]
    assert r.stdout.splitlines()[2:] == [f"{p} refused" for p in ("/pwn", "/usr/pwn", "/proc/pwn", "/dev/pwn")]


def test_the_program_is_alone_and_cannot_ptrace():
    """bwrap's own init (pid 1) had no limits and could be ptraced: code injected there forked past RLIMIT_NPROC
    0 and wrote past the output cap. Now the program is pid 1 itself, the only process it can see, and ptrace,
    process_vm_writev, io_uring and userfaultfd are refused."""
    code = LIBC + ("print(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                   "for pid in range(1, 64):\n"
                   "    if libc.ptrace(16, pid, None, None) == 0:\n"  # PTRACE_ATTACH
                   "        print('attached', pid)\n"
                   f"print('io_uring', libc.syscall({syscall('io_uring_setup')}, 8, ctypes.create_string_buffer(120)), "
                   f"err())\n"
                   f"print('userfaultfd', libc.syscall({syscall('userfaultfd')}, 0), err())\n")
    r = run_program(code)
    assert r.status == "ok", r
    assert r.stdout.splitlines() == ["1 [1]", "io_uring -1 Operation not permitted",
                                     "userfaultfd -1 Operation not permitted"], r.stdout


def test_the_trainers_keyring_is_out_of_reach_and_checks_share_none():
    """A key in the trainer's session keyring was readable from the sandbox, and a program could plant one that
    a later check read. The trainer here is a process of its own (its keyring is its own)."""
    name = f"ulorl-test-{uuid.uuid4().hex}"
    probe = LIBC + (f"print(libc.syscall({syscall('request_key')}, b'user', b'{name}', None, 0), err())\n"
                    f"print(libc.syscall({syscall('add_key')}, b'user', b'{name}-planted', b'x', 1, -3), err())\n"
                    f"print(libc.syscall({syscall('request_key')}, b'user', b'{name}-planted', None, 0), err())\n")
    trainer = ("import ctypes, json, sys\nfrom systems import sandbox\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               f"assert libc.syscall({syscall('add_key')}, b'user', b'{name}', b'HF_TOKEN', 8, -3) > 0\n"  # session
               "print(json.dumps([sandbox.run_program(sys.argv[1]).stdout for _ in range(2)]))")
    p = run([sys.executable, "-c", trainer, probe], timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    refused = "-1 Operation not permitted"
    assert json.loads(p.stdout) == ["\n".join([refused] * 3) + "\n"] * 2, p.stdout


def test_no_host_path_is_visible_inside():
    """The program's mounts and the command lines it can read named the runner's temporary directories
    (/tmp/ulorl_sandbox_<pid>_..., the bwrap copy's path)."""
    code = ("import os\n"
            "seen = open('/proc/self/mountinfo').read()\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    seen += open(f'/proc/{pid}/cmdline').read()\n"
            f"print('ulorl_' in seen, {tempfile.gettempdir() + '/'!r} in seen)\n")
    r = run_program(code)
    assert (r.status, r.stdout) == ("ok", "False False\n"), r


def test_only_local_and_ip_sockets_open():
    """The program opened AF_VSOCK sockets: on a VM-hosted GPU machine, a channel to the host that the network
    namespace does not cover. Every family but AF_UNIX, AF_INET and AF_INET6 is refused by the filter now."""
    code = ("import socket\n"
            "for name, family, kind in (('vsock', 40, 1), ('netlink', 16, 3), ('unix', 1, 1), ('inet', 2, 1)):\n"
            "    try:\n"
            "        socket.socket(family, kind).close()\n"
            "        print(name, 'opened')\n"
            "    except OSError as e:\n"
            "        print(name, e.errno)\n")
    r = run_program(code)
    assert (r.status, r.stdout.split("\n")) == ("ok", ["vsock 97", "netlink 97", "unix opened", "inet opened", ""]), r


def test_the_tmp_holds_a_bounded_number_of_files():
    """Empty files cost no bytes of /tmp's size but kernel memory no limit counted: 126,000 in one check took
    156 MB. /tmp now holds sandbox.TMP_INODES files and folders."""
    code = ("n = 0\n"
            "try:\n"
            "    while True:\n"
            "        open(f'/tmp/{n}', 'w').close()\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print(n, e.errno)\n")
    r = run_program(code, timeout=10.0)
    made, code = map(int, r.stdout.split())
    assert r.status == "ok" and made < sandbox.TMP_INODES and code == 28, r  # ENOSPC


def test_a_nested_user_namespace_cannot_escape_the_limits():
    """unshare(NEWUSER | NEWNS) and a tmpfs of its own would write memory past /tmp's size and RLIMIT_AS."""
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "ok = libc.unshare(0x10000000 | 0x00020000) == 0\n"
            "print('unshared' if ok else 'refused', os.strerror(ctypes.get_errno()) if not ok else '')\n"
            "if ok:\n"
            "    os.makedirs('/tmp/m', exist_ok=True)\n"
            "    print('mounted', libc.mount(b'x', b'/tmp/m', b'tmpfs', 0, b'size=64m') == 0)")
    r = run_program(code)
    assert r.status == "ok" and r.stdout.startswith("refused"), r


def test_a_non_root_trainer_gets_the_same_isolation():
    """CI runs as root: the trainer's side drops to `nobody` here, with the system's python3 (the pyenv under
    /root is out of its reach), a copy of bwrap it can run, and systems/sandbox.py and pyseccomp copied where it can
    read them (the clone may sit in a folder `nobody` cannot enter, as `mktemp -d` makes)."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.path.exists(python):
        pytest.skip("needs root to drop privileges, and /usr/bin/python3")
    import pyseccomp
    bwrap = sandbox._bwrap()  # as root: a copy that `nobody` may run, as every root trainer's worker makes
    home = os.path.dirname(os.path.dirname(os.path.dirname(bwrap)))
    code = tempfile.mkdtemp(prefix="ulorl_test_nobody_")
    for module in (sandbox, pyseccomp):
        shutil.copy(module.__file__, code)
    for d, _, names in os.walk(code):
        os.chmod(d, 0o755)
        for name in names:
            os.chmod(os.path.join(d, name), 0o644)
    probe = ("import sandbox\n"
             "r = sandbox.run_program(\"import os\\nprint(os.getuid(), len([p for p in os.listdir('/proc') "
             "if p.isdigit()]), os.path.exists('/work'), os.path.exists('/etc'))\")\n"
             "print(r.status, r.stdout.strip())")
    env = {"PATH": os.path.dirname(bwrap) + ":/usr/bin:/bin", "PYTHONPATH": code}

    def drop():
        os.setgroups([])
        os.setgid(sandbox.NOBODY)
        os.setuid(sandbox.NOBODY)

    try:
        p = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, env=env, cwd="/",
                           preexec_fn=drop)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(code, ignore_errors=True)
    assert p.returncode == 0, p.stderr[-2000:]
    uid, processes, work, etc = p.stdout.split()[1:]
    assert p.stdout.startswith("ok ") and uid == "65534" and processes == "1" and work == etc == "False", p.stdout


def test_the_sandbox_works_under_the_trainers_umask():
    """train.py runs under umask 077 (its files hold the data's answers): the program's file must still be
    readable by `nobody`, in the probe as in every run. A fresh process: the probe runs once per process."""
    code = ("import os\nos.umask(0o077)\nfrom systems import sandbox\n"
            "print(sandbox.available(), sandbox.run_program('print(6 * 7)').stdout.strip())")
    p = run([sys.executable, "-c", code], timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stdout == "None 42\n", p.stdout + p.stderr[-2000:]


@pytest.mark.slow
def test_a_run_with_code_rows_starts(tmp_path):
    """train.py checks, before training, that code can run isolated (in the trainer, under its umask)."""
    rows = tmp_path / "code.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": ADD_ONE, "verifier": "code"}) + "\n"
                            for i in range(4)))
    p = run([sys.executable, "train.py", "--data", str(rows), "--eval-data", "", "--steps", "1",
             "--dynamic-sampling", "false", "--train-groups", "2", "--prompts-per-step", "2", "--dump-samples", "0",
             "--out", str(tmp_path / "out")], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
def test_reasoning_gym_scores_from_a_virtual_environment(tmp_path):
    """A venv made as the README says (`python3 -m venv`) holds packages its base interpreter does not see: the
    scorer server ran the base interpreter (the venv's python resolved to its target), without them, so every
    check scored 0 and `--data rg:NAME` was refused. The venv here (under the temporary folder, as a clone made by
    `mktemp -d` would be, which the sandbox's own /tmp hid) holds a scorer module of its own that imports another
    on first use (under the guard, which took modules below /tmp for an answer's code), and reaches this
    environment's packages through a .pth file instead of installing them again."""
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], timeout=120, warm=False)
    assert made.returncode == 0, made.stderr[-2000:]
    python = str(venv / "bin" / "python")
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60, warm=False)
    site = site.stdout.strip()
    ours = [p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]
    with open(os.path.join(site, "ulorl_test.pth"), "w") as f:
        f.write("\n".join(ours) + "\n")
    with open(os.path.join(site, "ulorl_venv_scorer.py"), "w") as f:  # in the venv only, importing on first use
        f.write("def make(key):\n"
                "    def score(answer, entry):\n"
                "        import ulorl_venv_compare\n"
                "        return ulorl_venv_compare.same(answer, key)\n"
                "    return score\n")
    with open(os.path.join(site, "ulorl_venv_compare.py"), "w") as f:
        f.write("def same(a, b):\n    return float(a == b)\n")
    code = ("import json, sys\nimport data, verifiers\nfrom systems import sandbox\n"
            "server = sandbox.Server('ulorl_venv_scorer:make')\n"
            "print(server.call('ok', ['ok', {}], ['ok', {}], set()), server.call('ok', ['no', {}], ['ok', {}], set()))\n"
            "row = data.rg_rows('rg:countdown:4', 0)[0]\n"
            "gold = json.loads(row['answer'])['answer']\n"
            "print(sys.prefix, verifiers.rg_reward(f'<answer>{gold}</answer>', row['answer']))")
    p = run([python, "-c", code], timeout=300, warm=False, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["1.0", "0.0", str(venv), "1.0"], p.stdout


# ------------------------------------------------------------------------ answers read as code (Reasoning Gym)

SYMPY = frozenset(verifiers.SYMPY_NAMES)


@pytest.mark.parametrize("source", [
    "Integer (2 )*Symbol ('x' )**Integer (2 )+Integer (3 )",  # what sympy's parse_expr makes of 2*x**2+3
    "sqrt (Integer (2 ))/Integer (2 )+pi *I", "[1, 2, (3, -4.5)]", "{'a': [1.5e3, None]}", b"1+1",
    "from sympy import *", "Symbol ('x' )**Integer (10000 )", "factorial (Integer (10000 ))", "2**(3*x)",
])
def test_arithmetic_and_literals_pass_the_guard(source):
    assert sandbox.refusal(source, SYMPY | {"I"}) is None


@pytest.mark.parametrize("source, why", [
    # the answer of the keyword attack, as parse_expr hands it to eval: Function's keywords become methods
    ("Function ('f',__eq__ =lambda S ,N :True ,__hash__ =lambda S :True )", "keyword arguments"),
    ("Function ('F')(Integer (1 ))", "calls a Call"), ("Function ('F')", "names 'Function'"),
    ("Integer (8 )*Integer (0_0 )+Integer (1_64 )", "underscore"),  # countdown's number check read no 1_64
    ("oracle_answer .split ()", "calls a Attribute"), ("x.diff(x)", "calls a Attribute"),
    ("sqrt(*[4])", "Starred"), ("{**x}", "unpacks"), ("lambda: 1", "Lambda"), ("[i for i in x]", "ListComp"),
    ("(1).__class__", "Attribute"), ("x[0]", "Subscript"), ("1 if x else 2", "IfExp"), ("x == x", "Compare"),
    ("import os", "not one expression"), ("__import__('os')", "names '__import__'"),
    # arithmetic evaluated as it is parsed, for seconds: each bound on both sides (the passing side above)
    ("Integer (9 )**Integer (9 )**Integer (9 )", "power of a power"), ("x**(10*10*10*10*10)", "power past 10000"),
    ("Symbol ('x' )**Integer (10001 )", "power past 10000"), ("1 << 10**6", "power of a power"),
    ("factorial (Integer (10001 ))", "factorial of more than 10000"), ("binomial(10**9, 5)", "binomial of more"),
])
def test_code_in_an_answer_is_refused_by_its_structure(source, why):
    assert why in (sandbox.refusal(source, SYMPY) or "")


@pytest.mark.slow
def test_sympy_answers_that_evaluate_for_seconds_score_nothing_in_time():
    """Through the reward pool, as training scores them: 9**9**9 on a polynomial_multiplication row ran to the 5 s
    timeout, factorial(10**9) for 10 s, x**(10**10) on an integration row 2 s. Refused by the guard, each is a
    counted error at once, never a timeout; the rows' own answers still score 1.0."""
    import data
    poly = data.rg_rows("rg:polynomial_multiplication:2", seed=0)
    integration = data.rg_rows("rg:simple_integration:2", seed=0)
    items = [("rg", f"<answer>{a}</answer>", row["answer"]) for row in poly
             for a in ("9**9**9", "factorial(10**9)", "x**(10**10)")]
    items += [("rg", "<answer>x**(10**10)</answer>", row["answer"]) for row in integration]
    golds = [("rg", f"<answer>{json.loads(row['answer'])['answer']}</answer>", row["answer"]) for row in poly + integration]
    start = time.monotonic()
    scores, metrics = reward.score_batch(workers.run, items + golds, timeout=5.0, workers=2)
    assert scores == [0.0] * len(items) + [1.0] * len(golds) and metrics["reward/timeouts"] == 0, (scores, metrics)
    assert time.monotonic() - start < 30, "a check ran for seconds"


def test_a_program_printing_what_the_prompt_shows_earns_nothing(tmp_path):
    """A code row's prompt often shows a test (input 3, output 4): a program that prints 4 passed it and earned
    that test's share without solving. Such a row counts only when every test passes; a row whose tests the
    prompt does not show keeps its per-test credit."""
    import data
    tests = {"inputs": ["3", "10"], "outputs": ["4", "11"]}
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": tests, "verifier": "code"}) + "\n" for p in (
        "Read n and print n+1. Example: input 3, output 4.", "Read n and print n+1.")))
    shown, hidden = data.load_rows(str(path))
    assert sandbox.visible_tests(shown["prompt"], hidden["answer"]) == 1 and json.loads(shown["answer"])["full_marks"]
    assert "full_marks" not in json.loads(hidden["answer"])
    items = [("code", fenced(program), row["answer"]) for row in (shown, hidden)
             for program in ("print(4)", "print(int(input()) + 1)")]
    scores, metrics = reward.score_batch(workers.run, items, timeout=20)
    assert scores == [0.0, 1.0, 0.5, 1.0] and metrics["reward/errors"] == 0, (scores, metrics)
    with pytest.raises(ValueError, match="'full_marks' must be true or false"):
        sandbox.parse_tests(json.dumps({**tests, "full_marks": "yes"}))
