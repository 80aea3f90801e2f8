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
#   Ablation kinds (one DSpine switch off each, ABLATIONS in smollm2_common.sh): dspine-no-injection
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

source train/smollm2_common.sh

stage_data() {
  timed data dspine data regenerate --out "$RUNS/data/sharegpt" --limit "$PROMPTS" \
    --max-new-tokens "$MAX_NEW" --batch-size "$REGEN_BATCH"
}

stage_train() {
  local kind spec extra
  for kind in $KINDS; do
    if [[ -f "$RUNS/smollm2-$kind/drafter/model.safetensors" ]]; then
      echo "smollm2-$kind: already trained"; continue
    fi
    spec=($(config_of "$kind"))
    extra=()
    for kv in "${spec[@]:1}" $TRAIN_SET; do extra+=(--set "$kv"); done
    timed "train-$kind" dspine train --config "${spec[0]}" "${extra[@]}" \
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

run_stage "$@"
