"""Fixtures and helpers shared by test files, and the environment every test runs in: no hub (models and data
are made locally), and no test or process it starts may hang the suite.

    python -m pytest                     # the whole suite, two files at a time; pytest.ini sets a per-test timeout
    python -m pytest -m "not slow"       # without the tests that start a process
    python -m pytest -n 0 tests/X.py     # one file in this process (pdb, prints), at the threads you set
"""
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: a test that tries fails at once instead of hanging
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, on any machine: --device auto would take a GPU
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest.ini runs two files side by side (pytest-xdist, -n 2): each test and every process it starts takes
    # one thread, since a thread pool that counts on both cores slows 2-20x while its neighbour runs;
    # vLLM's CPU worker would otherwise bind a thread to every core. -n 0 runs one file at a time, as set.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def real_set_num_threads():
    """vLLM's CPU worker, started in this process, replaces torch.set_num_threads with a no-op that only warns,
    for the rest of the process: every later test that sets threads would silently run at whatever was set."""
    yield
    torch.set_num_threads = torch._C.set_num_threads


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and everything it started: its process group (it was started in a session of its own: vLLM's
    engine, reward workers) and every process below it, also those in sessions of their own (torchrun starts each
    worker in one). Returns once they are dead: an --out lock is released only then, and a run started at once on
    the same folder would find it held."""
    import time
    import warm
    tree = warm.kill(proc.pid)
    if proc.poll() is None:
        proc.wait()
    deadline = time.time() + 30
    while any(map(warm.alive, tree)) and time.time() < deadline:
        time.sleep(0.02)


def start(cmd: list[str], warm=True, **kw):
    """subprocess.Popen in a process group of its own (cwd: the project): end it with kill_group. A command that
    run() would run warm (`python SCRIPT`, `-m`, `-c` of the project, torchrun running them) is a WarmChild here
    too, unless `warm` is False."""
    cwd, env = kw.pop("cwd", ROOT), kw.pop("env", None)
    env = dict(os.environ if env is None else env)
    if warm and warm_eligible(cmd, cwd):
        return WarmChild(cmd, cwd, env, **kw)
    workers = warm and warm_workers(cmd, cwd)
    if workers:  # torchrun and its workers, each a child of the warm interpreter
        interpreter = warm_interpreter(env, cwd)
        try:
            return WarmChild(workers, cwd, dict(env, ULORL_WARM_SOCKET=interpreter["socket"]), **kw)
        finally:
            warm_done(interpreter)
    return subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, **kw)


def run(cmd: list[str], timeout: float, cwd=ROOT, env=None, warm=True) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) in a process group of its own, which
    is killed whole when the command ends, times out or the test is interrupted (pytest-timeout): no
    grandchild outlives its test. A command that times out raises subprocess.TimeoutExpired. `python SCRIPT`,
    `-m MODULE` and `-c CODE` of the project, and torchrun running them (its workers too), are children forked
    from a warm interpreter (tests/warm.py) unless `warm` is False."""
    proc = start(cmd, warm=warm, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class WarmChild:
    """`cmd` run as a child of the warm interpreter for `env`, with what the tests use of subprocess.Popen: pid
    (the child's), poll, wait, send_signal, communicate and returncode (negative: the signal that ended it).
    Its streams: PIPE (read by communicate) or none."""

    def __init__(self, cmd: list[str], cwd, env: dict, stdout=None, stderr=None, text=False):
        import tempfile
        import warm
        self.args, self.returncode, self.text, self.error = cmd, None, text, None
        self.stdout = self.stderr = None  # no stream to read while it runs: communicate() returns what it wrote
        self.files = [open(os.devnull, "rb")] + [tempfile.TemporaryFile() if how == subprocess.PIPE
                                                 else open(os.devnull, "wb") for how in (stdout, stderr)]
        self.piped = [stdout == subprocess.PIPE, stderr == subprocess.PIPE]
        interpreter, started, pid = warm_interpreter(env, cwd), threading.Event(), []

        def serve():
            try:
                self.returncode = warm.request(interpreter["socket"], cmd[1:], str(cwd), env,
                                               [f.fileno() for f in self.files],
                                               started=lambda p: (pid.append(p), started.set()))
            except BaseException as e:
                self.error = e
            finally:
                warm_done(interpreter)
                started.set()
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        started.wait()
        if not pid:
            raise RuntimeError(f"the warm interpreter did not run {cmd}") from self.error
        self.pid = pid[0]

    def poll(self):
        return None if self.thread.is_alive() else self.wait()

    def wait(self, timeout=None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.error is not None:
            raise RuntimeError(f"the warm interpreter lost {self.args}") from self.error
        return self.returncode

    def send_signal(self, sig):
        if self.thread.is_alive():
            os.kill(self.pid, sig)

    def communicate(self, timeout=None):
        self.wait(timeout)
        out = []
        for f, piped in zip(self.files[1:], self.piped):
            f.seek(0)
            data = f.read() if piped else None
            if piped and self.text:  # as Popen's text mode reads: universal newlines ("\r" and "\r\n" are "\n")
                data = data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            out.append(data)
        for f in self.files:
            f.close()
        return tuple(out)


# read only while a process runs, never while Python and the libraries start: a warm interpreter serves commands
# that differ from it in these alone; any other difference (threads, Hugging Face's cache, PYTHONPATH) gets one of its own
RUNTIME_ENV = ("PYTEST_", "VLLM_", "ULORL_WARM_SOCKET", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WARM: dict = {}  # environment (less RUNTIME_ENV) -> the warm interpreter started with it
WARM_LIMIT = 2  # each holds torch and transformers in memory (~0.5 GB)
WARM_LOCK = threading.Lock()  # together() asks from several threads at once


def warm_eligible(cmd: list[str], cwd) -> bool:
    """Whether `cmd` is the interpreter running a project's own code from its top folder `cwd` (this checkout, or a
    copy that has tests/warm.py): a script there or a test's own script outside the project, `-m` of the
    benchmarks, or `-c`. (Scripts in the project's subfolders, tests/gpu/ and experiments/, start fresh: they
    find the project's modules themselves.)"""
    root = os.path.realpath(cwd)
    if os.environ.get("ULORL_TESTS_COLD") or len(cmd) < 2 or cmd[0] != sys.executable \
            or not os.path.exists(os.path.join(root, "tests", "warm.py")):
        return False
    if cmd[1] in ("-c", "-m"):
        return len(cmd) >= 3 and (cmd[1] == "-c" or cmd[2].split(".")[0] == "bench")
    folder = os.path.dirname(os.path.realpath(os.path.join(root, cmd[1])))
    return cmd[1].endswith(".py") and (folder == root or not folder.startswith(root + os.sep)
                                       and not os.path.exists(os.path.join(folder, "train.py")))


def warm_workers(cmd: list[str], cwd) -> list[str] | None:
    """`cmd` with tests/warm.py --client before the script, if it is torchrun (python -m torch.distributed.run)
    starting the project's script or `-m bench`: its workers then run as children of a warm interpreter."""
    if os.environ.get("ULORL_TESTS_COLD") or cmd[:3] != [sys.executable, "-m", "torch.distributed.run"]:
        return None
    client = [os.path.join(os.path.realpath(cwd), "tests", "warm.py"), "--client"]
    for i, arg in enumerate(cmd[3:], 3):
        if arg == "-m" or arg.endswith(".py"):  # the script, or torchrun's -m before a module's name
            return [*cmd[:i], *client, *cmd[i:]] if warm_eligible([sys.executable, *cmd[i:]], cwd) else None
    return None


def warm_interpreter(env: dict, root: str) -> dict:
    """The warm interpreter of the project in `root` for `env` ({"proc", "socket", "busy"}), started (and waited
    for: it imports) if none is running; counted busy until warm_done(). One for the tests' own environment stays;
    of the others (a test's Hugging Face cache, a copy of the project), an idle one is stopped when a new one would
    pass WARM_LIMIT."""
    key, own = warm_key(env, root), warm_key(os.environ, ROOT)
    with WARM_LOCK:
        if key not in WARM or WARM[key]["proc"].poll() is not None:
            idle = [k for k, w in WARM.items() if w["busy"] == 0 and k != own]
            for old in idle[:max(0, len(WARM) + 1 - WARM_LIMIT)]:
                kill_group(WARM.pop(old)["proc"])
            WARM[key] = start_warm(env, key[0])
        WARM[key]["busy"] += 1
        return WARM[key]


def warm_key(env, root: str) -> tuple:
    """What a warm interpreter is started with: the project's folder, and the environment but RUNTIME_ENV (and a
    PYTHONPATH of just that folder, which a script of the folder has on its path anyway)."""
    root = os.path.realpath(root)
    return (root, *sorted((k, v) for k, v in env.items() if not k.startswith(RUNTIME_ENV)
                          and not (k == "PYTHONPATH" and os.path.realpath(v) == root)))


def warm_done(interpreter: dict) -> None:
    with WARM_LOCK:
        interpreter["busy"] -= 1


def start_warm(env: dict, root: str) -> dict:
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="ulorl-warm-"), "socket")
    proc = start([sys.executable, os.path.join(root, "tests", "warm.py"), path], warm=False, cwd=root, env=env,
                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.wait()
        raise RuntimeError(f"the warm interpreter did not start (exit {proc.returncode})")
    return {"proc": proc, "socket": path, "busy": 0}


def run_many(script: str, runs: list[list[str]], timeout: float, env=None) -> list[subprocess.CompletedProcess]:
    """`python SCRIPT ARGS` for each ARGS of `runs`, one after another (each a child of the same warm interpreter)."""
    return [run([sys.executable, script, *args], timeout, env=env) for args in runs]


def hub_cache(root, name: str, files: str) -> dict:
    """A Hugging Face cache in `root` that holds the directory `files` as the hub model `name` (what a download
    leaves: models--org--name/snapshots/<commit>/ and refs/main); returns the environment that makes
    transformers, huggingface_hub and vLLM find it there, offline."""
    import shutil
    repo = os.path.join(str(root), "hub", "models--" + name.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(files, os.path.join(repo, "snapshots", commit), dirs_exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    return {"HF_HOME": str(root), "HF_HUB_CACHE": os.path.join(str(root), "hub"), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def one_thread():
    """A 0.8M-parameter model gains nothing from intra-op threads, and on a busy 2-core machine their
    spin-waits cost 5-10x: files that run it in-process use one thread (their `pytestmark`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    import tiny  # here, not at the top: scripts in tests/ import this file without the project on their path
    return tiny.make_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    """A small *random* tiny model (fp32, CPU), shared by a module's tests: those that change weights work on
    a deepcopy. Its next-token distribution is close to uniform over 17 tokens, so EOS (p ~ 1/17 per token)
    ends some responses and the caps end others."""
    import tiny
    return tiny.make_model(tok, seed=0).eval()


FP32_EPS = torch.finfo(torch.float32).eps
WIDEST = 384  # the longest sum in the tiny models' forward and backward: the dense MLP's intermediate size


def close_up_to_order(a: torch.Tensor, b: torch.Tensor, terms: int = WIDEST) -> bool:
    """Whether float32 results agree as two computations of the same sums added in different orders (another
    kernel, packing, thread count, machine) must: reordering an n-term sum moves its rounding by up to about
    n x eps of the terms' magnitude, taken as the largest |b|. `terms`: the longest sum the computation holds."""
    return bool((a - b).abs().max() <= terms * FP32_EPS * b.abs().max())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for process groups a test starts itself)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def together(*calls, at_once: int = 4):
    """Call each of `calls` (functions of no arguments that run processes, as run() does), `at_once` at a time,
    each in a thread of its own, and return their results in order (an exception in one is raised here, after all
    have ended). Independent runs of one-thread processes overlap on the second core instead of queuing, and a
    torchrun run's other ranks idle while rank 0 rolls out; nothing they check may depend on timing."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(at_once, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def spawn(func, world: int, *args, timeout: float = 300) -> None:
    """func(rank, world, *args) in `world` processes at once (a gloo group's ranks), as torch.multiprocessing.spawn
    runs it, but each a child of the warm interpreter instead of a fresh one that imports torch again; `func`
    lives at the top of a test file and `args` are plain values (their repr is Python). Raises if one fails."""
    code = (f"import sys; sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}]; "
            f"import {func.__module__} as m; m.{func.__name__}(int(sys.argv[1]), {world}, *{args!r})")
    procs = together(*(lambda rank=rank: run([sys.executable, "-c", code, str(rank)], timeout)
                       for rank in range(world)), at_once=world)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}: " + proc.stderr[-3000:]


# the files that take longest on 2 cores, longest first (as timed in a run one file at a time), started first so
# that the two workers of -n 2 end together instead of one finishing a long file alone; the rest follow in pytest's order
LONGEST_FIRST = ["test_bench", "test_overlap", "test_experiments", "test_engine_gap", "test_moe", "test_gpu_check",
                 "test_train", "test_bf16", "test_run_files", "test_vllm", "test_distributed", "test_guide", "test_golden",
                 "test_reward", "test_plan", "test_placement", "test_resume", "test_flags", "test_splits"]


def undocumented_metrics(records: list[dict]) -> list[str]:
    """The keys of metrics.jsonl records that docs/outputs.md's table of keys does not list (its first column's
    `code` spans; NAME stands for any one name)."""
    text = open(os.path.join(ROOT, "docs", "outputs.md")).read()
    section = text.split("## Every key of `metrics.jsonl`")[1].split("\n## ")[0]
    listed = [k for line in section.splitlines() if line.startswith("| `")
              for k in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    patterns = [re.compile(re.escape(k).replace("NAME", "[^/]+") + "$") for k in listed]
    return sorted({k for r in records for k in r if not any(p.match(k) for p in patterns)})


# an in-process test (not marked slow) takes seconds: one that runs a minute hangs (a rollout that never ends,
# a loop that never converges) and fails then, not at pytest.ini's 900 s
FAST_TIMEOUT = 60


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's tests keep their order
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAST_TIMEOUT))
