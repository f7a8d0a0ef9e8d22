"""oneDNN prepacked weights (medusa.onednn, the ``onednn`` engine): same results, the base left as it was."""

from __future__ import annotations

import pytest
import torch
from test_decoding import hf_greedy, random_heads
from tiny import tiny_model

from medusa import engine as engines
from medusa import kv_cache, onednn
from medusa.model import MedusaModel

pytestmark = pytest.mark.skipif(onednn.onednn_unavailable(tiny_model("llama")) is not None,
                                reason="oneDNN prepacked fp32 linear layers unavailable in this torch build")


def linear_modules(model):
    return [m for m in kv_cache.decoder_of(model).modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_swapped_linears_give_the_same_hidden_states_and_are_put_back(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    packed = onednn.PackedLinears(kv_cache.decoder_of(model), model.get_output_embeddings())
    with torch.no_grad():
        expected = kv_cache.decoder_of(model)(input_ids=ids).last_hidden_state
        with packed.swapped():
            assert all(isinstance(m.forward, onednn._Packed) for m in linear_modules(model))
            got = kv_cache.decoder_of(model)(input_ids=ids).last_hidden_state
        logits = packed.lm_head_product(got[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, model.get_output_embeddings()(expected[0]), atol=1e-5, rtol=1e-5)
    assert all("forward" not in m.__dict__ for m in linear_modules(model))


def test_an_error_inside_the_block_and_a_hooked_forward_are_put_back():
    model = tiny_model("llama")
    first = linear_modules(model)[0]
    own = first.forward  # a bound method of nn.Linear ...
    first.forward = lambda x: own(x) * 1.0  # ... and an instance-level wrapper, as a hook library sets one
    wrapper = first.forward
    packed = onednn.PackedLinears(kv_cache.decoder_of(model), model.get_output_embeddings())
    with pytest.raises(RuntimeError, match="boom"), packed.swapped():
        raise RuntimeError("boom")
    assert first.__dict__["forward"] is wrapper
    assert all("forward" not in m.__dict__ for m in linear_modules(model)[1:])


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    model = tiny_model("llama")
    layer = linear_modules(model)[0]
    packed = onednn.PackedLinears(kv_cache.decoder_of(model), model.get_output_embeddings())
    x = torch.randn(3, layer.in_features)
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place, as merging an adapter does
        with packed.swapped():
            doubled = layer(x)
        expected_doubled = torch.nn.functional.linear(x, layer.weight)
        layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # replaced
        with packed.swapped():
            zeroed = layer(x)
        model.get_output_embeddings().weight.add_(1.0)
        lm = packed.lm_head_product(hidden)
        expected_lm = model.get_output_embeddings()(hidden)
    torch.testing.assert_close(doubled, expected_doubled, atol=1e-5, rtol=1e-5)
    assert zeroed.abs().max() == 0
    torch.testing.assert_close(lm, expected_lm, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_onednn_engine_decodes_the_base_greedy_tokens_and_leaves_hf_generate_alone(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))
    reference = hf_greedy(model, ids, 32)
    engine = engines.make_engine("onednn", model)
    assert engine.packs_lm_head and engine.settings()["packed"] is True
    heads = random_heads(model)
    medusa = MedusaModel(model, heads)
    medusa.use_engine("onednn")
    assert medusa.verify_logits == "all"  # a prepacked lm_head scores every node at once
    model.generation_config.eos_token_id = None
    out, stats = medusa.generate(ids, max_new_tokens=32, stop_token_ids=set(), do_sample=False)
    assert out == reference and stats.decode_steps > 0
    assert hf_greedy(model, ids, 32) == reference  # the base's own modules still run as before
    medusa.use_engine("static")
    assert medusa.verify_logits == "path"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_decoding_runs_on_the_packed_weights_and_stays_exact(arch, monkeypatch):
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 20, 13)]
    references = [hf_greedy(model, p, 24) for p in prompts]
    medusa = MedusaModel(model, random_heads(model), engine="onednn")
    calls = []
    packed_call = onednn._Packed.__call__
    monkeypatch.setattr(onednn._Packed, "__call__", lambda self, x: calls.append(1) or packed_call(self, x))
    for tree in (None, medusa.tree.chain(0)):  # Medusa and plain batched decoding
        calls.clear()
        outs, _ = medusa.generate_batch(prompts, max_new_tokens=24, tree=tree, stop_token_ids=set())
        assert outs == references
        assert calls  # the base's linear layers ran on the oneDNN copies
    assert not any("forward" in m.__dict__ for m in model.modules())  # put back afterwards
    medusa.use_engine("static")
    calls.clear()
    assert medusa.generate_batch(prompts, max_new_tokens=24, stop_token_ids=set())[0] == references and not calls


def test_onednn_engine_runs_as_static_with_a_warning_naming_why(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(onednn, "onednn_unavailable", lambda m: "no oneDNN (test)")
    with pytest.warns(RuntimeWarning, match=r"engine 'onednn' runs as 'static': no oneDNN \(test\)"):
        engine = engines.make_engine("onednn", model)
    assert not engine.packs_lm_head
    assert engine.settings()["packed"] is False and engine.settings()["fallback_reason"] == "no oneDNN (test)"


def test_a_dtype_onednn_cannot_run_is_named():
    model = tiny_model("llama").to(torch.float16)
    reason = onednn.onednn_unavailable(model)
    if reason is not None:  # CPUs with AVX-512 FP16 or AVX-NE-CONVERT can run it
        assert "torch.float16" in reason


def test_engines_of_one_model_share_one_packed_copy():
    model = tiny_model("llama")
    first, second = engines.make_engine("onednn", model), engines.make_engine("onednn", model)
    assert first.packed is second.packed
    assert engines.make_engine("onednn", tiny_model("llama")).packed is not first.packed
