# Helpers of scripts/gpu_check.sh, sourced by it (and by tests/test_bench.py, which runs them alone).

# test_workers SMOKE: pytest's worker arguments for the CUDA tests, one per line. 8 workers (the GPU
# machine has 16 cores; the compiles are the CPU's work), and where this pytest-xdist has
# --maxschedchunk (3.3 on), tests handed out two to a worker and then one at a time (`--dist load
# --maxschedchunk 1`): gpu_check.sh puts the slow tests first (HF_DILATED_SLOW_FIRST, tests/conftest.py),
# so every worker starts on them. By default a worker is handed a run of consecutive tests: on
# 2026-11-27 (4 workers) one held every slow model and sparse-far test and the step stopped at 94%;
# with worksteal (8 workers) the slow ones were the last to run and it stopped at 98%. None with
# --smoke (SMOKE=1) or without pytest-xdist. (Imports, not `pytest --help | grep -q`: under pipefail
# grep's early exit fails the pipe.)
test_workers() {
    [ "$1" = 1 ] && return 0
    python -c "import xdist" 2>/dev/null || return 0
    printf '%s\n' -n 8
    if python -c "import inspect, xdist.scheduler.load as m, sys; sys.exit('maxschedchunk' not in inspect.getsource(m))" \
            2>/dev/null; then
        printf '%s\n' --dist load --maxschedchunk 1
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
