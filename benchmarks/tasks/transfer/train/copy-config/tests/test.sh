#!/usr/bin/env bash
# copy-config (copy-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f config.bak ] && [ ! -L config.bak ] && [ "$(head -c 4096 config.bak 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = '[main]
debug = false' ] && [ -f config.ini ] && [ ! -L config.ini ] && [ "$(head -c 4096 config.ini 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = '[main]
debug = false' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
