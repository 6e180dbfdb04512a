# Helpers of scripts/gpu_check.sh, sourced by it (and by tests/test_bench.py, which runs them alone).

# test_workers SMOKE: pytest's worker arguments for the CUDA tests, one per line. 8 workers (the GPU
# machine has 16 cores; the compiles are the CPU's work), each taking tests from the others' queues
# where pytest-xdist has worksteal: on 2026-11-27 (4 workers, its default scheduling) one worker
# held every slow model and sparse-far test and the step stopped at 94%. None with --smoke (SMOKE=1)
# or without pytest-xdist. (Imports, not `pytest --help | grep -q`: under pipefail grep's early exit
# fails the pipe, and worksteal was never added.)
test_workers() {
    [ "$1" = 1 ] && return 0
    python -c "import xdist" 2>/dev/null || return 0
    printf '%s\n' -n 8
    if python -c "from xdist.scheduler import WorkStealingScheduling" 2>/dev/null; then
        printf '%s\n' --dist worksteal
    fi
}

# archive_logs DIR: every file under DIR in DIR/all-logs.tgz (the device tool returns the first few
# files by name; this one holds them all). Written outside DIR, then moved in: tar fails ("file
# changed as we read it") on a folder that its own archive grows in. Says so in DIR/summary.txt and
# returns 1 where tar fails; leaves no partial archive.
archive_logs() {
    local dir=$1 archive
    archive=$(mktemp)
    if tar czf "$archive" -C "$dir" --exclude=all-logs.tgz . && chmod 644 "$archive" \
            && mv "$archive" "$dir/all-logs.tgz"; then
        return 0
    fi
    echo "all-logs.tgz: tar failed" | tee -a "$dir/summary.txt"
    rm -f "$archive"
    return 1
}
