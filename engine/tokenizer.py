"""Tokenizer: a fast `tokenizers.Tokenizer` plus the HF conventions the engine needs (special tokens, BOS,
chat template, streaming detokenization).

Reads an HF-format directory (tokenizer.json, tokenizer_config.json, optionally chat_template.jinja,
config.json, generation_config.json) without importing transformers or torch, so it loads in milliseconds.
Chat templates are rendered the way transformers renders them (sandboxed jinja2, trim_blocks, lstrip_blocks,
`raise_exception`, a non-escaping `tojson`), so prompts are byte-identical to `apply_chat_template`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Tokenizer:
    """Text <-> token ids for one model.

    Thread-safety: encode/decode/token_text/decode_incremental only read state and may be called from any
    thread; the compiled chat template is built lazily once (a benign race: two threads may both compile it).
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """Wrap `tokenizer`; token strings must be in its vocabulary (unknown ones raise ValueError).

        `extra_eos_token_ids` adds stop ids that have no token string at hand (config.json's eos_token_id).
        """
        self._tk = tokenizer
        self._bos_token = bos_token
        self._eos_token = eos_tokens[0] if eos_tokens else None
        self._unk_token = unk_token
        self._pad_token = pad_token
        self._add_bos = add_bos_token
        self._chat_template = chat_template
        self._compiled_template: Any = None
        self.directory: Path | None = None  # the HF-format directory it was read from (from_dir)

        self._bos_id = self._id_of(bos_token) if bos_token is not None else None
        eos_ids = [self._id_of(t) for t in eos_tokens] + [int(i) for i in extra_eos_token_ids]
        self._eos_ids = tuple(dict.fromkeys(eos_ids))  # de-duplicated, first occurrence keeps its rank
        added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        named = [self._bos_id, *self._eos_ids, *(self._id_of(t) for t in (unk_token, pad_token) if t is not None)]
        self._special_ids = frozenset([i for i, tok in added.items() if tok.special] +
                                      [i for i in named if i is not None])

        # Sentencepiece-style decoders drop the leading space of a sequence's first token ("▁the" -> "the"), so
        # token_text decodes each token after a reference token and strips the reference's text.
        self._ref_id, self._ref_text = _reference_token(tokenizer)

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from an HF-format directory.

        Requires tokenizer.json. From tokenizer_config.json: bos/eos/unk/pad tokens (strings or serialized
        AddedToken dicts), add_bos_token, chat_template (a string, or a list of named templates of which
        "default" is used); a chat_template.jinja file (transformers >= 4.50 layout) overrides it. Extra
        stop ids come from config.json / generation_config.json "eos_token_id" when present.
        """
        path = Path(path)
        tk_file = path / "tokenizer.json"
        if not tk_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        tokenizer = _HFTokenizer.from_file(str(tk_file))
        cfg = _read_json(path / "tokenizer_config.json")

        chat_template = cfg.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        if (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(path / name).get("eos_token_id")
            extra_eos += [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])

        bos_token = _token_str(cfg.get("bos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # Not stated (e.g. Llama-3): the tokenizer.json post-processor is what adds BOS in HF; probe it.
            probe = tokenizer.encode("a", add_special_tokens=True).ids
            add_bos = bos_token is not None and probe[:1] == [tokenizer.token_to_id(bos_token)]
        eos_token = _token_str(cfg.get("eos_token"))
        tok = cls(
            tokenizer,
            bos_token=bos_token,
            eos_tokens=() if eos_token is None else (eos_token,),
            unk_token=_token_str(cfg.get("unk_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            extra_eos_token_ids=extra_eos,
            add_bos_token=bool(add_bos),
            chat_template=chat_template,
        )
        tok.directory = path  # where it came from: what get_tokenizer() loads with transformers
        return tok

    def _id_of(self, token: str) -> int:
        token_id = self._tk.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    # ---- properties ----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may have more rows)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: tokenizer_config's eos_token first, then config/generation_config ids."""
        return self._eos_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Added tokens flagged special, plus bos/eos/unk/pad: what skip_special_tokens drops."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        """Replace the chat template (Jinja text): what `Engine(chat_template=FILE)` does."""
        self._chat_template, self._compiled_template = template, None

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def max_token_chars(self) -> int:
        """The longest token's string (byte-level or sentencepiece form): no token decodes to more characters,
        so a text of N characters needs at least N / max_token_chars tokens (a length check before encoding)."""
        if getattr(self, "_max_token_chars", None) is None:
            self._max_token_chars = max((len(t) for t in self._tk.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped `tokenizers.Tokenizer` (read-only use; e.g. for grammar backends)."""
        return self._tk

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. "<|im_end|>"), or None when it is not in the vocabulary."""
        return self._tk.token_to_id(token)

    def add_special_token(self, token: str) -> int:
        """Add `token` as a special token (a multimodal placeholder such as "<image>" for a dummy model that
        borrows this tokenizer) and return its id; the id of an existing token is returned as it is."""
        existing = self._tk.token_to_id(token)
        if existing is not None:
            return existing
        from tokenizers import AddedToken

        self._tk.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        token_id = self._tk.token_to_id(token)
        assert token_id is not None, token  # just added
        self._special_ids = frozenset(self._special_ids | {token_id})
        return token_id

    # ---- text <-> ids --------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Special-token text (e.g. "<|im_start|>") becomes its special id.

        Never appends EOS. Prepends BOS only when the tokenizer asks for it (add_bos_token) and the text
        does not already start with it (a chat template that writes bos_token would otherwise double it).
        """
        return self.encode_many([text])[0]

    def encode_with_offsets(self, text: str) -> tuple[list[int], TextOffsets]:
        """encode(text), and where its tokens sit in `text`'s characters."""
        # encode_batch lets go of the GIL while it works (encode holds it): many programs' prompts are
        # tokenized at once, beside the scheduler thread (mmlu at GPU scale on a dummy model ran 1.2-1.7x the
        # programs a second on this 2-core machine; its prompts' encodes had held the GIL ~30% of the run)
        encoding = self._tk.encode_batch([text], add_special_tokens=False)[0]
        ids, skipped = self._with_bos(encoding.ids)
        return ids, TextOffsets(encoding, skipped)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """encode() of each text, in one call: the texts are tokenized in parallel, without the GIL (a select's
        prefix and its prefix + choice texts). No character offsets are worked out: tokenizers'
        encode_batch_fast gives the same ids in 0.76x encode_batch's time for a hellaswag select's five
        450-token texts on 2 cores (tokenizers >= 0.21; encode_batch before)."""
        batch = getattr(self._tk, "encode_batch_fast", None) or self._tk.encode_batch
        return [self._with_bos(e.ids)[0] for e in batch(list(texts), add_special_tokens=False)]

    def _with_bos(self, ids: list[int]) -> tuple[list[int], int]:
        """ids with BOS prepended when the tokenizer asks for it and they do not start with it; how many ids
        were prepended (0 or 1)."""
        if self._add_bos and self._bos_id is not None and ids[:1] != [self._bos_id]:
            ids.insert(0, self._bos_id)
            return ids, 1
        return ids, 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless skip_special_tokens=False."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of a single token as it reads inside a sequence (leading space kept), special tokens shown as
        themselves. A token holding part of a UTF-8 character reads as U+FFFD; an id outside the vocabulary
        reads as "" (dummy models may have a larger vocabulary than this tokenizer)."""
        if self._ref_id is not None:
            text = self._tk.decode([self._ref_id, token_id], skip_special_tokens=False)
            if text.startswith(self._ref_text):
                return text[len(self._ref_text):]
        return self._tk.decode([token_id], skip_special_tokens=False)

    def decode_incremental(
        self, ids: Sequence[int], prefix_offset: int, read_offset: int, *,
        skip_special_tokens: bool = True, final: bool = False,
    ) -> tuple[str, int, int]:
        """Streaming detokenization: the text that `ids[read_offset:]` adds, and the offsets for the next call.

        Start a stream with prefix_offset = read_offset = 0 (or, to continue after a prompt, read_offset =
        len(prompt_ids) and prefix_offset a few tokens before it, so that word boundaries read right).
        `ids[prefix_offset:read_offset]` is context that was already emitted; decoding it with and without the
        new tokens and taking the difference keeps spaces that decoders only render between tokens. Text
        that ends in U+FFFD (an incomplete UTF-8 character) is held back until a later call completes it,
        so no chunk ever carries a broken character; pass final=True on the last call to flush whatever is
        held. Concatenating the returned chunks gives decode(ids) (offsets starting at 0).
        Returns (new_text, new_prefix_offset, new_read_offset); the offsets are unchanged when nothing is
        emitted.
        """
        ids = list(ids)
        prefix_text = self._tk.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
        full_text = self._tk.decode(ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith(_REPLACEMENT_CHAR)):
            return full_text[len(prefix_text):], read_offset, len(ids)
        return "", prefix_offset, read_offset

    # ---- chat template -------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, as transformers' apply_chat_template(tokenize=False).

        Template variables: messages, add_generation_prompt, bos_token, eos_token, unk_token, pad_token,
        tools/documents (None unless given), plus any **kwargs. Raises ValueError when the tokenizer has no
        chat template, or when the template rejects the conversation (its raise_exception).
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no chat_template); "
                             "build the prompt text yourself or use a chat model")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self._chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = getattr(self, f"_{name}")
            if value is not None:  # as in HF: unset tokens are undefined, not "None"
                variables[name] = value
        variables.update(kwargs)
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **variables)


class TextOffsets:
    """Where the tokens of an encoded text end in its characters, looked up one at a time: building a long
    prompt's whole offset list in Python costs ~0.3 us a token, one lookup ~4 us. Holds the tokenizer's encoding
    (of the order of the ids' own memory) while it lives."""

    def __init__(self, encoding: Any, skipped: int) -> None:
        self._encoding = encoding
        self._skipped = skipped  # ids before the encoding's first token (a BOS that encode prepended)

    def prefix_chars(self, tokens: int) -> int:
        """How many characters of the text its first `tokens` ids cover: where the last of them ends (a BOS
        covers none; a token holding part of a character's UTF-8 bytes covers the whole character)."""
        for i in range(min(tokens, len(self._encoding) + self._skipped) - 1 - self._skipped, -1, -1):
            span = self._encoding.token_to_chars(i)
            if span is not None:  # (no span: a token the tokenizer added, not read from the text)
                return span[1]
        return 0


def fit_pieces(pieces: Sequence[str], count: int, text: str) -> list[str]:
    """`count` texts, one per output token, that join to exactly `text`: `pieces` (the incremental
    detokenizer's, one per token it read) taken as the same lengths of `text` (they read as it, but for the one
    a stop string cut, and where a final decode reads otherwise), what `text` holds past them (a character held
    back) given to the next token, and "" for the tokens past its end (a stop string's, EOS)."""
    if len(pieces) == count and "".join(pieces) == text:  # the usual case: one join
        return list(pieces)
    out: list[str] = []
    pos = 0
    for piece in pieces[:count]:
        if pos >= len(text):
            break
        out.append(text[pos:pos + len(piece)])
        pos += len(out[-1])
    if pos < len(text):
        if len(out) < count:
            out.append(text[pos:])
        elif out:
            out[-1] += text[pos:]
    return out + [""] * (count - len(out))


def compile_chat_template(source: str) -> Any:
    """Compile a chat template in a sandbox configured like transformers' (so output matches it byte for byte)."""
    import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks; render the body."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # jinja2's own tojson HTML-escapes and sorts keys; templates are written against HF's plain json.dumps.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _reference_token(tokenizer: _HFTokenizer) -> tuple[int | None, str]:
    """A plain token that encodes and decodes to itself (e.g. "▁the" <-> "the"), with its text."""
    for candidate in ("a", "the", "x", "I", ".", "0"):
        ids = tokenizer.encode(candidate, add_special_tokens=False).ids
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == candidate:
            return ids[0], candidate
    return None, ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value
