"""Prompts for sampling: text checked and encoded to ids that fit the model's context, and the
token that ends a sample.

    >>> from tokenizer import CharTokenizer
    >>> tok = CharTokenizer.train("abc", special_tokens=["<|endoftext|>"])
    >>> encode_prompt(tok, "cab", block_size=8), encode_prompt(tok, "", block_size=8)
    ([2, 0, 1], [3])
"""

from __future__ import annotations

from plumbing.errors import UsageError

END_OF_TEXT = "<|endoftext|>"


def check_text(prompt: str) -> None:
    """Refuse a prompt that is not valid Unicode text: bytes that were not UTF-8 reach Python
    (command line, stdin) as lone surrogates, which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = prompt[err.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        offset = len(prompt[: err.start].encode("utf-8", "surrogateescape"))
        raise UsageError(
            f"the prompt is not valid UTF-8 ({what} at byte {offset}): pass the prompt as UTF-8 "
            "text"
        ) from None


def encode_prompt(tokenizer, prompt: str, block_size: int | None) -> list[int]:
    """Token ids of a prompt; an empty one is the end-of-text token when the tokenizer has it.
    With `block_size`, a prompt longer than that context is refused (check_prompt_length);
    None leaves the length to the caller's own limit (the server's)."""
    check_text(prompt)
    ids = tokenizer.encode(prompt)
    if not ids:
        eot = stop_token_of(tokenizer)
        if eot is None:
            # (the message reaches --inference and the server alike: it names no flag)
            raise UsageError(
                "the prompt is empty, and this tokenizer has no end-of-text token to stand for "
                "one: give some text"
            )
        ids = [eot]
    if block_size is not None:
        check_prompt_length(len(ids), block_size)
    return ids


def check_prompt_length(tokens: int, block_size: int) -> None:
    """UsageError when a prompt of `tokens` tokens is longer than the model's context."""
    if tokens > block_size:
        raise UsageError(
            f"the prompt is {tokens} tokens, longer than the model's context of {block_size} "
            "tokens: shorten it"
        )


def stop_token_of(tokenizer) -> int | None:
    """The id of the end-of-text token, which ends a sample, when the tokenizer has one."""
    if END_OF_TEXT in getattr(tokenizer, "special_tokens", ()):
        return tokenizer.token_to_id(END_OF_TEXT)
    return None
