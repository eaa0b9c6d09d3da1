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


@pytest.mark.parametrize("text", ["", " ", "Hello world", "<|im_start|>user\nhi<|im_end|>", "Hi 😀 漢字\x00\r\n" * 50])
@pytest.mark.parametrize("special", [True, False])
def test_encode_gives_the_ids_of_the_tokenizers_own_encode(tokenizer, text, special):
    """encode goes through encode_batch (below); the ids are those of tokenizers' encode."""
    assert tokenizer.encode(text, add_special_tokens=special) == \
        tokenizer._tokenizer.encode(text, add_special_tokens=special).ids


def test_encode_lets_other_threads_run(tokenizer):
    """A long encode must not hold the GIL: the server tokenizes prompts on worker threads beside the event loop
    and the engine's step loop. A counting thread gets far more turns during our encode than during tokenizers'
    encode of the same text (which holds the GIL: measured ~86x fewer; asserted 5x, same run)."""
    import threading

    text = "The orbit of a planet is long. " * 20000  # ~0.6 MB

    def turns_during(encode) -> int:
        count, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                count[0] += 1

        thread = threading.Thread(target=spin)
        thread.start()
        try:
            encode(text)
        finally:
            stop.set()
            thread.join()
        return count[0]

    holding = turns_during(tokenizer._tokenizer.encode)
    ours = turns_during(tokenizer.encode)
    assert ours > 5 * max(holding, 1), (ours, holding)


def test_the_byte_level_alphabet_is_the_tokenizers_own():
    from tokenizers import pre_tokenizers

    from orbitflow.model.tokenizer import _BYTE_OF_CHAR

    assert set(_BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_BYTE_OF_CHAR.values()) == list(range(256))


@pytest.mark.parametrize("text", ["Hi 😀🚀 é 漢字 ok", "🇫🇷 flag", " two  spaces\tand\nlines", "plain words"])
def test_token_bytes_join_into_the_text(tokenizer, text):
    """A token that splits a character decodes to U+FFFD alone; its bytes are the character's own."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    if text.isascii():
        assert [p.decode() for p in pieces] == [tokenizer.decode([i]) for i in ids]
    else:
        assert any(b"\xef\xbf\xbd" not in p and "\ufffd" in tokenizer.decode([i]) for p, i in zip(pieces, ids))
    assert tokenizer.token_bytes(tokenizer.eos_token_ids[0]) == b"<|im_end|>"  # an added token: its text


def test_token_bytes_of_a_sentencepiece_tokenizer_with_byte_fallback():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581Hi": 1, "<0xF0>": 2, "<0x9F>": 3, "<0x98>": 4, "<0x80>": 5, "!": 6}
    hf = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(hf, {}, None)
    assert [tok.token_bytes(i) for i in (1, 2, 3, 4, 5, 6)] == [b" Hi", b"\xf0", b"\x9f", b"\x98", b"\x80", b"!"]
    assert tok.decode([1, 2, 3, 4, 5, 6]) == "Hi😀!"


def _byte_token(tokenizer, value: bytes) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == value)


@pytest.mark.parametrize("stream", ["continuation bytes", "special tokens", "garbage then text"])
def test_each_push_decodes_a_short_window_whatever_the_model_generates(tokenizer, stream, monkeypatch):
    """Tokens that complete no text (lone UTF-8 continuation bytes, special tokens the text skips) used to stay in the
    window, so every push re-decoded the whole tail: 8,000 of them took 17 s of the server's event loop. Now the
    tokens a push decodes stay bounded, and the text is still the stream's own."""
    lone, eos = _byte_token(tokenizer, b"\x80"), tokenizer.eos_token_ids[0]
    ids = {"continuation bytes": [lone] * 2000, "special tokens": [eos] * 2000,
           "garbage then text": [lone] * 1000 + tokenizer.encode(" ok 😀 漢字" * 50, add_special_tokens=False)}[stream]
    decoded: list[int] = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda t, **kw: decoded.append(len(t)) or real(t, **kw))
    decoder = IncrementalDecoder(tokenizer)
    out = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert max(decoded, default=0) <= 16 and sum(decoded) <= 20 * len(ids)
    want = real(ids)
    assert want.startswith(out) and out.rstrip("\ufffd") == want.rstrip("\ufffd")


def test_random_streams_come_out_as_their_decode(tokenizer):
    """Seeded random streams of byte tokens (most of them split or break a character), text tokens and special
    tokens: what the decoder emits is the stream's decode, less at most the U+FFFDs at its very end (an incomplete
    character is never emitted), and never a character it later takes back."""
    import random

    rng = random.Random(0)
    single = [i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes(i)) == 1
              and tokenizer.token_bytes(i)[0] >= 0x80]
    text = tokenizer.encode("Hi 😀🚀 é 漢字 ok. 🇫🇷 a 🤖 b 中文测试", add_special_tokens=False)
    pool = single + text + sorted(tokenizer.special_ids)[:3] + list(range(200, 400))
    for _ in range(400):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 60))]
        decoder = IncrementalDecoder(tokenizer)
        pieces = [decoder.push(i) for i in ids]
        out = "".join(pieces) + decoder.flush()
        want = tokenizer.decode(ids)
        assert want.startswith(out) and out.rstrip("\ufffd") == want.rstrip("\ufffd"), ids
