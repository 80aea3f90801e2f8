# Sourced by train/replicate_smollm2.sh and train/scale_smollm2.sh: the drafter kinds
# both scripts train, the wall-time log, and the stage dispatch.

# DSpine with switches of the design doc turned off (space-separated overrides).
declare -A ABLATIONS=(
  [dspine-no-injection]=dspine.injection=false
  [dspine-no-teacher]=loss.teacher_replacement=false
  [dspine-bidirectional]=dspine.causal_block=false
  [dspine-no-alignment]=loss.alignment=false
  [dspine-no-chain]=dspine.refinement_head=false
  [dspine-ce]=loss.backbone=ce
  [dspine-ce-no-alignment]="loss.backbone=ce loss.alignment=false"
  [dspine-ce-no-alignment-no-teacher]="loss.backbone=ce loss.alignment=false
    loss.teacher_replacement=false"
)

config_of() {  # config_of KIND: the config file of a drafter kind, then its --set pairs
  case $1 in
    dflash) echo "train/configs/smollm2_dflash.toml" ;;
    dflash-cel1) echo "train/configs/smollm2_dflash.toml loss.backbone=ce+l1" ;;
    dspine) echo "train/configs/smollm2_dspine.toml" ;;
    *) [[ -n ${ABLATIONS[$1]:-} ]] || {
         echo "unknown drafter kind $1 (dflash, dflash-cel1, dspine, ${!ABLATIONS[*]})" >&2
         exit 2; }
       echo "train/configs/smollm2_dspine.toml ${ABLATIONS[$1]}" ;;
  esac
}

timed() {  # timed NAME CMD...: run CMD and append its wall time to $RUNS/wall_times.tsv
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  printf '%s\t%s s\t%s\n' "$name" "$(( $(date +%s) - start ))" "$*" >> "$RUNS/wall_times.tsv"
}

run_stage() {  # run_stage [data|train|eval|all]: the script's stage functions
  mkdir -p "$RUNS"
  case ${1:-all} in
    data) stage_data ;;
    train) stage_train ;;
    eval) stage_eval ;;
    all) stage_data; stage_train; stage_eval ;;
    *) echo "usage: $0 [data|train|eval|all]" >&2; exit 2 ;;
  esac
}
