"""Damaged or foreign heads folders, tree files and run configs: an error naming the file, before the base loads.

Each case of docs/bad-inputs.md that is not covered next to its module is here. ``MedusaModel.from_pretrained`` is
called with base loading forbidden, so every error is proven to come before the base model is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import medusa.model
from medusa.drafters.heads import MedusaHeads, MedusaHeadsConfig, lm_head_fingerprint
from medusa.io.checkpoint import HEADS_CONFIG_NAME, HEADS_WEIGHTS_NAME, HeadsMismatchError, load_heads, save_heads
from medusa.model import MedusaModel
from train.config import load_config
from train.store import StoreError

H, V = 16, 64


@pytest.fixture
def weight():
    return torch.randn(V, H, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def heads_dir(tmp_path, weight):
    config = MedusaHeadsConfig(hidden_size=H, vocab_size=V, num_heads=3, num_layers=1,
                               lm_head_fingerprint=lm_head_fingerprint(weight))
    return save_heads(MedusaHeads(config, weight), tmp_path / "heads")


@pytest.fixture(autouse=True)
def no_base_loading(monkeypatch):
    def forbidden(*args, **kwargs):
        pytest.fail("the base model was loaded before the bad input was reported")

    monkeypatch.setattr(medusa.model, "load_base", forbidden)


def load(heads, tree=None):
    return MedusaModel.from_pretrained("unused-base", heads, tree=tree)


def edit_config(heads_dir: Path, change) -> None:
    path = heads_dir / HEADS_CONFIG_NAME
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# (damage applied to a valid heads folder, exception, message); every message must also name the file.
HEADS_CASES = {
    "weights truncated mid-data": (lambda d: truncate(d / HEADS_WEIGHTS_NAME, 0.6), ValueError,
                                   r"model.safetensors are damaged .*incomplete metadata"),
    "weights truncated mid-header": (lambda d: truncate(d / HEADS_WEIGHTS_NAME, 0.01), ValueError,
                                     "model.safetensors are damaged"),
    "weights empty": (lambda d: (d / HEADS_WEIGHTS_NAME).write_bytes(b""), ValueError,
                      "model.safetensors are damaged"),
    "weights not safetensors": (lambda d: (d / HEADS_WEIGHTS_NAME).write_bytes(b"PK\x03\x04 a zip file" * 10),
                                ValueError, "model.safetensors are damaged"),
    "config misses hidden_size": (lambda d: edit_config(d, lambda c: c.pop("hidden_size")), ValueError,
                                  r"config.json misses the required field 'hidden_size'"),
    "config num_heads is a string": (lambda d: edit_config(d, lambda c: c.update(num_heads="3")), ValueError,
                                     r"config.json: field 'num_heads' must be int, got '3'"),
    "config share_lm_head is a string": (lambda d: edit_config(d, lambda c: c.update(share_lm_head="yes")),
                                         ValueError, r"field 'share_lm_head' must be bool"),
    "config head_vocab_size is a float": (lambda d: edit_config(d, lambda c: c.update(head_vocab_size=8.5)),
                                          ValueError, r"field 'head_vocab_size' must be int or null"),
    "config num_heads is zero": (lambda d: edit_config(d, lambda c: c.update(num_heads=0)), ValueError,
                                 r"config.json: num_heads must be a positive integer"),
    "config hidden_size disagrees with weights": (lambda d: edit_config(d, lambda c: c.update(hidden_size=32)),
                                                  HeadsMismatchError, r"linear.\w+ has shape .* from its config.json"),
    "config num_layers disagrees with weights": (lambda d: edit_config(d, lambda c: c.update(num_layers=2)),
                                                 HeadsMismatchError, r"missing keys \['blocks.0.1.linear.bias'"),
    "config says truncated vocab, no token_map": (lambda d: edit_config(d, lambda c: c.update(head_vocab_size=8)),
                                                  HeadsMismatchError, r"missing keys \['token_map'\]"),
    "config not valid JSON": (lambda d: (d / HEADS_CONFIG_NAME).write_text('{"hidden_size": 16,'), ValueError,
                              "config.json is not valid JSON"),
    "config a JSON list": (lambda d: (d / HEADS_CONFIG_NAME).write_text("[16, 64]"), ValueError,
                           "config.json must be a JSON object, got list"),
    "config missing": (lambda d: (d / HEADS_CONFIG_NAME).unlink(), FileNotFoundError,
                       "Medusa heads config not found: .*config.json"),
    "weights missing": (lambda d: (d / HEADS_WEIGHTS_NAME).unlink(), FileNotFoundError,
                        "no Medusa heads weights at .*model.safetensors"),
}


@pytest.mark.parametrize("case", HEADS_CASES, ids=list(HEADS_CASES))
def test_damaged_heads_folder_is_reported_before_the_base_loads(heads_dir, case):
    damage, error, message = HEADS_CASES[case]
    damage(heads_dir)
    with pytest.raises(error, match=message) as info:
        load(heads_dir)
    assert str(heads_dir) in str(info.value)


def fasterdecoding_medusa(folder: Path) -> Path:
    """The layout of FasterDecoding/Medusa: medusa_* config keys and medusa_lm_head.safetensors."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    save_file({"0.0.linear.weight": torch.zeros(H, H), "0.0.linear.bias": torch.zeros(H),
               "0.1.weight": torch.zeros(V, H)}, folder / "medusa_lm_head.safetensors")
    return folder


def vllm_medusa(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1,
                                                    "hidden_size": H, "vocab_size": V}))
    save_file({"blocks.0.layers.0.weight": torch.zeros(H, H), "lm_heads.0.weight": torch.zeros(V, H)},
              folder / "model.safetensors")
    return folder


def base_model_folder(folder: Path) -> Path:
    from tests.tiny import tiny_model

    tiny_model("llama").save_pretrained(folder)
    return folder


def fasterdecoding_weights_only(folder: Path) -> Path:
    fasterdecoding_medusa(folder)
    (folder / "config.json").unlink()
    return folder


FOREIGN_CASES = {
    "FasterDecoding/Medusa": (fasterdecoding_medusa, r"config.json has medusa_num_heads.* is a FasterDecoding/Medusa "
                                                     r"checkpoint, not this project's heads format"),
    "FasterDecoding/Medusa weights only": (fasterdecoding_weights_only,
                                           r"medusa_lm_head.safetensors: .* is a FasterDecoding/Medusa checkpoint"),
    "vLLM Medusa": (vllm_medusa, r"config.json has model_type 'medusa': .* is a vLLM Medusa checkpoint"),
    "a base model folder": (base_model_folder, r"config.json has model_type 'llama': .* looks like a model folder"),
}


@pytest.mark.parametrize("case", FOREIGN_CASES, ids=list(FOREIGN_CASES))
def test_folder_in_another_format_is_named(tmp_path, case):
    build, message = FOREIGN_CASES[case]
    folder = build(tmp_path / "foreign")
    with pytest.raises(ValueError, match=message):
        load(folder)


def test_missing_heads_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="Medusa heads folder not found: .*nowhere"):
        load(tmp_path / "nowhere")


def test_non_finite_weights_are_refused(heads_dir, weight):
    state = load_file(heads_dir / HEADS_WEIGHTS_NAME)
    state["blocks.1.0.linear.weight"][0, 0] = float("nan")
    save_file(state, heads_dir / HEADS_WEIGHTS_NAME)
    with pytest.raises(ValueError, match=r"model.safetensors: blocks.1.0.linear.weight holds NaN or infinite"):
        load_heads(heads_dir, weight)


TREE_CASES = {
    "a path is not a list": ('{"paths": [0, 1]}', "every path must be a list of integer ranks, got 0"),
    "a rank is a float": ('{"paths": [[0], [0.5]]}', r"every path must be a list of integer ranks, got \[0.5\]"),
    "a rank is a string": ('{"paths": [["0"]]}', "every path must be a list of integer ranks"),
    "a rank is negative": ('{"paths": [[-1]]}', "has a rank that is not a non-negative int"),
    "name is not a string": ('{"paths": [[0]], "name": 3}', "'name' must be a string"),
    "deeper than the heads": ('{"paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}', "depth 4 but the model has only 3"),
}


@pytest.mark.parametrize("case", TREE_CASES, ids=list(TREE_CASES))
def test_bad_tree_file_is_reported_before_the_base_loads(heads_dir, tmp_path, case):
    content, message = TREE_CASES[case]
    tree = tmp_path / "tree.json"
    tree.write_text(content)
    with pytest.raises(ValueError, match=message):
        load(heads_dir, tree=tree)


def test_tree_file_errors_name_the_file(tmp_path):
    from medusa.decode.tree import load_tree

    tree = tmp_path / "bad-tree.json"
    tree.write_text('{"paths": [[0, 0]]}')
    with pytest.raises(ValueError, match=r"tree file .*bad-tree.json: .*has no parent"):
        load_tree(tree)


@pytest.mark.parametrize("content, message", [
    ("base: m\nmax_steps: [1, 2\n", r"config file .*run.yaml is not valid YAML"),
    ("base: m\nmax_steps: ten\n", r"config file .*run.yaml: max_steps: expected int, got 'ten'"),
    ("base: m\nshare_lm_head: maybe\n", r"config file .*run.yaml: share_lm_head: expected bool"),
    ("- base: m\n", r"run.yaml: expected a mapping of TrainConfig fields, got list"),
])
def test_bad_run_config_names_the_file(tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_catalogue_names_only_tests_that_exist():
    """Every test docs/bad-inputs.md cites exists, and the catalogue holds at least 30 cases."""
    import re

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "bad-inputs.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 30
    cited = re.findall(r"(test_\w+)::(test_\w+)", text)
    assert cited
    for module, name in cited:
        source = (root / "tests" / f"{module}.py").read_text()
        assert f"def {name}(" in source, f"docs/bad-inputs.md cites {module}::{name}, which does not exist"


@pytest.mark.parametrize("argv, message", [
    (["distill", "--base", "nowhere", "--data", "nowhere.jsonl", "--out-dir", "out", "--skip-conversations", "-1"],
     "--skip-conversations must be >= 0, got -1"),
    (["profile", "--base", "nowhere", "--step-size", "0"], "--step-size values must be >= 1, got [0]"),
    (["profile", "--base", "nowhere", "--engines", "static", "turbo"], "unknown engine(s) turbo: choose from"),
])
def test_profile_and_split_flags_are_refused_by_name_before_anything_loads(argv, message, capsys):
    from medusa.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("field", ["validation_fraction", "held_out_fraction"])
def test_split_fractions_outside_zero_one_are_refused(field):
    from train.config import TrainConfig

    for value in (-0.1, 1.0):
        with pytest.raises(ValueError, match=f"{field} must be in \\[0, 1\\), got {value}"):
            TrainConfig(base="b", data="d", output_dir="o", **{field: value})


def _write_calibration(heads_dir: Path, text: str | None = None) -> Path:
    from medusa.drafters.calibration import CALIBRATION_FILE_NAME

    path = heads_dir / CALIBRATION_FILE_NAME
    path.write_text(text if text is not None else json.dumps({"version": 1}))
    return path


@pytest.mark.parametrize("extra, calibrated, message", [
    (["--tree", "T", "--per-step-tree", "on"], True, "--tree forces one fixed tree every step and --per-step-tree on"),
    (["--tree", "T", "--max-tree-nodes", "8"], True, "--max-tree-nodes sizes the per-step tree, but --tree forces"),
    (["--max-tree-nodes", "0"], True, "--max-tree-nodes must be >= 1, got 0"),
    (["--per-step-tree", "on"], False, "--per-step-tree on needs"),
    (["--per-step-tree", "off", "--max-tree-nodes", "8"], True, "--max-tree-nodes sizes the per-step tree, which is "
                                                                "off here"),
    ([], "damaged", "is damaged"),
])
def test_per_step_flags_that_contradict_are_refused_before_the_base_loads(heads_dir, extra, calibrated, message,
                                                                          capsys, monkeypatch):
    import medusa.cli

    monkeypatch.setattr(medusa.model.MedusaModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the bad flags were reported"))
    if calibrated == "damaged":
        _write_calibration(heads_dir, '{"heads": {"num_heads": 3}, "top_k": 8, "accuracy": [[0.5')
    elif calibrated:
        _write_calibration(heads_dir)
    argv = ["generate", "--base", "nowhere", "--heads", str(heads_dir), "--prompt", "hi", *extra]
    assert medusa.cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    if calibrated is False:
        assert "medusa calibrate" in err  # and how to make one


def test_per_step_from_python_is_refused_before_the_base_loads(heads_dir, tmp_path):
    with pytest.raises(ValueError, match="per_step=True needs .*calibration.json"):
        MedusaModel.from_pretrained("unused-base", heads_dir, per_step=True)
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"paths": [[0]]}))
    with pytest.raises(ValueError, match="a tree forces one fixed tree every step, and per_step=True"):
        MedusaModel.from_pretrained("unused-base", heads_dir, tree=tree, per_step=True)
    _write_calibration(heads_dir, '{"version": 1, "heads": {}, "top_k": 8, "accuracy": [[NaN]]}')
    with pytest.raises(ValueError, match="calibration file .* is damaged"):
        MedusaModel.from_pretrained("unused-base", heads_dir)  # found in the folder: the per-step tree, refused


@pytest.mark.parametrize("flag, value, message", [
    ("--top-k", "0", "--top-k must be >= 1"), ("--lookup-length", "-1", "--lookup-length >= 0"),
    ("--lookup-ngram", "0", "--lookup-ngram >= 1"),
])
def test_calibrate_flags_are_refused_by_name(heads_dir, flag, value, message, capsys):
    from medusa.cli import main

    argv = ["calibrate", "--base", "nowhere", "--heads", str(heads_dir), "--data", "nowhere.jsonl", flag, value]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _valid_calibration(heads_dir: Path, **changes) -> Path:
    """A calibration that matches the fixture's heads (from their files), with ``changes`` to its identity."""
    from medusa.drafters.calibration import CONFIDENCE_EDGES, Calibration, folder_identity, save_calibration

    bins = len(CONFIDENCE_EDGES) - 1
    identity = {**folder_identity(heads_dir), **changes}
    calibration = Calibration(identity, 4, [[0.5] * 4] * 3, [[0.5] * bins] * 3, [[1] * bins] * 3, 3, [[0.5] * 4] * 4,
                              [[1] * 4] * 4)
    return save_calibration(calibration, heads_dir / "calibration.json")


@pytest.mark.parametrize("changes, extra, message", [
    ({"num_heads": 4}, [], "was measured for other heads (num_heads: calibrated 4, heads 3"),
    ({"weights_sha256": "0" * 64}, [], "weights_sha256"),
    ({}, ["--lookup", "9"], "--lookup 9: the heads' calibration measured the lookup chain at 4 positions"),
    ({}, ["--lookup-ngram", "2"], "--lookup-ngram 2: the heads' calibration measured the lookup chain with n-grams "
                                  "up to 3"),
])
def test_a_calibration_that_does_not_fit_is_refused_before_the_base_loads(heads_dir, changes, extra, message,
                                                                           capsys, monkeypatch):
    import medusa.cli
    from medusa.drafters.calibration import CalibrationMismatchError

    if changes.get("num_heads"):  # the tables must hold as many depths as the identity names
        from medusa.drafters.calibration import CONFIDENCE_EDGES, Calibration, folder_identity, save_calibration

        bins = len(CONFIDENCE_EDGES) - 1
        save_calibration(Calibration({**folder_identity(heads_dir), **changes}, 4, [[0.5] * 4] * 4,
                                     [[0.5] * bins] * 4, [[1] * bins] * 4, 3, [[0.5] * 4] * 4, [[1] * 4] * 4),
                         heads_dir / "calibration.json")
    else:
        _valid_calibration(heads_dir, **changes)
    if not extra:
        with pytest.raises(CalibrationMismatchError, match=message.split(" (")[0]):
            MedusaModel.from_pretrained("unused-base", heads_dir)
    monkeypatch.setattr(medusa.model.MedusaModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the calibration was refused"))
    argv = ["generate", "--base", "nowhere", "--heads", str(heads_dir), "--prompt", "hi", *extra]
    assert medusa.cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "2"], "--fixed-tree times a fixed tree beside the per-step one in the one-prompt bench"),
    (["--do-sample"], "the fixed-tree comparison is greedy only"),
    ([], "has depth 5 but the model has only 3 heads"),
])
def test_bench_fixed_tree_flags_are_refused_before_the_base_loads(heads_dir, tmp_path, extra, message, capsys):
    from medusa.cli import main
    from medusa.decode.tree import Tree, save_tree

    tree = tmp_path / "fixed.json"
    save_tree(Tree.chain(5 if not extra else 2), tree)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    argv = ["bench", "--base", "nowhere", "--heads", str(heads_dir), "--prompts", str(prompts), "--fixed-tree",
            str(tree), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_calibrate_top_k_beyond_the_heads_vocabulary_is_refused(heads_dir, capsys):
    from medusa.cli import main

    argv = ["calibrate", "--base", "nowhere", "--heads", str(heads_dir), "--data", "nowhere.jsonl", "--top-k", "65"]
    assert main(argv) == 2
    assert "--top-k 65 is more than the heads' vocabulary of 64 tokens" in capsys.readouterr().err


# --- the eagle drafter in training (head_type eagle) ---------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"head_type": "eagle", "ttt_steps": 0}, "ttt_steps must be >= 1, got 0"),
    ({"head_type": "eagle", "ttt_steps": -2}, "ttt_steps must be >= 1, got -2"),
    ({"head_type": "hydra", "ttt_steps": 5}, "ttt_steps belong to head_type eagle, not 'hydra'"),
    ({"eagle_layers": [1, 2]}, "eagle_layers belong to head_type eagle, not 'medusa'"),
    ({"head_type": "eagle", "eagle_layers": [1, -1]}, r"eagle_layers must be a non-empty list of decoder layer "
                                                      r"indices >= 0 \(or null\), got \[1, -1\]"),
    ({"head_type": "eagle", "eagle_layers": "1,x"}, r"eagle_layers: expected int, got 'x'"),
    ({"head_type": "eagle", "num_layers": 2}, "head_type eagle is one decoder layer: num_layers must be 1, got 2"),
    ({"head_type": "eagle", "share_lm_head": False}, "head_type eagle projects every depth with one lm_head"),
    ({"head_type": "eagle", "training_mode": "medusa2"}, "head_type eagle reads intermediate base layers"),
], ids=["ttt_steps 0", "ttt_steps -2", "ttt_steps for hydra", "eagle_layers for medusa", "negative layer",
        "layer not an int", "num_layers 2", "own lm_heads", "medusa2"])
def test_bad_eagle_training_fields_are_refused_when_the_config_is_built(fields, message):
    from train.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(base="b", data="d", output_dir="o", **fields)


@pytest.fixture
def no_data_work(monkeypatch):
    """Fail the test if the trainer reads its data: the bad input must be refused as soon as the base loads."""
    import train.setup as setup_module

    monkeypatch.setattr(setup_module, "prepare_conversations",
                        lambda *a, **k: pytest.fail("the data was read before the bad input was reported"))


@pytest.mark.parametrize("arch, fields, message", [
    ("llama", {"eagle_layers": [0, 5]}, r"eagle_layers: layer 5 is outside the base's 2 decoder layers \(0 .. 1\)"),
    ("llama", {"eagle_layers": [2, 3, 1]}, r"eagle_layers: layers 2, 3 are outside the base's 2 decoder layers"),
    ("gpt2", {"train_window": 16}, r"train_window=16 with head_type eagle needs a base with rotary positions: this "
                                   r"gpt2 base has learned positions"),
], ids=["layer 5 of 2", "layers 2 and 3 of 2", "window on learned positions"])
def test_eagle_settings_the_base_cannot_serve_are_refused_before_the_data_is_read(tmp_path, no_data_work, arch,
                                                                                 fields, message):
    from tests.tiny import save_tiny
    from train.trainer import train

    config = load_config(overrides={"base": str(save_tiny(tmp_path / arch, arch)), "data": "unread.jsonl",
                                    "output_dir": str(tmp_path / "run"), "head_type": "eagle",
                                    "mixed_precision": "no", **fields})
    with pytest.raises(ValueError, match=message):
        train(config)


def test_a_store_built_with_other_layers_is_refused_by_the_trainer(tmp_path):
    """An eagle run pointed at a store of the last hidden states alone (a Medusa run's) is refused naming both
    layer lists, before any training step."""
    import train.loop as loop_module
    from tests.test_train import make_config, write_chats
    from tests.tiny import save_tiny, tiny_tokenizer
    from train.trainer import train

    base, chats = save_tiny(tmp_path / "llama", "llama"), write_chats(tmp_path / "chats.jsonl")
    store = str(tmp_path / "store")
    train(make_config(base, chats, tmp_path / "medusa", hidden_state_store=store, max_steps=1, eval_every=0),
          tokenizer=tiny_tokenizer())
    eagle = make_config(base, chats, tmp_path / "eagle", hidden_state_store=store, head_type="eagle",
                        eagle_layers=[1, 0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop_module, "train_step", lambda *a: pytest.fail("a training step ran"))
        with pytest.raises(StoreError, match=r"store/meta.json: a store built with other layers: it holds the base "
                                             r"states of layers \[\], the heads read layers \[1, 0\]"):
            train(eagle, tokenizer=tiny_tokenizer())
