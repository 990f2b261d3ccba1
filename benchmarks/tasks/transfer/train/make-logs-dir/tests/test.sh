#!/usr/bin/env bash
# make-logs-dir (make-dir): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -d logs ] && [ ! -L logs ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
