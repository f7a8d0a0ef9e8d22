"""Training config: YAML < CLI precedence, unknown keys rejected, shipped configs load."""

import argparse
from pathlib import Path

import pytest

from train.cli import add_train_arguments, config_from_args
from train.config import TrainConfig, field_docs, load_config, resume_mismatch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_yaml_key_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys .*\['lerning_rate'\]"):
        load_config(write(tmp_path, "base: m\nlerning_rate: 0.1\n"))
    with pytest.raises(ValueError, match="unknown keys in overrides"):
        load_config(None, {"base": "m", "nope": 1})


def test_precedence_defaults_yaml_cli(tmp_path):
    path = write(tmp_path, "base: m\nlearning_rate: 1e-4\nmax_steps: 7\nhead_vocab_size: null\n")
    cfg = load_config(path, {"max_steps": 3, "batch_size": None})
    assert cfg.learning_rate == 1e-4  # PyYAML reads "1e-4" as a string: coerced
    assert cfg.max_steps == 3 and cfg.batch_size == TrainConfig.batch_size and cfg.head_vocab_size is None


def test_cli_flags_override_yaml(tmp_path):
    path = write(tmp_path, "base: m\nnum_heads: 5\nshare_lm_head: true\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--num-heads", "3", "--no-share-lm-head",
                              "--head-vocab-size", "none", "--learning-rate", "2e-3", "--output-dir", "o"])
    cfg = config_from_args(args)
    assert (cfg.num_heads, cfg.share_lm_head, cfg.head_vocab_size, cfg.learning_rate) == (3, False, None, 2e-3)
    assert cfg.output_dir == "o"
    # Every field has a flag.
    flags = {a.dest for a in parser._actions}
    assert set(TrainConfig.__dataclass_fields__) <= flags


def test_validation_errors():
    with pytest.raises(ValueError, match="base"):
        TrainConfig()
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainConfig(base="m", mixed_precision="fp8")
    with pytest.raises(ValueError, match="num_heads"):
        TrainConfig(base="m", num_heads=0)
    with pytest.raises(ValueError, match="expected int"):
        TrainConfig(base="m", max_steps="ten")
    with pytest.raises(ValueError, match="expected int"):
        TrainConfig(base="m", max_steps=True)


def test_every_field_has_a_docstring():
    assert set(field_docs()) == set(TrainConfig.__dataclass_fields__)


def test_resume_mismatch_ignores_resumable_fields():
    stored = TrainConfig(base="m").to_dict()
    assert resume_mismatch(stored, TrainConfig(base="m", max_steps=9, tracker="tensorboard", output_dir="x")) == []
    problems = resume_mismatch(stored, TrainConfig(base="m", learning_rate=0.5, num_heads=2))
    assert [p.split(":")[0] for p in problems] == ["learning_rate", "num_heads"]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.base


@pytest.mark.parametrize("path", [p for p in sorted(CONFIGS.glob("*.yaml")) if load_config(p).init_heads],
                         ids=lambda p: p.name)
def test_a_config_starting_from_committed_heads_fits_them(path):
    """A config whose ``init_heads`` is a committed heads folder must match that folder's head type, count and
    layers (the check :func:`train.setup.check_init_heads` makes at the start of the run), so that swapping the
    shipped heads cannot leave a documented recipe that fails at its first step."""
    from medusa.io.checkpoint import read_heads_config
    from train.setup import check_init_heads

    cfg = load_config(path)
    folder = CONFIGS.parent / cfg.init_heads
    if not (folder / "config.json").is_file():
        pytest.skip(f"{cfg.init_heads} is not committed (made by an earlier run)")
    heads = read_heads_config(folder)
    # the eagle drafter's fused layers are checked against the base's when it loads (not committed); the rest here
    check_init_heads(cfg, heads, tuple(heads.eagle_layers or ()))
    assert cfg.head_vocab_size == heads.head_vocab_size, "head_vocab_size differs from the committed heads'"


def test_shipped_configs_exist():
    assert {"smollm2-135m-medusa.yaml", "quickstart.yaml"} <= {p.name for p in CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(path)).num_processes >= 1


def test_drafter_is_a_validated_synonym_of_head_type(tmp_path):
    assert load_config(write(tmp_path, "base: m\ndrafter: hydra\n")).head_type == "hydra"
    assert load_config(write(tmp_path, "base: m\ndrafter: eagle\nhead_type: eagle\n")).head_type == "eagle"
    with pytest.raises(ValueError, match="drafter 'eagle' and head_type 'hydra' name the same setting"):
        load_config(write(tmp_path, "base: m\ndrafter: eagle\nhead_type: hydra\n"))
    with pytest.raises(ValueError, match=r"head_type must be one of .*got 'nope'"):
        load_config(write(tmp_path, "base: m\ndrafter: nope\n"))
    parser = add_train_arguments(argparse.ArgumentParser())
    yaml_path = write(tmp_path, "base: m\ndrafter: hydra\n")
    assert config_from_args(parser.parse_args(["--config", str(yaml_path), "--drafter", "medusa"])).head_type == \
        "medusa"  # the command line overrides the YAML file, under either name
    with pytest.raises(ValueError, match="overrides: drafter 'eagle' and head_type 'hydra'"):
        config_from_args(parser.parse_args(["--config", str(yaml_path), "--drafter", "eagle", "--head-type",
                                            "hydra"]))
