#!/bin/sh
# The Secrets deploy/k8s needs, from `nexus auth init` (docs/deploy.md):
#
#   deploy/k8s/make-secrets.sh DIR [NAMESPACE]      # default namespace: vla-nexus
#
# DIR keeps every seed (operator, accounts): keep it off the cluster, where `nexus tenant
# create --data-dir DIR --nats-url ...` runs. Into the cluster go only
#   nexus-nats-auth          nats-auth.conf + accounts.conf: operator and account JWTs, no seed
#   nexus-creds-<role>       role.creds: that role's own user (health monitor master trainer
#                            inferencer env; supervisor: the layout Job's)
# Re-running keeps the identities and updates the Secrets (after a tenant was added, the
# preload in nexus-nats-auth; the running servers already have it, pushed).
set -eu
dir="${1:?usage: make-secrets.sh DIR [NAMESPACE]}"
ns="${2:-vla-nexus}"
nexus auth init --data-dir "$dir" --resolver-dir /data/jwt
apply() {
  kubectl -n "$ns" create secret generic "$@" --dry-run=client -o yaml | kubectl -n "$ns" apply -f -
}
apply nexus-nats-auth --from-file="$dir/auth/nats-auth.conf" --from-file="$dir/auth/accounts.conf"
for role in health monitor master trainer inferencer env supervisor; do
  apply "nexus-creds-$role" --from-file=role.creds="$dir/role-creds/$role.creds"
done
