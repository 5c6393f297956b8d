#!/bin/bash
# killed_test.sh MPIRUN ARGS... — remote.np3_killed: runs the RemoteKilled
# test (a worker killed mid-run) under mpirun and passes when GoogleTest
# says it passed. What Kiln must do (the next ops fail clearly, the other
# worker serves on, rank 0 finalizes) is inside the test; after it Open
# MPI's own teardown with a dead rank sometimes never ends (its PMIx fence
# waits for the killed process), so the launcher gets 60 s and is then
# stopped: a hang there is MPI's, not a failure of the test.
out=$(timeout -k 5 60 "$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if grep -q '\[  PASSED  \] 1 test' <<<"$out"; then
  [ $rc -eq 124 ] && echo "killed_test.sh: the test passed; mpirun's teardown did not end within 60 s and was stopped"
  exit 0
fi
echo "killed_test.sh: the test did not pass (mpirun exit $rc)"
exit 1
