"""The text the ``medusa`` command prints for bench, batched bench and drift results.

Pure formatting of the result dictionaries :mod:`medusa.tools.bench` and :mod:`medusa.tools.drift` return (and write
as JSON); no model, no timing.
"""

from __future__ import annotations

from pathlib import Path


def speedup_text(value) -> str:
    """A ratio as ``1.234x`` (anything else, a missing value or "not timed", as :func:`fmt` writes it)."""
    return f"{value:.3f}x" if isinstance(value, float) else fmt(value)


def lookup_text(r: dict) -> str:
    """The share of emitted tokens that were accepted prompt-lookup drafts, and tau counting only the rest."""
    if "lookup_share" not in r:
        return "not recorded"
    return f"{100 * r['lookup_share']:.1f}%, {r['tau_without_lookup_tokens']:.3f}"


def bench_table(result: dict, reference: dict | None = None, reference_name: str | None = None) -> str:
    """The bench figures as aligned text; with ``reference``, a second column holds that earlier result's."""
    def rows(r: dict) -> list[tuple[str, str]]:
        return [("prompts x max new tokens", f"{r['prompts']} x {r.get('max_new_tokens', '?')}"),
                ("tau (tokens / verify forward)", f"{r['tau']:.3f}"),
                ("lookup chain's share of tokens, tau less them", lookup_text(r)),
                ("HF generate tokens/s", f"{r['baseline_tokens_per_s']:.2f}"),
                ("Medusa tokens/s", f"{r['medusa_tokens_per_s']:.2f}"), ("speedup", f"{r['speedup']:.3f}x"),
                ("plain tokens/s (same engine)", fmt(r.get("plain_tokens_per_s"))),
                ("speedup vs plain (same engine)", speedup_text(r.get("speedup_vs_plain"))),
                ("HF prompt lookup tokens/s", fmt(r.get("hf_prompt_lookup_tokens_per_s", "not timed"))),
                ("speedup vs HF prompt lookup", speedup_text(r.get("speedup_vs_hf_prompt_lookup", "not timed"))),
                ("per prompt vs HF: min/median/max", spread_text((r.get("per_prompt_speedup") or {}).get("vs_hf"))),
                ("per prompt vs plain: min/median/max",
                 spread_text((r.get("per_prompt_speedup") or {}).get("vs_plain"))),
                ("prompts slower than plain / HF", slower_text(r.get("per_prompt_speedup"))),
                ("step ms: draft/choose/forward/accept/cache", step_text(r.get("step_ms"))),
                ("tree sizes: mean (root incl.), plain steps", tree_sizes_text(r.get("tree_sizes"))),
                ("fixed tree tokens/s", fmt(r.get("fixed_tokens_per_s", "not timed"))),
                ("speedup vs fixed tree", speedup_text(r.get("speedup_vs_fixed", "not timed"))),
                ("step cost / plain step", fmt(r.get("step_cost_vs_plain"))),
                ("engine, dtype, verify logits", f"{engine_text(r.get('engine'))}, {r.get('dtype', '?')}, "
                                                  f"{r.get('verify_logits', '?')}"),
                ("machine", machine_text(r)),
                ("machine profile", Path((r.get("profile") or {}).get("path", "not recorded")).name),
                ("identical prompts", fmt(r["identical"])),
                ("identical to plain, same engine", fmt(r.get("identical_to_plain"))),
                ("divergences: ties / true", f"{r.get('ties', '?')} / {r.get('true_divergences', '?')}"),
                ("per-head accept", " ".join(f"{a:.3f}" for a in r["per_head_accept"])),
                ("kept a draft at depth 1, 2, ...", " ".join(f"{a:.3f}" for a in r.get("per_depth_accept", []))),
                ("tree", f"{r.get('tree', '?')} ({'at most ' if r.get('tree') == 'per-step' else ''}"
                         f"{r['tree_nodes'] if 'tree_nodes' in r else '?'} nodes, root included)"),
                ("torch threads", f"{r.get('torch_threads', '?')}"),
                ("load average (1 min) / cores", load_text(r.get("load"))),
                ("predicted tau / speedup (chain)", prediction_text(r.get("prediction"))),
                ("predicted vs measured: tau, speedup vs plain", predicted_vs_measured(r))] + [
                (f"{m} mean log-prob/token",
                 f"{r[f'{m}_mean_logprob']:.4f} (+- {fmt(r[f'{m}_mean_logprob_stderr'])})")
                for m in ("hf", "medusa") if f"{m}_mean_logprob" in r]
    mine = rows(result)
    width = max(len(k) for k, _ in mine)
    if reference is None:
        return "\n".join(f"{k:<{width}}  {v}" for k, v in mine)
    theirs = dict(rows(reference))
    column = max(len(v) for _, v in mine + [("", "this run")])
    lines = [f"{'':<{width}}  {'this run':<{column}}  {reference_name or 'reference'}"]
    lines += [f"{k:<{width}}  {v:<{column}}  {theirs.get(k, '')}" for k, v in mine]
    same = same_prompts_text(result, reference)
    if same:
        lines.append(f"{'reference, same prompts only':<{width}}  {'':<{column}}  {same}")
    return "\n".join(lines)


def batch_bench_table(result: dict) -> str:
    """The batched bench as text: tokens/s per method and batch size, identical prompts, Medusa tau."""
    lines = [f"{'batch':>5}  {'method':6}  {'tokens/s':>9}  {'identical':>9}  {'tau':>5}"]
    for size, by_method in result["results"].items():
        for method, r in by_method.items():
            tau = f"{r['tau']:.2f}" if "tau" in r else ""
            lines.append(f"{size:>5}  {method:6}  {r['tokens_per_s']:9.2f}  {r['identical']:>4}/{result['prompts']:<4}"
                         f"  {tau:>5}")
    return "\n".join(lines)


def same_prompts_text(result: dict, reference: dict) -> str | None:
    """The reference's tau and speedup over just the prompts this run decoded, when it decoded a subset of the
    reference's prompts (same indices, same token counts); ``None`` otherwise. A subset's tau can differ a lot from
    the whole set's (prompts differ in how much the base repeats itself)."""
    ours, theirs = result.get("per_prompt") or [], {p["prompt"]: p for p in reference.get("per_prompt") or []}
    if not ours or len(ours) >= len(theirs):
        return None
    picked = [theirs.get(p["prompt"]) for p in ours]
    if any(t is None or t["tokens"] != p["tokens"] for t, p in zip(picked, ours, strict=True)):
        return None
    # As the bench's tau: decode tokens (the prefill's token excluded) over decode steps; a prompt the prefill alone
    # answered (tau NaN) has neither.
    decoded = [(t["tokens"] - 1, (t["tokens"] - 1) / t["tau"]) for t in picked if t["tokens"] > 1 and t["tau"] > 0]
    tokens, steps = sum(d for d, _ in decoded), sum(s for _, s in decoded)
    hf_tokens = sum(t.get("hf_tokens_per_s", 0.0) * t["hf_s"] for t in picked) or sum(t["tokens"] for t in picked)
    medusa_s, hf_s = sum(t["medusa_s"] for t in picked), sum(t["hf_s"] for t in picked)
    if not steps or not medusa_s or not hf_s:
        return None
    speedup = (sum(t["tokens"] for t in picked) / medusa_s) / (hf_tokens / hf_s)  # tokens/s over tokens/s
    return f"tau {tokens / steps:.3f}, speedup {speedup:.3f}x ({len(picked)} of its {len(theirs)} prompts)"


def spread_text(spread: dict | None) -> str:
    """A per-prompt spread (:func:`medusa.tools.bench.spread`) as ``0.91x / 1.40x / 2.10x``."""
    if not spread:
        return "not recorded"
    return " / ".join(f"{spread[k]:.2f}x" for k in ("min", "median", "max"))


def slower_text(per_prompt: dict | None) -> str:
    """How many prompts Medusa decoded slower than plain decoding and than HF ``generate``, of how many."""
    if not per_prompt:
        return "not recorded"
    plain = per_prompt["slower_than_plain"] if per_prompt.get("vs_plain") else "?"
    return f"{plain} / {per_prompt['slower_than_hf']} of {per_prompt['prompts']}"


def machine_text(result: dict) -> str:
    """The CPU (model and the flags that matter) or the device a result was measured on."""
    cpu = result.get("cpu")
    if result.get("device", "cpu").startswith("cuda") or not cpu:
        return str(result.get("device", "not recorded"))
    return f"{cpu['model']} ({' '.join(cpu['flags']) or 'no AVX2/AVX-512/AMX'})"


def predicted_vs_measured(r: dict) -> str:
    """The seed's prediction beside the run's measured tau and speedup over plain decoding, with the gap."""
    prediction = r.get("prediction") or {}
    predicted, measured = prediction.get("predicted_speedup"), r.get("speedup_vs_plain")
    if predicted is None or measured is None:
        return "not recorded"
    return (f"{prediction['predicted_tau']:.2f} vs {r['tau']:.2f}, {predicted:.2f}x vs {measured:.2f}x "
            f"(measured {100 * (measured / predicted - 1):+.1f}%)")


def prediction_text(prediction: dict | None) -> str:
    """A bench's chain prediction (:func:`medusa.tools.bench.chain_prediction`) as text."""
    if not prediction:
        return "not recorded"
    speedup = prediction.get("predicted_speedup")
    draft = "" if "cost_ratio" not in prediction else f", c_q/c_p {prediction['cost_ratio']:.3f}"
    return (f"{prediction['predicted_tau']:.2f} / {'?' if speedup is None else f'{speedup:.2f}x'} (alpha "
            f"{prediction['alpha']:.2f}, step {prediction.get('step_cost', float('nan')):.2f}x one token{draft})")


def tree_sizes_text(sizes: dict | None) -> str:
    """The steps' tree sizes: mean nodes (root included) and the share of plain steps."""
    if not sizes or sizes.get("mean") is None:
        return "not recorded"
    return f"{sizes['mean']:.1f} nodes, {100 * sizes['plain_fraction']:.0f}% plain steps"


def step_text(step_ms: dict | None) -> str:
    """Milliseconds per Medusa step by part: draft / choose (the per-step tree's) / verify forward / accept / cache
    (total); results from before the choose part existed show 0 there."""
    if not step_ms:
        return "not recorded"
    parts = " / ".join(f"{step_ms.get(k, 0.0):.1f}" for k in ("draft", "choose", "verify_forward", "accept", "cache"))
    return f"{parts} (total {step_ms['total']:.1f})"


def engine_text(engine: dict | None) -> str:
    """The engine a bench ran on, with the static fallback and its reason when it could not pack or compile."""
    if not engine:
        return "not recorded"
    name = engine.get("engine")
    if (name == "compiled" and not engine.get("compiled")) or (name == "onednn" and not engine.get("packed")):
        return f"{name} -> static ({engine.get('fallback_reason')})"
    return f"{name} (chosen by auto)" if engine.get("auto") else name


def load_text(load: dict | None) -> str:
    """The 1-minute load average over the usable cores."""
    if not load or load.get("load_1min") is None:
        return "not recorded"
    return f"{load['load_1min']:.1f} / {load['cores']}"


def fmt(value) -> str:
    """A float to three decimals; anything else as ``str``."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def drift_text(result: dict) -> str:
    """A drift result (:func:`medusa.tools.drift.drift`) in one line."""
    return (f"top-1 agreement {result['top1_agreement']:.4f}, NLL adapted {result['adapted_nll']:.4f} vs original "
            f"{result['original_nll']:.4f} nats/token ({result['tokens']} tokens)")


def profile_table(profile: dict, path: str | None = None, choices: dict[int, str] | None = None) -> str:
    """A machine profile (:meth:`medusa.profile.MachineProfile.to_dict`) as text: the key, Hugging Face ``generate``
    per token, per engine its plain decoding per token and its forward's milliseconds by step size (batched sizes
    after), then ``auto``'s pick for each step size in ``choices`` (``{step size: reason}``)."""
    key = profile["key"]
    measured = profile.get("measured") or {}
    lines = [f"profile: {path or '(not stored)'} (measured {measured.get('at', '?')} in "
             f"{measured.get('seconds', '?')} s, {measured.get('prefix_len', '?')} cached tokens before each timed "
             "forward)",
             f"machine: {key['cpu']} ({' '.join(key['cpu_flags']) or 'no AVX2/AVX-512/AMX flags'}), {key['cores']} "
             f"cores, {key['torch_threads']} torch threads, torch {key['torch']}, transformers {key['transformers']}",
             f"model: {key['model'].get('architecture')} {key['model'].get('hidden_size')}x"
             f"{key['model'].get('num_hidden_layers')}, vocab {key['model'].get('vocab_size')}, {key['dtype']} on "
             f"{key['device']}"]
    hf = profile.get("hf_generate_token_s")
    lines.append(f"HF generate: {'?' if hf is None else f'{1e3 * hf:.1f}'} ms per new token")
    sizes = sorted({int(n) for e in profile["engines"].values() for n in e.get("forward_s", {})})
    head = f"{'engine':8}  {'plain ms/token':>14}  " + "  ".join(f"{'n=' + str(n):>7}" for n in sizes)
    lines += ["", "forward ms over n new tokens (batch 1):", head]
    for name, entry in profile["engines"].items():
        if "error" in entry:
            lines.append(f"{name:8}  could not run here: {entry['error']}")
            continue
        curve = {int(k): v for k, v in entry["forward_s"].items()}
        cells = "  ".join(f"{1e3 * curve[n]:7.1f}" if n in curve else f"{'':7}" for n in sizes)
        lines.append(f"{name:8}  {1e3 * entry['plain_token_s']:14.1f}  {cells}")
        split = entry.get("one_token_split_s")
        if split:
            lines.append(f"{'':8}  one token: {1e3 * split['products_s']:.1f} ms in matrix products, "
                         f"{1e3 * split['outside_s']:.1f} ms outside them")
            whole, one = split["products_s"] + split["outside_s"], curve.get(1)
            if one and whole > 1.5 * one:  # timed apart from the curve: a busy machine, or the profiler's own cost
                lines.append(f"{'':8}  (the split's forward took {1e3 * whole:.1f} ms against {1e3 * one:.1f} ms in "
                             "the curve: it was timed on a busy machine; measure again when the machine is idle)")
        for batch, by_n in (entry.get("batch_forward_s") or {}).items():
            text = ", ".join(f"n={k} {1e3 * v:.1f} ms" for k, v in by_n.items())
            lines.append(f"{'':8}  batch {batch}: {text}")
    for name, by_key in (profile.get("drafters") or {}).items():
        per_depth = " / ".join(f"{1e3 * s:.2f}" for s in by_key["per_depth_s"])
        lines.append(f"drafter {name}: {per_depth} ms per tree level (depth 1, 2, ...)")
    for size, reason in (choices or {}).items():
        lines.append(f"auto for {size}-token steps: {reason}")
    return "\n".join(lines)


def tree_text(model, stats) -> str:
    """The tree a decode used, for ``--stats``: the fixed tree's name and size, or the per-step tree's sizes
    (``stats``: a :class:`medusa.decode.loop.GenerationStats`)."""
    if not model.per_step:
        return f"{model.tree.name} ({model.tree.num_nodes - 1} nodes + root)"
    sizes = stats.tree_nodes or [1]
    plain = sum(n == 1 for n in sizes) / len(sizes)
    return (f"per-step, {sum(sizes) / len(sizes):.1f} nodes on average (root included), {min(sizes)}-{max(sizes)}, "
            f"{100 * plain:.0f}% plain steps")


def generate_stats_text(model, stats) -> str:
    """``medusa generate --stats``: tokens, tau, forwards, tokens/s and the tree; the lookup chain's share on a
    second line when it copied tokens."""
    text = (f"tokens: {stats.new_tokens}  tau: {stats.tau:.2f} tokens/forward  verify forwards: "
            f"{stats.decode_steps}  tokens/s: {stats.tokens_per_s:.1f}  tree: {tree_text(model, stats)}")
    if stats.copied_tokens:
        text += (f"\nlookup chain: {stats.lookup_share:.0%} of the tokens copied from the context; tau without them "
                 f"{stats.tau_without_lookup:.2f}")
    return text


def batch_stats_text(model, first: int, outputs: list, stats) -> str:
    """``medusa generate --prompts --stats``: one batch's figures (``stats``: a :class:`medusa.decode.batch.
    BatchStats`)."""
    taus = ", ".join(f"{s.tau:.2f}" for s in stats.rows)
    return (f"prompts {first}-{first + len(outputs) - 1}: tokens {stats.new_tokens}  batched forwards "
            f"{stats.forwards}  tau per prompt [{taus}]  tokens/s {stats.tokens_per_s:.1f}  tree: "
            f"{tree_text(model, stats.rows[0])}")


def bench_progress_line(i: int, total: int, record: dict, per_step: bool) -> str:
    """One prompt's line as the bench runs."""
    line = f"[{i + 1}/{total}] tokens {record['tokens']:4d}  tau {record['tau']:.2f}  "
    line += f"hf {record['hf_s']:.2f}s  medusa {record['medusa_s']:.2f}s"
    for key, name in (("speedup_vs_hf", "hf"), ("speedup_vs_plain", "plain"), ("speedup_vs_fixed", "fixed")):
        if record.get(key) is not None:
            line += f"  {record[key]:.2f}x {name}"
    if per_step:
        line += f"  nodes {record['mean_tree_nodes']:.1f}"
    return line + (f"  DIVERGED at {record['diverged_at']}" if "diverged_at" in record else "")


def batch_progress_line(size: int, method: str, record: dict) -> str:
    """One batch size and method's line as the batched bench runs."""
    return f"[batch {size}] {method:6s} {record['tokens']:5d} tokens in {record['seconds']:.1f}s"


def bench_text(result: dict, reference: dict | None = None, reference_name: str | None = None) -> str:
    """:func:`bench_table`, then a line per divergence from Hugging Face's tokens."""
    return "\n".join([bench_table(result, reference, reference_name)]
                     + [divergence_text(d) for d in result["divergences"]])


def divergence_text(d: dict) -> str:
    """A bench divergence: where, the base's top-2 gap there, and whether it was a numerical tie."""
    kind = "tie" if d.get("tie") else "true divergence"
    return (f"divergence: prompt {d['prompt']} at token {d['position']}, base top-2 gap {d['base_top2_gap']:.3g} "
            f"({kind})")


def plan_text(rows: list[dict], header: str) -> str:
    """``medusa plan``'s table of tokens, cost and speedup per K, and the optimal K."""
    lines = [header, f"{'K':>3} {'tokens/round':>13} {'cost/round':>11} {'speedup':>8}"]
    lines += [f"{r['k']:>3} {r['tokens']:>13.3f} {r['cost']:>11.3f} {r['speedup']:>7.2f}x" for r in rows]
    best = max(rows, key=lambda r: r["speedup"])
    lines.append(f"optimal K: {best['k']} ({best['speedup']:.2f}x, {best['tokens']:.2f} tokens per round)")
    return "\n".join(lines)


def head_accuracy_text(top1: list[float], top5: list[float]) -> str:
    """``medusa eval-heads``: each head's top-1 and top-5 accuracy."""
    return "\n".join(f"head {k} (token t+{k + 2}): top-1 {a1:.3f}  top-5 {a5:.3f}"
                     for k, (a1, a5) in enumerate(zip(top1, top5, strict=True)))


def build_tree_text(tree, report: dict, out: str, seconds: float) -> str:
    """``medusa build-tree``'s summary: accuracy per head, the cost curve and the tree chosen."""
    best = report["chosen"]
    lookup = f" and a {tree.lookup_length}-token prompt-lookup chain" if tree.lookup_length else ""
    curve = {int(k) if k.isdigit() else k: round(v, 3) for k, v in report["cost_curve"].items()}
    return (f"top-1 accuracy per head: {[round(a[0], 3) for a in report['accuracy']]}\ncost curve: {curve}\n"
            f"chose {len(tree.paths)} nodes{lookup}: replayed tau {best['replayed_tau']:.2f} (heads alone, expected "
            f"{best['expected_tau']:.2f}), predicted speedup {best['predicted_speedup']:.2f}x -> {out} "
            f"({seconds:.0f} s)")


def plan_k_text(alpha, k: int, cost_ratio: float, verify_cost: float = 1.0) -> str:
    """``medusa plan --k K``: that K's expected tokens, round cost and speedup."""
    from medusa.tools import plan

    cost = plan.round_cost(k, cost_ratio, verify_cost)
    return (f"K={k}: {plan.expected_tokens(alpha, k):.3f} tokens, cost {cost:.3f}, "
            f"{plan.speedup(alpha, k, cost_ratio, verify_cost):.2f}x")


def plan_tree_text(alpha: float, branching: int, depth: int) -> str:
    """``medusa plan --branching B --depth D``: a full tree's paths, nodes and expected tokens (an upper bound)."""
    from medusa.tools import plan

    tokens = plan.tree_expected_tokens(alpha, branching, depth)
    return (f"tree of branching {branching}, depth {depth}: {plan.tree_paths(branching, depth)} candidate paths, "
            f"{plan.tree_nodes(branching, depth)} draft nodes, {tokens:.3f} "
            "expected tokens per round if each sibling were accepted independently (an upper bound: a greedy base "
            "accepts one sibling)")


def calibration_text(calibration, path, sequences: int, seconds: float) -> str:
    """``medusa calibrate``'s summary: top-1 acceptance per depth and what was measured, written where."""
    return (f"top-1 acceptance per depth (given the path above): {[round(a[0], 3) for a in calibration.accuracy]}\n"
            f"measured on {sequences} sequences ({calibration.source['positions']} positions) -> {path} "
            f"({seconds:.0f} s)")


def busy_during(before: dict, after: dict) -> str | None:
    """What :func:`medusa.tools.bench.machine_load` warned before and after a timed run, as one line's parenthesis
    (``"before: load average 3.1 on 2 cores ...; after: ..."``), or ``None`` when neither warned."""
    busy = [f"{when}: {load['warning'].split(':')[0]}" for when, load in (("before", before), ("after", after))
            if load["warning"]]
    return "; ".join(busy) or None
