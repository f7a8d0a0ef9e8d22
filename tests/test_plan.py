"""medusa plan: the seed's analysis (Leviathan et al. 2023) as functions and a CLI; the worked example and the
exercises (docs/plan.md), the edge cases, and bad input."""

from __future__ import annotations

import doctest

import pytest

from medusa.cli import main
from medusa.tools import plan
from medusa.tools.bench import chain_prediction


def test_the_modules_worked_example_and_exercises_hold():
    failures, tried = doctest.testmod(plan)
    assert tried >= 4 and failures == 0


def test_expected_tokens_edges_and_per_depth_rates():
    assert plan.expected_tokens(1.0, 5) == 6.0  # every draft accepted: K + 1
    assert plan.expected_tokens(0.0, 5) == 1.0  # none: the base's own token
    assert plan.expected_tokens([0.5, 0.5, 0.5]) == pytest.approx(plan.expected_tokens(0.5, 3))
    assert plan.expected_tokens([0.9, 0.5], 1) == pytest.approx(1.9)
    assert plan.expected_tokens([0.9, 0.5]) == pytest.approx(1 + 0.9 + 0.45)
    # a brute-force sum over acceptance lengths agrees with the closed form
    a, k = 0.7, 8
    brute = sum((n + 1) * a ** n * (1 - a) for n in range(k)) + (k + 1) * a ** k
    assert plan.expected_tokens(a, k) == pytest.approx(brute)


def test_optimal_k_is_the_table_maximum_and_a_dearer_verify_shortens_it():
    rows = plan.plan_table(0.9, 0.05)
    best = max(rows, key=lambda r: r["speedup"])
    assert plan.optimal_k(0.9, 0.05) == (best["k"], round(best["speedup"], 2))
    k_dear, s_dear = plan.optimal_k(0.9, 0.05, verify_cost=lambda k: 1 + 0.2 * k)
    assert k_dear < best["k"] and s_dear < best["speedup"]


def test_the_bench_prediction_uses_the_same_formula():
    hist = [10, 5, 3, 2]  # steps that accepted 0..3 drafts
    pred = chain_prediction(hist, step_cost=1.2)
    assert pred["predicted_tau"] == pytest.approx(plan.expected_tokens(pred["alpha"], 3))
    assert pred["predicted_speedup"] == pytest.approx(pred["predicted_tau"] / 1.2)


def test_plan_cli_prints_the_worked_example_and_the_tree(capsys):
    assert main(["plan", "--alpha", "0.8", "--cost-ratio", "0.05", "--k", "5", "--branching", "3", "--depth",
                 "4"]) == 0
    out = capsys.readouterr().out
    assert "K=5: 3.689 tokens, cost 1.250, 2.95x" in out
    assert "81 candidate paths, 120 draft nodes" in out
    assert "optimal K: 8" in out  # k-max 16: the best K for alpha 0.8 at c = 0.05 (3.09x)


@pytest.mark.parametrize("argv, message", [
    (["--alpha", "1.2", "--cost-ratio", "0.05"], "alpha must be in [0, 1], got 1.2"),
    (["--alpha", "-0.1", "--cost-ratio", "0.05"], "alpha must be in [0, 1], got -0.1"),
    (["--alpha", "0.5", "--cost-ratio", "0"], "cost ratio c_q/c_p must be > 0"),
    (["--alpha", "0.5", "--cost-ratio", "-1"], "cost ratio c_q/c_p must be > 0"),
    (["--alpha", "0.5", "--cost-ratio", "0.1", "--branching", "3"], "--branching and --depth go together"),
    (["--alpha", "0.5", "--cost-ratio", "0.1", "--branching", "0", "--depth", "2"], "tree branching must be"),
])
def test_plan_bad_input_is_named(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
