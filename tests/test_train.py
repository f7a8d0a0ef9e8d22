"""Training end to end on a tiny Llama: frozen base, heads move, checkpoints resume, heads load, 2-process DDP."""

import json
import os
import signal
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from medusa.checkpoint import load_heads
from tests.tiny import save_tiny, tiny_tokenizer
from train.config import TrainConfig
from train.trainer import latest_checkpoint, micro_batches, train

REPO = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over the lazy dog hello world how are you today Medusa heads predict tokens".split()


def write_chats(path: Path, n: int = 24) -> Path:
    records = []
    for i in range(n):
        question = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4))
        answer = " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(10))
        records.append({"id": f"c{i}", "conversations": [{"from": "human", "value": question},
                                                          {"from": "gpt", "value": answer}]})
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


def make_config(base_dir, chats, out, **overrides) -> TrainConfig:
    values = dict(base=str(base_dir), data=str(chats), output_dir=str(out), num_heads=3, head_vocab_size=64,
                  max_seq_len=64, batch_size=4, learning_rate=1e-2, warmup_steps=1, max_steps=4, save_every=2,
                  eval_every=2, log_every=1, held_out_fraction=0.25, mixed_precision="no")
    values.update(overrides)
    return TrainConfig(**values)


def heads_state(heads_dir: Path) -> dict:
    return load_file(str(heads_dir / "model.safetensors"))


def test_base_frozen_and_heads_trained(base_dir, chats, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    heads_dir = train(make_config(base_dir, chats, tmp_path / "run", grad_accum_steps=2), model, tiny_tokenizer())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "base parameters moved"
    assert all(not p.requires_grad for p in model.parameters())
    # ResBlocks start at zero: training moved every head.
    state = heads_state(heads_dir)
    for k in range(3):
        assert state[f"blocks.{k}.0.linear.weight"].abs().sum() > 0

    heads = load_heads(heads_dir, model.get_output_embeddings().weight)
    assert heads.config.num_heads == 3 and heads.config.head_vocab_size == 64
    assert 2 in heads.token_map.tolist()  # EOS is always in the truncated head vocabulary
    training = json.loads((heads_dir / "config.json").read_text())["training"]
    assert training["steps"] == 4 and training["config"]["num_heads"] == 3
    metrics = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert [h["offset"] for h in metrics["heads"]] == [2, 3, 4]
    assert all(0 <= h["top1"] <= h["top5"] <= 1 and h["targets"] > 0 for h in metrics["heads"])
    assert metrics == training["held_out"] | {"steps": 4}


def test_resume_continues_from_checkpoint(base_dir, chats, tmp_path, caplog):
    straight = train(make_config(base_dir, chats, tmp_path / "a", share_lm_head=False))
    train(make_config(base_dir, chats, tmp_path / "b", share_lm_head=False, max_steps=2))
    assert latest_checkpoint(tmp_path / "b").name == "step_2"
    with caplog.at_level("INFO", logger="train.trainer"):
        resumed = train(make_config(base_dir, chats, tmp_path / "b", share_lm_head=False, max_steps=4))
    assert "resuming from step 2" in caplog.text
    assert latest_checkpoint(tmp_path / "b").name == "step_4"
    a, b = heads_state(straight), heads_state(resumed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)

    with pytest.raises(ValueError, match=r"learning_rate.*\n.*num_layers|num_layers.*\n.*learning_rate"):
        train(make_config(base_dir, chats, tmp_path / "b", share_lm_head=False, max_steps=6, learning_rate=0.5,
                          num_layers=2))


def test_self_distill_then_train(base_dir, chats, tmp_path):
    out = tmp_path / "sd"
    train(make_config(base_dir, chats, out, self_distill=True, distill_max_new_tokens=6, max_steps=2, eval_every=0,
                      tracker="tensorboard"))
    lines = (out / "distilled_train.jsonl").read_text().splitlines()
    held = (out / "distilled_held_out.jsonl").read_text().splitlines()
    assert len(lines) + len(held) == 24
    assert all("response_ids" in json.loads(line) for line in lines)
    assert list(out.glob("runs/**/events.out.tfevents*"))


def test_micro_batches_resume_and_shard():
    full = list(islice(micro_batches(10, 3, seed=1, rank=0, world=1), 12))
    resumed = list(islice(micro_batches(10, 3, seed=1, rank=0, world=1, start=5), 7))
    assert full[5:] == resumed
    rank0 = list(islice(micro_batches(10, 3, seed=1, rank=0, world=2), 2))
    rank1 = list(islice(micro_batches(10, 3, seed=1, rank=1, world=2), 2))
    assert all(len(b) == 3 for b in rank0 + rank1)
    assert sorted(rank0[0] + rank1[0]) == sorted(set(rank0[0] + rank1[0]))  # one global batch, no overlap


@pytest.mark.slow
def test_two_process_cpu_launch(base_dir, chats, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "configs/accelerate/cpu_2proc.yaml"), "--main_process_port", "29517", "-m", "train",
           "--base", str(base_dir), "--data", str(chats), "--output-dir", str(out), "--max-steps", "2",
           "--batch-size", "2", "--grad-accum-steps", "2", "--max-seq-len", "48", "--num-heads", "2",
           "--head-vocab-size", "64", "--held-out-fraction", "0.25", "--mixed-precision", "no", "--eval-every", "0",
           "--self-distill", "--distill-max-new-tokens", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # Own process group: on a timeout the launcher and both workers are killed, not left orphaned.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "training on 2 processes (DDP on CPU)" in result.stderr
    metrics = json.loads((out / "eval.json").read_text())
    assert metrics["steps"] == 2 and metrics["examples"] > 0
    assert not list(out.glob("*.rank*.jsonl"))  # per-process distillation shards were merged
    assert len((out / "distilled_train.jsonl").read_text().splitlines()) > 0


def test_hidden_state_cache_runs_the_base_once_per_example(base_dir, chats, tmp_path, monkeypatch):
    import train.trainer as trainer

    calls = []
    real = trainer.base_hidden_states

    def counting(model, input_ids, attention_mask):
        calls.append(input_ids.shape[0])
        return real(model, input_ids, attention_mask)

    monkeypatch.setattr(trainer, "base_hidden_states", counting)
    # 18 train examples, batch 4: one epoch is 5 micro-batches; 12 steps are more than two epochs.
    config = make_config(base_dir, chats, tmp_path / "cached", cache_hidden_states=True, max_steps=12,
                         save_every=0, eval_every=0)
    heads_dir = train(config)
    cached_calls = len(calls)
    uncached = make_config(base_dir, chats, tmp_path / "plain", max_steps=12, save_every=0, eval_every=0)
    calls.clear()
    plain_dir = train(uncached)
    eval_calls = len(calls) - 12  # the final held-out evaluation runs the base too
    # About 18 train examples in batches of 4: the first epoch (at most 6 micro-batches) runs the base, later ones not.
    assert 1 <= cached_calls - eval_calls <= 6, "the base ran again for examples already cached"
    cached, plain = heads_state(heads_dir), heads_state(plain_dir)
    # Same data order; the cache only rounds hidden states to bf16.
    for key in plain:
        assert torch.allclose(cached[key].float(), plain[key].float(), atol=5e-3), key
