"""Medusa heads: target offset, distinct ResBlocks, zero-init equals the base, truncated vocab, config checks."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from medusa import losses
from medusa.drafters import heads as heads_module
from medusa.drafters.heads import (
    MedusaHeads,
    MedusaHeadsConfig,
    ResBlock,
    head_target_offset,
    most_frequent_tokens,
)
from medusa.engines import kv_cache

H, V = 8, 20


def make_heads(num_heads=3, num_layers=2, token_map=None, share=True, weight=None):
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) if weight is None else weight
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=num_heads,
                               num_layers=num_layers, share_lm_head=share,
                               head_vocab_size=None if token_map is None else len(token_map))
    return MedusaHeads(config, weight, token_map)


def test_head_k_predicts_k_plus_2_ahead():
    assert [head_target_offset(k) for k in range(4)] == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="must be >= 0"):
        head_target_offset(-1)


def test_loss_targets_follow_the_single_offset_definition(monkeypatch):
    """The loss reads the offset from head_target_offset, not its own copy: moving the constant moves the targets."""
    labels = torch.arange(10)[None]  # (1, T)
    targets, _ = losses.head_targets(labels, 1, None)
    assert targets[0].tolist() == list(range(head_target_offset(1), 10))
    monkeypatch.setattr(heads_module, "HEAD_TOKEN_OFFSET", 5)
    targets, _ = losses.head_targets(labels, 1, None)
    assert targets[0].tolist() == list(range(6, 10))


def test_resblocks_are_distinct_modules():
    heads = make_heads(num_heads=3, num_layers=2)
    blocks = [block for head in heads.blocks for block in head]
    assert len(blocks) == 6 and all(isinstance(b, ResBlock) for b in blocks)
    assert len({id(b) for b in blocks}) == 6
    # 6 blocks x (weight, bias), no tensor shared between two blocks.
    assert len({p.data_ptr() for p in heads.parameters()}) == 12
    x = torch.randn(5, H)
    before = heads(x)
    with torch.no_grad():
        heads.blocks[1][0].linear.weight.normal_()
    after = heads(x)
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    assert not torch.allclose(after[1], before[1])


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("truncated", [False, True])
def test_zero_initialised_heads_equal_base_next_token_logits(share, truncated):
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = model(ids).logits[0]  # (T, V)
        hidden = kv_cache.decoder_of(model)(input_ids=ids).last_hidden_state[0]  # (T, H)
    weight = model.get_output_embeddings().weight
    token_map = torch.tensor([2, 5, 7, 40, 299, 300]) if truncated else None
    heads = make_heads(num_heads=3, num_layers=1, token_map=token_map, share=share, weight=weight)
    with torch.no_grad():
        head_logits = heads(hidden)  # (K, T, Vh)
    expected = base_logits if token_map is None else base_logits[:, token_map]
    assert head_logits.shape == (3, *expected.shape)
    for k in range(3):
        torch.testing.assert_close(head_logits[k], expected)


def test_per_head_projection_is_a_trainable_copy():
    weight = torch.randn(V, H)
    heads = make_heads(share=False, weight=weight)
    assert heads.shared_weight is None
    ptrs = {head.weight.data_ptr() for head in heads.lm_heads}
    assert len(ptrs) == 3 and weight.data_ptr() not in ptrs
    with torch.no_grad():
        heads.lm_heads[0].weight.add_(1.0)
    assert torch.equal(heads.lm_heads[1].weight, weight)
    assert all(head.weight.requires_grad for head in heads.lm_heads)


def test_shared_projection_is_not_saved_or_trained():
    heads = make_heads(share=True)
    assert all("shared_weight" not in name for name in heads.state_dict())
    assert all("lm_head" not in name for name, _ in heads.named_parameters())


def test_truncated_vocab_token_map_rows_and_id_round_trip():
    weight = torch.randn(V, H)
    token_map = torch.tensor([1, 4, 9, 15, 19])
    heads = make_heads(token_map=token_map, weight=weight)
    assert torch.equal(heads.shared_weight, weight[token_map])
    assert heads.head_vocab_size == 5
    head_ids = torch.arange(5)
    assert torch.equal(heads.to_base_ids(head_ids), token_map)
    assert torch.equal(heads.to_head_ids(heads.to_base_ids(head_ids)), head_ids)
    assert torch.equal(heads.to_base_ids(heads.to_head_ids(token_map)), token_map)
    outside = torch.tensor([[0, 4, 2], [19, -100, 18]])
    assert heads.to_head_ids(outside).tolist() == [[-100, 1, -100], [4, -100, -100]]
    assert heads.to_head_ids(outside, missing=-1).tolist() == [[-1, 1, -1], [4, -1, -1]]


def test_full_vocab_ids_are_unchanged():
    heads = make_heads()
    ids = torch.tensor([0, 7, 19])
    assert torch.equal(heads.to_head_ids(ids), ids) and torch.equal(heads.to_base_ids(ids), ids)


@pytest.mark.parametrize("fields, message", [
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(vocab_size=-3), "vocab_size must be a positive integer"),
    (dict(num_heads=0), "num_heads must be a positive integer"),
    (dict(num_heads=2.0), "num_heads must be a positive integer"),
    (dict(num_layers=-1), "num_layers must be a non-negative integer"),
    (dict(head_vocab_size=0), r"head_vocab_size must be in \[1, vocab_size=20\]"),
    (dict(head_vocab_size=21), r"head_vocab_size must be in \[1, vocab_size=20\]"),
])
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        MedusaHeadsConfig(**{"hidden_size": H, "vocab_size": V, **fields})


def test_config_round_trip_and_unknown_keys_rejected():
    config = MedusaHeadsConfig(hidden_size=H, vocab_size=V, num_heads=5, head_vocab_size=7)
    assert MedusaHeadsConfig.from_dict(config.to_dict()) == config
    data = {**config.to_dict(), "medusa_num_heads": 5}
    with pytest.raises(ValueError, match=r"unknown keys.*medusa_num_heads"):
        MedusaHeadsConfig.from_dict(data)


@pytest.mark.parametrize("head_vocab, token_map, message", [
    (None, torch.tensor([1, 2]), "token_map given but head_vocab_size is None"),
    (3, None, "head_vocab_size=3 needs a token_map"),
    (3, torch.tensor([1, 2]), r"token_map must have shape \(3,\)"),
    (3, torch.tensor([1, 2, 20]), r"token_map ids must be in \[0, 20\)"),
    (3, torch.tensor([-1, 2, 3]), r"token_map ids must be in \[0, 20\)"),
    (3, torch.tensor([1, 2, 2]), "duplicate"),
])
def test_token_map_validation(head_vocab, token_map, message):
    config = MedusaHeadsConfig(hidden_size=H, vocab_size=V, head_vocab_size=head_vocab)
    with pytest.raises(ValueError, match=message):
        MedusaHeads(config, torch.randn(V, H), token_map)


def test_lm_head_shape_must_match_config():
    config = MedusaHeadsConfig(hidden_size=H, vocab_size=V)
    with pytest.raises(ValueError, match="does not match heads config"):
        MedusaHeads(config, torch.randn(V, H + 1))


def test_most_frequent_tokens_keeps_requested_ids():
    counts = torch.tensor([0, 0, 5, 50, 40, 1, 30, 0, 20, 10])
    token_map = most_frequent_tokens(counts, 4, always=[0, 7])
    assert token_map.tolist() == sorted(token_map.tolist())
    assert set(token_map.tolist()) == {0, 7} | set(counts.topk(2).indices.tolist())
    assert set(most_frequent_tokens(counts, 3).tolist()) == set(counts.topk(3).indices.tolist())
    assert counts.tolist() == [0, 0, 5, 50, 40, 1, 30, 0, 20, 10]  # the caller's counts are not modified


def test_most_frequent_tokens_refuses_to_drop_requested_ids():
    with pytest.raises(ValueError, match="3 token ids must always be kept"):
        most_frequent_tokens(torch.arange(10), 2, always=[0, 1, 2])


def test_drafting_on_a_cpu_projects_through_a_packed_copy_equal_to_matmul_and_repacked_after_a_change():
    """Under no_grad on a CPU the shared projection runs on a oneDNN-packed copy of the rows (when oneDNN runs here):
    the logits equal ``matmul``'s up to summation order, a changed weight is packed again, and with gradients on the
    product stays ``matmul`` (training is untouched)."""
    from medusa.engines.onednn import onednn_unavailable_for, packed_product

    heads = make_heads()
    feats = torch.randn(4, heads.config.hidden_size)
    reference = feats @ heads.shared_weight_t
    with torch.no_grad():
        heads.project(0, feats)
        assert "_products" not in heads.__dict__  # no engine offers products: matmul
        heads.drafter_products = lambda weight, role: packed_product(weight) if role == "projection" else None
        packed = heads.project(0, feats)
        if onednn_unavailable_for("cpu", torch.float32) is None:
            assert heads.__dict__["_products"]["projection"][2] is not None
        assert torch.allclose(packed, reference, atol=1e-5) and packed.shape == (4, heads.head_vocab_size)
        assert torch.allclose(heads.project(0, feats[None]), reference[None], atol=1e-5)  # (1, 4, H) too
        heads.shared_weight_t.mul_(2)  # changed in place: packed again
        assert torch.allclose(heads.project(0, feats), 2 * reference, atol=1e-5)
    feats.requires_grad_(True)
    heads.project(0, feats).sum().backward()  # gradients on: matmul, which has a backward
    assert torch.allclose(feats.grad, heads.shared_weight_t.sum(1).expand(4, -1), atol=1e-5)


def test_the_heads_pack_their_projection_exactly_when_the_engine_packs_its_own_products():
    """The choice follows the engine (which auto picks by measuring): packed beside onednn, matmul beside static."""
    from medusa.decode.tree import Tree
    from medusa.engines.onednn import onednn_unavailable_for
    from medusa.model import MedusaModel

    base = tiny_model("llama")
    heads = make_heads(weight=base.get_output_embeddings().weight.detach())
    model = MedusaModel(base, heads, Tree.chain(2), None, "static")
    weight = model.heads.shared_weight_t.T
    assert model.heads.drafter_products(weight, "projection") is None
    if onednn_unavailable_for("cpu", torch.float32) is None:
        model.use_engine("onednn")
        assert model.heads.drafter_products(weight, "projection") is not None
        assert model.heads.drafter_products(weight, "input0") is None  # the projection only
        model.use_engine("static")
        assert model.heads.drafter_products(weight, "projection") is None
