#!/usr/bin/env bash
# Builds a PgBouncer with prepared-statement support (1.21+) for test/session/pooler.test.ts, from Debian's source
# package of a newer suite (upstream's release tarball plus Debian's patches), into
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gwl-pgbouncer/VERSION/bin/pgbouncer
# where test/support/pgbouncer.ts finds it (PGBOUNCER_BUILT=<binary> points it at another one).
#
#   bash scripts/build-pgbouncer.sh [VERSION]     (default 1.24.1, Debian 13 "trixie"'s; another suite with
#                                                  PGBOUNCER_SUITE=...; exits at once when the build exists)
#
# Only the Debian mirror apt already uses is needed. apt reads the suite's source index into a private
# directory (the system's apt sources, lists and caches are left alone) and downloads the source package,
# checked against that signed index. The build uses bookworm's libevent-dev, libssl-dev, pkg-config, make,
# gcc and patch, installed when missing (as root). Each step is bounded in time; a build takes about a
# minute on two cores.
# Exits non-zero, saying why, when it cannot build; the tests that need the build then skip and say so.
set -euo pipefail

version=${1:-1.24.1}
suite=${PGBOUNCER_SUITE:-trixie}
case "$version" in
  1.2[1-9].* | 1.[3-9][0-9].* | [2-9].*) ;;
  *)
    echo "build-pgbouncer: version $version: expected 1.21.0 or later (prepared-statement support)" >&2
    exit 2
    ;;
esac
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gwl-pgbouncer
dest=$cache/$version

built() { "$1/bin/pgbouncer" --version 2>/dev/null | head -1 | grep -qx "PgBouncer $version"; }
if built "$dest"; then
  echo "PgBouncer $version is built: $dest/bin/pgbouncer"
  exit 0
fi
fail() {
  echo "build-pgbouncer: $*" >&2
  exit 1
}

if ! mkdir -p "$cache" 2>/dev/null || [ ! -w "$cache" ]; then
  fail "cannot write to $cache (set XDG_CACHE_HOME)"
fi

# Build dependencies (bookworm's packages).
missing=()
for tool in gcc make pkg-config patch tar; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -gt 0 ] || pkg-config --exists libevent || missing+=(libevent-dev)
[ ${#missing[@]} -gt 0 ] || pkg-config --exists openssl || missing+=(libssl-dev)
if [ ${#missing[@]} -gt 0 ]; then
  packages=(gcc make pkg-config patch libevent-dev libssl-dev)
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    fail "missing ${missing[*]}; install them (apt-get install ${packages[*]}) or run as root"
  fi
  echo "installing the build dependencies (${packages[*]})"
  timeout 120 apt-get update -qq >/dev/null 2>&1 || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive timeout 120 apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null 2>&1 || fail "could not install ${packages[*]}"
fi
command -v apt-get >/dev/null || fail "apt-get is needed to fetch Debian's source package"

# The Debian mirror apt uses: the first non-security "deb" source, in either sources format.
mirror=$(
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk '
      /^deb[ \t]/ && $0 ~ /(bookworm|trixie)([ \t]|$)/ && $0 !~ /security/ {
        for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit }
      }
      /^URIs:/ { uri = $2 }
      /^Suites:/ && /(bookworm|trixie)([ \t]|$)/ && uri !~ /security/ && uri != "" { print uri; exit }
    ' || true
)
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d)
# (stopped by a signal, the compilers may still be writing for a moment: a second try then)
cleanup() { rm -rf "$work" 2>/dev/null || { sleep 2 && rm -rf "$work"; }; }
trap cleanup EXIT
trap 'exit 1' INT TERM
mkdir -p "$work/lists/partial" "$work/cache" "$work/src" "$work/sources.list.d"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
signed_by=""
[ -f "$keyring" ] && signed_by="[signed-by=$keyring] "
echo "deb-src $signed_by$mirror $suite main" >"$work/sources.list"
apt_private=(
  -o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=$work/sources.list.d"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
  -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
  -o "APT::Sandbox::User=$(id -un)"
)
echo "reading $suite's source index from $mirror"
timeout 60 apt-get "${apt_private[@]}" -qq update >"$work/apt.log" 2>&1 ||
  fail "could not read $suite's source index from $mirror: $(tail -3 "$work/apt.log")"
# The newest Debian revision of that upstream version.
debian_version=$(
  apt-cache "${apt_private[@]}" showsrc pgbouncer 2>/dev/null |
    awk -v v="$version" '$1 == "Version:" && index($2, v "-") == 1 { print $2 }' |
    sort -V | tail -1
)
if [ -z "$debian_version" ]; then
  available=$(apt-cache "${apt_private[@]}" showsrc pgbouncer 2>/dev/null | awk '$1 == "Version:" { print $2 }' | xargs)
  fail "$suite has no source package of pgbouncer $version (it has: ${available:-none})"
fi
echo "downloading Debian's source package pgbouncer $debian_version"
(cd "$work/src" && timeout 60 apt-get "${apt_private[@]}" -qq source --download-only \
  "pgbouncer=$debian_version" >"$work/apt.log" 2>&1) ||
  fail "could not download pgbouncer $debian_version: $(tail -3 "$work/apt.log")"

tree=$work/pgbouncer-$version
mkdir "$tree"
tarball() { find "$work/src" -maxdepth 1 -name "$1" ! -name '*.asc' | head -1; }
orig=$(tarball "pgbouncer_$version.orig.tar.*")
debian=$(tarball "pgbouncer_$debian_version.debian.tar.*")
if [ -z "$orig" ] || [ -z "$debian" ]; then
  fail "the source package has no orig or debian tarball: $(ls "$work/src")"
fi
tar -xf "$orig" -C "$tree" --strip-components=1
tar -xf "$debian" -C "$tree"
if [ -f "$tree/debian/patches/series" ]; then
  while read -r name _; do
    case "$name" in '' | '#'*) continue ;; esac
    patch -d "$tree" -p1 --batch --forward --quiet <"$tree/debian/patches/$name" ||
      fail "Debian's patch $name does not apply"
  done <"$tree/debian/patches/series"
fi

echo "building PgBouncer $version"
(
  cd "$tree" &&
    timeout 60 ./configure --prefix="$dest" --without-cares --without-systemd --without-pam \
      >"$work/build.log" 2>&1 &&
    timeout 150 make -j"$(nproc)" >>"$work/build.log" 2>&1
) || fail "the build failed: $(tail -15 "$work/build.log")"

# Into place at once: a half-built directory is never where the tests look.
stage=$cache/.$version.$$
rm -rf "$stage"
mkdir -p "$stage/bin"
install -m 755 "$tree/pgbouncer" "$stage/bin/pgbouncer"
echo "Debian source package pgbouncer $debian_version ($suite), from $mirror" >"$stage/SOURCE"
if ! mv -T "$stage" "$dest" 2>/dev/null; then
  rm -rf "$stage"
  built "$dest" || fail "could not move the build into $dest"
fi
built "$dest" || fail "$dest/bin/pgbouncer does not report version $version"
echo "built PgBouncer $version: $dest/bin/pgbouncer"
