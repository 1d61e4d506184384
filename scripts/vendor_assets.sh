#!/usr/bin/env bash
# Fetch the browser assets the web UI serves from its own static files (never a CDN: the
# appliance must work with no internet), and axe-core, which only the browser tests load.
# Versions and hashes are pinned here; a tarball or a file whose hash differs stops the
# script. Each package lands in <dest>/<dir>-<version>/ with its LICENSE, and
# <dest>/vendor.json records what is there (the templates read the sha384 values for
# <script integrity=...>).
#
#   ./scripts/vendor_assets.sh          fetch (needs `npm` and a registry), verify, write
#   ./scripts/vendor_assets.sh --check  verify the files already in the tree (offline)
set -euo pipefail
cd "$(dirname "$0")/.."
WEB=web/static/vendor
TESTS=tests/browser/vendor

# name | version | npm tarball integrity (sha512) | file in the package | its sha384 | license | dest | dir
PINS=(
  "htmx.org|2.0.11|sha512-Thx/WtpeOQqSrqBCw/A1cwGJGg4UrVa3+sW0GmrM3p4gJgO89ecH4qtbnyzDDWFvBTqjnIMCgELTNt636dtamA==|dist/htmx.min.js|sha384-2OatzQy1H+Zd/IIrjr1TcuDGqLXeHhbooAyJY1KdQMKnr4LZ22k31GBLdYKHmVjg|0BSD|$WEB|htmx.org"
  "htmx-ext-sse|2.2.4|sha512-LJmxVhykyflBWgh5PvbRidcyuqMHlgfajmmzumvKctv9puvsufeH6OaejSMZTNTnEI8O2wXXn4ZZtBdpEMqmEQ==|dist/sse.min.js|sha384-A986SAtodyH8eg8x8irJnYUk7i9inVQqYigD6qZ9evobksGNIXfeFvDwLSHcp31N|0BSD|$WEB|htmx-ext-sse"
  "@highlightjs/cdn-assets|11.11.1|sha512-VEPdHzwelZ12hEX18BHduqxMZGolcUsrbeokHYxOUIm8X2+M7nx5QPtPeQgRxR9XjhdLv4/7DD5BWOlSrJ3k7Q==|highlight.min.js|sha384-RH2xi4eIQ/gjtbs9fUXM68sLSi99C7ZWBRX1vDrVv6GQXRibxXLbwO2NGZB74MbU|BSD-3-Clause|$WEB|highlight.js"
  "axe-core|4.11.0|sha512-ilYanEU8vxxBexpJd8cWM4ElSQq4QctCLKih0TSfjIfCQTeyH/6zVrmIJfLPrKTKJRbiG+cfnZbQIjAlJmF1jQ==|axe.min.js|sha384-C9AUAqw5Tb7bgiS/Z+U3EGEzD+qn2oE0sJOC4kp0Xu8DcQMLKECMpbVsuWxF+rdh|MPL-2.0|$TESTS|axe-core"
)

digest() {  # digest ALGO FILE -> ALGO-base64 (openssl: same on Linux and macOS)
  printf '%s-%s' "$1" "$(openssl dgst "-$1" -binary "$2" | openssl base64 -A)"
}

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
declare -A entries=()
for pin in "${PINS[@]}"; do
  IFS='|' read -r name version integrity file sha384 license dest dir <<<"$pin"
  out="$dest/$dir-$version"
  base=$(basename "$file")
  if [ $check_only = 0 ]; then
    tgz="$tmp/$(cd "$tmp" && npm pack --silent "$name@$version" | tail -1)"
    got=$(digest sha512 "$tgz")
    if [ "$got" != "$integrity" ]; then
      echo "vendor: $name@$version tarball is $got, pinned $integrity" >&2
      exit 1
    fi
    mkdir -p "$tmp/$dir"
    tar xzf "$tgz" -C "$tmp/$dir"
    rm -rf "$out"
    mkdir -p "$out"
    cp "$tmp/$dir/package/$file" "$out/$base"
    cp "$tmp/$dir/package/LICENSE" "$out/LICENSE"
  fi
  got=$(digest sha384 "$out/$base")
  if [ "$got" != "$sha384" ]; then
    echo "vendor: $out/$base is $got, pinned $sha384" >&2
    exit 1
  fi
  [ -s "$out/LICENSE" ] || { echo "vendor: $out/LICENSE is missing" >&2; exit 1; }
  line="  \"$name\": {\"version\": \"$version\", \"license\": \"$license\", \"tarball\": \"$integrity\", \"file\": \"$dir-$version/$base\", \"integrity\": \"$sha384\"}"
  entries[$dest]="${entries[$dest]:+${entries[$dest]},
}$line"
done

if [ $check_only = 0 ]; then
  for dest in "${!entries[@]}"; do
    printf '{\n%s\n}\n' "${entries[$dest]}" > "$dest/vendor.json"
  done
  echo "vendor: wrote ${!entries[*]} (${#PINS[@]} packages, hashes verified)"
else
  echo "vendor: ${#PINS[@]} packages match their pinned hashes"
fi
