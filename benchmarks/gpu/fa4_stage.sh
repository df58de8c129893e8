#!/usr/bin/env bash
# On the GPU machine, from the project root: install flash-attn-4 from the wheels that
# benchmarks/gpu/fa4_wheels.sh packed, carried over two calls on a warm machine (carry .fa4/part1 in
# one, .fa4/part2 in the next; a carried path the next call does not carry is removed, /tmp stays).
# Run it in both calls: it copies whichever part is there to /tmp/fa, and once both pieces of the
# split wheel are there, puts it back together, checks its sha256 and installs everything (once)
# into /tmp/fasite. pip --target does not run nvidia-cutlass-dsl's .pth file, which puts
# nvidia_cutlass_dsl/dsl_packages (the `cutlass` package) on sys.path: the printed line does.
# Quiet on success but for that line:
#   eval "$(bash benchmarks/gpu/fa4_stage.sh)" && python3 -c 'import flash_attn.cute'
set -euo pipefail
stage=/tmp/fa
site=/tmp/fasite
mkdir -p "$stage"
for part in .fa4/part1 .fa4/part2; do
  if [ -d "$part" ]; then cp "$part"/* "$stage"/; fi
done

if [ ! -f "$site/.installed" ]; then
  for first in "$stage"/*.part-1; do
    [ -e "$first" ] || { echo "fa4_stage.sh: no .fa4/part1 carried yet" >&2; exit 1; }
    wheel=${first%.part-1}
    if [ ! -f "$wheel.part-2" ]; then
      echo "fa4_stage.sh: part 1 staged in $stage; carry .fa4/part2 in the next call" >&2
      exit 0
    fi
    cat "$first" "$wheel.part-2" > "$wheel.tmp"
    if [ "$(sha256sum "$wheel.tmp" | cut -d' ' -f1)" != "$(cat "$wheel.sha256")" ]; then
      echo "fa4_stage.sh: $(basename "$wheel") put together has the wrong sha256" >&2
      exit 1
    fi
    mv "$wheel.tmp" "$wheel"
  done
  rm -rf "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stage"/*.whl
  touch "$site/.installed"
fi
echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages:$PWD"
