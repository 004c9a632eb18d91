"""Smoke test of experiments/findings.py at a trivial size: a finding's variants train (2 steps, one seed),
its figure (beside the runs, not over the committed docs/findings/ one) and summary are written, and a second
call reuses the finished runs instead of training again; a study of one's own variants does the same.
The findings themselves are in docs/findings.md; experiments are not tests.

    python -m pytest tests/test_experiments.py        # ~2.5 minutes on 2 cores
"""
import json
import os
import shutil
import sys

import pytest

from conftest import run


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def findings():
    import importlib.util
    spec = importlib.util.spec_from_file_location("findings", os.path.join(ROOT, "experiments", "findings.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # several training runs: -m "not slow" skips it
def test_a_finding_runs_end_to_end_and_reuses_its_runs(tmp_path):
    committed = os.path.join(ROOT, "docs", "findings", "dmmpt-any.png")
    before = os.stat(committed).st_mtime_ns
    cmd = [sys.executable, "experiments/findings.py", "dmmpt-any", "--seeds", "0", "--root", str(tmp_path / "runs"),
           "--steps", "2", "--eval-n", "16", "--eval-every", "1",
           "--prompts-per-step", "2", "--train-groups", "2", "--dynamic-sampling", "false",
           "--jobs", "2"]  # its 3 variants two at a time (one thread each): the same runs, sooner on 2 cores
    first = run(cmd, cwd=ROOT, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["finding"] == "dmmpt-any" and summary["steps"] == 2
    assert set(summary["numbers"]) == {"off", "static", "dynamic"}
    assert summary["numbers"]["off"]["masked_frac"]["mean"] == 0 < summary["numbers"]["static"]["masked_frac"]["mean"]
    figure = tmp_path / "runs" / "dmmpt-any" / "dmmpt-any.png"
    assert summary["figure"] == str(figure) and open(figure, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.stat(committed).st_mtime_ns == before
    for variant in ("off", "static", "dynamic"):
        with open(tmp_path / "runs" / "dmmpt-any" / f"{variant}_s0" / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        assert [r["step"] for r in records] == [0, 1, 2] and records[0]["config"]["model"].endswith("tiny_any_ckpt")
    again = run(cmd, cwd=ROOT, timeout=300)
    assert again.returncode == 0 and "_s0:" not in again.stdout  # no run trained again


@pytest.mark.slow
def test_the_resets_finding_reads_each_arm_s_gain_kl_and_resets_from_its_runs(tmp_path):
    """resets-dose-any at a trivial size (4 steps, both arms): each run trains with its own KL and reset period, and
    the gain over the run's second half, the mean KL and the count of resets are read from its own records."""
    cmd = [sys.executable, "experiments/findings.py", "resets-dose-any", "--seeds", "0", "--root", str(tmp_path),
           "--steps", "4", "--eval-n", "8", "--eval-every", "2", "--prompts-per-step", "2", "--train-groups", "2",
           "--jobs", "2"]
    p = run(cmd, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    numbers = json.loads(p.stdout.strip().splitlines()[-1])["numbers"]
    assert set(numbers) == {"kl0.1", "kl0.1+both"}
    for variant, row in numbers.items():
        with open(tmp_path / "resets-dose-any" / f"{variant}_s0" / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        config, evals = records[0]["config"], {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
        assert config["kl_coef"] == 0.1 and config["mpt"] == "off" and config["eps_high"] == 0.4
        assert config["ref_reset_every"] == (50 if variant.endswith("+both") else 0)
        assert row["gain_second_half"]["mean"] == pytest.approx(evals[4] - evals[2])
        assert row["kl_mean"]["mean"] == pytest.approx(sum(r["loss/kl"] for r in records[1:]) / 4) and row["kl_mean"]["mean"] > 0
        assert row["resets"]["mean"] == sum(1 for r in records if r.get("train/ref_reset")) == 0  # none before step 50
    assert open(tmp_path / "resets-dose-any" / "resets-dose-any.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def two_steps(finding: str, only: str, tmp_path) -> list[tuple]:
    """A finding's command at a trivial size (2 steps of 2 prompts, seed 0) for the variants `only` names: per
    variant its row of the printed numbers, its run's config and its trained steps' records. Dynamic sampling
    stays on, so every trained group has a right answer."""
    cmd = [sys.executable, "experiments/findings.py", finding, "--only", only, "--seeds", "0", "--root", str(tmp_path),
           "--steps", "2", "--eval-n", "8", "--eval-every", "2", "--prompts-per-step", "2", "--train-groups", "2",
           "--jobs", "2"]
    p = run(cmd, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    numbers = json.loads(p.stdout.strip().splitlines()[-1])["numbers"]
    assert set(numbers) == set(only.split(","))
    assert open(tmp_path / finding / f"{finding}.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    rows = []
    for variant, row in numbers.items():
        with open(tmp_path / finding / f"{variant}_s0" / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        rows.append((variant, row, records[0]["config"], records[1:]))
    return rows


@pytest.mark.slow
def test_the_sigma_finding_sets_dynamic_dmmpts_against_sigma(tmp_path):
    """sigma-any at a trivial size, both arms: every run dynamic on the any-order warm start, each at the sigma its
    name gives; where the entropy settled is read against that sigma."""
    variants = findings().FINDINGS["sigma-any"]["variants"]
    assert list(variants) == [f"dynamic_sigma{s}" for s in findings().SIGMA_ANY_DOSES]
    for variant, row, config, trained in two_steps("sigma-any", ",".join(variants), tmp_path):
        assert config["mpt"] == "dynamic" and config["model"].endswith("tiny_any_ckpt")
        sigma = float(variant.rpartition("sigma")[2])
        late = sum(r["entropy/mean"] for r in trained) / 2  # both steps are the "last 20"
        assert config["mpt_sigma"] == sigma and row["entropy_last20"]["mean"] == pytest.approx(late)
        assert row["late_minus_sigma"]["mean"] == pytest.approx(late - sigma)


@pytest.mark.slow
def test_variants_of_ones_own_over_seeds(tmp_path):
    cmd = [sys.executable, "experiments/findings.py", "variants", "--variant", "kl=--kl-coef 0.1 --mpt off", "--seeds",
           "0", "--root", str(tmp_path), "--name", "mine", "--keys", "loss/kl,mpt/masked_frac,eval/accuracy",
           "--steps", "2", "--eval-data", "", "--prompts-per-step", "2", "--train-groups", "2",
           "--dynamic-sampling", "false"]
    p = run(cmd, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["name"] == "mine" and summary["variants"] == {"kl": ["--kl-coef", "0.1", "--mpt", "off"]}
    assert sorted(os.listdir(tmp_path / "mine")) == ["kl_s0", "kl_s0.log", "mine.png", "summary.json"]
    with open(tmp_path / "mine" / "kl_s0" / "metrics.jsonl") as f:
        config = json.loads(f.readline())["config"]
    assert config["kl_coef"] == 0.1 and config["mpt"] == "off" and config["steps"] == 2  # its flags and the run's
    numbers = summary["numbers"]
    assert numbers["kl"]["loss/kl"]["mean"] > 0 and numbers["kl"]["mpt/masked_frac"]["mean"] == 0
    assert numbers["kl"]["eval/accuracy"]["mean"] is None  # no evaluation ran: none is made up


def test_only_names_variants_of_the_finding(capsys):
    for argv, why in ((["is-any", "--only", "pois-3seg"], "is-any has the variants tois-1seg, sais-8seg, pois-8seg"),
                      (["variants", "--variant", "a=", "--only", "a"], "--only is for a finding")):
        with pytest.raises(SystemExit):
            findings().main(argv)
        assert why in capsys.readouterr().err


def test_variants_are_name_equals_flags():
    parse = findings().parse_variants
    assert parse(["base=", "kl=--kl-coef 0.1 --mpt off"]) == {"base": [], "kl": ["--kl-coef", "0.1", "--mpt", "off"]}
    for bad, why in (("no-equals-sign", "expected NAME=FLAGS"), ("=--kl-coef 0.1", "expected NAME=FLAGS"),
                     ("a b=", "expected NAME=FLAGS")):
        with pytest.raises(SystemExit, match=why):
            parse([bad])
    with pytest.raises(SystemExit, match="the name 'x' is given twice"):
        parse(["x=", "x=--mpt off"])


def test_the_verdict_rule_on_both_sides_of_each_threshold():
    """Reproduced only with the paper's direction, bands apart and 5 seeds; one seed fewer, or bands touching, is
    'in part'; the reverse is 'not reproduced'; both arms at one value on every seed (a ceiling), 'not testable'."""
    verdict = findings().verdict
    high, low = [0.50, 0.52, 0.55, 0.53, 0.51], [0.40, 0.42, 0.45, 0.43, 0.41]
    assert verdict(high, low)[0] == "reproduced"
    assert verdict(high[:4], low[:4]) == ("in part", "the direction matches, bands apart, but 4 seeds (< 5)")
    assert verdict(high, [*low[:4], 0.50])[0] == "in part"  # the lower arm's best seed reaches the higher's worst
    assert verdict(high, [*low[:4], 0.499])[0] == "reproduced"
    assert verdict(low, high) == ("not reproduced", "the reverse direction, bands apart over 5 seeds")
    assert verdict([*low[:4], 0.50], high) == ("not reproduced", "no difference: the bands overlap (the means the "
                                                                 "other way)")
    assert verdict(high, high)[0] == "not reproduced"
    assert verdict([1.0] * 5, [1.0] * 5) == ("not testable here", "every seed of both arms at 1.000: nothing can differ")
    assert verdict([1.0] * 5, [1.0] * 4 + [0.999])[0] == "in part"  # one seed off the ceiling: a direction


def recorded(tmp_path, module, shift: float = 0.0):
    """Records of dmmpt-any's three arms over 5 seeds (entropy and accuracy made up, dynamic above off), written
    as --record writes them, and a findings document that holds their verdict rows and count."""
    runs = {arm: [[{"step": step, "entropy/mean": base + 0.01 * seed + (shift if step == 150 else 0.0),
                    "eval/accuracy": base + 0.02 * seed} for step in range(131, 151)] for seed in range(5)]
            for arm, base in (("off", 0.10), ("static", 0.40), ("dynamic", 0.25))}
    for arm, seeds in runs.items():
        for seed, rows in enumerate(seeds):
            (tmp_path / "runs" / f"{arm}_s{seed}").mkdir(parents=True)
            (tmp_path / "runs" / f"{arm}_s{seed}" / "metrics.jsonl").write_text(
                "".join(json.dumps({**r, "unkept/key": 1}) + "\n" for r in rows))
    module.write_records("dmmpt-any", str(tmp_path / "runs"), list(runs), list(range(5)), str(tmp_path / "records"))
    rows = module.verdict_rows("dmmpt-any", runs)
    (tmp_path / "findings.md").write_text("| finding | claim |\n|---|---|\n" + "\n".join(rows) + "\n\n"
                                          + module.count_line(rows) + "\n")
    return rows


def test_check_recomputes_the_verdict_rows_from_the_records_and_fails_on_any_difference(tmp_path):
    """findings.py check on a document and the records behind it passes; a record changed afterwards (one seed's
    last step), a row the records do not give, or a wrong count fails it, naming what differs."""
    module = findings()
    rows = recorded(tmp_path, module)
    assert len(rows) == 3 and all("**reproduced**" in row for row in rows)
    records, doc = str(tmp_path / "records"), str(tmp_path / "findings.md")
    assert module.check(records, doc) == []
    with open(tmp_path / "records" / "dmmpt-any" / "off_s0.jsonl.gz", "rb") as f:
        assert b"unkept" not in __import__("gzip").decompress(f.read())  # only the kept keys
    text = (tmp_path / "findings.md").read_text()
    (tmp_path / "findings.md").write_text(text.replace(rows[0], rows[0].replace(" 0.2", " 0.3", 1)))
    problems = module.check(records, doc)
    assert any("not from the records" in p for p in problems) and any("not in" in p for p in problems)
    (tmp_path / "findings.md").write_text(text.replace("3 claims", "4 claims"))
    assert module.check(records, doc) == [f"{doc} does not say: {module.count_line(rows)}"]
    (tmp_path / "findings.md").write_text(text)
    recorded(tmp_path / "again", module, shift=0.5)  # one step of every run moved: other means
    problems = module.check(str(tmp_path / "again" / "records"), doc)
    assert problems and any("in the records, not in" in p for p in problems)


def test_check_recomputes_a_marked_table_from_the_records(tmp_path):
    """A table under a `findings.py table` line: each row an arm, each column a metric's mean [lowest, highest seed]
    over its steps, recomputed from the records; a changed cell, a missing row or a finding without records fails."""
    module = findings()
    recorded(tmp_path, module)
    records, doc = str(tmp_path / "records"), tmp_path / "findings.md"
    # by hand: seed s's entropy is base + 0.01 s at every step, its accuracy base + 0.02 s (off's base 0.10)
    rows = ["| off | 0.120 [0.100, 0.140] | 0.140 [0.100, 0.180] |",
            "| static | 0.420 [0.400, 0.440] | 0.440 [0.400, 0.480] |",
            "| dynamic | 0.270 [0.250, 0.290] | 0.290 [0.250, 0.330] |"]
    verdicts = doc.read_text()
    table = ("\n<!-- findings.py table dmmpt-any: entropy/mean@131-150 eval/accuracy@150 -->\n\n"
             "| arm | entropy | accuracy |\n|---|---|---|\n" + "\n".join(rows) + "\n\nText.\n")
    doc.write_text(verdicts + table)
    assert module.check(records, str(doc)) == []
    doc.write_text(verdicts + table.replace("0.120 [", "0.121 ["))
    assert sorted(p.split(":")[0] for p in module.check(records, str(doc))) == [
        "table of dmmpt-any, in the doc, not from the records", "table of dmmpt-any, in the records, not in the doc"]
    doc.write_text(verdicts + table.replace(rows[2] + "\n", ""))
    assert module.check(records, str(doc)) == [f"table of dmmpt-any, in the records, not in the doc: {rows[2]}"]
    doc.write_text(verdicts + table.replace("table dmmpt-any", "table is-any"))
    assert module.check(records, str(doc)) == [f"table of is-any: no records in {records}"]
    indented = table.replace("\n", "\n  ").replace("0.120 [", "0.121 [")  # a table in a list item is checked too
    doc.write_text(verdicts + indented)
    assert len(module.check(records, str(doc))) == 2


def test_check_recomputes_a_bench_table_and_quoted_numbers_from_the_bench_s_record(tmp_path):
    """A bench table's row i takes item i of each column's list, formatted as its marker says; a quote's numbers,
    rendered from the record, must stand in the text under it. A changed number or a missing record fails."""
    module = findings()
    records, doc = tmp_path / "records", tmp_path / "findings.md"
    (records / "bench").mkdir(parents=True)
    (records / "bench" / "seg.json").write_text(json.dumps({
        "segments": ["1", "4"], "speedup": [1.0, 1.397], "prefill": [3819, 15424], "reward": [0.7771, 0.772],
        "reward_sem": [0.0126, 0.01], "results": {"hf 1x2": {"step_ms": [4.0714, 7.1158]}},
        "rows": [{"m": 0.0031}, {"m": 0.04947}], "by": {"8": {"s": 1.442}}}))
    rows = ["| 1 | 1.00x | 3,819 | 0.777 +- 0.013 | 4.1 | 0.31% |",  # by hand: 1.397 -> 1.40x, 0.0126 -> 0.013
            "| 4 | 1.40x | 15,424 | 0.772 +- 0.010 | 7.1 | 4.95% |"]
    text = ('<!-- findings.py bench bench/seg: segments speedup:.2fx prefill:, reward+-reward_sem:.3f '
            '"results.hf 1x2.step_ms:.1f" rows.m:.2% -->\n\n| segments | speedup | prefill | reward | ms | m |\n'
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\nWith 4 segments:\n"
            '<!-- findings.py quote bench/seg: {speedup[1]:.2f}x faster, {results[hf 1x2][step_ms][1]:.1f} ms -->\n'
            '<!-- findings.py quote bench/seg: {by[8][s]:.2f}x on 8, {rows[1][m]:.1%} -->\n'
            "1.40x faster,\n7.1 ms a step; 1.44x on 8, 4.9% of them.\n\nNext.\n")  # a quote may break lines
    doc.write_text(text)
    assert module.check(str(records), str(doc)) == []
    doc.write_text(text.replace("| 1.40x |", "| 1.39x |"))
    assert sorted(p.split(":")[0] for p in module.check(str(records), str(doc))) == [
        "table of bench/seg, in the doc, not from the records", "table of bench/seg, in the records, not in the doc"]
    doc.write_text(text.replace("7.1 ms a step", "7.2 ms a step"))
    assert module.check(str(records), str(doc)) == [
        "quote of bench/seg: '1.40x faster, 7.1 ms' is not in the text under its marker"]
    doc.write_text(text.replace("ms -->\n", "ms -->\nOther words.\n\n"))  # a blank line ends the marker's block
    assert len(module.check(str(records), str(doc))) == 1
    doc.write_text(text.replace("bench/seg:", "bench/other:"))
    assert sorted(module.check(str(records), str(doc))) == [
        *[f"quote of bench/other: no record {records / 'bench' / 'other.json'}"] * 2,
        f"table of bench/other: no records in {records}"]


def test_a_table_cell_is_a_window_mean_or_a_count_of_the_steps_that_log_it():
    """`metric@first-last`: the mean over the steps that log it; `count:metric@...`: how many of them do (a reset
    logs train/ref_reset at its step only)."""
    cell = findings().cell
    records = [{"step": s, "loss/kl": 0.1 * s, **({"train/ref_reset": 1} if s % 50 == 0 else {})} for s in range(1, 151)]
    assert cell(records, "loss/kl@1-3") == pytest.approx(0.2)
    assert cell(records, "loss/kl@150") == pytest.approx(15.0)
    assert cell(records, "count:train/ref_reset@1-150") == 3.0
    assert cell(records, "count:train/ref_reset@51-149") == 1.0
    assert cell(records, "count:train/ref_reset@1-49") == 0.0


def test_the_count_line_counts_the_reproduced_rows():
    count_line = findings().count_line
    rows = ["| a | c | m | x | **reproduced**: bands apart over 5 seeds |", "| a | c | m | x | **in part**: overlap |"]
    assert count_line(rows) == "By the rule, 1 of the 2 claims tested on the any-order task is reproduced."
    assert count_line(rows[1:]) == "By the rule, 0 of the 1 claims tested on the any-order task are reproduced."
    assert count_line(rows[:1] * 2) == "By the rule, 2 of the 2 claims tested on the any-order task are reproduced."


def test_a_band_keeps_a_small_share_readable():
    """Three decimals, four where every value is under 0.01 and one is not 0 (a clipped share would read 0.001)."""
    band = findings().band
    assert band([0.1, 0.2, 0.3]) == "0.200 [0.100, 0.300]"
    assert band([0.0005, 0.0009]) == "0.0007 [0.0005, 0.0009]"
    assert band([0.0, 0.0]) == "0.000 [0.000, 0.000]"
    assert band([0.002, 0.01]) == "0.006 [0.002, 0.010]"


def test_the_committed_findings_agree_with_their_records():
    """What CI checks: `python experiments/findings.py check` on docs/findings.md and experiments/records/."""
    done = run([sys.executable, "experiments/findings.py", "check"], cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_every_claim_compares_two_arms_its_finding_runs():
    module = findings()
    for name, claims in module.CLAIMS.items():
        if name == "boundary-any":  # evaluates, trains nothing: its rows are one a k
            variants, metrics, last = {"rl", "warm-start"}, {"passk"}, module.BOUNDARY_K
        else:
            variants, metrics, last = module.FINDINGS[name]["variants"], module.KEPT, module.FINDINGS[name]["steps"]
        for claim in claims:
            assert claim.higher in variants and claim.lower in variants and claim.higher != claim.lower, (name, claim)
            assert claim.metric in metrics and 0 < claim.first <= claim.last <= last


@pytest.mark.slow  # two evaluations by eval.py
def test_the_boundary_finding_keeps_pass_at_k_of_each_seed_s_draw_by_k(tmp_path):
    module = findings()
    for seed in (3, 4):  # a trained run's last checkpoint: the warm start itself stands in for it
        shutil.copytree(os.path.join(ROOT, module.tiny.ANY_CKPT), tmp_path / "dynsamp-any" / f"on_s{seed}" / "step_000007")
    records = tmp_path / "records"
    module.main(["boundary-any", "--seeds", "3,4", "--root", str(tmp_path), "--passk-samples", "4",
                 "--passk-problems", "6", "--record", "--records", str(records)])
    runs = module.read_records("boundary-any", str(records))
    assert list(runs) == ["rl", "warm-start"] and all(len(per_seed) == 2 for per_seed in runs.values())
    for seed, rl, warm in zip((3, 4), runs["rl"], runs["warm-start"]):
        with open(tmp_path / "boundary-any" / f"rl_s{seed}.pass4x6.json") as f:
            report = json.load(f)
        assert report["args"]["seed"] == seed and report["model"].endswith(f"on_s{seed}/step_000007")
        counts = [sum(p["correct"]) for p in report["per_problem"]]
        assert len(counts) == 6 and [r["step"] for r in rl] == [1, 2, 3, 4]
        assert rl[0]["passk"] == pytest.approx(sum(counts) / 24)  # pass@1: the share of right samples
        assert rl[3]["passk"] == pytest.approx(sum(c > 0 for c in counts) / 6)  # pass@4 of 4: any right
        assert rl[1]["passk"] == pytest.approx(sum(1 - (4 - c) * (3 - c) / 12 for c in counts) / 6)  # 1 - C(4-c,2)/C(4,2)
        with open(tmp_path / "boundary-any" / f"warm-start_s{seed}.pass4x6.json") as f:
            assert json.load(f)["model"] == module.tiny.ANY_CKPT
        assert warm == rl  # the same weights on the same seed's draw sample the same
    with pytest.raises(SystemExit, match="dynsamp-any --only on --seeds 5"):
        module.main(["boundary-any", "--seeds", "5", "--root", str(tmp_path)])


@pytest.mark.slow  # the cleaning samples two warm starts, then two 1-step runs
def test_the_noisy_finding_makes_its_data_then_trains_each_arm_on_its_own(tmp_path, monkeypatch):
    module = findings()
    monkeypatch.setattr(module, "NOISY_ROWS", 120)
    folder = tmp_path / "noisy-any"
    runs = module.run_all("noisy-any", module.FINDINGS["noisy-any"], [0], str(tmp_path),
                          ["--steps", "1", "--eval-n", "8", "--prompts-per-step", "2", "--train-groups", "2",
                           "--dynamic-sampling", "false"], jobs=2)

    def rows(arm):
        with open(folder / f"{arm}.jsonl") as f:
            return [json.loads(line) for line in f]
    true, noisy, cleaned = rows("true"), rows("noisy"), rows("cleaned")
    assert len(true) == len(noisy) == 120
    assert all(r["answer"] == str(sum(map(int, r["prompt"][:-1].split("+")))) for r in true)
    wrong = [n["answer"] != t["answer"] for n, t in zip(noisy, true)]
    assert all(abs(int(n["answer"]) - int(t["answer"])) == 1 for n, t, w in zip(noisy, true, wrong) if w)
    assert 0.15 < sum(wrong) / len(wrong) < 0.45  # NOISE 0.3
    with open(folder / "cleaned.report.json") as f:
        dropped = {int(d["where"].rpartition(":")[2]) - 1 for d in json.load(f)["dropped_rows"]}
    assert cleaned == [r for i, r in enumerate(noisy) if i not in dropped]
    # greedy warm starts rarely slip: their majority catches most wrong labels and drops no right one here
    assert sum(wrong[i] for i in dropped) >= 0.6 * sum(wrong) and all(wrong[i] for i in dropped)
    with open(folder / module.PREPARED) as f:  # what --record keeps of the cleaning
        assert json.load(f) == {"rows": 120, "wrong": sum(wrong), "dropped": len(dropped),
                                "dropped_wrong": sum(wrong[i] for i in dropped), "dropped_right": 0}
    assert set(runs) == {"noisy", "cleaned"}
    for arm in runs:
        assert [r["step"] for r in runs[arm][0]] == [0, 1]
        with open(folder / f"{arm}_s0" / "step_000001" / "ulorl_state.json") as f:
            assert json.load(f)["config"]["data"] == str(folder / f"{arm}.jsonl")
