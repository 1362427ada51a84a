"""Prompt text and token counts for a parsed request, using the served model's tokenizer."""

from __future__ import annotations

from typing import Any

from tokenrouter.serving.openai.errors import OpenAIError
from tokenrouter.serving.openai.protocol import GenerationRequest


def load_frontend_tokenizer(tokenizer_dir: str) -> Any:
    """The tokenizer in `tokenizer_dir` (loaded the way the engine loads it); ValueError if there is none."""
    from tokenrouter.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files in {tokenizer_dir!r}")
    return tokenizer


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text for `messages`: the tokenizer's chat template with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("the served tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 raises TemplateError for e.g. roles a template refuses
        raise OpenAIError(f"the chat template rejected the messages: {e}", param="messages") from None


def count_tokens(tokenizer: Any, text: str) -> int:
    """Token count the same way the engine tokenizes string prompts (`tokenizer(text)["input_ids"]`)."""
    return len(tokenizer(text)["input_ids"])


def prepare_prompt(req: GenerationRequest, tokenizer: Any) -> tuple[str, int]:
    """(prompt text to send, prompt token count) for a parsed request."""
    prompt = render_chat_prompt(tokenizer, req.messages or []) if req.kind == "chat" else req.prompt or ""
    return prompt, count_tokens(tokenizer, prompt)
