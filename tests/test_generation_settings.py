"""The base's generation settings are honoured as Hugging Face ``generate`` honours them, bad ones are refused, and
sampling is reproducible from a seed."""

from __future__ import annotations

import pytest
import torch
from test_decoding import WIDE_TREE, random_heads
from tiny import tiny_model

from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import medusa_generate
from medusa.model import MedusaModel

EOS = 2


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = EOS
    return model


def prompt(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def hf_tokens(model, ids: torch.Tensor, n: int, **settings) -> list[int]:
    out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
                         do_sample=False, pad_token_id=0, **settings)
    return out[0, len(ids):].tolist()


def medusa_tokens(model, ids: torch.Tensor, n: int, verify_logits: str, **settings) -> list[int]:
    decoding = resolve_decoding(model.generation_config, **settings)
    out, _ = medusa_generate(model, random_heads(model), ids, WIDE_TREE, n, {EOS}, verify_logits, decoding)
    return out


def settings_for(reference: list[int]) -> dict[str, dict]:
    """One setting per supported processor, aimed at tokens the plain greedy output contains so each one bites."""
    a, b, c = reference[0], reference[4], reference[9]
    return {
        "repetition_penalty": {"repetition_penalty": 1.8},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
        "bad_words_ids": {"bad_words_ids": [[b], [reference[1], reference[2]]]},
        "sequence_bias": {"sequence_bias": [[[c], -8.0], [[a, reference[1]], -8.0]]},
        "suppress_tokens": {"suppress_tokens": [a, c]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [a]},
        "min_new_tokens": {"min_new_tokens": 20, "suppress_tokens": [b], "sequence_bias": [[[EOS], 9.0]]},
        "min_length": {"min_length": 30, "sequence_bias": [[[EOS], 9.0]]},
        "forced_eos_token_id": {"forced_eos_token_id": EOS},
        "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (4, 1.6)},
        "remove_invalid_values": {"remove_invalid_values": True, "renormalize_logits": True},
    }


@pytest.mark.parametrize("name", list(settings_for(list(range(10)))))
def test_each_processor_gives_hf_greedy_tokens(llama, name):
    ids = prompt()
    plain = hf_tokens(llama, ids, 24)
    settings = settings_for(plain)[name]
    reference = hf_tokens(llama, ids, 24, **settings)
    if name not in ("remove_invalid_values", "forced_eos_token_id"):
        assert reference != plain, "the setting should change the greedy tokens"
    for verify_logits in ("all", "path"):
        assert medusa_tokens(llama, ids, 24, verify_logits, **settings) == reference, verify_logits


def test_forced_bos_on_a_one_token_prompt(llama):
    ids = prompt(1)
    reference = hf_tokens(llama, ids, 10, forced_bos_token_id=7)
    assert reference[0] == 7
    assert medusa_tokens(llama, ids, 10, "path", forced_bos_token_id=7) == reference


def test_settings_in_the_base_generation_config_are_applied():
    """The new user's case: repetition_penalty in the base's generation_config; HF generate applies it, so must we."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = EOS
    model.generation_config.repetition_penalty = 1.8
    ids = prompt(seed=1)
    reference = hf_tokens(model, ids, 20)
    medusa = MedusaModel(model, random_heads(model), WIDE_TREE)
    assert medusa.generate(ids, 20, stop_token_ids={EOS})[0] == reference
    model.generation_config.repetition_penalty = 1.0
    assert hf_tokens(model, ids, 20) != reference


def test_near_zero_temperature_sampling_is_greedy(llama):
    ids = prompt(seed=2)
    reference = hf_tokens(llama, ids, 24)
    medusa = MedusaModel(llama, random_heads(llama), WIDE_TREE)
    for scores_all_nodes in (True, False):
        medusa.use_engine("static", scores_all_nodes=scores_all_nodes)
        for acceptance in ("rejection", "typical"):
            out, _ = medusa.generate(ids, 24, stop_token_ids={EOS}, do_sample=True, temperature=1e-3, seed=0,
                                     acceptance=acceptance)
            assert out == reference, (scores_all_nodes, acceptance)


def test_same_seed_same_tokens(llama):
    medusa = MedusaModel(llama, random_heads(llama), WIDE_TREE)
    ids = prompt(seed=3)
    runs = {}
    for acceptance in ("rejection", "typical"):
        for seed in (0, 0, 1):
            out, _ = medusa.generate(ids, 30, do_sample=True, temperature=0.8, top_p=0.95, seed=seed,
                                     acceptance=acceptance)
            runs.setdefault((acceptance, seed), []).append(out)
        assert runs[(acceptance, 0)][0] == runs[(acceptance, 0)][1]
        assert runs[(acceptance, 0)][0] != runs[(acceptance, 1)][0]
    streamed = [t for step in medusa.stream(ids, 30, do_sample=True, temperature=0.8, top_p=0.95, seed=0)
                for t in step.tokens]
    assert streamed == runs[("rejection", 0)][0]


@pytest.mark.parametrize("kwargs, message", [
    ({"do_sample": True, "temperature": 0.0}, "temperature must be a positive"),
    ({"do_sample": True, "temperature": -1.0}, "temperature must be a positive"),
    ({"do_sample": True, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"do_sample": True, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"do_sample": True, "top_k": -1}, "top_k must be >= 0"),
    ({"do_sample": True, "acceptance": "greedy"}, "unknown acceptance 'greedy'"),
    ({"acceptance": "typical"}, "needs sampling"),
    ({"temperature": 0.7}, "only apply when sampling"),
    ({"num_beams": 4}, "num_beams=4"),
    ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
    ({"stop_strings": ["x"]}, "stop_strings"),
    ({"penalty_alpha": 0.6, "top_k": 4, "do_sample": True}, "penalty_alpha"),
])
def test_bad_settings_are_refused(llama, kwargs, message):
    medusa = MedusaModel(llama, random_heads(llama), WIDE_TREE)
    with pytest.raises(ValueError, match=message):
        medusa.generate(prompt(), 5, **kwargs)


def test_unsupported_setting_in_the_generation_config_is_named():
    model = tiny_model("llama")
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match="num_beams=3"):
        MedusaModel(model, random_heads(model), WIDE_TREE).generate(prompt(), 5)
