"""The native int4 decoder (medusa/engines/native.py, csrc/q4_decoder.c): its product, its forward against the same
fp32 model run by transformers, row invariance, Medusa = plain through it, and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decoding import random_heads
from tiny import tiny_model

from medusa import engines
from medusa.decode.tree import Tree
from medusa.engines import native, quantized
from medusa.engines.int4 import quantize_int4
from medusa.model import MedusaModel


@pytest.fixture(autouse=True)
def _native_decoder_here():
    """Skip where the library cannot be built (no C compiler) or torch lacks its int4 kernel (the engine's other
    path); checked inside the session, so the build lands in the suite's own cache folder."""
    reason = native.native_unavailable() or quantized.quantize_unavailable("int4", "cpu")
    if reason is not None:
        pytest.skip(reason)

IDS = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))


def greedy(medusa, tree=None, n=24):
    return medusa.generate(IDS, n, tree=tree, stop_token_ids=set(), do_sample=False)[0]


def test_the_product_is_q_times_d_plus_m_and_each_row_has_the_bits_of_its_row_alone():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen)
    codes = native.NativeCodes(*quantize_int4(weight))
    dense = codes.weight()
    assert (dense - weight).abs().max() <= (weight.abs().max() / 15)  # within the int4 rounding of the weights
    assert torch.allclose(dense, quantized.dequantize_int4(*quantize_int4(weight)), atol=1e-6)
    x = torch.randn(11, 96, generator=gen)
    together = codes.product(x)
    assert torch.allclose(together, x @ dense.T, atol=1e-4)
    for i in range(11):  # 11 rows: two blocks of four and a remainder of three; one and two threads
        assert torch.equal(codes.product(x[i:i + 1]), together[i:i + 1])
        assert torch.equal(codes.product(x[i:i + 1], threads=1), together[i:i + 1])
    with pytest.raises(ValueError, match="multiple of 4"):
        native.NativeCodes(*quantize_int4(torch.randn(6, 64)))


def _dequantized_copy(model, engine):
    """The model whose linear layers hold the weights the native decoder computes with (fp32)."""
    copy_ = copy.deepcopy(model)
    layers = engine.lean.weights
    for i, layer in enumerate(copy_.model.layers):
        qkv, o, gate_up, down = (layers[4 * i + j].weight() for j in range(4))
        attn, mlp = layer.self_attn, layer.mlp
        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        with torch.no_grad():
            for module, w in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv.split(sizes), strict=True):
                module.weight.copy_(w)
            attn.o_proj.weight.copy_(o)
            mlp.gate_proj.weight.copy_(gate_up[:mlp.gate_proj.out_features])
            mlp.up_proj.weight.copy_(gate_up[mlp.gate_proj.out_features:])
            mlp.down_proj.weight.copy_(down)
    return copy_


@pytest.mark.parametrize("kv_heads, head_dim", [(2, 16), (4, 16), (2, 64), (1, 128), (2, 32), (4, 24)])
def test_the_forward_is_the_fp32_model_on_the_dequantized_weights(kv_heads, head_dim):
    """The prompt and a branching tree step: hidden states, logits and the layers a feature drafter reads match
    transformers' fp32 forward of the same weights (up to summation order), each tree row on its own branch; with
    grouped query heads and without, and head sizes the attention's 16-key blocks take (16-128) and one they do not
    (24: the slot-by-slot path)."""
    model = tiny_model("llama", num_key_value_heads=kv_heads, head_dim=head_dim)
    engine = engines.make_engine("int4", model, kernel="native")
    settings = engine.settings()
    assert settings["forward"] == "native" and settings["activation_dtype"] == "float32"
    assert settings["native_isa"] == native.isa()
    assert settings["native_isa"].split("+")[0] in ("avx512", "avx2", "scalar")
    assert_forward_is(engine, _dequantized_copy(model, engine))


def assert_forward_is(engine, reference):
    """The prompt (with the layers a feature drafter reads: the first and the last) and a branching tree step
    through ``engine`` match transformers' fp32 forward of ``reference`` (up to summation order): hidden states,
    layers and logits, each tree row on its own branch."""
    cache = engine.new_cache(64)
    logits, hidden, features = engine.forward_features(IDS, torch.arange(20), torch.ones(20, 20).tril().bool(),
                                                       cache, (0, reference.config.num_hidden_layers - 1))
    with torch.no_grad():
        out = reference(IDS[None], output_hidden_states=True)
    assert torch.allclose(hidden, out.hidden_states[-1][0], atol=1e-4)
    assert torch.allclose(features[:, :reference.config.hidden_size], out.hidden_states[1][0], atol=1e-4)
    assert torch.allclose(logits, out.logits[0], atol=1e-3)
    # a tree after the prompt: 0 -> (1, 2), 2 -> 3; row 3's branch is tokens 0, 2, 3
    tree_ids = torch.tensor([5, 6, 7, 8])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    logits, _ = engine.forward(tree_ids, torch.tensor([20, 21, 21, 22]), mask, cache)
    for row, branch in ((1, [5, 6]), (3, [5, 7, 8])):
        with torch.no_grad():
            expected = reference(torch.cat([IDS, torch.tensor(branch)])[None]).logits[0, -1]
        assert torch.allclose(logits[row], expected, atol=1e-3)


@pytest.mark.parametrize("kernel, head_dim, prompt", [("native", 16, 20), ("native-q8", 16, 20), ("native", 64, 14),
                                                     ("native-q8", 128, 15)])
def test_a_tree_rows_bits_equal_the_same_row_decoded_alone(kernel, head_dim, prompt):
    """A tree row's hidden state has the bits of the same token decoded alone after the same path, and keeping the
    accepted path leaves the cache that decoding made; with prompts of 14 and 15 tokens the tree's own keys straddle
    a 16-key block of the attention."""
    model = tiny_model("llama", head_dim=head_dim)
    engine = engines.make_engine("int4", model, kernel=kernel)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree, alone = engine.new_cache(64), engine.new_cache(64)
    causal = torch.ones(prompt, prompt).tril().bool()
    engine.forward(IDS[:prompt], torch.arange(prompt), causal, tree)
    engine.forward(IDS[:prompt], torch.arange(prompt), causal, alone)
    # hidden states: the decoder's own bits (an fp32 lm_head over several rows may sum otherwise than over one)
    p = prompt
    _, hidden = engine.forward(torch.tensor([5, 6, 7, 8]), torch.tensor([p, p + 1, p + 1, p + 2]), mask, tree)
    steps = [engine.forward(torch.tensor([t]), torch.tensor([q]), torch.ones(1, 1, dtype=torch.bool), alone)[1]
             for t, q in ((5, p), (7, p + 1), (8, p + 2))]
    assert torch.equal(hidden[0], steps[0][0]) and torch.equal(hidden[2], steps[1][0])
    assert torch.equal(hidden[3], steps[2][0])
    assert not torch.equal(hidden[1], steps[1][0])  # row 1 (token 6) is another branch: the control
    # Keeping the accepted path 5 -> 7 -> 8 (rows 0, 2, 3: a move, in the one store of every layer) leaves the
    # cache the row-by-row decoding made: the next token's bits agree.
    tree.keep(p, torch.tensor([0, 2, 3]))
    assert tree.length == alone.length == p + 3 and tree.slot_store.data_ptr() == tree.layers[0].keys.data_ptr()
    after = [engine.forward(torch.tensor([9]), torch.tensor([p + 3]), torch.ones(1, 1, dtype=torch.bool), c)[1]
             for c in (tree, alone)]
    assert torch.equal(after[0], after[1])


@pytest.mark.parametrize("kernel", ["native", "native-q8"])
def test_medusa_through_the_native_decoder_equals_plain_greedy_through_it(kernel):
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model), engine="int4", kernel=kernel, lm_head="bf16")
    assert greedy(medusa) == greedy(medusa, Tree.chain(0))
    # the profile's figures are for this build of the decoder
    assert medusa.engine.profile_name == f"int4:kernel={kernel}@{native.library_key()[:8]}:lm_head=bf16"


@pytest.mark.parametrize("kernel, head_dim", [("native", 16), ("native-q8", 64)])
def test_batched_decoding_through_the_native_decoder_gives_each_prompt_its_tokens_alone(kernel, head_dim):
    """Rows of different lengths in one C call a step (the shorter rows' holes never read): plain and Medusa
    batched greedy decoding give each prompt the tokens it gets decoded alone through the same engine; rows leave
    the batch as they finish (a stop token) and the rest go on. The wide tree straddles rows of different lengths."""
    model = tiny_model("llama", head_dim=head_dim)
    medusa = MedusaModel(model, random_heads(model), Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]),
                         engine="int4", kernel=kernel, lm_head="bf16")
    assert medusa.engine.supports_batch
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen) for n in (7, 19, 12, 3)]
    for tree in (Tree.chain(0), None):
        alone = [medusa.generate(p, 20, tree=tree, stop_token_ids=set(), do_sample=False)[0] for p in prompts]
        batched, _ = medusa.generate_batch(prompts, 20, tree=tree, stop_token_ids=set(), do_sample=False)
        assert batched == alone, tree
    stop = {alone[1][5]}  # the second prompt stops early; the others go on beside it, then without it
    alone = [medusa.generate(p, 20, stop_token_ids=stop, do_sample=False)[0] for p in prompts]
    assert min(len(a) for a in alone) < 20 < max(len(a) for a in alone) + 1
    assert medusa.generate_batch(prompts, 20, stop_token_ids=stop, do_sample=False)[0] == alone


def test_rows_join_and_leave_a_running_native_batch_each_exact():
    """The server's continuous batching through the native decoder: rows prefilled on their own join a running batch
    (their caches stacked beside the running rows'), plain and speculative steps alternate, rows leave at their
    budgets; each row's tokens are its tokens decoded alone through the same engine."""
    from medusa.decode.batch import RunningBatch
    from medusa.drafters.composite import tree_drafter

    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model), Tree.from_paths([(0,), (1,), (0, 0)]), engine="int4",
                         kernel="native-q8", lm_head="bf16")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=gen) for n in (7, 19, 12)]
    budgets = {0: 24, 1: 9, 2: 20}
    batch = RunningBatch(model, tree_drafter(medusa.heads, medusa.tree), engine=medusa.engine)
    out = {k: list(batch.join(k, prompts[k], budgets[k], set()).tokens) if k == 0 else [] for k in range(3)}
    for step in range(80):
        for k, at in ((1, 2), (2, 4)):
            if step == at:
                out[k] += batch.join(k, prompts[k], budgets[k], set()).tokens
        if not batch.keys:
            break
        for key, s in batch.step(plain=step % 3 == 1):
            out[key] += s.tokens
    assert batch.max_rows == 3 and not batch.keys
    for k, ids in enumerate(prompts):
        assert out[k] == medusa.generate(ids, budgets[k], stop_token_ids=set(), do_sample=False)[0], k


def test_the_native_batched_forward_refuses_what_it_cannot_decode():
    engine = engines.make_engine("int4", tiny_model("llama"), kernel="native")
    caches = []
    for n in (5, 8):
        cache = engine.new_cache(32)
        engine.forward(IDS[:n], torch.arange(n), torch.ones(n, n).tril().bool(), cache)
        caches.append(cache)
    batch = engine.stack_rows(caches)
    ids, positions = torch.tensor([[4], [5]]), torch.tensor([[5], [8]])
    with pytest.raises(ValueError, match="valid_len .* of a cache of length 8"):
        engine.forward_rows(ids, positions, torch.tensor([5, 9]), torch.ones(1, 1, dtype=torch.bool), batch)
    with pytest.raises(ValueError, match="must see itself"):
        engine.forward_rows(ids, positions, torch.tensor([5, 8]), torch.zeros(1, 1, dtype=torch.bool), batch)
    seen = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"positions of shape \(2, 2\) for token ids of shape \(2, 1\)"):
        engine.forward_rows(ids, torch.tensor([[5, 6], [8, 9]]), torch.tensor([5, 8]), seen, batch)
    with pytest.raises(ValueError, match="new_visible of shape"):
        engine.forward_rows(ids, positions, torch.tensor([5, 8]), torch.ones(3, 2, 2, dtype=torch.bool), batch)
    with pytest.raises(ValueError, match="B, N >= 1"):
        engine.forward_rows(ids[:, :0], positions[:, :0], torch.tensor([5, 8]), seen[:0, :0], batch)
    with pytest.raises(ValueError, match="got an empty one"):
        engine.forward_rows(ids, positions, torch.tensor([0, 0]), seen, engine.new_cache(32))
    assert batch.length == 8  # nothing refused was written
    hidden = engine.forward_rows(ids, positions, torch.tensor([5, 8]), torch.ones(1, 1, dtype=torch.bool), batch)
    assert hidden.shape == (2, 1, engine.model.config.hidden_size) and batch.length == 9


def test_q8_0_blocks_round_trip_and_the_drafter_products_compute_with_them():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 96, generator=gen)
    weight[0, :32] = 0  # a block of zeros: d 0, codes 0
    codes, d = native.quantize_q8_0(weight)
    step = d.repeat_interleave(32, 1)
    dense = codes.float() * step
    assert d[0, 0] == 0 and not codes[0, :32].any() and codes.abs().max() == 127
    assert ((dense - weight).abs() <= step / 2 + 1e-6).all()  # within half a step of the weights
    x = torch.randn(5, 96, generator=gen)
    reference = x @ dense.T
    assert torch.allclose(native.q8_0_product(weight, int8_activations=False)(x), reference, atol=1e-4)
    rounded = native.q8_0_product(weight, int8_activations=True)(x)  # the activations rounded to int8 too
    assert (rounded - reference).abs().max() < 0.02 * reference.abs().max() and not torch.equal(rounded, reference)
    assert native.q8_0_product(torch.randn(40, 96), int8_activations=False) is None  # 40 rows: not blocks of 16
    with pytest.raises(ValueError, match="multiple of 32"):
        native.quantize_q8_0(torch.randn(16, 40))


@pytest.mark.parametrize("kernel", ["native", "native-q8"])
def test_hydra_heads_draft_through_q8_0_products_beside_the_native_decoder(kernel):
    """Beside the native decoder the heads' input layers and projection run on Q8_0 products (the drafter's key in
    the profile says so, and the tree's size may be any: the decoder's cost is smooth); the tokens stay plain's.
    Another engine takes them back to matmul."""
    from medusa.profile import heads_key

    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model, head_type="hydra"), engine="int4", kernel=kernel, lm_head="bf16")
    assert greedy(medusa) == greedy(medusa, Tree.chain(0))
    made = medusa.heads.__dict__["_products"]
    assert made["input0"][2] is not None and medusa.engine.smooth_step_cost
    assert heads_key(medusa.heads).endswith(":products=q8_0" + (":int8" if kernel == "native-q8" else "") + ":level")
    medusa.use_engine("int4", lm_head="bf16")  # torch's kernels: the packed projection, no Q8_0, measured sizes
    assert medusa.heads.drafter_products_key is None and "_products" not in medusa.heads.__dict__
    assert not medusa.engine.smooth_step_cost and ":products" not in heads_key(medusa.heads)


@pytest.mark.parametrize("kernel", ["native", "native-q8"])
def test_a_hydra_level_in_one_c_call_ranks_as_the_two_products_and_top_k_do(kernel):
    """The fused level (input layer, SiLU, the ResBlocks, projection, softmax, top-k in one call) gives the
    candidates and probabilities of the unfused path up to float summation order; heads whose drafting cannot fuse
    (no engine products) say so with ``None``, and Medusa stays plain's with either."""
    from medusa.drafters.base import TopK

    model = tiny_model("llama")
    heads = random_heads(model, head_type="hydra")
    medusa = MedusaModel(model, heads, engine="int4", kernel=kernel, lm_head="bf16")
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for k in range(heads.config.num_heads):
            hidden = torch.randn(3, heads.config.hidden_size, generator=gen)
            paths = torch.randint(0, heads.config.vocab_size, (3, k + 1), generator=gen)
            logits = heads.draft_logits(k, hidden, paths)
            ids, _, probs = TopK().draw_ranked(logits, 4)
            fused_logits, fused_ids, fused_probs = heads.draft_ranked(k, hidden, paths, 4)
            assert torch.allclose(fused_logits, logits, atol=1e-5) and torch.equal(fused_ids, ids)
            assert torch.allclose(fused_probs, probs, atol=1e-6)
        with pytest.raises(ValueError, match="shapes do not fit"):
            medusa.heads.__dict__["_products"]["input0"][2].__self__.hydra_level(
                heads.inputs[0].bias, medusa.heads.__dict__["_products"]["projection"][2].__self__,
                heads.embed_weight, 1e-6, hidden, torch.zeros(3, 2, dtype=torch.long), 4)  # head 0 reads 1 token
        with pytest.raises(ValueError, match="not an id of the"):
            heads.draft_ranked(0, hidden, torch.full((3, 1), heads.config.vocab_size), 4)
        assert heads.draft_ranked(0, hidden[0], torch.zeros(0, 1, dtype=torch.long), 4)[1].shape == (0, 4)
        # the fused level is resolved once per head: a changed weight (or bias) is read again, not the stale copy
        paths = paths[:, :1]
        before = heads.draft_ranked(0, hidden, paths, 4)[0]
        heads.inputs[0].bias.add_(1.0)
        moved = heads.draft_ranked(0, hidden, paths, 4)[0]
        heads.shared_weight_t.mul_(2.0)
        scaled = heads.draft_ranked(0, hidden, paths, 4)[0]
        unfused = heads.draft_logits(0, hidden, paths)
        assert not torch.allclose(moved, before, atol=1e-3) and not torch.allclose(scaled, moved, atol=1e-3)
        assert torch.allclose(scaled, unfused, atol=1e-4)
        # ... and another engine's products (or none) are never served from the previous engine's fused level
        products = heads.drafter_products
        heads.drafter_products = None
        assert heads.draft_ranked(0, hidden, paths, 4) is None
        heads.drafter_products = lambda weight, role: None  # an engine that offers no product
        assert heads.draft_ranked(0, hidden, paths, 4) is None
        heads.drafter_products = products
        assert torch.equal(heads.draft_ranked(0, hidden, paths, 4)[0], scaled)
    from medusa.drafters.heads import MedusaHeadsConfig, build_heads

    weight = model.get_output_embeddings().weight.detach()
    deeper = build_heads(MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=3,
                                           head_type="hydra", num_layers=3), weight,
                         model.get_input_embeddings().weight.detach())
    with torch.no_grad():  # Hydra++'s deeper MLP, trained: ResBlocks that are not the identity
        for param in deeper.parameters():
            if param.requires_grad:
                param.normal_(0.0, 0.05, generator=gen)
    medusa_deeper = MedusaModel(model, deeper, engine="int4", kernel=kernel, lm_head="bf16")
    with torch.inference_mode():
        for k in range(deeper.config.num_heads):
            hidden = torch.randn(3, deeper.config.hidden_size, generator=gen)
            paths = torch.randint(0, deeper.config.vocab_size, (3, k + 1), generator=gen)
            logits = deeper.draft_logits(k, hidden, paths)  # each ResBlock through its own Q8_0 product
            ids, _, probs = TopK().draw_ranked(logits, 4)
            fused_logits, fused_ids, fused_probs = deeper.draft_ranked(k, hidden, paths, 4)
            assert torch.allclose(fused_logits, logits, atol=1e-5) and torch.equal(fused_ids, ids)
            assert torch.allclose(fused_probs, probs, atol=1e-6)
        assert len(deeper.__dict__["_fused_levels"][0][2][3]) == 2  # both ResBlocks went into the C call
        with torch.enable_grad():  # training runs the ResBlock modules: the same features up to Q8_0 rounding
            exact = deeper.project(0, deeper.features(0, hidden[:1], paths[:1, :1]))
        assert torch.allclose(exact, deeper.draft_logits(0, hidden[:1], paths[:1, :1]), atol=0.05)
    from medusa.profile import heads_key

    assert heads_key(deeper).endswith(":level+blocks") and heads_key(heads).endswith(":level")
    # decoding through the per-step tree calls the fused level, ResBlocks and all, and stays plain decoding's tokens
    from test_per_step import COST, HEAD_CALL, flat_calibration

    from medusa.drafters.per_step import PerStepDrafter, StepCost

    calls = []
    level = type(deeper.__dict__["_fused_levels"][0][2][0].__self__).hydra_level

    def spy(self, *args, **kwargs):
        calls.append(len(args[7]))
        return level(self, *args, **kwargs)

    medusa_deeper.drafter = PerStepDrafter(deeper, flat_calibration(deeper, 0.9), StepCost(COST, [HEAD_CALL] * 3),
                                           max_nodes=16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(deeper.__dict__["_fused_levels"][0][2][0].__self__), "hydra_level", spy)
        deeper.__dict__.pop("_fused_levels")  # resolved again: through the spy
        assert greedy(medusa_deeper) == greedy(medusa_deeper, Tree.chain(0)) == greedy(medusa)
    assert calls and set(calls) == {2}


def test_what_the_native_decoder_refuses_names_what_works(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt2'.*use kernel 'torch'"):
        engines.make_engine("int4", tiny_model("gpt2"), kernel="native")
    with pytest.raises(ValueError, match="a sliding attention window; use kernel 'torch'"):
        engines.make_engine("int4", tiny_model("mistral"), kernel="native-q8")
    with pytest.raises(ValueError, match="the int8 engine runs kernel 'torch'"):
        engines.make_engine("int8", tiny_model("llama"), kernel="native")
    with pytest.raises(ValueError, match="kernel must be one of"):
        engines.make_engine("int4", tiny_model("llama"), kernel="fast")
    # no compiler: a clear error, nothing half-built in the cache folder
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_LIBRARY", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert "no C compiler" in native.native_unavailable()
    with pytest.raises(ValueError, match="no C compiler"):
        engines.make_engine("int4", tiny_model("llama"), kernel="native")
    assert not list(tmp_path.rglob("*.so"))


def test_the_flags_through_the_builder_and_the_cli(base_dir, capsys):
    """``--int4-kernel`` through build_model decodes what the engine does; bad combinations are refused by name (CLI
    exit 2)."""
    from medusa.build import DecodeConfig, build_model
    from medusa.cli import main

    plain = build_model(DecodeConfig(base=str(base_dir), drafter="none", quantize="int4", int4_kernel="native-q8"))
    assert plain.engine.settings()["forward"] == "native-q8"
    lookup = build_model(DecodeConfig(base=str(base_dir), drafter="lookup", lookup=4, quantize="int4",
                                      int4_kernel="native-q8"))
    ids = torch.tensor([5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9])
    assert lookup.generate(ids, max_new_tokens=24)[0] == plain.generate(ids, max_new_tokens=24)[0]
    with pytest.raises(ValueError, match="--int4-kernel native runs the int4 engine"):
        DecodeConfig(base=str(base_dir), int4_kernel="native")
    argv = ["generate", "--base", str(base_dir), "--drafter", "none", "--prompt", "hi", "--quantize", "int4",
            "--quantized-lm-head", "gguf"]
    assert main(argv) == 2
    assert "give gguf= and kernel 'native' or 'native-q8'" in capsys.readouterr().err


def test_the_lm_head_from_the_ggufs_q8_0_blocks_is_the_prepared_lm_head(tmp_path):
    """A base prepared from a GGUF whose (tied) lm_head is Q8_0: the engine reads those blocks into the C product,
    its logits are the fp32 lm_head's up to summation order, Medusa equals plain through it; a GGUF whose lm_head is
    another type, or that is not this base's, is refused by name."""
    from gguf import GGMLQuantizationType, quants
    from test_quantized import _q4_1_model_and_gguf

    from medusa.io.gguf_pack import gguf_q8_0_head

    model, path = _q4_1_model_and_gguf(tmp_path)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():  # what prepare-model loads: the Q8_0 blocks dequantized
        blocks = quants.quantize(embed.detach().numpy(), GGMLQuantizationType.Q8_0)
        embed.copy_(torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)))
    medusa = MedusaModel(model, random_heads(model), engine="int4", gguf=path, kernel="native", lm_head="gguf")
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(medusa.engine.lm_logits_rows(hidden), hidden @ model.lm_head.weight.T, atol=1e-4)
    assert greedy(medusa) == greedy(medusa, Tree.chain(0))
    with torch.no_grad():
        embed.mul_(1.5)
    with pytest.raises(ValueError, match="does not reproduce the lm_head"):
        engines.make_engine("int4", model, gguf=path, kernel="native", lm_head="gguf")
    (tmp_path / "q4").mkdir()
    model, path = _q4_1_model_and_gguf(tmp_path / "q4", lm_head_type="Q4_1")
    with pytest.raises(ValueError, match="token_embd.weight is Q4_1, not Q8_0"):
        gguf_q8_0_head(path, model)


def test_releasing_the_dense_weights_frees_the_torch_packs_too_and_keeps_the_tokens():
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model), engine="int4", kernel="native-q8")
    before = greedy(medusa)
    packs = medusa.engine.quantized.nbytes()
    assert medusa.engine.release_dense() > packs > 0
    assert medusa.engine.quantized.nbytes() == 0
    assert greedy(medusa) == before == greedy(medusa, Tree.chain(0))


@pytest.mark.parametrize("isa", [("-march=x86-64",), ("-mavx2", "-mno-fma"), ("-march=haswell",),
                                 ("-march=skylake-avx512",), ("-march=icelake-server",)])
def test_the_c_decoder_compiles_without_warnings_for_every_instruction_set_it_has_a_path_for(isa):
    """The library is built with -march=native on the user's CPU, so each #if branch (scalar, AVX2 without and with
    FMA, AVX-512 without and with VNNI) must build there: compile the source for each, as the loader does."""
    import platform
    import subprocess

    compiler = native._compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler for x86-64")
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    done = subprocess.run([compiler, *flags, *isa, "-Wall", "-Wextra", "-fsyntax-only", str(native.SOURCE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr[-2000:]
