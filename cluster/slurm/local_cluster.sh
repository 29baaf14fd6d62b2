#!/usr/bin/env bash
# A SLURM cluster on this one machine, for the tests and for trying the batch file without a cluster:
# munged + slurmctld + slurmd (one node with this machine's cores, or N nodes sharing them when the
# build runs several slurmd on one host), every file under DIR, run as root.
#
#   cluster/slurm/local_cluster.sh start DIR [NODES]   # writes DIR/slurm.conf, DIR/cgroup.conf; starts the daemons
#   export SLURM_CONF=DIR/slurm.conf                  # then sbatch, srun, squeue, scontrol talk to it
#   cluster/slurm/local_cluster.sh stop DIR            # stops them (every job is killed)
#   cluster/slurm/local_cluster.sh install             # apt-get install slurm-wlm munge where missing; says why not
#
# Needs Debian's packages slurm-wlm and munge (the install action). Ports: SLURMCTLD_PORT
# (default 6817) and SLURMD_PORT (6818; node i listens on SLURMD_PORT + i - 1).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR [NODES] | install" >&2; exit 2; }

install() {  # never fails: the tests skip, saying why, where the packages are still missing
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    echo "slurm-wlm and munge: installed ($(slurmd -V))"
  elif [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "slurm-wlm and munge are missing and cannot be installed here (apt-get as root is needed)"
  elif ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >/dev/null; then
    echo "slurm-wlm and munge could not be installed: apt-get failed (no package index or network?)"
  else
    echo "slurm-wlm and munge: installed ($(slurmd -V))"
  fi
}
if [[ ${1:-} == install ]]; then install; exit 0; fi
[[ $# -ge 2 ]] || usage
action=$1 dir=$2 nodes=${3:-1}
ctld_port=${SLURMCTLD_PORT:-6817} slurmd_port=${SLURMD_PORT:-6818}

node_names() {  # the node names: this host's name for one node, n1..nN for several
  if [[ $nodes == 1 ]]; then hostname -s; else for i in $(seq 1 "$nodes"); do echo "n$i"; done; fi
}

write_conf() {
  local cores host
  cores=$(nproc) host=$(hostname -s)
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
  chmod 700 "$dir/munge"
  # Every node declares the machine's cores: several nodes share them (config_overrides: the declared, not the real)
  {
    echo "# written by $0 for $host ($cores cores, $nodes node(s))"
    echo "ClusterName=transformer"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$ctld_port"
    echo "SlurmdPort=$slurmd_port"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$dir/munge/munge.socket"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/slurmctld.pid"
    echo "SlurmdPidFile=$dir/slurmd.%n.pid"
    echo "SlurmctldLogFile=$dir/slurmctld.log"
    echo "SlurmdLogFile=$dir/slurmd.%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "SchedulerType=sched/builtin"
    echo "ReturnToService=2"
    echo "MpiDefault=none"
    echo "JobCompType=jobcomp/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "KillWait=30"
    echo "MinJobAge=300"
    if [[ $nodes == 1 ]]; then
      echo "NodeName=$host NodeAddr=127.0.0.1 CPUs=$cores State=UNKNOWN"
    else
      local i
      for i in $(seq 1 "$nodes"); do
        echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((slurmd_port + i - 1)) CPUs=$cores State=UNKNOWN"
      done
    fi
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$dir/slurm.conf"
  printf 'CgroupPlugin=autodetect\nIgnoreSystemd=yes\n' > "$dir/cgroup.conf"
}

start() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null \
    || { echo "$0: slurmctld or munged not found: apt-get install -y slurm-wlm munge" >&2; exit 2; }
  write_conf
  [[ -s $dir/munge/munge.key ]] || { head -c 1024 /dev/urandom > "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"; }
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -i  # -i: ignore state left by an earlier cluster in DIR
  local name
  for name in $(node_names); do
    slurmd -N "$name"
  done
  local deadline=$((SECONDS + 60))  # until every node is idle
  until [[ $(sinfo -h -N -t idle -o %N 2>/dev/null | wc -l) -ge $nodes ]]; do
    if (( SECONDS > deadline )); then
      echo "$0: the nodes are not idle after 60 s:" >&2
      sinfo -N >&2 || true; tail -n 5 "$dir"/slurm*.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  echo "SLURM cluster up: $nodes node(s) ($(node_names | paste -sd, -)); export SLURM_CONF=$dir/slurm.conf"
}

stop_pidfile() {  # kill the daemon whose pid file is $1, and wait until it has gone
  local pid
  [[ -s $1 ]] || return 0
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || { rm -f "$1"; return 0; }
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
}

stop() {
  [[ -f $dir/slurm.conf ]] || { echo "$0: no cluster in $dir" >&2; return 0; }
  local f
  for f in "$dir"/slurmd.*.pid; do stop_pidfile "$f"; done
  stop_pidfile "$dir/slurmctld.pid"
  stop_pidfile "$dir/munge/munged.pid"
  echo "SLURM cluster in $dir stopped"
}

case $action in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
