"""The SentencePiece tokenizer: BOS rule, round trips, the Gemma 4 chat format, special ids."""

import json

import pytest

from refimpl.config import load_config
from refimpl.errors import TokenizerError
from refimpl.synth import SPECIAL_PIECES
from refimpl.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ckpt(preset_dirs):
    return preset_dirs["e4b-mini"]


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def test_gemma_core_ids(tok):
    assert [tok.piece(i) for i in range(5)] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    # Gemma 4's markers are single pieces, right after the core ids
    assert [tok.piece_id(p) for p in SPECIAL_PIECES] == list(range(4, 4 + len(SPECIAL_PIECES)))


def test_encode_prepends_bos_and_round_trips(tok):
    for text in ["hello world", "the model  prefill\tdecode\n", "café 漢字 🙂 naïve", "123 4096", ""]:
        ids = tok.encode(text)
        assert ids[0] == 2
        assert tok.encode(text, add_bos=False) == ids[1:]
        assert tok.decode(ids[1:]) == text
    assert tok.vocab_size == 512


def test_unknown_characters_use_byte_fallback(tok):
    ids = tok.encode("ж", add_bos=False)  # not in the training corpus: two UTF-8 bytes
    assert [tok.piece(i) for i in ids] == ["<0xD0>", "<0xB6>"]


def test_chat_format(tok):
    ids = tok.encode_chat([{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "why?"}])
    assert ids[0] == 2
    # <bos> is a control piece and decodes to nothing; the markers are user-defined pieces and do
    assert tok.decode(ids) == (
        "<|turn>system\nbe brief<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nhello<turn|>\n"
        "<|turn>user\nwhy?<turn|>\n<|turn>model\n"
    )
    start, end = tok.piece_id("<|turn>"), tok.piece_id("<turn|>")
    assert ids.count(start) == 5 and ids.count(end) == 4
    # without the generation prompt the conversation ends after the last turn
    short = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.decode(short) == "<|turn>user\nhi<turn|>\n"


def test_chat_markers_typed_by_the_user_are_the_same_pieces(tok):
    # a user-defined piece in plain text is matched whole, so the rendered string re-encodes identically
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.encode("<|turn>user\nhi<turn|>\n<|turn>model\n") == ids


def test_bad_chat_message(tok):
    with pytest.raises(TokenizerError) as e:
        tok.encode_chat([{"role": "robot", "content": "x"}])
    assert str(e.value) == "chat message 0 has role 'robot'; use one of system, developer, user, assistant, model"
    with pytest.raises(TokenizerError) as e:
        tok.encode_chat([{"content": "x"}])
    assert str(e.value) == "chat message 0 must be an object with 'role' and 'content'"


def test_stop_ids_include_end_of_turn(ckpt, tok):
    cfg = load_config(ckpt)
    assert cfg.eos_token_ids == (1, tok.piece_id("<turn|>"))


def test_generation_config_stop_ids_are_added(tmp_path, ckpt):
    d = tmp_path / "g"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 6, 19]}))
    assert load_config(d).eos_token_ids == (1, 6, 19)


def test_not_a_sentencepiece_model(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'tokenizer.model'}: not a SentencePiece model (")


def test_directory_without_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
