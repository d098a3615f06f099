#!/bin/sh
# usage: tools/deepspeed-wheel.sh VERSION OUT_DIR   (from the repository root, .venv with torch)
#
# DeepSpeed's wheel, its shared-memory op compiled against .venv's torch, into OUT_DIR.
# Built once per machine and key (DeepSpeed version, torch version, Python, CPU
# architecture) and kept in a wheel cache, as pip keeps the wheels it builds: the build takes
# 89 CPU-s and 93 s on an idle machine here (2026-11-27), which every clean clone
# paid again. pip's own cache is not used: its key is the sdist alone, so it would hand a
# wheel built against one torch to another. The cache is
# ${XDG_CACHE_HOME:-~/.cache}/raylastic/wheels, or RAYLASTIC_WHEEL_CACHE; set that empty to
# build every time. A wheel enters the cache by a rename, so a concurrent build never reads
# half of one.
set -eu
version=$1
out=$2
# The key reads torch's version from its metadata, not by importing it: under `make test` this
# runs while the lock's packages install beside it, and an import of torch that met a
# half-installed numpy failed a clean clone (2026-12-07: "module 'numpy' has no attribute
# 'ndarray'"). The same string as torch.__version__ ("2.13.0+cpu").
key=$(.venv/bin/python -c 'import platform, sys; from importlib.metadata import version; v = version("torch"); print(f"torch-{v}-cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')
cache=${RAYLASTIC_WHEEL_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/raylastic/wheels}
dir="$cache/deepspeed-$version-shm-$key"
rm -rf "$out"
mkdir -p "$out"
if [ -n "$cache" ]; then
  for whl in "$dir"/deepspeed-"$version"-*.whl; do
    if [ -f "$whl" ]; then
      cp "$whl" "$out"/
      echo "DeepSpeed $version: the wheel built before for $key ($whl)"
      exit 0
    fi
  done
fi
build() {
  DS_BUILD_SHM_COMM=1 .venv/bin/pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$out" "deepspeed==$version"
}
# The build imports torch too, and so can meet the same half-installed packages: once more
# after them (uv installs the lock in well under 30 s here).
build || { echo "DeepSpeed's build failed; once more in 30 s" >&2; sleep 30; build; }
if [ -n "$cache" ]; then
  mkdir -p "$dir"
  for whl in "$out"/deepspeed-"$version"-*.whl; do
    name=$(basename "$whl")
    cp "$whl" "$dir/.$name.$$" && mv "$dir/.$name.$$" "$dir/$name"
  done
fi
