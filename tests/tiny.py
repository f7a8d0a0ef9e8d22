"""Tiny random models and a tiny chat tokenizer, built in-process (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VOCAB_SIZE = 320  # model vocabulary; the tokenizer uses fewer ids (up to 300)


def tiny_config(arch: str, vocab_size: int = VOCAB_SIZE, **overrides):
    """A 2-4 layer random config of ``arch`` in {llama, qwen2, gpt2, mistral, gemma3}."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=8)
    elif arch == "gemma3":
        common.update(num_hidden_layers=4, head_dim=16)
        cfg = Gemma3TextConfig(**common, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                               query_pre_attn_scalar=16)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random tiny causal LM in eval mode, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    # Larger-than-default init makes logits peaky, so greedy paths are not decided by near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return model.eval()


def tiny_tokenizer():
    """A byte-level BPE tokenizer with a ChatML chat template, trained in-process on a few sentences.

    Special tokens: ``<pad>`` 0, ``<s>`` 1, ``<|im_end|>`` 2 (EOS), ``<|im_start|>`` 3.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "user assistant system", "Medusa heads predict tokens ahead"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def save_tiny(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny model and the tiny tokenizer as a Hugging Face folder; returns the folder."""
    model = tiny_model(arch, seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return Path(path)


def save_cli_files(root: Path, prompts: list[dict], num_heads: int = 3, seed: int = 0) -> tuple[Path, Path]:
    """What the CLI tests run on: a tiny Llama folder ``root/base``, random Medusa heads for it in ``root/heads``
    (small weights, so some drafts are accepted) and ``root/prompts.jsonl``. Returns ``(base, prompts)``."""
    import json

    import torch

    from medusa.drafters.heads import MedusaHeads, MedusaHeadsConfig, lm_head_fingerprint
    from medusa.io.checkpoint import save_heads

    base = save_tiny(root / "base", "llama")
    weight = tiny_model("llama").get_output_embeddings().weight
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=num_heads,
                               lm_head_fingerprint=lm_head_fingerprint(weight))
    torch.manual_seed(seed)
    heads = MedusaHeads(config, weight)
    for p in heads.parameters():
        p.data.normal_(0, 0.05)
    save_heads(heads, root / "heads")
    path = root / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in prompts) + "\n")
    return base, path
