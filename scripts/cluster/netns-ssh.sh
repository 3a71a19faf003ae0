#!/usr/bin/env bash
# An "ssh" for hosts that are Linux network namespaces on this machine (the multi-host test).
#
#   netns-ssh.sh [ssh options...] HOST COMMAND [ARGS...]
#
# MPI launchers start their remote daemons with `ssh HOST COMMAND`; pointing them here
# (MPICH: `mpiexec -launcher ssh -launcher-exec netns-ssh.sh`, Open MPI:
# `mpirun --prtemca plm_ssh_agent netns-ssh.sh`) runs COMMAND inside the network
# namespace of HOST instead, with its own host name (a UTS namespace), so every MPI
# process sees the host it was placed on, as on separate machines.
#
# HOST maps to the namespace "${HOST}${MPT_NETNS_SUFFIX}" (the test sets the suffix so
# that concurrent runs do not share namespaces). As with ssh, the words of COMMAND are
# joined by spaces and run by a shell. Options ssh would take (-x, -T, -o OPT, -p PORT,
# -l USER, ...) are accepted and ignored. Like ssh, COMMAND starts with a fresh login
# environment (PATH, HOME, USER only), so what the ranks need must travel through the MPI
# launcher, as it must between real machines.
set -euo pipefail
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;   # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
host=${1:?usage: netns-ssh.sh [ssh options] HOST COMMAND...}
shift
[ $# -gt 0 ] || { echo "netns-ssh.sh: no command for $host (interactive logins are not supported)" >&2; exit 2; }
host=${host#*@}
netns="${host}${MPT_NETNS_SUFFIX:-}"
if [ ! -e "/run/netns/$netns" ]; then
  echo "netns-ssh.sh: no network namespace $netns for host $host" >&2
  exit 255
fi
# shellcheck disable=SC2016 # $0/$1 expand in the inner shell, on purpose
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME="${HOME:-/root}" USER="${USER:-root}" \
  ip netns exec "$netns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
