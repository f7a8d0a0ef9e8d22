"""The EAGLE-3-style drafter (medusa.drafters.eagle): training-time test equals decoding, level-by-level drafting
equals drafting each node alone, its cache equals one rebuilt from the accepted tokens, and decoding with a trained
drafter (several drafts accepted) is exactly the base's greedy decoding on every tiny architecture, alone, batched,
beside the prompt-lookup chain and on the per-step tree; speculative sampling with it keeps the base's distribution."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decoding import hf_greedy
from tiny import tiny_model

from medusa.base import base_states as medusa_base_states
from medusa.decode.batch import batch_decode_steps, batch_generate
from medusa.decode.loop import decode_steps, medusa_generate
from medusa.decode.tree import Tree, tree_buffers
from medusa.drafters.calibration import measure_calibration
from medusa.drafters.eagle import default_eagle_layers, eagle_base_settings
from medusa.drafters.heads import MedusaHeadsConfig, build_heads
from medusa.drafters.heads_drafter import HeadsDrafter, draft_tree
from medusa.drafters.per_step import PerStepDrafter, StepCost

ARCHS = ["llama", "qwen2", "mistral", "gemma3", "gpt2"]
WIDE_TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])


def base_states(model, ids: torch.Tensor, layers) -> torch.Tensor:
    """``(T, (1 + k) H)``: the base's last hidden state and the outputs of ``layers`` over ``ids`` ``(T,)``."""
    return medusa_base_states(model, ids[None], None, layers)[0]


def eagle_heads(model, num_heads: int = 3, seed: int = 1, scale: float = 0.2, token_map=None):
    """An eagle drafter on ``model`` with random weights (``scale`` their spread)."""
    text = model.config.get_text_config(decoder=True)
    settings = eagle_base_settings(text)
    weight = model.get_output_embeddings().weight.detach()
    config = MedusaHeadsConfig(hidden_size=text.hidden_size, vocab_size=weight.shape[0], num_heads=num_heads,
                               head_type="eagle", eagle_layers=default_eagle_layers(settings["num_hidden_layers"]),
                               eagle_base=settings, head_vocab_size=None if token_map is None else len(token_map))
    decoder = model.get_decoder()
    position = decoder.wpe.weight.detach() if settings["positions"] == "learned" else None
    heads = build_heads(config, weight, model.get_input_embeddings().weight.detach(), token_map, position)
    torch.manual_seed(seed)
    for p in heads.parameters():
        p.data.normal_(0, scale)
    return heads.eval()


PROMPTS = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (10, 5, 14, 8)]
NEW_TOKENS = 32


def train_eagle(model, prompts=PROMPTS, steps: int = 150, seed: int = 0):
    """An eagle drafter trained for ``steps`` Adam steps on the base's own greedy continuations of ``prompts``
    (cross-entropy to the base's argmax at every unrolled step): one that gets drafts accepted when it decodes
    them (a tiny random base's text is not predictable beyond what was seen, so the test prompts are the data)."""
    heads = eagle_heads(model, scale=0.02, seed=seed).train()
    layers = heads.base_layers
    length = max(len(p) for p in prompts) + NEW_TOKENS
    seqs = [torch.tensor(p.tolist() + hf_greedy(model, p, length - len(p))) for p in prompts]
    states = torch.stack([base_states(model, s, layers) for s in seqs])  # (n, T, (1+k)H)
    tokens = torch.stack(seqs)  # (n, T)
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        logits = heads(states, tokens, steps=2)  # (2, 6, T, V)
        loss = 0.0
        for k in range(2):
            pred, target = logits[k, :, : -(k + 2)], tokens[:, k + 2 :]
            loss = loss + torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_training_time_test_is_what_decoding_drafts(arch):
    """Unrolled step j at anchor t (training) gives the logits decoding drafts at depth j + 1 along the true tokens."""
    model = tiny_model(arch)
    heads = eagle_heads(model)
    ids = torch.randint(3, 300, (14,), generator=torch.Generator().manual_seed(3))
    states = base_states(model, ids, heads.base_layers)
    with torch.no_grad():
        unrolled = heads(states, ids, steps=3)  # (3, T, V)
        for t in (0, 4, 9):
            context = heads.extend_context(heads.new_context(), states[: t + 1], ids[1 : t + 2])
            path = [int(ids[t + 1])]
            for j in range(3):
                logits = heads.draft_logits(j, context, torch.tensor([path]))[0]
                torch.testing.assert_close(logits, unrolled[j, t], atol=1e-4, rtol=1e-4)
                path.append(int(ids[t + 2 + j]))


def test_each_unrolled_step_reads_the_previous_steps_output():
    """Step j's input feature at position p is step j-1's output at p-1: changing step 0's output at one position
    changes step 1 only at the next position (its own chain), and step 0 nowhere else."""
    model = tiny_model("llama")
    heads = eagle_heads(model)
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(4))
    states = base_states(model, ids, heads.base_layers)
    seen = []
    finish = heads.layer.finish

    def spy(hidden, attended):
        seen.append(hidden.detach().clone())
        out = finish(hidden, attended)
        seen.append(out.detach().clone())
        return out

    heads.layer.finish = spy
    with torch.no_grad():
        heads(states, ids, steps=3)
    assert len(seen) == 6  # exactly 3 steps
    for j in (1, 2):
        step_input, previous_output = seen[2 * j][0], seen[2 * j - 1][0]  # (T, H)
        torch.testing.assert_close(step_input[1:], previous_output[:-1])
        assert torch.all(step_input[0] == 0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_level_by_level_drafting_equals_each_node_alone(arch):
    model = tiny_model(arch)
    heads = eagle_heads(model)
    ids = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(5))
    states = base_states(model, ids, heads.base_layers)
    layout = tree_buffers(WIDE_TREE)
    with torch.no_grad():
        context = heads.extend_context(heads.new_context(), states[:-1], ids[1:])
        alone = copy.deepcopy(context)
        tree = draft_tree(heads, context, ids[-1], layout)
        for draws in tree.draws:
            for slot, parent in enumerate(draws.parents.tolist()):
                path = tree.tokens[layout.node_paths[parent, : int(layout.depth[parent]) + 1]]
                # The node drafted alone: a fresh copy of the context, its chain fed one node per call.
                single = copy.deepcopy(alone)
                for d in range(len(path)):
                    logits = heads.draft_logits(d, single, path[None, : d + 1])[0]
                torch.testing.assert_close(logits, draws.logits[slot], atol=1e-5, rtol=1e-5)


class Keeping(HeadsDrafter):
    """The heads' drafter, keeping the last state it made (so a test can read the drafter's cache)."""

    def new_state(self):
        self.state, self.fed = super().new_state(), []
        return self.state

    def start(self, state, hidden, next_tokens):
        super().start(state, hidden, next_tokens)
        self.fed += next_tokens[-1:].tolist()

    def update(self, state, draft, path, hidden, next_tokens):
        super().update(state, draft, path, hidden, next_tokens)
        self.fed += next_tokens.tolist()  # every accepted token, also past a budget that cut the output


def test_cache_after_steps_equals_one_rebuilt_from_the_accepted_tokens():
    model = tiny_model("llama")
    heads = train_eagle(model, steps=100)
    ids = PROMPTS[0]
    drafter = Keeping(heads, WIDE_TREE)
    accepted = sum(step.accepted for step in decode_steps(model, drafter, ids, NEW_TOKENS))
    assert accepted > 0  # the cache went through real multi-token steps
    full = torch.cat([ids, torch.tensor(drafter.fed)])
    with torch.no_grad():
        rebuilt = heads.extend_context(heads.new_context(), base_states(model, full[:-1], heads.base_layers),
                                       full[1:])
    kept = drafter.state.context
    assert kept.length == rebuilt.length == len(full) - 1
    torch.testing.assert_close(kept.keys, rebuilt.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kept.values, rebuilt.values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kept.last, rebuilt.last, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained():
    cache = {}

    def get(arch):
        if arch not in cache:
            model = tiny_model(arch)
            cache[arch] = (model, train_eagle(model))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_trained_drafter_is_exact_alone_and_batched(arch, trained):
    model, heads = trained(arch)
    prompts = PROMPTS[:3]
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    taus = []
    for prompt, reference in zip(prompts, references, strict=True):
        out, stats = medusa_generate(model, heads, prompt, WIDE_TREE, NEW_TOKENS)
        assert out == reference, arch
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.5, taus  # trained: drafts accepted, not only the bonus token
    out, _ = batch_generate(model, heads, prompts, WIDE_TREE, NEW_TOKENS)
    assert out == references, arch


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_trained_drafter_beside_the_lookup_chain_and_on_the_per_step_tree(arch, trained):
    model, heads = trained(arch)
    prompts = PROMPTS[2:]
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    with_lookup = Tree(WIDE_TREE.paths, "wide+lookup", lookup_length=3)
    for prompt, reference in zip(prompts, references, strict=True):
        assert medusa_generate(model, heads, prompt, with_lookup, NEW_TOKENS)[0] == reference
    states = []
    for prompt, reference in zip(prompts, references, strict=True):
        seq = torch.cat([prompt, torch.tensor(reference)])
        states.append((seq, len(prompt), base_states(model, seq, heads.base_layers)))
    with torch.no_grad():
        calibration = measure_calibration(heads, states, top_k=4, lookup_length=4)
    cost = StepCost({1: 1.0, 4: 1.05, 8: 1.1, 16: 1.3}, [0.002] * heads.config.num_heads)
    drafter = PerStepDrafter(heads, calibration, cost, max_nodes=16)
    assert drafter.base_layers == heads.base_layers
    taus = []
    for prompt, reference in zip(prompts, references, strict=True):
        stats_out = list(decode_steps(model, drafter, prompt, NEW_TOKENS))
        tokens = [t for s in stats_out for t in s.tokens]
        assert tokens == reference
        taus.append(sum(len(s.tokens) for s in stats_out[1:]) / max(len(stats_out) - 1, 1))
    assert max(taus) > 1.2, taus
    rows = [[] for _ in prompts]
    for step in batch_decode_steps(model, drafter, prompts, NEW_TOKENS):
        for i, s in step:
            rows[i].extend(s.tokens)
    assert rows == references


class EagleOnTable:
    """The eagle drafter drafting the sampling test's tree (tests/test_sampling.py) after its fixed prompt: its
    context is made once from the tabulated base's states; the heads' ``hidden`` argument is not read. A node's
    logits depend on its path only, so each path's are computed once (20,000 steps then cost little)."""

    def __init__(self, heads, context):
        self.heads, self.context, self.seen = heads, context, {}
        self.config, self.head_vocab_size = heads.config, heads.head_vocab_size

    def draft_logits(self, k, hidden, path_tokens):
        rows = []
        for path in path_tokens:
            key = tuple(path.tolist())
            if key not in self.seen:
                self.seen[key] = self.heads.draft_logits(k, self.context, path[None])[0]
            rows.append(self.seen[key])
        return torch.stack(rows)  # (P, Vh)

    def to_base_ids(self, ids):
        return self.heads.to_base_ids(ids)


@pytest.fixture(scope="module")
def eagle_on_table():
    import test_sampling as ts

    model = tiny_model("llama", vocab_size=ts.V)
    heads = eagle_heads(model, num_heads=2, scale=0.1, token_map=ts.HEAD_VOCAB)
    prompt = torch.tensor(ts.PROMPT + [ts.ROOT])
    with torch.no_grad():
        context = heads.extend_context(heads.new_context(), base_states(model, prompt[:-1], heads.base_layers),
                                       prompt[1:])
    return EagleOnTable(heads, context), ts.tabulated_base_logits()


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["t1.0", "t0.7"])
def test_speculative_sampling_with_the_eagle_drafter_keeps_the_base_distribution(eagle_on_table, setting):
    import test_sampling as ts

    drafter, raw = eagle_on_table
    tables = ts.processed(ts.SETTINGS[setting], raw)
    accepted = []
    with torch.no_grad():
        samples = ts.run_steps(ts.rejection_rule(ts.SETTINGS[setting]), drafter, tables, ts.DRAWS,
                               accepted=accepted)
    assert sum(a > 0 for a in accepted) > 0.05 * len(accepted)  # drafts were accepted: the test sees them
    assert ts.chi_square_p(samples, tables) > 0.01


@pytest.mark.slow
def test_the_distribution_test_catches_a_broken_q_with_the_eagle_drafter(eagle_on_table):
    import test_sampling as ts

    drafter, raw = eagle_on_table
    tables = ts.processed(ts.SETTINGS["t1.0"], raw)
    rule = ts.rejection_rule(ts.SETTINGS["t1.0"])
    with torch.no_grad():
        samples = ts.run_steps(rule, drafter, tables, ts.DRAWS, sampler=ts.TopKClaimingSoftmax(rule.sampler.warp))
    assert ts.chi_square_p(samples, tables) < 1e-6


def test_typical_acceptance_and_sampling_run_with_the_trained_drafter(trained):
    """Sampled decoding with the drafter: rejection sampling (lossless; its law is tested above) and typical
    acceptance (lossy, labelled so) both accept drafts and stop at the budget; the same seed gives the same tokens."""
    from medusa.decode.logits_process import resolve_decoding

    model, heads = trained("llama")
    for acceptance in ("rejection", "typical"):
        runs = []
        for _ in range(2):
            decoding = resolve_decoding(model.generation_config, do_sample=True, temperature=0.7, seed=3,
                                        acceptance=acceptance)
            steps = list(decode_steps(model, HeadsDrafter(heads, WIDE_TREE), PROMPTS[0], NEW_TOKENS,
                                      decoding=decoding))
            runs.append([t for s in steps for t in s.tokens])
            assert sum(s.accepted for s in steps) > 0, acceptance
        assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS, acceptance


def test_the_per_step_tree_drafts_an_eagle_node_only_below_one_drafted_from():
    """Eagle's drafting keeps each drafted-from node's features: with one parent a depth and a lookup chain that
    wins depth 2 after a head's child won depth 1, the chain node's parent was never drafted from, so the per-step
    tree must not pick the chain node (it raised KeyError); the tokens stay the base's greedy ones."""
    from test_per_step import BINS, COST, HEAD_CALL

    from medusa.drafters.calibration import Calibration, heads_identity
    from medusa.engines import make_engine

    model = tiny_model("llama")
    heads = eagle_heads(model)
    k = heads.config.num_heads
    calibration = Calibration(heads_identity(heads), 8, [[0.9] * 8] * k, [[0.9] * BINS] * k, [[1] * BINS] * k, 3,
                              [[0.85, 0.99, 0.99, 0.99, 0.99, 0.99]] * 4, [[1] * 6] * 4)
    drafter = PerStepDrafter(heads, calibration, StepCost(COST, [HEAD_CALL] * 3), max_parents=1,
                             learn_acceptance=False)
    prompt = torch.tensor([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8])
    out = [t for s in decode_steps(model, drafter, prompt, 16, engine=make_engine("eager", model)) for t in s.tokens]
    assert out == hf_greedy(model, prompt, 16)
