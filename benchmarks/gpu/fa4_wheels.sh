#!/usr/bin/env bash
# Download flash-attn-4 and its CuTe DSL wheels for the GPU machine (Python 3.12, torch 2.11 cu130)
# into ./.fa4 (run here, from the project root), then pack them for the device tool's 64 MiB carry
# per call: the libs-cu13 wheel (~92 MB) is split in two, `.fa4/part1/` (every small wheel + the
# first piece) and `.fa4/part2/` (the second piece), each carried in its own call on a warm machine.
# There, benchmarks/gpu/fa4_stage.sh puts them together and installs them.
# Usage: bash benchmarks/gpu/fa4_wheels.sh
set -euo pipefail
dest=.fa4
mkdir -p "$dest"
grep -qx '/.fa4/' .git/info/exclude 2>/dev/null || echo '/.fa4/' >> .git/info/exclude
pkgs=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
      torch-c-dlpack-ext==0.1.5)
# the same platform list as ../shared/gpu/wheels.sh: the newest manylinux tag first, pure Python last
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$dest" "$p"
done

big=$(ls "$dest"/nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl)
name=$(basename "$big")
rm -rf "$dest/part1" "$dest/part2"
mkdir -p "$dest/part1" "$dest/part2"
for w in "$dest"/*.whl; do
  [ "$w" = "$big" ] || cp "$w" "$dest/part1/"
done
# The first piece evens the two parts out (small wheels + piece 1 = piece 2, ~51 MB each); the
# names sort in the order fa4_stage.sh cats them back.
small=$(du -cb "$dest"/part1/*.whl | tail -1 | cut -f1)
size=$(stat -c %s "$big")
first=$(( (size - small) / 2 ))
head -c "$first" "$big" > "$dest/part1/$name.part-1"
tail -c +"$((first + 1))" "$big" > "$dest/part2/$name.part-2"
sha256sum "$big" | awk '{print $1}' > "$dest/part1/$name.sha256"
du -b "$dest/part1" "$dest/part2"
ls -l "$dest/part1" "$dest/part2"
