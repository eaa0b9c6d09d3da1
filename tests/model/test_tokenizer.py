"""Incremental detokenization never emits a partial character (issue 13's D6)."""

import pytest

from orbitflow.model.tokenizer import IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from orbitflow.model.loader import _model_dir_for
    from orbitflow.model.registry import resolve_model_path

    return Tokenizer.from_dir(_model_dir_for(resolve_model_path("smollm2-135m")))


@pytest.mark.parametrize("text", ["Hi 😀🚀 é 漢字 ok", "😀😀😀", "🇫🇷 flag", "a 🤖 b"])
def test_characters_split_across_tokens_come_out_whole(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the case should split a character"
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == text


def test_a_stream_that_ends_inside_a_character_drops_it(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids[:-1]] + [decoder.flush()]  # the last byte never came
    assert "".join(pieces) == "ok " and not any("\ufffd" in piece for piece in pieces)
