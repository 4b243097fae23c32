#!/bin/bash
# A throw-away Slurm on localhost for the `slurm` tests: munge, mariadb + slurmdbd (sacct, account
# enforcement), slurmctld, slurmd `localhost` with 3 fake A40s (GRES type a40; character devices: Slurm only
# stats them, and plain files would give no CUDA_VISIBLE_DEVICES), and, as root where `ip netns` works, a second
# node `node2` with 2 fake V100s (GRES type v100; CPU jobs use it as a CPU node): its own slurmd in network
# namespace $NETNS behind a veth pair, so that it has its own address and a job spanning both nodes talks across
# a real (virtual) link.
#
# Partitions: `debug` (default) = localhost only (A40s), so no existing test lands on node2; `two` = both nodes;
# `v100` = node2 only (the typed-GRES tests: a V100 plan is refused on debug and accepted there).
#
#   tests/slurm/cluster.sh up     install (apt-get) if needed, start from a fresh state dir, wait until idle
#   tests/slurm/cluster.sh down   cancel jobs, stop exactly the daemons `up` started (pid files), in reverse order
#   tests/slurm/cluster.sh env    print the export line for SLURM_CONF
#
# Env: ROOT or OGRPO_SLURM_ROOT (default /tmp/ogrpo-slurm-test); account `ogrpo` (user root belongs to it).
# Two clusters side by side need their own OGRPO_SLURM_PORT_BASE (slurmctld, slurmd, slurmdbd take BASE..BASE+2;
# default 6817), OGRPO_SLURM_DB_PORT (mariadb, default 3306), OGRPO_SLURM_NETNS (default ogrpo-n2) and
# OGRPO_SLURM_SUBNET (first three octets of a /24, default 10.213.0: .1 host side, .2 node2).
# OGRPO_SLURM_NODE2=0 brings up the one-node cluster only.
set -euo pipefail
ROOT=${ROOT:-${OGRPO_SLURM_ROOT:-/tmp/ogrpo-slurm-test}}
PORT=${OGRPO_SLURM_PORT_BASE:-6817}
DB_PORT=${OGRPO_SLURM_DB_PORT:-3306}
NETNS=${OGRPO_SLURM_NETNS:-ogrpo-n2}
NET=${OGRPO_SLURM_SUBNET:-10.213.0}
VETH=v$(printf %s "$NETNS" | tail -c 10)   # interface names: at most 15 characters
export SLURM_CONF=$ROOT/etc/slurm.conf
SOCK=$ROOT/munge/munge.socket
PKGS=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)

ensure_packages() {
  dpkg -s "${PKGS[@]}" >/dev/null 2>&1 && return 0
  [ "$(id -u)" = 0 ] || { echo "cluster.sh: needs root to apt-get install ${PKGS[*]}" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
}

wait_for() {  # wait_for TRIES CMD...: poll every 0.2 s
  local n=$1; shift
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}

sweep_orphans() {
  local pid left=()
  for pid in $(for d in munged mariadbd slurmdbd slurmctld slurmd; do pgrep -x "$d"; done); do
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$ROOT" ||
       tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
      left+=("$pid")
    fi
  done
  [ "${#left[@]}" -eq 0 ] && return 0
  kill -TERM "${left[@]}" 2>/dev/null || true
  for _ in $(seq 40); do
    local alive=0
    for pid in "${left[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.25
  done
  kill -KILL "${left[@]}" 2>/dev/null || true
}

can_node2() {
  [ "${OGRPO_SLURM_NODE2:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v ip >/dev/null || return 1
  ip netns add "$NETNS.probe" 2>/dev/null && ip netns del "$NETNS.probe"
}

netns_up() {  # veth pair: $NET.1 on the host, $NET.2 in $NETNS (node2); lo up there for its own services
  netns_down
  ip netns add "$NETNS"
  ip link add "$VETH-h" type veth peer name "$VETH-n"
  ip link set "$VETH-n" netns "$NETNS"
  ip addr add "$NET.1/24" dev "$VETH-h"; ip link set "$VETH-h" up
  ip netns exec "$NETNS" ip addr add "$NET.2/24" dev "$VETH-n"
  ip netns exec "$NETNS" ip link set "$VETH-n" up
  ip netns exec "$NETNS" ip link set lo up
}

netns_down() {  # deleting the namespace deletes the veth pair with it
  ip netns pids "$NETNS" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  ip netns del "$NETNS" 2>/dev/null || true
  ip link del "$VETH-h" 2>/dev/null || true
}

node_state() { timeout 5 sinfo -h -N -n "$1" -o %T 2>/dev/null | head -n 1; }

up() {
  ensure_packages
  if [ -s "$ROOT/run/slurmctld.pid" ] && kill -0 "$(cat "$ROOT/run/slurmctld.pid")" 2>/dev/null; then
    if [ "$(node_state localhost)" = idle ]; then
      echo "slurm already up: export SLURM_CONF=$SLURM_CONF"; return 0
    fi
    echo "cluster.sh: daemons running under $ROOT but the node is not idle (run 'down' first)" >&2; exit 1
  fi
  sweep_orphans
  local two=0 ctl=127.0.0.1
  if can_node2; then netns_up; two=1; ctl=$NET.1; fi
  rm -rf "$ROOT"; mkdir -p "$ROOT"/{etc,run,log,state/ctld,state/d,munge/key,dev,mysql}
  chmod 755 "$ROOT/munge"; chmod 700 "$ROOT/munge/key"
  for i in 0 1 2 3 4; do mknod "$ROOT/dev/nvidia$i" c 195 "$i"; done   # never opened, only stat'ed by slurmd
  mungekey --create --keyfile="$ROOT/munge/key/munge.key"
  cat > "$ROOT/etc/gres.conf" <<EOT
AutoDetect=off
NodeName=localhost Name=gpu Type=a40 File=$ROOT/dev/nvidia[0-2]
NodeName=node2 Name=gpu Type=v100 File=$ROOT/dev/nvidia[3-4]
EOT
  local mem; mem=$(( $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) * 8 / 10 ))
  # At least 8 CPUs as Slurm sees them (config_overrides: slurmd takes the configured count), so that two jobs of
  # two `--exact` steps each fit side by side on a 2-core CI machine; task/none binds nothing, the cores are shared.
  local cpus; cpus=$(nproc); [ "$cpus" -ge 8 ] || cpus=8
  cat > "$ROOT/etc/slurm.conf" <<EOT
ClusterName=ci
SlurmctldHost=localhost($ctl)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10 lets a requeued job start again after ~15 s instead of the default 2 minutes
AuthInfo=socket=$SOCK,cred_expire=10
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$ROOT/state/ctld
# %n: each slurmd (node) its own spool, pid and log file
SlurmdSpoolDir=$ROOT/state/d/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MpiDefault=none
# linuxproc tracks every descendant of a step, so scancel reaches the trainer's worker processes too
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=1000
GresTypes=gpu
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$((PORT + 2))
AccountingStoragePass=$SOCK
AccountingStorageTRES=gres/gpu
AccountingStorageEnforce=associations,qos
JobAcctGatherType=jobacct_gather/linux
KillWait=5
MinJobAge=300
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
EOT
  if [ "$two" = 1 ]; then
    # localhost's NodeAddr is the host end of the veth: 127.0.0.1 inside the namespace would be node2 itself.
    # A job's node list comes sorted by name: in a two-node plan node 0 (the vLLM server) is localhost and
    # node 1 (the trainer) node2.
    cat >> "$ROOT/etc/slurm.conf" <<EOT
NodeName=node2 NodeAddr=$NET.2 CPUs=$cpus RealMemory=$mem Gres=gpu:v100:2 State=UNKNOWN
NodeName=localhost NodeAddr=$NET.1 CPUs=$cpus RealMemory=$mem Gres=gpu:a40:3 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=two Nodes=node2,localhost MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=v100 Nodes=node2 MaxTime=INFINITE State=UP OverSubscribe=NO
EOT
  else
    cat >> "$ROOT/etc/slurm.conf" <<EOT
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem Gres=gpu:a40:3 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOT
  fi
  munged --force --socket="$SOCK" --key-file="$ROOT/munge/key/munge.key" --log-file="$ROOT/log/munged.log" \
         --pid-file="$ROOT/run/munged.pid" --seed-file="$ROOT/munge/key/munged.seed"
  mariadb-install-db --no-defaults --user=root --datadir="$ROOT/mysql/data" \
     --auth-root-authentication-method=socket >"$ROOT/log/mariadb-install.log" 2>&1
  # setsid: the database must not die with the shell that ran `up` (CI steps, pytest fixtures)
  setsid mariadbd --no-defaults --user=root --datadir="$ROOT/mysql/data" --socket="$ROOT/mysql/mysqld.sock" \
     --pid-file="$ROOT/run/mariadb.pid" --bind-address=127.0.0.1 --port=$DB_PORT --skip-name-resolve \
     --log-error="$ROOT/log/mariadb.err" --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
  wait_for 150 mariadb-admin --no-defaults -S "$ROOT/mysql/mysqld.sock" -uroot ping \
    || { echo "mariadb did not start"; tail -n 20 "$ROOT/log/mariadb.err"; exit 1; }
  mariadb --no-defaults -S "$ROOT/mysql/mysqld.sock" -uroot -e \
    "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  install -m 600 /dev/stdin "$ROOT/etc/slurmdbd.conf" <<EOT
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOT
  slurmdbd
  wait_for 150 bash -c "echo >/dev/tcp/127.0.0.1/$((PORT + 2))" || { echo "slurmdbd did not start"; exit 1; }
  # Associations first: with AccountingStorageEnforce=associations,qos an unknown --account or --qos is
  # refused at submit
  sacctmgr -i add cluster ci >/dev/null
  sacctmgr -i add account ogrpo Description=tests Organization=ogrpo >/dev/null
  sacctmgr -i add user root account=ogrpo DefaultAccount=ogrpo >/dev/null
  slurmctld -i
  slurmd -N localhost
  # node2: same filesystem (munge socket, spool under $ROOT), own network namespace
  # nsenter, not `ip netns exec`: that also remounts /sys, which hides /sys/fs/cgroup from slurmd. A private
  # /dev/shm (own mount namespace), as on a separate host: nothing may pass between the nodes through it.
  if [ "$two" = 1 ]; then
    unshare --mount --propagation private sh -c \
      "mount -t tmpfs -o size=25% tmpfs /dev/shm && exec nsenter --net=/run/netns/$NETNS slurmd -N node2" ||
      { echo "slurmd node2 did not start"; tail -n 5 "$ROOT/log/slurmd-node2.log"; exit 1; }
  fi
  for _ in $(seq 120); do
    if [ "$(node_state localhost)" = idle ] && { [ "$two" = 0 ] || [ "$(node_state node2)" = idle ]; }; then
      echo "slurm up$([ "$two" = 1 ] && echo " (node2 in netns $NETNS, partition two)"): export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.25
  done
  echo "slurm did not come up"; tail -n 30 "$ROOT"/log/*.log; exit 1
}

down() {
  [ -d "$ROOT/run" ] || { echo "cluster.sh: nothing under $ROOT"; return 0; }
  if [ -s "$ROOT/run/slurmctld.pid" ] && kill -0 "$(cat "$ROOT/run/slurmctld.pid")" 2>/dev/null; then
    timeout 10 scancel --user=root 2>/dev/null || true
    # slurmstepd outlives slurmd otherwise: wait (max 30 s) until jobs and steps are gone
    for _ in $(seq 60); do [ -z "$(timeout 5 squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  local d f pid
  # slurmd.pid: clusters started before the per-node pid files
  for f in "$ROOT"/run/slurmd-*.pid "$ROOT"/run/{slurmd,slurmctld,slurmdbd,mariadb,munged}.pid; do
    [ -s "$f" ] || continue
    d=$(basename "$f" .pid)
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -0 "$pid" 2>/dev/null && { echo "$d ($pid) did not stop; SIGKILL"; kill -KILL "$pid"; }
    fi
    rm -f "$f"
  done
  # An interrupted `up` can leave daemons whose pid files a later `up` overwrote: every daemon of this cluster
  # names $ROOT on its command line (or, for slurm*, in SLURM_CONF), so sweep what is left.
  sweep_orphans
  netns_down
  echo "slurm down ($ROOT)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
