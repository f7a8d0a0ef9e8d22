"""Self-distillation: regenerate the assistant turns of a chat dataset, or continue the documents of a plain-text
corpus, with the base model itself.

Medusa heads must predict the base model's own continuations, not the text another model (ChatGPT, for ShareGPT)
wrote: at decoding time the verified tokens are the base's greedy tokens. This module takes the prompt of each
conversation (everything before the first assistant turn), lets the base answer it greedily, and writes one JSON
line per conversation with the messages and the exact token ids (Medusa report, Cai et al. 2024, section 2.3.2,
"self-distillation").

The output file is appended batch by batch and read back on restart, so an interrupted run resumes where it stopped.
Prompts are batched by length within windows of file order (little padding, yet a time-limited run keeps prompts of
every length, not only the shortest ones), and each batch logs answers/s and generated tokens/s.
Under ``accelerate launch`` the processes share the batches of that one-process plan, whole, and the main process
merges their files in the plan's order: the result is the one-process file (:func:`distill`).
A plain-text document gives one prompt: its first ``n`` tokens, ``n`` drawn by a hash of its id from
``prefix_lengths`` (those shorter than the document), and the base continues it greedily; its record holds the
prefix and continuation ids and their text (a pretrained base, with no chat template, is distilled this way). Chats
for a tokenizer without a chat template are rendered as plain role-labelled text
(:func:`medusa.base.render_plain_chat`).
``medusa distill`` (:func:`distill_splits`) writes a dataset's validation split first (what trees are fitted on), then
its held-out split, then its training split.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from medusa.base import chat_prompt_ids, hf_greedy_batch, stop_token_ids
from train.data import Conversation, turn_prompts
from train.processes import rank_and_world, wait_for_everyone

logger = logging.getLogger(__name__)

DISTILLED_TRAIN_NAME = "distilled_train.jsonl"
DISTILLED_HELD_OUT_NAME = "distilled_held_out.jsonl"
DISTILLED_VALIDATION_NAME = "distilled_validation.jsonl"
DEFAULT_PREFIX_LENGTHS = (16, 32, 64, 128)
"""Document prefix lengths (tokens) distillation draws from: short and long contexts both."""
WINDOW_BATCHES = 8
"""Prompts are sorted by length within windows of this many batches, taken in file order."""


def jsonl_ids(out_path: Path) -> set[str]:
    """Ids of the complete records of a JSON-lines file (empty when the file does not exist)."""
    if not out_path.is_file():
        return set()
    ids = (record_id(line) for line in out_path.read_bytes().split(b"\n"))
    return {i for i in ids if i is not None}


def record_id(line: bytes | str) -> str | None:
    """The id of one JSON line, or ``None`` for a line cut off by an interrupted write (it is answered again).

    Lines are split at ``\\n`` only: ``json.dumps(..., ensure_ascii=False)`` leaves U+2028 and its kin raw inside
    strings, where ``str.splitlines`` would cut a record in two.
    """
    try:
        return json.loads(line)["id"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None


@torch.inference_mode()
def distill(
    model,
    tokenizer,
    conversations: list[Conversation],
    out_path: str | Path,
    max_new_tokens: int = 192,
    max_prompt_tokens: int = 384,
    batch_size: int = 32,
    time_limit_s: float | None = None,
    turns: str = "all",
    seed: int = 0,
    prefix_lengths: tuple[int, ...] = DEFAULT_PREFIX_LENGTHS,
    accelerator=None,
    answer=None,
) -> int:
    """Answer one prompt of each conversation (or continue a prefix of each document) with the base model (greedy)
    and append the results as JSON lines.

    Under several processes each answers whole batches of the one-process plan (:func:`planned_batches`, batch
    ``b`` on process ``b % N``) into a file of its own (:func:`rank_file`), and the main process then appends them to
    ``out_path`` in the plan's order: the batches, their padding and their order are those of one process, so the
    file is byte-identical to one process's wherever the base gives the same tokens for the same batch (same
    kernels: device, dtype, thread count). Per-process files an interrupted run left are folded in first, whatever
    number of processes wrote them (:func:`fold_rank_files`).

    Args:
        model: the base causal LM (eval mode, on its device).
        tokenizer: its tokenizer. Chats use its chat template, or plain role-labelled text when it has none.
        conversations: source conversations; of each, the messages before one assistant turn are the prompt
            (:func:`train.data.turn_prompts`: a turn drawn from all of them, or the first; the latest that fits
            ``max_prompt_tokens``).
        out_path: JSON-lines file, appended to; ids already present are skipped.
        max_new_tokens: generation budget per answer (tokens).
        max_prompt_tokens: prompts longer than this are skipped (counted in the log).
        batch_size: prompts generated together (left padded; sorted by length within windows of
            :data:`WINDOW_BATCHES` batches in file order, to limit padding).
        time_limit_s: stop after the batch that crosses this wall-clock budget (seconds; each process its own);
            ``None`` for no limit; at most 0: no batch is answered (under several processes the other steps still
            run: every process takes part in the merge).
        turns: ``"all"`` or ``"first"`` (:data:`train.data.TURN_CHOICES`).
        seed: seeds the drawn turn and the drawn document prefix length.
        prefix_lengths: documents: the prefix lengths (tokens) one is drawn from.
        accelerator: an ``accelerate`` ``Accelerator`` or ``PartialState`` when every process of a launch calls
            this together (it waits for the others three times); ``None`` for one process.
        answer: ``(prompts, max_new_tokens) -> answers``, each prompt a list of ids and each answer the greedy ids
            that follow it (the stop token included where it stopped): what answers a batch instead of Hugging Face
            ``generate`` on ``model`` (:func:`medusa.base.hf_greedy_batch`), e.g. this project's own decoder
            (:func:`decoder_answer`).

    Returns:
        Number of new records this process answered.

    Raises:
        ValueError: ``prefix_lengths`` is empty or holds a length < 1.
    """
    if not prefix_lengths or min(prefix_lengths) < 1:
        raise ValueError(f"prefix_lengths must be lengths >= 1, got {list(prefix_lengths)}")
    rank, world = rank_and_world(accelerator)
    if rank == 0:
        fold_rank_files(Path(out_path))  # what an interrupted multi-process run left
    wait_for_everyone(accelerator)
    out_of_time = time_limit_s is not None and time_limit_s <= 0
    if out_of_time:
        logger.info("time limit reached: %s waits for the next run", Path(out_path).name)
        if world == 1:
            return 0
    out_path, done, (todo, too_long, too_short) = pending_prompts(out_path, tokenizer, conversations,
                                                                  max_prompt_tokens, turns, seed, prefix_lengths)
    batches = planned_batches(todo, batch_size)
    if rank == 0:
        logger.info("distilling %d prompts in %d batches on %d process(es) (%d already done, %d longer than %d "
                    "tokens skipped, %d documents no longer than the shortest prefix skipped)", len(todo),
                    len(batches), world, len(done), too_long, max_prompt_tokens, too_short)
    mine = [] if out_of_time else batches[rank::world]  # whole batches: each answered as one process would
    written = answer_batches(model, tokenizer, mine, rank_file(out_path, rank, world), max_new_tokens,
                             time_limit_s, answer)
    if world > 1:
        wait_for_everyone(accelerator)
        if rank == 0:
            fold_rank_files(out_path, order=[conv_id for batch in batches for conv_id, _, _ in batch])
        wait_for_everyone(accelerator)  # the file is whole before any process reads it
    return written


def planned_batches(todo: list, batch_size: int) -> list[list]:
    """The batches one process answers ``todo`` (:func:`prompts_to_distill`'s items) in: sorted by prompt length
    within windows of :data:`WINDOW_BATCHES` batches in file order, then cut into ``batch_size`` prompts."""
    todo = window_sorted(todo, lambda item: len(item[2]), batch_size * WINDOW_BATCHES)
    return [todo[b : b + batch_size] for b in range(0, len(todo), batch_size)]


def answer_batches(model, tokenizer, batches: list[list], out_path: Path, max_new_tokens: int,
                   time_limit_s: float | None, answer=None) -> int:
    """Answer ``batches`` greedily in turn (``answer``: see :func:`distill`), appending each batch's records to
    ``out_path`` (flushed per batch); stop after the batch that crosses ``time_limit_s`` (seconds). Returns the
    records written."""
    if answer is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stop = stop_token_ids(model.generation_config)  # where generate stops: the tokenizer's EOS is not added

        def answer(prompts, budget):
            return hf_greedy_batch(model, prompts, budget, stop, pad_id)

    total = sum(len(batch) for batch in batches)
    start, written, generated = time.monotonic(), 0, 0
    with open_for_append(out_path) as out:
        for batch in batches:
            batch_start = time.monotonic()
            responses = answer([ids for _, _, ids in batch], max_new_tokens)
            for (conv_id, prompt, ids), response in zip(batch, responses, strict=True):
                out.write(json.dumps(distilled_record(tokenizer, conv_id, prompt, ids, response), ensure_ascii=False)
                          + "\n")
            out.flush()
            written += len(batch)
            generated += sum(len(r) for r in responses)
            now = time.monotonic()
            elapsed, batch_s = now - start, max(now - batch_start, 1e-9)
            logger.info("distilled %d/%d prompts in %.0f s: batch %.2f answers/s %.1f tokens/s; overall %.2f "
                        "answers/s %.1f tokens/s", written, total, elapsed, len(batch) / batch_s,
                        sum(len(r) for r in responses) / batch_s, written / elapsed, generated / elapsed)
            if time_limit_s is not None and elapsed > time_limit_s:
                break
    return written


def rank_file(out_path: Path, rank: int, world: int) -> Path:
    """Where process ``rank`` of ``world`` writes its answers: ``out_path`` itself for one process, else
    ``<stem>.rank<rank><suffix>`` beside it (folded into ``out_path`` by :func:`fold_rank_files`)."""
    return out_path if world == 1 else out_path.with_name(f"{out_path.stem}.rank{rank}{out_path.suffix}")


def rank_files(out_path: Path) -> list[Path]:
    """The per-process files beside ``out_path`` (:func:`rank_file`), in rank order."""
    pattern = re.compile(rf"{re.escape(out_path.stem)}\.rank(\d+){re.escape(out_path.suffix)}")
    found = [(int(m.group(1)), p) for p in out_path.parent.glob(f"{out_path.stem}.rank*{out_path.suffix}")
             if (m := pattern.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def fold_rank_files(out_path: Path, order: Sequence[str] = ()) -> int:
    """Append to ``out_path`` the complete records of its per-process files whose ids it lacks, then delete those
    files; returns how many were appended.

    The ids of ``order`` come first, in that order (the one-process plan); any others (an interrupted run's, whose
    plan is gone) follow in rank-file order. Lines are copied byte for byte, a cut-off one is dropped (answered
    again), and an id is written once. Interrupted, it leaves the per-process files in place and the next fold
    appends only what is still missing.
    """
    shards = rank_files(out_path)
    if not shards:
        return 0
    done, lines = jsonl_ids(out_path), {}
    for shard in shards:
        for line in shard.read_bytes().split(b"\n"):
            conv_id = record_id(line)
            if conv_id is not None and conv_id not in done and conv_id not in lines:
                lines[conv_id] = line
    position = {conv_id: i for i, conv_id in enumerate(order)}
    ordered = sorted(lines, key=lambda conv_id: position.get(conv_id, len(position)))  # stable: the rest keep order
    open_for_append(out_path).close()  # cuts a line an interrupted write left unfinished
    with open(out_path, "ab") as out:
        out.write(b"".join(lines[conv_id] + b"\n" for conv_id in ordered))
        out.flush()
        os.fsync(out.fileno())  # on disk before the per-process copies go
    for shard in shards:
        shard.unlink()
    logger.info("%s: %d answers folded in from %d per-process files", out_path.name, len(ordered), len(shards))
    return len(ordered)


def pending_prompts(out_path, tokenizer, conversations: list[Conversation], max_prompt_tokens: int, turns: str,
                    seed: int, prefix_lengths: tuple[int, ...]):
    """``(out_path as a Path, ids already in it, prompts_to_distill(...) for the rest)``; the folder is made."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = jsonl_ids(out_path)
    return out_path, done, prompts_to_distill(tokenizer, conversations, done, max_prompt_tokens, turns, seed,
                                              prefix_lengths)


def prompts_to_distill(tokenizer, conversations: list[Conversation], done: set[str], max_prompt_tokens: int,
                       turns: str, seed: int, prefix_lengths: tuple[int, ...]):
    """The prompts :func:`distill` (and ``distill --server``) answer, in file order.

    Returns:
        ``(todo, too_long, too_short)``: ``todo`` holds ``(id, prompt messages or None for a document prefix,
        prompt token ids)`` of every conversation not in ``done``; the counts of those skipped because no prompt fit
        ``max_prompt_tokens``, and of documents no longer than the shortest prefix.
    """
    todo, too_long, too_short = [], 0, 0
    for conv in conversations:
        if conv.id in done:
            continue
        if conv.is_document:
            ids = document_prefix(tokenizer, conv, prefix_lengths, seed)
            if ids is None:
                too_short += 1
            elif len(ids) > max_prompt_tokens:
                too_long += 1
            else:
                todo.append((conv.id, None, ids))
            continue
        for prompt in turn_prompts(conv, turns, seed):
            ids = chat_prompt_ids(tokenizer, prompt)
            if len(ids) <= max_prompt_tokens:
                todo.append((conv.id, prompt, list(ids)))
                break
        else:
            too_long += 1
    return todo, too_long, too_short


def distilled_record(tokenizer, conv_id: str, prompt: list[dict] | None, ids: list[int], response: list[int]) -> dict:
    """One JSON line of distilled data: a chat's messages with the answer's text, or a document prefix's text with
    its continuation, and the exact ``prompt_ids`` / ``response_ids``."""
    if prompt is None:
        return {"id": conv_id, "text": tokenizer.decode(ids + response, skip_special_tokens=True),
                "prompt_ids": ids, "response_ids": response}
    text = tokenizer.decode(response, skip_special_tokens=True)
    return {"id": conv_id, "messages": prompt + [{"role": "assistant", "content": text}], "prompt_ids": ids,
            "response_ids": response}


def open_for_append(path: Path):
    """``path`` opened to append JSON lines, after cutting off a last line an interrupted write left unfinished
    (so that the next record starts on a line of its own)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            data = f.read()
            if not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")


def document_prefix(tokenizer, conv: Conversation, prefix_lengths, seed: int) -> list[int] | None:
    """The first ``n`` token ids of a document (encoded as the tokenizer encodes any text), ``n`` drawn by a hash of
    ``(seed, id)`` from the ``prefix_lengths`` shorter than the document; ``None`` when none is."""
    ids = list(tokenizer(conv.text, add_special_tokens=True)["input_ids"])
    usable = sorted(n for n in set(prefix_lengths) if n < len(ids))
    if not usable:
        return None
    digest = hashlib.sha256(f"{seed}:prefix:{conv.id}".encode()).digest()
    return ids[: usable[int.from_bytes(digest[:8], "big") % len(usable)]]


def window_sorted(items: list, key, window: int) -> list:
    """``items`` cut into consecutive windows of ``window`` (their file order kept), each sorted by ``key``."""
    return [item for w in range(0, len(items), window) for item in sorted(items[w : w + window], key=key)]


def distill_splits(model, tokenizer, splits: list[tuple[list[Conversation], str | Path]], max_new_tokens: int,
                   max_prompt_tokens: int, batch_size: int, time_limit_s: float | None = None, turns: str = "all",
                   seed: int = 0, prefix_lengths: tuple[int, ...] = DEFAULT_PREFIX_LENGTHS,
                   accelerator=None, answer=None) -> list[Path]:
    """Distill each ``(conversations, path)`` split in turn (each resumable, see :func:`distill`, whose
    ``accelerator`` and ``answer`` this passes on); ``medusa distill`` passes validation, held-out, training.

    ``time_limit_s`` (seconds) bounds them together: each split gets what the ones before left, and none is answered
    once nothing is left. Returns the paths.
    """
    start = time.monotonic()
    paths = []
    for convs, path in splits:
        paths.append(Path(path))
        left = None if time_limit_s is None else time_limit_s - (time.monotonic() - start)
        # Called even when no time is left: under several processes each must take part in every split's merge.
        distill(model, tokenizer, convs, path, max_new_tokens, max_prompt_tokens, batch_size, left, turns, seed,
                prefix_lengths, accelerator, answer)
    return paths


def decoder_answer(decoder, known: dict[tuple[int, ...], list[int]] | None = None):
    """:func:`distill`'s ``answer`` through this project's decoder: each prompt greedy through ``decoder`` (a
    :class:`medusa.model.MedusaModel` from :func:`medusa.build.build_model`: plain decoding, or Medusa decoding, on
    any engine, a quantized one included), stopping where Hugging Face ``generate`` stops (the
    ``generation_config``'s EOS ids, whatever it says about sampling): the in-process path's answers. A batch's
    prompts are decoded together where the engine batches (:meth:`medusa.model.MedusaModel.generate_batch`: each
    prompt gets the tokens it gets alone), else one at a time.
    Speculation is exact, so they are the greedy tokens of the model that engine runs: the base's own on an
    unquantized engine, and on a quantized one the quantized model's (``medusa distill``'s token check measures how
    far they are the base's). ``known``: answers already
    made, by prompt ids (the token check's), written as they are."""
    stop = stop_token_ids(decoder.base.generation_config)
    known = known or {}

    def answer(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        todo = list(dict.fromkeys(tuple(ids) for ids in prompts if tuple(ids) not in known))
        tensors = [torch.tensor(ids, device=decoder.device) for ids in todo]
        with torch.inference_mode():
            if len(todo) > 1 and decoder.engine.supports_batch:
                made, _ = decoder.generate_batch(tensors, max_new_tokens, stop_token_ids=stop, do_sample=False)
            else:
                made = [decoder.generate(ids, max_new_tokens, stop_token_ids=stop, do_sample=False)[0]
                        for ids in tensors]
        answers = known | dict(zip(todo, made, strict=True))
        return [answers[tuple(ids)] for ids in prompts]

    return answer
