"""Tokenizer wrapper over the `tokenizers` library, built from tokenizer.json or GGUF metadata."""

from __future__ import annotations

from pathlib import Path

from specjax.errors import ModelFormatError

_GGUF_CONTROL = 3  # llama.cpp token type CONTROL


class Tokenizer:
    def __init__(self, backend, eos_ids: tuple[int, ...] = (), bos_id: int | None = None,
                 add_bos: bool = False):
        self.backend = backend
        self.eos_ids = tuple(eos_ids)
        self.bos_id = bos_id
        self.add_bos = add_bos

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_file(cls, path: Path) -> "Tokenizer":
        import json

        from tokenizers import Tokenizer as Backend
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:
            raise ModelFormatError(f"{path}: unreadable tokenizer: {e}") from None
        eos: tuple[int, ...] = ()
        cfg_file = Path(path).parent / "config.json"
        if cfg_file.is_file():
            e = json.loads(cfg_file.read_text()).get("eos_token_id")
            eos = tuple(e) if isinstance(e, list) else ((e,) if e is not None else ())
        return cls(backend, eos_ids=eos)

    @classmethod
    def from_gguf_reader(cls, reader, where: str) -> "Tokenizer":
        """Rebuild a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelFormatError(f"{where}: GGUF tokenizer model {kind!r} is not supported (gpt2 only)")
        tokens = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        types = field("tokenizer.ggml.token_type", [])
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if field("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
            # These vocabularies were trained with each digit split off (as their tokenizer.json says).
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL]
        backend.add_special_tokens(control)
        eos = field("tokenizer.ggml.eos_token_id")
        return cls(backend, eos_ids=(int(eos),) if eos is not None else (),
                   bos_id=field("tokenizer.ggml.bos_token_id"),
                   add_bos=bool(field("tokenizer.ggml.add_bos_token", False)))
