#!/bin/sh
# Builds the aarch64 guest tier's 64 KiB-page kernel: Debian's linux-source-6.1 (SOURCE, the
# tarball) cross-built with gcc-aarch64-linux-gnu, `make allnoconfig` with the symbols of
# FRAGMENT, into OUT/boot/vmlinuz-<release> (with OUT/boot/config-<release>). The tree is built
# in OUT/build and removed after. Every symbol FRAGMENT sets must survive Kconfig's dependency
# resolution: one that does not stops the build with its name, so the kernel has no silent gap.
set -eu
source=$1 fragment=$2 out=$3
export ARCH=arm64 CROSS_COMPILE=aarch64-linux-gnu-
mkdir -p "$out/build" "$out/boot"
tar -xJf "$source" -C "$out/build" --strip-components=1
cd "$out/build"
KCONFIG_ALLCONFIG="$fragment" make -s allnoconfig
missing=""
for line in $(grep -E '^CONFIG_[A-Z0-9_]+=' "$fragment"); do
    grep -qxF "$line" .config || missing="$missing $line"
done
[ -z "$missing" ] || {
    echo "arm64_64k_kernel.sh: the configuration lacks$missing (a dependency is not met)" >&2
    exit 1
}
make -s -j"$(nproc)" Image
release=$(make -s kernelrelease)
cp arch/arm64/boot/Image "$out/boot/vmlinuz-$release"
cp .config "$out/boot/config-$release"
cd /
rm -rf "$out/build"
