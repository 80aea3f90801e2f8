#!/usr/bin/env bash
# The SmolLM2-135M-Instruct replication: regenerate data, train DFlash, DSpine and
# the loss-confound baseline (DFlash trained with DSpine's backbone loss), evaluate all
# three against AR at T=0 and T=1. Every stage resumes where it stopped, so the script can
# be rerun (or run stage by stage) after an interruption.
#
#   train/replicate_smollm2.sh [data|train|eval|all] ...
#
# Environment knobs (defaults = the published run):
#   PROMPTS=16000 MAX_NEW=256 REGEN_BATCH=128 STEPS=2000 EVAL_LIMIT=32 EVAL_BATCH=32 EVAL_PROMPT=768 RUNS=runs
#   KINDS="dspine dflash dflash-cel1"  TEMPS="0 1"  TRAIN_SET="..." (extra --set for train)
#   Ablation kinds (one DSpine switch off each, ABLATIONS below): dspine-no-injection
#   dspine-no-teacher dspine-bidirectional dspine-no-alignment dspine-no-chain dspine-ce;
#   and dspine-ce-no-alignment (both losses the ablations found costly, off).
#   The shipped drafters: STEPS=3000 KINDS="dflash dspine-ce-no-alignment"
set -euo pipefail
cd "$(dirname "$0")/.."

PROMPTS=${PROMPTS:-16000}
MAX_NEW=${MAX_NEW:-256}
REGEN_BATCH=${REGEN_BATCH:-128}
STEPS=${STEPS:-2000}
EVAL_LIMIT=${EVAL_LIMIT:-32}
EVAL_BATCH=${EVAL_BATCH:-32}
EVAL_PROMPT=${EVAL_PROMPT:-768}
RUNS=${RUNS:-runs}
KINDS=${KINDS:-"dspine dflash dflash-cel1"}
TEMPS=${TEMPS:-"0 1"}
TRAIN_SET=${TRAIN_SET:-}

# Ablations: DSpine with switches of the design doc turned off (space-separated overrides).
declare -A ABLATIONS=(
  [dspine-no-injection]=dspine.injection=false
  [dspine-no-teacher]=loss.teacher_replacement=false
  [dspine-bidirectional]=dspine.causal_block=false
  [dspine-no-alignment]=loss.alignment=false
  [dspine-no-chain]=dspine.refinement_head=false
  [dspine-ce]=loss.backbone=ce
  [dspine-ce-no-alignment]="loss.backbone=ce loss.alignment=false"
)

timed() {  # timed NAME CMD...: run CMD and append its wall time to $RUNS/wall_times.tsv
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  printf '%s\t%s s\t%s\n' "$name" "$(( $(date +%s) - start ))" "$*" >> "$RUNS/wall_times.tsv"
}

stage_data() {
  timed data dspine data regenerate --out "$RUNS/data/sharegpt" --limit "$PROMPTS" \
    --max-new-tokens "$MAX_NEW" --batch-size "$REGEN_BATCH"
}

stage_train() {
  local kind config extra
  for kind in $KINDS; do
    if [[ -f "$RUNS/smollm2-$kind/drafter/model.safetensors" ]]; then
      echo "smollm2-$kind: already trained"; continue
    fi
    extra=()
    case $kind in
      dspine) config=train/configs/smollm2_dspine.toml ;;
      dflash) config=train/configs/smollm2_dflash.toml ;;
      dflash-cel1) config=train/configs/smollm2_dflash.toml
                   extra=(--set loss.backbone=ce+l1) ;;
      *) [[ -n ${ABLATIONS[$kind]:-} ]] || { echo "unknown drafter run $kind" >&2; exit 2; }
         config=train/configs/smollm2_dspine.toml
         for kv in ${ABLATIONS[$kind]}; do extra+=(--set "$kv"); done ;;
    esac
    for kv in $TRAIN_SET; do extra+=(--set "$kv"); done
    timed "train-$kind" dspine train --config "$config" "${extra[@]}" \
      --set "data.path=$RUNS/data/sharegpt" --set "run.out=$RUNS/smollm2-$kind" \
      --set "run.steps=$STEPS"
  done
}

stage_eval() {
  local t drafters=()
  for kind in $KINDS; do drafters+=(--drafter "$RUNS/smollm2-$kind/drafter"); done
  for t in $TEMPS; do
    timed "eval-t$t" dspine eval "${drafters[@]}" --temperature "$t" --limit "$EVAL_LIMIT" \
      --batch-size "$EVAL_BATCH" --max-new-tokens "$MAX_NEW" --max-prompt-tokens "$EVAL_PROMPT" \
      --out "$RUNS/eval-t$t"
  done
}

mkdir -p "$RUNS"
case ${1:-all} in
  data) stage_data ;;
  train) stage_train ;;
  eval) stage_eval ;;
  all) stage_data; stage_train; stage_eval ;;
  *) echo "usage: $0 [data|train|eval|all]" >&2; exit 2 ;;
esac
