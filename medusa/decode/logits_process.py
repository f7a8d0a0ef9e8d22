"""The base's generation settings, applied to Medusa's verify logits exactly as Hugging Face ``generate`` applies them.

Settings come from the base's ``generation_config`` (then Hugging Face's global defaults for what it leaves unset),
overridden by the caller's arguments: the merge ``generate`` itself performs. Every setting that ``generate`` would
apply to the next-token logits of a single greedy or sampled sequence is built here with transformers' own
``LogitsProcessor`` classes, in ``generate``'s order, and run at each tree node on the node's own prefix (the
accepted tokens plus the path down to the node). A setting that changes decoding in a way Medusa decoding does not
reproduce (beam search, guidance, watermarking, stop strings...) is refused with an error that names it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Applied by :func:`logits_processors` (the order there is generate's).
APPLIED = {
    "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "sequence_bias", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "renormalize_logits", "eos_token_id",
}
# Do not change the tokens of one greedy or sampled sequence: ids used elsewhere, output formatting, cache and
# compile options, the length budget (max_new_tokens is the caller's), and options of other decoding modes that
# generate ignores when those modes are off (beam-search scoring, assisted-generation schedules).
NO_EFFECT = {
    "bos_token_id", "pad_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
    "max_cache_len", "compile_config", "disable_compile", "prefill_chunk_size", "continuous_batching_config",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "max_length", "max_new_tokens", "early_stopping", "length_penalty", "low_memory", "is_assistant",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
    "target_lookbehind", "max_matching_ngram_size", "transformers_version", "_from_model_config",
}
# Settings Medusa decoding cannot honour, with the value at which they are off.
REFUSED_UNLESS = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "num_return_sequences": 1,
    "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0,
}


def resolve_generation_config(base_config, **overrides):
    """The settings HF ``generate`` would use: ``base_config`` filled with HF's global defaults, then ``overrides``
    (``None`` values mean "not given").

    Raises:
        ValueError: a setting Medusa decoding cannot honour is active; the error names it.
    """
    from transformers import GenerationConfig

    config = copy.deepcopy(base_config) if base_config is not None else GenerationConfig()
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    config.update(**{k: v for k, v in overrides.items() if v is not None})
    for key, value in config.to_dict().items():
        if key in APPLIED or key in NO_EFFECT or value is None:
            continue
        if key in REFUSED_UNLESS and value in (REFUSED_UNLESS[key], None):
            continue
        if key not in REFUSED_UNLESS and value in (False, 0, 0.0, {}, [], ""):
            continue
        raise ValueError(f"generation setting {key}={value!r} (from the base's generation_config or the arguments) "
                         "cannot be honoured by Medusa decoding; unset it")
    return config


@dataclass
class Decoding:
    """How tokens are picked: the resolved generation settings plus the speculative-sampling options.

    Build it with :func:`resolve_decoding`.
    """

    generation_config: object
    """The resolved ``transformers.GenerationConfig`` (see :func:`resolve_generation_config`)."""
    seed: int | None = None
    """Seed of the decode call's own random generator; ``None`` draws a fresh one."""
    acceptance: str = "rejection"
    """With sampling: "rejection" (lossless recursive rejection sampling), "coupled" (lossless, and the tokens a
    function of the seed alone, whatever the drafter, tree or batch: :class:`medusa.decode.acceptance.CoupledSampling`)
    or "typical" (Medusa's typical acceptance, lossy, faster)."""
    typical_epsilon: float = 0.3
    """Typical acceptance: hard threshold epsilon on p(x)."""
    typical_delta: float = 0.09
    """Typical acceptance: entropy-scaled threshold delta, as in delta * exp(-H(p))."""

    def __post_init__(self):
        config = self.generation_config
        from medusa.decode.acceptance import sampling_rules  # here: that module reads Decoding from this one

        if self.acceptance not in sampling_rules():
            raise ValueError(f"unknown acceptance {self.acceptance!r}: expected one of {list(sampling_rules())}")
        if config.top_k is not None and config.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {config.top_k}")
        if config.top_p is not None and not 0 < config.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {config.top_p}")
        if not self.do_sample:
            if self.acceptance == "typical":
                raise ValueError("acceptance='typical' needs sampling (do_sample=True)")
            return
        if config.temperature is None or not config.temperature > 0 or math.isinf(config.temperature):
            raise ValueError(f"temperature must be a positive number when sampling, got {config.temperature}")
        if self.acceptance == "typical" and not (self.typical_epsilon > 0 and self.typical_delta > 0):
            raise ValueError(f"typical_epsilon and typical_delta must be > 0, got {self.typical_epsilon}, "
                             f"{self.typical_delta}")

    @property
    def do_sample(self) -> bool:
        return bool(self.generation_config.do_sample)

    def processors(self, prompt_len: int, max_new_tokens: int, eos_token_ids: set[int], device):
        """The logits processors HF ``generate`` builds for these settings (see :func:`logits_processors`)."""
        return logits_processors(self.generation_config, prompt_len, max_new_tokens, eos_token_ids, device)

    def draft_warp(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Head logits ``(P, Vh)`` -> the logits the draft is sampled from: the same temperature, top-k and top-p."""
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        config, warpers = self.generation_config, []
        if config.temperature not in (None, 1.0):
            warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            warpers.append(TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            warpers.append(TopPLogitsWarper(config.top_p))

        def warp(logits: torch.Tensor) -> torch.Tensor:
            for w in warpers:
                logits = w(None, logits)
            return logits

        return warp


def resolve_decoding(base_config=None, do_sample: bool | None = None, temperature: float | None = None,
                     top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                     acceptance: str = "rejection", typical_epsilon: float = 0.3, typical_delta: float = 0.09,
                     **settings) -> Decoding:
    """Merge the base's ``generation_config`` with the caller's arguments (``None``: take the base's, then HF's
    global default; note HF's default ``top_k`` is 50 when sampling) into a validated :class:`Decoding`.

    ``settings`` are further generation-config fields (e.g. ``repetition_penalty=1.2``).

    Raises:
        ValueError: temperature <= 0 with sampling, top_p outside (0, 1], top_k < 0, an unknown acceptance rule,
            typical acceptance without sampling, sampling arguments given without sampling, or a generation setting
            that cannot be honoured (named).
    """
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    config = resolve_generation_config(base_config, do_sample=do_sample, **given, **settings)
    if not config.do_sample and (explicit := [k for k, v in given.items() if v is not None]):
        raise ValueError(f"{', '.join(explicit)} only apply when sampling: pass do_sample=True")
    return Decoding(config, seed, acceptance, typical_epsilon, typical_delta)


def logits_processors(config, prompt_len: int, max_new_tokens: int, eos_token_ids: set[int], device):
    """transformers' ``LogitsProcessorList`` for one sequence, as ``GenerationMixin._get_logits_processor`` builds it
    (same classes, same order) for a decoder-only model given ``max_new_tokens``.

    Args:
        config: a resolved ``GenerationConfig``.
        prompt_len: prompt tokens (where new tokens start).
        max_new_tokens: the budget (``max_length`` is ``prompt_len + max_new_tokens``, as in ``generate``).
        eos_token_ids: the stop tokens (``generate``'s ``eos_token_id``); processors that need one are skipped
            without it, as in ``generate``.

    Returns:
        A list; call it as ``processors(input_ids (1, L), scores (1, V))``.
    """
    from transformers.generation import logits_process as lp

    eos = torch.tensor(sorted(eos_token_ids), device=device) if eos_token_ids else None
    out = lp.LogitsProcessorList()
    if config.sequence_bias is not None:
        out.append(lp.SequenceBiasLogitsProcessor(config.sequence_bias))
    if config.repetition_penalty not in (None, 1.0):
        out.append(lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        out.append(lp.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        out.append(lp.NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_length and eos is not None:
        out.append(lp.MinLengthLogitsProcessor(config.min_length, eos, device=device))
    if config.min_new_tokens and eos is not None:
        out.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos, device=device))
    if config.forced_bos_token_id is not None:
        out.append(lp.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        out.append(lp.ForcedEOSTokenLogitsProcessor(prompt_len + max_new_tokens, config.forced_eos_token_id,
                                                    device=device))
    if config.remove_invalid_values:
        out.append(lp.InfNanRemoveLogitsProcessor())
    if config.exponential_decay_length_penalty is not None:
        out.append(lp.ExponentialDecayLengthPenalty(config.exponential_decay_length_penalty, eos, prompt_len))
    if config.suppress_tokens is not None:
        out.append(lp.SuppressTokensLogitsProcessor(config.suppress_tokens, device=device))
    if config.begin_suppress_tokens is not None:
        begin = prompt_len if prompt_len > 1 or config.forced_bos_token_id is None else prompt_len + 1
        out.append(lp.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin, device=device))
    if config.do_sample:
        out.extend(_sampling_warpers(config, device))
    if config.renormalize_logits:
        out.append(lp.LogitNormalization())
    return out


def _sampling_warpers(config, device) -> list:
    """``generate``'s sampling-only warpers, in its order (one sequence: ``min_tokens_to_keep`` 1)."""
    from transformers.generation import logits_process as lp

    out = []
    if config.temperature not in (None, 1.0):
        out.append(lp.TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        out.append(lp.TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        out.append(lp.TopPLogitsWarper(config.top_p))
    if config.min_p is not None:
        out.append(lp.MinPLogitsWarper(config.min_p))
    if config.typical_p is not None and config.typical_p < 1.0:
        out.append(lp.TypicalLogitsWarper(mass=config.typical_p))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        out.append(lp.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        out.append(lp.EtaLogitsWarper(epsilon=config.eta_cutoff, device=device))
    return out
