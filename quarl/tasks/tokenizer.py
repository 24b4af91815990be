"""Tokenizers: any local Hugging Face tokenizer directory, or the built-in one.

Both expose the small surface the trainer and CLI use: ``encode``, ``decode``,
``apply_chat_template`` (messages -> prompt token ids ending where the assistant's
answer starts), ``eos_token_id``, ``pad_token_id`` and ``vocab_size``.

The built-in tokenizer is character-level over printable ASCII plus a few special
tokens and a fixed chat format; it needs no files, which is what lets the default
run and the tests work on a machine with no model downloads.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Protocol

Message = dict[str, str]


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int
    vocab_size: int
    has_chat_template: bool  # False: apply_chat_template just joins the contents

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]: ...


class CharTokenizer:
    """Built-in character tokenizer: ids 0-7 are special, then printable ASCII.

    Chat format: ``<bos>`` then for each message ``<system>|<user>|<assistant>`` +
    text + ``<end>``; a generation prompt ends with ``<assistant>``. The model ends its
    answer with ``<eos>``.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>", "<end>")
    CHARS = string.printable[:-3]  # printable ASCII, space, tab and newline (no \r \x0b \x0c)

    def __init__(self) -> None:
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self.vocab_size = 128  # rounded up; ids past len(itos) are never produced
        self.name = "builtin-char"
        self.has_chat_template = True

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, self.unk_token_id) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if 0 <= i < len(self.itos):
                tok = self.itos[i]
                if i < len(self.SPECIALS) and skip_special_tokens:
                    continue
                out.append(tok)
        return "".join(out)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        ids = [self.bos_token_id]
        for m in messages:
            role = m.get("role")
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"chat message role must be system, user or assistant, got {role!r}")
            ids.append(self.stoi[f"<{role}>"])
            ids.extend(self.encode(m.get("content", "")))
            ids.append(self.stoi["<end>"])
        if add_generation_prompt:
            ids.append(self.stoi["<assistant>"])
        return ids


class HFTokenizer:
    """A local HF tokenizer directory (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # a core install has no transformers; the train extra does
            raise ValueError(
                f"the Hugging Face tokenizer in {path} needs transformers, which is not installed: "
                'pip install -e ".[train]" (or pip install "transformers>=4.45")'
            ) from e
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.name = str(path)
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer at {path} defines no eos_token; set one in tokenizer_config.json")
        self.eos_token_id = int(eos)
        pad = self.tok.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            # No template: plain concatenation of the contents.
            return self.encode("\n".join(m["content"] for m in messages) + "\n")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """``None`` or ``"builtin"`` -> the built-in tokenizer; otherwise a local HF tokenizer directory."""
    if path is None or str(path) == "builtin":
        return CharTokenizer()
    p = Path(path)
    # The hints name the run config's settings (quarl train / eval); quarl generate checks its own
    # --tokenizer before it gets here.
    if not p.exists():  # (a run reads its tokenizer before its weights: this is the first look at model.path)
        raise FileNotFoundError(
            f"{str(p)!r} does not exist: point --model.path (and --model.tokenizer, if set) at a local Hugging Face "
            "model directory (config.json, *.safetensors and tokenizer.json), or pass --model.tokenizer=builtin "
            "for the built-in character tokenizer"
        )
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(
            f"{str(p)!r} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
            "point --model.tokenizer at the model's tokenizer directory, or pass --model.tokenizer=builtin for the "
            "built-in character tokenizer (models trained by the demo run use it)"
        )
    return HFTokenizer(p)
