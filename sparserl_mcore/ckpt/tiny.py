"""Tiny random-weight HF checkpoints for tests and demos, built offline from a config.

Every parameter is drawn from a seeded generator, including norm weights and biases (which HF
initialises to ones/zeros): a layout bug that swaps two norms or drops a bias would otherwise be
invisible to round-trip and parity tests. The tokenizer is character level over printable ASCII
plus newline and tab, so digits, arithmetic and punctuation encode one character per token and
decode back exactly, and it needs no download.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import string

from model_providers.hf_config import ARCHITECTURES
from sparserl_mcore.ckpt.atomic import atomic_output_dir

# The tokenizer's special tokens; ids 0..2, before the characters.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARACTERS = tuple(string.printable[:95]) + ("\n", "\t")  # printable[:95]: digits..punctuation+space
TOKENIZER_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Shape of a random HF checkpoint; defaults give a ~1 MB model that runs in milliseconds."""

    arch: str = "qwen2"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # default hidden // heads (qwen3 stores it explicitly)
    ffn: int = 128
    vocab: int = 128
    tie_embeddings: bool = False
    seed: int = 0
    dtype: str = "float32"
    max_shard_size: str | None = None  # e.g. "200KB": force a sharded safetensors + index json
    # mixture-of-experts families only (qwen3_moe, qwen2_moe): experts, top-k, widths
    experts: int = 4
    top_k: int = 2
    expert_ffn: int = 32
    shared_expert_ffn: int = 48  # qwen2_moe's shared expert

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r} is not supported; choose from {sorted(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose from {DTYPES}")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "experts", "top_k", "expert_ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"head_dim={self.head_dim} must be >= 1 (or None: hidden // heads)")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; set head_dim")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} must be <= experts={self.experts}")
        if self.vocab < TOKENIZER_SIZE:
            raise ValueError(f"vocab={self.vocab} is smaller than the tokenizer ({TOKENIZER_SIZE} tokens)")


def hf_config(cfg: TinyModelConfig):
    """The transformers config object for `cfg` (also used by tests as the HF reference)."""
    import transformers

    traits = ARCHITECTURES[cfg.arch]
    fields = dict(
        num_hidden_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim or cfg.hidden // cfg.heads,
        intermediate_size=cfg.ffn,
        vocab_size=cfg.vocab,
        tie_word_embeddings=cfg.tie_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        **copy.deepcopy(dict(traits.tiny_fields)),  # transformers may edit nested dicts
    )
    fields.setdefault("max_position_embeddings", 2048)
    if traits.moe:
        fields.update(
            num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_ffn
        )
        if traits.shared_expert:
            fields["shared_expert_intermediate_size"] = cfg.shared_expert_ffn
    config = getattr(transformers, traits.config_class)(**fields)
    config.dtype = cfg.dtype
    return config


def build_tokenizer():
    """A character-level fast tokenizer (no merges, no download); unknown characters map to eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level symbols (space -> "Ġ", newline -> "Ċ"): transformers re-creates Qwen2's byte-level
    # pipeline around the vocab whatever tokenizer_config.json says, so the vocab must be in that form.
    byte_symbol = _byte_level_alphabet()
    symbols = [byte_symbol[ord(ch)] for ch in CHARACTERS]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(symbols))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[0]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        unk_token=SPECIAL_TOKENS[0],
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the one tokenizers' ByteLevel uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shift)
            shift += 1
    return table


def _randomize(model, seed: int) -> None:
    """Overwrite every parameter: matrices ~N(0, 0.02), norms ~1+N(0, 0.1), biases ~N(0, 0.02),
    MoE routers ~N(0, 0.2): at 0.02 the router logits of a tiny model are nearly tied, and a
    selection decided by rounding noise would make every parity test flaky (trained routers are
    decisive too)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            base = 1.0 if name.endswith("norm.weight") else 0.0
            scale = 0.1 if base else (0.2 if name.endswith("mlp.gate.weight") else 0.02)
            param.copy_(base + scale * noise)


def make_tiny(cfg: TinyModelConfig, out: str | os.PathLike, *, overwrite: bool = False) -> pathlib.Path:
    """Write config.json, safetensors weights and tokenizer files for `cfg` to `out` atomically."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one tiny shard: no "Writing model shards" bar
    config = hf_config(cfg)
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, cfg.seed)
    model = model.to(getattr(torch, cfg.dtype))
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        kwargs = {"max_shard_size": cfg.max_shard_size} if cfg.max_shard_size else {}
        model.save_pretrained(tmp, **kwargs)
        build_tokenizer().save_pretrained(tmp)
        (tmp / "sparserl_tiny.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    return pathlib.Path(out)
