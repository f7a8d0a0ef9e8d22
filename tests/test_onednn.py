"""oneDNN prepacked weights (medusa.engines.onednn, the ``onednn`` engine): same results, the base left as it was."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
from test_decoding import hf_greedy, random_heads
from tiny import tiny_model

from medusa import engines
from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree
from medusa.engines import kv_cache, onednn
from medusa.model import MedusaModel

pytestmark = pytest.mark.skipif(onednn.onednn_unavailable(tiny_model("llama")) is not None,
                                reason="oneDNN prepacked fp32 linear layers unavailable in this torch build")

IDS = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))


def linear_modules(model):
    return [m for m in kv_cache.decoder_of(model).modules() if isinstance(m, torch.nn.Linear)]


def greedy(medusa, n=24):
    return medusa.generate(IDS, n, stop_token_ids=set(), do_sample=False)[0]


def packed_of(model):
    return onednn.PackedLinears(kv_cache.decoder_of(model), model.get_output_embeddings())


def module_tree(model):
    """Every module of the model with its children and its instance attributes' identities (to see nothing changed)."""
    return [(m, dict(m._modules), "forward" in m.__dict__) for m in model.modules()]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_the_shadow_decoder_gives_the_same_hidden_states_and_leaves_the_base_modules_alone(arch):
    model = tiny_model(arch)
    before = module_tree(model)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    packed = packed_of(model)
    shadow = packed.shadow_decoder()
    with torch.no_grad():
        expected = kv_cache.decoder_of(model)(input_ids=ids).last_hidden_state
        got = shadow(input_ids=ids).last_hidden_state
        logits = packed.lm_head_product(got[0])
    linears = [m for m in shadow.modules() if isinstance(m, onednn.PackedLinear)]
    assert len(linears) == len(linear_modules(model)) and not set(map(id, shadow.modules())) & set(
        map(id, [m for m in kv_cache.decoder_of(model).modules() if not isinstance(m, torch.nn.Linear)]))
    base_parameters = {id(p) for p in kv_cache.decoder_of(model).parameters()}
    assert {id(p) for p in shadow.parameters()} <= base_parameters  # shared, not copied
    assert all(id(m.weight) in base_parameters for m in linears)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, model.get_output_embeddings()(expected[0]), atol=1e-5, rtol=1e-5)
    assert module_tree(model) == before


def test_a_modules_own_forward_wrapper_stays_and_runs_where_gradients_are_needed():
    model = tiny_model("llama")
    first = linear_modules(model)[0]
    own = first.forward  # a bound method of nn.Linear ...
    calls = []
    first.forward = lambda x: calls.append(1) or own(x)  # ... and an instance-level wrapper, as a hook library sets
    wrapper = first.forward
    engine = engines.make_engine("onednn", model)
    cache = engine.new_cache(12)
    with torch.no_grad(), pytest.raises(Exception, match="holds 12 positions"):
        engine.forward(IDS[:14], torch.arange(14), kv_cache.causal_mask(14, "cpu"), cache)  # fails inside
    assert first.__dict__["forward"] is wrapper
    assert all("forward" not in m.__dict__ for m in linear_modules(model)[1:])
    with torch.enable_grad():
        engine.forward(IDS[:4], torch.arange(4), kv_cache.causal_mask(4, "cpu"), engine.new_cache(8))
    assert calls  # the shadow ran the module itself, wrapper included, for a product with a backward


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    model = tiny_model("llama")
    layer = linear_modules(model)[0]
    packed = packed_of(model)
    shadow = packed.layers[layer]
    x = torch.randn(3, layer.in_features)
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place, as merging an adapter does
        packed.refresh()
        doubled = shadow(x)
        expected_doubled = torch.nn.functional.linear(x, layer.weight)
        layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # replaced
        packed.refresh()
        zeroed = shadow(x)
        model.get_output_embeddings().weight.add_(1.0)
        lm = packed.lm_head_product(hidden)
        expected_lm = model.get_output_embeddings()(hidden)
    torch.testing.assert_close(doubled, expected_doubled, atol=1e-5, rtol=1e-5)
    assert zeroed.abs().max() == 0
    torch.testing.assert_close(lm, expected_lm, atol=1e-5, rtol=1e-5)


def test_a_module_replaced_in_the_base_is_used_by_the_shadow():
    model = tiny_model("llama")
    packed = packed_of(model)
    layer = kv_cache.decoder_of(model).layers[0].mlp
    layer.down_proj = torch.nn.Linear(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    torch.nn.init.zeros_(layer.down_proj.weight)
    shadow = packed.shadow_decoder()
    assert shadow.layers[0].mlp.down_proj.module is layer.down_proj
    model.train()
    assert packed.shadow_decoder().training and packed.shadow_decoder().layers[0].training
    model.eval()
    ids = IDS[None, :8]
    with torch.no_grad():
        torch.testing.assert_close(packed.shadow_decoder()(input_ids=ids).last_hidden_state,
                                   kv_cache.decoder_of(model)(input_ids=ids).last_hidden_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_onednn_engine_decodes_the_base_greedy_tokens_and_leaves_hf_generate_alone(arch):
    model = tiny_model(arch)
    reference = hf_greedy(model, IDS, 32)
    engine = engines.make_engine("onednn", model)
    assert engine.scores_all_nodes and engine.settings()["packed"] is True
    assert not engines.make_engine("onednn", model, scores_all_nodes=False).scores_all_nodes
    heads = random_heads(model)
    medusa = MedusaModel(model, heads)
    medusa.use_engine("onednn")
    assert medusa.engine.scores_all_nodes  # a prepacked lm_head scores every node at once
    model.generation_config.eos_token_id = None
    out, stats = medusa.generate(IDS, max_new_tokens=32, stop_token_ids=set(), do_sample=False)
    assert out == reference and stats.decode_steps > 0
    assert hf_greedy(model, IDS, 32) == reference  # the base's own modules still run as before
    medusa.use_engine("static")
    assert not medusa.engine.scores_all_nodes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_decoding_runs_on_the_packed_weights_and_stays_exact(arch, monkeypatch):
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 20, 13)]
    references = [hf_greedy(model, p, 24) for p in prompts]
    medusa = MedusaModel(model, random_heads(model), engine="onednn")
    before = module_tree(model)
    calls = []
    packed_forward = onednn.PackedLinear.forward
    monkeypatch.setattr(onednn.PackedLinear, "forward", lambda self, x: calls.append(1) or packed_forward(self, x))
    for tree in (None, medusa.tree.chain(0)):  # Medusa and plain batched decoding
        calls.clear()
        outs, _ = medusa.generate_batch(prompts, max_new_tokens=24, tree=tree, stop_token_ids=set())
        assert outs == references
        assert calls  # the base's linear layers ran on the oneDNN copies
    assert module_tree(model) == before
    medusa.use_engine("static")
    calls.clear()
    assert medusa.generate_batch(prompts, max_new_tokens=24, stop_token_ids=set())[0] == references and not calls


def test_onednn_engine_runs_as_static_with_a_warning_naming_why(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(onednn, "onednn_unavailable", lambda m: "no oneDNN (test)")
    with pytest.warns(RuntimeWarning, match=r"engine 'onednn' runs as 'static': no oneDNN \(test\)"):
        engine = engines.make_engine("onednn", model)
    assert not engine.scores_all_nodes  # a CPU without a packed lm_head: along the path
    assert engine.settings()["packed"] is False and engine.settings()["fallback_reason"] == "no oneDNN (test)"


def test_a_dtype_onednn_cannot_run_is_named():
    model = tiny_model("llama").to(torch.float16)
    reason = onednn.onednn_unavailable(model)
    if reason is not None:  # CPUs with AVX-512 FP16 or AVX-NE-CONVERT can run it
        assert "torch.float16" in reason


def test_each_engine_owns_its_packed_copy_and_frees_it_with_itself():
    model = tiny_model("llama")
    first, second = engines.make_engine("onednn", model), engines.make_engine("onednn", model)
    assert first.packed is not second.packed
    gone = weakref.ref(second.packed)
    del second
    gc.collect()
    assert gone() is None and first.packed is not None


def test_a_peft_lora_merged_after_packing_is_decoded_with_the_merged_weights():
    """peft's merge does ``base_layer.weight.data += delta``: same Parameter, ``_version`` unchanged; a new
    MedusaModel on the merged base packs the merged weights."""
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


def test_a_weight_changed_through_data_is_packed_again_by_a_new_engine():
    model = tiny_model("llama")
    heads = random_heads(model)
    MedusaModel(model, heads)
    with torch.no_grad():
        for layer in linear_modules(model):
            layer.weight.data += 0.3 * torch.randn_like(layer.weight)  # _version is not bumped through .data
    assert greedy(MedusaModel(model, heads)) == hf_greedy(model, IDS, 24)


def test_a_replaced_lm_head_is_used():
    """set_output_embeddings (resize, a new head) after packing: the engine runs the new head."""
    model = tiny_model("llama", tie_word_embeddings=False)
    heads = random_heads(model)
    medusa = MedusaModel(model, heads)
    new_head = torch.nn.Linear(64, 320, bias=False)
    with torch.no_grad():
        new_head.weight.normal_(0, 0.2)
    model.set_output_embeddings(new_head)
    assert greedy(medusa, 16) == hf_greedy(model, IDS, 16)  # the engine packed before the change
    assert greedy(MedusaModel(model, heads), 16) == hf_greedy(model, IDS, 16)


def test_an_nn_linear_subclass_with_its_own_forward_is_not_replaced():
    """PhiMoE's router (like Llama4's) subclasses nn.Linear and returns a tuple: a plain product in its place would
    raise (or, for a 3-node step, route silently wrong)."""
    from transformers import AutoModelForCausalLM, PhimoeConfig

    torch.manual_seed(0)
    cfg = PhimoeConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       num_local_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    reference = hf_greedy(model, IDS, 16)
    assert greedy(MedusaModel(model, random_heads(model)), 16) == reference


def test_a_model_moved_to_another_dtype_after_packing_still_decodes():
    """``.to(dtype)`` keeps each Parameter and its _version: the fp32 copies cannot run float64 inputs, so the
    engine runs as static."""
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model))
    medusa.to(torch.float64)
    assert greedy(medusa, 16) == hf_greedy(model, IDS, 16)


def test_the_engine_under_grad_mode_does_not_silently_drop_gradients():
    """Outside inference mode the packed products (no backward) give way to the modules' own: every linear weight
    gets a gradient, as with the static engine."""
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
    assert all(m.weight.grad is not None for m in linear_modules(model))


def test_choosing_another_engine_frees_the_packed_copy():
    """MedusaModel.__init__ builds the default (onednn) engine: choosing another frees its packed copy (as much
    memory again as the weights)."""
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model))
    packed = weakref.ref(medusa.engine.packed)
    medusa.use_engine("static")
    gc.collect()
    assert packed() is None


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


def test_two_engines_of_one_model_decoding_in_two_threads_both_stay_exact():
    model = tiny_model("llama")
    heads = random_heads(model)
    reference = hf_greedy(model, IDS, 24)
    before = module_tree(model)
    results = []

    def decode():
        engine = engines.make_engine("onednn", model)
        results.extend(medusa_generate(model, heads, IDS, Tree.chain(3), 24, engine=engine)[0] for _ in range(3))

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [reference] * 6 and module_tree(model) == before


def sdpa_flags():
    b = torch.backends.cuda
    return (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


@pytest.mark.parametrize("name", ["onednn", "static", "eager"])
def test_another_thread_using_the_model_sees_nothing_change_while_an_engine_decodes(name):
    """One thread decodes through an engine while another runs the same model's plain forward and HF generate:
    the second gets what it gets alone, and sees the modules and torch's attention-kernel flags as they were."""
    model = tiny_model("llama")
    heads = random_heads(model)
    layer = linear_modules(model)[0]
    plain = layer.forward
    layer.forward = lambda x: plain(x) * 0.5  # an instance-level wrapper, as hook libraries install
    ids = IDS[None, :12]
    with torch.no_grad():
        logits_alone = model(ids).logits
    generate_alone = hf_greedy(model, IDS, 12)
    tree_before, flags_before = module_tree(model), sdpa_flags()
    engine = engines.make_engine(name, model)
    decode_alone = medusa_generate(model, heads, IDS, Tree.chain(3), 24, engine=engine)[0]

    first_forward, stop, seen, decoded = threading.Event(), threading.Event(), [], []
    original = engine._forward

    def forward(*args):  # tells the other thread the decode has begun
        out = original(*args)
        first_forward.set()
        return out

    engine._forward = forward

    def decode():
        while not stop.is_set():
            decoded.append(medusa_generate(model, heads, IDS, Tree.chain(3), 24, engine=engine)[0])

    decoder = threading.Thread(target=decode)
    decoder.start()
    try:
        assert first_forward.wait(60)
        for _ in range(3):
            with torch.no_grad():
                seen.append(torch.equal(model(ids).logits, logits_alone))
            seen.append(hf_greedy(model, IDS, 12) == generate_alone)
            seen.append(module_tree(model) == tree_before and sdpa_flags() == flags_before)
    finally:
        stop.set()
        decoder.join(120)
    assert all(seen), seen
    assert decoded and all(d == decode_alone for d in decoded)
    assert layer.__dict__["forward"] is not None and module_tree(model) == tree_before
    assert hf_greedy(model, IDS, 12) == generate_alone  # and after the decode


def test_hooks_on_the_base_linear_layers_still_fire_on_the_onednn_engine():
    model = tiny_model("llama")
    reference = hf_greedy(model, IDS, 12)
    layer = kv_cache.decoder_of(model).layers[0].mlp.down_proj
    engine = engines.make_engine("onednn", model)
    calls = []
    handle = layer.register_forward_hook(lambda module, args, out: calls.append(1) or out * 0.0)
    try:
        hooked = hf_greedy(model, IDS, 12)
        out, _ = medusa_generate(model, random_heads(model), IDS, Tree.chain(3), 12, engine=engine)
        assert out == hooked != reference and calls  # the hook (zeroing the MLP output) runs in the engine too
    finally:
        handle.remove()


def test_a_change_through_data_is_seen_after_a_forced_refresh():
    model = tiny_model("llama")
    engine = engines.make_engine("onednn", model)
    layer = kv_cache.decoder_of(model).layers[0].self_attn.o_proj
    layer.weight.data += 0.5  # no version bump (peft's default merge writes weights this way)
    changed = hf_greedy(model, IDS, 12)
    engine.refresh(force=True)
    out, _ = medusa_generate(model, random_heads(model), IDS, Tree.chain(3), 12, engine=engine)
    assert out == changed


def sdpa_model(arch):
    model = tiny_model(arch)
    model.config._attn_implementation = "sdpa"  # tiny models default to eager; real bases load with SDPA
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_grouped_query_attention_gives_the_same_bits_as_transformers_sdpa(arch):
    """Grouped key heads read in place under a mask (a tree's, a batch's, a sliding window's) equal transformers'
    SDPA attention, which copies them first, bit for bit; the call without a mask is transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from medusa.engines.attention import grouped_query_attention

    model = sdpa_model(arch)
    module = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    assert module.num_key_value_groups > 1
    g = torch.Generator().manual_seed(0)
    heads, kv, dim = model.config.num_attention_heads, model.config.num_key_value_heads, module.head_dim
    for batch, n, length in [(1, 5, 30), (3, 4, 41), (16, 2, 64), (2, 7, 200)]:
        q, k, v = (torch.randn(batch, h, s, dim, generator=g) for h, s in ((heads, n), (kv, length), (kv, length)))
        visible = torch.rand(batch, 1, n, length, generator=g) > 0.3
        visible[..., -1] = True  # every row sees at least one key
        additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        for mask in (visible, additive, None):
            got = grouped_query_attention(module, q, k, v, mask, scaling=module.scaling)[0]
            expected = sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)[0]
            assert torch.equal(got, expected), (batch, n, length, None if mask is None else mask.dtype)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_shadow_decoder_reads_grouped_keys_in_place_with_the_same_bits(arch, monkeypatch):
    """The onednn shadow's attention modules (only theirs: the base keeps SDPA) run the grouped attention; a tree
    verify and a batched step give the same logits as the shadow on transformers' SDPA."""
    from medusa.engines.attention import GROUPED_QUERY_ATTENTION

    model = sdpa_model(arch)
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 17)]
    tree = kv_cache.causal_mask(5, "cpu")
    tree[3, 1:3] = False  # a branch: node 3 sees the root only

    def run(engine):
        cache = engine.new_cache(40)
        engine.forward(prompts[0], torch.arange(9), kv_cache.causal_mask(9, "cpu"), cache)
        one = engine.forward(IDS[:5], 9 + torch.tensor([0, 1, 2, 1, 2]), tree, cache)[0]
        rows = [engine.prefill_row(p, capacity=40)[0] for p in prompts]
        batched = engine.forward_rows(IDS[None, :5].expand(2, 5), torch.tensor([[9, 10, 11, 10, 11], [17, 18, 19, 18,
                                      19]]), torch.tensor([9, 17]), tree, engine.stack_rows(rows))
        return one, batched

    with torch.inference_mode():
        grouped = engines.make_engine("onednn", model)
        attention = {m.config._attn_implementation for m in grouped.packed.shadow_decoder().modules()
                     if type(m).__name__.endswith("Attention")}
        assert attention == {GROUPED_QUERY_ATTENTION} and model.config._attn_implementation == "sdpa"
        assert all(m.config._attn_implementation == "sdpa" for m in model.modules()
                   if type(m).__name__.endswith("Attention"))
        sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                          lambda *a, **k: calls.append(k.get("enable_gqa")) or sdpa(*a, **k))
            got = run(grouped)
        assert True in calls  # the tree's and the batch's forwards took the grouped path
        monkeypatch.setattr(onednn, "use_grouped_query_attention", lambda shadow: 0)
        expected = run(engines.make_engine("onednn", model))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
