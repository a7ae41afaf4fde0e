#!/usr/bin/env bash
# train_imagenet.py under torchrun: NNODES nodes of NPROC ranks each (one
# rank per GPU). Run this same script on every node, with NODE_RANK set to
# 0 on the node whose address is MASTER_ADDR and 1, 2, ... on the others.
#
#   DATA=packed NNODES=2 NODE_RANK=0 MASTER_ADDR=node1 examples/train_imagenet_torchrun.sh
#
# Any further arguments go to train_imagenet.py (e.g. --epochs 1 --arch resnet18).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DATA=${DATA:-packed}           # holds train/train.index and val/val.index (img2tfrecord)
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
NPROC=$(( NPROC > 0 ? NPROC : 1 ))
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

val=()
[ -f "$DATA/val/val.index" ] && val=(--val "$DATA/val/val.index")
exec torchrun --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "$here/train_imagenet.py" --train "$DATA/train/train.index" "${val[@]}" "$@"
