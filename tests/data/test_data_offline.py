"""Offline sets: the arith demo generator, reasoning-gym and CHAMP."""

import random
import re

import pytest

from mcpo_megatron.data import load_prompts
from mcpo_megatron.data.offline import arith_problems, champ_answer


def test_arith_answers_are_right_and_deterministic():
    recs, rep = load_prompts("arith:ops=+-,digits=1", num_samples=50, seed=1, template="number")
    again, _ = load_prompts("arith:ops=+-,digits=1", num_samples=50, seed=1, template="number")
    assert [r.uid for r in recs] == [r.uid for r in again]
    assert len(recs) == 50 == rep.returned and len({r.problem for r in recs}) == 50
    for r in recs:
        a, op, b = re.fullmatch(r"What is (\d) ([+-]) (\d)\?", r.problem).groups()
        want = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert r.ground_truth == str(want) and want >= 0
        assert r.prompt == r.problem + " Answer with just the number."
    other, _ = load_prompts("arith:ops=+-,digits=1", num_samples=50, seed=2)
    assert [r.uid for r in other] != [r.uid for r in recs]


def test_arith_problem_counts():
    # 9*9 additions + 45 subtractions with a >= b (one digit, 1..9)
    assert len(arith_problems("+-", (1, 1))) == 81 + 45
    assert len(arith_problems("+", (2, 1))) == 90 * 9
    recs, rep = load_prompts("arith:ops=-,digits=2/1", num_samples=10_000)
    assert rep.returned == len(recs) == 90 * 9  # capped at the distinct questions
    train, _ = load_prompts("arith:ops=+,digits=2/2", num_samples=100, split="train")
    test, _ = load_prompts("arith:ops=+,digits=2/2", num_samples=100, split="test")
    assert not {r.uid for r in train} & {r.uid for r in test}


def test_arith_mixed_sizes_are_balanced_and_held_out():
    """digits=1|2/1: the sizes are taken in turn (a pool of 16 holds 8 of each), train and test never share a
    problem, and one size alone gives exactly the subset it gave before sizes could be mixed."""
    train, rep = load_prompts("arith:ops=+,digits=1|2/1", num_samples=16, seed=0)
    test, _ = load_prompts("arith:ops=+,digits=1|2/1", num_samples=64, split="test", seed=0)
    assert rep.rows_read == 81 + 810
    assert [r.extra["digits"] for r in train[:4]] == [[1, 1], [2, 1], [1, 1], [2, 1]]
    assert sum(r.extra["digits"] == [1, 1] for r in train) == 8 and sum(r.extra["digits"] == [1, 1] for r in test) == 32
    assert not {r.uid for r in train} & {r.uid for r in test}
    for r in train + test:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", r.problem).groups())
        assert r.ground_truth == str(a + b) and len(str(a)) == r.extra["digits"][0] and len(str(b)) == r.extra["digits"][1]
    # more than the small size holds: it runs out and the large one fills the rest
    many, _ = load_prompts("arith:ops=+,digits=1|2/1", num_samples=200, seed=0)
    assert sum(r.extra["digits"] == [1, 1] for r in many) == 81 and len({r.uid for r in many}) == 200
    single, _ = load_prompts("arith:ops=+,digits=2/1", num_samples=10, seed=3)
    pairs = arith_problems("+", (2, 1))
    order = list(range(len(pairs)))
    random.Random(3).shuffle(order)
    assert [r.problem for r in single] == [pairs[i][0] for i in order[:10]]


def test_arith_bad_options():
    with pytest.raises(ValueError, match="ops='/'"):
        load_prompts("arith:ops=/")
    with pytest.raises(ValueError, match="digits='5'"):
        load_prompts("arith:digits=5")
    with pytest.raises(ValueError, match="names a size twice"):
        load_prompts("arith:digits=1|1")
    with pytest.raises(ValueError, match="joined by"):
        load_prompts("arith:digits=1|4")
    with pytest.raises(ValueError, match="option 'size=3' is not key=value"):
        load_prompts("arith:size=3")


def test_reasoning_gym_sets_are_seeded_and_checkable():
    recs, rep = load_prompts("reasoning_gym:basic_arithmetic,gsm_symbolic", num_samples=6, seed=5)
    again, _ = load_prompts("reasoning_gym:basic_arithmetic,gsm_symbolic", num_samples=6, seed=5)
    assert [r.problem for r in recs] == [r.problem for r in again]
    assert {r.data_source for r in recs} == {"reasoning_gym/basic_arithmetic", "reasoning_gym/gsm_symbolic"}
    assert rep.rows_read == 6
    for r in recs:
        assert r.ground_truth and r.prompt.endswith('after "Answer:".')
    # basic_arithmetic answers evaluate the printed expression
    for r in recs:
        if r.data_source.endswith("basic_arithmetic"):
            expr = re.fullmatch(r"Calculate (.*)\.", r.problem)
            if expr:
                assert float(eval(expr.group(1))) == pytest.approx(float(r.ground_truth))  # noqa: S307


def test_champ_loads_270_problems():
    recs, rep = load_prompts("champ", template="raw")
    assert rep.rows_read == 270 == len(recs)
    assert recs[0].prompt == recs[0].problem and recs[0].data_source == "champ"
    numeric, _ = load_prompts("champ:numeric")
    assert 0 < len(numeric) < 270
    assert all(re.fullmatch(r"-?\d+(\.\d+)?(/\d+)?", r.ground_truth) for r in numeric)


def test_champ_answer_keeps_the_checkable_part():
    assert champ_answer("C(10, 5), or equivalently 252") == "252"
    assert champ_answer("5/14, or approximately 35.7%") == "5/14"
    assert champ_answer("239") == "239"
