#!/usr/bin/env bash
# Builds a PostgreSQL image for `TEST_PG=container` from Debian packages, without pulling from any image
# registry: debootstrap a minimal Debian bookworm with postgresql-15 from the apt mirror this machine
# uses, then `docker import` it.
#
#   bash scripts/build-pg-image.sh [TAG]      (default gwl-postgres:15; skipped when TAG already exists,
#                                              unless --force comes first)
#
# The image behaves like the official `postgres` images where the tests rely on it: the command
# `postgres -c name=value ...` starts the server with those settings, as the superuser `postgres` with the
# password POSTGRES_PASSWORD (default postgres), on a data directory created at start in PGDATA
# (/var/lib/postgresql/data, a tmpfs in the tests). It listens on all addresses on the port given by
# `-c port=N` (5432 otherwise): with the host's network, pass a free port of the host.
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then force=1; shift; fi
tag=${1:-gwl-postgres:15}

if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "image $tag exists (--force rebuilds it)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

# The Debian mirror apt uses: the first bookworm "deb" source, in either sources format.
mirror=$(
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk '
      /^deb[ \t]/ && $0 ~ /bookworm([ \t]|$)/ && $0 !~ /security/ {
        for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit }
      }
      /^URIs:/ { uri = $2 }
      /^Suites:/ && /bookworm([ \t]|$)/ && uri !~ /security/ && uri != "" { print uri; exit }
    ' || true
)
mirror=${mirror:-http://deb.debian.org/debian}

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm with postgresql-15 from $mirror"
debootstrap --variant=minbase --include=postgresql-15 bookworm "$root" "$mirror" >"$root.log" 2>&1 || {
  tail -20 "$root.log" >&2
  rm -f "$root.log"
  exit 1
}
rm -f "$root.log"

cat >"$root/usr/local/bin/gwl-postgres-entrypoint" <<'SH'
#!/bin/sh
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
if [ "${1:-}" = postgres ]; then shift; fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  chown postgres:postgres "$PGDATA"
  chmod 700 "$PGDATA"
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-postgres}" >"$pwfile"
  chown postgres "$pwfile"
  runuser -u postgres -- "$bin/initdb" -D "$PGDATA" --username=postgres --pwfile="$pwfile" \
    --auth=scram-sha-256 --no-sync --encoding=UTF8 --locale=C >/dev/null
  rm -f "$pwfile"
fi
exec runuser -u postgres -- "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' \
  -c unix_socket_directories=/tmp "$@"
SH
chmod 755 "$root/usr/local/bin/gwl-postgres-entrypoint"
# The package's own cluster and caches are not used.
rm -rf "$root/var/lib/postgresql/15/main" "$root/etc/postgresql/15/main" "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*

tar -C "$root" -c . | docker import \
  --change 'ENV PGDATA=/var/lib/postgresql/data' \
  --change 'ENTRYPOINT ["/usr/local/bin/gwl-postgres-entrypoint"]' \
  --change 'CMD ["postgres"]' \
  - "$tag" >/dev/null
echo "built $tag ($(docker image inspect "$tag" --format '{{.Size}}' | awk '{printf "%d MB", $1 / 1e6}'))"
