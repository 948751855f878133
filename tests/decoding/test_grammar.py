"""Grammar-constrained decoding: the constraint's moves, and constrained lookahead == constrained greedy."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from decoding.batch import BatchEngine
from decoding.errors import InvalidParameterError
from decoding.grammar import ANY_JSON_OBJECT, ConstraintViolation, Grammar, GrammarCompiler, GrammarError
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.step.sampling import row_chooser
from decoding.step.stream import DecodeStream, StepCounts, generate_autoregressive, generate_lookahead
from decoding.step.verify import verify_constrained
from decoding.weights.loading import ensure_default_model
from tests.conftest import TINY_SIZES
from tests.decoding.step.test_sampling import P_FLOOR, goodness_of_fit

PERSON = Grammar.json_schema({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "age": {"type": "integer"},
    },
    "required": ["name", "mood", "age"],
    "additionalProperties": False,
})
YES_NO = Grammar("regex", r"(yes|no)( (yes|no)){1,6}")


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer (files only: no weights are read)."""
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer))


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random LLaMA over the real vocabulary, so the real tokenizer's grammars apply to it."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_SIZES, "vocab_size": len(tokenizer)})).eval()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_constraint_allows_valid_prefixes_and_moves_only_when_told(compiler, tokenizer):
    constraint = compiler.constraint(PERSON)
    good = encode(tokenizer, '{"name": "Ada", "mood": "calm", "age": 36}')
    bad = encode(tokenizer, '{"nom": 1}')
    assert constraint.valid_prefix(good) == len(good)
    assert 0 < constraint.valid_prefix(bad) < len(bad)
    assert constraint.valid_prefix(good) == len(good), "valid_prefix must not move the state"
    constraint.consume(good[:3])
    constraint.advance(good[3])
    constraint.retreat(1)
    assert constraint.valid_prefix(good[3:]) == len(good) - 3
    constraint.consume(good[3:])
    assert constraint.complete
    assert constraint.allowed().nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_mask_sets_forbidden_tokens_to_minus_infinity(compiler, tokenizer):
    constraint = compiler.constraint(YES_NO)
    scores = constraint.mask(torch.zeros(len(tokenizer) + 7))  # wider than the vocabulary: padding is forbidden
    allowed = torch.isfinite(scores).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    with pytest.raises(ConstraintViolation):
        constraint.advance(encode(tokenizer, "maybe")[0])


@pytest.mark.parametrize("grammar", [
    Grammar("json_schema", '{"type": "nonsense"}'),
    Grammar("json_schema", "[1, 2"),
    Grammar("lark", "start: ("),
    Grammar("regex", "(unclosed"),
])
def test_bad_grammars_raise_a_readable_error(compiler, grammar):
    with pytest.raises(GrammarError) as raised:
        compiler.check(grammar)
    assert str(raised.value)


def test_a_grammar_needs_its_constraint(model, compiler):
    stop = StopCriteria(4)
    with pytest.raises(InvalidParameterError, match="grammar"):
        DecodeStream(model, [1, 2], stop, SamplingParams(grammar=YES_NO))
    with pytest.raises(InvalidParameterError, match="grammar"):
        DecodeStream(model, [1, 2], stop, SamplingParams(), constraint=compiler.constraint(YES_NO))
    with pytest.raises(InvalidParameterError, match="grammar"):
        BatchEngine(model).add("r", [1, 2], stop, SamplingParams(grammar=YES_NO))


CONFIGS = [
    LookaheadConfig(1, 3, 2),
    LookaheadConfig(3, 4, 3),
    LookaheadConfig(5, 4, 5),
    LookaheadConfig(5, 4, 5, copy_length=16, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.85, copy_length=16, copy_min_match=2),
    LookaheadConfig(3, 4, 3, jump_forward=True, runner_up=2, recycled=4),
    LookaheadConfig(1, 3, 2, lazy_window=True, jump_forward=True),
]
GRAMMARS = {"person": PERSON, "yes-no": YES_NO, "object": ANY_JSON_OBJECT}


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


def test_constrained_lookahead_equals_constrained_greedy(model, compiler, tokenizer):
    stop = StopCriteria(48, frozenset({tokenizer.eos_token_id}))
    prompts = [encode(tokenizer, 'Reply with JSON: {"name": "Bo", "mood": "sad", "age": 3}'), [5, 6, 7, 5, 6, 7]]
    accepted = 0
    for grammar, prompt, config in itertools.product(GRAMMARS.values(), prompts, CONFIGS):
        sampling = SamplingParams(grammar=grammar)
        expected = tokens_of(generate_autoregressive(model, prompt, stop, sampling, compiler.constraint(grammar)))
        steps = list(generate_lookahead(model, prompt, stop, sampling, config, compiler.constraint(grammar)))
        assert tokens_of(steps) == expected, (grammar, prompt, config)
        assert compiler.constraint(grammar).valid_prefix(expected) == len(expected)
        accepted += sum(step.stats.accepted for step in steps)
    assert accepted > 0, "multi-token steps must happen"


def test_json_whitespace_is_bounded(compiler, tokenizer):
    constraint = compiler.constraint(ANY_JSON_OBJECT)
    indented = encode(tokenizer, '{\n  "a": [1, 2]\n}')
    assert constraint.valid_prefix(indented) == len(indented)
    endless = encode(tokenizer, "{" + " " * 40 + '"a": 1}')
    assert constraint.valid_prefix(endless) < len(endless)


def test_a_complete_output_matches_the_schema_and_ends_with_eos(model, compiler, tokenizer):
    """A strong bias towards closing tokens makes the random model finish: the text is then valid JSON."""
    closing = {token: 8.0 for token in encode(tokenizer, '"}0')}
    sampling = SamplingParams(grammar=PERSON, logit_bias=tuple(closing.items()))
    stop = StopCriteria(64, frozenset({tokenizer.eos_token_id}))
    steps = list(generate_lookahead(model, [1, 2, 3], stop, sampling, CONFIGS[2], compiler.constraint(PERSON)))
    assert steps[-1].finish_reason == "stop"
    document = json.loads(tokenizer.decode(tokens_of(steps)))
    assert set(document) == {"name", "mood", "age"} and document["mood"] in ("happy", "sad", "calm")


def test_a_walk_through_the_end_of_the_output_leaves_the_constraint_where_it_was(compiler, tokenizer):
    """llguidance cannot roll back over a consumed EOS: the constraint keeps EOS to itself."""
    constraint = compiler.constraint(PERSON)
    document = encode(tokenizer, '{"name": "Ada", "mood": "calm", "age": 36}')
    constraint.consume(document[:-1])
    ending = [document[-1], tokenizer.eos_token_id, document[0]]
    assert constraint.valid_prefix(ending) == 2
    constraint.advance(ending[0])
    constraint.advance(ending[1])
    assert constraint.complete and not constraint.allowed().any() and constraint.valid_prefix([ending[1]]) == 0
    constraint.retreat(2)
    constraint.advance(ending[0])  # llguidance alone refuses this token after rolling back over EOS
    assert constraint.allowed().nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_the_grammars_end_stops_the_decode_even_when_eos_is_ignored(model, compiler, tokenizer):
    closing = {token: 8.0 for token in encode(tokenizer, '"}0')}
    sampling = SamplingParams(grammar=PERSON, logit_bias=tuple(closing.items()))
    stop = StopCriteria(64)  # ignore_eos: EOS is no stop token
    for config in (None, CONFIGS[2]):
        steps = list(DecodeStream(model, [1, 2, 3], stop, sampling, config, constraint=compiler.constraint(PERSON)))
        assert steps[-1].finish_reason == "stop" and json.loads(tokenizer.decode(tokens_of(steps)))


def test_sampled_constrained_lookahead_stays_in_the_grammar_and_equals_the_seeded_loop(model, compiler, tokenizer):
    """A seed gives the same constrained tokens with lookahead on or off, at every shape."""
    stop = StopCriteria(24, frozenset({tokenizer.eos_token_id}))
    prompts = [[9, 9, 9], encode(tokenizer, 'Reply with JSON: {"name": "Bo", "mood": "sad", "age": 3}')]
    accepted = 0
    for seed, grammar, prompt in itertools.product(range(3), [YES_NO, *GRAMMARS.values()], prompts):
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
        expected = tokens_of(generate_autoregressive(model, prompt, stop, sampling, compiler.constraint(grammar)))
        assert compiler.constraint(grammar).valid_prefix(expected) == len(expected)
        for config in CONFIGS:
            steps = list(generate_lookahead(model, prompt, stop, sampling, config, compiler.constraint(grammar)))
            assert tokens_of(steps) == expected, (seed, grammar, config)
            accepted += sum(step.stats.accepted for step in steps)
        if grammar is YES_NO:
            assert set(tokenizer.decode(expected).split(" ")) <= {"yes", "no"}
    assert accepted > 0, "multi-token steps must happen"


def test_batched_constrained_decodes_equal_their_greedy_loops(model, compiler, tokenizer):
    stop = StopCriteria(32, frozenset({tokenizer.eos_token_id}))
    engine = BatchEngine(model, grammars=compiler)
    requests = {name: SamplingParams(grammar=grammar) for name, grammar in GRAMMARS.items()}
    for name, sampling in requests.items():
        engine.add(name, [4, 5, 6], stop, sampling, CONFIGS[2])
    produced: dict[str, list[int]] = {name: [] for name in requests}
    while engine.has_work:
        for name, step in engine.step():
            produced[name] += step.token_ids
    for name, sampling in requests.items():
        constraint = compiler.constraint(sampling.grammar)
        assert produced[name] == tokens_of(generate_autoregressive(model, [4, 5, 6], stop, sampling, constraint))


class SetConstraint:
    """A stand-in grammar over a 6-token vocabulary: ``forbidden(path)`` is the set the grammar rules out next."""

    eos = 99  # outside the vocabulary: never chosen

    def __init__(self, forbidden) -> None:
        self.forbidden = forbidden
        self.path: list[int] = []

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        banned = torch.tensor(sorted(self.forbidden(tuple(self.path))), dtype=torch.long)
        return scores.index_fill(0, banned, float("-inf")) if len(banned) else scores

    def advance(self, token: int) -> None:
        assert token not in self.forbidden(tuple(self.path)), "the walk moved through a forbidden token"
        self.path.append(token)

    def retreat(self, count: int) -> None:
        del self.path[len(self.path) - count :]


def test_constrained_sampling_verification_keeps_each_masked_conditional():
    """Rows are masked after the accepted path: the first token follows the masked root, the second the masked row
    of the accepted candidate; the constraint ends where it started."""
    forbidden = {(): {0}, (1,): {5}, (3,): {2}}
    constraint = SetConstraint(lambda path: forbidden.get(path, set()))
    scores = torch.log(torch.tensor([
        [0.2, 0.3, 0.1, 0.2, 0.1, 0.1],   # after last
        [0.1, 0.1, 0.4, 0.1, 0.1, 0.2],   # after candidate 0's token 1
        [0.3, 0.1, 0.2, 0.1, 0.2, 0.1],   # after candidate 1's token 3
    ]))
    candidates = [(1, 2), (3, 4)]
    sampling = SamplingParams(temperature=1.0)
    first, second = Counter(), {1: Counter(), 3: Counter()}
    total = 6000
    for seed in range(total):
        choose = row_chooser(sampling, seed, 0)
        verdict = verify_constrained(scores, candidates, lambda c, k: 1 + c, constraint, choose)
        assert constraint.path == []
        first[verdict.tokens[0]] += 1
        if verdict.num_accepted:
            second[verdict.tokens[0]][verdict.tokens[1]] += 1
    masked = {(): scores[0], (1,): scores[1], (3,): scores[2]}
    exact = {path: torch.softmax(constraint_free(row, forbidden[path]), dim=0) for path, row in masked.items()}
    assert goodness_of_fit(Counter({(t,): n for t, n in first.items()}),
                           {(t,): float(p) for t, p in enumerate(exact[()])}, total) > P_FLOOR
    for token in (1, 3):
        seen = Counter({(t,): n for t, n in second[token].items()})
        expected = {(t,): float(p) for t, p in enumerate(exact[(token,)])}
        assert sum(seen.values()) > 500 and goodness_of_fit(seen, expected, sum(seen.values())) > P_FLOOR
    assert first[0] == 0 and second[1][5] == 0 and second[3][2] == 0


def constraint_free(row: torch.Tensor, banned: set[int]) -> torch.Tensor:
    """``row`` with ``banned`` at -inf."""
    return row.index_fill(0, torch.tensor(sorted(banned), dtype=torch.long), float("-inf"))


def test_jump_forward_offers_the_tokens_the_grammar_forces(model, compiler, tokenizer):
    """After '{"' the grammar of PERSON forces its first key: the jump source proposes such runs, and the output
    stays the constrained loop's."""
    constraint = compiler.constraint(PERSON)
    assert constraint.forced(32) == []  # whitespace may come first: nothing is forced
    constraint.consume(encode(tokenizer, '{"'))
    forced = constraint.forced(32)
    assert tokenizer.decode(forced) == "name" and constraint.valid_prefix(forced) == len(forced)
    assert constraint.forced(32) == forced  # the state did not move
    stop = StopCriteria(48, frozenset({tokenizer.eos_token_id}))
    sampling = SamplingParams(grammar=PERSON)
    prompt = encode(tokenizer, 'Reply with JSON: {"name": "Bo", "mood": "sad", "age": 3}')
    config = LookaheadConfig(1, 3, 2, lazy_window=True, jump_forward=True)
    steps = list(generate_lookahead(model, prompt, stop, sampling, config, compiler.constraint(PERSON)))
    expected = tokens_of(generate_autoregressive(model, prompt, stop, sampling, compiler.constraint(PERSON)))
    assert tokens_of(steps) == expected
    counts = sum((step.stats.counts() for step in steps), StepCounts())
    assert counts.source("jump")[1] <= counts.source("jump")[0]
