#!/usr/bin/env bash
# Install the Slurm daemons and client commands and munge from Debian's packages
# (slurm-wlm 22.05 on bookworm) when they are missing. Used by `make services` and by
# the slurm tests' session fixture; does nothing when everything is already there.
# iproute2 (`ip netns`) is for the two-node test (a slurmd per network namespace).
set -euo pipefail
need=()
for cmd in slurmctld slurmd sbatch munged ip; do
    command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: missing ${need[*]} and no apt-get to install slurm-wlm/munge" >&2
    exit 3
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_slurm.sh: not root and no sudo" >&2; exit 3; }
    SUDO="sudo"
fi
echo "install_slurm.sh: installing slurm-wlm slurmctld slurmd munge iproute2 (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
# --no-install-recommends: the daemons and clients only, no docs or GUI bits.
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends \
        slurm-wlm slurmctld slurmd slurm-client munge iproute2 >/dev/null; }; then
    echo "install_slurm.sh: apt-get could not install slurm-wlm/munge (no package source?)" >&2
    exit 3
fi
command -v slurmctld >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null
echo "install_slurm.sh: done ($(dpkg-query -W -f '${Version}' slurm-client))"
