"""Medusa decoding gives exactly the base model's greedy tokens, on every architecture family we support."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree, grow_tree
from medusa.drafters.heads import MedusaHeadsConfig, build_heads, head_target_offset
from medusa.engines import kv_cache

ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma3"]
WIDE_TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]])


def hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    # No EOS: min_new_tokens would suppress it and make HF's greedy differ from the true argmax sequence.
    model.generation_config.eos_token_id = None
    out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=ids.device),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


class StatelessContext:
    """The decoding-context interface for test heads that keep no state (as
    :class:`medusa.drafters.heads.MedusaHeads`), reading the base's last hidden state only."""

    base_layers = ()

    def new_context(self):
        return None

    def extend_context(self, context, hidden, next_tokens):
        return hidden[-1]


class OracleHeads(StatelessContext, torch.nn.Module):
    """Heads that know the reference greedy sequence: head k puts the true token t+k+2 at rank ``rank[k]`` (or
    nowhere when ``rank[k]`` is None), so acceptance of several tokens, non-zero ranks and cache compaction of
    non-contiguous tree paths are all exercised. The position t is recovered from the hidden state."""

    def __init__(self, model, sequence: list[int], ranks: list[int | None], vocab: int):
        super().__init__()
        ids = torch.tensor(sequence)
        with torch.no_grad():
            self.ref_hidden = kv_cache.decoder_of(model)(input_ids=ids[None]).last_hidden_state[0]  # (S, H)
        self.sequence, self.ranks, self.vocab = sequence, ranks, vocab
        self.config = MedusaHeadsConfig(hidden_size=self.ref_hidden.shape[1], vocab_size=vocab, num_heads=len(ranks))
        self.head_vocab_size = vocab

    def forward(self, hidden):
        t = int((self.ref_hidden - hidden).norm(dim=-1).argmin())
        logits = torch.zeros(len(self.ranks), self.vocab)
        logits[:, :] = torch.linspace(1, 0, self.vocab)  # a fixed ranking of wrong guesses
        for k, rank in enumerate(self.ranks):
            target = t + head_target_offset(k)
            if rank is None or target >= len(self.sequence):
                continue
            order = logits[k].argsort(descending=True).tolist()
            order.remove(self.sequence[target])
            order.insert(rank, self.sequence[target])
            logits[k, torch.tensor(order)] = torch.linspace(10, 0, self.vocab)
        return logits

    def draft_logits(self, k, hidden, path_tokens):
        return self(hidden)[k].expand(len(path_tokens), -1)

    def to_base_ids(self, ids):
        return ids



def random_heads(model, num_heads=3, seed=1, head_type="medusa"):
    weight = model.get_output_embeddings().weight
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=num_heads,
                               head_type=head_type)
    heads = build_heads(config, weight.detach(), model.get_input_embeddings().weight.detach())
    torch.manual_seed(seed)
    for p in heads.parameters():
        p.data.normal_(0, 0.05)
    return heads.to(weight.device)  # drawn on the CPU: the same heads whatever the model's device


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
@pytest.mark.parametrize("verify_logits", ["all", "path"])
@pytest.mark.parametrize("arch", ARCHS)
def test_random_heads_give_base_greedy_tokens(arch, verify_logits, head_type):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, ids, 40)
    for tree in (Tree.chain(3), WIDE_TREE):
        heads = random_heads(model, head_type=head_type)
        out, stats = medusa_generate(model, heads, ids, tree, 40, verify_logits=verify_logits)
        assert out == reference, (arch, tree.name)
        assert stats.new_tokens == 40


@pytest.mark.parametrize("verify_logits", ["all", "path"])
@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_heads_accept_several_tokens_and_stay_exact(arch, verify_logits):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(model, ids, 48)
    sequence = ids.tolist() + reference
    # Head 1 is right only at rank 1, head 2 never: accepted paths go through a non-first branch and stop early.
    heads = OracleHeads(model, sequence, ranks=[0, 1, None], vocab=model.config.vocab_size)
    out, stats = medusa_generate(model, heads, ids, WIDE_TREE, 48, verify_logits=verify_logits)
    assert out == reference
    assert stats.tau > 2.5  # 1 bonus + 2 drafts accepted on almost every step
    # Head 2's fixed wrong guesses can hit the true token by chance, so a rare step may accept 3.
    assert stats.accepted_per_step.count(2) >= len(stats.accepted_per_step) - 3


def test_sliding_window_is_really_exercised():
    """Control: with the sliding window ignored, the mistral reference is not reproduced (so the test above
    would catch a tree mask that forgets the window)."""
    model = tiny_model("mistral")
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, ids, 40)
    model.config.sliding_window = None
    out, _ = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 40)
    assert out != reference


def test_stop_token_and_budget():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, ids, 30)
    stop = reference[7]
    first = reference.index(stop)
    out, stats = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 30, stop_token_ids={stop})
    assert out == reference[: first + 1] and stats.stopped_by == "stop_token"
    out, stats = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 5)
    assert out == reference[:5] and stats.stopped_by == "max_new_tokens"


def test_tree_deeper_than_heads_is_rejected():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="depth 4 but the model has only 3 heads"):
        medusa_generate(model, random_heads(model), torch.tensor([5, 6, 7]), Tree.chain(4), 5)


def test_prompt_longer_than_context_is_rejected():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        medusa_generate(model, random_heads(model), torch.arange(3, 503) % 300 + 3, WIDE_TREE, 20)


def test_grown_tree_decodes_exactly():
    model = tiny_model("qwen2")
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.15, 0.1], [0.3, 0.1, 0.05]])
    tree = grow_tree(accuracy, 12)
    ids = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(3))
    out, _ = medusa_generate(model, random_heads(model), ids, tree, 24)
    assert out == hf_greedy(model, ids, 24)
