"""Math answers checked by HF's `math-verify`: the reference and the completion are parsed (boxed answers, LaTeX,
fractions, plain numbers; units and spacing normalised as it does) and compared symbolically.

`math-verify` is an optional dependency (`pip install megatron-spec[math]`), imported when a reward is first
computed. Its own timeouts use `signal.alarm`, which would cancel the per-item timeout of `tasks.scoring`; they are
turned off here and the scorer's timeout bounds each call instead.

One thing math-verify accepts is refused here: a final answer that is itself unevaluated arithmetic on numbers
(`7 + 9`, `12 \\times 3`). math-verify evaluates it and finds it equal, so a policy trained on that reward learns
to restate the question's expression instead of computing it. A fraction of two numbers (`3/4`) is a final form
and stays accepted, as does any answer with a symbol, root or function in it.
"""

from __future__ import annotations

import logging
import re

_OPERATORS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "÷": "/"}
_ARITHMETIC = re.compile(r"[\d\s.()+\-*/]+")
_NUMBER = r"\(?\s*-?\d+(?:\.\d+)?\s*\)?"
_FRACTION = re.compile(rf"\s*{_NUMBER}\s*(?:/\s*{_NUMBER}\s*)?")


def _math_verify():
    try:
        import math_verify
    except ImportError as err:
        raise ImportError("the math-verify reward needs the `math` extra: pip install 'megatron-spec[math]' "
                          "(math-verify)") from err
    # It warns on every call whose timeout is off; the scorer provides the timeout.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def gold_text(answer: str) -> str:
    """The reference as math-verify should read it: a bare answer (`3/4`, `\\frac{3}{4}`, `\\sqrt{2}`) is boxed, so
    its LaTeX is parsed as LaTeX; one that already has `\\boxed` or `$` delimiters is left alone."""
    answer = answer.strip()
    return answer if "\\boxed" in answer or "$" in answer else f"\\boxed{{{answer}}}"


def unevaluated(extracted: str) -> bool:
    """Whether a final answer, as math-verify extracted it, is arithmetic on numbers left to the grader (`7 + 9`,
    `2 \\times 3`) rather than a number or a fraction of two."""
    text = extracted
    for op, plain in _OPERATORS.items():
        text = text.replace(op, plain)
    return bool(_ARITHMETIC.fullmatch(text)) and not _FRACTION.fullmatch(text)


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when `completion`'s final answer is mathematically equal to `answer` (math-verify's `verify` of the
    parsed reference against the parsed completion) and is not unevaluated arithmetic (`unevaluated`), else 0.0."""
    mv = _math_verify()
    gold = mv.parse(gold_text(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    pred = mv.parse(completion, parsing_timeout=None)
    if len(pred) > 1 and isinstance(pred[-1], str) and unevaluated(pred[-1]):
        return 0.0
    return float(mv.verify(gold, pred, timeout_seconds=None))
