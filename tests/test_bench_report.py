"""The bench report's comparison with a reference run over the same prompts (``same_prompts_text``)."""

from __future__ import annotations

from medusa.tools.report import same_prompts_text


def _record(i, tokens, decode_steps, hf_s=1.0, medusa_s=1.0):
    # as run_bench writes it: tokens include the prefill's token, tau = decode tokens / decode steps
    tau = (tokens - 1) / decode_steps if decode_steps else float("nan")
    return {"prompt": i, "tokens": tokens, "tau": tau, "hf_s": hf_s, "medusa_s": medusa_s}


def test_same_prompts_tau_is_decode_tokens_over_decode_steps_like_the_bench():
    reference = {"per_prompt": [_record(0, 11, 4), _record(1, 3, 2), _record(2, 9, 3)]}
    ours = {"per_prompt": [{"prompt": 0, "tokens": 11}, {"prompt": 1, "tokens": 3}]}
    # decode tokens 10 + 2 over decode steps 4 + 2: tau 2.000 (a mean of per-prompt taus would give 1.892)
    assert same_prompts_text(ours, reference).startswith("tau 2.000,")


def test_same_prompts_tau_survives_a_prompt_decoded_by_the_prefill_alone():
    # a one-token answer (EOS first, or max_new_tokens 1): no decode step, stats.tau is NaN
    reference = {"per_prompt": [_record(0, 11, 4), _record(1, 1, 0), _record(2, 9, 3)]}
    ours = {"per_prompt": [{"prompt": 0, "tokens": 11}, {"prompt": 1, "tokens": 1}]}
    assert same_prompts_text(ours, reference).startswith("tau 2.500,")


def test_the_profile_table_says_when_the_one_token_split_was_timed_on_a_busy_machine():
    """The split is timed apart from the forward curve: when its forward took far longer than the curve's one-token
    figure (a busy machine), the table says so instead of leaving two figures that disagree; a consistent split
    gets no such line (the control)."""
    from medusa.tools.report import profile_table

    key = {"cpu": "x", "cpu_flags": [], "cores": 2, "torch_threads": 2, "torch": "t", "transformers": "t",
           "model": {}, "dtype": "float32", "device": "cpu"}

    def table(products_s: float) -> str:
        entry = {"forward_s": {"1": 0.041}, "plain_token_s": 0.043,
                 "one_token_split_s": {"products_s": products_s, "outside_s": 0.03}}
        return profile_table({"key": key, "engines": {"onednn": entry}})

    assert "timed on a busy machine" in table(0.128)  # 158 ms against 41 ms
    assert "timed on a busy machine" not in table(0.012)  # 42 ms against 41 ms
