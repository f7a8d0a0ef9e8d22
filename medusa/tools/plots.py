"""Pictures of a bench result, a tree-sizing report and a training run (matplotlib, PNG, no display needed).

Each function takes the JSON the command already writes (or the list it already holds) and saves one PNG; nothing
here runs a model. matplotlib is optional (``pip install -e ".[plots]"``): :func:`pyplot` raises an ``ImportError``
naming that command when it is missing.
"""

from __future__ import annotations

from pathlib import Path

INSTALL_HINT = 'pip install -e ".[plots]"  (or: pip install matplotlib)'
HEAD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, works without a display).

    Raises:
        ImportError: matplotlib is not installed; the message names the install command.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"plots need matplotlib: {INSTALL_HINT}") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def plot_bench(result: dict, path: str | Path) -> Path:
    """Three panels from a ``medusa bench`` result: tokens per step, per-head acceptance, and each prompt's speedup
    over HF ``generate`` and over plain decoding (sorted, with the 1.0x line: the prompts below it were slower); a
    fourth with the per-step tree's sizes (how many steps verified a tree of n nodes; n = 1: a plain step) when the
    tree changed from step to step.

    Args:
        result: the bench JSON (:func:`medusa.tools.bench.run_bench`); ``per_prompt`` is optional (older results lack
            it; the third panel then shows the totals).
        path: PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    sizes = (result.get("tree_sizes") or {}).get("histogram") or {}
    per_step = len(sizes) > 1
    fig, axes = plt.subplots(1, 4 if per_step else 3, figsize=(20 if per_step else 15, 4.2))
    ax_hist, ax_heads, ax_speed = axes[:3]
    if per_step:
        _plot_tree_sizes(axes[3], result["tree_sizes"], result.get("step_ms", {}).get("choose"))
    hist = result["accepted_histogram"]
    steps = max(sum(hist), 1)
    emitted = range(1, len(hist) + 1)  # accepted drafts + the base's own token
    bars = ax_hist.bar(emitted, [100 * c / steps for c in hist], color="tab:blue")
    ax_hist.bar_label(bars, fmt="%.0f%%")
    ax_hist.axvline(result["tau"], color="black", linestyle="--", label=f"tau = {result['tau']:.2f}")
    ax_hist.set(xlabel="tokens emitted per verify forward (accepted drafts + 1)", ylabel="verify forwards (%)",
                title=f"Tokens per step ({sum(hist)} steps)", xticks=list(emitted),
                ylim=(0, 115 * max(hist) / steps or 1))
    ax_hist.legend()

    from medusa.tools.bench import kept_by_depth

    accept = kept_by_depth(hist)  # depth d: head d-1's draft or the d-th copied token of a prompt-lookup chain
    ticks = list(range(1, len(accept) + 1))
    bars = ax_heads.bar(ticks, [100 * a for a in accept],
                        color=[HEAD_COLORS[k % len(HEAD_COLORS)] for k in range(len(accept))])
    ax_heads.bar_label(bars, fmt="%.0f%%")
    ax_heads.set(xlabel="draft depth d (token t+d+1; heads' nodes or the copied chain)",
                 ylabel="verify forwards that kept a draft at depth d (%)", title="Drafts kept by depth",
                 xticks=ticks, ylim=(0, 100))

    rows = [r for r in result.get("per_prompt") or [] if "hf_tokens_per_s" in r] or [
        {"prompt": "all", "hf_tokens_per_s": result["baseline_tokens_per_s"],
         "medusa_tokens_per_s": result["medusa_tokens_per_s"], "plain_tokens_per_s": result.get("plain_tokens_per_s")}]
    vs_hf = sorted(r["medusa_tokens_per_s"] / r["hf_tokens_per_s"] for r in rows)
    vs_plain = sorted(r["medusa_tokens_per_s"] / r["plain_tokens_per_s"] for r in rows if r.get("plain_tokens_per_s"))
    ranks = [100 * (i + 0.5) / len(vs_hf) for i in range(len(vs_hf))]
    ax_speed.plot(ranks, vs_hf, marker="o", color="tab:blue", label=f"vs HF generate (min {vs_hf[0]:.2f}x)")
    if vs_plain:
        ax_speed.plot([100 * (i + 0.5) / len(vs_plain) for i in range(len(vs_plain))], vs_plain, marker="s",
                      color="tab:orange", label=f"vs plain decoding (min {vs_plain[0]:.2f}x, "
                      f"{sum(v < 1 for v in vs_plain)} below 1)")
    ax_speed.axhline(1.0, color="black", linewidth=1)
    ax_speed.set(xlabel="prompts, sorted by speedup (%)", ylabel="Medusa speedup (tokens/s ratio)", xlim=(0, 100),
                 title=f"Per-prompt speedup ({len(rows)} prompts; {result['speedup']:.2f}x HF overall)")
    ax_speed.legend(loc="upper left")
    fig.suptitle(_bench_caption(result), fontsize=10)
    return _save(fig, path)


def _plot_tree_sizes(ax, tree_sizes: dict, choose_ms: float | None) -> None:
    """The per-step tree's sizes: steps (%) by nodes per tree, the mean and the plain steps' share."""
    counts = {int(n): c for n, c in tree_sizes["histogram"].items()}
    steps = max(sum(counts.values()), 1)
    ax.bar(list(counts), [100 * c / steps for c in counts.values()], color="tab:green", width=0.9)
    ax.axvline(tree_sizes["mean"], color="black", linestyle="--", label=f"mean {tree_sizes['mean']:.1f} nodes")
    overhead = f", choosing {choose_ms:.2f} ms/step" if choose_ms is not None else ""
    ax.set(xlabel="nodes in the step's tree (root included; 1: a plain step)", ylabel="verify forwards (%)",
           title=f"Tree sizes ({100 * tree_sizes['plain_fraction']:.0f}% plain{overhead})")
    ax.legend()


def _bench_caption(result: dict) -> str:
    nodes = result.get("tree_nodes")
    most = "at most " if result.get("tree") == "per-step" else ""
    parts = [f"tree {result.get('tree', '?')} ({most}{'?' if nodes is None else nodes - 1} nodes + root)",
             f"{result['prompts']} prompts x {result.get('max_new_tokens', '?')} new tokens",
             f"identical to HF greedy: {100 * result['identical']:.0f}% of prompts",
             f"{result.get('dtype', '?')}, {result.get('device', '?')}",
             f"torch threads: {result.get('torch_threads', '?')}"]
    load = result.get("load")
    if load and load.get("load_1min") is not None:
        parts.append(f"load {load['load_1min']:.1f} on {load['cores']} cores")
    return "   |   ".join(parts)


def plot_tree_report(report: dict, path: str | Path) -> Path:
    """Three panels from a ``medusa build-tree`` report: tau, the verify cost, the predicted speedup.

    The x axis of the first and last panels is the heads' node budget (draft nodes, root excluded), one line per
    prompt-lookup length tried (reports from before lookup have one line, length 0); the verify forward of a tree
    with b heads' nodes and a lookup chain of L carries b + L + 1 tokens. The chosen tree is marked in all three.

    Args:
        report: the ``<tree>.report.json`` (``table``, ``cost_curve``, ``level_cost``, ``chosen_nodes``,
            optionally ``chosen_lookup``).
        path: PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    table, chosen, chosen_lookup = report["table"], report["chosen_nodes"], report.get("chosen_lookup", 0)
    best = next(r for r in table if r["nodes"] == chosen and r.get("lookup", 0) == chosen_lookup)
    lengths = sorted({r.get("lookup", 0) for r in table})
    fig, (ax_tau, ax_cost, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.2))

    def tau_of(row):
        return row.get("replayed_tau", row["expected_tau"])

    for length in lengths:
        rows = [r for r in table if r.get("lookup", 0) == length]
        budgets = [r["nodes"] for r in rows]
        label = f"lookup {length}" if length else "heads only"
        ax_tau.plot(budgets, [tau_of(r) for r in rows], marker=".", label=label)
        ax_speed.plot(budgets, [r["predicted_speedup"] for r in rows], marker=".", label=label)
    replayed = "replayed_tau" in best
    ax_tau.set(xlabel="heads' tree nodes (root excluded)",
               ylabel=f"{'replayed' if replayed else 'expected'} tau (tokens / verify forward)",
               title="Acceptance length")
    ax_tau.legend(fontsize="small")

    curve = {int(k): v for k, v in report["cost_curve"].items() if k.isdigit()}
    sizes = sorted(curve)
    ax_cost.plot(sizes, [curve[n] for n in sizes], marker="o", color="tab:red", label="measured forward cost")
    tokens = chosen + chosen_lookup + 1
    ax_cost.axvline(tokens, color="black", linestyle="--", label=f"chosen: {tokens} tokens")
    one_token_ms = 1000 * report["cost_curve"].get("one_token_s", float("nan"))
    ax_cost.set(xscale="log", xlabel="tokens in one verify forward (nodes + root)",
                ylabel="cost (× one-token forward)",
                title=f"Verify cost (one token = {one_token_ms:.0f} ms; + {report.get('level_cost', 0):.2f} a level)")
    ax_cost.set_xticks(sizes, [str(n) for n in sizes])
    ax_cost.legend()

    ax_speed.axhline(1.0, color="gray", linewidth=0.8)
    ax_speed.set(xlabel="heads' tree nodes (root excluded)", ylabel="predicted speedup (× plain decoding)",
                 title="Predicted speedup = tau / cost")
    for ax in (ax_tau, ax_speed):
        ax.axvline(chosen, color="black", linestyle="--")
    lookup = f" + lookup {chosen_lookup}" if chosen_lookup else ""
    ax_speed.annotate(f"chosen: {chosen} nodes{lookup}\ntau {tau_of(best):.2f}, {best['predicted_speedup']:.2f}x",
                      xy=(chosen, best["predicted_speedup"]), xytext=(0.45, 0.88), textcoords="axes fraction",
                      arrowprops={"arrowstyle": "->"})
    return _save(fig, path)


def plot_training(history: list[dict], path: str | Path) -> Path:
    """Per-head held-out loss and top-1 accuracy against the optimizer step.

    Args:
        history: held-out evaluations in step order, each ``{"step", "heads": [{"head", "offset", "loss",
            "top1"}, ...]}`` (as :func:`train.trainer.evaluate` returns, with the step added).
        path: PNG to write.

    Returns:
        ``path``.

    Raises:
        ValueError: ``history`` is empty.
    """
    if not history:
        raise ValueError("no held-out evaluation to plot")
    plt = pyplot()
    fig, (ax_loss, ax_top1) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps = [h["step"] for h in history]
    for k, head in enumerate(history[-1]["heads"]):
        color = HEAD_COLORS[k % len(HEAD_COLORS)]
        label = f"head {head['head']} (token t+{head['offset']})"
        ax_loss.plot(steps, [h["heads"][k]["loss"] for h in history], marker="o", color=color, label=label)
        ax_top1.plot(steps, [100 * h["heads"][k]["top1"] for h in history], marker="o", color=color, label=label)
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy (nats / token)", title="Held-out loss per head")
    ax_top1.set(xlabel="optimizer step", ylabel="top-1 accuracy (%)", title="Held-out top-1 per head")
    ax_top1.set_ylim(bottom=0)
    ax_loss.legend()
    return _save(fig, path)


def plot_profile(profile: dict, path: str | Path) -> Path:
    """A machine profile's cost curves (:meth:`medusa.profile.MachineProfile.to_dict`): forward milliseconds by new
    tokens per engine, HF ``generate``'s and each engine's plain decoding per token as horizontal marks.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, (ax_abs, ax_rel) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (name, entry) in enumerate(profile["engines"].items()):
        if "error" in entry:
            continue
        curve = sorted((int(k), 1e3 * v) for k, v in entry["forward_s"].items())
        color = HEAD_COLORS[i % len(HEAD_COLORS)]
        ax_abs.plot([n for n, _ in curve], [ms for _, ms in curve], marker="o", color=color, label=name)
        ax_abs.axhline(1e3 * entry["plain_token_s"], color=color, linestyle=":", linewidth=1)
        ax_rel.plot([n for n, _ in curve], [ms / curve[0][1] for _, ms in curve], marker="o", color=color, label=name)
    hf = profile.get("hf_generate_token_s")
    if hf:
        ax_abs.axhline(1e3 * hf, color="black", linestyle="--", label=f"HF generate per token ({1e3 * hf:.1f} ms)")
    ax_abs.set(xlabel="new tokens in one forward", ylabel="ms", xscale="log", xticks=[1, 2, 4, 8, 16, 32, 64],
               title="Forward cost (dotted: plain decoding per token)")
    ax_abs.set_xticklabels(["1", "2", "4", "8", "16", "32", "64"])
    ax_abs.legend()
    ax_rel.set(xlabel="new tokens in one forward", ylabel="cost / one-token forward", xscale="log",
               xticks=[1, 2, 4, 8, 16, 32, 64], title="Relative verify cost (what build-tree sizes trees by)")
    ax_rel.set_xticklabels(["1", "2", "4", "8", "16", "32", "64"])
    ax_rel.legend()
    key = profile["key"]
    fig.suptitle(f"{key['cpu'] if key['device'] == 'cpu' else key['device']}, {key['torch_threads']} threads, "
                 f"{key['dtype']}, {key['model'].get('architecture')}", fontsize=10)
    return _save(fig, path)

