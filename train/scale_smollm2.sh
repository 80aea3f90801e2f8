#!/usr/bin/env bash
# SmolLM2-135M-Instruct drafters on every ShareGPT turn: regenerate every ShareGPT human
# turn at several temperatures, train each drafter as a chain of short links (each link
# one `dspine train` that resumes the previous link's full state), join the chain's
# curves, evaluate against AR at T=0 and T=1. Every stage resumes where it stopped: rerun
# the same command after an interruption.
#
#   train/scale_smollm2.sh [data|train|eval|all] ...
#
# Environment knobs (defaults):
#   RUNS=runs  DATA=$RUNS/data/sharegpt-all  PROMPTS= (all)  TEMPERATURES=0,0.7,1  SAMPLES=1
#   SOURCE= (the ShareGPT package, every turn; or a prompts file of
#   `python -m dspine_train.prompt_file`, which already holds every turn, for a host without
#   the package)
#   INIT_FROM= ("KIND=DRAFTER ...": that kind's first link starts from an exported drafter's
#   weights (a folder or a built-in name), a fresh optimizer and schedule, e.g.
#   dflash=smollm2-135m-instruct-dflash continues the built-in drafter; later links resume
#   the chain's full state)
#   MAX_NEW=1024  MAX_PROMPT=512  REGEN_BATCH=1024 (slots)  SHARD=512
#   NUM_PAGES= (the shared KV page pool; default every slot at MAX_PROMPT + MAX_NEW, never
#   preempted)
#   DATA_SECONDS=0 (>0: the data stage stops once a shard lands past this many seconds;
#   rerun to continue)
#   KINDS="dflash dspine-ce-no-alignment"  STEPS=15000 (the whole chain)  LINK=2000 (steps
#   per link)  LINK_SECONDS=0 (>0: a link also stops, checkpointed, after this long)
#   LINKS_PER_CALL=0 (>0: run at most this many links, then exit: one call per link)
#   SEQ_LEN=1024  BATCH=32  TRAIN_SET="..." (extra --set for every link, e.g. "mesh.data=2")
#   EVAL_LIMIT=32 EVAL_BATCH=32 EVAL_NEW=256 EVAL_PROMPT=768 TEMPS="0 1"
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs}
DATA=${DATA:-$RUNS/data/sharegpt-all}
PROMPTS=${PROMPTS:-}
SOURCE=${SOURCE:-}
INIT_FROM=${INIT_FROM:-}
TEMPERATURES=${TEMPERATURES:-0,0.7,1}
SAMPLES=${SAMPLES:-1}
MAX_NEW=${MAX_NEW:-1024}
MAX_PROMPT=${MAX_PROMPT:-512}
REGEN_BATCH=${REGEN_BATCH:-1024}
SHARD=${SHARD:-512}
DATA_SECONDS=${DATA_SECONDS:-0}
KINDS=${KINDS:-"dflash dspine-ce-no-alignment"}
STEPS=${STEPS:-15000}
LINK=${LINK:-2000}
LINK_SECONDS=${LINK_SECONDS:-0}
LINKS_PER_CALL=${LINKS_PER_CALL:-0}
SEQ_LEN=${SEQ_LEN:-1024}
BATCH=${BATCH:-32}
TRAIN_SET=${TRAIN_SET:-}
EVAL_LIMIT=${EVAL_LIMIT:-32}
EVAL_BATCH=${EVAL_BATCH:-32}
EVAL_NEW=${EVAL_NEW:-256}
EVAL_PROMPT=${EVAL_PROMPT:-768}
TEMPS=${TEMPS:-"0 1"}

source train/smollm2_common.sh

stage_data() {
  local source=(--turns all)
  [[ -n $SOURCE ]] && source=(--source "$SOURCE")
  timed data dspine data regenerate --out "$DATA" "${source[@]}" ${PROMPTS:+--limit "$PROMPTS"} \
    --temperatures "$TEMPERATURES" --samples-per-prompt "$SAMPLES" \
    --max-new-tokens "$MAX_NEW" --max-prompt-tokens "$MAX_PROMPT" \
    --batch-size "$REGEN_BATCH" --shard-size "$SHARD" \
    ${NUM_PAGES:+--num-pages "$NUM_PAGES"} \
    $( ((DATA_SECONDS > 0)) && echo --max-seconds "$DATA_SECONDS")
}

summary_field() {  # summary_field RUN_DIR KEY: a field of the run's summary.json
  python -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' \
    "$1/summary.json" "$2"
}

init_of() {  # init_of KIND: the weights INIT_FROM gives KIND's first link, if any
  local pair
  for pair in $INIT_FROM; do
    [[ ${pair%%=*} == "$1" ]] && { echo "${pair#*=}"; return; }
  done
  return 0
}

stage_train() {
  local kind spec config link dir prev init extra start calls=0 links
  for kind in $KINDS; do
    spec=($(config_of "$kind"))
    config=${spec[0]}
    init=$(init_of "$kind")
    prev=""
    link=1
    while :; do
      dir=$RUNS/scale-$kind/link-$link
      if [[ -f $dir/summary.json ]]; then  # this link ran to its stop: on to the next
        [[ $(summary_field "$dir" finished) == True ]] && break
        prev=$dir; link=$((link + 1)); continue
      fi
      if (( LINKS_PER_CALL > 0 && calls >= LINKS_PER_CALL )); then
        echo "scale-$kind: $calls links run in this call; rerun to continue"; return
      fi
      extra=() start=()   # start: the previous link's full state, or INIT_FROM's weights
      for kv in "${spec[@]:1}" $TRAIN_SET; do extra+=(--set "$kv"); done
      if [[ -n $prev ]]; then start=(--resume-from "$prev")
      elif [[ -n $init ]]; then start=(--init-from "$init"); fi
      timed "train-$kind-link-$link" dspine train --config "$config" "${extra[@]}" \
        --set "data.path=$DATA" --set "data.seq_len=$SEQ_LEN" --set "run.batch_size=$BATCH" \
        --set "run.out=$dir" --set "run.steps=$STEPS" --set "run.stop_after=$LINK" \
        --set "run.max_seconds=$LINK_SECONDS" "${start[@]}"
      calls=$((calls + 1))
    done
    links=$(seq -f "$RUNS/scale-$kind/link-%g" 1 "$link")
    python -m dspine_train.chain $links --out "$RUNS/scale-$kind/chain"
    ln -sfn "link-$link/drafter" "$RUNS/scale-$kind/drafter"
  done
}

stage_eval() {
  local t drafters=()
  for kind in $KINDS; do drafters+=(--drafter "$RUNS/scale-$kind/drafter"); done
  for t in $TEMPS; do
    timed "eval-t$t" dspine eval "${drafters[@]}" --temperature "$t" --limit "$EVAL_LIMIT" \
      --batch-size "$EVAL_BATCH" --max-new-tokens "$EVAL_NEW" \
      --max-prompt-tokens "$EVAL_PROMPT" --out "$RUNS/scale-eval-t$t"
  done
}

run_stage "$@"
