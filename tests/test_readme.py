"""The README's Usage commands, run in order through the CLI on a tiny random model, and its Python API block.

Only the two lines that need the reference model (``prepare-model`` and the reference training config) are left
out; every other line runs as written, with ``DIR`` and ``my_chats.jsonl`` pointing at tiny stand-ins and a few
flags appended (later flags win in argparse) to keep it fast.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from tiny import save_cli_files, save_tiny

from medusa.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
WORDS = "the quick brown fox jumps over the lazy dog hello world how are you today Medusa heads predict tokens".split()
NEEDS_REFERENCE = ("medusa prepare-model", "medusa train --config configs/smollm2-135m-hydra-2layer-all.yaml")
TINY_FLAGS = {
    "train": "--num-heads 3 --head-vocab-size 64 --max-seq-len 64 --batch-size 4 --max-steps 4 --eval-every 2 "
             "--warmup-steps 1 --learning-rate 0.01 --held-out-fraction 0.25 --distill-max-new-tokens 12 "
             "--mixed-precision no --validation-fraction 0.25",
    "distill": "--max-new-tokens 8 --held-out-fraction 0.25 --batch-size 8",
    "build-tree": "--limit 4 --top-k 4 --max-nodes 6",
    "calibrate": "--top-k 4",
    "generate": "--max-new-tokens 8",
    "held-out-prompts": "--held-out-fraction 0.25 --n 2",
    "bench": "--max-new-tokens 8",
    "eval-heads": "--limit 4",
}


def usage_commands() -> list[str]:
    """The ``medusa ...`` lines of the README's Usage code blocks, in order."""
    section = README.read_text().split("## Usage", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```bash")[1:]
    return [line.strip() for block in blocks for line in block.split("```")[0].splitlines()
            if line.strip().startswith("medusa ")]


def write_chats(path: Path, n: int = 24) -> Path:
    records = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4))},
        {"from": "gpt", "value": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(10))}]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_usage_lists_the_whole_path():
    commands = usage_commands()
    assert [c for c in commands if c.startswith(NEEDS_REFERENCE)] == [c for c in commands if "prepare-model" in c
                                                                       or "configs/smollm2" in c]
    verbs = [shlex.split(c, comments=True)[1] for c in commands if not c.startswith(NEEDS_REFERENCE)]
    assert verbs == ["distill", "train", "profile", "calibrate", "build-tree", "generate", "generate", "generate",
                     "held-out-prompts", "bench", "eval-heads", "plot"]


@pytest.mark.slow
def test_usage_commands_run_in_order(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    base = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "my_chats.jsonl")
    monkeypatch.chdir(tmp_path)
    for command in usage_commands():
        if command.startswith(NEEDS_REFERENCE):
            continue
        stand_ins = {"DIR": str(base), "my_chats.jsonl": str(chats)}
        argv = [stand_ins.get(a, a) for a in shlex.split(command, comments=True)[1:]]
        argv += shlex.split(TINY_FLAGS.get(argv[0], ""))
        assert main(argv) == 0, f"{command}\n{capsys.readouterr().err}"
    for produced in ("runs/x/heads/model.safetensors", "runs/x/heads/calibration.json", "runs/x/eval.json",
                     "runs/x/eval.png", "trees/x.json",
                     "trees/x.report.json", "trees/x.report.png", "prompts.jsonl", "bench.json", "bench.png"):
        assert (tmp_path / produced).stat().st_size > 0, produced
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["identical"] == 1.0 and bench["fixed_identical"] == 1.0 and bench["tree"] == "per-step"


def python_api_block() -> str:
    """The README's Python API code block."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_python_api_block_runs(tmp_path):
    base, _ = save_cli_files(tmp_path, [{"prompt": "hello"}])
    code = python_api_block()
    for shipped, stand_in in (("models/smollm2-135m-instruct", base), ("checkpoints/smollm2-135m-instruct-hydra",
                                                                        tmp_path / "heads")):
        assert f'"{shipped}"' in code
        code = code.replace(f'"{shipped}"', repr(str(stand_in)))
    code = code.replace("max_new_tokens=128", "max_new_tokens=6")
    names: dict = {}
    exec(compile(code, "README.md:Python API", "exec"), names)
    assert len(names["outputs"]) == 2 and all(names["outputs"])
    assert names["model"].engine is not None and names["stats"].new_tokens > 0
