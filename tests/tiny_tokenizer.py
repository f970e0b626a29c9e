"""A tiny byte-level BPE tokenizer for the tiny models (vocabulary 512), trained in-process.

Nothing is downloaded.  Ids 0-2 are ``<pad>``, ``<s>``, ``</s>``, matching ``tests/tiny_models.py``
(pad 0, bos 1, eos 2).  Byte-level, so every string can be encoded, which the grammar library needs
(it maps each token to its bytes).  The chat template renders Hermes-style tools (``<tools>`` in the
system turn, ``<tool_call>`` / ``<tool_response>`` blocks), as Qwen2.5 and Hermes models do.
"""

from __future__ import annotations

import functools

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    '{"name": "Ada", "age": 36, "role": "admin", "tags": ["math", "code"]}',
    '{"city": "Paris", "zip": "75001", "country": "France", "items": [1, 2, 3]}',
    "The quick brown fox jumps over the lazy dog. What is the weather in Paris today?",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "You are a helpful assistant. You may call one or more functions to assist with the user query.",
    "user assistant system tool yes no true false null 0123456789 answer question",
]

HERMES_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": '
    "{%- if call.function.arguments is string %}{{ call.function.arguments }}"
    "{%- else %}{{ call.function.arguments | tojson }}{%- endif %}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# The same conversation layout without any notion of tools: the server must refuse ``tools`` with it.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@functools.lru_cache(maxsize=4)
def _trained(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 512, chat_template: str | None = HERMES_CHAT_TEMPLATE):
    """A fresh ``PreTrainedTokenizerFast`` (eos ``</s>`` = 2, pad ``<pad>`` = 0) with ``chat_template``."""
    inner = Tokenizer.from_str(_trained(vocab_size))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = chat_template
    assert fast.convert_tokens_to_ids(SPECIAL[:3]) == [0, 1, 2]
    assert len(fast) <= vocab_size
    return fast
