"""Math answers checked by HF's `math-verify`: the reference and the completion are parsed (boxed answers, LaTeX,
fractions, plain numbers; units and spacing normalised as it does) and compared symbolically.

`math-verify` is an optional dependency (`pip install megatron-spec[math]`), imported when a reward is first
computed. Its own timeouts use `signal.alarm`, which would cancel the per-item timeout of `tasks.scoring`; they are
turned off here and the scorer's timeout bounds each call instead.
"""

from __future__ import annotations

import logging


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


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when `completion`'s final answer is mathematically equal to `answer` (math-verify's `verify` of the
    parsed reference against the parsed completion), else 0.0."""
    mv = _math_verify()
    gold = mv.parse(gold_text(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    pred = mv.parse(completion, parsing_timeout=None)
    return float(mv.verify(gold, pred, timeout_seconds=None))
