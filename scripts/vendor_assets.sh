#!/usr/bin/env bash
# Fetch the browser assets the web UI serves from its own static files (never a CDN: the
# appliance must work with no internet). Versions and hashes are pinned here; a tarball or a
# file whose hash differs stops the script. Each package lands in
# web/static/vendor/<name>-<version>/ with its LICENSE, and web/static/vendor/vendor.json
# records what is there (the templates read the sha384 values for <script integrity=...>).
#
#   ./scripts/vendor_assets.sh          fetch (needs `npm` and a registry), verify, write
#   ./scripts/vendor_assets.sh --check  verify the files already in the tree (offline)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=web/static/vendor

# name | version | npm tarball integrity (sha512) | file in the package | its sha384 | license
PINS=(
  "htmx.org|2.0.11|sha512-Thx/WtpeOQqSrqBCw/A1cwGJGg4UrVa3+sW0GmrM3p4gJgO89ecH4qtbnyzDDWFvBTqjnIMCgELTNt636dtamA==|dist/htmx.min.js|sha384-2OatzQy1H+Zd/IIrjr1TcuDGqLXeHhbooAyJY1KdQMKnr4LZ22k31GBLdYKHmVjg|0BSD"
  "htmx-ext-sse|2.2.4|sha512-LJmxVhykyflBWgh5PvbRidcyuqMHlgfajmmzumvKctv9puvsufeH6OaejSMZTNTnEI8O2wXXn4ZZtBdpEMqmEQ==|dist/sse.min.js|sha384-A986SAtodyH8eg8x8irJnYUk7i9inVQqYigD6qZ9evobksGNIXfeFvDwLSHcp31N|0BSD"
)

digest() {  # digest ALGO FILE -> ALGO-base64 (openssl: same on Linux and macOS)
  printf '%s-%s' "$1" "$(openssl dgst "-$1" -binary "$2" | openssl base64 -A)"
}

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
entries=()
for pin in "${PINS[@]}"; do
  IFS='|' read -r name version integrity file sha384 license <<<"$pin"
  out="$DEST/$name-$version"
  base=$(basename "$file")
  if [ $check_only = 0 ]; then
    (cd "$tmp" && npm pack --silent "$name@$version" >/dev/null)
    tgz="$tmp/$name-$version.tgz"
    got=$(digest sha512 "$tgz")
    if [ "$got" != "$integrity" ]; then
      echo "vendor: $name@$version tarball is $got, pinned $integrity" >&2
      exit 1
    fi
    mkdir -p "$tmp/$name"
    tar xzf "$tgz" -C "$tmp/$name"
    rm -rf "$out"
    mkdir -p "$out"
    cp "$tmp/$name/package/$file" "$out/$base"
    cp "$tmp/$name/package/LICENSE" "$out/LICENSE"
  fi
  got=$(digest sha384 "$out/$base")
  if [ "$got" != "$sha384" ]; then
    echo "vendor: $out/$base is $got, pinned $sha384" >&2
    exit 1
  fi
  [ -s "$out/LICENSE" ] || { echo "vendor: $out/LICENSE is missing" >&2; exit 1; }
  entries+=("  \"$name\": {\"version\": \"$version\", \"license\": \"$license\", \"tarball\": \"$integrity\", \"file\": \"$name-$version/$base\", \"integrity\": \"$sha384\"}")
done

if [ $check_only = 0 ]; then
  {
    echo "{"
    for i in "${!entries[@]}"; do
      sep=","
      [ "$i" = $((${#entries[@]} - 1)) ] && sep=""
      echo "${entries[$i]}$sep"
    done
    echo "}"
  } > "$DEST/vendor.json"
  echo "vendor: wrote $DEST (${#entries[@]} packages, hashes verified)"
else
  echo "vendor: ${#entries[@]} packages match their pinned hashes"
fi
