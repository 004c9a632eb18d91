"""docs/extending.md, followed on copies of the project: each example's diff applies to the project as it is, and
does what the page says, against values computed by hand; the flags of the example's command exist.

    python -m pytest -n 0 tests/test_extending.py        # ~30 s on 2 shared cores: a warm interpreter per copy
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run
from test_guide import project_files

PAGE = os.path.join(ROOT, "docs", "extending.md")


def examples() -> dict[str, str]:
    """The page's sections ('## 1. A policy loss: ...'), by their heading."""
    sections = re.split(r"^## ", open(PAGE).read(), flags=re.M)[1:]
    return {s.split("\n", 1)[0]: s for s in sections}


def diff_of(section: str) -> str:
    (diff,) = re.findall(r"^```diff\n(.*?)^```$", section, re.S | re.M)
    return diff


def command_of(section: str) -> list[str]:
    """The example's `python train.py ...` command, as train.py would get its arguments."""
    (line,) = re.findall(r"^python train\.py ((?:.*\\\n)*.*)$", section, re.M)
    return shlex.split(line.replace("\\\n", " "))


def section(start: str) -> str:
    (found,) = [s for heading, s in examples().items() if heading.startswith(start)]
    return found


def patched(tmp_path, sec: str):
    """A copy of the project with the section's diff applied (git apply: it fails on a line that moved)."""
    copy = tmp_path / "ulorl"
    for f in project_files():
        os.makedirs(copy / os.path.dirname(f), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), copy / f)
    (tmp_path / "example.diff").write_text(diff_of(sec))
    applied = subprocess.run(["git", "apply", "--verbose", str(tmp_path / "example.diff")], cwd=copy,
                             capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, f"the diff no longer applies to the project:\n{applied.stderr}"
    return copy


def python(copy, code: str, *args: str) -> list[str]:
    """`code` run in the copy, its printed lines (argv: args)."""
    done = run([sys.executable, "-c", code, *args], timeout=300, cwd=copy, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_page_has_three_examples_each_a_diff_and_a_command():
    assert [h.split(".")[0] for h in examples()] == ["1", "2", "3"]
    for sec in examples().values():
        assert diff_of(sec).startswith("diff --git a/") and command_of(sec)


GSPO = """
import sys, torch, config, registry
cfg = config.parse_config(sys.argv[1:])
f = registry.function(registry.POLICY_LOSSES[cfg.policy_loss])
lp, old, mask = torch.tensor([[0.1, 0.2, 0.3]]), torch.zeros(1, 3), torch.ones(1, 3)
for a in (1.0, -1.0):
    print(f(logprobs=lp, old_logprobs=old, advantages=torch.tensor([a]), mask=mask)[0].item())
"""


def test_gspo_clips_one_ratio_per_sample(tmp_path):
    """Log-ratios 0.1, 0.2, 0.3: s = exp(0.2) = 1.2214, clipped to 1.2 for A = +1 (loss -1.2) and not for A = -1
    (loss +1.2214); the token-level loss would be -(exp(0.1) + 1.2 + 1.2) / 3 = -1.1684 for A = +1."""
    sec = section("1.")
    copy = patched(tmp_path, sec)
    positive, negative = map(float, python(copy, GSPO, *command_of(sec)))
    assert positive == pytest.approx(-1.2, abs=1e-6)
    assert negative == pytest.approx(1.2214028, abs=1e-6)


DR_GRPO = """
import sys
from types import SimpleNamespace
import config, ulorl
cfg = config.parse_config(sys.argv[1:])
groups = [[SimpleNamespace(reward=r) for r in (1.0, 0.0, 0.0, 0.0)], [SimpleNamespace(reward=r) for r in (1.0, 1.0, 0.0, 0.0)]]
print(*ulorl.sample_advantages(groups).tolist())
def planned(samples, adv, *rest):  # what update hands the micro-batches: the flag's advantages
    print(*adv.tolist())
    raise SystemExit
ulorl.plan_micro_batches = planned
ulorl.update(None, None, None, None, groups, 0, 0, cfg, None)
"""


def test_dr_grpo_subtracts_the_group_mean_only(tmp_path):
    """Rewards (1, 0, 0, 0): mean 0.25, sample std 0.5, so GRPO gives (1.5, -0.5, -0.5, -0.5) and Dr. GRPO
    (0.75, -0.25, -0.25, -0.25); (1, 1, 0, 0): std 0.5774, GRPO +-0.8660, Dr. GRPO +-0.5. update uses the flag's."""
    sec = section("2.")
    copy = patched(tmp_path, sec)
    grpo, dr_grpo = [list(map(float, line.split())) for line in python(copy, DR_GRPO, *command_of(sec))]
    assert grpo == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.8660254, 0.8660254, -0.8660254, -0.8660254],
                                       abs=1e-5)
    assert dr_grpo == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5], abs=1e-6)


MC = """
import json, sys, config, data, registry, verifiers
cfg = config.parse_config([*sys.argv[1:], "--device", "cpu"])  # the page's command, on a machine without a GPU
rows = data.load_prompts(cfg.data, default_verifier=cfg.default_verifier)
held = data.load_prompts(cfg.eval_data, held_out=True, n=cfg.eval_n, default_verifier=cfg.default_verifier)
print(json.dumps([[r["answer"], r["verifier"]] for r in rows + held]))
for response in ("<think>A or B?</think> The answer is (C). Done.", "<think>It is C.</think> B", "I pick D",
                 "no letter"):
    print(json.dumps([registry.function(registry.VERIFIERS["mc"].reward)(response, "C"),
                      verifiers.final_answer("mc", response)]))
"""


def test_a_multiple_choice_verifier_on_a_jsonl_file_and_its_held_out_split(tmp_path):
    """The page's files, written as its commands write them; the verifier reads the last standalone A-D after the
    reasoning ('Done' holds no answer, the reasoning's C is not the answer)."""
    sec = section("3.")
    copy = patched(tmp_path, sec)
    for name, body in re.findall(r"^cat > (\S+) <<'EOF'\n(.*?)^EOF$", sec, re.S | re.M):
        (copy / name).write_text(body)
    out = [json.loads(line) for line in python(copy, MC, *command_of(sec))]
    assert out[0] == [["C", "mc"], ["B", "mc"], ["C", "mc"]]
    assert out[1:] == [[1.0, "C"], [0.0, "B"], [0.0, "D"], [0.0, None]]
