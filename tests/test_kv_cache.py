"""KV-cache surgery, masks and the explicit-mask forward, checked against the stock transformers model.

Run on every supported transformers version: the installed one by the suite, another one with
``scripts/test_transformers_version.sh 5.17.0`` (a second virtual environment with that release).
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from tiny import tiny_config, tiny_model

from medusa.decode.tree import Tree, tree_buffers
from medusa.engines import kv_cache

ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma3"]
WINDOW = 8  # tiny mistral and gemma3 sliding window
# Node indices (root 0): (0)=1 (1)=2 (0,0)=3 (1,0)=4 (1,1)=5 (1,0,0)=6.
TREE = Tree.from_paths([[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0]])


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def stock_cache(model, ids: torch.Tensor):
    """The model's own forward over ``ids`` from position 0 into a fresh cache: ``(logits (T, V), cache)``."""
    cache = kv_cache.new_cache()
    with torch.no_grad():
        out = model(ids[None], use_cache=True, **{kv_cache._cache_kwarg(type(model)): cache})
    return out.logits[0], cache


def prefill(model, ids: torch.Tensor):
    """``kv_cache.forward`` over ``ids`` from position 0 into a fresh cache: ``(logits, hidden, cache)``."""
    cache = kv_cache.new_cache()
    n = len(ids)
    with torch.no_grad():
        logits, hidden = kv_cache.forward(model, ids, torch.arange(n), kv_cache.causal_mask(n, "cpu"), cache)
    return logits, hidden, cache


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_keep_positions_equals_a_cache_built_from_the_accepted_tokens(arch):
    model = tiny_model(arch)
    prefix_len = 12  # longer than the sliding window
    prefix, nodes = ids_of(prefix_len), ids_of(TREE.num_nodes, seed=1)
    _, _, cache = prefill(model, prefix)
    buffers = tree_buffers(TREE)
    with torch.no_grad():
        kv_cache.forward(model, nodes, prefix_len + buffers.depth, buffers.ancestor_mask, cache)
    assert kv_cache.cache_length(cache) == prefix_len + TREE.num_nodes
    keep = torch.tensor([0, 2, 4, 6])  # root, (1), (1,0), (1,0,0): not contiguous in the node order
    kv_cache.keep_positions(cache, prefix_len, keep)

    accepted = torch.cat([prefix, nodes[keep]])
    full_logits, reference = stock_cache(model, accepted)
    assert kv_cache.cache_length(cache) == len(accepted)
    assert len(cache.layers) == len(reference.layers)
    for layer, ref in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-5)

    # Decoding goes on from the compacted cache exactly as from the reference one.
    nxt = ids_of(1, seed=2)
    with torch.no_grad():
        logits, _ = kv_cache.forward(model, nxt, torch.tensor([len(accepted)]), kv_cache.causal_mask(1, "cpu"), cache)
    expected, _ = stock_cache(model, torch.cat([accepted, nxt]))
    torch.testing.assert_close(logits[0], expected[-1], atol=1e-5, rtol=1e-5)


def test_keep_positions_with_nothing_kept_restores_the_prefix():
    model = tiny_model("llama")
    prefix = ids_of(6)
    _, _, cache = prefill(model, prefix)
    before = [layer.keys.clone() for layer in cache.layers]
    with torch.no_grad():
        kv_cache.forward(model, ids_of(3, seed=1), torch.arange(6, 9), kv_cache.causal_mask(3, "cpu"), cache)
    kv_cache.keep_positions(cache, 6, torch.tensor([], dtype=torch.long))
    assert kv_cache.cache_length(cache) == 6
    assert all(torch.equal(layer.keys, old) for layer, old in zip(cache.layers, before, strict=True))


def visible_keys(mask: torch.Tensor) -> torch.Tensor:
    """Boolean visibility from an additive mask, after checking it holds only 0 and dtype-min."""
    assert mask.dtype.is_floating_point
    zero, minimum = mask == 0, mask == torch.finfo(mask.dtype).min
    assert (zero | minimum).all()
    return zero[0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, kinds", [("llama", None), ("mistral", None), ("qwen2", {"full_attention"}),
                                         ("gemma3", {"full_attention", "sliding_attention"})])
def test_mask_form_values_and_window(arch, kinds, dtype):
    config = tiny_config(arch)
    prefix_len = 12
    buffers = tree_buffers(TREE)
    positions = prefix_len + buffers.depth  # (N,)
    mask = kv_cache.build_attention_mask(config, prefix_len, positions, buffers.ancestor_mask, dtype)
    if kinds is None:  # no per-layer types: a single tensor
        assert isinstance(mask, torch.Tensor)
        masks = {"sliding_attention" if arch == "mistral" else "full_attention": mask}
    else:
        assert isinstance(mask, dict) and set(mask) == kinds
        masks = mask
    n = TREE.num_nodes
    key_pos = torch.cat([torch.arange(prefix_len), positions]).tolist()
    for kind, m in masks.items():
        assert m.shape == (1, 1, n, prefix_len + n) and m.dtype == dtype
        visible = visible_keys(m)
        for i in range(n):
            for j in range(prefix_len + n):
                allowed = j < prefix_len or bool(buffers.ancestor_mask[i, j - prefix_len])
                if kind == "sliding_attention":
                    allowed = allowed and positions[i] - key_pos[j] < WINDOW
                assert bool(visible[i, j]) == allowed, (kind, i, j)
    if "sliding_attention" in masks:  # the window really cuts something here
        assert not visible_keys(masks["sliding_attention"])[:, :prefix_len].all()


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_the_stock_model(arch):
    model = tiny_model(arch)
    ids = ids_of(20)
    expected, _ = stock_cache(model, ids)
    logits, hidden, _ = prefill(model, ids)
    assert hidden.shape == (20, model.config.get_text_config().hidden_size)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    # The same prompt in two chunks: the second sees the first through the cache and the prefix mask.
    _, _, cache = prefill(model, ids[:13])
    with torch.no_grad():
        tail, _ = kv_cache.forward(model, ids[13:], torch.arange(13, 20), kv_cache.causal_mask(7, "cpu"), cache,
                                   logits_for=slice(-2, None))
    torch.testing.assert_close(tail, expected[-2:], atol=1e-5, rtol=1e-5)


def test_forward_applies_final_logit_softcapping():
    model = tiny_model("gemma3", final_logit_softcapping=30.0)
    ids = ids_of(20)
    expected, _ = stock_cache(model, ids)
    logits, hidden, _ = prefill(model, ids)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        uncapped = model.get_output_embeddings()(hidden)
    assert (uncapped - expected).abs().max() > 1e-3  # control: the cap changes these logits
    assert expected.abs().max() < 30.0


class NoCacheDecoder(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


def test_cache_keyword_matches_the_installed_signature():
    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        kv_cache._cache_kwarg(NoCacheDecoder)
    for arch in ARCHS:
        decoder = kv_cache.decoder_of(tiny_model(arch))
        keyword = kv_cache._cache_kwarg(type(decoder))
        assert keyword in inspect.signature(type(decoder).forward).parameters
        cache = kv_cache.new_cache()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            decoder(input_ids=ids_of(5)[None], use_cache=True, **{keyword: cache})
        # A keyword the decoder ignores leaves the cache empty (5.17 with `cache`); a deprecated one warns (5.24).
        assert kv_cache.cache_length(cache) == 5, arch
        assert not [w for w in caught if "deprecated" in str(w.message) and "past_key_values" in str(w.message)]


def test_unsupported_layer_types_are_refused():
    config = tiny_config("qwen2")
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        kv_cache.attention_layout(config)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_lm_logits_rows_match_lm_logits_and_follow_weight_changes(arch):
    model = tiny_model(arch)
    hidden = torch.randn(3, model.get_output_embeddings().weight.shape[1])
    head = kv_cache.TransposedLMHead()  # the copy an engine keeps
    torch.testing.assert_close(kv_cache.lm_logits_rows(model, hidden), kv_cache.lm_logits(model, hidden))
    torch.testing.assert_close(kv_cache.lm_logits_rows(model, hidden, head), kv_cache.lm_logits(model, hidden))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)  # an in-place change: the transposed copy is made again
    torch.testing.assert_close(kv_cache.lm_logits_rows(model, hidden, head), kv_cache.lm_logits(model, hidden))
    model.get_output_embeddings().weight = torch.nn.Parameter(torch.zeros_like(model.get_output_embeddings().weight))
    assert kv_cache.lm_logits_rows(model, hidden, head).abs().max() == 0  # replaced: made again


@pytest.mark.other_transformers
@pytest.mark.skipif(not os.environ.get("MEDUSA_TRANSFORMERS_VERSION"),
                    reason="run by scripts/test_transformers_version.sh VERSION")
def test_the_other_transformers_release_is_the_one_asked_for():
    import transformers

    assert transformers.__version__ == os.environ["MEDUSA_TRANSFORMERS_VERSION"]


def test_a_slot_cache_keeps_slots_already_in_place_without_copying_and_moves_the_rest(monkeypatch):
    """Plain decoding and an accepted chain prefix keep slots ``0 .. A-1``, already where they belong: nothing is
    copied (a gather and a write per layer cost 0.4 ms a token on SmolLM2-135M). Any other kept set is moved down."""
    from medusa.engines import static_cache

    cache = static_cache.SlotCache(num_layers=2, capacity=8)
    cache.begin_step(3)
    keys = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    for layer in range(2):
        cache.update(keys, -keys, layer)
    moved = []
    monkeypatch.setattr(kv_cache, "move_slots", lambda *args, **kw: moved.append(args))
    cache.keep(0, torch.tensor([0, 1]))
    assert cache.length == 2 and moved == []
    cache.keep(0, torch.tensor([], dtype=torch.long))
    assert cache.length == 0 and moved == []
    monkeypatch.undo()
    cache.length = 0
    cache.begin_step(3)
    for layer in range(2):
        cache.update(keys, -keys, layer)
    cache.keep(0, torch.tensor([0, 2]))  # a branch: slot 2 moves down to slot 1
    assert cache.length == 2
    assert torch.equal(cache.layers[1].keys[:, :, :2], keys[:, :, [0, 2]])
    assert torch.equal(cache.layers[1].values[:, :, :2], -keys[:, :, [0, 2]])


@pytest.mark.parametrize("engine_name", ["eager", "onednn", "int4-native"])
def test_near_tie_rows_read_the_same_greedy_token_whichever_product_scored_them(engine_name):
    """Two tokens whose lm_head rows differ by rounding noise: a product over several rows or over one can round
    their logits apart the wrong way (the control finds such a row), but after settling every path (several rows,
    one row, the batched path's product) reads the exact argmax; rows far from a tie keep the product's bits."""
    from medusa import engines

    model = tiny_model("llama", hidden_size=256, intermediate_size=256, vocab_size=4096)
    if engine_name == "int4-native":  # the native decoder beside the base's fp32 lm_head (its default)
        from medusa.engines import native

        if native.native_unavailable() is not None:
            pytest.skip(native.native_unavailable())
        engine = engines.make_engine("int4", model, kernel="native")
    else:
        engine = engines.make_engine(engine_name, model)
    weight = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=g)
    with torch.no_grad():  # row 2k + 1 a rounding-noise copy of row 2k, aimed at by hidden row k
        for k in range(64):
            weight[2 * k] = hidden[k] / hidden[k].norm() * 4
            weight[2 * k + 1] = weight[2 * k] * (1 + 1e-7 * torch.randn(256, generator=g))
    exact = (hidden.double() @ weight.detach().double().T).argmax(-1)
    raw = [kv_cache.lm_logits(model, hidden), kv_cache.lm_logits_rows(model, hidden),
           torch.cat([kv_cache.lm_logits(model, h[None]) for h in hidden])]
    assert any((r.argmax(-1) != exact).any() for r in raw)  # the control: unsettled, products miss some planted tie
    for logits in (engine.lm_logits_rows(hidden), engine.batch_lm_logits(hidden),
                   torch.cat([engine.lm_logits_rows(h[None]) for h in hidden]),
                   torch.cat([engine.batch_lm_logits(h[None]) for h in hidden])):
        assert torch.equal(logits.argmax(-1), exact)
    far = weight[200:208].detach() * 3  # aimed at unplanted rows, far from any tie: the several-row bits stay
    assert torch.equal(engine.batch_lm_logits(far), kv_cache.lm_logits(model, far))
