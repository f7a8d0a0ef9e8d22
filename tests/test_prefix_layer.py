"""The heads' own attention layer (medusa/prefix_layer.py): what it reads, its decoding cache, exact decoding."""

from __future__ import annotations

import json

import pytest
import torch
from test_hydra import H, V, make_hydra

from medusa.drafters.heads import FORMAT_VERSION, MedusaHeadsConfig
from medusa.drafters.prefix_layer import PrefixAttention, PrefixContext, rotate, window_mask
from medusa.io.checkpoint import load_heads, save_heads


def test_untrained_layer_leaves_the_heads_as_they_were():
    plain = make_hydra(num_heads=2, seed=3)
    with_prefix = make_hydra(num_heads=2, seed=3, prefix_window=4)
    with_prefix.load_state_dict(plain.state_dict(), strict=False)  # same head weights, fresh attention layer
    torch.nn.init.zeros_(with_prefix.prefix.out.weight)
    hidden, ids = torch.randn(2, 7, H), torch.randint(0, V, (2, 7))
    torch.testing.assert_close(with_prefix(hidden, ids), plain(hidden, ids))


def test_position_t_reads_only_pairs_within_its_window():
    heads = make_hydra(num_heads=1, prefix_window=3)
    hidden, ids = torch.randn(1, 9, H), torch.randint(0, V, (1, 9))
    base = heads.context_states(hidden, heads._following_tokens(hidden, ids))  # (1, T, H)
    changed = hidden.clone()
    changed[0, 4] += 1.0  # the pair at position 4 (h_4, x_5)
    other_ids = ids.clone()
    other_ids[0, 5] = (ids[0, 5] + 1) % V  # x_5, also read by position 4's pair
    for h, i in ((changed, ids), (hidden, other_ids)):
        out = heads.context_states(h, heads._following_tokens(h, i))
        # Positions 4, 5, 6 see position 4 (window 3); earlier ones and later ones do not.
        assert torch.equal(out[0, :4], base[0, :4]) and torch.equal(out[0, 7:], base[0, 7:])
        assert not torch.allclose(out[0, 5], base[0, 5]) and not torch.allclose(out[0, 6], base[0, 6])


def test_rotary_attention_depends_only_on_relative_positions():
    q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8)
    pos = torch.arange(4)
    scores = rotate(q, pos) @ rotate(k, pos).transpose(-1, -2)
    shifted = rotate(q, pos + 37) @ rotate(k, pos + 37).transpose(-1, -2)
    torch.testing.assert_close(scores, shifted, rtol=1e-4, atol=1e-4)
    assert torch.equal(window_mask(pos, pos, 2), torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0],
                                                               [0, 0, 1, 1]], dtype=torch.bool))


@pytest.mark.parametrize("window", [1, 2, 5, 64])
def test_decoding_cache_equals_the_training_forward(window):
    """Extending the context a few positions at a time gives h'_t at each chunk's end equal to the whole-sequence
    forward: the cache (trimmed to the window) loses nothing a later query can see."""
    torch.manual_seed(0)
    layer = PrefixAttention(H, window)
    torch.nn.init.normal_(layer.out.weight, 0, 0.3)
    hidden, embeds = torch.randn(13, H), torch.randn(13, H)
    full = layer(hidden, embeds)  # (T, H)
    context, end = PrefixContext(), 0
    for n in (5, 1, 3, 2, 2):  # a prefill, then accepted paths of different lengths
        out = layer.extend(context, hidden[end : end + n], embeds[end : end + n])
        end += n
        torch.testing.assert_close(out, full[end - 1], rtol=1e-5, atol=1e-5)
        assert context.keys.shape[-2] == min(end, window) and context.length == end


def test_prefix_checkpoint_round_trip_and_bad_configs(tmp_path):
    weight, embed = torch.randn(V, H), torch.randn(V, H)
    heads = make_hydra(weight=weight, embed=embed, prefix_window=6)
    out = save_heads(heads, tmp_path / "heads")
    config = json.loads((out / "config.json").read_text())
    assert config["prefix_layers"] == 1 and config["prefix_window"] == 6 and config["format_version"] == FORMAT_VERSION
    loaded = load_heads(out, weight, embed_weight=embed)
    hidden, ids = torch.randn(1, 9, H), torch.randint(0, V, (1, 9))
    assert torch.equal(loaded(hidden, ids), heads(hidden, ids))
    with pytest.raises(ValueError, match="prefix_layers needs head_type 'hydra'"):
        MedusaHeadsConfig(hidden_size=H, vocab_size=V, prefix_layers=1)
    with pytest.raises(ValueError, match="prefix_layers must be 0 or 1"):
        MedusaHeadsConfig(hidden_size=H, vocab_size=V, head_type="hydra", prefix_layers=2)
    with pytest.raises(ValueError, match="prefix_window must be a positive integer"):
        MedusaHeadsConfig(hidden_size=H, vocab_size=V, head_type="hydra", prefix_layers=1, prefix_window=0)


def test_decoding_feeds_the_layer_through_the_engines_drafter_products():
    """``extend_context`` runs the layer's three linears through the products the engine offers the drafter (the
    native decoder's Q8_0 ones), as the heads' own layers: equal to the layers themselves when the product is the
    same product, and a different product changes the drafting input."""
    torch.manual_seed(0)
    heads = make_hydra(num_heads=2, prefix_window=4)
    torch.nn.init.normal_(heads.prefix.out.weight, 0, 0.3)
    hidden, tokens = torch.randn(6, H), torch.randint(0, V, (6,))
    with torch.no_grad():
        reference = heads.extend_context(heads.new_context(), hidden[:4], tokens[:4])
        asked = []

        def products(weight, role, scale=1.0):
            asked.append(role)
            return lambda rows: scale * (rows @ weight.T)

        heads.drafter_products = products
        same = heads.extend_context(heads.new_context(), hidden[:4], tokens[:4])
        assert {"prefix.fuse", "prefix.qkv", "prefix.out"} <= set(asked)
        torch.testing.assert_close(same, reference, rtol=1e-5, atol=1e-5)
        heads.drafter_products = lambda weight, role: products(weight, role, 1.5 if role == "prefix.out" else 1.0)
        heads.__dict__.pop("_products", None)
        assert not torch.allclose(heads.extend_context(heads.new_context(), hidden[:4], tokens[:4]), reference)
