"""Tests for sandbox.py (the code domain's sandbox) and the "code" verifier: hostile programs score 0 and
leave the trainer and the machine as they were; correct programs score 1.

    OMP_NUM_THREADS=1 python -m pytest tests/test_sandbox.py -q
"""
import glob
import json
import os
import socket
import subprocess
import tempfile
import time

import pytest


import reward
import sandbox
from sandbox import code_reward, extract_code, run_program

ADD_ONE = json.dumps({"inputs": ["1\n", "41\n", "-5\n"], "outputs": ["2\n", "42", "-4\n"]})
ONE_TEST = json.dumps({"inputs": [""], "outputs": ["ok"], "timeout": 1.0})


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


def test_extract_code_takes_the_last_block():
    assert extract_code("```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4) without a fence") is None


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


def test_infinite_loop_is_killed_with_its_process():
    start = time.monotonic()
    r = run_program("import os, sys\nprint(os.getpid(), flush=True)\nwhile True: pass", timeout=1.0)
    assert r.status == "timeout" and time.monotonic() - start < 3.0
    with pytest.raises(ProcessLookupError):
        os.kill(int(r.stdout), 0)
    assert code_reward(fenced("while True: pass\nprint('ok')"), ONE_TEST) == 0.0


def test_sleeping_forever_is_killed_on_the_wall_clock():
    start = time.monotonic()  # sleeping uses no CPU time: only the wall-clock timeout catches it
    assert code_reward(fenced("import time\ntime.sleep(1000)\nprint('ok')"), ONE_TEST) == 0.0
    assert time.monotonic() - start < 3.0


def test_allocating_10_gb_fails_inside_the_sandbox():
    assert code_reward(fenced("x = bytearray(10 * 2**30)\nprint('ok')"), ONE_TEST) == 0.0
    r = run_program("x = bytearray(10 * 2**30)")
    assert r.status == "error"


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


@pytest.mark.skipif(os.geteuid() != 0, reason="without root the program runs as the trainer's user and can write "
                                              "that user's files (see sandbox.py)")
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
    assert code_reward(fenced(f"import os\nprint(os.environ.get('ULORL_TEST_SECRET', ''))"), answer) == 0.0


@pytest.mark.skipif(not sandbox.network_isolated(), reason="this kernel refuses network namespaces (see sandbox.py)")
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


def test_code_verifier_runs_in_the_reward_workers():
    items = [("code", fenced("print(int(input()) + 1)"), ADD_ONE), ("code", fenced("while True: pass"), ONE_TEST),
             ("code", fenced("import os\nwhile True: os.fork()"), ONE_TEST), ("code", "no code", ADD_ONE),
             ("code", fenced("print('ok')"), "not json")]
    with pytest.warns(UserWarning, match="1 of 5 reward checks raised"):
        scores, metrics = reward.score_batch(items, timeout=10.0)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert metrics == {"reward/timeouts": 0, "reward/errors": 1}


def sandboxed_pids() -> list[int]:
    """Processes running in a sandbox directory right now."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and "ulorl_sandbox_" in os.readlink(f"/proc/{entry}/cwd"):
                pids.append(int(entry))
        except OSError:  # gone, or not ours to look at
            pass
    return pids


def test_program_dies_with_a_reward_worker_killed_for_its_timeout():
    # the test's own timeout (30 s) outlasts the check's (1 s): the pool kills the worker, and the kernel
    # must kill the program with it (PR_SET_PDEATHSIG), or it would sleep on after the step
    slow = json.dumps({"inputs": [""], "outputs": ["ok"], "timeout": 30})
    start = time.monotonic()
    scores, metrics = reward.score_batch([("code", fenced("import time\ntime.sleep(30)"), slow)], timeout=1.0)
    assert scores == [0.0] and metrics["reward/timeouts"] == 1 and time.monotonic() - start < 5.0
    time.sleep(0.5)
    assert sandboxed_pids() == []
    left = [path for path in glob.glob(os.path.join(tempfile.gettempdir(), "ulorl_sandbox_*_*"))
            if not os.path.exists(f"/proc/{os.path.basename(path).split('_')[2]}")]
    assert left  # the killed worker could not remove its directory ...
    run_program("print(1)")
    assert not any(os.path.exists(path) for path in left)  # ... the next run sweeps it away


@pytest.mark.skipif(not sandbox.network_isolated(), reason="this kernel refuses namespaces (see sandbox.py)")
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
    assert lines[:5] == ["/tmp writable", "/var/tmp OSError", "/dev/shm OSError", "/run/lock OSError", ". writable"]
    assert lines[5] == "big 28"  # ENOSPC: the private /tmp is full at TMP_MB
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        assert not os.path.exists(os.path.join(d, "ulorl_probe_file")), d
    assert not os.path.exists("/tmp/ulorl_probe_big")
