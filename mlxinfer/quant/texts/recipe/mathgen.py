"""Worked arithmetic and algebra, in plain text and LaTeX, generated from a seed (written for
mlxinfer, MIT): each corpus draws its own problems from its own seed."""

import math
import random
from fractions import Fraction


def _frac(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def _tex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def multiplication(r):
    a, b = r.randint(120, 9899), r.randint(13, 987)
    digits = [int(d) for d in str(b)][::-1]
    lines = [f"Compute {a} × {b} by long multiplication."]
    total = 0
    for place, d in enumerate(digits):
        part = a * d * 10**place
        total += part
        lines.append(f"  {a} × {d * 10**place} = {part}")
    lines.append(
        f"Adding the partial products: {' + '.join(str(a * d * 10**p) for p, d in enumerate(digits))} = {total}."
    )
    lines.append(f"So {a} × {b} = {a * b}.")
    return "\n".join(lines)


TEX_OPS = {"+": "+", "-": "-", "×": "\\times", "÷": "\\div"}


def fractions(r):
    p = Fraction(r.randint(1, 11), r.randint(2, 12))
    q = Fraction(r.randint(1, 11), r.randint(2, 12))
    op = r.choice("+-×÷")
    value = {"+": p + q, "-": p - q, "×": p * q, "÷": p / q}[op]
    lines = [f"Evaluate {_frac(p)} {op} {_frac(q)}."]
    if op in "+-":
        d = p.denominator * q.denominator // math.gcd(p.denominator, q.denominator)
        a, b = p.numerator * (d // p.denominator), q.numerator * (d // q.denominator)
        lines.append(f"The least common denominator of {p.denominator} and {q.denominator} is {d}.")
        lines.append(
            f"{_frac(p)} = {a}/{d} and {_frac(q)} = {b}/{d}, so the result is ({a} {op} {b})/{d} = {a + b if op == '+' else a - b}/{d}."
        )
    elif op == "×":
        lines.append(
            f"Multiply numerators and denominators: ({p.numerator}·{q.numerator})/({p.denominator}·{q.denominator})."
        )
    else:
        lines.append(f"Dividing by {_frac(q)} is multiplying by its reciprocal {_frac(1 / q)}.")
    sym = TEX_OPS[op]
    lines.append(
        f"In lowest terms: {_frac(value)}. In LaTeX: ${_tex(p)} {sym} {_tex(q)} = {_tex(value)}$."
    )
    return "\n".join(lines)


def percent(r):
    old = r.randint(40, 5000)
    pct = r.choice([5, 8, 12.5, 15, 20, 25, 30, 35, 40, 60, 75])
    up = r.random() < 0.5
    change = old * pct / 100
    new = old + change if up else old - change
    word = "increase" if up else "decrease"
    return (
        f"A price of {old} is subject to a {pct}% {word}. What is the new price?\n"
        f"{pct}% of {old} is {old} × {pct}/100 = {change:g}.\n"
        f"The new price is {old} {'+' if up else '-'} {change:g} = {new:g}.\n"
        f"Equivalently, {old} × {1 + pct / 100 if up else 1 - pct / 100:g} = {new:g}."
    )


def linear(r):
    x = r.randint(-15, 15)
    a, c = r.sample([k for k in range(-9, 10) if k != 0], 2)
    b = r.randint(-30, 30)
    d = (a - c) * x + b
    return (
        f"Solve {a}x + {b} = {c}x + {d}.\n".replace("+ -", "- ")
        + f"Collect the x terms on the left: ({a} - {c})x = {d} - {b}, that is {a - c}x = {d - b}.\n".replace(
            "- -", "+ "
        )
        + f"Divide by {a - c}: x = {x}.\n"
        + f"Check: {a}·({x}) + ({b}) = {a * x + b} and {c}·({x}) + ({d}) = {c * x + d}.\n"
        + f"\\[ {a}x + {b} = {c}x + {d} \\implies x = \\frac{{{d - b}}}{{{a - c}}} = {x} \\]".replace(
            "+ -", "- "
        )
    )


def quadratic(r):
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    k = r.choice([1, 1, 1, 2, 3])
    b, c = -k * (p + q), k * p * q
    disc = b * b - 4 * k * c
    poly = f"{k if k > 1 else ''}x^2 {'+' if b >= 0 else '-'} {abs(b)}x {'+' if c >= 0 else '-'} {abs(c)}"
    return (
        f"Find the roots of {poly} = 0.\n"
        f"The discriminant is b^2 - 4ac = ({b})^2 - 4·{k}·({c}) = {disc}, and its square root is {math.isqrt(disc)}.\n"
        f"$$x = \\frac{{-b \\pm \\sqrt{{b^2 - 4ac}}}}{{2a}} = \\frac{{{-b} \\pm {math.isqrt(disc)}}}{{{2 * k}}}$$\n"
        f"So x = {max(p, q)} or x = {min(p, q)}"
        + (
            f", and the polynomial factors as {k if k > 1 else ''}(x - {p})(x - {q}).".replace(
                "- -", "+ "
            )
            if p != q
            else f" (a double root): {poly} = {k if k > 1 else ''}(x - {p})^2.".replace("- -", "+ ")
        )
    )


def system(r):
    x, y = r.randint(-8, 8), r.randint(-8, 8)
    a, b, c, d = (r.choice([k for k in range(-6, 7) if k]) for _ in range(4))
    if a * d - b * c == 0:
        d += 1 if d != -1 else 2
    e, f = a * x + b * y, c * x + d * y
    det = a * d - b * c
    return (
        f"Solve the system {a}x + {b}y = {e} and {c}x + {d}y = {f}.\n".replace("+ -", "- ")
        + f"The determinant is ({a})({d}) - ({b})({c}) = {det}.\n"
        + f"By Cramer's rule, x = (({e})({d}) - ({b})({f}))/{det} = {e * d - b * f}/{det} = {x}, "
        + f"and y = (({a})({f}) - ({e})({c}))/{det} = {a * f - e * c}/{det} = {y}.\n"
        + f"\\begin{{pmatrix}} {a} & {b} \\\\ {c} & {d} \\end{{pmatrix}}"
        + f"\\begin{{pmatrix}} x \\\\ y \\end{{pmatrix}} = \\begin{{pmatrix}} {e} \\\\ {f} \\end{{pmatrix}}"
    )


def series(r):
    a, d, n = r.randint(1, 20), r.randint(2, 9), r.randint(10, 60)
    last = a + (n - 1) * d
    return (
        f"Sum the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ..., {last} ({n} terms).\n"
        f"The sum is n(first + last)/2 = {n}·({a} + {last})/2 = {n * (a + last) // 2}.\n"
        f"$$\\sum_{{k=0}}^{{{n - 1}}} ({a} + {d}k) = {n * (a + last) // 2}$$"
    )


def derivative(r):
    coeffs = [r.randint(-9, 9) for _ in range(r.randint(3, 5))]
    while coeffs[-1] == 0:
        coeffs[-1] = r.randint(1, 9)

    def show(cs):
        terms = []
        for power in range(len(cs) - 1, -1, -1):
            c = cs[power]
            if c == 0:
                continue
            t = f"{c}" if power == 0 else f"{c}x" if power == 1 else f"{c}x^{power}"
            terms.append(t)
        return " + ".join(terms).replace("+ -", "- ") or "0"

    deriv = [k * c for k, c in enumerate(coeffs)][1:]
    x0 = r.randint(-3, 3)
    slope = sum(c * x0**k for k, c in enumerate(deriv))
    return (
        f"Differentiate f(x) = {show(coeffs)} and find the slope at x = {x0}.\n"
        f"Term by term, d/dx (c x^n) = n c x^(n-1), so f'(x) = {show(deriv)}.\n"
        f"At x = {x0}: f'({x0}) = {slope}.\n"
        f"\\[ \\frac{{d}}{{dx}}\\left({show(coeffs)}\\right) = {show(deriv)} \\]"
    )


def euclid(r):
    g = r.randint(2, 40)
    a, b = g * r.randint(20, 400), g * r.randint(5, 300)
    a, b = max(a, b), min(a, b)
    lines = [f"Find gcd({a}, {b}) with Euclid's algorithm."]
    x, y = a, b
    while y:
        lines.append(f"  {x} = {x // y}·{y} + {x % y}")
        x, y = y, x % y
    lines.append(
        f"The last non-zero remainder is {x}, so gcd({a}, {b}) = {x} and lcm = {a * b // x}."
    )
    return "\n".join(lines)


GENERATORS = [
    multiplication,
    fractions,
    percent,
    linear,
    quadratic,
    system,
    series,
    derivative,
    euclid,
]


def problems(seed: int, count: int) -> list[str]:
    r = random.Random(seed)
    return [f"Problem {i + 1}. " + r.choice(GENERATORS)(r) for i in range(count)]
