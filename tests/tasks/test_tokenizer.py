from __future__ import annotations

import pytest

from quarl.tasks.tokenizer import CharTokenizer, load_tokenizer


def test_char_tokenizer_round_trip_and_chat():
    tok = CharTokenizer()
    text = "What is 12 + 7?\nAnswer: 19"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1"}])
    assert chat[0] == tok.bos_token_id and chat[-1] == tok.stoi["<assistant>"]
    assert tok.decode(chat) == "1+1"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_load_tokenizer_errors(tmp_path):
    assert isinstance(load_tokenizer(None), CharTokenizer)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_builtin_name_gives_the_character_tokenizer():
    tok = load_tokenizer("builtin")
    assert isinstance(tok, CharTokenizer)
    assert tok.decode(tok.encode("7+12=19")) == "7+12=19"
