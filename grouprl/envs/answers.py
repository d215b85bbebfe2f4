"""Answer extraction helpers shared by tasks and reward functions.

Everything here is a pure function on strings: find the final number in a completion, the text
between two tags, the ground truth of a GSM8K-style solution ("... #### 42"), and compare two
numeric answers exactly. None means "nothing usable was found"; callers turn that into a 0 reward.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# An optional sign, digits with optional thousands commas ("1,234"), an optional decimal part.
# A lone "." or "," is not a number; "1,234" is one number, "1, 2" is two.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_GSM8K_MARK = "####"


def last_number(text: str) -> str | None:
    """The last number written in `text`, commas removed ("x = 1,234." -> "1234"), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "")


def between_tags(text: str, open_tag: str, close_tag: str) -> str | None:
    """The stripped text inside the LAST `open_tag ... close_tag` pair, or None if there is none.

    The last pair wins because models often restate the format ("use <answer></answer>") before
    answering.
    """
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    if start < 0:
        return None
    return text[start + len(open_tag) : end].strip()


def tag_pair(tag: str) -> tuple[str, str]:
    """("<answer>", "</answer>") from "answer" or "<answer>"; an empty tag is an error."""
    name = tag.strip().removeprefix("<").removesuffix(">").strip()
    if not name or "<" in name or ">" in name or "/" in name:
        raise ValueError(f"answer tag must be a plain name such as 'answer', got {tag!r}")
    return f"<{name}>", f"</{name}>"


def gsm8k_answer(solution: str) -> str | None:
    """Ground truth of a GSM8K-style solution: the text after the last '####', commas removed.

    "Natalia sold 48 ... #### 1,072" -> "1072". None when the mark is absent or nothing follows.
    """
    if _GSM8K_MARK not in solution:
        return None
    tail = solution.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
    return tail or None


def to_fraction(text: str) -> Fraction | None:
    """Exact value of a plain decimal number ("-3", "2.50", "1,000"), or None if it is not one."""
    cleaned = text.strip().replace(",", "")
    if not _NUMBER.fullmatch(cleaned):
        return None
    try:
        return Fraction(Decimal(cleaned))
    except (InvalidOperation, ValueError):
        return None


def same_answer(predicted: str, gold: str) -> bool:
    """Exact comparison: numerically when both are numbers ("42.0" == "42"), else stripped text."""
    p, g = to_fraction(predicted), to_fraction(gold)
    if p is not None and g is not None:
        return p == g
    return predicted.strip() == gold.strip()
