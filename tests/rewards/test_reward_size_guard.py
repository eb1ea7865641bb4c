"""The structural size bound that answers huge expressions without evaluating them.

Expressions are built unevaluated, so a broken guard fails the test instead of hanging it.
"""

import math

import sympy
from sympy import Integer, Pow, Symbol, binomial, factorial

from mcpo_megatron.rewards.verify import MAX_DIGITS, is_huge, size_digits


def P(b, e):
    return Pow(b, e, evaluate=False)


def test_size_bound_is_an_upper_bound_on_small_values():
    for b, e in [(2, 16), (9, 9), (10, 5), (99, 3), (7, 0)]:
        exact_digits = len(str(b**e))
        assert size_digits(P(Integer(b), Integer(e))) >= exact_digits - 1
    assert size_digits(factorial(Integer(20), evaluate=False)) >= len(str(math.factorial(20))) - 1


def test_towers_and_giant_values_are_huge():
    nine = Integer(9)
    assert is_huge(P(nine, P(nine, P(nine, nine))))  # 9^(9^(9^9))
    assert is_huge(P(P(Integer(2), Integer(99999)), Integer(99999)))  # (2^99999)^99999
    assert is_huge(factorial(P(Integer(10), Integer(10)), evaluate=False))  # (10^10)!
    assert is_huge(binomial(P(Integer(10), Integer(9)), P(Integer(10), Integer(8)), evaluate=False))
    k = Symbol("k")
    assert is_huge(sympy.Product(k, (k, 1, P(Integer(10), Integer(8)))))
    assert is_huge(P(Integer(2), Integer(-99_999_999)))  # exact rational with a giant denominator


def test_ordinary_answers_are_not_huge():
    x = Symbol("x")
    for expr in [Integer(12), sympy.Rational(1, 2), sympy.sqrt(8), sympy.FiniteSet(1, 2, 3),
                 sympy.Interval.Lopen(1, 2), (x + 1) ** 2, P(Integer(99999), Integer(99999)),
                 P(Integer(2), P(Integer(2), Integer(16))) + 1, P(x, P(Integer(10), Integer(9)))]:
        assert not is_huge(expr), expr
    assert size_digits(P(Integer(99999), Integer(99999))) < MAX_DIGITS
