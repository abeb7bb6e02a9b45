"""What the device check brings back, within the device tool's return limits (at most
8 files, 16 MiB each, 64 MiB in all, names of letters, digits, '.', '_' and '-'):

    device_check.json     the summary: steps, machine, bench counts, training, report,
                          the model's files and hashes, the shipping judgement's inputs
    benchmarks.json       the B2/B3 rows as a ``python -m bench`` results document
    device_check.log      every step's output (cut in the middle when long)
    model.tar.part-NN     the exported model folder as one tar, in parts
                          (``cat model.tar.part-* > model.tar``)

And the judgement: the trained model against the shipped one (docs/gpu.md).
Standard library only.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile

from .device_payload import sha256

MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * 2**20, 64 * 2**20
LOG_HEAD, LOG_TAIL = 512 * 2**10, 3 * 2**20
OWN = re.compile(r"^(device_check\.json|benchmarks\.json|device_check\.log|model\.tar\.part-\d+)$")
# the shipped model (docs/training.md): held-out target loss, greedy alpha at K=4 over
# 24 and over 8 held-out prompts, and the repository's size rule
SHIPPED = {"heldout_nats": 3.107, "alpha_k4_24": 0.776, "alpha_k4_8": 0.725, "size_mb_max": 40.0}


def _copy_log(src: str, dst: str) -> None:
    n = os.path.getsize(src) if os.path.isfile(src) else 0
    with open(dst, "wb") as g:
        if not n:
            return
        with open(src, "rb") as f:
            if n <= LOG_HEAD + LOG_TAIL:
                shutil.copyfileobj(f, g)
                return
            g.write(f.read(LOG_HEAD))
            g.write(f"\n... [{n - LOG_HEAD - LOG_TAIL} bytes cut] ...\n".encode())
            f.seek(n - LOG_TAIL)
            shutil.copyfileobj(f, g)


def _model_tar(model_dir: str) -> tuple:
    """(tar bytes, [{name, size, sha256}]) of the model folder's files."""
    files, buf = [], io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name in sorted(os.listdir(model_dir)):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                info = t.gettarinfo(path, arcname=name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(path, "rb") as f:
                    t.addfile(info, f)
                files.append({"name": name, "size": info.size, "sha256": sha256(path)})
    return buf.getvalue(), files


def pack(summary: dict, out: str, model_dir, log_path: str, part_bytes: int, bench_json) -> list:
    """Write the return files into ``out``; ``summary["returned"]`` lists them."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):             # an earlier run's files, never anything else
        if OWN.match(name):
            os.remove(os.path.join(out, name))
    written = []
    if bench_json and os.path.isfile(bench_json):
        shutil.copyfile(bench_json, os.path.join(out, "benchmarks.json"))
        written.append("benchmarks.json")
    _copy_log(log_path, os.path.join(out, "device_check.log"))
    written.append("device_check.log")
    part_bytes = min(part_bytes, MAX_FILE_BYTES)
    if model_dir and os.path.isdir(model_dir):
        data, files = _model_tar(model_dir)
        parts = -(-len(data) // part_bytes)
        used = sum(os.path.getsize(os.path.join(out, n)) for n in written)
        room_files = MAX_FILES - len(written) - 1          # the summary comes last
        if parts > room_files or used + len(data) + 2**20 > MAX_TOTAL_BYTES:
            summary["model"] = {"files": files, "returned": False,
                                "note": f"{len(data)} bytes in {parts} parts do not fit the return limits"}
        else:
            names = []
            for i in range(parts):
                name = f"model.tar.part-{i:02d}"
                with open(os.path.join(out, name), "wb") as f:
                    f.write(data[i * part_bytes:(i + 1) * part_bytes])
                names.append(name)
            written += names
            safetensors = sum(f["size"] for f in files if f["name"].endswith(".safetensors"))
            summary["model"] = {"files": files, "returned": True, "parts": names, "tar_bytes": len(data),
                                "tar_sha256": hashlib.sha256(data).hexdigest(), "size_mb": safetensors / 1e6,
                                "restore": "cat model.tar.part-* > model.tar && mkdir -p M && tar -xf model.tar -C M"}
    summary["returned"] = written + ["device_check.json"]
    with open(os.path.join(out, "device_check.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary["returned"]


def judgement(summary: dict, model_dir) -> dict:
    """The trained model's figures beside the shipped model's.  ``ship`` is only a
    first reading: the decision takes train_report --prompts 24 on the returned
    model, on the machine the shipped model was measured on (docs/gpu.md)."""
    rep = summary.get("report") or {}
    held = (rep.get("heldout") or {}).get("target_nats_per_token")
    alpha = (rep.get("alpha") or {}).get("alpha")
    prompts = (rep.get("alpha") or {}).get("prompts")
    size = None
    if model_dir and os.path.isdir(model_dir):
        size = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir)
                   if n.endswith(".safetensors")) / 1e6
    alpha_ref = SHIPPED["alpha_k4_24"] if prompts == 24 else SHIPPED["alpha_k4_8"]
    checks = {"heldout_loss": None if held is None else held < SHIPPED["heldout_nats"],
              "alpha_k4": None if alpha is None else alpha > alpha_ref,
              "size": None if size is None else size <= SHIPPED["size_mb_max"]}
    return {"shipped": SHIPPED, "heldout_nats": held, "alpha_k4": alpha, "alpha_prompts": prompts,
            "alpha_to_beat": alpha_ref, "size_mb": size, "checks": checks,
            "ship": all(v is True for v in checks.values())}
