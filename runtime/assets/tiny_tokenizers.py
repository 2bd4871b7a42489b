"""Tokenizers of the tiny pipelines, built offline by the ``tokenizers`` library and wrapped in
the tokenizer classes the pipelines expect (``CLIPTokenizer``, ``T5Tokenizer``,
``Qwen2Tokenizer``), with the prompt templates their pipelines read. See ``pipelines.py``.

Pitfalls (transformers 5): the tokenizer classes take a vocabulary directly (``vocab=`` and
``merges=``; ``T5Tokenizer`` a list of ``(piece, score)``); CLIP pools at the highest token id
when ``eos_token_id`` is 2, so ``<|endoftext|>`` is the last id; Qwen-Image's ``encode_prompt``
drops a fixed 34 template tokens.
"""

from __future__ import annotations

SEED = 0
WORDS = (
    "a photo of the digit zero one two three four five six seven eight nine "
    "handwritten white on black small big"
).split()
"""The tiny tokenizers' words: enough for the digits captions and the sample prompts."""

QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
"""QwenImagePipeline's prompt template: its ``encode_prompt`` drops the first 34 tokens (the
system part), so the tiny tokenizer must give exactly 34 tokens for it, as Qwen's does."""


def _bpe_vocab(words: list[str], start: list[str], end: list[str]) -> tuple[dict, list]:
    """A byte-level-free BPE vocabulary and merges in which every word of ``words`` is one
    token (``word</w>``), built by merging its characters left to right."""
    vocab: dict[str, int] = {t: i for i, t in enumerate(start)}
    merges: list[tuple[str, str]] = []

    def add(token: str) -> None:
        if token not in vocab:
            vocab[token] = len(vocab)

    for c in sorted(set("".join(words))):
        add(c)
        add(c + "</w>")
    for word in words:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            if (pieces[0], pieces[1]) not in merges:
                merges.append((pieces[0], pieces[1]))
            add(merged)
            pieces = [merged] + pieces[2:]
    for token in end:
        add(token)
    return vocab, merges


def clip_tokenizer(words: list[str] = WORDS):
    """``CLIPTokenizer`` whose ``<|endoftext|>`` is the highest id (CLIP pools there)."""
    from transformers import CLIPTokenizer

    vocab, merges = _bpe_vocab(words, ["<|startoftext|>"], ["<|endoftext|>"])
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer(words: list[str] = WORDS):
    """``T5TokenizerFast`` from a unigram vocabulary of ``(piece, score)`` pairs (no extra ids)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(f"\u2581{w}", -1.0) for w in words]
    pieces += [(c, -5.0) for c in sorted(set("".join(words)))]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def qwen_tokenizer(words: list[str] = WORDS):
    """``Qwen2Tokenizer`` (byte-level BPE) trained by the ``tokenizers`` library on the template
    and ``words``: every word one token, ``<|im_start|>`` / ``<|im_end|>`` special."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = QWEN_TEMPLATE.format(" ".join(words))
    for token in specials:
        text = text.replace(token, "")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # more than the corpus can fill: every word becomes one token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    bpe.train_from_iterator([text] * 50, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, model_max_length=1058)
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tok


QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""Qwen3's chat template, reduced to what ``ZImagePipeline._encode_prompt`` uses (a user turn,
the generation prompt, ``enable_thinking``)."""
