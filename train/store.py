"""Hidden-state store: the frozen base's states (its last hidden state, and the outputs of the decoder layers a
drafter fuses), computed once and kept on disk in bf16.

Medusa-1 trains the heads over a frozen base (Cai et al. 2024, section 2.2.1), so the base's hidden states of a
training example never change: one pass of the base writes them here, and every later epoch reads them back at the
speed of the heads, for data larger than RAM too (the shards are memory-mapped). What is stored per position is
:func:`medusa.base.base_states` of the store's ``layers``: the last hidden state, then the outputs of those decoder
layers (EAGLE-3's fused features, :mod:`medusa.drafters.eagle`; none for Medusa and Hydra heads). Teacher logits are
the base's lm_head applied to the last hidden state: they are recomputed, not stored.

A store is a folder:

- ``meta.json``: format version, the base's identity (name, sizes, lm_head fingerprint), ``layers``,
  ``max_seq_len``, dtype, counts, bytes per token, and for each finished shard its files, their exact byte sizes and
  its example lengths. Version 1 (before ``layers``) is read as ``layers: []``.
- ``shard_NNNNN.hidden``: ``(N, (1 + len(layers)) H)`` uint16 holding the bf16 bits of the unpadded states of
  consecutive examples.
- ``shard_NNNNN.tokens``: ``(N, 2)`` int32, the input id and the label of each of those tokens.

Example ``i`` lives in one shard at a token offset, with its length ``T_i``; that index is rebuilt from the lengths
in ``meta.json``. Shards keep the examples in their original order; inside a shard the examples go through the base
in length-sorted batches (little padding). A shard is written under a temporary name and renamed, then ``meta.json``
is rewritten the same way, so an interrupted build resumes after the last shard ``meta.json`` lists. Under
``accelerate launch`` the processes write the shards in rounds, one each, and the main process lists them: the folder
is the one a single process writes (:func:`build_store`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from medusa.base import base_states, check_layer_indices
from medusa.drafters.heads import fingerprint_mismatch, lm_head_fingerprint
from medusa.io.files import atomic_file
from train.data import collate
from train.processes import rank_and_world, wait_for_everyone

logger = logging.getLogger(__name__)

STORE_FORMAT = "medusa-hidden-state-store"
# Version 1: the last hidden states only. Version 2: ``layers`` in meta.json, their outputs after the last hidden.
STORE_FORMAT_VERSION = 2
SUPPORTED_STORE_VERSIONS = (1, 2)
META_NAME = "meta.json"
HIDDEN_SUFFIX = ".hidden"
TOKENS_SUFFIX = ".tokens"
TMP_PREFIX = ".tmp-"
DEFAULT_SHARD_TOKENS = 1 << 18
"""Tokens per shard unless asked otherwise: small enough that a store of a few million tokens gives several
processes a shard each (the shard is the unit of work), large enough to keep the files few. It was ``1 << 20``
before the processes shared the build: stores built so open as they are, and a partly built one resumes with its
own size."""
# On open with a model, this many leading tokens of example 0 go through the base again and must match the stored
# states to this relative L2 error: bf16 storage and another compute dtype stay far below it, another base does not.
STATE_CHECK_TOKENS = 16
STATE_CHECK_RTOL = 5e-2


class StoreError(ValueError):
    """A hidden-state store that cannot be used as asked: another base, data, max_seq_len or layers, or a damaged
    file."""


def state_width(hidden_size: int, layers) -> int:
    """Width of one position's stored states: the last hidden state and one hidden state per layer."""
    return (1 + len(layers)) * hidden_size


def bytes_per_token(hidden_size: int, layers) -> int:
    """Disk bytes of one stored token: its bf16 states and its int32 input id and label."""
    return 2 * state_width(hidden_size, layers) + 2 * np.dtype(np.int32).itemsize


def base_identity(model) -> dict:
    """What identifies the base a store was built with: name, sizes and the lm_head fingerprint."""
    text_config = model.config.get_text_config(decoder=True)
    lm_head = model.get_output_embeddings().weight  # (V, H)
    return {"name_or_path": getattr(model.config, "name_or_path", ""), "model_type": model.config.model_type,
            "hidden_size": int(text_config.hidden_size), "vocab_size": int(lm_head.shape[0]),
            "num_hidden_layers": int(text_config.num_hidden_layers),
            "lm_head_fingerprint": lm_head_fingerprint(lm_head)}


def examples_digest(examples: list[dict]) -> str:
    """SHA-256 of every example's input ids and labels, in order: a store answers for exactly these examples."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(np.asarray([len(e["input_ids"])], dtype=np.int64).tobytes())
        digest.update(np.asarray(e["input_ids"], dtype=np.int64).tobytes())
        digest.update(np.asarray(e["labels"], dtype=np.int64).tobytes())
    return digest.hexdigest()


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """``[(first, stop), ...]``: consecutive examples, each shard closed once it holds ``shard_tokens`` tokens."""
    plan, first, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens:
            plan.append((first, i + 1))
            first, tokens = i + 1, 0
    if first < len(lengths):
        plan.append((first, len(lengths)))
    return plan


def length_sorted_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices into ``lengths`` in batches of similar length (sorted, longest first, so memory peaks at once)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


# ---------------------------------------------------------------------------------------------------------------------
# Building.


def build_store(path: str | Path, model, examples: list[dict], max_seq_len: int, batch_size: int = 8,
                shard_tokens: int | None = None, layers: tuple[int, ...] = (), accelerator=None) -> Path:
    """Run the frozen base once over ``examples`` and write their states to the store folder ``path``.

    Resumable: a folder holding part of the same store (same base, examples, ``max_seq_len``, ``shard_tokens``,
    ``layers``) continues after the last shard ``meta.json`` lists; a finished store is left as it is. The bytes per
    token are logged at the start, progress (tokens/s) per shard.

    Under several processes the shards of the plan (:func:`plan_shards`, which does not depend on how many) are
    written in rounds: in each, process ``r`` writes shard ``done + r``; once all have written theirs, the main
    process lists them in ``meta.json``. Each shard holds the same examples in the same batches as one process would
    compute, so the folder is byte-identical to one process's wherever the base gives the same states for the same
    batch (same kernels: device, dtype, thread count). An interrupted round is written again on resume.

    Args:
        path: the store folder (created).
        model: the base causal LM, frozen, on its device; states are computed in its dtype and stored in bf16.
        examples: ``{"input_ids", "labels"}`` lists, as :func:`train.data.tokenize_conversations` returns.
        max_seq_len: the tokenisation limit the examples were cut to (recorded and checked on open).
        batch_size: sequences per base forward.
        shard_tokens: tokens per shard file (the last shard may hold fewer); :func:`bytes_per_token` each.
            ``None``: a partly built store resumes with the size it was started with, else
            :data:`DEFAULT_SHARD_TOKENS`.
        layers: decoder layers (0-based) whose outputs are stored after the last hidden state
            (:func:`medusa.base.base_states`); ``()`` stores the last hidden state alone.
        accelerator: an ``accelerate`` ``Accelerator`` or ``PartialState`` when every process of a launch calls
            this together (with the same arguments); ``None`` for one process.

    Returns:
        ``path``, the store finished (on every process).

    Raises:
        StoreError: ``path`` holds a store of another base, other examples, another ``max_seq_len`` or other
            ``layers``, a damaged ``meta.json`` or a finished shard whose size differs from ``meta.json``.
        ValueError: ``examples`` is empty, an example is empty or longer than ``max_seq_len``, or a layer is
            outside the base.
    """
    path = Path(path)
    if not examples:
        raise ValueError(f"{path}: no examples to store")
    lengths = [len(e["input_ids"]) for e in examples]
    if min(lengths) < 1 or max(lengths) > max_seq_len:
        raise ValueError(f"{path}: example lengths must be in [1, max_seq_len={max_seq_len}], got "
                         f"{min(lengths)}..{max(lengths)}")
    check_layer_indices(layers, base_identity(model)["num_hidden_layers"])
    # Every process reads and checks the folder before any writes to it, so all raise the same error or none does.
    stored = read_meta(path) if (path / META_NAME).is_file() else None
    if shard_tokens is None:
        resumed = stored is not None and not stored.get("complete")
        shard_tokens = stored.get("shard_tokens", DEFAULT_SHARD_TOKENS) if resumed else DEFAULT_SHARD_TOKENS
    meta = _new_meta(model, examples, lengths, max_seq_len, shard_tokens, layers)
    if stored is not None:
        # A finished store is used whatever shard size built it; a partial one resumes only with the same plan.
        _check_same_build(path, stored, meta, model, with_plan=not stored.get("complete"))
        _check_shard_sizes(path, stored["shards"])
        if stored.get("complete"):
            return path
        meta["shards"] = stored["shards"]
    rank, world = rank_and_world(accelerator)
    plan = plan_shards(lengths, shard_tokens)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        for leftover in path.glob(f"{TMP_PREFIX}*"):  # an interrupted shard: written again below
            leftover.unlink()
        _log_plan(path, meta, len(plan))
    wait_for_everyone(accelerator)  # no process writes a temporary file before the leftovers are gone
    for done in range(len(meta["shards"]), len(plan), world):
        if done + rank < len(plan):
            _write_planned_shard(path, done + rank, plan, model, examples, batch_size, layers)
        wait_for_everyone(accelerator)
        if rank == 0:
            width = state_width(meta["base"]["hidden_size"], layers)
            written = range(done, min(done + world, len(plan)))
            meta["shards"] += [_shard_entry(i, plan[i][0], lengths[plan[i][0] : plan[i][1]], width) for i in written]
            _check_shard_sizes(path, meta["shards"][done:])  # what the other processes wrote is on disk
            meta["complete"] = len(meta["shards"]) == len(plan)
            _write_json_atomic(path / META_NAME, meta)
    wait_for_everyone(accelerator)  # meta.json lists every shard before any process returns
    return path


def _log_plan(path: Path, meta: dict, shards: int) -> None:
    logger.info("%s: %d examples, %d tokens, layers %s: %d bytes per token (%.2f GB)", path, meta["num_examples"],
                meta["num_tokens"], meta["layers"], meta["bytes_per_token"],
                meta["bytes_per_token"] * meta["num_tokens"] / 1e9)
    if meta["shards"]:
        logger.info("%s: resuming after shard %d of %d", path, len(meta["shards"]), shards)


def _write_planned_shard(path: Path, index: int, plan: list[tuple[int, int]], model, examples: list[dict],
                         batch_size: int, layers: tuple[int, ...]) -> None:
    """Write shard ``index`` of ``plan`` and log its rate."""
    first, stop = plan[index]
    start = time.monotonic()
    shard = _write_shard(path, index, first, model, examples[first:stop], batch_size, layers)
    seconds = time.monotonic() - start
    logger.info("%s: shard %d/%d, %d examples, %d tokens in %.1f s (%.0f tokens/s)", path, index + 1, len(plan),
                stop - first, shard["tokens"], seconds, shard["tokens"] / max(seconds, 1e-9))


def _new_meta(model, examples: list[dict], lengths: list[int], max_seq_len: int, shard_tokens: int,
              layers: tuple[int, ...]) -> dict:
    identity = base_identity(model)
    return {"format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION, "base": identity,
            "layers": list(layers), "max_seq_len": max_seq_len, "dtype": "bfloat16", "token_dtype": "int32",
            "num_examples": len(examples), "num_tokens": int(sum(lengths)),
            "bytes_per_token": bytes_per_token(identity["hidden_size"], layers),
            "shard_tokens": shard_tokens, "examples_sha256": examples_digest(examples), "complete": False,
            "shards": []}


def _check_same_build(path: Path, stored: dict, meta: dict, model, with_plan: bool = True) -> None:
    """Raise :class:`StoreError` when the store at ``path`` is not the one ``meta`` describes (``with_plan``: the
    shard plan too, which a partly built store must share to resume)."""
    _check_layers(path, stored, meta["layers"], superset=not with_plan)
    keys = ("max_seq_len", "num_examples", "examples_sha256") + (("shard_tokens",) if with_plan else ())
    problems = [f"{key}: stored {stored.get(key)!r} != now {meta[key]!r}" for key in keys
                if stored.get(key) != meta[key]]
    problems += _identity_problems(stored["base"], model)
    if problems:
        raise StoreError(f"{path / META_NAME}: a different store is in this folder:\n  " + "\n  ".join(problems)
                         + "\ndelete the folder or choose another one")


def _check_layers(path: Path, stored: dict, layers, superset: bool = True) -> None:
    """Raise :class:`StoreError` naming both layer lists when the store at ``path`` does not hold the states of
    ``layers``: with ``superset`` a finished store holding more layers serves (its columns are selected on read,
    so Medusa and Hydra heads and eagle drafters of fewer layers train on one store; the base's last layer is
    always held, its output being the last hidden state); else they must be equal (a partial store resumes only
    with the same layers)."""
    have, want = list(stored["layers"]), list(layers)
    last = stored["base"]["num_hidden_layers"] - 1  # its output is the last hidden state, every store's first block
    if have == want or (superset and set(want) <= set(have) | {last}):
        return
    raise StoreError(f"{path / META_NAME}: a store built with other layers: it holds the base states of layers "
                     f"{have}, the heads read layers {want}; delete the folder or choose another one for these "
                     "heads")


def _identity_problems(stored: dict, model) -> list[str]:
    """How the base ``model`` differs from the identity a store recorded (empty when it is the same base)."""
    now = base_identity(model)
    problems = [f"base {key}: stored {stored.get(key)!r} != now {now[key]!r}"
                for key in ("hidden_size", "vocab_size", "num_hidden_layers") if stored.get(key) != now[key]]
    lm_head = model.get_output_embeddings().weight  # (V, H)
    if not problems and (mismatch := fingerprint_mismatch(stored.get("lm_head_fingerprint"), lm_head)):
        problems.append(mismatch.replace("the heads were trained on", "the store was built with"))
    return problems


def _write_shard(path: Path, index: int, first: int, model, examples: list[dict], batch_size: int,
                 layers: tuple[int, ...]) -> dict:
    """Write one shard (base states and tokens) under temporary names, then rename; returns its meta entry."""
    name = f"shard_{index:05d}"
    lengths = [len(e["input_ids"]) for e in examples]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    width = state_width(base_identity(model)["hidden_size"], layers)
    tokens = np.empty((offsets[-1], 2), dtype=np.int32)  # (N, 2)
    for e, offset, n in zip(examples, offsets, lengths, strict=False):
        tokens[offset : offset + n, 0], tokens[offset : offset + n, 1] = e["input_ids"], e["labels"]
    with (atomic_file(path / f"{name}{HIDDEN_SUFFIX}", TMP_PREFIX, sync=True) as tmp_hidden,
          atomic_file(path / f"{name}{TOKENS_SUFFIX}", TMP_PREFIX, sync=True) as tmp_tokens):
        hidden = np.memmap(tmp_hidden, dtype=np.uint16, mode="w+", shape=(int(offsets[-1]), width))  # (N, W)
        device = next(model.parameters()).device
        for batch_rows in length_sorted_batches(lengths, batch_size):
            batch = collate([examples[r] for r in batch_rows], pad_id=0)
            states = base_states(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                 layers)  # (B, T, W)
            bits = states.to("cpu", torch.bfloat16).view(torch.uint16).numpy()  # (B, T, W)
            for row, r in enumerate(batch_rows):
                hidden[offsets[r] : offsets[r + 1]] = bits[row, : lengths[r]]
        hidden.flush()
        del hidden
        tokens.tofile(tmp_tokens)
    return _shard_entry(index, first, lengths, width)


def _shard_entry(index: int, first: int, lengths: list[int], width: int) -> dict:
    """Shard ``index``'s entry in ``meta.json`` (its examples start at ``first``, their lengths ``lengths``; ``width``
    bf16 states per token): what the files must hold, known without reading them."""
    tokens = int(sum(lengths))
    return {"name": f"shard_{index:05d}", "first_example": first, "examples": len(lengths), "tokens": tokens,
            "hidden_bytes": tokens * width * 2, "tokens_bytes": tokens * 2 * np.dtype(np.int32).itemsize,
            "lengths": list(lengths)}


def _write_json_atomic(path: Path, data: dict) -> None:
    with atomic_file(path, TMP_PREFIX) as tmp:
        tmp.write_text(json.dumps(data, indent=1) + "\n")


def ensure_store(path: str | Path, model, examples: list[dict], max_seq_len: int, batch_size: int = 8,
                 accelerator=None, layers: tuple[int, ...] = ()) -> HiddenStateStore:
    """Build (or resume) the store of ``layers`` at ``path``, the processes sharing its shards
    (:func:`build_store`), then open it on every process.

    ``accelerator`` is an ``accelerate.Accelerator`` (or ``PartialState``), or ``None`` for a single process.
    Raises what :func:`build_store` and :meth:`HiddenStateStore.open` raise.
    """
    build_store(path, model, examples, max_seq_len, batch_size, layers=layers, accelerator=accelerator)
    return HiddenStateStore.open(path, model=model, max_seq_len=max_seq_len, examples=examples, layers=layers)


# ---------------------------------------------------------------------------------------------------------------------
# Reading.


def read_meta(path: str | Path) -> dict:
    """The ``meta.json`` of the store folder ``path`` (a version 1 meta gets ``layers: []``: it holds the last
    hidden states alone).

    Raises:
        StoreError: it is missing, not valid JSON, not a store's meta, or of an unknown format version.
    """
    meta_path = Path(path) / META_NAME
    if not meta_path.is_file():
        raise StoreError(f"{meta_path} not found: {path} is not a hidden-state store (or its build never started)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{meta_path} is corrupt (not valid JSON: {e}); delete the store and build it again") from e
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        raise StoreError(f"{meta_path} is not the meta of a hidden-state store (format {STORE_FORMAT!r} expected)")
    if meta.get("format_version") not in SUPPORTED_STORE_VERSIONS:
        raise StoreError(f"{meta_path}: unknown store format version {meta.get('format_version')!r} (this code "
                         f"reads versions {list(SUPPORTED_STORE_VERSIONS)}); rebuild the store with this version")
    if meta["format_version"] == 1:
        meta["layers"] = []
    missing = {"base", "layers", "max_seq_len", "num_examples", "shards", "complete"} - set(meta)
    if missing:
        raise StoreError(f"{meta_path} is corrupt: missing {sorted(missing)}")
    return meta


def _check_shard_sizes(path: Path, shards: list[dict]) -> None:
    """Raise :class:`StoreError` naming the first shard file whose size on disk differs from ``meta.json``."""
    for shard in shards:
        for suffix, key in ((HIDDEN_SUFFIX, "hidden_bytes"), (TOKENS_SUFFIX, "tokens_bytes")):
            file = path / f"{shard['name']}{suffix}"
            size = file.stat().st_size if file.is_file() else None
            if size != shard[key]:
                found = "missing" if size is None else f"{size} bytes"
                raise StoreError(f"{file}: shard {found} on disk, {shard[key]} bytes in {path / META_NAME} "
                                 "(truncated or replaced); delete the store and build it again")


class HiddenStateStore:
    """Read access to a finished store: examples, their ``(T_i, W)`` bf16 base states (``W`` =
    :attr:`width`: the last hidden state, then each of :attr:`layers`) and padded batches.

    Shards are memory-mapped copy-on-write: reading an example touches only its pages, nothing is loaded up front.
    """

    def __init__(self, path: Path, meta: dict, layers: tuple[int, ...] | None = None):
        self.path, self.meta = path, meta
        self.hidden_size = int(meta["base"]["hidden_size"])
        stored = tuple(meta["layers"])
        self.layers: tuple[int, ...] = stored if layers is None else tuple(layers)
        """The decoder layers whose outputs follow the last hidden state in the states this store returns (a subset
        of those it holds, chosen on open)."""
        self.width = state_width(self.hidden_size, self.layers)
        self._stored_width = state_width(self.hidden_size, stored)  # what each position holds on disk
        last = int(meta["base"]["num_hidden_layers"]) - 1  # its output is the last hidden state (block 0)
        blocks = [0] + [1 + stored.index(i) if i in stored else 0 for i in self.layers]
        if any(i not in stored and i != last for i in self.layers):
            raise StoreError(f"{path / META_NAME}: the store holds layers {list(stored)}, asked for {list(layers)}")
        h = self.hidden_size
        self._columns = None if list(self.layers) == list(stored) else torch.cat(
            [torch.arange(b * h, (b + 1) * h) for b in blocks])  # (W,) columns of the stored states returned
        lengths = [np.asarray(s["lengths"], dtype=np.int64) for s in meta["shards"]]
        self.lengths = np.concatenate(lengths)  # (N,)
        self.shard_of = np.concatenate([np.full(len(x), s, dtype=np.int64) for s, x in enumerate(lengths)])  # (N,)
        self.offset = np.concatenate([np.cumsum(x) - x for x in lengths])  # (N,) token offset inside the shard
        self._hidden: dict[int, np.ndarray] = {}
        self._tokens: dict[int, np.ndarray] = {}

    @classmethod
    def open(cls, path: str | Path, model=None, max_seq_len: int | None = None,
             examples: list[dict] | None = None, layers: tuple[int, ...] | None = None) -> HiddenStateStore:
        """Open the store folder ``path``, checking it against what the caller is about to train with.

        Args:
            path: the store folder.
            model: when given, the store must have been built by this base: same sizes, lm_head fingerprint, and the
                first tokens of example 0 give the same states again (relative L2 error below 5e-2).
            max_seq_len: when given, must equal the store's.
            examples: when given, must be exactly the stored examples (same ids and labels, same order).
            layers: when given, must be the store's layers (the heads' ``base_layers``).

        Raises:
            StoreError: meta.json missing, corrupt or of an unknown version; the build is unfinished; a shard's size
                on disk differs from meta.json; another base, ``max_seq_len``, examples or layers.
        """
        path = Path(path)
        meta = read_meta(path)
        meta_path = path / META_NAME
        if not meta["complete"]:
            raise StoreError(f"{meta_path}: the build stopped after {len(meta['shards'])} shards; run it again "
                             "(build_store resumes it)")
        _check_shard_sizes(path, meta["shards"])
        if max_seq_len is not None and meta["max_seq_len"] != max_seq_len:
            raise StoreError(f"{meta_path}: built with max_seq_len {meta['max_seq_len']}, asked for {max_seq_len}")
        if layers is not None:
            _check_layers(path, meta, layers)  # a store of more layers serves: the heads' are selected
        if examples is not None and (len(examples) != meta["num_examples"]
                                     or examples_digest(examples) != meta.get("examples_sha256")):
            raise StoreError(f"{meta_path}: the store holds other examples than the {len(examples)} given "
                             f"({meta['num_examples']} stored); data, split or tokenizer changed: delete the store "
                             "or choose another folder")
        store = cls(path, meta, layers)
        if model is not None:
            store._check_base(model)
        return store

    def _check_base(self, model) -> None:
        problems = _identity_problems(self.meta["base"], model)
        if not problems:
            n = min(STATE_CHECK_TOKENS, int(self.lengths[0]))
            device = next(model.parameters()).device
            ids = torch.tensor([self.example(0)["input_ids"][:n]], device=device)  # (1, n)
            fresh = base_states(model, ids, torch.ones_like(ids), self.layers)[0].float().cpu()  # (n, W)
            stored = self.hidden(0)[:n].float()  # (n, W)
            error = ((fresh - stored).norm() / stored.norm().clamp_min(1e-12)).item()
            if error > STATE_CHECK_RTOL:
                problems.append(f"the base gives other hidden states (relative error {error:.3g} on example 0)")
        if problems:
            raise StoreError(f"{self.path / META_NAME}: built by another base "
                             f"({self.meta['base'].get('name_or_path')!r}):\n  " + "\n  ".join(problems))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def max_seq_len(self) -> int:
        return int(self.meta["max_seq_len"])

    def _shard_arrays(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        if s not in self._hidden:
            shard = self.meta["shards"][s]
            self._hidden[s] = np.memmap(self.path / f"{shard['name']}{HIDDEN_SUFFIX}", dtype=np.uint16, mode="c",
                                        shape=(shard["tokens"], self._stored_width))  # (N_s, W)
            self._tokens[s] = np.memmap(self.path / f"{shard['name']}{TOKENS_SUFFIX}", dtype=np.int32, mode="r",
                                        shape=(shard["tokens"], 2))  # (N_s, 2)
        return self._hidden[s], self._tokens[s]

    def _span(self, i: int) -> tuple[int, int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} outside the store's {len(self)} examples ({self.path})")
        return int(self.shard_of[i]), int(self.offset[i]), int(self.lengths[i])

    def example(self, i: int) -> dict:
        """``{"input_ids", "labels"}`` (lists of ints) of example ``i``."""
        s, offset, n = self._span(i)
        tokens = self._shard_arrays(s)[1][offset : offset + n]  # (T_i, 2)
        return {"input_ids": tokens[:, 0].tolist(), "labels": tokens[:, 1].tolist()}

    def hidden(self, i: int) -> torch.Tensor:
        """Example ``i``'s base states ``(T_i, W)`` in bf16: a view of the memory map (a copy of the selected columns
        when the store holds more layers than were asked for)."""
        s, offset, n = self._span(i)
        states = torch.from_numpy(self._shard_arrays(s)[0][offset : offset + n]).view(torch.bfloat16)  # (T_i, W')
        return states if self._columns is None else states[:, self._columns]  # (T_i, W)

    def hidden_batch(self, indices: list[int]) -> torch.Tensor:
        """Right-padded float32 base states ``(B, T, W)`` of ``indices``, ``T`` the longest; padding is zero."""
        longest = int(max(self.lengths[i] for i in indices))
        hidden = torch.zeros(len(indices), longest, self.width)  # (B, T, W)
        for row, i in enumerate(indices):
            states = self.hidden(i)  # (T_i, W)
            hidden[row, : len(states)] = states.float()
        return hidden

    def batch(self, indices: list[int], pad_id: int = 0) -> dict:
        """``hidden`` ``(B, T, W)`` float32 plus ``input_ids``/``attention_mask``/``labels`` ``(B, T)`` as
        :func:`train.data.collate` makes them (padding: ``pad_id``, mask 0, label -100, zero states)."""
        return {"hidden": self.hidden_batch(indices), **collate([self.example(i) for i in indices], pad_id)}
