"""``medusa export`` and ``medusa import``: heads written in another project's layout, or read from one
(:mod:`medusa.io.interop` for vLLM's Medusa model and FasterDecoding/Medusa, :mod:`medusa.io.speculators` for the
speculators eagle3 format), each returning the line the command prints."""

from __future__ import annotations

from pathlib import Path

EXPORT_FORMATS = ("vllm", "speculators-eagle3")
IMPORT_SOURCES = ("medusa-v1", "vllm")


def base_lm_head(base: str | Path | None):
    """The base's lm_head weight ``(V, H)`` in its stored dtype, or ``None`` without a base.

    Raises:
        ValueError: the base exposes no lm_head.
    """
    if base is None:
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    if model.get_output_embeddings() is None:
        raise ValueError(f"{base}: {type(model).__name__} exposes no lm_head")
    return model.get_output_embeddings().weight.detach()


def export_heads(fmt: str, heads_dir: str | Path, out: str | Path, base: str | Path | None = None) -> str:
    """Write the heads of ``heads_dir`` to ``out`` in the layout ``fmt`` (:data:`EXPORT_FORMATS`); ``base`` is
    needed when the heads share its lm_head, and always for speculators-eagle3.

    Raises:
        ValueError: an unknown format, or a base needed and not given.
    """
    from medusa.io.checkpoint import check_heads_folder, load_heads
    from medusa.io.interop import export_vllm

    if fmt == "speculators-eagle3":
        return _export_speculators_eagle3(heads_dir, out, base)
    if fmt != "vllm":
        raise ValueError(f"unknown export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    config = check_heads_folder(heads_dir)
    if config.share_lm_head and base is None:
        raise ValueError(f"{heads_dir} shares the base's lm_head, which is not saved with the heads: pass --base")
    lm_head = base_lm_head(base)
    if lm_head is None:  # heads with their own projections: a stand-in of the right shape, not saved or exported
        import torch

        lm_head = torch.zeros(config.vocab_size, config.hidden_size)
    heads = load_heads(heads_dir, lm_head, check_fingerprint=base is not None)
    written = export_vllm(heads, out, lm_head if config.share_lm_head else None)
    return f"wrote vLLM Medusa layout ({config.num_heads} heads x {config.num_layers} layers) to {written}"


def _export_speculators_eagle3(heads_dir, out, base) -> str:
    """The eagle drafter with the base's embedding and lm_head rows, as the speculators eagle3 folder vLLM serves
    EAGLE-3 from."""
    from transformers import AutoModelForCausalLM

    from medusa.io.checkpoint import check_heads_folder, load_heads_for_base
    from medusa.io.speculators import check_eagle3_config, export_speculators_eagle3

    config = check_heads_folder(heads_dir)
    check_eagle3_config(config)  # before the base loads
    if base is None:
        raise ValueError("the speculators eagle3 format stores the base's embedding and lm_head rows: pass --base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    lm_head, embed = model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()
    heads = load_heads_for_base(heads_dir, model)
    written = export_speculators_eagle3(heads, out, model.config, lm_head if config.share_lm_head else None, embed,
                                        verifier_name_or_path=config.base_model_name_or_path)
    return (f"wrote the speculators eagle3 format (layers {config.eagle_layers}, {config.num_heads} draft tokens) "
            f"to {written}")


def import_heads(source: str, src: str | Path, out: str | Path, base: str | Path | None = None) -> str:
    """Convert the heads folder ``src`` from ``source``'s layout (:data:`IMPORT_SOURCES`) into ours at ``out``;
    ``base`` is checked against them and stored as their fingerprint.

    Raises:
        ValueError: an unknown source, or as the converters.
    """
    from medusa.io.checkpoint import read_heads_config
    from medusa.io.interop import import_medusa_v1, import_vllm

    converters = {"medusa-v1": import_medusa_v1, "vllm": import_vllm}
    if source not in converters:
        raise ValueError(f"unknown import source {source!r}: choose one of {', '.join(IMPORT_SOURCES)}")
    written = converters[source](src, out, base_lm_head(base))
    config = read_heads_config(written)
    projection = "the base's lm_head (shared)" if config.share_lm_head else "one projection per head"
    return f"wrote {config.num_heads} heads x {config.num_layers} layers, {projection}, to {written}"


def add_export_arguments(p) -> None:
    """The ``medusa export`` flags."""
    p.add_argument("--format", default="vllm", choices=["vllm", "speculators-eagle3"], help="target layout: vllm "
                   "(Medusa heads), speculators-eagle3 (the eagle drafter, for vLLM's EAGLE-3)")
    p.add_argument("--heads", required=True, help="our heads folder")
    p.add_argument("--out", required=True, help="folder to write (must not exist or be empty)")
    p.add_argument("--base", help="base model folder: needed when the heads share the base's lm_head, and always for "
                   "speculators-eagle3 (its embedding, lm_head and config)")


def add_import_arguments(p) -> None:
    """The ``medusa import`` flags."""
    p.add_argument("src", help="folder to convert")
    p.add_argument("--from", dest="source", required=True, choices=["medusa-v1", "vllm"],
                   help="medusa-v1: FasterDecoding/Medusa (medusa_lm_head.safetensors or .pt); vllm: vLLM's Medusa")
    p.add_argument("--out", required=True, help="our heads folder to write (must not exist or be empty)")
    p.add_argument("--base", help="base model folder: checked against the heads and stored as their fingerprint; "
                   "a vLLM original_lm_head equal to its rows is imported as sharing it")
