"""Rule-based math reward: the last \\boxed{...} of a completion against the reference answer.

With the optional `math-verify` package installed (`pip install sparserl-mcore[math]`) the
comparison is symbolic; without it a small, tested normaliser decides: it strips LaTeX
decoration ($, \\left/\\right, spacing, \\text{}, degree and percent signs, trailing periods),
turns \\frac/\\dfrac/\\tfrac into a/b and compares numbers exactly as fractions (0.5 == 1/2 ==
\\frac{1}{2}, 1,000 == 1000), otherwise the normalised strings.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the LAST \\boxed{...} (or \\fbox{...}) in `text`, nested braces balanced.

    Also accepts the brace-less form `\\boxed 5`. Returns None when there is no complete box.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = text.index("\\", start) + 1
    while i < len(text) and text[i].isalpha():
        i += 1
    if i < len(text) and text[i] == " ":
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _frac_to_slash(s: str) -> str:
    """\\frac{a}{b} -> (a)/(b) (innermost first), \\frac12 -> 1/2."""
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    pattern = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
    while True:
        new = pattern.sub(lambda m: _paren(m.group(1)) + "/" + _paren(m.group(2)), s)
        if new == s:
            return s
        s = new


def _paren(s: str) -> str:
    return s if re.fullmatch(r"-?[\w.]+", s) else f"({s})"


def normalize_answer(s: str) -> str:
    """Canonical text of a final answer, for string comparison after numeric comparison fails."""
    s = s.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for junk in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\ ",
        "$",
        "^\\circ",
        "^{\\circ}",
        "\\%",
        "%",
    ):
        s = s.replace(junk, "")
    s = _frac_to_slash(s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x=3" -> "3"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if len(s) > 2 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    return s


def as_number(s: str) -> Fraction | None:
    """Exact value of an integer, decimal or a/b fraction (after `normalize_answer`), else None."""
    match = re.fullmatch(r"\(?(-?\d+(?:\.\d+)?)\)?/\(?(-?\d+(?:\.\d+)?)\)?", s)
    try:
        if match:
            return Fraction(match.group(1)) / Fraction(match.group(2))
        if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(predicted: str, reference: str) -> bool:
    """Equivalence of two final answers by the built-in normaliser."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if not a:
        return False
    na, nb = as_number(a), as_number(b)
    if na is not None and nb is not None:
        return na == nb
    return a == b


@functools.cache
def _math_verify():
    """(parse, verify) from math-verify, or None when the package is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def math_boxed_reward(completion: str, answer: str, *, use_math_verify: bool = True) -> float:
    """1.0 if the completion's last \\boxed{} answer equals `answer`, else 0.0.

    `answer` may itself be boxed (e.g. a full reference solution). math-verify is used when
    installed and `use_math_verify`; the normaliser decides otherwise (and when math-verify
    cannot parse either side).
    """
    predicted = extract_boxed(completion)
    if predicted is None:
        return 0.0
    reference = extract_boxed(answer) or answer
    backend = _math_verify() if use_math_verify else None
    if backend is not None:
        parse, verify = backend
        gold, pred = parse(f"${reference}$"), parse(f"${predicted}$")
        if gold and pred:
            return 1.0 if verify(gold, pred) else 0.0
    return 1.0 if answers_match(predicted, reference) else 0.0
