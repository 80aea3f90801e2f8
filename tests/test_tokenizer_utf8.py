"""Text cut inside a multibyte character: `TextTokenizer.decode_complete` drops the
unfinished character the decoder writes as U+FFFD, and keeps a U+FFFD the model wrote."""

from __future__ import annotations

import random

import pytest

from dspine_jax.tokenizer import TextTokenizer, incomplete_utf8_tail

TEXT = "naïve café: 5 €, 日本語 🙂!"


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> TextTokenizer:
    return TextTokenizer.from_hf_folder(tiny_llama_dir)   # byte-level BPE, ASCII merges


def test_token_bytes_are_what_the_decoder_joins(tok):
    """The decoder writes the tokens' bytes as UTF-8 with U+FFFD for what is not: so does
    Python's decoder, on the bytes token_bytes gives, for every byte in every order."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert tok.token_bytes(ids).decode("utf-8", "replace") == tok.decode(ids), ids


def test_incomplete_utf8_tail():
    data = "é€🙂".encode()                   # 2 + 3 + 4 bytes
    assert [incomplete_utf8_tail(data[:n]) for n in range(len(data) + 1)] == \
        [0, 1, 0, 1, 2, 0, 1, 2, 3, 0]
    assert incomplete_utf8_tail(b"ab") == incomplete_utf8_tail(b"") == 0
    assert incomplete_utf8_tail(b"a\x80\x80") == 0          # stray continuation bytes
    assert incomplete_utf8_tail(b"\xe2\x82\xac\x82") == 0   # one byte past a whole char


def test_a_text_cut_anywhere_ends_on_its_last_whole_character(tok):
    ids = tok.encode(TEXT)
    data = TEXT.encode()
    cut_inside = 0
    for n in range(len(ids) + 1):
        covered = len(tok.token_bytes(ids[:n]))
        want = data[:covered].decode("utf-8", "ignore")     # a prefix: only its tail can break
        assert tok.decode_complete(ids[:n]) == want, n
        cut_inside += tok.decode(ids[:n]).endswith("\ufffd")
    assert cut_inside >= 8 and tok.decode_complete(ids) == TEXT


def test_a_replacement_character_the_model_wrote_stays(tok):
    ids = tok.encode("ok \ufffd")
    assert tok.decode_complete(ids) == tok.decode(ids) == "ok \ufffd"
    cut = tok.encode("ok \ufffd") + tok.encode("€")[:1]
    assert tok.decode_complete(cut) == "ok \ufffd"
