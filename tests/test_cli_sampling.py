"""``medusa generate`` and ``medusa bench`` with sampling flags on a tiny model."""

from __future__ import annotations

import json

from test_cli import setup  # noqa: F401  (the module fixture: a tiny base, heads and prompts)

from medusa.cli import main


def test_generate_samples_reproducibly(setup, capsys):  # noqa: F811
    root, base, _ = setup
    args = ["generate", "--base", str(base), "--heads", str(root / "heads"), "--prompt", "hello world",
            "--max-new-tokens", "12", "--do-sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert main(args + ["--acceptance", "typical"]) == 0


def test_generate_with_coupled_sampling_prints_the_plain_samples_with_or_without_heads(setup, capsys):  # noqa: F811
    root, base, _ = setup
    common = ["generate", "--base", str(base), "--prompt", "hello world", "--max-new-tokens", "16", "--do-sample",
              "--temperature", "0.9", "--top-k", "0", "--seed", "5", "--acceptance", "coupled"]
    assert main(common + ["--heads", str(root / "heads")]) == 0
    medusa = capsys.readouterr().out
    assert main(common + ["--drafter", "none"]) == 0
    assert capsys.readouterr().out == medusa
    assert main(common[:-4] + ["--seed", "6", "--acceptance", "coupled", "--drafter", "none"]) == 0
    assert capsys.readouterr().out != medusa


def test_generate_refuses_bad_sampling_flags(setup, capsys):  # noqa: F811
    root, base, _ = setup
    common = ["generate", "--base", str(base), "--heads", str(root / "heads"), "--prompt", "hi"]
    assert main(common + ["--do-sample", "--temperature", "0"]) == 2
    assert "temperature must be a positive" in capsys.readouterr().err
    assert main(common + ["--acceptance", "typical"]) == 2
    assert "needs sampling" in capsys.readouterr().err


def test_bench_with_sampling_reports_logprobs(setup, tmp_path):  # noqa: F811
    root, base, prompts = setup
    out = tmp_path / "bench.json"
    assert main(["bench", "--base", str(base), "--heads", str(root / "heads"), "--prompts", str(prompts),
                 "--max-new-tokens", "16", "--do-sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "0",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"].startswith("not applicable")
    for key in ("tau", "speedup", "hf_mean_logprob", "medusa_mean_logprob", "sampling"):
        assert key in result
    assert result["hf_mean_logprob"] < 0 and result["medusa_mean_logprob"] < 0
    assert result["sampling"]["temperature"] == 0.7
