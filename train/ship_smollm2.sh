#!/usr/bin/env bash
# The stage-two SmolLM2-135M-Instruct drafters (docs/replication.md, "The stage-two pair"),
# which the built-in pair continues (train/scale_smollm2.sh, "Longer runs and other data"):
# a prompts file of every ShareGPT training turn cut to 256 tokens (first turns first), the
# target's greedy answers (up to 256 tokens) to its first 31,744 prompts, DFlash and DSpine
# (CE backbone, no alignment) trained identically for 5,000 steps at 512 tokens, saved in
# bf16; then (`continue`) the answers to all 44,546 prompts and 5,000 more steps of each
# drafter from those bf16 weights (a fresh optimizer and schedule), saved in bf16; both
# evaluated against AR at T = 0 and T = 1. `ablate` repeats the ablations that chose
# DSpine's recipe at that scale: each kind trained from scratch on the answers to all
# prompts, then (`ablate-eval`) all of them in one evaluation. Every stage resumes or skips
# what is done, so the script can be rerun after an interruption.
#
#   train/ship_smollm2.sh [prompts|data|train|continue|eval|ablate|ablate-eval|all]
#
# Environment knobs (defaults = the stage-two run):
#   RUNS=runs  PROMPT_FILE=$RUNS/prompts-256.jsonl  PROMPTS=31744  MAX_PROMPT=256  MAX_NEW=256
#   ALL_PROMPTS=44546 (continue)
#   REGEN_BATCH=1024 (slots)  SHARD=1024  STEPS=5000  SEQ_LEN=512
#   KINDS="dflash dspine-ce-no-alignment"  TRAIN_SET="..." (extra --set for every training)
#   EVAL_LIMIT=32  EVAL_BATCH=32  EVAL_PROMPT=768  TEMPS="0 1"
#   ABLATE_KINDS="dspine-ce-no-alignment dspine-no-alignment dspine-ce
#                 dspine-ce-no-alignment-no-teacher dflash"  ABLATE_STEPS=2500  ABLATE_TEMPS=0
# The built-in drafters are $RUNS/ship-<kind>-cont/drafter-bf16/ (copy them into
# dspine_jax/assets/drafters/ and their sha256 into dspine_jax/registry.py).
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs}
PROMPT_FILE=${PROMPT_FILE:-$RUNS/prompts-256.jsonl}
PROMPTS=${PROMPTS:-31744}
ALL_PROMPTS=${ALL_PROMPTS:-44546}
MAX_PROMPT=${MAX_PROMPT:-256}
MAX_NEW=${MAX_NEW:-256}
REGEN_BATCH=${REGEN_BATCH:-1024}
SHARD=${SHARD:-1024}
STEPS=${STEPS:-5000}
SEQ_LEN=${SEQ_LEN:-512}
KINDS=${KINDS:-"dflash dspine-ce-no-alignment"}
TRAIN_SET=${TRAIN_SET:-}
EVAL_LIMIT=${EVAL_LIMIT:-32}
EVAL_BATCH=${EVAL_BATCH:-32}
EVAL_PROMPT=${EVAL_PROMPT:-768}
TEMPS=${TEMPS:-"0 1"}
# The shipped recipe, then one change each: the CE+L1 backbone, the alignment loss, no
# teacher replacement; DFlash trained the same way gives the ratio.
ABLATE_KINDS=${ABLATE_KINDS:-"dspine-ce-no-alignment dspine-no-alignment dspine-ce
  dspine-ce-no-alignment-no-teacher dflash"}
ABLATE_STEPS=${ABLATE_STEPS:-2500}
ABLATE_TEMPS=${ABLATE_TEMPS:-0}

source train/smollm2_common.sh

stage_prompts() {
  [[ -f $PROMPT_FILE ]] && { echo "$PROMPT_FILE: already written"; return; }
  timed prompts python -m dspine_train.prompt_file --out "$PROMPT_FILE" \
    --max-prompt-tokens "$MAX_PROMPT"
}

regenerate() {  # regenerate NAME OUT LIMIT: the target's greedy answers to LIMIT prompts (resumes)
  [[ -f $PROMPT_FILE ]] || stage_prompts
  timed "$1" dspine data regenerate --out "$2" \
    --source "$PROMPT_FILE" --limit "$3" --max-prompt-tokens "$MAX_PROMPT" \
    --max-new-tokens "$MAX_NEW" --batch-size "$REGEN_BATCH" --shard-size "$SHARD"
}

stage_data() { regenerate data "$RUNS/data/sharegpt-turns-$MAX_PROMPT" "$PROMPTS"; }

save_bf16() {  # save_bf16 DIR: DIR/drafter -> DIR/drafter-bf16, bf16 weights as drafters ship
  python -c '
import sys, jax.numpy as jnp
from dspine_jax.drafters.checkpoint import load_drafter, save_drafter
save_drafter(load_drafter(sys.argv[1]), sys.argv[2], dtype=jnp.bfloat16)' \
    "$1/drafter" "$1/drafter-bf16"
}

train_kind() {  # train_kind NAME KIND DATA DIR [ARG...]: KIND's recipe on DATA into DIR, then bf16
  local name=$1 kind=$2 data=$3 dir=$4 spec extra=()
  shift 4
  spec=($(config_of "$kind"))
  for kv in "${spec[@]:1}" $TRAIN_SET; do extra+=(--set "$kv"); done
  [[ -f $dir/drafter/model.safetensors ]] ||
    timed "$name" dspine train --config "${spec[0]}" "${extra[@]}" "$@" \
      --set "data.path=$data" --set "data.seq_len=$SEQ_LEN" --set "run.out=$dir" \
      --set "run.steps=$STEPS" --set run.checkpoint_every=1000
  [[ -f $dir/drafter-bf16/model.safetensors ]] || save_bf16 "$dir"
}

stage_train() {
  for kind in $KINDS; do
    train_kind "train-$kind" "$kind" "$RUNS/data/sharegpt-turns-$MAX_PROMPT" "$RUNS/ship-$kind"
  done
}

stage_continue() {  # every prompt answered, then STEPS more steps from the bf16 weights
  local data=$RUNS/data/sharegpt-turns-$MAX_PROMPT-all
  stage_train   # skips what is trained
  regenerate data-all "$data" "$ALL_PROMPTS"
  for kind in $KINDS; do
    train_kind "continue-$kind" "$kind" "$data" "$RUNS/ship-$kind-cont" \
      --init-from "$RUNS/ship-$kind/drafter-bf16"
  done
}

evaluate() {  # evaluate LABEL OUT "TEMPS" DRAFTER...: one dspine eval per T into OUT-tT
  local label=$1 out=$2 temps=$3 t dir drafters=()
  shift 3
  for dir in "$@"; do drafters+=(--drafter "$dir"); done
  for t in $temps; do
    timed "$label-t$t" dspine eval "${drafters[@]}" --temperature "$t" --limit "$EVAL_LIMIT" \
      --batch-size "$EVAL_BATCH" --max-new-tokens "$MAX_NEW" \
      --max-prompt-tokens "$EVAL_PROMPT" --out "$out-t$t"
  done
}

stage_eval() {
  local kind dirs=()
  for kind in $KINDS; do dirs+=("$RUNS/ship-$kind-cont/drafter-bf16"); done
  evaluate eval "$RUNS/ship-eval" "$TEMPS" "${dirs[@]}"
}

stage_ablate() {  # each of ABLATE_KINDS from scratch, ABLATE_STEPS steps on every answer
  local data=$RUNS/data/sharegpt-turns-$MAX_PROMPT-all kind STEPS=$ABLATE_STEPS
  regenerate data-all "$data" "$ALL_PROMPTS"
  for kind in $ABLATE_KINDS; do
    train_kind "ablate-$kind" "$kind" "$data" "$RUNS/ablate-$kind"
  done
}

stage_ablate_eval() {
  local kind dirs=()
  for kind in $ABLATE_KINDS; do
    [[ -f $RUNS/ablate-$kind/drafter-bf16/model.safetensors ]] || {
      echo "$RUNS/ablate-$kind is not trained: run the ablate stage first" >&2; exit 2; }
    dirs+=("$RUNS/ablate-$kind/drafter-bf16")
  done
  evaluate ablate-eval "$RUNS/ablate-eval" "$ABLATE_TEMPS" "${dirs[@]}"
}

case ${1:-all} in
  prompts) mkdir -p "$RUNS"; stage_prompts ;;
  continue) mkdir -p "$RUNS"; stage_continue ;;
  ablate) mkdir -p "$RUNS"; for kind in $ABLATE_KINDS; do config_of "$kind" >/dev/null; done
          stage_ablate ;;
  ablate-eval) mkdir -p "$RUNS"; stage_ablate_eval ;;
  all) mkdir -p "$RUNS"; stage_prompts; stage_data; stage_train; stage_continue; stage_eval ;;
  *) run_stage "$@" ;;
esac
