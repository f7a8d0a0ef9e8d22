"""Self-distillation: regenerate the assistant turns of a chat dataset with the base model itself.

Medusa heads must predict the base model's own continuations, not the text another model (ChatGPT, for ShareGPT)
wrote: at decoding time the verified tokens are the base's greedy tokens. This module takes the prompt of each
conversation (everything before the first assistant turn), lets the base answer it greedily, and writes one JSON
line per conversation with the messages and the exact token ids (Medusa report, Cai et al. 2024, section 2.3.2,
"self-distillation").

The output file is appended batch by batch and read back on restart, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from train.data import Conversation, first_prompt

logger = logging.getLogger(__name__)


def jsonl_ids(out_path: Path) -> set[str]:
    """Ids of the complete records of a JSON-lines file (empty when the file does not exist)."""
    if not out_path.is_file():
        return set()
    done = set()
    for line in out_path.read_text(encoding="utf-8").splitlines():
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            # A line cut off by an interrupted write: it will be regenerated.
            continue
    return done


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
) -> int:
    """Answer each conversation's first prompt with the base model (greedy) and append the results as JSON lines.

    Args:
        model: the base causal LM (eval mode, on its device).
        tokenizer: its tokenizer; must have a chat template.
        conversations: source conversations; only the messages before the first assistant turn are used.
        out_path: JSON-lines file, appended to; ids already present are skipped.
        max_new_tokens: generation budget per answer (tokens).
        max_prompt_tokens: prompts longer than this are skipped (counted in the log).
        batch_size: prompts generated together (left padded, sorted by length to limit padding).
        time_limit_s: stop after the batch that crosses this wall-clock budget (seconds); ``None`` for no limit.

    Returns:
        Number of new records written.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not tokenizer.chat_template:
        raise ValueError("self-distillation needs a tokenizer with a chat template")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = jsonl_ids(out_path)
    todo, too_long = [], 0
    for conv in conversations:
        if conv.id in done:
            continue
        prompt = first_prompt(conv)
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        todo.append((conv.id, prompt, list(ids)))
    logger.info("distilling %d prompts (%d already done, %d longer than %d tokens skipped)",
                len(todo), len(done), too_long, max_prompt_tokens)
    todo.sort(key=lambda item: len(item[2]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    start, written = time.monotonic(), 0
    with open(out_path, "a", encoding="utf-8") as out:
        for b in range(0, len(todo), batch_size):
            batch = todo[b : b + batch_size]
            responses = _generate_batch(model, [ids for _, _, ids in batch], pad_id, max_new_tokens, device)
            for (conv_id, prompt, ids), response in zip(batch, responses, strict=True):
                text = tokenizer.decode(response, skip_special_tokens=True)
                record = {"id": conv_id, "messages": prompt + [{"role": "assistant", "content": text}],
                          "prompt_ids": ids, "response_ids": response}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            written += len(batch)
            elapsed = time.monotonic() - start
            logger.info("distilled %d/%d prompts in %.0f s", written, len(todo), elapsed)
            if time_limit_s is not None and elapsed > time_limit_s:
                break
    return written


def _generate_batch(model, prompts: list[list[int]], pad_id: int, max_new_tokens: int, device) -> list[list[int]]:
    """Greedy answers for left-padded prompts; each answer is cut after its first EOS (kept) or at the budget."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers
