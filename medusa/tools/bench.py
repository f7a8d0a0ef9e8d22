"""``medusa bench``: Hugging Face ``generate`` against Medusa decoding, in one process: greedy, or sampling with the
same settings.

For each prompt both decoders run back to back (alternating which goes first), so machine noise hits both alike.
Reported: tau (tokens per verify forward, prefill excluded), wall-clock tokens/s of each and their ratio, the fraction
of prompts whose tokens are identical, and for each differing prompt the first differing position and the base's
top-2 logit gap there (a gap near zero means a numerical tie, not a decoding bug), the figures of each prompt, and
the machine's load average (timings on a machine busy with other work say little: see :func:`machine_load`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from medusa.base import hf_greedy_batch
from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import STEP_PARTS
from medusa.decode.tree import Tree
from medusa.model import MedusaModel
from medusa.tools.plan import expected_tokens

PLAIN = Tree.chain(0)
"""A tree of one node (the root): plain decoding, one token per forward, through the same engine."""
TIE_ULPS = 2.0
"""A divergence is a tie when the base's top-2 gap there is at most this many units of rounding of the dtype at
the top logit's magnitude (``eps * |logit|``): bf16 rounds at about 2**-8 relative, fp32 at 2**-24."""


def read_prompts(path: str | Path) -> list[dict]:
    """Read a JSON-lines file of ``{"prompt": str}``, ``{"messages": [...]}`` or ``{"text": str}`` (a document
    prefix to continue) records (see :func:`encode_prompt`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON or has neither field, or the file has no prompt.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON: {e}") from e
        if not isinstance(record, dict) or not {"prompt", "messages", "text"} & set(record):
            raise ValueError(f"{path}:{n} has none of 'prompt', 'messages', 'text'")
        prompts.append(record)
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def read_distilled_sequences(path: str | Path, limit: int | None = None) -> list[tuple[list[int], int]]:
    """``(token_ids, response_start)`` of the first ``limit`` self-distilled records (``prompt_ids``/``response_ids``,
    as ``medusa distill`` writes them) of a JSON-lines file.

    Raises:
        ValueError: a line is not JSON or lacks either field, or the file holds no record.
    """
    sequences = []
    for line in Path(path).read_text().splitlines()[:limit]:
        record = json.loads(line)
        if "prompt_ids" not in record or "response_ids" not in record:
            raise ValueError(f"{path}: needs self-distilled records with prompt_ids/response_ids")
        sequences.append((record["prompt_ids"] + record["response_ids"], len(record["prompt_ids"])))
    if not sequences:
        raise ValueError(f"{path} holds no sequence")
    return sequences


def read_messages(value: str) -> list[dict]:
    """Chat messages given as a JSON list of ``{"role", "content"}`` objects, or the path of a file holding one.

    Raises:
        ValueError: neither, or a list that is empty or holds something else.
    """
    text = Path(value).read_text() if Path(value).is_file() else value
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--messages is neither a JSON list nor a file holding one: {e}") from e

    def well_formed(m) -> bool:
        return isinstance(m, dict) and {"role", "content"} <= set(m)

    if not isinstance(messages, list) or not messages or not all(well_formed(m) for m in messages):
        raise ValueError("--messages must be a JSON list of {\"role\": ..., \"content\": ...} objects")
    return messages


def check_fixed_tree(path: str | Path, heads_dir: str | Path):
    """The fixed tree file the bench times beside the per-step tree, read and checked against the heads folder's
    config before any model loads.

    Raises:
        FileNotFoundError, ValueError: a missing or damaged file, or a tree deeper or wider than the heads.
    """
    from medusa.decode.tree import load_tree
    from medusa.io.checkpoint import check_heads_folder

    tree = load_tree(path)
    config = check_heads_folder(heads_dir)
    tree.check_fits(config.num_heads, config.head_vocab_size or config.vocab_size)
    return tree


def check_bench_options(heads_dir, fixed_tree=None, batch_sizes=None, sampling: dict | None = None,
                        plot: bool = False, out=None, drift_data=None, original=None, adapter=None, base=None):
    """``medusa bench``'s options checked before any model loads: a plot needs ``out``, the fixed
    tree goes with the one-prompt greedy bench and must fit the heads (:func:`check_fixed_tree`), the batched bench
    is greedy with batch sizes >= 1, and drift needs an original (``original``, else ``base`` when an ``adapter``
    is merged).

    Returns:
        ``(fixed tree or None, the original drift compares with or None)``.

    Raises:
        ValueError, FileNotFoundError, ImportError: the option at fault named.
    """
    if plot and not out:
        raise ValueError("--plot writes <out>.png next to the JSON: pass --out too")
    sampled = any(v is not None for k, v in (sampling or {}).items() if k != "acceptance")
    tree = None
    if fixed_tree:  # a damaged file, one that does not fit, or other modes
        if batch_sizes:
            raise ValueError("--fixed-tree times a fixed tree beside the per-step one in the one-prompt bench: drop "
                             "--batch-size or --fixed-tree")
        if (sampling or {}).get("do_sample"):
            raise ValueError("the fixed-tree comparison is greedy only: drop --fixed-tree")
        tree = check_fixed_tree(fixed_tree, heads_dir)
    if batch_sizes and min(batch_sizes) < 1:
        raise ValueError(f"--batch-size values must be >= 1, got {batch_sizes}")
    if batch_sizes and sampled:
        raise ValueError("the batched bench is greedy only: drop the sampling flags")
    drift_original = None
    if drift_data:
        drift_original = original or (base if adapter else None)
        if drift_original is None:
            raise ValueError("--drift-data needs the original to compare with: pass --adapter or --original")
    return tree, drift_original


def encode_prompt(tokenizer, record: dict, use_chat_template: bool = True) -> torch.Tensor:
    """``(T,)`` prompt ids of one prompt record.

    - ``{"text": ...}``: a document prefix to continue, encoded as plain text (as the tokenizer encodes any text,
      a base model's BOS included) whatever the tokenizer;
    - ``{"messages": [...]}`` or ``{"prompt": ...}`` (one user message): the chat template with its generation
      prompt when the tokenizer has one (and ``use_chat_template``); else a ``prompt`` is encoded as plain text and
      ``messages`` are rendered as plain role-labelled text ending in ``"Assistant:"``
      (:func:`medusa.base.render_plain_chat`, as training renders chats for such a tokenizer).

    Raises:
        ValueError: the record has none of ``text``, ``messages``, ``prompt``.
    """
    from medusa.base import chat_prompt_ids, render_plain_chat

    if record.get("text") is not None:
        return torch.tensor(tokenizer(record["text"])["input_ids"], dtype=torch.long)
    if record.get("messages") is None and record.get("prompt") is None:
        raise ValueError(f"a prompt record needs 'text', 'messages' or 'prompt', got keys {sorted(record)}")
    messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
    if use_chat_template and tokenizer.chat_template:
        ids = chat_prompt_ids(tokenizer, messages)
    elif record.get("messages"):
        ids = tokenizer(render_plain_chat(messages, add_generation_prompt=True)[0])["input_ids"]
    else:
        ids = tokenizer(record["prompt"])["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def hf_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids: set[int],
              prompt_lookup: int = 0) -> list[int]:
    """Hugging Face ``generate`` with greedy decoding; returns the new token ids (stopping at a stop token).

    ``prompt_lookup`` > 0: Hugging Face's own prompt lookup decoding (``prompt_lookup_num_tokens``), the baseline
    for our trees' lookup chain."""
    ids = input_ids[None].to(model.device)
    lookup = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(stop_token_ids) or None, pad_token_id=next(iter(stop_token_ids), 0),
                         **lookup)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def hf_sample(model, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids: set[int], seed: int,
              **settings) -> list[int]:
    """Hugging Face ``generate`` sampling with ``settings`` (temperature, top_k, top_p), seeded through torch's
    global generator as HF sampling is."""
    ids = input_ids[None].to(model.device)
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
                         eos_token_id=sorted(stop_token_ids) or None, pad_token_id=next(iter(stop_token_ids), 0),
                         **settings)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def sum_logprob(model, input_ids: torch.Tensor, continuation: list[int]) -> float:
    """Sum of the base's log-probabilities (raw logits, temperature 1) of ``continuation`` after the prompt."""
    if not continuation:
        return 0.0
    tail = torch.tensor(continuation, dtype=torch.long, device=input_ids.device)
    ids = torch.cat([input_ids, tail])[None].to(model.device)
    logprobs = torch.log_softmax(model(ids).logits[0, len(input_ids) - 1 : -1].float(), dim=-1)  # (n, V)
    return float(logprobs.gather(1, ids[0, len(input_ids):, None]).sum())


@torch.inference_mode()
def top2(model, input_ids: torch.Tensor, continuation: list[int], position: int) -> tuple[float, float]:
    """The base's top logit and top-2 gap when predicting ``continuation[position]`` after the prompt and the tokens
    before: ``(top logit, top-1 minus top-2)``."""
    tail = torch.tensor(continuation[:position], dtype=torch.long, device=input_ids.device)
    ids = torch.cat([input_ids, tail])[None].to(model.device)
    logits = model(ids).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0]), float(top[0] - top[1])


def tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    """The largest top-2 gap still counted as a numerical tie in ``dtype`` (see :data:`TIE_ULPS`)."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(abs(top_logit), 1.0)


def divergence(model, input_ids: torch.Tensor, tokens: list[int], reference: list[int], prompt: int) -> dict:
    """Where ``tokens`` first leaves ``reference``, the base's top-2 gap there and whether it is a tie in the base's
    dtype (:func:`tie_tolerance`)."""
    pairs = enumerate(zip(tokens, reference, strict=False))
    pos = next((j for j, (a, b) in pairs if a != b), min(len(tokens), len(reference)))
    top, gap = top2(model, input_ids, reference, pos)
    tolerance = tie_tolerance(model.dtype, top)
    return {"prompt": prompt, "position": pos, "base_top2_gap": gap, "tie_tolerance": tolerance,
            "tie": gap <= tolerance}


@dataclass
class BenchResult:
    """Aggregated bench figures (see module docstring); times in seconds."""

    prompts: int = 0
    identical_prompts: int = 0
    baseline_tokens: int = 0
    baseline_s: float = 0.0
    medusa_tokens: int = 0
    medusa_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    copied_tokens: int = 0
    """Emitted tokens that were accepted prompt-lookup drafts (copied nodes)."""
    accepted_hist: list[int] = field(default_factory=list)
    divergences: list[dict] = field(default_factory=list)
    per_prompt: list[dict] = field(default_factory=list)
    medusa_decode_s: float = 0.0
    step_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    plain_tokens: int = 0
    plain_s: float = 0.0
    plain_decode_s: float = 0.0
    plain_decode_steps: int = 0
    plain_identical_prompts: int = 0
    identical_to_plain_prompts: int = 0
    """Prompts whose Medusa tokens equal plain decoding's through the same engine (exactness relative to the model
    the engine runs: a quantized engine's tokens may differ from the fp32 base's)."""
    hf_lookup_tokens: int = 0
    hf_lookup_s: float = 0.0
    hf_lookup_identical_prompts: int = 0
    tree_nodes: dict[int, int] = field(default_factory=dict)
    """Steps by the number of nodes their tree had (root included; 1: a plain step)."""
    fixed_tokens: int = 0
    fixed_s: float = 0.0
    fixed_identical_prompts: int = 0
    fixed_name: str = ""

    def to_dict(self, num_heads: int) -> dict:
        steps = max(self.decode_steps, 1)
        per_depth = kept_by_depth(self.accepted_hist)
        per_head = (per_depth + [0.0] * num_heads)[:num_heads]  # head k drafts depth k + 1
        base_tps = self.baseline_tokens / self.baseline_s if self.baseline_s else float("nan")
        medusa_tps = self.medusa_tokens / self.medusa_s if self.medusa_s else float("nan")
        plain_tps = self.plain_tokens / self.plain_s if self.plain_s else float("nan")
        step_ms = {part: 1e3 * s / steps for part, s in self.step_s.items()} | {
            "total": 1e3 * self.medusa_decode_s / steps}
        plain_step_ms = 1e3 * self.plain_decode_s / self.plain_decode_steps if self.plain_decode_steps else None
        ties = sum(d.get("tie", False) for d in self.divergences)
        return {
            "tau": self.decode_tokens / steps,
            "lookup_share": self.copied_tokens / max(self.medusa_tokens, 1),
            "tau_without_lookup_tokens": (self.decode_tokens - self.copied_tokens) / steps,
            "speedup": medusa_tps / base_tps,
            "speedup_vs_plain": medusa_tps / plain_tps if self.plain_s else None,
            "step_ms": step_ms,
            "plain_step_ms": plain_step_ms,
            "step_cost_vs_plain": step_ms["total"] / plain_step_ms if plain_step_ms else None,
            "identical": self.identical_prompts / max(self.prompts, 1),
            "plain_identical": self.plain_identical_prompts / max(self.prompts, 1) if self.plain_s else None,
            "identical_to_plain": self.identical_to_plain_prompts / max(self.prompts, 1) if self.plain_s else None,
            "ties": ties,
            "true_divergences": len(self.divergences) - ties,
            "divergences": self.divergences,
            "per_head_accept": per_head,
            "per_depth_accept": per_depth,
            "baseline_tokens_per_s": base_tps,
            "medusa_tokens_per_s": medusa_tps,
            "plain_tokens_per_s": plain_tps if self.plain_s else None,
            "prompts": self.prompts,
            "baseline_tokens": self.baseline_tokens,
            "medusa_tokens": self.medusa_tokens,
            "decode_steps": self.decode_steps,
            "accepted_histogram": self.accepted_hist,
            "per_prompt": self.per_prompt,
            "per_prompt_speedup": per_prompt_speedup(self.per_prompt),
            "tree_sizes": tree_sizes(self.tree_nodes),
        } | ({} if not self.fixed_s else {
            "fixed_tree": self.fixed_name,
            "fixed_tokens_per_s": self.fixed_tokens / self.fixed_s,
            "speedup_vs_fixed": medusa_tps / (self.fixed_tokens / self.fixed_s),
            "fixed_identical": self.fixed_identical_prompts / max(self.prompts, 1),
        }) | ({} if not self.hf_lookup_s else {
            "hf_prompt_lookup_tokens_per_s": self.hf_lookup_tokens / self.hf_lookup_s,
            "speedup_vs_hf_prompt_lookup": medusa_tps / (self.hf_lookup_tokens / self.hf_lookup_s),
            "hf_prompt_lookup_identical": self.hf_lookup_identical_prompts / max(self.prompts, 1),
        })


def tree_sizes(histogram: dict[int, int]) -> dict:
    """``{"mean", "histogram", "plain_fraction"}`` of the steps' tree sizes (nodes, root included)."""
    steps = sum(histogram.values())
    mean = sum(n * c for n, c in histogram.items()) / steps if steps else None
    return {"mean": mean, "histogram": {str(n): histogram[n] for n in sorted(histogram)},
            "plain_fraction": histogram.get(1, 0) / steps if steps else None}


def spread(values: list[float]) -> dict | None:
    """``{"min", "median", "max"}`` of ``values`` (``None`` when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"min": ordered[0], "median": median, "max": ordered[-1]}


def per_prompt_speedup(per_prompt: list[dict]) -> dict:
    """The truth per prompt: min / median / max of each prompt's speedup over HF ``generate`` and over plain
    decoding (tokens/s over tokens/s), and how many prompts were slower than each.

    Returns:
        ``{"vs_hf": spread, "vs_plain": spread, "slower_than_hf": n, "slower_than_plain": n, "prompts": n}``
        (a spread is ``None`` where that method was not timed).
    """
    vs_hf = [p["speedup_vs_hf"] for p in per_prompt if p.get("speedup_vs_hf") is not None]
    vs_plain = [p["speedup_vs_plain"] for p in per_prompt if p.get("speedup_vs_plain") is not None]
    return {"vs_hf": spread(vs_hf), "vs_plain": spread(vs_plain), "slower_than_hf": sum(s < 1 for s in vs_hf),
            "slower_than_plain": sum(s < 1 for s in vs_plain), "prompts": len(per_prompt)}


def kept_by_depth(accepted_hist: list[int]) -> list[float]:
    """Fraction of steps that kept a draft at depth d = 1 .. len - 1 (a head's or a prompt-lookup chain's), from
    ``accepted_hist[a]`` = steps that accepted ``a`` drafts: a step keeps depth d when it accepted at least d."""
    steps = max(sum(accepted_hist), 1)
    return [sum(accepted_hist[d:]) / steps for d in range(1, len(accepted_hist))]


def chain_prediction(accepted_hist: list[int], step_cost: float | None = None) -> dict:
    """The speculative-decoding estimate of tau from a per-token acceptance rate (Leviathan et al. 2023, section 3.1;
    Medusa report section 2.1): a chain of D drafts each accepted with probability alpha emits
    ``(1 - alpha**(D+1)) / (1 - alpha)`` tokens per step; divided by the step's cost relative to one plain token it
    predicts the speedup.

    Args:
        accepted_hist: ``[c_0, ..., c_D]``: steps that accepted 0..D drafts (D = the tree's depth).
        step_cost: measured cost of one verify step relative to one plain decoding step, or ``None``.

    Returns:
        ``{"alpha", "predicted_tau", "predicted_speedup"}``; alpha is accepted drafts over drafts tried (a step that
        accepted a < D drafts tried a + 1 of them, one that accepted all tried D).
    """
    depth = len(accepted_hist) - 1
    accepted = sum(a * c for a, c in enumerate(accepted_hist))
    tried = sum((a + 1 if a < depth else a) * c for a, c in enumerate(accepted_hist))
    alpha = accepted / tried if tried else 0.0
    tau = expected_tokens(alpha, depth)  # medusa plan's formula
    return {"alpha": alpha, "predicted_tau": tau,
            "predicted_speedup": None if step_cost is None else tau / step_cost}


def run_bench(model: MedusaModel, prompts: list[dict], max_new_tokens: int, warmup: int = 1,
              use_chat_template: bool = True, progress=None, sampling: dict | None = None,
              hf_prompt_lookup: int = 0, fixed_tree: Tree | None = None) -> dict:
    """Run the comparison over ``prompts`` (see module docstring) and return the JSON-ready result dict.

    ``warmup`` prompts are first decoded by both methods untimed. ``progress`` is called with
    ``(index, per_prompt_dict)`` after each prompt. ``sampling``: decoding arguments of
    :meth:`MedusaModel.generate` (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``acceptance``);
    when they sample, both methods sample with the same settings (prompt i seeded ``seed + i``), ``identical`` is
    not applicable, and the mean log-probability per token under the base of each method's outputs is reported
    instead (equal within noise when Medusa's sampling is lossless). ``hf_prompt_lookup`` > 0 (greedy only) times
    a fourth method, Hugging Face's prompt lookup decoding with that many tokens. ``fixed_tree`` (greedy only) times
    the heads on that fixed tree too (``fixed``; the per-step tree against the best fixed one, in one process).
    """
    tokenizer, base = model.tokenizer, model.base
    stop = model.stop_token_ids()
    encoded = [encode_prompt(tokenizer, p, use_chat_template) for p in prompts]
    sampling = dict(sampling or {})
    seed = sampling.pop("seed", None) or 0
    config = resolve_decoding(base.generation_config, **sampling).generation_config
    if config.do_sample:
        hf_settings = {"temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p}
        if hf_prompt_lookup:
            raise ValueError("the Hugging Face prompt lookup baseline is greedy only: drop --hf-prompt-lookup")
        if fixed_tree is not None:
            raise ValueError("the fixed-tree comparison is greedy only: drop --fixed-tree")
        return _run_bench_sampling(model, encoded, max_new_tokens, warmup, progress, sampling, seed, hf_settings)
    compile_s = warm_up_engine(model, encoded, max_new_tokens)
    for ids in encoded[:warmup]:
        hf_greedy(base, ids, 8, stop)
        if hf_prompt_lookup:
            hf_greedy(base, ids, 8, stop, hf_prompt_lookup)
        model.generate(ids, max_new_tokens=8)
        model.generate(ids, max_new_tokens=8, tree=PLAIN)
        if fixed_tree is not None:
            model.generate(ids, max_new_tokens=8, tree=fixed_tree)
    result = BenchResult(accepted_hist=[0] * (model.drafter.max_depth + 1))
    result.fixed_name = fixed_tree.name if fixed_tree is not None else ""
    methods = ["hf", "medusa", "plain"] + (["hf_lookup"] if hf_prompt_lookup else []) + (
        ["fixed"] if fixed_tree is not None else [])
    for i, ids in enumerate(encoded):
        runs = {}
        shift = i % len(methods)
        for method in methods[shift:] + methods[:shift]:  # rotated, so machine noise hits every method alike
            start = time.perf_counter()
            if method in ("hf", "hf_lookup"):
                lookup = hf_prompt_lookup if method == "hf_lookup" else 0
                runs[method] = (hf_greedy(base, ids, max_new_tokens, stop, lookup), None)
            else:
                tree = {"plain": PLAIN, "fixed": fixed_tree}.get(method)
                runs[method] = model.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=stop, tree=tree)
            runs[method + "_s"] = time.perf_counter() - start
        reference, (tokens, stats), (plain, plain_stats) = runs["hf"][0], runs["medusa"], runs["plain"]
        _add_prompt(result, runs, reference, tokens, stats, plain, plain_stats)
        record = {"prompt": i, "tokens": len(tokens), "tau": stats.tau,
                  "lookup_share": stats.lookup_share, "hf_s": runs["hf_s"],
                  "medusa_s": runs["medusa_s"], "plain_s": runs["plain_s"],
                  "hf_tokens_per_s": len(reference) / runs["hf_s"],
                  "medusa_tokens_per_s": len(tokens) / runs["medusa_s"],
                  "plain_tokens_per_s": len(plain) / runs["plain_s"]}
        record["speedup_vs_hf"] = record["medusa_tokens_per_s"] / record["hf_tokens_per_s"]
        record["speedup_vs_plain"] = record["medusa_tokens_per_s"] / record["plain_tokens_per_s"]
        record["mean_tree_nodes"] = sum(stats.tree_nodes) / max(len(stats.tree_nodes), 1)
        record["plain_steps"] = sum(n == 1 for n in stats.tree_nodes) / max(len(stats.tree_nodes), 1)
        if fixed_tree is not None:
            fixed, fixed_stats = runs["fixed"]
            result.fixed_tokens += len(fixed)
            result.fixed_s += runs["fixed_s"]
            result.fixed_identical_prompts += fixed == reference
            record.update(fixed_s=runs["fixed_s"], fixed_tau=fixed_stats.tau,
                          speedup_vs_fixed=record["medusa_tokens_per_s"] / (len(fixed) / runs["fixed_s"]))
        record.update({k: prompts[i][k] for k in ("id", "category") if k in prompts[i]})
        if hf_prompt_lookup:
            result.hf_lookup_tokens += len(runs["hf_lookup"][0])
            result.hf_lookup_s += runs["hf_lookup_s"]
            result.hf_lookup_identical_prompts += runs["hf_lookup"][0] == reference
            record["hf_prompt_lookup_s"] = runs["hf_lookup_s"]
        if tokens != reference:
            result.divergences.append(divergence(base, ids.to(base.device), tokens, reference, i))
            record["diverged_at"] = result.divergences[-1]["position"]
        result.per_prompt.append(record)
        if progress is not None:
            progress(i, record)
    out = result.to_dict(drafting_depth(model))
    out.update(environment(model, max_new_tokens))
    out["engine"]["compile_s_before_timing"] = compile_s  # any other compile_s entry happened inside a timing
    out["prediction"] = predict(model, out)
    return out


def _add_prompt(result: BenchResult, runs: dict, reference, tokens, stats, plain, plain_stats) -> None:
    """Account one prompt's three runs (HF, Medusa, plain through the same engine) in ``result``."""
    result.prompts += 1
    result.baseline_tokens += len(reference)
    result.baseline_s += runs["hf_s"]
    result.medusa_tokens += len(tokens)
    result.medusa_s += runs["medusa_s"]
    result.decode_steps += stats.decode_steps
    result.decode_tokens += stats.decode_tokens
    result.copied_tokens += stats.copied_tokens
    result.medusa_decode_s += stats.decode_s
    for part, seconds in stats.step_s.items():
        result.step_s[part] += seconds
    for a in stats.accepted_per_step:
        result.accepted_hist[a] += 1
    for n in stats.tree_nodes:
        result.tree_nodes[n] = result.tree_nodes.get(n, 0) + 1
    result.plain_tokens += len(plain)
    result.plain_s += runs["plain_s"]
    result.plain_decode_s += plain_stats.decode_s
    result.plain_decode_steps += plain_stats.decode_steps
    result.identical_prompts += tokens == reference
    result.plain_identical_prompts += plain == reference
    result.identical_to_plain_prompts += tokens == plain


def warm_up_engine(model: MedusaModel, encoded: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Compile the engine's steps (plain and tree) for every cache size the prompts need, before any timing;
    returns the compile seconds (empty for an engine that does not compile)."""
    nodes = model.drafter.max_nodes
    sizes = {1, nodes}
    if model.per_step:  # a per-step tree takes the sizes of its buckets (fixed-shape engines), or any size
        sizes |= {b for b in model.drafter.cost.buckets or () if b <= nodes}
    compile_s: dict = {}
    # Plain decoding (one node) and the tree can need caches of different capacities: warm both.
    for needed in sorted({len(ids) + max_new_tokens + n for ids in encoded for n in (1, nodes)}):
        compile_s = model.engine.warm_up(sorted(sizes), needed)
    return dict(compile_s)


def predict(model: MedusaModel, result: dict) -> dict:
    """:func:`chain_prediction` for a bench result, with the step cost read from this machine's profile (a verify
    forward over the tree's nodes after :data:`medusa.profile.PREFIX_LEN` cached tokens, relative to one token,
    through the bench's engine): the seed's analysis next to the measured figures."""
    from medusa.tools.measure import ensure_profile, stderr_progress, time_forwards

    name, nodes = model.engine.profile_name, model.drafter.max_nodes
    if model.per_step and result.get("tree_sizes", {}).get("mean"):
        nodes = max(1, round(result["tree_sizes"]["mean"]))
    profile = ensure_profile(model.base, announce=stderr_progress)
    if "forward_s" in profile.engines.get(name, {}):
        one, verify_s = profile.forward_s(name, 1), profile.forward_s(name, nodes)
    else:  # not in the profile (compiled: each size compiles): the two sizes this bench ran, on its own engine
        times = time_forwards(model.engine, model.base, sizes=(1, nodes))
        one, verify_s = times[1], times[nodes]
    out = {**chain_prediction(result["accepted_histogram"], verify_s / one), "step_cost": verify_s / one}
    if model.draft_model is not None:  # a draft model: its K forwards a step add K c_q / c_p
        out.update(draft_prediction(model, out["alpha"], one, verify_s, profile))
    return out


def draft_prediction(model: MedusaModel, alpha: float, base_one_s: float, verify_s: float, profile) -> dict:
    """The seed's analysis for a draft-model run: a step costs one verify forward over the tree plus the draft's
    forwards (the catch-up over the tokens emitted since the last step, about tau of them, then one per deeper
    level over that level's parents), each from the machine profile's single-forward timings of the base and of
    this kind of draft (:func:`medusa.tools.measure.draft_forward_costs`), never from the run's step times.

    Returns:
        ``{"cost_ratio", "draft_forward_s", "step_cost", "predicted_tau", "predicted_speedup"}``: ``cost_ratio`` is
        c_q / c_p (one draft token against one base token), ``step_cost`` relative to one plain base step.
    """
    from medusa.profile import interpolate
    from medusa.tools.measure import draft_forward_costs

    paths = set(model.tree.paths)
    depth = max(len(p) for p in paths)
    tau = expected_tokens(alpha, depth)
    parents = [sum(1 for p in paths if len(p) == d and any(q[:d] == p for q in paths if len(q) == d + 1))
               for d in range(1, depth)]  # the parents each deeper level's forward feeds
    times = draft_forward_costs(profile, model.draft_model)  # {n: s}
    draft_s = interpolate(times, max(1, round(tau))) + sum(interpolate(times, p) for p in parents)
    cost = (verify_s + draft_s) / base_one_s
    return {"cost_ratio": times[1] / base_one_s, "draft_forward_s": times, "step_cost": cost,
            "predicted_tau": tau, "predicted_speedup": tau / cost}


def load_average() -> tuple[float, float, float] | None:
    """The machine's 1, 5 and 15 minute load averages (``os.getloadavg``), or ``None`` where there are none."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


# Load (runnable processes) tolerated on top of the cores the threads need: the 1-minute average lags, and a job that
# just ended or this process's own start-up leaves a few tenths in it.
LOAD_SLACK = 0.45


def running_elsewhere(samples: int = 5, interval_s: float = 0.05) -> int | None:
    """Tasks running on the CPUs right now besides this one (``procs_running`` of ``/proc/stat``, the fewest over
    ``samples`` readings, this reader taken off), or ``None`` where there is no ``/proc/stat``."""
    counts = []
    for i in range(samples):
        try:
            text = Path("/proc/stat").read_text()
        except OSError:
            return None
        line = next((x for x in text.splitlines() if x.startswith("procs_running")), None)
        if line is None:
            return None
        counts.append(int(line.split()[1]) - 1)
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(min(counts), 0)


def machine_load(threads: int, loadavg=None, cores: int | None = None, running=None) -> dict:
    """The machine's load next to the threads in use, and a warning when they do not fit.

    The 1-minute load average counts runnable processes; what is left of the cores for this process is roughly
    ``cores - load``. When that is below ``threads``, torch's threads wait on each other and on the other work, and
    timings (and a speedup measured from them) say little: one busy process next to them can cut the throughput of
    as many threads as cores by an order of magnitude, where one thread fewer loses far less. The average lags by
    about a minute, so a job that has just ended (the step before, in a script) still shows in it: the warning is
    given only when tasks are also running elsewhere right now (:func:`running_elsewhere`), where that can be read.

    Args:
        threads: torch CPU threads in use.
        loadavg: callable returning ``(1min, 5min, 15min)`` or ``None``; :func:`load_average` when ``None``
            (tests pass a fake one).
        cores: usable cores; :func:`medusa.profile.usable_cores` when ``None``.
        running: callable returning the tasks running elsewhere now, or ``None`` when unknown;
            :func:`running_elsewhere` when ``None``.

    Returns:
        ``{"load_1min", "load_5min", "load_15min", "running_elsewhere", "cores", "threads", "warning"}``; loads
        are ``None`` and ``warning`` is ``None`` when the platform has no load average.
    """
    from medusa.profile import usable_cores

    loads = (loadavg or load_average)()
    cores = cores or usable_cores()
    out = {"load_1min": None, "load_5min": None, "load_15min": None, "running_elsewhere": None, "cores": cores,
           "threads": threads, "warning": None}
    if loads is None:
        return out
    out.update(load_1min=round(loads[0], 2), load_5min=round(loads[1], 2), load_15min=round(loads[2], 2))
    free = cores - loads[0]
    if threads > free + LOAD_SLACK:
        now = (running or running_elsewhere)()
        out["running_elsewhere"] = now
        if now is not None and threads <= cores - now:
            return out  # the average still holds a job that has ended: nothing competes now
        fewer = max(int(free), 1)
        advice = f" or pass --threads {fewer}" if fewer < threads else ""
        plural = "s" if threads != 1 else ""
        busy_now = "" if now is None else f" ({now} task{'s' if now != 1 else ''} running elsewhere now)"
        out["warning"] = (f"load average {loads[0]:.1f} on {cores} cores leaves about {max(free, 0):.1f} free for "
                          f"{threads} torch thread{plural}{busy_now}: timings are unreliable. Wait until the machine "
                          f"is idle{advice}.")
    return out


def _run_bench_sampling(model: MedusaModel, encoded: list[torch.Tensor], max_new_tokens: int, warmup: int, progress,
                        sampling: dict, seed: int, hf_settings: dict) -> dict:
    """:func:`run_bench` when sampling: tau, speedup and the base's mean log-probability of each method's tokens."""
    base, stop = model.base, model.stop_token_ids()
    for ids in encoded[:warmup]:
        hf_sample(base, ids, 8, stop, seed, **hf_settings)
        model.generate(ids, max_new_tokens=8, seed=seed, **sampling)
    result = BenchResult(accepted_hist=[0] * (model.drafter.max_depth + 1))
    logprob = {"hf": [], "medusa": []}  # per prompt: (sum, tokens)
    for i, ids in enumerate(encoded):
        runs = {}
        for method in (("hf", "medusa") if i % 2 == 0 else ("medusa", "hf")):
            start = time.perf_counter()
            if method == "hf":
                runs["hf"] = hf_sample(base, ids, max_new_tokens, stop, seed + i, **hf_settings)
            else:
                runs["medusa"], stats = model.generate(ids, max_new_tokens, stop_token_ids=stop, seed=seed + i,
                                                       **sampling)
            runs[method + "_s"] = time.perf_counter() - start
        result.prompts += 1
        result.baseline_tokens += len(runs["hf"])
        result.baseline_s += runs["hf_s"]
        result.medusa_tokens += len(runs["medusa"])
        result.medusa_s += runs["medusa_s"]
        result.decode_steps += stats.decode_steps
        result.decode_tokens += stats.decode_tokens
        for a in stats.accepted_per_step:
            result.accepted_hist[a] += 1
        for method in logprob:
            logprob[method].append((sum_logprob(base, ids.to(base.device), runs[method]), len(runs[method])))
        record = {"prompt": i, "tokens": len(runs["medusa"]), "tau": stats.tau, "hf_s": runs["hf_s"],
                  "medusa_s": runs["medusa_s"], "speedup_vs_hf": (len(runs["medusa"]) / runs["medusa_s"])
                  / (len(runs["hf"]) / runs["hf_s"]) if runs["hf"] and runs["medusa"] else None}
        result.per_prompt.append(record)
        if progress is not None:
            progress(i, record)
    out = result.to_dict(drafting_depth(model))
    out["identical"] = "not applicable (sampling)"
    for method, per_prompt in logprob.items():
        out[f"{method}_mean_logprob"] = sum(s for s, _ in per_prompt) / max(sum(n for _, n in per_prompt), 1)
        means = torch.tensor([s / n for s, n in per_prompt if n], dtype=torch.float64)
        out[f"{method}_mean_logprob_stderr"] = float(means.std() / len(means) ** 0.5) if len(means) > 1 else None
    out["sampling"] = {**hf_settings, "seed": seed, "acceptance": sampling.get("acceptance", "rejection")}
    out.update(environment(model, max_new_tokens))
    out["prediction"] = predict(model, out)
    return out


def drafting_depth(model: MedusaModel) -> int:
    """The depths a bench reports acceptance for: the heads' (or the draft model's) count, else the drafter's
    deepest node (prompt lookup, a registered drafter)."""
    network = model.drafts_from
    return network.config.num_heads if network is not None else model.drafter.max_depth


def drafting_settings(model: MedusaModel) -> dict:
    """What drafts, for a bench result: the heads' (or draft model's) type, count and vocabulary, and the draft
    model's own settings (:attr:`medusa.model.MedusaModel.draft_model`); a drafter without either, its name."""
    network = model.drafts_from
    if network is None:
        return {"head_type": None, "num_heads": 0, "head_vocab_size": None}
    out = {"head_type": network.config.head_type, "num_heads": network.config.num_heads,
           "head_vocab_size": network.head_vocab_size}
    if model.draft_model is not None:
        out["draft"] = model.draft_model.settings()
    return out


def environment(model: MedusaModel, max_new_tokens: int) -> dict:
    """Settings and versions recorded next to the figures: the machine (CPU model and flags), the profile key and
    file this machine's choices are read from, and the engine (with ``auto``'s choice and reason, when it chose)."""
    import transformers

    from medusa.profile import cpu_info, profile_key, profile_path

    key = profile_key(model.base)

    return {
        "max_new_tokens": max_new_tokens,
        "tree": "per-step" if model.per_step else model.tree.name,
        "tree_nodes": model.drafter.max_nodes,
        "drafter": model.drafter.settings() if model.per_step else {"drafter": model.drafter.name},
        "verify_logits": "all" if model.engine.scores_all_nodes else "path",
        "engine": model.engine.settings(),
        **drafting_settings(model),
        "dtype": str(model.base.dtype),
        "dtype_reason": model.dtype_reason,
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpu": cpu_info(),
        "profile": {"path": str(profile_path(key)), "key": key},
    }


BATCH_METHODS = ("plain", "medusa", "hf")


def run_batch_bench(model: MedusaModel, prompts: list[dict], max_new_tokens: int, batch_sizes=(1, 4, 16),
                    use_chat_template: bool = True, methods=BATCH_METHODS, progress=None) -> dict:
    """Tokens/s of batched decoding at each batch size: plain greedy (a tree of one node), Medusa (``model.drafter``:
    the per-step tree, or the fixed tree) and Hugging Face ``generate`` with left padding, all greedy, in one
    process.

    At batch size B the prompts are decoded in consecutive groups of B (the last group may be smaller), so every
    batch size decodes the same prompts; a batch size above the number of prompts uses them all (noted in
    ``notes``). Methods alternate their order across batch sizes. Each method's tokens are compared, prompt by
    prompt, with plain decoding at the smallest batch size (``identical``: prompts whose tokens are the same).

    Returns:
        ``{"batch_sizes", "results": {B: {method: {tokens, seconds, tokens_per_s, identical, ...}}}, "notes", ...}``.
    """
    from medusa.decode.batch import BatchStats

    stop = model.stop_token_ids()
    pad = next(iter(sorted(stop)), 0)
    encoded = [encode_prompt(model.tokenizer, p, use_chat_template).to(model.device) for p in prompts]
    notes = []
    sizes = []
    for size in batch_sizes:
        if size > len(encoded):
            notes.append(f"batch size {size} is larger than the {len(encoded)} prompts given: used {len(encoded)}")
        sizes.append(min(size, len(encoded)))
    for method in methods:  # warm-up, untimed
        _decode_batch(model, method, encoded[:2], 4, stop, pad, BatchStats())
    results, reference = {}, None
    for n, size in enumerate(sizes):
        results[size] = {}
        for method in (methods if n % 2 == 0 else tuple(reversed(methods))):
            stats, outputs = BatchStats(), []
            start = time.perf_counter()
            for first in range(0, len(encoded), size):
                group = encoded[first : first + size]
                outputs += _decode_batch(model, method, group, max_new_tokens, stop, pad, stats)
            seconds = time.perf_counter() - start
            tokens = sum(len(o) for o in outputs)
            record = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "outputs": outputs}
            if method != "hf":
                steps = sum(s.decode_steps for s in stats.rows)
                record["tau"] = sum(s.decode_tokens for s in stats.rows) / max(steps, 1)
                record["batched_forwards"] = stats.forwards
            results[size][method] = record
            if progress is not None:
                progress(size, method, record)
        if reference is None:
            reference = results[size].get("plain", next(iter(results[size].values())))["outputs"]
    for by_method in results.values():
        for record in by_method.values():
            record["identical"] = sum(a == b for a, b in zip(record.pop("outputs"), reference, strict=True))
    return {"batch_sizes": sizes, "requested_batch_sizes": list(batch_sizes), "prompts": len(encoded),
            "results": {str(k): v for k, v in results.items()}, "notes": notes, **environment(model, max_new_tokens)}


def _decode_batch(model: MedusaModel, method: str, group: list[torch.Tensor], max_new_tokens: int, stop: set[int],
                  pad: int, stats) -> list[list[int]]:
    """One group of prompts decoded by ``method`` (see :func:`run_batch_bench`); Medusa/plain stats added to
    ``stats``."""
    if method == "hf":
        return hf_greedy_batch(model.base, group, max_new_tokens, stop, pad)
    outputs, run = model.generate_batch(group, max_new_tokens, tree=PLAIN if method == "plain" else None,
                                        stop_token_ids=stop)
    stats.rows += run.rows
    stats.forwards += run.forwards
    return outputs
