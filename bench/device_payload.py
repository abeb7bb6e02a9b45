"""The device check's payload: the files a bare device machine needs (wheels, the
mlx-cuda-13 wheel recompressed, the prepared corpus), split over calls that each fit
the device tool's transfer limit, and put back together there.  Standard library
only: it runs before anything is installed.

    here:   python -m bench.device_payload plan SRC_DIR OUT_ROOT --tree-bytes N
            -> OUT_ROOT/call1, call2, ...: carry one per call (bench/device_wheels.sh)
    there:  stage CARRIED_ROOT STAGE_DIR       (every call: keep what was carried)
            assemble STAGE_DIR DEST_DIR        (once complete: wheels/, corpus/)

Files of SRC_DIR: ``*.whl`` go as they are; ``NAME.whl.tar.xz`` (a wheel's files
as an xz tarball, far smaller than the wheel's own deflate) becomes ``NAME.whl``
again, stored uncompressed (its RECORD hashes are of the files, so pip accepts
it); ``corpus.tar.xz`` is unpacked into DEST_DIR/corpus.  ``payload.json`` in each
call folder lists every piece with its size and sha256, so any call can tell what
is still missing.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import tarfile
import zipfile

TRANSFER_LIMIT = 64 * 2**20     # the device tool: working tree + carried paths, per call
MARGIN = 2 * 2**20              # room for files added to the tree after planning
MANIFEST = "payload.json"


class PayloadError(RuntimeError):
    """A missing, damaged or inconsistent payload piece (names it)."""


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- here: split the payload over calls ----------------------------------------------
def plan(src: str, out_root: str, tree_bytes: int, limit: int = TRANSFER_LIMIT,
         margin: int = MARGIN) -> dict:
    """Write OUT_ROOT/call1..callN, each under ``limit - tree_bytes - margin`` bytes:
    small files first, then the big ones cut into pieces where a call fills up."""
    room = limit - tree_bytes - margin
    if room < 2**16:
        raise PayloadError(f"the working tree ({tree_bytes / 2**20:.1f} MiB) leaves "
                           f"{room / 2**20:.1f} MiB per call: too little to carry the payload")
    names = sorted(os.listdir(src), key=lambda n: (os.path.getsize(os.path.join(src, n)), n))
    if not names:
        raise PayloadError(f"{src}: no payload files")
    for old in glob.glob(os.path.join(out_root, "call*")):     # an earlier plan's folders only
        shutil.rmtree(old)
    calls, used, files = [[]], 0, []
    for name in names:
        path = os.path.join(src, name)
        size, at, entry = os.path.getsize(path), 0, {"name": name, "parts": []}
        entry.update(size=size, sha256=sha256(path))
        while at < size or not entry["parts"]:
            if used >= room:
                calls.append([])
                used = 0
            n = min(size - at, room - used)
            part = {"name": f"{name}.part-{len(entry['parts']):02d}", "offset": at, "size": n,
                    "call": len(calls)}
            entry["parts"].append(part)
            calls[-1].append((path, at, n, part))
            used += n
            at += n
        files.append(entry)
    for i, pieces in enumerate(calls, 1):
        folder = os.path.join(out_root, f"call{i}")
        os.makedirs(folder)
        for path, at, n, part in pieces:
            h = hashlib.sha256()
            with open(path, "rb") as f, open(os.path.join(folder, part["name"]), "wb") as g:
                f.seek(at)
                while n:
                    block = f.read(min(n, 1 << 20))
                    h.update(block)
                    g.write(block)
                    n -= len(block)
            part["sha256"] = h.hexdigest()
    manifest = {"files": files, "calls": len(calls), "room_bytes": room, "tree_bytes": tree_bytes}
    for i in range(1, len(calls) + 1):
        with open(os.path.join(out_root, f"call{i}", MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


# --- there: keep what each call carried, then rebuild the files ------------------------
def stage(carried_root: str, stage_dir: str) -> dict:
    """Copy the pieces of every carried call folder into STAGE_DIR (checked against
    the manifest); returns what is there and what is still missing."""
    os.makedirs(stage_dir, exist_ok=True)
    folders = sorted(d for d in (os.listdir(carried_root) if os.path.isdir(carried_root) else [])
                     if d.startswith("call") and os.path.isfile(os.path.join(carried_root, d, MANIFEST)))
    for d in folders:
        src = os.path.join(carried_root, d)
        manifest = _read_manifest(os.path.join(src, MANIFEST))
        known = {p["name"]: p for e in manifest["files"] for p in e["parts"]}
        for name in sorted(os.listdir(src)):
            if name == MANIFEST:
                continue
            if name not in known:
                raise PayloadError(f"{src}/{name}: not in the payload manifest")
            if sha256(os.path.join(src, name)) != known[name]["sha256"]:
                raise PayloadError(f"{src}/{name}: sha256 differs from the manifest (damaged in transfer)")
            shutil.copyfile(os.path.join(src, name), os.path.join(stage_dir, name))
        old = os.path.join(stage_dir, MANIFEST)
        if os.path.isfile(old) and _read_manifest(old)["files"] != manifest["files"]:
            raise PayloadError(f"{src}/{MANIFEST}: another payload than the one staged before "
                               f"({stage_dir}); clear it or plan again")
        shutil.copyfile(os.path.join(src, MANIFEST), old)
    return status(stage_dir, carried=folders)


def status(stage_dir: str, carried=()) -> dict:
    path = os.path.join(stage_dir, MANIFEST)
    if not os.path.isfile(path):
        return {"complete": False, "calls": None, "carried": list(carried), "missing": ["payload.json"]}
    manifest = _read_manifest(path)
    missing = [p for e in manifest["files"] for p in e["parts"]
               if not os.path.isfile(os.path.join(stage_dir, p["name"]))]
    return {"complete": not missing, "calls": manifest["calls"], "carried": list(carried),
            "missing": [p["name"] for p in missing],
            "missing_calls": sorted({p["call"] for p in missing})}


def assemble(stage_dir: str, dest: str) -> dict:
    """DEST/wheels/*.whl and DEST/corpus/ from a complete stage."""
    st = status(stage_dir)
    if not st["complete"]:
        raise PayloadError(f"payload incomplete: missing {', '.join(st['missing'])} "
                           f"(carry .whl/call{st.get('missing_calls', ['?'])[0]} in a call)")
    manifest = _read_manifest(os.path.join(stage_dir, MANIFEST))
    wheels, out = os.path.join(dest, "wheels"), {"wheels": [], "corpus": None}
    os.makedirs(wheels, exist_ok=True)
    for e in manifest["files"]:
        whole = os.path.join(dest, e["name"])
        with open(whole, "wb") as g:
            for p in e["parts"]:
                with open(os.path.join(stage_dir, p["name"]), "rb") as f:
                    shutil.copyfileobj(f, g)
        if sha256(whole) != e["sha256"]:
            raise PayloadError(f"{e['name']}: the reassembled file's sha256 differs from the manifest")
        if e["name"].endswith(".whl"):
            os.replace(whole, os.path.join(wheels, e["name"]))
            out["wheels"].append(e["name"])
        elif e["name"].endswith(".whl.tar.xz"):
            name = e["name"][:-len(".tar.xz")]
            _tar_to_wheel(whole, os.path.join(wheels, name))
            os.remove(whole)
            out["wheels"].append(name)
        elif e["name"] == "corpus.tar.xz":
            out["corpus"] = os.path.join(dest, "corpus")
            shutil.rmtree(out["corpus"], ignore_errors=True)
            with tarfile.open(whole, "r:xz") as t:
                t.extractall(out["corpus"], filter="data")
            os.remove(whole)
        else:
            raise PayloadError(f"{e['name']}: unknown payload file (expected *.whl, *.whl.tar.xz, corpus.tar.xz)")
    return out


def _tar_to_wheel(tar_path: str, wheel_path: str) -> None:
    with tarfile.open(tar_path, "r:xz") as t, zipfile.ZipFile(wheel_path, "w", zipfile.ZIP_STORED) as z:
        for m in t:
            if m.isfile():
                info = zipfile.ZipInfo(os.path.normpath(m.name), date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = (0o100000 | (m.mode & 0o777)) << 16      # a regular file
                with t.extractfile(m) as f, z.open(info, "w", force_zip64=True) as g:
                    shutil.copyfileobj(f, g, 1 << 20)


def _read_manifest(path: str) -> dict:
    try:
        with open(path) as f:
            m = json.load(f)
        if not isinstance(m, dict) or not isinstance(m.get("files"), list):
            raise ValueError("no file list")
        return m
    except (OSError, ValueError) as e:
        raise PayloadError(f"{path}: not a payload manifest ({e})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_payload", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("src")
    p.add_argument("out_root")
    p.add_argument("--tree-bytes", type=int, required=True, help="bytes of the working tree that travels")
    p.add_argument("--limit-bytes", type=int, default=TRANSFER_LIMIT)
    s = sub.add_parser("stage")
    s.add_argument("carried_root")
    s.add_argument("stage_dir")
    a = sub.add_parser("assemble")
    a.add_argument("stage_dir")
    a.add_argument("dest")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "plan":
            res = plan(args.src, args.out_root, args.tree_bytes, args.limit_bytes)
        elif args.cmd == "stage":
            res = stage(args.carried_root, args.stage_dir)
        else:
            res = assemble(args.stage_dir, args.dest)
    except (PayloadError, OSError) as e:
        print(f"device_payload: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
