"""``MedusaModel``: a stock transformers causal LM plus Medusa heads, ready to decode self-speculatively."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from medusa.base import load_base, stop_token_ids
from medusa.decode.batch import BatchStats, batch_decode_steps
from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import GenerationStats, Step, decode_steps
from medusa.decode.tree import Tree, load_tree
from medusa.drafters.composite import tree_drafter
from medusa.drafters.heads import HydraHeads, MedusaHeads
from medusa.engines import AUTO, make_engine
from medusa.io.adapter import check_adapter_folder, merge_adapter
from medusa.io.checkpoint import check_heads_folder, load_heads_for_base

logger = logging.getLogger(__name__)

TREE_FILE_NAME = "tree.json"
CALIBRATION_NOTE = ("the heads folder has no calibration.json, so every step uses one fixed tree; `medusa calibrate "
                    "--base BASE --heads DIR --data VALIDATION.jsonl` measures one and turns on the per-step tree")


def _default_engine() -> str:
    """The engine name ``None`` means now (read when called: the test suite pins it)."""
    from medusa.engines import base

    return base.DEFAULT_ENGINE


class MedusaModel(nn.Module):
    """A base causal LM (frozen, stock transformers) with Medusa heads on its last hidden state.

    Args:
        base: a transformers ``*ForCausalLM``.
        heads: heads trained for this base (same device and dtype as the base after construction); ``None`` for a
            model that drafts without heads (a draft model, prompt lookup, a registered drafter).
        tree: default candidate tree; ``None`` means the top-1 chain over all heads (over the draft model's depth;
            no node without either).
        tokenizer: optional, used for stop tokens and by the CLI.
        engine: the decode engine's name (:func:`medusa.engines.make_engine`; ``engine_options`` go to it).
        drafter: what proposes each step's tree (:mod:`medusa.drafters`); ``None``: the heads (or the draft model)
            on ``tree`` (with its prompt-lookup chain), :func:`medusa.drafters.tree_drafter`.
        draft_model: a separate draft model (:class:`medusa.drafters.draft_model.DraftModelHeads`) drafting the
            tree's nodes instead of heads (:meth:`from_draft_model`).

    Raises:
        ValueError: both ``heads`` and ``draft_model`` given.
    """

    def __init__(self, base, heads: MedusaHeads | HydraHeads | None, tree: Tree | None = None, tokenizer=None,
                 engine: str | None = None, drafter=None, draft_model=None, **engine_options):
        super().__init__()
        if heads is not None and draft_model is not None:
            raise ValueError("a model drafts with heads or with a draft model, not both")
        dtype = base.get_output_embeddings().weight.dtype
        self.base = base
        self.heads = heads.to(device=base.device, dtype=dtype) if heads is not None else None
        self.draft_model = draft_model.to(device=base.device, dtype=dtype) if draft_model is not None else None
        """The separate draft model the drafter drafts with (:mod:`medusa.drafters.draft_model`), or ``None``."""
        self.tokenizer = tokenizer
        network = self.drafts_from
        # Also makes self.drafter: the heads (or draft model) on this tree.
        self.tree = tree or Tree.chain(network.config.num_heads if network is not None else 0)
        if drafter is not None:
            self.drafter = drafter
        self.dtype_reason: str | None = None
        """Why this dtype, when ``--dtype auto`` chose it (:func:`medusa.tools.measure.choose_dtype`)."""
        self.use_engine(engine, **engine_options)

    def use_engine(self, name: str | None = None, step_size: int | None = None, measure: bool = False,
                   **options) -> None:
        """Decode through the engine ``name`` (:func:`medusa.engines.make_engine`; ``options`` go to it, e.g.
        ``scores_all_nodes=``; ``None``: the default, ``"auto"``: chosen from this machine's stored profile for steps
        of this model's tree, or the static default, said in one log line, where none is stored).

        ``measure`` with ``auto``: measure the profile first when none is stored, announced with its duration (about
        30 s, :func:`medusa.tools.measure.ensure_profile`); nothing is measured otherwise. The engine declares whether
        one lm_head product over all tree nodes or one row at a time along the accepted path is cheaper
        (:attr:`medusa.engines.Engine.scores_all_nodes`); both accept the same tokens.
        """
        self.engine = None  # the previous engine (and the packed copy it owns) is freed first
        step_size = step_size or getattr(self.drafter, "typical_nodes", self.drafter.max_nodes)
        if measure and (name or _default_engine()) == AUTO:
            from medusa.profile import FALLBACK_ENGINE, EngineChoice
            from medusa.tools.measure import ensure_profile, stderr_progress

            try:
                options["profile"] = ensure_profile(self.base, announce=stderr_progress)
            except Exception as e:  # noqa: BLE001 - a failure to measure falls back, and says why
                reason = f"{FALLBACK_ENGINE}: measuring this machine failed ({type(e).__name__}: {e})"
                logger.warning("--engine auto: %s", reason)
                self.engine = make_engine(FALLBACK_ENGINE, self.base, step_size=step_size, **options)
                self.engine.choice = EngineChoice(FALLBACK_ENGINE, reason, step_size)
                self._pack_drafter()
                return
        self.engine = make_engine(name, self.base, step_size=step_size, **options)
        self._pack_drafter()

    def _pack_drafter(self) -> None:
        """The heads draft through the products the engine offers them (:meth:`medusa.engines.Engine.drafter_product`:
        packed projections beside an engine that packs its own products, Q8_0 products beside the native decoder)."""
        if self.heads is not None and hasattr(self.heads, "drafter_products"):
            self.heads.drafter_products = self.engine.drafter_product
            self.heads.drafter_products_key = self.engine.drafter_products_key
            self.heads.__dict__.pop("_products", None)  # made by the previous engine
            self.heads.__dict__.pop("_fused_levels", None)  # its fused levels too (they hold its products)

    def use_per_step_tree(self, calibration, profile=None, measure: bool = False, **options) -> None:
        """Decode with a tree grown each step from the heads' calibrated confidence and this machine's measured
        cost (:class:`medusa.drafters.per_step.PerStepDrafter`), through the current engine.

        Args:
            calibration: a :class:`medusa.drafters.calibration.Calibration`, or a heads folder holding
                ``calibration.json`` (its weights digest is then checked too).
            profile: this machine's :class:`medusa.profile.MachineProfile` (default: the stored one); the engine's
                forward costs and the heads' drafting cost are read from it. Figures it lacks are measured into it
                with ``measure``, else stand-in costs are used and said in one log line
                (:meth:`medusa.drafters.per_step.StepCost.from_profile`).
            measure: measure what the profile lacks (the profile itself, this engine, the heads' cost).
            options: :class:`medusa.drafters.per_step.PerStepDrafter` options (``max_nodes``, ``lookup_length``...).

        Raises:
            FileNotFoundError, ValueError, medusa.drafters.calibration.CalibrationMismatchError: no calibration in the
                folder, a damaged one, or one for other heads.
        """
        from medusa.drafters.per_step import DEFAULT_BUCKETS, PerStepDrafter, StepCost
        from medusa.profile import stored_profile

        if isinstance(calibration, str | Path):
            from medusa.drafters.calibration import (
                CALIBRATION_FILE_NAME,
                check_calibration,
                heads_identity,
                load_calibration,
            )
            from medusa.io.checkpoint import HEADS_WEIGHTS_NAME

            folder = Path(calibration)
            calibration = load_calibration(folder / CALIBRATION_FILE_NAME)
            check_calibration(calibration, heads_identity(self.heads, folder / HEADS_WEIGHTS_NAME),
                              f"calibration file {folder / CALIBRATION_FILE_NAME}")
        why = "given"
        level_s = None
        if measure:
            from medusa.tools.measure import ensure_engine, ensure_profile, heads_level_s, stderr_progress

            profile = profile if profile is not None else ensure_profile(self.base, announce=stderr_progress)
            profile = ensure_engine(profile, self.base, self.engine, stderr_progress)
            self._choose_drafter_dtype(profile, measure=True)
            level_s = heads_level_s(profile, self.heads)
        else:
            if profile is None:
                profile, why = stored_profile(self.base)
            self._choose_drafter_dtype(profile, measure=False)
        # The sizes a tree settles on: the engine's buckets, else the sizes the profile measured (a forward's cost
        # jumps between sizes, by kernel choice, more than interpolation shows), unless its cost grows smoothly.
        buckets = self.engine.step_buckets or (DEFAULT_BUCKETS if self.engine.fixed_shapes else
                                               None if self.engine.smooth_step_cost else "measured")
        cost = StepCost.from_profile(profile, self.engine.profile_name, self.heads, buckets, level_s=level_s,
                                     why=why)
        self.drafter = PerStepDrafter(self.heads, calibration, cost, **options)

    def _choose_drafter_dtype(self, profile, measure: bool) -> None:
        """Set the engine's :attr:`medusa.engines.Engine.drafter_dtype` to the one of its
        :attr:`~medusa.engines.Engine.drafter_dtypes` whose drafting (the heads' seconds per depth, summed) this
        machine's ``profile`` holds cheapest; each is measured into it first with ``measure``. Without every figure
        (nothing measured, no profile) the weights' own dtype stays: a choice made from measurements only. The
        figures are measured here (every decode command's build measures what its profile lacks); ``medusa profile
        --heads`` stores the weights' own dtype's only. Heads that run nothing through the engine's products (eagle,
        Medusa heads with lm_head copies of their own) keep their dtype. A later :meth:`use_engine` drafts through
        the new engine in its weights' dtype, with the per-step tree's costs as they were (stale, as its forward
        costs are: call :meth:`use_per_step_tree` again)."""
        options = getattr(self.engine, "drafter_dtypes", (None,))
        if self.heads is None or not hasattr(self.heads, "drafter_products"):
            return
        if not getattr(self.heads, "drafts_through_products", False):
            options = (None,)  # nothing of theirs would change: no dtype to choose, nothing to time twice
        if len(options) < 2:
            if self.engine.drafter_dtype != options[0]:
                self.engine.drafter_dtype = options[0]
                self._pack_drafter()
            return
        from medusa.profile import heads_key

        costs = {}
        for dtype in options:
            self.engine.drafter_dtype = dtype
            self._pack_drafter()
            if measure:
                from medusa.tools.measure import heads_level_s

                level_s = heads_level_s(profile, self.heads)
            else:
                level_s = None if profile is None else profile.drafter_cost(heads_key(self.heads))
            if level_s is not None:
                costs[dtype] = sum(level_s)
        self.engine.drafter_dtype = min(costs, key=costs.get) if len(costs) == len(options) else None
        self._pack_drafter()

    @property
    def per_step(self) -> bool:
        """Whether the model decodes with a per-step tree (:meth:`use_per_step_tree`)."""
        from medusa.drafters.per_step import PerStepDrafter

        return isinstance(self.drafter, PerStepDrafter)

    @classmethod
    def from_pretrained(cls, base: str | Path, heads: str | Path, tree: str | Path | Tree | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        attn_implementation: str | None = None, adapter: str | Path | None = None,
                        engine: str | None = None, per_step: bool | None = None, **engine_options) -> MedusaModel:
        """Load a base model and a heads folder (see :mod:`medusa.io.checkpoint`).

        ``adapter`` is a Medusa-2 LoRA folder (peft): it is merged into the base before decoding, so the drafts are
        verified against the adapted model the heads were trained with (:mod:`medusa.io.adapter`).

        Which tree each step verifies: ``tree`` (a tree file or :class:`Tree`) forces that fixed tree. Otherwise
        heads whose folder holds a ``calibration.json`` get the per-step tree (:meth:`use_per_step_tree`; ``per_step``
        ``False`` turns it off); heads without one use ``tree.json`` from the folder if present, else the top-1 chain
        (logged, with how to calibrate).

        Raises:
            FileNotFoundError: a folder or file is missing.
            medusa.io.checkpoint.HeadsMismatchError: the heads were trained for another base.
            ValueError: the tree does not fit the heads, ``per_step=True`` with a ``tree``, or ``per_step=True`` and
                no calibration in the folder.
            medusa.drafters.calibration.CalibrationMismatchError: the folder's calibration is for other heads.
        """
        from medusa.drafters.calibration import CALIBRATION_FILE_NAME

        # Fail on a bad heads folder or tree file before spending time loading the base.
        config = check_heads_folder(heads)
        calibrated = (Path(heads) / CALIBRATION_FILE_NAME).is_file()
        if per_step and tree is not None:
            raise ValueError("a tree forces one fixed tree every step, and per_step=True asks for a per-step tree: "
                             "pass one of them")
        if per_step and not calibrated:
            raise ValueError(f"per_step=True needs {Path(heads) / CALIBRATION_FILE_NAME}: {CALIBRATION_NOTE}")
        per_step = (calibrated and tree is None) if per_step is None else per_step
        if per_step:  # a damaged calibration, or one for other heads, is refused before the base loads
            from medusa.drafters.calibration import check_calibration, folder_identity, load_calibration

            path = Path(heads) / CALIBRATION_FILE_NAME
            check_calibration(load_calibration(path), folder_identity(heads, config), f"calibration file {path}")
        given = tree
        if tree is None and not per_step and (Path(heads) / TREE_FILE_NAME).is_file():
            tree = Path(heads) / TREE_FILE_NAME  # the per-step tree never reads it: a stale one cannot block it
        if tree is not None and not isinstance(tree, Tree):
            tree = load_tree(tree)
        if tree is None and not per_step:
            logger.info("no tree given and none in %s: using the top-1 chain%s", heads,
                        "" if calibrated else f"; {CALIBRATION_NOTE}")
        elif given is None and not per_step and not calibrated:
            logger.info("%s", CALIBRATION_NOTE)
        if tree is not None:
            tree.check_fits(config.num_heads, config.head_vocab_size or config.vocab_size)
        if adapter is not None:
            check_adapter_folder(adapter)
        model, tokenizer = load_base(base, dtype, device, attn_implementation)
        if adapter is not None:
            model = merge_adapter(model, adapter).eval()
        loaded = load_heads_for_base(heads, model)
        out = cls(model, loaded, tree, tokenizer, engine, **engine_options)
        if per_step:
            out.use_per_step_tree(heads)
        return out

    @classmethod
    def from_draft_model(cls, base: str | Path, draft: str | Path, draft_tokens: int = 4, draft_width: int = 1,
                         lookup: int = 0, lookup_ngram: int = 3, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", engine: str | None = None,
                         draft_engine: str | None = "eager", draft_quantize: str | None = None,
                         **engine_options) -> MedusaModel:
        """Classic speculative decoding: a base and a separate draft model folder sharing its tokenizer
        (:mod:`medusa.drafters.draft_model`), the draft filling a chain of ``draft_tokens`` (``draft_width`` 1) or
        the full top-``draft_width`` tree of that depth, optionally beside a prompt-lookup chain of ``lookup``
        tokens. Greedy: exactly the base's tokens; rejection sampling: exactly its distribution.

        ``draft_engine`` is the draft's own engine (:func:`medusa.engines.make_engine`), ``engine`` the base's;
        ``draft_quantize="int8"`` quantizes the draft's decoder layers (:func:`medusa.drafters.draft_model.
        quantize_draft`: the base's own folder as the draft is then a quantized copy of the target).

        Raises:
            FileNotFoundError: a folder is missing.
            ValueError: the draft's vocabulary differs from the base's (the first differing id named),
                ``draft_tokens`` or ``draft_width`` below 1, ``lookup`` below 0, or a quantization that cannot run
                on this device and dtype.
        """
        from medusa.drafters.draft_model import check_quantize, draft_tree_shape, load_draft_model

        tree = draft_tree_shape(draft_tokens, draft_width)  # bad counts are refused before anything loads
        if not isinstance(lookup, int) or lookup < 0:
            raise ValueError(f"lookup must be an int >= 0, got {lookup!r}")
        if lookup:
            tree = tree.with_lookup(lookup, lookup_ngram)
        check_quantize(draft_quantize, torch.device(device), dtype)  # before the models load
        model, tokenizer = load_base(base, dtype, device)
        drafting = load_draft_model(draft, model, tokenizer, draft_tokens, draft_engine, quantize=draft_quantize)
        return cls(model, None, tree, tokenizer, engine, draft_model=drafting, **engine_options)

    @property
    def tree(self) -> Tree:
        """The tree the heads draft on. Setting it (``model.tree = tree.with_lookup(0)``) checks it fits the heads
        and makes the model's drafter the heads on that tree (:func:`medusa.drafters.tree_drafter`), replacing a
        drafter given at construction; the engine stays (``use_engine`` to choose again for the new step size)."""
        return self._tree

    @tree.setter
    def tree(self, tree: Tree) -> None:
        network = self.drafts_from
        if network is not None:
            tree.check_fits(network.config.num_heads, network.head_vocab_size)
        self._tree = tree
        self.drafter = tree_drafter(network, tree)

    @property
    def drafts_from(self):
        """What a tree's nodes are drafted with: the heads, the draft model (:attr:`draft_model`), or ``None``."""
        return self.heads if self.heads is not None else self.draft_model

    @property
    def device(self) -> torch.device:
        return self.base.device

    def stop_token_ids(self) -> set[int]:
        """EOS ids from the generation config (and tokenizer), as a set."""
        return stop_token_ids(self.base.generation_config, self.tokenizer)

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int = 128, tree: Tree | None = None,
               stop_token_ids: set[int] | None = None, stats: GenerationStats | None = None,
               do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, acceptance: str = "rejection",
               typical_epsilon: float = 0.3, typical_delta: float = 0.09, **settings) -> Iterator[Step]:
        """Yield :class:`~medusa.decode.loop.Step` s as tokens are accepted. ``input_ids``: ``(T,)`` or ``(1, T)``.

        Decoding settings as in :meth:`generate`; ``tree`` decodes this call with the heads on that tree instead of
        the model's drafter (a drafter given at construction included).
        """
        ids = _as_1d(input_ids).to(self.device)
        stop = self.stop_token_ids() if stop_token_ids is None else stop_token_ids
        decoding = resolve_decoding(self.base.generation_config, do_sample, temperature, top_k, top_p, seed,
                                    acceptance, typical_epsilon, typical_delta, **settings)
        drafter = self.drafter if tree is None else tree_drafter(self.heads, tree)
        return decode_steps(self.base, drafter, ids, max_new_tokens, stop, stats, decoding, self.engine)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 128, tree: Tree | None = None,
                 stop_token_ids: set[int] | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, acceptance: str = "rejection", typical_epsilon: float = 0.3,
                 typical_delta: float = 0.09, **settings) -> tuple[list[int], GenerationStats]:
        """Medusa decoding; returns ``(new_token_ids, stats)``.

        Settings left ``None`` come from the base's ``generation_config`` (then Hugging Face's defaults, as
        ``generate`` takes them); further generation-config fields (``repetition_penalty=...``) go in ``settings``.
        Greedy (``do_sample`` false): exactly the base's greedy tokens under those settings. Sampling with
        ``acceptance="rejection"``: lossless, distributed exactly as the base's samples
        (:mod:`medusa.decode.acceptance`); ``"typical"``: Medusa's typical acceptance, faster and lossy
        (``typical_epsilon``, ``typical_delta``). The same ``seed`` gives the same tokens.

        Raises:
            ValueError: bad settings, or one the base's generation config sets that Medusa cannot honour
                (:func:`medusa.decode.logits_process.resolve_decoding`).
        """
        stats = GenerationStats()
        steps = self.stream(input_ids, max_new_tokens, tree, stop_token_ids, stats, do_sample, temperature, top_k,
                            top_p, seed, acceptance, typical_epsilon, typical_delta, **settings)
        return [t for step in steps for t in step.tokens], stats

    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int = 128, tree: Tree | None = None,
                       stop_token_ids: set[int] | None = None, do_sample: bool | None = None,
                       temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                       seed: int | None = None, acceptance: str = "rejection", typical_epsilon: float = 0.3,
                       typical_delta: float = 0.09, **settings) -> tuple[list[list[int]], BatchStats]:
        """Batched Medusa decoding of several prompts ``(T_b,)`` of any lengths, one verify forward per step for all
        of them (:mod:`medusa.decode.batch`); returns ``(new_token_ids per prompt, stats)``.

        Decoding settings as in :meth:`generate`, for every prompt; each prompt decodes as :meth:`generate` decodes
        it alone: greedy, exactly the same tokens; sampling, its own random generator (seeded with ``seed``) and
        acceptance rule. ``tree=Tree.chain(0)`` is plain batched decoding.

        Raises:
            ValueError: an empty prompt (named), a prompt that does not fit the context, or bad settings
                (:func:`medusa.decode.logits_process.resolve_decoding`).
        """
        decoding = resolve_decoding(self.base.generation_config, do_sample, temperature, top_k, top_p, seed,
                                    acceptance, typical_epsilon, typical_delta, **settings)
        stop = self.stop_token_ids() if stop_token_ids is None else stop_token_ids
        ids = [_as_1d(p).to(self.device) for p in prompts]
        drafter = self.drafter if tree is None else tree_drafter(self.heads, tree)
        stats = BatchStats()
        out: list[list[int]] = [[] for _ in ids]
        for step in batch_decode_steps(self.base, drafter, ids, max_new_tokens, stop, stats, engine=self.engine,
                                       decoding=decoding):
            for i, s in step:
                out[i].extend(s.tokens)
        return out, stats


def _as_1d(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.ndim == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"generate() decodes one sequence; got batch size {input_ids.shape[0]} (several prompts: "
                             "generate_batch())")
        return input_ids[0]
    if input_ids.ndim != 1:
        raise ValueError(f"input_ids must be (T,) or (1, T), got shape {tuple(input_ids.shape)}")
    return input_ids
