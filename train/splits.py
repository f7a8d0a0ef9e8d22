"""The splits the ``distill`` and ``held-out-prompts`` commands read: a dataset's train / validation / held-out
conversations (:func:`distill_splits_of`), and the held-out split's first prompts as JSON-lines records
(:func:`held_out_prompt_records`). Settings left ``None`` take :class:`train.config.TrainConfig`'s defaults, so the
splits are the ones a training run with the same settings makes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from train.config import TrainConfig
from train.data import (
    document_prefix_text,
    first_prompt,
    load_conversations,
    load_splits,
    split_conversations,
    split_held_out,
)

logger = logging.getLogger(__name__)

DISTILL_SPLITS = ("validation", "held-out", "train")
"""The splits ``distill`` writes, in the order it writes them."""


def split_file(out_dir: str | Path, split: str) -> Path:
    """The file ``distill`` writes a split's answers to, in ``out_dir``."""
    from train.distill import DISTILLED_HELD_OUT_NAME, DISTILLED_TRAIN_NAME, DISTILLED_VALIDATION_NAME

    names = {"validation": DISTILLED_VALIDATION_NAME, "held-out": DISTILLED_HELD_OUT_NAME,
             "train": DISTILLED_TRAIN_NAME}
    return Path(out_dir) / names[split]


def train_default(field: str, given=None):
    """``given``, or :class:`train.config.TrainConfig`'s default for ``field`` when ``given`` is ``None``."""
    if given is not None:
        return given
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}[field]


def distill_splits_of(data: str, max_conversations: int | None = None, sample: str | None = None,
                      held_out_fraction: float | None = None, validation_fraction: float | None = None,
                      seed: int | None = None, skip_conversations: int = 0) -> dict[str, list]:
    """``{"validation": [...], "held-out": [...], "train": [...]}``: the conversations of ``data`` split as training
    splits them. With ``skip_conversations`` the file is read in its own order (``sample`` first), its first N left
    out (e.g. those an earlier run read), then split.

    Raises:
        ValueError: ``skip_conversations`` below 0, or as :func:`train.data.load_conversations`.
    """
    if skip_conversations < 0:
        raise ValueError(f"--skip-conversations must be >= 0, got {skip_conversations}")
    held = train_default("held_out_fraction", held_out_fraction)
    validation, seed = train_default("validation_fraction", validation_fraction), train_default("seed", seed)
    if skip_conversations:  # the file's order matters here: read it as it is, then split
        conversations, _ = load_conversations(data, limit=max_conversations, sample="first")
        train, val, held_out = split_conversations(conversations[skip_conversations:], held, validation, seed)
    else:
        train, val, held_out = load_splits(data, max_conversations, train_default("data_sample", sample), held,
                                           validation, seed)
    return {"validation": val, "held-out": held_out, "train": train}


def held_out_prompt_records(data: str, n: int, held_out_fraction: float | None = None, seed: int | None = None,
                            max_conversations: int | None = None, max_prompt_chars: int = 1000,
                            prefix_chars: int = 400) -> list[dict]:
    """The first ``n`` usable held-out records: ``{"id", "messages"}`` (a conversation's first prompt, at most
    ``max_prompt_chars`` long) or ``{"id", "text"}`` (a document's prefix of about ``prefix_chars``, cut at a space).

    Raises:
        ValueError: fewer than ``n`` usable held-out conversations or documents.
    """
    conversations, _ = load_conversations(data, limit=max_conversations)
    _, held_out = split_held_out(conversations, train_default("held_out_fraction", held_out_fraction),
                                 train_default("seed", seed))
    records = []
    for conv in held_out:
        if conv.is_document:
            prefix = document_prefix_text(conv.text, prefix_chars)
            if prefix:
                records.append({"id": conv.id, "text": prefix})
        elif sum(len(m["content"]) for m in first_prompt(conv)) <= max_prompt_chars:
            records.append({"id": conv.id, "messages": first_prompt(conv)})
    if len(records) < n:
        raise ValueError(f"only {len(records)} usable held-out conversations or documents, asked for {n}")
    return records[:n]


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Write ``records`` as JSON lines (the folder made if needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def int_list(value: str) -> list[int]:
    """An argparse type: comma-separated integers."""
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def add_distill_arguments(p: argparse.ArgumentParser) -> None:
    """``medusa distill``'s flags (settings left unset take :class:`train.config.TrainConfig`'s defaults)."""
    from medusa.build import DTYPES, INT4_KERNELS, QUANTIZE, QUANTIZED_LM_HEADS

    p.add_argument("--base", required=True,
                   help="base model folder (chats use its chat template, or plain role-labelled text without one)")
    p.add_argument("--data", default="sharegpt", help="dataset (as for train --data): chats, or plain-text documents "
                   "whose prefixes the base continues")
    p.add_argument("--out-dir", required=True, help="writes distilled_validation.jsonl (what build-tree fits trees "
                   "on), then distilled_held_out.jsonl, then distilled_train.jsonl")
    p.add_argument("--split", choices=["all", "validation", "held-out", "train"], default="all",
                   help="distill only this split")
    p.add_argument("--max-conversations", type=int, default=None, help="as in training: read at most this many")
    p.add_argument("--sample", choices=["spread", "first"], default=None,
                   help="which --max-conversations: spread evenly over the whole dataset (default) or its first ones")
    p.add_argument("--turns", choices=["all", "first"], default=None,
                   help="answer a turn drawn from all of each conversation's turns (default) or only the first")
    p.add_argument("--skip-conversations", type=int, default=0, metavar="N",
                   help="leave out the first N conversations of the file (e.g. those an earlier training run read)")
    p.add_argument("--held-out-fraction", type=float, default=None, help="as in training (default: TrainConfig's)")
    p.add_argument("--validation-fraction", type=float, default=None, help="as in training (default: TrainConfig's)")
    p.add_argument("--seed", type=int, default=None, help="as in training (default: TrainConfig's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget (default: TrainConfig's)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="skip longer prompts (default: TrainConfig's)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (default: TrainConfig's; "
                   "1 with --decoder medusa on an engine that decodes one prompt at a time)")
    p.add_argument("--time-limit-s", type=float, default=None, help="stop after the batch that crosses this budget")
    p.add_argument("--prefix-lengths", type=int_list, default=None, metavar="N,N,...",
                   help="documents: prefix lengths in tokens, one drawn per document (default: 16,32,64,128)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the base's weights and compute dtype")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when available)")
    g = p.add_argument_group("through this project's decoder, in process (--decoder medusa)")
    g.add_argument("--decoder", choices=["hf", "medusa"], default="hf",
                   help="hf: Hugging Face generate, --batch-size prompts at once; medusa: this project's decoder, "
                        "--batch-size prompts at once where the engine batches (each gets its tokens alone), else one "
                        "at a time: plain decoding, or Medusa decoding with --heads, through --engine or "
                        "--quantize (exact: the greedy tokens of the model that engine runs; on a quantized engine "
                        "the token check says how far they are the base's)")
    g.add_argument("--heads", default=None, help="with --decoder medusa: Medusa/Hydra heads folder (default: plain "
                   "decoding)")
    g.add_argument("--engine", default=None, help="with --decoder medusa: the base's engine (default: auto)")
    g.add_argument("--quantize", choices=QUANTIZE, default="none",
                   help="with --decoder medusa: weight-only quantized linears (as generate --quantize)")
    g.add_argument("--gguf", default=None, metavar="FILE",
                   help="with --quantize int4: the 4-bit GGUF the base was prepared from (its own codes)")
    g.add_argument("--int4-kernel", choices=INT4_KERNELS, default=None,
                   help="with --quantize int4: as generate --int4-kernel; native (default here): fp32 activations, "
                        "the closest to the base")
    g.add_argument("--quantized-lm-head", choices=QUANTIZED_LM_HEADS, default=None,
                   help="with --quantize: as generate --quantized-lm-head (default: gguf with --gguf and a native "
                        "kernel, else fp32)")
    g.add_argument("--threads", type=int, default=None, help="with --decoder medusa: torch CPU threads")
    g = p.add_argument_group("through a server (any OpenAI-compatible one: vLLM, SGLang, TGI, llama.cpp, serve)")
    g.add_argument("--server", metavar="URL", default=None,
                   help="ask this server instead of running --base here, e.g. http://127.0.0.1:8000/v1 (--base "
                        "still gives the tokenizer, and the token check's model)")
    g.add_argument("--server-model", default=None, help="the served name (default: the first /v1/models lists)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions: the prompt's token ids, exactly the record's (default); chat: the messages, "
                        "through the server's own chat template")
    g.add_argument("--api-key-file", default=None,
                   help="a file whose first line is the API key (default: $MEDUSA_API_KEY, then $OPENAI_API_KEY)")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    g.add_argument("--request-timeout-s", type=float, default=300.0, help="limit per request, in seconds")
    g.add_argument("--retries", type=int, default=4,
                   help="tries again after 429, 5xx, timeouts and network errors, with backoff")
    g.add_argument("--check-prompts", type=int, default=8,
                   help="answer this many prompts with --base here too (Hugging Face generate), and compare tokens "
                        "before writing; with --server, and with --decoder medusa on a quantized engine (0: no "
                        "check, and --base's weights are not loaded for it)")
    g.add_argument("--min-agreement", type=float, default=0.5,
                   help="the token check fails below this mean share of tokens agreeing before the first "
                        "difference")


def add_held_out_arguments(p: argparse.ArgumentParser) -> None:
    """``medusa held-out-prompts``' flags."""
    p.add_argument("--data", default="sharegpt", help="dataset (as for train --data)")
    p.add_argument("--n", type=int, default=20, help="number of prompts")
    p.add_argument("--held-out-fraction", type=float, default=None, help="as in training (default: TrainConfig's)")
    p.add_argument("--seed", type=int, default=None, help="as in training (default: TrainConfig's)")
    p.add_argument("--max-conversations", type=int, default=None, help="as in training: read at most this many")
    p.add_argument("--max-prompt-chars", type=int, default=1000, help="skip longer prompts")
    p.add_argument("--prefix-chars", type=int, default=400,
                   help="documents: the prefix is about this many characters, cut at a space")
    p.add_argument("--out", required=True, help="JSON-lines file to write")


def distill_settings(args: argparse.Namespace) -> dict:
    """Which prompts ``medusa distill`` answers and how long: its flags, :class:`train.config.TrainConfig`'s defaults
    where unset (keywords of :func:`train.distill.distill_splits`, :func:`train.distill.pending_prompts` and
    :func:`train.distill_server.distill_through_server`)."""
    from train.distill import DEFAULT_PREFIX_LENGTHS

    return {"max_new_tokens": train_default("distill_max_new_tokens", args.max_new_tokens),
            "max_prompt_tokens": train_default("distill_max_prompt_tokens", args.max_prompt_tokens),
            "turns": train_default("distill_turns", args.turns), "seed": train_default("seed", args.seed),
            "prefix_lengths": tuple(args.prefix_lengths or DEFAULT_PREFIX_LENGTHS)}


def run_distill(args: argparse.Namespace) -> int:
    """``medusa distill``: the chosen splits answered by the base, written to ``--out-dir``; one line per file.

    Under ``accelerate launch`` every process loads the base on its own device and answers its share of the batches;
    the files are the one-process files (:func:`train.distill.distill`). The process group is closed at the end.

    With ``--decoder medusa`` the answers come from this project's decoder (:func:`train.distill.decoder_answer`),
    built as ``medusa generate`` builds it; on a quantized engine its first ``--check-prompts`` answers are first
    compared with the base's own (:func:`train.distill_server.token_check`).

    Raises:
        ValueError: ``--server``, or a ``--device`` other than cpu, under several processes; decoder flags without
            ``--decoder medusa``, or with ``--server``; the token check under several processes; a failed check.
    """
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa.build import DTYPES
    from train.distill import decoder_answer, distill_splits
    from train.setup import launched_on_cpu

    state = PartialState(cpu=launched_on_cpu())
    several = state.num_processes > 1
    if several and args.server:
        raise ValueError(f"--server under {state.num_processes} processes: distill --server runs in one process (it "
                         "sends --concurrency requests at once); run it without accelerate launch")
    medusa_decoder = args.decoder == "medusa"
    decoder_flags = [f for f, v in (("--heads", args.heads), ("--engine", args.engine), ("--gguf", args.gguf),
                                    ("--quantize", args.quantize != "none"), ("--threads", args.threads),
                                    ("--quantized-lm-head", args.quantized_lm_head),
                                    ("--int4-kernel", args.int4_kernel)) if v]
    if decoder_flags and not medusa_decoder:
        raise ValueError(f"{', '.join(decoder_flags)} choose this project's decoder: add --decoder medusa")
    if medusa_decoder and args.server:
        raise ValueError("--decoder medusa answers in process and --server through a server: pass one")
    quantize_flags = [f for f, v in (("--gguf", args.gguf), ("--int4-kernel", args.int4_kernel),
                                     ("--quantized-lm-head", args.quantized_lm_head)) if v]
    if quantize_flags and args.quantize == "none":
        raise ValueError(f"{', '.join(quantize_flags)} set how --quantize quantizes: pass --quantize int4 (or int8)")
    checked = medusa_decoder and args.quantize != "none" and args.check_prompts > 0
    if several and checked:
        raise ValueError(f"the token check (--check-prompts {args.check_prompts}) runs in one process: run a first "
                         "split alone (e.g. --split validation) to see it, then --check-prompts 0 under "
                         f"{state.num_processes} processes")
    if several and args.device not in (None, "cpu"):
        raise ValueError(f"--device {args.device} under {state.num_processes} processes would put them all on one "
                         f"device: leave it out (each process then runs on its own; this one on {state.device})")
    splits = distill_splits_of(args.data, args.max_conversations, args.sample, args.held_out_fraction,
                               args.validation_fraction, args.seed, args.skip_conversations)
    logging.getLogger("train.distill").setLevel(logging.INFO)  # answers/s per batch, even without --verbose
    names = DISTILL_SPLITS if args.split == "all" else [args.split]
    chosen = [(splits[name], split_file(args.out_dir, name)) for name in names]
    device = args.device or (state.device if several else "cuda" if torch.cuda.is_available() else "cpu")
    if args.server:
        return run_distill_through_server(args, chosen, device)
    tokenizer, answer, model = AutoTokenizer.from_pretrained(args.base), None, None
    if medusa_decoder:
        decoder = distilling_decoder(args, device)
        checked_answers = check_decoder_answers(args, tokenizer, chosen, decoder_answer(decoder), device) \
            if checked else {}
        answer = decoder_answer(decoder, checked_answers)  # the checked answers are written, not made again
    else:
        model = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, DTYPES[args.dtype])).to(device)
        model.eval()
    # through a decoder whose engine cannot batch, one prompt a batch (it answers one at a time): the time limit, the
    # flush and the dealing to processes then go prompt by prompt
    one_at_a_time = medusa_decoder and not decoder.engine.supports_batch
    batch_size = args.batch_size or (1 if one_at_a_time else train_default("distill_batch_size"))
    distill_splits(model, tokenizer, chosen, batch_size=batch_size, time_limit_s=args.time_limit_s,
                   accelerator=state if several else None, answer=answer, **distill_settings(args))
    if several:
        # Left to interpreter teardown, gloo's threads can abort a process after its work is done.
        state.destroy_process_group()
    if state.is_main_process:
        for split, path in chosen:
            done = sum(1 for _ in open(path, encoding="utf-8")) if path.is_file() else 0
            print(f"{path}: {done} answers ({len(split)} conversations in the split)")
    return 0


def distilling_decoder(args: argparse.Namespace, device: str):
    """``--decoder medusa``'s model: :func:`medusa.build.build_model` with the distill command's decoder flags (the
    base's dense weights released where a quantized engine no longer reads them)."""
    from medusa.build import DecodeConfig, build_model

    kernel = args.int4_kernel or "native"
    native = args.quantize == "int4" and kernel in ("native", "native-q8")
    lm_head = args.quantized_lm_head or ("gguf" if native and args.gguf else "fp32")
    drafter = {"heads": args.heads} if args.heads else {"drafter": "none"}
    config = DecodeConfig(base=args.base, dtype=args.dtype, device=device, threads=args.threads, engine=args.engine,
                          quantize=args.quantize, gguf=args.gguf,
                          int4_kernel=kernel if args.quantize == "int4" else "torch",
                          quantized_lm_head=lm_head if args.quantize != "none" else "fp32",
                          release_dense=args.quantize != "none", **drafter)
    return build_model(config, report=lambda text: logger.info("%s", text))


def check_decoder_answers(args: argparse.Namespace, tokenizer, chosen: list, answer, device: str) -> dict:
    """Before anything is written: the decoder's answers to the first ``--check-prompts`` pending prompts of the
    chosen splits, in order, against the base's own greedy tokens (:func:`train.distill_server.token_check`, which
    raises below ``--min-agreement``). Returns those answers by prompt ids, for the distillation to write as they
    are."""
    import torch
    from transformers import AutoModelForCausalLM

    from medusa.base import stop_token_ids
    from medusa.build import DTYPES
    from train.distill import pending_prompts
    from train.distill_server import token_check

    settings = distill_settings(args)
    max_new = settings.pop("max_new_tokens")
    todo = []
    for split, path in chosen:
        _, _, (pending, _, _) = pending_prompts(path, tokenizer, split, **settings)
        todo += pending[: args.check_prompts - len(todo)]
        if len(todo) == args.check_prompts:
            break
    if not todo:
        return {}
    answers = answer([ids for _, _, ids in todo], max_new)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, DTYPES[args.dtype])).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        report = token_check(base.eval(), todo, answers, stop_token_ids(base.generation_config), pad, tokenizer,
                             args.min_agreement, source="the decoder",
                             why=f"--quantize {args.quantize} rounds the weights, so near-ties can part the two "
                                 "(--int4-kernel native keeps fp32 activations, the closest to the base)")
    print(f"token check against --base's own greedy tokens: {report['identical']}/{report['checked']} answers "
          f"identical, {100 * report['agreement']:.1f}% of tokens agree before the first difference")
    return {tuple(ids): response for (_, _, ids), response in zip(todo, answers, strict=True)}


def run_distill_through_server(args: argparse.Namespace, chosen: list, device: str) -> int:
    """``medusa distill --server``: the chosen splits answered by the server (:mod:`train.distill_server`)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from medusa.base import stop_token_ids
    from medusa.build import DTYPES
    from train.distill_server import ServerClient, ServerSettings, distill_through_server, read_api_key

    logging.getLogger("train.distill_server").setLevel(logging.INFO)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    try:
        generation = GenerationConfig.from_pretrained(args.base)
    except OSError:  # no generation_config.json: the tokenizer's EOS is where the base stops
        generation = None
    stop = stop_token_ids(generation, tokenizer if generation is None else None)
    settings = ServerSettings(args.server, args.server_model, args.endpoint, read_api_key(args.api_key_file),
                              args.concurrency, args.request_timeout_s, args.retries)
    check_model = None
    if args.check_prompts > 0:
        check_model = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, DTYPES[args.dtype]))
        check_model = check_model.to(device).eval()
    client = ServerClient(settings, stop, tokenizer)
    start, totals = time.monotonic(), {"written": 0, "malformed": 0, "answer_tokens": 0}
    try:
        for split, path in chosen:
            left = None if args.time_limit_s is None else args.time_limit_s - (time.monotonic() - start)
            if left is not None and left <= 0:
                print(f"time limit reached: {path.name} waits for the next run")
                continue
            with torch.inference_mode():
                result = distill_through_server(
                    client, tokenizer, split, path, time_limit_s=left, check_model=check_model,
                    check_prompts=args.check_prompts, min_agreement=args.min_agreement, **distill_settings(args))
            check_model = None  # checked once, on the first split's first answers
            for key in totals:
                totals[key] += result[key]
            done = sum(1 for _ in open(path, encoding="utf-8")) if path.is_file() else 0
            print(f"{path}: {done} answers ({len(split)} conversations in the split)")
    finally:
        client.close()
    seconds = time.monotonic() - start
    print(f"{settings.url}: {totals['written']} answers, {totals['answer_tokens']} answer tokens in {seconds:.0f} s "
          f"({totals['answer_tokens'] / max(seconds, 1e-9):.1f} answer tokens/s); {totals['malformed']} malformed "
          f"answers not written (a rerun asks again)")
    return 1 if totals["malformed"] else 0


def run_held_out_prompts(args: argparse.Namespace) -> int:
    """``medusa held-out-prompts``: the held-out split's first prompts written as JSON lines."""
    records = held_out_prompt_records(args.data, args.n, args.held_out_fraction, args.seed, args.max_conversations,
                                      args.max_prompt_chars, args.prefix_chars)
    print(f"wrote {args.n} held-out prompts to {write_jsonl(records, args.out)}")
    return 0
