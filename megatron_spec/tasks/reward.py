"""Verifiable reward: find the final integer answer in free text and compare it with the reference.

The same extractor serves the tiny models (`=> -6`) and SmolLM2 (`The answer is -6.`, `\\boxed{-6}`, `**-6**`).
Where the answer is looked for, most explicit first (the first rule that finds a number wins; within a rule the
last occurrence wins, because models restate intermediate results before concluding):

1. the task's own marker `=> N`;
2. `\\boxed{N}` (also `\\boxed{\\text{N}}`, `\\boxed{x = N}`; a box holding anything else, e.g. `\\frac{1}{2}`, is skipped);
3. "answer is N", "answer: N", "answer = N" (any case);
4. the final non-empty line, if it is just a number or ends with `= N` (after markdown and punctuation are removed).

A completion whose work was cut off mid-way therefore earns nothing unless it reached a conclusion. There is no
format bonus: the reward is 1.0 for the right answer and 0.0 otherwise, so the RL signal is exactly accuracy.
Every scan is linear in the text length (400 kB of adversarial garbage takes about 0.15 s).
"""

from __future__ import annotations

import re

# An integer, possibly signed, possibly with thousands separators, possibly with a zero fraction (`42.0`).
_NUMBER = r"[-+−]?\s?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+−]?\s?\d+(?:\.\d+)?"
# Between a cue and its number: spaces and markdown/LaTeX decoration (`**`, `_`, `$`).
_MARKER = re.compile(r"=>[\s*_$]*(" + _NUMBER + ")")
_ANSWER_IS = re.compile(r"answer[\s*_]*(?:is|:|=)[\s*_$:]*(" + _NUMBER + ")", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")
_MAX_BOX = 64
"""Longest `\\boxed{}` content read as an answer."""
# A box holds a number, optionally after `x =` and before a period; anything else (\frac{1}{2}, words) is no answer.
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathbf|mathrm|bm|displaystyle)\s*\{|[{}]")
_BOX_ANSWER = re.compile(r"(?:.*=)?\s*(" + _NUMBER + r")\s*\.?\s*")
# What may decorate a bare final line: markdown bold/italics/code, LaTeX dollars, trailing punctuation.
_DECORATION = re.compile(r"[*_`$]|\\\(|\\\)|\\\[|\\\]")
_FINAL_LINE = re.compile(r"^(?:.*=\s*)?(" + _NUMBER + r")\s*[.!;]?\s*$")


def normalize_number(text: str) -> str | None:
    """Canonical integer string of a number written with spaces, separators, a sign or a zero fraction.

    `"1,234"` -> `"1234"`, `"- 6"` -> `"-6"`, `"+7"` -> `"7"`, `"42.0"` -> `"42"`, `"007"` -> `"7"`, `"-0"` -> `"0"`;
    a real fraction such as `"2.5"` is kept as written (it can never equal an integer answer). Works on the
    digits as a string: `int()` refuses numbers over 4300 digits, and garbage text may hold one.
    """
    s = text.strip().replace("−", "-").replace(" ", "").replace(",", "")
    match = re.fullmatch(r"([-+]?)(\d+)(?:\.(\d+))?", s)
    if match is None:
        return None
    sign, whole, frac = match.groups()
    if frac and frac.strip("0"):
        return s
    digits = whole.lstrip("0") or "0"
    return "-" + digits if sign == "-" and digits != "0" else digits


def _boxed_contents(text: str) -> list[str]:
    """Contents of every closed `\\boxed{...}`, nested braces balanced (e.g. `\\boxed{\\text{-6}}`), in order of
    their closing brace. One pass with a stack of open braces: a rescan per box would be quadratic on garbage
    such as thousands of unclosed `\\boxed{`."""
    opens = {m.end() - 1 for m in _BOXED.finditer(text)}  # index of each box's own "{"
    stack: list[int] = []
    found = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            start = stack.pop()
            # A box holding more than a short number is not an answer; skipping it keeps nested garbage linear.
            if start in opens and i - start <= _MAX_BOX:
                found.append(text[start + 1 : i])
    return found


def _marker_answers(text: str) -> list[str | None]:
    return [normalize_number(m.group(1)) for m in _MARKER.finditer(text)]


def _boxed_answers(text: str) -> list[str | None]:
    # Formatting wrappers (`\\text{}`, `\\mathbf{}`, ...) and `$` go before the number is read; other LaTeX
    # such as `\\frac{1}{2}` stays, so it cannot be misread as 12.
    unwrapped = (_WRAPPERS.sub("", box).replace("$", "") for box in _boxed_contents(text))
    return [normalize_number(m.group(1)) for m in map(_BOX_ANSWER.fullmatch, unwrapped) if m]


def _answer_is_answers(text: str) -> list[str | None]:
    return [normalize_number(m.group(1)) for m in _ANSWER_IS.finditer(text)]


def _final_line_answer(text: str) -> str | None:
    lines = [line for line in text.splitlines() if line.strip()]
    match = _FINAL_LINE.match(_DECORATION.sub("", lines[-1]).strip()) if lines else None
    return normalize_number(match.group(1)) if match else None


def extract_answer(text: str) -> str | None:
    """The final answer in `text` as a canonical integer string, or None if there is none. Never raises."""
    if not isinstance(text, str):
        return None
    # Rules 1-3 of the module docstring, in order; the last occurrence within the first rule that matches wins.
    for rule in (_marker_answers, _boxed_answers, _answer_is_answers):
        found = [answer for answer in rule(text) if answer is not None]
        if found:
            return found[-1]
    return _final_line_answer(text)  # rule 4


def reward(completion_text: str, answer: str | int) -> float:
    """1.0 if the completion's final answer equals `answer`, else 0.0. Never raises on any completion text.

    `answer` is our own reference (a `Problem.answer`); one that is not an integer is a bug and raises.
    """
    reference = normalize_number(str(answer))
    if reference is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    return 1.0 if extract_answer(completion_text) == reference else 0.0
