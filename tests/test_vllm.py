"""The vLLM engine, for real (vLLM's CPU build in CI): behaviour log-probs, continuation across weight
updates, and the weight sync that other RL frameworks get wrong (stale prefix cache, tied lm_head on CPU).

    python -m pytest tests/test_vllm.py      # skipped when vLLM is not installed
"""
import copy
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # every test starts a vLLM engine, in this process or in one it starts

import tiny  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from systems.engine import Sampling, VLLMEngine, process_logits  # noqa: E402

SAMPLING = Sampling(temperature=1.0)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The scripts of the last three tests (MIDWAY in both places, SYNCS), each its own mostly single-threaded
    process, started at once and before this process's engine: they run while the in-process tests do.
    {name: future of its CompletedProcess}."""
    from conftest import ROOT, run
    path = tmp_path_factory.mktemp("tiny_tied")
    tok = tiny.make_tokenizer()
    tiny.make_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    # nobind: each engine's worker keeps OMP_NUM_THREADS' one thread instead of binding one to every core, so
    # the three share the cores instead of each spinning on both
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    quiet = {k: v for k, v in env.items() if k != "VLLM_LOGGING_LEVEL"}  # vLLM's own default level
    jobs = {"own": (MIDWAY, ["own"], env), "here": (MIDWAY, ["here"], env), "syncs": (SYNCS, [], quiet)}
    pool = ThreadPoolExecutor(len(jobs))
    futures = {name: pool.submit(run, [sys.executable, "-c", script, str(path), *args], 180, env=e)
               for name, (script, args, e) in jobs.items()}
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, scripts):
    """A random tiny Qwen3 with tied embeddings, saved where vLLM can load it, and an engine on it (after
    `scripts` started theirs)."""
    path = str(tmp_path_factory.mktemp("tiny_random"))
    tok = tiny.make_tokenizer()
    torch.manual_seed(0)
    # vocabulary 512 (ids past the tokenizer's are fine: vLLM does not detokenize here): with 17 the CPU
    # backend does not repack the lm_head, and the tied-weights bug this file guards against would hide
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine = VLLMEngine(path, seed=0, dtype="float32", max_model_len=512, mem=0.25, device="cpu")
    return tok, model, engine


def naive_logprobs(model, prompt, tokens):
    """log_softmax(logits / T) of each sampled token, from one full forward without cache or padding."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return process_logits(logits, SAMPLING).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std())


def prompts(tok, n=6):
    # 140+ tokens: vLLM's CPU KV-cache blocks hold 128, and only whole blocks are reused by a continuation
    return [tok("+".join(str((i * 7 + j) % 9 + 1) for j in range(70 + i)) + "=").input_ids for i in range(n)]


def test_logprobs_match_trainer_across_weight_updates(setup):
    """Three updates: after each, a continued sample's engine log-probs equal the trainer's (1e-4). Fails
    without reset_prefix_cache() (stale KV of the old weights) or without the tied lm_head repack."""
    tok, model, engine = setup
    model = copy.deepcopy(model)
    engine.update_weights(model)
    ps = prompts(tok)
    seqs = [p + g.tokens for p, g in zip(ps, engine.generate(ps, [24] * len(ps), SAMPLING))]
    for update in range(3):
        perturb(model, seed=update)
        engine.update_weights(model)
        gens = engine.generate(seqs, [16] * len(seqs), SAMPLING)
        for seq, g in zip(seqs, gens):
            assert g.tokens, "the random model should not stop at once"
            diff = (naive_logprobs(model, seq, g.tokens) - torch.tensor(g.logprobs)).abs().max().item()
            assert diff < 1e-4, f"update {update}: engine vs trainer log-prob gap {diff:.2e}"
        seqs = [s + g.tokens for s, g in zip(seqs, gens)]


def test_segments_remember_the_policy_that_sampled_them(setup):
    """A sample continued over 3 segments, weights updated between them: each segment's behaviour
    log-probs are those of the weights that were live when it was sampled, and differ from later ones."""
    from segment_rollout import Pools, rollout_step
    tok, model, engine = setup
    model = copy.deepcopy(model)
    engine.update_weights(model)
    pools = Pools()
    group = pools.new_group(prompts(tok, 1)[0], {"answer": "0", "verifier": "tiny"}, size=4)
    snapshots = []
    for version in range(3):
        snapshots.append(copy.deepcopy(model))
        rollout_step(engine, pools, [group] if version == 0 else [], segment_len=8, max_len=64,
                     sampling=SAMPLING, version=version)
        perturb(model, seed=10 + version)
        engine.update_weights(model)
    long = [s for s in group if len(s.seg_starts) == 3]
    assert long, "no sample ran three segments"
    for s in long:
        bounds = s.seg_starts + [len(s.tokens)]
        for v in range(3):
            seg = slice(bounds[v], bounds[v + 1])
            assert s.versions[seg] == [v] * (bounds[v + 1] - bounds[v])
            prefix = s.prompt_ids + s.tokens[:bounds[v]]
            own = naive_logprobs(snapshots[v], prefix, s.tokens[seg])
            assert torch.allclose(own, torch.tensor(s.logprobs[seg]), atol=1e-4)
            if v < 2:  # the newest weights would give other log-probs: SAIS and POIS really differ
                assert (naive_logprobs(model, prefix, s.tokens[seg]) - own).abs().max() > 1e-3


def test_per_sample_budgets_and_seeded_sampling(setup):
    tok, model, engine = setup
    engine.update_weights(model)
    ps = prompts(tok, 4)
    state = engine.rng_state()
    a = engine.generate(ps, [0, 1, 5, 9], SAMPLING)
    assert [len(g.tokens) for g in a][:1] == [0] and all(len(g.tokens) <= m for g, m in zip(a, [0, 1, 5, 9]))
    engine.set_rng_state(state)
    b = engine.generate(ps, [0, 1, 5, 9], SAMPLING)
    assert [g.tokens for g in a] == [g.tokens for g in b]


def test_batch_larger_than_the_token_budget(setup):
    """A rollout batch whose prompts exceed one engine step's token budget (here 100 x 150 tokens) must not
    crash: on CPU, vLLM rewinds a seeded request's generator after a split prefill, which CPU generators
    cannot do, so the engine keeps every prompt whole."""
    tok, model, engine = setup
    engine.update_weights(model)
    ps = [p for p in prompts(tok, 5) for _ in range(20)]
    gens = engine.generate(ps, [2] * len(ps), SAMPLING)
    assert len(gens) == 100 and all(1 <= len(g.tokens) <= 2 for g in gens)


# A trainer whose sync fails midway (an out-of-memory error while gathering the 4th tensor), with the engine in
# this process (CPU, one process) or in a process of its own (argv[2] "own": as on GPUs, over NCCL there)
MIDWAY = """import sys, time
import model as model_lib
import tiny
from systems import distributed
from systems.engine import VLLMEngine
tok = tiny.make_tokenizer()
lm = tiny.make_model(tok)
engine = VLLMEngine(sys.argv[1], seed=0, dtype="float32", max_model_len=256, mem=0.25, device="cpu",
                    own_process=sys.argv[2] == "own")
real = distributed.hf_weights
def failing(module, **kw):
    for i, item in enumerate(real(module, **kw)):
        if i == 3 and not kw.get("on_meta"):
            raise MemoryError("out of memory while gathering (stand-in)")
        yield item
distributed.hf_weights = failing
start = time.time()
try:
    engine.update_weights(lm)
except RuntimeError as e:
    print("failed after", f"{time.time() - start:.1f}", repr(e), repr(e.__cause__), sep="\t", flush=True)
    raise SystemExit(1)
"""


@pytest.mark.parametrize("where", ["own", "here"])
def test_a_sync_that_fails_midway_ends_the_run_with_its_error(scripts, where):
    """The workers wait in the broadcast for tensors that never come: finishing their update, as a failed sync
    used to, waited with them (for --dist-timeout, 30 minutes, on GPUs). Now the engine is torn down and the
    trainer's error ends the run within seconds."""
    import subprocess
    try:
        p = scripts[where].result()
    except subprocess.TimeoutExpired:
        pytest.fail("the failed sync hung")
    assert p.returncode == 1, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("failed after\t"))  # vLLM logs to stdout too
    seconds, error, cause = line.split("\t")[1:]
    assert float(seconds) < 30 and "the weight sync failed while the engine's workers were receiving" in error
    assert ("the rollout engine was shut down" if where == "own" else "the rollout engine holds broken weights") \
        in error and "out of memory while gathering" in cause


# Two syncs of the tiny (tied) model into an in-process engine, then one that leaves a layer's weight out
SYNCS = """import sys
import tiny
from systems import distributed
from systems.engine import VLLMEngine
tok = tiny.make_tokenizer()
lm = tiny.make_model(tok)
engine = VLLMEngine(sys.argv[1], seed=0, dtype="float32", max_model_len=256, mem=0.25, device="cpu")
print("=== syncs", flush=True)
engine.update_weights(lm)
engine.update_weights(lm)
print("=== one left out", flush=True)
real = distributed.hf_weights
distributed.hf_weights = lambda module, **kw: ((n, t) for n, t in real(module, **kw) if "0.mlp.down_proj" not in n)
engine.transfer = None  # metadata taken again
engine.update_weights(lm)
print("=== done", flush=True)
"""


def test_a_sync_prints_vllms_warnings_not_its_expected_ones(scripts):
    """Every sync into vLLM's CPU build printed "RotaryEmbedding: Failed to load weights" and "ParallelLMHead:
    Failed to load weights" between the step lines: a rotary cache and a tied lm_head receive nothing, rightly
    (the engine follows the trainer: test_logprobs_match_trainer_across_weight_updates; an untied lm_head does
    receive its weights: test_moe's engine test). vLLM logs at warning level, those two are dropped, and a layer
    that really missed its weights is still reported."""
    p = scripts["syncs"].result()
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    syncs, left_out = out.split("=== syncs")[1].split("=== one left out")
    assert "Failed to load weights" not in syncs and " INFO " not in syncs, syncs[-2000:]
    assert "RowParallelLinear: Failed to load weights" in left_out.split("=== done")[0], left_out[-2000:]


# train.py whose first weight sync breaks (argv[1]): "killed" kills the engine's processes after the 3rd tensor,
# "raises" sends one tensor in a shape the engine's load_weights refuses, "hangs" stops sending after the 3rd
# (a broadcast that never returns; the watchdog's stall is 5 s here, 60 in a run)
BROKEN_SYNC = """import os, signal, sys, time
import train
from systems import distributed, engine, weight_sync
how = sys.argv.pop(1)
weight_sync.SYNC_STALL_S = 5.0
real_weights, real_update = distributed.hf_weights, engine.VLLMEngine.update_weights
def update(self, lm):
    def broken(module, **kw):
        for i, (name, t) in enumerate(real_weights(module, **kw)):
            if how == "raises" and i == 3:
                t = t.reshape(-1)[:-1]
            yield name, t
            if i == 3 and not kw.get("on_meta"):
                print("broken at", time.time(), flush=True)
                if how == "killed":
                    for pid in self.processes:
                        os.kill(pid, signal.SIGKILL)
                if how == "hangs":
                    time.sleep(3600)
    distributed.hf_weights = broken
    self.transfer = None  # its metadata taken again, through the broken weights
    return real_update(self, lm)
engine.VLLMEngine.update_weights = update
if __name__ == "__main__":  # vLLM's engine process starts by spawn
    train.cli()
"""


@pytest.mark.slow
def test_a_sync_that_breaks_ends_every_rank_of_the_run(tmp_path):
    """An engine killed in the middle of a weight sync (2 ranks under torchrun: the engine in a process of its
    own), a worker that raises in load_weights, and a sync that never returns (one process each): the run ended
    with a traceback and then hung (vLLM's pending call is never failed, and its thread is joined at exit), the
    other ranks waiting in their gathers for --dist-timeout; a worker that raised left the trainer in a broadcast.
    Now each ends the run, every rank, within seconds of the failure, the cause printed once."""
    from conftest import ROOT, run, together
    script = tmp_path / "broken_sync.py"
    script.write_text(BROKEN_SYNC)
    common = ["train.py", "--engine", "vllm", "--steps", "2", "--eval-data", "", "--dump-samples", "0",
              "--train-groups", "2", "--prompts-per-step", "2", "--max-response-len", "16", "--segments", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=ROOT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

    def broken(how, launcher):
        p = run([*launcher, str(script), how, *common[1:], "--out", str(tmp_path / how), "--dist-timeout", "600"],
                timeout=400, cwd=ROOT, env=env, warm=False)
        return p, time.time()
    done = together(lambda: broken("killed", torchrun), lambda: broken("raises", [sys.executable]),
                    lambda: broken("hangs", [sys.executable]))
    for (p, ended), why in zip(done, ["the engine's process died", "failed to load the weights",
                                      "no tensor moved for 5 s"]):
        assert p.returncode != 0, p.stderr[-3000:]
        assert "broken at" in p.stdout, (why, p.stdout[-2000:], p.stderr[-2000:])
        broken_at = float(next(x for x in p.stdout.splitlines() if x.startswith("broken at")).split()[-1])
        assert ended - broken_at < 60, (why, ended - broken_at)
        assert p.stderr.count("error: the weight sync failed") == 1 and why in p.stderr, p.stderr[-3000:]
        if why != "the engine's process died":  # (under torchrun the other rank's gathers then say rank 0 is gone)
            assert "Traceback" not in p.stderr, p.stderr[-3000:]


AMX_PERMISSION = """import ctypes, torch
from systems import weight_sync
granted = ctypes.c_ulong(0)  # arch_prctl(ARCH_GET_XCOMP_PERM): the extended states this process may use
assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(granted)) == 0
print(torch.cpu._is_amx_tile_supported(), bool(granted.value & 1 << 18))  # bit 18: AMX tile data
"""


def test_an_engine_process_may_use_amx_before_its_first_forward():
    """vLLM's CPU attention runs AMX tiles in bf16 on a CPU that has them, without asking Linux first: an engine in
    a process of its own died of SIGILL at its first forward in 5 of 6 starts (the --overlap runs). Importing
    weight_sync, as every engine worker does, asks. A fresh interpreter: a forked one inherits what was granted."""
    from conftest import ROOT, run
    proc = run([sys.executable, "-c", AMX_PERMISSION], timeout=120, cwd=ROOT, warm=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    has_amx, granted = proc.stdout.split()
    assert granted == has_amx, proc.stdout  # granted exactly where the CPU has AMX
