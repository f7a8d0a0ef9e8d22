"""Pictures from small results (matplotlib's Agg backend, no display), eval history, and the load warning."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from medusa.tools.bench import machine_load  # noqa: E402
from medusa.tools.plots import plot_bench, plot_training, plot_tree_report  # noqa: E402
from train.history import HISTORY_NAME, append_evaluation, read_history, write_curves  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def bench_result(per_prompt: bool = True) -> dict:
    result = {"tau": 1.6, "speedup": 1.1, "identical": 1.0, "per_head_accept": [0.5, 0.1, 0.0],
              "baseline_tokens_per_s": 10.0, "medusa_tokens_per_s": 11.0, "prompts": 2,
              "accepted_histogram": [5, 4, 1, 0],
              "max_new_tokens": 16, "tree": "t", "tree_nodes": 5, "dtype": "torch.float32", "device": "cpu",
              "torch_threads": 2, "load": {"load_1min": 0.5, "cores": 2}}
    if per_prompt:
        result["per_prompt"] = [{"prompt": 0, "hf_tokens_per_s": 9.0, "medusa_tokens_per_s": 12.0},
                                {"prompt": 1, "hf_tokens_per_s": 11.0, "medusa_tokens_per_s": 10.0}]
    return result


@pytest.mark.parametrize("deeper_than_heads", [True, False])
@pytest.mark.parametrize("per_prompt", [True, False])
def test_bench_plot_is_a_png(tmp_path, per_prompt, deeper_than_heads):
    result = bench_result(per_prompt)
    if deeper_than_heads:  # a tree with a prompt-lookup chain: drafts kept at depths 4 and 5 too
        result["accepted_histogram"] = [5, 4, 1, 0, 0, 2]
    assert_png(plot_bench(result, tmp_path / "bench.png"))


def test_tree_report_plot_is_a_png(tmp_path):
    table = [{"nodes": n, "expected_tau": 1 + 0.1 * n, "relative_cost": 1 + 0.05 * n,
              "predicted_speedup": (1 + 0.1 * n) / (1 + 0.05 * n)} for n in range(1, 9)]
    report = {"cost_curve": {"1": 1.0, "2": 1.2, "4": 1.3, "8": 1.5, "one_token_s": 0.05}, "head_cost": 0.02,
              "table": table, "chosen_nodes": 8, "accuracy": [[0.3, 0.1]]}
    assert_png(plot_tree_report(report, tmp_path / "tree.report.png"))


def test_tree_report_plot_with_lookup_lengths_is_a_png(tmp_path):
    table = [{"nodes": n, "lookup": length, "expected_tau": 1 + 0.1 * n, "replayed_tau": 1 + 0.1 * n + 0.1 * length,
              "relative_cost": 1 + 0.05 * (n + length), "predicted_speedup": 1.0 + 0.01 * (n + length)}
             for length in (0, 4) for n in range(1, 5)]
    report = {"cost_curve": {"1": 1.0, "2": 1.2, "4": 1.3, "8": 1.5, "one_token_s": 0.05}, "level_cost": 0.02,
              "table": table, "chosen_nodes": 4, "chosen_lookup": 4, "accuracy": [[0.3, 0.1]]}
    assert_png(plot_tree_report(report, tmp_path / "tree.report.png"))


def metrics(loss: float, top1: float) -> dict:
    return {"examples": 4, "loss": loss, "heads": [{"head": k, "offset": k + 2, "top1": top1 / (k + 1), "top5": 0.5,
                                                    "targets": 10, "loss": loss + k} for k in range(3)]}


def test_history_keeps_the_finished_run_and_draws_curves(tmp_path):
    for step, loss in [(2, 5.0), (4, 4.0), (6, 3.5), (4, 3.9), (6, 3.4), (8, 3.0)]:  # resumed from step 4
        append_evaluation(tmp_path, step, metrics(loss, 0.2))
    (tmp_path / HISTORY_NAME).open("a").write('{"step": 9, "hea')  # an interrupted write
    history = read_history(tmp_path)
    assert [h["step"] for h in history] == [2, 4, 6, 8]
    assert [h["loss"] for h in history] == [5.0, 3.9, 3.4, 3.0]
    assert_png(write_curves(tmp_path))
    assert_png(plot_training(history[:1], tmp_path / "one.png"))  # a single evaluation still draws


def test_no_history_draws_nothing(tmp_path):
    assert write_curves(tmp_path) is None
    with pytest.raises(ValueError, match="no held-out evaluation"):
        plot_training([], tmp_path / "x.png")


def test_load_warning_with_a_fake_load_average():
    unknown = lambda: None  # noqa: E731 - no /proc/stat: the load average alone decides
    busy = machine_load(2, loadavg=lambda: (1.5, 1.2, 1.0), cores=2, running=unknown)
    assert busy["load_1min"] == 1.5 and busy["threads"] == 2
    assert "load average 1.5 on 2 cores" in busy["warning"] and "pass --threads 1" in busy["warning"]
    assert "--threads" not in machine_load(1, loadavg=lambda: (1.5, 1.2, 1.0), cores=2, running=unknown)["warning"]
    assert "--threads 2" in machine_load(4, loadavg=lambda: (1.2, 1.0, 1.0), cores=4, running=unknown)["warning"]
    assert machine_load(2, loadavg=lambda: (0.2, 0.3, 0.1), cores=4)["warning"] is None
    assert machine_load(1, loadavg=lambda: None, cores=2) == {"load_1min": None, "load_5min": None,
                                                              "load_15min": None, "running_elsewhere": None,
                                                              "cores": 2, "threads": 1, "warning": None}
    # The average lags: a job that just ended still shows in it. Nothing running elsewhere now: no warning.
    ended = machine_load(2, loadavg=lambda: (1.6, 1.2, 1.0), cores=2, running=lambda: 0)
    assert ended["warning"] is None and ended["running_elsewhere"] == 0
    competing = machine_load(2, loadavg=lambda: (1.6, 1.2, 1.0), cores=2, running=lambda: 1)
    assert "(1 task running elsewhere now)" in competing["warning"]


def test_running_elsewhere_reads_proc_stat():
    from pathlib import Path

    from medusa.tools.bench import running_elsewhere

    now = running_elsewhere(samples=2, interval_s=0.0)
    if Path("/proc/stat").is_file():
        assert isinstance(now, int) and now >= 0
    else:
        assert now is None


def test_plot_command_dispatches_on_the_json(tmp_path, capsys):
    from medusa.cli import main

    (tmp_path / "b.json").write_text(json.dumps(bench_result()))
    (tmp_path / "other.json").write_text("{}")
    append_evaluation(tmp_path / "run", 2, metrics(4.0, 0.2))
    assert main(["plot", str(tmp_path / "b.json"), str(tmp_path / "run")]) == 0
    assert_png(tmp_path / "b.png")
    assert_png(tmp_path / "run" / "eval.png")
    assert main(["plot", str(tmp_path / "other.json")]) == 2
    assert "neither a bench result nor a build-tree report" in capsys.readouterr().err


def test_missing_matplotlib_names_the_install_command(tmp_path, monkeypatch, capsys):
    from medusa.cli import main
    from medusa.tools import plots

    def missing():
        raise ImportError(f"plots need matplotlib: {plots.INSTALL_HINT}")

    monkeypatch.setattr(plots, "pyplot", missing)
    append_evaluation(tmp_path, 2, metrics(4.0, 0.2))
    assert write_curves(tmp_path) is None  # training does not fail for a picture
    assert main(["bench", "--base", "b", "--heads", "h", "--prompts", "p", "--out", str(tmp_path / "b.json"),
                 "--plot"]) == 2
    assert 'pip install -e ".[plots]"' in capsys.readouterr().err
