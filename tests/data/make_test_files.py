"""Write the small hub-schema files under ``files/`` that the data tests load.

The problems are invented for the tests (not copies of the real sets); the structure mimics
the hub sets: DAPO-Math-17k repeats one block of rows many times and has prompts with
conflicting answers; AIME-2024 repeats each problem 32 times; AMC-2023 has float answers
("27.0"). Run ``python tests/data/make_test_files.py`` to regenerate (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent / "files"

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# (problem, answer) of one DAPO-style block
DAPO_BLOCK = [
    ("Compute $3 + 4 \\cdot 5$.", "23"),
    ("How many positive divisors does $36$ have?", "9"),
    ("Find the remainder when $2^{10}$ is divided by $7$.", "2"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
    ("If $x + y = 10$ and $x - y = 2$, what is $xy$?", "24"),
    ("How many ways can 3 books be arranged on a shelf?", "6"),
    ("What is the least common multiple of $4$ and $6$?", "12"),
]
DAPO_REPEATS = 5
# The last block carries a different answer for this problem: a conflicting prompt.
DAPO_CONFLICT = ("What is the least common multiple of $4$ and $6$?", "24")

AIME_PROBLEMS = [
    ("Find the number of ordered pairs $(a, b)$ of positive integers with $a + b = 20$.", "19"),
    ("Find the last three digits of $7^{4}$.", "401"),
    ("A square has area $144$. Find its perimeter.", "48"),
]
AIME_COPIES = 32

AMC_ROWS = [
    {"id": 0, "question": "What is $3^3$?", "answer": 27.0},
    {"id": 1, "question": "What is half of $25$?", "answer": 12.5},
    {"id": 2, "question": "What is $\\sqrt{9}$?", "answer": "3.0"},
    {"id": 3, "question": "What is $10 - 3$?", "answer": "7"},
]

AIME25_ROWS = [
    {"id": "I-1", "problem": "Find the number of primes less than $30$.", "answer": "10", "year": 2025},
    {"id": "I-2", "problem": "Find $5!$ divided by $4$.", "answer": "30", "year": 2025},
]


def dapo_rows() -> list[dict]:
    rows = []
    for rep in range(DAPO_REPEATS):
        for j, (problem, answer) in enumerate(DAPO_BLOCK):
            if rep == DAPO_REPEATS - 1 and problem == DAPO_CONFLICT[0]:
                answer = DAPO_CONFLICT[1]
            rows.append({
                "data_source": "math_dapo",
                "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"test-{j}"},
            })
    return rows


def aime_rows() -> list[dict]:
    rows = []
    for copy in range(AIME_COPIES):
        for j, (problem, answer) in enumerate(AIME_PROBLEMS):
            rows.append({
                "data_source": "aime_2024",
                "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": j, "copy": copy},
            })
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    dapo = dapo_rows()
    pq.write_table(pa.Table.from_pylist(dapo), HERE / "dapo_math_mini.parquet")
    write_jsonl(HERE / "dapo_math_mini.jsonl", dapo)
    pq.write_table(pa.Table.from_pylist(aime_rows()), HERE / "aime_2024_mini.parquet")
    # mixed float / string answers, as the AMC uploads have
    write_jsonl(HERE / "amc_2023_mini.jsonl", AMC_ROWS)
    write_jsonl(HERE / "aime_2025_mini.jsonl", AIME25_ROWS)


if __name__ == "__main__":
    main()
