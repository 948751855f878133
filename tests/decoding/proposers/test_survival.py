"""How far copies are accepted (``decoding.proposers.survival``): the estimate, and the length it picks."""

from __future__ import annotations

import pytest

from decoding.proposers.survival import PRIOR, Survival


def test_a_copy_accepted_whole_never_lowers_the_later_rate():
    survival = Survival()
    for _ in range(10):
        survival.update(offered=3, reach=3)
    assert survival.first > PRIOR and survival.later > PRIOR


def test_a_copy_broken_at_its_second_token_counts_one_later_token_tried_and_none_accepted():
    survival, broken = Survival(), Survival()
    broken.update(offered=8, reach=1)
    survival.update(offered=1, reach=1)  # accepted whole: nothing tried past its end
    assert broken.later < survival.later == pytest.approx(PRIOR)
    assert broken.first == pytest.approx(survival.first)


def test_the_expectation_grows_with_the_length_and_never_past_it():
    survival = Survival()
    survival.update(offered=8, reach=5)
    lengths = [survival.expected(length) for length in range(1, 17)]
    assert lengths == sorted(lengths) and all(value <= length for length, value in enumerate(lengths, 1))


@pytest.mark.parametrize("reach, want", [(0, 1), (1, 1), (8, 8)])
def test_the_best_length_on_a_steep_curve_follows_how_far_copies_reach(reach, want):
    """A quarter step a draft token: copies that break at once or after one token are verified one token long,
    copies accepted whole eight long."""
    survival = Survival()
    for _ in range(8):
        survival.update(offered=8, reach=reach)
    assert survival.best(lambda tokens: 0.25 * tokens, 8)[0] == want


def test_the_best_length_is_the_limit_when_tokens_are_free_and_its_expectation_is_expected():
    survival = Survival()
    survival.update(offered=8, reach=2)
    length, expected = survival.best(lambda tokens: 0.0, 12)
    assert length == 12 and expected == pytest.approx(survival.expected(12))
