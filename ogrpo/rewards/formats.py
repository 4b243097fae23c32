"""open-r1's layout regexes as scanners whose time is linear in the completion's length, with the same answers.

The patterns chain lazy `.*?` gaps between literals, e.g. open-r1's code_format
`^<think>\\n.*?\\n</think>\\n<answer>\\n.*?```python.*?```.*?\\n</answer>$` (DOTALL | MULTILINE): on a miss,
Python's backtracking engine retries every combination of gap lengths, which measured 63 s on one 8 KiB
completion (format: 3.3 s at 128 KiB), long enough to stall a training step on model-written text.

Why finding each literal at its earliest place is exact: with DOTALL a gap matches any text, so the pattern
matches iff the literals occur in order without overlapping, the first at position 0, and the last one followed
by the end of the text or a newline (`$` under MULTILINE). If any placement works, the earliest one does too:
each literal's earliest occurrence ends no later than the chosen one, leaving at least as much room for the
next. Only the last literal carries an extra condition, so every occurrence of it after the earliest placement
of the others is tried, each in O(1). Every `str.find` resumes after the previous one: O(n) in all.

tests/test_rewards.py checks each scanner against the original regex on a generated corpus and on mutations
of valid completions.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"


def ordered_literals(text: str, head: str, middle: tuple[str, ...], last: str) -> bool:
    """re.match(re.escape(head) + ".*?" + ".*?".join(map(re.escape, middle + (last,))) + "$", text,
    re.DOTALL | re.MULTILINE), in linear time."""
    if not text.startswith(head):
        return False
    pos = len(head)
    for literal in middle:
        pos = text.find(literal, pos)
        if pos < 0:
            return False
        pos += len(literal)
    n = len(text)
    at = text.find(last, pos)
    while at >= 0:
        end = at + len(last)
        if end == n or text[end] == "\n":  # MULTILINE `$`: the end, or just before a "\n" (not "\r")
            return True
        at = text.find(last, at + 1)
    return False


def is_format(text: str) -> bool:
    """open-r1's format_reward: `^<think>\\n.*?\\n</think>\\n<answer>\\n.*?\\n</answer>$`, DOTALL | MULTILINE."""
    return ordered_literals(text, "<think>\n", ("\n</think>\n<answer>\n",), "\n</answer>")


def is_code_format(text: str, language: str) -> bool:
    """open-r1's code_format_reward:
    `^<think>\\n.*?\\n</think>\\n<answer>\\n.*?```{language}.*?```.*?\\n</answer>$`, DOTALL | MULTILINE,
    with the language taken literally (open-r1 pastes it into the pattern; no supported name has a regex
    metacharacter, and `c++` would be an error there)."""
    return ordered_literals(text, "<think>\n", ("\n</think>\n<answer>\n", f"```{language}", "```"), "\n</answer>")


def is_soft_format(text: str) -> bool:
    """re.match(r"<think>.*?</think>\\s*<answer>.*?</answer>", text, re.DOTALL), in linear time.

    The first `</think>` followed by whitespace and `<answer>` is the best candidate: a later one leaves less
    text in which to find `</answer>`. `\\s` of a str pattern is exactly `str.isspace` (both are CPython's
    Py_UNICODE_ISSPACE). Whitespace runs after different `</think>`s are disjoint, so the skipping is linear.
    """
    if not text.startswith(THINK_OPEN):
        return False
    n = len(text)
    at = text.find(THINK_CLOSE, len(THINK_OPEN))
    while at >= 0:
        k = at + len(THINK_CLOSE)
        while k < n and text[k].isspace():
            k += 1
        if text.startswith(ANSWER_OPEN, k):
            return text.find(ANSWER_CLOSE, k + len(ANSWER_OPEN)) >= 0
        at = text.find(THINK_CLOSE, at + 1)
    return False


def is_think_format(text: str) -> bool:
    """open-r1's think_format_reward (branch zero-math-code, 296aa66): `re.match(r"^[\\s\\n]*<think>", text,
    re.DOTALL | re.MULTILINE)` and exactly one `<think>` and one `</think>` anywhere (str.count: non-overlapping,
    and the two tags cannot overlap each other or themselves).

    `re.match` tries position 0 only (`^` adds nothing there, MULTILINE or not) and `<` is not whitespace, so the
    greedy whitespace run ends exactly where `<think>` must start: the leading run str.lstrip removes, which is
    the `\\s` set (both are CPython's Py_UNICODE_ISSPACE; `\\n` is in it). Three linear passes, no regex.
    """
    return (text.count(THINK_OPEN) == 1 and text.count(THINK_CLOSE) == 1
            and text.lstrip().startswith(THINK_OPEN))


def after_last_think(text: str) -> str:
    """open-r1's think_accuracy_reward input: the text after the last `</think>`, stripped; "" without one."""
    at = text.rfind(THINK_CLOSE)
    return "" if at < 0 else text[at + len(THINK_CLOSE):].strip()


def fenced_blocks(text: str, language: str) -> list[str]:
    """re.findall(rf"```{re.escape(language)}\\n(.*?)```", text, re.DOTALL), in linear time.

    findall takes the leftmost opening fence that has a closing one after it; when the leftmost opening has
    none, no later one has either, so the scan stops there (the regex retried every later opening to the end
    of the text: quadratic in the number of unclosed fences)."""
    opening = f"```{language}\n"
    out, pos = [], 0
    while True:
        start = text.find(opening, pos)
        if start < 0:
            return out
        body = start + len(opening)
        end = text.find("```", body)
        if end < 0:
            return out
        out.append(text[body:end])
        pos = end + 3
