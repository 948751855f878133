"""The text pipeline: UTF-8-safe incremental detokenization, stop strings across pieces, per-step deltas, and
decoding that never waits for an encode."""

from __future__ import annotations

import threading

import pytest

from server.text import REPLACEMENT_CHARACTER, IncrementalDetokenizer, StopMatcher, TextCodec, TextStream

MULTIBYTE = "héllo 😀 世界 🎉🎉 naïve café, 日本語のテキスト. Ünïcödé ✓ 🚀"


def decode_fn(tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def test_real_tokenizer_splits_multibyte_characters(tokenizer):
    """Guard: the emoji/CJK text really has tokens that end inside a character (else the next test is moot)."""
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any(REPLACEMENT_CHARACTER in tokenizer.decode([token]) for token in ids)


def test_detokenizer_never_emits_a_broken_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(decode_fn(tokenizer))
    pieces = [detokenizer.add(token) for token in ids]
    pieces.append(detokenizer.flush())
    assert all(REPLACEMENT_CHARACTER not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE == tokenizer.decode(ids)
    assert sum(1 for piece in pieces if piece) > 10  # it streams, it does not hold everything to the end


def test_detokenizer_flushes_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(decode_fn(tokenizer))
    streamed = "".join(detokenizer.add(token) for token in ids[:-1])
    assert REPLACEMENT_CHARACTER not in streamed
    tail = detokenizer.flush()
    assert (streamed + tail).startswith("ok")
    assert tail.endswith(REPLACEMENT_CHARACTER)  # the truncated emoji comes out once, at the end


def test_detokenizer_with_byte_tokens():
    """A toy tokenizer whose tokens are raw bytes: 'é' is two tokens."""
    vocab = {i: bytes([i]) for i in range(256)}

    def decode(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    data = "café".encode()
    detokenizer = IncrementalDetokenizer(decode)
    pieces = [detokenizer.add(byte) for byte in data]
    assert pieces == ["c", "a", "f", "", "é"]


@pytest.mark.parametrize(
    "stops, feeds, expected, matched",
    [
        (["###"], ["a#", "#", "#b"], "a", True),
        (["###"], ["a#", "#x", "y"], "a##xy", False),
        (["\n\n"], ["one\n", "\ntwo"], "one", True),
        (["END", "STOP"], ["xxST", "OP", "yy"], "xx", True),
        (["abc"], ["ab"], "ab", False),  # released by flush at the end
        (["ab", "b"], ["xab"], "x", True),  # the earliest match wins
        ([], ["any", "thing"], "anything", False),
    ],
)
def test_stop_matcher(stops, feeds, expected, matched):
    matcher = StopMatcher(stops)
    out, hit = [], False
    for text in feeds:
        piece, hit = matcher.feed(text)
        out.append(piece)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    assert ("".join(out), hit) == (expected, matched)


def test_stop_matcher_holds_back_a_possible_match():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("text </e") == ("text ", False)
    assert matcher.feed("nd>tail") == ("", True)


def test_text_stream_counts_tokens_up_to_the_stop(tokenizer):
    """The stop string "two three" spans two tokens (" two", " three") and two steps."""
    codec = TextCodec(tokenizer)
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)  # [" one", " two", " three", " four"]
    stream = TextStream(codec.decode, stops=["two three"])
    first = stream.feed(ids[:2])
    assert (first.text, first.tokens, first.stopped) == (" one ", 2, False)  # "two" is held back
    second = stream.feed(ids[2:])
    assert (second.text, second.tokens, second.stopped) == ("", 1, True)  # " four" is never kept
    assert stream.finish() == ""
    assert stream.feed(ids[3:]).tokens == 0


def test_text_stream_same_text_whatever_the_step_split(tokenizer):
    codec = TextCodec(tokenizer)
    ids = tokenizer.encode(MULTIBYTE + " STOP here", add_special_tokens=False)
    outputs = set()
    for step in (1, 2, 3, 5):
        stream = TextStream(codec.decode, stops=["STOP"])
        text = "".join(stream.feed(ids[i : i + step]).text for i in range(0, len(ids), step)) + stream.finish()
        outputs.add(text)
    assert outputs == {MULTIBYTE + " "}


def test_chat_template_maps_developer_to_system(tokenizer):
    codec = TextCodec(tokenizer)
    as_developer = codec.encode_chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    as_system = codec.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert as_developer == as_system
    assert tokenizer.decode(as_system).endswith("<|im_start|>assistant\n")


class HeldEncoder:
    """A tokenizer whose ``encode`` blocks until ``release`` is set (a huge prompt being tokenized)."""

    def __init__(self, entered: threading.Event, release: threading.Event) -> None:
        self.entered, self.release = entered, release

    def __deepcopy__(self, memo: dict) -> HeldEncoder:
        return HeldEncoder(self.entered, self.release)

    def __len__(self) -> int:
        return 4

    def encode(self, text: str, **_: object) -> list[int]:
        self.entered.set()
        assert self.release.wait(10)
        return [1]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def test_decode_does_not_wait_for_an_encode_in_progress():
    entered, release = threading.Event(), threading.Event()
    codec = TextCodec(HeldEncoder(entered, release))
    encoding = threading.Thread(target=codec.encode_text, args=("a huge prompt",))
    encoding.start()
    try:
        assert entered.wait(10)
        decoded = []
        decoding = threading.Thread(target=lambda: decoded.append(codec.decode([1, 2, 3])))
        decoding.start()
        decoding.join(5)
        assert decoded == ["xxx"]  # done while the encode still holds its lock
    finally:
        release.set()
        encoding.join(10)
