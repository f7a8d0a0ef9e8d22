"""Batched decoding gives each prompt exactly the tokens it gets when decoded alone (greedy, with logits
processors, and seeded sampling)."""

from __future__ import annotations

import pytest
import torch
from test_decoding import ARCHS, WIDE_TREE, OracleHeads, StatelessContext, hf_greedy, random_heads
from tiny import tiny_model

from medusa.decode.batch import batch_generate
from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree, tree_buffers
from medusa.engines import kv_cache

LENGTHS = [5, 17, 1, 11, 23]


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen) for n in lengths]


class BatchOracle(StatelessContext, torch.nn.Module):
    """One :class:`OracleHeads` per sequence; each call is answered by the oracle whose reference hidden states hold
    the nearest one, so every row can be given its own head ranks (and accept its own number of drafts)."""

    def __init__(self, oracles):
        super().__init__()
        self.oracles = oracles
        self.config, self.head_vocab_size = oracles[0].config, oracles[0].head_vocab_size

    def draft_logits(self, k, hidden, path_tokens):
        nearest = min(self.oracles, key=lambda o: float((o.ref_hidden - hidden).norm(dim=-1).min()))
        return nearest.draft_logits(k, hidden, path_tokens)

    def to_base_ids(self, ids):
        return ids



@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
@pytest.mark.parametrize("verify_logits", ["all", "path"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_equals_one_at_a_time(arch, verify_logits, head_type):
    model = tiny_model(arch)
    heads = random_heads(model, head_type=head_type)
    prompts = prompts_of(LENGTHS)
    alone = [medusa_generate(model, heads, p, WIDE_TREE, 24)[0] for p in prompts]
    # One row meets a stop token early, the others at other times or never: rows leave the batch one by one.
    stop = {alone[1][2], alone[3][9]}
    alone_stopped = [medusa_generate(model, heads, p, WIDE_TREE, 24, stop_token_ids=stop)[0] for p in prompts]
    for expected, stops in ((alone, None), (alone_stopped, stop)):
        out, stats = batch_generate(model, heads, prompts, WIDE_TREE, 24, stops, verify_logits)
        assert out == expected, arch
        assert [s.new_tokens for s in stats.rows] == [len(e) for e in expected]
    assert len({len(e) for e in alone_stopped}) > 1
    assert stats.row_forwards < stats.forwards * len(prompts)  # finished rows stopped costing work
    assert alone[0] == hf_greedy(model, prompts[0], 24)


@pytest.mark.parametrize("verify_logits", ["all", "path"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_accept_different_paths_and_stay_exact(arch, verify_logits):
    """Oracle heads make each row accept its own number of drafts (0 to 3) through non-first branches, so the
    cache rows become ragged every step."""
    model = tiny_model(arch)
    prompts = prompts_of([12, 4, 20, 9], seed=2)
    references = [hf_greedy(model, p, 40) for p in prompts]
    ranks = [[0, 1, None], [None, None, None], [0, None, None], [0, 0, 0]]
    oracles = [OracleHeads(model, p.tolist() + r, rk, model.config.vocab_size)
               for p, r, rk in zip(prompts, references, ranks, strict=True)]
    out, stats = batch_generate(model, BatchOracle(oracles), prompts, WIDE_TREE, 40, verify_logits=verify_logits)
    assert out == references
    taus = [s.tau for s in stats.rows]
    assert taus[3] > taus[0] > taus[2] > taus[1], taus


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_heads_with_their_own_attention_layer_keep_one_state_per_row(arch):
    """Hydra heads with a prefix attention layer (per-sequence state): trained on row 0's continuation, they accept
    several drafts there; each row drafts exactly as alone (same accepted counts step by step), so no row reads
    another's state."""
    from test_hydra import make_hydra, train_on_greedy

    model = tiny_model(arch)
    prompts = prompts_of([12, 5, 9], seed=4)
    weight, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    heads = make_hydra(3, 2, weight.detach(), embed.detach(), seed=1, scale=0.05, prefix_window=4)
    train_on_greedy(model, heads, prompts[0])
    heads.eval()
    alone = [medusa_generate(model, heads, p, WIDE_TREE, 32) for p in prompts]
    out, stats = batch_generate(model, heads, prompts, WIDE_TREE, 32, verify_logits="path")
    assert out == [tokens for tokens, _ in alone]
    assert [s.accepted_per_step for s in stats.rows] == [s.accepted_per_step for _, s in alone]
    assert stats.rows[0].tau > 1.5


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_batched_decoding_is_greedy(arch):
    model = tiny_model(arch)
    prompts = prompts_of([7, 19, 2], seed=4)
    expected = [hf_greedy(model, p, 16) for p in prompts]
    for verify_logits in ("all", "path"):
        out, stats = batch_generate(model, None, prompts, Tree.chain(0), 16, verify_logits=verify_logits)
        assert out == expected
        assert stats.forwards == 15 and all(s.tau == 1 for s in stats.rows)


def trie_walk(tokens: list[int], predicted: list[int], children) -> tuple[list[int], int]:
    """The greedy walk over the tree read as a trie (the rule before the drafter seam, kept here as the reference):
    follow the children of every twin, keep the first twin, ask the base at that first twin."""
    twins, path = [0], [0]
    while True:
        want = predicted[twins[0]]
        twins = [c for node in twins for c in children[node] if tokens[c] == want]
        if not twins:
            return path, want
        path.append(twins[0])


@pytest.mark.parametrize("tree", [WIDE_TREE, WIDE_TREE.with_lookup(4), Tree.chain(3).with_lookup(3)],
                         ids=["wide", "wide+lookup", "chain+lookup"])
def test_vectorised_and_walked_greedy_acceptance_agree_with_the_trie_walk(tree):
    """Random drafts over 3 tokens (many twins between the lookup chain and the heads' nodes): every row, both ways,
    accepts the path the trie walk accepts."""
    from medusa.decode.greedy import greedy_accept, greedy_paths, greedy_walk

    buffers = tree_buffers(tree)
    index = {(): 0} | {p: i for i, p in enumerate(tree.paths, 1)}
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        # Siblings among the heads' nodes hold distinct tokens (one head's top-k), as drafting guarantees.
        offsets = torch.randint(0, 3, (4, tree.num_nodes), generator=gen)  # per (row, parent)
        tokens = torch.randint(0, 3, (4, tree.num_nodes), generator=gen)
        for i, path in enumerate(tree.paths, 1):
            tokens[:, i] = (path[-1] + offsets[:, index[path[:-1]]]) % 3
        predicted = torch.randint(0, 3, (4, tree.num_nodes), generator=gen)
        paths, accepted = greedy_paths(tokens, predicted, buffers)
        asked = []

        def next_tokens_at(rows, nodes, asked=asked, predicted=predicted):
            asked.append(len(rows))
            return predicted[rows, nodes]

        walked, walked_accepted, bonus = greedy_walk(tokens, next_tokens_at, buffers)
        assert torch.equal(walked, paths) and torch.equal(walked_accepted, accepted)
        assert sum(asked) == int(accepted.sum()) + 4  # only along each row's path
        for b in range(4):
            path, want = trie_walk(tokens[b].tolist(), predicted[b].tolist(), buffers.children)
            assert paths[b, : len(path)].tolist() == path and int(accepted[b]) == len(path) - 1
            assert int(bonus[b]) == want == int(predicted[b, paths[b, accepted[b]]])
            single = greedy_accept(tokens[b], predicted[b], buffers)
            assert single.path_nodes.tolist() == path and int(single.next_token) == want


@pytest.mark.parametrize("cache_kind", ["dynamic", "slots"])
def test_keep_row_paths_moves_only_the_kept_slots(cache_kind):
    """The batched operations of each cache class (a DynamicCache, the static engines' SlotCache) do the same."""
    batched_ops_on(cache_kind)


def test_both_caches_give_the_same_batched_forward():
    assert torch.allclose(batched_ops_on("dynamic"), batched_ops_on("slots"), atol=1e-5)


def batched_ops_on(cache_kind: str) -> torch.Tensor:
    """Two rows with holes through forward_rows, keep_row_paths and select_rows on one cache class, checked; returns
    the tree forward's hidden states ``(2, 4, H)``."""
    from medusa.engines import static_cache

    model = tiny_model("llama")
    ops = kv_cache if cache_kind == "dynamic" else static_cache
    cache = kv_cache.new_cache() if cache_kind == "dynamic" else static_cache.new_cache(model, 16)
    valid = torch.tensor([3, 5])
    ids = torch.randint(3, 300, (2, 5), generator=torch.Generator().manual_seed(0))
    positions = torch.minimum(torch.arange(5)[None], valid[:, None] - 1)
    visible = kv_cache.causal_mask(5, "cpu")[None] & (torch.arange(5)[None, None] < valid[:, None, None])
    with torch.no_grad():
        ops.forward_rows(model, ids, positions, torch.zeros(2, dtype=torch.long), visible, cache)
        tree = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(1))
        hidden = ops.forward_rows(model, tree, valid[:, None] + torch.arange(4)[None], valid,
                                  kv_cache.causal_mask(4, "cpu"), cache)  # (2, 4, H)
    before = cache.layers[0].keys.clone()  # (2, Hkv, 9 or 16, D)
    new_len = ops.keep_row_paths(cache, 5, valid, [torch.tensor([0, 2, 3]), torch.tensor([1])])
    after = cache.layers[0].keys
    assert new_len.tolist() == [6, 6] and kv_cache.cache_length(cache) == 6
    assert after.shape[2] == (6 if cache_kind == "dynamic" else 16)
    assert torch.equal(after[0, :, :3], before[0, :, :3]) and torch.equal(after[1, :, :5], before[1, :, :5])
    assert torch.equal(after[0, :, 3:6], before[0, :, [5, 7, 8]])
    assert torch.equal(after[1, :, 5], before[1, :, 6])
    ops.select_rows(cache, torch.tensor([1]), 6)
    assert torch.equal(cache.layers[0].keys[0, :, :6], after[1, :, :6]) and kv_cache.cache_length(cache) == 6
    return hidden


def test_empty_prompt_in_a_batch_is_named():
    model = tiny_model("llama")
    prompts = prompts_of([4, 0, 6, 0])
    with pytest.raises(ValueError, match="prompts 1, 3 of the batch are empty"):
        batch_generate(model, random_heads(model), prompts, WIDE_TREE, 4)
    with pytest.raises(ValueError, match="holds no prompt"):
        batch_generate(model, random_heads(model), [], WIDE_TREE, 4)


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    from tiny import save_cli_files

    root = tmp_path_factory.mktemp("batch-cli")
    base, prompts = save_cli_files(root, [
        {"prompt": "hello world"}, {"messages": [{"role": "user", "content": "the quick brown fox jumps"}]},
        {"prompt": "how are you today? Medusa heads predict tokens ahead"}])
    return root, base, prompts


def test_cli_generate_batched_equals_one_at_a_time(cli_setup, capsys):
    from medusa.cli import main
    from medusa.model import MedusaModel
    from medusa.tools.bench import encode_prompt, read_prompts

    root, base, prompts = cli_setup
    args = ["generate", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--stats"]
    assert main(args + ["--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    assert "--batch-size 8 is larger than the 3 prompts given: using 3" in captured.err
    model = MedusaModel.from_pretrained(base, root / "heads")
    expected = []
    for i, record in enumerate(read_prompts(prompts)):
        tokens, _ = model.generate(encode_prompt(model.tokenizer, record), max_new_tokens=12)
        expected += [f"--- prompt {i} ---", model.tokenizer.decode(tokens, skip_special_tokens=True)]
    assert captured.out == "\n".join(expected) + "\n"
    assert main(args + ["--batch-size", "2"]) == 0
    assert capsys.readouterr().out == "\n".join(expected) + "\n"


def test_cli_batched_bad_inputs(cli_setup, tmp_path, capsys):
    from medusa.cli import main

    root, base, prompts = cli_setup
    with_empty = tmp_path / "with-empty.jsonl"
    with_empty.write_text('{"prompt": "hello"}\n{"prompt": ""}\n')
    common = ["generate", "--base", str(base), "--heads", str(root / "heads"), "--max-new-tokens", "4"]
    assert main(common + ["--prompts", str(with_empty), "--no-chat-template"]) == 2
    assert "prompt 1 of the batch is empty" in capsys.readouterr().err
    assert main(common + ["--prompts", str(prompts), "--do-sample", "--seed", "1"]) == 0  # batched sampling runs
    assert capsys.readouterr().out.count("--- prompt") == 3
    assert main(common + ["--prompt", "hello", "--batch-size", "2"]) == 2
    assert "--batch-size needs --prompts" in capsys.readouterr().err
    assert main(common + ["--prompts", str(prompts), "--stream"]) == 2
    assert "not with --prompts" in capsys.readouterr().err


def test_batched_rows_with_logits_processors_or_sampling_decode_as_alone():
    """Each row has its own rule, logits processors and seeded generator: greedy with a repetition penalty gives
    each prompt generate()'s tokens; seeded rejection sampling and typical acceptance on a fixed tree draw in the
    same order as alone, so the same tokens."""
    from medusa.model import MedusaModel

    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model), WIDE_TREE, engine="eager")
    prompts = prompts_of([7, 12, 5])
    for settings in ({"repetition_penalty": 1.3}, {"do_sample": True, "temperature": 0.9, "seed": 3},
                     {"do_sample": True, "temperature": 0.9, "seed": 3, "acceptance": "typical"}):
        batched, _ = medusa.generate_batch(prompts, 16, stop_token_ids=set(), **settings)
        alone = [medusa.generate(p, 16, stop_token_ids=set(), **settings)[0] for p in prompts]
        assert batched == alone, settings


def test_cli_batched_bench(cli_setup, tmp_path, capsys):
    import json

    from medusa.cli import main

    root, base, prompts = cli_setup
    out = tmp_path / "batch.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--max-new-tokens", "10", "--batch-size", "1", "2", "16", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "batch size 16 is larger than the 3 prompts given: used 3" in captured.err
    result = json.loads(out.read_text())
    assert result["batch_sizes"] == [1, 2, 3] and result["prompts"] == 3
    for size in ("1", "2", "3"):
        for method in ("plain", "medusa", "hf"):
            record = result["results"][size][method]
            assert record["identical"] == 3, (size, method)
            assert record["tokens_per_s"] > 0
        assert result["results"][size]["medusa"]["tau"] >= 1
    assert "tokens/s" in captured.out
