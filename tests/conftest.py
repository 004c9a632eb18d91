"""Fixtures and helpers shared by test files, and the environment every test runs in: no hub (models and data
are made locally), and no test or process it starts may hang the suite.

    python -m pytest                     # the whole suite, two files at a time; pytest.ini sets a per-test timeout
    python -m pytest -m "not slow"       # without the tests that start a process
    python -m pytest -n 0 tests/X.py     # one file in this process (pdb, prints), at the threads you set
"""
import json
import os
import signal
import subprocess
import sys

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


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and everything it started (torchrun's workers, vLLM's engine, reward workers): it was
    started in a session of its own, so its process group holds them all."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start(cmd: list[str], **kw) -> subprocess.Popen:
    """subprocess.Popen in a process group of its own (cwd: the project): end it with kill_group."""
    return subprocess.Popen(cmd, cwd=kw.pop("cwd", ROOT), start_new_session=True, **kw)


def run(cmd: list[str], timeout: float, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) in a process group of its own, which
    is killed whole when the command ends, times out or the test is interrupted (pytest-timeout): no
    grandchild outlives its test. A command that times out raises subprocess.TimeoutExpired."""
    proc = start(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
        if proc.poll() is None:
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_many(script: str, runs: list[list[str]], timeout: float, env=None) -> list[subprocess.CompletedProcess]:
    """`python SCRIPT ARGS` for each ARGS of `runs`, in one process (tests/entries.py): for commands that stop
    before loading a model, whose cost is mostly Python's start and torch's import. The runs share that process,
    so one that leaves state behind (a loaded model, a changed global) would be seen by the next."""
    p = run([sys.executable, os.path.join(ROOT, "tests", "entries.py"), script, json.dumps(runs)], timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return [subprocess.CompletedProcess([script, *args], r["returncode"], r["stdout"], r["stderr"])
            for args, r in zip(runs, map(json.loads, p.stdout.splitlines()[-len(runs):]))]


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


# the files that take longest on 2 cores, longest first (as timed in a run one file at a time), started first so
# that the two workers of -n 2 end together instead of one finishing a long file alone; the rest follow in pytest's order
LONGEST_FIRST = ["test_distributed", "test_train", "test_moe", "test_bench", "test_engine_gap", "test_overlap",
                 "test_experiments", "test_placement", "test_sequence_parallel", "test_bf16", "test_gpu_check",
                 "test_plan", "test_guide", "test_run_files", "test_vllm", "test_errors", "test_golden"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's tests keep their order
