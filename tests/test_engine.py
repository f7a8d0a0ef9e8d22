"""Decode engines (eager, static, onednn, compiled) give the base's greedy tokens; the cache compacts exactly."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_decoding import WIDE_TREE, OracleHeads, hf_greedy, random_heads
from tiny import tiny_model

from medusa import engines
from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree, tree_buffers
from medusa.engines import kv_cache, static_cache

ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma3"]
# Node indices (root 0): (0)=1 (1)=2 (0,0)=3 (1,0)=4 (1,1)=5 (1,0,0)=6.
TREE = Tree.from_paths([[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0]])


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["eager", "static", "onednn"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engines_give_base_greedy_tokens(arch, name):
    model = tiny_model(arch)
    ids = ids_of(20)
    reference = hf_greedy(model, ids, 40)
    engine = engines.make_engine(name, model)
    for tree in (Tree.chain(0), Tree.chain(3), WIDE_TREE):
        for verify_logits in ("all", "path"):
            out, stats = medusa_generate(model, random_heads(model), ids, tree, 40, verify_logits=verify_logits,
                                         engine=engine)
            assert out == reference, (arch, name, tree.name, verify_logits)
    # Oracle heads accept several tokens through non-first branches: compaction of non-contiguous paths.
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, None], vocab=model.config.vocab_size)
    out, stats = medusa_generate(model, heads, ids, WIDE_TREE, 40, engine=engine)
    assert out == reference
    assert stats.tau > 2.5


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_static_compaction_equals_a_cache_rebuilt_from_the_accepted_tokens(arch):
    model = tiny_model(arch)
    engine = engines.make_engine("static", model)
    prefix_len = 12  # longer than the sliding window
    prefix, nodes = ids_of(prefix_len), ids_of(TREE.num_nodes, seed=1)
    buffers = tree_buffers(TREE)
    cache = engine.new_cache(prefix_len + TREE.num_nodes + 4)
    with torch.no_grad():
        engine.forward(prefix, torch.arange(prefix_len), kv_cache.causal_mask(prefix_len, "cpu"), cache)
        engine.forward(nodes, prefix_len + buffers.depth, buffers.ancestor_mask, cache)
    assert engine.cache_length(cache) == prefix_len + TREE.num_nodes
    keep = torch.tensor([0, 2, 4, 6])  # root, (1), (1,0), (1,0,0): not contiguous in the node order
    engine.keep_positions(cache, prefix_len, keep)

    accepted = torch.cat([prefix, nodes[keep]])
    reference = kv_cache.new_cache()
    with torch.no_grad():
        full = model(accepted[None], use_cache=True, **{kv_cache._cache_kwarg(type(model)): reference}).logits[0]
    assert engine.cache_length(cache) == len(accepted)
    for layer, ref in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.keys[:, :, : len(accepted)], ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values[:, :, : len(accepted)], ref.values, atol=1e-5, rtol=1e-5)
    # Decoding goes on from the compacted cache as from a fresh forward over the accepted tokens.
    nxt = ids_of(1, seed=2)
    with torch.no_grad():
        logits, _ = engine.forward(nxt, torch.tensor([len(accepted)]), kv_cache.causal_mask(1, "cpu"), cache)
        expected = model(torch.cat([accepted, nxt])[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-5, rtol=1e-5)
    assert full.shape[0] == len(accepted)


def test_static_cache_is_written_in_place_without_growing():
    model = tiny_model("llama")
    engine = engines.make_engine("static", model)
    ids = ids_of(10)
    cache = engine.new_cache(10 + 8 + TREE.num_nodes)
    buffers = tree_buffers(TREE)
    with torch.no_grad():
        engine.forward(ids, torch.arange(10), kv_cache.causal_mask(10, "cpu"), cache)
        storage = [layer.keys.data_ptr() for layer in cache.layers]
        for _ in range(3):
            start = engine.cache_length(cache)
            engine.forward(ids_of(TREE.num_nodes), start + buffers.depth, buffers.ancestor_mask, cache)
            engine.keep_positions(cache, start, torch.tensor([0, 1]))
    assert [layer.keys.data_ptr() for layer in cache.layers] == storage
    assert engine.cache_length(cache) == 16


def test_a_step_past_the_preallocated_cache_is_a_clear_error():
    model = tiny_model("llama")
    engine = engines.make_engine("static", model)
    cache = engine.new_cache(12)
    with torch.no_grad():
        engine.forward(ids_of(10), torch.arange(10), kv_cache.causal_mask(10, "cpu"), cache)
        with pytest.raises(static_cache.CacheFullError, match="holds 12 positions"):
            engine.forward(ids_of(4), 10 + torch.arange(4), kv_cache.causal_mask(4, "cpu"), cache)
    assert engine.cache_length(cache) == 10  # nothing was written past the buffers


def test_prompt_plus_budget_beyond_max_cache_len_is_a_clear_error():
    model = tiny_model("llama")
    engine = engines.make_engine("static", model, max_cache_len=32)
    heads = random_heads(model)
    with pytest.raises(ValueError, match="needs 44 cache positions .* at most 32"):
        medusa_generate(model, heads, ids_of(20), Tree.chain(3), 20, engine=engine)


def test_unknown_engine_and_bad_dtype_are_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError,
                       match="unknown engine 'turbo': choose one of auto, eager, static, onednn, compiled"):
        engines.make_engine("turbo", model)
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        engines.check_dtype(torch.int8, "cpu")
    engines.check_dtype(torch.bfloat16, "cpu")


def test_compiled_engine_falls_back_with_a_warning_naming_why(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(engines.compiled, "compile_unavailable", lambda device: "no C++ compiler (test)")
    with pytest.warns(RuntimeWarning, match=r"runs as 'static' \(uncompiled\): no C\+\+ compiler \(test\)"):
        engine = engines.make_engine("compiled", model)
    ids = ids_of(16)
    out, _ = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 24, engine=engine)
    assert out == hf_greedy(model, ids, 24)
    assert engine.settings()["compiled"] is False


def test_compiled_engine_falls_back_when_compiling_fails():
    model = tiny_model("llama")
    engine = engines.make_engine("compiled", model)

    def broken(**kwargs):
        raise RuntimeError("inductor exploded\nlong traceback")

    engine.decoder = broken
    ids = ids_of(16)
    with pytest.warns(RuntimeWarning, match="RuntimeError: inductor exploded$"):
        out, _ = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 24, engine=engine)
    assert out == hf_greedy(model, ids, 24)


# Compiling a tiny model's two step sizes takes 1-6 minutes on 2 cores (C++ builds), so these are marked slow.
@pytest.mark.slow
@pytest.mark.skipif(engines.compile_unavailable("cpu") is not None, reason="torch.compile unavailable here")
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_engine_gives_base_greedy_tokens(arch):
    model = tiny_model(arch)
    engine = engines.make_engine("compiled", model)
    ids = ids_of(20)
    reference = hf_greedy(model, ids, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would hide the compiled path
        compile_s = engine.warm_up([1, WIDE_TREE.num_nodes], needed=20 + 40 + WIDE_TREE.num_nodes)
    assert set(compile_s) == {"1@256", f"{WIDE_TREE.num_nodes}@256"}
    for tree in (Tree.chain(0), WIDE_TREE):
        out, _ = medusa_generate(model, random_heads(model), ids, tree, 40, engine=engine)
        assert out == reference, (arch, tree.name)
    assert engine.settings()["compiled"] is True


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    from tiny import save_cli_files

    root = tmp_path_factory.mktemp("engine-cli")
    base, prompts = save_cli_files(root, [{"prompt": p} for p in ["hello world", "how are you today?"]])
    return root, base, prompts


@pytest.mark.parametrize("name", ["eager", "static", "onednn"])
def test_bench_reports_plain_baseline_step_parts_and_engine(cli_setup, tmp_path, name):
    import json

    from medusa.cli import main

    root, base, prompts = cli_setup
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--max-new-tokens", "16", "--engine", name, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] == 1.0 and result["plain_identical"] == 1.0
    assert result["speedup_vs_plain"] > 0 and result["plain_step_ms"] > 0 and result["step_cost_vs_plain"] > 0
    assert set(result["step_ms"]) == {"draft", "choose", "verify_forward", "accept", "cache", "total"}
    assert sum(result["step_ms"][k] for k in ("draft", "verify_forward", "accept", "cache")) <= (
        result["step_ms"]["total"] * 1.01)
    assert result["engine"]["engine"] == name and result["dtype"] == "torch.float32"
    assert result["ties"] == 0 and result["true_divergences"] == 0
    assert all(r["plain_tokens_per_s"] > 0 for r in result["per_prompt"])


def test_cli_refuses_an_unknown_engine_and_a_dtype_the_device_cannot_run(cli_setup, capsys, monkeypatch):
    from medusa.cli import main

    root, base, prompts = cli_setup
    args = ["generate", "--base", str(base), "--heads", str(root / "heads"), "--prompt", "hi", "--max-new-tokens", "4"]
    assert main([*args, "--engine", "turbo"]) == 2
    assert "unknown engine 'turbo': choose one of auto, eager, static, onednn, compiled" in capsys.readouterr().err

    def no_kernels(*a, **k):
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(torch.nn.functional, "linear", no_kernels)
    assert main([*args, "--dtype", "float16"]) == 2
    assert "cpu cannot run torch.float16" in capsys.readouterr().err


def test_ties_are_counted_within_the_dtype_rounding():
    from medusa.tools.bench import tie_tolerance

    # bf16 keeps 8 significant bits: two units of 2**-7 relative at a logit of 20 are 0.31 (gaps of 0.016-0.19
    # were seen between tree and plain bf16 forwards); fp32's are 5e-6.
    assert 0.3 < tie_tolerance(torch.bfloat16, 20.0) < 0.32
    assert tie_tolerance(torch.float32, 20.0) < 1e-5
    assert tie_tolerance(torch.bfloat16, 0.01) == tie_tolerance(torch.bfloat16, 1.0)


def test_gpu_bench_script_runs_its_code_paths_on_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    out = tmp_path / "gpu.json"
    result = bench_gpu.main(["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--engines", "eager",
                             "static", "--sizes", "1", "4", "--trees", "4", "8", "--prefix", "16", "--new-tokens",
                             "8", "--repeats", "1", "--out", str(out)])
    assert out.is_file() and result["floor_ms"] > 0 and result["hf_generate_ms_per_token"] > 0
    assert set(result["step_ms"]) == {"eager", "static", "eager_min", "static_min"}
    assert set(result["step_ms"]["static"]) == {"1", "4"}
    assert set(result["medusa"]["static"]) == {"4", "8"}
    assert result["plain"]["eager"]["tau"] == 1.0


def test_attention_kernel_ab_script_runs_on_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "gpu_sdpa_ab.py"
    spec = importlib.util.spec_from_file_location("gpu_sdpa_ab", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main(["--device", "cpu", "--shape", "tiny", "--new-tokens", "6",
                          "--out", str(tmp_path / "ab.json")])
    assert result["settings"]["static-default-sdpa"]["cuda_sdpa_backends"] is None
    assert "CUDNN_ATTENTION" not in result["settings"]["static-no-cudnn"]["cuda_sdpa_backends"]
    assert {f"{e}/{t}/round{r}" for e in ("static-default-sdpa", "static-no-cudnn", "eager")
            for t in ("plain", "tree16", "tree64") for r in (0, 1)} <= set(result)
    assert result["eager/plain/round0"]["tau"] == 1.0


# -- the Engine interface: registry, declared capabilities, a new engine with no package file edited ----------------
def test_every_engine_declares_its_capabilities_and_warms_up():
    model = tiny_model("llama")
    for name, cls in engines.ENGINES.items():
        assert cls.name == name and cls.summary
        engine = engines.make_engine(name, model)
        assert isinstance(engine, engines.Engine)
        # on a CPU: only a packed lm_head or the native engine's C lm_head scores every node
        assert engine.scores_all_nodes is (name in ("onednn", "native"))
        assert engines.make_engine(name, model, scores_all_nodes=True).scores_all_nodes is True
        assert engine.supports_batch and engine.step_buckets is None
        assert engine.fixed_shapes is (name == "compiled" and engine.settings()["compiled"])
        if name != "compiled":  # compiling is the slow test above
            assert engine.warm_up([1, 4], 32) == {}
    assert engines.AUTO not in engines.ENGINES  # "auto" names a choice among the engines, not an engine


class ToyEngine(engines.Engine):
    """A whole new engine, defined outside the package: it keeps only the accepted token ids and recomputes their
    keys and values at every forward."""

    summary = "recomputes the whole sequence every forward (a test)"
    supports_batch = False  # its cache is its own (no batched operations on it): one row at a time

    def new_cache(self, capacity):
        return {"ids": []}

    def cache_length(self, cache):
        return len(cache["ids"])

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        prefix = torch.tensor(cache["ids"], dtype=torch.long)
        inner = kv_cache.new_cache()
        if len(prefix):
            kv_cache.forward(self.model, prefix, torch.arange(len(prefix)), kv_cache.causal_mask(len(prefix), "cpu"),
                             inner)
        cache["ids"] = cache["ids"] + input_ids.tolist()
        return kv_cache.forward(self.model, input_ids, positions, tree_mask, inner, logits_for)

    def keep_positions(self, cache, prefix_len, keep):
        cache["ids"] = cache["ids"][:prefix_len] + [cache["ids"][prefix_len + int(k)] for k in keep]


def test_a_registered_toy_engine_decodes_exactly(monkeypatch):
    monkeypatch.setitem(engines.ENGINES, "toy", ToyEngine)
    engines.register_engine("toy")(ToyEngine)  # registering the same class again is fine
    with pytest.raises(ValueError, match=r"'toy' is already registered to \S*test_engine\.ToyEngine; cannot "
                                         r"register \S*Other"):
        engines.register_engine("toy")(type("Other", (ToyEngine,), {}))
    model = tiny_model("llama")
    ids = ids_of(12)
    reference = hf_greedy(model, ids, 16)
    engine = engines.make_engine("toy", model)
    for scores_all in (True, False):
        engine = engines.make_engine("toy", model, scores_all_nodes=scores_all)
        out, _ = medusa_generate(model, random_heads(model), ids, WIDE_TREE, 16, engine=engine)
        assert out == reference
    from medusa.decode.batch import batch_generate

    outs, _ = batch_generate(model, random_heads(model), [ids_of(7, seed=3)], WIDE_TREE, 16, engine=engine)
    assert outs == [hf_greedy(model, ids_of(7, seed=3), 16)]  # one row: the engine's one-sequence forward
    with pytest.raises(ValueError, match="engine 'toy' does not run batched decoding"):
        batch_generate(model, random_heads(model), [ids, ids_of(7, seed=3)], WIDE_TREE, 16, engine=engine)
    with pytest.raises(ValueError, match="choose one of auto, eager, static, onednn, compiled, native, int4, int8, "
                                         "toy"):
        engines.make_engine("turbo", model)


# -- attention kernels on CUDA: narrowed around the engine's own forward only --------------------------------------
def _cuda_looking_engine(forward):
    from types import SimpleNamespace

    engine = engines.StaticEngine.__new__(engines.StaticEngine)
    engines.Engine.__init__(engine, SimpleNamespace(device=torch.device("cuda")))
    def logits_and_hidden(*args):  # what an engine's forward returns (no rows here)
        forward(*args)
        return torch.zeros(0, 1), torch.zeros(0, 1)

    engine._forward = logits_and_hidden
    return engine


def test_two_threads_decoding_leave_the_process_attention_flags_as_they_were():
    """torch keeps the kernel choice in process-wide flags and sdpa_kernel saves/restores them: if A enters, B enters
    (saving A's set), A leaves and B leaves restoring A's set, cuDNN attention stays off for the whole process."""
    import threading

    before = torch.backends.cuda.cudnn_sdp_enabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a_forward(*_):
        a_in.set()
        b_in.wait(10)

    def b_forward(*_):
        b_in.set()
        a_out.wait(10)

    a, b = _cuda_looking_engine(a_forward), _cuda_looking_engine(b_forward)
    ta = threading.Thread(target=a.forward, args=(None, None, None, None))
    ta.start()
    a_in.wait(10)
    tb = threading.Thread(target=b.forward, args=(None, None, None, None))
    tb.start()
    ta.join(10)
    a_out.set()
    tb.join(10)
    try:
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_engine_narrows_attention_kernels_only_inside_its_forward():
    seen = {}

    def forward(*_):
        seen["cudnn"] = torch.backends.cuda.cudnn_sdp_enabled()

    before = torch.backends.cuda.cudnn_sdp_enabled()
    _cuda_looking_engine(forward).forward(None, None, None, None)
    assert seen == {"cudnn": False} and torch.backends.cuda.cudnn_sdp_enabled() == before


def test_a_callers_own_kernel_choice_is_not_widened():
    """A caller that asked for the math kernel only (reproducibility) keeps flash and efficient off inside."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seen = {}

    def forward(*_):
        seen["flash"] = torch.backends.cuda.flash_sdp_enabled()
        seen["efficient"] = torch.backends.cuda.mem_efficient_sdp_enabled()

    with sdpa_kernel([SDPBackend.MATH]):
        _cuda_looking_engine(forward).forward(None, None, None, None)
    assert seen == {"flash": False, "efficient": False}


def test_a_compiled_engine_that_fell_back_avoids_cudnn_like_static():
    engine = engines.CompiledEngine.__new__(engines.CompiledEngine)
    engine.fallback_reason, engine.decoder = None, object()
    with pytest.warns(RuntimeWarning):
        engine._fall_back("test")
    assert engine.sdpa_backends == engines.StaticEngine.sdpa_backends and not engine.fixed_shapes
