#!/usr/bin/env bash
# Device call 1b (docs/GPU_HOST.md): stash .gpu/part1w beside the part 1 that call 1 stashed.
# part1w holds the wheels that no longer fit beside the tree in the other calls, and the tail of
# vLLM's C.so.xz (`make gpu-bundle` splits it: the whole file and the tree passed a call's 64 MiB
# in session 20). Joined here, the stash looks as install-on-host.sh expects it.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=/root/mixprec-stash
PART=${1:-.gpu/part1w}
mkdir -p "$STASH/wheels"
cp "$PART"/wheels/*.whl "$STASH/wheels/"
if [ -f "$STASH/C.so.xz.aa" ]; then
  cat "$STASH/C.so.xz.aa" "$PART"/C.so.xz.a? > "$STASH/C.so.xz"
  xz -t "$STASH/C.so.xz"
  rm "$STASH/C.so.xz.aa"
fi
test -f "$STASH/C.so.xz" || { echo "part 1 is missing: run call 1 (the stash of .gpu/part1) first, on this host" >&2; exit 3; }
echo "part1w stashed: $(ls "$STASH/wheels" | wc -l) wheels, C.so.xz $(du -h "$STASH/C.so.xz" | cut -f1)"
