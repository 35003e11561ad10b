# Sourced by the scripts in this folder: installs what a fresh Debian machine with only
# Rust lacks, using apt-get when run as root.

apt_updated=0
need() {
    # need <command> <debian package>
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "railover: '$1' is missing; install the Debian package '$2' (apt-get install $2) and run again" >&2
        exit 1
    fi
    if [ "$apt_updated" -eq 0 ]; then
        apt-get update -qq >/dev/null
        apt_updated=1
    fi
    echo "railover: installing $2 (for $1)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
}

need cc gcc
need nm binutils
need ip iproute2
# The verbs fabric's rdma-mummy-sys: cmake builds its dlopen stubs, bindgen needs libclang
# and clang's own headers (libclang-dev brings both; rdma-core itself is not needed).
need cmake cmake
if ! { ls /usr/lib/llvm-*/lib/libclang*.so* /usr/lib/*/libclang-*.so* 2>/dev/null | grep -q . &&
    ls /usr/lib/llvm-*/lib/clang/*/include/stddef.h 2>/dev/null | grep -q .; }; then
    need libclang libclang-dev
fi

want() {
    # want <command> <debian package>: like need, for tools that only add a figure; a
    # missing one is named and the caller carries on without it.
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "railover: optional '$1' is missing (apt-get install $2); going on without it" >&2
        return 0
    fi
    if [ "$apt_updated" -eq 0 ]; then
        apt-get update -qq >/dev/null || true
        apt_updated=1
    fi
    echo "railover: installing $2 (for $1)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null ||
        echo "railover: could not install $2; going on without it" >&2
}
