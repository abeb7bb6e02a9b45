"""A converted model folder appears whole or not at all (issue 36): a full disk, a
failure, or kill -9 leaves no folder at the destination (nor one holding only temp
files), the next conversion cleans what a killed one left, and a tokenizer.model that
cannot be read is an error naming it."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import spel_mlx  # noqa: F401  (the BLAS first)
from spel_mlx.cli import convert
from spel_mlx.api import LoadError, load
from spel_mlx.checkpoints.files import StagedFolder, clean_stale_temps
from spel_mlx.converters import CONFIG_FILE, MODEL_FILE, spelw_to_safetensors
from spel_mlx.synth import write_synth

from test_hostile import TINY


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("convert_files") / "m.spelw"
    write_synth(path, TINY, 3, progress=False, target="numpy", draft="numpy")
    return path


@pytest.fixture(scope="module")
def reference(model_file, tmp_path_factory):
    """The folder a conversion that nothing disturbed writes: {name: bytes}."""
    d = tmp_path_factory.mktemp("ref") / "folder"
    spelw_to_safetensors(model_file, d)
    return {p.name: p.read_bytes() for p in d.iterdir()}


def files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_a_new_folder_appears_by_one_rename(model_file, reference, tmp_path, monkeypatch):
    """The files are written in a staged temp folder; the destination does not exist
    until the one rename that makes it whole (seen from inside the write)."""
    import spel_mlx.converters.spelw_safetensors as conv
    dst = tmp_path / "out"
    seen = []
    real = conv.write_safetensors

    def watching(path, *a, **kw):
        seen.append((os.path.exists(dst), Path(path).parent.name))
        return real(path, *a, **kw)

    monkeypatch.setattr(conv, "write_safetensors", watching)
    spelw_to_safetensors(model_file, dst)
    (exists, staged), = seen
    assert not exists and staged.startswith(".out.") and staged.endswith(".tmp")
    assert files(dst) == reference and sorted(os.listdir(tmp_path)) == ["out"]
    assert oct(dst.stat().st_mode & 0o777) != oct(0o700)      # a plain mkdir's mode, not mkdtemp's


def test_into_an_existing_folder_both_files_move_in(model_file, reference, tmp_path):
    dst = tmp_path / "has_other"
    dst.mkdir()
    (dst / "tokenizer.model").write_bytes(b"keep me")
    (dst / MODEL_FILE).write_bytes(b"old")
    spelw_to_safetensors(model_file, dst)
    assert files(dst) == {**reference, "tokenizer.model": b"keep me"}
    assert sorted(os.listdir(tmp_path)) == ["has_other"]


KILLED = """
import sys, time
from spel_mlx.checkpoints.files import StagedFolder
out = StagedFolder(sys.argv[1])
with open(out.file("model.safetensors"), "wb") as f:
    f.write(b"half of a model")
print(out.tmp_path, flush=True)
time.sleep(600)
"""


def test_kill_9_leaves_no_destination_and_the_next_conversion_cleans_up(model_file, reference, tmp_path):
    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(dst)], stdout=subprocess.PIPE, text=True)
    staged = p.stdout.readline().strip()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not dst.exists() and os.path.isdir(staged)       # only the hidden staged folder is left
    live = StagedFolder(dst)                                # a new one removes the killed one's ...
    assert not os.path.exists(staged)
    assert clean_stale_temps(dst) == [] and os.path.isdir(live.tmp_path)     # ... and keeps a live one's
    rc = convert.main([str(model_file), str(dst), "--quiet"])
    assert rc == 0 and files(dst) == reference
    live.abort()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failed_conversion_leaves_nothing(model_file, tmp_path, monkeypatch):
    import spel_mlx.converters.spelw_safetensors as conv

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conv, "config_json", full)           # after model.safetensors is written
    with pytest.raises(OSError):
        spelw_to_safetensors(model_file, tmp_path / "out")
    assert os.listdir(tmp_path) == []


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted on a folder (root, and a kernel that lets this process mount)."""
    d = tmp_path / "disk"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(d)], capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")

    def resize(nbytes: int):
        subprocess.run(["mount", "-o", f"remount,size={nbytes}", str(d)], check=True, capture_output=True)

    try:
        yield d, resize
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_a_full_disk_leaves_no_folder(model_file, reference, small_disk, capsys):
    """On a disk that fills while the model is written, and on one that fills between
    the two files, the conversion fails with one line and leaves nothing; with room, the
    same command then succeeds (nothing "already exists")."""
    disk, resize = small_disk
    page = os.sysconf("SC_PAGE_SIZE")
    model_pages = -(-len(reference[MODEL_FILE]) // page)
    dst = disk / "out"
    for pages in (model_pages // 2, model_pages):           # fills in the model; fills before config.json
        resize(pages * page)
        rc = convert.main([str(model_file), str(dst), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and "No space left" in err and err.count("\n") == 1, err
        assert os.listdir(disk) == []
    resize((model_pages + 4) * page)
    assert convert.main([str(model_file), str(dst), "--quiet"]) == 0
    assert files(dst) == reference and sorted(os.listdir(disk)) == ["out"]


@pytest.fixture
def sp_folder(tmp_path):
    """A model folder of vocab 2048 (the shipped tokenizer's) and where its tokenizer goes."""
    write_synth(tmp_path / "big.spelw", TINY.replace(vocab=2048), 3, progress=False, target="numpy", draft="numpy")
    spelw_to_safetensors(tmp_path / "big.spelw", tmp_path / "big")
    return tmp_path / "big", tmp_path / "big" / "tokenizer.model"


def test_a_tokenizer_that_is_a_folder_or_missing_is_named(sp_folder, tmp_path):
    """A tokenizer.model beside the checkpoint that is a folder or a dangling link stops
    the load with its name (no silent fallback to the shipped one)."""
    d, tok = sp_folder
    model, _ = load(d)                          # none beside it: the shipped one
    model.close()
    tok.mkdir()
    with pytest.raises(LoadError, match=f"{tok}.*folder"):
        load(d)
    tok.rmdir()
    tok.symlink_to(tmp_path / "missing.model")
    with pytest.raises(LoadError, match=f"{tok}.*not found"):
        load(d)


def test_an_unreadable_tokenizer_is_named(sp_folder):
    from spel_mlx.tokenizer import DEFAULT_SP_MODEL
    d, tok = sp_folder
    tok.write_bytes(Path(DEFAULT_SP_MODEL).read_bytes())
    tok.chmod(0)
    try:
        if os.access(tok, os.R_OK):
            pytest.skip("this user reads a file of mode 000 (root): the unreadable case cannot be made")
        with pytest.raises(LoadError, match=f"{tok}.*cannot read"):
            load(d)
    finally:
        tok.chmod(0o644)


class _Stream:
    def __init__(self, tty: bool):
        self.text, self.tty = "", tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return self.tty


def test_progress_bars():
    """Progress draws with tqdm: redrawn in place on a terminal; in a log, whole lines
    (no carriage returns), the first at 0% and the last at 100%; nothing when disabled;
    a bar that never reaches its total ends at close()."""
    from spel_mlx.checkpoints.files import Progress
    log = _Stream(tty=False)
    p = Progress("convert a -> b", 8 << 20, stream=log)
    for done in range(0, (8 << 20) + 1, 1 << 20):
        p(done)
    p(8 << 20)                       # after the end: nothing more
    lines = log.text.splitlines()
    assert "\r" not in log.text and log.text.endswith("\n") and len(lines) == 2
    assert lines[0].startswith("convert a -> b:   0%") and lines[-1].startswith("convert a -> b: 100%")
    assert "8.00M/8.00M" in lines[-1]
    term = _Stream(tty=True)
    p = Progress("synth", 100, stream=term)
    p(50)
    p.close()
    assert term.text.startswith("\r") and "50%" in term.text and term.text.endswith("\n")
    quiet = _Stream(tty=True)
    p = Progress("x", 100, stream=quiet, enabled=False)
    p(100)
    p.close()
    assert quiet.text == ""
