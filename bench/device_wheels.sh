#!/usr/bin/env bash
# bench/device_wheels.sh: prepare here what bench/device_check.sh needs on the bare
# device machine (docs/gpu.md), split into one folder per device call:
#   - wheels for CPython 3.12 manylinux x86-64: mlx and mlx-cuda-13 (the version the
#     cuda extra of pyproject.toml pins), cffi and pycparser (the C draft's build),
#     nanobind (the fused CPU module's build); mlx-cuda-13's CUDA 13 libraries are
#     already on the machine (PyTorch's);
#   - the mlx-cuda-13 wheel recompressed as a tar.xz (~75 MB instead of ~90 MB);
#   - the prepared corpus (data/corpus, made by `python -m spel_mlx.corpus` if absent).
# Each .whl/callN fits the device tool's 64 MiB together with this checkout's working
# tree. Run it in the checkout the device tool sends (the session's own), then carry
# .whl/call1 in the first call, .whl/call2 in the next, ... with the same command.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
mlx_version=$(sed -n 's/.*mlx\[cuda13\]==\([0-9.]*\).*/\1/p' pyproject.toml | head -1)
[ -n "$mlx_version" ] || { echo "device_wheels: no mlx[cuda13]==VERSION in pyproject.toml" >&2; exit 2; }
git check-ignore -q .whl/probe || { echo "device_wheels: .whl/ is not git-ignored here: it would travel whole" >&2; exit 2; }
cache=.whl/cache src=.whl/src
mkdir -p "$cache"
rm -rf "$src" && mkdir -p "$src"

platforms=""
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086
# cffi and pycparser as installed here (the versions the C draft builds with); nanobind as
# pyproject.toml pins it (the one MLX was built with)
pins=$("$py" -c 'from importlib.metadata import version as v; print("cffi==" + v("cffi"), "pycparser==" + v("pycparser"))')
nanobind=$(sed -n 's/.*"\(nanobind==[0-9.]*\)".*/\1/p' pyproject.toml | head -1)
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d "$cache" "mlx==$mlx_version" "mlx-cuda-13==$mlx_version" $pins "$nanobind"

for w in "$cache"/*.whl; do
    case "$(basename "$w")" in
        mlx_cuda_13-*) ;;
        *) ln -f "$w" "$src/" ;;
    esac
done
cuda_whl=$(ls "$cache"/mlx_cuda_13-"$mlx_version"-*.whl)
packed="$cache/$(basename "$cuda_whl").tar.xz"
if [ ! -s "$packed" ]; then
    echo "recompressing $(basename "$cuda_whl") (about 2 minutes)"
    tmp=$(mktemp -d)
    (cd "$tmp" && unzip -q "$OLDPWD/$cuda_whl")
    tar --sort=name --owner=0 --group=0 --mtime=@0 -C "$tmp" -cf - . | xz -9 -T1 > "$packed.tmp"
    mv "$packed.tmp" "$packed"
    rm -rf "$tmp"
fi
ln -f "$packed" "$src/"

if [ ! -s data/corpus/train.txt ] || [ ! -s data/corpus/heldout.txt ]; then
    "$py" -m spel_mlx.corpus --out data/corpus
fi
tar --sort=name --owner=0 --group=0 --mtime=@0 -C data/corpus -cJf "$src/corpus.tar.xz" train.txt heldout.txt manifest.json

# what travels besides the carried folder: tracked and untracked-not-ignored files, shared/
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | "$py" -c '
import os, sys
names = set(sys.stdin.read().split("\0")) - {""}
total = sum(os.path.getsize(n) for n in names if os.path.isfile(n))
for root, _, files in os.walk("shared"):
    total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.join(root, f) not in names)
print(total)')
"$py" -m bench.device_payload plan "$src" .whl --tree-bytes "$tree_bytes" > .whl/plan.json
"$py" - <<'PY'
import json
m = json.load(open(".whl/plan.json"))
print(f"working tree {m['tree_bytes'] / 2**20:.1f} MiB; {m['room_bytes'] / 2**20:.1f} MiB per call; "
      f"{m['calls']} calls:")
for c in range(1, m["calls"] + 1):
    parts = [p for f in m["files"] for p in f["parts"] if p["call"] == c]
    size = sum(p["size"] for p in parts) / 2**20
    what = "stages" if c < m["calls"] else "installs, builds, measures, trains"
    print(f"  call {c}: carry [\".whl/call{c}\"] ({size:.1f} MiB), command: bash bench/device_check.sh $OUT"
          f"   ({what})")
PY
