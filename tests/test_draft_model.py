"""A separate draft model as the drafter (medusa.drafters.draft_model): greedy identical to the base on five
architectures, a self-draft accepting every draft, exact speculative sampling with the draft's own q (chain and
tree, chi-square, with a broken-q control), the draft's cache kept to the accepted tokens, and bad input named."""

from __future__ import annotations

import logging

import pytest
import torch
from test_sampling import (
    PROMPT,
    ROOT,
    TopKClaimingSoftmax,
    V,
    chi_square_p,
    processed,
    rejection_rule,
    table_logits_at,
)
from tiny import save_tiny, tiny_model, tiny_tokenizer

from medusa.decode.loop import GenerationStats, decode_steps
from medusa.decode.tree import tree_buffers
from medusa.drafters.composite import CompositeDrafter, tree_drafter
from medusa.drafters.draft_model import (
    DraftModelDrafter,
    DraftModelHeads,
    check_vocabularies,
    draft_tree_shape,
    load_draft_model,
)
from medusa.drafters.heads_drafter import draft_tree
from medusa.engines import make_engine

ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma3"]


def hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def decode(base, drafter, ids: torch.Tensor, n: int, engine: str = "eager", **kw) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    steps = decode_steps(base, drafter, ids, n, set(), stats, engine=make_engine(engine, base), **kw)
    return [t for s in steps for t in s.tokens], stats


def prompt(seed: int = 0, n: int = 12) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_a_draft_model_is_the_base_greedy(arch):
    """Another random model of the architecture (its drafts mostly wrong) on a chain, and on a top-2 tree beside a
    prompt-lookup chain: both give exactly HF's greedy tokens."""
    base, draft = tiny_model(arch, seed=0), tiny_model(arch, seed=1)
    ids = prompt()
    reference = hf_greedy(base, ids, 32)
    chain = tree_drafter(DraftModelHeads(draft, 3, base.config.vocab_size), draft_tree_shape(3))
    assert isinstance(chain, DraftModelDrafter)
    assert decode(base, chain, ids, 32)[0] == reference
    tree = tree_drafter(DraftModelHeads(draft, 2, base.config.vocab_size), draft_tree_shape(2, 2).with_lookup(4))
    assert isinstance(tree, CompositeDrafter)
    assert decode(base, tree, ids, 32)[0] == reference


@pytest.mark.parametrize("engine", ["static", "onednn"])
def test_a_self_draft_accepts_every_draft_on_any_engine(engine):
    """The base as its own draft (alpha = 1): every step accepts all K drafts, tau = K + 1, through the draft's own
    static or oneDNN engine as through eager."""
    base = tiny_model("llama", seed=0)
    k = 3
    heads = DraftModelHeads(tiny_model("llama", seed=0), k, base.config.vocab_size, engine=engine)
    tokens, stats = decode(base, tree_drafter(heads, draft_tree_shape(k)), prompt(), 41, engine=engine)
    assert tokens == hf_greedy(base, prompt(), 41)
    assert stats.accepted_per_step == [k] * stats.decode_steps
    assert stats.decode_tokens == (k + 1) * stats.decode_steps  # 40 tokens after the prefill's one


def test_draft_logits_are_the_draft_models_own_conditionals():
    """What each tree level drafts from equals the draft model's full forward over prompt + root + the node's path
    (chain levels fed incrementally, a tree's levels refed with the tree's mask), and the draft's cache holds the
    accepted tokens only after each step."""
    draft = tiny_model("qwen2", seed=2)
    heads = DraftModelHeads(draft, 3, draft.config.vocab_size)
    sequence = prompt(3)
    for shape in (draft_tree_shape(3), draft_tree_shape(3, 2)):
        context = heads.new_context()
        heads.catch_up(context, sequence)
        layout = tree_buffers(shape)
        tree = draft_tree(heads, context, sequence[-1], layout)
        for d, parents in enumerate(layout.level_parents):
            for node in parents.tolist():
                path = tree.tokens[layout.node_paths[node, 1 : d + 1]]
                with torch.no_grad():
                    full = draft(torch.cat([sequence, path])[None]).logits[0, -1]
                assert torch.allclose(tree.draws[d].logits[parents.tolist().index(node)], full, atol=1e-4)
        heads.discard_tree(context)
        assert heads.engine.cache_length(context.cache) == len(sequence)


# -- exact sampling: the test_sampling harness, with a draft model's tabulated conditionals as q ---------------------

@pytest.fixture(scope="module")
def tables():
    """Base and draft logits after PROMPT + ROOT + y1 (+ y2): the base's three levels, the draft's two."""
    from test_sampling import tabulated_base_logits

    draft = tiny_model("llama", vocab_size=V, seed=3)
    prefix = torch.tensor(PROMPT + [ROOT])
    ids = torch.cat([prefix.expand(V, -1), torch.arange(V)[:, None]], dim=1)  # (V, 8)
    with torch.no_grad():
        q = 1.5 * draft(ids).logits
    return tabulated_base_logits(), (q[0, -2], q[:, -1]), draft


class DraftTable:
    """The draft model's conditionals, tabulated (one model call per distinct path would make 8,000 steps slow);
    :func:`test_table_is_the_draft_models_own` checks them against :class:`DraftModelHeads`."""

    config = type("C", (), {"num_heads": 2})
    head_vocab_size = V
    base_layers = ()

    def __init__(self, q):
        self.q = q

    def draft_logits(self, k, hidden, path_tokens):
        return torch.stack([self.q[0] if k == 0 else self.q[1][int(p[1])] for p in path_tokens])

    def to_base_ids(self, ids):
        return ids


def test_table_is_the_draft_models_own(tables):
    _, q, draft = tables
    heads = DraftModelHeads(draft, 2, V)
    context = heads.new_context()
    heads.catch_up(context, torch.tensor(PROMPT + [ROOT]))
    paths = torch.tensor([[ROOT, 4], [ROOT, 17]])
    assert torch.allclose(1.5 * heads.draft_logits(0, context, paths[:, :1])[0], q[0], atol=1e-4)
    assert torch.allclose(1.5 * heads.draft_logits(1, context, paths), q[1][[4, 17]], atol=1e-4)


def sample_steps(rule, heads, tables_p, shape, n, sampler=None) -> torch.Tensor:
    """``(n, 3)``: first three tokens after the root of ``n`` independent steps on ``shape``, completed from the
    exact base distribution (test_sampling's harness on this tree)."""
    buffers = tree_buffers(shape)
    probs = [torch.softmax(t, dim=-1) for t in tables_p]
    gen = torch.Generator().manual_seed(5)
    out = torch.empty(n, 3, dtype=torch.long)
    for i in range(n):
        tree = draft_tree(heads, None, torch.tensor(ROOT), buffers, sampler or rule.sampler)
        result = rule.accept(tree, table_logits_at(tables_p, buffers, tree.tokens))
        emitted = tree.tokens[result.path_nodes[1:]].tolist() + [int(result.next_token)]
        while len(emitted) < 3:
            emitted.append(int(torch.multinomial(probs[len(emitted)][tuple(emitted)], 1, generator=gen)))
        out[i] = torch.tensor(emitted[:3])
    return out


DRAWS = 6_000


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("width", [1, 2])
def test_speculative_sampling_with_a_draft_model_is_the_base_distribution(tables, width, temperature):
    base, q, _ = tables
    settings = {"temperature": temperature}
    p = processed(settings, base)
    samples = sample_steps(rejection_rule(settings), DraftTable(q), p, draft_tree_shape(2, width), DRAWS)
    assert chi_square_p(samples, p) > 0.01


def test_control_a_q_the_drafts_were_not_drawn_from_fails(tables):
    """Top-1 drafts (deterministic) scored as if drawn from the draft's softmax: the same test must fail."""
    base, q, _ = tables
    p = processed({"temperature": 1.0}, base)
    rule = rejection_rule({"temperature": 1.0})
    samples = sample_steps(rule, DraftTable(q), p, draft_tree_shape(2), DRAWS, TopKClaimingSoftmax(rule.sampler.warp))
    assert chi_square_p(samples, p) < 1e-6


def test_sampled_decoding_through_the_loop_is_seeded_and_runs_the_draft():
    base = tiny_model("llama", seed=0)
    from medusa.decode.logits_process import resolve_decoding

    outs = []
    for _ in range(2):
        heads = DraftModelHeads(tiny_model("llama", seed=0), 3, base.config.vocab_size)
        decoding = resolve_decoding(do_sample=True, temperature=0.8, top_k=0, seed=11)
        tokens, stats = decode(base, tree_drafter(heads, draft_tree_shape(3)), prompt(), 30, decoding=decoding)
        outs.append(tokens)
    assert outs[0] == outs[1] and len(outs[0]) == 30
    assert stats.tau > 2  # the base as its own draft: q == p, nearly every draft accepted


# -- bad input ------------------------------------------------------------------------------------------------------

def test_bad_draft_counts_and_context_are_refused():
    base = tiny_model("llama", seed=0)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="draft tokens must be an int >= 1"):
            draft_tree_shape(bad)
        with pytest.raises(ValueError, match="draft tokens must be an int >= 1"):
            DraftModelHeads(base, bad, base.config.vocab_size)
    with pytest.raises(ValueError, match="draft width must be an int >= 1"):
        draft_tree_shape(2, 0)
    short = tiny_model("llama", seed=1, max_position_embeddings=20)
    drafter = tree_drafter(DraftModelHeads(short, 4, base.config.vocab_size), draft_tree_shape(4))
    with pytest.raises(ValueError, match="draft model's context is 20 positions"):
        decode(base, drafter, prompt(n=12), 30)


def test_another_vocabulary_is_refused_naming_the_first_differing_id():
    tok = tiny_tokenizer()
    other = tiny_tokenizer()
    vocab = other.get_vocab()
    token = next(t for t, i in vocab.items() if i == 40)
    other.add_tokens(["<zz-new>"])  # a longer vocabulary: differs at its end
    with pytest.raises(ValueError, match=rf"token id {len(vocab)}: base None, draft '<zz-new>'"):
        check_vocabularies(tok, other, 320, 320)
    with pytest.raises(ValueError, match="lm_head has 100 rows but the base's tokenizer has"):
        check_vocabularies(tok, tok, 320, 100)
    assert token  # id 40 exists in both: equal tokenizers pass
    check_vocabularies(tok, tiny_tokenizer(), 320, 320)


def test_a_draft_folder_is_moved_to_the_base_dtype_with_a_note(tmp_path, caplog):
    base_dir = save_tiny(tmp_path / "base", "llama", seed=0)
    draft = tiny_model("llama", seed=1).to(torch.bfloat16)
    draft.save_pretrained(tmp_path / "draft")
    tiny_tokenizer().save_pretrained(tmp_path / "draft")
    from medusa.base import load_base

    base, tokenizer = load_base(base_dir)
    with caplog.at_level(logging.WARNING):
        heads = load_draft_model(tmp_path / "draft", base, tokenizer, depth=2)
    assert heads.model.dtype == torch.float32
    assert "moved to the base's torch.float32" in caplog.text
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_draft_model(tmp_path / "missing", base, tokenizer)


# -- the command line -----------------------------------------------------------------------------------------------

def test_cli_bench_and_generate_with_a_made_draft(tmp_path, capsys):
    """``make-draft`` then ``bench --draft-model``: identical to HF, the prediction beside the measured figures with
    the draft's c_q / c_p; ``generate --draft-model`` prints text; heads-only flags are refused by name."""
    import json

    from tiny import save_cli_files

    from medusa.cli import main

    base, prompts = save_cli_files(tmp_path, [{"prompt": "hello world"}, {"prompt": "how are you today?"}])
    base_dir = save_tiny(tmp_path / "deep", "llama", seed=0, num_hidden_layers=3)
    assert main(["make-draft", "--base", str(base_dir), "--layers", "1", "--out", str(tmp_path / "draft")]) == 0
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base_dir), "--draft-model", str(tmp_path / "draft"), "--draft-tokens", "2",
                 "--prompts", str(prompts), "--max-new-tokens", "12", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] == 1.0 and result["head_type"] == "draft_model"
    assert result["draft"]["draft_layers"] == 1 and result["tree"] == "draft-chain-2"
    prediction = result["prediction"]
    # step_cost comes from timed forwards, which a loaded machine (a parallel suite) can invert: its arithmetic only.
    assert prediction["cost_ratio"] > 0 and prediction["step_cost"] > 0 and 1 <= prediction["predicted_tau"] <= 3
    assert prediction["predicted_speedup"] == pytest.approx(prediction["predicted_tau"] / prediction["step_cost"])
    stored = json.loads(open(result["profile"]["path"]).read())["drafters"]  # c_q read from the machine profile
    draft_costs = [v["per_depth_s"] for k, v in stored.items() if k.startswith("draft_model:llama:1x")]
    assert len(draft_costs) == 1 and len(prediction["draft_forward_s"]) == len(draft_costs[0]) == 8
    assert prediction["draft_forward_s"]["1"] == draft_costs[0][0]
    assert "predicted vs measured" in capsys.readouterr().out
    assert main(["generate", "--base", str(base), "--draft-model", str(base), "--draft-tokens", "3", "--draft-width",
                 "2", "--prompt", "hello world", "--max-new-tokens", "8", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "draft-tree-2x3" in captured.err
    for flags, message in ((["--draft-tokens", "0"], "--draft-tokens must be >= 1"),
                           (["--heads", str(tmp_path / "heads")], "drop --heads"),
                           (["--tree", "x.json"], "drop --tree")):
        assert main(["generate", "--base", str(base), "--draft-model", str(base), "--prompt", "hi", *flags]) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", "--base", str(base), "--prompt", "hi"]) == 2
    assert "or --draft-model (a separate draft model)" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_a_quantized_copy_of_the_base_drafts_mostly_accepted_tokens_and_greedy_stays_exact(tmp_path, engine):
    """The base's own folder with --draft-quantize int8 (a quantized copy of the target): its decoder layers hold
    int8 weights, its drafts mostly agree with the base (alpha well above a random draft's), and the output is
    still exactly HF's greedy tokens; a bf16 base refuses it, naming the setting."""
    from medusa.drafters.draft_model import check_quantize

    folder = save_tiny(tmp_path / "base", "llama", seed=0)
    base = tiny_model("llama", seed=0)
    heads = load_draft_model(folder, base, tiny_tokenizer(), depth=3, engine=engine, quantize="int8")
    assert heads.quantized == "int8" and heads.engine.name == engine
    assert isinstance(heads.model.model.layers[0].mlp.up_proj, torch.ao.nn.quantized.dynamic.Linear)
    tokens, stats = decode(base, tree_drafter(heads, draft_tree_shape(3)), prompt(), 40)
    assert tokens == hf_greedy(base, prompt(), 40)
    assert sum(stats.accepted_per_step) / (3 * stats.decode_steps) > 0.6
    with pytest.raises(ValueError, match="--draft-quantize int8 runs on the CPU in float32"):
        check_quantize("int8", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        check_quantize("int4", torch.device("cpu"), torch.float32)
