#!/usr/bin/env bash
# train_imagenet.py under Open MPI's mpirun: NP ranks in all, NPROC per node,
# on the hosts of HOSTS (mpirun's --host syntax: node1:8,node2:8). The
# script is started once, on the first host, which is also where rank 0
# runs and the process group meets (MASTER_ADDR).
#
#   DATA=packed HOSTS=node1:8,node2:8 NPROC=8 examples/train_imagenet_mpirun.sh
#
# init_tiacc_training() reads OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK and
# _LOCAL_SIZE; -x passes the variables it needs besides them. Any further
# arguments go to train_imagenet.py.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DATA=${DATA:-packed}
NPROC=${NPROC:-1}
HOSTS=${HOSTS:-localhost:$NPROC}
NP=${NP:-$(( $(tr ',' '\n' <<<"$HOSTS" | wc -l) * NPROC ))}
export MASTER_ADDR=${MASTER_ADDR:-$(cut -d, -f1 <<<"$HOSTS" | cut -d: -f1)}
export MASTER_PORT=${MASTER_PORT:-29500}
[ "$MASTER_ADDR" = localhost ] && MASTER_ADDR=127.0.0.1

val=()
[ -f "$DATA/val/val.index" ] && val=(--val "$DATA/val/val.index")
# --allow-run-as-root: containers often run as root; --bind-to none: the
# decode threads of each rank may use every core mpirun would not give it.
exec mpirun --allow-run-as-root --bind-to none -np "$NP" --host "$HOSTS" \
    -x MASTER_ADDR -x MASTER_PORT -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
    -x OMP_NUM_THREADS -x 'TIACC_TRAINING_*' -x 'LIGHT_*' -x 'NCCL_*' \
    ${MPIRUN_ARGS:-} \
    "${PYTHON:-python3}" "$here/train_imagenet.py" --train "$DATA/train/train.index" "${val[@]}" "$@"
