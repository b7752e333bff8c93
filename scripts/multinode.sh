#!/usr/bin/env bash
# Load a checkpoint onto N nodes with distload: the documented way, and its emulation on one machine.
#
# A real cluster: run the same command on every node, changing only NODE_RANK (0 on the node whose
# address is the rendezvous endpoint). torchrun's static rendezvous gives every process RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (= the node); distload takes node identity from those, and
# with `--readers per-node` (the default) local rank 0 of each node reads its share of the checkpoint
# from that node's storage, once, and every rank receives only its own shards.
#
#   NNODES=2 NODE_RANK=0 MASTER=10.0.0.1 NPROC=8 scripts/multinode.sh /models/Llama-3-70B --tp 8 ...   # node 0
#   NNODES=2 NODE_RANK=1 MASTER=10.0.0.1 NPROC=8 scripts/multinode.sh /models/Llama-3-70B --tp 8 ...   # node 1
#
# which runs, on each node:
#
#   torchrun --nnodes $NNODES --node-rank $NODE_RANK --nproc-per-node $NPROC \
#            --rdzv-backend static --rdzv-endpoint $MASTER:$PORT -m distload load CKPT [distload options]
#
# (--rdzv-backend c10d also works, but assigns node ranks in arrival order; static keeps NODE_RANK.)
# The checkpoint path must be the same on every node (a shared file system, or a copy per node).
#
# Emulation on one machine (needs root: mount namespaces): `scripts/multinode.sh --emulate 2 CKPT [options]`
# starts NNODES node agents here, each in its own mount namespace where a copy of the checkpoint is
# bind-mounted at one path, so each emulated node has its own page cache, as a real node would; the copies
# live next to CKPT (CKPT-node1, ...) and are made once. scripts/bench.py uses the same arrangement.
set -euo pipefail

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[[ $# -ge 1 ]] || usage 1
[[ "$1" == -h || "$1" == --help ]] && usage 0

PYTHON=${PYTHON:-python}
PORT=${PORT:-29511}
NPROC=${NPROC:-2}

if [[ "$1" == --emulate ]]; then
  NNODES=${2:?--emulate needs a node count}
  CKPT=$(realpath "${3:?--emulate N needs a checkpoint directory}")
  shift 3
  [[ $(id -u) -eq 0 ]] || { echo "multinode.sh --emulate: needs root (unshare -m, mount --bind)" >&2; exit 1; }
  MOUNT=$(mktemp -d "${TMPDIR:-/tmp}/distload-node-mount.XXXXXX")
  pids=()
  for ((node = 0; node < NNODES; node++)); do
    COPY=$CKPT
    if ((node > 0)); then
      COPY=$CKPT-node$node
      [[ -e $COPY/config.json ]] || cp -r "$CKPT" "$COPY"
    fi
    # Each agent sees its own copy at $MOUNT; unshare keeps the bind mount private to that agent.
    unshare --mount --propagation private sh -c "mount --bind '$COPY' '$MOUNT' && exec \"\$@\"" sh \
      "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$node" --nproc-per-node "$NPROC" \
      --rdzv-backend static --rdzv-endpoint "127.0.0.1:$PORT" -m distload load "$MOUNT" "$@" &
    pids+=($!)
  done
  rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  rmdir "$MOUNT" 2>/dev/null || true
  exit $rc
fi

CKPT=$1
shift
: "${NNODES:?set NNODES (number of nodes)}" "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" "${MASTER:?set MASTER (node 0 address)}"
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend static --rdzv-endpoint "$MASTER:$PORT" -m distload load "$CKPT" "$@"
