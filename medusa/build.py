"""One model builder for every decoding command and the server: :class:`DecodeConfig` names what decodes (base,
drafter, tree, engine, dtype), :func:`build_model` assembles it into a :class:`medusa.model.MedusaModel`.

The drafter is chosen by its registered name (:func:`medusa.drafters.drafter_class`): ``heads`` (Medusa, Hydra or
eagle heads on a fixed tree, or the per-step tree when their folder is calibrated), ``per-step`` (the heads on the
per-step tree), ``draft_model`` (a separate draft model), ``lookup`` (prompt lookup alone), ``none`` (plain decoding),
or any class registered with :func:`medusa.drafters.register_drafter` that builds itself from the configuration
(a classmethod ``from_decode_config(config, base) -> drafter``). Left unset, the name follows from the folders given:
``draft_model`` with a draft model, else ``heads``.

What the builder says as it chooses (``--dtype auto``'s and ``--engine auto``'s reasons, the per-step tree, the draft
model) goes to ``report``, one line each: the CLI passes a printer to stderr, a library caller may pass ``None``.

Reading order: :class:`DecodeConfig` -> :func:`build_model` -> :func:`_build_heads` / :func:`_build_draft_model` /
:func:`_build_registered`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
"""The dtype names the commands take (``auto`` besides, for heads), to torch's."""

PER_STEP_MODES = ("auto", "on", "off")
VERIFY_LOGITS = {"auto": None, "all": True, "path": False}
"""``verify_logits`` to the engine's ``scores_all_nodes`` (``None``: the engine's own choice)."""
QUANTIZE = ("none", "int4", "int8")
QUANTIZED_LM_HEADS = ("fp32", "bf16", "int4", "gguf")
"""``--quantized-lm-head``: the quantized engines' lm_head (:data:`medusa.engines.quantized.LM_HEADS`)."""
"""``--quantize``: ``none``, or the weight-only quantized engine of that name (:mod:`medusa.engines.quantized`)."""
INT4_KERNELS = ("torch", "native", "native-q8")
"""``--int4-kernel``: who runs one sequence's forwards on the int4 engine
(:data:`medusa.engines.quantized.KERNELS`)."""
QUANTIZED_DRAFT_ENGINES = ("eager", "static")
BUILT_IN_DRAFTERS = ("heads", "per-step", "draft_model", "lookup", "none")
"""The drafter names :func:`build_model` assembles itself; any other registered name builds itself."""

Report = Callable[[str], None] | None


def registered_drafter(name: str) -> type:
    """The drafter class registered as ``name``, the built-in ones all registered first (the draft model's module
    is not imported with :mod:`medusa.drafters`).

    Raises:
        ValueError: no drafter of that name (the known ones are named).
    """
    import medusa.drafters.draft_model  # noqa: F401  (registers draft_model)
    from medusa.drafters import drafter_class

    return drafter_class(name)


def drafter_names() -> tuple[str, ...]:
    """The registered drafter names :func:`build_model` can build, sorted: the built-in ones
    (:data:`BUILT_IN_DRAFTERS`) and those with a ``from_decode_config`` (``composite`` is made from the others, by
    ``--heads`` with ``--lookup``)."""
    import medusa.drafters.draft_model  # noqa: F401  (registers draft_model)
    from medusa.drafters import drafter_class
    from medusa.drafters import drafter_names as names

    return tuple(n for n in names() if n in BUILT_IN_DRAFTERS or getattr(drafter_class(n), "from_decode_config", None))


@dataclass
class DecodeConfig:
    """What a decoding command decodes with. Each field is the flag of the same name (``--max-tree-nodes`` is
    ``max_tree_nodes``); bad values are refused on construction, by the flag's name, before anything loads.

    Raises:
        ValueError: a value out of range, an unknown choice, or flags that contradict each other (named).
    """

    base: str
    """Base model folder (or hub id)."""
    heads: str | None = None
    """Medusa, Hydra or eagle heads folder (the ``heads`` and ``per-step`` drafters)."""
    drafter: str | None = None
    """The drafter's registered name; ``None``: ``draft_model`` when :attr:`draft_model` is given, else ``heads``."""
    tree: str | None = None
    """Tree file: one fixed tree every step (``None``: the per-step tree when the heads are calibrated, else the
    folder's ``tree.json``, else the top-1 chain)."""
    per_step_tree: str = "auto"
    """``on``, ``off``, or ``auto``: the per-step tree when the heads folder holds ``calibration.json`` and no
    :attr:`tree` is given."""
    max_tree_nodes: int | None = None
    """Per-step tree: the most nodes a step's tree may have, root included (``None``: the drafter's default)."""
    lookup: int | None = None
    """Prompt lookup: a chain of this many tokens copied from the context (``None``: the tree file's; 0: none)."""
    lookup_ngram: int | None = None
    """Longest context n-gram prompt lookup matches (``None``: the tree file's, else 3)."""
    adapter: str | None = None
    """Medusa-2 LoRA adapter folder (peft), merged into the base before decoding."""
    draft_model: str | None = None
    """A causal-LM folder sharing the base's tokenizer: the ``draft_model`` drafter."""
    draft_tokens: int = 4
    """Draft model: drafts per step, the tree's depth."""
    draft_width: int = 1
    """Draft model: 1, a chain of :attr:`draft_tokens` drafts; W > 1, the full top-W tree of that depth."""
    draft_engine: str | None = None
    """Draft model: its own engine (``None``: the base's, after ``auto`` chose it; eager for a quantized draft)."""
    draft_quantize: str | None = None
    """Draft model: ``int8`` quantizes its decoder layers (CPU, float32)."""
    dtype: str = "float32"
    """Weights and compute dtype, a key of :data:`DTYPES` or ``auto`` (measured, heads only)."""
    device: str | None = None
    """``cpu``, ``cuda``, ``cuda:1``... (``None``: cuda when available)."""
    threads: int | None = None
    """Torch CPU threads (``None``: torch's)."""
    engine: str | None = None
    """The base's engine name (:mod:`medusa.engines`; ``None``: the library default; ``auto``: from the profile)."""
    quantize: str = "none"
    """Weight-only quantized linear layers: ``int4`` (group 32) or ``int8`` (per channel) run the engine of that
    name (:mod:`medusa.engines.quantized`, CPU, bf16 activations); speculation is then exact relative to the
    quantized model. ``none``: the weights as they are."""
    gguf: str | None = None
    """With ``quantize="int4"``: the 4-bit GGUF the base was prepared from, whose own blocks become the int4 codes
    (nothing rounded twice, :mod:`medusa.io.gguf_pack`)."""
    quantized_lm_head: str = "fp32"
    """With ``quantize``: the lm_head's precision, ``fp32`` (the base's), ``bf16`` (a bf16 copy whose argmax is
    checked to be fp32's, :mod:`medusa.engines.checked_head`) or ``int4`` (codes like the linears; lossy)."""
    int4_kernel: str = "torch"
    """With ``quantize="int4"``: ``torch`` (torch's int4 kernel, bf16 activations), ``native`` (one C call a
    forward of every row, fp32 activations: :mod:`medusa.engines.native`) or ``native-q8`` (the same, activations
    rounded to int8 blocks)."""
    release_dense: bool = False
    """With ``quantize``: free the base's dense copies of the layers the engine runs quantized, once the model is
    built (:meth:`medusa.engines.quantized.QuantizedEngine.release_dense`), so the process holds the quantized
    model alone; the base can then no longer run unquantized (no HF ``generate`` beside it)."""
    verify_logits: str = "auto"
    """The verify's lm_head: ``all`` nodes in one product, one row at a time along the ``path``, or ``auto``: the
    engine's own choice (:data:`VERIFY_LOGITS`)."""
    max_cache_len: int | None = None
    """The most cache positions one call may preallocate (static, onednn, compiled engines)."""
    fixed_tree_only: bool = False
    """Never take the per-step tree (``build-tree`` and ``eval-heads``, which read the heads on fixed trees)."""

    @classmethod
    def from_flags(cls, args: argparse.Namespace, **overrides) -> DecodeConfig:
        """The configuration parsed flags describe (:func:`add_decode_arguments`): each field from the flag of its
        name when the command has it; ``overrides`` set fields directly."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**({k: v for k, v in vars(args).items() if k in fields} | overrides))

    def __post_init__(self):
        self._check_quantize()
        if self.lookup is not None and self.lookup < 0:
            raise ValueError(f"--lookup must be >= 0, got {self.lookup}")
        if self.lookup_ngram is not None and self.lookup_ngram < 1:
            raise ValueError(f"--lookup-ngram must be >= 1, got {self.lookup_ngram}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose auto or one of {', '.join(sorted(DTYPES))}")
        for name, value, choices in (("--per-step-tree", self.per_step_tree, PER_STEP_MODES),
                                     ("--verify-logits", self.verify_logits, tuple(VERIFY_LOGITS))):
            if value not in choices:
                raise ValueError(f"{name} {value!r}: choose one of {', '.join(choices)}")
        if self.drafter is not None:
            registered_drafter(self.drafter)  # an unknown name is refused with the known ones
        if self.drafter_name == "draft_model":
            self._check_draft_model()
        elif self.draft_model is not None:
            raise ValueError(f"--draft-model drafts with the draft_model drafter, not --drafter {self.drafter}")
        elif self.drafter_name in ("heads", "per-step"):
            self._check_heads()

    @property
    def drafter_name(self) -> str | None:
        """The drafter's registered name, :attr:`drafter` or the one the folders given imply (``None``: neither
        heads nor a draft model given, and no name)."""
        if self.drafter is not None:
            return self.drafter
        return "draft_model" if self.draft_model is not None else "heads" if self.heads is not None else None

    @property
    def scores_all_nodes(self) -> bool | None:
        """The engine option :attr:`verify_logits` asks for."""
        return VERIFY_LOGITS[self.verify_logits]

    def _check_heads(self) -> None:
        if self.heads is None:
            raise ValueError("pass --heads (Medusa, Hydra or eagle heads) or --draft-model (a separate draft model), "
                             "or --drafter NAME")
        mode = "on" if self.drafter == "per-step" else self.per_step_tree
        if self.drafter == "per-step" and self.per_step_tree == "off":
            raise ValueError("--drafter per-step grows a tree each step: drop --per-step-tree off")
        if self.tree is not None and mode == "on":
            raise ValueError("--tree forces one fixed tree every step and --per-step-tree on asks for a tree grown "
                             "each step: pass one of them")
        if self.tree is not None and self.max_tree_nodes is not None:
            raise ValueError("--max-tree-nodes sizes the per-step tree, but --tree forces a fixed tree: drop one")
        if self.max_tree_nodes is not None and self.max_tree_nodes < 1:
            raise ValueError(f"--max-tree-nodes must be >= 1, got {self.max_tree_nodes}")

    def _check_draft_model(self) -> None:
        if self.draft_model is None:
            raise ValueError("--drafter draft_model needs --draft-model DIR (a causal-LM folder sharing the base's "
                             "tokenizer)")
        given = [f for f, v in (("--heads", self.heads), ("--tree", self.tree), ("--adapter", self.adapter),
                                ("--max-tree-nodes", self.max_tree_nodes)) if v is not None]
        if self.per_step_tree == "on":
            given.append("--per-step-tree on")
        if given:
            raise ValueError(f"--draft-model drafts with a separate model on a chain or a full tree: drop "
                             f"{', '.join(given)}")
        if self.dtype == "auto":
            raise ValueError("--dtype auto is measured for heads; with --draft-model pass float32 or bfloat16")
        for flag, value in (("--draft-tokens", self.draft_tokens), ("--draft-width", self.draft_width)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.draft_quantize and self.draft_engine not in (None, *QUANTIZED_DRAFT_ENGINES):
            raise ValueError(f"--draft-quantize {self.draft_quantize} runs the draft's own quantized modules: "
                             f"--draft-engine must be eager or static, got {self.draft_engine}")

    def _check_quantize(self) -> None:
        """Raises ValueError or FileNotFoundError naming the bad ``--quantize`` / ``--gguf`` combination."""
        if self.quantize not in QUANTIZE:
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {self.quantize!r}")
        if self.quantize != "none" and self.engine not in (None, "auto", self.quantize):
            raise ValueError(f"--quantize {self.quantize} runs the {self.quantize} engine: drop --engine "
                             f"{self.engine}")
        if self.gguf is not None and self.quantize != "int4":
            raise ValueError(f"--gguf reads a GGUF's 4-bit blocks as int4 codes: pass --quantize int4 (got "
                             f"--quantize {self.quantize})")
        if self.quantized_lm_head not in QUANTIZED_LM_HEADS:
            raise ValueError(f"--quantized-lm-head must be one of {', '.join(QUANTIZED_LM_HEADS)}, got "
                             f"{self.quantized_lm_head!r}")
        if self.int4_kernel not in INT4_KERNELS:
            raise ValueError(f"--int4-kernel must be one of {', '.join(INT4_KERNELS)}, got {self.int4_kernel!r}")
        if self.int4_kernel != "torch" and self.quantize != "int4":
            raise ValueError(f"--int4-kernel {self.int4_kernel} runs the int4 engine: pass --quantize int4 too (got "
                             f"--quantize {self.quantize})")
        if self.release_dense and self.quantize == "none":
            raise ValueError("--release-dense frees the dense weights a quantized engine replaces: pass --quantize "
                             "int4 or int8 too")
        if self.quantized_lm_head != "fp32" and self.quantize == "none":
            raise ValueError(f"--quantized-lm-head {self.quantized_lm_head} sets a quantized engine's lm_head: pass "
                             "--quantize int4 or int8 too")
        if self.gguf is not None and not Path(self.gguf).is_file():
            raise FileNotFoundError(f"--gguf {self.gguf}: no such file")

    @property
    def engine_name(self) -> str | None:
        """The engine the base decodes through: :attr:`quantize`'s when it asks for one, else :attr:`engine`."""
        return self.engine if self.quantize == "none" else self.quantize

    def per_step_calibration(self):
        """The heads' :class:`medusa.drafters.calibration.Calibration` when they decode on the per-step tree (``on``,
        or ``auto`` with a calibrated heads folder and no :attr:`tree`), else ``None``. Read and checked once, here:
        a damaged file, one for other heads, or lookup flags it cannot honour are refused before the base loads.

        Raises:
            ValueError, FileNotFoundError, medusa.drafters.calibration.CalibrationMismatchError: as above, named.
        """
        from medusa.drafters.calibration import CALIBRATION_FILE_NAME

        if self.drafter_name not in ("heads", "per-step") or self.fixed_tree_only:
            return None
        path = Path(self.heads) / CALIBRATION_FILE_NAME
        calibrated = path.is_file()
        mode = "on" if self.drafter == "per-step" else self.per_step_tree
        if mode == "on" and not calibrated:
            raise ValueError(f"--per-step-tree on needs {path}, which is missing: `medusa calibrate --base BASE "
                             f"--heads {self.heads} --data VALIDATION.jsonl` measures it")
        per_step = mode == "on" or (mode == "auto" and calibrated and self.tree is None)
        if self.max_tree_nodes is not None and not per_step:
            raise ValueError(f"--max-tree-nodes sizes the per-step tree, which is off here (--per-step-tree {mode}"
                             f"{'' if calibrated else ', and the heads folder has no calibration.json'})")
        return self._checked_calibration(path) if per_step else None

    def _checked_calibration(self, path: Path):
        from medusa.drafters.calibration import check_calibration, folder_identity, load_calibration

        calibration = load_calibration(path)
        check_calibration(calibration, folder_identity(self.heads), f"calibration file {path}")
        if self.lookup is not None and self.lookup > calibration.lookup_length:
            raise ValueError(f"--lookup {self.lookup}: the heads' calibration measured the lookup chain at "
                             f"{calibration.lookup_length} positions (calibrate again with --lookup-length "
                             f"{self.lookup}, or pass a smaller --lookup)")
        if self.lookup_ngram is not None and self.lookup_ngram != calibration.lookup_max_ngram:
            raise ValueError(f"--lookup-ngram {self.lookup_ngram}: the heads' calibration measured the lookup chain "
                             f"with n-grams up to {calibration.lookup_max_ngram} (calibrate again with "
                             f"--lookup-ngram {self.lookup_ngram}, or drop the flag)")
        return calibration


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}


def add_decode_arguments(p: argparse.ArgumentParser, draft_model: bool = False) -> None:
    """The decoding commands' flags, one per :class:`DecodeConfig` field (its default written there once);
    ``draft_model``: with the draft-model group and ``--drafter`` (the commands that take either)."""
    p.add_argument("--base", required=True, help="base model folder (or hub id)")
    p.add_argument("--heads", required=not draft_model,
                   help="Medusa heads folder" + (" (or --draft-model)" if draft_model else ""))
    if draft_model:
        g = p.add_argument_group("a separate draft model (classic speculative decoding, instead of --heads)")
        g.add_argument("--draft-model", metavar="DIR",
                       help="a causal-LM folder sharing the base's tokenizer (a smaller sibling, or make-draft)")
        g.add_argument("--draft-tokens", type=int, default=_DEFAULTS["draft_tokens"], metavar="K",
                       help="drafts per step: the tree's depth")
        g.add_argument("--draft-width", type=int, default=_DEFAULTS["draft_width"], metavar="W",
                       help="1: a chain of K drafts; W > 1: the full top-W tree of depth K")
        g.add_argument("--draft-engine", default=None, help="the draft's own engine (default: the base's, after "
                       "--engine auto chose it; eager for a quantized draft)")
        g.add_argument("--draft-quantize", choices=["int8"], default=None,
                       help="quantize the draft's decoder layers to int8 (CPU, float32; with --draft-model set to "
                            "the base's own folder: a quantized copy of the target)")
        p.add_argument("--drafter", metavar="NAME",
                       help=f"the drafter by its registered name ({', '.join(drafter_names())}, or one registered "
                       "with medusa.register_drafter that has from_decode_config); default: draft_model with "
                       "--draft-model, else heads (--heads, --draft-model and --lookup are its shorthands)")
    p.add_argument("--adapter", help="Medusa-2 LoRA adapter folder (peft), merged into the base before decoding")
    p.add_argument("--tree", help="tree file: one fixed tree every step (default: the per-step tree when the heads "
                                  "folder holds calibration.json, else its tree.json, else the top-1 chain)")
    p.add_argument("--per-step-tree", choices=list(PER_STEP_MODES), default=_DEFAULTS["per_step_tree"],
                   help="grow each step's tree from the heads' calibrated confidence and this machine's measured "
                        "cost; auto: when the heads folder holds calibration.json and no --tree is given")
    p.add_argument("--max-tree-nodes", type=int, default=None, metavar="N",
                   help="per-step tree: the most nodes a step's tree may have, root included (default: 48)")
    p.add_argument("--lookup", type=int, default=None, metavar="N", help="prompt lookup: a chain of N tokens copied "
                   "from the context, verified with the heads' tree (overrides the tree file's; 0: none)")
    p.add_argument("--lookup-ngram", type=int, default=None, metavar="N", help="longest context n-gram prompt lookup "
                   "matches (default: the tree file's, else 3; build-tree: 3)")
    p.add_argument("--dtype", default=_DEFAULTS["dtype"], choices=["auto", *sorted(DTYPES)],
                   help="weights and compute dtype; auto: bfloat16 where the GPU supports it, or where this CPU has "
                        "AMX / AVX-512 BF16 and its measured profile says bfloat16 pays (its outputs can then differ "
                        "from float32's at numerical ties), else float32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, usually the number of cores)")
    from medusa.engines import AUTO, ENGINES

    p.add_argument("--engine", default=None,
                   help=f"KV cache and step: {AUTO}: chosen from this machine's measured profile (medusa profile; "
                   "measured once, about 40 s); " + "; ".join(f"{n}: {e.summary}" for n, e in ENGINES.items())
                   + f"; default: {AUTO}")
    p.add_argument("--quantize", choices=QUANTIZE, default="none",
                   help="weight-only quantized linear layers through the engine of that name: int4 (group 32) or "
                        "int8 (per channel), CPU, bf16 activations; speculation is exact relative to the quantized "
                        "model (docs/quantized.md)")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="with --quantize int4: the 4-bit GGUF the base was prepared from; its own blocks become the "
                        "int4 codes (nothing rounded twice)")
    p.add_argument("--quantized-lm-head", choices=QUANTIZED_LM_HEADS, default="fp32",
                   help="with --quantize: the lm_head's precision: fp32 (the base's, default), bf16 (half the bytes; "
                        "its argmax is checked to be fp32's, so greedy tokens are kept), int4 (lossy), gguf (the "
                        "GGUF's own Q8_0 lm_head, the fp32 weights exactly, fp32 activations; --int4-kernel native "
                        "or native-q8)")
    p.add_argument("--int4-kernel", choices=INT4_KERNELS, default="torch",
                   help="with --quantize int4: torch (torch's int4 kernel, bf16 activations, default); native (the "
                        "whole forward in one C call, every batched row in it, fp32 activations, compiled on first "
                        "use with the system's C compiler); native-q8 (the same with activations rounded to int8 "
                        "blocks on AVX-512 VNNI, as llama.cpp: lossy, faster): docs/quantized.md")
    p.add_argument("--verify-logits", choices=tuple(VERIFY_LOGITS), default=_DEFAULTS["verify_logits"],
                   help="the verify's lm_head: all: one product over every tree node; path: one row at a time along "
                        "the accepted path (the same tokens; cheaper where the vocabulary is large and the kernel "
                        "is matrix-vector bound); auto: the engine's own choice (default)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="static/onednn/compiled: the most cache positions one call may preallocate (prompt + "
                        "max_new_tokens + tree nodes); compiled: every call uses this one size (one compilation)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Decoding flags; unset ones come from the base's generation_config (then Hugging Face's defaults)."""
    g = p.add_argument_group("decoding (default: the base's generation_config, as Hugging Face generate)")
    g.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None, help="sample instead of greedy")
    g.add_argument("--temperature", type=float, help="sampling temperature (> 0)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0: off; Hugging Face's default is 50)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--seed", type=int, help="seed of the decode call's generator (same seed, same tokens)")
    g.add_argument("--acceptance", default="rejection", help="with sampling: 'rejection' (lossless), 'coupled' "
                   "(lossless; the same seed gives the same tokens whatever the heads, tree or batch, up to float "
                   "rounding), 'typical' "
                   "(Medusa's typical acceptance, lossy), or a rule registered with medusa.register_acceptance")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags (:func:`add_sampling_arguments`) as ``MedusaModel.generate`` keywords."""
    return {"do_sample": args.do_sample, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "seed": args.seed, "acceptance": args.acceptance}


def build_model(config: DecodeConfig, report: Report = None):
    """The :class:`medusa.model.MedusaModel` ``config`` describes: torch threads and the device set, the dtype
    checked for the device (or, ``auto``, decided), the base loaded (with its adapter merged), the drafter its name
    chooses, then the engine (``auto`` reads the profile for the drafter's step size), one line to ``report`` for
    each choice made on the caller's behalf.

    Which tree a heads drafter verifies: :attr:`DecodeConfig.tree` forces that fixed tree; otherwise heads whose
    folder holds ``calibration.json`` get the per-step tree; otherwise the folder's ``tree.json``, or the top-1 chain,
    with a note on how to calibrate.

    Raises:
        ValueError, FileNotFoundError: as :class:`DecodeConfig`, :meth:`DecodeConfig.per_step_calibration`, the
            loaders, or a dtype the device cannot run (all before the base loads where they can be).
    """
    import torch

    from medusa.engines import check_dtype

    say = report or (lambda text: None)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype, reason, measure_dtype = getattr(torch, DTYPES.get(config.dtype, "float32")), None, config.dtype == "auto"
    if measure_dtype and torch.device(device).type == "cuda":  # decided before loading: a 7B base loads in bf16
        from medusa.profile import cuda_dtype

        (dtype, reason), measure_dtype = cuda_dtype(device), False
    check_dtype(dtype, device)
    name = config.drafter_name
    if name is None:
        config._check_heads()  # names the flags to pass
    if name == "draft_model":
        model = _build_draft_model(config, dtype, device, say)
    elif name in ("heads", "per-step"):
        model = _build_heads(config, dtype, device, reason, measure_dtype, say)
    else:
        model = _build_registered(config, dtype, device, say)
    if config.release_dense:  # last: building may still measure the profile through other engines
        say(f"--release-dense: freed {model.engine.release_dense() / 2**20:.0f} MB of the base's dense weights")
    return model


def _build_heads(config: DecodeConfig, dtype, device, reason, measure_dtype: bool, say):
    """:func:`build_model` for heads: loaded on the eager engine (nothing to prepare), then the tree and dtype are
    settled, then the engine asked for is made, then the per-step tree reads its costs from the profile."""
    from medusa.model import CALIBRATION_NOTE, MedusaModel

    calibration = config.per_step_calibration()
    per_step = calibration is not None
    model = MedusaModel.from_pretrained(config.base, config.heads, tree=config.tree, dtype=dtype, device=device,
                                        adapter=config.adapter, engine="eager", per_step=False)
    if not per_step and (config.lookup is not None or config.lookup_ngram is not None):
        length = model.tree.lookup_length if config.lookup is None else config.lookup
        model.tree = model.tree.with_lookup(length, config.lookup_ngram)
    model.dtype_reason = reason
    typical = min(16, config.max_tree_nodes or 16) if per_step else None
    if measure_dtype:  # a CPU: the fp32 model is measured against a bf16 copy (once; then the profiles are read)
        from medusa.tools.measure import choose_dtype

        chosen, model.dtype_reason = choose_dtype(model.base, typical or model.drafter.max_nodes, measure=True)
        if chosen != dtype:
            model.base.to(chosen)
            model.heads.to(chosen)
    if model.dtype_reason:
        say(f"--dtype auto: {model.dtype_reason}")
    _use_engine(model, config, say, step_size=typical)
    if per_step:
        options = {"lookup_length": config.lookup} if config.lookup is not None else {}
        if config.max_tree_nodes is not None:
            options["max_nodes"] = config.max_tree_nodes
        model.use_per_step_tree(calibration, measure=True, **options)  # checked against the folder's weights above
        say(f"per-step tree: up to {model.drafter.max_nodes} nodes (root included), from "
            f"{Path(config.heads) / 'calibration.json'} and this machine's profile")
    elif not config.fixed_tree_only and config.tree is None and config.per_step_tree == "auto":
        say(f"note: {CALIBRATION_NOTE}")
    return model


def _build_draft_model(config: DecodeConfig, dtype, device, say):
    """:func:`build_model` for a draft model: the base, the draft on its chain (or top-W tree), the prompt-lookup
    chain when :attr:`DecodeConfig.lookup` asks for one, the base's engine, then the draft's own
    (:attr:`DecodeConfig.draft_engine`, default the base's)."""
    from medusa.model import MedusaModel

    model = MedusaModel.from_draft_model(config.base, config.draft_model, config.draft_tokens, config.draft_width,
                                         config.lookup or 0, config.lookup_ngram or 3, dtype, device, engine="eager",
                                         draft_quantize=config.draft_quantize)
    _use_engine(model, config, say)
    draft = model.draft_model
    draft.use_engine(config.draft_engine or ("eager" if config.draft_quantize else model.engine.name))
    say(f"draft model {config.draft_model}: {model.tree.name} ({model.tree.num_nodes - 1} nodes + root), its own "
        f"{draft.engine.name} engine")
    return model


def _build_registered(config: DecodeConfig, dtype, device, say):
    """:func:`build_model` for a drafter without heads: ``lookup`` (prompt lookup alone, a chain of
    :attr:`DecodeConfig.lookup` tokens, default 10), ``none`` (plain decoding), or a registered class's own
    ``from_decode_config(config, base)``.

    Raises:
        ValueError: a registered class that cannot build itself from a configuration (or built nothing), or
            heads-only flags.
    """
    from medusa.base import load_base
    from medusa.decode.tree import Tree
    from medusa.model import MedusaModel

    name = config.drafter
    given = [f for f, v in (("--heads", config.heads), ("--tree", config.tree),
                            ("--max-tree-nodes", config.max_tree_nodes)) if v is not None]
    if given:
        raise ValueError(f"--drafter {name} drafts without heads: drop {', '.join(given)}")
    cls = registered_drafter(name)
    build = getattr(cls, "from_decode_config", None)
    if name not in BUILT_IN_DRAFTERS and build is None:
        raise ValueError(f"drafter {name!r} ({cls.__name__}) cannot be built from a decode configuration: give it a "
                         f"classmethod from_decode_config(config, base)")
    if config.adapter is not None:
        from medusa.io.adapter import check_adapter_folder

        check_adapter_folder(config.adapter)
    base, tokenizer = load_base(config.base, dtype, device)
    if config.adapter is not None:
        from medusa.io.adapter import merge_adapter

        base = merge_adapter(base, config.adapter).eval()
    if name == "lookup":
        length = 10 if config.lookup is None else config.lookup
        model = MedusaModel(base, None, Tree.chain(0).with_lookup(length, config.lookup_ngram), tokenizer, "eager")
    elif name == "none":
        model = MedusaModel(base, None, Tree.chain(0), tokenizer, "eager")
    else:
        drafter = build(config, base)
        if drafter is None:
            raise ValueError(f"drafter {name!r}: {cls.__name__}.from_decode_config returned None, not a drafter")
        model = MedusaModel(base, None, None, tokenizer, "eager", drafter=drafter)
    _use_engine(model, config, say)
    return model


def _use_engine(model, config: DecodeConfig, say, step_size: int | None = None) -> None:
    """The engine :attr:`DecodeConfig.engine_name` names (``--quantize``'s, else ``--engine``), with its options;
    ``auto``'s reason to ``say``."""
    options = {} if config.gguf is None else {"gguf": config.gguf}
    if config.quantized_lm_head != "fp32":
        options["lm_head"] = config.quantized_lm_head
    if config.int4_kernel != "torch":
        options["kernel"] = config.int4_kernel
    model.use_engine(config.engine_name, step_size=step_size, max_cache_len=config.max_cache_len,
                     scores_all_nodes=config.scores_all_nodes, measure=True, **options)
    if model.engine.choice is not None:
        say(f"--engine auto: {model.engine.choice.reason}")


def plan_verify_cost(base_dir: str, engine: str | None, progress: Report = None):
    """``medusa plan --profile``: ``(verify_cost, profile path)``, ``verify_cost(k)`` the verify forward's cost over
    ``k + 1`` tokens relative to one, read from this machine's profile of the base (measured once) through
    ``engine`` (``None``: ``auto``'s pick for each step size)."""
    import torch

    from medusa.base import load_base
    from medusa.tools.measure import load_profile

    base, _ = load_base(base_dir, torch.float32, "cpu")
    profile = load_profile(base, progress=progress)

    def verify_cost(k: int) -> float:
        name = engine or profile.choose_engine(k + 1).engine
        return profile.forward_s(name, k + 1) / profile.forward_s(name, 1)

    return verify_cost, profile.path


def profile_machine(base_dir: str, dtype: str = "float32", device: str | None = None, engines=None,
                    heads: str | None = None, step_sizes=None, refresh: bool = False, progress: Report = None):
    """``medusa profile``: this machine's profile of the base (measured once, stored; ``refresh`` measures again)
    holding ``engines`` (default: ``auto``'s candidates) and, with ``heads``, their drafting cost per depth; and
    ``auto``'s choice with its reason for each of ``step_sizes`` (default: 1, the heads' tree's nodes, 16).

    Returns:
        ``(profile, {step size: reason})``.

    Raises:
        ValueError: a step size below 1, an unknown engine, or a dtype the device cannot run (before anything loads).
    """
    import torch

    from medusa.base import load_base
    from medusa.engines import ENGINES, check_dtype
    from medusa.tools.measure import ensure_engine, heads_level_s, load_profile

    if step_sizes is not None and min(step_sizes) < 1:
        raise ValueError(f"--step-size values must be >= 1, got {step_sizes}")
    engines = engines or []  # auto's candidates are always measured (load_profile)
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {', '.join(unknown)}: choose from {', '.join(ENGINES)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, DTYPES[dtype])
    check_dtype(torch_dtype, device)
    base, _ = load_base(base_dir, torch_dtype, device)
    profile = load_profile(base, refresh=refresh, progress=progress)  # auto's candidates, always
    for name in engines:
        ensure_engine(profile, base, name, progress)
    sizes = list(step_sizes or [1, 16])
    if heads:
        from medusa.decode.tree import load_tree
        from medusa.drafters import tree_drafter
        from medusa.io.checkpoint import load_heads_for_base
        from medusa.model import TREE_FILE_NAME

        loaded = load_heads_for_base(heads, base).to(device=base.device, dtype=torch_dtype)
        heads_level_s(profile, loaded)
        if step_sizes is None and (Path(heads) / TREE_FILE_NAME).is_file():
            tree = load_tree(Path(heads) / TREE_FILE_NAME)
            sizes = sorted({1, tree_drafter(loaded, tree).max_nodes, 16})
    return profile, {n: profile.choose_engine(n).reason for n in sizes}
