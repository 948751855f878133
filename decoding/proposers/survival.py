"""How far a decode's copies are accepted, and the copy length that pays best on the step-cost curve.

Contract: ``Survival()`` estimates, from the copy steps one decode verified, the chance that a copy's first token is
accepted (``first``) and that each later token is, given the one before it was (``later``): a two-hazard survival
model (a copy that starts right tends to go on right). Each rate is a ratio of decayed counts, tokens accepted over
tokens tried, each ``update`` first multiplying the counts by ``DECAY`` (recent copies weigh most: text moves between
passages that repeat and passages that do not); both start from ``PRIOR_WEIGHT`` pseudo-trials at ``PRIOR`` (what
a decode's first copies were accepted to on the tune splits: on a CPU its first copies are 3-4 tokens, on a flat
curve the whole span). A copy accepted whole says nothing of the token after its end: only the tokens it
offered count as tried.

``expected(length)``: the accepted tokens a copy of ``length`` tokens expects, ``first * (1 - later**length) / (1 -
later)``. ``best(price, limit)``: the length ``L`` in ``1..limit`` that commits the most tokens per unit of step cost,
``(1 + expected(L)) / (1 + price(L))`` (``price``: ``decoding.proposers.base.Context.price``, the accepted guesses L
draft tokens must bring on this step), and that length's expectation. Where the step costs grow with its tokens (a
CPU), text whose copies break after a token or two is verified with short copies that pay instead of long ones that do
not; where they hardly grow (a GPU's flat curve, or no curve: ``price`` 0), the best length is ``limit``.

>>> survival = Survival()
>>> survival.best(lambda tokens: 0.0, 8)[0]
8
>>> for _ in range(6):
...     survival.update(offered=8, reach=1)  # the first token right, the second wrong
>>> survival.best(lambda tokens: 0.25 * tokens, 8)[0]  # each draft token costs a quarter step (a CPU)
1
"""

from __future__ import annotations

from collections.abc import Callable

PRIOR = 0.75  # the rates a decode starts from: its first copies measured on the tune splits (the first three copies
# of each CPU decode, 2026-12-07: first token 0.69 chat / 0.82 HumanEval, each later one 0.67 / 0.85)
PRIOR_WEIGHT = 2.0  # pseudo-trials behind each prior rate
DECAY = 0.75  # each verified copy multiplies the counts before it by this: the last ~4 copies weigh most


class Survival:
    """How far copies are accepted (module contract)."""

    def __init__(self) -> None:
        self._tried = [PRIOR_WEIGHT, PRIOR_WEIGHT]  # first token, later tokens
        self._accepted = [PRIOR * PRIOR_WEIGHT, PRIOR * PRIOR_WEIGHT]

    @property
    def first(self) -> float:
        """The chance a copy's first token is accepted."""
        return self._accepted[0] / self._tried[0]

    @property
    def later(self) -> float:
        """The chance a later token is, given the one before it was."""
        return self._accepted[1] / self._tried[1]

    def update(self, offered: int, reach: int) -> None:
        """One verified copy of ``offered`` tokens whose first ``reach`` were accepted.

        >>> survival = Survival()
        >>> survival.update(offered=4, reach=4); survival.update(offered=4, reach=0)
        >>> round(survival.first, 3), round(survival.later, 3)
        (0.554, 0.917)
        """
        reach = min(reach, offered)
        for kind in (0, 1):
            self._tried[kind] *= DECAY
            self._accepted[kind] *= DECAY
        self._tried[0] += 1
        self._accepted[0] += reach > 0
        if reach:
            self._tried[1] += min(reach + 1, offered) - 1  # the tokens after the first that were tried
            self._accepted[1] += reach - 1

    def expected(self, length: int) -> float:
        """Accepted tokens a copy of ``length`` tokens expects.

        >>> round(Survival().expected(1), 3), round(Survival().expected(8), 3)
        (0.75, 2.7)
        """
        later = self.later
        if later >= 1.0:
            return self.first * length
        return self.first * (1.0 - later ** length) / (1.0 - later)

    def best(self, price: Callable[[int], float], limit: int) -> tuple[int, float]:
        """``(length, expected(length))`` for the length in ``1..limit`` with the most committed tokens per unit of
        step cost (the shortest among equals)."""
        best, best_ratio, best_expected = 1, -1.0, 0.0
        first, later, expected = self.first, self.later, 0.0
        chance = first
        for length in range(1, max(1, limit) + 1):
            expected += chance
            chance *= later
            ratio = (1.0 + expected) / (1.0 + price(length))
            if ratio > best_ratio + 1e-12:
                best, best_ratio, best_expected = length, ratio, expected
        return best, best_expected
