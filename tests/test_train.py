"""The real entry point as a subprocess with a tiny budget: the metrics.jsonl / samples.jsonl / checkpoint
contracts that outside tools rely on, the CLI flags, and clear errors on bad data.

    python -m pytest tests/test_train.py
"""
import json
import os
import sys

import pytest

from conftest import hub_cache, run, run_many, undocumented_metrics
import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTRACT_FLAGS = ["--model", "--data", "--steps", "--out", "--resume", "--seed", "--preset", "--engine", "--segments",
                  "--max-response-len", "--is-mode", "--mpt-tau", "--mpt-sigma", "--kl-coef", "--ref-reset-every",
                  "--rollout-gpus", "--save-every", "--eval-every"]
METRIC_KEYS = ["step", "time/step_s", "reward/mean", "entropy/mean", "mpt/masked_frac", "rollout/unfinished",
               "tokens/generated"]


def run_train(*args, timeout=300, warm=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tests may run beside each other on 2 cores
    return run([sys.executable, "train.py", *args], cwd=ROOT, timeout=timeout, env=env, warm=warm)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # 4 segments of 8 tokens: many samples need more than one step, so the unfinished pool is exercised;
    # kl-coef and ref-reset-every exercise the reference model and its reset.
    p = run_train("--steps", "3", "--out", str(out), "--eval-n", "32", "--eval-every", "2", "--train-groups", "4",
                  "--prompts-per-step", "8", "--max-response-len", "32", "--segments", "4", "--kl-coef", "0.01",
                  "--ref-reset-every", "2", "--save-every", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_help_lists_contract_flags():
    # a fresh interpreter (the other runs are forked from one that imported the project): train.py's imports
    # work in the order its own code makes them
    p = run_train("--help", timeout=60, warm=False)
    assert p.returncode == 0
    for flag in CONTRACT_FLAGS:
        assert flag in p.stdout, flag


@pytest.mark.slow
def test_help_answers_before_torch_loads():
    """config.py loads no torch, transformers or project module, so `--help` (and a value a flag's own check
    refuses) answers at once; --help lists the algorithm's flags first, under their headings, and the systems' last."""
    p = run([sys.executable, "-c", "import sys, config; print(sorted({'torch', 'transformers', 'data', 'tiny', "
             "'verifiers'} & set(sys.modules)))"], cwd=ROOT, timeout=60, warm=False)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
    p = run_train("--help", timeout=60, warm=False)
    headings = [line[:-1] for line in p.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[1:4] == ["run", "rollout (UloRL 3.1)", "loss (GRPO + DAPO's token-level loss; UloRL 3.1-3.2; ProRL)"]
    assert [h.split(":")[0] for h in headings[-2:]] == ["systems", "systems"]
    assert p.stdout.index("--mpt-tau") < p.stdout.index("--parallel") < p.stdout.index("--routing-replay")


def test_the_flags_defaults_name_what_their_modules_hold():
    """config.py names the built-in warm start without loading tiny.py (the verifiers: tests/test_registry.py)."""
    import tiny
    assert config.TINY_CKPT == tiny.CKPT


@pytest.mark.slow
def test_metrics_contract(short_run):
    out, p = short_run
    recs = records(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert undocumented_metrics(recs) == []  # docs/outputs.md lists every key a run writes
    assert 0 <= recs[0]["eval/accuracy"] <= 1 and "config" in recs[0]  # before any update
    for r in recs[1:]:
        for k in METRIC_KEYS:
            assert isinstance(r[k], (int, float)), (r["step"], k)
        assert r["tokens/generated"] > 0 or r["rollout/rounds"] == 0
    assert "eval/accuracy" in recs[2] and "eval/accuracy" in recs[3] and "eval/accuracy" not in recs[1]
    assert recs[2]["train/ref_reset"] == 1
    for r in recs[1:]:  # how stale the trained tokens were: whole numbers of policy versions
        assert 0 <= r["staleness/token_mean"] <= r["staleness/token_max"] <= r["step"] - 1
        assert 0 <= r["staleness/last_segment_mean"] <= r["staleness/last_segment_max"] <= r["step"] - 1
    assert recs[1]["staleness/token_max"] == 0 and recs[3]["staleness/token_max"] >= 1
    assert "eval accuracy" in p.stdout and "step     3" in p.stdout
    # piped, no evaluation progress bar: its carriage returns would glue it to the step line that follows (read as
    # text, a "\r" is a line end already: the bar's unit is what shows it)
    assert "problem/s" not in p.stdout + p.stderr
    assert [line.split("|")[0].split()[1] for line in p.stdout.splitlines() if line.startswith("step ")] == \
        ["0", "1", "2", "3"]


@pytest.mark.slow
def test_eval_every_0_never_evaluates(tmp_path):
    p = run_train("--steps", "1", "--eval-every", "0", "--train-groups", "2", "--prompts-per-step", "2",
                  "--dump-samples", "0", "--out", str(tmp_path), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1] and not any(k.startswith("eval/") for k in recs[0])
    assert recs[0]["config"]["eval_every"] == 0 and recs[0]["git"]  # the first record holds the config
    with pytest.raises(SystemExit):  # nothing to count evaluations with
        config.parse_config(["--ref-reset-on-stall", "2", "--eval-every", "0", "--kl-coef", "0.1"])


@pytest.mark.slow
def test_samples_contract(short_run):
    out, _ = short_run
    samples = records(out / "samples.jsonl")
    assert {s["step"] for s in samples} == {1, 2, 3}
    for s in samples:
        assert set(s) >= {"step", "group", "prompt", "response", "n_tokens", "versions", "finish", "reward"}
        assert s["finish"] in ("eos", "truncated")
        assert 1 <= len(s["versions"]) <= 4 and s["versions"] == sorted(s["versions"])
        assert s["versions"][-1] <= s["step"] - 1  # sampled by a policy older than this step's update
        if s["finish"] == "truncated":
            assert s["n_tokens"] == 32 and s["reward"] == 0
    by_group = {}
    for s in samples:
        by_group.setdefault((s["step"], s["group"]), []).append(s)
    assert all(len(g) == 8 for g in by_group.values())  # whole groups train
    assert any(len(s["versions"]) > 1 for s in samples), "no sample spanned several segments"


@pytest.mark.slow
def test_checkpoint_loads_with_transformers(short_run):
    from transformers import AutoModelForCausalLM
    out, _ = short_run
    assert sorted(os.listdir(out)) == [".lock", "metrics.jsonl", "runs.json", "samples.jsonl", "step_000002",
                                       "step_000003"]
    for d, dirs, files in os.walk(out):  # private: samples and checkpoints hold the data's answers (umask 077)
        for name in [d, *(os.path.join(d, n) for n in dirs + files)]:
            assert os.stat(name).st_mode & 0o077 == 0, oct(os.stat(name).st_mode)
    model = AutoModelForCausalLM.from_pretrained(out / "step_000003")
    assert model.config.model_type == "qwen3"
    assert os.path.exists(out / "step_000003" / "reference" / "model.safetensors")


@pytest.mark.slow
def test_bad_dataset_row_names_file_row_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    p = run_train("--data", str(bad), "--eval-data", "", "--steps", "1", "--out", str(tmp_path / "o"), timeout=120)
    assert p.returncode != 0
    assert f"{bad}:2" in p.stderr and "answer" in p.stderr


@pytest.mark.parametrize("argv, message", [
    (["--is-mode", "tois", "--segments", "4"], "--is-mode tois is defined for one segment"),
    (["--top-p", "0.95"], "--top-p 0.95 / --top-k -1: training samples with top_p 1"),
    (["--top-k", "20"], "--top-p 1.0 / --top-k 20: training samples with top_p 1"),
    (["--report-to", "mlflow"], "--report-to mlflow: must be none, tensorboard, wandb"),
])
def test_flags_the_objective_cannot_honour_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        config.parse_config(argv)
    assert stop.value.code == 2  # argparse's usage error, as for any bad flag
    assert message in capsys.readouterr().err
    assert config.parse_config(["--is-mode", "tois", "--segments", "1"]).is_mode == "tois"


def test_reset_without_kl_warns_that_it_resets_only_the_optimizer(capsys):
    config.parse_config(["--ref-reset-every", "10"])
    assert "only clears the optimizer state" in capsys.readouterr().err


@pytest.mark.slow
def test_a_hub_name_loads_from_the_local_cache_offline(tmp_path):
    """--model ORG/NAME as every peer takes it: here from a fresh Hugging Face cache holding the tiny model
    under a hub-style name, offline (HF_HUB_OFFLINE=1), through transformers and (when installed) vLLM."""
    env = dict(os.environ, **hub_cache(tmp_path / "hf", "ulorl-test/tiny-qwen3", os.path.join(ROOT, "tiny_ckpt")),
               OMP_NUM_THREADS="1")
    engines = ["hf", "vllm"] if __import__("importlib").util.find_spec("vllm") else ["hf"]
    for engine in engines:  # --preset tiny: a hub name alone would take UloRL's settings
        p = run([sys.executable, "train.py", "--preset", "tiny", "--model", "ulorl-test/tiny-qwen3", "--engine", engine,
                "--steps", "1", "--eval-n", "8", "--out", str(tmp_path / engine)], cwd=ROOT,
                timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert os.path.exists(tmp_path / engine / "step_000001" / "model.safetensors")
    p = run([sys.executable, "train.py", "--preset", "tiny", "--model", "ulorl-test/not-there", "--out", str(tmp_path / "x")],
            cwd=ROOT, timeout=300, env=env)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "--model ulorl-test/not-there: neither a local directory nor a model" in p.stderr


@pytest.mark.slow
def test_an_engine_that_disagrees_with_the_trainer_stops_the_run(tmp_path):
    """An engine/trainer KL past --max-engine-kl stops the run before its update, naming it (here a threshold
    below the fp32 noise of a correct engine, ~1e-13, stands in for a broken one); warn trains on."""
    strict = ["--eval-data", "", "--max-engine-kl", "1e-30"]
    p, warned = run_many("train.py", [["--steps", "2", *strict, "--out", str(tmp_path / "o")],
                                      ["--steps", "1", *strict, "--on-engine-kl", "warn", "--out", str(tmp_path / "w")]],
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode != 0
    assert "the rollout engine and the trainer disagree" in p.stderr and "past --max-engine-kl 1e-30" in p.stderr
    assert not os.path.exists(tmp_path / "o" / "step_000001")
    assert warned.returncode == 0 and "WARNING: the rollout engine and the trainer disagree" in warned.stderr


@pytest.mark.slow
def test_report_to_tensorboard_and_wandb_offline(tmp_path):
    """--report-to: the same numbers as metrics.jsonl, in TensorBoard event files and an offline W&B run
    (no network, no account)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    p = run_train("--steps", "2", "--eval-n", "16", "--report-to", "tensorboard,wandb", "--out", str(out),
                  "--dump-samples", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(out / "metrics.jsonl")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb")).Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("reward/mean")] == \
        [(r["step"], round(r["reward/mean"], 5)) for r in recs if r["reward/mean"] is not None]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2]
    (run,) = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    (log,) = [f for f in os.listdir(out / "wandb" / run) if f.endswith(".wandb")]  # the offline run's records
    data = (out / "wandb" / run / log).read_bytes()  # history values are stored as JSON text
    for r in recs[1:]:
        assert json.dumps(r["reward/mean"]).encode() in data and json.dumps(r["loss/policy"]).encode() in data
    # W&B links its latest run and logs inside --out/wandb: a resumed run still takes the folder
    p = run_train("--steps", "3", "--eval-n", "16", "--report-to", "tensorboard,wandb", "--out", str(out),
                  "--dump-samples", "0", "--resume", "auto")
    assert p.returncode == 0 and any(os.path.islink(out / "wandb" / f) for f in os.listdir(out / "wandb")), \
        p.stderr[-3000:]


@pytest.mark.slow
def test_tois_trains_only_tokens_of_the_weights_being_updated(tmp_path):
    """--is-mode tois: pi_old is the engine's log-prob only where the current weights sampled; a surplus ready
    group kept for the next step would train one version behind. Every step's staleness is 0, and the surplus
    is counted as dropped."""
    p = run_train("--steps", "3", "--out", str(tmp_path), "--eval-data", "", "--segments", "1", "--is-mode", "tois",
                  "--train-groups", "2", "--prompts-per-step", "4", "--max-response-len", "32", "--save-every", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(tmp_path / "metrics.jsonl")
    assert all(r["staleness/token_max"] == 0 and r["staleness/token_mean"] == 0 for r in recs), recs
    assert sum(r["rollout/dropped_surplus_groups"] for r in recs) > 0  # there was a surplus to drop


def test_a_reset_of_the_reference_alone_needs_a_reference(capsys):
    """--reset reference with --kl-coef 0 would renew nothing at each reset: refused, naming both flags; the
    optimizer alone, or a reference to renew, is accepted."""
    with pytest.raises(SystemExit):
        config.parse_config(["--ref-reset-every", "5", "--reset", "reference"])
    assert "--reset reference with --kl-coef 0" in capsys.readouterr().err
    config.parse_config(["--ref-reset-every", "5", "--reset", "optimizer"])
    config.parse_config(["--ref-reset-every", "5", "--reset", "reference", "--kl-coef", "0.01"])
