"""Prompt tokenization, done the way mlx-lm's generate does it so both see the same ids."""

from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_text(tokenizer, prompt: str) -> list[int]:
    bos = tokenizer.bos_token
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
