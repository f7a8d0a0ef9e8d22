"""Review of bd285a9 (GPU session): each test fails on bd285a9 and runs on a CPU."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from medusa import engine as engines
from medusa.cli import _same_prompts_text


# -- medusa/cli.py: the reference over the same prompts -----------------------------------------------------------
def _record(i, tokens, decode_steps, hf_s=1.0, medusa_s=1.0):
    # as run_bench writes it: tokens include the prefill's token, tau = decode tokens / decode steps
    tau = (tokens - 1) / decode_steps if decode_steps else float("nan")
    return {"prompt": i, "tokens": tokens, "tau": tau, "hf_s": hf_s, "medusa_s": medusa_s}


def test_same_prompts_tau_is_decode_tokens_over_decode_steps_like_the_bench():
    reference = {"per_prompt": [_record(0, 11, 4), _record(1, 3, 2), _record(2, 9, 3)]}
    ours = {"per_prompt": [{"prompt": 0, "tokens": 11}, {"prompt": 1, "tokens": 3}]}
    # decode tokens 10 + 2 over decode steps 4 + 2: tau 2.000 (the code gives 1.892)
    assert _same_prompts_text(ours, reference).startswith("tau 2.000,")


def test_same_prompts_tau_survives_a_prompt_decoded_by_the_prefill_alone():
    # a one-token answer (EOS first, or max_new_tokens 1): no decode step, stats.tau is NaN
    reference = {"per_prompt": [_record(0, 11, 4), _record(1, 1, 0), _record(2, 9, 3)]}
    ours = {"per_prompt": [{"prompt": 0, "tokens": 11}, {"prompt": 1, "tokens": 1}]}
    assert _same_prompts_text(ours, reference).startswith("tau 2.500,")


# -- medusa/engine.py: the attention-kernel context on CUDA -------------------------------------------------------
def _cuda_looking_engine(forward):
    engine = engines.StaticEngine.__new__(engines.StaticEngine)
    engines.EagerEngine.__init__(engine, SimpleNamespace(device=torch.device("cuda")))
    engine._forward = forward
    return engine


def test_two_threads_decoding_leave_the_process_attention_flags_as_they_were():
    """sdpa_kernel saves/restores process-global flags: A enters, B enters (saves A's set), A leaves, B leaves and
    restores A's set: cuDNN attention is then off for the whole process (HF generate, training)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a_forward(*_):
        a_in.set()
        b_in.wait(10)

    def b_forward(*_):
        b_in.set()
        a_out.wait(10)

    a, b = _cuda_looking_engine(a_forward), _cuda_looking_engine(b_forward)
    ta = threading.Thread(target=a.forward, args=(None, None, None, None))
    ta.start()
    a_in.wait(10)
    tb = threading.Thread(target=b.forward, args=(None, None, None, None))
    tb.start()
    ta.join(10)
    a_out.set()
    tb.join(10)
    try:
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_callers_own_kernel_choice_is_not_widened():
    """A caller that asked for the math kernel only (reproducibility) gets flash and efficient back inside."""
    seen = {}

    def forward(*_):
        seen["flash"] = torch.backends.cuda.flash_sdp_enabled()
        seen["efficient"] = torch.backends.cuda.mem_efficient_sdp_enabled()

    with sdpa_kernel([SDPBackend.MATH]):
        _cuda_looking_engine(forward).forward(None, None, None, None)
    assert seen == {"flash": False, "efficient": False}


def test_a_compiled_engine_that_fell_back_avoids_cudnn_like_static():
    engine = engines.CompiledEngine.__new__(engines.CompiledEngine)
    engine.fallback_reason, engine.decoder = None, object()
    with pytest.warns(RuntimeWarning):
        engine._fall_back("test")
    assert engine.sdpa_backends == engines.StaticEngine.sdpa_backends
