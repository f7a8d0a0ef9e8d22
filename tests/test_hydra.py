"""Hydra (sequentially dependent) heads: inputs, level-by-level drafting, exact decoding, teacher loss, format."""

from __future__ import annotations

import json

import pytest
import torch
from test_decoding import ARCHS, WIDE_TREE, hf_greedy
from tiny import tiny_model

from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree, tree_buffers
from medusa.drafters.heads import HydraHeads, MedusaHeadsConfig, build_heads, lm_head_fingerprint
from medusa.drafters.heads_drafter import draft_tree
from medusa.engines import kv_cache
from medusa.io.checkpoint import load_heads, read_heads_config, save_heads
from medusa.losses import medusa_loss, soft_cross_entropy

H, V = 8, 20


def make_hydra(num_heads=3, num_layers=2, weight=None, embed=None, seed=0, scale=0.3, prefix_window=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=gen) if weight is None else weight
    embed = torch.randn(weight.shape, generator=gen) if embed is None else embed
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=num_heads,
                               num_layers=num_layers, head_type="hydra",
                               lm_head_fingerprint=lm_head_fingerprint(weight), prefix_layers=int(prefix_window > 0),
                               prefix_window=prefix_window or 64)
    heads = HydraHeads(config, weight, embed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale, generator=gen)
    return heads


def test_head_k_reads_exactly_the_embeddings_of_the_next_k_plus_1_tokens():
    heads = make_hydra(num_heads=3, num_layers=1)
    hidden = torch.randn(2, 6, H)
    ids = torch.randint(0, V, (2, 6))
    logits = heads(hidden, ids)  # (K, B, T, V)
    rms = torch.nn.functional.rms_norm
    for k in range(3):
        for b in range(2):
            for t in range(6 - k - 1):  # positions whose k+1 following tokens exist
                following = ids[b, t + 1 : t + k + 2]
                x = torch.cat([hidden[b, t]] + [rms(heads.embed_weight[i], (H,)) for i in following])
                feats = hidden[b, t] + torch.nn.functional.silu(heads.inputs[k](x))
                expected = feats @ heads.shared_weight.T
                torch.testing.assert_close(logits[k, b, t], expected, rtol=1e-5, atol=1e-5)


def test_changing_a_token_after_the_heads_window_changes_nothing():
    heads = make_hydra(num_heads=2)
    hidden, ids = torch.randn(1, 8, H), torch.randint(0, V, (1, 8))
    other = ids.clone()
    other[0, 4] = (ids[0, 4] + 1) % V
    a, b = heads(hidden, ids), heads(hidden, other)
    # Head k at t reads tokens t+1..t+k+1: position 4 is seen by head 0 at t=3 and head 1 at t=2..3 only.
    assert torch.equal(a[0, :, :3], b[0, :, :3]) and not torch.equal(a[0, :, 3], b[0, :, 3])
    assert torch.equal(a[1, :, :2], b[1, :, :2]) and not torch.equal(a[1, :, 2], b[1, :, 2])
    assert torch.equal(a[:, :, 4:], b[:, :, 4:])


def test_hydra_heads_need_input_ids():
    with pytest.raises(ValueError, match="Hydra heads need input_ids"):
        make_hydra()(torch.randn(1, 4, H))


def test_tree_drafting_equals_evaluating_every_node_alone():
    heads = make_hydra(num_heads=3)
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 1], [0, 0, 0], [0, 1, 0], [1, 0, 1]])
    buffers = tree_buffers(tree)
    hidden, root = torch.randn(H), torch.tensor(5)
    tokens = draft_tree(heads, hidden, root, buffers).tokens
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    for path, i in index.items():
        # The training-time forward over (x_t, root, ..., parent) alone, read at position t.
        parent_tokens = [torch.tensor(0), root] + [tokens[index[path[:d]]] for d in range(1, len(path))]
        k = len(path) - 1
        logits = heads(hidden[None, None].expand(1, k + 2, H), torch.stack(parent_tokens)[None])[k, 0, 0]
        assert tokens[i] == logits.topk(path[-1] + 1).indices[-1], path


def test_drafted_children_depend_on_their_own_path():
    """Two level-1 nodes get different candidates when their parents differ (a Medusa head would give the same)."""
    heads = make_hydra(num_heads=2, scale=1.0)
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0]])
    draft = draft_tree(heads, torch.randn(H), torch.tensor(3), tree_buffers(tree))
    assert not torch.equal(draft.draws[1].logits[0], draft.draws[1].logits[1])


def tiny_hydra_for(model, num_heads=3, seed=1, prefix_window=0):
    weight, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return make_hydra(num_heads, 2, weight.detach(), embed.detach(), seed=seed, scale=0.05,
                      prefix_window=prefix_window)


def train_on_greedy(model, heads, ids, steps=80):
    """Fit the heads to the base's own greedy continuation of ``ids`` (teacher loss), as training would."""
    sequence = torch.tensor(ids.tolist() + hf_greedy(model, ids, 60), device=ids.device)[None]  # (1, T)
    with torch.no_grad():
        hidden = kv_cache.decoder_of(model)(input_ids=sequence).last_hidden_state  # (1, T, H)
        teacher = hidden @ model.get_output_embeddings().weight.T  # (1, T, V)
    labels = sequence.clone()
    labels[:, : len(ids)] = -100
    optimizer = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, stats = medusa_loss(heads(hidden, sequence), labels, teacher_logits=teacher, loss_type="teacher")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return stats


@pytest.mark.parametrize("prefix_window", [0, 16])  # without and with the heads' own attention layer
@pytest.mark.parametrize("arch", ARCHS)
def test_trained_hydra_heads_accept_tokens_and_stay_exact(arch, prefix_window):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(4))
    heads = tiny_hydra_for(model, prefix_window=prefix_window)
    stats = train_on_greedy(model, heads, ids)
    assert (stats["top1"].float() / stats["count"]).min() > 0.5  # the heads learned the sequence
    heads.eval()
    reference = hf_greedy(model, ids, 48)
    for verify_logits in ("all", "path"):
        with torch.no_grad():
            out, gen_stats = medusa_generate(model, heads, ids, WIDE_TREE, 48, verify_logits=verify_logits)
        assert out == reference
        assert gen_stats.tau > 1.5


def test_teacher_loss_equals_hard_loss_for_a_one_hot_teacher():
    torch.manual_seed(0)
    labels = torch.randint(0, V, (2, 12))
    labels[0, :3] = -100
    logits = torch.randn(3, 2, 12, V, requires_grad=True)
    # Teacher row j is one-hot on labels[j + 1], the token it predicts.
    teacher = torch.full((2, 12, V), -1e4)
    nxt = torch.cat([labels[:, 1:], labels[:, :1]], dim=1).clamp_min(0)
    teacher.scatter_(2, nxt[..., None], 0.0)
    hard, _ = medusa_loss(logits, labels)
    soft, _ = medusa_loss(logits, labels, teacher_logits=teacher, loss_type="teacher")
    mixed, _ = medusa_loss(logits, labels, teacher_logits=teacher, loss_type="mixed", mix=0.3)
    torch.testing.assert_close(soft, hard)
    torch.testing.assert_close(mixed, hard)
    (grad_hard,) = torch.autograd.grad(hard, logits)
    (grad_soft,) = torch.autograd.grad(soft, logits)
    torch.testing.assert_close(grad_soft, grad_hard)


def test_teacher_loss_prefers_the_teacher_ranking():
    teacher = torch.tensor([[3.0, 2.0, 1.0, -5.0]])
    aligned = soft_cross_entropy(torch.tensor([[3.0, 2.0, 1.0, -5.0]]), teacher)
    swapped = soft_cross_entropy(torch.tensor([[3.0, 1.0, 2.0, -5.0]]), teacher)  # same top-1, ranks 2-3 swapped
    assert aligned < swapped
    with pytest.raises(ValueError, match="needs the base's teacher logits"):
        medusa_loss(torch.randn(2, 1, 6, V), torch.randint(0, V, (1, 6)), loss_type="teacher")
    with pytest.raises(ValueError, match="unknown loss 'soft'"):
        medusa_loss(torch.randn(2, 1, 6, V), torch.randint(0, V, (1, 6)), loss_type="soft")


def test_hydra_checkpoint_round_trip(tmp_path):
    weight, embed = torch.randn(V, H), torch.randn(V, H)
    heads = make_hydra(weight=weight, embed=embed)
    out = save_heads(heads, tmp_path / "heads")
    assert json.loads((out / "config.json").read_text())["head_type"] == "hydra"
    loaded = load_heads(out, weight, embed_weight=embed)
    assert isinstance(loaded, HydraHeads)
    hidden, ids = torch.randn(1, 5, H), torch.randint(0, V, (1, 5))
    assert torch.equal(loaded(hidden, ids), heads(hidden, ids))
    with pytest.raises(ValueError, match="need the base's input embeddings"):
        load_heads(out, weight)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (path / "config.json").write_text(json.dumps(config))


def test_format_versions(tmp_path):
    weight = torch.randn(V, H)
    config = MedusaHeadsConfig(hidden_size=H, vocab_size=V, num_heads=2)
    out = save_heads(build_heads(config, weight), tmp_path / "heads")
    # A version 1 folder (no head_type) still loads, as Medusa heads.
    edit_config(out, format_version=1, head_type=None)
    assert read_heads_config(out).head_type == "medusa"
    assert load_heads(out, weight).config.num_heads == 2
    edit_config(out, format_version=5)
    with pytest.raises(ValueError, match="unknown heads format_version 5"):
        read_heads_config(out)
    edit_config(out, format_version=2, head_type="lstm")
    with pytest.raises(ValueError, match="unknown head_type 'lstm'"):
        read_heads_config(out)


def test_hydra_tree_deeper_than_heads_is_rejected():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="depth 4 but the model has only 3 heads"):
        medusa_generate(model, tiny_hydra_for(model), torch.tensor([5, 6, 7]), Tree.chain(4), 5)


def test_train_hydra_teacher_end_to_end_then_decode_exactly(tmp_path):
    """The trainer builds Hydra heads, trains them on the teacher loss, saves them; MedusaModel loads and decodes
    them to the base's greedy tokens."""
    from test_train import make_config, write_chats
    from tiny import save_tiny, tiny_tokenizer

    from medusa.model import MedusaModel
    from train.trainer import train

    base = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "chats.jsonl")
    config = make_config(base, chats, tmp_path / "run", head_type="hydra", loss="teacher", num_layers=2)
    heads_dir = train(config, tokenizer=tiny_tokenizer())
    assert json.loads((heads_dir / "config.json").read_text())["head_type"] == "hydra"
    model = MedusaModel.from_pretrained(base, heads_dir, tree=WIDE_TREE)
    assert isinstance(model.heads, HydraHeads)
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(0))
    out, _ = model.generate(ids, max_new_tokens=24, stop_token_ids=set())
    assert out == hf_greedy(model.base, ids, 24)


def test_teacher_loss_without_an_lm_head_is_refused(tmp_path, monkeypatch):
    from test_train import make_config, write_chats
    from tiny import save_tiny, tiny_tokenizer

    from train.trainer import train

    base = save_tiny(tmp_path / "base", "llama")
    model = tiny_model("llama")
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    config = make_config(base, write_chats(tmp_path / "chats.jsonl"), tmp_path / "run", loss="teacher")
    with pytest.raises(ValueError, match="exposes no lm_head"):
        train(config, model, tiny_tokenizer())
