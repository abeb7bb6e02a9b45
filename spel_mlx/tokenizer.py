"""Tokenizers: a SentencePiece model (the shipped default) and the original's
128-symbol ASCII byte vocabulary (for vocab-128 SPELW001 files).

Common interface: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``name``.  ``load_tokenizer(vocab, path)`` picks by the
checkpoint's vocabulary size.

    python -m spel_mlx tokenizer train --input data/corpus/train.txt --vocab 2048 --out spel_mlx/assets/tokenizer.model
"""
from __future__ import annotations

import os
import sys
import tempfile

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_SP_MODEL = os.path.join(ASSETS, "tokenizer.model")
# the end-of-text piece, and the line that marks a document's end in training text
# (a control piece: no text encodes to it; training data puts it where the marks are)
EOT_PIECE = "<|endoftext|>"
EOT_LINE = EOT_PIECE + "\n"


class TokenizerError(ValueError):
    """Tokenizer file missing/invalid or not matching the checkpoint's vocabulary."""


class ByteTokenizer:
    """The original SPEL vocabulary: token id = ASCII code, 128 symbols.

    Characters outside ASCII encode as '?' (id 63); ids outside 0..127 decode to
    nothing (a model with this vocab never produces them).
    """
    name = "ascii-bytes"
    vocab_size = 128
    eot_id = None

    def encode(self, text: str) -> list:
        return [o if o < 128 else 63 for o in map(ord, text)]

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids if 0 <= int(i) < 128)

    def id_to_piece(self, i: int) -> str:
        return chr(int(i)) if 0 <= int(i) < 128 else ""


class SentencePieceTokenizer:
    """A SentencePiece model; identity normalization so decode(encode(s)) == s
    for ASCII text (unknown characters fall back to byte pieces)."""

    def __init__(self, path: str = DEFAULT_SP_MODEL):
        import sentencepiece as spm
        if os.path.isdir(path):
            raise TokenizerError(f"{path}: is a folder, not a SentencePiece model")
        if not os.path.exists(path):
            raise TokenizerError(f"{path}: SentencePiece model not found")
        try:
            open(path, "rb").close()
        except OSError as e:
            raise TokenizerError(f"{path}: cannot read ({e.strerror or e})") from None
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            ok = self.sp.Load(path)
        except Exception as e:  # sentencepiece raises OSError/RuntimeError on bad files
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from None
        if not ok:
            raise TokenizerError(f"{path}: not a SentencePiece model")
        self.vocab_size = int(self.sp.GetPieceSize())
        self.name = f"sentencepiece-{self.vocab_size}"
        eos = int(self.sp.eos_id())
        # the end-of-text id: the model's eos piece where it is ours (None: no such piece)
        self.eot_id = eos if eos >= 0 and self.sp.IdToPiece(eos) == EOT_PIECE else None
        if self.eot_id is not None:
            self.name += "-eot"

    def encode(self, text: str) -> list:
        return list(self.sp.EncodeAsIds(text))

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self.sp.IdToPiece(int(i))


def encode_documents(tokenizer, text: str) -> list:
    """Token ids of training text whose documents end at EOT_LINE marks: each document
    encoded alone, the end-of-text id where its mark was.  A tokenizer without that
    piece gets the marks dropped."""
    docs = text.split(EOT_LINE)
    ids = []
    for i, doc in enumerate(docs):
        ids += tokenizer.encode(doc)
        if i < len(docs) - 1 and tokenizer.eot_id is not None:
            ids.append(tokenizer.eot_id)
    return ids


def load_tokenizer(vocab: int, path: str | None = None):
    """Tokenizer for a checkpoint with vocabulary ``vocab``.

    vocab 128 -> ByteTokenizer; otherwise a SentencePiece model at ``path``
    (default: the shipped spel_mlx/assets/tokenizer.model) whose size must equal vocab.
    """
    if vocab == 128 and path is None:
        return ByteTokenizer()
    tok = SentencePieceTokenizer(path or DEFAULT_SP_MODEL)
    if tok.vocab_size != vocab:
        raise TokenizerError(f"{tok.path}: tokenizer has {tok.vocab_size} pieces but the checkpoint's "
                             f"vocab is {vocab}")
    return tok


def train_sentencepiece(input_txt: str, out_model: str, vocab: int = 2048,
                        threads: int = 2, max_lines: int = 0) -> SentencePieceTokenizer:
    """Train a BPE SentencePiece model on input_txt (one paragraph per line), with the
    end-of-text control piece (id 1); the EOT_LINE marks in the text are left out of
    what it learns from.  Write it atomically to out_model."""
    import sentencepiece as spm
    if not (256 < vocab <= 65536):
        raise TokenizerError(f"vocab={vocab}: must be in 257..65536 (256 byte-fallback pieces)")
    if not os.path.exists(input_txt):
        raise TokenizerError(f"{input_txt}: training text not found (run python -m spel_mlx.corpus)")
    out_dir = os.path.dirname(os.path.abspath(out_model))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        prefix = os.path.join(tmp, "sp")
        text_only = os.path.join(tmp, "text.txt")
        with open(input_txt, encoding="utf-8") as src, open(text_only, "w", encoding="utf-8") as dst:
            dst.writelines(line for line in src if line != EOT_LINE)
        spm.SentencePieceTrainer.Train(
            input=text_only, model_prefix=prefix, vocab_size=vocab, model_type="bpe",
            character_coverage=1.0, byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True, user_defined_symbols=["\n"],
            unk_id=0, bos_id=-1, eos_id=1, eos_piece=EOT_PIECE, pad_id=-1, max_sentence_length=1 << 16,
            input_sentence_size=max_lines, shuffle_input_sentence=True,
            num_threads=threads, minloglevel=2)
        os.replace(prefix + ".model", out_model)
    return SentencePieceTokenizer(out_model)


if __name__ == "__main__":       # python -m spel_mlx.tokenizer: the tokenizer command
    from .cli.tokenizer import main
    sys.exit(main())
