"""Weight-only quantized engines (medusa.engines.quantized) and GGUF blocks as int4 codes (medusa.io.gguf_pack)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decoding import hf_greedy, random_heads
from tiny import tiny_model

from medusa import engines
from medusa.decode.tree import Tree
from medusa.engines import kv_cache, quantized
from medusa.model import MedusaModel

pytestmark = pytest.mark.skipif(quantized.quantize_unavailable("int4", "cpu") is not None,
                                reason="torch's int4 weight-only CPU kernel is unavailable here")

IDS = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(1))
ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma3"]


def greedy(medusa, tree=None, n=24):
    return medusa.generate(IDS, n, tree=tree, stop_token_ids=set(), do_sample=False)[0]


def test_the_kernel_computes_codes_minus_8_times_scale_plus_zero():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    # Powers of two and small multiples: exact in bfloat16, so the kernel's own rounding does not blur the check.
    scale = 2.0 ** -torch.randint(2, 6, (32, 2), generator=gen).float()
    zero = torch.randint(-8, 8, (32, 2), generator=gen).float() / 16
    layer = quantized.Int4Linear(codes, scale, zero)
    weight = layer(torch.eye(64)).t()  # (N, K): row k of the identity reads column k of the weight
    assert weight.dtype == torch.float32
    torch.testing.assert_close(weight, quantized.dequantize_int4(codes, scale, zero), rtol=0, atol=0)


def test_int4_and_int8_rounding_stays_within_half_a_step():
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    codes, scale, zero = quantized.quantize_int4(weight)
    step = scale.repeat_interleave(quantized.GROUP_SIZE, 1)
    assert int(codes.max()) <= 15 and ((quantized.dequantize_int4(codes, scale, zero) - weight).abs()
                                       <= step / 2 + 1e-6).all()
    codes8, scale8 = quantized.quantize_int8(weight)
    assert ((codes8.float() * scale8[:, None] - weight).abs() <= scale8[:, None] / 2 + 1e-6).all()


def _q4_1_model_and_gguf(tmp_path, lm_head_type="Q8_0"):
    """A tiny Llama whose linear weights are exactly the dequantized Q4_1 blocks of a GGUF written beside it (its
    query/key rows stored in GGUF's permuted order, as llama.cpp writes them): what ``prepare-model`` makes."""
    from gguf import GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants
    from gguf.constants import MODEL_ARCH

    model = tiny_model("llama")
    config = model.config
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    for name, module in model.model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        base = names.get_name(f"model.{name}")
        weight = module.weight.detach()
        heads = config.num_attention_heads if base.endswith("attn_q") else config.num_key_value_heads
        permuted = base.endswith(("attn_q", "attn_k"))
        if permuted:  # llama.cpp's order: the two rotary halves of each head interleaved
            weight = weight.reshape(heads, 2, -1, weight.shape[1]).transpose(1, 2).reshape(weight.shape)
        kind = GGMLQuantizationType.Q4_0 if base.endswith("ffn_down") else GGMLQuantizationType.Q4_1
        blocks = quants.quantize(weight.numpy(), kind)
        writer.add_tensor(f"{base}.weight", blocks, raw_dtype=kind)
        dequantized = torch.from_numpy(quants.dequantize(blocks, kind))
        with torch.no_grad():
            module.weight.copy_(quantized_rows(dequantized, heads) if permuted else dequantized)
    embed = model.get_input_embeddings().weight.detach().numpy()
    kind = getattr(GGMLQuantizationType, lm_head_type)
    writer.add_tensor("token_embd.weight", quants.quantize(embed, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tmp_path / "tiny.gguf"


def quantized_rows(weight, heads):
    from medusa.io.gguf_pack import unpermute_rows

    return unpermute_rows(weight, heads)


def test_q4_blocks_of_a_gguf_are_packed_value_for_value_and_a_q8_tensor_stays_dense(tmp_path):
    from medusa.io.gguf_pack import check_codes, gguf_codes

    model, path = _q4_1_model_and_gguf(tmp_path)
    read = gguf_codes(path, model)
    linears = {n: m for n, m in kv_cache.decoder_of(model).named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(read.codes) == set(linears) and read.max_abs_error == 0.0
    for name, codes in read.codes.items():
        assert check_codes(codes, linears[name].weight) == 0.0
    assert "token_embd.weight is Q8_0" in read.dense["lm_head"]
    # The codes are the file's, not a second rounding: min-max requantizing the Q4_0 (symmetric) weights moves them.
    down = linears["layers.0.mlp.down_proj"].weight
    assert check_codes(quantized.Int4Codes(*quantized.quantize_int4(down)), down) > 1e-3


def test_q4_k_blocks_map_onto_the_kernels_scale_and_zero():
    from gguf import GGMLQuantizationType, quants

    from medusa.io.gguf_pack import blocks_to_codes

    # gguf-py cannot quantize to Q4_K, so the blocks are random bytes (every bit pattern is a valid block).
    rng = np.random.default_rng(0)
    n_blocks = 16 * 2  # 16 rows of 512 weights: two 256-weight super-blocks per row
    scales = rng.uniform(1e-3, 1e-1, (n_blocks, 2)).astype(np.float16).view(np.uint8)  # d and dmin, fp16
    codes = rng.integers(0, 256, (n_blocks, 12 + 128), dtype=np.uint8)  # 6-bit sub-scales/mins, 4-bit codes
    blocks = np.concatenate([scales, codes], axis=1).reshape(16, 2 * 144)
    expected = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_K))
    codes = [torch.from_numpy(a) for a in blocks_to_codes("Q4_K", blocks, 512)]
    # Q4_K's "d sc q - dmin m" is summed in another order than "(q - 8) scale + zero": a rounding of the zero point
    # apart at most (Q4_0 and Q4_1 give exact equality: the test above).
    _, scale, zero = codes
    bound = 2 * torch.finfo(torch.float32).eps * (zero.abs() + 8 * scale).repeat_interleave(32, 1)
    error = (quantized.dequantize_int4(*codes) - expected).abs()
    assert (error <= bound).all() and (error == 0).float().mean() > 0.99


def test_an_engine_packed_from_the_gguf_decodes_medusa_equal_to_its_plain_greedy(tmp_path):
    model, path = _q4_1_model_and_gguf(tmp_path)
    reference = hf_greedy(model, IDS, 24)
    medusa = MedusaModel(model, random_heads(model), engine="int4", gguf=path)
    settings = medusa.engine.settings()
    assert settings["codes_from"] == ["codes"] and "Q8_0" in settings["gguf_unpackable"]["lm_head"]
    assert greedy(medusa) == greedy(medusa, Tree.chain(0))
    assert hf_greedy(model, IDS, 24) == reference  # the base itself runs as before
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
    medusa.engine.refresh()  # the changed layer's GGUF codes no longer hold: it is quantized from its weight
    assert medusa.engine.quantized.source["layers.0.mlp.up_proj"] == "weights"
    assert medusa.engine.quantized.source["layers.0.mlp.down_proj"] == "codes"


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_medusa_greedy_equals_quantized_plain_greedy(arch):
    model = tiny_model(arch)
    reference = hf_greedy(model, IDS, 24)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    for kind, lm_head in (("int4", False), ("int4", True), ("int8", False)):
        medusa = MedusaModel(model, random_heads(model), engine=kind, lm_head=lm_head)
        plain = greedy(medusa, Tree.chain(0))
        assert greedy(medusa) == plain
        assert medusa.engine.scores_all_nodes == lm_head
        assert medusa.engine.settings()["dense_layers"] == {}
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    assert hf_greedy(model, IDS, 24) == reference


def test_the_shadow_shares_the_bases_parameters_and_quantizes_every_linear():
    model = tiny_model("llama")
    linears = quantized.QuantizedLinears(kv_cache.decoder_of(model), model.get_output_embeddings(), "int4")
    base_parameters = {id(p) for p in model.parameters()}
    assert {id(p) for p in linears.decoder.parameters()} <= base_parameters
    shadow = [m for m in linears.decoder.modules() if isinstance(m, quantized.Int4Linear)]
    assert len(shadow) == sum(isinstance(m, torch.nn.Linear) for m in kv_cache.decoder_of(model).modules())
    assert not any(isinstance(m, quantized.Int4Linear) for m in model.modules())


def test_auto_never_chooses_a_quantized_engine():
    assert not {"int4", "int8"} & set(engines.auto_candidates(torch.device("cpu"), torch.float32))


def test_a_layer_the_kernel_cannot_take_stays_dense_and_is_named():
    model = tiny_model("llama", vocab_size=312)  # 312 rows: not a multiple of 16
    engine = engines.make_engine("int4", model, lm_head=True)
    assert "multiple of 16" in engine.settings()["dense_layers"]["lm_head"] and not engine.scores_all_nodes


def test_bad_input_is_refused_with_what_works(tmp_path):
    from medusa.io.gguf_pack import blocks_to_codes, gguf_codes

    assert "move the model to the CPU" in quantized.quantize_unavailable("int4", "cuda")
    with pytest.raises(ValueError, match="choose one of int4, int8"):
        quantized.quantize_unavailable("int3", "cpu")
    with pytest.raises(ValueError, match="Q8_0 is not a 4-bit code"):
        blocks_to_codes("Q8_0", np.zeros((16, 34), np.uint8), 32)
    model, path = _q4_1_model_and_gguf(tmp_path)
    with pytest.raises(ValueError, match="use the int4 engine"):
        engines.make_engine("int8", model, gguf=path)
    with pytest.raises(FileNotFoundError):
        gguf_codes(tmp_path / "missing.gguf", model)
    with pytest.raises(ValueError, match="not the GGUF this model was prepared from"):
        gguf_codes(path, tiny_model("llama", seed=3))  # same shapes, other weights
    with pytest.raises(ValueError, match="not the GGUF this model was prepared from"):
        gguf_codes(path, tiny_model("llama", intermediate_size=96))


def test_a_decoding_steps_attention_gives_each_row_the_bits_of_attending_alone():
    # torch's CPU attention gives a query row last-bit different results beside other rows or with more (masked)
    # keys; the int4 kernels' bfloat16 activations then round those apart, and a Medusa tree would drift from plain
    # decoding. In decoding steps the engine attends row by row on exactly the keys a row sees.
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, n, 64, generator=gen) for n in (8, 88, 88))  # 80 cached keys, 8 new rows
    mask = torch.full((1, 1, 8, 88), torch.finfo(torch.float32).min)
    for i in range(8):
        mask[..., i, :81 + i] = 0  # row i: the 80 cached keys, the new rows up to itself
    module = SimpleNamespace(config=SimpleNamespace(medusa_base_attention="sdpa"), num_key_value_groups=1,
                             is_causal=True)
    with quantized.row_invariant_steps():
        together = quantized.row_invariant_attention(module, q, k, v, mask, scaling=0.125)[0]  # (1, 8, H, D)
        for i in range(8):
            alone = quantized.row_invariant_attention(module, q[:, :, i:i + 1], k[:, :, :81 + i], v[:, :, :81 + i],
                                                      mask[..., i:i + 1, :81 + i], scaling=0.125)[0]
            assert torch.equal(together[:, i:i + 1], alone)
    with quantized.row_invariant_steps(False):  # outside decoding steps: the base's own attention
        base = quantized.row_invariant_attention(module, q, k, v, mask, scaling=0.125)[0]
    torch.testing.assert_close(base, together)


def test_quantize_through_the_model_builder_and_the_cli(base_dir, capsys):
    """``--quantize int4`` picks the int4 engine through build_model; prompt lookup through it equals plain greedy
    through it; bad combinations are refused by name (CLI exit 2)."""
    from medusa.build import DecodeConfig, build_model
    from medusa.cli import main

    ids = torch.tensor([5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9])  # repetitive: the lookup chain gets accepted
    lookup = build_model(DecodeConfig(base=str(base_dir), drafter="lookup", lookup=4, quantize="int4",
                                      quantized_lm_head="bf16"))
    plain = build_model(DecodeConfig(base=str(base_dir), drafter="none", quantize="int4"))
    assert lookup.engine.name == plain.engine.name == "int4" and lookup.engine.settings()["lm_head"] == "bf16"
    tokens, stats = lookup.generate(ids, max_new_tokens=24)
    assert tokens == plain.generate(ids, max_new_tokens=24)[0]
    assert stats.tau > 1
    for argv, message in ((["--quantize", "int4", "--engine", "static"], "--quantize int4 runs the int4 engine: "
                                                                          "drop --engine static"),
                          (["--quantize", "int8", "--gguf", str(base_dir / "config.json")],
                           "pass --quantize int4 (got --quantize int8)"),
                          (["--quantize", "int4", "--gguf", str(base_dir / "missing.gguf")], "no such file"),
                          (["--quantized-lm-head", "bf16"], "pass --quantize int4 or int8 too")):
        assert main(["generate", "--base", str(base_dir), "--drafter", "none", "--prompt", "hi", *argv]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_lean_forward_gives_the_stock_shadows_bits_and_holds_the_codes_once(kind):
    """The lean single-row forward (fused products, its own layer loop) against the stock decoder's shadow on the
    same codes: the prompt, a chain step (cache views) and a branching tree step (gathers), hidden states, logits,
    the fused base layers a feature drafter reads and the cache left behind, all bit for bit."""
    from medusa.engines import static_cache

    model = tiny_model("llama")
    lean = engines.make_engine(kind, model)
    stock = engines.make_engine(kind, model, lean=False)
    assert lean.settings()["forward"] == "lean" and stock.settings()["forward"] == "stock shadow (lean=False)"
    gate_up, gate = lean.lean.layers[0].gate_up, lean.quantized.decoder.layers[0].mlp.gate_proj
    codes = "packed" if kind == "int4" else "codes"  # gate's 128 rows fill whole int4 row blocks: a view
    assert getattr(gate, codes).data_ptr() == getattr(gate_up, codes).data_ptr()
    caches = [e.new_cache(64) for e in (lean, stock)]
    steps = [(IDS, torch.arange(20), torch.ones(20, 20, dtype=torch.bool).tril()),  # the prompt
             (IDS[:3], torch.arange(20, 23), torch.ones(3, 3, dtype=torch.bool).tril()),  # a chain
             (IDS[3:7], torch.tensor([23, 24, 24, 25]),  # a tree: 0 -> (1, 2), 2 -> 3
              torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))]
    layers = (0, model.config.num_hidden_layers - 1)
    for ids, positions, tree_mask in steps:
        a, b = (e.forward_features(ids, positions, tree_mask, c, layers)
                for e, c in zip((lean, stock), caches, strict=True))
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
        for e, c in zip((lean, stock), caches, strict=True):
            e.keep_positions(c, c.length - len(ids), torch.arange(len(ids) - 1))
    for x, y in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(x.keys[:, :, :caches[0].length], y.keys[:, :, :caches[1].length])
    assert isinstance(caches[0], static_cache.SlotCache)


def test_the_lean_forward_names_what_it_does_not_run():
    from medusa.engines.lean import lean_unsupported

    assert engines.make_engine("int4", tiny_model("gpt2")).settings()["forward"].startswith("stock shadow (model_type")
    assert "dense linear layers" in lean_unsupported(tiny_model("llama"), {"layers.0.mlp.up_proj": "kept dense"})


def test_int4_packing_concatenates_along_the_output_axis_after_whole_row_blocks():
    pack, block = torch.ops.aten._convert_weight_to_int4pack_for_cpu, quantized.INT4_ROW_BLOCK
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=gen) for n in (block, 32, 32))
    assert torch.equal(pack(torch.cat([a, b]), 2), torch.cat([pack(a, 2), pack(b, 2)]))
    assert not torch.equal(pack(torch.cat([b, c]), 2), torch.cat([pack(b, 2), pack(c, 2)]))  # a part block


def test_the_checked_bf16_lm_head_keeps_the_fp32_argmax_where_plain_bf16_rounding_loses_it():
    """Hidden states built so that bf16 rounding of the logits ties or flips the top two tokens: the checked head's
    argmax is the fp32 one's on every row, computed alone or beside other rows, and a broken bound (no candidates
    rescored) gets some rows wrong, so the check is what holds it."""
    from medusa.engines.checked_head import CheckedHead

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 64, generator=gen)
    weight[9] = weight[7] * (1 + 2e-4)  # token 9 just above token 7, the same in bf16
    hidden = torch.randn(64, 64, generator=gen) * 3
    hidden[:32] = hidden[:32] + 4 * weight[7]  # ... and on top in half the rows
    head = CheckedHead(weight)
    exact = (hidden @ weight.T).argmax(-1)
    together = head.logits(hidden)
    assert torch.equal(together.argmax(-1), exact)
    for i in range(0, 64, 7):
        assert torch.equal(head.logits(hidden[i:i + 1])[0, exact[i]], together[i, exact[i]])  # alone: same bits
    rounded = torch.nn.functional.linear(hidden.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
    assert not torch.equal(rounded.argmax(-1), exact)  # the control: bf16 alone loses some
    assert max(head.candidates) < 512  # only candidates are rescored
    with pytest.raises(ValueError, match="float32 hidden states"):
        head.logits(hidden.double())


@pytest.mark.parametrize("lm_head", ["bf16"])
def test_quantized_medusa_equals_plain_with_a_checked_lm_head_whose_argmax_is_the_fp32_ones(lm_head):
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model), engine="int4", lm_head=lm_head)
    fp32 = MedusaModel(model, random_heads(model), engine="int4")
    assert medusa.engine.settings()["lm_head"] == lm_head and medusa.engine.scores_all_nodes
    assert greedy(medusa) == greedy(medusa, Tree.chain(0)) == greedy(fp32, Tree.chain(0))
    hidden = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 4
    assert torch.equal(medusa.engine.lm_logits_rows(hidden).argmax(-1), (hidden @ model.lm_head.weight.T).argmax(-1))
    with pytest.raises(ValueError, match="lm_head must be one of"):
        engines.make_engine("int4", model, lm_head="fp16")


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_releasing_the_dense_weights_keeps_the_tokens_and_refuses_the_unquantized_base(kind):
    """``release_dense`` frees the fp32 weight of every layer the engine runs quantized: decoding through the engine
    is unchanged (Medusa still equals plain through it), the base itself then refuses to run by name, refresh
    refuses, and a second call frees nothing."""
    model = tiny_model("llama")
    medusa = MedusaModel(model, random_heads(model), engine=kind)
    plain, spec = greedy(medusa, Tree.chain(0)), greedy(medusa)
    linears = [m for m in kv_cache.decoder_of(model).modules() if isinstance(m, torch.nn.Linear)]
    dense_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert medusa.engine.release_dense() == dense_bytes > 0
    assert all(m.weight.numel() == 0 for m in linears)
    assert model.get_output_embeddings().weight.numel() > 0  # the heads and the lm_head still read it
    assert greedy(medusa, Tree.chain(0)) == plain and greedy(medusa) == spec
    assert medusa.engine.settings()["released_dense_bytes"] == dense_bytes
    assert medusa.engine.release_dense() == 0
    with pytest.raises(RuntimeError, match="dense weight was freed by the quantized engine"):
        hf_greedy(model, IDS, 4)
    with pytest.raises(RuntimeError, match="freed the base's dense weights"):
        medusa.engine.refresh()


def test_release_dense_through_the_builder_and_the_cli(base_dir, capsys):
    """generate frees the dense weights by default with --quantize (its tokens are unchanged), keeps them with
    --no-release-dense, and --release-dense without a quantized engine is refused by name."""
    from medusa.build import DecodeConfig, build_model
    from medusa.cli import main

    ids = torch.tensor([5, 9, 14, 5, 9, 14, 5, 9])
    kept = build_model(DecodeConfig(base=str(base_dir), drafter="none", quantize="int4"))
    freed = build_model(DecodeConfig(base=str(base_dir), drafter="none", quantize="int4", release_dense=True))
    assert kept.engine.released_bytes == 0 < freed.engine.released_bytes
    assert freed.generate(ids, max_new_tokens=12)[0] == kept.generate(ids, max_new_tokens=12)[0]
    argv = ["generate", "--base", str(base_dir), "--drafter", "none", "--prompt", "hi", "--max-new-tokens", "4"]
    assert main([*argv, "--quantize", "int4"]) == 0
    assert "--release-dense: freed" in capsys.readouterr().err
    assert main([*argv, "--quantize", "int4", "--no-release-dense"]) == 0
    assert "--release-dense" not in capsys.readouterr().err
    assert main([*argv, "--release-dense"]) == 2
    assert "pass --quantize int4 or int8 too" in capsys.readouterr().err


@pytest.mark.parametrize("kernel", ["torch", "native", "native-q8"])
def test_a_prompt_prefilled_in_chunks_and_path_scoring_go_through_the_quantized_lm_head(kernel):
    """A forward that scores no row (every prefill chunk before the last, as ``medusa serve`` runs a long prompt; the
    path-only verify) returns ``(0, V)`` logits through the engine's own lm_head, not an error; the chunked prompt
    gives the first token of the prompt prefilled at once, and path scoring the tokens of scoring every node."""
    from medusa.decode.loop import RunningBatch
    from medusa.drafters.composite import tree_drafter
    from medusa.engines import native

    if kernel != "torch" and native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())
    model = tiny_model("llama")
    engine = engines.make_engine("int4", model, kernel=kernel, lm_head="bf16")
    hidden = torch.randn(3, 0, model.config.hidden_size)[0]  # (0, H)
    assert engine.lm_logits_rows(hidden).shape == (0, model.config.vocab_size)
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(ValueError, match="at least one new token, got none"):
        engine.forward(none, none, torch.ones(0, 0, dtype=torch.bool), engine.new_cache(8))
    heads = random_heads(model)
    firsts = []
    for chunk in (20, 7):
        batch = RunningBatch(model, tree_drafter(heads, Tree.chain(0)), engine)
        joining = batch.begin("a", IDS, 8)
        steps = [batch.prefill(joining, chunk) for _ in range(-(-len(IDS) // chunk))]
        assert steps[:-1] == [None] * (len(steps) - 1)
        firsts.append(steps[-1].tokens)
    assert firsts[0] == firsts[1]
    medusa = MedusaModel(model, heads, engine="int4", kernel=kernel, lm_head="bf16")
    tree = Tree.from_paths([[0], [0, 0], [1]])
    every = medusa.generate(IDS, 16, tree=tree, stop_token_ids=set(), do_sample=False)[0]
    medusa.engine.scores_all_nodes = False
    assert medusa.generate(IDS, 16, tree=tree, stop_token_ids=set(), do_sample=False)[0] == every
