"""Tokenizers: text <-> token ids, the chat-template prompt and the stop ids.

This module owns the one interface the trainer, the sampler and the reward pool use
(`Tokenizer`) and its two implementations:
  * `CharTokenizer`: the procedural default. Ids: 0 pad, 1 eos (the only stop id), 2 "\\n",
    then printable ASCII (" " .. "~"), 98 ids in all. Prompt rendering is "{user_text}\\n".
  * `HfTokenizer`: a Hugging Face checkpoint directory: `tokenizers.Tokenizer.from_file(
    "tokenizer.json")` and the chat template of `tokenizer_config.json` (or `chat_template.jinja`)
    rendered with jinja2 exactly as transformers' `apply_chat_template` does (sandboxed
    environment with trim_blocks / lstrip_blocks, its `tojson`, `raise_exception`,
    `strftime_now`; the named special tokens passed as variables), then encoded without added
    special tokens, as transformers does. Stop ids: `generation_config.json` `eos_token_id` (an
    int or a list) then the tokenizer's eos token; pad id: the config's `pad_token`, else the
    first stop id.

Invariants: `decode` drops pad and stop ids, so a completion decodes to its text alone;
`encode_completion(text)` ends with `stop_ids[0]` (the SFT demonstration ends the turn); both
tokenizers pickle (the reward pool's workers call `decode` in other processes).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

from espo import errors

PAD_ID = 0
EOS_ID = 1
_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # "\n", then printable ASCII
_CHAR_TO_ID = {ch: i + 2 for i, ch in enumerate(_ALPHABET)}
_REPLACEMENT = "\ufffd"  # what `CharTokenizer.decode` shows for an id outside its alphabet

# transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the variables `apply_chat_template` passes.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer(Protocol):
    vocab_size: int  # ids are in [0, vocab_size)
    pad_id: int
    stop_ids: tuple[int, ...]  # generation stops at any of them; [0] ends an SFT demonstration

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...  # drops pad and stop ids

    def encode_prompt(self, user_text: str) -> list[int]: ...  # chat template + generation prompt

    def encode_completion(self, text: str) -> list[int]: ...  # text, then stop_ids[0]


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokenizer over "\\n" and printable ASCII; see the module docstring."""

    vocab_size: int = dataclasses.field(default=2 + len(_ALPHABET), init=False)
    pad_id: int = dataclasses.field(default=PAD_ID, init=False)
    stop_ids: tuple[int, ...] = dataclasses.field(default=(EOS_ID,), init=False)

    def encode(self, text: str) -> list[int]:
        ids = []
        for position, ch in enumerate(text):
            token = _CHAR_TO_ID.get(ch)
            if token is None:
                raise ValueError(
                    f"CharTokenizer.encode: character {ch!r} (U+{ord(ch):04X}) at position "
                    f"{position} is not in the alphabet; valid: printable ASCII and '\\n'"
                )
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without pad and eos; an id outside the alphabet (a model whose vocab
        is larger than 98 can sample one) shows as U+FFFD, so a reward sees a wrong answer
        rather than a crash."""
        chars = []
        for token in ids:
            token = int(token)
            if token in (PAD_ID, EOS_ID):
                continue
            index = token - 2
            chars.append(_ALPHABET[index] if 0 <= index < len(_ALPHABET) else _REPLACEMENT)
        return "".join(chars)

    def render_prompt(self, user_text: str) -> str:
        return f"{user_text}\n"

    def encode_prompt(self, user_text: str) -> list[int]:
        return self.encode(self.render_prompt(user_text))

    def encode_completion(self, text: str) -> list[int]:
        return self.encode(text) + [EOS_ID]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        directory, name = os.path.split(path)
        raise errors.CheckpointError(directory, name, valid="present (a Hugging Face dir)")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"HfTokenizer: {path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"HfTokenizer: {path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a str or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_chat_template(template: str):
    """`template` compiled the way transformers' `_compile_jinja_template` does."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: Jinja's own filter escapes HTML characters.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class HfTokenizer:
    """A Hugging Face tokenizer directory; see the module docstring. Build with `from_dir`."""

    def __init__(
        self,
        *,
        tokenizer: Any,  # a `tokenizers.Tokenizer`
        chat_template: str,
        special_tokens: dict[str, str],
        stop_ids: Sequence[int],
        pad_id: int,
        path: str = "",
    ) -> None:
        self.path = path
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.pad_id = int(pad_id)
        self._tokenizer = tokenizer
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        if not self.stop_ids:
            raise ValueError(f"HfTokenizer({path!r}): no stop ids")
        for name, ids in (("stop_ids", self.stop_ids), ("pad_id", (self.pad_id,))):
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(
                    f"HfTokenizer({path!r}): {name} {bad} are outside the tokenizer's "
                    f"{self.vocab_size} ids"
                )
        self._drop = frozenset(self.stop_ids) | {self.pad_id}
        self._template = None

    @classmethod
    def from_dir(cls, path: str) -> HfTokenizer:
        """The tokenizer of checkpoint directory `path` (tokenizer.json, tokenizer_config.json,
        generation_config.json; the chat template may also sit in chat_template.jinja)."""
        import tokenizers

        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise errors.CheckpointError(
                path, "tokenizer.json", valid="present (a Hugging Face dir)"
            )
        tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
        config_file = os.path.join(path, "tokenizer_config.json")
        config = _read_json(config_file)
        generation = _read_json(os.path.join(path, "generation_config.json"))

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if not isinstance(template, str) or not template:
            raise errors.CheckpointError(
                config_file, "chat_template", template,
                f"a Jinja chat template string (or a file {jinja_file})",
            )  # fmt: skip

        special_tokens = {}
        for name in _SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                special_tokens[name] = text

        def token_id(name: str) -> int:
            token = tokenizer.token_to_id(special_tokens[name])
            if token is None:
                raise errors.CheckpointError(
                    config_file, name, special_tokens[name], f"a token of {tokenizer_file}"
                )
            return token

        eos = generation.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in eos
        ):
            raise errors.CheckpointError(
                os.path.join(path, "generation_config.json"), "eos_token_id", eos,
                "an int or a list of ints",
            )  # fmt: skip
        stop_ids = list(dict.fromkeys(eos))
        if "eos_token" in special_tokens and token_id("eos_token") not in stop_ids:
            stop_ids.append(token_id("eos_token"))
        if not stop_ids:
            raise ValueError(
                f"HfTokenizer: no stop ids in {path}: generation_config.json has no "
                "eos_token_id and tokenizer_config.json no eos_token"
            )
        pad_id = token_id("pad_token") if "pad_token" in special_tokens else stop_ids[0]
        return cls(
            tokenizer=tokenizer,
            chat_template=template,
            special_tokens=special_tokens,
            stop_ids=stop_ids,
            pad_id=pad_id,
            path=path,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens added around it (no BOS)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without pad and stop ids (other special tokens are kept as text)."""
        kept = [int(i) for i in ids if int(i) not in self._drop]
        return self._tokenizer.decode(kept, skip_special_tokens=False)

    def render_prompt(self, user_text: str) -> str:
        """The chat template applied to one user message, with the generation prompt."""
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        return self._template.render(
            messages=[{"role": "user", "content": user_text}],
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self.special_tokens,
        )

    def encode_prompt(self, user_text: str) -> list[int]:
        return self.encode(self.render_prompt(user_text))

    def encode_completion(self, text: str) -> list[int]:
        return self.encode(text) + [self.stop_ids[0]]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_template"] = None  # a compiled jinja template does not pickle; recompiled lazily
        return state

    def __repr__(self) -> str:
        return (
            f"HfTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, "
            f"stop_ids={self.stop_ids}, pad_id={self.pad_id})"
        )


def load_tokenizer(hf_path: str = "") -> Tokenizer:
    """The tokenizer of checkpoint directory `hf_path`; "" gives the `CharTokenizer`."""
    return HfTokenizer.from_dir(hf_path) if hf_path else CharTokenizer()


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raise unless every id of `tokenizer` indexes the model's vocabulary of `vocab_size`."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise errors.InvalidValue("check_vocab", "vocab_size", vocab_size, "an int >= 1")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{vocab_size}: token ids would index past the embedding; valid: "
            f"model.vocab_size >= {tokenizer.vocab_size}"
        )
