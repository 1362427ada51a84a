"""Prompt text and token counts for a parsed request, using the served model's tokenizer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenrouter.serving.openai.errors import OpenAIError
from tokenrouter.serving.openai.protocol import GenerationRequest

if TYPE_CHECKING:  # (tokenrouter.tokenizer imports transformers; this package stays light to import)
    from tokenrouter.tokenizer import PromptCharBound

# Past any real context: transformers sets `model_max_length` to 1e30 when the tokenizer files name no limit.
_NO_LIMIT = 10**12


def load_frontend_tokenizer(tokenizer_dir: str) -> Any:
    """The tokenizer in `tokenizer_dir` (loaded the way the engine loads it); ValueError if there is none."""
    from tokenrouter.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files in {tokenizer_dir!r}")
    return tokenizer


def tokenizer_context_limit(tokenizer: Any) -> int | None:
    """The context limit a tokenizer declares (`model_max_length`), or None when it declares none."""
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < _NO_LIMIT else None


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text for `messages`: the tokenizer's chat template with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("the served tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 raises TemplateError for e.g. roles a template refuses
        raise OpenAIError(f"the chat template rejected the messages: {e}", param="messages") from None


def count_tokens(tokenizer: Any, text: str) -> int:
    """Token count the same way the engine tokenizes string prompts."""
    from tokenrouter.tokenizer import encode_prompt  # (loaded with the tokenizer: load_frontend_tokenizer)

    return len(encode_prompt(tokenizer, text))


def _check_chars(bound: PromptCharBound | None, num_chars: int, what: str, param: str) -> None:
    if bound is None:
        return
    try:
        bound.check(num_chars, what)
    except ValueError as e:
        raise OpenAIError(str(e), param=param) from None


def text_size(req: GenerationRequest) -> int:
    """Characters of prompt text a request carries before any template: its prompt, or every string of its
    messages (roles and names reach the template too, not only the content)."""
    if req.kind == "chat":
        return sum(len(v) for m in req.messages or [] for v in m.values())
    return len(req.prompt or "")


def prepare_prompt(req: GenerationRequest, tokenizer: Any, bound: PromptCharBound | None = None,
                   turn: Callable[[int], contextlib.AbstractContextManager] | None = None) -> tuple[str, int]:
    """(prompt text to send, prompt token count) for a parsed request.

    With `bound` (the router's own rule), a prompt the context cannot hold is a 400 before anything is
    tokenized: tokenizing megabytes takes seconds and gigabytes, for a request the router refuses anyway.
    `turn(chars)`: entered around the tokenizing of the prompt text as sent (the chat template's included), for
    that text's length.
    """
    if req.kind == "chat":
        _check_chars(bound, text_size(req), "the messages' text", "messages")
        prompt = render_chat_prompt(tokenizer, req.messages or [])
        # The template adds text per message: many empty messages can still make an over-long prompt.
        _check_chars(bound, len(prompt), "the chat prompt (the messages in the chat template)", "messages")
    else:
        prompt = req.prompt or ""
        _check_chars(bound, text_size(req), "prompt", "prompt")
    with turn(len(prompt)) if turn is not None else contextlib.nullcontext():
        return prompt, count_tokens(tokenizer, prompt)


def check_context(req: GenerationRequest, prompt_tokens: int, max_model_len: int | None) -> None:
    """Against a context limit the operator stated: a 400 for a prompt it cannot hold with one token after it (as
    the router answers against the deployment's), and for an output limit the client set that it cannot hold after
    the prompt (as OpenAI's API and vLLM's answer it; the engine would stop at the context limit instead, short of
    what was asked). An unset output limit is capped."""
    if not max_model_len:
        return
    if prompt_tokens >= max_model_len:
        raise OpenAIError(f"prompt has {prompt_tokens} tokens, but the context limit is {max_model_len} (prompt plus "
                          "at least one generated token)", param="messages" if req.kind == "chat" else "prompt")
    key = req.max_tokens_key
    asked, room = req.sampling["max_tokens"], max_model_len - prompt_tokens
    if key is not None and asked > room:
        raise OpenAIError(
            f"'{key}' is {asked}, but the prompt has {prompt_tokens} tokens and the context limit is "
            f"{max_model_len}: at most {room} tokens can follow it", param=key)
