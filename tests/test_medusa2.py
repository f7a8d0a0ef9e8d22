"""Medusa-2 on a tiny Llama: only the LoRA and the heads move, the KL holds the adapted base near the original, the
merged model equals the adapter model and decodes exactly, LoRA state resumes, bad LoRA settings are refused."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from medusa.io.adapter import merge_adapter, write_merged
from medusa.model import MedusaModel
from medusa.tools.drift import drift
from tests.test_train import make_config
from tests.tiny import tiny_tokenizer
from train.config import load_config
from train.trainer import train

M2 = dict(training_mode="medusa2", lora_rank=4, lora_alpha=8.0, lora_learning_rate=1e-2, stage1_steps=1,
          heads_loss_warmup_steps=2, lora_target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def trained(base_dir, chats, tmp_path_factory):
    """A Medusa-2 run (1 stage-1 step, 3 joint steps) and snapshots of the base before it."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    out = tmp_path_factory.mktemp("m2") / "run"
    heads_dir = train(make_config(base_dir, chats, out, **M2), model, tiny_tokenizer())
    return {"out": out, "heads": heads_dir, "adapter": out / "adapter", "before": before}


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits  # (1, T, V)


def test_only_lora_and_heads_move(trained, base_dir):
    for name, (param, snapshot) in trained["before"].items():
        assert torch.equal(param.detach(), snapshot), f"base parameter {name} moved"
        assert not param.requires_grad, name
    lora = load_file(trained["adapter"] / "adapter_model.safetensors")
    b_weights = [v for k, v in lora.items() if "lora_B" in k]
    assert b_weights and all(v.abs().sum() > 0 for v in b_weights), "LoRA B starts at zero: training moved each one"
    assert {k.split(".")[-3] for k in lora if "lora_A" in k} == {"q_proj", "v_proj", "down_proj"}
    heads = load_file(trained["heads"] / "model.safetensors")
    assert all(heads[f"blocks.{k}.0.linear.weight"].abs().sum() > 0 for k in range(3))
    saved = json.loads((trained["heads"] / "config.json").read_text())["training"]["config"]
    assert saved["training_mode"] == "medusa2" and saved["lora_rank"] == 4


def test_lora_gets_its_own_learning_rate_and_heads_weight_warms_up(base_dir, chats, tmp_path):
    from train.medusa2 import heads_loss_weight
    from train.setup import setup

    config = make_config(base_dir, chats, tmp_path / "run", **{**M2, "lora_learning_rate": 1e-3})
    run = setup(config)
    lora = {id(p) for p in run.lora_params}
    assert lora and all(p.requires_grad for p in run.lora_params)
    for group in run.optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        assert ids <= lora or not ids & lora, "a group mixes LoRA and head parameters"
        assert group["initial_lr"] == (1e-3 if ids <= lora else 1e-2)
    assert sum(len(g["params"]) for g in run.optimizer.param_groups if {id(p) for p in g["params"]} <= lora) == \
        len(run.lora_params)
    assert [heads_loss_weight(config, s) for s in range(4)] == [1.0, 0.5, 1.0, 1.0]


def test_large_kl_weight_keeps_the_adapted_logits_near_the_original(base_dir, chats, tmp_path):
    ids = torch.tensor([[1, 5, 9, 40, 77, 3, 120, 200, 8, 2]])
    original = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    reference = logits_of(original, ids)
    gaps = {}
    for kl_weight in (0.0, 1000.0):
        overrides = {**M2, "stage1_steps": 0, "heads_loss_warmup_steps": 0, "lora_learning_rate": 3e-3}
        out = tmp_path / f"kl{kl_weight}"
        train(make_config(base_dir, chats, out, kl_weight=kl_weight, max_steps=6, **overrides))
        adapted = merge_adapter(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                out / "adapter").eval()
        # Adam moves every LoRA weight by about the learning rate per step whatever the loss scale: the KL bounds
        # the drift, it does not pin it at zero.
        gaps[kl_weight] = (logits_of(adapted, ids) - reference).abs().max().item()
    assert gaps[1000.0] < 0.2, gaps
    assert gaps[1000.0] < gaps[0.0] / 2, gaps


def test_merged_model_equals_the_adapter_model_and_decodes_like_hf(trained, base_dir, tmp_path):
    from peft import PeftModel

    merged_dir = write_merged(base_dir, trained["adapter"], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                             str(trained["adapter"])).eval()
    ids = torch.tensor([[1, 5, 9, 40, 77, 3, 120, 200, 8, 2]])
    torch.testing.assert_close(logits_of(merged, ids), logits_of(with_adapter, ids), rtol=0, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    assert not torch.allclose(logits_of(merged, ids), logits_of(original, ids), atol=1e-4), "the LoRA changed nothing"

    prompt = torch.tensor([1, 3, 60, 61, 62, 2, 3, 70])
    expected = merged.generate(prompt[None], max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    for model in (MedusaModel.from_pretrained(base_dir, trained["heads"], adapter=trained["adapter"]),
                  MedusaModel.from_pretrained(merged_dir, trained["heads"])):
        tokens, _ = model.generate(prompt, max_new_tokens=24, stop_token_ids=set(), do_sample=False)
        assert tokens == expected


def test_drift_reports_agreement_and_nll(trained, base_dir):
    original = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    adapted = merge_adapter(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                            trained["adapter"]).eval()
    sequences = [([1, 5, 9, 40, 77, 3, 120, 200, 8, 2], 4), ([1, 7, 7, 30, 31, 32], 2)]
    same = drift(original, original, sequences)
    assert same["top1_agreement"] == 1.0 and same["adapted_nll"] == same["original_nll"]
    assert same["tokens"] == 6 + 4
    moved = drift(original, adapted, sequences)
    assert 0 <= moved["top1_agreement"] <= 1 and moved["adapted_nll"] != moved["original_nll"]


def test_resume_continues_the_lora_exactly(base_dir, chats, tmp_path):
    straight = tmp_path / "straight"
    train(make_config(base_dir, chats, straight, **M2))
    resumed = tmp_path / "resumed"
    train(make_config(base_dir, chats, resumed, **{**M2, "max_steps": 2}))
    assert (resumed / "checkpoints" / "step_2" / "adapter" / "adapter_model.safetensors").is_file()
    train(make_config(base_dir, chats, resumed, **M2))
    for name in ("adapter/adapter_model.safetensors", "heads/model.safetensors"):
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_resume_with_another_lora_rank_is_refused(base_dir, chats, tmp_path):
    out = tmp_path / "run"
    train(make_config(base_dir, chats, out, **{**M2, "max_steps": 2}))
    with pytest.raises(ValueError, match=r"lora_rank: checkpoint 4 != now 8"):
        train(make_config(base_dir, chats, out, **{**M2, "lora_rank": 8}))
    # A checkpoint whose adapter disagrees with its own recorded config is refused by the adapter check too.
    config_path = out / "checkpoints" / "step_2" / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "r": 2}))
    with pytest.raises(ValueError, match=r"its LoRA has rank 2, the config asks lora_rank=4"):
        train(make_config(base_dir, chats, out, **{**M2, "max_steps": 3}))


@pytest.mark.parametrize("targets, message", [
    (("q_proj", "nope_proj"), r"lora_target_modules \['nope_proj'\] match no module of the base \(LlamaForCausalLM\)"),
    (("q_proj", "lm_head"), r"match \['lm_head'\]: the heads share the base's lm_head"),
    (("embed_tokens",), r"match \['model.embed_tokens'\]: the heads share"),
], ids=["missing module", "lm_head", "embeddings"])
def test_bad_lora_target_modules_are_refused(base_dir, chats, tmp_path, targets, message):
    with pytest.raises(ValueError, match=message):
        train(make_config(base_dir, chats, tmp_path / "run", **{**M2, "lora_target_modules": targets}))
    assert not (tmp_path / "run" / "heads").exists()


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_state_store": "outputs/stores/x"}, r"medusa2 adapts the base.*hidden_state_store"),
    ({"cache_hidden_states": True}, r"medusa2 adapts the base.*cache_hidden_states"),
    ({"lora_rank": 0}, r"lora_rank must be >= 1"),
    ({"lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
    ({"lora_target_modules": ""}, r"lora_target_modules must name modules"),
    ({"training_mode": "medusa3"}, r"training_mode must be one of \['medusa1', 'medusa2'\]"),
    ({"lora_target_modules": 5}, r"lora_target_modules: expected a list of strings"),
], ids=["store", "cache", "rank 0", "dropout 1", "no targets", "unknown mode", "targets not strings"])
def test_bad_medusa2_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, {"base": "b", "training_mode": "medusa2", **overrides})


def test_yaml_list_and_cli_string_give_the_same_targets(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: b\ntraining_mode: medusa2\nlora_target_modules: [q_proj, v_proj]\n")
    assert load_config(path).lora_target_modules == ("q_proj", "v_proj")
    for flag in ("k_proj, o_proj", "[k_proj, o_proj]", "['k_proj', 'o_proj']"):
        assert load_config(path, {"lora_target_modules": flag}).lora_target_modules == ("k_proj", "o_proj"), flag


def test_init_heads_of_another_shape_are_refused(trained, base_dir, chats, tmp_path):
    with pytest.raises(ValueError, match=r"init_heads .* do not fit the config: num_heads: heads 3 != config 2"):
        train(make_config(base_dir, chats, tmp_path / "run", init_heads=str(trained["heads"]), num_heads=2, **M2))


def test_stage2_starts_from_the_init_heads(trained, base_dir, chats, tmp_path):
    from train.setup import setup

    config = make_config(base_dir, chats, tmp_path / "run", **{**M2, "stage1_steps": 0},
                         init_heads=str(trained["heads"]))
    run = setup(config)
    start = load_file(trained["heads"] / "model.safetensors")
    state = run.accelerator.unwrap_model(run.heads).state_dict()
    assert all(torch.equal(state[k], v) for k, v in start.items())


def test_a_checkpoint_from_before_medusa2_still_resumes():
    from train.config import TrainConfig, resume_mismatch

    new_fields = {"training_mode", "init_heads", "stage1_steps", "lora_target_modules", "lora_rank", "lora_alpha",
                  "lora_dropout", "lora_learning_rate", "kl_weight", "heads_loss_warmup_steps"}
    older = {k: v for k, v in TrainConfig(base="m").to_dict().items() if k not in new_fields}
    assert resume_mismatch(older, TrainConfig(base="m")) == []
    assert resume_mismatch(older, TrainConfig(base="m", training_mode="medusa2")) == [
        "training_mode: checkpoint 'medusa1' != now 'medusa2'"]


def test_missing_adapter_or_busy_merge_folder_is_refused(trained, base_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"LoRA adapter folder not found: .*nowhere"):
        MedusaModel.from_pretrained(base_dir, trained["heads"], adapter=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"is not a peft adapter folder: adapter_config.json is missing"):
        MedusaModel.from_pretrained(base_dir, trained["heads"], adapter=trained["heads"].parent / "checkpoints")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"exists and is not empty"):
        write_merged(base_dir, trained["adapter"], busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_merge_drift_and_bench_commands(trained, base_dir, tmp_path, capsys):
    from medusa.cli import main

    data = tmp_path / "held.jsonl"
    data.write_text("\n".join(json.dumps({"id": str(i), "prompt_ids": [1, 3, 60 + i], "response_ids": [70, 71, 72, i]})
                              for i in range(3)) + "\n")
    merged = tmp_path / "merged"
    assert main(["merge", "--base", str(base_dir), "--adapter", str(trained["adapter"]), "--out", str(merged)]) == 0
    out = tmp_path / "drift.json"
    assert main(["drift", "--base", str(base_dir), "--adapted", str(merged), "--data", str(data),
                 "--out", str(out)]) == 0
    by_merged = json.loads(out.read_text())
    assert main(["drift", "--base", str(base_dir), "--adapter", str(trained["adapter"]), "--data", str(data),
                 "--out", str(out)]) == 0
    by_adapter = json.loads(out.read_text())
    assert by_merged["tokens"] == 12 and by_merged["top1_agreement"] == by_adapter["top1_agreement"]
    assert abs(by_merged["adapted_nll"] - by_adapter["adapted_nll"]) < 1e-5
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    bench = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base_dir), "--heads", str(trained["heads"]), "--adapter",
                 str(trained["adapter"]), "--prompts", str(prompts), "--max-new-tokens", "8", "--warmup", "0",
                 "--drift-data", str(data), "--out", str(bench)]) == 0
    result = json.loads(bench.read_text())
    assert result["identical"] == 1.0 and result["drift"]["original"] == str(base_dir)
    assert result["drift"]["top1_agreement"] == by_adapter["top1_agreement"]
    assert "drift from" in capsys.readouterr().out
