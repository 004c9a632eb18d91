"""registry.py: the one table of verifiers and the one of data sources, which config.py (--help, the flag checks),
data.py, reward.py, the reward workers and clean.py all read."""
import sys

import pytest

from conftest import ROOT, run
import config
import data
import registry
import verifiers

ROW_KEYS = ("prompt", "answer", "verifier", "math")  # make_row's keys and default verifier: a file's, as --data reads it

def test_config_reads_the_registry_without_loading_what_it_names():
    """--help answers at once: `import config` loads no verifier (math-verify, sympy), data loader or torch."""
    p = run([sys.executable, "-c", "import sys, config; print(sorted({'math_verify', 'sympy', 'verifiers', 'data', "
             "'reasoning_gym', 'torch', 'transformers'} & set(sys.modules)))"], cwd=ROOT, timeout=60, warm=False)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr


@pytest.mark.parametrize("name", sorted(registry.VERIFIERS))
def test_every_verifier_names_functions_and_is_a_choice_exactly_when_a_file_may_name_it(name, capsys):
    v = registry.VERIFIERS[name]
    for ref in (v.reward, v.final, v.answer_check):
        assert ref is None or callable(registry.function(ref)), ref
    assert v.help and v.help in config.Config.__dataclass_fields__["default_verifier"].metadata["help"]
    if v.from_file:
        assert config.parse_config(["--default-verifier", name]).default_verifier == name
    else:
        with pytest.raises(SystemExit):
            config.parse_config(["--default-verifier", name])
        assert f"invalid choice: '{name}'" in capsys.readouterr().err
        with pytest.raises(ValueError, match=f"is '{name}': " + v.help[:30].replace("(", r"\(")):
            data.make_row({"prompt": "1+1=", "answer": "2", "verifier": name}, "f.jsonl:1", *ROW_KEYS)


def test_a_json_answer_is_checked_as_its_row_loads_and_a_final_answer_comes_from_the_registry():
    for name, v in registry.VERIFIERS.items():
        if v.answer_check and v.from_file:
            with pytest.raises(ValueError, match=f"f.jsonl:1: field 'answer' \\(the answer of a '{name}' row\\)"):
                data.make_row({"prompt": "p", "answer": "not json", "verifier": name}, "f.jsonl:1", *ROW_KEYS)
    assert verifiers.final_answer("math_boxed", "it is 5") is None and verifiers.final_answer("math", "it is 5") == "5"
    assert verifiers.final_answer("code", "5") is None and verifiers.final_answer("nope", "5") is None
    for name, v in registry.VERIFIERS.items():
        if v.as_response:  # clean.py's majority filter writes a voted answer so that its reward reads it back
            assert verifiers.final_answer(name, v.as_response.format("12")) == "12", name


@pytest.mark.parametrize("source, kind", [("tiny", "tiny"), ("tiny:4", "tiny"), ("rg:chain_sum:5", "rg"),
                                          ("rg", "file"), ("a.jsonl", "file"), ("org/dataset", "file")])
def test_a_source_is_of_the_first_kind_whose_pattern_it_matches(source, kind):
    assert registry.source_kind(source) == kind
    s = registry.SOURCES[kind]
    assert callable(registry.function(s.rows)) and (s.check is None or callable(registry.function(s.check)))
    assert s.help in config.Config.__dataclass_fields__["data"].metadata["help"]


def test_eval_data_auto_is_the_training_spec_when_every_source_has_a_held_out_draw():
    assert config.held_out_of("tiny:4@0.5,rg:chain_sum@0.5", 0) == "tiny:4@0.5,rg:chain_sum@0.5"
    assert config.held_out_of("tiny@0.5,a.jsonl@0.5", 0) == ""


def test_every_policy_loss_takes_policy_loss_s_arguments():
    """--policy-loss hands every variant loss.policy_loss's arguments by keyword: a variant must take them all."""
    import inspect
    import loss
    want = inspect.signature(loss.policy_loss).parameters.keys()
    for ref in registry.POLICY_LOSSES.values():
        assert inspect.signature(registry.function(ref)).parameters.keys() == want, ref
