"""Interop: export to vLLM's Medusa layout, import from FasterDecoding/Medusa and vLLM, and loud refusals.

The fake FasterDecoding/Medusa and vLLM checkpoints are built here from tiny random tensors, in the key layouts
those projects write (see medusa/interop.py for the vLLM source version followed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_checkpoint as checkpoint_helpers
import torch
from safetensors.torch import load_file, save_file

from medusa import cli
from medusa.drafters.heads import HydraHeads, MedusaHeads, MedusaHeadsConfig, lm_head_fingerprint
from medusa.io.checkpoint import HEADS_CONFIG_NAME, load_heads, read_heads_config, save_heads
from medusa.io.interop import (
    VLLM_CONFIG_NAME,
    VLLM_WEIGHTS_NAME,
    FormatError,
    export_vllm,
    import_medusa_v1,
    import_vllm,
    vllm_logits,
)

H, V, K, L = 16, 64, 3, 2


def base_weight(seed=0):
    return checkpoint_helpers.base_weight(seed, V, H)


def trained_heads(weight, share=True, token_map=None, num_heads=K, num_layers=L):
    return checkpoint_helpers.trained_heads(weight, share, token_map, num_heads, num_layers, scale=0.3,
                                            base_name="tiny-base")


def medusa_v1_folder(path: Path, num_heads=K, num_layers=L, config_heads=None, config_layers=None, pt=False,
                     dtype=torch.float16) -> Path:
    """A FasterDecoding/Medusa heads folder: ``{k}.{j}.linear.*`` ResBlocks and ``{k}.{L}.weight`` projections."""
    g = torch.Generator().manual_seed(3)
    state = {}
    for k in range(num_heads):
        for j in range(num_layers):
            state[f"{k}.{j}.linear.weight"] = (torch.randn(H, H, generator=g) * 0.1).to(dtype)
            state[f"{k}.{j}.linear.bias"] = (torch.randn(H, generator=g) * 0.1).to(dtype)
        state[f"{k}.{num_layers}.weight"] = torch.randn(V, H, generator=g).to(dtype)
    path.mkdir(parents=True)
    config = {"medusa_num_heads": config_heads or num_heads, "medusa_num_layers": config_layers or num_layers,
              "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    (path / "config.json").write_text(json.dumps(config))
    if pt:
        torch.save(state, path / "medusa_lm_head.pt")
    else:
        save_file(state, str(path / "medusa_lm_head.safetensors"))
    return path


def v1_reference_logits(state: dict, k: int, num_layers: int, hidden: torch.Tensor) -> torch.Tensor:
    """FasterDecoding/Medusa's head k: ResBlocks ``x + SiLU(Linear(x))`` then its own projection, in fp32."""
    x = hidden
    for j in range(num_layers):
        w, b = state[f"{k}.{j}.linear.weight"].float(), state[f"{k}.{j}.linear.bias"].float()
        x = x + torch.nn.functional.silu(x @ w.T + b)
    return x @ state[f"{k}.{num_layers}.weight"].float().T


# --- export ours -> vLLM -> ours ------------------------------------------------------------------------------------

@pytest.mark.parametrize("share, token_map", [(True, None), (True, torch.tensor([0, 3, 9, 10, 33, 63])),
                                              (False, None), (False, torch.tensor([5, 6, 7, 40]))],
                         ids=["shared", "shared truncated", "own", "own truncated"])
def test_vllm_round_trip_gives_bit_identical_outputs(tmp_path, share, token_map):
    weight = base_weight()
    heads = trained_heads(weight, share=share, token_map=token_map)
    out = export_vllm(heads, tmp_path / "vllm", weight if share else None)
    back = import_vllm(out, tmp_path / "ours", weight if share else None)
    loaded = load_heads(back, weight)
    assert loaded.config.share_lm_head == share
    assert loaded.config.lm_head_fingerprint == heads.config.lm_head_fingerprint
    hidden = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))
    if token_map is not None:
        assert torch.equal(loaded.token_map, token_map)


@pytest.mark.parametrize("share, token_map", [(True, None), (False, torch.tensor([5, 6, 7, 40]))])
def test_exported_folder_is_vllm_layout_and_computes_the_heads_logits(tmp_path, share, token_map):
    """Names and config fields as vLLM's medusa.py declares them, and vLLM's forward on them gives our logits."""
    weight = base_weight()
    heads = trained_heads(weight, share=share, token_map=token_map)
    out = export_vllm(heads, tmp_path / "vllm", weight)
    config = json.loads((out / VLLM_CONFIG_NAME).read_text())
    state = load_file(out / VLLM_WEIGHTS_NAME)
    assert sorted(p.name for p in out.iterdir()) == sorted([VLLM_CONFIG_NAME, VLLM_WEIGHTS_NAME])
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"]) == (K, L, H)
    assert config["vocab_size"] == V and config["medusa_fc_bias"] is True
    assert config["original_lm_head"] is share
    assert config["truncated_vocab_size"] == (V if token_map is None else len(token_map))
    assert "09cddad8" in config["medusa_heads_export"]["layout"]
    # vLLM's config reader renames any top-level key holding "num" and "heads"/"layers": only the two real ones.
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    blocks = {f"blocks.{k}.layers.{j}.{p}" for k in range(K) for j in range(L) for p in ("weight", "bias")}
    projections = {"lm_heads.0.weight"} if share else {f"lm_heads.{k}.weight" for k in range(K)}
    assert set(state) == blocks | projections | (set() if token_map is None else {"token_map"})
    hidden = torch.randn(4, H)
    with torch.no_grad():
        ours = heads(hidden)  # (K, 4, Vh)
    theirs = vllm_logits(config, state, hidden)  # (K, 4, V)
    if token_map is not None:
        outside = torch.ones(V, dtype=torch.bool)
        outside[token_map] = False
        assert torch.isneginf(theirs[..., outside]).all()
        theirs = theirs[..., token_map]
    torch.testing.assert_close(theirs, ours)


def test_export_refuses_hydra_heads(tmp_path):
    weight = base_weight()
    config = MedusaHeadsConfig(hidden_size=H, vocab_size=V, num_heads=2, num_layers=1, head_type="hydra")
    heads = HydraHeads(config, weight, weight)
    with pytest.raises(FormatError, match="head_type 'hydra' cannot be exported.*Hydra heads also read"):
        export_vllm(heads, tmp_path / "vllm", weight)
    assert not (tmp_path / "vllm").exists()


def test_export_refuses_what_the_layout_cannot_hold(tmp_path):
    """A module the layout has no place for (standing in for a layer added to the heads later) is an error, never
    a weight silently left out; so is shared heads without their base, or another base."""
    weight = base_weight()
    heads = trained_heads(weight, share=False)
    heads.blocks[1].append(torch.nn.LayerNorm(H))
    with pytest.raises(FormatError, match=r"head 1 holds \['ResBlock', 'ResBlock', 'LayerNorm'\]"):
        export_vllm(heads, tmp_path / "a")
    heads = trained_heads(weight, share=False)
    heads.prefix = torch.nn.Linear(H, H)
    with pytest.raises(FormatError, match=r"no place for: \['prefix.bias', 'prefix.weight'\]"):
        export_vllm(heads, tmp_path / "b")
    shared = trained_heads(weight, share=True)
    with pytest.raises(FormatError, match="share the base's lm_head.*--base"):
        export_vllm(shared, tmp_path / "c")
    with pytest.raises(FormatError, match="not the one the heads were trained on"):
        export_vllm(shared, tmp_path / "d", base_weight(seed=7))
    assert not any(tmp_path.iterdir())


def test_export_refuses_a_config_field_it_cannot_express(tmp_path, monkeypatch):
    """A heads config field outside what the layout holds (e.g. prefix layers) must be at its default ("off")."""
    import dataclasses

    from medusa.io import interop

    heads = trained_heads(base_weight(), share=False)
    field = dataclasses.field(default=0)
    field.name = "prefix_layers"
    monkeypatch.setattr(dataclasses, "fields", lambda _: [field])
    heads.config.prefix_layers = 2
    with pytest.raises(FormatError, match="prefix_layers=2 has no counterpart in vLLM's Medusa layout"):
        interop.check_exportable(heads)
    heads.config.prefix_layers = 0
    interop.check_exportable(heads)


def test_export_refuses_heads_vllm_would_compute_differently(tmp_path, monkeypatch):
    """The written files are run the way vLLM runs them; heads whose forward differs are refused."""
    heads = trained_heads(base_weight(), share=False)
    original = MedusaHeads.features
    monkeypatch.setattr(MedusaHeads, "features", lambda self, k, h, t: 2 * original(self, k, h, t))
    with pytest.raises(FormatError, match="do not reproduce the heads' logits"):
        export_vllm(heads, tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_export_never_overwrites_a_folder(tmp_path):
    out = tmp_path / "vllm"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        export_vllm(trained_heads(base_weight(), share=False), out)
    assert (out / "keep.txt").read_text() == "mine"


# --- import FasterDecoding/Medusa -------------------------------------------------------------------------------

@pytest.mark.parametrize("pt", [False, True], ids=["safetensors", "pt"])
def test_medusa_v1_import_computes_the_original_heads(tmp_path, pt):
    src = medusa_v1_folder(tmp_path / "v1", pt=pt)
    state = load_file(src / "medusa_lm_head.safetensors") if not pt else torch.load(src / "medusa_lm_head.pt")
    out = import_medusa_v1(src, tmp_path / "ours")
    config = read_heads_config(out)
    assert (config.num_heads, config.num_layers, config.share_lm_head) == (K, L, False)
    assert config.base_model_name_or_path == "lmsys/vicuna-7b-v1.3"
    heads = load_heads(out, base_weight(), check_fingerprint=False)
    hidden = torch.randn(5, H)
    with torch.no_grad():
        logits = heads(hidden)  # (K, 5, V)
    for k in range(K):
        torch.testing.assert_close(logits[k], v1_reference_logits(state, k, L, hidden))


def test_medusa_v1_pt_with_one_resblock_under_every_layer_name(tmp_path):
    """FasterDecoding/Medusa's ``[ResBlock(h)] * L`` shares one module L times: its .pt holds one tensor under L
    names. The import gives L equal, separate blocks that compute the same."""
    src = medusa_v1_folder(tmp_path / "v1", pt=True, dtype=torch.float32)
    state = torch.load(src / "medusa_lm_head.pt")
    for k in range(K):
        for p in ("weight", "bias"):
            state[f"{k}.1.linear.{p}"] = state[f"{k}.0.linear.{p}"]  # the same tensor object
    torch.save(state, src / "medusa_lm_head.pt")
    heads = load_heads(import_medusa_v1(src, tmp_path / "ours"), base_weight(), check_fingerprint=False)
    hidden = torch.randn(5, H)
    with torch.no_grad():
        logits = heads(hidden)
    for k in range(K):
        torch.testing.assert_close(logits[k], v1_reference_logits(state, k, L, hidden))


def test_medusa_v1_import_with_base_stores_its_fingerprint(tmp_path):
    weight = base_weight()
    out = import_medusa_v1(medusa_v1_folder(tmp_path / "v1"), tmp_path / "ours", weight)
    assert read_heads_config(out).lm_head_fingerprint == lm_head_fingerprint(weight)
    with pytest.raises(ValueError, match="trained for another base"):
        load_heads(out, base_weight(seed=7))


@pytest.mark.parametrize("heads_in_config, layers_in_config, message", [
    (5, None, r"medusa_num_heads=5 in .*config.json but the weights medusa_lm_head.safetensors hold 3 heads"),
    (None, 1, r"medusa_num_layers=1 in .*config.json but the weights .* hold 2 ResBlocks per head"),
], ids=["head count", "layer count"])
def test_medusa_v1_config_disagreeing_with_weights_is_refused(tmp_path, heads_in_config, layers_in_config, message):
    src = medusa_v1_folder(tmp_path / "v1", config_heads=heads_in_config, config_layers=layers_in_config)
    with pytest.raises(FormatError, match=message):
        import_medusa_v1(src, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


class NotATensor:
    """Something a pickle may hold that weights_only loading must refuse (never executed)."""


@pytest.mark.parametrize("payload, message", [
    ({"0.0.linear.weight": torch.zeros(H, H), "step": 3}, r"holds entries that are not tensors: \['step'\]"),
    ({"0.0.linear.weight": NotATensor()}, "not a plain torch file of tensors .*weights_only=True"),
    ([torch.zeros(2)], "must hold a dict of name -> tensor, got list"),
], ids=["an int entry", "an arbitrary object", "a list"])
def test_medusa_v1_pt_holding_anything_but_tensors_is_refused(tmp_path, payload, message):
    src = medusa_v1_folder(tmp_path / "v1", pt=True)
    torch.save(payload, src / "medusa_lm_head.pt")
    with pytest.raises(FormatError, match=message):
        import_medusa_v1(src, tmp_path / "ours")


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("1.1.linear.bias"), r"head 1 misses ResBlock tensors"),
    (lambda s: s.update({"0.0.linear.scale": torch.ones(H)}), r"unknown weight names \['0.0.linear.scale'\]"),
    (lambda s: s.update({"1.0.linear.weight": torch.zeros(H + 1, H)}), "do not form 3 heads"),
    (lambda s: s["2.2.weight"].__setitem__(0, float("nan")), "2.2.weight holds NaN"),
    (lambda s: s.update({"3.0.linear.weight": torch.zeros(H, H)}), r"head 3 has ResBlocks \[0\], head 0 has \[0, 1\]"),
], ids=["missing bias", "unknown key", "misshaped", "NaN", "extra partial head"])
def test_corrupted_medusa_v1_weights_are_refused(tmp_path, damage, message):
    src = medusa_v1_folder(tmp_path / "v1", dtype=torch.float32)
    state = load_file(src / "medusa_lm_head.safetensors")
    damage(state)
    save_file(state, str(src / "medusa_lm_head.safetensors"))
    with pytest.raises(FormatError, match=message):
        import_medusa_v1(src, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_truncated_medusa_v1_file_is_refused(tmp_path):
    src = medusa_v1_folder(tmp_path / "v1")
    data = (src / "medusa_lm_head.safetensors").read_bytes()
    (src / "medusa_lm_head.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="damaged"):
        import_medusa_v1(src, tmp_path / "ours")


# --- import vLLM ------------------------------------------------------------------------------------------------

def exported(tmp_path, share=False, token_map=None) -> tuple[Path, dict, dict]:
    weight = base_weight()
    out = export_vllm(trained_heads(weight, share=share, token_map=token_map), tmp_path / "vllm", weight)
    return out, json.loads((out / VLLM_CONFIG_NAME).read_text()), load_file(out / VLLM_WEIGHTS_NAME)


def rewrite(out: Path, config: dict, state: dict) -> None:
    (out / VLLM_CONFIG_NAME).write_text(json.dumps(config))
    save_file(state, str(out / VLLM_WEIGHTS_NAME))


@pytest.mark.parametrize("change, message", [
    (lambda c, s: c.update(num_heads=4),
     r"num_heads=4 in .*config.json but the weights model.safetensors hold 3 heads"),
    (lambda c, s: c.update(num_hidden_layers=1), r"num_hidden_layers=1 .* hold 2 ResBlocks per head"),
    (lambda c, s: s.update({"blocks.0.layers.0.linear.weight": s.pop("blocks.0.layers.0.weight")}),
     r"unknown weight names \['blocks.0.layers.0.linear.weight'\]"),
    (lambda c, s: c.update(medusa_fc_bias=False), "medusa_fc_bias is False .* have biases: vLLM would skip them"),
    (lambda c, s: s.pop("lm_heads.2.weight"), r"missing \['lm_heads.2.weight'\]"),
    (lambda c, s: c.update(truncated_vocab_size=3), "token_map has shape"),
    (lambda c, s: c.update(model_type="llama"), "model_type 'llama', not 'medusa'"),
], ids=["head count", "layer count", "TGI-style names", "bias flag", "missing projection", "token map size",
        "not medusa"])
def test_mismatched_vllm_import_is_refused(tmp_path, change, message):
    out, config, state = exported(tmp_path, token_map=torch.tensor([5, 6, 7, 40]))
    change(config, state)
    rewrite(out, config, state)
    with pytest.raises(FormatError, match=message):
        import_vllm(out, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_vllm_import_without_bias_or_base(tmp_path):
    """medusa_fc_bias false (vLLM's default) imports as zero biases; an original_lm_head without the base becomes
    per-head copies, computing the same logits."""
    weight = base_weight()
    heads = trained_heads(weight, share=True)
    out, config, state = exported(tmp_path, share=True)
    for name in [n for n in state if n.endswith(".bias")]:
        state.pop(name)
        heads.state_dict()[name.replace("layers.", "").replace(".bias", ".linear.bias")].zero_()
    config["medusa_fc_bias"] = False
    rewrite(out, config, state)
    loaded = load_heads(import_vllm(out, tmp_path / "ours"), weight)
    assert not loaded.config.share_lm_head
    hidden = torch.randn(3, H)
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden), heads(hidden))


def test_vllm_config_counts_under_other_names_are_read_as_vllm_reads_them(tmp_path):
    """vLLM renames any config key holding "num" and "heads" to num_heads: a medusa_num_heads there is checked too."""
    out, config, state = exported(tmp_path)
    config["medusa_num_heads"] = config.pop("num_heads") + 1
    rewrite(out, config, state)
    with pytest.raises(FormatError, match="num_heads=4 in .* hold 3 heads"):
        import_vllm(out, tmp_path / "ours")
    config["medusa_num_heads"] = 3
    config["vocab_size"] = config["truncated_vocab_size"] = V + 1
    rewrite(out, config, state)
    with pytest.raises(FormatError, match=r"vocab projections of shapes \[\(64, 16\)\], expected 65 rows"):
        import_vllm(out, tmp_path / "ours")


def test_vllm_original_lm_head_that_is_not_the_base_is_refused(tmp_path):
    out, _, _ = exported(tmp_path, share=True)
    with pytest.raises(FormatError, match="original_lm_head rows differ from the base's lm_head"):
        import_vllm(out, tmp_path / "ours", base_weight(seed=7))


# --- command line ---------------------------------------------------------------------------------------------

def test_cli_export_and_import(tmp_path, capsys):
    heads_dir = save_heads(trained_heads(base_weight(), share=False), tmp_path / "heads")
    assert cli.main(["export", "--format", "vllm", "--heads", str(heads_dir), "--out", str(tmp_path / "vllm")]) == 0
    assert cli.main(["import", "--from", "vllm", str(tmp_path / "vllm"), "--out", str(tmp_path / "back")]) == 0
    back, before = load_file(tmp_path / "back" / "model.safetensors"), load_file(heads_dir / "model.safetensors")
    assert back.keys() == before.keys() and all(torch.equal(back[k], before[k]) for k in before)
    src = medusa_v1_folder(tmp_path / "v1", config_heads=5)
    assert cli.main(["import", "--from", "medusa-v1", str(src), "--out", str(tmp_path / "v1-ours")]) == 2
    assert "medusa_num_heads=5" in capsys.readouterr().err
    shared = save_heads(trained_heads(base_weight(), share=True), tmp_path / "shared")
    assert cli.main(["export", "--format", "vllm", "--heads", str(shared), "--out", str(tmp_path / "x")]) == 2
    assert "pass --base" in capsys.readouterr().err
    assert json.loads((heads_dir / HEADS_CONFIG_NAME).read_text())["model_type"] == "medusa_heads"


def test_cli_round_trip_of_shared_heads_through_a_base_folder(tmp_path):
    """Shared heads need --base to export (its lm_head rows become vLLM's original_lm_head) and, imported back with
    the same --base, share its lm_head again and give bit-identical outputs."""
    from tiny import save_tiny
    from transformers import AutoModelForCausalLM

    base = save_tiny(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base)
    weight = model.get_output_embeddings().weight.detach()  # (V, H)
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=2, num_layers=1,
                               head_vocab_size=8, lm_head_fingerprint=lm_head_fingerprint(weight))
    heads = MedusaHeads(config, weight, torch.arange(0, 16, 2))
    with torch.no_grad():
        heads.blocks[1][0].linear.weight.normal_()
    heads_dir = save_heads(heads, tmp_path / "heads")
    vllm_dir, back = tmp_path / "vllm", tmp_path / "back"
    assert cli.main(["export", "--format", "vllm", "--heads", str(heads_dir), "--out", str(vllm_dir),
                     "--base", str(base)]) == 0
    assert json.loads((vllm_dir / VLLM_CONFIG_NAME).read_text())["original_lm_head"] is True
    assert cli.main(["import", "--from", "vllm", str(vllm_dir), "--out", str(back), "--base", str(base)]) == 0
    loaded = load_heads(back, weight)
    assert loaded.config.share_lm_head and loaded.config.head_vocab_size == 8
    hidden = torch.randn(3, weight.shape[1])
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))


# --- export the eagle drafter -> speculators eagle3 ---------------------------------------------------------------

def eagle_drafter(arch="llama", layers=(0, 1, 2), token_map=None, share=True, seed=0, tied=False):
    """A random eagle drafter on a tiny base config (4 decoder layers, GPT-2's 2), with the base's weights (``tied``:
    the lm_head is the input embedding, one tensor, as in a base with ``tie_word_embeddings``)."""
    from tiny import tiny_config

    from medusa.drafters.eagle import eagle_base_settings
    from medusa.drafters.heads import build_heads

    base = tiny_config(arch) if arch == "gpt2" else tiny_config(arch, num_hidden_layers=4)
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = base.vocab_size, base.hidden_size
    lm_head = torch.randn(vocab, hidden, generator=g)
    embed = lm_head if tied else torch.randn(vocab, hidden, generator=g)
    config = MedusaHeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=3, head_type="eagle",
                               eagle_layers=list(layers), eagle_base=eagle_base_settings(base),
                               head_vocab_size=None if token_map is None else len(token_map), share_lm_head=share,
                               lm_head_fingerprint=lm_head_fingerprint(lm_head), base_model_name_or_path="tiny-base")
    extra = {"position_weight": torch.randn(512, hidden, generator=g)} if arch == "gpt2" else {}
    heads = build_heads(config, lm_head, embed, token_map, **extra)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2, generator=g)
    return heads, base, lm_head, embed


@pytest.mark.parametrize("layers, token_map, share", [
    ((0, 1, 2), None, True),
    ((2, 0, 1), torch.tensor([9, 3, 100, 5, 77, 300, 1, 2]), True),
    ((1, 0, 2), torch.tensor([40, 7, 6, 5]), False),
], ids=["full vocabulary", "draft vocabulary, layers out of order", "own lm_head, draft vocabulary"])
def test_eagle3_folder_recomputes_the_drafters_logits(tmp_path, layers, token_map, share):
    """The written files, run with the format's math (step 0 and one unrolled step), give the drafter's logits; the
    config and names are the format's, d2t maps draft ids to base ids and t2d marks them."""
    from medusa.io.speculators import export_speculators_eagle3, speculators_eagle3_logits

    heads, base, lm_head, embed = eagle_drafter(layers=layers, token_map=token_map, share=share)
    out = export_speculators_eagle3(heads, tmp_path / "eagle3", base, lm_head if share else None, embed)
    config, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (config["speculators_model_type"], config["architectures"]) == ("eagle3", ["Eagle3DraftModel"])
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-base"
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"], layer["head_dim"]) == (
        "llama", 1, V_BASE, 16)
    vocab = len(token_map) if token_map is not None else V_BASE
    assert config["draft_vocab_size"] == vocab and state["lm_head.weight"].shape == (vocab, 64)
    assert {"embed_tokens.weight", "fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.gate_proj.weight", "norm.weight"} <= set(state)
    if token_map is not None:
        assert torch.equal(torch.arange(vocab) + state["d2t"], token_map.sort().values)
        assert state["t2d"].dtype == torch.bool and state["t2d"].sum() == vocab and state["t2d"][token_map].all()
    else:
        assert "d2t" not in state and "t2d" not in state
    hidden_states, ids = torch.randn(10, 5, 64), torch.randint(0, V_BASE, (10,))  # (T, L + 1, H): layer i's input
    ours_in = torch.cat([hidden_states[:, -1]] + [hidden_states[:, i + 1] for i in layers], dim=-1)
    with torch.no_grad():
        ours = heads(ours_in, ids, steps=2)  # (2, T, Vh)
    theirs = speculators_eagle3_logits(config, state, hidden_states, ids, steps=2)  # (2, T - 1, V)
    columns = torch.arange(V_BASE) if token_map is None else token_map
    for j in range(2):
        torch.testing.assert_close(theirs[j, : 9 - j][:, columns], ours[j, : 9 - j])
    outside = torch.ones(V_BASE, dtype=torch.bool)
    outside[columns] = False
    assert torch.isneginf(theirs[..., outside]).all()


V_BASE = 320  # tests/tiny.py's vocabulary


def test_eagle3_export_writes_a_tied_bases_embedding_and_lm_head(tmp_path):
    """A base whose lm_head is its input embedding (tie_word_embeddings, as SmolLM2) hands the export one tensor for
    both names; the full-vocabulary folder holds it under each (safetensors writes no shared storage)."""
    from medusa.io.speculators import export_speculators_eagle3

    heads, base, lm_head, embed = eagle_drafter(tied=True)
    out = export_speculators_eagle3(heads, tmp_path / "eagle3", base, lm_head, embed)
    state = load_file(out / "model.safetensors")
    assert torch.equal(state["lm_head.weight"], lm_head) and torch.equal(state["embed_tokens.weight"], lm_head)


def with_base_setting(**setting):
    """A Llama-base drafter whose recorded base settings say otherwise (standing in for such a base)."""
    heads = eagle_drafter()[0]
    heads.config.eagle_base.update(setting)
    return heads


@pytest.mark.parametrize("make, message", [
    (lambda: eagle_drafter("gpt2", layers=(0, 1, 1))[0], "learned position embeddings .* rotary positions only"),
    (lambda: eagle_drafter("gemma3")[0], "norms are 'rms_unit_offset' .* RMSNorm"),
    (lambda: trained_heads(base_weight(), share=False), "head_type 'medusa' cannot be exported to the speculators"),
    (lambda: with_base_setting(hidden_act="gelu"), "activation is 'gelu': vLLM's Llama MLP.* SiLU only"),
    (lambda: with_base_setting(gated_mlp=False), "MLP is not gated"),
    (lambda: eagle_drafter(layers=(0, 1, 3))[0], "output of the base's last layer"),
    (lambda: eagle_drafter(layers=(0, 1, 1))[0], r"fuses base layers \[0, 1, 1\]: .* exactly 3 distinct"),
], ids=["gpt2 base", "gemma3 norm", "medusa heads", "activation", "mlp", "last layer", "repeated layer"])
def test_eagle3_export_refuses_what_the_format_cannot_hold(tmp_path, make, message):
    from medusa.io.speculators import export_speculators_eagle3

    with pytest.raises(FormatError, match=message):
        export_speculators_eagle3(make(), tmp_path / "eagle3")
    assert not (tmp_path / "eagle3").exists()


def test_eagle3_export_refuses_another_base(tmp_path):
    """A base config, lm_head or embedding other than the drafter's, or a base with a scaled rotary embedding, is
    refused, naming what differs."""
    from tiny import tiny_config

    from medusa.io.speculators import export_speculators_eagle3

    heads, base, lm_head, embed = eagle_drafter()
    with pytest.raises(FormatError, match="not the one the drafter was built for.*rope_theta"):
        export_speculators_eagle3(heads, tmp_path / "a", tiny_config(
            "llama", num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    scaled = tiny_config("llama", num_hidden_layers=4,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(FormatError, match="rotary embedding cannot be expressed.*'linear'"):
        export_speculators_eagle3(heads, tmp_path / "a", scaled)
    with pytest.raises(FormatError, match="not the one the drafter was trained on"):
        export_speculators_eagle3(heads, tmp_path / "b", base, lm_head + 1)
    with pytest.raises(FormatError, match="input embedding given .* is not the one the drafter reads"):
        export_speculators_eagle3(heads, tmp_path / "c", base, embed_weight=embed + 1)
    assert not any(tmp_path.iterdir())


def test_eagle3_export_catches_a_corrupted_weight(tmp_path, monkeypatch):
    """Weights written wrongly (here: one hidden_norm entry) are caught by the recomputation; nothing is written."""
    from medusa.io import speculators

    original = speculators._eagle3_state

    def corrupted(*args):
        state = original(*args)
        state["layers.0.hidden_norm.weight"] = state["layers.0.hidden_norm.weight"].clone()
        state["layers.0.hidden_norm.weight"][5] += 0.5
        return state

    monkeypatch.setattr(speculators, "_eagle3_state", corrupted)
    with pytest.raises(FormatError, match=r"do not reproduce the drafter's logits \(step 0\)"):
        speculators.export_speculators_eagle3(eagle_drafter()[0], tmp_path / "eagle3")
    assert not (tmp_path / "eagle3").exists()


def test_cli_exports_the_eagle_drafter_to_speculators_eagle3(tmp_path, capsys):
    from tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from medusa.drafters.eagle import eagle_base_settings
    from medusa.drafters.heads import build_heads

    base = save_tiny(tmp_path / "base", num_hidden_layers=4)
    model = AutoModelForCausalLM.from_pretrained(base)
    lm_head, embed = model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()
    config = MedusaHeadsConfig(hidden_size=64, vocab_size=V_BASE, num_heads=2, head_type="eagle",
                               eagle_layers=[0, 2, 1], eagle_base=eagle_base_settings(model.config), head_vocab_size=4,
                               lm_head_fingerprint=lm_head_fingerprint(lm_head))
    heads = build_heads(config, lm_head, embed, torch.tensor([5, 6, 7, 40]))
    heads_dir = save_heads(heads, tmp_path / "heads")
    args = ["export", "--format", "speculators-eagle3", "--heads", str(heads_dir)]
    assert cli.main(args + ["--out", str(tmp_path / "x")]) == 2
    assert "pass --base" in capsys.readouterr().err
    assert cli.main(args + ["--out", str(tmp_path / "eagle3"), "--base", str(base)]) == 0
    written = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert written["speculators_config"]["verifier"] == {"name_or_path": str(base),
                                                         "architectures": ["LlamaForCausalLM"]}
    assert written["draft_vocab_size"] == 4 and written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    medusa_dir = save_heads(trained_heads(base_weight(), share=False), tmp_path / "medusa")
    assert cli.main(["export", "--format", "speculators-eagle3", "--heads", str(medusa_dir), "--out",
                     str(tmp_path / "y"), "--base", str(base)]) == 2
    assert "head_type 'medusa'" in capsys.readouterr().err
