"""The machine profile: measured (medusa.tools.measure), stored and read back (medusa.profile), re-measured when its
key or its file is not this machine's, ``--engine auto`` / ``--dtype auto`` chosen from it, and nothing measured
unless asked."""

import json
import logging

import pytest
import torch
from conftest import SHIPPED_DEFAULT_ENGINE
from tiny import save_tiny, tiny_model

import medusa.profile as prof
import medusa.tools.measure as measure
from medusa.cli import main
from medusa.engines import AUTO, auto_candidates, make_engine

CANDIDATES = auto_candidates("cpu", torch.float32)  # eager, static, onednn where oneDNN runs, native where C builds


def fake_profile(key: dict, hf_ms: float, engines: dict[str, tuple[float, dict[int, float]]]) -> prof.MachineProfile:
    """A profile with ``engines[name] = (plain ms/token, {n: forward ms})``, the curve filled in at every measured
    size (as a stored profile must be)."""
    def filled(curve):
        return {n: prof.interpolate(curve, n) / 1e3 for n in prof.STEP_SIZES}

    return prof.MachineProfile(
        key=key, hf_generate_token_s=hf_ms / 1e3,
        engines={name: {"plain_token_s": plain / 1e3, "forward_s": filled(curve),
                        "scores_all_nodes": name == "onednn"} for name, (plain, curve) in engines.items()})


# Shapes of the two machines in docs/benchmark.md, 15-node tree: on the AMD EPYC oneDNN makes every step cheaper; on
# the Intel Xeon its plain decoding is 25% slower than HF generate (14.48 vs 19.41 tok/s) while static keeps up.
AMD_LIKE = {"onednn": (57.6, {1: 52.0, 16: 88.0}), "static": (62.5, {1: 58.0, 16: 112.0}),
            "eager": (66.0, {1: 61.0, 16: 118.0})}
INTEL_LIKE = {"onednn": (69.1, {1: 64.0, 16: 100.0}), "static": (49.2, {1: 45.0, 16: 108.0}),
              "eager": (53.0, {1: 49.0, 16: 112.0})}


@pytest.fixture
def without_native(monkeypatch):
    """The fake profiles here list eager, static and onednn: the native engine (a candidate where its C library
    builds) is left out of ``auto``'s candidates, so that loading one measures nothing else."""
    from medusa.engines import NativeEngine

    monkeypatch.setattr(NativeEngine, "candidate_for", classmethod(lambda cls, device, dtype: False))


def test_auto_picks_the_faster_engine_on_an_amd_like_and_an_intel_like_profile():
    amd = fake_profile({}, 65.2, AMD_LIKE).choose_engine(15)
    intel = fake_profile({}, 51.5, INTEL_LIKE).choose_engine(15)
    assert amd.engine == "onednn" and intel.engine == "static"
    assert "excluded: onednn 69.1 ms/token" in intel.reason and "HF generate 51.5 ms/token" in intel.reason
    # Plain decoding is its own step size: the cheapest one-token forward that keeps up.
    assert fake_profile({}, 51.5, INTEL_LIKE).choose_engine(1).engine == "static"
    # When no engine keeps up with HF generate, the fastest plain decoding, and the reason says so.
    slow = fake_profile({}, 30.0, INTEL_LIKE).choose_engine(15)
    assert slow.engine == "static" and "no engine's plain decoding keeps up" in slow.reason
    with pytest.raises(ValueError, match="no candidate engine ran"):
        prof.MachineProfile({}, {"onednn": {"error": "no oneDNN"}}, 0.05).choose_engine(1)


def test_interpolation_between_and_beyond_the_measured_sizes():
    curve = {1: 10.0, 4: 16.0, 8: 24.0}
    assert prof.interpolate(curve, 2) == pytest.approx(12.0)
    assert prof.interpolate(curve, 12) == pytest.approx(32.0)  # along the last two sizes
    p = fake_profile({}, 50.0, {"static": (50.0, curve)})
    assert p.forward_s("static", 3) == pytest.approx(0.014) and p.cost_curve("static")[8] == pytest.approx(2.4)


def test_a_profile_is_measured_written_and_read_back(tmp_path, monkeypatch):
    model = tiny_model("llama")
    profile = measure.load_profile(model, folder=tmp_path)
    assert profile.path.is_file() and profile.path.parent == tmp_path / "profiles"
    assert {"eager", "static"} <= set(profile.usable()) and profile.hf_generate_token_s > 0
    entry = profile.engines["static"]
    assert sorted(entry["forward_s"]) == list(prof.STEP_SIZES) and entry["plain_token_s"] > 0
    assert sorted(entry["batch_forward_s"]) == list(prof.BATCH_SIZES)
    assert profile.key == prof.profile_key(model) and profile.key["model"]["hidden_size"] == 64
    # a one-token forward split into its matrix products and the rest, for every engine (the overhead has a number)
    for name in ("eager", "static", "onednn"):
        split = profile.engines[name]["one_token_split_s"]
        assert split["products_s"] > 0 and split["outside_s"] >= 0
        # one forward's parts, not a sum over the timed rounds: a loose bound, as both are timed on a shared machine
        # (with another job on the 2 cores one split took 10.3 ms against a 1.0 ms forward)
        assert split["products_s"] + split["outside_s"] < 50 * profile.forward_s(name, 1)

    def must_not_measure(*args, **kwargs):
        raise AssertionError("a matching stored profile was measured again")

    monkeypatch.setattr(measure, "measure_profile", must_not_measure)
    again = measure.load_profile(model, folder=tmp_path)
    assert json.loads(json.dumps(again.to_dict())) == json.loads(profile.path.read_text())
    assert again.forward_s("static", 4) == profile.forward_s("static", 4)  # int sizes survive the JSON round trip
    assert again.engines["onednn"]["batch_forward_s"][4][16] > 0
    # A drafter's cost is measured once and stored with the profile.
    calls = []
    assert again.drafter_cost("toy") is None  # nothing stored, nothing asked: not measured
    assert again.drafter_cost("toy", lambda: calls.append(1) or [0.001, 0.002]) == [0.001, 0.002]
    assert again.drafter_cost("toy", lambda: calls.append(1) or [9.0]) == [0.001, 0.002] and calls == [1]
    assert json.loads(profile.path.read_text())["drafters"]["toy"]["per_depth_s"] == [0.001, 0.002]


@pytest.fixture
def fast_measure(monkeypatch):
    """``measure_profile`` replaced by a quick fake that records its calls (what it measures is tested above)."""
    calls = []

    def fake_measure(model, candidates=None, progress=None):
        calls.append(model)
        if progress is not None:  # as the real one announces each stage
            progress("profile: (a fake measurement)")
        return fake_profile(prof.profile_key(model), 50.0, AMD_LIKE)

    monkeypatch.setattr(measure, "measure_profile", fake_measure)
    return calls


@pytest.mark.parametrize("field, value, named", [
    ("cpu", "Intel(R) Xeon(R) Platinum 8488C", "cpu: 'Intel(R) Xeon(R) Platinum 8488C' -> "),
    ("torch", "2.9.1", "torch: '2.9.1' -> "),
    ("dtype", "bfloat16", "dtype: 'bfloat16' -> 'float32'"),
    ("model", {"architecture": "LlamaForCausalLM", "hidden_size": 4096}, "model.hidden_size: 4096 -> 64"),
])
def test_a_profile_whose_key_does_not_match_is_measured_again_naming_the_mismatch(tmp_path, fast_measure, caplog,
                                                                                   field, value, named):
    model = tiny_model("llama")
    key = prof.profile_key(model)
    path = prof.profile_path(key, tmp_path)
    fake_profile(key | {field: value}, 50.0, INTEL_LIKE).save(path)
    with caplog.at_level(logging.WARNING, logger="medusa.tools.measure"):
        profile = measure.load_profile(model, folder=tmp_path)
    assert len(fast_measure) == 1 and "measured for another setup" in caplog.text and named in caplog.text
    assert json.loads(path.read_text())["key"] == key  # the new measurement replaced it
    assert profile.choose_engine(15).engine == "onednn"


def test_a_run_at_another_thread_count_keeps_its_own_profile_and_leaves_the_other_as_it_was(tmp_path, fast_measure):
    model = tiny_model("llama")
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    measure.load_profile(model, folder=tmp_path)
    first = prof.profile_path(prof.profile_key(model), tmp_path)
    before = first.read_bytes()
    try:
        torch.set_num_threads(other)
        measure.load_profile(model, folder=tmp_path)
        second = prof.profile_path(prof.profile_key(model), tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(fast_measure) == 2 and second != first and first.read_bytes() == before
    assert json.loads(second.read_text())["key"]["torch_threads"] == other
    measure.load_profile(model, folder=tmp_path)  # back at the first count: read back, not measured again
    assert len(fast_measure) == 2 and sorted(_files_under(tmp_path)) == sorted([first, second])


def _stored(engines: str = "", hf: str = "0.05", drafters: str = "{}") -> str:
    good = json.dumps({str(n): 0.01 * n for n in prof.STEP_SIZES})
    engines = engines or f'{{"static": {{"forward_s": {good}, "plain_token_s": 0.05}}}}'
    return f'{{"key": {{}}, "engines": {engines}, "hf_generate_token_s": {hf}, "drafters": {drafters}}}'


@pytest.mark.parametrize("content", [
    "{not json", '{"key": {}, "engines": []}', '[1, 2]', "\udcff",
    _stored('{"static": {"forward_s": {"1": -1.0}, "plain_token_s": 0.1}}'),  # a negative timing, sizes missing
    _stored('{"static": {"forward_s": {"1": 0.01, "16": 0.02}, "plain_token_s": 0.1}}'),  # sizes missing
    _stored(hf="null"), _stored(hf="0"), _stored(hf='"fast"'),  # no HF baseline: the plain-decoding guard is off
    _stored(drafters='{"heads": {"per_depth_s": []}}'), _stored(drafters='{"heads": 3}'),
])
def test_a_corrupt_profile_is_measured_again_with_a_warning(tmp_path, fast_measure, caplog, content):
    model = tiny_model("llama")
    path = prof.profile_path(prof.profile_key(model), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="medusa.tools.measure"):
        measure.load_profile(model, folder=tmp_path)
    assert len(fast_measure) == 1 and "is unreadable" in caplog.text and "not trusting it" in caplog.text
    assert prof.MachineProfile.from_dict(json.loads(path.read_text())).engines  # now a valid profile


def _heads_for(base):
    from medusa.drafters.heads import MedusaHeads, MedusaHeadsConfig

    return MedusaHeads(MedusaHeadsConfig(num_heads=2, hidden_size=64, vocab_size=base.config.vocab_size),
                       base.get_output_embeddings().weight)


@pytest.fixture
def no_timings(monkeypatch):
    """Every timer of the measurer raises: a test under it proves nothing was measured."""
    def timed(*args, **kwargs):
        raise AssertionError("the machine was timed without being asked")

    for name in ("time_forwards", "time_batch_forwards", "time_plain_decoding", "time_hf_generate",
                 "time_heads_levels", "measure_profile", "_measure_engines"):
        monkeypatch.setattr(measure, name, timed)


def _files_under(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_building_a_model_with_no_stored_profile_measures_nothing_and_says_so_once(tmp_path, monkeypatch, caplog,
                                                                                   no_timings):
    import medusa.engines.base as engine_base
    from medusa.base import hf_greedy_batch
    from medusa.decode.loop import GenerationStats, decode_steps
    from medusa.drafters.composite import NoDrafter
    from medusa.model import MedusaModel

    assert SHIPPED_DEFAULT_ENGINE == AUTO  # the suite pins its own default (conftest); the package's is auto
    monkeypatch.setattr(engine_base, "DEFAULT_ENGINE", SHIPPED_DEFAULT_ENGINE)
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    base = tiny_model("llama")
    with caplog.at_level(logging.INFO):
        model = MedusaModel(base, _heads_for(base))  # engine=None: the shipped default, auto
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("medusa")]
    assert len(lines) == 1 and "not measured" in lines[0] and "medusa profile" in lines[0]
    assert model.engine.name == prof.FALLBACK_ENGINE and "none stored" in model.engine.choice.reason
    ids = torch.tensor([5, 9, 2, 7])
    tokens, _ = model.generate(ids, max_new_tokens=8)
    assert tokens == hf_greedy_batch(base, [ids], 8, set(), 0)[0]
    stats = GenerationStats()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert len(list(decode_steps(base, NoDrafter(), ids, 4, set(), stats))) > 0  # engine=None: auto, read only
        assert make_engine(None, base, step_size=15).name == prof.FALLBACK_ENGINE
    assert caplog.records == []  # said once, not once per decode call
    assert measure.choose_dtype(base, 15)[0] == torch.float32
    assert _files_under(tmp_path) == []  # nothing written under MEDUSA_CACHE_DIR


def test_a_per_step_tree_with_no_stored_profile_uses_stand_in_costs_said_once(tmp_path, monkeypatch, caplog,
                                                                              no_timings):
    from test_per_step import flat_calibration

    from medusa.drafters.per_step import STAND_IN_LEVEL_S
    from medusa.model import MedusaModel

    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    base = tiny_model("llama")
    model = MedusaModel(base, _heads_for(base), engine="static")
    with caplog.at_level(logging.WARNING):
        model.use_per_step_tree(flat_calibration(model.heads, 0.8))
    assert len(caplog.records) == 1 and "stand-in costs" in caplog.text and "none stored" in caplog.text
    assert model.per_step and model.drafter.cost.level_s == [STAND_IN_LEVEL_S] * 2
    assert model.drafter.cost.buckets == prof.STEP_SIZES
    tokens, _ = model.generate(torch.tensor([5, 9, 2, 7]), max_new_tokens=6)
    assert len(tokens) == 6 and _files_under(tmp_path) == []
    # A stored profile's own figures are read (its heads' cost too), still without measuring.
    stored = fake_profile(prof.profile_key(base), 50.0, AMD_LIKE)
    stored.drafters[prof.heads_key(model.heads)] = {"per_depth_s": [0.004, 0.005]}
    stored.save(prof.profile_path(stored.key))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model.use_per_step_tree(flat_calibration(model.heads, 0.8))
    assert caplog.records == [] and model.drafter.cost.level_s == [0.004, 0.005]
    assert model.drafter.cost.forward(16) == pytest.approx(stored.forward_s("static", 16))


def test_auto_reads_a_stored_profile_without_measuring(tmp_path, monkeypatch, no_timings):
    from medusa.model import MedusaModel

    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    base = tiny_model("llama")
    key = prof.profile_key(base)
    fake_profile(key, 65.2, AMD_LIKE).save(prof.profile_path(key))
    model = MedusaModel(base, _heads_for(base), engine=AUTO)
    assert model.engine.name == "onednn" and model.engine.choice.profile.startswith(str(tmp_path))
    fake_profile(key, 51.5, INTEL_LIKE).save(prof.profile_path(key))
    assert make_engine(AUTO, base, step_size=15).name == "static"


def test_measure_true_measures_once_announced_and_decodes_through_the_chosen_engine(tmp_path, monkeypatch, capsys):
    from medusa.base import hf_greedy_batch
    from medusa.model import MedusaModel

    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    base = tiny_model("llama")
    model = MedusaModel(base, _heads_for(base), engine="eager")
    model.use_engine(AUTO, measure=True)
    choice = model.engine.choice
    assert choice.engine == model.engine.name in CANDIDATES and choice.step_size == model.tree.num_nodes
    assert choice.profile.startswith(str(tmp_path))
    assert _files_under(tmp_path) == [prof.profile_path(prof.profile_key(base))]
    err = capsys.readouterr().err
    assert "measuring this machine for LlamaForCausalLM in float32 on cpu once (none stored" in err
    assert "measured this machine in " in err
    model.use_engine(AUTO, measure=True)  # stored now: read back, not announced again
    assert "measuring" not in capsys.readouterr().err
    ids = torch.tensor([5, 9, 2, 7])
    tokens, _ = model.generate(ids, max_new_tokens=12)
    assert tokens == hf_greedy_batch(base, [ids], 12, set(), 0)[0]


def test_auto_falls_back_to_static_with_the_reason_when_measuring_fails(tmp_path, monkeypatch, caplog):
    from medusa.model import MedusaModel

    def broken(*args, **kwargs):
        raise RuntimeError("perf counters unavailable")

    monkeypatch.setattr(measure, "measure_profile", broken)
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    base = tiny_model("llama")
    model = MedusaModel(base, _heads_for(base), engine="eager")
    with caplog.at_level(logging.WARNING, logger="medusa.model"):
        model.use_engine(AUTO, measure=True)
    assert model.engine.name == prof.FALLBACK_ENGINE == "static"
    assert "measuring this machine failed (RuntimeError: perf counters unavailable)" in model.engine.choice.reason
    assert "perf counters unavailable" in caplog.text
    assert model.engine.settings()["auto"]["engine"] == "static"


def test_profile_command_prints_the_table_and_auto_choice(tmp_path, fast_measure, capsys, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path / "cache"))
    base = save_tiny(tmp_path / "base", "llama")
    assert main(["profile", "--base", str(base), "--step-size", "1", "15"]) == 0
    out = capsys.readouterr().out
    assert "HF generate: 50.0 ms per new token" in out and "onednn" in out and "n=16" in out
    assert "auto for 15-token steps: onednn" in out and "machine: " in out
    assert main(["profile", "--base", str(base), "--json"]) == 0  # read back, not measured again
    assert len(fast_measure) == 1 and json.loads(capsys.readouterr().out)["hf_generate_token_s"] == 0.05
    assert main(["profile", "--base", str(base), "--refresh", "--json"]) == 0
    assert len(fast_measure) == 2
    assert main(["profile", "--base", str(base), "--engines", "turbo"]) == 2
    assert "unknown engine(s) turbo" in capsys.readouterr().err
    # measured on a busy machine: said, with how to measure again; measured on an idle one: not said
    monkeypatch.setattr("medusa.tools.bench.load_average", lambda: (64.0, 60.0, 50.0))
    monkeypatch.setattr("medusa.tools.bench.running_elsewhere", lambda: 63)
    assert main(["profile", "--base", str(base), "--refresh", "--json"]) == 0
    err = capsys.readouterr().err
    assert "warning: this profile was measured on a busy machine (before: load average 64.0" in err
    assert "; after: load average 64.0" in err and "--refresh" in err
    monkeypatch.setattr("medusa.tools.bench.load_average", lambda: (0.1, 0.1, 0.1))
    assert main(["profile", "--base", str(base), "--refresh", "--json"]) == 0
    assert "busy machine" not in capsys.readouterr().err


def test_dtype_auto_keeps_float32_without_bf16_hardware_and_takes_bf16_where_it_pays(monkeypatch, tmp_path):
    model = tiny_model("llama")
    monkeypatch.setattr(prof, "cpu_info", lambda: {"model": "test cpu", "flags": ["avx2"]})
    dtype, reason = measure.choose_dtype(model, 15, folder=tmp_path, measure=True)
    assert dtype == torch.float32 and "no bfloat16 matrix instructions" in reason
    monkeypatch.setattr(prof, "cpu_info", lambda: {"model": "test cpu", "flags": ["avx512f", "amx_bf16"]})
    by_dtype = {"float32": {"static": (50.0, {1: 45.0, 16: 100.0})},
                "bfloat16": {"static": (30.0, {1: 28.0, 16: 40.0})}}

    def fake_measure(model, candidates=None, progress=None):
        key = prof.profile_key(model)
        return fake_profile(key, 50.0, by_dtype[key["dtype"]])

    monkeypatch.setattr(measure, "measure_profile", fake_measure)
    dtype, reason = measure.choose_dtype(model, 15, folder=tmp_path)  # not asked to measure: the exact default
    assert dtype == torch.float32 and "not measured" in reason and not (tmp_path / "profiles").exists()
    dtype, reason = measure.choose_dtype(model, 15, folder=tmp_path, measure=True)
    assert dtype == torch.bfloat16 and "bfloat16 pays here" in reason
    assert model.dtype == torch.float32  # the model asked about is left as it was
    assert measure.choose_dtype(model, 15, folder=tmp_path)[0] == torch.bfloat16  # both stored now: read
    by_dtype["bfloat16"]["static"] = (55.0, {1: 50.0, 16: 98.0})
    dtype, reason = measure.choose_dtype(model, 15, folder=tmp_path / "other", measure=True)
    assert dtype == torch.float32 and "does not pay" in reason


def test_gpu_profile_check_script_runs_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh's profile phase, kept working without a GPU (--tiny on the CPU)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_profile_check

    out = tmp_path / "profile.json"
    assert gpu_profile_check.main(["--tiny", "--device", "cpu", "--new-tokens", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["failures"] and result["decode"]["identical"] and result["decode"]["plain_identical"]
    assert result["bench_choice"]["engine"] in CANDIDATES and result["bench_choice"]["reason"]
    assert Path(result["profile_path"]).is_file() and set(result["choices"]) == {"1", "16", "64"}


def test_only_missing_or_failed_engines_are_measured_into_a_stored_profile(tmp_path, monkeypatch):
    model = tiny_model("llama")
    key = prof.profile_key(model)
    stored = fake_profile(key, 50.0, {"static": AMD_LIKE["static"], "eager": AMD_LIKE["eager"]})
    stored.engines["eager"] = {"error": "RuntimeError: out of memory"}
    stored.save(prof.profile_path(key, tmp_path))
    measured = []

    def fake_measure(profile, model, names, progress):
        measured.extend(names)
        for name in names:
            profile.engines[name] = fake_profile(key, 50.0, {name: AMD_LIKE.get(name, AMD_LIKE["static"])}
                                                 ).engines[name]

    monkeypatch.setattr(measure, "_measure_engines", fake_measure)
    profile = measure.load_profile(model, folder=tmp_path)
    # static was there; eager had failed; onednn (and native, where the C library builds) were missing
    assert sorted(measured) == sorted(set(CANDIDATES) - {"static"}) and "onednn" in measured
    assert set(profile.usable()) == set(CANDIDATES)
    measured.clear()
    measure.load_profile(model, folder=tmp_path)
    assert measured == []  # complete now: read, not measured


def test_auto_measures_and_chooses_among_the_engines_that_declare_themselves_candidates(monkeypatch, tmp_path):
    from medusa.engines import ENGINES, NativeEngine, OneDNNEngine, StaticEngine

    class Turbo(StaticEngine):
        name = "turbo"

        @classmethod
        def candidate_for(cls, device, dtype):
            return torch.device(device).type == "cpu"

    for cls in (OneDNNEngine, NativeEngine):
        monkeypatch.setattr(cls, "candidate_for", classmethod(lambda cls, device, dtype: False))
    monkeypatch.setitem(ENGINES, "turbo", Turbo)
    assert auto_candidates("cpu", torch.float32) == ["eager", "static", "turbo"]
    assert auto_candidates("cuda", torch.float32) == ["eager", "static"]
    measured = []

    def fake_measure(profile, model, names, progress):
        measured.extend(names)
        costs = {"turbo": (40.0, {1: 30.0, 16: 50.0}), **AMD_LIKE}
        profile.engines.update({n: fake_profile({}, 50.0, {n: costs[n]}).engines[n] for n in names})

    monkeypatch.setattr(measure, "_measure_engines", fake_measure)
    monkeypatch.setattr(measure, "time_hf_generate", lambda model: 0.05)
    model = tiny_model("llama")
    profile = measure.load_profile(model, folder=tmp_path)
    assert measured == ["eager", "static", "turbo"] and "onednn" not in profile.engines
    assert make_engine(AUTO, model, step_size=15, profile=profile).name == "turbo"
    measured.clear()
    assert measure.load_profile(model, folder=tmp_path).choose_engine(15).engine == "turbo" and measured == []


def test_an_engine_measured_on_request_is_not_a_candidate_of_auto(monkeypatch, tmp_path, without_native):
    model = tiny_model("llama")
    key = prof.profile_key(model)
    fake_profile(key, 50.0, INTEL_LIKE).save(prof.profile_path(key, tmp_path))
    monkeypatch.setattr(measure, "time_forwards", lambda engine, model: {n: 1e-4 for n in prof.STEP_SIZES})
    monkeypatch.setattr(measure, "time_batch_forwards", lambda engine, model, batch: {n: 1e-4 for n in (1, 16)})
    monkeypatch.setattr(measure, "time_plain_decoding", lambda engine, model: 1e-4)  # by far the fastest
    profile = measure.ensure_engine(measure.load_profile(model, folder=tmp_path), model, "eager")
    assert profile.choose_engine(15).engine == "static"  # eager was there: not measured again
    monkeypatch.setattr("medusa.engines.compiled.compile_unavailable", lambda device: "not in this test")
    with pytest.warns(RuntimeWarning, match="runs as 'static'"):
        profile = measure.ensure_engine(profile, model, "compiled")
    assert profile.engines["compiled"]["candidate"] is False
    reread = measure.load_profile(model, folder=tmp_path)
    assert "compiled" in reread.usable() and reread.choose_engine(15).engine == "static"
    assert make_engine(AUTO, model, step_size=15, profile=reread).name == "static"


def test_make_engine_with_no_name_runs_the_default_auto(monkeypatch, fast_measure, tmp_path):
    import medusa.engines.base as engine_base

    monkeypatch.setattr(engine_base, "DEFAULT_ENGINE", SHIPPED_DEFAULT_ENGINE)
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    engine = make_engine(None, model, step_size=15)
    assert engine.name == "static" and "not measured" in engine.choice.reason and fast_measure == []
    measure.load_profile(model)  # asked for: measured (the fake) and stored
    engine = make_engine(None, model, step_size=15)
    assert engine.name == "onednn" and engine.choice.engine == "onednn" and len(fast_measure) == 1


def test_auto_falls_back_when_the_chosen_engine_cannot_be_made(monkeypatch, fast_measure, tmp_path, caplog):
    from medusa.engines import ENGINES

    class Broken(ENGINES["onednn"]):
        def __init__(self, model, **options):
            raise RuntimeError("no packed weights today")

    monkeypatch.setitem(ENGINES, "onednn", Broken)
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    measure.load_profile(model)
    with caplog.at_level(logging.WARNING, logger="medusa.engines.base"):
        engine = make_engine(AUTO, model, step_size=15)
    assert engine.name == "static" and "the chosen onednn engine could not be made" in engine.choice.reason
    assert "no packed weights today" in caplog.text


def test_dtype_auto_through_the_cli_converts_the_model_and_the_bench_records_why(tmp_path, monkeypatch, capsys):
    from tiny import save_cli_files

    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(prof, "cpu_info", lambda: {"model": "test cpu", "flags": ["avx512f", "avx512_bf16"]})

    def fake_measure(model, candidates=None, progress=None):
        key = prof.profile_key(model)
        scale = 0.5 if key["dtype"] == "bfloat16" else 1.0  # bf16 twice as fast; static the fastest engine
        return fake_profile(key, 50.0, {name: (scale * plain, {n: scale * ms for n, ms in curve.items()})
                                        for name, (plain, curve) in INTEL_LIKE.items()})

    monkeypatch.setattr(measure, "measure_profile", fake_measure)
    base, prompts = save_cli_files(tmp_path, [{"prompt": "hello world"}])
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(tmp_path / "heads"), "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--dtype", "auto", "--engine", "auto", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "torch.bfloat16" and "bfloat16 pays here" in result["dtype_reason"]
    assert result["engine"]["engine"] == "static" and result["profile"]["key"]["dtype"] == "bfloat16"
    assert "--dtype auto: bfloat16 pays here" in capsys.readouterr().err


def test_an_engine_instance_is_measured_as_configured_under_its_profile_name(monkeypatch, tmp_path,
                                                                             without_native):
    """The int4 engine with the checked bf16 lm_head costs otherwise than the default int4 (its lm_head scores every
    node): it is measured as it was made, under ``int4:lm_head=bf16``, beside (not over) ``int4``."""
    from medusa.engines.quantized import quantize_unavailable

    if quantize_unavailable("int4", "cpu") is not None:
        pytest.skip(quantize_unavailable("int4", "cpu"))
    model = tiny_model("llama")
    key = prof.profile_key(model)
    fake_profile(key, 50.0, AMD_LIKE).save(prof.profile_path(key, tmp_path))
    measured = []
    monkeypatch.setattr(measure, "time_forwards",
                        lambda engine, model: measured.append(engine) or {n: 1e-4 for n in prof.STEP_SIZES})
    monkeypatch.setattr(measure, "time_batch_forwards", lambda engine, model, batch: {n: 1e-4 for n in (1, 16)})
    monkeypatch.setattr(measure, "time_plain_decoding", lambda engine, model: 1e-4)
    engine = make_engine("int4", model, lm_head="bf16")
    assert engine.profile_name == "int4:lm_head=bf16" and make_engine("int4", model).profile_name == "int4"
    profile = measure.ensure_engine(measure.load_profile(model, folder=tmp_path), model, engine)
    assert measured == [engine]  # this very engine, not a default int4 made by name
    entry = profile.engines["int4:lm_head=bf16"]
    assert entry["scores_all_nodes"] is True and entry["candidate"] is False and "int4" not in profile.engines
    measure.ensure_engine(profile, model, engine)
    assert measured == [engine]  # stored: not measured again


def test_drafting_is_timed_call_by_call_after_a_flush_of_the_caches(monkeypatch):
    """On a CPU every timed head call follows a read that pushes the heads' weights out of the caches (as the base's
    forward does in decoding); the figure per depth is the median of the calls, each one positive. Elsewhere the
    flush is nothing."""
    from tiny import tiny_model

    heads = _heads_for(tiny_model("llama"))
    order = []
    assert measure._cache_evictor("cpu")() > 0 and measure._cache_evictor("meta")() is None  # a read; nothing
    monkeypatch.setattr(measure, "_cache_evictor", lambda device: lambda: order.append("flush"))
    draft = heads.draft_logits
    monkeypatch.setattr(heads, "draft_logits", lambda *a: (order.append("call"), draft(*a))[1])
    per_depth = measure.time_heads_levels(heads, rows=2, repeats=3)
    assert len(per_depth) == 2 and all(s > 0 for s in per_depth)
    assert order == ["call", "flush", "call", "flush", "call", "flush", "call"] * 2  # one untimed call a depth


def test_the_drafters_products_take_the_dtype_whose_stored_drafting_cost_is_lower(tmp_path, monkeypatch, no_timings):
    """Beside onednn the heads may draft in bf16 (half the bytes a level); the profile's measured drafting cost
    decides, each dtype stored under its own key, and without both figures the weights' own dtype stays. Greedy
    decoding stays equal to plain decoding either way: only the drafts change."""
    from test_per_step import flat_calibration

    from medusa.decode.tree import Tree
    from medusa.engines.onednn import onednn_unavailable_for
    from medusa.model import MedusaModel

    if onednn_unavailable_for("cpu", torch.float32) or onednn_unavailable_for("cpu", torch.bfloat16):
        pytest.skip("oneDNN runs no bf16 products on this CPU")
    monkeypatch.setenv("MEDUSA_CACHE_DIR", str(tmp_path))
    base = tiny_model("llama")
    model = MedusaModel(base, _heads_for(base), engine="onednn")
    assert model.engine.drafter_dtypes == (None, torch.bfloat16)
    stored = fake_profile(prof.profile_key(base), 50.0, AMD_LIKE)
    fp32_key = prof.heads_key(model.heads)
    stored.drafters[fp32_key] = {"per_depth_s": [0.004, 0.005]}
    stored.save(prof.profile_path(stored.key))
    model.use_per_step_tree(flat_calibration(model.heads, 0.8))  # bf16's cost not stored: not chosen
    assert model.engine.drafter_dtype is None and model.heads.drafter_products_key is None
    weight = model.heads.shared_weight_t.T
    assert model.heads.drafter_products(weight, "input0") is None  # fp32: the projection alone is packed

    model.engine.drafter_dtype = torch.bfloat16
    model._pack_drafter()
    bf16_key = prof.heads_key(model.heads)
    assert bf16_key != fp32_key and bf16_key.endswith(":products=onednn:bfloat16")
    rows = torch.randn(3, weight.shape[1])
    product = model.heads.drafter_products(weight, "projection")
    out = product(rows)
    assert out.dtype == torch.float32 and out.shape == (3, weight.shape[0])
    assert torch.allclose(out, rows @ weight.T, atol=0.05 * float((rows @ weight.T).abs().max()))
    assert model.heads.drafter_products(weight, "input0") is not None  # every product in bf16
    assert product(rows[:0]).shape == (0, weight.shape[0])  # no rows, as the fp32 product gives

    for bf16_s, expected in ((0.006, None), (0.003, torch.bfloat16)):
        stored.drafters[bf16_key] = {"per_depth_s": [bf16_s, bf16_s]}
        stored.save(prof.profile_path(stored.key))
        model.use_per_step_tree(flat_calibration(model.heads, 0.8))
        assert model.engine.drafter_dtype == expected
        assert model.drafter.cost.level_s == ([bf16_s] * 2 if expected else [0.004, 0.005])
        assert model.engine.settings()["drafter_dtype"] == (None if expected is None else "bfloat16")
    ids = torch.tensor([5, 9, 2, 7, 5, 9])
    drafted, _ = model.generate(ids, max_new_tokens=12)
    model.drafter = None
    plain, _ = model.generate(ids, max_new_tokens=12, tree=Tree.chain(0))
    assert drafted == plain

    # Measuring: each dtype's drafting is timed through its own products and stored under its own key, both ways.
    from medusa.tools import measure

    for bf16_s, expected in ((0.006, None), (0.002, torch.bfloat16)):
        timed = []

        def fake_levels(heads, bf16_s=bf16_s, timed=timed):
            timed.append(heads.drafter_products_key)
            return [bf16_s] * 2 if heads.drafter_products_key else [0.004, 0.005]

        monkeypatch.setattr(measure, "time_heads_levels", fake_levels)
        fresh = fake_profile(prof.profile_key(base), 50.0, AMD_LIKE)
        model._choose_drafter_dtype(fresh, measure=True)
        assert timed == [None, "onednn:bfloat16"] and model.engine.drafter_dtype == expected
        assert fresh.drafters[fp32_key]["per_depth_s"] == [0.004, 0.005]
        assert fresh.drafters[bf16_key]["per_depth_s"] == [bf16_s] * 2

    # Heads that run nothing through the engine's products (an lm_head copy each) keep their dtype, whatever the
    # profile holds under the bf16 key.
    from medusa.drafters.heads import MedusaHeads, MedusaHeadsConfig

    own = MedusaModel(base, MedusaHeads(MedusaHeadsConfig(num_heads=2, hidden_size=64, vocab_size=base.config
                                                          .vocab_size, share_lm_head=False),
                                        base.get_output_embeddings().weight), engine="onednn")
    assert not own.heads.drafts_through_products
    stored.drafters[prof.heads_key(own.heads)] = {"per_depth_s": [0.004, 0.005]}
    stored.drafters[prof.heads_key(own.heads) + ":products=onednn:bfloat16"] = {"per_depth_s": [0.001, 0.001]}
    stored.save(prof.profile_path(stored.key))
    own.use_per_step_tree(flat_calibration(own.heads, 0.8))
    assert own.engine.drafter_dtype is None and own.drafter.cost.level_s == [0.004, 0.005]
