"""YaRN rope scaling (UloRL section 4) from the --rope-scaling-factor / --rope-original-max-positions flags:
the overrides' numbers, their effect on the trainer, a checkpoint that keeps them, and -- when vLLM is
installed -- the vLLM engine computing the same positions as the trainer (log-probs within 1e-4).

    python -m pytest tests/test_yarn.py      # the vLLM test is skipped without vLLM (~30-60 s with it)
"""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import model as model_lib
import tiny
from systems.engine import Sampling, process_logits

ORIGINAL, FACTOR = 128, 1.5  # positions past 128 are where YaRN matters; the model then takes 192


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A random tiny Qwen3 saved without rope scaling (vocabulary 512 and head_dim 32 for vLLM's CPU backend,
    as in test_vllm.py)."""
    out = str(tmp_path_factory.mktemp("tiny_rope"))
    tok = tiny.make_tokenizer()
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=ORIGINAL, rope_theta=10000.0,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def logprobs(model, seq: list[int], n: int) -> torch.Tensor:
    """Log-probs (temperature 1) of the last n tokens of seq, from one full forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, len(seq) - n - 1:-1]
    return process_logits(logits, Sampling()).gather(1, torch.tensor(seq[-n:])[:, None]).squeeze(1)


def test_overrides_numbers():
    qwen3_30b = Qwen3Config(max_position_embeddings=40960, rope_theta=1e6)
    assert model_lib.yarn_overrides(qwen3_30b, 0, 95232) == {}
    over = model_lib.yarn_overrides(qwen3_30b, 1.5, 95232)  # UloRL's numbers
    assert over == {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 1.5,
                                        "original_max_position_embeddings": 95232},
                    "max_position_embeddings": 142848}
    # without --rope-original-max-positions: the config's length, and a config that has YaRN already
    # (a checkpoint of a YaRN run, on resume) is not scaled a second time
    first = model_lib.yarn_overrides(qwen3_30b, 1.5, 0)
    assert first["max_position_embeddings"] == 61440
    scaled = Qwen3Config(**{**qwen3_30b.to_dict(), **first})
    assert model_lib.yarn_overrides(scaled, 1.5, 0) == first


def test_trainer_positions_change_and_checkpoint_keeps_them(path, tmp_path):
    plain, tok = model_lib.load(path)
    yarn = model_lib.load(path, rope_scaling_factor=FACTOR, rope_original_max_positions=ORIGINAL)[0]
    assert yarn.config.max_position_embeddings == 192 and yarn.config.rope_parameters["rope_type"] == "yarn"
    assert yarn.get_decoder().rotary_emb.attention_scaling > 1  # YaRN's 0.1 ln(s) + 1 on cos and sin
    seq = torch.randint(3, 512, (180,), generator=torch.Generator().manual_seed(0)).tolist()
    gap = (logprobs(plain, seq, 60) - logprobs(yarn, seq, 60)).abs()  # positions 120-179
    assert gap.max() > 1e-2, "the flag has no effect on the trainer"
    yarn.save_pretrained(str(tmp_path))  # its config.json, as checkpoints write it: loads with YaRN, no flag
    tok.save_pretrained(str(tmp_path))
    again = model_lib.load(str(tmp_path))[0]
    assert torch.equal(logprobs(again, seq, 60), logprobs(yarn, seq, 60))


@pytest.mark.slow
def test_vllm_computes_the_same_positions(path):
    """Engine log-probs of sampled continuations past position 128 equal the YaRN trainer's (1e-4) and not
    the unscaled model's: the overrides reached vLLM (hf_overrides) as they reached transformers."""
    pytest.importorskip("vllm")
    from systems.engine import VLLMEngine
    yarn, tok = model_lib.load(path, rope_scaling_factor=FACTOR, rope_original_max_positions=ORIGINAL)
    plain = model_lib.load(path)[0]
    overrides = model_lib.yarn_overrides(yarn.config, FACTOR, ORIGINAL)
    engine = VLLMEngine(path, seed=0, dtype="float32", max_model_len=yarn.config.max_position_embeddings, mem=0.25,
                        device="cpu", hf_overrides=overrides)
    prompts = [tok("+".join(str((i * 7 + j) % 9 + 1) for j in range(70 + i)) + "=").input_ids for i in range(4)]
    assert min(map(len, prompts)) > ORIGINAL
    gens = engine.generate(prompts, [24] * len(prompts), Sampling())
    for p, g in zip(prompts, gens):
        assert g.tokens, "the random model should not stop at once"
        n, engine_lp = len(g.tokens), torch.tensor(g.logprobs)
        assert (logprobs(yarn, p + g.tokens, n) - engine_lp).abs().max() < 1e-4
        assert (logprobs(plain, p + g.tokens, n) - engine_lp).abs().max() > 1e-3
