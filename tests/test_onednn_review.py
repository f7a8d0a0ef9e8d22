"""Review of the onednn engine: each test is a break (it fails on 1968c95)."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_decoding import hf_greedy, random_heads
from tiny import tiny_model

from medusa import engine as engines
from medusa import kv_cache, onednn
from medusa.generate import medusa_generate
from medusa.model import MedusaModel
from medusa.tree import Tree

pytestmark = pytest.mark.skipif(onednn.onednn_unavailable(tiny_model("llama")) is not None,
                                reason="oneDNN prepacked fp32 linear layers unavailable in this torch build")

IDS = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))


def linears(model):
    return [m for m in kv_cache.decoder_of(model).modules() if isinstance(m, torch.nn.Linear)]


def greedy(medusa, n=24):
    return medusa.generate(IDS, n, stop_token_ids=set(), do_sample=False)[0]


# 1 (high) -------------------------------------------------------------------------------------------------------
def test_a_peft_lora_merged_after_packing_is_decoded_with_the_merged_weights():
    """peft's merge does ``base_layer.weight.data += delta``: same Parameter, ``_version`` unchanged, so the cached
    PackedLinears keeps the pre-merge weights, also for a brand-new MedusaModel on the merged base."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    heads = random_heads(model)
    MedusaModel(model, heads)  # packs (the default engine)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    merged = peft_model.merge_and_unload()
    reference = hf_greedy(merged, IDS, 24)
    assert greedy(MedusaModel(merged, heads)) == reference


def test_a_weight_changed_through_data_is_packed_again():
    model = tiny_model("llama")
    heads = random_heads(model)
    MedusaModel(model, heads)
    with torch.no_grad():
        for layer in linears(model):
            layer.weight.data += 0.3 * torch.randn_like(layer.weight)  # _version is not bumped through .data
    assert greedy(MedusaModel(model, heads)) == hf_greedy(model, IDS, 24)


# 2 (medium-high) ------------------------------------------------------------------------------------------------
def test_two_overlapping_swapped_blocks_leave_the_base_unchanged():
    """What two threads decoding on one base do (seen with two threads calling MedusaModel.generate): A enters,
    B enters (saves A's _Packed as the module's 'own' forward), A leaves, B leaves and restores A's _Packed. The base
    then runs oneDNN forever: no gradients in training, stale weights after any change."""
    model = tiny_model("llama")
    packed = onednn.packed_linears(model, kv_cache.decoder_of(model))
    a, b = packed.swapped(), packed.swapped()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert [m for m in linears(model) if "forward" in m.__dict__] == []


# 3 (medium) -----------------------------------------------------------------------------------------------------
def test_a_replaced_lm_head_is_used():
    """The cache is keyed by the model and holds the lm_head *module*: set_output_embeddings (resize, a new head)
    leaves lm_head_product on the old module, also for new engines."""
    model = tiny_model("llama", tie_word_embeddings=False)
    heads = random_heads(model)
    MedusaModel(model, heads)
    new_head = torch.nn.Linear(64, 320, bias=False)
    with torch.no_grad():
        new_head.weight.normal_(0, 0.2)
    model.set_output_embeddings(new_head)
    assert greedy(MedusaModel(model, heads), 16) == hf_greedy(model, IDS, 16)


# 4 (medium) -----------------------------------------------------------------------------------------------------
def test_an_nn_linear_subclass_with_its_own_forward_is_not_replaced():
    """PhiMoE's router (like Llama4's) subclasses nn.Linear and returns a tuple; the swap replaces its forward with a
    plain product: ValueError (or, for a 3-node step, silently wrong routing). The default engine breaks a model the
    static engine decodes."""
    from transformers import AutoModelForCausalLM, PhimoeConfig

    torch.manual_seed(0)
    cfg = PhimoeConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       num_local_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    reference = hf_greedy(model, IDS, 16)
    assert greedy(MedusaModel(model, random_heads(model)), 16) == reference


# 5 (low-medium) -------------------------------------------------------------------------------------------------
def test_a_model_moved_to_another_dtype_after_packing_still_decodes():
    """``.to(dtype)`` keeps each Parameter and its _version: the fp32 copies are used with float64 inputs and oneDNN
    fails with 'itensor_view_from_dense expects float/bfloat16/half/int8/fp8 tensor inputDouble'; static decodes."""
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model))
    medusa.to(torch.float64)
    assert greedy(medusa, 16) == hf_greedy(model, IDS, 16)


# 6 (low) --------------------------------------------------------------------------------------------------------
def test_the_engine_under_grad_mode_does_not_silently_drop_gradients():
    """Outside inference mode the logits require grad (embedding/norm path) but the packed products have no
    backward: backward() warns and leaves every linear weight's .grad None. The static engine backpropagates."""
    model = tiny_model("llama")
    engine = engines.make_engine("onednn", model)
    cache = engine.new_cache(16)
    try:
        logits, _ = engine.forward(IDS[:10], torch.arange(10), kv_cache.causal_mask(10, "cpu"), cache)
    except RuntimeError:
        return  # refusing is fine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits.sum().backward()
    assert all(m.weight.grad is not None for m in linears(model))


# 7 (medium, memory) ---------------------------------------------------------------------------------------------
def test_choosing_another_engine_does_not_keep_a_packed_copy_or_warn_about_onednn():
    """MedusaModel.__init__ always builds the default (onednn) engine: the packed copy (as much memory again as the
    weights, ~540 MB for SmolLM2-135M fp32) stays in _BY_MODEL for the model's life even with --engine static /
    eager / compiled; on a CPU where oneDNN cannot run the dtype, '--engine static' still warns "engine 'onednn' runs
    as 'static'"."""
    import weakref

    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model))
    medusa.use_engine("static")
    live = onednn._BY_MODEL.get(model)
    if isinstance(live, weakref.ref):
        live = live()
    assert live is None


# review of bd285a9 -----------------------------------------------------------------------------------------------
def test_another_threads_plain_forward_keeps_a_modules_own_forward_wrapper():
    """While one thread is inside swapped(), another thread's plain forward falls back to nn.Linear.forward, not to
    the module's own instance-level forward (accelerate's hooks, a user's wrapper): it silently skips it."""
    import threading

    model = tiny_model("llama")
    layer = linears(model)[0]
    plain = layer.forward
    layer.forward = lambda x: plain(x) * 0.5  # an instance-level wrapper, as hook libraries install
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        expected = layer(x)
    packed = onednn.packed_linears(model, kv_cache.decoder_of(model))
    inside, done = threading.Event(), threading.Event()

    def hold():
        with packed.swapped():
            inside.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(30)
    try:
        with torch.no_grad():
            got = layer(x)
    finally:
        done.set()
        holder.join(30)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", ["static", "onednn"])
@pytest.mark.parametrize("verify_logits", ["all", "path"])
def test_a_model_made_under_inference_mode_decodes(name, verify_logits):
    """Inference tensors keep no version counter: the lm_head copy and the oneDNN copies must not ask for one."""
    with torch.inference_mode():
        model = tiny_model("llama")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, ids, 16)
    out, _ = medusa_generate(model, random_heads(model), ids, Tree.chain(3), 16, verify_logits=verify_logits,
                             engine=engines.make_engine(name, model))
    assert out == reference
