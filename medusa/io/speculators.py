"""Export the eagle drafter (:mod:`medusa.drafters.eagle`) to the ``speculators`` ``eagle3`` format: the folder vLLM
serves EAGLE-3 drafts from (``--speculative-config '{"model": DIR, "method": "eagle3"}'``).

Format facts (followed from the files below; facts only, no code taken from them):

- speculators 0.9.0, the PyPI release (its ``speculators/version.py``: ``version = "0.9.0"``, ``git_last_tag =
  "v0.9.0"``; the repository, vllm-project/speculators, sets the version from git tags, ``pyproject.toml``:
  ``dynamic = ["version"]``): ``speculators/models/eagle3/config.py`` (``Eagle3SpeculatorConfig``),
  ``speculators/models/eagle3/core.py`` (``Eagle3DraftModel``), ``speculators/models/eagle3/model_definitions.py``
  (the Llama first layer), ``speculators/model.py`` (``DraftVocabMixin``: ``d2t`` / ``t2d``, ``lm_head``),
  ``speculators/config.py`` (``speculators_config``, ``verifier``) and ``speculators/proposals/greedy.py``; the same
  files sit in vllm-project/speculators under ``src/speculators/`` (``models/eagle3/config.py`` @11ecdd33 and
  ``core.py`` @033c87f2 read there too). ``scripts/speculators_check.sh`` loads exported folders with speculators
  0.9.0's own ``SpeculatorModel.from_pretrained`` in a second environment and compares its forward's logits with the
  drafter's (docs/formats.md); speculators is no dependency of ours, so the tests recompute with
  :func:`speculators_eagle3_logits` instead.
- The reader that serves it: vllm-project/vllm ``vllm/model_executor/models/llama_eagle3.py`` @00bd1493 (model and
  weight loader), ``vllm/transformers_utils/configs/speculators/algos.py`` @cfb173ab (config translation) and
  ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` @da844450 (which base layers it captures).

What the folder holds:

- ``config.json``: ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3DraftModel"]``,
  ``transformer_layer_config`` (a Llama config dict of the one decoder layer: ``model_type: "llama"``,
  ``num_hidden_layers: 1``, ``vocab_size`` = the base's, head layout, ``head_dim``, ``rms_norm_eps``, ``rope_theta``,
  ``attention_bias: false``, ``mlp_bias: false``, ``hidden_act: "silu"``), ``draft_vocab_size``,
  ``norm_before_residual: false`` (written: vLLM's default when absent is *true*), ``norm_before_fc``, ``fc_norm``
  and ``norm_output`` false (no norm before ``fc``; each step feeds back the pre-norm output),
  ``target_hidden_size: null`` (the base's hidden size), ``eagle_aux_hidden_state_layer_ids`` and
  ``speculators_config`` (``algorithm: "eagle3"``, one ``greedy`` proposal method with ``speculative_tokens``,
  ``default_proposal_method: "greedy"``, ``verifier: {name_or_path, architectures}``).
- ``model.safetensors``: ``embed_tokens.weight`` ``(V, H)``, ``fc.weight`` ``(H, 3H)`` (no bias),
  ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``layers.0.self_attn.{q,k,v}_proj.weight`` ``(heads x head_dim, 2H)``, ``layers.0.self_attn.o_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` ``(Vd, H)`` and, for a draft
  vocabulary smaller than the base's, ``d2t`` ``(Vd,)`` int64 and ``t2d`` ``(V,)`` bool.

Semantics: draft id ``i`` is target id ``i + d2t[i]`` (vLLM scatters the draft logits into a full-vocabulary row of
-inf at those ids); ``t2d`` marks the target ids that have a draft id, and speculators takes ``lm_head`` as the
base's lm_head rows where ``t2d`` is set, in ascending target id. So the draft vocabulary is written sorted by base
id (rows of our ``lm_head`` permuted to match). The layer's input is ``cat([input_layernorm(embed(x_{t+1})),
hidden_norm(g_t)])`` (embedding first), its residual the un-normed ``g_t = fc(aux_t)``, then Llama's attention
(rotary, grouped-query, scale ``head_dim ** -0.5``), ``post_attention_layernorm`` and the SiLU-gated MLP, the final
``norm`` and ``lm_head``; a step past the first reads the previous step's (pre-norm) layer output as ``g``. The fused
base states are the streams *entering* decoder layers ``eagle_aux_hidden_state_layer_ids`` (``hidden_states[i]`` in
transformers' terms; id 0 is the embeddings), concatenated in ascending id order: our ``eagle_layers`` count each
layer's *output*, so id = layer + 1. vLLM's capture loop takes the stream before each of the L layers runs (ids
0 .. L-1), so the output of the base's last layer (id L, which speculators 0.9.0 accepts for hidden states extracted
with ``--include-last-layer``) is refused.

vLLM runs its Llama layer over whatever the files hold, so a drafter that computes something else would serve wrong
drafts without an error. The export therefore refuses drafters the format's Llama layer cannot express
(:func:`check_exportable_eagle3`) and, before it writes, recomputes the written files' logits with the format's math
written out here (:func:`speculators_eagle3_logits`), refusing them unless they give the drafter's own.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from medusa.drafters.eagle import EagleDrafterHeads, eagle_base_settings
from medusa.drafters.heads import MedusaHeadsConfig, fingerprint_mismatch
from medusa.io.interop import EXPORT_INFO_KEY, FormatError, write_export_folder

SPECULATORS_CONFIG_NAME = "config.json"
SPECULATORS_WEIGHTS_NAME = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose layout this export writes (module docstring)."""
SPECULATORS_LAYOUT = ("speculators 0.9.0 speculators/models/eagle3/{config,core,model_definitions}.py; "
                      "vllm-project/vllm@00bd1493 vllm/model_executor/models/llama_eagle3.py")
AUX_LAYERS = 3
"""Base layers the format's ``fc`` fuses: vLLM's ``fc`` reads exactly ``3 * hidden`` (speculators 0.9.0 allows any
count, sized by ``eagle_aux_hidden_state_layer_ids``)."""
# Our layer's weights -> the format's names (the embedding, lm_head and vocabulary maps are added separately).
LAYER_NAMES = {
    "fc.weight": "fc.weight",
    "layer.input_layernorm.weight": "layers.0.input_layernorm.weight",
    "layer.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "layer.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "layer.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "layer.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "layer.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "layer.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "layer.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "layer.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "layer.down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
}
CHECK_STEPS = 2
"""Steps the export verifies: the first (fused base states) and one unrolled step (the drafter's own output)."""


# ---------------------------------------------------------------------------------------------------------------------
# Refusals.


def check_eagle3_config(config: MedusaHeadsConfig) -> None:
    """Refuse, from the heads config alone (before any base loads), a drafter the format cannot hold.

    Raises:
        FormatError: naming the reason: a head type other than "eagle"; a base whose layer the format's Llama layer
            cannot express (learned positions, a norm other than RMSNorm, a non-gated MLP, an activation other than
            SiLU); fused layers other than three distinct ones vLLM captures.
    """
    if config.head_type != "eagle":
        raise FormatError(f"head_type {config.head_type!r} cannot be exported to the speculators eagle3 format: it "
                          "holds one EAGLE-3 decoder layer over fused base layers (head_type 'eagle'); Medusa heads "
                          "export with --format vllm")
    s = config.eagle_base
    if s["positions"] == "learned":
        raise FormatError("the drafter adds the base's learned position embeddings (GPT-2) to its token embedding: "
                          "the format's Llama layer has rotary positions only")
    if s["norm"] != "rms":
        raise FormatError(f"the drafter's norms are {s['norm']!r} (the base's kind, {s['model_type']}): the format's "
                          "Llama layer uses RMSNorm w * x / rms(x) only")
    if not s["gated_mlp"]:
        raise FormatError("the drafter's MLP is not gated: the format's Llama MLP is down(act(gate(x)) * up(x))")
    if s["hidden_act"] != "silu":
        raise FormatError(f"the drafter's activation is {s['hidden_act']!r}: vLLM's Llama MLP, which serves the "
                          "format, runs SiLU only")
    _check_layers(config.eagle_layers, s["num_hidden_layers"])


def _check_layers(layers: list[int], num_layers: int) -> None:
    """Three distinct fused layers, none the base's last (module docstring: what vLLM captures)."""
    if len(layers) != AUX_LAYERS or len(set(layers)) != AUX_LAYERS:
        raise FormatError(f"the drafter fuses base layers {layers}: the format's fc reads exactly {AUX_LAYERS} "
                          "distinct ones (vLLM captures each layer once)")
    if num_layers - 1 in layers:
        raise FormatError(f"the drafter fuses the output of the base's last layer ({num_layers - 1}): vLLM captures "
                          f"the stream entering a layer (ids 0 .. {num_layers - 1}), never the last layer's output")


def check_exportable_eagle3(heads: nn.Module) -> None:
    """Refuse a drafter whose computation the format cannot hold (:func:`check_eagle3_config`), or that holds
    modules or a vocabulary the format has no place for.

    Raises:
        FormatError: naming the reason.
    """
    check_eagle3_config(heads.config)
    if type(heads) is not EagleDrafterHeads:
        raise FormatError(f"{type(heads).__name__} is not the eagle drafter the format holds")
    expected = set(LAYER_NAMES) | {f"lm_heads.{k}.weight" for k in range(heads.config.num_heads)} | {"token_map"}
    unknown = sorted(set(heads.state_dict()) - expected)
    if unknown:
        raise FormatError(f"the drafter holds weights the eagle3 format has no place for: {unknown}")
    if heads.token_map is not None and len(torch.unique(heads.token_map)) != len(heads.token_map):
        raise FormatError("the drafter's token_map repeats a base token: the format's t2d marks each base token once")


def _check_base_config(heads: EagleDrafterHeads, base_config) -> None:
    """The base config given is the one the drafter was built for, with a rotary embedding the format holds."""
    text = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    try:
        settings = eagle_base_settings(text)
    except ValueError as e:  # a rotary kind other than the default one
        raise FormatError(f"the base's rotary embedding cannot be expressed in the eagle3 format: {e}") from e
    differ = {k: (v, settings.get(k)) for k, v in heads.config.eagle_base.items() if settings.get(k) != v}
    if differ:
        raise FormatError(f"the base given is not the one the drafter was built for: (drafter, base) {differ}")


# ---------------------------------------------------------------------------------------------------------------------
# Export.


def export_speculators_eagle3(heads: EagleDrafterHeads, out_dir: str | Path, base_config=None,
                              lm_head_weight: torch.Tensor | None = None, embed_weight: torch.Tensor | None = None,
                              verifier_name_or_path: str = "") -> Path:
    """Write the eagle drafter as a speculators ``eagle3`` folder (module docstring); returns ``out_dir``.

    Args:
        heads: the eagle drafter (its embedding and, when shared, lm_head rows are the base's buffers).
        out_dir: destination folder; must not exist or be empty. Written under a temporary name and renamed.
        base_config: the base's transformers config: checked against the drafter's base settings, and the source of
            the verifier's ``architectures`` (and name, when ``verifier_name_or_path`` is empty).
        lm_head_weight: the base's lm_head ``(V, H)``; for a drafter sharing it, its (token map) rows are written as
            ``lm_head.weight`` after a fingerprint check (default: the drafter's shared rows).
        embed_weight: the base's input embedding ``(V, H)``, checked equal to the drafter's copy of it, which is
            written as ``embed_tokens.weight``.
        verifier_name_or_path: the base's Hub id or path vLLM and speculators load as the verifier (default: the
            base config's name, else the heads config's ``base_model_name_or_path``, else null).

    Raises:
        FormatError: a drafter the format cannot hold (:func:`check_exportable_eagle3`), another base's config,
            lm_head or embedding, or written files whose recomputed logits differ from the drafter's (nothing is
            written).
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    check_exportable_eagle3(heads)
    if base_config is not None:
        _check_base_config(heads, base_config)
    config = speculators_eagle3_config(heads, base_config, verifier_name_or_path)
    state = _eagle3_state(heads, lm_head_weight, embed_weight)
    _check_same_logits(heads, config, state)
    return write_export_folder(out_dir, state, SPECULATORS_WEIGHTS_NAME, config, SPECULATORS_CONFIG_NAME)


def speculators_eagle3_config(heads: EagleDrafterHeads, base_config=None, verifier_name_or_path: str = "") -> dict:
    """The ``config.json`` dict of the drafter in the eagle3 format (module docstring)."""
    c, s = heads.config, heads.config.eagle_base
    name = (verifier_name_or_path or getattr(base_config, "_name_or_path", "") or c.base_model_name_or_path
            or None)
    dtype = str(next(heads.parameters()).dtype).removeprefix("torch.")
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": heads.head_vocab_size,
        "norm_before_residual": False,  # our residual is the un-normed feature; vLLM assumes true when absent
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": sorted(layer + 1 for layer in c.eagle_layers),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "transformer_layer_config": _llama_layer_config(c, s),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_heads,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": list(getattr(base_config, "architectures", None)
                                                                     or [])},
        },
        EXPORT_INFO_KEY: {"layout": SPECULATORS_LAYOUT, "lm_head_fingerprint": c.lm_head_fingerprint},
    }


def _llama_layer_config(c: MedusaHeadsConfig, s: dict) -> dict:
    """The format's ``transformer_layer_config``: one Llama decoder layer with the drafter's shapes. ``rope_theta``
    is what speculators' pinned transformers and vLLM read; ``rope_parameters`` what transformers 5 reads."""
    return {
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": s["intermediate_size"], "num_hidden_layers": 1,
        "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"], "hidden_act": "silu", "max_position_embeddings": s["max_position_embeddings"],
        "rms_norm_eps": s["norm_eps"], "rope_theta": s["rope_theta"], "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"]},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
    }


def _eagle3_state(heads: EagleDrafterHeads, lm_head_weight: torch.Tensor | None,
                  embed_weight: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The format's weight name -> tensor (cpu, contiguous): the layer, the embedding, the lm_head rows sorted by
    base id and, for a draft vocabulary, ``d2t`` / ``t2d``."""
    c = heads.config
    ours = heads.state_dict()
    state = {theirs: ours[name] for name, theirs in LAYER_NAMES.items()}
    state["fc.weight"] = _fc_in_capture_order(ours["fc.weight"], c.eagle_layers, c.hidden_size)
    if embed_weight is not None and (embed_weight.shape != heads.embed_weight.shape
                                     or not torch.equal(embed_weight.to(heads.embed_weight), heads.embed_weight)):
        raise FormatError(f"the input embedding given {tuple(embed_weight.shape)} is not the one the drafter reads: "
                          "give the base it was built on")
    state["embed_tokens.weight"] = heads.embed_weight
    rows = _lm_head_rows(heads, lm_head_weight)  # (Vd, H), in the drafter's order
    if heads.token_map is None:
        # A copy: a tied base's lm_head is its embedding, one tensor, and safetensors writes no shared storage.
        state["lm_head.weight"] = rows.clone()
    else:
        order = torch.argsort(heads.token_map.cpu())
        target = heads.token_map.cpu()[order]  # (Vd,) ascending base ids
        state["lm_head.weight"] = rows[order.to(rows.device)]
        state["d2t"] = target - torch.arange(len(target))  # (Vd,) target id = draft id + d2t
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[target] = True
        state["t2d"] = t2d  # (V,)
    return {name: t.detach().cpu().contiguous() for name, t in state.items()}


def _fc_in_capture_order(weight: torch.Tensor, layers: list[int], hidden: int) -> torch.Tensor:
    """``fc`` ``(H, 3H)`` with its input blocks reordered from ``layers``' order to ascending layer order: vLLM
    concatenates the captured layers in the order it runs them."""
    blocks = weight.split(hidden, dim=1)
    return torch.cat([blocks[i] for i in sorted(range(len(layers)), key=layers.__getitem__)], dim=1)


def _lm_head_rows(heads: EagleDrafterHeads, lm_head_weight: torch.Tensor | None) -> torch.Tensor:
    """The drafter's projection ``(Vd, H)``: its own ``lm_heads[0]``, or the base's rows it shares."""
    if heads.lm_heads is not None:
        return heads.lm_heads[0].weight
    if lm_head_weight is None:
        return heads.shared_weight
    c = heads.config
    if tuple(lm_head_weight.shape) != (c.vocab_size, c.hidden_size):
        raise FormatError(f"the base's lm_head is {tuple(lm_head_weight.shape)}, the drafter was trained on "
                          f"({c.vocab_size}, {c.hidden_size})")
    if problem := fingerprint_mismatch(c.lm_head_fingerprint, lm_head_weight):
        raise FormatError(f"the base given is not the one the drafter was trained on: {problem}")
    rows = lm_head_weight.detach()
    return rows if heads.token_map is None else rows[heads.token_map.to(rows.device)]


# ---------------------------------------------------------------------------------------------------------------------
# Verification: the format's forward, written from its definition (not through medusa.drafters.eagle).


def speculators_eagle3_logits(config: dict, state: dict[str, torch.Tensor], hidden_states: torch.Tensor,
                              input_ids: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """What a speculators ``eagle3`` folder drafts, as vLLM runs it, in float32, for every anchor of a sequence.

    Step 0 pairs the base's captured states at position t with the embedding of token t+1 (vLLM's proposer shifts
    the tokens by one) and attends causally over positions 0..t. Step j >= 1 at anchor t sits at position t+j,
    reads the previous step's layer output (before the final norm) and token t+j+1, and attends to step 0's keys of
    positions 0..t and to its own chain's keys of steps 1..j (as vLLM's KV cache holds them while drafting from t).
    The tokens past the first are the given ones (vLLM feeds back its own drafts; the function is the same).

    Args:
        config: the folder's ``config.json`` dict.
        state: its weights.
        hidden_states: ``(T, L + 1, H)`` the base's residual streams, index i entering decoder layer i
            (transformers' ``hidden_states[i]``; 0 is the embeddings), as vLLM captures them.
        input_ids: ``(T,)`` the sequence's base token ids.
        steps: drafting steps.

    Returns:
        ``(steps, T - 1, V)`` logits over the base vocabulary (-inf outside the draft vocabulary); step j's row t
        predicts token t + j + 2 (rows t > T - 2 - j read tokens past the end, 0, and are garbage).
    """
    tl = config["transformer_layer_config"]
    weights = {name: t.float() for name, t in state.items() if t.is_floating_point()}
    ids = sorted(config["eagle_aux_hidden_state_layer_ids"])
    n = len(input_ids) - 1
    aux = torch.cat([hidden_states[:n, i] for i in ids], dim=-1).float()  # (n, 3H), ascending ids
    hidden = aux @ weights["fc.weight"].T  # (n, H)
    positions = torch.arange(n)
    prefix, chain, logits = None, [], []
    for j in range(steps):
        tokens = nn.functional.pad(input_ids[1 + j :], (0, j), value=0)  # (n,): token t + j + 1
        embeds = weights["embed_tokens.weight"][tokens]  # (n, H)
        q, k, v = _eagle3_qkv(weights, tl, hidden, embeds, positions + j)
        if prefix is None:
            prefix = (k, v)
        else:
            chain.append((k, v))
        attended = _eagle3_attention(q, prefix, chain, tl)  # (n, heads * head_dim)
        hidden = _eagle3_finish(weights, tl, hidden, attended)  # (n, H): the next step's input
        draft = _rms_norm(hidden, weights["norm.weight"], tl["rms_norm_eps"]) @ weights["lm_head.weight"].T
        logits.append(_to_target_vocab(draft, state.get("d2t"), tl["vocab_size"]))
    return torch.stack(logits)  # (steps, n, V)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's default rotary embedding of ``x`` ``(heads, n, d)`` at ``positions`` ``(n,)``: channel i and
    i + d/2 rotate together by ``position * theta ** (-2i / d)``."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # (d/2,)
    angle = torch.cat([positions[:, None] * freq] * 2, dim=-1)  # (n, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * angle.cos() + torch.cat([-x2, x1], dim=-1) * angle.sin()


def _eagle3_qkv(weights: dict, tl: dict, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
    """Rotated queries ``(heads, n, d)``, keys and values ``(kv_heads, n, d)`` of the first layer's input
    ``[input_layernorm(embeds) ; hidden_norm(hidden)]`` ``(n, 2H)``."""
    eps, d = tl["rms_norm_eps"], tl["head_dim"]
    x = torch.cat([_rms_norm(embeds, weights["layers.0.input_layernorm.weight"], eps),
                   _rms_norm(hidden, weights["layers.0.hidden_norm.weight"], eps)], dim=-1)  # (n, 2H)
    q, k, v = (x @ weights[f"layers.0.self_attn.{p}_proj.weight"].T for p in "qkv")
    q, k, v = (t.view(len(x), -1, d).transpose(0, 1) for t in (q, k, v))  # (heads, n, d)
    return _rotary(q, positions, tl["rope_theta"]), _rotary(k, positions, tl["rope_theta"]), v


def _eagle3_attention(q: torch.Tensor, prefix: tuple, chain: list[tuple], tl: dict) -> torch.Tensor:
    """Softmax attention ``(n, heads * d)`` of the queries at anchor t over the prefix keys 0..t and the anchor's own
    chain keys (one per step past the first, the last being the query's own), kv heads shared by groups."""
    groups = tl["num_attention_heads"] // tl["num_key_value_heads"]
    n = q.shape[1]
    k0, v0 = (t.repeat_interleave(groups, dim=0) for t in prefix)  # (heads, n, d)
    scores = [(q @ k0.transpose(1, 2)).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)]
    values = []
    for k, v in chain:
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        scores.append((q * k).sum(-1, keepdim=True))  # (heads, n, 1): anchor t's own key of that step
        values.append(v)
    weights = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(q.shape[-1]), dim=-1)  # (heads, n, n + len(chain))
    out = weights[..., :n] @ v0
    for i, v in enumerate(values):
        out = out + weights[..., n + i : n + i + 1] * v
    return out.transpose(0, 1).reshape(n, -1)  # (n, heads * d)


def _eagle3_finish(weights: dict, tl: dict, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The layer's output ``(n, H)``: residual (the un-normed input hidden, ``norm_before_residual`` false) plus
    ``o_proj``, then the post-attention norm and the SiLU-gated MLP with their residual."""
    h = hidden + attended @ weights["layers.0.self_attn.o_proj.weight"].T
    x = _rms_norm(h, weights["layers.0.post_attention_layernorm.weight"], tl["rms_norm_eps"])
    gate = nn.functional.silu(x @ weights["layers.0.mlp.gate_proj.weight"].T)
    return h + (gate * (x @ weights["layers.0.mlp.up_proj.weight"].T)) @ weights["layers.0.mlp.down_proj.weight"].T


def _to_target_vocab(draft: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft logits ``(n, Vd)`` in a row of the base vocabulary ``(n, V)``: draft id i at ``i + d2t[i]``, -inf
    elsewhere (no ``d2t``: the draft vocabulary is the base's)."""
    target = torch.arange(draft.shape[-1]) if d2t is None else torch.arange(draft.shape[-1]) + d2t.long()
    full = torch.full((len(draft), vocab_size), -math.inf)
    full[:, target] = draft
    return full


def _check_same_logits(heads: EagleDrafterHeads, config: dict, state: dict) -> None:
    """The written files, run as the format runs, give the drafter's own logits for two steps (up to rounding)."""
    c = heads.config
    g = torch.Generator().manual_seed(0)
    length, num_layers = 8, c.eagle_base["num_hidden_layers"]
    hidden_states = torch.randn(length, num_layers + 1, c.hidden_size, generator=g)  # (T, L + 1, H)
    input_ids = torch.randint(0, c.vocab_size, (length,), generator=g)  # (T,)
    param = next(heads.parameters())
    hidden_states = hidden_states.to(param.dtype)
    # Our base states: [last hidden ; output of each fused layer] = streams entering layer l + 1.
    ours_in = torch.cat([hidden_states[:, -1]] + [hidden_states[:, layer + 1] for layer in c.eagle_layers], dim=-1)
    with torch.no_grad():
        ours = heads(ours_in.to(param.device), input_ids.to(param.device), steps=CHECK_STEPS).float().cpu()
        theirs = speculators_eagle3_logits(config, state, hidden_states, input_ids, steps=CHECK_STEPS)
    columns = torch.arange(c.vocab_size) if heads.token_map is None else heads.token_map.cpu()
    tolerance = 1e-4 if param.dtype == torch.float32 else 5e-2
    for j in range(CHECK_STEPS):
        rows = length - 1 - j  # anchors whose tokens all exist
        a, b = ours[j, :rows], theirs[j, :rows][:, columns]  # (rows, Vd)
        scale = a.abs().max().clamp_min(1.0)
        if not torch.isfinite(b).all() or (a - b).abs().max() > tolerance * scale:
            raise FormatError(f"the eagle3-format weights do not reproduce the drafter's logits (step {j}): the "
                              "drafter computes something the format's Llama layer does not")
