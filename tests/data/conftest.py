"""Fixtures of the data tests: toy sources, JSONL files and a tiny Hugging Face tokenizer dir.

The helpers are handed out as fixtures (the tests import with --import-mode=importlib, so a
conftest is not importable).
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from espo.data import examples, sources

# A Qwen-style chat template (the shape of Qwen3's: an optional system turn, a namespace scan
# for the last user query, im_start / im_end turns, the assistant generation prompt and the
# `enable_thinking` switch).
QWEN_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# A Mixtral-style template: reads bos_token / eos_token and calls raise_exception.
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Exercises what transformers' environment adds: trim_blocks / lstrip_blocks (indented block
# tags on their own lines), its HTML-safe `tojson`, loop controls, namespaces, special tokens.
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ message['role'] }}> {{ message['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}
    <assistant n={{ ns.n }} eos={{ eos_token }} unk={{ unk_token }}>
{% endif %}"""

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIXTRAL_SPECIALS = ("<unk>", "<s>", "</s>")
_CORPUS = [
    "State the final answer to the following arithmetic problem: 4 - 1 =",
    "What is 12 + 30? Answer with a number. The answer is 42.",
    'system user assistant think <think> </think> [INST] [/INST] {"a": [1, 2]}',
]


def _make_examples(n: int, *, prefix: str = "test:toy") -> list[examples.Example]:
    return [
        examples.Example(
            id=f"{prefix}:{i}",
            prompt=f"prompt {i}",
            answer=str(i),
            difficulty=math.nan,
            meta={"answer": str(i), "task": "toy"},
        )
        for i in range(n)
    ]


def _make_source(n: int, *, num_skipped: int = 0) -> sources.Source:
    return sources.Source(name="toy", examples=_make_examples(n), num_skipped=num_skipped)


def _write_lines(path: pathlib.Path, lines: list) -> pathlib.Path:
    """A JSONL file: dicts are dumped as JSON, strings written as they are (bad lines)."""
    text = "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def _write_hf_tokenizer(
    path: pathlib.Path,
    *,
    style: str = "qwen",  # qwen | mixtral | features
    eos_token_id="list",
    pad_token: str | None = "<|endoftext|>",
    chat_template_in_jinja_file: bool = False,
) -> pathlib.Path:
    """A tiny byte-level BPE `tokenizer.json` with a chat template (tokenizer_config.json) and a
    generation_config.json, as a Hugging Face checkpoint directory holds them."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = QWEN_SPECIALS if style == "qwen" else MIXTRAL_SPECIALS
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    if style != "qwen":  # Llama / Mistral style: the tokenizer itself adds BOS by default
        bos = ("<s>", tok.token_to_id("<s>"))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if style == "qwen":
        config = {"eos_token": "<|im_end|>", "pad_token": pad_token, "bos_token": None}
        template = QWEN_TEMPLATE
        ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    else:
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        template = MIXTRAL_TEMPLATE if style == "mixtral" else FEATURES_TEMPLATE
        ids = [tok.token_to_id("</s>")]
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template_in_jinja_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    eos = {"list": ids, "int": ids[-1]}[eos_token_id]
    generation = {"eos_token_id": eos, "bos_token_id": None}
    (path / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return path


@pytest.fixture
def make_source():
    """`make_source(n, num_skipped=0)`: a Source of n toy Examples ("prompt i" -> "i")."""
    return _make_source


@pytest.fixture
def write_lines():
    """`write_lines(path, lines)`: a JSONL file; dicts dumped, strings written as they are."""
    return _write_lines


@pytest.fixture
def write_hf_tokenizer():
    """`write_hf_tokenizer(dir, style="qwen" | "mixtral" | "features", ...)`: a tiny
    tokenizer checkpoint dir."""
    return _write_hf_tokenizer
