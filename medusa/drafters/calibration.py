"""Calibration of drafts: from a draft's confidence to the probability the base accepts it (pure tensor code).

The per-step tree (:mod:`medusa.drafters.per_step`) values a candidate node by the probability that the base accepts
its whole path, the product along the path of each node's acceptance probability given its parent was accepted
(EAGLE-2, Li et al. 2024, section 4: draft confidence approximates acceptance; here it is calibrated rather than
trusted). This module measures those probabilities on validation sequences (the base's own greedy continuations of
a validation split, never the frozen held-out prompt sets) by replaying greedy decoding, and stores them in the heads
folder as ``calibration.json``:

- ``accuracy[d][r]``: how often head d's rank-r candidate is the base's token, given the path above is right;
- ``acceptance[d][b]``: the same, by confidence bin b (the head's softmax probability of the candidate, bins
  :data:`CONFIDENCE_EDGES`), made monotone in confidence when measured (pool adjacent violators) and shrunk towards
  the depth's overall rate where it holds few samples (a high confidence alone earns no trust);
- ``lookup[n][j]``: how often the prompt-lookup chain's token j is right given tokens 1..j-1 were, by the length n of
  the context n-gram that matched (0: no match, the last token repeated).

A calibration belongs to one set of heads: it records their type, count, sizes, the base's lm_head fingerprint and
the digest of their weights file, and :func:`check_calibration` refuses it for any other heads, naming the difference.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from medusa.drafters.heads import head_target_offset
from medusa.drafters.prompt_lookup import lookup_match

CALIBRATION_FILE_NAME = "calibration.json"
CALIBRATION_VERSION = 1
CONFIDENCE_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
"""Bin edges of draft confidence; bin b holds ``edges[b] <= c < edges[b + 1]`` (the last includes 1)."""
PRIOR_WEIGHT = 4.0
"""Pseudo-samples at the depth's overall acceptance rate added to each bin before the monotone fit."""


class CalibrationMismatchError(ValueError):
    """The calibration was measured for other heads (the difference is named)."""


@dataclass
class Calibration:
    """Measured acceptance of one set of heads' drafts and of the prompt-lookup chain (see module docstring)."""

    heads: dict
    """Identity of the heads measured: type, count, sizes, lm_head fingerprint, weights digest."""
    top_k: int
    accuracy: list[list[float]]
    """``(K, top_k)`` per depth and rank."""
    acceptance: list[list[float]]
    """``(K, bins)`` per depth and confidence bin."""
    counts: list[list[int]]
    """``(K, bins)`` samples per bin."""
    lookup_max_ngram: int
    lookup: list[list[float]]
    """``(lookup_max_ngram + 1, L)`` per matched n-gram length and chain position."""
    lookup_counts: list[list[int]]
    source: dict = field(default_factory=dict)
    """Where it was measured: data file, sequences, positions."""
    edges: list[float] = field(default_factory=lambda: list(CONFIDENCE_EDGES))
    version: int = CALIBRATION_VERSION

    @property
    def num_heads(self) -> int:
        return len(self.acceptance)

    @property
    def lookup_length(self) -> int:
        return len(self.lookup[0]) if self.lookup else 0

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(edges (bins+1,), acceptance (K, bins), lookup (n+1, L))`` as float tensors on ``device``."""
        return (torch.tensor(self.edges, device=device), torch.tensor(self.acceptance, device=device),
                torch.tensor(self.lookup, device=device).reshape(self.lookup_max_ngram + 1, -1))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "calibration") -> Calibration:
        """Validate and build.

        Raises:
            ValueError: a missing or unknown field, a wrong version, ragged or non-finite tables, or a probability
                outside [0, 1] (the field is named).
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object")
        names = {f for f in cls.__dataclass_fields__}
        missing, unknown = names - set(data) - {"source", "edges", "version"}, set(data) - names
        if missing or unknown:
            raise ValueError(f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        if data.get("version", CALIBRATION_VERSION) != CALIBRATION_VERSION:
            raise ValueError(f"{where}: format version {data.get('version')!r}, this release reads "
                             f"{CALIBRATION_VERSION}")
        cal = cls(**data)
        if not isinstance(cal.heads, dict) or not isinstance(cal.top_k, int) or cal.top_k < 1:
            raise ValueError(f"{where}: 'heads' must be an object and 'top_k' an int >= 1")
        if not isinstance(cal.lookup_max_ngram, int) or cal.lookup_max_ngram < 1:
            raise ValueError(f"{where}: 'lookup_max_ngram' must be an int >= 1, got {cal.lookup_max_ngram!r}")
        edges = _table(cal.edges, where, "edges", 1)[0]
        if edges[0] != 0.0 or edges[-1] != 1.0 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            raise ValueError(f"{where}: 'edges' must rise strictly from 0 to 1, got {edges}")
        bins = len(edges) - 1
        k = len(_table(cal.acceptance, where, "acceptance", 2, cols=bins, probability=True))
        if k < 1:
            raise ValueError(f"{where}: 'acceptance' holds no head")
        if k != cal.heads.get("num_heads", k):
            raise ValueError(f"{where}: 'acceptance' has {k} rows, but the heads it names have "
                             f"{cal.heads['num_heads']}")
        _table(cal.counts, where, "counts", 2, rows=k, cols=bins)
        _table(cal.accuracy, where, "accuracy", 2, rows=k, cols=cal.top_k, probability=True)
        look = _table(cal.lookup, where, "lookup", 2, rows=cal.lookup_max_ngram + 1,
                      cols=len(cal.lookup[0]) if cal.lookup and isinstance(cal.lookup[0], list) else None,
                      probability=True)
        _table(cal.lookup_counts, where, "lookup_counts", 2, rows=len(look), cols=len(look[0]) if look else 0)
        return cal


def _table(value, where: str, name: str, ndim: int, rows: int | None = None, cols: int | None = None,
           probability: bool = False) -> list:
    """Check a rectangular table of finite numbers (``ndim`` 1 or 2); returns it as rows."""
    table = [value] if ndim == 1 else value
    if not isinstance(table, list) or not all(isinstance(r, list) for r in table):
        raise ValueError(f"{where}: {name!r} must be a list{' of lists' if ndim == 2 else ''} of numbers")
    if rows is not None and len(table) != rows:
        raise ValueError(f"{where}: {name!r} has {len(table)} rows, expected {rows}")
    for r in table:
        if cols is not None and len(r) != cols:
            raise ValueError(f"{where}: {name!r} has a row of {len(r)} entries, expected {cols}")
        for x in r:
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
                raise ValueError(f"{where}: {name!r} holds {x!r}: every entry must be a finite number")
            if (probability and not 0 <= x <= 1) or x < 0:
                raise ValueError(f"{where}: {name!r} holds {x!r}, outside [0, 1]" if probability else
                                 f"{where}: {name!r} holds {x!r} < 0")
    return table


# -- identity -------------------------------------------------------------------------------------------------------
def file_digest(path: str | Path) -> str:
    """sha256 of a file (the heads' weights file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def heads_identity(heads, weights_file: str | Path | None = None) -> dict:
    """What a calibration must match: the heads' type, count, sizes and base lm_head fingerprint, and the sha256 of
    their weights file when one is given (heads loaded from a folder)."""
    c = heads.config
    out = {"head_type": c.head_type, "num_heads": c.num_heads, "num_layers": c.num_layers,
           "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "head_vocab_size": heads.head_vocab_size,
           "lm_head_fingerprint": _fingerprint_digest(c.lm_head_fingerprint)}
    if weights_file is not None:
        out["weights_sha256"] = file_digest(weights_file)
    return out


def folder_identity(heads_dir: str | Path, config=None) -> dict:
    """:func:`heads_identity` of a heads folder from its files alone (``config.json`` and the weights file's
    digest), so a calibration for other heads is refused before any model loads. ``config``: the folder's
    :class:`medusa.drafters.heads.MedusaHeadsConfig` when already read."""
    from medusa.io.checkpoint import HEADS_WEIGHTS_NAME, check_heads_folder

    c = config if config is not None else check_heads_folder(heads_dir)
    return {"head_type": c.head_type, "num_heads": c.num_heads, "num_layers": c.num_layers,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "head_vocab_size": c.head_vocab_size or c.vocab_size,
            "lm_head_fingerprint": _fingerprint_digest(c.lm_head_fingerprint),
            "weights_sha256": file_digest(Path(heads_dir) / HEADS_WEIGHTS_NAME)}


def _fingerprint_digest(fingerprint) -> str | None:
    if not fingerprint:
        return None
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def check_calibration(calibration: Calibration, identity: dict, where: str = "calibration") -> None:
    """Refuse a calibration measured for other heads.

    Raises:
        CalibrationMismatchError: a field of ``identity`` (:func:`heads_identity`) differs; each difference is named.
            The weights digest is compared only when both sides have one.
    """
    differences = []
    for key, want in identity.items():
        have = calibration.heads.get(key)
        if key == "weights_sha256" and have is None:
            continue
        if have != want:
            differences.append(f"{key}: calibrated {_short(have)!r}, heads {_short(want)!r}")
    if differences:
        raise CalibrationMismatchError(f"{where} was measured for other heads ({'; '.join(differences)}): measure "
                                       "it again with `medusa calibrate --heads DIR --data VALIDATION`")


def _short(value):
    return value[:12] if isinstance(value, str) and len(value) > 16 else value


def save_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Write ``calibration`` as JSON, atomically (a temporary file renamed into place)."""
    from medusa.io.files import atomic_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(calibration.to_dict(), indent=1) + "\n")
    return path


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, or invalid (:meth:`Calibration.from_dict`; NaN and infinities are refused).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no calibration file {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"calibration file {path} is damaged ({e}): measure it again with `medusa calibrate`") from e
    return Calibration.from_dict(data, f"calibration file {path}")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a calibration may hold")


# -- measuring ------------------------------------------------------------------------------------------------------
def monotone_fit(hits: torch.Tensor, counts: torch.Tensor, prior: torch.Tensor,
                 prior_weight: float = PRIOR_WEIGHT) -> torch.Tensor:
    """Acceptance rate per bin, non-decreasing along the bins: ``(hits + w prior) / (counts + w)`` made monotone by
    pooling adjacent violators (weighted by ``counts + w``). All ``(bins,)``."""
    rate = ((hits + prior_weight * prior) / (counts + prior_weight)).tolist()
    weight = (counts + prior_weight).tolist()
    blocks: list[list[float]] = []  # [value, weight, length]
    for r, w in zip(rate, weight, strict=True):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return torch.tensor([v for v, _, n in blocks for _ in range(n)])


@torch.inference_mode()
def measure_calibration(heads, states: list[tuple[torch.Tensor, int, torch.Tensor]], top_k: int = 8,
                        lookup_length: int = 16, lookup_max_ngram: int = 3, identity: dict | None = None,
                        source: dict | None = None) -> Calibration:
    """Replay greedy decoding of validation sequences and measure how often drafts are accepted.

    Args:
        heads: :class:`medusa.drafters.heads.MedusaHeads` or :class:`medusa.drafters.heads.HydraHeads`.
        states: ``(token_ids (T,), response_start, hidden (T, H))`` per sequence
            (:func:`medusa.tools.calibrate.sequence_states`): the base's own continuation and its hidden states.
        top_k: ranks measured per head.
        lookup_length: prompt-lookup chain positions measured.
        lookup_max_ngram: longest n-gram the lookup matches.
        identity: the heads' :func:`heads_identity` (default: without a weights digest).

    Returns:
        The :class:`Calibration`. Position t of head d counts only when the true tokens t+2 .. t+d+1 are within the
        ``top_k`` of heads 0..d-1 (the path above is in the tree): acceptance given the parent was accepted. Bins
        with few samples lean on the depth's overall rate; a depth never reached takes the depth above's fit.

    Raises:
        ValueError: no sequence has a response long enough to measure the first head.
    """
    num_heads = heads.config.num_heads
    bins = len(CONFIDENCE_EDGES) - 1
    edges = torch.tensor(CONFIDENCE_EDGES)
    hits, counts = torch.zeros(num_heads, bins), torch.zeros(num_heads, bins)
    rank_hits, rank_counts = torch.zeros(num_heads, top_k), torch.zeros(num_heads)
    look_hits = torch.zeros(lookup_max_ngram + 1, lookup_length)
    look_counts = torch.zeros(lookup_max_ngram + 1, lookup_length)
    positions = 0
    for tokens, start, hidden in states:
        probs = torch.softmax(heads(hidden, tokens).float(), dim=-1)  # (K, T, Vh)
        conf, ids = probs.topk(top_k, dim=-1)  # (K, T, top_k)
        ids = heads.to_base_ids(ids).cpu()
        conf = conf.cpu()
        tokens_cpu = tokens.cpu()
        length = len(tokens_cpu)
        path_in = torch.ones(length, dtype=torch.bool)  # (T,): the true path above depth d is in the top-k
        for d in range(num_heads):
            offset = head_target_offset(d)
            rows = torch.arange(max(start - 1, 0), max(length - offset, 0))  # positions with a response target
            if len(rows) == 0:
                break
            right = ids[d, rows] == tokens_cpu[rows + offset, None]  # (n, top_k)
            keep = path_in[rows]
            right_k, conf_k = right[keep], conf[d, rows][keep]  # (m, top_k)
            which = (torch.bucketize(conf_k.clamp(0, 1 - 1e-7), edges, right=True) - 1).clamp(0, bins - 1)
            counts[d] += torch.bincount(which.flatten(), minlength=bins)[:bins].float()
            hits[d] += torch.bincount(which.flatten(), weights=right_k.flatten().float(), minlength=bins)[:bins]
            rank_hits[d] += right_k.float().sum(0)
            rank_counts[d] += len(right_k)
            below = torch.zeros(length, dtype=torch.bool)
            below[rows] = right.any(dim=1)
            path_in = path_in & below
        for i in range(max(start - 1, 0), length - 2):
            draft, n = lookup_match(tokens_cpu[: i + 2], lookup_length, lookup_max_ngram)
            truth = tokens_cpu[i + 2 : i + 2 + lookup_length]
            agree = (draft[: len(truth)] == truth).long().cumprod(0)  # (m,)
            reached = torch.cat([torch.ones(1, dtype=torch.long), agree[:-1]])  # token j was tried
            look_counts[n, : len(truth)] += reached.float()
            look_hits[n, : len(truth)] += agree.float()
            positions += 1
    if rank_counts[0] == 0:
        raise ValueError("no validation sequence has a response long enough to measure the heads: calibrate on "
                         "longer answers")
    rows, above = [], None
    for d in range(num_heads):
        if counts[d].sum() == 0:  # never reached (the path above never was in the top-k): the depth above's fit
            rows.append(above if above is not None else torch.zeros(bins))
        else:  # sparse bins lean on the depth's overall rate: a confidence alone earns no trust
            rows.append(monotone_fit(hits[d], counts[d], (hits[d].sum() / counts[d].sum()).expand(bins)))
        above = rows[-1]
    acceptance = torch.stack(rows)
    pooled = (look_hits.sum(0) + 1) / (look_counts.sum(0) + 2)  # (L,) every n-gram length together
    lookup = (look_hits + 2 * pooled) / (look_counts + 2)
    accuracy = rank_hits / rank_counts.clamp_min(1)[:, None]  # (K, top_k)
    return Calibration(identity or heads_identity(heads), top_k, accuracy.tolist(),
                       acceptance.tolist(), counts.long().tolist(), lookup_max_ngram, lookup.tolist(),
                       look_counts.long().tolist(), {**(source or {}), "sequences": len(states),
                                                      "positions": positions})
