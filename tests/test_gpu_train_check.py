"""scripts/gpu_train_check.py (the GPU session's training check) on the CPU: the tiny shape trains Medusa and Hydra
heads from a hidden-state store with the loss going down, the heads load back, ``datasets`` is never imported, and a
run whose loss does not fall fails."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "gpu_train_check.py"
# The script as __main__ with `import datasets` made to fail (the GPU machine has no datasets package).
WITHOUT_DATASETS = ("import runpy, sys; sys.modules['datasets'] = None; sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_train_check", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_tiny_run_trains_heads_from_a_store_without_datasets_and_the_heads_load_back(tmp_path):
    out = tmp_path / "tmp" / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", WITHOUT_DATASETS, str(SCRIPT), "--tiny", "--device", "cpu", "--steps", "40",
           "--head-types", "medusa", "hydra", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["failures"] == [] and result["device"] == "cpu"
    assert result["store_tokens"] > 0 and result["store_bytes"] == result["store_tokens"] * (2 * 64 + 2 * 4)
    assert set(result["heads"]) == {"medusa", "hydra"}
    for heads in result["heads"].values():
        assert heads["steps"] == 40 and len(heads["losses"]) == 40
        assert heads["all_finite"] and all(math.isfinite(x) for x in heads["losses"])
        assert heads["last_mean_loss"] < 0.9 * heads["first_mean_loss"]
        assert heads["heads_weights_equal"] and heads["heads_logits_equal"] and heads["heads_bytes"] > 0
        assert heads["steps_per_s"] > 0
    assert result["versions"]["torch"] and "medusa:" in proc.stdout


def test_a_run_whose_loss_does_not_fall_exits_with_the_reason_and_heads_round_trip_under_autocast(
        tmp_path, fresh_accelerator_state):
    # bf16 autocast is what the trainer runs on CUDA: Accelerate wraps the trained heads' forward in it.
    out = tmp_path / "result.json"
    with pytest.raises(SystemExit, match="medusa: loss did not go down"):
        load_script().main(["--tiny", "--steps", "8", "--sequences", "8", "--learning-rate", "1e-9",
                            "--mixed-precision", "bf16", "--out", str(out)])
    result = json.loads(out.read_text())
    assert not result["ok"] and result["mixed_precision"] == "bf16"
    assert result["heads"]["medusa"]["heads_weights_equal"] and result["heads"]["medusa"]["heads_logits_equal"]


def test_loss_check_names_non_finite_steps_and_a_loss_that_does_not_fall():
    loss_failures = load_script().loss_failures
    assert loss_failures([5.0, 4.0, 3.0, 2.0], min_drop=0.1) == []
    assert "not finite at 1 of 4 steps (first: step 3)" in loss_failures([5.0, 4.0, math.nan, 2.0], 0.1)[0]
    assert "did not go down" in loss_failures([5.0, 5.0, 5.0, 4.9], 0.1)[0]
    assert "did not go down" in loss_failures([5.0, 5.0, 6.0, 6.0], 0.0)[0]


@pytest.mark.parametrize("flags, message", [(["--steps", "3"], "--steps must be >= 4"),
                                            (["--cycle", "600"], "--cycle 600 exceeds the 509"),
                                            (["--min-drop", "1"], "--min-drop must be in"),
                                            (["--learning-rate", "-1"], "--learning-rate must be > 0")])
def test_bad_settings_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(["--tiny", "--out", "x.json", *flags])
    assert message in capsys.readouterr().err
