#!/usr/bin/env bash
# The shipped drafters (dspine_jax/assets/drafters, ~84 MB) are tracked, and every tracked
# file travels with a device call (64 MiB limit). Move them out of the working tree before
# GPU calls and back afterwards; nothing is deleted from git.
#   tools/device/weights_aside.sh out     # before the calls
#   tools/device/weights_aside.sh back    # after them
set -euo pipefail
cd "$(dirname "$0")/../.."
assets=dspine_jax/assets/drafters aside=.carry/drafters-aside
case ${1:-} in
  out) [[ -d $aside ]] && { echo "$aside already exists" >&2; exit 1; }
       mkdir -p .carry && mv "$assets" "$aside" ;;
  back) [[ -d $aside ]] || { echo "nothing aside in $aside" >&2; exit 1; }
        mv "$aside" "$assets" ;;
  *) echo "usage: $0 out|back" >&2; exit 2 ;;
esac
