#!/bin/sh
# Entrypoint of the role image: `nexus-role ROLE [actors.run flags]` runs one role as PID 1.
# Each start gets a fresh instance id, written where the health check (nexus-probe) reads it;
# a container restarted by its restart policy is a new instance, as a supervisor restart is.
# Any other command (`nexus ...`, `python ...`) runs as given.
set -eu
case "${1:-}" in
  health|monitor|master|trainer|inferencer|env) ;;
  "") echo "error: nexus-role: no role given; use one of health monitor master trainer inferencer env" >&2; exit 2 ;;
  *) exec "$@" ;;
esac
role="$1"; shift
instance="$role-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
printf '%s %s\n' "$role" "$instance" > /tmp/nexus-role
exec python -m actors.run "$role" --instance "$instance" "$@"
