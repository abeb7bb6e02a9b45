"""Tokenizers: the shipped SentencePiece model round-trips text exactly; the
original's 128-symbol ASCII vocabulary; loader selection by checkpoint vocab."""
import os

import numpy as np
import pytest

from spel_mlx import tokenizer as T

SHIPPED = T.DEFAULT_SP_MODEL
TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,"
    " must be in want of a wife.\n",
    "And God said, Let there be light: and there was light.\nGenesis 1:3",
    "  two  spaces,\ttab, digits 1811 and 3.14159, symbols <>{}[]|~^`@#$%&*_+=\\",
    "\n\nblank lines\n\n\n",
    "",
]


@pytest.mark.skipif(not os.path.exists(SHIPPED), reason="no shipped tokenizer.model")
def test_shipped_sentencepiece_round_trip():
    tok = T.load_tokenizer(2048)
    assert isinstance(tok, T.SentencePieceTokenizer) and tok.vocab_size == 2048
    for s in TEXTS:
        ids = tok.encode(s)
        assert all(0 <= i < 2048 for i in ids)
        assert tok.decode(ids) == s
    # compresses English prose to well under one token per character
    s = TEXTS[0] * 4
    assert len(tok.encode(s)) < len(s) / 2.5
    # non-ASCII text survives through byte-fallback pieces
    assert tok.decode(tok.encode("café naïve")) == "café naïve"
    # a newline is its own piece, so line starts look the same in training and prompts
    assert tok.encode("a\nb")[1] == tok.encode("\n")[0]


def test_byte_tokenizer_is_the_ascii_vocabulary():
    tok = T.load_tokenizer(128)
    assert isinstance(tok, T.ByteTokenizer) and tok.vocab_size == 128
    s = "Hello, world!\n\t~"
    assert tok.encode(s) == [ord(c) for c in s]
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode("é") == [63]                      # non-ASCII -> '?'
    assert tok.decode([72, 105, 200, -1, 33]) == "Hi!"   # ids outside 0..127 are dropped
    assert tok.id_to_piece(65) == "A"


def test_loader_checks_vocab(tmp_path):
    if os.path.exists(SHIPPED):
        with pytest.raises(T.TokenizerError, match="2048 pieces but the checkpoint's vocab is 4096"):
            T.load_tokenizer(4096)
    with pytest.raises(T.TokenizerError, match="not found"):
        T.load_tokenizer(2048, str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(T.TokenizerError, match="not a SentencePiece model"):
        T.load_tokenizer(2048, str(bad))


def test_train_sentencepiece_small(tmp_path):
    rng = np.random.default_rng(0)
    words = ["the", "lady", "said", "that", "her", "sister", "was", "not", "at", "home",
             "and", "he", "went", "away", "with", "great", "haste"]
    lines = [" ".join(rng.choice(words, 10)) + "." for _ in range(400)]
    src = tmp_path / "train.txt"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "sp.model"
    tok = T.train_sentencepiece(str(src), str(out), vocab=300, threads=1)
    assert out.exists() and tok.vocab_size == 300
    s = lines[0] + "\n" + lines[1]
    assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(s)) < len(s) / 1.7   # only ~40 merges fit beside 256 byte pieces
    with pytest.raises(T.TokenizerError, match="vocab=100"):
        T.train_sentencepiece(str(src), str(out), vocab=100)


def test_end_of_text_piece_and_documents(tmp_path):
    """A trained tokenizer has the end-of-text control piece: no text encodes to it (the
    literal mark is plain text), it decodes to nothing, and training text gets it exactly
    where a document's EOT_LINE mark was; the marks are not learned as pieces."""
    rng = np.random.default_rng(1)
    words = ["the", "lady", "said", "that", "her", "sister", "was", "at", "home"]
    docs = ["\n".join(" ".join(rng.choice(words, 8)) + "." for _ in range(40)) + "\n" for _ in range(5)]
    src = tmp_path / "train.txt"
    src.write_text("".join(d + T.EOT_LINE for d in docs))
    tok = T.train_sentencepiece(str(src), str(tmp_path / "sp.model"), vocab=300, threads=1)
    assert tok.eot_id == 1 and tok.id_to_piece(1) == T.EOT_PIECE and tok.name.endswith("-eot")
    assert tok.eot_id not in tok.encode(T.EOT_PIECE)
    assert tok.decode([tok.eot_id]) == ""
    assert not any("endoftext" in tok.id_to_piece(i) for i in range(2, 300))   # not learned
    ids = T.encode_documents(tok, src.read_text())
    ends = [i for i, t in enumerate(ids) if t == tok.eot_id]
    assert len(ends) == 5 and ends[-1] == len(ids) - 1
    starts = [0] + [e + 1 for e in ends[:-1]]
    assert [tok.decode(ids[s:e]) for s, e in zip(starts, ends)] == docs
    # the byte vocabulary (and any tokenizer without the piece) drops the marks
    byte = T.ByteTokenizer()
    assert byte.eot_id is None and byte.decode(T.encode_documents(byte, src.read_text())) == "".join(docs)


def test_shipped_tokenizers_without_the_piece_have_no_eot_id():
    if os.path.exists(SHIPPED):
        # the 7.9M model's tokenizer predates the piece: nothing stops on an id it lacks
        tok = T.SentencePieceTokenizer(os.path.join(T.ASSETS, "spel-8m", "tokenizer.model"))
        assert tok.eot_id is None
