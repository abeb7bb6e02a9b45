"""bench/device_check.sh --dry-run: the GPU session's script, run here on the CPU in its
tiny form over a payload split across two calls, exactly as the device machine gets
it; its return files and their fields.  Also the payload's split and staging."""
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile

import pytest

from bench import device_pack
from bench import device_payload as dp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to a in that was her it his she he had as with for not be but you at "
         "by on said which were all this have they so my from would there been one no could "
         "Elizabeth Darcy sister mother letter morning family house answer manner").split()


def _text(rng, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= 14:
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    return "\n".join(lines) + "\n"


def _payload_src(tmp) -> str:
    """A corpus, a wheel as a tar.xz (made back into a wheel there) and a small wheel."""
    rng = random.Random(7)
    src, corpus, tree = tmp / "src", tmp / "corpus", tmp / "tree"
    for d in (src, corpus, tree / "fakepkg"):
        d.mkdir(parents=True)
    (corpus / "train.txt").write_text(_text(rng, 9000))
    (corpus / "heldout.txt").write_text(_text(rng, 1500))
    (corpus / "manifest.json").write_text("{}")
    with tarfile.open(src / "corpus.tar.xz", "w:xz") as t:
        for name in ("train.txt", "heldout.txt", "manifest.json"):
            t.add(corpus / name, arcname=name)
    (tree / "fakepkg" / "blob.bin").write_bytes(random.Random(1).randbytes(300_000))
    (tree / "fakepkg" / "__init__.py").write_text("")
    with tarfile.open(src / "fakepkg-1.0-py3-none-any.whl.tar.xz", "w:xz") as t:
        t.add(tree, arcname=".")
    with zipfile.ZipFile(src / "tiny-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tiny/__init__.py", "")
    return str(src)


def test_payload_split_stage_and_assemble(tmp_path):
    src = _payload_src(tmp_path)
    sizes = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src))
    m = dp.plan(src, str(tmp_path / "one"), tree_bytes=0, limit=dp.MARGIN + sizes)
    assert m["calls"] == 1
    with pytest.raises(dp.PayloadError, match="leaves 0.0 MiB per call"):
        dp.plan(src, str(tmp_path / "none"), tree_bytes=dp.TRANSFER_LIMIT - dp.MARGIN)
    # a room of half the payload: two calls, the big file cut between them
    tight = str(tmp_path / "tight")
    m = dp.plan(src, tight, tree_bytes=0, limit=dp.MARGIN + sizes // 2 + 1)
    assert m["calls"] == 2 and m["room_bytes"] == sizes // 2 + 1
    for c in (1, 2):
        got = sum(os.path.getsize(os.path.join(tight, f"call{c}", n))
                  for n in os.listdir(os.path.join(tight, f"call{c}")) if n != dp.MANIFEST)
        assert got <= m["room_bytes"]
    stage = str(tmp_path / "stage")
    st = dp.stage(tight, stage)                 # both carried at once
    assert st["complete"]
    out = dp.assemble(stage, str(tmp_path / "dest"))
    assert sorted(out["wheels"]) == ["fakepkg-1.0-py3-none-any.whl", "tiny-1.0-py3-none-any.whl"]
    with zipfile.ZipFile(tmp_path / "dest" / "wheels" / "fakepkg-1.0-py3-none-any.whl") as z:
        assert z.read("fakepkg/blob.bin") == random.Random(1).randbytes(300_000)
    assert (tmp_path / "dest" / "corpus" / "heldout.txt").stat().st_size > 1000
    # a damaged piece is named
    piece = next(n for n in os.listdir(os.path.join(tight, "call2")) if n != dp.MANIFEST)
    with open(os.path.join(tight, "call2", piece), "r+b") as f:
        f.write(b"X")
    with pytest.raises(dp.PayloadError, match=f"{piece}: sha256 differs"):
        dp.stage(tight, str(tmp_path / "stage2"))


def _run(out, carried, stage, work):
    env = {**os.environ, "SPEL_DC_CARRIED": str(carried), "SPEL_DC_STAGE": str(stage),
           "SPEL_DC_WORK": str(work), "SPEL_DC_PYTHON": sys.executable}
    return subprocess.run(["bash", os.path.join(REPO, "bench", "device_check.sh"), str(out), "--dry-run"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=170)


@pytest.mark.timeout(360)   # the dry run takes about 10 s; one CI run saw a 6-step training take 47 s
def test_dry_run_two_calls(tmp_path):
    src = _payload_src(tmp_path)
    sizes = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src))
    plan_root = tmp_path / "whl"
    m = dp.plan(src, str(plan_root), tree_bytes=0, limit=dp.MARGIN + sizes // 2 + 1)
    assert m["calls"] == 2
    out, stage, work = tmp_path / "OUT", tmp_path / "stage", tmp_path / "work"
    # call 1 carries .whl/call1 only: staged, and the check says what to carry next
    carried1 = tmp_path / "carry1"
    carried1.mkdir()
    os.symlink(plan_root / "call1", carried1 / "call1")
    r = _run(out, carried1, stage, work)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "now run the same command carrying .whl/call2" in r.stdout
    assert json.loads((out / "device_check.json").read_text())["next"] == "carry .whl/call2"
    # call 2 carries .whl/call2: the payload is complete, every step runs
    carried2 = tmp_path / "carry2"
    carried2.mkdir()
    os.symlink(plan_root / "call2", carried2 / "call2")
    r = _run(out, carried2, stage, work)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    # the return limits: at most 8 files, 16 MiB each, 64 MiB in all, plain names, no folders
    names = sorted(os.listdir(out))
    assert len(names) <= 8 and all(device_pack.OWN.match(n) for n in names)
    assert all((out / n).stat().st_size <= 16 * 2**20 for n in names)
    assert sum((out / n).stat().st_size for n in names) <= 64 * 2**20
    s = json.loads((out / "device_check.json").read_text())
    assert s["schema"] == "spel-mlx-device-check/1" and s["mode"] == "dry-run"
    assert sorted(s["returned"]) == names
    steps = {st["name"]: st for st in s["steps"]}
    assert list(steps) == ["payload", "install", "build", "check", "bench", "train", "report"]
    assert steps["install"]["status"] == steps["build"]["status"] == "skipped"
    assert all(steps[n]["status"] == "ok" for n in ("payload", "check", "bench", "train", "report")), steps
    assert s["payload"]["complete"] and sorted(s["payload"]["wheels"]) == \
        ["fakepkg-1.0-py3-none-any.whl", "tiny-1.0-py3-none-any.whl"]
    assert s["machine"]["c_draft"] is True and "mlx" in s["machine"]

    # B2 (v at M = K+1) and B3 rows; the GPU rows are there and say why they are not measured
    b = json.loads((out / "benchmarks.json").read_text())
    assert b["schema"] == "spel-mlx-bench/1" and b["level"] == "device"
    rows = b["rows"]
    v = {(r["mode"], r["K"]) for r in rows if r["section"] == "b2" and r["status"] == "ok"
         and r["placement"] == "target=mlx-cpu" and r["mode"] in ("strict", "fast")}
    assert v == {(m, k) for m in ("strict", "fast") for k in (1, 2)}
    assert all(r["metrics"]["M"]["median"] == r["K"] + 1 for r in rows
               if r["section"] == "b2" and r["status"] == "ok" and r["mode"] != "ar")
    b3 = {(r["name"], r["placement"]) for r in rows if r["section"] == "b3" and r["status"] == "ok"}
    for name in ("AR target", "raw spec", "governed spec", "forced 0.75", "forced 1.00"):
        assert any(n == name and "target=mlx-cpu" in p for n, p in b3), name
    assert any(r["name"] == "forced 1.00" and r["K"] == 3 and r["status"] == "ok" for r in rows)   # the ceiling
    gpu = [r for r in rows if "target=mlx-gpu" in (r.get("placement") or "")]
    assert gpu and all(r["status"] == "not available" and "no GPU" in r["note"] for r in gpu)
    assert s["bench"]["rows"] == len(rows) and s["bench"]["gpu_rows_ok"] == 0 and s["bench"]["errors"] == 0
    r = subprocess.run([sys.executable, "-m", "bench", "--from-json", str(out / "benchmarks.json"), "--out",
                        str(tmp_path / "render"), "--no-plots"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "## B2" in (tmp_path / "render" / "benchmarks.md").read_text(), r.stderr

    # training, its report, the judgement's inputs
    t = s["train"]
    assert t["target"]["step"] == 6 and t["draft"]["step"] == 4
    assert t["target"]["heldout_nats"] > 0 and 0 <= t["draft"]["heldout_top1_agree"] <= 1
    held, alpha = s["report"]["heldout"], s["report"]["alpha"]
    assert held["target_nats_per_token"] > 0 and alpha["k"] == 4 and alpha["prompts"] == 1
    j = s["judgement"]
    assert j["heldout_nats"] == held["target_nats_per_token"] and j["alpha_k4"] == alpha["alpha"]
    assert j["shipped"]["heldout_nats"] == 3.107 and set(j["checks"]) == {"heldout_loss", "alpha_k4", "size"}
    assert j["ship"] is False            # a 6-step tiny model is no candidate

    # the model comes back in parts that make the exported folder again
    model = s["model"]
    assert model["returned"] and len(model["parts"]) >= 2          # 512 KiB parts in the dry run
    data = b"".join((out / p).read_bytes() for p in model["parts"])
    import hashlib
    import io
    assert hashlib.sha256(data).hexdigest() == model["tar_sha256"]
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert sorted(tf.getnames()) == ["config.json", "model.safetensors", "tokenizer.model"]
    log = (out / "device_check.log").read_text()
    assert "spel_mlx.train" in log and "-m bench --worker" in log
