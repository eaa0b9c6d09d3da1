"""Tokenizer wrapper over `tokenizers` + jinja2, so that loading a model never imports transformers.

Mirrors transformers' behaviour: `encode` adds special tokens through tokenizer.json's post-processor, and
chat templates render in the same sandboxed jinja2 environment transformers uses.
"""

import json
import re
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# GPT-2's byte-level alphabet, read backwards: a byte-level BPE token spells each byte with a printable character,
# the printable Latin-1 bytes with themselves and the other 68, in byte order, with U+0100 onwards.
_PRINTABLE_BYTES = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
_STAND_INS = iter(range(0x100, 0x200))
_BYTE_OF_CHAR = {chr(b if b in _PRINTABLE_BYTES else next(_STAND_INS)): b for b in range(256)}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    def __init__(
        self,
        tokenizer: _HFTokenizer,
        tokenizer_config: dict[str, Any],
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = {
            key: _token_content(tokenizer_config[key])
            for key in _SPECIAL_TOKEN_KEYS
            if tokenizer_config.get(key) is not None
        }
        self._clean_up_spaces = bool(tokenizer_config.get("clean_up_tokenization_spaces", False))
        eos_ids = list(extra_eos_token_ids)
        eos_token = self.special_tokens.get("eos_token")
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """Reads tokenizer.json, tokenizer_config.json and the chat template (config or .jinja file)."""
        path = Path(path)
        tokenizer = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        return cls(tokenizer, config, _read_chat_template(path, config), extra_eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: a megabyte prompt would stop every other
        # thread, the engine's step loop and the server's event loop included, for about a second); same ids.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a generated token stands for. A byte-level token may hold part of a UTF-8 character, which
        `decode` turns into U+FFFD; the bytes of consecutive tokens join into the text. Added (special) tokens give
        their text, and tokens of other tokenizers what they decode to alone."""
        known = self._token_bytes.get(token_id)
        if known is None:
            known = self._token_bytes[token_id] = self._read_token_bytes(token_id)
        return known

    def _read_token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        kinds = self._decoder_kinds
        if "ByteLevel" in kinds and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if "ByteFallback" in kinds and (byte := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        if "Metaspace" in kinds or "Replace" in kinds:  # sentencepiece: U+2581 marks a space
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    @cached_property
    def _token_bytes(self) -> dict[int, bytes]:
        return {}

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    def is_byte_piece(self, token_id: int) -> bool:
        """Whether the token is a sentencepiece byte-fallback piece (``<0xNN>``), which its decoder turns into text
        a whole run at a time."""
        if "ByteFallback" not in self._decoder_kinds:
            return False
        piece = self._tokenizer.id_to_token(token_id)
        return piece is not None and token_id not in self._added_ids and _BYTE_PIECE.fullmatch(piece) is not None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The special tokens: what `decode(..., skip_special_tokens=True)` leaves out of the text."""
        return frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def _decoder_kinds(self) -> frozenset[str]:
        """The types of the tokenizer's decoder, and of its steps when it is a sequence."""
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        steps = decoder.get("decoders") or [decoder]
        return frozenset(step.get("type", "") for step in steps if isinstance(step, dict))

    def render_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        template = self._template_environment.from_string(self.chat_template)
        return template.render(
            messages=messages,
            tools=kwargs.pop("tools", None),
            documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # The rendered template already contains its special tokens, so none are added (as in transformers).
        text = self.render_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _template_environment(self) -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env


HOLD_TOKENS = 4  # a UTF-8 character has at most 4 bytes and a token at least one: held longer, a window holds garbage
MAX_HELD = 64  # tokens held without a safe place to cut (a long run of sentencepiece byte pieces): cut anyway


class IncrementalDecoder:
    """Streaming detokenizer: `push` returns the text completed by each new token.

    Decodes a short window of recent ids rather than single tokens, so that word-boundary spaces come out
    right and a multi-byte character split across tokens is only emitted once complete. The window stays short
    whatever the model generates: tokens that decode to nothing anywhere (special tokens the text skips, ids past
    the tokenizer's vocabulary) never enter it, and once `HOLD_TOKENS` tokens are held without completing text
    (bytes that are no UTF-8 character, each decoded as U+FFFD; tokens that add no text) the text up to the last
    token boundary that the later tokens no longer change goes out. Before, such a stream re-decoded its whole tail
    on every token: 8,000 lone continuation bytes took 17 s of the server's event loop. A sentencepiece decoder
    with byte fallback decodes a run of byte pieces all or nothing (every byte U+FFFD unless the whole run is
    UTF-8), so such a run is never cut, until `MAX_HELD` tokens of garbage are held: then the text that goes out may
    differ from the whole stream's decode in those garbage bytes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # decode(..., skip_special_tokens=True) drops these wherever they are: they add nothing to any window
        self._skipped = getattr(tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
        self._token_bytes = getattr(tokenizer, "token_bytes", None)
        self._byte_piece = getattr(tokenizer, "is_byte_piece", None)
        self.ids: list[int] = []  # the tokens pushed, less those that decode to nothing
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # end of the text already returned

    def push(self, token_id: int) -> str:
        if token_id in self._skipped or (self._token_bytes is not None and not self._token_bytes(token_id)):
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            return self._advance(len(self.ids), new_text, prefix_text)
        held = len(self.ids) - self._read_offset
        if held < HOLD_TOKENS:
            return ""
        if len(new_text) <= len(prefix_text):  # the held tokens add no text: they become context
            return self._advance(len(self.ids), new_text, prefix_text)
        # The text ends in U+FFFD this long after the last emit: release it up to the last token boundary whose
        # text is final. A character still being completed has at most 3 bytes so far, all in the last 3 tokens
        # (each holds one at least); before them, the text up to a boundary that no character straddles (a prefix
        # of the whole window's text) and no run of byte pieces spans never changes again.
        for end in range(len(self.ids) - (HOLD_TOKENS - 1), self._read_offset, -1):
            if held < MAX_HELD and self._byte_piece is not None and self._byte_piece(self.ids[end - 1]) \
                    and self._byte_piece(self.ids[end]):
                continue
            text = self._decode(self.ids[self._prefix_offset : end])
            if held >= MAX_HELD or (len(text) > len(prefix_text) and new_text.startswith(text)):
                return self._advance(end, text, prefix_text)
        return ""

    def _advance(self, end: int, text: str, prefix_text: str) -> str:
        """Emit the window's text up to token ``end``; the tokens since the last emit become its context."""
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held back at the end of the stream. A character left incomplete (the stream ended
        between its bytes) is dropped rather than emitted as U+FFFD: no partial character ever goes out."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :].rstrip("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def _token_content(token: str | dict) -> str:
    return token["content"] if isinstance(token, dict) else token


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    json_file = path / "chat_template.json"
    if template is None and json_file.exists():
        template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _clean_up_tokenization(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
