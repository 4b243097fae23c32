"""tiny-code: stdin -> stdout programs with test cases in open-r1's `verification_info` layout
({"language": "python", "test_cases": [{"input", "output", "type": "stdin_stdout"}]}), graded by the sandboxed
`code` reward (the share of test cases a completion's last ```python block passes).
"""

from __future__ import annotations

import random
import re

SEED = 0

# (statement with {k}, reference program with {k}, input generator, expected output of one input)
KINDS = (
    ("Read an integer n and print n + {k}.", "print(int(input()) + {k})",
     lambda rng: str(rng.randint(-50, 50)), lambda s, k: str(int(s) + k)),
    ("Read an integer n and print n * {k}.", "print(int(input()) * {k})",
     lambda rng: str(rng.randint(-50, 50)), lambda s, k: str(int(s) * k)),
    ("Read a word and print it reversed {k} time(s), one per line.",
     "w = input()\nfor _ in range({k}):\n    print(w[::-1])",
     lambda rng: "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6))),
     lambda s, k: "\n".join([s[::-1]] * k)),
    ("Read integers on one line and print their sum plus {k}.", "print(sum(map(int, input().split())) + {k})",
     lambda rng: " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(1, 5))),
     lambda s, k: str(sum(map(int, s.split())) + k)),
)


def rows(n: int = 128, seed: int = SEED, tests: int = 3) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        statement, _, make_input, answer = KINDS[rng.randrange(len(KINDS))]
        k = rng.randint(1, 3)
        inputs = [make_input(rng) for _ in range(tests)]
        cases = [{"input": s + "\n", "output": answer(s, k) + "\n", "type": "stdin_stdout"} for s in inputs]
        out.append({"prompt": "Write a Python program. " + statement.format(k=k),
                    "verification_info": {"language": "python", "test_cases": cases}})
    return out


def _kind(prompt: str) -> tuple[str, int]:
    """(reference program template, k) of a tiny-code prompt."""
    statement = prompt.removeprefix("Write a Python program. ")
    for template, program, _, _ in KINDS:
        prefix = template.split("{k}")[0]
        if statement.startswith(prefix):
            return program, int(re.match(r"\d+", statement[len(prefix):]).group())
    raise ValueError(f"not a tiny-code prompt: {prompt!r}")


def _completion(code: str) -> str:
    return f"<think>\nread, compute, print\n</think>\n<answer>\n```python\n{code}\n```\n</answer>"


def reference_completion(row: dict) -> str:
    """A correct completion in open-r1's code format (for tests)."""
    program, k = _kind(row["prompt"])
    return _completion(program.format(k=k))


# --- warm start of `ogrpo:tiny-code` (ogrpo/tasks/warm.py) ------------------------------------------------------
# `correct`: the share of warm-start completions with the reference program; the others use a wrong constant
# (k + 1 or k - 1: it runs and prints, and fails the test cases; for the reversal kind open-r1's zip-truncated
# comparison passes it anyway), so the sandbox runs programs of both kinds and `code` varies within a group.
# Measured after 300 steps (~30 s of one core): code_format ~0.98 and code ~0.4 on sampled completions (200
# steps: ~0.9 and ~0.16).
WARM = {"vocab_size": 448, "steps": 300, "batch": 32, "lr": 1e-2, "seed": 0, "correct": 0.6}


def warm_examples(n: int | None = None, seed: int = WARM["seed"]) -> list[tuple[str, str]]:
    """(prompt, completion) pairs over the training prompts (`rows()`, which the recipe trains on)."""
    rng = random.Random(seed)
    out = []
    for row in rows():
        program, k = _kind(row["prompt"])
        if rng.random() >= WARM["correct"]:
            k = k + 1 if k == 1 or rng.random() < 0.5 else k - 1
        out.append((row["prompt"], _completion(program.format(k=k))))
    return out if n is None else out[:n]
