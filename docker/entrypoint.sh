#!/bin/sh
# The worker image's entry point: Beam's boot (/opt/apache/beam/boot), run as the image's user
# (uid 10001, not root), with a semi-persistent folder that user can write.
#
# Dataflow starts the SDK container with --semi_persist_dir (a folder of the worker VM mounted into
# the container). Beam's boot writes the job's staged files there (<dir>/staged) before it starts
# Python, and fails if it cannot. Where that folder is not writable by this user (a mount owned by
# root), Beam gets a folder under $HOME instead, and the log says so: the staged files are fetched
# again if the container restarts, which is all the mount saves. Every other argument is handed
# to Beam's boot as it came.
set -eu

boot=${NEWSVEC_BEAM_BOOT:-/opt/apache/beam/boot}
fallback=$HOME/beam-semi-persist

semi_persist() {
    if mkdir -p "$1" 2>/dev/null && [ -w "$1" ] && [ -x "$1" ]; then
        printf '%s\n' "$1"
    else
        mkdir -p "$fallback"
        echo "newsvec: $1 is not writable by uid $(id -u): Beam's semi-persistent folder is" \
            "$fallback" >&2
        printf '%s\n' "$fallback"
    fi
}

# Go's flag forms: -name=value, --name=value, -name value, --name value.
n=$#
folder_next=false
while [ "$n" -gt 0 ]; do
    arg=$1
    shift
    n=$((n - 1))
    if $folder_next; then
        arg=$(semi_persist "$arg")
        folder_next=false
    else
        case $arg in
            -semi_persist_dir=* | --semi_persist_dir=*)
                arg="${arg%%=*}=$(semi_persist "${arg#*=}")" ;;
            -semi_persist_dir | --semi_persist_dir)
                folder_next=true ;;
        esac
    fi
    set -- "$@" "$arg"
done

exec "$boot" "$@"
