"""espo.data.tokenizer: the character tokenizer, the Hugging Face tokenizer against transformers'
own `apply_chat_template`, stop / pad ids, pickling and the vocabulary check."""

import json
import pickle
import re

import pytest

from espo import errors
from espo.data import tokenizer as tokenizer_lib
from espo.testing import raises_invalid

_PROMPTS = [
    "What is 4 - 1?",
    "  leading spaces, trailing newline\n",
    'Unicode: caf\u00e9 \u2212 \u00bd, JSON {"a": [1, 2]}, tab\there',
    "Line one\nLine two <think> </think>",
]

# ---- CharTokenizer -------------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_ids():
    tok = tokenizer_lib.CharTokenizer()
    alphabet = "\n" + "".join(chr(c) for c in range(32, 127))
    ids = tok.encode(alphabet)
    assert ids == list(range(2, 98)) and tok.vocab_size == 98
    assert (tok.pad_id, tok.stop_ids) == (0, (1,))
    assert tok.decode(ids) == alphabet
    text = "State the final answer: 4 - 1 =\n3"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_prompt("2+2") == tok.encode("2+2\n")
    assert tok.encode_completion("4") == tok.encode("4") + [1]
    # decode drops pad and eos, shows an id outside the alphabet as U+FFFD
    assert tok.decode([0, *tok.encode("ab"), 1, 0, 0]) == "ab"
    assert tok.decode([*tok.encode("a"), 98, 300, -1]) == "a\ufffd\ufffd\ufffd"
    assert pickle.loads(pickle.dumps(tok)) == tok


@pytest.mark.parametrize(
    "text, char, position", [("a\tb", "'\\t'", 1), ("x = \u00bd", "'\u00bd'", 4)]
)
def test_char_tokenizer_names_a_foreign_character(text, char, position):
    with pytest.raises(
        ValueError, match=rf"character {re.escape(char)} .* at position {position} "
    ):
        tokenizer_lib.CharTokenizer().encode(text)


def test_load_tokenizer_default_is_char():
    assert isinstance(tokenizer_lib.load_tokenizer(""), tokenizer_lib.CharTokenizer)


# ---- HfTokenizer vs transformers -----------------------------------------------------------


@pytest.mark.parametrize("style", ["qwen", "mixtral", "features"])
def test_hf_tokenizer_matches_transformers_chat_template(tmp_path, write_hf_tokenizer, style):
    import transformers

    path = write_hf_tokenizer(tmp_path / style, style=style)
    ours = tokenizer_lib.load_tokenizer(str(path))
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    for prompt in _PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = theirs.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ours.render_prompt(prompt) == text
        assert ours.encode_prompt(prompt) == list(ids)
        assert ours.encode(prompt) == theirs.encode(prompt, add_special_tokens=False)
    if style == "qwen":
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    elif style == "mixtral":
        assert text.startswith("<s>[INST] ")  # bos_token reaches the template
    else:
        assert '<user> "Line one\\nLine two <think> </think>"\n' in text  # tojson, no escaping
        assert text.endswith("<assistant n=1 eos=</s> unk=<unk>>\n")


def test_hf_tokenizer_stop_and_pad_ids(tmp_path, write_hf_tokenizer):
    tok = tokenizer_lib.HfTokenizer.from_dir(str(write_hf_tokenizer(tmp_path / "a")))
    raw = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in raw["added_tokens"]}
    im_end, eot = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    assert tok.stop_ids == (im_end, eot)  # generation_config's list (holds the eos token)
    assert tok.pad_id == eot  # tokenizer_config's pad_token
    assert tok.vocab_size == max(raw["model"]["vocab"].values()) + 1
    text = "the answer is 42."
    assert tok.encode_completion(text) == tok.encode(text) + [im_end]
    assert tok.decode([*tok.encode(text), im_end, eot, eot]) == text
    assert tok.decode(tok.encode_prompt("hi")) == "<|im_start|>user\nhi\n<|im_start|>assistant\n"

    # eos_token_id an int (not the tokenizer's eos token); no pad_token: pad = first stop id
    path = write_hf_tokenizer(tmp_path / "b", eos_token_id="int", pad_token=None)
    tok = tokenizer_lib.HfTokenizer.from_dir(str(path))
    assert tok.stop_ids == (eot, im_end) and tok.pad_id == eot
    # decode drops every stop id, not only the first (the pad): a turn may end on the second
    assert tok.decode([*tok.encode(text), im_end]) == text


def test_hf_tokenizer_pickles_and_reads_chat_template_jinja(tmp_path, write_hf_tokenizer):
    path = write_hf_tokenizer(tmp_path / "j", chat_template_in_jinja_file=True)
    tok = tokenizer_lib.load_tokenizer(str(path))
    expected = tok.encode_prompt(_PROMPTS[2])  # compiles (and caches) the template first
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode_prompt(_PROMPTS[2]) == expected
    assert again.decode(expected) == tok.decode(expected)
    assert (again.stop_ids, again.pad_id, again.vocab_size) == (
        tok.stop_ids,
        tok.pad_id,
        tok.vocab_size,
    )


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
)
def test_hf_tokenizer_missing_file_is_named(tmp_path, write_hf_tokenizer, name):
    path = write_hf_tokenizer(tmp_path / "m")
    (path / name).unlink()
    with raises_invalid(name, where=str(path), kind=errors.CheckpointError):
        tokenizer_lib.load_tokenizer(str(path))


def test_hf_tokenizer_bad_configs(tmp_path, write_hf_tokenizer):
    path = write_hf_tokenizer(tmp_path / "c")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    with raises_invalid("chat_template", where=str(path / "tokenizer_config.json")):
        tokenizer_lib.load_tokenizer(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<pad>"}))
    with raises_invalid("pad_token", kind=errors.CheckpointError):
        tokenizer_lib.load_tokenizer(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with raises_invalid("eos_token_id"):
        tokenizer_lib.load_tokenizer(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(ValueError, match="stop_ids \\[1000000\\] are outside"):
        tokenizer_lib.load_tokenizer(str(path))


def test_template_raise_exception_surfaces(tmp_path, write_hf_tokenizer):
    import jinja2

    tok = tokenizer_lib.load_tokenizer(str(write_hf_tokenizer(tmp_path / "x", style="mixtral")))
    tok._template = None
    template = tok.chat_template
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        tok.render_prompt("hi")
    tok.chat_template, tok._template = template, None
    assert tok.render_prompt("hi") == "<s>[INST] hi [/INST]"


# ---- check_vocab ---------------------------------------------------------------------------


def test_check_vocab(tmp_path, write_hf_tokenizer):
    char = tokenizer_lib.CharTokenizer()
    tokenizer_lib.check_vocab(char, 98)
    tokenizer_lib.check_vocab(char, 512)
    with pytest.raises(ValueError, match="tokenizer has 98 ids but the model's vocab_size is 97"):
        tokenizer_lib.check_vocab(char, 97)
    hf = tokenizer_lib.load_tokenizer(str(write_hf_tokenizer(tmp_path / "v")))
    tokenizer_lib.check_vocab(hf, hf.vocab_size)
    with pytest.raises(ValueError, match=f"has {hf.vocab_size} ids .* vocab_size is 96"):
        tokenizer_lib.check_vocab(hf, 96)
