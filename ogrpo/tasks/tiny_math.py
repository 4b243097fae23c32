"""tiny-math: one-step arithmetic with gold answers in the forms real math sets use, checked by math-verify.

Rows: {"prompt": text, "solution": gold}. Gold answers alternate between `\\boxed{7}` and a plain `7`, and a
division that does not come out even is a reduced LaTeX fraction `\\frac{3}{4}`, so every parse path of the
`accuracy` reward is taken. A completion earns 1.0 when it writes the value in `\\boxed{}` in any equivalent form
(`\\boxed{0.75}` for `\\frac{3}{4}`).
"""

from __future__ import annotations

import random
from math import gcd

SEED = 0
OPS = ("+", "-", "*", "/")


def value(a: int, op: str, b: int) -> tuple[int, int]:
    """(numerator, denominator) of `a op b`, reduced, denominator positive."""
    if op == "/":
        g = gcd(a, b)
        return a // g, b // g
    return {"+": a + b, "-": a - b, "*": a * b}[op], 1


def gold(num: int, den: int, i: int) -> str:
    """The gold answer as the dataset writes it (the form rotates with the row index)."""
    if den != 1:
        return f"{'-' if num < 0 else ''}\\frac{{{abs(num)}}}{{{den}}}"
    return f"\\boxed{{{num}}}" if i % 2 == 0 else str(num)


def rows(n: int = 64, seed: int = SEED) -> list[dict]:
    """The training set: 64 problems by default, few enough for the warm start to memorise some answers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, op, b = rng.randint(1, 12), rng.choice(OPS), rng.randint(1, 12)
        out.append({"prompt": f"Compute {a} {op} {b}. Put the final answer in \\boxed{{}}.",
                    "solution": gold(*value(a, op, b), i)})
    return out


def _operands(prompt: str) -> tuple[int, str, int]:
    a, op, b = prompt.removeprefix("Compute ").split(".")[0].split()
    return int(a), op, int(b)


def _written(num: int, den: int) -> str:
    """The value as a completion writes it: an integer, a decimal when that is exact (5/8 -> 0.625), or a
    LaTeX fraction."""
    if den == 1:
        return str(num)
    if 10 ** 6 % den == 0:  # a finite decimal
        return repr(num / den)
    return f"\\frac{{{num}}}{{{den}}}"


def _completion(a: int, op: str, b: int, answer: str) -> str:
    return f"<think>\n{a} {op} {b} = {answer}\n</think>\n<answer>\n\\boxed{{{answer}}}\n</answer>"


def reference_completion(row: dict) -> str:
    """A correct completion in open-r1's format (for tests): the value recomputed from the prompt, written as a
    decimal when that is exact (5/8 -> 0.625), so a check needs math-verify's equivalence, not string equality."""
    a, op, b = _operands(row["prompt"])
    return _completion(a, op, b, _written(*value(a, op, b)))


# --- warm start of `ogrpo:tiny-math` (ogrpo/tasks/warm.py) ------------------------------------------------------
# The tiny model memorises answers slowly (it does not learn arithmetic), and how fast depends on the host's float
# kernels: 400 steps gave a right answer on 10-25% of sampled completions at temperature 1 on an AVX2 EPYC but 6%
# on an AVX-512 Xeon (64 rows x 4 samples), too few for a 2-step test to see one; 600 steps (~40 s of one core)
# give 34% there (800: 63%), so every reward fires while answers still vary within a group. The dataset has 64
# rows: over 256 rows the same budget left the answers near chance (~2%). `correct`: the share of warm-start
# completions with the right value; the others are off by one (in the numerator for a fraction). vocab_size:
# what BPE reaches on this corpus.
WARM = {"vocab_size": 400, "steps": 600, "batch": 32, "lr": 1e-2, "seed": 0, "correct": 0.9}


def warm_examples(n: int | None = None, seed: int = WARM["seed"]) -> list[tuple[str, str]]:
    """(prompt, completion) pairs over the training prompts (`rows()`, which the recipe trains on), each a
    correct completion with probability WARM["correct"], else one whose answer is off by one."""
    rng = random.Random(seed)
    out = []
    for row in rows():
        a, op, b = _operands(row["prompt"])
        num, den = value(a, op, b)
        if rng.random() >= WARM["correct"]:
            num += rng.choice((-1, 1))
            g = gcd(num, den) or 1
            num, den = num // g, den // g
        out.append((row["prompt"], _completion(a, op, b, _written(num, den))))
    return out if n is None else out[:n]
