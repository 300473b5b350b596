# Shared by the build scripts under hack/ (sourced, after setting LOG_TAG): their log
# lines, and the one build at a time per cache that each of them runs.

log() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# cached_or_lock CHECK OUT [REFRESH]: when the command CHECK succeeds the build is in the
# cache: run REFRESH (if given), print OUT and exit. Otherwise take "$cache/.lock" (one
# build at a time per cache: a second caller waits) and check again, since the build the
# caller waited for may be this one; return holding the lock, for the caller to build.
cached_or_lock() {
  local check=$1 out=$2 refresh=${3:-}
  if $check; then
    [ -z "$refresh" ] || $refresh
    log "cached: $out"; echo "$out"; exit 0
  fi
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  flock 9
  if $check; then
    [ -z "$refresh" ] || $refresh
    log "cached (built by a concurrent run): $out"; echo "$out"; exit 0
  fi
}

# go_build_progress WHAT EVERY: reads `go build -v` and prints a count of the package
# paths every EVERY of them, so a long build on 2 cores shows it is alive; any other line
# (downloads, compiler errors) passes through.
go_build_progress() {
  awk -v tag="$LOG_TAG" -v what="$1" -v every="$2" -v t0="$(date +%s)" '
    / / || /^#/ { print > "/dev/stderr"; fflush("/dev/stderr"); next }
    { n++ }
    n % every == 0 { printf "[%s %s] %s: %d packages compiled (%ds)\n", tag, strftime("%H:%M:%S"), what, n, systime() - t0 > "/dev/stderr"; fflush("/dev/stderr") }
    END { printf "[%s %s] %s: %d packages compiled in %ds\n", tag, strftime("%H:%M:%S"), what, n, systime() - t0 > "/dev/stderr" }'
}
