"""Qwen's ChatML special tokens and chat template, shared by the generated tokenizers."""

from __future__ import annotations

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Every message is framed by <|im_start|>role\n ... <|im_end|>\n and the generation prompt opens an
# assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
