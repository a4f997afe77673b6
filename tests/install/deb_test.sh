#!/usr/bin/env bash
# The Debian package of Shoal as a user meets it: `cpack -G DEB` (make deb) builds it; its Depends
# name the Debian packages a build against it needs and apt can satisfy them (apt-get install
# --simulate: nothing is installed); its files, unpacked with dpkg -x into a folder (a dry run of
# dpkg -i that leaves the machine's /usr alone), serve install_test.sh: examples/ built against
# them with find_package(Shoal) and pkg-config, run under the packaged `shoal run`.
#
#   deb_test.sh BUILD_DIR SOURCE_DIR        (~1-2 minutes; called by .ci/run, not by ctest)
set -euo pipefail
build=$(cd "$1" && pwd)
source=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "deb_test: FAIL: $*" >&2; exit 1; }

(cd "$build" && cpack -G DEB >"$build/cpack.log" 2>&1) || { tail -n 20 "$build/cpack.log"; fail "cpack -G DEB"; }
deb=$(ls -t "$build"/shoal_*.deb | head -n1)
[ -s "$deb" ] || fail "cpack wrote no .deb"
depends=$(dpkg-deb -f "$deb" Depends)
echo "deb_test: $deb: Depends: $depends"
for package in libtorch-dev zlib1g-dev libspdlog-dev; do
  grep -q "$package" <<<"$depends" || fail "Depends lacks $package"
done
contents=$(dpkg-deb -c "$deb")
for path in ./usr/include/shoal/shoal.h ./usr/bin/shoal; do
  grep -q " $path\$" <<<"$contents" || fail "$path is not in the package"
done
# apt resolves the Depends against this machine's archive without installing anything.
if command -v apt-get >/dev/null; then
  apt-get install --simulate -qq "$deb" >"$build/deb-simulate.log" 2>&1 \
    || { tail -n 20 "$build/deb-simulate.log"; fail "apt-get cannot satisfy the package's Depends"; }
fi
root=$build/deb-test/root
rm -rf "$root"
mkdir -p "$root"
dpkg -x "$deb" "$root"
if grep -rq "set(Shoal_HAVE_MPI ON)" "$root"/usr/lib*/cmake/Shoal/ShoalConfig.cmake "$root"/usr/lib/*/cmake/Shoal/ShoalConfig.cmake 2>/dev/null; then
  grep -q "libopenmpi-dev" <<<"$depends" || fail "Depends lacks libopenmpi-dev (built with MPI)"
fi
"$here/install_test.sh" "$build" "$source" "$root/usr"
echo "deb_test: OK"
