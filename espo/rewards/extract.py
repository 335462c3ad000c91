"""Final-answer extraction from model completions, shared by every verifiable reward.

This module owns *where* an answer is in a completion; whether it is right is the business of
`espo.rewards.math` (symbolic equivalence) and `espo.rewards.procedural` (exact / numeric match).

Extraction order (`extract_answer`):
  1. The content of the last `\\boxed{...}` or `\\fbox{...}` (braces may nest; `\\boxed 5` is
     accepted too).
  2. Otherwise the last final-answer statement: "The final answer is X", "Final Answer: X",
     a line starting "Answer: X", or a GSM8K "#### X" line. When the statement ends its line
     ("**Final Answer**" then the answer below), the next non-empty line is the answer.
  3. Otherwise `None`: the completion stated no answer.

Invariants: all functions are pure functions of their string arguments (no global state), so they
are safe in threads and picklable by reference; the returned answer is stripped of surrounding
`$...$`, markdown emphasis and a trailing period, and is never the empty string.
"""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# `\boxed` and `\fbox` followed by an opening brace or a single space-separated token.
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{|\s+[^\s$]+)")

# Checked on each line from the last line upwards; for one line, earlier patterns win. The leading
# `.*` makes "final answer" match its *last* occurrence on the line.
_ANSWER_LINE_RES = (
    re.compile(r"^\s*####\s*(.*)$"),
    re.compile(r"(?i)^.*\bfinal\s+answer\b[*_]*(?:\s+is)?[*_]*\s*[:：]?\s*(.*)$"),
    re.compile(r"(?i)^\s*[*_#>\s]*answer\s*[*_]*\s*[:：]\s*(.*)$"),
)
_HOPE_RE = re.compile(r"(?i)\.?\s*I hope it is correct\.?\s*$")
_MATH_DELIMITERS = ((r"\(", r"\)"), (r"\[", r"\]"))
# A line that is only an answer header ("**Final Answer**", "Answer:"): the answer follows it.
_HEADER_RE = re.compile(r"(?i)^[\s*_#>]*(?:the\s+)?(?:final\s+)?answer(?:\s+is)?[\s*_:：]*$")


def answer_section(completion: str, *, think_open: bool = False) -> str:
    """The part of `completion` after the reasoning block, where the answer should be.

    Args:
      completion: the generated text.
      think_open: whether the prompt already opened a `<think>` block (chat templates that end
        the prompt with "<think>"), so the completion starts inside the reasoning.

    Returns:
      The text after the last `</think>`. Without `</think>`: the empty string when a reasoning
      block was opened and never closed (a truncated thought holds no answer), else the whole
      completion (a model that does not think).
    """
    head, sep, tail = completion.rpartition(THINK_CLOSE)
    del head
    if sep:
        return tail
    if think_open or THINK_OPEN in completion:
        return ""
    return completion


def find_boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` / `\\fbox{...}` in `text`, in order.

    Braces nest (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`); escaped braces `\\{ \\}` do not
    count. An unclosed `\\boxed{` (a truncated completion) is skipped.
    """
    contents = []
    for match in _BOXED_RE.finditer(text):
        opener = match.group(1)
        if opener != "{":  # `\boxed 5`: the token itself.
            contents.append(opener.strip())
            continue
        body = _balanced_body(text, match.end())
        if body is not None:
            contents.append(body)
    return contents


def _balanced_body(text: str, start: int) -> str | None:
    """The text from `start` up to the brace closing the one just before `start`, or None."""
    depth = 1
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":  # Skip the escaped character: `\{` and `\}` are literal braces.
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The cleaned content of the last non-empty `\\boxed{...}` in `text`, or None."""
    for body in reversed(find_boxed(text)):
        answer = clean_answer(body)
        if answer:
            return answer
    return None


def extract_answer_line(text: str) -> str | None:
    """The answer of the last final-answer statement in `text` (see the module doc), or None."""
    lines = text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        for pattern in _ANSWER_LINE_RES:
            match = pattern.match(lines[index])
            if match is None:
                continue
            answer = clean_answer(match.group(1))
            if not answer and _HEADER_RE.match(lines[index]):  # Answer on the next line.
                following = (clean_answer(line) for line in lines[index + 1 :])
                answer = next((line for line in following if line), "")
            if answer:
                return answer
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer stated in `completion`: last boxed, else last answer line, else None.

    >>> extract_answer(r"so \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> extract_answer("Natalia sold 48 + 24 = 72 clips.\\n#### 72")
    '72'
    """
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    return extract_answer_line(completion)


def clean_answer(answer: str) -> str:
    """`answer` without surrounding whitespace, `$...$`, `\\(...\\)`, markdown emphasis, a
    trailing period and a trailing "I hope it is correct." (the Minerva answer format)."""
    previous = None
    while answer != previous:
        previous = answer
        answer = _HOPE_RE.sub("", answer).strip()
        answer = answer.strip("*_").strip()
        if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
            answer = answer.strip("$").strip()
        elif any(answer.startswith(a) and answer.endswith(b) for a, b in _MATH_DELIMITERS):
            answer = answer[2:-2].strip()
        elif answer.endswith(".") and not answer.endswith(".."):
            answer = answer[:-1].strip()
    return answer
