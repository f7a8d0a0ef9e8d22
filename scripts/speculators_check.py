"""Load the eagle drafter's speculators ``eagle3`` export in speculators 0.9.0 itself and compare its logits with ours.

speculators is no dependency of ours, so :mod:`medusa.io.speculators` checks an export against its own recomputation
of the format (:func:`~medusa.io.speculators.speculators_eagle3_logits`). This script closes the loop with the real
package: ``scripts/speculators_check.sh`` makes a second virtual environment with speculators 0.9.0 and runs it there.

For each case a drafter is saved as ``medusa train`` saves one, exported as ``medusa export --format
speculators-eagle3`` does (:func:`medusa.io.convert.export_heads`), loaded with speculators' own
``SpeculatorModel.from_pretrained`` (which reads the verifier's config and weights from the base folder) and run with
its own ``Eagle3DraftModel.forward`` (training-time-test unrolling, ``steps`` draft tokens) on the base's hidden states
of a random sequence. Three logits are compared at every anchor whose tokens exist, over the base vocabulary: the
drafter's own, the recomputation's and speculators'. The loaded weights are also compared with the file's.

Cases: random drafters on a tiny random Llama base (4 layers, grouped-query attention, ``rope_theta`` 50000, an
untied lm_head) saved to a temporary folder: the full vocabulary, a draft vocabulary with fused layers out of order,
and an own lm_head; each under speculators' default attention (``simple_flex_attention``) and ``eager``. With
``--base`` (and optionally ``--heads``, a saved eagle drafter for it) the case is that base instead.

    python scripts/speculators_check.py                                      # the tiny cases, seconds on a CPU
    python scripts/speculators_check.py --base models/smollm2-135m-instruct  # a random drafter on the real base

Exit status 1 when a loaded weight differs from the file, or logits differ by more than ``--tolerance`` times the
largest logit (at least 1), or any argmax differs. ``--control`` flips ``norm_before_residual`` in each written config
(the one setting vLLM defaults the other way), so every comparison with speculators must fail.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from loguru import logger
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from medusa.drafters.eagle import default_eagle_layers, eagle_base_settings
from medusa.drafters.heads import MedusaHeadsConfig, build_heads, lm_head_fingerprint
from medusa.io.checkpoint import load_heads_for_base, save_heads
from medusa.io.convert import export_heads
from medusa.io.speculators import speculators_eagle3_logits

ATTENTION = ("simple_flex_attention", "eager")
"""speculators' default attention for ``Eagle3DraftModel`` (flex attention with a block mask), and transformers'
eager one (a dense float mask): the two mask paths its forward has."""
TINY_CASES = {  # name: (fused layers, draft vocabulary or None, share the base's lm_head)
    "full vocabulary": ((0, 1, 2), None, True),
    "draft vocabulary, layers out of order": ((2, 0, 1), [9, 3, 100, 5, 77, 300, 1, 2], True),
    "own lm_head, draft vocabulary": ((1, 0, 2), [40, 7, 6, 5, 250], False),
}


def tiny_base(folder: Path, seed: int = 0) -> Path:
    """A random 4-layer Llama saved to ``folder``, with what the format must carry through: grouped-query attention,
    an explicit ``head_dim``, a non-default ``rope_theta`` and ``rms_norm_eps``, and an lm_head not tied to the
    embedding (so using one for the other shows)."""
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the default init, so logits are peaky and argmaxes not near-ties
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def random_drafter(base, layers, token_map, share: bool, folder: Path, seed: int = 1) -> Path:
    """A random eagle drafter on ``base`` (a loaded causal LM), every weight drawn N(0, 0.2), saved to ``folder``."""
    lm_head, embed = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
    token_map = None if token_map is None else torch.tensor(token_map)
    c = base.config
    config = MedusaHeadsConfig(hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_heads=3, head_type="eagle",
                               eagle_layers=list(layers), eagle_base=eagle_base_settings(c),
                               head_vocab_size=None if token_map is None else len(token_map), share_lm_head=share,
                               lm_head_fingerprint=lm_head_fingerprint(lm_head))
    heads = build_heads(config, lm_head, embed, token_map)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2, generator=g)
    return save_heads(heads, folder)


def load_in_speculators(folder: Path, base: Path, attention: str):
    """speculators' ``Eagle3DraftModel`` of ``folder``, with the verifier read from the local ``base`` folder (the
    Hub is not reached), under ``attention``."""
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.speculators_config.verifier.name_or_path = str(base)
    config.transformer_layer_config._attn_implementation = attention
    model = SpeculatorModel.from_pretrained(str(folder), config=config)
    return model.eval()


def loaded_weights_differ(model, folder: Path) -> list[str]:
    """The file's tensors the loaded model does not hold, or holds different."""
    ours, theirs = load_file(folder / "model.safetensors"), model.state_dict()
    return [name for name, t in ours.items() if name not in theirs or not torch.equal(theirs[name].cpu(), t)]


def speculators_logits(model, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """speculators' own forward: ``aux`` ``(n, 3H)`` the fused states at positions 0..n-1 (ascending layer ids),
    ``input_ids`` ``(n,)`` token t+1 at position t (its ``shift_batch``), one document. Its forward returns argmax
    tokens only, so the draft logits are caught at ``lm_head`` (once per step) and placed in the base vocabulary
    through the model's own ``d2t``. Returns ``(steps, n, V)``, -inf outside the draft vocabulary."""
    caught = []
    hook = model.lm_head.register_forward_hook(lambda _module, _args, out: caught.append(out[0].float()))
    try:
        with torch.no_grad():
            model(hidden_states=aux[None], input_ids=input_ids[None], document_ids=torch.zeros_like(input_ids)[None],
                  ttt_steps=steps)
    finally:
        hook.remove()
    draft = torch.stack(caught)  # (steps, n, Vd)
    ids = torch.arange(draft.shape[-1]) if model.d2t is None else torch.arange(draft.shape[-1]) + model.d2t.cpu()
    full = torch.full((*draft.shape[:2], model.config.transformer_layer_config.vocab_size), -torch.inf)
    full[..., ids] = draft
    return full


def drafter_logits(heads, states: torch.Tensor, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Our drafter's ``(steps, T, V)`` logits (-inf outside its vocabulary) from the base's streams ``states``
    ``(T, L + 1, H)``: its input is the last hidden state, then the output of each fused layer (stream l + 1)."""
    ours_in = torch.cat([states[:, -1]] + [states[:, layer + 1] for layer in heads.config.eagle_layers], dim=-1)
    with torch.no_grad():
        draft = heads(ours_in, input_ids, steps=steps).float()  # (steps, T, Vh)
    columns = torch.arange(heads.config.vocab_size) if heads.token_map is None else heads.token_map
    full = torch.full((*draft.shape[:2], heads.config.vocab_size), -torch.inf)
    full[..., columns] = draft
    return full


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max |a - b| over the finite entries, argmax agreement, same -inf pattern) of ``(rows, V)`` logits."""
    finite = torch.isfinite(a)
    same_pattern = bool(torch.equal(finite, torch.isfinite(b)))
    diff = (a[finite] - b[finite]).abs().max().item() if same_pattern else float("inf")
    agreement = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return diff, agreement, same_pattern


def check_case(name: str, heads_dir: Path, base: Path, work: Path, steps: int, length: int, tolerance: float,
               control: bool = False, seed: int = 2) -> bool:
    """Export ``heads_dir``, load it under each attention, compare the three logits; print one line per pair.
    ``control``: flip ``norm_before_residual`` in the written config before speculators loads it, a folder that must
    fail (the check can tell)."""
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    heads = load_heads_for_base(heads_dir, base_model).float().eval()
    work.mkdir(exist_ok=True)
    out = work / f"eagle3-{len(list(work.iterdir()))}"
    print(f"# {name}: {export_heads('speculators-eagle3', heads_dir, out, base)}")
    config, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    if control:
        (out / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, base_model.config.vocab_size, (length,), generator=g)  # (T,)
    with torch.no_grad():
        streams = base_model(input_ids[None], output_hidden_states=True).hidden_states
    states = torch.stack(streams, dim=2)[0]  # (T, L + 1, H): index i enters decoder layer i
    ours = drafter_logits(heads, states, input_ids, steps)  # (steps, T, V)
    recomputed = speculators_eagle3_logits(config, state, states, input_ids, steps=steps)  # (steps, T - 1, V)
    n = length - 1
    aux = torch.cat([states[:n, i] for i in config["eagle_aux_hidden_state_layer_ids"]], dim=-1)  # (n, 3H)
    ok = True
    for attention in ATTENTION:
        model = load_in_speculators(out, base, attention)
        differ = loaded_weights_differ(model, out)
        theirs = speculators_logits(model, aux, input_ids[1:], steps)  # (steps, n, V)
        print(f"  speculators {attention}: loaded {len(state)} tensors, {len(differ)} differ from the file"
              + (f" {differ}" if differ else ""))
        ok &= not differ
        for label, mine in (("drafter", ours), ("recomputation", recomputed)):
            for j in range(steps):
                a, b = theirs[j, : n - j], mine[j, : n - j]  # anchors whose tokens all exist
                diff, agreement, same_pattern = compare(a, b)
                scale = max(1.0, a[torch.isfinite(a)].abs().max().item())
                passed = same_pattern and diff <= tolerance * scale and agreement == 1.0
                ok &= passed
                print(f"    vs {label:13s} step {j}: max abs diff {diff:.2e} (logits up to {scale:.1f}), argmax "
                      f"agreement {agreement:.0%} of {n - j}{'' if same_pattern else ', vocabulary differs'}"
                      f"{'' if passed else '  FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="a base model folder (default: the tiny random cases)")
    p.add_argument("--heads", type=Path, help="a saved eagle drafter for --base (default: a random one)")
    p.add_argument("--steps", type=int, default=3, help="draft tokens speculators' forward unrolls")
    p.add_argument("--length", type=int, default=129,
                   help="tokens in the random sequence: 129 makes 128 anchors, whole blocks of speculators' flex mask")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest difference, relative to the logits")
    p.add_argument("--control", action="store_true",
                   help="a negative control: norm_before_residual flipped in each written config, so each case fails")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU: unfused is fine
    logger.remove()  # speculators logs each verifier file it opens
    print(", ".join(f"{name} {version(name)}" for name in ("speculators", "torch", "transformers")))
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.base is not None:
            heads_dir = args.heads
            if heads_dir is None:
                base_model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
                layers = default_eagle_layers(base_model.config.num_hidden_layers)
                heads_dir = random_drafter(base_model, layers, None, True, work / "heads")
            name = f"{args.base}, {'drafter ' + str(args.heads) if args.heads else 'random drafter'}"
            ok = check_case(name, heads_dir, args.base, work / "out", args.steps, args.length, args.tolerance,
                            args.control)
        else:
            base = tiny_base(work / "base")
            base_model = AutoModelForCausalLM.from_pretrained(base)
            for i, (name, (layers, token_map, share)) in enumerate(TINY_CASES.items()):
                heads_dir = random_drafter(base_model, layers, token_map, share, work / f"heads-{i}")
                ok &= check_case(name, heads_dir, base, work / "out", args.steps, args.length, args.tolerance,
                                 args.control)
    print("OK: speculators' logits match" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
