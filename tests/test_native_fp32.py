"""The engine ``native`` (medusa/engines/native_fp32.py; the C decoder of csrc/q4_decoder.c on fp32 weights): its
product, its forward against transformers' fp32 forward, row invariance (a tree or a batch row has the bits of the
row alone), Medusa = plain through it, sampling's law through it (chi-square, with the control of
tests/test_decode_step.py), a weight changed in place, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_step import PROMPT, TREE, V
from test_decoding import random_heads
from test_native import assert_forward_is
from test_sampling import chi_square_p
from tiny import tiny_model

from medusa import engines
from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import RunningBatch
from medusa.decode.tree import Tree
from medusa.drafters.composite import tree_drafter
from medusa.engines import native
from medusa.engines.native_fp32 import NativeEngine, native_fp32_unavailable
from medusa.model import MedusaModel


@pytest.fixture(autouse=True)
def _native_library_here():
    reason = native.native_unavailable()
    if reason is not None:
        pytest.skip(reason)


IDS = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))


def greedy(medusa, tree=None, n=24, ids=IDS):
    return medusa.generate(ids, n, tree=tree, stop_token_ids=set(), do_sample=False)[0]


@pytest.mark.parametrize("n, k", [(41, 70), (64, 96), (8, 16)])
def test_the_fp32_product_is_x_w_t_and_each_row_has_the_bits_of_its_row_alone(n, k):
    """Any output size and input size (a tail past the vector width, fewer channels than a tile); 1 to 11 rows, on
    both sides of the one-stream / four-channel tiling switch; one and two threads: every row has its bits alone."""
    gen = torch.Generator().manual_seed(n + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(11, k, generator=gen)
    dense = native.NativeDense(weight)
    assert dense.codes.data_ptr() == weight.data_ptr()  # read in place, not copied
    exact = (x.double() @ weight.double().T).float()
    together = dense.product(x)
    assert torch.allclose(together, exact, atol=1e-5, rtol=1e-5)
    for m in (1, 2, 4, 5, 9):
        part = dense.product(x[:m])
        assert torch.equal(part, together[:m])
        for i in range(m):
            assert torch.equal(dense.product(x[i:i + 1], threads=1), together[i:i + 1])
    assert dense.product(x[:0]).shape == (0, n)


@pytest.mark.parametrize("kv_heads, head_dim", [(2, 16), (1, 64), (4, 24)])
def test_the_forward_is_transformers_fp32_forward_up_to_rounding(kv_heads, head_dim):
    """The prompt (with the layers a feature drafter reads) and a branching tree step: hidden states and logits
    match transformers' forward of the same fp32 model, each tree row on its own branch."""
    model = tiny_model("llama", num_key_value_heads=kv_heads, head_dim=head_dim)
    engine = engines.make_engine("native", model)
    assert engine.settings()["forward"] == "native fp32" and engine.head_row_invariant
    assert_forward_is(engine, model)


def test_a_tree_rows_logits_have_the_bits_of_the_same_token_decoded_alone():
    """Logits included: the C lm_head scores a row alike among four rows or alone (nothing to settle)."""
    model = tiny_model("llama", head_dim=64)
    engine = engines.make_engine("native", model)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree, alone = engine.new_cache(64), engine.new_cache(64)
    causal = torch.ones(14, 14).tril().bool()
    for c in (tree, alone):
        engine.forward(IDS[:14], torch.arange(14), causal, c)
    logits, _ = engine.forward(torch.tensor([5, 6, 7, 8]), torch.tensor([14, 15, 15, 16]), mask, tree)
    one = torch.ones(1, 1, dtype=torch.bool)
    steps = [engine.forward(torch.tensor([t]), torch.tensor([q]), one, alone)[0] for t, q in ((5, 14), (7, 15),
                                                                                                 (8, 16))]
    assert torch.equal(logits[0], steps[0][0]) and torch.equal(logits[2], steps[1][0])
    assert torch.equal(logits[3], steps[2][0])
    assert not torch.equal(logits[1], steps[1][0])  # another branch: the control


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_medusa_through_the_native_engine_equals_plain_greedy_and_hf(head_type):
    """Greedy Medusa (a tree of eight nodes) through ``native`` gives plain greedy decoding's tokens through it,
    which are transformers' greedy tokens on this model; batched rows of different lengths give each prompt its
    tokens alone. The heads draft through the engine's C products."""
    model = tiny_model("llama")
    heads = random_heads(model, head_type=head_type)
    medusa = MedusaModel(model, heads, Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]),
                         engine="native")
    plain = greedy(medusa, Tree.chain(0))
    assert greedy(medusa) == plain
    with torch.no_grad():
        hf = model.generate(IDS[None], max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, 20:].tolist()
    assert plain == hf
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen) for n in (7, 19, 3)]
    alone = [greedy(medusa, n=16, ids=p) for p in prompts]
    assert medusa.generate_batch(prompts, 16, stop_token_ids=set(), do_sample=False)[0] == alone


def _sampled_rows(model, drafter, rows: int, per_batch: int) -> torch.Tensor:
    """``(rows, 3)``: the first three tokens of ``rows`` rows of ``PROMPT`` sampled through ``native``,
    ``per_batch`` rows sharing each verify forward, row i seeded with i."""
    out = []
    decoding = resolve_decoding(do_sample=True, top_k=0, temperature=1.0)
    engine = engines.make_engine("native", model)
    for first in range(0, rows, per_batch):
        batch = RunningBatch(model, drafter, engine)
        tokens = {i: batch.join(i, PROMPT, 3, set(), None, dataclasses.replace(decoding, seed=i)).tokens
                  for i in range(first, min(first + per_batch, rows))}
        while batch.rows:
            for key, step in batch.step():
                tokens[key] += step.tokens
        out += [tokens[i][:3] for i in sorted(tokens)]
    return torch.tensor(out)


def test_speculative_sampling_through_the_native_engine_is_the_base_law():
    """Rows sampled in shared verify forwards through ``native``: their first three tokens follow the enumerated
    base joint (the control of tests/test_decode_step.py, accepting every draft, fails this test there)."""
    model = tiny_model("llama", vocab_size=V)
    y1, y2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([PROMPT.expand(V * V, -1), y1.reshape(-1, 1), y2.reshape(-1, 1)], dim=1)
    with torch.no_grad():
        logits = model(ids).logits
    tables = (logits[0, -3], logits[::V, -2].reshape(V, V), logits[:, -1].reshape(V, V, V))
    assert chi_square_p(_sampled_rows(model, tree_drafter(random_heads(model), TREE), 1500, 500), tables) > 0.01


def test_a_weight_changed_in_place_is_read_again():
    model = tiny_model("llama")
    engine = engines.make_engine("native", model)
    one = torch.ones(20, 20).tril().bool()
    before = engine.forward(IDS, torch.arange(20), one, engine.new_cache(32))[0]
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # fused with gate_proj: a copy the engine made
        model.model.layers[1].self_attn.o_proj.weight.mul_(0.5)  # read in place
        expected = model(IDS[None]).logits[0]
    after = engine.forward(IDS, torch.arange(20), one, engine.new_cache(32))[0]
    assert not torch.allclose(before, after, atol=1e-2) and torch.allclose(after, expected, atol=1e-3)
    model.model.layers[0].mlp.gate_proj.weight.data.mul_(2.0)  # .data keeps the version counter
    engine.refresh(force=True)
    with torch.no_grad():
        expected = model(IDS[None]).logits[0]
    assert torch.allclose(engine.forward(IDS, torch.arange(20), one, engine.new_cache(32))[0], expected, atol=1e-3)


def test_what_the_native_engine_refuses_names_what_works():
    assert NativeEngine.candidate_for("cpu", torch.float32)
    assert not NativeEngine.candidate_for("cpu", torch.bfloat16) and not NativeEngine.candidate_for("cuda",
                                                                                                   torch.float32)
    for model, why in ((tiny_model("gpt2"), "model_type 'gpt2'"), (tiny_model("qwen2"), "model_type 'qwen2'"),
                       (tiny_model("llama").to(torch.bfloat16), "torch.bfloat16")):
        assert why in native_fp32_unavailable(model)
        with pytest.raises(ValueError, match=f"native engine cannot run this model here: .*{why}.*--engine onednn"):
            engines.make_engine("native", model)

    class Doubled(torch.nn.Linear):  # a wrapper's own forward (an unmerged adapter computes otherwise too)
        def forward(self, x):
            return super().forward(x) * 2

    model = tiny_model("llama")
    old = model.model.layers[1].mlp.down_proj
    model.model.layers[1].mlp.down_proj = Doubled(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError,
                       match=r"layers.1.mlp.down_proj is a test_native_fp32\..*Doubled, not a plain nn.Linear"):
        engines.make_engine("native", model)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_oracle_heads_accept_through_non_first_branches_and_the_tokens_stay_hfs(arch):
    """Paths through non-first branches (a compaction of non-contiguous slots) with heads that know the answer."""
    from test_engine import WIDE_TREE, OracleHeads, hf_greedy, ids_of, medusa_generate

    model = tiny_model(arch)
    reason = native_fp32_unavailable(model)
    if reason is not None:  # the tiny mistral may use a sliding window, which the C forward does not run
        with pytest.raises(ValueError, match="native engine cannot run"):
            engines.make_engine("native", model)
        return
    ids = ids_of(20)
    reference = hf_greedy(model, ids, 40)
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, None], vocab=model.config.vocab_size)
    out, stats = medusa_generate(model, heads, ids, WIDE_TREE, 40, engine=engines.make_engine("native", model))
    assert out == reference and stats.tau > 2.5


def test_a_replaced_or_recast_parameter_is_read_again_and_hooks_run_as_static():
    """What the version counter alone misses (a review's findings): a Parameter replaced by one of the same version,
    a model cast to bf16 and back (``.to`` swaps the storage, keeps the version), a model made under
    ``inference_mode`` (no version counter); and what the C forward cannot run: a forward hook added later runs, the
    engine running as ``static`` with a warning that names it."""
    model = tiny_model("llama")
    engine = engines.make_engine("native", model)
    one = torch.ones(20, 20).tril().bool()

    def logits():
        return engine.forward(IDS, torch.arange(20), one, engine.new_cache(32))[0]

    def hf():
        with torch.no_grad():
            return model(IDS[None]).logits[0]

    proj = model.model.layers[0].self_attn.q_proj
    fresh = torch.nn.Parameter(proj.weight.detach() * 1.7)
    with torch.no_grad():
        while fresh._version < proj.weight._version:
            fresh.mul_(1.0)
    assert fresh._version == proj.weight._version  # a version check alone would miss it
    proj.weight = fresh
    assert torch.allclose(logits(), hf(), atol=1e-3)
    before = logits()
    model.to(torch.bfloat16).to(torch.float32)  # rounded to bf16: other weights, the same versions
    assert not torch.allclose(before, hf(), atol=1e-3) and torch.allclose(logits(), hf(), atol=1e-3)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    with pytest.warns(RuntimeWarning, match="runs as 'static': layers.1.mlp has forward hooks"):
        assert torch.allclose(logits(), hf(), atol=1e-3)
    handle.remove()
    assert torch.allclose(logits(), hf(), atol=1e-3) and engine._current()  # the C decoder again
    # what else the check before each forward reads: a pre-hook, a replaced forward (each run as static), a replaced
    # module and a replaced lm_head (each read again)
    attn = model.model.layers[0].self_attn
    handle = attn.register_forward_pre_hook(lambda module, args, kwargs: (args, kwargs), with_kwargs=True)
    with pytest.warns(RuntimeWarning, match="layers.0.self_attn has forward hooks"):
        assert not engine._current() and torch.allclose(logits(), hf(), atol=1e-3)
    handle.remove()
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x, _forward=mlp.forward: _forward(x) * 0.5
    with pytest.warns(RuntimeWarning, match="layers.0.mlp has forward hooks or a replaced forward"):
        assert torch.allclose(logits(), hf(), atol=1e-3)
    del mlp.forward
    down = mlp.down_proj
    mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    assert not engine._current() and torch.allclose(logits(), hf(), atol=1e-3) and engine._current()
    head = torch.nn.Linear(64, model.config.vocab_size, bias=False)
    model.set_output_embeddings(head)
    assert not engine._current() and torch.allclose(logits(), hf(), atol=1e-3) and engine._current()
    # a parameter whose data became an inference tensor on its own storage, then written under inference_mode:
    # that write bumps no version, so such a parameter is never current
    weight = proj.weight
    with torch.inference_mode():
        alias = torch.empty(0).set_(weight.untyped_storage(), weight.storage_offset(), weight.shape, weight.stride())
    proj.weight.data = alias
    assert proj.weight.data_ptr() == weight.data_ptr() and proj.weight.is_inference()
    with torch.inference_mode():
        proj.weight.mul_(3.0)
    assert not engine._current() and torch.allclose(logits(), hf(), atol=1e-3)
    with torch.inference_mode():
        made_here = tiny_model("llama")
        native = engines.make_engine("native", made_here)
        assert torch.equal(native.forward(IDS, torch.arange(20), one, native.new_cache(32))[0].argmax(-1),
                           made_here(IDS[None]).logits[0].argmax(-1))


def test_the_heads_draft_in_the_dtype_the_profile_measured_cheapest_and_the_tokens_stay_plains(monkeypatch, tmp_path):
    """The fp32 engine offers the drafter its C fp32 products and Q8_0 ones (a Hydra level fused into one call);
    each is timed under its own profile key, the cheapest is chosen, and greedy decoding gives plain's tokens with
    any of them (only the drafts change)."""
    from test_per_step import flat_calibration
    from test_profile import AMD_LIKE, fake_profile

    from medusa import profile as prof
    from medusa.engines.native import NativeDense
    from medusa.tools import measure

    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model, head_type="hydra"), engine="native")
    options = medusa.engine.drafter_dtypes
    assert options == ((None, "q8_0", "q8_0:int8") if native.isa().endswith("+vnni") else (None, "q8_0"))
    with pytest.raises(ValueError, match="drafts with one of"):
        medusa.engine.drafter_dtype = "bf16"
    plain = greedy(medusa, Tree.chain(0))
    heads, hidden = medusa.heads, torch.randn(3, 64)
    paths = torch.randint(0, 300, (3, 1))
    keys = set()
    for dtype in options:
        medusa.engine.drafter_dtype = dtype
        medusa._pack_drafter()
        keys.add(prof.heads_key(heads))
        product = heads.drafter_products(heads.inputs[0].weight, "input0")
        assert isinstance(product.__self__, NativeDense if dtype is None else native.NativeHead)
        assert dtype is None or product.__self__.int8_activations == (dtype == "q8_0:int8")
        odd = heads.drafter_products(torch.randn(8, 40), "input0")  # 40 inputs: no Q8_0 blocks, the fp32 product
        assert isinstance(odd.__self__, NativeDense)
        with torch.no_grad():  # drafting: no gradient
            fused = heads.draft_ranked(0, hidden, paths, 4)
            assert (fused is None) == (dtype is None)  # the fp32 products run the level as two calls
            exact = heads.draft_logits(0, hidden, paths)  # through the same products
            reference = hidden + torch.nn.functional.silu(heads.inputs[0](torch.cat(
                [hidden, heads.embed(paths, hidden.dtype).flatten(-2)], -1)))
            for block in heads.blocks[0]:
                reference = block(reference)
            reference = reference @ heads.shared_weight_t  # matmul on the fp32 weights
        scale = float(reference.abs().max())
        assert torch.allclose(exact, reference, atol=(1e-5 if dtype is None else 0.05) * scale)
        if fused is not None:
            assert torch.allclose(fused[0], exact, atol=1e-4 * scale)
        assert greedy(medusa) == plain
    assert len(keys) == len(options)  # each stored apart
    assert medusa.engine.settings()["drafter_dtype"] == options[-1]

    for cheapest in options:
        timed = []

        def fake_levels(heads, cheapest=cheapest, timed=timed):
            timed.append(heads.drafter_products_key)
            return [0.001, 0.001] if medusa.engine.drafter_dtype == cheapest else [0.004, 0.005]

        monkeypatch.setattr(measure, "time_heads_levels", fake_levels)
        fresh = fake_profile(prof.profile_key(model), 50.0, AMD_LIKE)
        medusa.use_per_step_tree(flat_calibration(heads, 0.8), profile=fresh, measure=True)
        assert len(timed) == len(options) and medusa.engine.drafter_dtype == cheapest
        assert medusa.drafter.cost.level_s == [0.001, 0.001]
        assert greedy(medusa) == plain


def test_heads_made_under_inference_mode_draft_through_the_native_engine():
    """Inference tensors keep no version counter: the heads' products are keyed without one (a review's finding:
    drafting raised "Inference tensors do not track version counter")."""
    model = tiny_model("llama")
    with torch.inference_mode():
        heads = random_heads(model, head_type="hydra")
    medusa = MedusaModel(model, heads, Tree.from_paths([(0,), (1,), (0, 0)]), engine="native")
    plain = greedy(medusa, Tree.chain(0))
    for dtype in medusa.engine.drafter_dtypes:
        medusa.engine.drafter_dtype = dtype
        medusa._pack_drafter()
        assert greedy(medusa) == plain
