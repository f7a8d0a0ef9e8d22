"""Distillation and the hidden-state store under ``accelerate launch``: 2 CPU processes (gloo) share the batches and
the shards, and write the files one process writes, byte for byte; per-process files an interrupted run left are
folded in, whatever number of processes wrote them.

One launch (:func:`two_process_run`) runs ``medusa distill`` and two store builds (one fresh, one resuming an
interrupted build); each test checks one thing it did against one process in this test's own process. Both sides run
one torch thread per process: the batches are the same, and so are the kernels that answer them.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from processes import free_port, run_launcher

REPO = Path(__file__).resolve().parents[1]
SPLITS = ("validation", "held_out", "train")
# 24 chats split into 8 held out, 5 validation, 11 train; batches of 2: at least 3 per split, so the processes'
# files interleave (rank 0 answers batches 0 and 2, rank 1 batch 1).
DISTILL_ARGS = ["--held-out-fraction", "0.2", "--validation-fraction", "0.4", "--seed", "0", "--max-new-tokens", "4",
                "--batch-size", "2", "--dtype", "float32"]
SHARD_TOKENS = 80  # the examples' ~260 tokens in several shards
RESUME_AFTER = 1  # the interrupted build had listed this many shards


def distill_args(base: Path, chats: Path, out: Path) -> list[str]:
    return ["distill", "--base", str(base), "--data", str(chats), "--out-dir", str(out), *DISTILL_ARGS]


@contextmanager
def one_thread():
    """torch on one thread (as each launched process), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def recording_answer_batches(target: dict, rank_suffix: str = ""):
    """:func:`train.distill.answer_batches`, keeping per split file the ids of each batch it is given."""
    from train.distill import answer_batches

    def recording(model, tokenizer, batches, out_path, *args):
        name = Path(out_path).name.replace(rank_suffix, "")
        target.setdefault(name, []).extend([[conv_id for conv_id, _, _ in batch] for batch in batches])
        return answer_batches(model, tokenizer, batches, out_path, *args)

    return recording


def recording_write_shard(target: list):
    """:func:`train.store._write_shard`, keeping ``(folder name, index)`` of each shard this process writes."""
    from train.store import _write_shard

    def recording(path, index, *args):
        target.append((Path(path).name, index))
        return _write_shard(path, index, *args)

    return recording


def interrupted_store(built: Path, dst: Path, listed: int) -> Path:
    """The folder a build interrupted in its second round leaves: ``meta.json`` lists ``listed`` shards, the next
    shard is finished but not listed (its process was faster), a temporary file is half written."""
    dst.mkdir()
    meta = json.loads((built / "meta.json").read_text())
    for shard in meta["shards"][: listed + 1]:
        for suffix in (".hidden", ".tokens"):
            (dst / f"{shard['name']}{suffix}").write_bytes((built / f"{shard['name']}{suffix}").read_bytes())
    (dst / f".tmp-shard_{listed + 2:05d}.hidden").write_bytes(b"half")
    partial = meta | {"shards": meta["shards"][:listed], "complete": False}
    (dst / "meta.json").write_text(json.dumps(partial, indent=1) + "\n")
    return dst


def leftover_train_files(reference: list[bytes], out: Path) -> list[bytes]:
    """What an interrupted run of 4 processes leaves for the train split: records in the main file and in the files
    of ranks 0 and 3, one record in both, unfinished lines, one record whose text holds U+2028 (a line separator to
    ``str.splitlines``). Returns the complete records in the order a fold appends them."""
    record = json.loads(reference[1])
    record["messages"][-1]["content"] += " \u2028 end"
    changed = json.dumps(record, ensure_ascii=False).encode()
    out.mkdir(parents=True)
    (out / "distilled_train.jsonl").write_bytes(reference[0] + b"\n" + reference[3][:20])
    (out / "distilled_train.rank0.jsonl").write_bytes(changed + b"\n" + reference[2] + b"\n" + reference[3][:30])
    (out / "distilled_train.rank3.jsonl").write_bytes(reference[2] + b"\n" + reference[3] + b"\n")
    return [reference[0], changed, reference[2], reference[3]]


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """One process's distilled files and stores (here), and the same made by 2 launched processes."""
    from transformers import AutoModelForCausalLM

    import train.distill as distill_module
    from medusa.cli import main
    from tests.test_store import make_examples
    from tests.test_train import write_chats
    from tests.tiny import save_tiny
    from train.store import build_store

    root = tmp_path_factory.mktemp("data_parallel")
    base, chats = save_tiny(root / "base", "llama"), write_chats(root / "chats.jsonl", n=24)
    examples = make_examples(n=16)
    (root / "examples.json").write_text(json.dumps(examples))
    one_batches: dict = {}
    with one_thread(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(distill_module, "answer_batches", recording_answer_batches(one_batches))
        assert main(distill_args(base, chats, root / "one")) == 0
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        one_store = build_store(root / "one_store", model, examples, 64, batch_size=2, shard_tokens=SHARD_TOKENS)
    leftovers = leftover_train_files(lines(root / "one" / "distilled_train.jsonl"), root / "two")
    interrupted_store(one_store, root / "resumed_store", RESUME_AFTER)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "configs/accelerate/cpu_2proc.yaml"), "--main_process_port", str(free_port()),
           str(Path(__file__).resolve()), str(root), str(base), str(chats)]
    result = run_launcher(cmd, REPO, {**os.environ, "OMP_NUM_THREADS": "1",
                                      "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}, timeout=300)
    work = [json.loads((root / f"work.rank{r}.json").read_text()) for r in range(2)]
    return {"root": root, "one_batches": one_batches, "one_store": one_store, "leftovers": leftovers,
            "work": work, "stdout": result.stdout}


@pytest.mark.slow
def test_two_processes_distill_the_file_one_process_distills_byte_for_byte(two_process_run):
    root = two_process_run["root"]
    for split in ("validation", "held_out"):
        one, two = root / "one" / f"distilled_{split}.jsonl", root / "two" / f"distilled_{split}.jsonl"
        assert len(lines(one)) >= 5
        assert two.read_bytes() == one.read_bytes(), split
    assert not list((root / "two").glob("*.rank*"))  # every per-process file was folded in and deleted
    assert two_process_run["stdout"].count("distilled_validation.jsonl: ") == 1  # the main process reports


@pytest.mark.slow
def test_each_process_answers_whole_batches_of_the_one_process_plan(two_process_run):
    """Process r answers batches r, r + 2, ... of one process's batches: the same prompts padded together."""
    one, work = two_process_run["one_batches"], two_process_run["work"]
    for split in ("validation", "held_out"):
        name = f"distilled_{split}.jsonl"
        assert len(one[name]) >= 3
        assert [w["batches"][name] for w in work] == [one[name][0::2], one[name][1::2]]


@pytest.mark.slow
def test_an_interrupted_runs_per_process_files_are_folded_in_once(two_process_run):
    """The train split started from a 4-process run's leftovers: kept byte for byte and first, each id once, the
    rest answered."""
    root = two_process_run["root"]
    one = [json.loads(line) for line in lines(root / "one" / "distilled_train.jsonl")]
    two = lines(root / "two" / "distilled_train.jsonl")
    leftovers = two_process_run["leftovers"]
    assert two[: len(leftovers)] == leftovers
    ids = [json.loads(line)["id"] for line in two]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(r["id"] for r in one)
    prompts = {r["id"]: r["prompt_ids"] for r in one}
    assert all(json.loads(line)["prompt_ids"] == prompts[json.loads(line)["id"]] for line in two)


def assert_same_folder(one: Path, two: Path) -> None:
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    for p in one.iterdir():
        assert (two / p.name).read_bytes() == p.read_bytes(), p.name


@pytest.mark.slow
def test_two_processes_build_the_store_one_process_builds_byte_for_byte(two_process_run):
    one = two_process_run["one_store"]
    shards = len(json.loads((one / "meta.json").read_text())["shards"])
    assert shards >= 3
    assert_same_folder(one, two_process_run["root"] / "two_store")
    written = [[i for name, i in w["shards"] if name == "two_store"] for w in two_process_run["work"]]
    assert written == [list(range(0, shards, 2)), list(range(1, shards, 2))]


@pytest.mark.slow
def test_two_processes_resume_an_interrupted_store_build(two_process_run):
    """``ensure_store`` (what training calls) continues after the listed shards, at the shard size the build
    started with, and rewrites the finished but unlisted shard."""
    one = two_process_run["one_store"]
    shards = len(json.loads((one / "meta.json").read_text())["shards"])
    assert_same_folder(one, two_process_run["root"] / "resumed_store")
    written = [[i for name, i in w["shards"] if name == "resumed_store"] for w in two_process_run["work"]]
    assert written == [list(range(RESUME_AFTER, shards, 2)), list(range(RESUME_AFTER + 1, shards, 2))]


def test_one_process_folds_in_what_several_processes_left(tmp_path):
    from tests.tiny import tiny_model, tiny_tokenizer
    from train.data import Conversation
    from train.distill import distill

    convs = [Conversation(f"c{i}", [{"role": "user", "content": "the quick brown fox"[: 5 + i]}]) for i in range(6)]
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    distill(model, tokenizer, convs[:4], tmp_path / "reference.jsonl", max_new_tokens=2)
    leftovers = leftover_train_files(lines(tmp_path / "reference.jsonl"), tmp_path / "out")
    written = distill(model, tokenizer, convs, tmp_path / "out" / "distilled_train.jsonl", max_new_tokens=2,
                      batch_size=2)
    out = lines(tmp_path / "out" / "distilled_train.jsonl")
    assert out[: len(leftovers)] == leftovers and written == 2
    assert sorted(json.loads(line)["id"] for line in out) == [f"c{i}" for i in range(6)]
    assert not list((tmp_path / "out").glob("*.rank*"))


@pytest.mark.parametrize("flags, match", [(["--server", "http://127.0.0.1:9/v1"], "--server under 2 processes"),
                                          (["--device", "cuda:0"], "would put them all on one device")])
def test_distill_refuses_what_several_processes_cannot_share(monkeypatch, capsys, tmp_path, flags, match):
    import accelerate

    from medusa.cli import main

    class TwoProcesses:
        """What ``PartialState`` says in process 0 of a 2-process launch."""

        num_processes, process_index, is_main_process, device = 2, 0, True, torch.device("cpu")

        def __init__(self, cpu: bool = False):
            pass

    monkeypatch.setattr(accelerate, "PartialState", TwoProcesses)
    args = ["distill", "--base", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--out-dir",
            str(tmp_path / "out"), *flags]
    assert main(args) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def worker(root: Path, base: Path, chats: Path) -> None:
    """Run per launched process: the two store builds, then ``medusa distill`` (which closes the process group)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    import train.distill as distill_module
    import train.store as store_module
    from medusa.cli import main
    from train.setup import launched_on_cpu
    from train.store import build_store, ensure_store

    state = PartialState(cpu=launched_on_cpu())
    rank = state.process_index
    work = {"batches": {}, "shards": []}
    distill_module.answer_batches = recording_answer_batches(work["batches"], rank_suffix=f".rank{rank}")
    store_module._write_shard = recording_write_shard(work["shards"])
    examples = json.loads((root / "examples.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    build_store(root / "two_store", model, examples, 64, batch_size=2, shard_tokens=SHARD_TOKENS, accelerator=state)
    ensure_store(root / "resumed_store", model, examples, 64, batch_size=2, accelerator=state)
    assert main(distill_args(base, chats, root / "two")) == 0
    (root / f"work.rank{rank}.json").write_text(json.dumps(work))


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
