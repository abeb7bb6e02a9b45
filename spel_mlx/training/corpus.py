"""Training corpus: public-domain English prose from Debian packages.

Sources (see docs/training.md for why these):
  austen  Jane Austen's six novels, from r-cran-janeaustenr's R lazy-load data
          (Rdata.rdb), read here without R: zlib blocks of R's XDR serialization.
  kjv     the King James Bible, from bible-kjv (+ bible-kjv-text): `bible gen1:1-rev22:21`.
  mhcc    Matthew Henry's Concise Commentary, from sword-comm-mhcc (a SWORD zCom4
          module, read here without libsword). Training text only: it adds no held-out
          text, and the commentary on every chapter the KJV holds out is left out.

``prepare(out_dir)`` writes ``train.txt`` and ``heldout.txt`` (+ ``manifest.json``).
The held-out split is contiguous ~8 KB blocks, every 50th block of each source
(block index % 50 == 25), cut at line ends; training never sees them.

    python -m spel_mlx corpus [--out data/corpus] [--sources austen,kjv[,mhcc]]
"""
from __future__ import annotations

import html
import os
import re
import shutil
import struct
import subprocess
import zlib

from ..atomic import write_json, write_text
from ..tokenizer import EOT_LINE

AUSTEN_DIR = "/usr/lib/R/site-library/janeaustenr/data"
AUSTEN_BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma",
                "northangerabbey", "persuasion")
BLOCK_BYTES = 8192
# a heading line starts a new document (chapter) once the current one holds this much
DOC_MIN_BYTES = 500
AUSTEN_HEADING = re.compile(r"^(CHAPTER|Chapter|VOLUME|Volume) [0-9IVXLC]+\.?$")
KJV_HEADING = re.compile(r"^[1-3]?\s?[A-Z][A-Za-z ]+ \d+$")
HELDOUT_EVERY = 50
HELDOUT_PHASE = 25
SOURCES = ("austen", "kjv")
KNOWN_SOURCES = SOURCES + ("mhcc",)
TRAIN_ONLY = ("mhcc",)
MHCC_DIR = "/usr/share/sword/modules/comments/zcom/mhcc"


class CorpusError(RuntimeError):
    """A corpus source is missing or unreadable (names the Debian package)."""


# --- R serialization (XDR) reader: just enough for character vectors --------
class _RReader:
    def __init__(self, buf: bytes, where: str):
        self.b, self.i, self.where = buf, 0, where

    def int(self) -> int:
        if self.i + 4 > len(self.b):
            raise CorpusError(f"{self.where}: truncated R data at offset {self.i}")
        v = struct.unpack_from(">i", self.b, self.i)[0]
        self.i += 4
        return v

    def bytes(self, n: int) -> bytes:
        out = self.b[self.i:self.i + n]
        if len(out) != n:
            raise CorpusError(f"{self.where}: truncated R string at offset {self.i}")
        self.i += n
        return out


def _read_r_character_vector(buf: bytes, where: str) -> list:
    r = _RReader(buf, where)
    if r.bytes(2) != b"X\n":
        raise CorpusError(f"{where}: not an XDR R serialization (magic {buf[:2]!r})")
    version = r.int()
    r.int(), r.int()  # writer version, minimum reader version
    if version == 3:
        r.bytes(r.int())  # native encoding name
    flags = r.int()
    if flags & 0xFF != 16:  # STRSXP
        raise CorpusError(f"{where}: R object type {flags & 0xFF}, expected a character vector (16)")
    n = r.int()
    out = []
    for _ in range(n):
        cflags = r.int()
        if cflags & 0xFF != 9:  # CHARSXP
            raise CorpusError(f"{where}: element type {cflags & 0xFF} at offset {r.i}, expected 9")
        ln = r.int()
        out.append("" if ln < 0 else r.bytes(ln).decode("utf-8", errors="replace"))
    return out


def read_austen(data_dir: str = AUSTEN_DIR) -> dict:
    """{book: [lines]} from janeaustenr's Rdata.rdb (zlib blocks, R XDR)."""
    rdb, rdx = os.path.join(data_dir, "Rdata.rdb"), os.path.join(data_dir, "Rdata.rdx")
    if not (os.path.exists(rdb) and os.path.exists(rdx)):
        raise CorpusError(f"{rdb} not found: install the Debian package r-cran-janeaustenr "
                          "(apt-get install r-cran-janeaustenr)")
    import gzip
    index = gzip.decompress(open(rdx, "rb").read())
    # Variable names appear in offset order in the index; the blocks follow in the same order.
    names = [m.decode() for m in re.findall(rb"\x00\x04\x00\t\x00\x00\x00.([a-z]+)", index, re.S)]
    names = [n for n in names if n in AUSTEN_BOOKS]
    data = open(rdb, "rb").read()
    books, off = {}, 0
    for name in names:
        if off + 4 > len(data):
            raise CorpusError(f"{rdb}: ends at offset {off} before block for {name!r}")
        size = struct.unpack_from(">I", data, off)[0]
        d = zlib.decompressobj()
        raw = d.decompress(data[off + 4:])
        if len(raw) != size:
            raise CorpusError(f"{rdb}: block at offset {off} inflates to {len(raw)} bytes, header says {size}")
        books[name] = _read_r_character_vector(raw, f"{rdb}@{off}")
        off = len(data) - len(d.unused_data)
    missing = [b for b in AUSTEN_BOOKS if b not in books]
    if missing:
        raise CorpusError(f"{rdb}: books missing from the index: {', '.join(missing)}")
    return books


_ASCII_MAP = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "--",
              "\u2013": "-", "\u00e9": "e", "\u00e8": "e", "\u00ea": "e", "\u00e0": "a",
              "\u00e2": "a", "\u00ef": "i", "\u00f4": "o", "\u00e6": "ae", "\u00a3": "L",
              "\u00fc": "u", "\u00e7": "c", "\u00bd": "1/2"}


def _to_ascii(s: str) -> str:
    s = "".join(_ASCII_MAP.get(c, c) for c in s)
    return s.encode("ascii", errors="ignore").decode()


def clean_austen(lines: list) -> str:
    """Join hard-wrapped lines into one line per paragraph; drop _italic_ markers."""
    paras, cur = [], []
    for line in lines:
        line = line.strip()
        if not line:
            if cur:
                paras.append(" ".join(cur))
                cur = []
            continue
        cur.append(line)
    if cur:
        paras.append(" ".join(cur))
    text = "\n".join(paras)
    text = text.replace("_", "")
    text = re.sub(r"[ \t]+", " ", text)
    return _to_ascii(text) + "\n"


def read_kjv() -> str:
    exe = shutil.which("bible")
    if exe is None or not os.path.exists("/usr/lib/bible.data"):
        raise CorpusError("the `bible` program or its text is missing: install the Debian packages "
                          "bible-kjv and bible-kjv-text (apt-get install bible-kjv bible-kjv-text)")
    try:
        out = subprocess.run([exe, "gen1:1-rev22:21"], capture_output=True, timeout=300,
                             env={**os.environ, "COLUMNS": "100000"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CorpusError(f"running `bible` failed: {e}") from None
    if out.returncode != 0 or len(out.stdout) < 1_000_000:
        raise CorpusError(f"`bible gen1:1-rev22:21` failed (exit {out.returncode}, "
                          f"{len(out.stdout)} bytes): reinstall bible-kjv and bible-kjv-text")
    return out.stdout.decode("utf-8", errors="replace")


def clean_kjv(raw: str) -> str:
    """One verse per line without its number; chapter headings ("Genesis 1") kept."""
    out, cur = [], []
    verse_start = re.compile(r"^\s+\d+\s+(.*)$")
    for line in raw.splitlines():
        if not line.strip():
            continue
        m = verse_start.match(line)
        if m:
            if cur:
                out.append(" ".join(cur))
            cur = [m.group(1).strip()]
        elif line.startswith(" "):
            cur.append(line.strip())
        elif cur and not KJV_HEADING.match(line.strip()):
            cur.append(line.strip())  # wrapped continuation at column 0
        else:
            if cur:
                out.append(" ".join(cur))
                cur = []
            out.append(line.strip())
    if cur:
        out.append(" ".join(cur))
    return _to_ascii("\n".join(out)) + "\n"


def mark_documents(text: str, heading) -> str:
    """The text with an end-of-text mark (EOT_LINE) after each document: a document
    ends before a heading line once it holds DOC_MIN_BYTES (so a title block or a
    "VOLUME II" line stays with the chapter after it), and at the text's end."""
    out, size = [], 0
    for line in text.splitlines(keepends=True):
        if size >= DOC_MIN_BYTES and heading.match(line.rstrip("\n")):
            out.append(EOT_LINE)
            size = 0
        out.append(line)
        size += len(line)
    if size:
        out.append(EOT_LINE)
    return "".join(out)


def split_blocks(text: str, block_bytes: int = BLOCK_BYTES) -> list:
    """Contiguous blocks of about block_bytes, each ending at a line end."""
    blocks, i, n = [], 0, len(text)
    while i < n:
        j = min(n, i + block_bytes)
        nl = text.find("\n", j - 1)
        j = n if nl < 0 else nl + 1
        blocks.append(text[i:j])
        i = j
    return blocks


def split_heldout(text: str, every: int = HELDOUT_EVERY, phase: int = HELDOUT_PHASE):
    """(train_text, heldout_text): every `every`-th block (index % every == phase) is held out."""
    train, held = [], []
    for i, b in enumerate(split_blocks(text)):
        (held if i % every == phase else train).append(b)
    return "".join(train), "".join(held)


# --- SWORD zCom4 reader: Matthew Henry's Concise Commentary -------------------
def _read_file(path: str, package: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CorpusError(f"{path} not found: install the Debian package {package} "
                          f"(apt-get install {package})") from None


def read_mhcc(module_dir: str = MHCC_DIR) -> list:
    """[(osis chapter id, [OSIS entries])] in canonical order.

    zCom4 layout per testament: ``.bzs`` 12-byte block records (offset, compressed size,
    size; u32 little-endian) into ``.bzz`` (zlib streams); ``.bzv`` 10-byte entry records
    (block u32, offset u32, size u16) into the inflated blocks. A comment spanning several
    verses is one entry that several records point at: it is read once."""
    chapters, seen = [], set()
    for testament in ("ot", "nt"):
        base = os.path.join(module_dir, testament)
        bzs = _read_file(base + ".bzs", "sword-comm-mhcc")
        bzz = _read_file(base + ".bzz", "sword-comm-mhcc")
        bzv = _read_file(base + ".bzv", "sword-comm-mhcc")
        if len(bzs) % 12 or len(bzv) % 10:
            raise CorpusError(f"{base}.bzs/.bzv: sizes {len(bzs)}, {len(bzv)} are not whole "
                              "12- and 10-byte records")
        blocks = []
        for i in range(0, len(bzs), 12):
            off, csize, size = struct.unpack_from("<III", bzs, i)
            if off + csize > len(bzz):
                raise CorpusError(f"{base}.bzs@{i}: block [{off}, {off + csize}) past the end "
                                  f"of {base}.bzz ({len(bzz)} bytes)")
            raw = zlib.decompress(bzz[off:off + csize]) if csize else b""
            if len(raw) != size:
                raise CorpusError(f"{base}.bzz@{off}: inflates to {len(raw)} bytes, index says {size}")
            blocks.append(raw)
        for i in range(0, len(bzv), 10):
            b, start, n = struct.unpack_from("<IIH", bzv, i)
            if not n or (testament, b, start) in seen:
                continue
            if b >= len(blocks) or start + n > len(blocks[b]):
                raise CorpusError(f"{base}.bzv@{i}: entry (block {b}, {start}+{n}) outside the blocks")
            seen.add((testament, b, start))
            entry = blocks[b][start:start + n].decode("utf-8", errors="replace")
            m = re.search(r'<chapter [^>]*osisID="([^"]+)"', entry)
            if m:
                chapters.append((m.group(1), []))
            elif chapters:
                chapters[-1][1].append(entry)
    if not chapters:
        raise CorpusError(f"{module_dir}: no chapters found (not a zCom4 module?)")
    return chapters


def clean_mhcc(entries: list) -> str:
    """OSIS markup to text: a bold verse heading ("Verses 1-3") and each paragraph on a line."""
    x = " ".join(entries)
    x = re.sub(r'<hi type="bold">(.*?)</hi>', r"\n\1\n", x)
    x = re.sub(r"<title[^>]*>.*?</title>", "", x)
    x = re.sub(r'<div [^>]*type="x-p"[^>]*/>', "\n", x)
    x = html.unescape(re.sub(r"<[^>]+>", "", x))
    lines = (re.sub(r"\s+", " ", line).strip() for line in x.split("\n"))
    return _to_ascii("\n".join(line for line in lines if line))


def kjv_chapters_held_out(kjv_text: str) -> set:
    """{(book ordinal, chapter)} of every KJV chapter a held-out block touches."""
    held, books, current = set(), {}, None
    for i, block in enumerate(split_blocks(kjv_text)):
        is_held = i % HELDOUT_EVERY == HELDOUT_PHASE
        if is_held and current:
            held.add(current)
        for line in block.splitlines():
            if KJV_HEADING.match(line):
                book, chapter = line.rsplit(" ", 1)
                current = (books.setdefault(book, len(books)), int(chapter))
                if is_held:
                    held.add(current)
    return held


def mhcc_text(chapters: list, leave_out: set) -> str:
    """Each chapter's commentary as a document, but those whose (book ordinal, chapter) is in leave_out."""
    out, books = [], {}
    for osis_id, entries in chapters:
        book, chapter = osis_id.split(".")[:2]
        key = (books.setdefault(book, len(books)), int(chapter))
        text = clean_mhcc(entries)
        if text and key not in leave_out:
            out.append(text + "\n" + EOT_LINE)
    return "".join(out)


def load_source(name: str) -> str:
    """A source's clean text, its documents (chapters) marked (mark_documents)."""
    if name == "austen":
        books = read_austen()
        return "".join(mark_documents(clean_austen(books[b]), AUSTEN_HEADING) for b in AUSTEN_BOOKS)
    if name == "kjv":
        return mark_documents(clean_kjv(read_kjv()), KJV_HEADING)
    if name == "mhcc":
        return mhcc_text(read_mhcc(), kjv_chapters_held_out(load_source("kjv")))
    raise CorpusError(f"unknown corpus source {name!r} (known: {', '.join(KNOWN_SOURCES)})")


def prepare(out_dir: str, sources=SOURCES) -> dict:
    """Write train.txt / heldout.txt / manifest.json under out_dir; return the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    train_parts, held_parts, manifest = [], [], {"sources": {}, "block_bytes": BLOCK_BYTES,
                                                  "heldout_every": HELDOUT_EVERY,
                                                  "heldout_phase": HELDOUT_PHASE}
    for s in sources:
        text = load_source(s)
        tr, he = (text, "") if s in TRAIN_ONLY else split_heldout(text)
        train_parts.append(tr)
        held_parts.append(he)
        manifest["sources"][s] = {"bytes": len(text), "train_bytes": len(tr), "heldout_bytes": len(he)}
    write_text(os.path.join(out_dir, "train.txt"), "".join(train_parts), encoding="ascii")
    write_text(os.path.join(out_dir, "heldout.txt"), "".join(held_parts), encoding="ascii")
    write_json(os.path.join(out_dir, "manifest.json"), manifest)
    return manifest
