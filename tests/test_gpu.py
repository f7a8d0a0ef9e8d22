"""On a CUDA device (skipped elsewhere): the decoding checks of the CPU suite, run where the GPU kernels, the CUDA
static cache and CUDA-graph compilation do the work. ``pytest -m gpu`` runs them on a GPU machine
(``scripts/gpu_check.sh`` runs them with the GPU benchmark). ``MEDUSA_GPU_TEST_DEVICE=cpu`` runs them on the CPU,
to check the tests themselves without a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from test_decoding import ARCHS, WIDE_TREE, hf_greedy, random_heads
from test_hydra import tiny_hydra_for, train_on_greedy
from tiny import tiny_model

from medusa import engines
from medusa.decode.batch import batch_generate
from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree
from medusa.tools.bench import divergence

DEVICE = os.environ.get("MEDUSA_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

TREES = [Tree.chain(0), Tree.chain(3), WIDE_TREE, WIDE_TREE.with_lookup(4)]


def ids_of(n: int, seed: int = 0, device=DEVICE) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def heads_for(model, ids):
    """Random Medusa heads, random Hydra heads, and Hydra heads trained (on the device) on the base's greedy text."""
    trained = tiny_hydra_for(model.cpu()).to(DEVICE)
    model.to(DEVICE)
    stats = train_on_greedy(model, trained, ids)
    assert (stats["top1"].float() / stats["count"]).min() > 0.5  # the heads learned the sequence
    return {"medusa": random_heads(model), "hydra": random_heads(model, head_type="hydra"),
            "hydra-trained": trained.eval()}


@pytest.mark.parametrize("name", ["eager", "static", "onednn"])  # onednn is static again on a GPU
@pytest.mark.parametrize("arch", ARCHS)
def test_engines_give_base_greedy_tokens_on_cuda(arch, name):
    model = tiny_model(arch).to(DEVICE)
    ids = ids_of(20)
    reference = hf_greedy(model, ids, 40)
    all_heads = heads_for(model, ids)
    engine = engines.make_engine(name, model)
    for kind, heads in all_heads.items():
        for tree in TREES:
            for verify_logits in ("all", "path"):
                with torch.no_grad():
                    out, stats = medusa_generate(model, heads, ids, tree, 40, verify_logits=verify_logits,
                                                 engine=engine)
                assert out == reference, (arch, name, kind, tree.name, verify_logits)
                if kind == "hydra-trained" and tree.num_nodes > 4:
                    assert stats.tau > 1.5, (arch, name, tree.name, stats.tau)  # paths of several tokens kept


@pytest.mark.skipif(engines.compile_unavailable(DEVICE) is not None, reason="torch.compile unavailable here")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # plain attention; sliding windows and soft-capping
def test_compiled_engine_gives_base_greedy_tokens_on_cuda(arch):
    model = tiny_model(arch).to(DEVICE)
    ids = ids_of(20)
    reference = hf_greedy(model, ids, 40)
    engine = engines.make_engine("compiled", model)
    compile_s = engine.warm_up([1, WIDE_TREE.num_nodes], needed=20 + 40 + WIDE_TREE.num_nodes)
    assert len(compile_s) == 2
    heads = random_heads(model)
    for tree in (Tree.chain(0), WIDE_TREE):
        with torch.no_grad():
            out, _ = medusa_generate(model, heads, ids, tree, 40, engine=engine)
        assert out == reference, (arch, tree.name)
    settings = engine.settings()
    assert settings["compiled"] is True and settings["fallback_reason"] is None, settings


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_on_cuda_leaves_the_base_only_at_ties(arch):
    model = tiny_model(arch).to(DEVICE, torch.bfloat16)
    heads = random_heads(model).to(torch.bfloat16)
    for seed in range(4):
        ids = ids_of(20, seed)
        reference = hf_greedy(model, ids, 40)
        with torch.no_grad():
            out, _ = medusa_generate(model, heads, ids, WIDE_TREE, 40, engine=engines.make_engine("static", model))
        if out != reference:
            assert divergence(model, ids, out, reference, seed)["tie"], (arch, seed)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decoding_on_cuda_equals_the_base_row_by_row(arch):
    model = tiny_model(arch).to(DEVICE)
    prompts = [ids_of(n, seed) for seed, n in enumerate((7, 20, 13))]
    references = [hf_greedy(model, p, 24) for p in prompts]
    for head_type in ("medusa", "hydra"):
        for verify_logits in ("all", "path"):
            with torch.no_grad():
                outs, _ = batch_generate(model, random_heads(model, head_type=head_type), prompts, WIDE_TREE, 24,
                                         verify_logits=verify_logits)
            assert outs == references, (arch, head_type, verify_logits)
    for name in ("static", "onednn"):  # batched decoding through an engine's batch operations
        with torch.no_grad():
            outs, _ = batch_generate(model, random_heads(model), prompts, WIDE_TREE, 24,
                                     engine=engines.make_engine(name, model))
        assert outs == references, (arch, name)


def test_coupled_sampling_on_cuda_gives_the_plain_samples_through_any_tree():
    """Seeded coupled sampling (the noise hashed on the CPU, the draws on the device): the same tokens with and
    without drafts, on every engine that runs on CUDA."""
    from medusa.model import MedusaModel

    model = tiny_model("llama").to(DEVICE)
    ids = ids_of(11)
    settings = {"do_sample": True, "temperature": 0.9, "top_k": 0, "seed": 3, "acceptance": "coupled"}
    medusa = MedusaModel(model, random_heads(model), Tree.chain(0), engine="eager")
    reference, _ = medusa.generate(ids, 24, stop_token_ids=set(), **settings)
    for name in ("eager", "static"):
        medusa.use_engine(name)
        for tree in TREES[1:]:
            medusa.tree = tree
            assert medusa.generate(ids, 24, stop_token_ids=set(), **settings)[0] == reference, (name, tree.name)


def test_the_static_engine_narrows_attention_kernels_only_inside_its_forward_on_cuda():
    def flags():
        b = torch.backends.cuda
        return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()

    model = tiny_model("llama").to(DEVICE)
    engine = engines.make_engine("static", model)
    before, inside = flags(), []
    original = engine._forward
    engine._forward = lambda *args: inside.append(flags()) or original(*args)
    ids = ids_of(20)
    with torch.no_grad():
        out, _ = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 16, engine=engine)
    assert out == hf_greedy(model, ids, 16)
    assert flags() == before and inside
    if torch.device(DEVICE).type == "cuda":  # not cuDNN's attention inside (see StaticEngine.sdpa_backends)
        assert all(not cudnn for cudnn, *_ in inside)
    else:  # nothing narrowed elsewhere
        assert all(f == before for f in inside)
