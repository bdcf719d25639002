"""Tiny random Gemma 4 / Gemma 3n transformers models whose per-layer embedding table is most of their bytes: the
checkpoints the transformers and vLLM tests and benches load (no download). One place for their shape."""
from __future__ import annotations


def text_model(kind: str, *, vocab: int, n_layer: int, per_layer: int, hidden: int = 64, head_dim: int = 32,
               **overrides):
    """(the causal-LM class, its text config) of a tiny `kind` model (gemma4 or gemma3n): two attention heads, one
    KV head, sliding and full attention layers in turn; a [vocab, n_layer x per_layer] per-layer table. overrides:
    config fields to set (e.g. tie_word_embeddings)."""
    import transformers
    common = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=hidden,
                  intermediate_size=2 * hidden, num_hidden_layers=n_layer, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=head_dim, hidden_size_per_layer_input=per_layer, sliding_window=16,
                  layer_types=["sliding_attention", "full_attention"] * (n_layer // 2))
    common.update(overrides)
    if kind == "gemma4":
        return transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig(**common)
    if kind == "gemma3n":
        return transformers.Gemma3nForCausalLM, transformers.Gemma3nTextConfig(
            laurel_rank=8, altup_num_inputs=2, num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * n_layer,
            **common)
    raise ValueError(f"kind is gemma4 or gemma3n, got {kind!r}")


def add_noise(model, seed: int = 0, scale: float = 0.05):
    """Noise on every parameter (in place; returns the model): Gemma 3n initializes its altup output scale to 0,
    which would cut the per-layer inputs off from the logits, and tests comparing them could not fail."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


# a plain chat template (role: content lines, then the assistant's turn): what a chat request is rendered with
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def byte_tokenizer(path) -> None:
    """Save a byte-level tokenizer to `path` (tokenizer.json + tokenizer_config.json, loadable offline by
    AutoTokenizer): ids 0-3 are Gemma's <pad>, <eos>, <bos>, <unk> (the ids its configs name), then one id per byte,
    so any text round-trips; CHAT_TEMPLATE renders chat requests (a server's /v1/chat/completions needs one).
    Byte-level BPE without merges: `tokenizers` builds it, nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>", chat_template=CHAT_TEMPLATE).save_pretrained(path)


def tiny(kind: str, path, vocab: int = 65536, n_layer: int = 4, per_layer: int = 128, seed: int = 0,
         multimodal: bool = False, tokenizer: bool = False) -> str:
    """A tiny random `kind` checkpoint saved to `path` (float32); multimodal: Gemma 4 with a one-layer vision
    tower (Gemma4ForConditionalGeneration); tokenizer: with `byte_tokenizer` beside it."""
    import torch
    import transformers
    cls, text = text_model(kind, vocab=vocab, n_layer=n_layer, per_layer=per_layer)
    torch.manual_seed(seed)
    if multimodal:
        if kind != "gemma4":
            raise ValueError("multimodal: gemma4 only")
        vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
            text_config=text.to_dict(), vision_config=vision, audio_config=None))
    else:
        model = cls(text)
    add_noise(model, seed + 1).eval().save_pretrained(path)
    if tokenizer:
        byte_tokenizer(path)
    return str(path)
