"""Sharded training: the Accelerate FSDP / DeepSpeed config files, heads built from a gathered lm_head, the heads
trained under Accelerate's FSDP2 on 2 CPU processes (gloo), and the whole trainer saving and resuming there.

Accelerate 1.x selects FSDP only with GPUs (a CPU launch becomes DDP), so the 2-process tests build the Accelerator
on CPU and switch its state to the FSDP2 plugin that configs/accelerate/fsdp.yaml describes (:func:`force_fsdp2`):
the wrapping, optimizer hand-over, gradient reduction and state gathering are Accelerate's and torch's own FSDP2
code. DeepSpeed is not installed here: its configs are checked to parse into the intended plugins, and the trainer's
DeepSpeed branches are driven by stand-ins.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from processes import free_port, run_launcher
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = REPO / "configs" / "accelerate"
H, V, K = 16, 64, 2


def launcher_env(config_file: Path) -> dict[str, str]:
    """The environment ``accelerate launch --config_file FILE`` gives its processes (FSDP / multi-GPU configs)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


def train_config(**overrides):
    from train.config import TrainConfig

    values = dict(base="tiny", num_heads=K, num_layers=1, share_lm_head=False, head_vocab_size=None,
                  learning_rate=1e-2, max_grad_norm=1.0, mixed_precision="no")
    return TrainConfig(**(values | overrides))


def base_weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)  # lm_head, embeddings


# What each head type trains with here: the eagle drafter reads layers 1 and 0 of a 2-layer Llama-shaped base (its
# shared lm_head: it projects every depth with one).
HEAD_TYPES = {"medusa": {}, "eagle": {"head_type": "eagle", "eagle_layers": [1, 0], "share_lm_head": True}}


def base_config():
    """The text config of a Llama-shaped base of hidden size ``H``: what the eagle drafter's layer copies."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def heads_of(head_type: str, lm_head, embed):
    """Fresh heads of ``head_type`` (:data:`HEAD_TYPES`) over these base weights, through the trainer's builder."""
    from train.trainer import heads_for_training

    config = train_config(**HEAD_TYPES[head_type])
    return config, heads_for_training(config, lm_head, embed, [], [], base_config())


# --- config files ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(p.name for p in ACCELERATE_CONFIGS.glob("*.yaml")))
def test_every_accelerate_config_file_loads(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ACCELERATE_CONFIGS / name))
    assert config.num_machines == 1


def test_fsdp_config_gives_an_fsdp2_plugin_that_keeps_the_base_whole(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    env = launcher_env(ACCELERATE_CONFIGS / "fsdp.yaml")
    assert env["ACCELERATE_USE_FSDP"] == "true"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # heads saved whole, not per-rank shards
    assert plugin.cpu_ram_efficient_loading is False  # else ranks > 0 load the unwrapped base as meta tensors
    assert plugin.auto_wrap_policy is None


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_parse_into_zero_plugins(stage):
    """Without deepspeed installed: the YAML names a JSON that parses into ZeRO-``stage``, with zero3_init_flag
    off, so transformers loads the frozen base whole (not partitioned)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled

    config = load_config_from_file(str(ACCELERATE_CONFIGS / f"deepspeed_zero{stage}.yaml"))
    assert config.distributed_type.value == "DEEPSPEED"
    ds = config.deepspeed_config
    assert ds["zero3_init_flag"] is False
    json_path = REPO / ds["deepspeed_config_file"]  # relative to the repository root, where launches run
    assert json.loads(json_path.read_text())["zero_optimization"]["stage"] == stage
    plugin = DeepSpeedPlugin(hf_ds_config=str(json_path), zero3_init_flag=ds["zero3_init_flag"])
    assert plugin.zero_stage == stage and plugin.hf_ds_config.is_zero3() == (stage == 3)
    assert not is_deepspeed_zero3_enabled()


# --- heads from a gathered lm_head ------------------------------------------------------------------------------

def fake_deepspeed(full: dict[int, torch.Tensor]) -> types.ModuleType:
    """A stand-in for ``deepspeed.zero.GatheredParameters``: fills each partitioned parameter with its full value
    inside the context and empties it again on exit, as ZeRO-3 does."""

    @contextmanager
    def gathered(params, modifier_rank=None):
        for p in params:
            p.data = full[id(p)].clone()
        yield
        for p in params:
            p.data = torch.empty(0)

    module = types.ModuleType("deepspeed")
    module.zero = types.SimpleNamespace(GatheredParameters=gathered)
    return module


def partitioned(weight: torch.Tensor) -> torch.nn.Parameter:
    """A ZeRO-3-style partitioned parameter: empty ``(0,)`` data, the full shape in ``ds_shape``."""
    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    param.ds_shape = weight.shape
    return param


@pytest.mark.parametrize("head_type", ["medusa", "hydra", "eagle"])
def test_partitioned_lm_head_is_gathered_once(monkeypatch, head_type):
    from train.trainer import heads_for_training

    lm_head, embed = base_weights()
    config = train_config(**({"head_type": head_type, "share_lm_head": True} | HEAD_TYPES.get(head_type, {})))
    expected = heads_for_training(config, lm_head, embed, [], [], base_config())
    parts = partitioned(lm_head), partitioned(embed)
    monkeypatch.setitem(sys.modules, "deepspeed", fake_deepspeed({id(parts[0]): lm_head, id(parts[1]): embed}))
    heads = heads_for_training(config, *parts, [], [], base_config())
    assert parts[0].shape == (0,) and parts[1].shape == (0,)  # partitioned again after the gather
    assert heads.config == expected.config  # sizes and lm_head fingerprint from the full weight
    hidden, ids = step_batch(head_type)[0][:2, :5], torch.randint(0, V, (2, 5))
    with torch.no_grad():
        assert torch.equal(heads(hidden, ids), expected(hidden, ids))  # the heads kept their own full copy


@pytest.mark.parametrize("weight, message", [
    (torch.empty(0), r"lm_head has shape \(0,\), not \(vocab, hidden\): it looks partitioned .*zero3_init_flag"),
    (torch.empty(V, H, device="meta"), "lm_head is on the meta device .*fsdp_cpu_ram_efficient_loading"),
], ids=["empty (0,)", "meta"])
def test_partitioned_lm_head_without_a_gather_is_refused(weight, message):
    from train.trainer import heads_for_training

    with pytest.raises(ValueError, match=message):
        heads_for_training(train_config(), weight, base_weights()[1], [], [])


# --- saving sharded heads, DeepSpeed (stand-ins) ---------------------------------------------------------------

@pytest.mark.parametrize("case", ["partitioned", "missing key"])
def test_save_heads_refuses_weights_that_are_not_the_full_heads(tmp_path, case):
    """A ZeRO-3-partitioned ``(0,)`` weight (the unwrapped heads' own state dict) or a missing key: refused with the
    key named, nothing written. The full weights (``accelerator.get_state_dict``) save."""
    from medusa.io.checkpoint import HeadsMismatchError, save_heads
    from train.trainer import heads_for_training

    heads = heads_for_training(train_config(), *base_weights(), [], [])
    state = dict(heads.state_dict())
    if case == "partitioned":
        state["blocks.1.0.linear.weight"] = torch.empty(0)
        message = r"blocks.1.0.linear.weight has shape \(0,\), expected \(16, 16\)"
    else:
        del state["lm_heads.0.weight"]
        message = r"missing keys \['lm_heads.0.weight'\]"
    with pytest.raises(HeadsMismatchError, match=message):
        save_heads(heads, tmp_path / "heads", state_dict=state)
    assert list(tmp_path.iterdir()) == []
    save_heads(heads, tmp_path / "heads", state_dict=heads.state_dict())
    assert load_file(tmp_path / "heads" / "model.safetensors").keys() == heads.state_dict().keys()


def test_deepspeed_with_gradient_accumulation_is_refused_before_the_base_loads(tmp_path, monkeypatch):
    from accelerate.utils import DistributedType

    import train.setup as setup_module

    monkeypatch.setattr(setup_module, "make_accelerator",
                        lambda config: types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
    monkeypatch.setattr(setup_module, "prepare_base", lambda *a, **k: pytest.fail("the base was loaded"))
    with pytest.raises(ValueError, match="grad_accum_steps=2 cannot run under DeepSpeed: its engine steps the "
                                         "optimizer inside backward"):
        setup_module.setup(train_config(grad_accum_steps=2, output_dir=str(tmp_path)))


class StandInEngine(torch.nn.Module):
    """A ZeRO-3 engine stand-in: its module's parameters are partitioned ``(0,)`` tensors, the full weights come
    from the consolidated state dict, and the optimizer partitions go through ``save_checkpoint`` /
    ``load_checkpoint`` (written here as one marker file per call)."""

    def __init__(self, heads):
        super().__init__()
        self.full = {k: v.clone() for k, v in heads.state_dict().items()}
        self.module = heads
        for p in heads.parameters():
            p.data = torch.empty(0)
        self.loaded = []

    def save_checkpoint(self, save_dir, tag):
        Path(save_dir, tag).mkdir(parents=True)
        Path(save_dir, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"partition")

    def load_checkpoint(self, load_dir, tag, **kwargs):
        self.loaded.append((Path(load_dir), tag, kwargs))


def test_deepspeed_checkpoint_holds_the_gathered_heads_and_the_engine_partitions(tmp_path):
    """The DeepSpeed branches of save_checkpoint / resume, driven by stand-ins (no deepspeed here): the heads folder
    is written from ``accelerator.get_state_dict`` (ZeRO-3's consolidated weights), not from the partitioned module;
    the optimizer state is the engine's own checkpoint in ``deepspeed/``, reloaded from there on resume."""
    from accelerate.utils import DistributedType

    from medusa.io.checkpoint import load_heads
    from train.checkpoints import DEEPSPEED_DIR, OPTIMIZER_NAME, load_optimizer_state, save_checkpoint
    from train.trainer import heads_for_training

    lm_head, embed = base_weights()
    heads = heads_for_training(train_config(), lm_head, embed, [], [])
    torch.nn.init.normal_(heads.blocks[0][0].linear.weight)  # not the zero initialisation
    expected = {k: v.clone() for k, v in heads.state_dict().items()}
    engine = StandInEngine(heads)
    accelerator = types.SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, is_fsdp2=False, is_main_process=True, process_index=0,
        num_processes=1, wait_for_everyone=lambda: None, unwrap_model=lambda m: m.module,
        get_state_dict=lambda m: m.full)
    run = types.SimpleNamespace(accelerator=accelerator, heads=engine, optimizer=None, model=None, lora_params=None,
                                step=2, config=train_config(output_dir=str(tmp_path)))
    path = save_checkpoint(run)
    loaded = load_heads(path / "heads", lm_head)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert not (path / OPTIMIZER_NAME).exists()
    assert (path / DEEPSPEED_DIR / "heads" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    load_optimizer_state(accelerator, engine, None, path)
    assert engine.loaded == [(path / DEEPSPEED_DIR, "heads", {"load_module_strict": True,
                                                            "load_optimizer_states": True,
                                                            "load_lr_scheduler_states": False})]


# --- FSDP2 on 2 CPU processes ---------------------------------------------------------------------------------

def step_batch(head_type: str = "medusa"):
    """Base states ``(4, 6, (1 + layers) H)``, tokens ``(4, 6)`` and labels ``(K, 4, 6)`` of one optimizer step
    (split by rows over processes)."""
    g = torch.Generator().manual_seed(1)
    width = (1 + len(HEAD_TYPES.get(head_type, {}).get("eagle_layers", []))) * H
    return (torch.randn(4, 6, width, generator=g), torch.randint(0, V, (4, 6), generator=g),
            torch.randint(0, V, (K, 4, 6), generator=g))


def step_loss(heads, hidden, ids, labels, total_targets: int) -> torch.Tensor:
    logits = heads(hidden, ids)  # (K, B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="sum") / total_targets


def run_two_process_command(cmd: list[str]) -> str:
    """Run a ``torch.distributed.run`` command on 2 CPU processes; asserts it succeeded and returns its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    return run_launcher(cmd, REPO, env).stderr


def force_fsdp2(accelerator) -> None:
    """Switch a CPU (gloo) Accelerator to the FSDP2 plugin configs/accelerate/fsdp.yaml describes.

    Both of Accelerate's process-wide states are switched: ``prepare`` re-reads the distributed type from the partial
    state, and with only the accelerator's switched it falls back to CPU DDP's type after wrapping.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ.update(launcher_env(ACCELERATE_CONFIGS / "fsdp.yaml"))
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    assert accelerator.is_fsdp2


def fsdp_worker(out: Path, head_type: str) -> None:
    """One training step of heads built from a row-sharded lm_head, under Accelerate's FSDP2 (run per process).

    What the step built (the FSDP2-wrapped heads, their DTensors, the optimizer, the device mesh) is freed while the
    gloo group still exists, and only then, after a barrier, is the group destroyed: as ``train.run.end_run`` does.
    With them left to the interpreter's teardown, after the group was gone, one process aborted in about one run in
    30 to 70 ("terminate called without an active exception", then SIGSEGV; its main thread had no Python frame
    left), after its work was done. The process then leaves through ``os._exit``: what it had to do is written and
    checked by the test, and torch's C++ teardown is not what this test is about.
    """
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # gloo process group; Accelerate picks FSDP only with GPUs
    force_fsdp2(accelerator)
    fsdp_step(accelerator, out, head_type)
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fsdp_step(accelerator, out: Path, head_type: str) -> None:
    """:func:`fsdp_worker`'s step; what it builds is this frame's (the prepared heads and optimizer are also the
    accelerator's, until :meth:`Accelerator.free_memory`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from train.trainer import make_optimizer

    rank, world = accelerator.process_index, accelerator.num_processes
    lm_head, embed = base_weights()
    sharded = distribute_tensor(lm_head, init_device_mesh("cpu", (world,)), [Shard(0)])  # this rank's V / 2 rows
    config, heads = heads_of(head_type, sharded, embed)
    first = next(name for name, _ in heads.named_parameters())
    optimizer = make_optimizer(heads, config)
    heads, optimizer = accelerator.prepare(heads, optimizer)
    hidden, ids, labels = step_batch(head_type)
    loss = step_loss(heads, hidden[rank::world], ids[rank::world], labels[:, rank::world], labels.numel())
    accelerator.backward(loss * world)  # as train_step: the loss is this process's share of the step's sum
    accelerator.clip_grad_norm_(heads.parameters(), config.max_grad_norm)
    optimizer.step()
    state = accelerator.get_state_dict(heads)  # a collective under FSDP2: the main process gets the full weights
    unwrapped = accelerator.unwrap_model(heads).state_dict()
    if accelerator.is_main_process:
        from medusa.io.checkpoint import save_heads

        save_file({k: v.detach().clone() for k, v in state.items()}, str(out / "heads.safetensors"))
        save_heads(accelerator.unwrap_model(heads), out / "folder", state_dict=state)  # every key and shape checked
        (out / "info.json").write_text(json.dumps({
            "wrapped": type(heads).__name__, "sharded_params": [type(p).__name__ for p in heads.parameters()],
            "local_rows": sharded.to_local().shape[0],
            "unwrapped_state": type(unwrapped[first]).__name__,
        }))
    accelerator.wait_for_everyone()


@pytest.mark.slow
@pytest.mark.parametrize("head_type, wrapped", [("medusa", "FSDPMedusaHeads"), ("eagle", "FSDPEagleDrafterHeads")])
def test_heads_train_under_accelerate_fsdp2_on_two_cpu_processes(tmp_path, head_type, wrapped):
    """One step of Medusa heads, and of the eagle drafter (its decoder layer, fusion and norm sharded), on 2 FSDP2
    processes equals the step on one process; the heads folder saved from the gathered state loads back."""
    from medusa.io.checkpoint import load_heads
    from train.trainer import make_optimizer

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), str(tmp_path), head_type]
    run_two_process_command(cmd)
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["wrapped"] == wrapped and set(info["sharded_params"]) == {"DTensor"}
    assert info["local_rows"] == V // 2  # the lm_head the heads were built from was sharded
    # The unwrapped module's own state is still sharded: a heads folder must be saved from get_state_dict.
    assert info["unwrapped_state"] == "DTensor"
    # The same step on one process, from the whole lm_head, gives the same heads.
    lm_head, embed = base_weights()
    config, heads = heads_of(head_type, lm_head, embed)
    optimizer = make_optimizer(heads, config)
    hidden, ids, labels = step_batch(head_type)
    step_loss(heads, hidden, ids, labels, labels.numel()).backward()
    torch.nn.utils.clip_grad_norm_(heads.parameters(), config.max_grad_norm)
    optimizer.step()
    sharded = load_file(tmp_path / "heads.safetensors")
    assert sharded.keys() == heads.state_dict().keys()
    for key, value in heads.state_dict().items():
        torch.testing.assert_close(sharded[key], value, rtol=1e-5, atol=1e-6)
    folder = load_heads(tmp_path / "folder", lm_head, embed_weight=embed, num_base_layers=2)  # saved from shards
    assert all(torch.equal(v, sharded[k]) for k, v in folder.state_dict().items())


# --- the whole trainer under FSDP2 on 2 CPU processes: save, load, resume -----------------------------------------

def trainer_worker(config_json: str) -> None:
    """``train()`` with the run's Accelerator switched to FSDP2 (run per process)."""
    import train.setup as setup_module
    from train.config import TrainConfig
    from train.trainer import train

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    make_accelerator = setup_module.make_accelerator

    def fsdp2_accelerator(config):
        accelerator = make_accelerator(config)
        force_fsdp2(accelerator)
        return accelerator

    setup_module.make_accelerator = fsdp2_accelerator
    train(TrainConfig(**json.loads(config_json)))


def launch_fsdp2_trainer(values: dict) -> str:
    """Run :func:`trainer_worker` on 2 processes; returns their stderr."""

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "train", json.dumps(values)]
    return run_two_process_command(cmd)


@pytest.mark.slow
def test_trainer_saves_full_heads_and_resumes_under_fsdp2_on_two_cpu_processes(tmp_path):
    """2 FSDP2 processes x batch 1 x 2 micro-batches, stopped after step 2 and resumed to step 4, against one process
    x batch 4 straight to step 4: the heads folders written from sharded heads load and agree within 1e-5 relative.
    A resume that lost the AdamW moments would differ far more (steps 3 and 4 would restart Adam); the step-2
    optimizer state, saved whole and keyed by parameter name, equals the single-process one. The held-out metrics
    match too, though one process's held-out slice is empty (a sharded heads forward may be a collective)."""
    from accelerate import Accelerator
    from test_train import heads_state, max_relative_difference, write_mixed_chats
    from transformers import AutoModelForCausalLM

    from medusa.io.checkpoint import load_heads
    from tests.tiny import save_tiny
    from train.checkpoints import load_optimizer_state
    from train.config import TrainConfig
    from train.trainer import latest_checkpoint, make_optimizer, train

    # 1 held-out conversation: one process scores it, the other has none (and runs a spare heads forward).
    base, chats = save_tiny(tmp_path / "llama", "llama"), write_mixed_chats(tmp_path / "mixed.jsonl", n=10)
    values = dict(base=str(base), data=str(chats), num_heads=2, head_vocab_size=None, max_seq_len=128,
                  learning_rate=1e-2, warmup_steps=1, max_steps=4, save_every=2, eval_every=2, log_every=1,
                  held_out_fraction=0.1, max_grad_norm=1.0, mixed_precision="no")
    # warmup_steps=1: the first two learning rates are 0 and the peak whether max_steps is 2 or 4.
    config = TrainConfig(**values, batch_size=4, output_dir=str(tmp_path / "one"))
    one = train(config)
    sharded = values | {"batch_size": 1, "grad_accum_steps": 2, "output_dir": str(tmp_path / "two")}
    stderr = launch_fsdp2_trainer(sharded | {"max_steps": 2})
    assert "training on 2 processes (FSDP)" in stderr
    step2 = latest_checkpoint(tmp_path / "two")
    assert step2.name == "step_2"
    lm_head = AutoModelForCausalLM.from_pretrained(base).get_output_embeddings().weight.detach()  # (V, H)
    heads = load_heads(step2 / "heads", lm_head)  # full weights: every key and shape checked
    optimizer = make_optimizer(heads, config)
    load_optimizer_state(Accelerator(), heads, optimizer, step2)  # one process, whole heads
    reference = torch.load(tmp_path / "one" / "checkpoints" / "step_2" / "optimizer.pt", weights_only=True)
    restored = optimizer.state_dict()["state"]
    assert restored.keys() == reference["state"].keys() and len(restored) == len(list(heads.parameters()))
    for index, state in reference["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(restored[index][name], state[name], rtol=1e-4, atol=1e-7)

    stderr = launch_fsdp2_trainer(sharded)
    assert "resuming from step 2" in stderr
    expected = heads_state(one)
    for folder in (tmp_path / "two" / "heads", latest_checkpoint(tmp_path / "two") / "heads"):
        load_heads(folder, lm_head)
        assert max_relative_difference(expected, heads_state(folder)) < 1e-5
    metrics = [json.loads((tmp_path / run / "eval.json").read_text()) for run in ("one", "two")]
    assert metrics[0]["examples"] == metrics[1]["examples"] == 1
    assert metrics[0]["heads"] == metrics[1]["heads"]  # summed over both processes' slices, one of them empty
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-4)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        trainer_worker(sys.argv[2])
    else:
        fsdp_worker(Path(sys.argv[1]), sys.argv[2])
